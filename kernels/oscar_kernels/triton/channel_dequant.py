"""Per-channel INT2 pool -> BF16 keys and values of a batch's cached prefixes, one piece at a time.

What a reader of the prefix sees (the source rule of ops.py: BF16 sink, BF16 ring, quantised body),
written out as plain [rows, H, D] / [rows, H, Dv] tensors, so that a BF16 prefill kernel (FlashInfer's
ragged prefill, non-causal) can attend over it at tensor-core speed. A piece holds, for request b,
positions [lo[b], lo[b] + n_b) with n_b = out_indptr[b + 1] - out_indptr[b], at rows
out_indptr[b] ..; lo[b] is a multiple of the key block, so a program's BLK positions are one page.

One program = one page block of one request and KV head: the keys' four quarters dequantised with
the page's per-channel (scale, min) (core_codes.dequant_codes), the values with their per-token group
params; sink / ring positions copied from the BF16 buffers. The arithmetic is fp32 from the pool's
fp16 params, rounded once to the output dtype (bf16 arithmetic would round the params first, an
error of 2^-9 of |code * scale| + |min|, which for a key channel spans its largest value in the
block).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .core import as_param_words, source_ranges
from .core_codes import dequant_codes, key_quarter, unpack_params


@triton.jit
def _dequant_prefix_kernel(
    KC, stride_kcn, stride_kch, KP, stride_kpn, stride_kph,
    VC, stride_vcn, stride_vch, VP, stride_vpn, stride_vph,
    SK, stride_skr, stride_skp, stride_skh, SV, stride_svr, stride_svp, stride_svh,
    RK, stride_rkr, stride_rkp, stride_rkh, RV, stride_rvr, stride_rvp, stride_rvh,
    kv_indptr, kv_indices, req_rows, own_start, sink_start, piece_lo, out_indptr,
    OK, stride_okn, stride_okh, OV, stride_ovn, stride_ovh,
    D: tl.constexpr, DV: tl.constexpr, BITS: tl.constexpr, BLK: tl.constexpr, GV: tl.constexpr,
    S: tl.constexpr, W: tl.constexpr,
):
    QD: tl.constexpr = D // 4
    QDV: tl.constexpr = DV // 4
    b = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    jb = tl.program_id(2)
    o0 = tl.load(out_indptr + b)
    n = tl.load(out_indptr + b + 1) - o0
    if jb * BLK >= n:
        return
    lo = tl.load(piece_lo + b)
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    row = tl.load(req_rows + b).to(tl.int64)
    sink_lo, sink_hi, ring_lo, _ = source_ranges(kv_len, tl.load(own_start + row),
                                                 tl.load(sink_start + row), S, W)
    offs = tl.arange(0, BLK)
    p = lo + jb * BLK + offs
    valid = jb * BLK + offs < n
    body = valid & (p < ring_lo) & ((p < sink_lo) | (p >= sink_hi))
    in_sink = valid & (p >= sink_lo) & (p < sink_hi)
    in_ring = valid & (p >= ring_lo)
    out_row = (o0 + jb * BLK + offs).to(tl.int64)
    dq = tl.arange(0, QD)
    dv = tl.arange(0, QDV)
    # the block's first position (< kv_len) names its page; its positions are the page's slots
    page = (tl.load(kv_indices + kv_start + lo + jb * BLK) // BLK).to(tl.int64)
    slot = page * BLK + offs
    kcb = KC + h * stride_kch + slot[:, None] * stride_kcn
    kc = tl.load(kcb + dq[None, :], mask=body[:, None], other=0).to(tl.int32)
    kc2 = kc
    hb = kc
    if BITS == 3:
        hb = tl.load(kcb + QD + (dq % (QD // 2))[None, :], mask=body[:, None], other=0).to(tl.int32)
    if BITS == 4:
        kc2 = tl.load(kcb + QD + dq[None, :], mask=body[:, None], other=0).to(tl.int32)
    vc = tl.load(VC + h * stride_vch + slot[:, None] * stride_vcn + dv[None, :], mask=body[:, None],
                 other=0).to(tl.int32)
    okb = OK + out_row[:, None] * stride_okn + h * stride_okh
    ovb = OV + out_row[:, None] * stride_ovn + h * stride_ovh
    for j in tl.static_range(4):
        sc, mn = unpack_params(tl.load(KP + page * stride_kpn + h * stride_kph + j * QD + dq))
        kj = dequant_codes(key_quarter(kc, kc2, hb, j, BITS, QD), sc, mn, 0, tl.float32)
        tl.store(okb + j * QD + dq[None, :], kj.to(OK.dtype.element_ty), mask=body[:, None])
        w = tl.load(VP + slot * stride_vpn + h * stride_vph + (j * QDV) // GV, mask=body, other=0)
        vsc, vmn = unpack_params(w)
        vj = dequant_codes((vc >> (2 * j)) & 3, vsc, vmn, 1, tl.float32)
        tl.store(ovb + j * QDV + dv[None, :], vj.to(OV.dtype.element_ty), mask=body[:, None])
    # BF16 copies: the sink at position p, the ring at p % W
    dk = tl.arange(0, D)
    dvv = tl.arange(0, DV)
    sp = tl.where(in_sink, p, 0).to(tl.int64)
    rp = tl.where(in_ring, p % W, 0).to(tl.int64)
    ks = tl.load(SK + row * stride_skr + sp[:, None] * stride_skp + h * stride_skh + dk[None, :],
                 mask=in_sink[:, None], other=0.0)
    kr = tl.load(RK + row * stride_rkr + rp[:, None] * stride_rkp + h * stride_rkh + dk[None, :],
                 mask=in_ring[:, None], other=0.0)
    tl.store(OK + out_row[:, None] * stride_okn + h * stride_okh + dk[None, :],
             tl.where(in_sink[:, None], ks, kr).to(OK.dtype.element_ty), mask=(in_sink | in_ring)[:, None])
    vs = tl.load(SV + row * stride_svr + sp[:, None] * stride_svp + h * stride_svh + dvv[None, :],
                 mask=in_sink[:, None], other=0.0)
    vr = tl.load(RV + row * stride_rvr + rp[:, None] * stride_rvp + h * stride_rvh + dvv[None, :],
                 mask=in_ring[:, None], other=0.0)
    tl.store(OV + out_row[:, None] * stride_ovn + h * stride_ovh + dvv[None, :],
             tl.where(in_sink[:, None], vs, vr).to(OV.dtype.element_ty), mask=(in_sink | in_ring)[:, None])


def dequant_prefix_channel(k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
                           kv_indptr, kv_indices, req_rows, own_start, piece_lo, out_indptr, out_k, out_v,
                           *, k_bits, k_block, v_group, max_piece_len, sink_start=None):
    """See ops.dequant_prefix_channel."""
    from .channel_attend import check_channel_pool

    check_channel_pool(out_k[:0].new_empty((0, k_codes.shape[1], out_k.shape[-1])), k_codes, k_params,
                       v_codes, v_params, sink_k, ring_k, k_bits, k_block, v_group)
    B = kv_indptr.shape[0] - 1
    H = k_codes.shape[1]
    if B == 0 or max_piece_len <= 0:
        return out_k, out_v
    sink_start = own_start if sink_start is None else sink_start
    kp, vp = as_param_words(k_params), as_param_words(v_params)
    _dequant_prefix_kernel[(B, H, triton.cdiv(int(max_piece_len), k_block))](
        k_codes, k_codes.stride(0), k_codes.stride(1), kp, kp.stride(0), kp.stride(1),
        v_codes, v_codes.stride(0), v_codes.stride(1), vp, vp.stride(0), vp.stride(1),
        sink_k, *sink_k.stride()[:3], sink_v, *sink_v.stride()[:3],
        ring_k, *ring_k.stride()[:3], ring_v, *ring_v.stride()[:3],
        kv_indptr, kv_indices, req_rows, own_start, sink_start, piece_lo, out_indptr,
        out_k, out_k.stride(0), out_k.stride(1), out_v, out_v.stride(0), out_v.stride(1),
        D=out_k.shape[-1], DV=out_v.shape[-1], BITS=k_bits, BLK=k_block, GV=v_group,
        S=sink_k.shape[1], W=ring_k.shape[1], num_warps=4,
    )
    return out_k, out_v
