"""Extend-prefix attention of the per-token recipe: the E_b new query tokens of
request b against its whole cached prefix (no mask), keys from the BF16 sink, the BF16 ring and
the INT2 body by the rule of reference.source_masks (core.source_ranges), o float32
[T, Hq, Dv] normalised and its natural-log LSE [T, Hq] (o = 0, lse = -inf for an empty prefix).

extend_kernel (here) where supports() holds (D, Dv in {64, 128}, 16-bit queries; the others run
token_attend.attend_kernel in extend mode). Prefill is compute bound (every INT2 key is read by
E_b * GQA query rows), and the generic attend kernel is shaped for decode (quarter-split dot products of K = D/4, 64
rows, 4 warps: mma v2 on the H100). Here one program takes BLOCK_M = 128 (token, query head)
rows of one KV head and runs the textbook flash-attention loop with full-width tiles:
  * each INT2 K / V tile is dequantised once to a [BLOCK_N, D] fp16 tile (code * scale + min),
    shared by all 128 rows;
  * one tl.dot(q, k^T) with K = D and one tl.dot(p, v), 8 warps: on sm_90 Triton emits wgmma
    (HGMMA; offline sm_90 compile, docs/design.md has the instruction mix);
  * the INT2 loop runs unmasked full tiles and one masked tail tile.
Dequantisation: the quarter-split bytes (format.py: byte i of a row holds dims
i + j * D/4, j = 0..3, at bits 2j) are unpacked by one PTX block into four [BLOCK_N, D/4] quarter
tiles (plain Triton arithmetic in the interpreter) and joined in registers to a [BLOCK_N, D] tile whose column 4i + j is dim j * D/4 + i. That
column order costs nothing: q is loaded in the same order (q . k is order-free) and V's columns
come out of p @ v in that order, so o is stored with the inverse permutation.
MMA operands are fp16, not bf16: the parameters are fp16 already, so code * scale + min is one
fp16 fma with one rounding (2^-11 relative); bf16 K tiles lose LSE accuracy on heavy-tailed
data. BF16 queries and sink / ring rows convert to fp16
exactly within its range and saturate at +-65504 beyond it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .core import (INT2_STAGES, LN2, LOG2E, as_param_words, cap_and_scale, check_pool, compiled, extend_outputs,
                   pool_launch_args, source_ranges)
from .core_codes import unpack_params
from .token_attend import launch_attend

BLOCK_M = 128  # (token, query head) rows per program
BLOCK_N = 128  # keys per tile (the fastest tile measured, docs/design.md)
BLOCK_B = 64  # keys per BF16 sink / ring tile
NUM_WARPS = 8
# Smallest INT2 tile the compiled kernel is known to compute right: with 16-key tiles (a size only
# tests and sweeps ask for) it gave outputs off by a factor of ~2 on an H200 with either
# dequantisation, before and after the 2026-12-01 consolidation; 32 and the default 128 matched the
# float64 reference. The interpreter runs any size.
MIN_COMPILED_BLOCK_N = 32
NUM_STAGES = 2
# the generic kernel's extend mode (D = 256, or fp32 queries)
BASE_BLOCK_M = 64
BASE_BLOCK_N = 64
BASE_BLOCK_B = 64


@triton.jit
def _to_mma(x, DT: tl.constexpr):
    """x -> the MMA dtype; fp16 saturates at +-65504 instead of overflowing to inf."""
    if DT == tl.float16:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0)
    return x.to(DT)


@triton.jit
def _softmax_tile(qk, kmask, m_i, l_i, sm_scale_log2, logit_cap, LOGIT_CAP: tl.constexpr,
                  MASKED: tl.constexpr):
    """Online softmax step on raw q.k; keys with kmask False (if MASKED) get -inf after the cap
    (>= 1 valid key per tile).

    The scale is applied inside the exponent (one FFMA per score) and to the row max, instead of
    to every score first: sm_scale is not folded into q, whose 16-bit rounding would shift the
    LSE on heavy-tailed data."""
    if LOGIT_CAP:
        s = cap_and_scale(qk, sm_scale_log2, logit_cap, LOGIT_CAP)
        c = 1.0
    else:
        s = qk
        c = sm_scale_log2
    if MASKED:
        s = tl.where(kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * c)  # c > 0: max commutes with the scale
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * c - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


# PTX, per 4 code bytes (4 elements of the [N, D/4] byte tile; $8) -> 4 values per quarter j (outputs
# $2j, $2j+1 as fp16 pairs), with inputs ($9 + 4j, $10 + 4j) = scale and ($11 + 4j, $12 + 4j) = min
# of quarter j's group as fp16 pairs: bytes are spread to 16-bit lanes (prmt), each lane becomes
# 0x6400 | code = 1024 + code (exact), minus 1024, then one fma.rn.f16x2 with (scale, min):
# ~2 instructions per value instead of ~6 in fp32 plus a conversion.
_DEQ_ASM = tl.constexpr(
    "{.reg .b32 x, y, t, u, z, m; mov.b32 z, 0; mov.b32 m, 0x64006400; "
    "prmt.b32 x, $8, z, 0x4140; prmt.b32 y, $8, z, 0x4342; "
    + "".join(
        ("" if j == 0 else "shr.b32 x, x, 2; shr.b32 y, y, 2; ")
        + "lop3.b32 t, x, 0x00030003, m, 0xEA; lop3.b32 u, y, 0x00030003, m, 0xEA; "
        "sub.f16x2 t, t, m; sub.f16x2 u, u, m; "
        f"fma.rn.f16x2 ${2 * j}, t, ${9 + 4 * j}, ${11 + 4 * j}; "
        f"fma.rn.f16x2 ${2 * j + 1}, u, ${10 + 4 * j}, ${12 + 4 * j}; "
        for j in range(4))
    + "}"
)


@triton.jit
def _quarter_params(Pb, slot, stride_pn, J: tl.constexpr, QD: tl.constexpr, G: tl.constexpr):
    """(scale, min) word of the group that holds quarter J (G >= D/4: one group per quarter)."""
    return tl.load(Pb + slot * stride_pn + (J * QD) // G)


@triton.jit
def _half_params(w, BLOCK_N: tl.constexpr, QD: tl.constexpr):
    """int32 (scale, min) words [N] -> fp16 scale and min, broadcast to [N, D/4]."""
    sc = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    mn = ((w >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.broadcast_to(sc[:, None], [BLOCK_N, QD]), tl.broadcast_to(mn[:, None], [BLOCK_N, QD])


@triton.jit
def _dequant_join(Cb, Pb, slot, stride_cn, stride_pn, D: tl.constexpr, G: tl.constexpr,
                  DT: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr):
    """INT2 rows at `slot` -> [N, D] dequantised, columns in interleaved order 4 * i + j = dim
    j * D/4 + i (byte i, bit field j): the four quarters of one byte column are joined in
    registers, no shuffles. The caller permutes q's and o's columns the same way."""
    QD: tl.constexpr = D // 4
    c = tl.load(Cb + slot[:, None] * stride_cn + tl.arange(0, QD)[None, :])
    # one load (and one fp16 pair conversion) per group, not per quarter
    w0 = _quarter_params(Pb, slot, stride_pn, 0, QD, G)
    w1 = w0 if QD // G == 0 else _quarter_params(Pb, slot, stride_pn, 1, QD, G)
    w2 = w1 if (2 * QD) // G == QD // G else _quarter_params(Pb, slot, stride_pn, 2, QD, G)
    w3 = w2 if (3 * QD) // G == (2 * QD) // G else _quarter_params(Pb, slot, stride_pn, 3, QD, G)
    if USE_ASM:
        s0, m0 = _half_params(w0, BLOCK_N, QD)
        s1, m1 = _half_params(w1, BLOCK_N, QD)
        s2, m2 = _half_params(w2, BLOCK_N, QD)
        s3, m3 = _half_params(w3, BLOCK_N, QD)
        k0, k1, k2, k3 = tl.inline_asm_elementwise(
            _DEQ_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r" + ",r" * 16, [c, s0, m0, s1, m1, s2, m2, s3, m3],
            dtype=(tl.float16,) * 4, is_pure=True, pack=4)
        k0, k1, k2, k3 = k0.to(DT), k1.to(DT), k2.to(DT), k3.to(DT)
    else:
        ci = c.to(tl.int32)
        sc, mn = unpack_params(w0)
        k0 = ((ci & 3).to(tl.float32) * sc[:, None] + mn[:, None]).to(DT)
        sc, mn = unpack_params(w1)
        k1 = (((ci >> 2) & 3).to(tl.float32) * sc[:, None] + mn[:, None]).to(DT)
        sc, mn = unpack_params(w2)
        k2 = (((ci >> 4) & 3).to(tl.float32) * sc[:, None] + mn[:, None]).to(DT)
        sc, mn = unpack_params(w3)
        k3 = (((ci >> 6) & 3).to(tl.float32) * sc[:, None] + mn[:, None]).to(DT)
    # join adds a new last dim: [n, i, b, a] = (k0, k2 | k1, k3)[a][b] = quarter 2b + a -> column 4i + 2b + a
    return tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), [BLOCK_N, D])


@triton.jit
def _bf16_tile(p0, hi, Kb, Vb, stride_kp, stride_vp, dk, dv, q, m_i, l_i, acc, sm_scale_log2, logit_cap,
               IS_RING: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, LOGIT_CAP: tl.constexpr,
               DT: tl.constexpr):
    """Keys at positions [p0, min(p0 + BLOCK, hi)) of a BF16 side buffer (p, or p % W for the ring);
    dk / dv: the K / V columns in the kernel's column order."""
    p = p0 + tl.arange(0, BLOCK)
    kmask = p < hi
    if IS_RING:
        idx = p % W
    else:
        idx = p
    k = _to_mma(tl.load(Kb + idx[:, None] * stride_kp + dk[None, :], mask=kmask[:, None], other=0.0), DT)
    pr, alpha, m_i, l_i = _softmax_tile(tl.dot(q, tl.trans(k)), kmask, m_i, l_i, sm_scale_log2, logit_cap,
                                        LOGIT_CAP, True)
    v = _to_mma(tl.load(Vb + idx[:, None] * stride_vp + dv[None, :], mask=kmask[:, None], other=0.0), DT)
    acc = tl.dot(pr.to(DT), v, acc * alpha[:, None])
    return m_i, l_i, acc


@triton.jit
def _int2_tile(i0, i_hi, sink_lo, hole, idx_base, KCh, KPh, VCh, VPh,
               stride_kcn, stride_kpn, stride_vcn, stride_vpn, q, m_i, l_i, acc, sm_scale_log2, logit_cap,
               MASKED: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
               BLOCK_N: tl.constexpr, LOGIT_CAP: tl.constexpr, DT: tl.constexpr,
               USE_ASM: tl.constexpr):
    """INT2 keys i0 .. i0 + BLOCK_N - 1 of the virtual INT2 index range (see token_attend.py)."""
    ii = i0 + tl.arange(0, BLOCK_N)
    pos = ii + tl.where(ii >= sink_lo, hole, 0)
    if MASKED:  # tail tile: lanes past i_hi read slot 0 (a valid row) and get -inf scores
        kmask = ii < i_hi
        slot = tl.load(idx_base + pos, mask=kmask, other=0).to(tl.int64)
    else:
        kmask = ii >= 0  # all valid (not read when MASKED is False)
        slot = tl.load(idx_base + pos).to(tl.int64)
    k = _dequant_join(KCh, KPh, slot, stride_kcn, stride_kpn, D, GK, DT, USE_ASM, BLOCK_N)
    pr, alpha, m_i, l_i = _softmax_tile(tl.dot(q, tl.trans(k)), kmask, m_i, l_i, sm_scale_log2, logit_cap,
                                        LOGIT_CAP, MASKED)
    v = _dequant_join(VCh, VPh, slot, stride_vcn, stride_vpn, DV, GV, DT, USE_ASM, BLOCK_N)
    acc = tl.dot(pr.to(DT), v, acc * alpha[:, None])
    return m_i, l_i, acc


# num_mb (query blocks per KV head) follows the longest new-token run of the batch: a runtime
# argument, not a constexpr (that compiled a new kernel for every new chunk length in serving)
@triton.jit(do_not_specialize=["num_mb"])
def extend_kernel(
    Q, stride_qt, stride_qh,
    Out, stride_ot, stride_oh,
    Lse, stride_lt, stride_lh,
    KC, stride_kcn, stride_kch,
    KP, stride_kpn, stride_kph,
    VC, stride_vcn, stride_vch,
    VP, stride_vpn, stride_vph,
    SK, stride_skr, stride_skp, stride_skh,
    SV, stride_svr, stride_svp, stride_svh,
    RK, stride_rkr, stride_rkp, stride_rkh,
    RV, stride_rvr, stride_rvp, stride_rvh,
    kv_indptr, kv_indices, qo_indptr, req_rows, own_start, sink_start,
    sm_scale_log2, logit_cap, num_mb,
    GQA: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    S: tl.constexpr, W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    LOGIT_CAP: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr,
    INT2_STAGES: tl.constexpr,
):
    b = tl.program_id(0)
    pid1 = tl.program_id(1)
    kvh = pid1 // num_mb  # neighbouring programs share a KV head: its tiles stay in L2
    mb = pid1 % num_mb

    tok0 = tl.load(qo_indptr + b)
    n_tok = tl.load(qo_indptr + b + 1) - tok0
    if mb * BLOCK_M >= n_tok * GQA:
        return
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    row = tl.load(req_rows + b).to(tl.int64)
    own = tl.load(own_start + row)  # per-request state is indexed by request row, not batch slot
    sink_own = tl.load(sink_start + row)
    sink_lo, sink_hi, ring_lo, n_int2 = source_ranges(kv_len, own, sink_own, S, W)
    hole = sink_hi - sink_lo

    # query rows m -> token m // GQA, head kvh * GQA + m % GQA
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // GQA
    hq = kvh * GQA + rows % GQA
    rmask = t < n_tok
    tok = (tok0 + t).to(tl.int64)
    dk = tl.arange(0, D)
    dv = tl.arange(0, DV)
    # interleaved column order of _dequant_join: column 4 * i + j = dim j * D/4 + i
    dk = (dk % 4) * (D // 4) + dk // 4
    dv = (dv % 4) * (DV // 4) + dv // 4
    q = tl.load(Q + tok[:, None] * stride_qt + hq[:, None] * stride_qh + dk[None, :],
                mask=rmask[:, None], other=0.0)
    q = _to_mma(q, DT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)

    # ---- BF16 sink and ring (<= S + W keys) --------------------------------------------------
    SKb = SK + row * stride_skr + kvh * stride_skh
    SVb = SV + row * stride_svr + kvh * stride_svh
    for p0 in range(sink_lo, sink_hi, BLOCK_B):
        m_i, l_i, acc = _bf16_tile(p0, sink_hi, SKb, SVb, stride_skp, stride_svp, dk, dv, q, m_i, l_i, acc,
                                   sm_scale_log2, logit_cap, False, W, BLOCK_B, LOGIT_CAP, DT)
    RKb = RK + row * stride_rkr + kvh * stride_rkh
    RVb = RV + row * stride_rvr + kvh * stride_rvh
    for p0 in range(ring_lo, kv_len, BLOCK_B):
        m_i, l_i, acc = _bf16_tile(p0, kv_len, RKb, RVb, stride_rkp, stride_rvp, dk, dv, q, m_i, l_i, acc,
                                   sm_scale_log2, logit_cap, True, W, BLOCK_B, LOGIT_CAP, DT)

    # ---- INT2 body: full tiles, then one masked tail -----------------------------------------
    idx_base = kv_indices + kv_start
    kvh64 = kvh.to(tl.int64)  # the pool is head-major: kvh * stride can pass 2^31
    KCh = KC + kvh64 * stride_kch
    KPh = KP + kvh64 * stride_kph
    VCh = VC + kvh64 * stride_vch
    VPh = VP + kvh64 * stride_vph
    n_full = (n_int2 // BLOCK_N) * BLOCK_N
    for i0 in tl.range(0, n_full, BLOCK_N, num_stages=INT2_STAGES):  # see INT2_STAGES
        m_i, l_i, acc = _int2_tile(i0, n_int2, sink_lo, hole, idx_base, KCh, KPh, VCh, VPh,
                                   stride_kcn, stride_kpn, stride_vcn, stride_vpn, q, m_i, l_i, acc,
                                   sm_scale_log2, logit_cap, False, D, DV, GK, GV, BLOCK_N, LOGIT_CAP, DT, USE_ASM)
    if n_full < n_int2:
        m_i, l_i, acc = _int2_tile(n_full, n_int2, sink_lo, hole, idx_base, KCh, KPh, VCh, VPh,
                                   stride_kcn, stride_kpn, stride_vcn, stride_vpn, q, m_i, l_i, acc,
                                   sm_scale_log2, logit_cap, True, D, DV, GK, GV, BLOCK_N, LOGIT_CAP, DT, USE_ASM)

    # ---- normalised output + natural-log LSE -------------------------------------------------
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    ob = Out + tok[:, None] * stride_ot + hq[:, None] * stride_oh + dv[None, :]
    tl.store(ob, acc * inv_l[:, None], mask=rmask[:, None])
    tl.store(Lse + tok * stride_lt + hq * stride_lh, lse, mask=rmask)


def supports(q, k_codes, v_codes, k_group, v_group) -> bool:
    """Shapes this kernel handles: D, Dv in {64, 128} (any group size the format allows), 16-bit
    queries. D = 256 keeps the generic kernel (a 128 x 256 fp32 accumulator does not fit 8 warps)."""
    D, Dv = k_codes.shape[-1] * 4, v_codes.shape[-1] * 4
    # every quarter inside one group (G >= D/4): true of every group size the format allows here
    return (D in (64, 128) and Dv in (64, 128) and D % k_group == 0 and Dv % v_group == 0
            and k_group >= D // 4 and v_group >= Dv // 4 and q.dtype in (torch.bfloat16, torch.float16))


def extend_prefix_attention(
    q, qo_indptr, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_group, v_group, sm_scale, max_len_extend,
    sink_start=None, logit_cap=0.0, o=None, lse=None,
):
    """See ops.extend_prefix_attention: extend_kernel where supports() holds, else the generic kernel."""
    args = (q, qo_indptr, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
            kv_indptr, kv_indices, req_rows, own_start)
    kw = dict(k_group=k_group, v_group=v_group, sm_scale=sm_scale, max_len_extend=max_len_extend,
              sink_start=sink_start, logit_cap=logit_cap, o=o, lse=lse)
    if supports(q, k_codes, v_codes, k_group, v_group):
        return extend_prefix_attention_fast(*args, **kw)
    return extend_prefix_attention_base(*args, **kw)


def extend_prefix_attention_base(
    q, qo_indptr, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_group, v_group, sm_scale, max_len_extend,
    sink_start=None, logit_cap=0.0, o=None, lse=None, block_m=None, num_warps=4, num_stages=2,
):
    """extend_prefix_attention with the generic kernel (any head dim and group size)."""
    check_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_group, v_group)
    T, Hq, D = q.shape
    B = qo_indptr.shape[0] - 1
    Hkv = k_codes.shape[1]
    gqa = Hq // Hkv
    o, lse = extend_outputs(q, qo_indptr, kv_indptr, v_codes, o, lse)
    if T == 0 or B == 0:
        return o, lse
    bm = block_m or BASE_BLOCK_M
    bm = max(bm, 16, triton.next_power_of_2(gqa))
    num_mb = triton.cdiv(max(1, int(max_len_extend)) * gqa, bm)
    launch_attend(
        (B, Hkv * num_mb, 1), q, o, lse, k_codes, k_params, v_codes, v_params,
        sink_k, sink_v, ring_k, ring_v, kv_indptr, kv_indices, qo_indptr, req_rows, own_start,
        sink_start, None, out_split_stride=0, lse_split_stride=0,
        k_group=k_group, v_group=v_group, sm_scale=sm_scale, logit_cap=logit_cap,
        num_mb=num_mb, block_m=bm, block_n=BASE_BLOCK_N, block_b=BASE_BLOCK_B, split=False,
        max_splits=1, min_chunk=1, num_warps=num_warps, num_stages=num_stages,
    )
    return o, lse


def extend_prefix_attention_fast(
    q, qo_indptr, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_group, v_group, sm_scale, max_len_extend,
    sink_start=None, logit_cap=0.0, o=None, lse=None, block_m=None, block_n=None, num_warps=None,
    num_stages=None, int2_stages=None,
):
    """extend_prefix_attention with extend_kernel; block_m / block_n / num_warps / num_stages /
    int2_stages override the defaults (benchmark sweeps). The quarters are joined in registers
    (interleaved column order), dequantised by PTX in fp16 where compiled, by plain Triton
    arithmetic in fp32 in the interpreter."""
    check_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_group, v_group)
    if not supports(q, k_codes, v_codes, k_group, v_group):
        raise ValueError("extend_prefix_attention_fast supports D, Dv in {64, 128} and bf16/fp16 queries; "
                         "extend_prefix_attention picks the generic kernel for the others")
    T, Hq, D = q.shape
    B = qo_indptr.shape[0] - 1
    Hkv = k_codes.shape[1]
    Dv = v_codes.shape[-1] * 4
    gqa = Hq // Hkv
    o, lse = extend_outputs(q, qo_indptr, kv_indptr, v_codes, o, lse)
    if T == 0 or B == 0:
        return o, lse
    sink_start = own_start if sink_start is None else sink_start
    bm = block_m or BLOCK_M
    if block_n is not None and block_n < MIN_COMPILED_BLOCK_N and compiled(q):
        raise ValueError(f"block_n={block_n}: compiled, this kernel needs block_n >= "
                         f"{MIN_COMPILED_BLOCK_N} (16 gave wrong outputs on an H200)")
    num_mb = triton.cdiv(max(1, int(max_len_extend)) * gqa, bm)
    kp, vp = as_param_words(k_params), as_param_words(v_params)
    # MMA operands in fp16 (module docstring); the Triton interpreter's 16-bit tl.dot is wrong: fp32 there
    asm = compiled(q)
    dt = tl.float16 if asm else tl.float32
    extend_kernel[(B, Hkv * num_mb)](
        q, q.stride(0), q.stride(1),
        o, o.stride(0), o.stride(1),
        lse, lse.stride(0), lse.stride(1),
        *pool_launch_args(k_codes, kp, v_codes, vp, sink_k, sink_v, ring_k, ring_v),
        kv_indptr, kv_indices, qo_indptr, req_rows, own_start, sink_start,
        sm_scale * LOG2E, float(logit_cap),
        GQA=gqa, D=D, DV=Dv, GK=k_group, GV=v_group, S=sink_k.shape[1], W=ring_k.shape[1],
        num_mb=num_mb, BLOCK_M=bm, BLOCK_N=block_n or BLOCK_N, BLOCK_B=BLOCK_B,
        LOGIT_CAP=logit_cap > 0, DT=dt, USE_ASM=asm, INT2_STAGES=int2_stages or INT2_STAGES,
        num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES,
    )
    return o, lse
