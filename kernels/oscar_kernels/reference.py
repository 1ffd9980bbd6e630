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


def fill_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices):
    """kv_indices[kv_indptr[b] + p] = req_to_token[req_pool_indices[b], p] for p < seq_lens[b],
    one request at a time (the oracle of ops.fill_kv_indices); other entries are left alone."""
    for b in range(seq_lens.shape[0]):
        n, start = int(seq_lens[b]), int(kv_indptr[b])
        kv_indices[start:start + n] = req_to_token[int(req_pool_indices[b]), :n].to(kv_indices.dtype)
    return kv_indices


# --------------------------------------------------------------------------------------------
# KVFormat references (docs/format.md, "KVFormat"): 2/3/4-bit codes, per-channel keys over page
# blocks, token-norm, per-token values, and the reader's view of one request.
# Arithmetic is float32 for float32/bf16/fp16 inputs (what a kernel does, bit-exact target) and
# float64 for float64 inputs; scales and minimums are always rounded to fp16.
# --------------------------------------------------------------------------------------------


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., D] (0 .. 2^bits - 1) -> packed uint8 [..., bits*D/8].

    2 bits: the quarter split of pack_codes. 4 bits, "half split": byte j = c[j] | c[j+D/2] << 4.
    3 bits: a 2-bit plane (quarter split of the low 2 bits, D/4 bytes) followed by a 1-bit plane,
    "eighth split": byte j of it holds the high bit of dims j + k*D/8 at bit k (k = 0..7).
    """
    D = q.shape[-1]
    q = q.to(torch.uint8)
    if bits == 2:
        return pack_codes(q)
    if bits == 4:
        h = q.reshape(*q.shape[:-1], 2, D // 2)
        return h[..., 0, :] | (h[..., 1, :] << 4)
    if bits == 3:
        hi = (q >> 2).reshape(*q.shape[:-1], 8, D // 8)
        plane1 = torch.zeros_like(hi[..., 0, :])
        for k in range(8):
            plane1 |= hi[..., k, :] << k
        return torch.cat([pack_codes(q & 3), plane1], dim=-1)
    raise ValueError(f"no packing for {bits}-bit codes (2, 3 or 4)")


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: packed [..., bits*D/8] -> codes uint8 [..., D]."""
    if bits == 2:
        return unpack_codes(packed)
    if bits == 4:
        return torch.cat([packed & 15, packed >> 4], dim=-1)
    if bits == 3:
        D = packed.shape[-1] * 8 // 3
        lo = unpack_codes(packed[..., : D // 4])
        plane1 = packed[..., D // 4:]
        hi = torch.cat([(plane1 >> k) & 1 for k in range(8)], dim=-1)
        return lo | (hi << 2)
    raise ValueError(f"no packing for {bits}-bit codes (2, 3 or 4)")


def _work(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def minmax_quantize(xg: torch.Tensor, bits: int, clip_ratio: float | None = 1.0):
    """One asymmetric min-max group per row of the last dim -> (codes uint8 [..., G] unpacked,
    params fp16 [..., 2] = (scale, min)). Same operations as ``quantize`` with 2^bits levels."""
    xg = clip_groups(_work(xg), normalize_clip_ratio(clip_ratio))
    top = (1 << bits) - 1
    mn = xg.amin(-1).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    sc = ((xg.amax(-1) - mn.to(xg.dtype)) / top).clamp(MIN_SCALE, FP16_MAX).to(torch.float16)
    inv = 1.0 / sc.to(xg.dtype)
    q = torch.floor((xg - mn.to(xg.dtype).unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5).clamp(0, top)
    return q.to(torch.uint8), torch.stack([sc, mn], dim=-1)


def minmax_dequantize(q: torch.Tensor, params: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """codes [..., G] and params [..., 2] -> code * scale + min."""
    return q.to(dtype) * params[..., 0:1].to(dtype) + params[..., 1:2].to(dtype)


def quantize_rows(x: torch.Tensor, bits: int, group: int, clip_ratio: float | None = 1.0):
    """Per-token groups along head_dim (V always; K with k_layout='token'), 2/3/4 bits.

    x [..., D] -> (codes uint8 [..., bits*D/8] packed, params fp16 [..., D/group, 2]).
    With bits=2 the result is bit-identical to ``quantize`` (the served Int2Format).
    """
    D = x.shape[-1]
    if D % group:
        raise ValueError(f"group size {group} does not divide head_dim {D}")
    q, params = minmax_quantize(x.reshape(*x.shape[:-1], D // group, group), bits, clip_ratio)
    return pack_bits(q.reshape(x.shape), bits), params


def dequantize_rows(codes: torch.Tensor, params: torch.Tensor, bits: int, dtype=torch.float32):
    """Inverse of quantize_rows (dtype float32, or float64 for exact checks)."""
    q = unpack_bits(codes, bits)
    D, n_groups = q.shape[-1], params.shape[-2]
    qg = q.reshape(*q.shape[:-1], n_groups, D // n_groups)
    return minmax_dequantize(qg, params, dtype).reshape(q.shape)


def token_norms(k: torch.Tensor) -> torch.Tensor:
    """fp16 L2 norm of every (token, KV head) row of K [..., D]; 0 is stored as 1 (a zero row
    stays zero). Rotation-invariant (R is orthogonal), so it may be taken before or after R_k."""
    n = _work(k).pow(2).sum(-1).sqrt().clamp(max=FP16_MAX).to(torch.float16)
    return torch.where(n > 0, n, torch.ones_like(n))


def quantize_key_blocks(k: torch.Tensor, bits: int, block: int, token_norm: bool = False,
                        clip_ratio: float | None = 1.0):
    """Per-channel keys over page blocks, for one request whose positions start at 0.

    k [L, H, D] (positions 0..L-1). Only the L // block complete blocks are quantised; block b
    covers positions b*block .. (b+1)*block - 1 and gets one fp16 (scale, min) per (head,
    channel). With token_norm each row is first divided by its fp16 norm (token_norms), which is
    stored. Returns (codes uint8 [n*block, H, bits*D/8], params fp16 [n, H, D, 2],
    norms fp16 [n*block, H] or None), n = number of complete blocks.
    """
    L, H, D = k.shape
    n = L // block
    x = _work(k[: n * block])
    norms = None
    if token_norm:
        norms = token_norms(x)
        x = x / norms.to(x.dtype).unsqueeze(-1)
    g = x.reshape(n, block, H, D).permute(0, 2, 3, 1)  # [n, H, D, block]: groups along tokens
    q, params = minmax_quantize(g, bits, clip_ratio)
    q = q.permute(0, 3, 1, 2).reshape(n * block, H, D)
    return pack_bits(q, bits), params, norms


def dequantize_key_blocks(codes, params, norms, bits: int, dtype=torch.float32) -> torch.Tensor:
    """(codes [n*B, H, bits*D/8], params [n, H, D, 2], norms [n*B, H] or None) -> K [n*B, H, D]."""
    q = unpack_bits(codes, bits)  # [n*B, H, D]
    n = params.shape[0]
    B = q.shape[0] // n if n else 0
    qg = q.reshape(n, B, *q.shape[1:]).to(dtype)
    sc = params[..., 0].to(dtype).unsqueeze(1)  # [n, 1, H, D]
    mn = params[..., 1].to(dtype).unsqueeze(1)
    x = (qg * sc + mn).reshape(q.shape)
    if norms is not None:
        x = x * norms.to(dtype).unsqueeze(-1)
    return x


def format_fake_quant(x: torch.Tensor, fmt, which: str, layer: int = 0,
                      num_layers: int | None = None, clip_ratio: float | None = 1.0) -> torch.Tensor:
    """What the quantised body of one request reads back as, K or V [L, H, D] (positions from 0).

    which: "k" or "v". For channel-layout keys, positions of the trailing incomplete block are
    returned unchanged (the body holds no value for them yet; readers take them from BF16).
    Float32 result (float64 for float64 input).
    """
    kb, vb = fmt.layer_bits(layer, num_layers)
    out_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if which == "v":
        return dequantize_rows(*quantize_rows(x, vb, fmt.v_group, clip_ratio), vb, out_dtype)
    if which != "k":
        raise ValueError(f"which must be 'k' or 'v', got {which!r}")
    if fmt.k_layout == "token":
        return dequantize_rows(*quantize_rows(x, kb, fmt.k_group, clip_ratio), kb, out_dtype)
    codes, params, norms = quantize_key_blocks(x, kb, fmt.k_group, fmt.token_norm, clip_ratio)
    out = x.to(out_dtype).clone()
    out[: codes.shape[0]] = dequantize_key_blocks(codes, params, norms, kb, out_dtype)
    return out


def format_source_masks(kv_len: int, fmt, own_start: int = 0, sink_start: int | None = None,
                        device=None):
    """(is_sink, is_ring, is_body) over positions 0..kv_len-1 for a reader of kv_len keys.

    Same rule as source_masks with S = fmt.sink and W = fmt.window; with per-channel keys a body
    position must lie in a complete block (block end <= kv_len). A position that is neither in
    the BF16 buffers nor in a complete block cannot be served: ValueError.
    """
    is_sink, is_ring, is_body = source_masks(kv_len, fmt.sink, fmt.window, own_start, device,
                                             sink_start)
    if fmt.k_layout == "channel":
        p = torch.arange(kv_len, device=device)
        complete = (p // fmt.k_group + 1) * fmt.k_group <= kv_len
        if (is_body & ~complete).any():
            raise ValueError(f"{fmt.name}: position(s) {p[is_body & ~complete].tolist()[:4]} of an "
                             f"incomplete block are in neither the sink nor the ring")
    return is_sink, is_ring, is_body


def format_request_kv(x: torch.Tensor, fmt, which: str, kv_len: int | None = None,
                      layer: int = 0, num_layers: int | None = None, own_start: int = 0,
                      clip_ratio: float | None = 1.0, hp_dtype: torch.dtype = torch.bfloat16,
                      sink_start: int | None = None) -> torch.Tensor:
    """Effective K or V [kv_len, H, D] of one request as a reader of kv_len keys sees it:
    sink / ring positions read ``x.to(hp_dtype)``, the others the quantised body (blocks of
    per-channel keys are the complete blocks of the first kv_len positions)."""
    kv_len = x.shape[0] if kv_len is None else kv_len
    x = x[:kv_len]
    is_sink, is_ring, _ = format_source_masks(kv_len, fmt, own_start, sink_start, x.device)
    body = format_fake_quant(x, fmt, which, layer, num_layers, clip_ratio)
    hp = (is_sink | is_ring).view(-1, 1, 1)
    return torch.where(hp, x.to(hp_dtype).to(body.dtype), body)


# --------------------------------------------------------------------------------------------
# Page copies (the INT2 host tier)
# --------------------------------------------------------------------------------------------


def page_numbers(idx: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page of each run of page_size slots in idx; raises where a run is not page_size consecutive
    slots starting at a multiple of page_size."""
    runs = idx.reshape(-1, page_size).to(torch.int64)
    first = runs[:, :1]
    if not (bool((first % page_size == 0).all() and (first >= 0).all())
            and torch.equal(runs, first + torch.arange(page_size, device=idx.device))):
        raise ValueError(f"slots are not page-aligned runs of {page_size}")
    return first[:, 0] // page_size


def copy_pages(blob, sections, host_idx, dev_idx, page_size: int, to_host: bool) -> None:
    """ops.copy_pages in torch: section (buffer [H, P, ...], off) of blob row q holds the H runs
    buffer[h, p] (as bytes) one after another from byte off, for each run pair (q, p)."""
    hp, dp = page_numbers(host_idx, page_size), page_numbers(dev_idx, page_size)
    for buf, off in sections:
        H = buf.shape[0]
        raw = buf.reshape(H, buf.shape[1], -1).view(torch.uint8)  # [H, P, chunk bytes]
        n = H * raw.shape[2]
        if to_host:
            blob[hp.to(blob.device), off:off + n] = raw[:, dp].transpose(0, 1).reshape(len(dp), n).to(blob.device)
        else:
            raw[:, dp] = blob[hp.to(blob.device), off:off + n].reshape(len(hp), H, -1).transpose(0, 1).to(raw.device)
