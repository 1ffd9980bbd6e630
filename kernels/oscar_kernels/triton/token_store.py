"""KV store: (optional rotation) + clip + quantise + pack + scatter, plus the BF16 side buffers.

One program = BLOCK_T tokens x one KV head of K or of V; one launch does both. The quantiser is
``reference.quantize`` operation for operation (fp32, IEEE division, no FMA contraction), so on
unrotated input the codes and params are bit-identical to the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import FP16_MAX, MIN_SCALE, Int2Format, clip_index, normalize_clip_ratio

BLOCK_T = 16


@triton.jit
def store_rows(
    pid, h,
    X, stride_xt, stride_xh,
    Rot, stride_rh, stride_rk,
    Loc, Codes, stride_cn, stride_ch,
    Params, stride_pn, stride_ph, stride_pg,
    Pos, Rows, SeqLens,
    Sink, stride_sr, stride_sp, stride_sh,
    Ring, stride_rr, stride_rp, stride_rhd,
    T, clip_idx,
    D: tl.constexpr, G: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
    HAS_ROT: tl.constexpr, CLIP: tl.constexpr, HAS_SIDE: tl.constexpr,
    BLOCK_T: tl.constexpr, KT: tl.constexpr,
):
    """BLOCK_T tokens (block pid) of KV head h of one tensor (K or V)."""
    NG: tl.constexpr = D // G
    QD: tl.constexpr = D // 4
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    d = tl.arange(0, D)
    xrow = X + t64[:, None] * stride_xt + h * stride_xh
    if HAS_ROT:
        # x @ R[h], fp32 with IEEE products (no TF32), K dimension in tiles of KT
        x = tl.zeros([BLOCK_T, D], tl.float32)
        for k0 in tl.static_range(0, D, KT):
            kk = k0 + tl.arange(0, KT)
            xk = tl.load(xrow + kk[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            rk = tl.load(Rot + h * stride_rh + kk[:, None] * stride_rk + d[None, :])
            x += tl.dot(xk, rk, input_precision="ieee")
    else:
        x = tl.load(xrow + d[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)

    xg = tl.reshape(x, [BLOCK_T, NG, G])
    if CLIP:
        # thr = the clip_idx-th smallest |x| of the group, exactly (= sort(|x|)[clip_idx]): the
        # fp32 bit patterns of |x| order like the values, so build the largest pattern v with
        # #(|x| < v) <= clip_idx bit by bit (31 vectorised counts; cheaper than a bitonic sort).
        ab = tl.abs(xg).to(tl.int32, bitcast=True)
        ans = tl.zeros([BLOCK_T, NG], tl.int32)
        for i in tl.static_range(31):
            cand = ans | (1 << (30 - i))
            cnt = tl.sum((ab < cand[:, :, None]).to(tl.int32), 2)
            ans = tl.where(cnt <= clip_idx, cand, ans)
        thr = ans.to(tl.float32, bitcast=True)
        xg = tl.minimum(tl.maximum(xg, -thr[:, :, None]), thr[:, :, None])
    mn16 = tl.minimum(tl.maximum(tl.min(xg, 2), -65504.0), 65504.0).to(tl.float16)
    mn = mn16.to(tl.float32)
    sc = tl.math.div_rn(tl.max(xg, 2) - mn, 3.0)
    sc16 = tl.minimum(tl.maximum(sc, 9.5367431640625e-07), 65504.0).to(tl.float16)
    inv = tl.math.div_rn(tl.full([BLOCK_T, NG], 1.0, tl.float32), sc16.to(tl.float32))
    qf = tl.floor((xg - mn[:, :, None]) * inv[:, :, None] + 0.5)
    qi = tl.minimum(tl.maximum(qf, 0.0), 3.0).to(tl.int32)
    # quarter split: byte j = q[j] | q[j + D/4] << 2 | q[j + D/2] << 4 | q[j + 3D/4] << 6
    q4 = tl.reshape(qi, [BLOCK_T, 4, QD])
    shift = 2 * tl.arange(0, 4)
    packed = tl.sum(q4 << shift[None, :, None], 1).to(tl.uint8)

    loc = tl.load(Loc + t, mask=tmask, other=0).to(tl.int64)
    h64 = h.to(tl.int64)  # the pool is head-major: h * stride can pass 2^31
    tl.store(Codes + loc[:, None] * stride_cn + h64 * stride_ch + tl.arange(0, QD)[None, :], packed,
             mask=tmask[:, None])
    g = tl.arange(0, NG)
    pb = Params + loc[:, None] * stride_pn + h64 * stride_ph + g[None, :] * stride_pg
    tl.store(pb, sc16, mask=tmask[:, None])
    tl.store(pb + 1, mn16, mask=tmask[:, None])

    if HAS_SIDE:
        pos = tl.load(Pos + t, mask=tmask, other=0)
        row = tl.load(Rows + t, mask=tmask, other=0).to(tl.int64)
        seq = tl.load(SeqLens + t, mask=tmask, other=0)
        sink_m = tmask & (pos < S)
        sp = tl.where(sink_m, pos, 0)
        tl.store(Sink + row[:, None] * stride_sr + sp[:, None] * stride_sp + h * stride_sh + d[None, :],
                 x.to(Sink.dtype.element_ty), mask=sink_m[:, None])
        ring_m = tmask & (pos >= seq - W)
        rp = tl.where(ring_m, pos % W, 0)
        tl.store(Ring + row[:, None] * stride_rr + rp[:, None] * stride_rp + h * stride_rhd + d[None, :],
                 x.to(Ring.dtype.element_ty), mask=ring_m[:, None])


@triton.jit
def record_side_slots(
    pid, Loc, Pos, Rows, SeqLens, SlotEntry, EntryOwner, T, n_rows,
    S: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Which side-buffer entry holds each new token's BF16 copy, for radix-hit reuse.

    Entries: sink row r position p -> r * S + p; ring row r position p -> R * S + r * W + p % W.
    SlotEntry[slot] = entry (-1 when the token has no side copy) and EntryOwner[entry] = slot, so a
    later request that inherits the slot from the radix cache can find the copy and check that no
    newer token has overwritten it (EntryOwner[entry] == slot).
    """
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    pos = tl.load(Pos + t, mask=tmask, other=0)
    row = tl.load(Rows + t, mask=tmask, other=0).to(tl.int64)
    seq = tl.load(SeqLens + t, mask=tmask, other=0)
    loc = tl.load(Loc + t, mask=tmask, other=0).to(tl.int64)
    entry = tl.where(pos < S, row * S + pos,
                     tl.where(pos >= seq - W, n_rows * S + row * W + pos % W, -1))
    tl.store(SlotEntry + loc, entry.to(tl.int32), mask=tmask)
    tl.store(EntryOwner + tl.where(entry >= 0, entry, 0), loc.to(tl.int32), mask=tmask & (entry >= 0))


@triton.jit
def _store_kv_kernel(
    XK, sxk_t, sxk_h, RotK, srk_h, srk_k, CK, sck_n, sck_h, PK, spk_n, spk_h, spk_g,
    SinkK, ssk_r, ssk_p, ssk_h, RingK, srgk_r, srgk_p, srgk_h, clip_k,
    XV, sxv_t, sxv_h, RotV, srv_h, srv_k, CV, scv_n, scv_h, PV, spv_n, spv_h, spv_g,
    SinkV, ssv_r, ssv_p, ssv_h, RingV, srgv_r, srgv_p, srgv_h, clip_v,
    Loc, Pos, Rows, SeqLens, T, SlotEntry, EntryOwner, n_rows,
    DK: tl.constexpr, GK: tl.constexpr, ROT_K: tl.constexpr, CLIP_K: tl.constexpr,
    DV: tl.constexpr, GV: tl.constexpr, ROT_V: tl.constexpr, CLIP_V: tl.constexpr,
    S: tl.constexpr, W: tl.constexpr, HAS_SIDE: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    """K and V in one launch (grid axis 2: 0 = K, 1 = V), so decode-size stores cost one
    kernel's latency, not two."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_MAP:
        if (h == 0) and (tl.program_id(2) == 0):
            record_side_slots(pid, Loc, Pos, Rows, SeqLens, SlotEntry, EntryOwner, T, n_rows, S, W, BLOCK_T)
    if tl.program_id(2) == 0:
        store_rows(pid, h, XK, sxk_t, sxk_h, RotK, srk_h, srk_k, Loc, CK, sck_n, sck_h,
                    PK, spk_n, spk_h, spk_g, Pos, Rows, SeqLens, SinkK, ssk_r, ssk_p, ssk_h,
                    RingK, srgk_r, srgk_p, srgk_h, T, clip_k, DK, GK, S, W, ROT_K, CLIP_K, HAS_SIDE,
                    BLOCK_T, min(32, DK))
    else:
        store_rows(pid, h, XV, sxv_t, sxv_h, RotV, srv_h, srv_k, Loc, CV, scv_n, scv_h,
                    PV, spv_n, spv_h, spv_g, Pos, Rows, SeqLens, SinkV, ssv_r, ssv_p, ssv_h,
                    RingV, srgv_r, srgv_p, srgv_h, T, clip_v, DV, GV, S, W, ROT_V, CLIP_V, HAS_SIDE,
                    BLOCK_T, min(32, DV))


def tensor_args(x, codes, params, group, clip, rot, sink, ring):
    """Checked per-tensor (K or V) kernel arguments and constexprs."""
    T, H, D = x.shape
    fmt = Int2Format(D, group)
    ratio = normalize_clip_ratio(clip)
    if codes.shape[1:] != (H, D // 4) or params.shape[1:] != (H, fmt.n_groups, 2):
        raise ValueError(
            f"pool shapes {tuple(codes.shape)} / {tuple(params.shape)} do not fit tokens [T, {H}, {D}] "
            f"with group {group}"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    has_side = sink is not None
    if rot is not None:
        if rot.shape != (H, D, D) or rot.dtype != torch.float32:
            raise ValueError(f"rotation must be float32 [{H}, {D}, {D}], got {rot.dtype} {tuple(rot.shape)}")
        if rot.stride(-1) != 1:
            rot = rot.contiguous()  # the plugin passes contiguous matrices (no copy under graphs)
    has_side = sink is not None
    args = [
        x, x.stride(0), x.stride(1),
        rot if rot is not None else codes, rot.stride(0) if rot is not None else 0,
        rot.stride(1) if rot is not None else 0,
        codes, codes.stride(0), codes.stride(1),
        params, params.stride(0), params.stride(1), params.stride(2),
        sink if has_side else x, *(sink.stride()[:3] if has_side else (0, 0, 0)),
        ring if has_side else x, *(ring.stride()[:3] if has_side else (0, 0, 0)),
        clip_index(ratio, group),
    ]
    return args, (D, group, rot is not None, ratio < 1.0)


def store_kv(
    k, v, loc, k_codes, k_params, v_codes, v_params, *, k_group, v_group, k_clip=1.0, v_clip=1.0,
    k_rot=None, v_rot=None, positions=None, token_rows=None, token_seq_lens=None,
    sink_k=None, sink_v=None, ring_k=None, ring_v=None, slot_entry=None, entry_owner=None,
):
    side = (positions, token_rows, token_seq_lens, sink_k, sink_v, ring_k, ring_v)
    if any(s is not None for s in side) and any(s is None for s in side):
        raise ValueError(
            "store_kv: positions, token_rows, token_seq_lens, sink_k, sink_v, ring_k and ring_v "
            "must be given together (or none of them)"
        )
    assert MIN_SCALE == 9.5367431640625e-07 and FP16_MAX == 65504.0  # constants baked in the kernel
    if k.shape[:2] != v.shape[:2] or loc.shape[0] != k.shape[0]:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and loc {tuple(loc.shape)} disagree")
    T, H = k.shape[:2]
    if T == 0:
        return
    k_args, (dk, gk, rot_k, clip_k) = tensor_args(k, k_codes, k_params, k_group, k_clip, k_rot, sink_k, ring_k)
    v_args, (dv, gv, rot_v, clip_v) = tensor_args(v, v_codes, v_params, v_group, v_clip, v_rot, sink_v, ring_v)
    has_side = sink_k is not None
    has_map = slot_entry is not None
    if has_map and (not has_side or entry_owner is None or slot_entry.dtype != torch.int32
                    or entry_owner.dtype != torch.int32
                    or entry_owner.numel() < sink_k.shape[0] * (sink_k.shape[1] + ring_k.shape[1])):
        raise ValueError("store_kv: slot_entry / entry_owner need the side buffers and int32 "
                         "tensors, entry_owner with rows * (S + W) entries")
    _store_kv_kernel[(triton.cdiv(T, BLOCK_T), H, 2)](
        *k_args, *v_args,
        loc, positions if has_side else loc, token_rows if has_side else loc,
        token_seq_lens if has_side else loc, T,
        slot_entry if has_map else loc, entry_owner if has_map else loc,
        sink_k.shape[0] if has_side else 0,
        DK=dk, GK=gk, ROT_K=rot_k, CLIP_K=clip_k, DV=dv, GV=gv, ROT_V=rot_v, CLIP_V=clip_v,
        S=sink_k.shape[1] if has_side else 0, W=ring_k.shape[1] if has_side else 1, HAS_SIDE=has_side,
        BLOCK_T=BLOCK_T, HAS_MAP=has_map, num_warps=4, enable_fp_fusion=False,
    )
