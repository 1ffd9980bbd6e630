"""INT2 decode over long contexts in ONE split per request, vs float64 (CUDA only): the
per-channel decode (the default format) and the per-token decode for G = head_dim.

On the GPU the value operands carry an offset (the exponent trick: 128 + code, or 64 / 16 / 4 +
code for code words). Taken off once after the loop, the offsets' share would leave fp32 sums far
above the output in each accumulator, an error growing with the tiles a split walks, which is what
a large batch of long requests gets; the kernels take it off per tile, and the per-channel value
accumulators are centred on the mid-code (channel_attend.VMID). The interpreter runs without
offsets, so only a CUDA run can check this. Flat attention (q * 0.3) is the case that exposes it;
heavy-tailed keys and zero-mean values (tests/kernels/pool_case.rotated_kv) as everywhere else.
Head dim 128 reads code words, 64 bytes (and 3-bit keys there run the packed body).

Bound: 5e-2 relative per request (measured errors: docs/design.md "Kernel design choices").
"""
import pytest
import torch

from oscar_kernels import reference as ref

from ..kernels.pool_case import DEV, Pool, rel_err
from ..kernels.channel_case import ChannelPool, channel_fmt, run_decode
from ..kernels.test_token_decode import run_fast

LENS = [32768, 16384, 4096]
BOUND = 5e-2


@pytest.mark.parametrize("D,bits,vg", [
    (128, 3, 64), (128, 2, 64), (128, 4, 64), (128, 4, 128), (128, 3, 128),
    (64, 3, 64), (64, 2, 64), (64, 4, 64),
])
def test_one_split_over_long_context_matches_float64(seed, D, bits, vg):
    pool = ChannelPool(channel_fmt(D, bits, 64, vg), LENS, [0] * len(LENS), [0] * len(LENS), hkv=2)
    q = (torch.randn(len(LENS), 8, D) * 0.3).bfloat16()
    one = torch.ones(len(LENS), dtype=torch.int32, device=DEV)
    o = run_decode(pool, q, 8, one)
    assert not o.isnan().any()
    for b in range(len(LENS)):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].to(DEV).float(), K.to(DEV), V.to(DEV))
        err = rel_err(o[b], o_ref[0].cpu())
        assert err <= BOUND, (LENS[b], err)


@pytest.mark.parametrize("D", [128, 64], ids=["words", "bytes"])
def test_fast_token_decode_one_split_over_long_context_matches_float64(seed, D):
    lens = [1] + LENS  # request 0: a CUDA-graph padding request (pool_case.request_rows)
    pool = Pool(lens, [0] * len(lens), 2, D, D)
    q = (torch.randn(len(lens), 8, D) * 0.3).bfloat16()
    one = torch.ones(len(lens), dtype=torch.int32, device=DEV)
    o = run_fast(pool, q, D, num_kv_splits=one, max_kv_splits=8)
    for b in range(1, len(lens)):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].to(DEV).float(), K.to(DEV), V.to(DEV))
        err = rel_err(o[b], o_ref[0].cpu())
        assert err <= BOUND, (lens[b], D, err)
