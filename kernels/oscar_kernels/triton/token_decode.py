"""Decode attention of the per-token recipe: one query token per request over the BF16 sink, the
INT2 body and the BF16 ring, split-K with an LSE merge (core.merge_splits, or fused into the
decode's last program of a head: core.merge_if_last).

Two stage-1 kernels, picked by shape (decode_attention):
* decode_kernel (here), where K and V use one (scale, min) group per row (G = head_dim). Every
  split reads an equal BLOCK_N-aligned chunk of the INT2 range and an equal chunk of the BF16 sink
  ++ ring keys (NB16 = 0).
* token_attend.attend_kernel (decode mode) for the other group sizes: splits 0..NB16-1 read the
  BF16 keys, the others share the INT2 body.

What decode_kernel does to spend few instructions per INT2 key:
* Both products run transposed so that the long side fills the MMA's 16-row side and the GQA
  query rows its 8-column side (padded to 8, not to 16): scores s^T = codes_K @ q^T (keys x rows)
  and o^T += codes_V^T @ (p*sc) (Dv x rows). Half the MMAs and half the accumulator registers of
  the row-major form; p never needs transposing.
* One warp per program (see NUM_WARPS).
* Code words (WORDS, head_dim >= 128): each row's codes are read as D/8 16-bit words, and each of
  the 8 two-bit fields of a word becomes an MMA operand with one lop3 per two codes
  (core_codes.word_code): the operands come straight from ldmatrix, with no byte gathers for V and
  no widening (format.md). At head_dim 64 (an extraction would be 8 wide, under the MMA's 16) the
  bytes are widened to 16 bits once per tile and each quarter unpacked the same way
  (core_codes.quarter_k / quarter_v).
* The V (scale, min) sums are per-row scalars kept apart from the MMA accumulators and added once
  after the loop; the softmax scale is folded into q; whole tiles run without masks; offsets are
  32-bit when the pool allows.
* The INT2 loop is software-pipelined (core.INT2_STAGES): the next tile's codes are in flight
  while a tile is computed.
* The grid (see PROGRAMS_PER_SM and SPLIT_PROGRAMS_PER_SM): ~8 INT2 programs per SM in one wave,
  the BF16 keys spread over them, the merge fused at few splits.
The measurements behind these choices are in docs/design.md "Kernel design choices".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .core import (FUSED_MERGE_MAX_SPLITS, INT2_STAGES, LN2, LOG2E, as_param_words, bf16_sink_ring,
                   cap_and_scale, check_pool, empty_softmax_state, load_q_quarters, merge_if_last,
                   merge_splits, num_splits_of, plan_decode, pool_launch_args, pv_dtype, sm_count,
                   source_ranges, split_ranges, split_arrivals, use_asm)
from .core_codes import (V_OFS, WORDS_MIN_DIM, k_scale, quarter_k, quarter_v, unpack_params, v_scale,
                         word_code, word_dims, word_ofs, words_of_quarter)
from .token_attend import launch_attend

# One warp per program: the [BLOCK_N, 8] score tile is one warp's MMA column, so a second warp
# would only duplicate it (Triton gives every chained dot the same warp split).
NUM_WARPS = 1
# Program slots per SM: 12 one-warp programs fit by registers and by shared memory (16-key BF16
# tiles; tests/kernels/test_schedule.py), so a grid of up to 12 x SMs programs runs in one wave.
# 16-key BF16 tiles (BLOCK_B) keep shared memory small; when the whole grid fits in one wave
# 32-key tiles are as fast or faster (default_block_b).
PROGRAMS_PER_SM = 12
# ... but with code words (WORDS) fewer, longer programs (less fixed cost per program) are faster
# than one per slot: the split policy (default_max_splits) aims at 8 INT2 programs per SM.
SPLIT_PROGRAMS_PER_SM = 8
BLOCK_B = 16
BLOCK_B_ONE_WAVE = 32
BLOCK_N = 64  # INT2 keys per tile: the fastest tile measured (docs/design.md)

# The generic kernel's decode (other group sizes): 128-key tiles, 2 warps, 2 stages
BASE_BLOCK_N = 128
# head_dim 256: a 128-key tile at G=32 needs more shared memory than an H100 block has
# (tests/kernels/test_schedule.py checks it offline); 32 keys fit
BASE_BLOCK_N_D256 = 32
BASE_BLOCK_B = 32  # BF16 keys per tile
BASE_MIN_CHUNK = 256  # fewest INT2 keys per split when splits are derived in-kernel
BASE_PROGRAMS_PER_SM = 4  # target (B * Hkv * int2 splits) / SMs when max_kv_splits is not given


@triton.jit
def _int2_slots(i0, i_hi, sink_lo, hole, idx_base, BLOCK_N: tl.constexpr, OFS32: tl.constexpr):
    """Pool slots of INT2 keys i0 .. i0+BLOCK_N-1 (the sink hole skipped); keys at or past i_hi
    read slot 0 (always a valid pool row; their scores are masked)."""
    ii = i0 + tl.arange(0, BLOCK_N)
    pos = ii + tl.where(ii >= sink_lo, hole, 0)
    slot = tl.load(idx_base + pos, mask=ii < i_hi, other=0)
    # 32-bit offsets when every pool tensor is under 2^31 elements (one IMAD per address)
    return slot.to(tl.int32) if OFS32 else slot.to(tl.int64)


@triton.jit
def _int2_fetch(slot, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                QD: tl.constexpr, QDV: tl.constexpr):
    """K codes [keys, QD], K params, V codes transposed [QDV, keys], V params of one tile. The codes
    are bytes (QD = D/4) or, through int16 pointers, code words (QD = D/8; WORDS)."""
    kc = tl.load(KCh + slot[:, None] * stride_kcn + tl.arange(0, QD)[None, :])
    kpw = tl.load(KPh + slot * stride_kpn)
    vct = tl.load(VCh + slot[None, :] * stride_vcn + tl.arange(0, QDV)[:, None])
    vpw = tl.load(VPh + slot * stride_vpn)
    return kc, kpw, vct, vpw


@triton.jit
def _scores_softmax(part, kpw, qs_ofs, qsum, i0, i_hi, m_i, l_i, sm_scale_log2, logit_cap,
                    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_CAP: tl.constexpr):
    """part = q'.(offset + codes) of a tile [keys, rows] -> (p^T, alpha, m_i, l_i): the K (scale,
    min) applied (one group per row), online softmax in the log2 domain. MASKED: keys at or past
    i_hi get -inf scores."""
    ksc, kmn = unpack_params(kpw)
    st = (part - qs_ofs[None, :]) * ksc[:, None] + kmn[:, None] * qsum[None, :]
    if LOGIT_CAP:
        st = cap_and_scale(st, sm_scale_log2, logit_cap, LOGIT_CAP)
    if MASKED:
        st = tl.where((i0 + tl.arange(0, BLOCK_N) < i_hi)[:, None], st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 0))
    alpha = tl.exp2(m_i - m_new)
    pt = tl.exp2(st - m_new[None, :])
    l_i = l_i * alpha + tl.sum(pt, 0)
    return pt, alpha, m_new, l_i


@triton.jit
def _p_times_scale(pt, vpw, alpha, b_mn, DT: tl.constexpr):
    """p^T * V scale per key (the V MMAs' operand, in DT), the per-row sum(p*mn) rescaled by alpha
    (added to the accumulators once, after the loop), and this tile's sum(p*sc) [1, rows] of the
    rounded operand: the code operands' offsets times it are taken off each accumulator before the
    tile's MMA adds them (taken off once after the loop they would leave fp32 sums 64-128x the
    output to cancel: an error growing with the keys per split, tests/gpu/test_long_decode.py)."""
    vsc, vmn = unpack_params(vpw)
    pst = (pt * vsc[:, None]).to(DT)
    b_mn = b_mn * alpha + tl.sum(pt * vmn[:, None], 0)
    gs = tl.sum(pst.to(tl.float32), 0)[None, :]
    return pst, b_mn, gs


@triton.jit
def _int2_tile(i0, i_hi, kc, kpw, vct, vpw,
               q0t, q1t, q2t, q3t, qs_ofs, qsum, m_i, l_i, b_mn, a0, a1, a2, a3, sm_scale_log2, logit_cap,
               MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
               LOGIT_CAP: tl.constexpr, KDT: tl.constexpr, PV_DT: tl.constexpr, USE_ASM: tl.constexpr):
    """One tile of BLOCK_N INT2 keys (codes and params from _int2_fetch): scores s^T = codes @ q^T,
    online softmax, o^T += codes^T @ p. MASKED: keys at or past i_hi get -inf scores."""
    k16 = kc.to(tl.uint16)
    part = tl.dot(quarter_k(k16, 0, KDT, USE_ASM), q0t)
    part = tl.dot(quarter_k(k16, 1, KDT, USE_ASM), q1t, part)
    part = tl.dot(quarter_k(k16, 2, KDT, USE_ASM), q2t, part)
    part = tl.dot(quarter_k(k16, 3, KDT, USE_ASM), q3t, part)
    pt, alpha, m_i, l_i = _scores_softmax(part, kpw, qs_ofs, qsum, i0, i_hi, m_i, l_i, sm_scale_log2,
                                          logit_cap, MASKED, BLOCK_N, LOGIT_CAP)

    # o^T += codes^T @ (p*sc)
    pst, b_mn, gs = _p_times_scale(pt, vpw, alpha, b_mn, PV_DT)
    v16 = vct.to(tl.uint16)
    al = alpha[None, :]
    ofs = gs * (V_OFS if USE_ASM else 0.0)  # quarter_v's offsets' share of this tile
    a0 = tl.dot(quarter_v(v16, 0, PV_DT, USE_ASM), pst, a0 * al - ofs)
    a1 = tl.dot(quarter_v(v16, 1, PV_DT, USE_ASM), pst, a1 * al - ofs)
    a2 = tl.dot(quarter_v(v16, 2, PV_DT, USE_ASM), pst, a2 * al - ofs)
    a3 = tl.dot(quarter_v(v16, 3, PV_DT, USE_ASM), pst, a3 * al - ofs)
    return m_i, l_i, b_mn, a0, a1, a2, a3


@triton.jit
def _pv_words(vwt, pst, al, gs, a0, a1, a2, a3, a4, a5, a6, a7, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """o^T_p += extraction_p(V words)^T @ (p*sc) less its offset's share (ofs_p * gs: gs is the
    tile's sum(p*sc)) for the 8 extractions."""
    a0 = tl.dot(word_code(vwt, 0, DT, USE_ASM), pst, a0 * al - word_ofs(0, USE_ASM) * gs)
    a1 = tl.dot(word_code(vwt, 1, DT, USE_ASM), pst, a1 * al - word_ofs(1, USE_ASM) * gs)
    a2 = tl.dot(word_code(vwt, 2, DT, USE_ASM), pst, a2 * al - word_ofs(2, USE_ASM) * gs)
    a3 = tl.dot(word_code(vwt, 3, DT, USE_ASM), pst, a3 * al - word_ofs(3, USE_ASM) * gs)
    a4 = tl.dot(word_code(vwt, 4, DT, USE_ASM), pst, a4 * al - word_ofs(4, USE_ASM) * gs)
    a5 = tl.dot(word_code(vwt, 5, DT, USE_ASM), pst, a5 * al - word_ofs(5, USE_ASM) * gs)
    a6 = tl.dot(word_code(vwt, 6, DT, USE_ASM), pst, a6 * al - word_ofs(6, USE_ASM) * gs)
    a7 = tl.dot(word_code(vwt, 7, DT, USE_ASM), pst, a7 * al - word_ofs(7, USE_ASM) * gs)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _int2_tile_words(i0, i_hi, kw, kpw, vwt, vpw,
                     q0t, q1t, q2t, q3t, q4t, q5t, q6t, q7t, qs_ofs, qsum, m_i, l_i, b_mn,
                     a0, a1, a2, a3, a4, a5, a6, a7, sm_scale_log2, logit_cap,
                     MASKED: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_CAP: tl.constexpr,
                     DT: tl.constexpr, USE_ASM: tl.constexpr):
    """_int2_tile on code words: 8 extractions of K words [keys, D/8] against the matching q^T
    slices, 8 of V words [Dv/8, keys] against p*sc (DT: fp16, fp32 in the interpreter)."""
    part = tl.dot(word_code(kw, 0, DT, USE_ASM), q0t)
    part = tl.dot(word_code(kw, 1, DT, USE_ASM), q1t, part)
    part = tl.dot(word_code(kw, 2, DT, USE_ASM), q2t, part)
    part = tl.dot(word_code(kw, 3, DT, USE_ASM), q3t, part)
    part = tl.dot(word_code(kw, 4, DT, USE_ASM), q4t, part)
    part = tl.dot(word_code(kw, 5, DT, USE_ASM), q5t, part)
    part = tl.dot(word_code(kw, 6, DT, USE_ASM), q6t, part)
    part = tl.dot(word_code(kw, 7, DT, USE_ASM), q7t, part)
    pt, alpha, m_i, l_i = _scores_softmax(part, kpw, qs_ofs, qsum, i0, i_hi, m_i, l_i, sm_scale_log2,
                                          logit_cap, MASKED, BLOCK_N, LOGIT_CAP)

    pst, b_mn, gs = _p_times_scale(pt, vpw, alpha, b_mn, DT)
    a0, a1, a2, a3, a4, a5, a6, a7 = _pv_words(vwt, pst, alpha[None, :], gs, a0, a1, a2, a3, a4, a5, a6, a7,
                                               DT, USE_ASM)
    return m_i, l_i, b_mn, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _q_word_slice(qbt, rmask, QSC, P: tl.constexpr, QW: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """q^T [D/8, rows] at extraction P's dims, times QSC, in DT, and its per-row sum (fp32)."""
    qt = (tl.load(qbt + word_dims(P, QW)[:, None], mask=rmask[None, :], other=0.0).to(tl.float32) * QSC).to(DT)
    return qt, tl.sum(qt.to(tl.float32), 0)


@triton.jit
def _store_word_part(ob, x, b_mn, inv_l, rmask, P: tl.constexpr, QWV: tl.constexpr):
    """Extraction P's accumulator [Dv/8, rows] -> normalised partial output at its dims:
    (p*sc) @ c + p @ mn = x + sum(p*mn) per row (the offsets came off per tile)."""
    tl.store(ob + word_dims(P, QWV)[:, None], (x + b_mn) * inv_l,
             mask=rmask[None, :])


@triton.jit
def _int2_words_part(qbt, rmask, ob, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                     idx_base, i_lo, i_hi, sink_lo, hole, m_i, l_i, a0, a1, a2, a3, sm_scale_log2, logit_cap,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     LOGIT_CAP: tl.constexpr, PV_DT: tl.constexpr, USE_ASM: tl.constexpr, OFS32: tl.constexpr,
                     INT2_STAGES: tl.constexpr):
    """The kernel's INT2 body with WORDS: KCh / VCh are int16 views of the codes (strides in
    words). Continues the softmax state (m_i, l_i, output quarters a0..a3 [rows, Dv/4]) of the
    BF16 loops, stores the normalised partial output at ob + dim, returns (m_i, l_i)."""
    QW: tl.constexpr = D // 8
    QWV: tl.constexpr = DV // 8
    DT: tl.constexpr = tl.float32 if PV_DT == tl.float32 else tl.float16
    QSC = 1.0 if LOGIT_CAP else sm_scale_log2
    # q^T slices [D/8, rows] matching the 8 extractions, scaled by the softmax scale only (every
    # extraction has scale 1); part = q.c + sum_p ofs_p sum(q_p), q.k_hat = sc q.c + mn sum(q)
    q0t, s0 = _q_word_slice(qbt, rmask, QSC, 0, QW, DT, USE_ASM)
    q1t, s1 = _q_word_slice(qbt, rmask, QSC, 1, QW, DT, USE_ASM)
    q2t, s2 = _q_word_slice(qbt, rmask, QSC, 2, QW, DT, USE_ASM)
    q3t, s3 = _q_word_slice(qbt, rmask, QSC, 3, QW, DT, USE_ASM)
    q4t, s4 = _q_word_slice(qbt, rmask, QSC, 4, QW, DT, USE_ASM)
    q5t, s5 = _q_word_slice(qbt, rmask, QSC, 5, QW, DT, USE_ASM)
    q6t, s6 = _q_word_slice(qbt, rmask, QSC, 6, QW, DT, USE_ASM)
    q7t, s7 = _q_word_slice(qbt, rmask, QSC, 7, QW, DT, USE_ASM)
    qsum = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7
    qs_ofs = (word_ofs(0, USE_ASM) * s0 + word_ofs(1, USE_ASM) * s1 + word_ofs(2, USE_ASM) * s2
              + word_ofs(3, USE_ASM) * s3 + word_ofs(4, USE_ASM) * s4 + word_ofs(5, USE_ASM) * s5
              + word_ofs(6, USE_ASM) * s6 + word_ofs(7, USE_ASM) * s7)
    # the BF16 loops' output quarters -> the 8 extractions' transposed accumulators [Dv/8, rows]
    x0, x4 = words_of_quarter(a0, QWV, BLOCK_M)
    x1, x5 = words_of_quarter(a1, QWV, BLOCK_M)
    x2, x6 = words_of_quarter(a2, QWV, BLOCK_M)
    x3, x7 = words_of_quarter(a3, QWV, BLOCK_M)
    b_mn = tl.zeros([BLOCK_M], dtype=tl.float32)
    i_full = i_lo + (i_hi - i_lo) // BLOCK_N * BLOCK_N
    for i0 in tl.range(i_lo, i_full, BLOCK_N, num_stages=INT2_STAGES):
        kw, kpw, vwt, vpw = _int2_fetch(_int2_slots(i0, i_hi, sink_lo, hole, idx_base, BLOCK_N, OFS32),
                                              KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                                              QW, QWV)
        m_i, l_i, b_mn, x0, x1, x2, x3, x4, x5, x6, x7 = _int2_tile_words(
            i0, i_hi, kw, kpw, vwt, vpw, q0t, q1t, q2t, q3t, q4t, q5t, q6t, q7t, qs_ofs, qsum, m_i, l_i,
            b_mn, x0, x1, x2, x3, x4, x5, x6, x7, sm_scale_log2, logit_cap, False, BLOCK_N, LOGIT_CAP,
            DT, USE_ASM)
    if i_full < i_hi:
        kw, kpw, vwt, vpw = _int2_fetch(_int2_slots(i_full, i_hi, sink_lo, hole, idx_base, BLOCK_N, OFS32),
                                              KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                                              QW, QWV)
        m_i, l_i, b_mn, x0, x1, x2, x3, x4, x5, x6, x7 = _int2_tile_words(
            i_full, i_hi, kw, kpw, vwt, vpw, q0t, q1t, q2t, q3t, q4t, q5t, q6t, q7t, qs_ofs, qsum, m_i, l_i,
            b_mn, x0, x1, x2, x3, x4, x5, x6, x7, sm_scale_log2, logit_cap, True, BLOCK_N, LOGIT_CAP,
            DT, USE_ASM)
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)[None, :]
    b_mn = b_mn[None, :]
    _store_word_part(ob, x0, b_mn, inv_l, rmask, 0, QWV)
    _store_word_part(ob, x1, b_mn, inv_l, rmask, 1, QWV)
    _store_word_part(ob, x2, b_mn, inv_l, rmask, 2, QWV)
    _store_word_part(ob, x3, b_mn, inv_l, rmask, 3, QWV)
    _store_word_part(ob, x4, b_mn, inv_l, rmask, 4, QWV)
    _store_word_part(ob, x5, b_mn, inv_l, rmask, 5, QWV)
    _store_word_part(ob, x6, b_mn, inv_l, rmask, 6, QWV)
    _store_word_part(ob, x7, b_mn, inv_l, rmask, 7, QWV)
    return m_i, l_i


@triton.jit
def decode_kernel(
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
    kv_indptr, kv_indices, req_rows, own_start, sink_start, num_kv_splits,
    sm_scale_log2, logit_cap, MAX_SPLITS,
    Final, stride_fb, stride_fh, Arrived,
    GQA: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    S: tl.constexpr, W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, HAS_NSPLITS: tl.constexpr,
    MIN_CHUNK: tl.constexpr, LOGIT_CAP: tl.constexpr, PV_DT: tl.constexpr, NB16: tl.constexpr,
    USE_ASM: tl.constexpr, OFS32: tl.constexpr, INT2_STAGES: tl.constexpr,
    MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, SPLITS_P2: tl.constexpr, WORDS: tl.constexpr,
):
    QD: tl.constexpr = D // 4
    QDV: tl.constexpr = DV // 4
    K_OFS: tl.constexpr = 1024.0 if USE_ASM else 0.0  # offsets of quarter_k / quarter_v
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    row = tl.load(req_rows + b).to(tl.int64)
    own = tl.load(own_start + row)  # per-request state is indexed by request row, not batch slot
    sink_own = tl.load(sink_start + row)
    sink_lo, sink_hi, ring_lo, n_int2 = source_ranges(kv_len, own, sink_own, S, W)
    hole = sink_hi - sink_lo

    n_splits = num_splits_of(n_int2, b, num_kv_splits, HAS_NSPLITS, MAX_SPLITS, MIN_CHUNK, NB16)
    if split >= n_splits:
        return
    # the split of keys of core.split_ranges (NB16 = 0: every split reads a share of both lists)
    i_lo, i_hi, s_lo, s_hi, r_lo, r_hi = split_ranges(
        split, n_splits, n_int2, sink_lo, sink_hi, ring_lo, kv_len, BLOCK_N, NB16)

    # ---- query rows (GQA heads of this KV head, padded to BLOCK_M) ---------------------------
    rows = tl.arange(0, BLOCK_M)
    hq = kvh * GQA + rows
    rmask = rows < GQA
    dq = tl.arange(0, QD)
    qb = Q + b.to(tl.int64) * stride_qt + hq[:, None] * stride_qh + dq[None, :]
    q0, q1, q2, q3 = load_q_quarters(qb, rmask, QD, PV_DT)

    m_i, l_i, a0, a1, a2, a3 = empty_softmax_state(BLOCK_M, QDV)

    # ---- BF16 sink and ring ----------------------------------------------------------------------
    m_i, l_i, a0, a1, a2, a3 = bf16_sink_ring(
        s_lo, s_hi, r_lo, r_hi, row, kvh,
        SK, stride_skr, stride_skp, stride_skh, SV, stride_svr, stride_svp, stride_svh,
        RK, stride_rkr, stride_rkp, stride_rkh, RV, stride_rvr, stride_rvp, stride_rvh,
        q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, sm_scale_log2, logit_cap,
        W, QD, QDV, BLOCK_B, LOGIT_CAP, PV_DT)

    kvh64 = kvh.to(tl.int64)  # the pool is head-major: kvh * stride can pass 2^31
    KCh = KC + kvh64 * stride_kch
    KPh = KP + kvh64 * stride_kph
    VCh = VC + kvh64 * stride_vch
    VPh = VP + kvh64 * stride_vph
    idx_base = kv_indices + kv_start
    if WORDS:  # the INT2 body on 16-bit code words (see WORD_SRC), partial output stored
        m_i, l_i = _int2_words_part(
            Q + b.to(tl.int64) * stride_qt + hq[None, :] * stride_qh, rmask,
            Out + b.to(tl.int64) * stride_ot + hq[None, :] * stride_oh + split * stride_os,
            KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
            idx_base, i_lo, i_hi, sink_lo, hole, m_i, l_i, a0, a1, a2, a3,
            sm_scale_log2, logit_cap, D, DV, BLOCK_M, BLOCK_N, LOGIT_CAP, PV_DT, USE_ASM, OFS32, INT2_STAGES)
    else:
        # ---- INT2 body: scores transposed, s^T [BLOCK_N keys, BLOCK_M rows] ----------------------
        # q^T quarters loaded transposed ([D/4, rows], the MMA's B side) and scaled once: by the
        # softmax scale (log2 domain, unless a logit cap needs raw q.k) and by 1/(code scale of
        # quarter j), a power of two; KDT = fp16 for the K codes' exponent trick
        KDT: tl.constexpr = tl.float32 if PV_DT == tl.float32 else tl.float16
        QSC = 1.0 if LOGIT_CAP else sm_scale_log2
        qbt = Q + b.to(tl.int64) * stride_qt + hq[None, :] * stride_qh + dq[:, None]
        q0t = (tl.load(qbt, mask=rmask[None, :], other=0.0).to(tl.float32) * QSC).to(KDT)
        q1t = (tl.load(qbt + QD, mask=rmask[None, :], other=0.0).to(tl.float32) * (QSC / k_scale(1))).to(KDT)
        q2t = (tl.load(qbt + 2 * QD, mask=rmask[None, :], other=0.0).to(tl.float32) * (QSC / k_scale(2))).to(KDT)
        q3t = (tl.load(qbt + 3 * QD, mask=rmask[None, :], other=0.0).to(tl.float32) * (QSC / k_scale(3))).to(KDT)
        # scores: part = sum_j q'_j.(K_OFS + s_j c_j) = q.c + K_OFS * qs_ofs, q.k_hat = sc q.c + mn sum(q)
        s0 = tl.sum(q0t.to(tl.float32), 0)
        s1 = tl.sum(q1t.to(tl.float32), 0)
        s2 = tl.sum(q2t.to(tl.float32), 0)
        s3 = tl.sum(q3t.to(tl.float32), 0)
        qs_ofs = K_OFS * (s0 + s1 + s2 + s3)
        qsum = s0 + k_scale(1) * s1 + k_scale(2) * s2 + k_scale(3) * s3
        # V accumulators transposed ([Dv/4, rows]: Dv fills the MMA's 16-row side, no padding rows)
        # and in scaled units during the INT2 loop: a'_j = s_j * a_j
        a0 = tl.trans(a0)
        a1 = tl.trans(a1 * v_scale(1))
        a2 = tl.trans(a2 * v_scale(2))
        a3 = tl.trans(a3 * v_scale(3))
        # per-row part of the V sums, added to the accumulators once after the loop (rescaled by
        # alpha like them): sum_k p*mn; the tile's p @ codes accumulates in the MMA
        b_mn = tl.zeros([BLOCK_M], dtype=tl.float32)
        dv = tl.arange(0, QDV)
        # whole tiles without masks, then the partial last tile (if any) with them
        i_full = i_lo + (i_hi - i_lo) // BLOCK_N * BLOCK_N
        for i0 in tl.range(i_lo, i_full, BLOCK_N, num_stages=INT2_STAGES):  # see INT2_STAGES
            kc, kpw, vct, vpw = _int2_fetch(_int2_slots(i0, i_hi, sink_lo, hole, idx_base, BLOCK_N, OFS32),
                                            KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn, QD, QDV)
            m_i, l_i, b_mn, a0, a1, a2, a3 = _int2_tile(
                i0, i_hi, kc, kpw, vct, vpw, q0t, q1t, q2t, q3t, qs_ofs, qsum, m_i, l_i, b_mn,
                a0, a1, a2, a3, sm_scale_log2, logit_cap, False, BLOCK_N, LOGIT_CAP, KDT, PV_DT, USE_ASM)
        if i_full < i_hi:  # the partial last tile, masked
            kc, kpw, vct, vpw = _int2_fetch(_int2_slots(i_full, i_hi, sink_lo, hole, idx_base, BLOCK_N, OFS32),
                                            KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn, QD, QDV)
            m_i, l_i, b_mn, a0, a1, a2, a3 = _int2_tile(
                i_full, i_hi, kc, kpw, vct, vpw, q0t, q1t, q2t, q3t, qs_ofs, qsum, m_i, l_i, b_mn,
                a0, a1, a2, a3, sm_scale_log2, logit_cap, True, BLOCK_N, LOGIT_CAP, KDT, PV_DT, USE_ASM)

        # (p*sc) @ (V_OFS + s_j c) less V_OFS sum(p*sc) (per tile) is s_j (p*sc) @ c, and
        # s_j p @ v_hat_j = s_j (p*sc) @ c + s_j p @ mn: add s_j * sum(p*mn) per row
        b_mn = b_mn[None, :]
        a0 = a0 + b_mn * v_scale(0)
        a1 = (a1 + b_mn * v_scale(1)) * (1.0 / v_scale(1))
        a2 = (a2 + b_mn * v_scale(2)) * (1.0 / v_scale(2))
        a3 = (a3 + b_mn * v_scale(3)) * (1.0 / v_scale(3))

        # ---- normalised partial output ------------------------------------------------------------
        has = l_i > 0
        inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
        ob = Out + b.to(tl.int64) * stride_ot + hq[None, :] * stride_oh + split * stride_os + dv[:, None]
        tl.store(ob, a0 * inv_l[None, :], mask=rmask[None, :])
        tl.store(ob + QDV, a1 * inv_l[None, :], mask=rmask[None, :])
        tl.store(ob + 2 * QDV, a2 * inv_l[None, :], mask=rmask[None, :])
        tl.store(ob + 3 * QDV, a3 * inv_l[None, :], mask=rmask[None, :])
    has = l_i > 0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse + b.to(tl.int64) * stride_lt + hq * stride_lh + split * stride_ls, lse, mask=rmask)
    if MERGE:
        merge_if_last(b, kvh, n_splits, Out, stride_ot, stride_oh, stride_os,
                       Lse, stride_lt, stride_lh, stride_ls, Final, stride_fb, stride_fh, Arrived,
                       GQA, MERGE_ROWS, DV, SPLITS_P2)


def supports(D, Dv, k_group, v_group) -> bool:
    """Shapes decode_kernel handles: one (scale, min) group per K and per V row."""
    return k_group == D and v_group == Dv and D % 64 == 0 and Dv % 64 == 0


def default_block_b(batch: int, kv_heads: int, max_kv_splits: int, device) -> int:
    """BF16 keys per tile: BLOCK_B when the grid needs more than one wave of program slots,
    BLOCK_B_ONE_WAVE when every program starts at once."""
    one_wave = batch * kv_heads * max_kv_splits <= PROGRAMS_PER_SM * sm_count(device)
    return BLOCK_B_ONE_WAVE if one_wave else BLOCK_B


def default_max_splits(batch: int, kv_heads: int, device, nb16: int = 0) -> int:
    """INT2 splits for SPLIT_PROGRAMS_PER_SM programs per SM, at least one per (request, KV head)
    and at most 128 (nb16: BF16-only splits, none here: the BF16 keys are spread)."""
    return min(128, max(1, SPLIT_PROGRAMS_PER_SM * sm_count(device) // (batch * kv_heads))) + nb16


def base_max_splits(batch: int, kv_heads: int, device: torch.device, nb16: int = 2) -> int:
    """The generic kernel's plan: BF16 splits + enough INT2 splits to give every SM a few programs."""
    sms = sm_count(device)
    want = triton.cdiv(BASE_PROGRAMS_PER_SM * sms, batch * kv_heads)
    return min(64, triton.next_power_of_2(max(1, want))) + nb16


def decode_attention(
    q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_group, v_group, sm_scale, sink_start=None,
    num_kv_splits=None, max_kv_splits=None, attn_logits=None, attn_lse=None, logit_cap=0.0,
):
    """See ops.decode_attention: decode_kernel where supports() holds, else the generic kernel."""
    args = (q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
            kv_indptr, kv_indices, req_rows, own_start)
    kw = dict(k_group=k_group, v_group=v_group, sm_scale=sm_scale, sink_start=sink_start,
              num_kv_splits=num_kv_splits, max_kv_splits=max_kv_splits, attn_logits=attn_logits,
              attn_lse=attn_lse, logit_cap=logit_cap)
    if supports(k_codes.shape[-1] * 4, v_codes.shape[-1] * 4, k_group, v_group):
        return decode_attention_fast(*args, **kw)
    return decode_attention_base(*args, **kw)


def decode_attention_base(
    q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_group, v_group, sm_scale, sink_start=None,
    num_kv_splits=None, max_kv_splits=None, attn_logits=None, attn_lse=None, logit_cap=0.0,
    block_n=None, num_warps=2, num_stages=2, min_chunk=None, bf16_keys_per_split=None, maxnreg=None,
):
    """decode_attention with the generic kernel (any group size); the extra keywords are tuning
    knobs for bench/kernels.py."""
    check_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_group, v_group)
    sink_start = own_start if sink_start is None else sink_start
    B, Hq, D = q.shape
    Hkv = k_codes.shape[1]
    gqa = Hq // Hkv
    max_kv_splits, nb16, attn_logits, attn_lse = plan_decode(
        q, o, k_codes, v_codes, sink_k, ring_k, kv_indptr, max_kv_splits, attn_logits, attn_lse,
        bf16_keys_per_split, base_max_splits)
    min_chunk = min_chunk or BASE_MIN_CHUNK
    block_m = max(16, triton.next_power_of_2(gqa))
    bn = block_n or (BASE_BLOCK_N if max(D, v_codes.shape[-1] * 4) <= 128 else BASE_BLOCK_N_D256)
    launch_attend(
        (B, Hkv, max_kv_splits), q, attn_logits, attn_lse, k_codes, k_params, v_codes, v_params,
        sink_k, sink_v, ring_k, ring_v, kv_indptr, kv_indices, kv_indptr, req_rows, own_start,
        sink_start, num_kv_splits,
        out_split_stride=attn_logits.stride(2), lse_split_stride=attn_lse.stride(2),
        k_group=k_group, v_group=v_group, sm_scale=sm_scale, logit_cap=logit_cap,
        num_mb=1, block_m=block_m, block_n=bn, block_b=BASE_BLOCK_B, split=True,
        max_splits=max_kv_splits, min_chunk=min_chunk, num_warps=num_warps, num_stages=num_stages,
        nb16=nb16, maxnreg=maxnreg,
    )
    return merge_splits(o, attn_logits, attn_lse, kv_indptr, req_rows, own_start, sink_start, num_kv_splits,
                        max_kv_splits, nb16, min_chunk, sink_k.shape[1], ring_k.shape[1])


def decode_attention_fast(
    q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_group, v_group, sm_scale, sink_start=None,
    num_kv_splits=None, max_kv_splits=None, attn_logits=None, attn_lse=None, logit_cap=0.0,
    block_n=None, num_warps=None, num_stages=2, min_chunk=None, maxnreg=None, block_m=None,
    offsets_32bit=None, int2_stages=None, block_b=None, fused_merge=None, arrived=None,
):
    """decode_attention with decode_kernel (G = head_dim).

    offsets_32bit: pool offsets in 32-bit arithmetic; default: when every pool tensor has < 2^31
    elements (the other case is tested by forcing False). int2_stages: pipeline depth of the INT2
    loop (default INT2_STAGES). block_b: BF16 sink/ring keys per tile (default default_block_b).
    fused_merge: the last program of each (request, KV head) merges the splits, or (False) the
    merge kernel does; default: fused up to FUSED_MERGE_MAX_SPLITS splits. arrived: int32 scratch
    of >= batch x KV heads zeros, left zero by every call (default: split_arrivals). The codes are
    read as 16-bit words where head_dim >= WORDS_MIN_DIM, as bytes below."""
    check_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_group, v_group)
    sink_start = own_start if sink_start is None else sink_start
    B, Hq, D = q.shape
    Hkv = k_codes.shape[1]
    Dv = v_codes.shape[-1] * 4
    gqa = Hq // Hkv
    if not supports(D, Dv, k_group, v_group):
        raise ValueError(f"decode_attention_fast needs group size == head_dim (got D={D}, G={k_group}/{v_group}); "
                         "decode_attention picks the generic kernel for other group sizes")
    words = D >= WORDS_MIN_DIM and Dv >= WORDS_MIN_DIM
    S, W = sink_k.shape[1], ring_k.shape[1]
    max_kv_splits, nb16, attn_logits, attn_lse = plan_decode(
        q, o, k_codes, v_codes, sink_k, ring_k, kv_indptr, max_kv_splits, attn_logits, attn_lse,
        None, default_max_splits, True)
    min_chunk = min_chunk or BASE_MIN_CHUNK
    bm = block_m or max(8, triton.next_power_of_2(gqa))
    bn = block_n or BLOCK_N
    kp = as_param_words(k_params)
    vp = as_param_words(v_params)
    if fused_merge is None:
        fused_merge = max_kv_splits <= FUSED_MERGE_MAX_SPLITS
    if fused_merge and arrived is None:
        arrived = split_arrivals(q.device, B * Hkv)
    decode_kernel[(B, Hkv, max_kv_splits)](
        q, q.stride(0), q.stride(1),
        attn_logits, attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse, attn_lse.stride(0), attn_lse.stride(1), attn_lse.stride(2),
        *pool_launch_args(*((k_codes.view(torch.int16), kp, v_codes.view(torch.int16), vp) if words else
                            (k_codes, kp, v_codes, vp)), sink_k, sink_v, ring_k, ring_v),
        kv_indptr, kv_indices, req_rows, own_start, sink_start,
        num_kv_splits if num_kv_splits is not None else kv_indptr,
        sm_scale * LOG2E, float(logit_cap), int(max_kv_splits),
        o, o.stride(0), o.stride(1), arrived if fused_merge else kv_indptr,
        GQA=gqa, D=D, DV=Dv, GK=k_group, GV=v_group, S=S, W=W,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_B=block_b or default_block_b(B, Hkv, max_kv_splits, q.device),
        HAS_NSPLITS=num_kv_splits is not None,
        MIN_CHUNK=min_chunk, LOGIT_CAP=logit_cap > 0, PV_DT=pv_dtype(q), NB16=nb16, USE_ASM=use_asm(q),
        OFS32=(max(t.numel() for t in (k_codes, kp, v_codes, vp)) < 2 ** 31 if offsets_32bit is None
               else offsets_32bit),
        INT2_STAGES=int2_stages or INT2_STAGES,
        MERGE=fused_merge, MERGE_ROWS=triton.next_power_of_2(gqa),
        SPLITS_P2=triton.next_power_of_2(max_kv_splits), WORDS=words,
        num_warps=num_warps or NUM_WARPS, num_stages=num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if fused_merge:
        return o
    return merge_splits(o, attn_logits, attn_lse, kv_indptr, req_rows, own_start, sink_start,
                             num_kv_splits, max_kv_splits, nb16, min_chunk, S, W)
