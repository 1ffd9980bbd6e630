"""The test suite; its folders mirror the code: kernels/, runtime/, common/, tools/, bench/,
deploy/ (launch recipes and Docker files). Shared fixtures live in conftest.py."""
import os
import random
import socket
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (the oldest pyproject allows): the same parser, from PyPI (the test extra)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]  # the repository root
_PORTS = random.SystemRandom()


def load_toml(path: Path = ROOT / "pyproject.toml") -> dict:
    """A TOML file parsed (pyproject.toml by default), on every Python the package supports."""
    return tomllib.loads(Path(path).read_text())


def free_ports(n: int = 1) -> int:
    """The first of n consecutive loopback ports that are free now, below Linux's ephemeral range
    (32768+): a port the OS hands out for binding to 0 is one it also hands to outgoing client
    sockets, so a stand-in server started later on it, or on the port after it, can find it taken
    (a CI run on 2026-11-27 lost a stand-in BF16 server that way).

    Ports from 20000 to 25999 only: tests that hand a bench fixed ports (test_pd_bench's 26000
    and up, test_hicache_bench's 30800 / 31700) may run at the same time in the other pytest-xdist
    worker (`make test` runs 2). Each worker draws from its own slice of that range, so two workers
    cannot pick the same port between this check and their bind; the draw uses its own generator,
    not `random`'s, which the `seed` fixture seeds alike in every worker under OSCAR_TEST_SEED."""
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    width = 6000 // count
    lo = 20000 + (int(worker) % count if worker.isdigit() else 0) * width
    for _ in range(200):
        base = _PORTS.randrange(lo, lo + width - n)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} consecutive free loopback ports in {lo}-{lo + width}")
