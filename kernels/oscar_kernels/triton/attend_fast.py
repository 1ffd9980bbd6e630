"""Decode stage-1 kernel with fewer instructions per INT2 key ("fast" variant of attend.py).

Same semantics, split-K layout and outputs as attend.attend_kernel with SPLIT=True (every program
writes a normalised partial output and its natural-log LSE that decode's merge kernel combines, or
that the last program of each (request, KV head) merges itself: _merge_if_last). By default the
BF16 sink ++ ring keys are spread over every split (bf16_spread, NB16 = 0: each split gets an
equal BLOCK_N-aligned chunk of the INT2 range and an equal chunk of the BF16 keys); with
bf16_spread=False splits 0..NB16-1 read only the BF16 keys, as in attend.py.
ops.decode_attention uses it by default when K and V use one (scale, min) group per row
(G = head_dim); OSCAR_INT2_DECODE_KERNEL=base selects the original kernel (docs/benchmarks.md
"Kernels", 17:44 UTC run: 1.06-1.96x faster than it at every benchmarked shape).

What changes (SASS counts: docs/benchmarks.md "Findings", sm_90, Hq=32, Hkv=8, D=128, G=128):
* Both products run transposed so that the long side fills the MMA's 16-row side and the GQA
  query rows its 8-column side (padded to 8, not to 16): scores s^T = codes_K @ q^T (keys x rows)
  and o^T += codes_V^T @ (p*sc) (Dv x rows). Half the MMAs and half the accumulator registers of
  the row-major form; p never needs transposing.
* One warp per program (see NUM_WARPS).
* Code words (WORDS, head_dim >= 128): each row's codes are read as D/8 16-bit words, and each of
  the 8 two-bit fields of a word becomes an MMA operand with one lop3 per two codes
  (_word_code): the operands come straight from ldmatrix, with no byte gathers for V and no
  widening (format.md). At head_dim 64 (an extraction would be 8 wide, under the MMA's 16) the
  bytes are widened to 16 bits once per tile and each quarter unpacked the same way
  (_quarter_k / _quarter_v).
* The V (scale, min) sums are per-row scalars kept apart from the MMA accumulators and added once
  after the loop; the softmax scale is folded into q; whole tiles run without masks; offsets are
  32-bit when the pool allows.
* The INT2 loop is software-pipelined 5 deep (attend.INT2_STAGES): the next tile's codes are in flight
  while a tile is computed (7-14% faster than the default depth 2 on the H100).
* The grid (see PROGRAMS_PER_SM and SPLIT_PROGRAMS_PER_SM): ~8 INT2 programs per SM in one wave,
  the BF16 keys spread over them, the merge fused at few splits.
Base kernel 29.4 warp-instructions per (key, KV head); this one 13.2 at the default BLOCK_N=64
(17.2 reading bytes, 21.1 before the transposed p @ V), 168 registers and 12.8 KB of shared
memory: 12 one-warp programs per SM by both. BLOCK_N=64 was the fastest tile on the H100
(bench/kernels.py --tune-fast and bench/decode_breakdown.py, 2026-11-22 11:35-17:45 UTC: BLOCK_N
32 / 128, register caps, deeper pipelines, BF16 tiles of 16 and a hand-pipelined register
prefetch were slower or within 4%).
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import attend as _base
from .attend import (INT2_STAGES, _bf16_source_loop, _cap_and_scale, _unpack_params, as_param_words,
                     empty_softmax_state, load_q_quarters, num_splits_of, pool_launch_args, source_ranges,
                     split_ranges)

LN2 = tl.constexpr(0.6931471805599453)
MASKS = tl.constexpr(("0x00030003", "0x000C000C", "0x00300030", "0x00C000C0"))
# One warp per program: the [BLOCK_N, 8] score tile is one warp's MMA column, so a second warp
# would only duplicate it (Triton gives every chained dot the same warp split). Twice the base
# kernel's programs per SM keeps the same number of warps in flight.
NUM_WARPS = 1
# Program slots per SM: 12 one-warp programs fit by registers (168) and by shared memory (12.8 KB
# per program with 16-key BF16 tiles; tests/kernels/test_schedule.py), so a grid of up to
# 12 x SMs programs runs in one wave. BF16_LAST and BLOCK_B date from the byte-reading kernel,
# which was bound by its SMs (docs/benchmarks.md "Findings", 2026-11-22 15:28 UTC) and ran one INT2
# program per slot with BF16-only splits: those programs started last to fill the slots freed at
# the end (16:02 UTC: B=8 L=32K 80.1 vs 86.9 us); with bf16_spread (the default) there are no
# BF16-only programs and BF16_LAST changes nothing. 16-key BF16 tiles (BLOCK_B) keep shared
# memory at 12.8 KB; when the whole grid fits in one wave 32-key tiles are as fast or faster
# (default_block_b).
PROGRAMS_PER_SM = 12
# ... but with code words (WORDS) the INT2 loop is 23% shorter and fewer, longer programs (less
# fixed cost per program) are faster than one per slot: the split policy (default_max_splits)
# aims at 8 INT2 programs per SM. H100 (bench/decode_breakdown.py, 2026-11-22 17:45 UTC), INT2
# programs 768 / 1024 / 1280 / 1536: B=8 L=32K 79.7 / 67.6 / 82.6 / 87.1 us, B=32 L=8K 87.8 /
# 75.7 / 88.9 / 91.3 us; B=64 L=32K 1024 / 1536 / 2048: 461.2 / 482.4 / 546.5 us.
SPLIT_PROGRAMS_PER_SM = 8
BLOCK_B = 16
BLOCK_B_ONE_WAVE = 32
# H100, same run vs BLOCK_N=128 / 32 (us): B=64 L=32K 714 vs 1301 / 959, B=8 L=32K 101 vs 121 / 132
# (bench/kernels.py --tune-fast, 2026-11-22 11:35 UTC)
BLOCK_N = 64


# Codes as small floats with a constant offset and a power-of-two scale per quarter j (scale
# folded into q for K and into the output for V): a code byte widened to 16 bits has quarter j in
# bits 2j..2j+1, and OR-ing an exponent onto the masked bits makes a float of that mantissa:
#   K (fp16, 10 mantissa bits): 1024 + c_j * 4^j
#   V (bf16,  7 mantissa bits):  128 + c_j * (1, 4, 16, 16)[j]   (quarter 3 is shifted down by 2)
# one lop3 per two codes (two per two for V's quarter 3). The offsets are removed per row.
# (the plain-Triton fallback, used by the CPU interpreter, has no offset: exact small integers)


@triton.jit
def _k_scale(J: tl.constexpr):
    return 4.0 ** J


@triton.jit
def _v_scale(J: tl.constexpr):
    return 4.0 ** J if J < 3 else 16.0


@triton.jit
def _quarter_k(c16, J: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Quarter J of uint16-widened codes: K_OFS + code_J * _k_scale(J) in DT (one lop3 per 2).

    One quarter at a time keeps only that quarter's operand live (not all four)."""
    if USE_ASM:
        r = tl.inline_asm_elementwise(
            "{.reg .b32 m; mov.b32 m, 0x64006400; lop3.b32 $0, $1, " + MASKS[J] + ", m, 0xEA;}",
            "=r,r", [c16], dtype=tl.float16, is_pure=True, pack=2)
        return r.to(DT)
    else:
        return (c16.to(tl.int32) & (3 << (2 * J))).to(DT)


V_OFS = tl.constexpr(128.0)  # what _quarter_v's bf16 exponent trick adds to every value code


@triton.jit
def _quarter_v(c16, J: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Quarter J of uint16-widened codes: V_OFS + code_J * _v_scale(J) in DT (bf16 trick)."""
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
def _word_code(w16, P: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
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
def _word_dims(P: tl.constexpr, QW: tl.constexpr):
    """Dims of extraction P for words 0..QW-1."""
    return 2 * tl.arange(0, QW) + (P // 4 + 2 * QW * (P % 4))


@triton.jit
def _int2_slots(i0, i_hi, sink_lo, hole, idx_base, BLOCK_N: tl.constexpr, OFS32: tl.constexpr):
    """Pool slots of INT2 keys i0 .. i0+BLOCK_N-1 (the sink hole skipped); keys at or past i_hi
    read slot 0 (always a valid pool row; their scores are masked)."""
    ii = i0 + tl.arange(0, BLOCK_N)
    pos = ii + tl.where(ii >= sink_lo, hole, 0)
    slot = tl.load(idx_base + pos, mask=ii < i_hi, other=0)
    # 32-bit offsets when every pool tensor is under 2^31 elements (one IMAD per address)
    return slot.to(tl.int32) if OFS32 else slot.to(tl.int64)


@triton.jit
def _int2_fetch(slot, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                QD: tl.constexpr, QDV: tl.constexpr):
    """K codes [keys, QD], K params, V codes transposed [QDV, keys], V params of one tile. The codes
    are bytes (QD = D/4) or, through int16 pointers, code words (QD = D/8; WORDS)."""
    kc = tl.load(KCh + slot[:, None] * stride_kcn + tl.arange(0, QD)[None, :])
    kpw = tl.load(KPh + slot * stride_kpn)
    vct = tl.load(VCh + slot[None, :] * stride_vcn + tl.arange(0, QDV)[:, None])
    vpw = tl.load(VPh + slot * stride_vpn)
    return kc, kpw, vct, vpw


@triton.jit
def _scores_softmax(part, kpw, qs_ofs, qsum, i0, i_hi, m_i, l_i, sm_scale_log2, logit_cap,
                    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_CAP: tl.constexpr):
    """part = q'.(offset + codes) of a tile [keys, rows] -> (p^T, alpha, m_i, l_i): the K (scale,
    min) applied (one group per row), online softmax in the log2 domain. MASKED: keys at or past
    i_hi get -inf scores."""
    ksc, kmn = _unpack_params(kpw)
    st = (part - qs_ofs[None, :]) * ksc[:, None] + kmn[:, None] * qsum[None, :]
    if LOGIT_CAP:
        st = _cap_and_scale(st, sm_scale_log2, logit_cap, LOGIT_CAP)
    if MASKED:
        st = tl.where((i0 + tl.arange(0, BLOCK_N) < i_hi)[:, None], st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 0))
    alpha = tl.exp2(m_i - m_new)
    pt = tl.exp2(st - m_new[None, :])
    l_i = l_i * alpha + tl.sum(pt, 0)
    return pt, alpha, m_new, l_i


@triton.jit
def _p_times_scale(pt, vpw, alpha, b_mn, DT: tl.constexpr):
    """p^T * V scale per key (the V MMAs' operand, in DT), the per-row sum(p*mn) rescaled by alpha
    (added to the accumulators once, after the loop), and this tile's sum(p*sc) [1, rows] of the
    rounded operand: the code operands' offsets times it are taken off each accumulator before the
    tile's MMA adds them. (Taken off once after the loop, as before 2026-11-26, they left fp32 sums
    64-128x the output to cancel: an error growing with the keys per split, 3.3e-2 relative at 32K
    keys in one split here, up to 4.4 in the per-channel decode; H100.)"""
    vsc, vmn = _unpack_params(vpw)
    pst = (pt * vsc[:, None]).to(DT)
    b_mn = b_mn * alpha + tl.sum(pt * vmn[:, None], 0)
    gs = tl.sum(pst.to(tl.float32), 0)[None, :]
    return pst, b_mn, gs


@triton.jit
def _int2_tile(i0, i_hi, kc, kpw, vct, vpw,
               q0t, q1t, q2t, q3t, qs_ofs, qsum, m_i, l_i, b_mn, a0, a1, a2, a3, sm_scale_log2, logit_cap,
               MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
               LOGIT_CAP: tl.constexpr, KDT: tl.constexpr, PV_DT: tl.constexpr, USE_ASM: tl.constexpr):
    """One tile of BLOCK_N INT2 keys (codes and params from _int2_fetch): scores s^T = codes @ q^T,
    online softmax, o^T += codes^T @ p. MASKED: keys at or past i_hi get -inf scores."""
    k16 = kc.to(tl.uint16)
    part = tl.dot(_quarter_k(k16, 0, KDT, USE_ASM), q0t)
    part = tl.dot(_quarter_k(k16, 1, KDT, USE_ASM), q1t, part)
    part = tl.dot(_quarter_k(k16, 2, KDT, USE_ASM), q2t, part)
    part = tl.dot(_quarter_k(k16, 3, KDT, USE_ASM), q3t, part)
    pt, alpha, m_i, l_i = _scores_softmax(part, kpw, qs_ofs, qsum, i0, i_hi, m_i, l_i, sm_scale_log2,
                                          logit_cap, MASKED, BLOCK_N, LOGIT_CAP)

    # o^T += codes^T @ (p*sc)
    pst, b_mn, gs = _p_times_scale(pt, vpw, alpha, b_mn, PV_DT)
    v16 = vct.to(tl.uint16)
    al = alpha[None, :]
    ofs = gs * (V_OFS if USE_ASM else 0.0)  # _quarter_v's offsets' share of this tile
    a0 = tl.dot(_quarter_v(v16, 0, PV_DT, USE_ASM), pst, a0 * al - ofs)
    a1 = tl.dot(_quarter_v(v16, 1, PV_DT, USE_ASM), pst, a1 * al - ofs)
    a2 = tl.dot(_quarter_v(v16, 2, PV_DT, USE_ASM), pst, a2 * al - ofs)
    a3 = tl.dot(_quarter_v(v16, 3, PV_DT, USE_ASM), pst, a3 * al - ofs)
    return m_i, l_i, b_mn, a0, a1, a2, a3


@triton.jit
def _pv_words(vwt, pst, al, gs, a0, a1, a2, a3, a4, a5, a6, a7, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """o^T_p += extraction_p(V words)^T @ (p*sc) less its offset's share (ofs_p * gs: gs is the
    tile's sum(p*sc)) for the 8 extractions."""
    a0 = tl.dot(_word_code(vwt, 0, DT, USE_ASM), pst, a0 * al - _word_ofs(0, USE_ASM) * gs)
    a1 = tl.dot(_word_code(vwt, 1, DT, USE_ASM), pst, a1 * al - _word_ofs(1, USE_ASM) * gs)
    a2 = tl.dot(_word_code(vwt, 2, DT, USE_ASM), pst, a2 * al - _word_ofs(2, USE_ASM) * gs)
    a3 = tl.dot(_word_code(vwt, 3, DT, USE_ASM), pst, a3 * al - _word_ofs(3, USE_ASM) * gs)
    a4 = tl.dot(_word_code(vwt, 4, DT, USE_ASM), pst, a4 * al - _word_ofs(4, USE_ASM) * gs)
    a5 = tl.dot(_word_code(vwt, 5, DT, USE_ASM), pst, a5 * al - _word_ofs(5, USE_ASM) * gs)
    a6 = tl.dot(_word_code(vwt, 6, DT, USE_ASM), pst, a6 * al - _word_ofs(6, USE_ASM) * gs)
    a7 = tl.dot(_word_code(vwt, 7, DT, USE_ASM), pst, a7 * al - _word_ofs(7, USE_ASM) * gs)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _int2_tile_words(i0, i_hi, kw, kpw, vwt, vpw,
                     q0t, q1t, q2t, q3t, q4t, q5t, q6t, q7t, qs_ofs, qsum, m_i, l_i, b_mn,
                     a0, a1, a2, a3, a4, a5, a6, a7, sm_scale_log2, logit_cap,
                     MASKED: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_CAP: tl.constexpr,
                     DT: tl.constexpr, USE_ASM: tl.constexpr):
    """_int2_tile on code words: 8 extractions of K words [keys, D/8] against the matching q^T
    slices, 8 of V words [Dv/8, keys] against p*sc (DT: fp16, fp32 in the interpreter)."""
    part = tl.dot(_word_code(kw, 0, DT, USE_ASM), q0t)
    part = tl.dot(_word_code(kw, 1, DT, USE_ASM), q1t, part)
    part = tl.dot(_word_code(kw, 2, DT, USE_ASM), q2t, part)
    part = tl.dot(_word_code(kw, 3, DT, USE_ASM), q3t, part)
    part = tl.dot(_word_code(kw, 4, DT, USE_ASM), q4t, part)
    part = tl.dot(_word_code(kw, 5, DT, USE_ASM), q5t, part)
    part = tl.dot(_word_code(kw, 6, DT, USE_ASM), q6t, part)
    part = tl.dot(_word_code(kw, 7, DT, USE_ASM), q7t, part)
    pt, alpha, m_i, l_i = _scores_softmax(part, kpw, qs_ofs, qsum, i0, i_hi, m_i, l_i, sm_scale_log2,
                                          logit_cap, MASKED, BLOCK_N, LOGIT_CAP)

    pst, b_mn, gs = _p_times_scale(pt, vpw, alpha, b_mn, DT)
    a0, a1, a2, a3, a4, a5, a6, a7 = _pv_words(vwt, pst, alpha[None, :], gs, a0, a1, a2, a3, a4, a5, a6, a7,
                                               DT, USE_ASM)
    return m_i, l_i, b_mn, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _words_of_quarter(a, QW: tl.constexpr, BLOCK_M: tl.constexpr):
    """Output quarter a [rows, D/4] -> its two word extractions [D/8, rows]: even dims, odd dims."""
    ev, od = tl.split(tl.reshape(a, [BLOCK_M, QW, 2]))
    return tl.trans(ev), tl.trans(od)


# One warp merges n partials in n / 4 dependent L2 round trips: cheaper than the merge kernel's
# launch and wait at few splits, dearer at many. H100 (bench/decode_breakdown.py, 15:55 UTC),
# fused vs merge kernel: B=32 L=8K, 8 splits 81.2 vs 83.3 us; B=64 L=32K, 5 splits 523.5 vs
# 533.2 us; B=8 L=32K, 26 splits 83.4 vs 80.4 us.
FUSED_MERGE_MAX_SPLITS = 16
_ARRIVALS: dict = {}
ARRIVALS_MIN = 1 << 16  # counters allocated at once per device: batch x KV heads up to 65536


def split_arrivals(device, n: int):
    """The fused merge's per-(request, KV head) arrival counters on `device`: int32 zeros, kept
    zero by the kernel (the merging program resets its counter), allocated once per device (not
    while a CUDA graph is being captured: run one call before capture, as SGLang's warm-up does)."""
    import torch

    key = str(torch.device(device))
    t = _ARRIVALS.get(key)
    if t is None or t.numel() < n:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("INT2 decode: the split arrival counters must exist before CUDA graph capture "
                               "(run one decode call first, or pass arrived=)")
        t = _ARRIVALS[key] = torch.zeros(max(n, ARRIVALS_MIN), dtype=torch.int32, device=device)
    return t


def default_block_b(batch: int, kv_heads: int, max_kv_splits: int, device) -> int:
    """BF16 keys per tile: BLOCK_B when the grid needs more than one wave of program slots,
    BLOCK_B_ONE_WAVE when every program starts at once."""
    from .decode import sm_count

    one_wave = batch * kv_heads * max_kv_splits <= PROGRAMS_PER_SM * sm_count(device)
    return BLOCK_B_ONE_WAVE if one_wave else BLOCK_B


def default_max_splits(batch: int, kv_heads: int, device, nb16: int = 0) -> int:
    """BF16 splits (none when the BF16 keys are spread) + INT2 splits: SPLIT_PROGRAMS_PER_SM
    programs per SM, at least one per (request, KV head) and at most 128."""
    from .decode import sm_count

    return min(128, max(1, SPLIT_PROGRAMS_PER_SM * sm_count(device) // (batch * kv_heads))) + nb16


@triton.jit
def _merge_if_last(b, kvh, n_splits, Part, stride_pt, stride_ph, stride_ps,
                   Lse, stride_lt, stride_lh, stride_ls, Final, stride_fb, stride_fh, Arrived,
                   GQA: tl.constexpr, ROWS: tl.constexpr, DV: tl.constexpr, SPLITS_P2: tl.constexpr):
    """The last of the n_splits programs of (request b, KV head kvh) to finish LSE-merges their
    partial outputs into Final (decode.merge_splits' formula) and resets the arrival counter:
    no merge kernel to launch and wait for.

    Arrived[b * Hkv + kvh] counts finished programs. The barrier makes every lane's partial
    stores precede the counter's release; the acquire of the program that sees n_splits - 1
    orders its reads of the other programs' partials (read through L2, .cg) after their stores."""
    CH: tl.constexpr = 4  # splits per load: [ROWS, CH, DV] (64 fp32 per lane at GQA 4, DV 128)
    tl.debug_barrier()
    cnt = tl.atomic_add(Arrived + b * tl.num_programs(1) + kvh, 1, sem="acq_rel", scope="gpu")
    if cnt == n_splits - 1:
        tl.store(Arrived + b * tl.num_programs(1) + kvh, 0)  # every program of this call has counted
        bt = b.to(tl.int64)
        r = tl.arange(0, ROWS)
        hq = kvh * GQA + r
        rmask = r < GQA
        s = tl.arange(0, SPLITS_P2)
        lb = Lse + bt * stride_lt + hq * stride_lh
        lse = tl.load(lb[:, None] + s[None, :] * stride_ls, mask=rmask[:, None] & (s < n_splits)[None, :],
                      other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, 1)
        m = tl.where(m == float("-inf"), 0.0, m)
        wsum = tl.sum(tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m[:, None])), 1)
        c = tl.arange(0, CH)
        d = tl.arange(0, DV)
        pb = Part + bt * stride_pt + hq[:, None, None] * stride_ph + d[None, None, :]
        acc = tl.zeros([ROWS, DV], tl.float32)
        for s0 in range(0, n_splits, CH):
            sp = s0 + c
            cm = rmask[:, None] & (sp < n_splits)[None, :]
            # the chunk's LSEs again (from L2): a column block of `lse` cannot be sliced out in Triton
            lc = tl.load(lb[:, None] + sp[None, :] * stride_ls, mask=cm, other=float("-inf"), cache_modifier=".cg")
            wc = tl.where(lc == float("-inf"), 0.0, tl.exp(lc - m[:, None]))  # splits without keys: 0
            part = tl.load(pb + sp[None, :, None] * stride_ps, mask=cm[:, :, None], other=0.0, cache_modifier=".cg")
            acc += tl.sum(wc[:, :, None] * part, 1)
        o = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
        tl.store(Final + bt * stride_fb + hq[:, None] * stride_fh + d[None, :], o.to(Final.dtype.element_ty),
                 mask=rmask[:, None])


@triton.jit
def _word_ofs(P: tl.constexpr, USE_ASM: tl.constexpr):
    """The constant _word_code adds to extraction P's codes (none in the plain-Triton fallback)."""
    return WORD_OFS[P] if USE_ASM else 0.0


@triton.jit
def _q_word_slice(qbt, rmask, QSC, P: tl.constexpr, QW: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr):
    """q^T [D/8, rows] at extraction P's dims, times QSC, in DT, and its per-row sum (fp32)."""
    qt = (tl.load(qbt + _word_dims(P, QW)[:, None], mask=rmask[None, :], other=0.0).to(tl.float32) * QSC).to(DT)
    return qt, tl.sum(qt.to(tl.float32), 0)


@triton.jit
def _store_word_part(ob, x, b_mn, inv_l, rmask, P: tl.constexpr, QWV: tl.constexpr):
    """Extraction P's accumulator [Dv/8, rows] -> normalised partial output at its dims:
    (p*sc) @ c + p @ mn = x + sum(p*mn) per row (the offsets came off per tile)."""
    tl.store(ob + _word_dims(P, QWV)[:, None], (x + b_mn) * inv_l,
             mask=rmask[None, :])


@triton.jit
def _int2_words_part(qbt, rmask, ob, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                     idx_base, i_lo, i_hi, sink_lo, hole, m_i, l_i, a0, a1, a2, a3, sm_scale_log2, logit_cap,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     LOGIT_CAP: tl.constexpr, PV_DT: tl.constexpr, USE_ASM: tl.constexpr, OFS32: tl.constexpr,
                     INT2_STAGES: tl.constexpr):
    """The kernel's INT2 body with WORDS: KCh / VCh are int16 views of the codes (strides in
    words). Continues the softmax state (m_i, l_i, output quarters a0..a3 [rows, Dv/4]) of the
    BF16 loops, stores the normalised partial output at ob + dim, returns (m_i, l_i)."""
    QW: tl.constexpr = D // 8
    QWV: tl.constexpr = DV // 8
    DT: tl.constexpr = tl.float32 if PV_DT == tl.float32 else tl.float16
    QSC = 1.0 if LOGIT_CAP else sm_scale_log2
    # q^T slices [D/8, rows] matching the 8 extractions, scaled by the softmax scale only (every
    # extraction has scale 1); part = q.c + sum_p ofs_p sum(q_p), q.k_hat = sc q.c + mn sum(q)
    q0t, s0 = _q_word_slice(qbt, rmask, QSC, 0, QW, DT, USE_ASM)
    q1t, s1 = _q_word_slice(qbt, rmask, QSC, 1, QW, DT, USE_ASM)
    q2t, s2 = _q_word_slice(qbt, rmask, QSC, 2, QW, DT, USE_ASM)
    q3t, s3 = _q_word_slice(qbt, rmask, QSC, 3, QW, DT, USE_ASM)
    q4t, s4 = _q_word_slice(qbt, rmask, QSC, 4, QW, DT, USE_ASM)
    q5t, s5 = _q_word_slice(qbt, rmask, QSC, 5, QW, DT, USE_ASM)
    q6t, s6 = _q_word_slice(qbt, rmask, QSC, 6, QW, DT, USE_ASM)
    q7t, s7 = _q_word_slice(qbt, rmask, QSC, 7, QW, DT, USE_ASM)
    qsum = s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7
    qs_ofs = (_word_ofs(0, USE_ASM) * s0 + _word_ofs(1, USE_ASM) * s1 + _word_ofs(2, USE_ASM) * s2
              + _word_ofs(3, USE_ASM) * s3 + _word_ofs(4, USE_ASM) * s4 + _word_ofs(5, USE_ASM) * s5
              + _word_ofs(6, USE_ASM) * s6 + _word_ofs(7, USE_ASM) * s7)
    # the BF16 loops' output quarters -> the 8 extractions' transposed accumulators [Dv/8, rows]
    x0, x4 = _words_of_quarter(a0, QWV, BLOCK_M)
    x1, x5 = _words_of_quarter(a1, QWV, BLOCK_M)
    x2, x6 = _words_of_quarter(a2, QWV, BLOCK_M)
    x3, x7 = _words_of_quarter(a3, QWV, BLOCK_M)
    b_mn = tl.zeros([BLOCK_M], dtype=tl.float32)
    i_full = i_lo + (i_hi - i_lo) // BLOCK_N * BLOCK_N
    for i0 in tl.range(i_lo, i_full, BLOCK_N, num_stages=INT2_STAGES):
        kw, kpw, vwt, vpw = _int2_fetch(_int2_slots(i0, i_hi, sink_lo, hole, idx_base, BLOCK_N, OFS32),
                                              KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                                              QW, QWV)
        m_i, l_i, b_mn, x0, x1, x2, x3, x4, x5, x6, x7 = _int2_tile_words(
            i0, i_hi, kw, kpw, vwt, vpw, q0t, q1t, q2t, q3t, q4t, q5t, q6t, q7t, qs_ofs, qsum, m_i, l_i,
            b_mn, x0, x1, x2, x3, x4, x5, x6, x7, sm_scale_log2, logit_cap, False, BLOCK_N, LOGIT_CAP,
            DT, USE_ASM)
    if i_full < i_hi:
        kw, kpw, vwt, vpw = _int2_fetch(_int2_slots(i_full, i_hi, sink_lo, hole, idx_base, BLOCK_N, OFS32),
                                              KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                                              QW, QWV)
        m_i, l_i, b_mn, x0, x1, x2, x3, x4, x5, x6, x7 = _int2_tile_words(
            i_full, i_hi, kw, kpw, vwt, vpw, q0t, q1t, q2t, q3t, q4t, q5t, q6t, q7t, qs_ofs, qsum, m_i, l_i,
            b_mn, x0, x1, x2, x3, x4, x5, x6, x7, sm_scale_log2, logit_cap, True, BLOCK_N, LOGIT_CAP,
            DT, USE_ASM)
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)[None, :]
    b_mn = b_mn[None, :]
    _store_word_part(ob, x0, b_mn, inv_l, rmask, 0, QWV)
    _store_word_part(ob, x1, b_mn, inv_l, rmask, 1, QWV)
    _store_word_part(ob, x2, b_mn, inv_l, rmask, 2, QWV)
    _store_word_part(ob, x3, b_mn, inv_l, rmask, 3, QWV)
    _store_word_part(ob, x4, b_mn, inv_l, rmask, 4, QWV)
    _store_word_part(ob, x5, b_mn, inv_l, rmask, 5, QWV)
    _store_word_part(ob, x6, b_mn, inv_l, rmask, 6, QWV)
    _store_word_part(ob, x7, b_mn, inv_l, rmask, 7, QWV)
    return m_i, l_i


@triton.jit
def attend_fast_kernel(
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
    kv_indptr, kv_indices, req_rows, own_start, sink_start, num_kv_splits,
    sm_scale_log2, logit_cap, MAX_SPLITS,
    Final, stride_fb, stride_fh, Arrived,
    GQA: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    S: tl.constexpr, W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, HAS_NSPLITS: tl.constexpr,
    MIN_CHUNK: tl.constexpr, LOGIT_CAP: tl.constexpr, PV_DT: tl.constexpr, NB16: tl.constexpr,
    USE_ASM: tl.constexpr, OFS32: tl.constexpr, INT2_STAGES: tl.constexpr, BF16_LAST: tl.constexpr,
    MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, SPLITS_P2: tl.constexpr, WORDS: tl.constexpr,
):
    QD: tl.constexpr = D // 4
    QDV: tl.constexpr = DV // 4
    K_OFS: tl.constexpr = 1024.0 if USE_ASM else 0.0  # offsets of _quarter_k / _quarter_v
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    row = tl.load(req_rows + b).to(tl.int64)
    own = tl.load(own_start + row)  # per-request state is indexed by request row, not batch slot
    sink_own = tl.load(sink_start + row)
    sink_lo, sink_hi, ring_lo, n_int2 = source_ranges(kv_len, own, sink_own, S, W)
    hole = sink_hi - sink_lo

    n_splits = num_splits_of(n_int2, b, num_kv_splits, HAS_NSPLITS, MAX_SPLITS, MIN_CHUNK, NB16)
    if split >= n_splits:
        return
    if BF16_LAST:  # programs start in split order: INT2 splits (long) first, BF16 (short) last
        split = tl.where(split < n_splits - NB16, split + NB16, split - (n_splits - NB16))
    # the same split of keys as attend.py
    i_lo, i_hi, s_lo, s_hi, r_lo, r_hi = split_ranges(
        split, n_splits, n_int2, sink_lo, sink_hi, ring_lo, kv_len, BLOCK_N, NB16)

    # ---- query rows (GQA heads of this KV head, padded to BLOCK_M) ---------------------------
    rows = tl.arange(0, BLOCK_M)
    hq = kvh * GQA + rows
    rmask = rows < GQA
    dq = tl.arange(0, QD)
    qb = Q + b.to(tl.int64) * stride_qt + hq[:, None] * stride_qh + dq[None, :]
    q0, q1, q2, q3 = load_q_quarters(qb, rmask, QD, PV_DT)

    m_i, l_i, a0, a1, a2, a3 = empty_softmax_state(BLOCK_M, QDV)

    # ---- BF16 sink and ring (the shared loop of attend.py) -----------------------------------
    m_i, l_i, a0, a1, a2, a3 = _bf16_source_loop(
        s_lo, s_hi,
        SK + row * stride_skr + kvh * stride_skh, SV + row * stride_svr + kvh * stride_svh,
        stride_skp, stride_svp, q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3,
        sm_scale_log2, logit_cap, False, W, QD, QDV, BLOCK_B, LOGIT_CAP, PV_DT)
    m_i, l_i, a0, a1, a2, a3 = _bf16_source_loop(
        r_lo, r_hi,
        RK + row * stride_rkr + kvh * stride_rkh, RV + row * stride_rvr + kvh * stride_rvh,
        stride_rkp, stride_rvp, q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3,
        sm_scale_log2, logit_cap, True, W, QD, QDV, BLOCK_B, LOGIT_CAP, PV_DT)

    kvh64 = kvh.to(tl.int64)  # the pool is head-major: kvh * stride can pass 2^31
    KCh = KC + kvh64 * stride_kch
    KPh = KP + kvh64 * stride_kph
    VCh = VC + kvh64 * stride_vch
    VPh = VP + kvh64 * stride_vph
    idx_base = kv_indices + kv_start
    if WORDS:  # the INT2 body on 16-bit code words (see WORD_SRC), partial output stored
        m_i, l_i = _int2_words_part(
            Q + b.to(tl.int64) * stride_qt + hq[None, :] * stride_qh, rmask,
            Out + b.to(tl.int64) * stride_ot + hq[None, :] * stride_oh + split * stride_os,
            KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
            idx_base, i_lo, i_hi, sink_lo, hole, m_i, l_i, a0, a1, a2, a3,
            sm_scale_log2, logit_cap, D, DV, BLOCK_M, BLOCK_N, LOGIT_CAP, PV_DT, USE_ASM, OFS32, INT2_STAGES)
    else:
        # ---- INT2 body: scores transposed, s^T [BLOCK_N keys, BLOCK_M rows] ----------------------
        # q^T quarters loaded transposed ([D/4, rows], the MMA's B side) and scaled once: by the
        # softmax scale (log2 domain, unless a logit cap needs raw q.k) and by 1/(code scale of
        # quarter j), a power of two; KDT = fp16 for the K codes' exponent trick
        KDT: tl.constexpr = tl.float32 if PV_DT == tl.float32 else tl.float16
        QSC = 1.0 if LOGIT_CAP else sm_scale_log2
        qbt = Q + b.to(tl.int64) * stride_qt + hq[None, :] * stride_qh + dq[:, None]
        q0t = (tl.load(qbt, mask=rmask[None, :], other=0.0).to(tl.float32) * QSC).to(KDT)
        q1t = (tl.load(qbt + QD, mask=rmask[None, :], other=0.0).to(tl.float32) * (QSC / _k_scale(1))).to(KDT)
        q2t = (tl.load(qbt + 2 * QD, mask=rmask[None, :], other=0.0).to(tl.float32) * (QSC / _k_scale(2))).to(KDT)
        q3t = (tl.load(qbt + 3 * QD, mask=rmask[None, :], other=0.0).to(tl.float32) * (QSC / _k_scale(3))).to(KDT)
        # scores: part = sum_j q'_j.(K_OFS + s_j c_j) = q.c + K_OFS * qs_ofs, q.k_hat = sc q.c + mn sum(q)
        s0 = tl.sum(q0t.to(tl.float32), 0)
        s1 = tl.sum(q1t.to(tl.float32), 0)
        s2 = tl.sum(q2t.to(tl.float32), 0)
        s3 = tl.sum(q3t.to(tl.float32), 0)
        qs_ofs = K_OFS * (s0 + s1 + s2 + s3)
        qsum = s0 + _k_scale(1) * s1 + _k_scale(2) * s2 + _k_scale(3) * s3
        # V accumulators transposed ([Dv/4, rows]: Dv fills the MMA's 16-row side, no padding rows)
        # and in scaled units during the INT2 loop: a'_j = s_j * a_j
        a0 = tl.trans(a0)
        a1 = tl.trans(a1 * _v_scale(1))
        a2 = tl.trans(a2 * _v_scale(2))
        a3 = tl.trans(a3 * _v_scale(3))
        # per-row part of the V sums, added to the accumulators once after the loop (rescaled by
        # alpha like them): sum_k p*mn; the tile's p @ codes accumulates in the MMA
        b_mn = tl.zeros([BLOCK_M], dtype=tl.float32)
        dv = tl.arange(0, QDV)
        # whole tiles without masks, then the partial last tile (if any) with them
        i_full = i_lo + (i_hi - i_lo) // BLOCK_N * BLOCK_N
        for i0 in tl.range(i_lo, i_full, BLOCK_N, num_stages=INT2_STAGES):  # see INT2_STAGES
            kc, kpw, vct, vpw = _int2_fetch(_int2_slots(i0, i_hi, sink_lo, hole, idx_base, BLOCK_N, OFS32),
                                            KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn, QD, QDV)
            m_i, l_i, b_mn, a0, a1, a2, a3 = _int2_tile(
                i0, i_hi, kc, kpw, vct, vpw, q0t, q1t, q2t, q3t, qs_ofs, qsum, m_i, l_i, b_mn,
                a0, a1, a2, a3, sm_scale_log2, logit_cap, False, BLOCK_N, LOGIT_CAP, KDT, PV_DT, USE_ASM)
        if i_full < i_hi:  # the partial last tile, masked
            kc, kpw, vct, vpw = _int2_fetch(_int2_slots(i_full, i_hi, sink_lo, hole, idx_base, BLOCK_N, OFS32),
                                            KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn, QD, QDV)
            m_i, l_i, b_mn, a0, a1, a2, a3 = _int2_tile(
                i_full, i_hi, kc, kpw, vct, vpw, q0t, q1t, q2t, q3t, qs_ofs, qsum, m_i, l_i, b_mn,
                a0, a1, a2, a3, sm_scale_log2, logit_cap, True, BLOCK_N, LOGIT_CAP, KDT, PV_DT, USE_ASM)

        # (p*sc) @ (V_OFS + s_j c) less V_OFS sum(p*sc) (per tile) is s_j (p*sc) @ c, and
        # s_j p @ v_hat_j = s_j (p*sc) @ c + s_j p @ mn: add s_j * sum(p*mn) per row
        b_mn = b_mn[None, :]
        a0 = a0 + b_mn * _v_scale(0)
        a1 = (a1 + b_mn * _v_scale(1)) * (1.0 / _v_scale(1))
        a2 = (a2 + b_mn * _v_scale(2)) * (1.0 / _v_scale(2))
        a3 = (a3 + b_mn * _v_scale(3)) * (1.0 / _v_scale(3))

        # ---- normalised partial output ------------------------------------------------------------
        has = l_i > 0
        inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
        ob = Out + b.to(tl.int64) * stride_ot + hq[None, :] * stride_oh + split * stride_os + dv[:, None]
        tl.store(ob, a0 * inv_l[None, :], mask=rmask[None, :])
        tl.store(ob + QDV, a1 * inv_l[None, :], mask=rmask[None, :])
        tl.store(ob + 2 * QDV, a2 * inv_l[None, :], mask=rmask[None, :])
        tl.store(ob + 3 * QDV, a3 * inv_l[None, :], mask=rmask[None, :])
    has = l_i > 0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    tl.store(Lse + b.to(tl.int64) * stride_lt + hq * stride_lh + split * stride_ls, lse, mask=rmask)
    if MERGE:
        _merge_if_last(b, kvh, n_splits, Out, stride_ot, stride_oh, stride_os,
                       Lse, stride_lt, stride_lh, stride_ls, Final, stride_fb, stride_fh, Arrived,
                       GQA, MERGE_ROWS, DV, SPLITS_P2)


def supports(D, Dv, k_group, v_group, gqa) -> bool:
    """Shapes the fast kernel handles: one (scale, min) group per K and per V row."""
    return k_group == D and v_group == Dv and D % 64 == 0 and Dv % 64 == 0


def selected(q, k_codes, v_codes, k_group, v_group) -> bool:
    """ops.decode_attention uses this kernel unless OSCAR_INT2_DECODE_KERNEL=base (default: fast)
    and when the shapes are supported; other group sizes keep the base kernel."""
    D, Dv = k_codes.shape[-1] * 4, v_codes.shape[-1] * 4
    return (_base.kernel_choice("OSCAR_INT2_DECODE_KERNEL") == "fast"
            and supports(D, Dv, k_group, v_group, q.shape[1] // k_codes.shape[1]))


def decode_attention_fast(
    q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_group, v_group, sm_scale, sink_start=None,
    num_kv_splits=None, max_kv_splits=None, attn_logits=None, attn_lse=None, logit_cap=0.0,
    block_n=None, num_warps=None, num_stages=2, min_chunk=None, bf16_keys_per_split=None, use_asm=None,
    maxnreg=None, block_m=None, offsets_32bit=None, int2_stages=None, block_b=None, bf16_last=True,
    fused_merge=None, arrived=None, words=None, bf16_spread=True,
):
    """decode.decode_attention with the fast stage-1 kernel (same arguments, same results).

    offsets_32bit: pool offsets in 32-bit arithmetic; default: when every pool tensor has < 2^31
    elements (the other case is tested by forcing False). int2_stages: pipeline depth of the INT2
    loop (default INT2_STAGES). block_b: BF16 sink/ring keys per tile (default default_block_b).
    bf16_spread: every split reads a chunk of the BF16 sink + ring keys too (default), or (False)
    they get NB16 splits of their own (decode.bf16_splits). bf16_last: those BF16-only splits'
    programs start after the INT2 ones (default; False: in split order). fused_merge: the last
    program of each (request, KV head) merges the splits, or (False) decode's merge kernel does;
    default: fused up to FUSED_MERGE_MAX_SPLITS splits. arrived: int32 scratch of >= batch x KV
    heads zeros, left zero by every call (default: split_arrivals). words: read the codes as
    16-bit words (default when head_dim >= WORDS_MIN_DIM; False: as bytes)."""
    import torch

    from . import decode as _dec

    _base.check_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_group, v_group)
    sink_start = own_start if sink_start is None else sink_start
    B, Hq, D = q.shape
    Hkv = k_codes.shape[1]
    Dv = v_codes.shape[-1] * 4
    gqa = Hq // Hkv
    if not supports(D, Dv, k_group, v_group, gqa):
        raise ValueError(f"fast INT2 decode needs group size == head_dim (got D={D}, G={k_group}/{v_group}); "
                         "use OSCAR_INT2_DECODE_KERNEL=base")
    if words is None:
        words = D >= WORDS_MIN_DIM and Dv >= WORDS_MIN_DIM
    elif words and min(D, Dv) < WORDS_MIN_DIM:
        raise ValueError(f"code words need head_dim >= {WORDS_MIN_DIM} (got D={D}, Dv={Dv})")
    S, W = sink_k.shape[1], ring_k.shape[1]
    max_kv_splits, nb16, attn_logits, attn_lse = _dec.plan_decode(
        q, o, k_codes, v_codes, sink_k, ring_k, kv_indptr, max_kv_splits, attn_logits, attn_lse,
        bf16_keys_per_split, default_max_splits, bf16_spread)
    min_chunk = min_chunk or _dec.MIN_CHUNK
    bm = block_m or max(8, triton.next_power_of_2(gqa))
    bn = block_n or BLOCK_N
    kp = as_param_words(k_params)
    vp = as_param_words(v_params)
    if fused_merge is None:
        fused_merge = max_kv_splits <= FUSED_MERGE_MAX_SPLITS
    if fused_merge and arrived is None:
        arrived = split_arrivals(q.device, B * Hkv)
    attend_fast_kernel[(B, Hkv, max_kv_splits)](
        q, q.stride(0), q.stride(1),
        attn_logits, attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse, attn_lse.stride(0), attn_lse.stride(1), attn_lse.stride(2),
        *pool_launch_args(*((k_codes.view(torch.int16), kp, v_codes.view(torch.int16), vp) if words else
                            (k_codes, kp, v_codes, vp)), sink_k, sink_v, ring_k, ring_v),
        kv_indptr, kv_indices, req_rows, own_start, sink_start,
        num_kv_splits if num_kv_splits is not None else kv_indptr,
        sm_scale * _base.LOG2E, float(logit_cap), int(max_kv_splits),
        o, o.stride(0), o.stride(1), arrived if fused_merge else kv_indptr,
        GQA=gqa, D=D, DV=Dv, GK=k_group, GV=v_group, S=S, W=W,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_B=block_b or default_block_b(B, Hkv, max_kv_splits, q.device),
        HAS_NSPLITS=num_kv_splits is not None,
        MIN_CHUNK=min_chunk, LOGIT_CAP=logit_cap > 0, PV_DT=_base.PV_DTYPE, NB16=nb16,
        USE_ASM=(_base.USE_ASM if use_asm is None else use_asm) and q.dtype == torch.bfloat16,
        OFS32=(max(t.numel() for t in (k_codes, kp, v_codes, vp)) < 2 ** 31 if offsets_32bit is None
               else offsets_32bit),
        INT2_STAGES=int2_stages or INT2_STAGES, BF16_LAST=bf16_last,
        MERGE=fused_merge, MERGE_ROWS=triton.next_power_of_2(gqa),
        SPLITS_P2=triton.next_power_of_2(max_kv_splits), WORDS=words,
        num_warps=num_warps or NUM_WARPS, num_stages=num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if fused_merge:
        return o
    return _dec.merge_splits(o, attn_logits, attn_lse, kv_indptr, req_rows, own_start, sink_start,
                             num_kv_splits, max_kv_splits, nb16, min_chunk, S, W)
