"""bench/_launcher.py, the one server launcher of the bench scripts, on stand-in processes: a
server that never answers or that dies is a ServerError carrying its log's tail, and its whole
process group is gone once the `with` block ends."""
import os
import sys

import pytest

from bench import _launcher
from tests import free_ports

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
