"""KV store for per-channel keys over page blocks (KVFormat k_layout="channel").

Two launches, in this order on one stream (no host synchronisation, CUDA-graph safe):

1. _key_blocks_kernel, one program per (new token, KV head), or per (window of B new tokens, KV
   head) in calls of >= KEY_BLOCK_WINDOWS_MIN_T tokens: a token at position p with
   p % B == B - 1 completes block p // B. Its program gathers the block's B keys, quantises each
   channel over them (min-max over the block, sink tokens included; reference.quantize_key_blocks
   operation for operation: fp32, IEEE division, no FMA contraction) and writes the B code rows
   and the block's (scale, min) row. Positions of the block stored in this call are read from k
   (the tokens of a request are contiguous and in position order in the batch, so position
   p - i is token t - i when that token has the same row and that position); the others came
   in an earlier call and are read from the ring, which held the last W >= B positions after
   that call. This runs before launch 2 because a long chunk overwrites those ring entries.
   Every key enters the block statistics rounded to the ring's dtype, so a block's codes do not
   depend on where the chunks were cut (bf16 ring: codes of bf16(k); fp32 ring: of k).
2. _tokens_kernel: values exactly as token_store.py (per-token groups, 2 bits, optional clip) with
   their BF16 sink/ring copies, the keys' BF16 sink/ring copies, and the slot -> side-entry map.

With one_token_per_request (a decode step) launch 2 also does launch 1's work: a request's new
token then writes only its own ring entry, which no block of the call reads (W >= B), so the order
does not matter and one launch serves.

Optionally (rot_k, a decode step's few tokens) the keys arrive unrotated and both launches apply
R_k themselves (_rotate: one MMA, operands in k's dtype, fp32 accumulation, rounded as the GEMM it
replaces rounds), and launch 2 also writes the step's rotated queries (q @ R_k of each query head's
KV head): two GEMM launches a layer fewer.

Slots are page-aligned (SGLang pages of B slots): position p of a request lives at slot
page * B + p % B, so a completing token's loc names the block's page (loc // B) and every slot of
the block. Tokens of an incomplete block get no key codes yet (readers take them from the ring).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import FP16_MAX, MIN_SCALE, PAGE_SIZES, code_bytes
from .core import compiled
from .token_store import BLOCK_T, record_side_slots, store_rows, tensor_args

CHANNEL_HEAD_DIMS = (64, 128)
CHANNEL_KEY_BITS = (2, 3, 4)


@triton.jit
def _to_side_dtype(x, DT: tl.constexpr):
    """fp32 x rounded to the side buffers' dtype DT, as fp32. bf16 is rounded to nearest even
    with integer ops: the Triton interpreter truncates fp32 -> bf16 casts (CUDA rounds), and the
    block statistics must equal torch's x.to(bfloat16) on both."""
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        r = b.to(tl.float32, bitcast=True)
    else:
        r = x.to(DT).to(tl.float32)
    return r


@triton.jit
def _rotate(x, R, stride_rk, D: tl.constexpr, DT: tl.constexpr):
    """x [M, D] @ R [D, D] (row stride stride_rk) as fp32: operands in DT (k's dtype on CUDA, the
    GEMM's; fp32 in the interpreter, whose bf16 tl.dot is not usable), fp32 accumulation."""
    d = tl.arange(0, D)
    r = tl.load(R + d[:, None] * stride_rk + d[None, :])
    return tl.dot(x.to(DT), r.to(DT))


# Tokens a call must have for _key_blocks_kernel to give each program a window of BLK tokens
# (prefill chunks) instead of one token (decode steps): with one token a program, a prefill chunk
# launches a program per token of which 1 in BLK completes a block (docs/design.md "Kernel design
# choices"). A window holds at most one completion per request in it, so a decode step of
# requests in lockstep (all completing a block at the same step) keeps one token a program:
# windows would quantise up to BLK blocks one after another in one program.
KEY_BLOCK_WINDOWS_MIN_T = 1024


@triton.jit(do_not_specialize=["win"])
def _key_blocks_kernel(
    X, stride_xt, stride_xh,
    Loc, Pos, Rows,
    Ring, stride_rr, stride_rp, stride_rh,
    KC, stride_cn, stride_ch,
    KP, stride_pn, stride_ph, stride_pd,
    Rot, stride_roth, stride_rotk, T, win,
    D: tl.constexpr, BITS: tl.constexpr, BLK: tl.constexpr, W: tl.constexpr,
    HAS_ROT: tl.constexpr, DT: tl.constexpr,
):
    """Program (w, h): tokens [w * win, (w + 1) * win) of the call (win <= BLK), KV head h; each
    of them that completes a block quantises it (_key_block), in token order. win is not
    specialised: one compiled kernel for windows of 1 (decode steps) and of BLK (prefill)."""
    h = tl.program_id(1).to(tl.int64)  # head-major pool: h * stride can pass 2^31
    i = tl.arange(0, BLK)
    t = tl.program_id(0) * win + i
    inw = (i < win) & (t < T)
    done = inw & (tl.load(Pos + t, mask=inw, other=0) % BLK == BLK - 1)
    last = tl.program_id(0) * win - 1
    for _ in range(tl.sum(done.to(tl.int32), 0)):
        tk = tl.min(tl.where(done & (t > last), t, T), 0)  # the next completing token
        _key_block(tk, h, X, stride_xt, stride_xh, Loc, Pos, Rows, Ring, stride_rr, stride_rp, stride_rh,
                   KC, stride_cn, stride_ch, KP, stride_pn, stride_ph, stride_pd, Rot, stride_roth, stride_rotk,
                   D, BITS, BLK, W, HAS_ROT, DT)
        last = tk


@triton.jit
def _key_block(
    t, h, X, stride_xt, stride_xh, Loc, Pos, Rows, Ring, stride_rr, stride_rp, stride_rh,
    KC, stride_cn, stride_ch, KP, stride_pn, stride_ph, stride_pd, Rot, stride_roth, stride_rotk,
    D: tl.constexpr, BITS: tl.constexpr, BLK: tl.constexpr, W: tl.constexpr,
    HAS_ROT: tl.constexpr, DT: tl.constexpr,
):
    """Token t, KV head h: if t completes its block, quantise the block (module docstring, 1.)."""
    p = tl.load(Pos + t)
    if p % BLK == BLK - 1:
        row = tl.load(Rows + t)
        j = tl.arange(0, BLK)
        pj = p - (BLK - 1) + j  # the block's positions
        tj = t - (BLK - 1) + j  # the token that would hold pj if it was stored in this call
        tjc = tl.maximum(tj, 0)
        # the row tells another request's tokens apart; the position only guards batches whose
        # requests are not contiguous (SGLang's are)
        new = (tj >= 0) & (tl.load(Rows + tjc) == row) & (tl.load(Pos + tjc) == pj)
        d = tl.arange(0, D)
        xn = tl.load(X + tjc.to(tl.int64)[:, None] * stride_xt + h * stride_xh + d[None, :],
                     mask=new[:, None], other=0.0)
        if HAS_ROT:  # this call's keys arrive unrotated (the ring's are rotated)
            xn = _rotate(xn, Rot + h * stride_roth, stride_rotk, D, DT)
        rb = Ring + row.to(tl.int64) * stride_rr + h * stride_rh
        xr = tl.load(rb + (pj % W)[:, None] * stride_rp + d[None, :], mask=(~new)[:, None], other=0.0)
        # round to the ring's dtype: the block's values do not depend on the chunking
        x = tl.where(new[:, None], _to_side_dtype(xn.to(tl.float32), Ring.dtype.element_ty),
                     xr.to(tl.float32))

        TOP: tl.constexpr = (1 << BITS) - 1
        mn16 = tl.minimum(tl.maximum(tl.min(x, 0), -65504.0), 65504.0).to(tl.float16)
        mn = mn16.to(tl.float32)
        sc = tl.math.div_rn(tl.max(x, 0) - mn, TOP * 1.0)
        sc16 = tl.minimum(tl.maximum(sc, 9.5367431640625e-07), 65504.0).to(tl.float16)
        inv = tl.math.div_rn(tl.full([D], 1.0, tl.float32), sc16.to(tl.float32))
        qf = tl.floor((x - mn[None, :]) * inv[None, :] + 0.5)
        q = tl.minimum(tl.maximum(qf, 0.0), TOP * 1.0).to(tl.int32)

        page = (tl.load(Loc + t).to(tl.int64)) // BLK
        slot = page * BLK + j
        cb = KC + slot[:, None] * stride_cn + h * stride_ch
        QD: tl.constexpr = D // 4
        if BITS == 4:  # half split: byte i = c[i] | c[i + D/2] << 4
            q2 = tl.reshape(q, [BLK, 2, D // 2])
            sh2 = 4 * tl.arange(0, 2)
            tl.store(cb + tl.arange(0, D // 2)[None, :], tl.sum(q2 << sh2[None, :, None], 1).to(tl.uint8))
        else:
            # 2-bit plane, quarter split: byte i = c[i] | c[i + D/4] << 2 | ... (low 2 bits)
            q4 = tl.reshape(q & 3, [BLK, 4, QD])
            sh4 = 2 * tl.arange(0, 4)
            tl.store(cb + tl.arange(0, QD)[None, :], tl.sum(q4 << sh4[None, :, None], 1).to(tl.uint8))
            if BITS == 3:
                # 1-bit plane, eighth split: byte i holds bit 2 of dims i + k*D/8 at bit k
                q8 = tl.reshape(q >> 2, [BLK, 8, D // 8])
                sh8 = tl.arange(0, 8)
                tl.store(cb + QD + tl.arange(0, D // 8)[None, :],
                         tl.sum(q8 << sh8[None, :, None], 1).to(tl.uint8))
        pb = KP + page * stride_pn + h * stride_ph + d * stride_pd
        tl.store(pb, sc16)
        tl.store(pb + 1, mn16)


@triton.jit
def _key_copies(
    pid, h, X, stride_xt, stride_xh, Pos, Rows, SeqLens,
    Sink, stride_sr, stride_sp, stride_sh, Ring, stride_rr, stride_rp, stride_rh, T,
    Rot, stride_roth, stride_rotk,
    D: tl.constexpr, S: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_ROT: tl.constexpr, DT: tl.constexpr,
):
    """BF16 sink / ring copies of BLOCK_T keys (the rule of token_store.py's side-buffer writes)."""
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    d = tl.arange(0, D)
    x = tl.load(X + t.to(tl.int64)[:, None] * stride_xt + h * stride_xh + d[None, :],
                mask=tmask[:, None], other=0.0)
    if HAS_ROT:
        x = _rotate(x, Rot + h * stride_roth, stride_rotk, D, DT)
    x = _to_side_dtype(x.to(tl.float32), Ring.dtype.element_ty)  # what the block quantiser reads back
    pos = tl.load(Pos + t, mask=tmask, other=0)
    row = tl.load(Rows + t, mask=tmask, other=0).to(tl.int64)
    seq = tl.load(SeqLens + t, mask=tmask, other=0)
    sink_m = tmask & (pos < S)
    sp = tl.where(sink_m, pos, 0)
    tl.store(Sink + row[:, None] * stride_sr + sp[:, None] * stride_sp + h * stride_sh + d[None, :],
             x.to(Sink.dtype.element_ty), mask=sink_m[:, None])
    ring_m = tmask & (pos >= seq - W)
    rp = tl.where(ring_m, pos % W, 0)
    tl.store(Ring + row[:, None] * stride_rr + rp[:, None] * stride_rp + h * stride_rh + d[None, :],
             x.to(Ring.dtype.element_ty), mask=ring_m[:, None])


@triton.jit
def _rotate_q(pid, h, Q, stride_qt, stride_qh, QO, stride_ot, stride_oh, Rot, stride_roth, stride_rotk, T,
              GQA: tl.constexpr, GQA_P2: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
              DT: tl.constexpr):
    """q @ R_k[h] for the query heads of KV head h of BLOCK_T tokens: rows (token, head of the
    group), padded to a power-of-two group."""
    r = tl.arange(0, BLOCK_T * GQA_P2)
    t = pid * BLOCK_T + r // GQA_P2
    g = r % GQA_P2
    m = (t < T) & (g < GQA)
    hq = (h * GQA + tl.where(g < GQA, g, 0)).to(tl.int64)
    t64 = tl.where(m, t, 0).to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(Q + t64[:, None] * stride_qt + hq[:, None] * stride_qh + d[None, :], mask=m[:, None], other=0.0)
    # rounded to nearest even first: the interpreter's fp32 -> bf16 cast truncates
    y = _to_side_dtype(_rotate(x, Rot + h * stride_roth, stride_rotk, D, DT), QO.dtype.element_ty)
    tl.store(QO + t64[:, None] * stride_ot + hq[:, None] * stride_oh + d[None, :],
             y.to(QO.dtype.element_ty), mask=m[:, None])


@triton.jit
def _tokens_kernel(
    XK, sxk_t, sxk_h, SinkK, ssk_r, ssk_p, ssk_h, RingK, srgk_r, srgk_p, srgk_h,
    XV, sxv_t, sxv_h, RotV, srv_h, srv_k, CV, scv_n, scv_h, PV, spv_n, spv_h, spv_g,
    SinkV, ssv_r, ssv_p, ssv_h, RingV, srgv_r, srgv_p, srgv_h, clip_v,
    Loc, Pos, Rows, SeqLens, T, SlotEntry, EntryOwner, n_rows,
    Rot, stride_roth, stride_rotk, Q, stride_qt, stride_qh, QO, stride_ot, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, GV: tl.constexpr, CLIP_V: tl.constexpr,
    S: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_ROT: tl.constexpr, DT: tl.constexpr, GQA: tl.constexpr, GQA_P2: tl.constexpr,
    KC, stride_cn, stride_ch, KP, stride_pn, stride_ph, stride_pd,
    HAS_Q: tl.constexpr, BLOCKS: tl.constexpr, BITS: tl.constexpr, BLK: tl.constexpr,
):
    """Grid axis 2: 0 = key side copies (+ the slot map), 1 = values as token_store.py, then (with rot_k
    and q) the rotated queries, then (BLOCKS: at most one token a request, a decode step) the
    key blocks the BLOCK_T tokens complete, as _key_blocks_kernel: no launch of their own."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    role = tl.program_id(2)
    if HAS_Q:  # (static branches: a variant without a role compiles none of its code)
        if role == 2:
            _rotate_q(pid, h, Q, stride_qt, stride_qh, QO, stride_ot, stride_oh, Rot, stride_roth, stride_rotk,
                      T, GQA, GQA_P2, DK, BLOCK_T, DT)
    if BLOCKS:
        if role == 2 + HAS_Q:
            for i in range(BLOCK_T):
                t = pid * BLOCK_T + i
                if t < T:
                    _key_block(t, h.to(tl.int64), XK, sxk_t, sxk_h, Loc, Pos, Rows, RingK, srgk_r, srgk_p,
                               srgk_h, KC, stride_cn, stride_ch, KP, stride_pn, stride_ph, stride_pd, Rot,
                               stride_roth, stride_rotk, DK, BITS, BLK, W, HAS_ROT, DT)
    if role == 0:
        if HAS_MAP:
            if h == 0:
                record_side_slots(pid, Loc, Pos, Rows, SeqLens, SlotEntry, EntryOwner, T, n_rows,
                                   S, W, BLOCK_T)
        _key_copies(pid, h, XK, sxk_t, sxk_h, Pos, Rows, SeqLens, SinkK, ssk_r, ssk_p, ssk_h,
                    RingK, srgk_r, srgk_p, srgk_h, T, Rot, stride_roth, stride_rotk, DK, S, W, BLOCK_T,
                    HAS_ROT, DT)
    if role == 1:
        store_rows(pid, h, XV, sxv_t, sxv_h, RotV, srv_h, srv_k, Loc, CV, scv_n, scv_h,
                    PV, spv_n, spv_h, spv_g, Pos, Rows, SeqLens, SinkV, ssv_r, ssv_p, ssv_h,
                    RingV, srgv_r, srgv_p, srgv_h, T, clip_v, DV, GV, S, W, False, CLIP_V, True,
                    BLOCK_T, min(32, DV))


def store_kv_channel(
    k, v, loc, positions, token_rows, token_seq_lens, k_codes, k_params, v_codes, v_params,
    sink_k, sink_v, ring_k, ring_v, *, k_bits, k_block, v_group, v_clip=1.0,
    slot_entry=None, entry_owner=None, rot_k=None, q=None, q_out=None, one_token_per_request=False,
):
    """See ops.store_kv_channel."""
    assert MIN_SCALE == 9.5367431640625e-07 and FP16_MAX == 65504.0  # constants baked in the kernel
    T, H, D = k.shape
    B = k_block
    if v.shape[:2] != (T, H) or loc.shape[0] != T or positions.shape[0] != T \
            or token_rows.shape[0] != T or token_seq_lens.shape[0] != T:
        raise ValueError(f"store_kv_channel: k {tuple(k.shape)}, v {tuple(v.shape)}, loc, positions, "
                         "token_rows and token_seq_lens must agree on the token count")
    if D not in CHANNEL_HEAD_DIMS:
        raise ValueError(f"store_kv_channel: head_dim {D} is not supported {CHANNEL_HEAD_DIMS}")
    if k_bits not in CHANNEL_KEY_BITS:
        raise ValueError(f"store_kv_channel: {k_bits}-bit keys are not supported {CHANNEL_KEY_BITS}")
    if B not in PAGE_SIZES:
        raise ValueError(f"store_kv_channel: key block {B} is not a page size {PAGE_SIZES}")
    N = k_codes.shape[0]
    if k_codes.dtype != torch.uint8 or tuple(k_codes.shape[1:]) != (H, code_bytes(k_bits, D)):
        raise ValueError(f"k_codes must be uint8 [N, {H}, {code_bytes(k_bits, D)}], got "
                         f"{k_codes.dtype} {tuple(k_codes.shape)}")
    if k_params.dtype != torch.float16 or N % B or tuple(k_params.shape) != (N // B, H, D, 2):
        raise ValueError(f"k_params must be float16 [N / {B}, {H}, {D}, 2] (N = {N}), got "
                         f"{k_params.dtype} {tuple(k_params.shape)}")
    W = ring_k.shape[1]
    if W < B or ring_v.shape[1] != W or sink_v.shape[1] != sink_k.shape[1]:
        raise ValueError(f"store_kv_channel: the ring ({W} positions) must hold >= one key block ({B}) "
                         "and K / V side buffers must have the same sizes")
    if tuple(ring_k.shape[2:]) != (H, D) or tuple(sink_k.shape[2:]) != (H, D) or ring_k.stride(-1) != 1 \
            or sink_k.stride(-1) != 1 or k_params.stride(-1) != 1:
        raise ValueError("store_kv_channel: key sink / ring must be [R, S / W, H, D] with contiguous "
                         "last dims")
    has_map = slot_entry is not None
    if has_map and (entry_owner is None or slot_entry.dtype != torch.int32
                    or entry_owner.dtype != torch.int32
                    or entry_owner.numel() < sink_k.shape[0] * (sink_k.shape[1] + W)):
        raise ValueError("store_kv_channel: slot_entry / entry_owner need int32 tensors, entry_owner "
                         "with rows * (S + W) entries")
    rot, q_args, dt, gqa = _rotation_args(k, rot_k, q, q_out)
    if T == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    # values: the INT2 row quantiser of token_store.py (checks shapes / group / clip)
    v_args, (dv, gv, _, clip_v) = tensor_args(v, v_codes, v_params, v_group, v_clip, None, sink_v, ring_v)
    # 1. complete blocks: read the ring before launch 2 overwrites it; with one token a request
    # launch 2 writes only ring entries no block of this call reads, and quantises them itself
    blocks = dict(KC=k_codes, stride_cn=k_codes.stride(0), stride_ch=k_codes.stride(1), KP=k_params,
                  stride_pn=k_params.stride(0), stride_ph=k_params.stride(1), stride_pd=k_params.stride(2))
    if not one_token_per_request:
        win = B if T >= KEY_BLOCK_WINDOWS_MIN_T else 1
        _key_blocks_kernel[(triton.cdiv(T, win), H)](
            k, k.stride(0), k.stride(1), loc, positions, token_rows,
            ring_k, ring_k.stride(0), ring_k.stride(1), ring_k.stride(2), *blocks.values(), *rot, T, win,
            D=D, BITS=k_bits, BLK=B, W=W, HAS_ROT=rot_k is not None, DT=dt, num_warps=4, enable_fp_fusion=False,
        )
    # 2. values, side copies, slot map (and the rotated queries, and the blocks with one token a request)
    roles = 2 + (q is not None) + bool(one_token_per_request)
    _tokens_kernel[(triton.cdiv(T, BLOCK_T), H, roles)](
        k, k.stride(0), k.stride(1), sink_k, *sink_k.stride()[:3], ring_k, *ring_k.stride()[:3],
        *v_args, loc, positions, token_rows, token_seq_lens, T,
        slot_entry if has_map else loc, entry_owner if has_map else loc, sink_k.shape[0], *rot, *q_args,
        DK=D, DV=dv, GV=gv, CLIP_V=clip_v, S=sink_k.shape[1], W=W, BLOCK_T=BLOCK_T,
        HAS_MAP=has_map, HAS_ROT=rot_k is not None, DT=dt, GQA=gqa, GQA_P2=triton.next_power_of_2(gqa),
        **blocks, HAS_Q=q is not None, BLOCKS=bool(one_token_per_request), BITS=k_bits, BLK=B,
        num_warps=4, enable_fp_fusion=False,
    )


def _rotation_args(k, rot_k, q, q_out):
    """Kernel arguments of the optional in-kernel R_k: (Rot, head stride, row stride), (Q, its
    token / head strides, QO, its strides), the MMA operand dtype, GQA. Checks shapes."""
    T, H, D = k.shape
    if rot_k is None:
        if q is not None or q_out is not None:
            raise ValueError("store_kv_channel: q / q_out are rotated by rot_k; pass rot_k too")
        return (k, 0, 0), (k, 0, 0, k, 0, 0), tl.float32, 1
    if rot_k.dim() == 2 and tuple(rot_k.shape) == (D, D):
        rot_k = rot_k.unsqueeze(0).expand(H, D, D)  # shared by every KV head: head stride 0
    if tuple(rot_k.shape) != (H, D, D) or rot_k.stride(-1) != 1:
        raise ValueError(f"store_kv_channel: rot_k must be [{D}, {D}] or [{H}, {D}, {D}] with a "
                         f"contiguous last dim, got {tuple(rot_k.shape)}")
    # the GEMM it replaces multiplies in k's dtype; the interpreter's bf16 tl.dot is not usable
    dt = tl.float32 if not compiled(k) else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(k.dtype)
    if dt is None:
        raise ValueError(f"store_kv_channel: rot_k needs bf16 or fp16 keys, got {k.dtype}")
    if rot_k.dtype != k.dtype:
        raise ValueError(f"store_kv_channel: rot_k ({rot_k.dtype}) must have k's dtype ({k.dtype})")
    rot = (rot_k, rot_k.stride(0), rot_k.stride(1))
    if q is None:
        if q_out is not None:
            raise ValueError("store_kv_channel: q_out without q")
        return rot, (k, 0, 0, k, 0, 0), dt, 1
    if q.dim() != 3 or q.shape[0] != T or q.shape[2] != D or q.shape[1] % H or q.stride(-1) != 1:
        raise ValueError(f"store_kv_channel: q must be [{T}, a multiple of {H}, {D}] with a contiguous "
                         f"last dim, got {tuple(q.shape)}")
    if q_out is None or q_out.shape != q.shape or q_out.stride(-1) != 1:
        raise ValueError(f"store_kv_channel: q_out must be {tuple(q.shape)} with a contiguous last dim")
    return rot, (q, q.stride(0), q.stride(1), q_out, q_out.stride(0), q_out.stride(1)), dt, q.shape[1] // H
