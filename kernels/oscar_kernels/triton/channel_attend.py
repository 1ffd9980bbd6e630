"""The attention kernel over per-channel keys (KVFormat k_layout="channel", docs/format.md
"KVFormat"): one kernel, two modes (decode and extend-prefix), as token_attend.attend_kernel.

* Decode (SPLIT=True): stage 1 of split-K decode (channel_decode.py); stage 2 (LSE merge) and the
  split plan are core's. One program = (request b, KV head h, split s), rows = the GQA group of h
  (padded to >= 8 for tl.dot).
* Extend-prefix (SPLIT=False): E_b new tokens of request b against its cached prefix, no mask.
  Grid (B, Hkv * num_mb, 1): one program = (request b, KV head h, query block mb), rows = BLOCK_M
  (token, query head) pairs, row m -> token qo_indptr[b] + m // GQA, head h * GQA + m % GQA; no
  splits: the program walks the sink, the ring and every body block, and writes o [T, Hq, Dv]
  and its natural-log lse [T, Hq] (output split strides 0). A program that saw no key (empty
  prefix) writes o = 0, lse = -inf.

Key positions come from the same three sources as the per-token kernels (core.source_ranges):
BF16 sink, BF16 ring (read by core.bf16_sink_ring) and the quantised body, positions
[0, sink_lo) u [sink_hi, ring_lo). The body differs from the served INT2 layout:

* keys: 2/3/4-bit codes per (token, head) row (pack_bits), and one fp16 (scale, min) per
  (page block, head, channel) at k_params[slot // B, h, c]. A body tile is one page block of B
  positions, so the whole tile shares one (scale, min) row and the dequantisation folds into q:
      q . k_hat(t) = sum_c q_c (s_c code_tc + m_c) = (q * s) . code_t + q . m
  i.e. q is scaled once per tile and one constant per query row is added; codes go to tl.dot as
  small integers (exact in bf16).
* values: 2-bit per-token groups as in the INT2 format, folded the same way as the per-token kernels.

Body tiles walk whole blocks: the blocks holding [0, min(sink_lo, ring_lo)), then those holding
[sink_hi, ring_lo) (a block shared by both lists is walked once); positions of a block that are
not body positions (sink hole, ring, past the request) are masked. Every walked block holds at
least one body position, so no tile is fully masked. Decode: splits NB16..n-1 share the blocks
whose every position is a body position in equal contiguous chunks and walk them without masks;
the other blocks (the sink's and the ring's edges, list A) are BF16 split 0's, masked (4-bit keys:
the body splits share every block, masked; see the kernel); the split count is num_splits_of over
the body's key count, as in the merge kernel, so core.merge_splits needs no change. Extend: one
program walks them all.

A body position must lie in a complete block (the format's reader rule,
reference.format_source_masks): the ring holds >= one block, so only a request whose own_start
is past the start of its incomplete block could violate it; SGLang's paged radix hits are
page-aligned. The kernel does not check this. Extend-prefix reads the prefix as a reader of
kv_len keys, so it runs before the new tokens are stored (the backend's order): their store
overwrites ring entries of the prefix and may complete its last block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import PAGE_SIZES, code_bytes
from .core import (LN2, bf16_sink_ring, cap_and_scale, empty_softmax_state, load_q_quarters, merge_if_last,
                   num_splits_of, online_softmax, source_ranges, split_ranges)
from .core_codes import (dequant_codes, key_quarter, pick4, pick8, quarter_of_words, quarter_v, unpack_params,
                         v_scale, widen, word_code, word_dims, word_ofs, words_of_quarter)

CHANNEL_HEAD_DIMS = (64, 128)
CHANNEL_KEY_BITS = (2, 3, 4)


# Decode body (SPLIT): both products transposed as in token_decode (keys / value dims fill the
# MMA's 16-row side, the GQA rows its 8-column side: BLOCK_M = 8 at GQA <= 8), code operands made
# with exponent tricks instead of int -> float conversions (core_codes). The offsets are removed
# per tile: for keys through the (q * s) . m row constant, for values from the accumulators before
# each tile's MMA.
# ROWC, the keys' row constant per tile: q is divided once per program by each key quarter's
# operand scale ks (its place value: a power of two, so exactly), which makes q * s a single
# product per dim; the mins' term is summed per dim as (q / ks) . m, multiplied up between quarters
# (Horner, walking quarter 3 down to 0: ks_{J+1} / ks_J is a power of two); the operands' offsets
# come off as KOFS * sum(qs) from a second per-dim sum, after the loop of quarters.
# VONES, the values' offsets: each tile's sum(p * sc) per row comes from the tensor cores as
# ones @ (p * sc), the same [accumulator rows, keys] x [keys, rows] product as the tile's values,
# so it lands in the value accumulators' layout: no conversion of p * sc back to fp32, no
# cross-lane sums.
# VMID, the values' mid-code: the accumulators sum p * sc * (code - VMID), with VMID * sc added to
# the group's min in the fp32 row sums instead. Each value is sc * code + mn, and a group's codes
# spread over 0..3, so summed over a split's keys sc * code grows with the keys while the output
# (a weighted mean of values that may cancel) does not: the tensor cores' accumulation then drops
# low bits of a sum up to ~100x the output. Centred, the accumulators stay of the output's order.
VMID = tl.constexpr(1.5)
BODY_OFS = tl.constexpr(128.0)
# Key operands are fp16: each block's q * s is rounded once for its keys, so its error does not
# average out over keys (bf16 was measurably less accurate; docs/design.md). fp16 needs
# |q * s| < 65,504. Code fields go under 1024's exponent (fp16 mantissa ulp 1):
# BODY_OFS_FP16 + code * place, one lop3 per two codes; quarter 3 is read where it lies (bits 6-7,
# place 64: 1024 + 3 * 64 fits fp16's 10-bit mantissa).
BODY_OFS_FP16 = tl.constexpr(1024.0)
LO16_MASK = tl.constexpr(("0x00030003", "0x000C000C", "0x00300030", "0x00C000C0"))
KEY16_EXP = tl.constexpr("0x64006400")
PACK16_BASE = tl.constexpr(0x6400)  # a packed 3-bit code c in [0, 8) as fp16 bits c | 0x6400: 1024 + c


@triton.jit
def _v_place(J: tl.constexpr, USE_ASM: tl.constexpr):
    """Place value of value quarter J's code in its byte-read operand (1 without USE_ASM: bare codes)."""
    if USE_ASM:
        r = v_scale(J)
    else:
        r = 1.0
    return r


@triton.jit
def _k_place(J: tl.constexpr):
    """Place value of 2-bit key quarter J's code in its operand."""
    return 4.0 ** J


@triton.jit
def _lo_operand(c16, J: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Quarter J of uint16-widened 2-bit codes as a key operand in DT, code * _k_place(J) plus the
    operand's offset (BODY_OFS_FP16 with DT fp16 on CUDA; none without USE_ASM: exact codes)."""
    if DT == tl.float16 and USE_ASM:
        # one lop3 per two codes: (c16 & MASK) | EXP as two fp16 halves
        r = tl.inline_asm_elementwise(
            "{.reg .b32 m, w; mov.b32 m, " + KEY16_EXP + "; mov.b32 w, $1;"
            + " lop3.b32 $0, w, " + LO16_MASK[J] + ", m, 0xEA;}",
            "=r,r", [c16], dtype=tl.float16, is_pure=True, pack=2)
    elif J == 3:
        tl.static_assert(not USE_ASM, "place-64 key operands are fp16's")
        r = (c16.to(tl.int32) & 0xC0).to(DT)
    else:
        r = quarter_v(c16, J, DT, USE_ASM)
    return r


@triton.jit
def _k_scale_ch(J: tl.constexpr, BITS: tl.constexpr, NIBBLES: tl.constexpr = False):
    """Scale of key quarter J's operand (its code field's place value)."""
    if NIBBLES:
        r = 16.0 if J >= 2 else 1.0
    elif BITS == 2:
        r = _k_place(J)
    else:
        r = 1.0
    return r


@triton.jit
def _key_operand(kc, kc2, hb, J: tl.constexpr, BITS: tl.constexpr, QD: tl.constexpr, DT: tl.constexpr,
                 USE_ASM: tl.constexpr):
    """Key quarter J of 2- or 3-bit keys (the quarter body; 4-bit keys take _nibble_operand) as an
    MMA operand [BLK, D/4] in DT: BODY_OFS_FP16 + code * _k_scale_ch(J, BITS) with USE_ASM (DT is
    then fp16), the exact code without (interpreter). kc / kc2 / hb: key_quarter's."""
    if USE_ASM:
        if BITS == 2:
            r = _lo_operand(widen(kc, USE_ASM), J, DT, USE_ASM)
        else:
            c = key_quarter(kc.to(tl.int32), kc2, hb.to(tl.int32), J, BITS, QD)
            r = (c | PACK16_BASE).to(tl.int16).to(tl.float16, bitcast=True)
        return r.to(DT)
    else:
        return key_quarter(kc.to(tl.int32), kc2.to(tl.int32), hb.to(tl.int32), J, BITS, QD).to(DT)


# PLANES (3-bit keys, head_dim >= PLANES_MIN_DIM): the 2-bit plane (bytes 0..D/4-1) is read
# exactly as 2-bit keys, one eighth of the row (D/8 dims, the MMA's K of 16 at D=128) at a time:
# eighth E is quarter E // 2 of bytes (E % 2) * D/8 .. +D/8-1. The 1-bit plane (bytes
# D/4..3D/8-1, "eighth split": byte i holds bit 2 of dim i + E * D/8 at bit E) gives eighth E's
# high bit. Both are merged into one fp16 operand with no exponent bits (SUB3): eighth E's 2-bit
# field (quarter J = E // 2 of the widened 2-bit plane, bits 2J..2J+1) and its 1-bit plane bit
# (bit E of the widened bytes, shifted to bit 2J + 2) by an and and a lop3 per two codes: the
# subnormal (code + 4 * bit) * 4^J * 2^-24, exact (bits up to 8 < fp16's 10 mantissa bits). One
# MMA an eighth and no offsets (no per-dim sum of the rounded q * s); q is divided by 4^J and the
# tile's sums, in units of 2^-24, are scaled by NIB_SCALE with the softmax scale.
HI_BIT_MASK = tl.constexpr(("0x00040004", "0x00100010", "0x00400040", "0x01000100"))


@triton.jit
def _sub3_operand(lo, hi2, hi1, E: tl.constexpr, USE_ASM: tl.constexpr):
    """Eighth E's one operand (SUB3): quarter E // 2's 2-bit field of lo with the 1-bit plane's bit E
    (of hi2 = bytes << 2 for even E, hi1 = bytes << 1 for odd: at bit 2J + 2) right above it, no
    exponent bits: the fp16 subnormal (code + 4 * bit) * 4^J * 2^-24 on CUDA (an and and a lop3 per
    two codes); without USE_ASM the same field as an exact number, (code + 4 * bit) * 4^J."""
    J: tl.constexpr = E // 2
    h = hi2 if E % 2 == 0 else hi1
    if USE_ASM:
        r = tl.inline_asm_elementwise(
            "{.reg .b32 t; and.b32 t, $2, " + HI_BIT_MASK[J] + "; lop3.b32 $0, $1, " + LO16_MASK[J] + ", t, 0xEA;}",
            "=r,r,r", [lo, h], dtype=tl.float16, is_pure=True, pack=2)
    else:
        r = ((lo.to(tl.int32) & (3 << (2 * J))) | (h.to(tl.int32) & (4 << (2 * J)))).to(tl.float32)
    return r


SHL16 = tl.constexpr(("shl.b32 $0, $1, 0;", "shl.b32 $0, $1, 1;", "shl.b32 $0, $1, 2;"))


@triton.jit
def _shl16(x, N: tl.constexpr):
    """uint16-widened bytes shifted left by N (1 or 2) in place: one shl per two (no carry between
    halves: bits 8-15 of each are zero)."""
    return tl.inline_asm_elementwise(SHL16[N], "=r,r", [x], dtype=tl.uint16, is_pure=True, pack=2)


# NIBBLES (4-bit keys): the quarter body (key_quarter's half split: quarter J is nibble J // 2 of
# bytes (J % 2) * D/4 .. +D/4-1) with each nibble masked in place and no exponent: the fp16
# subnormal code * place * 2^-24 (place 1 low, 16 high), exact, one `and` per two codes. So there
# is no operand offset to take off and no shift of the high nibble; q is divided by the place
# (exact) and the tile's sums, in units of 2^-24, are scaled by NIB_SCALE with the rest of the
# scores. The tensor cores take the subnormals exactly. The edge blocks get their own masked loop,
# as 3-bit keys do, pipelined NIB_EDGE_STAGES deep, so that its copy buffers fit the body loop's
# shared memory (at the body's INT2_STAGES they left 7 programs an SM instead of 8).
NIB_MASK = tl.constexpr(("0x000F000F", "0x00F000F0"))
NIB_SCALE = tl.constexpr(16777216.0)  # 2^24: an fp16 subnormal's unit is 2^-24
NIB_EDGE_STAGES = tl.constexpr(4)


@triton.jit
def _nibble_operand(w16, H: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Nibble H (0 low, 1 high) of uint16-widened bytes as an MMA operand in DT: with USE_ASM the
    fp16 subnormal code * 16^H * 2^-24 (one and per two codes); without, code * 16^H exactly."""
    if USE_ASM:
        r = tl.inline_asm_elementwise("and.b32 $0, $1, " + NIB_MASK[H] + ";", "=r,r", [w16], dtype=tl.float16,
                                      is_pure=True, pack=2)
    else:
        r = (w16.to(tl.int32) & (15 << (4 * H))).to(DT)
    return r


# SCORE_FOLD: a tile's scores are its MMA sums st plus a row constant rcv (the keys' mins term, a
# per-block constant), times the softmax scale for the 3-bit planes. The max is taken over st and
# rcv added to the row's max (rounding is monotonic: the same maximum as over st + rcv), and
# exp2's argument is one multiply-add of st with the per-row (rcv * scale - max), instead of an
# add and a multiply per score before the max and a subtraction after it.
@triton.jit
def _scaled(x, s, SCALED: tl.constexpr):
    if SCALED:
        r = x * s
    else:
        r = x
    return r


@triton.jit
def _decode_body(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, t_lo, t_hi, n_head, jz, n_a, start_b, ring_lo,
                 sink_lo, sink_hi, idx_base, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                 sm_scale_log2, logit_cap, qrow,
                 D: tl.constexpr, DV: tl.constexpr, BITS: tl.constexpr, BLK: tl.constexpr, GV: tl.constexpr,
                 BLOCK_M: tl.constexpr, LOGIT_CAP: tl.constexpr, PV_DT: tl.constexpr, USE_ASM: tl.constexpr,
                 STAGES: tl.constexpr, PLANES: tl.constexpr, VWORDS: tl.constexpr, KWORDS: tl.constexpr,
                 MASKED: tl.constexpr, NIBBLES: tl.constexpr):
    """Decode's quantised body blocks (see _key_operand's note), continuing the BF16 loops' softmax
    state (row-major a0..a3 [rows, Dv/4]); returns it in the same form. Blocks: jb in [t_lo, t_hi)
    whose every position is a body position, without masks (MASKED False); or, MASKED, the edge
    blocks t in [t_lo, t_hi) -> jb = t below n_head, jz + t - n_head from there, every position
    masked to the body's (channel_kernel's split of the blocks). PLANES
    (3 bits, D >= 128): one subnormal operand an eighth for both planes (PLANES' note), q^T read
    again in eighths from qrow (pointers to the rows' q) and kept in PV_DT, the softmax scale
    applied per tile. VWORDS (Dv >= 128) / KWORDS (2-bit keys, D >= 128): VCh / KCh are int16 views
    of the value / key codes (strides in words), read as 16-bit code words (core_codes.word_code);
    with KWORDS q^T is read in the 8 extractions' dims from qrow. Below 128 the codes are read as
    bytes. NIBBLES (4-bit keys): the quarter body with subnormal nibble operands (NIBBLES' note);
    otherwise the quarter body takes _key_operand's fp16 offset operands."""
    QD: tl.constexpr = D // 4
    QDV: tl.constexpr = DV // 4
    QW: tl.constexpr = D // 8
    QWV: tl.constexpr = DV // 8
    # code-word operands are fp16 (their exponent trick); fp32 in the interpreter
    WDT: tl.constexpr = tl.float32 if PV_DT == tl.float32 else tl.float16
    VDT: tl.constexpr = WDT if VWORDS else PV_DT
    VCOLS: tl.constexpr = QWV if VWORDS else QDV
    D8: tl.constexpr = D // 8
    OFS: tl.constexpr = BODY_OFS if USE_ASM else 0.0
    # the key side's operands (q * s and the codes): fp16 with its own offset; fp32 in the
    # interpreter, as PV_DT (the CPU tests' float64 bounds stay tight)
    KDT: tl.constexpr = tl.float16 if PV_DT != tl.float32 else PV_DT
    KOFS: tl.constexpr = BODY_OFS_FP16 if USE_ASM else 0.0
    QSC = 1.0 if LOGIT_CAP else sm_scale_log2
    # the scores' scale: the 3-bit planes apply the softmax scale per tile (their q stays q / place
    # value), the other bodies fold it into q; the subnormal operands' sums (NIBBLES, SUB3) are in
    # units of 2^-24 on CUDA
    SUB: tl.constexpr = NIBBLES or PLANES  # subnormal key operands
    NSC: tl.constexpr = NIB_SCALE if SUB and USE_ASM else 1.0
    # the quarter body's q carries its operands' places on CUDA (NIBBLES: in the interpreter too,
    # whose nibble operands carry the same places)
    PLC: tl.constexpr = USE_ASM or NIBBLES
    SSC = NSC if NIBBLES else (QSC * NSC if PLANES else 1.0)
    TILE_SC: tl.constexpr = PLANES or NIBBLES  # SSC is applied per tile (else it is 1)
    if PLANES:
        # q^T eighths [D/8, rows] in PV_DT, each divided by its key quarter's place value (a power
        # of two: exact), so that q * s needs no scale of its own (ROWC's note)
        d8 = tl.arange(0, D8)
        qe = qrow[None, :] + d8[:, None]
        qe0 = (tl.load(qe).to(tl.float32) * (1.0 / _k_place(0))).to(PV_DT)
        qe1 = (tl.load(qe + D8).to(tl.float32) * (1.0 / _k_place(0))).to(PV_DT)
        qe2 = (tl.load(qe + 2 * D8).to(tl.float32) * (1.0 / _k_place(1))).to(PV_DT)
        qe3 = (tl.load(qe + 3 * D8).to(tl.float32) * (1.0 / _k_place(1))).to(PV_DT)
        qe4 = (tl.load(qe + 4 * D8).to(tl.float32) * (1.0 / _k_place(2))).to(PV_DT)
        qe5 = (tl.load(qe + 5 * D8).to(tl.float32) * (1.0 / _k_place(2))).to(PV_DT)
        qe6 = (tl.load(qe + 6 * D8).to(tl.float32) * (1.0 / _k_place(3))).to(PV_DT)
        qe7 = (tl.load(qe + 7 * D8).to(tl.float32) * (1.0 / _k_place(3))).to(PV_DT)
    elif KWORDS:
        # q^T at the 8 extractions' dims [D/8, rows] in fp32, the softmax scale folded in
        qw0 = tl.load(qrow[None, :] + word_dims(0, QW)[:, None]).to(tl.float32) * QSC
        qw1 = tl.load(qrow[None, :] + word_dims(1, QW)[:, None]).to(tl.float32) * QSC
        qw2 = tl.load(qrow[None, :] + word_dims(2, QW)[:, None]).to(tl.float32) * QSC
        qw3 = tl.load(qrow[None, :] + word_dims(3, QW)[:, None]).to(tl.float32) * QSC
        qw4 = tl.load(qrow[None, :] + word_dims(4, QW)[:, None]).to(tl.float32) * QSC
        qw5 = tl.load(qrow[None, :] + word_dims(5, QW)[:, None]).to(tl.float32) * QSC
        qw6 = tl.load(qrow[None, :] + word_dims(6, QW)[:, None]).to(tl.float32) * QSC
        qw7 = tl.load(qrow[None, :] + word_dims(7, QW)[:, None]).to(tl.float32) * QSC
    else:
        # q^T quarters [D/4, rows] in fp32, the softmax scale folded in (unless capped) and each
        # divided by its key operands' scale (a power of two: exact; ROWC's note)
        q0t = tl.trans(q0.to(tl.float32) * (QSC / _k_scale_ch(0, BITS, NIBBLES) if PLC else QSC))
        q1t = tl.trans(q1.to(tl.float32) * (QSC / _k_scale_ch(1, BITS, NIBBLES) if PLC else QSC))
        q2t = tl.trans(q2.to(tl.float32) * (QSC / _k_scale_ch(2, BITS, NIBBLES) if PLC else QSC))
        q3t = tl.trans(q3.to(tl.float32) * (QSC / _k_scale_ch(3, BITS, NIBBLES) if PLC else QSC))
    # value accumulators transposed, in operand units (as token_decode): bytes [Dv/4, rows] per quarter
    # (a'_j = vs_j a_j), or code words [Dv/8, rows] per extraction (x_j: quarter j's even dims,
    # x_{4+j}: its odd dims, scale 1); per quarter the per-row sums sum(p * mn), sum(p * sc) of its
    # value group, added after the loop
    if VWORDS:
        x0, x4 = words_of_quarter(a0, QWV, BLOCK_M)
        x1, x5 = words_of_quarter(a1, QWV, BLOCK_M)
        x2, x6 = words_of_quarter(a2, QWV, BLOCK_M)
        x3, x7 = words_of_quarter(a3, QWV, BLOCK_M)
    else:
        a0 = tl.trans(a0 * v_scale(0) if USE_ASM else a0)
        a1 = tl.trans(a1 * v_scale(1) if USE_ASM else a1)
        a2 = tl.trans(a2 * v_scale(2) if USE_ASM else a2)
        a3 = tl.trans(a3 * v_scale(3) if USE_ASM else a3)
    zero = tl.zeros([BLOCK_M], tl.float32)
    bm0, bm1, bm2, bm3 = zero, zero, zero, zero
    # the A operand of each value group's sum(p * sc) per row (VONES), [accumulator rows, keys]
    ones_v = tl.full([VCOLS, BLK], 1.0, VDT)
    offs = tl.arange(0, BLK)
    dq = tl.arange(0, QD)
    for t in tl.range(t_lo, t_hi, num_stages=STAGES):
        if MASKED:
            jb = tl.where(t < n_head, t, jz + t - n_head)
        else:
            jb = t
        blk = tl.where(jb < n_a, jb, jb - n_a + start_b)
        if MASKED:
            p = blk * BLK + offs
            body = (p < ring_lo) & ((p < sink_lo) | (p >= sink_hi))
        # a block is a page (see the extend loop below): its slots are page * BLK + offs, so the
        # tile needs one index load instead of a gather of BLK, and its addresses are affine
        page = (tl.load(idx_base + blk * BLK) // BLK).to(tl.int64)
        slot = page * BLK + offs
        kcb = KCh + slot[:, None] * stride_kcn
        # value codes transposed: [Dv/4 bytes, keys], or [Dv/8 words, keys] with VWORDS
        vct = tl.load(VCh + slot[None, :] * stride_vcn + tl.arange(0, VCOLS)[:, None])
        if PLANES:
            # the two halves of the 2-bit plane and the 1-bit plane, D/8 bytes each per key
            d8 = tl.arange(0, D8)
            lo_a = widen(tl.load(kcb + d8[None, :]), USE_ASM)
            lo_b = widen(tl.load(kcb + D8 + d8[None, :]), USE_ASM)
            hi16 = widen(tl.load(kcb + QD + d8[None, :]), USE_ASM)
            if USE_ASM:
                hi1 = _shl16(hi16, 1)
                hi2 = _shl16(hi16, 2)
            else:
                hi1 = (hi16.to(tl.int32) << 1)
                hi2 = (hi16.to(tl.int32) << 2)
            kpb = KPh + page * stride_kpn + d8
            # per-dim terms of the row constant: (q / place) . m, Horner over the quarters' place
            # values (the subnormal operands have no offsets)
            qc = tl.zeros([D8, BLOCK_M], tl.float32)
            part = tl.zeros([BLK, BLOCK_M], tl.float32)
            for e in tl.static_range(7, -1, -1):  # quarters 3 to 0
                if e % 2 == 1 and e < 7:
                    qc = qc * (_k_place(e // 2 + 1) / _k_place(e // 2))
                sc, mn = unpack_params(tl.load(kpb + e * D8))
                qet = pick8(e, qe0, qe1, qe2, qe3, qe4, qe5, qe6, qe7).to(tl.float32)  # q / place value
                qs = (qet * sc[:, None]).to(KDT)  # both planes: q * s / place value
                lo = lo_a if e % 2 == 0 else lo_b
                # one subnormal operand for both planes (SUB3)
                part = tl.dot(_sub3_operand(lo, hi2, hi1, e, USE_ASM).to(KDT), qs, part)
                qc += qet * mn[:, None]
            st = part
            rcv = tl.sum(qc, 0) * (1.0 / NSC)  # in the sums' units
        elif KWORDS:
            kw = tl.load(kcb + tl.arange(0, QW)[None, :])  # [keys, D/8 words]
            kpb = KPh + page * stride_kpn
            # s^T = sum_P extraction_P @ (q_P * s_P)^T + row constant (extraction scale 1)
            qc = tl.zeros([QW, BLOCK_M], tl.float32)  # q . m
            qo = tl.zeros([QW, BLOCK_M], tl.float32)  # the offsets' share
            part = tl.zeros([BLK, BLOCK_M], tl.float32)
            for e in tl.static_range(8):
                sc, mn = unpack_params(tl.load(kpb + word_dims(e, QW)))
                qpt = pick8(e, qw0, qw1, qw2, qw3, qw4, qw5, qw6, qw7)
                qs = (qpt * sc[:, None]).to(WDT)
                part = tl.dot(word_code(kw, e, WDT, USE_ASM), qs, part)
                qc += qpt * mn[:, None]
                qo += word_ofs(e, USE_ASM) * qs.to(tl.float32)  # from the rounded qs: exact removal
            st = part
            rcv = tl.sum(qc - qo, 0)
        else:
            kc = tl.load(kcb + dq[None, :])
            kc2 = kc
            hb = kc
            if BITS == 3:
                hb = tl.load(kcb + QD + (dq % (QD // 2))[None, :])
            if BITS == 4:
                kc2 = tl.load(kcb + QD + dq[None, :])
            kpb = KPh + page * stride_kpn + dq
            # scores s^T [keys, rows] = sum_j op_j @ (q_j / ks_j * s_j)^T + row constant (ROWC)
            qc = tl.zeros([QD, BLOCK_M], tl.float32)  # (q / ks) . m, Horner over the quarters' ks
            qo = tl.zeros([QD, BLOCK_M], tl.float32)  # the offsets' qs
            part = tl.zeros([BLK, BLOCK_M], tl.float32)
            for j in tl.static_range(3, -1, -1):
                if j < 3 and PLC:
                    if _k_scale_ch(j + 1, BITS, NIBBLES) != _k_scale_ch(j, BITS, NIBBLES):
                        qc = qc * (_k_scale_ch(j + 1, BITS, NIBBLES) / _k_scale_ch(j, BITS, NIBBLES))
                sc, mn = unpack_params(tl.load(kpb + j * QD))
                qjt = pick4(j, q0t, q1t, q2t, q3t)  # q / ks
                qs = (qjt * sc[:, None]).to(KDT)
                if NIBBLES:  # no offsets (NIBBLES' note)
                    op = _nibble_operand(widen(kc if j % 2 == 0 else kc2, USE_ASM), j // 2, KDT, USE_ASM)
                    part = tl.dot(op, qs, part)
                else:
                    part = tl.dot(_key_operand(kc, kc2, hb, j, BITS, QD, KDT, USE_ASM), qs, part)
                    qo += qs.to(tl.float32)  # from the rounded qs: exact removal
                qc += qjt * mn[:, None]
            st = part
            if NIBBLES:
                rcv = tl.sum(qc, 0) * (1.0 / NSC)  # in the sums' units
            else:
                rcv = tl.sum(qc - KOFS * qo, 0)
        # scores: (st + rcv) * SSC, rcv the tile's row constant (SCORE_FOLD)
        if LOGIT_CAP:
            st = cap_and_scale(_scaled(st + rcv[None, :], NSC, SUB), sm_scale_log2, logit_cap, LOGIT_CAP)
            if MASKED:
                st = tl.where(body[:, None], st, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(st, 0))
            pt = tl.exp2(st - m_new[None, :])
        else:
            if MASKED:
                st = tl.where(body[:, None], st, float("-inf"))
            m_new = tl.maximum(m_i, _scaled(tl.max(st, 0) + rcv, SSC, TILE_SC))
            pt = tl.exp2(_scaled(st, SSC, TILE_SC) + (_scaled(rcv, SSC, TILE_SC) - m_new)[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(pt, 0)
        m_i = m_new
        al = alpha[None, :]
        if not VWORDS:
            v16 = vct.to(tl.uint16)
        for j in tl.static_range(4):
            if (j * QDV) % GV == 0:  # first quarter of a value group: p * scale, row sums
                vsc, vmn = unpack_params(tl.load(VPh + slot * stride_vpn + (j * QDV) // GV))
                # masked lanes (the page's sink / ring positions) get p = 0; zeroed params keep
                # anything non-finite there out of the output (0 * NaN)
                if MASKED:
                    vsc = tl.where(body, vsc, 0.0)
                    vmn = tl.where(body, vmn, 0.0)
                pst = (pt * vsc[:, None]).to(VDT)
                # the accumulators hold p * sc * (code - VMID) (VMID's note): the mid-code's share
                # goes with the mins into the fp32 row sums
                gmn = tl.sum(pt * (vmn + VMID * vsc)[:, None], 0)
                # the operands' offsets (and VMID) times this tile's sum(p sc) (of the rounded p *
                # sc) come off each accumulator before the tile's MMA adds them: removed once after
                # the loop they would leave fp32 sums far above the output to cancel, an error
                # growing with the tiles a split walks (tests/gpu/test_long_decode.py). The sums
                # come from the tensor cores (VONES' note).
                gs = tl.dot(ones_v, pst)
            if VWORDS:  # quarter j = extractions j (even dims) and 4 + j (odd dims)
                if j == 0:
                    x0 = tl.dot(word_code(vct, 0, VDT, USE_ASM), pst, x0 * al - (word_ofs(0, USE_ASM) + VMID) * gs)
                    x4 = tl.dot(word_code(vct, 4, VDT, USE_ASM), pst, x4 * al - (word_ofs(4, USE_ASM) + VMID) * gs)
                elif j == 1:
                    x1 = tl.dot(word_code(vct, 1, VDT, USE_ASM), pst, x1 * al - (word_ofs(1, USE_ASM) + VMID) * gs)
                    x5 = tl.dot(word_code(vct, 5, VDT, USE_ASM), pst, x5 * al - (word_ofs(5, USE_ASM) + VMID) * gs)
                elif j == 2:
                    x2 = tl.dot(word_code(vct, 2, VDT, USE_ASM), pst, x2 * al - (word_ofs(2, USE_ASM) + VMID) * gs)
                    x6 = tl.dot(word_code(vct, 6, VDT, USE_ASM), pst, x6 * al - (word_ofs(6, USE_ASM) + VMID) * gs)
                else:
                    x3 = tl.dot(word_code(vct, 3, VDT, USE_ASM), pst, x3 * al - (word_ofs(3, USE_ASM) + VMID) * gs)
                    x7 = tl.dot(word_code(vct, 7, VDT, USE_ASM), pst, x7 * al - (word_ofs(7, USE_ASM) + VMID) * gs)
            else:
                if USE_ASM:
                    op = quarter_v(v16, j, PV_DT, USE_ASM)
                else:
                    op = ((vct >> (2 * j)) & 3).to(PV_DT)
                if j == 0:
                    a0 = tl.dot(op, pst, a0 * al - (OFS + VMID * _v_place(0, USE_ASM)) * gs)
                elif j == 1:
                    a1 = tl.dot(op, pst, a1 * al - (OFS + VMID * _v_place(1, USE_ASM)) * gs)
                elif j == 2:
                    a2 = tl.dot(op, pst, a2 * al - (OFS + VMID * _v_place(2, USE_ASM)) * gs)
                else:
                    a3 = tl.dot(op, pst, a3 * al - (OFS + VMID * _v_place(3, USE_ASM)) * gs)
            if j == 0:
                bm0 = bm0 * alpha + gmn
            elif j == 1:
                bm1 = bm1 * alpha + gmn
            elif j == 2:
                bm2 = bm2 * alpha + gmn
            else:
                bm3 = bm3 * alpha + gmn
    if VWORDS:
        # quarter j = its even and odd dims interleaved, each x + sum(p mn)
        a0 = quarter_of_words(x0, x4, bm0, QDV, BLOCK_M)
        a1 = quarter_of_words(x1, x5, bm1, QDV, BLOCK_M)
        a2 = quarter_of_words(x2, x6, bm2, QDV, BLOCK_M)
        a3 = quarter_of_words(x3, x7, bm3, QDV, BLOCK_M)
    else:
        # a_j = a'_j / vs_j + sum(p mn) (offsets taken off per tile), back to row-major [rows, Dv/4]
        a0 = tl.trans(a0 * (1.0 / v_scale(0) if USE_ASM else 1.0) + bm0[None, :])
        a1 = tl.trans(a1 * (1.0 / v_scale(1) if USE_ASM else 1.0) + bm1[None, :])
        a2 = tl.trans(a2 * (1.0 / v_scale(2) if USE_ASM else 1.0) + bm2[None, :])
        a3 = tl.trans(a3 * (1.0 / v_scale(3) if USE_ASM else 1.0) + bm3[None, :])
    return m_i, l_i, a0, a1, a2, a3


# num_mb (query blocks per KV head, extend only) follows the longest new-token run of the batch: a
# runtime argument, as in token_attend.attend_kernel (a constexpr would compile a kernel per chunk length);
# MAX_SPLITS too (an extend splits its prefix only sometimes: 1 would otherwise compile another
# kernel on the first split call, a cold start in the middle of serving)
NOT_SPECIALIZED = ("num_mb", "MAX_SPLITS")


@triton.jit(do_not_specialize=list(NOT_SPECIALIZED))
def channel_kernel(
    Q, stride_qt, stride_qh,
    Out, stride_ot, stride_oh, stride_os,
    Lse, stride_lt, stride_lh, stride_ls,
    KC, stride_kcn, stride_kch,
    KP, stride_kpn, stride_kph,
    VC, stride_vcn, stride_vch,
    VP, stride_vpn, stride_vph,
    SK, stride_skr, stride_skp, stride_skh,
    SV, stride_svr, stride_svp, stride_svh,
    RK, stride_rkr, stride_rkp, stride_rkh,
    RV, stride_rvr, stride_rvp, stride_rvh,
    kv_indptr, kv_indices, qo_indptr, req_rows, own_start, sink_start, num_kv_splits,
    sm_scale_log2, logit_cap, MAX_SPLITS, num_mb,
    GQA: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BITS: tl.constexpr, BLK: tl.constexpr,
    GV: tl.constexpr, S: tl.constexpr, W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT: tl.constexpr, HAS_NSPLITS: tl.constexpr,
    MIN_CHUNK: tl.constexpr, LOGIT_CAP: tl.constexpr, PV_DT: tl.constexpr, NB16: tl.constexpr,
    USE_ASM: tl.constexpr = False, STAGES: tl.constexpr = 2, PLANES: tl.constexpr = False,
    VWORDS: tl.constexpr = False, KWORDS: tl.constexpr = False,
    MERGE: tl.constexpr = False, MERGE_ROWS: tl.constexpr = 1, SPLITS_P2: tl.constexpr = 1,
    NIBBLES: tl.constexpr = False, Final=None, stride_fb=0, stride_fh=0, Arrived=None,
):
    """SPLIT (decode): grid (B, Hkv, max splits), one query token per request (token b), rows =
    the GQA group; qo_indptr / num_mb unused. Not SPLIT (extend-prefix): grid (B, Hkv * num_mb,
    MAX_SPLITS), rows = BLOCK_M (token, query head) pairs of query block mb of request b's tokens
    qo_indptr[b]:qo_indptr[b+1]; split 0 walks the sink and the ring, and split s the s-th of
    MAX_SPLITS equal chunks of the body blocks (one program walks everything at MAX_SPLITS = 1);
    each writes its normalised partial output and LSE at its split index (merge_extend_splits
    combines them); num_kv_splits is unused."""
    QD: tl.constexpr = D // 4
    QDV: tl.constexpr = DV // 4
    # the extend's MMA operands (q, dequantised keys and values, p): fp16 on CUDA, more accurate
    # than bf16 on outlier channels for little time (docs/design.md); |q|, |k|, |v| stay far below
    # fp16's 65504
    DQ_DT: tl.constexpr = tl.float16 if PV_DT == tl.bfloat16 else PV_DT
    b = tl.program_id(0)
    if SPLIT:
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        # launch order: grid z runs the body splits first, the BF16 splits (short programs) last
        split = tl.where(split < MAX_SPLITS - NB16, split + NB16, split - (MAX_SPLITS - NB16))
    else:
        pid1 = tl.program_id(1)
        kvh = pid1 // num_mb
        mb = pid1 % num_mb
        tok0 = tl.load(qo_indptr + b)
        n_tok = tl.load(qo_indptr + b + 1) - tok0
        if mb * BLOCK_M >= n_tok * GQA:
            return
        split = tl.program_id(2)

    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    row = tl.load(req_rows + b).to(tl.int64)
    own = tl.load(own_start + row)  # per-request state is indexed by request row
    sink_own = tl.load(sink_start + row)
    sink_lo, sink_hi, ring_lo, n_body = source_ranges(kv_len, own, sink_own, S, W)
    if SPLIT:
        n_splits = num_splits_of(n_body, b, num_kv_splits, HAS_NSPLITS, MAX_SPLITS, MIN_CHUNK, NB16)
        if split >= n_splits:
            return
        _, _, s_lo, s_hi, r_lo, r_hi = split_ranges(
            split, n_splits, n_body, sink_lo, sink_hi, ring_lo, kv_len, BLK, NB16)
    else:  # the BF16 keys are split 0's
        first = split == 0
        s_lo = tl.where(first, sink_lo, 0)
        s_hi = tl.where(first, sink_hi, 0)
        r_lo = tl.where(first, ring_lo, 0)
        r_hi = tl.where(first, kv_len, 0)

    # body blocks: list A holds [0, hi_a), list B [sink_hi, ring_lo); see module docstring
    hi_a = tl.minimum(sink_lo, ring_lo)
    n_a = tl.cdiv(hi_a, BLK)
    start_b = tl.maximum(sink_hi // BLK, n_a)
    n_b = tl.where(ring_lo > sink_hi, tl.maximum(tl.cdiv(ring_lo, BLK) - start_b, 0), 0)
    n_blk = n_a + n_b
    if SPLIT:
        # Blocks whose every position is a body position, [fa, fz) (list B's inside [sink_hi,
        # ring_lo)), are shared by splits NB16.. (num_splits_of leaves >= 1 of them) and walked
        # without the body masks; the others (at most the sink's and the ring's edge blocks, and
        # list A) go to BF16 split 0, masked: the body loop runs without the masks' instructions,
        # and the two loops in different programs' branches fit the registers without spills.
        fa = tl.minimum(tl.maximum(n_a + tl.cdiv(sink_hi, BLK) - start_b, n_a), n_blk)
        fz = tl.minimum(tl.maximum(n_a + ring_lo // BLK - start_b, fa), n_blk)
        chunk = tl.cdiv(fz - fa, n_splits - NB16)
        j_lo = tl.where(split >= NB16, tl.minimum(fa + (split - NB16) * chunk, fz), 0)
        j_hi = tl.where(split >= NB16, tl.minimum(j_lo + chunk, fz), 0)
        n_edge = tl.where(split == 0, fa + n_blk - fz, 0)
    else:
        chunk = tl.cdiv(n_blk, MAX_SPLITS)
        j_lo = tl.minimum(split * chunk, n_blk)
        j_hi = tl.minimum(j_lo + chunk, n_blk)

    # ---- query rows: (token, query head) pairs, row m -> token m // GQA, head kvh * GQA + m % GQA
    if SPLIT:  # decode: one token per request, rows = the GQA group
        rows = tl.arange(0, BLOCK_M)
        hq = kvh * GQA + rows % GQA
        rmask = rows < GQA
        tok = b.to(tl.int64)
        tok_col = tok  # a scalar: the addresses below are decode's own
    else:
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        t = rows // GQA
        hq = kvh * GQA + rows % GQA
        rmask = t < n_tok
        tok = (tok0 + t).to(tl.int64)
        tok_col = tok[:, None]
    dq = tl.arange(0, QD)
    qb = Q + tok_col * stride_qt + hq[:, None] * stride_qh + dq[None, :]
    if SPLIT:  # rows >= GQA repeat heads of the group (rows % GQA): valid, never stored
        q0, q1, q2, q3 = load_q_quarters(qb, rows >= 0, QD, PV_DT)
    else:
        q0, q1, q2, q3 = load_q_quarters(qb, rmask, QD, PV_DT)

    m_i, l_i, a0, a1, a2, a3 = empty_softmax_state(BLOCK_M, QDV)

    # ---- BF16 sink and ring ----------------------------------------------------------------------
    m_i, l_i, a0, a1, a2, a3 = bf16_sink_ring(
        s_lo, s_hi, r_lo, r_hi, row, kvh,
        SK, stride_skr, stride_skp, stride_skh, SV, stride_svr, stride_svp, stride_svh,
        RK, stride_rkr, stride_rkp, stride_rkh, RV, stride_rvr, stride_rvp, stride_rvh,
        q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, sm_scale_log2, logit_cap,
        W, QD, QDV, BLOCK_B, LOGIT_CAP, PV_DT)

    # ---- quantised body, one page block per tile -----------------------------------------------
    offs = tl.arange(0, BLK)
    dv = tl.arange(0, QDV)
    kvh64 = kvh.to(tl.int64)  # head-major pool: kvh * stride can pass 2^31
    KCh = KC + kvh64 * stride_kch
    KPh = KP + kvh64 * stride_kph
    VCh = VC + kvh64 * stride_vch
    VPh = VP + kvh64 * stride_vph
    idx_base = kv_indices + kv_start
    if SPLIT:
        if split < NB16:  # the edge blocks (split 0's), masked
            m_i, l_i, a0, a1, a2, a3 = _decode_body(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, 0, n_edge, fa, fz, n_a, start_b, ring_lo,
                sink_lo, sink_hi, idx_base, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                sm_scale_log2, logit_cap, Q + tok * stride_qt + hq * stride_qh,
                D, DV, BITS, BLK, GV, BLOCK_M, LOGIT_CAP, PV_DT, USE_ASM,
                NIB_EDGE_STAGES if NIBBLES else STAGES, PLANES, VWORDS, KWORDS, True, NIBBLES)
        else:
            m_i, l_i, a0, a1, a2, a3 = _decode_body(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, j_lo, j_hi, 0, 0, n_a, start_b, ring_lo,
                sink_lo, sink_hi, idx_base, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                sm_scale_log2, logit_cap, Q + tok * stride_qt + hq * stride_qh,
                D, DV, BITS, BLK, GV, BLOCK_M, LOGIT_CAP, PV_DT, USE_ASM, STAGES, PLANES, VWORDS, KWORDS,
                False, NIBBLES)
    else:  # extend: the body blocks [j_lo, j_hi), dequantised page by page
        # the q operands, converted once for every page
        q0 = q0.to(DQ_DT)
        q1 = q1.to(DQ_DT)
        q2 = q2.to(DQ_DT)
        q3 = q3.to(DQ_DT)
        for jb in range(j_lo, j_hi):
            blk = tl.where(jb < n_a, jb, jb - n_a + start_b)
            p = blk * BLK + offs
            body = (p < ring_lo) & ((p < sink_lo) | (p >= sink_hi))
            # blocks are pages: the block's first position (always < kv_len) names its page, and its
            # positions are the page's BLK consecutive slots, so the tile's addresses are affine
            # (vectorised loads, no per-token index gather). Masked lanes read their page's own
            # slots and get -inf scores and zero value params.
            page = (tl.load(idx_base + blk * BLK) // BLK).to(tl.int64)
            slot = page * BLK + offs
            kcb = KCh + slot[:, None] * stride_kcn
            kc = tl.load(kcb + dq[None, :]).to(tl.int32)
            kc2 = kc
            hb = kc
            if BITS == 3:
                hb = tl.load(kcb + QD + (dq % (QD // 2))[None, :]).to(tl.int32)
            if BITS == 4:
                kc2 = tl.load(kcb + QD + dq[None, :]).to(tl.int32)
            qk = tl.zeros([BLOCK_M, BLK], tl.float32)
            for j in tl.static_range(4):
                sc, mn = unpack_params(tl.load(KPh + page * stride_kpn + j * QD + dq))
                # the page's keys dequantised once ([BLK, D/4] per quarter), then q . k: the cost is the
                # tile's keys, not the tile's query rows (BLOCK_M >= BLK)
                kj = dequant_codes(key_quarter(kc, kc2, hb, j, BITS, QD), sc, mn, 0, DQ_DT)
                qk = tl.dot(pick4(j, q0, q1, q2, q3), tl.trans(kj), qk)  # q: DQ_DT already
            s = cap_and_scale(qk, sm_scale_log2, logit_cap, LOGIT_CAP)
            s = tl.where(body[None, :], s, float("-inf"))
            pr, alpha, m_i, l_i = online_softmax(s, m_i, l_i)

            vc = tl.load(VCh + slot[:, None] * stride_vcn + dv[None, :])
            a0 = a0 * alpha[:, None]
            a1 = a1 * alpha[:, None]
            a2 = a2 * alpha[:, None]
            a3 = a3 * alpha[:, None]
            prd = pr.to(DQ_DT)
            for j in tl.static_range(4):
                if (j * QDV) % GV == 0:  # first quarter of a value group: its per-token params
                    vsc, vmn = unpack_params(tl.load(VPh + slot * stride_vpn + (j * QDV) // GV))
                    # masked lanes (the page's sink / ring positions) get p = 0; zeroed params keep
                    # anything non-finite there out of the output (0 * NaN)
                    vsc = tl.where(body, vsc, 0.0)
                    vmn = tl.where(body, vmn, 0.0)
                # the page's values dequantised once, then p @ v
                vj = dequant_codes((vc.to(tl.int32) >> (2 * j)) & 3, vsc, vmn, 1, DQ_DT)
                upd = tl.dot(prd, vj)
                if j == 0:
                    a0 += upd
                elif j == 1:
                    a1 += upd
                elif j == 2:
                    a2 += upd
                else:
                    a3 += upd

    # ---- normalised partial output + LSE -----------------------------------------------------
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    ob = Out + tok_col * stride_ot + hq[:, None] * stride_oh + split * stride_os + dv[None, :]
    tl.store(ob, a0 * inv_l[:, None], mask=rmask[:, None])
    tl.store(ob + QDV, a1 * inv_l[:, None], mask=rmask[:, None])
    tl.store(ob + 2 * QDV, a2 * inv_l[:, None], mask=rmask[:, None])
    tl.store(ob + 3 * QDV, a3 * inv_l[:, None], mask=rmask[:, None])
    tl.store(Lse + tok * stride_lt + hq * stride_lh + split * stride_ls, lse, mask=rmask)
    if SPLIT and MERGE:  # the last of the request's programs for this head merges them (FMERGE)
        merge_if_last(b, kvh, n_splits, Out, stride_ot, stride_oh, stride_os,
                       Lse, stride_lt, stride_lh, stride_ls, Final, stride_fb, stride_fh, Arrived,
                       GQA, MERGE_ROWS, DV, SPLITS_P2)


def check_channel_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_bits, k_block, v_group):
    """Clear errors for shapes, bits and blocks this kernel does not handle."""
    D = q.shape[-1]
    if D not in CHANNEL_HEAD_DIMS:
        raise ValueError(f"channel-key attention: head_dim {D} is not supported {CHANNEL_HEAD_DIMS}")
    if k_bits not in CHANNEL_KEY_BITS:
        raise ValueError(f"channel-key attention: {k_bits}-bit keys are not supported {CHANNEL_KEY_BITS}")
    if k_block not in PAGE_SIZES:
        raise ValueError(f"channel-key attention: key block {k_block} is not a page size {PAGE_SIZES}")
    N, H = k_codes.shape[:2]
    if k_codes.dtype != torch.uint8 or k_codes.shape[-1] != code_bytes(k_bits, D):
        raise ValueError(f"k_codes must be uint8 [N, H, {code_bytes(k_bits, D)}] for {k_bits}-bit keys "
                         f"at head_dim {D}, got {k_codes.dtype} {tuple(k_codes.shape)}")
    if (k_params.dtype != torch.float16 or N % k_block
            or tuple(k_params.shape) != (N // k_block, H, D, 2)):
        raise ValueError(f"k_params must be float16 [N / {k_block}, H, {D}, 2] = "
                         f"[{N // k_block}, {H}, {D}, 2] (one (scale, min) per page, head, channel), "
                         f"got {k_params.dtype} {tuple(k_params.shape)} (N = {N})")
    Dv = v_codes.shape[-1] * 4
    if Dv not in CHANNEL_HEAD_DIMS or sink_k.shape[-1] != D:
        raise ValueError(f"channel-key attention: value dim {Dv} / sink dim {sink_k.shape[-1]} do not fit "
                         f"head_dim {D} (2-bit values only)")
    if Dv % v_group or v_group < Dv // 4 or tuple(v_params.shape[1:]) != (H, Dv // v_group, 2):
        raise ValueError(f"v_params {tuple(v_params.shape)}: value group {v_group} must divide {Dv} "
                         f"and be >= {Dv // 4} (v_params [N, H, Dv / group, 2])")
    if q.shape[1] % H:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {H}")
    if ring_k.shape[1] < k_block:
        raise ValueError(f"ring of {ring_k.shape[1]} positions is shorter than a key block ({k_block}): "
                         "an incomplete block must be readable from BF16")
    for name, t in (("q", q), ("k_codes", k_codes), ("v_codes", v_codes), ("sink_k", sink_k),
                    ("ring_k", ring_k), ("k_params", k_params), ("v_params", v_params)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got {t.stride()}")


