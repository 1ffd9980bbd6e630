"""Extend-prefix attention over per-channel keys: the E_b new tokens of each request against its
cached prefix (no mask), on channel_attend.channel_kernel (extend mode). Each page's keys and
values are dequantised once per tile (fp16 operands on CUDA) and multiplied by the query block.

Two launch-shape choices serve the shapes prefill produces: a prefix split (an extend grid under
one wave of the GPU walks each prefix in chunks merged by LSE, merge_extend_splits) and short
extends (a trailing run of one-token extends gets small query tiles). Neither changes the result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .channel_attend import channel_kernel, check_channel_pool
from .core import LOG2E, as_param_words, extend_outputs, pool_launch_args, pv_dtype, sm_count

EXTEND_BLOCK_M = 128  # (token, query head) rows per program: a page's dequantised tile serves them all
EXTEND_BLOCK_B = 64  # BF16 sink / ring keys per extend tile
# Prefix splits: one program walks a (request, KV head, query block)'s whole prefix, so a few new
# tokens over a long prefix (a chat's next turn: 100 tokens over 32K are 7 query blocks x 8 KV
# heads = 56 programs, on 132 SMs) leave most SMs idle while each program walks 512 pages. The
# prefix is then split into equal chunks of body blocks, one program each, merged by LSE
# (merge_extend_splits): enough splits for EXTEND_SPLIT_PROGRAMS_PER_SM programs per SM, each with
# >= EXTEND_SPLIT_MIN_KEYS prefix keys, at most EXTEND_MAX_SPLITS. The longest prefix must be known
# on the host (max_len_prefix; the backend has it from SGLang's extend_prefix_lens_cpu): without it
# nothing is split.
EXTEND_SPLIT_PROGRAMS_PER_SM = 2  # one 8-warp program per SM fits by registers; 2 evens the tail
EXTEND_SPLIT_MIN_KEYS = 1024
EXTEND_MAX_SPLITS = 32


def extend_block_m(head_dim: int) -> int:
    """Default (token, query head) rows per extend program (head_dim 64 and 128 alike)."""
    return EXTEND_BLOCK_M


def extend_prefix_splits(programs: int, max_len_prefix, device) -> int:
    """How many chunks the extend splits each prefix into (1 = not split): see EXTEND_*SPLIT*."""
    if not max_len_prefix or programs <= 0:
        return 1
    want = triton.cdiv(EXTEND_SPLIT_PROGRAMS_PER_SM * sm_count(device), programs)
    return max(1, min(want, int(max_len_prefix) // EXTEND_SPLIT_MIN_KEYS, EXTEND_MAX_SPLITS))


@triton.jit
def _merge_extend_splits_kernel(
    Part, s_pt, s_ps, s_ph, Lse, s_lt, s_ls, s_lh, O, s_ot, s_oh, LseOut, s_mt, s_mh, SPLITS,
    DV: tl.constexpr, SP2: tl.constexpr,
):
    """Program (t, h): one softmax over the splits' partial outputs of token t, query head h."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SP2)
    sm = s < SPLITS
    lse = tl.load(Lse + t * s_lt + s * s_ls + h * s_lh, mask=sm, other=float("-inf"))
    m = tl.max(lse, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: every weight 0
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_ref))
    den = tl.sum(w, 0)
    d = tl.arange(0, DV)
    # a split without keys wrote nothing: never read it (w == 0)
    part = tl.load(Part + t * s_pt + s[:, None] * s_ps + h * s_ph + d[None, :], mask=(sm & (w > 0))[:, None],
                   other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(O + t * s_ot + h * s_oh + d, o.to(O.dtype.element_ty))
    tl.store(LseOut + t * s_mt + h * s_mh, tl.where(den > 0, m_ref + tl.log(tl.where(den > 0, den, 1.0)),
                                                     float("-inf")))


def merge_extend_splits(o_part, lse_part, o, lse):
    """o_part [T, S, Hq, Dv] / lse_part [T, S, Hq] (natural log; -inf: a split without keys) ->
    o [T, Hq, Dv], lse [T, Hq] in place, as one softmax over all the splits' keys (o = 0,
    lse = -inf where no split saw a key). One launch (it was ten elementwise torch operations a
    layer, a cost of their own where a split extend runs every layer of a speculative verify)."""
    T, S, Hq, Dv = o_part.shape
    if T == 0:
        return o, lse
    if o_part.stride(-1) != 1 or o.stride(-1) != 1:
        raise ValueError("merge_extend_splits: o_part and o need a contiguous last dimension")
    _merge_extend_splits_kernel[(T, Hq)](
        o_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part, lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        o, o.stride(0), o.stride(1), lse, lse.stride(0), lse.stride(1), S,
        DV=Dv, SP2=triton.next_power_of_2(S), num_warps=4,
    )
    return o, lse


# Short extends (--enable-mixed-chunk): SGLang folds the running decodes into a prefill batch as
# one-token extends after the prefill's requests; in one launch each of their programs would run
# the prefill's 128-row query tile for GQA (4) rows. A trailing run of requests whose rows (tokens
# x GQA) fit SHORT_EXTEND_ROWS gets a launch of its own with tiles of that many rows and
# SHORT_EXTEND_WARPS warps (short_extend_start; needs SGLang's extend_seq_lens_cpu on the host).
SHORT_EXTEND_ROWS = 16  # the smallest MMA tile's rows
SHORT_EXTEND_WARPS = 4


def short_extend_start(extend_lens, gqa: int) -> int:
    """Index of the first request of the trailing run whose extends are short (len * gqa <=
    SHORT_EXTEND_ROWS): len(extend_lens) when the last one is not short, 0 when all are."""
    k = len(extend_lens)
    while k > 0 and int(extend_lens[k - 1]) * gqa <= SHORT_EXTEND_ROWS:
        k -= 1
    return k


def extend_prefix_attention_channel(
    q, qo_indptr, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_bits, k_block, v_group, sm_scale,
    max_len_extend, sink_start=None, logit_cap=0.0, o=None, lse=None, block_m=None,
    num_warps=None, num_stages=2, max_len_prefix=None, num_splits=None,
    extend_lens=None,
):
    """See ops.extend_prefix_attention_channel; block_m / num_warps / num_stages are tuning knobs
    (block_m default: extend_block_m, or SHORT_EXTEND_ROWS where every request's rows fit it;
    rounded up to >= 16 and >= the GQA group; num_warps default: 8 at
    head_dim 128, where 4 warps spill registers at sm_90 with 64 rows, else 4, and
    SHORT_EXTEND_WARPS for short tiles). max_len_prefix: the batch's longest cached prefix
    (host int; None: unknown, no prefix split); num_splits: the prefix split count (None:
    extend_prefix_splits' choice). extend_lens: each request's new tokens (host ints, optional):
    a trailing run of short extends is launched on its own (SHORT_EXTEND_ROWS)."""
    check_channel_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_bits, k_block, v_group)
    sink_start = own_start if sink_start is None else sink_start
    T, Hq, D = q.shape
    B = qo_indptr.shape[0] - 1
    Hkv = k_codes.shape[1]
    gqa = Hq // Hkv
    o, lse = extend_outputs(q, qo_indptr, kv_indptr, v_codes, o, lse)
    if T == 0 or B == 0:
        return o, lse
    if extend_lens is not None and block_m is None:
        if len(extend_lens) != B or sum(int(x) for x in extend_lens) != T:
            raise ValueError(f"extend_lens ({len(extend_lens)} requests, {sum(int(x) for x in extend_lens)} "
                             f"tokens) does not match the batch ({B} requests, {T} tokens)")
        k = short_extend_start(extend_lens, gqa)
        if 0 < k < B:  # the long requests, then the short run: two launches, each on its own
            # tokens (rows of q / o / lse, qo_indptr rebased), so split scratch is sized by them
            kw = dict(k_bits=k_bits, k_block=k_block, v_group=v_group, sm_scale=sm_scale, sink_start=sink_start,
                      logit_cap=logit_cap, num_warps=num_warps, num_stages=num_stages,
                      max_len_prefix=max_len_prefix, num_splits=num_splits)
            pool = (k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v)
            t_k = sum(int(x) for x in extend_lens[:k])
            for (lo, hi), (t_lo, t_hi) in (((0, k), (0, t_k)), ((k, B), (t_k, T))):
                extend_prefix_attention_channel(
                    q[t_lo:t_hi], qo_indptr[lo:hi + 1] - t_lo, *pool, kv_indptr[lo:hi + 1], kv_indices,
                    req_rows[lo:hi], own_start, max_len_extend=max(int(x) for x in extend_lens[lo:hi]),
                    o=o[t_lo:t_hi], lse=lse[t_lo:t_hi], extend_lens=extend_lens[lo:hi], **kw)
            return o, lse
    short = block_m is None and int(max_len_extend) * gqa <= SHORT_EXTEND_ROWS
    if short:
        block_m, num_warps = SHORT_EXTEND_ROWS, num_warps or SHORT_EXTEND_WARPS
    bm = max(block_m or extend_block_m(D), 16, triton.next_power_of_2(gqa))
    num_mb = triton.cdiv(max(1, int(max_len_extend)) * gqa, bm)
    splits = (extend_prefix_splits(B * Hkv * num_mb, max_len_prefix, q.device) if num_splits is None
              else int(num_splits))
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # split outputs [T, S, Hq, ...] with the same stride kinds as o / lse (Triton specialises ints
    # that are 1 or multiples of 16): head strides Dv and 1, split strides Hq * Dv and Hq (unused
    # at S = 1, passed alike), token strides padded by one where S * Hq would be a multiple of 16
    # and Hq is not, so a split call compiles nothing new (a first split would otherwise compile in
    # the middle of serving)
    o_out, lse_out = o, lse
    if splits > 1:
        o_out = torch.empty(T, splits, Hq, o.shape[-1], dtype=torch.float32, device=q.device)
        row = splits * Hq + (1 if (splits * Hq) % 16 == 0 and Hq % 16 else 0)
        lse_out = torch.empty(T, row, dtype=torch.float32, device=q.device)[:, :splits * Hq].view(T, splits, Hq)
    os_, ls_ = (o_out.stride(1), lse_out.stride(1)) if splits > 1 else (Hq * o.shape[-1], Hq)
    kp = as_param_words(k_params)
    vp = as_param_words(v_params)
    channel_kernel[(B, Hkv * num_mb, splits)](
        q, q.stride(0), q.stride(1),
        o_out, o_out.stride(0), o_out.stride(-2), os_,
        lse_out, lse_out.stride(0), lse_out.stride(-1), ls_,
        *pool_launch_args(k_codes, kp, v_codes, vp, sink_k, sink_v, ring_k, ring_v),
        kv_indptr, kv_indices, qo_indptr, req_rows, own_start, sink_start,
        kv_indptr,  # num_kv_splits: unused
        sm_scale * LOG2E, float(logit_cap), splits, num_mb,
        GQA=gqa, D=D, DV=v_codes.shape[-1] * 4, BITS=k_bits, BLK=k_block, GV=v_group,
        S=sink_k.shape[1], W=ring_k.shape[1], BLOCK_M=bm, BLOCK_B=EXTEND_BLOCK_B, SPLIT=False,
        HAS_NSPLITS=False, MIN_CHUNK=1, LOGIT_CAP=logit_cap > 0, PV_DT=pv_dtype(q), NB16=0,
        num_warps=num_warps or (8 if D >= 128 else 4), num_stages=num_stages,
    )
    if splits > 1:
        merge_extend_splits(o_out, lse_out, o, lse)
    return o, lse
