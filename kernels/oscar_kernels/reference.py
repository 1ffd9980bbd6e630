"""PyTorch reference implementations: the oracle for every kernel test.

Pure torch, CPU or GPU, no performance intent. Everything a Triton kernel does must equal one of
these functions (bit-exact for codes/params where the arithmetic is the same, within a stated
bound for attention).
"""
from __future__ import annotations

import math

import torch

from .format import FP16_MAX, MIN_SCALE, Int2Format, clip_index, normalize_clip_ratio

# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes in 0..3, shape [..., D] -> packed [..., D//4] in the quarter-split layout."""
    D = q.shape[-1]
    qq = q.to(torch.uint8).reshape(*q.shape[:-1], 4, D // 4)
    return qq[..., 0, :] | (qq[..., 1, :] << 2) | (qq[..., 2, :] << 4) | (qq[..., 3, :] << 6)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed [..., D//4] -> codes [..., D] (uint8 in 0..3)."""
    parts = [(packed >> (2 * k)) & 3 for k in range(4)]
    return torch.cat(parts, dim=-1)


# --------------------------------------------------------------------------------------------
# Quantise / dequantise
# --------------------------------------------------------------------------------------------


def clip_groups(xg: torch.Tensor, clip_ratio: float) -> torch.Tensor:
    """Clamp each group (last dim) to +-(the clip_index-th smallest |x|)."""
    G = xg.shape[-1]
    if clip_ratio >= 1.0:
        return xg
    idx = clip_index(clip_ratio, G)
    thr = xg.abs().kthvalue(idx + 1, dim=-1, keepdim=True).values
    return torch.maximum(torch.minimum(xg, thr), -thr)


def quantize(x: torch.Tensor, fmt: Int2Format, clip_ratio: float | None = 1.0):
    """Quantise rows x[..., D] -> (codes uint8[..., D//4], params fp16[..., D//G, 2]).

    Arithmetic (fp32), per group:
      x   <- clamp(x, -thr, thr) if clipping        (thr: see format.clip_index)
      mn  = fp16(min x);  sc = fp16(max((max x - mn) / 3, MIN_SCALE))
      q   = clamp(floor((x - mn) * (1/sc) + 0.5), 0, 3)
    The stored (rounded) mn and sc are the ones used to compute the codes, so the decoder's
    reconstruction q*sc+mn is the quantiser's own grid.
    """
    clip_ratio = normalize_clip_ratio(clip_ratio)
    D, G = fmt.head_dim, fmt.group_size
    assert x.shape[-1] == D, (x.shape, D)
    lead = x.shape[:-1]
    xg = x.float().reshape(*lead, fmt.n_groups, G)
    xg = clip_groups(xg, clip_ratio)
    mn = xg.amin(-1).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    mx = xg.amax(-1)
    sc = ((mx - mn.float()) / 3.0).clamp(MIN_SCALE, FP16_MAX).to(torch.float16)
    inv = 1.0 / sc.float()
    q = torch.floor((xg - mn.float().unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5).clamp(0, 3)
    codes = pack_codes(q.to(torch.uint8).reshape(*lead, D))
    params = torch.stack([sc, mn], dim=-1)
    return codes, params


def dequantize(codes: torch.Tensor, params: torch.Tensor, fmt: Int2Format) -> torch.Tensor:
    """(codes, params) -> float32 rows [..., D]."""
    D, G = fmt.head_dim, fmt.group_size
    lead = codes.shape[:-1]
    q = unpack_codes(codes).float().reshape(*lead, fmt.n_groups, G)
    sc = params[..., 0].float().unsqueeze(-1)
    mn = params[..., 1].float().unsqueeze(-1)
    return (q * sc + mn).reshape(*lead, D)


def fake_quant(x: torch.Tensor, fmt: Int2Format, clip_ratio: float | None = 1.0) -> torch.Tensor:
    """quantize + dequantize, float32 result (the value an INT2 slot reads back as)."""
    return dequantize(*quantize(x, fmt, clip_ratio), fmt)


# --------------------------------------------------------------------------------------------
# Mixed-source keys/values of one request and attention
# --------------------------------------------------------------------------------------------


def source_masks(kv_len: int, sink: int, window: int, own_start: int = 0, device=None,
                 sink_start: int | None = None):
    """Which source each key position 0..kv_len-1 is read from, for a reader that sees kv_len keys.

    Returns boolean masks (is_sink, is_ring, is_int2) over positions, by the rule
      sink : p < sink and p >= sink_start
      ring : p >= max(own_start, kv_len - window)   (and not sink)
      int2 : everything else
    ``own_start`` is the first position whose ring copy the request's row holds (the first
    position it computed itself, or earlier when a radix hit's ring copies were carried over);
    ``sink_start`` (default: own_start) the first whose sink copy it holds. Positions before them
    came from the radix cache and exist only as INT2.
    """
    sink_start = own_start if sink_start is None else sink_start
    p = torch.arange(kv_len, device=device)
    is_sink = (p < sink) & (p >= sink_start)
    is_ring = (p >= max(own_start, kv_len - window)) & ~is_sink
    is_int2 = ~(is_sink | is_ring)
    return is_sink, is_ring, is_int2


def mixed_kv(
    x: torch.Tensor,
    fmt: Int2Format,
    kv_len: int | None = None,
    sink: int = 64,
    window: int = 256,
    own_start: int = 0,
    clip_ratio: float | None = 1.0,
    hp_dtype: torch.dtype = torch.bfloat16,
    sink_start: int | None = None,
) -> torch.Tensor:
    """Effective float32 K or V [L, H, D] that a reader of kv_len keys sees.

    x: rotated K or V of one request, [L, H, D], positions 0..L-1. BF16 side-buffer positions read
    ``x.to(hp_dtype)``; INT2 positions read ``fake_quant(x)``.
    """
    kv_len = x.shape[0] if kv_len is None else kv_len
    x = x[:kv_len]
    is_sink, is_ring, _ = source_masks(kv_len, sink, window, own_start, device=x.device,
                                       sink_start=sink_start)
    hp = (is_sink | is_ring).view(-1, 1, 1)
    return torch.where(hp, x.to(hp_dtype).float(), fake_quant(x, fmt, clip_ratio))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float | None = None,
    causal_offset: int | None = None,
):
    """Plain softmax attention in float64 with GQA.

    q [Tq, Hq, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv]; query head j reads KV head j // (Hq // Hkv).
    causal_offset: if given, query i sees keys 0..causal_offset+i (extend with new tokens).
    Returns (o [Tq, Hq, Dv] float64, lse [Tq, Hq] float64, natural log of sum exp(scaled scores)).
    """
    Tq, Hq, D = q.shape
    Lk, Hkv, _ = k.shape
    g = Hq // Hkv
    assert g * Hkv == Hq
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("thd,lhd->htl", q.double(), kk) * sm_scale
    if causal_offset is not None:
        qi = torch.arange(Tq, device=q.device).view(-1, 1)
        kj = torch.arange(Lk, device=q.device).view(1, -1)
        s = s.masked_fill((kj > qi + causal_offset).unsqueeze(0), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Tq]
    p = torch.exp(s - lse.unsqueeze(-1))
    o = torch.einsum("htl,lhd->thd", p, vv)
    return o, lse.transpose(0, 1)


def merge_attention_states(o_a, lse_a, o_b, lse_b):
    """Merge two partial attentions over disjoint key sets (o: [..., Dv], lse: [...])."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).unsqueeze(-1)
    wb = torch.exp(lse_b - lse).unsqueeze(-1)
    return o_a * wa + o_b * wb, lse


# --------------------------------------------------------------------------------------------
# Pool readers: what a kernel sees for one request of a paged pool (oracle of the kernel tests)
# --------------------------------------------------------------------------------------------


def pool_request_kv(
    codes: torch.Tensor,
    params: torch.Tensor,
    sink: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
    row: int,
    own_start: int,
    fmt: Int2Format,
    sink_start: int | None = None,
) -> torch.Tensor:
    """Effective float32 K (or V) [len, H, D] of one request read from pool tensors.

    codes [N, H, D//4], params [N, H, D//G, 2], sink [R, S, H, D], ring [R, W, H, D] (BF16);
    slots [len]: the request's kv_indices in position order; row: its side-buffer row. Position p
    is read from sink[row, p], ring[row, p % W] or dequantize(codes/params[slots[p]]) by the rule
    of source_masks (len = the reader's kv length).
    """
    L = slots.shape[0]
    S, W = sink.shape[1], ring.shape[1]
    slots = slots.long()
    out = dequantize(codes[slots], params[slots], fmt)
    is_sink, is_ring, _ = source_masks(L, S, W, own_start, device=codes.device, sink_start=sink_start)
    p = torch.arange(L, device=codes.device)
    out[is_sink] = sink[row, p[is_sink]].float()
    out[is_ring] = ring[row, p[is_ring] % W].float()
    return out
