"""Extend-prefix attention: E_b new query tokens of each request against its cached prefix.

No mask (every new token sees the whole prefix). One program does the sink, ring and INT2 loops
for a block of (token, query head) rows of one KV head, so K/V tiles are shared by the GQA group
and by BLOCK_M // GQA tokens. Returns (o f32, lse f32) for an LSE merge with the new-token part.
"""
from __future__ import annotations

import torch
import triton

from .attend import check_pool, launch_attend

BLOCK_M = 64
BLOCK_N = 64
BLOCK_B = 64


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


def extend_prefix_attention(
    q, qo_indptr, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_group, v_group, sm_scale, max_len_extend,
    sink_start=None, logit_cap=0.0, o=None, lse=None, block_m=None, num_warps=4, num_stages=2,
):
    check_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_group, v_group)
    T, Hq, D = q.shape
    B = qo_indptr.shape[0] - 1
    Hkv = k_codes.shape[1]
    gqa = Hq // Hkv
    o, lse = extend_outputs(q, qo_indptr, kv_indptr, v_codes, o, lse)
    if T == 0 or B == 0:
        return o, lse
    bm = block_m or BLOCK_M
    bm = max(bm, 16, triton.next_power_of_2(gqa))
    num_mb = triton.cdiv(max(1, int(max_len_extend)) * gqa, bm)
    launch_attend(
        (B, Hkv * num_mb, 1), q, o, lse, k_codes, k_params, v_codes, v_params,
        sink_k, sink_v, ring_k, ring_v, kv_indptr, kv_indices, qo_indptr, req_rows, own_start,
        sink_start, None, out_split_stride=0, lse_split_stride=0,
        k_group=k_group, v_group=v_group, sm_scale=sm_scale, logit_cap=logit_cap,
        num_mb=num_mb, block_m=bm, block_n=BLOCK_N, block_b=BLOCK_B, split=False,
        max_splits=1, min_chunk=1, num_warps=num_warps, num_stages=num_stages,
    )
    return o, lse
