"""Common core of the attention kernels of both formats (per-token recipe and per-channel keys).

* Source rule and split plan: which key positions come from the BF16 sink, the BF16 ring and the
  quantised body (source_ranges, rule of reference.source_masks), how a decode request's keys are
  cut into splits (num_splits_of, split_ranges, plan_decode) and how the splits are merged (the
  merge kernel, merge_splits, or the fused merge_if_last of the last program of a head).
* Online softmax (cap_and_scale, online_softmax) and the BF16 sink + ring loop (bf16_sink_ring).
* Launch helpers: pool_launch_args, as_param_words, check_pool, and the compiled-vs-interpreter
  choice, made from the tensors' device (compiled on CUDA, the Triton interpreter on CPU).

Code-unpacking helpers (MMA operands made from packed codes) are in core_codes.py.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
# Software-pipeline depth of the quantised-body loops, set per loop with tl.range (the BF16 loops
# keep the launch's num_stages). The body's loads form a chain: slot indices, then the codes and
# params they address. At depth 2 or 3 every tile waits a full memory latency for its codes; from
# 5 the indices run two tiles and the codes one tile ahead of the compute
# (tests/kernels/test_schedule.py checks the copy groups in flight offline).
INT2_STAGES = 5


def compiled(t: torch.Tensor) -> bool:
    """True where the kernels are compiled for a GPU (CUDA tensors); False on CPU tensors, which
    run under the Triton interpreter (TRITON_INTERPRET=1)."""
    return t.is_cuda


def pv_dtype(t: torch.Tensor):
    """dtype of the tensor-core operands p and value codes (and of key codes when q is fp32):
    bf16 when compiled; fp32 in the interpreter, which multiplies bf16 tl.dot operands as raw
    bits."""
    return tl.bfloat16 if compiled(t) else tl.float32


def use_asm(q: torch.Tensor) -> bool:
    """PTX code unpacking (inline asm): whenever compiled with bf16 queries."""
    return compiled(q) and q.dtype == torch.bfloat16


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
    """(sink_lo, sink_hi, ring_lo, n_int2) for a reader of kv_len keys, by the rule of
    reference.source_masks (token_attend.py's docstring draws the ranges).

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
def cap_and_scale(qk, sm_scale_log2, logit_cap, LOGIT_CAP: tl.constexpr):
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
def online_softmax(s, m_i, l_i):
    """s: [M, N] log2-domain scores (-inf for masked keys; each tile has >= 1 valid key)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def bf16_source_loop(
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
        s = cap_and_scale(qk, sm_scale_log2, logit_cap, LOGIT_CAP)
        s = tl.where(kmask[None, :], s, float("-inf"))
        pr, alpha, m_i, l_i = online_softmax(s, m_i, l_i)
        pb = pr.to(PV_DT)
        vb = Vb + idx[:, None] * stride_vp + dv[None, :]
        a0 = a0 * alpha[:, None] + tl.dot(pb, tl.load(vb, mask=kmask[:, None], other=0.0).to(PV_DT))
        a1 = a1 * alpha[:, None] + tl.dot(pb, tl.load(vb + QDV, mask=kmask[:, None], other=0.0).to(PV_DT))
        a2 = a2 * alpha[:, None] + tl.dot(pb, tl.load(vb + 2 * QDV, mask=kmask[:, None], other=0.0).to(PV_DT))
        a3 = a3 * alpha[:, None] + tl.dot(pb, tl.load(vb + 3 * QDV, mask=kmask[:, None], other=0.0).to(PV_DT))
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def bf16_sink_ring(
    s_lo, s_hi, r_lo, r_hi, row, kvh,
    SK, stride_skr, stride_skp, stride_skh, SV, stride_svr, stride_svp, stride_svh,
    RK, stride_rkr, stride_rkp, stride_rkh, RV, stride_rvr, stride_rvp, stride_rvh,
    q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, sm_scale_log2, logit_cap,
    W: tl.constexpr, QD: tl.constexpr, QDV: tl.constexpr, BLOCK_B: tl.constexpr,
    LOGIT_CAP: tl.constexpr, PV_DT: tl.constexpr,
):
    """Sink positions [s_lo, s_hi) then ring positions [r_lo, r_hi) of request row `row`, KV head
    kvh, continuing the softmax state (m_i, l_i, output quarters a0..a3)."""
    m_i, l_i, a0, a1, a2, a3 = bf16_source_loop(
        s_lo, s_hi,
        SK + row * stride_skr + kvh * stride_skh, SV + row * stride_svr + kvh * stride_svh,
        stride_skp, stride_svp, q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3,
        sm_scale_log2, logit_cap, False, W, QD, QDV, BLOCK_B, LOGIT_CAP, PV_DT)
    m_i, l_i, a0, a1, a2, a3 = bf16_source_loop(
        r_lo, r_hi,
        RK + row * stride_rkr + kvh * stride_rkh, RV + row * stride_rvr + kvh * stride_rvh,
        stride_rkp, stride_rvp, q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3,
        sm_scale_log2, logit_cap, True, W, QD, QDV, BLOCK_B, LOGIT_CAP, PV_DT)
    return m_i, l_i, a0, a1, a2, a3


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


@triton.jit
def merge_splits_kernel(
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
    """Splits a merge program reads per step: all max_kv_splits at once in a small grid (a loop of
    dependent steps costs latency there), MERGE_CHUNK at a time in a large one (only the splits
    each request used are read; docs/design.md "Kernel design choices")."""
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
    merge_splits_kernel[(B, Hq)](
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






def extend_outputs(q, qo_indptr, kv_indptr, v_codes, o=None, lse=None):
    """Checks the request indptrs and returns the float32 (o [T, Hq, Dv], lse [T, Hq]) of an
    extend-prefix call (allocated unless given), for both extend kernels."""
    T, Hq, _ = q.shape
    B = qo_indptr.shape[0] - 1
    if kv_indptr.shape[0] < B + 1:
        raise ValueError(f"kv_indptr has {kv_indptr.shape[0]} entries, need len(qo_indptr) = {B + 1}")
    if o is None:
        o = torch.empty(T, Hq, v_codes.shape[-1] * 4, dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device)
    return o, lse


# One warp merges n partials in n / 4 dependent L2 round trips: cheaper than the merge kernel's
# launch and wait at few splits, dearer at many (docs/design.md "Kernel design choices").
FUSED_MERGE_MAX_SPLITS = 16
_ARRIVALS: dict = {}
ARRIVALS_MIN = 1 << 16  # counters allocated at once per device: batch x KV heads up to 65536


def split_arrivals(device, n: int):
    """The fused merge's per-(request, KV head) arrival counters on `device`: int32 zeros, kept
    zero by the kernel (the merging program resets its counter), allocated once per device (not
    while a CUDA graph is being captured: run one call before capture, as SGLang's warm-up does)."""
    key = str(torch.device(device))
    t = _ARRIVALS.get(key)
    if t is None or t.numel() < n:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("INT2 decode: the split arrival counters must exist before CUDA graph capture "
                               "(run one decode call first, or pass arrived=)")
        t = _ARRIVALS[key] = torch.zeros(max(n, ARRIVALS_MIN), dtype=torch.int32, device=device)
    return t


@triton.jit
def merge_if_last(b, kvh, n_splits, Part, stride_pt, stride_ph, stride_ps,
                   Lse, stride_lt, stride_lh, stride_ls, Final, stride_fb, stride_fh, Arrived,
                   GQA: tl.constexpr, ROWS: tl.constexpr, DV: tl.constexpr, SPLITS_P2: tl.constexpr):
    """The last of the n_splits programs of (request b, KV head kvh) to finish LSE-merges their
    partial outputs into Final (merge_splits' formula) and resets the arrival counter:
    no merge kernel to launch and wait for.

    Arrived[b * Hkv + kvh] counts finished programs. The barrier makes every lane's partial
    stores precede the counter's release; the acquire of the program that sees n_splits - 1
    orders its reads of the other programs' partials (read through L2, .cg) after their stores."""
    CH: tl.constexpr = 4  # splits per load: [ROWS, CH, DV] (64 fp32 per lane at GQA 4, DV 128)
    tl.debug_barrier()
    cnt = tl.atomic_add(Arrived + b * tl.num_programs(1) + kvh, 1, sem="acq_rel", scope="gpu")
    if cnt == n_splits - 1:
        tl.store(Arrived + b * tl.num_programs(1) + kvh, 0)  # every program of this call has counted
        bt = b.to(tl.int64)
        r = tl.arange(0, ROWS)
        hq = kvh * GQA + r
        rmask = r < GQA
        s = tl.arange(0, SPLITS_P2)
        lb = Lse + bt * stride_lt + hq * stride_lh
        lse = tl.load(lb[:, None] + s[None, :] * stride_ls, mask=rmask[:, None] & (s < n_splits)[None, :],
                      other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, 1)
        m = tl.where(m == float("-inf"), 0.0, m)
        wsum = tl.sum(tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m[:, None])), 1)
        c = tl.arange(0, CH)
        d = tl.arange(0, DV)
        pb = Part + bt * stride_pt + hq[:, None, None] * stride_ph + d[None, None, :]
        acc = tl.zeros([ROWS, DV], tl.float32)
        for s0 in range(0, n_splits, CH):
            sp = s0 + c
            cm = rmask[:, None] & (sp < n_splits)[None, :]
            # the chunk's LSEs again (from L2): a column block of `lse` cannot be sliced out in Triton
            lc = tl.load(lb[:, None] + sp[None, :] * stride_ls, mask=cm, other=float("-inf"), cache_modifier=".cg")
            wc = tl.where(lc == float("-inf"), 0.0, tl.exp(lc - m[:, None]))  # splits without keys: 0
            part = tl.load(pb + sp[None, :, None] * stride_ps, mask=cm[:, :, None], other=0.0, cache_modifier=".cg")
            acc += tl.sum(wc[:, :, None] * part, 1)
        o = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
        tl.store(Final + bt * stride_fb + hq[:, None] * stride_fh + d[None, :], o.to(Final.dtype.element_ty),
                 mask=rmask[:, None])
