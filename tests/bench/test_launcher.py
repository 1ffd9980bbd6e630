"""bench/_launcher.py, the one server launcher of the bench scripts, on stand-in processes: a
server that never answers or that dies is a ServerError carrying its log's tail, and its whole
process group is gone once the `with` block ends."""
import os
import sys

import pytest

from bench import _launcher
from tests import free_ports

pytestmark = pytest.mark.usefixtures("fast_polls")  # stand-in servers: see tests/conftest.py

SILENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a 'scheduler' child
print("loading weights: tail-marker", flush=True)
time.sleep(120)
"""


def test_a_server_that_never_answers_times_out_with_its_log_and_is_stopped(tmp_path):
    log = tmp_path / "logs" / "s.log"
    port = free_ports(1)
    with pytest.raises(_launcher.ServerError) as err:
        with _launcher.Server([sys.executable, "-c", SILENT], {"OSCAR_X": "a b"}, log, port) as srv:
            pgid = srv.proc.pid
            srv.wait_ready(3, poll_s=0.2)
    assert "not ready after 3 s" in str(err.value) and "tail-marker" in str(err.value)
    assert srv.startup_s is None
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # the server and its child were stopped on the way out
    assert log.read_text().startswith("$ OSCAR_X='a b' ")


@pytest.mark.parametrize("ready", _launcher.READY_CHECKS)
def test_a_server_that_exits_during_start_up_says_so(tmp_path, ready):
    log = tmp_path / "s.log"
    cmd = [sys.executable, "-c", "print('CUDA out of memory', flush=True); raise SystemExit(3)"]
    with pytest.raises(_launcher.ServerError, match=r"exited with 3 during start-up(.|\n)*CUDA out of memory"):
        with _launcher.Server(cmd, {}, log, free_ports(1), ready=ready) as srv:
            srv.wait_ready(60, poll_s=0.1)
    assert log.read_text().startswith("$ " + sys.executable)


def test_an_unknown_readiness_check_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ready='up'"):
        _launcher.Server(["true"], {}, tmp_path / "s.log", 1, ready="up")


def test_servers_sharing_a_gpu_start_together_and_are_measured_one_at_a_time():
    """GpuTurns: with a GPU listed twice both jobs run at once, neither measures before both have
    started (or failed), and the two measurements never overlap; a job that fails before saying
    it started (the runner says so when it ends) does not hold the other one forever."""
    import threading
    import time

    from bench.spec_decode import run_jobs

    turns = _launcher.GpuTurns(["0", "0"], 2)
    assert turns.assigned == ["0", "0"] and turns.shared == {"0"}
    events, lock = [], threading.Lock()

    def log(what):
        with lock:
            events.append(what)

    def job(name, gpu, port):
        time.sleep(0.3 if name == "slow" else 0.0)  # one start-up takes longer
        log(f"{name} ready")
        turns.started(gpu, name)
        with turns.turn(gpu):
            log(f"{name} measures")
            time.sleep(0.1)
            log(f"{name} done")
        return True

    assert run_jobs([(job, "fast", 1), (job, "slow", 2)], ["0", "0"], turns)
    assert events.index("fast measures") > events.index("slow ready")  # waited for the other start
    first = events[events.index("fast measures") if events.index("fast measures") < events.index("slow measures")
                   else events.index("slow measures")].split()[0]
    i = events.index(f"{first} measures")
    assert events[i + 1] == f"{first} done"  # nothing else measured in between

    turns = _launcher.GpuTurns(["0", "0"], 2)

    def failing(name, gpu, port):  # gave up before its server said it started
        return False

    t0 = time.monotonic()
    assert not run_jobs([(failing, "broken", 1), (job, "fast", 2)], ["0", "0"], turns)
    assert time.monotonic() - t0 < 5 and "fast done" in events


def test_gpu_turns_need_a_slot_per_server_on_a_shared_gpu_and_are_no_ops_otherwise():
    with pytest.raises(ValueError, match="one slot per server"):
        _launcher.GpuTurns(["0", "0"], 3)
    turns = _launcher.GpuTurns(["0", "1"], 5)  # GPUs not shared: jobs take them as they free up
    assert turns.assigned is None and not turns.shared
    turns.started("0", "a")
    with turns.turn("0"):  # returns at once
        pass
