"""kv_indices of a batch (SGLang's Triton-backend layout), filled by many programs per request.

kv_indices[kv_indptr[b] + p] = req_to_token[req_pool_indices[b], p] for p < seq_lens[b]: the same
table SGLang's create_flashinfer_kv_indices_triton fills, but that kernel runs one program per
request, which walks the request's slots 512 at a time: slow for one long request, and paid
outside the CUDA graph every decode step (docs/design.md "Kernel design choices"). Here each request's positions are cut into equal pieces, one program
each (kv_indices_pieces: more pieces the smaller the batch), so a batch of one long request is
filled by up to MAX_PIECES programs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .core import sm_count

BLOCK = 1024  # positions a program copies per step
TARGET_PROGRAMS_PER_SM = 4  # programs per SM over the batch (a batch of 1 gets the most pieces)
MAX_PIECES = 256  # pieces per request at most (1 x 128K: 512 positions a piece)


@triton.jit
def _fill_kv_indices_kernel(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
                            stride_row, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    piece = tl.program_id(1)
    pieces = tl.num_programs(1)
    n = tl.load(seq_lens + b).to(tl.int64)
    row = tl.load(req_pool_indices + b).to(tl.int64)
    out = tl.load(kv_indptr + b).to(tl.int64)
    per = tl.cdiv(n, pieces)
    lo = piece * per
    hi = tl.minimum(lo + per, n)
    src = req_to_token + row * stride_row
    for start in range(lo, hi, BLOCK):
        p = start + tl.arange(0, BLOCK)
        m = p < hi
        tl.store(kv_indices + out + p, tl.load(src + p, mask=m), mask=m)


def kv_indices_pieces(batch: int, sms: int) -> int:
    """Pieces per request: TARGET_PROGRAMS_PER_SM programs per SM over the batch, 1 to MAX_PIECES."""
    return max(1, min(MAX_PIECES, triton.cdiv(TARGET_PROGRAMS_PER_SM * sms, max(1, batch))))


def fill_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices):
    """Fills kv_indices (see the module docstring) for the first len(seq_lens) requests; kv_indptr
    must already hold the prefix sums of seq_lens. No host synchronisation (the grid depends only
    on the batch size), so it can run where SGLang fills its CUDA-graph buffers."""
    B = seq_lens.shape[0]
    if B == 0:
        return kv_indices
    if req_pool_indices.shape[0] < B or kv_indptr.shape[0] < B + 1:
        raise ValueError(f"fill_kv_indices: {B} requests need {B} req_pool_indices and {B + 1} kv_indptr "
                         f"entries (got {req_pool_indices.shape[0]} and {kv_indptr.shape[0]})")
    if req_to_token.stride(1) != 1:
        raise ValueError("fill_kv_indices: req_to_token rows must be contiguous")
    _fill_kv_indices_kernel[(B, kv_indices_pieces(B, sm_count(seq_lens.device)))](
        req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, req_to_token.stride(0),
        BLOCK=BLOCK)
    return kv_indices
