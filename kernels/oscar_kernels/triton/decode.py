"""Decode attention over sink + INT2 body + ring: split-K stage 1 (attend.py) + LSE merge (here).

CUDA-graph safe: no host synchronisation; with attn_logits/attn_lse passed nothing is allocated.
The number of splits per request is either given (num_kv_splits [B]) or derived *inside* the
kernels from the request length (same formula in both stages), so no host-side length is needed.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .attend import check_pool, launch_attend, num_splits_of, source_ranges

# Tuned on H100 (bench/kernels.py --tune, 2026-11-22): BLOCK_N=128 / 2 warps / 2 stages was the
# best or within 2% of the best tried setting at every benchmarked (B, L); see docs/benchmarks.md.
BLOCK_N = 128  # INT2 keys per tile
# head_dim 256: a 128-key tile at G=32 needs 290 KB of shared memory (the H100 has 227 KB per
# block; checked offline by tests/kernels/test_schedule.py), 32 keys need 149 KB
BLOCK_N_D256 = 32
BLOCK_B = 32  # BF16 keys per tile
MIN_CHUNK = 256  # fewest INT2 keys per split when splits are derived in-kernel
PROGRAMS_PER_SM = 4  # target (B * Hkv * int2 splits) / SMs when max_kv_splits is not given
MERGE_CHUNK = 8  # splits a merge program reads at a time, in a large grid (merge_chunk)
MERGE_ONE_SHOT_PROGRAMS_PER_SM = 8  # up to this many (request, head) programs: all splits at once
BF16_KEYS_PER_SPLIT = 160  # sink + ring keys per BF16 split (S=64, W=256 -> 2 splits)


def bf16_splits(sink: int, window: int, max_kv_splits: int, keys_per_split: int | None = None) -> int:
    """BF16 splits per request: static, from the side-buffer sizes; leaves >= 1 INT2 split."""
    keys = keys_per_split or BF16_KEYS_PER_SPLIT
    return max(1, min(triton.cdiv(sink + window, keys), max_kv_splits - 1, 8))


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device) -> int:
    """SMs of a CUDA device; 8 elsewhere (the CPU interpreter), so split plans stay small there."""
    device = torch.device(device)
    return _num_sms(device.index or 0) if device.type == "cuda" else 8


def default_max_splits(batch: int, kv_heads: int, device: torch.device, nb16: int = 2) -> int:
    """BF16 splits + enough INT2 splits to give every SM a few programs (static given B)."""
    sms = sm_count(device)
    want = triton.cdiv(PROGRAMS_PER_SM * sms, batch * kv_heads)
    return min(64, triton.next_power_of_2(max(1, want))) + nb16


@triton.jit
def _merge_splits_kernel(
    Part, stride_pb, stride_ph, stride_ps,
    PLse, stride_lb, stride_lh,
    O, stride_ob, stride_oh,
    kv_indptr, req_rows, own_start, sink_start, num_kv_splits, MAX_SPLITS,
    S: tl.constexpr, W: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
    HAS_NSPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, NB16: tl.constexpr,
):
    # CHUNK splits at a time with an online rescale (merge_chunk): one chunk of all splits when
    # the grid is small (latency), chunks of MERGE_CHUNK when it is large
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_len = tl.load(kv_indptr + b + 1) - tl.load(kv_indptr + b)
    row = tl.load(req_rows + b).to(tl.int64)
    _, _, _, n_int2 = source_ranges(kv_len, tl.load(own_start + row), tl.load(sink_start + row), S, W)
    n = num_splits_of(n_int2, b, num_kv_splits, HAS_NSPLITS, MAX_SPLITS, MIN_CHUNK, NB16)
    d = tl.arange(0, DV)
    c = tl.arange(0, CHUNK)
    m = tl.full([], float("-inf"), tl.float32)
    wsum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([DV], dtype=tl.float32)
    for start in range(0, n, CHUNK):
        s = start + c
        smask = s < n
        lse = tl.load(PLse + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights stay 0
        alpha = tl.exp(m - m_ref)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_ref))
        # splits that saw no key wrote nothing: never read them (w == 0)
        part = tl.load(Part + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                       mask=(smask & (w > 0))[:, None], other=0.0)
        acc = acc * alpha + tl.sum(part * w[:, None], 0)
        wsum = wsum * alpha + tl.sum(w, 0)
        m = m_new
    o = acc / tl.where(wsum > 0, wsum, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + d, o.to(O.dtype.element_ty))


def plan_decode(q, o, k_codes, v_codes, sink_k, ring_k, kv_indptr, max_kv_splits, attn_logits, attn_lse,
                bf16_keys_per_split, default_splits, bf16_spread=False):
    """Checks and split plan shared by both stage-1 kernels (base and fast):
    (max_kv_splits, BF16 splits, attn_logits, attn_lse); scratch is allocated only when not given.
    default_splits(B, Hkv, device, nb16) sizes max_kv_splits when neither it nor scratch is given."""
    B, Hq, _ = q.shape
    Hkv = k_codes.shape[1]
    Dv = v_codes.shape[-1] * 4
    if kv_indptr.shape[0] < B + 1:
        raise ValueError(f"kv_indptr has {kv_indptr.shape[0]} entries, need batch + 1 = {B + 1}")
    if o.shape != (B, Hq, Dv) or o.stride(-1) != 1:
        raise ValueError(f"o must be [{B}, {Hq}, {Dv}] with a contiguous last dim, got {tuple(o.shape)}")
    S, W = sink_k.shape[1], ring_k.shape[1]
    if max_kv_splits is None:
        max_kv_splits = (attn_logits.shape[2] if attn_logits is not None
                         else default_splits(B, Hkv, q.device, 0 if bf16_spread else
                                             bf16_splits(S, W, 1 << 30, bf16_keys_per_split)))
    if bf16_spread:  # every split reads its share of the BF16 keys too: no BF16-only splits
        nb16 = 0
    elif max_kv_splits < 2:
        raise ValueError("INT2 decode needs max_kv_splits >= 2 (one BF16 split + INT2 splits)")
    else:
        nb16 = bf16_splits(S, W, max_kv_splits, bf16_keys_per_split)
    if attn_logits is None:
        attn_logits = torch.empty(B, Hq, max_kv_splits, Dv, dtype=torch.float32, device=q.device)
    if attn_lse is None:
        attn_lse = torch.empty(B, Hq, max_kv_splits, dtype=torch.float32, device=q.device)
    assert attn_logits.shape[2] >= max_kv_splits and attn_lse.shape[2] >= max_kv_splits
    return max_kv_splits, nb16, attn_logits, attn_lse


def merge_chunk(batch: int, q_heads: int, max_kv_splits: int, device) -> int:
    """Splits a merge program reads per step. A small grid (batch 1-32 at 32 heads on the H100)
    reads all max_kv_splits at once: a loop of dependent steps cost 1.4 / 7.4 us more at batch 1,
    4K / 128K (H100, bench/results/kernels/2026-11-27_0006_merge-*.json). A large grid walks only
    the splits each request used (2-4 at large batch) MERGE_CHUNK at a time: one
    [next_pow2(max_kv_splits), Dv] tile of masked loads took 67 us a layer at batch 512 in the
    server (64 + 2 splits allowed; the decode profile of 2026-11-26, docs/benchmarks.md)."""
    p2 = triton.next_power_of_2(max_kv_splits)
    if batch * q_heads <= MERGE_ONE_SHOT_PROGRAMS_PER_SM * sm_count(device):
        return p2
    return min(MERGE_CHUNK, p2)


def merge_splits(o, attn_logits, attn_lse, kv_indptr, req_rows, own_start, sink_start, num_kv_splits,
                 max_kv_splits, nb16, min_chunk, S, W, chunk=None, num_warps=None):
    """Stage 2: LSE-merge the per-split partial outputs into o (both stage-1 kernels). chunk:
    splits per merge step (None: merge_chunk); num_warps: the merge's warps (None: 4)."""
    B, Hq, Dv = o.shape
    chunk = chunk or merge_chunk(B, Hq, max_kv_splits, o.device)
    _merge_splits_kernel[(B, Hq)](
        attn_logits, attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse, attn_lse.stride(0), attn_lse.stride(1),
        o, o.stride(0), o.stride(1),
        kv_indptr, req_rows, own_start, sink_start,
        num_kv_splits if num_kv_splits is not None else kv_indptr, max_kv_splits,
        S=S, W=W, DV=Dv, CHUNK=chunk,
        HAS_NSPLITS=num_kv_splits is not None, MIN_CHUNK=min_chunk,
        NB16=nb16, num_warps=num_warps or 4,
    )
    return o


def decode_attention(
    q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_group, v_group, sm_scale, sink_start=None,
    num_kv_splits=None, max_kv_splits=None, attn_logits=None, attn_lse=None, logit_cap=0.0,
    block_n=None, num_warps=2, num_stages=2, min_chunk=None, bf16_keys_per_split=None, use_asm=None, maxnreg=None,
):
    """See ops.decode_attention; the extra keywords are tuning knobs for bench/kernels.py."""
    check_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_group, v_group)
    sink_start = own_start if sink_start is None else sink_start
    B, Hq, D = q.shape
    Hkv = k_codes.shape[1]
    gqa = Hq // Hkv
    max_kv_splits, nb16, attn_logits, attn_lse = plan_decode(
        q, o, k_codes, v_codes, sink_k, ring_k, kv_indptr, max_kv_splits, attn_logits, attn_lse,
        bf16_keys_per_split, default_max_splits)
    min_chunk = min_chunk or MIN_CHUNK
    block_m = max(16, triton.next_power_of_2(gqa))
    bn = block_n or (BLOCK_N if max(D, v_codes.shape[-1] * 4) <= 128 else BLOCK_N_D256)
    launch_attend(
        (B, Hkv, max_kv_splits), q, attn_logits, attn_lse, k_codes, k_params, v_codes, v_params,
        sink_k, sink_v, ring_k, ring_v, kv_indptr, kv_indices, kv_indptr, req_rows, own_start,
        sink_start, num_kv_splits,
        out_split_stride=attn_logits.stride(2), lse_split_stride=attn_lse.stride(2),
        k_group=k_group, v_group=v_group, sm_scale=sm_scale, logit_cap=logit_cap,
        num_mb=1, block_m=block_m, block_n=bn, block_b=BLOCK_B, split=True,
        max_splits=max_kv_splits, min_chunk=min_chunk, num_warps=num_warps, num_stages=num_stages,
        nb16=nb16, use_asm=use_asm, maxnreg=maxnreg,
    )
    return merge_splits(o, attn_logits, attn_lse, kv_indptr, req_rows, own_start, sink_start, num_kv_splits,
                        max_kv_splits, nb16, min_chunk, sink_k.shape[1], ring_k.shape[1])
