"""Host-side index lists as device tensors, without a stream synchronisation.

`torch.tensor(values, device=cuda)` (or `.to(cuda)` of a CPU tensor) copies from pageable memory
and then synchronises the stream (PyTorch's memcpy_and_sync): the CPU waits for every kernel
queued before it. The scheduler prepares a batch while the previous forward still runs, so such a
copy on a per-batch path holds the CPU until that forward ends (the same pattern in the host
tier's copies held the CPU 32 ms behind a busy stream on the H200, docs/serving.md). From pinned
memory the copy is asynchronous; PyTorch's pinned-memory allocator keeps the host buffer until the
copy has run on its stream.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """values (a list or a CPU tensor) as a `dtype` tensor on `device`, queued on the current stream."""
    t = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
