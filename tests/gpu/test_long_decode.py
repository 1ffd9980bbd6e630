"""INT2 decode over long contexts in ONE split per request, vs float64 (CUDA only): the
per-channel decode (the default format) and the per-token fast decode.

On the GPU the value operands carry an offset (the bf16 / fp16 exponent trick: 128 + code, or
64 / 16 / 4 + code for code words). Until 2026-11-26 the offsets' share was taken off once after the
loop, so each accumulator held fp32 sums 64-128x the output: the error grew with the tiles a
split walks, to 1.4e-1 (peaked attention) and 4.4 (flat attention) relative at 32K keys in one
split, which is what a large batch of long requests gets. The interpreter runs without offsets,
so only a CUDA run can check this. Flat attention (q * 0.3) is the case that exposed it; heavy-tailed
keys and zero-mean values (tests/kernels/pool_case.rotated_kv) as everywhere else.

Bound: 5e-2 relative per request. Measured on the H100 (2026-11-26) with the fix: per-channel at
most 1.0e-2 (byte reads), 3.2e-2 (code words); without it 1.7 to 4.4 at 32K (all six cases
of the first test failed on the old kernels). The per-token fast decode (bench/kernel_speed.py's
check with q ~ N(0, 1)): 1.1e-3 with the fix, 3.3e-2 without. Since 2026-11-27 the per-channel
value accumulators are centred on the mid-code (attend_channel.VMID): on the same kind of case in
bench/kernel_error.py (flat q, one split, 32K keys; its own outlier pool, not this test's) 4.3e-3
(bytes) and 1.5e-3 (words) against 1.0e-2 and 2.6e-2 before (bench/results/kernels/
2026-11-27_2059_ / _2107_kernel-error_h100.json). This test's own errors were not recorded.
"""
import pytest
import torch

from oscar_kernels import reference as ref

from ..kernels.pool_case import DEV, Pool, rel_err
from ..kernels.test_channel_kernels import ChannelPool, channel_fmt, run_decode
from ..kernels.test_decode_fast import run_fast

LENS = [32768, 16384, 4096]
BOUND = 5e-2


@pytest.mark.parametrize("bits,k3,reads,vg", [
    (3, "planes", "bytes", 64), (3, "packed", "bytes", 64), (2, None, "bytes", 64), (4, None, "bytes", 64),
    (3, "planes", "words", 64), (2, None, "words", 64),
    (4, None, "words", 128),  # the default since 2026-11-29 (k4c64-v2h) at head_dim 128
    (3, "planes", "words", 128),
])
def test_one_split_over_long_context_matches_float64(seed, bits, k3, reads, vg):
    pool = ChannelPool(channel_fmt(128, bits, 64, vg), LENS, [0] * len(LENS), [0] * len(LENS), hkv=2)
    q = (torch.randn(len(LENS), 8, 128) * 0.3).bfloat16()
    one = torch.ones(len(LENS), dtype=torch.int32, device=DEV)
    o = run_decode(pool, q, 8, one, k3_variant=k3, code_reads=reads)
    assert not o.isnan().any()
    for b in range(len(LENS)):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].to(DEV).float(), K.to(DEV), V.to(DEV))
        err = rel_err(o[b], o_ref[0].cpu())
        assert err <= BOUND, (LENS[b], err)


@pytest.mark.parametrize("words", [True, False])
def test_fast_token_decode_one_split_over_long_context_matches_float64(seed, words):
    lens = [1] + LENS  # request 0: a CUDA-graph padding request (pool_case.request_rows)
    pool = Pool(lens, [0] * len(lens), 2, 128, 128)
    q = (torch.randn(len(lens), 8, 128) * 0.3).bfloat16()
    one = torch.ones(len(lens), dtype=torch.int32, device=DEV)
    o = run_fast(pool, q, 128, num_kv_splits=one, max_kv_splits=8, words=words)
    for b in range(1, len(lens)):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].to(DEV).float(), K.to(DEV), V.to(DEV))
        err = rel_err(o[b], o_ref[0].cpu())
        assert err <= BOUND, (lens[b], words, err)
