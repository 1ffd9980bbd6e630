"""Stage-1 attention kernel shared by decode and extend-prefix.

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
INT2 range into equal BLOCK_N-aligned chunks (a BF16 key costs ~7x the bytes of an INT2 key). Extend (SPLIT=False): one program does all three loops.
Outputs are normalised partial attention o [rows, Dv] and its natural-log LSE; a program that
saw no key writes o = 0, lse = -inf.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# dtype of the tensor-core operands p and V codes (and of K codes when q is fp32). The Triton
# interpreter (CPU tests) multiplies bf16 tl.dot operands as raw bits, so it computes in fp32.
PV_DTYPE = tl.float32 if os.environ.get("TRITON_INTERPRET") == "1" else tl.bfloat16
# PTX code unpacking (see _codes); CUDA only. OSCAR_INT2_NO_ASM=1 falls back to plain Triton ops.
USE_ASM = os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("OSCAR_INT2_NO_ASM") != "1"
# Software-pipeline depth of the INT2 loops of all three kernels (this one's decode path,
# attend_fast, extend_fast), set per loop with tl.range; the BF16 loops keep the launch's
# num_stages. The INT2 loads form a chain: slot indices, then the codes and params they address.
# At depth 2 or 3 Triton loads the indices synchronously (2) or one tile ahead (3) but issues each
# tile's code copies after the previous tile's compute and waits for them at the top of the next
# iteration, so every tile exposes a full memory latency (0 copy groups in flight at the wait); 4
# gives the depth-3 schedule. From 5 the indices run two tiles and the codes one tile ahead of the
# compute (tests/kernels/test_schedule.py checks the groups in flight offline). H100: decode
# 7-14%, extend 6-10% faster than at 2.
INT2_STAGES = 5


def kernel_choice(var: str) -> str:
    """'fast' (the default) or 'base': which of two kernels the environment variable var selects."""
    kind = os.environ.get(var, "fast")
    if kind not in ("base", "fast"):
        raise ValueError(f"{var} must be 'fast' or 'base', got {kind!r}")
    return kind


LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def num_splits_of(n_int2, b, num_kv_splits, HAS_NSPLITS: tl.constexpr, MAX_SPLITS,
                  MIN_CHUNK: tl.constexpr, NB16: tl.constexpr):
    """Splits used by request b (NB16 BF16 splits + >= 1 INT2 splits); stages 1 and 2 agree."""
    if HAS_NSPLITS:
        n = tl.load(num_kv_splits + b)
        n = tl.minimum(tl.maximum(n, NB16 + 1), MAX_SPLITS)
    else:
        n = tl.minimum(tl.maximum(tl.cdiv(n_int2, MIN_CHUNK), 1), MAX_SPLITS - NB16) + NB16
    return n


@triton.jit
def source_ranges(kv_len, own, sink_own, S: tl.constexpr, W: tl.constexpr):
    """(sink_lo, sink_hi, ring_lo, n_int2) for a reader of kv_len keys; see module docstring.

    own: first position whose ring copy the row holds; sink_own: first whose sink copy it holds."""
    sink_lo = tl.minimum(sink_own, kv_len)
    sink_hi = tl.maximum(sink_lo, tl.minimum(kv_len, S))
    ring_lo = tl.minimum(tl.maximum(tl.maximum(own, kv_len - W), S), kv_len)
    n_int2 = ring_lo - (sink_hi - sink_lo)
    return sink_lo, sink_hi, ring_lo, n_int2


@triton.jit
def split_ranges(split, n_splits, n_int2, sink_lo, sink_hi, ring_lo, kv_len,
                 BLOCK_N: tl.constexpr, NB16: tl.constexpr):
    """Key ranges of decode split `split`: (i_lo, i_hi) of the INT2 index range and the sink /
    ring position ranges (s_lo, s_hi), (r_lo, r_hi); empty ranges for the other kind of split.

    INT2 splits NB16..n-1 get equal BLOCK_N-aligned chunks of the INT2 index range; BF16 splits
    0..NB16-1 equal chunks of the sink ++ ring key list (a BF16 key costs ~7x an INT2 key).
    NB16 = 0 ("spread"): every split gets a chunk of both lists."""
    chunk = tl.cdiv(tl.cdiv(n_int2, n_splits - NB16), BLOCK_N) * BLOCK_N
    i_lo = tl.minimum((split - NB16) * chunk, n_int2)
    i_hi = tl.minimum(i_lo + chunk, n_int2)
    n_sink = sink_hi - sink_lo
    n_bf = n_sink + kv_len - ring_lo
    if NB16 == 0:
        do_bf16 = split >= 0
        bchunk = tl.cdiv(n_bf, n_splits)
    else:
        do_bf16 = split < NB16
        i_hi = tl.where(do_bf16, 0, i_hi)
        i_lo = tl.where(do_bf16, 0, i_lo)
        bchunk = tl.cdiv(n_bf, NB16)
    b_lo = tl.where(do_bf16, tl.minimum(split * bchunk, n_bf), 0)
    b_hi = tl.where(do_bf16, tl.minimum(b_lo + bchunk, n_bf), 0)
    s_lo = sink_lo + tl.minimum(b_lo, n_sink)
    s_hi = sink_lo + tl.minimum(b_hi, n_sink)
    r_lo = ring_lo + tl.maximum(b_lo - n_sink, 0)
    r_hi = ring_lo + tl.maximum(b_hi - n_sink, 0)
    return i_lo, i_hi, s_lo, s_hi, r_lo, r_hi


@triton.jit
def load_q_quarters(qb, rmask, QD: tl.constexpr, PV_DT: tl.constexpr):
    """The 4 quarter slices [rows, D/4] of the query rows at qb (masked rows read 0)."""
    q0 = tl.load(qb, mask=rmask[:, None], other=0.0)
    q1 = tl.load(qb + QD, mask=rmask[:, None], other=0.0)
    q2 = tl.load(qb + 2 * QD, mask=rmask[:, None], other=0.0)
    q3 = tl.load(qb + 3 * QD, mask=rmask[:, None], other=0.0)
    if PV_DT == tl.float32:  # interpreter: its bf16 tl.dot is wrong, compute in fp32
        q0 = q0.to(tl.float32)
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        q3 = q3.to(tl.float32)
    return q0, q1, q2, q3


@triton.jit
def empty_softmax_state(BLOCK_M: tl.constexpr, QDV: tl.constexpr):
    """(running max, running sum, 4 output quarters) before any key."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    a0 = tl.zeros([BLOCK_M, QDV], tl.float32)
    a1 = tl.zeros([BLOCK_M, QDV], tl.float32)
    a2 = tl.zeros([BLOCK_M, QDV], tl.float32)
    a3 = tl.zeros([BLOCK_M, QDV], tl.float32)
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _unpack_params(w):
    """int32 word = (fp16 scale | fp16 min << 16) -> (scale, min) in fp32."""
    sc = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    mn = ((w >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return sc, mn


@triton.jit
def _codes(c, J: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """2-bit field J of every byte of c (uint8), as DT, plus CODE_OFS (128 with USE_ASM, else 0).

    With USE_ASM one PTX block turns 4 bytes into 4 bf16 (two words) with a shift, a mask and two
    byte permutes: bf16 bits 0x4300 | c are exactly 128 + c, so the 2-bit code drops into the
    mantissa of 128.0 with no conversion instruction. The +128 is removed algebraically by the
    caller (it only shifts the per-group min: see CODE_OFS uses).
    """
    if USE_ASM:
        if J == 0:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 t, m; and.b32 t, $2, 0x03030303; mov.b32 m, 0x43434343; "
                "prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x7362;}",
                "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)
        elif J == 1:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 t, m; shr.b32 t, $2, 2; and.b32 t, t, 0x03030303; mov.b32 m, 0x43434343; "
                "prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x7362;}",
                "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)
        elif J == 2:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 t, m; shr.b32 t, $2, 4; and.b32 t, t, 0x03030303; mov.b32 m, 0x43434343; "
                "prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x7362;}",
                "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 t, m; shr.b32 t, $2, 6; and.b32 t, t, 0x03030303; mov.b32 m, 0x43434343; "
                "prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x7362;}",
                "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)
        r = r.to(DT)
    else:
        r = ((c >> (2 * J)) & 3).to(DT)
    return r


@triton.jit
def _pick4(J: tl.constexpr, a0, a1, a2, a3):
    if J == 0:
        r = a0
    elif J == 1:
        r = a1
    elif J == 2:
        r = a2
    else:
        r = a3
    return r


@triton.jit
def _cap_and_scale(qk, sm_scale_log2, logit_cap, LOGIT_CAP: tl.constexpr):
    """Raw q.k -> scores in the log2 domain (optionally tanh-capped like SGLang)."""
    if LOGIT_CAP:
        s = qk * (sm_scale_log2 * LN2)
        # cap * tanh(s / cap), tanh via exp (tl has no tanh on every backend)
        t = tl.exp(-2.0 * tl.abs(s) / logit_cap)
        th = (1.0 - t) / (1.0 + t)
        s = logit_cap * tl.where(s >= 0, th, -th)
        return s * 1.4426950408889634
    else:
        return qk * sm_scale_log2


@triton.jit
def _online_softmax(s, m_i, l_i):
    """s: [M, N] log2-domain scores (-inf for masked keys; each tile has >= 1 valid key)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _bf16_source_loop(
    lo, hi, Kb, Vb, stride_kp, stride_vp, q0, q1, q2, q3,
    m_i, l_i, a0, a1, a2, a3, sm_scale_log2, logit_cap,
    IS_RING: tl.constexpr, W: tl.constexpr, QD: tl.constexpr, QDV: tl.constexpr,
    BLOCK: tl.constexpr, LOGIT_CAP: tl.constexpr, PV_DT: tl.constexpr,
):
    """Keys at positions [lo, hi) read in BF16 from a per-request buffer (sink or ring).

    Kb/Vb point at buffer[row, 0, kv_head, 0]; position p lives at index p (sink) or p % W (ring).
    """
    offs = tl.arange(0, BLOCK)
    dq = tl.arange(0, QD)
    dv = tl.arange(0, QDV)
    for p0 in range(lo, hi, BLOCK):
        p = p0 + offs
        kmask = p < hi
        if IS_RING:
            idx = p % W
        else:
            idx = p
        kb = Kb + idx[:, None] * stride_kp + dq[None, :]
        qk = tl.dot(q0, tl.trans(tl.load(kb, mask=kmask[:, None], other=0.0).to(q0.dtype)))
        qk += tl.dot(q1, tl.trans(tl.load(kb + QD, mask=kmask[:, None], other=0.0).to(q0.dtype)))
        qk += tl.dot(q2, tl.trans(tl.load(kb + 2 * QD, mask=kmask[:, None], other=0.0).to(q0.dtype)))
        qk += tl.dot(q3, tl.trans(tl.load(kb + 3 * QD, mask=kmask[:, None], other=0.0).to(q0.dtype)))
        s = _cap_and_scale(qk, sm_scale_log2, logit_cap, LOGIT_CAP)
        s = tl.where(kmask[None, :], s, float("-inf"))
        pr, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        pb = pr.to(PV_DT)
        vb = Vb + idx[:, None] * stride_vp + dv[None, :]
        a0 = a0 * alpha[:, None] + tl.dot(pb, tl.load(vb, mask=kmask[:, None], other=0.0).to(PV_DT))
        a1 = a1 * alpha[:, None] + tl.dot(pb, tl.load(vb + QDV, mask=kmask[:, None], other=0.0).to(PV_DT))
        a2 = a2 * alpha[:, None] + tl.dot(pb, tl.load(vb + 2 * QDV, mask=kmask[:, None], other=0.0).to(PV_DT))
        a3 = a3 * alpha[:, None] + tl.dot(pb, tl.load(vb + 3 * QDV, mask=kmask[:, None], other=0.0).to(PV_DT))
    return m_i, l_i, a0, a1, a2, a3


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
    CODE_OFS: tl.constexpr = 128.0 if USE_ASM else 0.0  # _codes returns code + CODE_OFS
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
    m_i, l_i, a0, a1, a2, a3 = _bf16_source_loop(
        s_lo, s_hi,
        SK + row * stride_skr + kvh * stride_skh, SV + row * stride_svr + kvh * stride_svh,
        stride_skp, stride_svp, q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3,
        sm_scale_log2, logit_cap, False, W, QD, QDV, BLOCK_B, LOGIT_CAP, PV_DT)
    m_i, l_i, a0, a1, a2, a3 = _bf16_source_loop(
        r_lo, r_hi,
        RK + row * stride_rkr + kvh * stride_rkh, RV + row * stride_rvr + kvh * stride_rvh,
        stride_rkp, stride_rvp, q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3,
        sm_scale_log2, logit_cap, True, W, QD, QDV, BLOCK_B, LOGIT_CAP, PV_DT)

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
                cj = _codes(kc, j, q0.dtype, USE_ASM)
                part += tl.dot(_pick4(j, q0, q1, q2, q3), tl.trans(cj))
                qs += _pick4(j, qs0, qs1, qs2, qs3)
                if (j == 3) or (((j + 1) * QD) // GK != (j * QD) // GK):
                    sc, mn = _unpack_params(tl.load(KPh + slot * stride_kpn + (j * QD) // GK))
                    # q.(c + OFS) * sc + (mn - OFS * sc) * sum(q) = q.(c * sc + mn)
                    qk += part * sc[None, :] + qs[:, None] * (mn - CODE_OFS * sc)[None, :]
                    part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    qs = tl.zeros([BLOCK_M], tl.float32)
            else:
                cj = ((kc >> (2 * j)) & 3).to(q0.dtype)
                g = (j * QD + dq) // GK
                sc, mn = _unpack_params(tl.load(KPh + slot[:, None] * stride_kpn + g[None, :]))
                kj = (cj.to(tl.float32) * sc + mn).to(q0.dtype)
                qk += tl.dot(_pick4(j, q0, q1, q2, q3), tl.trans(kj))
        s = _cap_and_scale(qk, sm_scale_log2, logit_cap, LOGIT_CAP)
        s = tl.where(kmask[None, :], s, float("-inf"))
        pr, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)

        vc = tl.load(VCh + slot[:, None] * stride_vcn + dv[None, :])
        a0 = a0 * alpha[:, None]
        a1 = a1 * alpha[:, None]
        a2 = a2 * alpha[:, None]
        a3 = a3 * alpha[:, None]
        for j in tl.static_range(4):
            if FOLD_V:
                cj = _codes(vc, j, PV_DT, USE_ASM)
                if (j * QDV) % GV == 0:  # first quarter of a group: its (p * scale, p @ min)
                    sc, mn = _unpack_params(tl.load(VPh + slot * stride_vpn + (j * QDV) // GV))
                    ps = (pr * sc[None, :]).to(PV_DT)
                    # (p*sc) @ (c + OFS) + p @ mn - OFS * sum(p*sc) = p @ (c * sc + mn)
                    pm = tl.sum(pr * mn[None, :] - CODE_OFS * ps.to(tl.float32), 1)[:, None]
                upd = tl.dot(ps, cj) + pm
            else:
                cj = ((vc >> (2 * j)) & 3).to(PV_DT)
                g = (j * QDV + dv) // GV
                sc, mn = _unpack_params(tl.load(VPh + slot[:, None] * stride_vpn + g[None, :]))
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
    use_asm=None, maxnreg=None, int2_stages=None,
):
    import torch
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}

    """Host-side launcher: checks shapes, views params as int32 words and launches."""
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
        MIN_CHUNK=min_chunk, LOGIT_CAP=logit_cap > 0, PV_DT=PV_DTYPE, NB16=nb16,
        USE_ASM=(USE_ASM if use_asm is None else use_asm) and q.dtype == torch.bfloat16,
        # decode only: the base extend-prefix kernel (D = 256's prefill) keeps depth 2, its
        # shared memory at depth 2 is already 164-180 KB (tests/kernels/test_schedule.py)
        INT2_STAGES=int2_stages or (INT2_STAGES if split else 2),
        num_warps=num_warps, num_stages=num_stages, **extra,
    )


def pool_launch_args(k_codes, k_words, v_codes, v_words, sink_k, sink_v, ring_k, ring_v):
    """The pool arguments every INT2 attention kernel takes, in its signature's order: codes and
    param words [N, H, ...] with their slot and head strides, BF16 sink / ring buffers
    [rows, positions, H, D] with their row, position and head strides."""
    out = []
    for t in (k_codes, k_words, v_codes, v_words):
        out += [t, t.stride(0), t.stride(1)]
    for t in (sink_k, sink_v, ring_k, ring_v):
        out += [t, t.stride(0), t.stride(1), t.stride(2)]
    return out


def as_param_words(params):
    """fp16 params [N, H, NG, 2] -> int32 view [N, H, NG]: one 4-byte load per (row, group)."""
    assert params.dtype.itemsize == 2 and params.shape[-1] == 2 and params.stride(-1) == 1, (
        "INT2 params must be a float16 [N, H, D // G, 2] tensor with a contiguous last dim"
    )
    return params.view(dtype=__import__("torch").int32).squeeze(-1)


def check_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_group, v_group):
    D = q.shape[-1]
    if k_codes.shape[-1] * 4 != D:
        raise ValueError(f"k_codes last dim {k_codes.shape[-1]} != head_dim/4 = {D // 4}")
    if q.shape[1] % k_codes.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {k_codes.shape[1]}")
    if k_params.shape[-2] != D // k_group or v_params.shape[-2] != v_codes.shape[-1] * 4 // v_group:
        raise ValueError("params shape does not match head_dim // group_size")
    if ring_k.shape[1] < 1:
        raise ValueError("the BF16 ring needs W >= 1 slots")
    for name, t in (("q", q), ("k_codes", k_codes), ("v_codes", v_codes), ("sink_k", sink_k), ("ring_k", ring_k)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got {t.stride()}")
