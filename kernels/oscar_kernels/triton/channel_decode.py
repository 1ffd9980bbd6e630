"""Decode attention over per-channel keys (KVFormat k_layout="channel"): split-K stage 1 on
channel_attend.channel_kernel (decode mode) and the LSE merge (fused into the last program of a
head at few splits: core.merge_if_last, else core.merge_splits).

Decode paths by key width and head dim (all served; each read the same pool):
* 3-bit keys at head_dim >= PLANES_MIN_DIM (128): PLANES, a 2-bit and a 1-bit plane merged into
  one subnormal fp16 operand an eighth, one warp.
* 3-bit keys below (head_dim 64): the packed quarter body (each code assembled in a 32-bit
  register), two warps (one spills).
* 2-bit keys: the quarter body, or at head_dim >= 128 code words (KWORDS).
* 4-bit keys: the quarter body with subnormal nibble operands (NIBBLES).
Value codes are read as 16-bit code words at a value dim >= 128 (VWORDS), as bytes below.
"""
from __future__ import annotations

import torch
import triton

from .channel_attend import channel_kernel, check_channel_pool
from .core import (FUSED_MERGE_MAX_SPLITS, INT2_STAGES, LOG2E, as_param_words, bf16_splits, merge_splits,
                   plan_decode, pool_launch_args, pv_dtype, sm_count, split_arrivals, use_asm)
from .core_codes import WORDS_MIN_DIM

BLOCK_B = 32  # BF16 keys per tile
# Decode warps per key width: the transposed body's [64 keys, 8 rows] tiles are one warp's MMAs;
# 3-bit keys below PLANES_MIN_DIM build their codes in 32-bit registers and spill at one warp, so
# they take two; the planes take PLANES_NUM_WARPS = 1.
DECODE_NUM_WARPS = {2: 1, 3: 2, 4: 1}
PLANES_NUM_WARPS = 1
# the planes walk eighths of the row: an eighth (D/8 dims) must be the MMA's K of 16
PLANES_MIN_DIM = 128

# Split plan. A one-warp program takes 245-255 registers at sm_90, so 8 fit on an SM; fewer
# resident programs leave the SM's schedulers waiting on each program's dependent instructions,
# more than one wave of them adds a tail. The plan: body splits for DECODE_SPLIT_PROGRAMS_PER_SM
# programs per SM over the batch's (request, KV head) pairs (rounded down: no second, nearly empty
# wave), at least 1, and at most DECODE_MAX_SPLITS splits in all; in kernel each request then uses
# as many as its body has DECODE_MIN_CHUNK-key chunks (one page). SGLang's split scratch holds 64
# in the server, so the backend gives larger plans (batch 1 and 2) a scratch of its own.
DECODE_SPLIT_PROGRAMS_PER_SM = 8
DECODE_MAX_SPLITS = 128
DECODE_MIN_CHUNK = 64


def default_decode_splits(batch: int, kv_heads: int, device, nb16: int) -> int:
    """max_kv_splits of the per-channel decode (nb16 BF16 splits + body splits) when none is
    given: see DECODE_SPLIT_PROGRAMS_PER_SM."""
    body = DECODE_SPLIT_PROGRAMS_PER_SM * sm_count(device) // (batch * kv_heads)
    return max(1, min(DECODE_MAX_SPLITS - nb16, body)) + nb16


def decode_splits(batch: int, kv_heads: int, sink: int, window: int, device) -> int:
    """The split count decode_attention_channel picks for this batch when max_kv_splits and the
    scratch are not given (its BF16 splits for a sink + ring of sink + window keys included):
    what a caller sizing attn_logits / attn_lse needs."""
    return default_decode_splits(batch, kv_heads, device, bf16_splits(sink, window, 1 << 30))


def decode_attention_channel(
    q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_bits, k_block, v_group, sm_scale,
    sink_start=None, num_kv_splits=None, max_kv_splits=None, attn_logits=None, attn_lse=None,
    logit_cap=0.0, min_chunk=None, bf16_keys_per_split=None, num_warps=None, num_stages=2,
    num_int2_stages=None, maxnreg=None, merge_chunk=None, merge_warps=None, fused_merge=None, arrived=None,
):
    """See ops.decode_attention_channel; min_chunk / bf16_keys_per_split / num_warps /
    num_stages / num_int2_stages / maxnreg / merge_chunk / merge_warps are tuning knobs (maxnreg
    caps registers per thread; merge_*: the split merge's splits a step and warps). fused_merge:
    the last program of each (request, KV head) merges the splits (default: up to
    FUSED_MERGE_MAX_SPLITS splits), or (False) the merge kernel does; arrived: its int32
    counters, >= batch x KV heads zeros, left zero (default: core.split_arrivals)."""
    check_channel_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_bits, k_block, v_group)
    planes = k_bits == 3 and q.shape[-1] >= PLANES_MIN_DIM
    vwords = v_codes.shape[-1] * 4 >= WORDS_MIN_DIM
    kwords = k_bits == 2 and q.shape[-1] >= WORDS_MIN_DIM
    nibbles = k_bits == 4
    sink_start = own_start if sink_start is None else sink_start
    B, Hq, D = q.shape
    Hkv = k_codes.shape[1]
    gqa = Hq // Hkv
    max_kv_splits, nb16, attn_logits, attn_lse = plan_decode(
        q, o, k_codes, v_codes, sink_k, ring_k, kv_indptr, max_kv_splits, attn_logits, attn_lse,
        bf16_keys_per_split, default_decode_splits)
    min_chunk = min_chunk or DECODE_MIN_CHUNK
    kp = as_param_words(k_params)
    vp = as_param_words(v_params)
    if fused_merge is None:
        fused_merge = max_kv_splits <= FUSED_MERGE_MAX_SPLITS
    if fused_merge and arrived is None:
        arrived = split_arrivals(q.device, B * Hkv)
    # one SPLITS_P2 for every fused split count: a batch size's own would compile a variant each
    merge = dict(MERGE=True, MERGE_ROWS=triton.next_power_of_2(gqa),
                 SPLITS_P2=triton.next_power_of_2(max(max_kv_splits, FUSED_MERGE_MAX_SPLITS)),
                 Final=o, stride_fb=o.stride(0), stride_fh=o.stride(1), Arrived=arrived) if fused_merge else {}
    channel_kernel[(B, Hkv, max_kv_splits)](
        q, q.stride(0), q.stride(1),
        attn_logits, attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse, attn_lse.stride(0), attn_lse.stride(1), attn_lse.stride(2),
        # words: int16 views of the codes (their strides in words)
        *pool_launch_args(k_codes.view(torch.int16) if kwords else k_codes, kp,
                          v_codes.view(torch.int16) if vwords else v_codes, vp, sink_k, sink_v, ring_k, ring_v),
        kv_indptr, kv_indices, kv_indptr, req_rows, own_start, sink_start,  # qo_indptr: unused
        num_kv_splits if num_kv_splits is not None else kv_indptr,
        sm_scale * LOG2E, float(logit_cap), int(max_kv_splits), 1,
        GQA=gqa, D=D, DV=v_codes.shape[-1] * 4, BITS=k_bits, BLK=k_block, GV=v_group,
        S=sink_k.shape[1], W=ring_k.shape[1], BLOCK_M=max(8, triton.next_power_of_2(gqa)),
        BLOCK_B=BLOCK_B, SPLIT=True, HAS_NSPLITS=num_kv_splits is not None, MIN_CHUNK=min_chunk,
        LOGIT_CAP=logit_cap > 0, PV_DT=pv_dtype(q), NB16=nb16,
        USE_ASM=use_asm(q), STAGES=num_int2_stages or INT2_STAGES, PLANES=planes,
        VWORDS=vwords, KWORDS=kwords, NIBBLES=nibbles, **merge,
        num_warps=num_warps or (PLANES_NUM_WARPS if planes else DECODE_NUM_WARPS[k_bits]), num_stages=num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if fused_merge:
        return o
    return merge_splits(o, attn_logits, attn_lse, kv_indptr, req_rows, own_start, sink_start,
                        num_kv_splits, max_kv_splits, nb16, min_chunk, sink_k.shape[1], ring_k.shape[1],
                        chunk=merge_chunk, num_warps=merge_warps)
