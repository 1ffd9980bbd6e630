"""Code-unpacking helpers shared by the attention kernels: packed 2-bit (and wider) codes turned
into tensor-core operands, and the fp16 (scale, min) parameter words.

Operands are built with exponent tricks where compiled (USE_ASM): a code field masked under a
float exponent is that float's mantissa, so one lop3 makes two operands with no int-to-float
conversion; the constant the exponent adds (the offset) is removed algebraically by the caller.
In the Triton interpreter (CPU) the same helpers return the exact codes, no offset.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def unpack_params(w):
    """int32 word = (fp16 scale | fp16 min << 16) -> (scale, min) in fp32."""
    sc = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    mn = ((w >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return sc, mn


@triton.jit
def codes_2bit(c, J: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """2-bit field J of every byte of c (uint8), as DT, plus CODE_OFS (128 with USE_ASM, else 0).

    With USE_ASM one PTX block turns 4 bytes into 4 bf16 (two words) with a shift, a mask and two
    byte permutes: bf16 bits 0x4300 | c are exactly 128 + c, so the 2-bit code drops into the
    mantissa of 128.0 with no conversion instruction. The +128 is removed algebraically by the
    caller (it only shifts the per-group min: see CODE_OFS uses).
    """
    if USE_ASM:
        if J == 0:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 t, m; and.b32 t, $2, 0x03030303; mov.b32 m, 0x43434343; "
                "prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x7362;}",
                "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)
        elif J == 1:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 t, m; shr.b32 t, $2, 2; and.b32 t, t, 0x03030303; mov.b32 m, 0x43434343; "
                "prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x7362;}",
                "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)
        elif J == 2:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 t, m; shr.b32 t, $2, 4; and.b32 t, t, 0x03030303; mov.b32 m, 0x43434343; "
                "prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x7362;}",
                "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)
        else:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 t, m; shr.b32 t, $2, 6; and.b32 t, t, 0x03030303; mov.b32 m, 0x43434343; "
                "prmt.b32 $0, t, m, 0x5140; prmt.b32 $1, t, m, 0x7362;}",
                "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)
        r = r.to(DT)
    else:
        r = ((c >> (2 * J)) & 3).to(DT)
    return r


@triton.jit
def pick4(J: tl.constexpr, a0, a1, a2, a3):
    if J == 0:
        r = a0
    elif J == 1:
        r = a1
    elif J == 2:
        r = a2
    else:
        r = a3
    return r


@triton.jit
def pick8(E: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7):
    if E < 4:
        r = pick4(E, a0, a1, a2, a3)
    else:
        r = pick4(E - 4, a4, a5, a6, a7)
    return r


MASKS = tl.constexpr(("0x00030003", "0x000C000C", "0x00300030", "0x00C000C0"))


# Codes as small floats with a constant offset and a power-of-two scale per quarter j (scale
# folded into q for K and into the output for V): a code byte widened to 16 bits has quarter j in
# bits 2j..2j+1, and OR-ing an exponent onto the masked bits makes a float of that mantissa:
#   K (fp16, 10 mantissa bits): 1024 + c_j * 4^j
#   V (bf16,  7 mantissa bits):  128 + c_j * (1, 4, 16, 16)[j]   (quarter 3 is shifted down by 2)
# one lop3 per two codes (two per two for V's quarter 3). The offsets are removed per row.
# (the plain-Triton fallback, used by the CPU interpreter, has no offset: exact small integers)


@triton.jit
def k_scale(J: tl.constexpr):
    return 4.0 ** J


@triton.jit
def v_scale(J: tl.constexpr):
    return 4.0 ** J if J < 3 else 16.0


@triton.jit
def quarter_k(c16, J: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Quarter J of uint16-widened codes: K_OFS + code_J * k_scale(J) in DT (one lop3 per 2).

    One quarter at a time keeps only that quarter's operand live (not all four)."""
    if USE_ASM:
        r = tl.inline_asm_elementwise(
            "{.reg .b32 m; mov.b32 m, 0x64006400; lop3.b32 $0, $1, " + MASKS[J] + ", m, 0xEA;}",
            "=r,r", [c16], dtype=tl.float16, is_pure=True, pack=2)
        return r.to(DT)
    else:
        return (c16.to(tl.int32) & (3 << (2 * J))).to(DT)


V_OFS = tl.constexpr(128.0)  # what quarter_v's bf16 exponent trick adds to every value code


@triton.jit
def quarter_v(c16, J: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Quarter J of uint16-widened codes: V_OFS + code_J * v_scale(J) in DT (bf16 trick)."""
    if USE_ASM:
        if J < 3:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 m; mov.b32 m, 0x43004300; lop3.b32 $0, $1, " + MASKS[J] + ", m, 0xEA;}",
                "=r,r", [c16], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 m, w; mov.b32 m, 0x43004300; shr.b32 w, $1, 2; lop3.b32 $0, w, 0x00300030, m, 0xEA;}",
                "=r,r", [c16], dtype=tl.bfloat16, is_pure=True, pack=2)
        return r.to(DT)
    else:
        ci = c16.to(tl.int32)
        return ((ci >> 2) & 48).to(DT) if J == 3 else (ci & (3 << (2 * J))).to(DT)


# Code words (WORDS=True): a row's codes read as D/8 little-endian 16-bit words, word w = bytes
# 2w | 2w+1 << 8, so bits 8e + 2q of word w hold dim 2w + e + (D/4) q (format.md "quarter split").
# Eight extractions p = 4e + q, each a [words, keys] (or [keys, words]) MMA operand whose K index
# is the word: dims 2w + p // 4 + D/4 * (p % 4). A 16-bit operand has the two codes an MMA
# register needs (two keys for V, two words for K) in one 32-bit register, straight from
# ldmatrix: no byte gathers, no widening. Each extraction is one lop3 that drops a 2-bit field
# at mantissa bits b..b+1 (b = 4, 6, 8) under the fp16 exponent 2^(10-b): exactly
# WORD_OFS[p] + code, scale 1 (offsets 64 / 16 / 4: less cancellation than 1024 or bf16's 128).
# Fields are brought to bits 4..9 by one shift left by 4 (low byte) or right by 6 (high byte)
# per register, shared by three extractions.
WORD_SRC = tl.constexpr(("shl.b32 w, $1, 4;", "shl.b32 w, $1, 4;", "shl.b32 w, $1, 4;", "mov.b32 w, $1;",
                         "mov.b32 w, $1;", "shr.b32 w, $1, 6;", "shr.b32 w, $1, 6;", "shr.b32 w, $1, 6;"))
WORD_MASK = tl.constexpr(("0x00300030", "0x00C000C0", "0x03000300", "0x00C000C0",
                          "0x03000300", "0x00300030", "0x00C000C0", "0x03000300"))
WORD_EXP = tl.constexpr(("0x54005400", "0x4C004C00", "0x44004400", "0x4C004C00",
                         "0x44004400", "0x54005400", "0x4C004C00", "0x44004400"))
WORD_OFS = tl.constexpr((64.0, 16.0, 4.0, 16.0, 4.0, 64.0, 16.0, 4.0))
# An extraction is D/8 words: the MMA's K side (K codes) and 16-row side (V codes) need >= 16
WORDS_MIN_DIM = 128


@triton.jit
def word_code(w16, P: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Extraction P of 16-bit code words: WORD_OFS[P] + code of dim 2w + P // 4 + D/4 (P % 4) in DT
    (fp16; the plain-Triton fallback of the CPU interpreter: the exact code, no offset)."""
    if USE_ASM:
        r = tl.inline_asm_elementwise(
            "{.reg .b32 w; " + WORD_SRC[P] + " lop3.b32 $0, w, " + WORD_MASK[P] + ", " + WORD_EXP[P] + ", 0xEA;}",
            "=r,r", [w16], dtype=tl.float16, is_pure=True, pack=2)
        return r.to(DT)
    else:
        return ((w16.to(tl.int32) >> (8 * (P // 4) + 2 * (P % 4))) & 3).to(DT)


@triton.jit
def word_dims(P: tl.constexpr, QW: tl.constexpr):
    """Dims of extraction P for words 0..QW-1."""
    return 2 * tl.arange(0, QW) + (P // 4 + 2 * QW * (P % 4))


@triton.jit
def words_of_quarter(a, QW: tl.constexpr, BLOCK_M: tl.constexpr):
    """Output quarter a [rows, D/4] -> its two word extractions [D/8, rows]: even dims, odd dims."""
    ev, od = tl.split(tl.reshape(a, [BLOCK_M, QW, 2]))
    return tl.trans(ev), tl.trans(od)


@triton.jit
def word_ofs(P: tl.constexpr, USE_ASM: tl.constexpr):
    """The constant word_code adds to extraction P's codes (none in the plain-Triton fallback)."""
    return WORD_OFS[P] if USE_ASM else 0.0


@triton.jit
def quarter_of_words(ev, od, bm, QDV: tl.constexpr, BLOCK_M: tl.constexpr):
    """Value quarter [rows, Dv/4] (row-major) from its two code-word accumulators [Dv/8, rows]
    (even dims: extraction J, odd dims: J + 4; offsets already taken off per tile) plus sum(p mn)."""
    ev = tl.trans(ev + bm[None, :])
    od = tl.trans(od + bm[None, :])
    return tl.reshape(tl.join(ev, od), [BLOCK_M, QDV])


# prmt selectors of widen: bytes 0, 1 (then 2, 3) of a register into the low bytes of two 16-bit
# halves, their high bytes from the zero operand (selector digit 4: byte 0 of the second source)
WIDEN_PRMT = tl.constexpr(("0x4140", "0x4342"))


@triton.jit
def widen(c8, USE_ASM: tl.constexpr):
    """uint8 codes as uint16 (the operand idioms' input). USE_ASM: one prmt per two bytes (a plain
    cast has sm_90 extract every byte with its own prmt and pack the pairs with a third). Value
    codes keep the cast: they arrive one byte a load (transposed), and the cast packs those pairs
    with one prmt already."""
    if USE_ASM:
        r = tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, 0, " + WIDEN_PRMT[0] + "; prmt.b32 $1, $2, 0, " + WIDEN_PRMT[1] + ";",
            "=r,=r,r", [c8], dtype=tl.uint16, is_pure=True, pack=4)
    else:
        r = c8.to(tl.uint16)
    return r


@triton.jit
def key_quarter(kc, kc2, hb, J: tl.constexpr, BITS: tl.constexpr, QD: tl.constexpr):
    """Codes of dims [J*D/4, (J+1)*D/4) of every key of the tile, int32 [BLK, D/4].

    kc: bytes 0..D/4-1 of each row (the 2-bit plane / first quarter of the 4-bit half split),
    kc2: bytes D/4..D/2-1 (4 bits only), hb: the 1-bit plane gathered so that column i holds byte
    i % (D/8) (3 bits only): dim J*D/4 + i is eighth 2J + i // (D/8) of the plane."""
    if BITS == 2:
        c = (kc >> (2 * J)) & 3
    elif BITS == 3:
        E: tl.constexpr = QD // 2
        sh = 2 * J + tl.arange(0, QD) // E
        c = ((kc >> (2 * J)) & 3) | (((hb >> sh[None, :]) & 1) << 2)
    else:  # half split: dims [0, D/2) low nibbles, [D/2, D) high nibbles of bytes 0..D/2-1
        if J % 2 == 0:
            c = (kc >> (4 * (J // 2))) & 15
        else:
            c = (kc2 >> (4 * (J // 2))) & 15
    return c


# fp16 bits of 128 + code for a code in [0, 128): 128's exponent, the code in the mantissa's top 7
# bits (the ulp at 128 is 1/8). tests/kernels/test_channel_decode.py checks it bit for bit.
FP16_CODE_BASE = tl.constexpr(0x5800)
FP16_CODE_SHIFT = tl.constexpr(3)
FP32_CODE_BASE = tl.constexpr(0x4B000000)  # 2^23: a code in the low mantissa bits is 2^23 + code


@triton.jit
def dequant_codes(c, sc, mn, AXIS: tl.constexpr, DT: tl.constexpr):
    """code * scale + min as DT, for int32 codes c [rows, cols] in [0, 128) and fp32 (scale, min)
    vectors along AXIS (0: one per column, keys; 1: one per row, values), DT fp16 or fp32 (the
    pool's fp16 params are exact in both; bf16 would round them: channel_attend.DQ_DT). fp16 (the extend's
    operands on CUDA): packed half math, two elements an instruction (sm_90 HADD2 / HFMA2): 128 +
    code from the exponent trick, minus 128 exactly, times the scale plus the min rounded once to
    2^-11; no int-to-float or fp32-to-half conversions per element. fp32 (the interpreter's, and
    channel_dequant's pieces on CUDA): 2^23 + code from the fp32 exponent trick (one lop, no
    int-to-float conversion), minus 2^23 exactly, times the scale (exact) plus the min, rounded
    once to fp32."""
    if DT == tl.float16:
        x = ((c << FP16_CODE_SHIFT) | FP16_CODE_BASE).to(tl.int16).to(tl.float16, bitcast=True)
        s16 = sc.to(DT)
        m16 = mn.to(DT)
        if AXIS == 0:
            r = (x - 128.0) * s16[None, :] + m16[None, :]
        else:
            r = (x - 128.0) * s16[:, None] + m16[:, None]
    else:
        x = (c | FP32_CODE_BASE).to(tl.float32, bitcast=True) - 8388608.0
        if AXIS == 0:
            r = x * sc[None, :] + mn[None, :]
        else:
            r = x * sc[:, None] + mn[:, None]
    return r
