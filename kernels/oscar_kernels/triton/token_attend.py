"""The per-token recipe's generic attention kernel (both modes), for the group sizes and head dims
the specialised kernels (token_decode's and token_extend's) do not take.

One program = (request b, KV head h, block of query rows, split s). Query rows are the
(token, query head) pairs of request b that read KV head h: row m -> token m // GQA, head
h * GQA + m % GQA. Decode has one token (rows = the GQA group, padded to >= 16 for tl.dot), so each
K/V byte is read once per KV head, not once per query head.

Key positions 0..len-1 of the request come from three sources (rule of reference.source_masks):
  sink [sink_lo, sink_hi)   BF16, sink[row, p]
  ring [ring_lo, len)       BF16, ring[row, p % W]
  INT2 the rest             packed codes + (scale, min) of slot kv_indices[kv_start + p]
Each source has its own loop, so the hot INT2 loop has no per-element source selection. The INT2
positions are [0, sink_lo) u [sink_hi, ring_lo); they are walked as one "virtual" index range
i in [0, n_int2) with p = i + hole * (i >= sink_lo).

INT2 scores fold the affine dequantisation into the dot product (exact algebra):
  q . k_hat = sum_groups  scale_g * (q_g . codes_g) + min_g * sum(q_g)
so K codes go to the tensor cores as small integers (exact in bf16/fp16) and the scale multiplies
a [rows, BLOCK_N] tile instead of a [BLOCK_N, D] one. Likewise for V:
  p @ v_hat = (p * scale_g) @ codes_g + (p @ min_g)
This needs every quarter (D/4 dims) to lie inside one group (G >= D/4); the only other supported
case (D=256, G=32) dequantises explicitly (FOLD=False).

Decode (SPLIT=True): splits 0..NB16-1 share the BF16 sink ++ ring keys, splits NB16..n-1 cut the
INT2 range into equal BLOCK_N-aligned chunks (a BF16 key costs ~7x the bytes of an INT2 key).
Extend (SPLIT=False): one program does all three loops.
Outputs are normalised partial attention o [rows, Dv] and its natural-log LSE; a program that
saw no key writes o = 0, lse = -inf.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .core import (INT2_STAGES, LN2, LOG2E, as_param_words, bf16_sink_ring, cap_and_scale, empty_softmax_state,
                   load_q_quarters, num_splits_of, online_softmax, pool_launch_args, pv_dtype, source_ranges,
                   split_ranges, use_asm)
from .core_codes import codes_2bit, pick4, unpack_params


# num_mb (query blocks per KV head) follows the longest new-token run of the batch: a runtime
# argument, not a constexpr (that compiled a new kernel for every new chunk length in serving)
@triton.jit(do_not_specialize=["num_mb"])
def attend_kernel(
    Q, stride_qt, stride_qh,
    Out, stride_ot, stride_oh, stride_os,
    Lse, stride_lt, stride_lh, stride_ls,
    KC, stride_kcn, stride_kch,
    KP, stride_kpn, stride_kph,
    VC, stride_vcn, stride_vch,
    VP, stride_vpn, stride_vph,
    SK, stride_skr, stride_skp, stride_skh,
    SV, stride_svr, stride_svp, stride_svh,
    RK, stride_rkr, stride_rkp, stride_rkh,
    RV, stride_rvr, stride_rvp, stride_rvh,
    kv_indptr, kv_indices, qo_indptr, req_rows, own_start, sink_start, num_kv_splits,
    sm_scale_log2, logit_cap, MAX_SPLITS, num_mb,
    GQA: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    S: tl.constexpr, W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    SPLIT: tl.constexpr, HAS_NSPLITS: tl.constexpr,
    MIN_CHUNK: tl.constexpr, LOGIT_CAP: tl.constexpr, PV_DT: tl.constexpr, NB16: tl.constexpr,
    USE_ASM: tl.constexpr, INT2_STAGES: tl.constexpr,
):
    QD: tl.constexpr = D // 4
    QDV: tl.constexpr = DV // 4
    FOLD_K: tl.constexpr = GK >= QD
    FOLD_V: tl.constexpr = GV >= QDV
    CODE_OFS: tl.constexpr = 128.0 if USE_ASM else 0.0  # codes_2bit returns code + CODE_OFS
    b = tl.program_id(0)
    pid1 = tl.program_id(1)
    split = tl.program_id(2)
    kvh = pid1 // num_mb
    mb = pid1 % num_mb

    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    if SPLIT:
        tok0 = b
        n_tok = 1
    else:
        tok0 = tl.load(qo_indptr + b)
        n_tok = tl.load(qo_indptr + b + 1) - tok0
    if mb * BLOCK_M >= n_tok * GQA:
        return
    row = tl.load(req_rows + b).to(tl.int64)
    own = tl.load(own_start + row)  # per-request state is indexed by request row, not batch slot
    sink_own = tl.load(sink_start + row)
    sink_lo, sink_hi, ring_lo, n_int2 = source_ranges(kv_len, own, sink_own, S, W)
    hole = sink_hi - sink_lo

    if SPLIT:
        n_splits = num_splits_of(n_int2, b, num_kv_splits, HAS_NSPLITS, MAX_SPLITS, MIN_CHUNK, NB16)
        if split >= n_splits:
            return
        i_lo, i_hi, s_lo, s_hi, r_lo, r_hi = split_ranges(
            split, n_splits, n_int2, sink_lo, sink_hi, ring_lo, kv_len, BLOCK_N, NB16)
    else:
        i_lo = 0
        i_hi = n_int2
        s_lo = sink_lo
        s_hi = sink_hi
        r_lo = ring_lo
        r_hi = kv_len

    # ---- query rows --------------------------------------------------------------------------
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // GQA
    hq = kvh * GQA + rows % GQA
    rmask = t < n_tok
    tok = (tok0 + t).to(tl.int64)
    dq = tl.arange(0, QD)
    qb = Q + tok[:, None] * stride_qt + hq[:, None] * stride_qh + dq[None, :]
    q0, q1, q2, q3 = load_q_quarters(qb, rmask, QD, PV_DT)
    qs0 = tl.sum(q0.to(tl.float32), 1)
    qs1 = tl.sum(q1.to(tl.float32), 1)
    qs2 = tl.sum(q2.to(tl.float32), 1)
    qs3 = tl.sum(q3.to(tl.float32), 1)

    m_i, l_i, a0, a1, a2, a3 = empty_softmax_state(BLOCK_M, QDV)

    # ---- BF16 sink and ring ------------------------------------------------------------------
    m_i, l_i, a0, a1, a2, a3 = bf16_sink_ring(
        s_lo, s_hi, r_lo, r_hi, row, kvh,
        SK, stride_skr, stride_skp, stride_skh, SV, stride_svr, stride_svp, stride_svh,
        RK, stride_rkr, stride_rkp, stride_rkh, RV, stride_rvr, stride_rvp, stride_rvh,
        q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, sm_scale_log2, logit_cap,
        W, QD, QDV, BLOCK_B, LOGIT_CAP, PV_DT)

    # ---- INT2 body ---------------------------------------------------------------------------
    offs_n = tl.arange(0, BLOCK_N)
    dv = tl.arange(0, QDV)
    kvh64 = kvh.to(tl.int64)  # the pool is head-major: kvh * stride can pass 2^31
    KCh = KC + kvh64 * stride_kch
    KPh = KP + kvh64 * stride_kph
    VCh = VC + kvh64 * stride_vch
    VPh = VP + kvh64 * stride_vph
    idx_base = kv_indices + kv_start
    for i0 in tl.range(i_lo, i_hi, BLOCK_N, num_stages=INT2_STAGES):  # see INT2_STAGES
        ii = i0 + offs_n
        kmask = ii < i_hi
        pos = ii + tl.where(ii >= sink_lo, hole, 0)
        # masked lanes read slot 0 (always a valid pool row) and are dropped via -inf scores
        slot = tl.load(idx_base + pos, mask=kmask, other=0).to(tl.int64)
        kc = tl.load(KCh + slot[:, None] * stride_kcn + dq[None, :])
        qk = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        qs = tl.zeros([BLOCK_M], tl.float32)
        for j in tl.static_range(4):
            if FOLD_K:
                cj = codes_2bit(kc, j, q0.dtype, USE_ASM)
                part += tl.dot(pick4(j, q0, q1, q2, q3), tl.trans(cj))
                qs += pick4(j, qs0, qs1, qs2, qs3)
                if (j == 3) or (((j + 1) * QD) // GK != (j * QD) // GK):
                    sc, mn = unpack_params(tl.load(KPh + slot * stride_kpn + (j * QD) // GK))
                    # q.(c + OFS) * sc + (mn - OFS * sc) * sum(q) = q.(c * sc + mn)
                    qk += part * sc[None, :] + qs[:, None] * (mn - CODE_OFS * sc)[None, :]
                    part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    qs = tl.zeros([BLOCK_M], tl.float32)
            else:
                cj = ((kc >> (2 * j)) & 3).to(q0.dtype)
                g = (j * QD + dq) // GK
                sc, mn = unpack_params(tl.load(KPh + slot[:, None] * stride_kpn + g[None, :]))
                kj = (cj.to(tl.float32) * sc + mn).to(q0.dtype)
                qk += tl.dot(pick4(j, q0, q1, q2, q3), tl.trans(kj))
        s = cap_and_scale(qk, sm_scale_log2, logit_cap, LOGIT_CAP)
        s = tl.where(kmask[None, :], s, float("-inf"))
        pr, alpha, m_i, l_i = online_softmax(s, m_i, l_i)

        vc = tl.load(VCh + slot[:, None] * stride_vcn + dv[None, :])
        a0 = a0 * alpha[:, None]
        a1 = a1 * alpha[:, None]
        a2 = a2 * alpha[:, None]
        a3 = a3 * alpha[:, None]
        for j in tl.static_range(4):
            if FOLD_V:
                cj = codes_2bit(vc, j, PV_DT, USE_ASM)
                if (j * QDV) % GV == 0:  # first quarter of a group: its (p * scale, p @ min)
                    sc, mn = unpack_params(tl.load(VPh + slot * stride_vpn + (j * QDV) // GV))
                    ps = (pr * sc[None, :]).to(PV_DT)
                    # (p*sc) @ (c + OFS) + p @ mn - OFS * sum(p*sc) = p @ (c * sc + mn)
                    pm = tl.sum(pr * mn[None, :] - CODE_OFS * ps.to(tl.float32), 1)[:, None]
                upd = tl.dot(ps, cj) + pm
            else:
                cj = ((vc >> (2 * j)) & 3).to(PV_DT)
                g = (j * QDV + dv) // GV
                sc, mn = unpack_params(tl.load(VPh + slot[:, None] * stride_vpn + g[None, :]))
                upd = tl.dot(pr.to(PV_DT), (cj.to(tl.float32) * sc + mn).to(PV_DT))
            if j == 0:
                a0 += upd
            elif j == 1:
                a1 += upd
            elif j == 2:
                a2 += upd
            else:
                a3 += upd

    # ---- normalised partial output + LSE -----------------------------------------------------
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    ob = Out + tok[:, None] * stride_ot + hq[:, None] * stride_oh + split * stride_os + dv[None, :]
    tl.store(ob, a0 * inv_l[:, None], mask=rmask[:, None])
    tl.store(ob + QDV, a1 * inv_l[:, None], mask=rmask[:, None])
    tl.store(ob + 2 * QDV, a2 * inv_l[:, None], mask=rmask[:, None])
    tl.store(ob + 3 * QDV, a3 * inv_l[:, None], mask=rmask[:, None])
    tl.store(Lse + tok * stride_lt + hq * stride_lh + split * stride_ls, lse, mask=rmask)


def launch_attend(
    grid, q, out, lse, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, qo_indptr, req_rows, own_start, sink_start, num_kv_splits, *,
    out_split_stride, lse_split_stride, k_group, v_group, sm_scale, logit_cap,
    num_mb, block_m, block_n, block_b, split, max_splits, min_chunk, num_warps, num_stages, nb16=1,
    maxnreg=None, int2_stages=None,
):
    """Host-side launcher: views params as int32 words and launches (the callers check shapes)."""
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    D = q.shape[-1]
    Hkv = k_codes.shape[1]
    Dv = v_codes.shape[-1] * 4
    gqa = q.shape[1] // Hkv
    kp = as_param_words(k_params)
    vp = as_param_words(v_params)
    attend_kernel[grid](
        q, q.stride(0), q.stride(1),
        out, out.stride(0), out.stride(1), out_split_stride,
        lse, lse.stride(0), lse.stride(1), lse_split_stride,
        *pool_launch_args(k_codes, kp, v_codes, vp, sink_k, sink_v, ring_k, ring_v),
        kv_indptr, kv_indices, qo_indptr, req_rows, own_start,
        own_start if sink_start is None else sink_start,
        num_kv_splits if num_kv_splits is not None else kv_indptr,
        sm_scale * LOG2E, float(logit_cap), int(max_splits),
        GQA=gqa, D=D, DV=Dv, GK=k_group, GV=v_group, S=sink_k.shape[1], W=ring_k.shape[1],
        num_mb=num_mb, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=block_b,
        SPLIT=split, HAS_NSPLITS=num_kv_splits is not None,
        MIN_CHUNK=min_chunk, LOGIT_CAP=logit_cap > 0, PV_DT=pv_dtype(q), NB16=nb16, USE_ASM=use_asm(q),
        # decode only: the extend mode (D = 256's prefill) keeps depth 2, its shared memory at
        # depth 2 is already near the limit (tests/kernels/test_schedule.py)
        INT2_STAGES=int2_stages or (INT2_STAGES if split else 2),
        num_warps=num_warps, num_stages=num_stages, **extra,
    )
