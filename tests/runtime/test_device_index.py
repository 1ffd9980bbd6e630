"""runtime/device_index.to_device on CPU: the values and dtype arrive (the CUDA path, which must
not wait for the stream, is tests/gpu/test_device_index.py)."""
import torch

from oscar_sglang.runtime.device_index import to_device


def test_lists_and_cpu_tensors_arrive_with_their_dtype():
    t = to_device([3, 1, 2], torch.int64, "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    assert to_device([True, False], torch.bool, "cpu").tolist() == [True, False]
    src = torch.tensor([0, 64, 128], dtype=torch.int64)
    out = to_device(src, torch.int32, torch.device("cpu"))
    assert out.dtype == torch.int32 and out.tolist() == [0, 64, 128]
    assert to_device([], torch.int64, "cpu").numel() == 0
