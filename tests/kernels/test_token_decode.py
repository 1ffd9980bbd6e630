"""The per-token decode kernel for G = head_dim (triton/token_decode.py) vs the float64 reference.

Same pool, oracle and error bound as tests/kernels/test_attention.py (whose Pool it reuses):
||o - o_ref|| / ||o_ref|| per request <= 1e-4 with fp32 tensor-core operands (Triton
interpreter, CPU) and <= 2e-2 with bf16 operands (CUDA). Outputs and split-K scratch are
poisoned with NaN; requests cross every source boundary (padding request, all-BF16 request,
INT2 hole around the sink, radix-cache own_start past the sink and ring start).
"""
import math

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.triton import core, core_codes, token_decode

from .pool_case import DEV, LENS, OWNS, REL_TOL, SINKS, Pool, rel_err

pytestmark = pytest.mark.slow  # the module's cases take minutes on 2 cores: make test, not test-fast


def run_fast(pool, q, G, **kw):
    B, Hq, D = q.shape
    o = torch.full((B, Hq, D), float("nan"), device=DEV)
    ms = kw.pop("max_kv_splits", 4)
    logits = torch.full((B, Hq, ms, D), float("nan"), device=DEV)
    lse = torch.full((B, Hq, ms), float("nan"), device=DEV)
    token_decode.decode_attention_fast(
        q.to(DEV), o, *pool.tensors(), *pool.meta(), **pool.kw(), k_group=G, v_group=G,
        sm_scale=kw.pop("sm_scale", 1 / math.sqrt(D)),
        max_kv_splits=ms, attn_logits=logits, attn_lse=lse, **kw)
    assert not o.isnan().any()
    return o.cpu()


def assert_matches_reference(pool, q, o, *ctx, **ref_kw):
    """Every request's output within REL_TOL of the float64 oracle over the same stored K/V."""
    for b in range(q.shape[0]):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V, **ref_kw)
        err = rel_err(o[b], o_ref[0])
        assert err <= REL_TOL, (b, err, *ctx)


@pytest.mark.parametrize("D,gqa", [(128, 4), (64, 8), (64, 3), (128, 1)])
@pytest.mark.parametrize("splits", ["auto", "given"])
def test_fast_decode_matches_reference(seed, D, gqa, splits):
    hkv = 2
    pool = Pool(LENS, OWNS, hkv, D, D, sinks=SINKS)
    B = len(LENS)
    q = (torch.randn(B, hkv * gqa, D) * 2).bfloat16()
    nsplit = torch.tensor([2, 3, 4, 4, 3], dtype=torch.int32, device=DEV) if splits == "given" else None
    o = run_fast(pool, q, D, num_kv_splits=nsplit)
    assert_matches_reference(pool, q, o)


@pytest.mark.parametrize("block_b", [16, 32])
def test_fast_decode_bf16_tile(seed, block_b):
    """Either BF16 tile (default_block_b picks 32 when the grid fits one wave): same attention."""
    D, hkv, gqa = 64, 2, 4
    pool = Pool(LENS, OWNS, hkv, D, D, sinks=SINKS)
    q = (torch.randn(len(LENS), hkv * gqa, D) * 2).bfloat16()
    nsplit = torch.tensor([4, 5, 6, 7, 5], dtype=torch.int32, device=DEV)
    for nks in (None, nsplit):
        o = run_fast(pool, q, D, num_kv_splits=nks, block_b=block_b, max_kv_splits=7)
        assert_matches_reference(pool, q, o, nks is None)


@pytest.mark.parametrize("fused", [True, False])
def test_fast_decode_merge_fused_or_kernel(seed, fused):
    """The splits merged by the last program of each (request, KV head) (default) or by decode's
    merge kernel: same attention; the fused merge leaves its arrival counters at zero for the
    next call (given counters, and the per-device default ones)."""
    D, hkv, gqa = 64, 2, 4
    pool = Pool(LENS, OWNS, hkv, D, D, sinks=SINKS)
    q = (torch.randn(len(LENS), hkv * gqa, D) * 2).bfloat16()
    arrived = torch.zeros(len(LENS) * hkv + 3, dtype=torch.int32, device=DEV)
    for kw in ({"arrived": arrived}, {}):
        # a second call relies on the counters the first one left (the merge kernel keeps none)
        for _ in range(2 if fused else 1):
            o = run_fast(pool, q, D, fused_merge=fused, max_kv_splits=5, **kw)
            assert_matches_reference(pool, q, o, fused, kw.keys())
    assert not arrived.any()
    assert not core.split_arrivals(DEV, 1).any()


@pytest.mark.parametrize("D", [64, 128], ids=["bytes", "words"])
def test_fast_decode_small_tiles_many_splits(seed, D):
    """BLOCK_N=16, in-kernel split count: several INT2 tiles per split, masked tail tiles."""
    hkv, gqa = 1, 4
    lens, owns = [100, 37], [0, 10]
    pool = Pool(lens, owns, hkv, D, D)
    q = torch.randn(2, hkv * gqa, D).bfloat16()
    o = run_fast(pool, q, D, max_kv_splits=7, block_n=16, min_chunk=16, sm_scale=0.125)
    assert_matches_reference(pool, q, o, sm_scale=0.125)


@pytest.mark.parametrize("D", [64, 128], ids=["bytes", "words"])
def test_fast_decode_64bit_offsets(seed, D):
    """The int64 offset path (taken for pools of >= 2^31 elements) gives the same attention."""
    hkv, gqa = 2, 4
    pool = Pool(LENS, OWNS, hkv, D, D, sinks=SINKS)
    q = (torch.randn(len(LENS), hkv * gqa, D) * 2).bfloat16()
    o = run_fast(pool, q, D, offsets_32bit=False)
    assert_matches_reference(pool, q, o)


def test_fast_decode_head_major_pool(seed):
    """The plugin's pool is head-major ([H, N, ...] memory viewed as [N, H, ...]): same attention."""
    D, hkv, gqa = 64, 2, 4
    pool = Pool(LENS, OWNS, hkv, D, D, sinks=SINKS)
    for name in ("k_codes", "v_codes", "k_params", "v_params"):
        t = getattr(pool, name)
        setattr(pool, name, t.transpose(0, 1).contiguous().transpose(0, 1))
    assert pool.k_codes.stride(1) > pool.k_codes.stride(0)
    q = (torch.randn(len(LENS), hkv * gqa, D) * 2).bfloat16()
    o = run_fast(pool, q, D)
    assert_matches_reference(pool, q, o)


@pytest.mark.parametrize("D", [64, 128], ids=["bytes", "words"])
def test_fast_decode_logit_cap(seed, D):
    hkv, gqa, cap = 1, 2, 5.0
    pool = Pool([40], [0], hkv, D, D)
    q = (torch.randn(1, hkv * gqa, D) * 4).bfloat16()
    o = run_fast(pool, q, D, max_kv_splits=3, sm_scale=0.125, logit_cap=cap)
    K, V = pool.request_kv(0)
    s = torch.einsum("thd,lhd->htl", q.double(), K.double().repeat_interleave(gqa, 1)) * 0.125
    p = torch.softmax(cap * torch.tanh(s / cap), -1)
    o_ref = torch.einsum("htl,lhd->thd", p, V.double().repeat_interleave(gqa, 1))
    assert rel_err(o[0], o_ref[0]) <= REL_TOL


def test_ops_picks_the_kernel_by_group_size(seed, monkeypatch):
    """ops.decode_attention uses this kernel where G = head_dim and the generic one for the
    group sizes it does not handle; both match the reference."""
    calls = []
    real = token_decode.decode_attention_fast
    monkeypatch.setattr(token_decode, "decode_attention_fast", lambda *a, **k: calls.append(1) or real(*a, **k))
    D, hkv, gqa = 64, 1, 4
    for G, expect in ((64, 1), (32, 0)):
        calls.clear()
        pool = Pool([30], [0], hkv, D, G)
        q = torch.randn(1, hkv * gqa, D).bfloat16()
        o = torch.full((1, hkv * gqa, D), float("nan"), device=DEV)
        ops.decode_attention(q.to(DEV), o, *pool.tensors(), *pool.meta(), k_group=G, v_group=G,
                             sm_scale=0.125, max_kv_splits=3)
        assert len(calls) == expect
        K, V = pool.request_kv(0)
        o_ref, _ = ref.attention(q.float(), K, V, sm_scale=0.125)
        assert rel_err(o[0].cpu(), o_ref[0]) <= REL_TOL


@pytest.mark.parametrize("splits", ["auto", "given"])
def test_fast_decode_code_words(seed, splits):
    """head_dim 128: codes read as 16-bit words, BF16 sink + ring keys spread over every split,
    with split counts derived in-kernel or given per request (1 = one split reads everything)."""
    D, hkv, gqa = 128, 2, 4
    pool = Pool(LENS, OWNS, hkv, D, D, sinks=SINKS)
    q = (torch.randn(len(LENS), hkv * gqa, D) * 2).bfloat16()
    nsplit = torch.tensor([1, 3, 4, 2, 3], dtype=torch.int32, device=DEV) if splits == "given" else None
    o = run_fast(pool, q, D, num_kv_splits=nsplit)
    assert_matches_reference(pool, q, o)


def test_fast_decode_one_split_per_request(seed):
    """At large batch the split policy gives one split per (request, KV head) (1024 programs at
    B x Hkv >= 1024 on an H100): with the BF16 keys spread, that one split reads sink, INT2 body
    and ring, and the default split count itself can be 1."""
    D, hkv, gqa = 128, 2, 4
    pool = Pool(LENS, OWNS, hkv, D, D, sinks=SINKS)
    q = (torch.randn(len(LENS), hkv * gqa, D) * 2).bfloat16()
    assert token_decode.default_max_splits(4096, 8, "cuda" if DEV == "cuda" else "cpu") == 1
    o = run_fast(pool, q, D, max_kv_splits=1)
    assert_matches_reference(pool, q, o)


def test_fast_decode_refuses_other_group_sizes():
    pool = Pool([30], [0], 1, 64, 32)
    q = torch.randn(1, 4, 64).bfloat16()
    with pytest.raises(ValueError, match="group size == head_dim"):
        run_fast(pool, q, 32)


def _emulate_word_code(p, lo, hi):
    """core_codes.word_code's PTX on registers holding two 16-bit code words (lo | hi << 16),
    bit for bit: the shift, then lop3 0xEA = (w & mask) | exponent; the two fp16 halves."""
    import numpy as np

    reg = lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)
    op, _, amount = core_codes.WORD_SRC[p].partition("$1")
    shift = int(amount.strip(" ,;") or 0)
    w = (reg << shift) & 0xFFFFFFFF if op.startswith("shl") else reg >> shift
    out = (w & int(core_codes.WORD_MASK[p], 16)) | int(core_codes.WORD_EXP[p], 16)
    halves = np.stack([out & 0xFFFF, out >> 16], -1).astype(np.uint16)
    return halves.view(np.float16).astype(np.float64)


def test_word_code_extractions_are_offset_plus_code():
    """The GPU path's 8 extractions (one shift + one lop3 each, never run by the interpreter):
    for every 16-bit word in either half of a register, extraction p is exactly WORD_OFS[p] + the
    code of dim 2w + p // 4 + D/4 (p % 4), i.e. bits 8 (p // 4) + 2 (p % 4) of the word."""
    import numpy as np

    lo = np.arange(1 << 16, dtype=np.uint32)
    hi = np.random.default_rng(0).permutation(lo)
    for p in range(8):
        bit = 8 * (p // 4) + 2 * (p % 4)
        want = core_codes.WORD_OFS[p] + np.stack([(lo >> bit) & 3, (hi >> bit) & 3], -1)
        assert np.array_equal(_emulate_word_code(p, lo, hi), want), p


def test_word_dims_follow_the_quarter_split():
    """Word w = bytes 2w, 2w+1 of a row; byte j holds dims j + (D/4) k at bits 2k (format.md):
    extraction p of word w is dim 2w + p // 4 + (D/4)(p % 4), and the 8 extractions cover every
    dim once."""
    import numpy as np

    for D in (128, 256):
        QW = D // 8
        codes = np.random.default_rng(D).integers(0, 4, (5, D))
        j = np.arange(D // 4)
        packed = sum(codes[:, j + k * (D // 4)] << (2 * k) for k in range(4)).astype(np.uint8)
        words = np.ascontiguousarray(packed).view("<u2").astype(np.int64)  # byte 2w | byte 2w+1 << 8
        dims = []
        for p in range(8):
            d = 2 * np.arange(QW) + p // 4 + 2 * QW * (p % 4)  # core_codes.word_dims
            bit = 8 * (p // 4) + 2 * (p % 4)
            assert np.array_equal((words >> bit) & 3, codes[:, d]), (D, p)
            dims += list(d)
        assert sorted(dims) == list(range(D))
