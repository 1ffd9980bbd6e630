"""The INT2 host tier on a CUDA pool (CUDA only): its copies are GPU kernels over a CUDA view of
the pinned host blob (unified addressing, runtime/host_pool.host_view), which the CPU tests cannot
reach; the same byte-exact round trip as tests/runtime/test_host_pool.py, host blob included."""
import pytest
import torch

from ..runtime.test_host_pool import FORMATS, round_trip

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(autouse=True)
def _no_host_reserve(monkeypatch):
    import sglang.srt.mem_cache.pool_host.base as host_base

    monkeypatch.setattr(host_base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 0)


@pytest.mark.parametrize("spec", FORMATS, ids=[f[0] for f in FORMATS])
def test_pages_round_trip_byte_exact_on_cuda(spec, seed):
    round_trip(spec, "cuda")
