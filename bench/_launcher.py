"""Start, wait for and stop one SGLang server: the one launcher every bench script uses.

A `Server` runs a command (`python -m sglang.launch_server ...`, `oscar-sglang serve ...`) in its
own process session with extra environment, logs its output to a file (the first line is the
command with that environment), waits until it is ready within a timeout, and stops its whole
process group (SGLang's scheduler and detokenizer children too) when the `with` block ends. A
server that exits or is not ready in time raises ServerError with the tail of its log.

Two readiness checks, since the scripts measure different things:
  "health"      GET /health answers 200 (the accuracy and soak harnesses);
  "ready_line"  /server_info answers and the log holds READY_LINE, the line SGLang writes once its
                own start-up request is done (the speed harnesses: a measured request sent before
                it queues behind that request, whose first forward may JIT-compile kernels).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import shlex
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

# what sglang.launch_server logs once its start-up request has finished (server status Up)
READY_LINE = "The server is fired up and ready to roll!"
READY_CHECKS = ("health", "ready_line")


# how the speed harnesses (serving, serving_vs_fp8, server_e2e) start theirs: ready after SGLang's
# own start-up request, progress printed, 3 s after the stop for the GPU memory to be released
SPEED = {"ready": "ready_line", "progress": True, "settle_s": 3.0}
# polls (the tests' stand-in servers set them shorter): readiness checks in wait_ready (its
# default), and whether the stopped process group is gone (up to 30 s, then SIGKILL)
READY_POLL_S = 2.0
STOP_POLL_S = 1.0


class ServerError(RuntimeError):
    """The server exited or was not ready in time; the message ends with its log's tail."""


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


class Server:
    """One launched server; use it as a context manager so it is always stopped.

    ready: "health" or "ready_line" (module docstring). progress: print a line while waiting and
    once ready. settle_s: seconds to wait after the process group is gone, for the GPU memory of
    the dead scheduler to be released before the next server sizes its pool.
    """

    def __init__(self, cmd: List[str], env: Dict[str, str], log_path: Path, port: int, *,
                 ready: str = "health", progress: bool = False, settle_s: float = 0.0):
        if ready not in READY_CHECKS:
            raise ValueError(f"ready={ready!r}: expected one of {READY_CHECKS}")
        self.cmd, self.env, self.log_path, self.port = list(cmd), dict(env), Path(log_path), port
        self.ready, self.progress, self.settle_s = ready, progress, settle_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None
        self._log = None

    def __enter__(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        self._log.write(f"$ {envs} {shlex.join(self.cmd)}\n".replace("$  ", "$ ", 1))
        self._log.flush()
        # a new session: the server spawns scheduler / detokenizer children, stopped as one group
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env}, start_new_session=True)
        return self

    # ------------------------------------------------------------------------------ readiness

    def _answers(self) -> bool:
        try:
            if self.ready == "health":
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    return r.status == 200
            get_json(self.url + "/server_info", timeout=5)
            return self.logged_ready()
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError, OSError):
            return False

    def wait_ready(self, timeout_s: float, poll_s: Optional[float] = None) -> float:
        """Seconds until the server is ready (also kept as .startup_s); ServerError with the log's
        tail when the process exits first or `timeout_s` passes. poll_s: READY_POLL_S if None."""
        poll_s = READY_POLL_S if poll_s is None else poll_s
        t0 = time.monotonic()
        last_print = t0
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with {self.proc.returncode} during start-up "
                                  f"(log {self.log_path}); last lines:\n{self.tail(40)}")
            if self._answers():
                self.startup_s = time.monotonic() - t0
                if self.progress:
                    print(f"  server ready after {self.startup_s:.0f} s", flush=True)
                return self.startup_s
            if time.monotonic() - t0 > timeout_s:
                raise ServerError(f"server not ready after {timeout_s:.0f} s (log {self.log_path}); "
                                  f"last lines:\n{self.tail(40)}")
            if self.progress and time.monotonic() - last_print > 20:
                last_print = time.monotonic()
                print(f"  waiting for server ({last_print - t0:.0f} s) ...", flush=True)
            time.sleep(poll_s)

    def logged_ready(self) -> bool:
        try:
            return READY_LINE in self.log_path.read_text(errors="replace")
        except OSError:
            return False

    def server_info(self) -> dict:
        return get_json(self.url + "/server_info", timeout=30)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # ------------------------------------------------------------------------------ stopping

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:  # a reused id now owned by someone else: ours is gone
            return False

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        """SIGTERM to the group, up to 30 s for it to go, then SIGKILL; the next server must find
        the GPU memory free or its --mem-fraction-static pool would be smaller than alone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for _ in range(round(30 / STOP_POLL_S)):  # the scheduler children too
            if not self._group_alive():
                break
            time.sleep(STOP_POLL_S)
        if self._group_alive():
            self._signal_group(signal.SIGKILL)
            time.sleep(2)
        if self.proc.poll() is None:
            self.proc.wait(30)
        if self.settle_s:
            time.sleep(self.settle_s)

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._log is not None:
                self._log.close()


class GpuTurns:
    """Servers that share a GPU (a GPU id repeated in a script's --gpus) start together and are
    measured one at a time: the start-ups (Python imports, Triton and CUDA-graph compilation, about
    a minute each) overlap, the timed requests do not, since a server that is ready but idle uses
    no GPU time.

    `GpuTurns(gpus, jobs)`: with a GPU id repeated, job i runs on `assigned[i]` = gpus[i] and all
    start at once (a later start would overlap an earlier server's timing, so there must be a slot
    per job); with none repeated `assigned` is None and jobs take GPUs as they free up. A job calls
    `started(gpu, name)` once its server is ready or has failed (the job runner calls it again when
    the job ends: it counts once), then measures inside `with turns.turn(gpu):`, which waits until
    every server on that GPU has started and then holds the GPU's lock. For a GPU that only one job
    uses both are no-ops."""

    def __init__(self, gpus: List[Optional[str]], jobs: int):
        self.assigned: Optional[List[Optional[str]]] = None
        if len(set(gpus)) < len(gpus):
            if jobs > len(gpus):
                raise ValueError(f"{jobs} servers for the {len(gpus)} slots of --gpus {','.join(map(str, gpus))}: "
                                 "with a GPU listed more than once every server starts at once, so list one slot "
                                 "per server")
            self.assigned = list(gpus[:jobs])
        counts = collections.Counter(self.assigned or [])
        self.shared = {g for g, n in counts.items() if n > 1}
        self._expected = {g: counts[g] for g in self.shared}
        self._started = {g: set() for g in self.shared}
        self._cv = threading.Condition()
        self._locks = {g: threading.Lock() for g in self.shared}

    def started(self, gpu: Optional[str], name: str) -> None:
        if gpu in self.shared:
            with self._cv:
                self._started[gpu].add(name)
                self._cv.notify_all()

    @contextlib.contextmanager
    def turn(self, gpu: Optional[str]):
        if gpu not in self.shared:
            yield
            return
        with self._cv:
            self._cv.wait_for(lambda: len(self._started[gpu]) >= self._expected[gpu])
        with self._locks[gpu]:
            yield


def add_server_run_args(p) -> None:
    """The flags every script that starts servers and sends them requests shares."""
    p.add_argument("--startup-timeout", type=float, default=480)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--idle-timeout", type=float, default=60)
    p.add_argument("--print-commands", action="store_true", help="print the servers' commands, run nothing")
