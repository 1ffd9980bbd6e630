"""runtime/device_index.to_device on CUDA (CUDA only): the copy is queued behind the stream's work
instead of waiting for it, and the values arrive. The stream is kept busy by torch.cuda._sleep."""
import time

import pytest
import torch

from oscar_sglang.runtime.device_index import to_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BUSY_CYCLES = 200_000_000  # ~0.1 s of a spinning kernel on a ~2 GHz GPU clock


def _cpu_ms_behind_busy_stream(copy) -> tuple:
    """(ms the CPU was held by copy() behind ~0.1 s of queued GPU work, its result)"""
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    t0 = time.perf_counter()
    out = copy()
    held = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return held, out


def test_the_copy_does_not_wait_for_the_stream_and_arrives():
    values = list(range(1000))
    _cpu_ms_behind_busy_stream(lambda: to_device(values, torch.int64, "cuda"))  # pinned pool warm
    blocking, ref = _cpu_ms_behind_busy_stream(lambda: torch.tensor(values, dtype=torch.int64, device="cuda"))
    queued, out = _cpu_ms_behind_busy_stream(lambda: to_device(values, torch.int64, "cuda"))
    assert torch.equal(out, ref) and out.device.type == "cuda"
    assert blocking > 20.0, blocking  # the pageable copy waited for the busy stream
    assert queued < 5.0, (queued, blocking)
