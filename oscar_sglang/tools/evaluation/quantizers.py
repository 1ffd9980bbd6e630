"""Fake quantisers for the accuracy emulation (float32 in, float32 "what a slot reads back" out).

* ``token_groups``: the served INT2 format (oscar_kernels.reference.fake_quant): per (token, head)
  row, groups of G consecutive dims, asymmetric min-max, fp16 (scale, min), per-group clip.
  The same arithmetic with 16 levels gives the INT4 reference (emulation only, not served).
* ``channel_groups``: KIVI-style per-channel K (emulation only): per (head, channel), groups of G
  consecutive *tokens*, same min-max arithmetic. Optionally with OScaR token scaling: each token's
  K is divided by its L2 norm over all KV heads before grouping and multiplied back afterwards
  (exact in attention: the logit of key j is scaled by n_j).
"""
from __future__ import annotations

import torch
from oscar_kernels.format import FP16_MAX, MIN_SCALE, Int2Format, normalize_clip_ratio
from oscar_kernels.reference import clip_groups, fake_quant


def minmax_fake_quant(xg: torch.Tensor, levels: int, clip_ratio: float = 1.0) -> torch.Tensor:
    """Asymmetric min-max fake quantisation over the last dim (one group per row), fp16 params.

    Same arithmetic as oscar_kernels.reference.quantize (levels=4 is bit-identical to it).
    """
    xg = clip_groups(xg.float(), normalize_clip_ratio(clip_ratio))
    top = levels - 1
    mn = xg.amin(-1, keepdim=True).clamp(-FP16_MAX, FP16_MAX).half().float()
    sc = ((xg.amax(-1, keepdim=True) - mn) / top).clamp(MIN_SCALE, FP16_MAX).half().float()
    q = torch.floor((xg - mn) * (1.0 / sc) + 0.5).clamp(0, top)
    return q * sc + mn


def token_groups(x: torch.Tensor, group_size: int, levels: int = 4, clip_ratio: float = 1.0):
    """x [..., D] -> fake-quantised rows, groups of ``group_size`` dims (the served layout)."""
    D = x.shape[-1]
    if levels == 4:  # the served INT2 format: use the kernels' own reference
        return fake_quant(x, Int2Format(D, group_size), clip_ratio)
    if D % group_size:
        raise ValueError(f"group size {group_size} does not divide head_dim {D}")
    xg = x.float().reshape(*x.shape[:-1], D // group_size, group_size)
    return minmax_fake_quant(xg, levels, clip_ratio).reshape(x.shape)


def channel_groups(
    x: torch.Tensor, group_size: int, start: int = 0, levels: int = 4, token_scale: bool = False
) -> torch.Tensor:
    """KIVI-style per-channel quantisation of K.

    x: [B, H, T, D] (one layer, all KV heads). Tokens ``start + i*G .. start + (i+1)*G - 1`` form
    one group per (head, channel); tokens before ``start`` (the BF16 sink) and a trailing partial
    group are returned unchanged (a real cache keeps them in BF16 until a group completes).
    token_scale: divide each token by its L2 norm over all heads and channels first (OScaR).
    """
    B, H, T, D = x.shape
    x = x if x.dtype == torch.float64 else x.float()  # float64 stays (tests check invariances)
    out = x.clone()
    n_full = max(0, (T - start) // group_size)
    if n_full == 0:
        return out
    end = start + n_full * group_size
    body = x[:, :, start:end]
    if token_scale:
        norm = body.pow(2).sum(dim=(1, 3), keepdim=True).sqrt()  # [B, 1, T', 1]
        norm = torch.where(norm > 0, norm, torch.ones_like(norm))
        body = body / norm
    g = body.reshape(B, H, n_full, group_size, D).transpose(-1, -2)  # groups along tokens
    q = minmax_fake_quant(g, levels).transpose(-1, -2).reshape(B, H, n_full * group_size, D)
    if token_scale:
        q = q * norm
    out[:, :, start:end] = q
    return out
