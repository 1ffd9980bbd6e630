"""LSE merge of two partial attentions over disjoint keys (the cached prefix and the new tokens of
an extend), in one pass.

One program = ROWS (token, query head) rows. Each row's weights come from its two LSEs; either may
be in base 2 (FlashInfer's convention), scaled to natural log in registers. A row with no keys on
one side has LSE -inf there and weight 0 (whatever its output holds); with no keys on either side
its output is 0. Optionally the merged LSE (natural log), to merge further pieces.
The output is written in the caller's dtype, so the float32 prefix output never makes a second
trip through memory (the PyTorch merge it replaces took ~8 passes over [T, Hq, Dv] float32).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

ROWS = 16
LN2 = math.log(2.0)


@triton.jit
def _merge_kernel(
    Oa, La, Ob, Lb, Out, Lout, n_rows,
    LA_SCALE: tl.constexpr, LB_SCALE: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    ROWS: tl.constexpr, HAS_LOUT: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = r < n_rows
    la = tl.load(La + r, mask=rmask, other=float("-inf")).to(tl.float32) * LA_SCALE
    lb = tl.load(Lb + r, mask=rmask, other=float("-inf")).to(tl.float32) * LB_SCALE
    m = tl.maximum(la, lb)
    m = tl.where(m > float("-inf"), m, 0.0)  # no keys on either side: both weights 0
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    tot = wa + wb
    if HAS_LOUT:  # natural log; -inf where neither side has keys
        tl.store(Lout + r, tl.where(tot > 0, m + tl.log(tl.maximum(tot, 1e-30)), float("-inf")), mask=rmask)
    inv = 1.0 / tl.maximum(tot, 1e-30)
    wa = wa * inv
    wb = wb * inv
    c = tl.arange(0, BLOCK_DV)
    cmask = c < DV
    off = r.to(tl.int64)[:, None] * DV + c[None, :]
    mask = rmask[:, None] & cmask[None, :]
    oa = tl.load(Oa + off, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(Ob + off, mask=mask, other=0.0).to(tl.float32)
    # a side without keys may hold anything (FlashInfer's output for an empty key range): it is
    # selected away, not multiplied by 0 (0 * NaN)
    out = tl.where(wa[:, None] > 0, oa * wa[:, None], 0.0) + tl.where(wb[:, None] > 0, ob * wb[:, None], 0.0)
    tl.store(Out + off, out.to(Out.dtype.element_ty), mask=mask)


def merge_attention_states(o_a, lse_a, o_b, lse_b, *, lse_a_base2=False, lse_b_base2=False, out_dtype=None,
                           out=None, lse_out=None):
    """See ops.merge_attention_states."""
    if o_a.shape != o_b.shape or lse_a.shape != lse_b.shape or o_a.shape[:-1] != lse_a.shape:
        raise ValueError(
            f"merge_attention_states: shapes do not match: o_a {tuple(o_a.shape)}, o_b "
            f"{tuple(o_b.shape)}, lse_a {tuple(lse_a.shape)}, lse_b {tuple(lse_b.shape)}"
        )
    dv = o_a.shape[-1]
    o_a, o_b, lse_a, lse_b = (x.contiguous() for x in (o_a, o_b, lse_a, lse_b))
    if out is None:
        out = torch.empty(o_a.shape, dtype=out_dtype or o_a.dtype, device=o_a.device)
    elif not out.is_contiguous() or out.shape != o_a.shape:
        raise ValueError("merge_attention_states: out must be contiguous and shaped like o_a")
    if lse_out is not None and (not lse_out.is_contiguous() or lse_out.shape != lse_a.shape
                                or lse_out.dtype != torch.float32):
        raise ValueError("merge_attention_states: lse_out must be contiguous float32 shaped like lse_a")
    n = lse_a.numel()
    if n:
        _merge_kernel[(triton.cdiv(n, ROWS),)](
            o_a, lse_a, o_b, lse_b, out, lse_a if lse_out is None else lse_out, n,
            LA_SCALE=LN2 if lse_a_base2 else 1.0, LB_SCALE=LN2 if lse_b_base2 else 1.0, DV=dv,
            BLOCK_DV=triton.next_power_of_2(dv), ROWS=ROWS, HAS_LOUT=lse_out is not None,
        )
    return out
