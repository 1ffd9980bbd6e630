"""LSE merge of two partial attentions over disjoint keys (the cached prefix and the new tokens of
an extend), in one pass.

One program = ROWS (token, query head) rows. Each row's weights come from its two LSEs; the second
LSE may be in base 2 (FlashInfer's convention), scaled to natural log in registers. A row with no
keys on one side has LSE -inf there and weight 0; with no keys on either side its output is 0.
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
    Oa, La, Ob, Lb, Out, n_rows,
    LB_SCALE: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, ROWS: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = r < n_rows
    la = tl.load(La + r, mask=rmask, other=float("-inf")).to(tl.float32)
    lb = tl.load(Lb + r, mask=rmask, other=float("-inf")).to(tl.float32) * LB_SCALE
    m = tl.maximum(la, lb)
    m = tl.where(m > float("-inf"), m, 0.0)  # no keys on either side: both weights 0
    wa = tl.exp(la - m)
    wb = tl.exp(lb - m)
    inv = 1.0 / tl.maximum(wa + wb, 1e-30)
    wa = wa * inv
    wb = wb * inv
    c = tl.arange(0, BLOCK_DV)
    cmask = c < DV
    off = r.to(tl.int64)[:, None] * DV + c[None, :]
    mask = rmask[:, None] & cmask[None, :]
    oa = tl.load(Oa + off, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(Ob + off, mask=mask, other=0.0).to(tl.float32)
    out = oa * wa[:, None] + ob * wb[:, None]
    tl.store(Out + off, out.to(Out.dtype.element_ty), mask=mask)


def merge_attention_states(o_a, lse_a, o_b, lse_b, *, lse_b_base2=False, out_dtype=None, out=None):
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
    n = lse_a.numel()
    if n:
        _merge_kernel[(triton.cdiv(n, ROWS),)](
            o_a, lse_a, o_b, lse_b, out, n,
            LB_SCALE=LN2 if lse_b_base2 else 1.0, DV=dv, BLOCK_DV=triton.next_power_of_2(dv), ROWS=ROWS,
        )
    return out
