"""Decode and extend-prefix attention over per-channel keys (KVFormat k_layout="channel",
docs/format.md "KVFormat"): one kernel, two modes, as attend.attend_kernel.

* Decode (SPLIT=True): stage 1 of split-K decode; stage 2 (LSE merge) and the split plan are
  decode.py's, unchanged. One program = (request b, KV head h, split s), rows = the GQA group of h
  (padded to >= 16 for tl.dot), exactly as attend.py's decode path.
* Extend-prefix (SPLIT=False): E_b new tokens of request b against its cached prefix, no mask.
  Grid (B, Hkv * num_mb, 1): one program = (request b, KV head h, query block mb), rows = BLOCK_M
  (token, query head) pairs, row m -> token qo_indptr[b] + m // GQA, head h * GQA + m % GQA; no
  splits: the program walks the sink, the ring and every body block, and writes o [T, Hq, Dv]
  and its natural-log lse [T, Hq] (output split strides 0). A program that saw no key (empty
  prefix) writes o = 0, lse = -inf.

Key positions come from the same three sources as attend.py (source_ranges): BF16 sink, BF16
ring (read by attend._bf16_source_loop) and the quantised body, positions
[0, sink_lo) u [sink_hi, ring_lo). The body differs from the served INT2 layout:

* keys: 2/3/4-bit codes per (token, head) row (pack_bits), and one fp16 (scale, min) per
  (page block, head, channel) at k_params[slot // B, h, c]. A body tile is one page block of B
  positions, so the whole tile shares one (scale, min) row and the dequantisation folds into q:
      q . k_hat(t) = sum_c q_c (s_c code_tc + m_c) = (q * s) . code_t + q . m
  i.e. q is scaled once per tile and one constant per query row is added; codes go to tl.dot as
  small integers (exact in bf16).
* values: 2-bit per-token groups as in the INT2 format, folded the same way as attend.py.

Body tiles walk whole blocks: the blocks holding [0, min(sink_lo, ring_lo)), then those holding
[sink_hi, ring_lo) (a block shared by both lists is walked once); positions of a block that are
not body positions (sink hole, ring, past the request) are masked. Every walked block holds at
least one body position, so no tile is fully masked. Decode: splits NB16..n-1 share the blocks
whose every position is a body position in equal contiguous chunks and walk them without masks;
the other blocks (the sink's and the ring's edges, list A) are BF16 split 0's, masked (4-bit keys:
the body splits share every block, masked; see the kernel); the split count is num_splits_of over
the body's key count, as in the merge kernel, so decode.merge_splits needs no change. Extend: one
program walks them all.

A body position must lie in a complete block (the format's reader rule,
reference.format_source_masks): the ring holds >= one block, so only a request whose own_start
is past the start of its incomplete block could violate it; SGLang's paged radix hits are
page-aligned. The kernel does not check this. Extend-prefix reads the prefix as a reader of
kv_len keys, so it runs before the new tokens are stored (the backend's order): their store
overwrites ring entries of the prefix and may complete its last block.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..format import PAGE_SIZES, code_bytes
from .attend import (
    INT2_STAGES, LN2, LOG2E, PV_DTYPE, USE_ASM, _bf16_source_loop, _cap_and_scale, _online_softmax, _pick4, _unpack_params,
    as_param_words, empty_softmax_state, load_q_quarters, num_splits_of, pool_launch_args,
    source_ranges, split_ranges,
)
from .attend_fast import (FUSED_MERGE_MAX_SPLITS, WORDS_MIN_DIM, _merge_if_last, _quarter_v, _v_scale, _word_code,
                          _word_dims, _word_ofs, _words_of_quarter, split_arrivals)
from .decode import BLOCK_B, bf16_splits, merge_splits, plan_decode, sm_count
from .extend_prefix import extend_outputs

CHANNEL_HEAD_DIMS = (64, 128)
CHANNEL_KEY_BITS = (2, 3, 4)
# Decode warps per key width: the transposed body's [64 keys, 8 rows] tiles are one warp's MMAs
# (attend_fast); 3-bit keys ("packed") build their codes in 32-bit registers and spill at one warp
# (sm_90 ptxas: 480 B), so they take two; the "planes" variant below takes PLANES_NUM_WARPS = 1.
DECODE_NUM_WARPS = {2: 1, 3: 2, 4: 1}
# 3-bit decode variants (OSCAR_CHANNEL_DECODE_3BIT or decode_attention_channel(k3_variant=...)):
# "packed" assembles each 3-bit code in a 32-bit register (_key_quarter), "planes" (the default)
# reads the same bytes as two planes, each an MMA operand made with one lop3 per two codes
# (_decode_body's PLANES): the 2-bit plane exactly as 2-bit keys, the 1-bit plane per eighth of
# the row. "planes" needs head_dim >= 128 (an eighth is the MMA's K of 16 dims); at head_dim 64
# it runs "packed". sm_90 SASS (tests/kernels/sm90.py, B=8, L=32K, D=128): no spills at one warp,
# 2000 warp-instructions per body tile against packed's 3630 at two. H100, 2026-11-26
# (bench/results/kernels/2026-11-26_0811_channel-3bit-planes_h100.json): B=8, L=32K decode in
# 128 us against packed's 254 (55% vs 28% of copy bandwidth), relative difference 1e-3; the
# channel kernel tests pass on CUDA with both.
CHANNEL_3BIT_VARIANTS = ("packed", "planes")
CHANNEL_3BIT_ENV = "OSCAR_CHANNEL_DECODE_3BIT"
CHANNEL_3BIT_DEFAULT = "planes"
PLANES_NUM_WARPS = 1
PLANES_MIN_DIM = 128


# How decode reads codes (OSCAR_CHANNEL_DECODE_READS or decode_attention_channel(code_reads=...)):
# "bytes" reads value codes transposed, one byte per (dim quarter, key), which sm_90 builds from
# single-byte shared-memory loads and byte permutes (64 LDS.U8 per 64-key tile), and widens every
# key byte to 16 bits (byte permutes again); "words" (the default since 2026-11-27) reads value
# codes, and 2-bit key codes, as attend_fast's 16-bit code words (ldmatrix straight into the MMA
# operand, one lop3 per two codes, 8 extractions of D/8 dims each; needs a value / key dim >= 128,
# below it reads bytes; 3- and 4-bit keys keep their byte reads). Values are the same per-token
# 2-bit groups as the fast kernel's and 2-bit keys the same quarter-split bytes, so its validated
# extractions are reused; the per-channel key scales are read at each extraction's dims. Its value
# operands are fp16 (p * s rounded to fp16; bytes: bf16), so it is also the more accurate. H100,
# final kernels (bench/results/kernels/2026-11-27_2107_kernel-error_h100.json): on the outlier
# inputs of bench/kernel_error.py 0.35% / 0.25% / 0.12% max error against float64 for 3 / 2 / 4-bit
# keys (BF16 flash arithmetic: 0.86% / 0.67% / 0.65%); with flat attention over 32K zero-mean keys
# in one split 0.15% / 0.15% / 0.17%, bytes 0.43% / 0.49% / 0.49% (BF16: 0.26% / 0.23% / 0.26%).
# One call against bytes, before VMID (2026-11-27_2045_channel-rowc-vones_h100.json, k3c64):
# B=8 x 32K 101.8 vs 109.4 us, 64 x 8K 197.5 vs 215.8, 512 x 2K 458.1 vs 486.0, 1 x 128K 57.6 vs
# 63.3. It was opt-in until VMID: flat attention over 32K keys in one split erred 3.2e-2
# (2026-11-26) and 2.6e-2 (2026-11-27_2059_kernel-error_h100.json), bytes 1.0e-2.
CHANNEL_CODE_READS = ("bytes", "words")
CHANNEL_READS_ENV = "OSCAR_CHANNEL_DECODE_READS"
CHANNEL_READS_DEFAULT = "words"


# The decode body's key-side MMA operands (OSCAR_CHANNEL_DECODE_KEYS or
# decode_attention_channel(key_operands=...)): "fp16-subnormal" (the default since 2026-11-29)
# takes exact fp16 subnormal code operands where a layout has them, with no offsets: the 3-bit
# planes' one operand an eighth (SUB3 below) and 4-bit keys' nibbles (NIBBLES); 2-bit keys run
# "fp16". "fp16-paired" (the default from 2026-11-28) is
# "fp16" whose two 3-bit planes carry opposite offsets (PAIRED below; other layouts run "fp16");
# "fp16" (the default from 2026-11-27) rounds each block's q * s to
# fp16 and builds the code operands under fp16 exponents with bf16's lop3s (BODY_OFS_FP16 = 1024 +
# code * place: an offset 8x bf16's relative to the codes); "bf16" (the default until 2026-11-27)
# rounds q * s to bf16 and builds them under bf16 exponents (BODY_OFS + code * place);
# "fp16-shifted" shifts the code fields up 3 bits first (one shl or shr per register) so that the
# fp16 operands are bf16's values exactly, 128 + code * place. Why: the q * s of a block is rounded
# once for its 64 keys, so its error does not average out over keys. On outlier inputs against
# float64 (bench/kernel_error.py, H100: bench/results/kernels/2026-11-27_1257_kernel-error_h100.json)
# bf16 max 3.2% / 2.4% / 1.2% (3 / 2 / 4-bit keys), fp16 0.9% / 0.9% / 0.5%, BF16 flash arithmetic
# 0.5% / 0.3% / 0.3%; fp16 as fast or faster (H200, same run, _1241_ / _1242_channel-decode-defaults:
# 1 x 128K 65.9 vs 67.0 us, 512 x 2K 486 vs 501). fp16 needs |q * s| < 65,504: q is the rotated
# query (times the softmax scale off the 3-bit planes), s a key channel's range / (2^bits - 1) in
# its block, so |q| * |k| would have to reach ~10^5; such a model should set
# OSCAR_CHANNEL_DECODE_KEYS=bf16.
# 2-bit keys read as words (KWORDS) use fp16 either way; 4-bit keys with "fp16" / "fp16-paired" /
# "fp16-subnormal" operands take NIBBLES' subnormal ones (no offsets).
# fp16-paired against fp16, H100, one call (bench/results/kernels/
# 2026-11-28_0034_channel-paired-operands_h100.json, k3c64-v2t64-s4-w128): 8 x 32K 99.3 -> 97.2 us
# (69% -> 71% of copy), 64 x 8K 190.1 -> 185.6, 64 x 8.5K 194.9 -> 192.8, 1 x 128K 59.4 -> 57.8,
# but 512 x 2K 429.4 -> 437.0 (1.8% slower); offline sm_90 1,351 -> 1,317 instructions a body tile,
# 255 -> 238 registers. Error on kernel_error.py's outlier inputs 4.35e-3 max against fp16's
# 4.47e-3 (_0036_kernel-error_h100.json): the planes' offsets cancel after each pair of MMAs
# instead of accumulating over the eighths.
# "int8" (opt-in, 3-bit planes only; INT8's note): each block's q * s rounded to int8 on one grid
# per query row, the 3-bit codes as int8 operands (one m16n8k32 MMA per key quarter, two lop3s per
# four codes, no byte widening). Offline sm_90: 1,197 instructions a body tile against 1,281. H200,
# one call (bench/results/kernels/2026-11-28_1818_channel-int8-key-operands_h200.json): 8 x 32K
# 94.6 -> 86.0 us, 64 x 8K 173.9 -> 161.5, 512 x 2K 395.7 -> 374.3, 1 x 128K 56.5 -> 52.7. But
# one grid per row leaves the small channels few bits where a few channels' scales are 16x the
# rest: max error against float64 on kernel_error.py's outlier inputs 0.22 against fp16-paired's
# 4.35e-3 (2026-11-28_1814_kernel-error-int8_h200.json). Not for serving until that is fixed.
CHANNEL_KEY_OPERANDS = ("bf16", "fp16", "fp16-shifted", "fp16-paired", "int8", "fp16-subnormal")
CHANNEL_KEYS_ENV = "OSCAR_CHANNEL_DECODE_KEYS"
CHANNEL_KEYS_DEFAULT = "fp16-subnormal"


# Decode split plan (issue 19). A one-warp program takes 245-255 registers at sm_90, so 8 fit on an
# SM; fewer resident programs leave the SM's schedulers waiting on each program's dependent
# instructions, more than one wave of them adds a tail. The plan: body splits for
# DECODE_SPLIT_PROGRAMS_PER_SM programs per SM over the batch's (request, KV head) pairs (rounded
# down: no second, nearly empty wave), at least 1, and at most DECODE_MAX_SPLITS splits in all; in
# kernel each request then uses as many as its body has DECODE_MIN_CHUNK-key chunks (one page).
# H100, k3c64-v2t64-s4-w128, against SGLang's plan (its heuristic for its own kernel, up to 64
# splits, in a grid of 64 splits per request; bench/results/kernels/
# 2026-11-27_0251_channel-split-plan_h100.json): 8 x 32K 125.8 vs 168.3 us (SGLang's 18 body splits
# are 1,152 programs: a second wave of 96), 64 x 8K 247.8 vs 302.6 (its 1 body split), 256 / 512
# x 2K 284.7 / 552.5 vs 340.2 / 691.2 (the same 1 body split, but 64 programs a request, 62 of
# which return at once). Batch 1 (8 KV heads) gets 128 splits since 2026-11-27 12:28 (cap 64
# before): 1 x 128K 66.5 vs 77.2 us, 32K 27.2 vs 28.2, 4K 14.6 vs 14.3, 8K 16.4 vs 15.4 (a grid of
# 128 splits a head, most returning at once at 4K; 2026-11-27_1228_channel-split-plan-b1_h100.json);
# the merge's one-shot [128, Dv] tile stays at 4 warps (8 / 16 were 1.3-3.6 us slower), and a
# 128-key least chunk lost 3 us at 128K for 0.8 us at 4K. Batch 2 gets 68. SGLang's split scratch
# holds 64 in the server, so the backend gives these batches one of its own (_wide_split_scratch).
# Neither more warps, nor register caps (spills), nor a third pipeline stage helped at any batch
# (_0228_*); nor, for 4-bit keys, caps that leave the body loop without spills (224 / 200
# registers: 9 / 10 programs an SM), with or without the splits to fill them (H200,
# bench/results/kernels/2026-11-29_0548_channel-register-caps-*). Nor more parallelism inside a program's step (2026-11-28, one call, H100:
# bench/results/kernels/2026-11-28_0025_channel-pipelined-body_h100.json; the code was not kept): a
# body loop whose step scored tile t while taking the softmax and values of tile t - 1 (sm_90
# interleaved the two: 242 registers, no spills, +27 instructions a tile) was 3-6% slower at every
# shape, and the 3-bit planes' scores in two accumulators (a dependent MMA chain half as long)
# 0.6-3.4% slower. That points at the instructions the body issues rather than their latencies
# (fp16-paired below: 2.5% fewer, 1-2.7% faster at four of five shapes). The body programs of one
# SM end up to ~14 us apart at 8 x 32K (the warp schedulers' choice, not slower SMs), but neither
# 2-4 waves of programs nor splits sharing their head's blocks through an atomic counter (chunks
# after a static share) finished sooner: 4-12 us slower at 8 x 32K (bench/results/kernels/
# 2026-11-28_0655_*, _0657_*, _0704_*; docs/benchmarks.md 2026-11-28 06:37).
DECODE_SPLIT_PROGRAMS_PER_SM = 8
DECODE_MAX_SPLITS = 128
# FMERGE (decode_attention_channel(fused_merge=...)): up to attend_fast.FUSED_MERGE_MAX_SPLITS
# splits, the last program of each (request, KV head) to finish merges the splits' partials
# (attend_fast._merge_if_last) instead of a merge kernel launched after the decode. In the server
# at 64 x 8K the merge kernel took 8.0 us a layer after a 191 us decode (0.26 ms a step; bench/
# results/serving/2026-11-27_2214_batch64-step-profile_h100.json). Same registers, shared memory
# and body loop offline (sm_90: 255, 24,600 B, 1,351 instructions a tile).
# Launch order (BF16_LAST, decode_attention_channel(bf16_last=...)): the grid's z index runs the
# body splits first and the BF16 splits (sink, ring and edge blocks: short programs) last. In split
# order the BF16 programs took the first slots of the wave (512 of ~1,056 at 64 x 8K), so a third
# of the body programs started only when those ended. Bit-identical results.
# H100, both in one call (bench/results/kernels/2026-11-27_2246_channel-fused-merge_h100.json,
# k3c64-v2t64-s4-w128, words; fused at 64 x 8K and 512 x 2K, where the plan has 3 and 2 splits):
# | B x L     | neither | bf16_last | fused_merge | both (the default) |
# | 8 x 32K   | 102.4   | 98.1      | 102.3 (17 splits: not fused) | 99.0 us (as bf16_last) |
# | 64 x 8K   | 205.1   | 192.7     | 201.7       | 189.4 |
# | 512 x 2K  | 458.1   | 434.7     | 466.1       | 426.5 |
# | 1 x 128K  | 59.8    | 58.4      | 59.7 (128 splits: not fused) | 57.9 (as bf16_last) |
# In the server (64 x 8K + 512, dummy Llama-3.1-8B, bench/results/serving/) the launch order alone
# did not show: the decode kernel took 191.4 us a layer before it (_2214_) and 191.0 after
# (_2237_, another H100). With both, the full-occupancy decode was 0.991x the per-token recipe's
# in one run (_2253_), 0.974x with the launch order alone (_2236_).
DECODE_MIN_CHUNK = 64


def default_decode_splits(batch: int, kv_heads: int, device, nb16: int) -> int:
    """max_kv_splits of the per-channel decode (nb16 BF16 splits + body splits) when none is
    given: see DECODE_SPLIT_PROGRAMS_PER_SM."""
    body = DECODE_SPLIT_PROGRAMS_PER_SM * sm_count(device) // (batch * kv_heads)
    return max(1, min(DECODE_MAX_SPLITS - nb16, body)) + nb16


def decode_splits(batch: int, kv_heads: int, sink: int, window: int, device) -> int:
    """The split count decode_attention_channel picks for this batch when max_kv_splits and the
    scratch are not given (its BF16 splits for a sink + ring of sink + window keys included):
    what a caller sizing attn_logits / attn_lse needs."""
    return default_decode_splits(batch, kv_heads, device, bf16_splits(sink, window, 1 << 30))


def _kernel_choice(arg_name, value, env, choices, default) -> str:
    """A kernel switch: `value` if given, else the environment variable `env` (unset or empty:
    `default`); a value not in `choices` raises ValueError naming where it came from."""
    src = arg_name if value is not None else env
    kind = value if value is not None else (os.environ.get(env) or default)
    if kind not in choices:
        raise ValueError(f"{src} must be {' or '.join(repr(c) for c in choices)}, got {kind!r}")
    return kind


def channel_code_reads(code_reads=None) -> str:
    """How decode reads codes: code_reads if given, else OSCAR_CHANNEL_DECODE_READS ('words')."""
    return _kernel_choice("code_reads", code_reads, CHANNEL_READS_ENV, CHANNEL_CODE_READS, CHANNEL_READS_DEFAULT)


def channel_key_operands(key_operands=None) -> str:
    """The decode body's key operands: key_operands if given, else OSCAR_CHANNEL_DECODE_KEYS
    ('fp16-subnormal')."""
    return _kernel_choice("key_operands", key_operands, CHANNEL_KEYS_ENV, CHANNEL_KEY_OPERANDS, CHANNEL_KEYS_DEFAULT)


def channel_3bit_variant(k3_variant=None) -> str:
    """The 3-bit decode variant: k3_variant if given, else OSCAR_CHANNEL_DECODE_3BIT ('planes')."""
    return _kernel_choice("k3_variant", k3_variant, CHANNEL_3BIT_ENV, CHANNEL_3BIT_VARIANTS, CHANNEL_3BIT_DEFAULT)


@triton.jit
def _key_quarter(kc, kc2, hb, J: tl.constexpr, BITS: tl.constexpr, QD: tl.constexpr):
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


@triton.jit
def _code_operand(c, DT: tl.constexpr):
    """int32 codes in [0, 128) as exact DT values for an MMA operand. bf16 (CUDA): 128 + code
    from the exponent trick, minus 128 in packed bf16 (exact), instead of one int-to-bf16
    conversion per code (sm_90 issues those at 16 per clock and SM, an eighth of the fp32 rate);
    fp16: 1024 + code, minus 1024; otherwise (the interpreter's fp32) a cast."""
    if DT == tl.bfloat16:  # the decode's 3-bit operand idiom (_key_operand), less its offset
        r = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0
    elif DT == tl.float16:  # 1024's exponent: mantissa ulp 1
        r = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
    else:
        r = c.to(DT)
    return r


# fp16 bits of 128 + code for a code in [0, 128): 128's exponent, the code in the mantissa's top 7
# bits (the ulp at 128 is 1/8). tests/kernels/test_channel_kernels.py checks it bit for bit.
FP16_CODE_BASE = tl.constexpr(0x5800)
FP16_CODE_SHIFT = tl.constexpr(3)
FP32_CODE_BASE = tl.constexpr(0x4B000000)  # 2^23: a code in the low mantissa bits is 2^23 + code


@triton.jit
def _dequant(c, sc, mn, AXIS: tl.constexpr, DT: tl.constexpr):
    """code * scale + min as DT, for int32 codes c [rows, cols] in [0, 128) and fp32 (scale, min)
    vectors along AXIS (0: one per column, keys; 1: one per row, values), DT fp16 or fp32 (the
    pool's fp16 params are exact in both; bf16 would round them, see DQ_DT). fp16 (the extend's
    operands on CUDA): packed half math, two elements an instruction (sm_90 HADD2 / HFMA2): 128 +
    code from the exponent trick, minus 128 exactly, times the scale plus the min rounded once to
    2^-11; no int-to-float or fp32-to-half conversions per element. fp32 (the interpreter's, and
    dequant_channel's pieces on CUDA): 2^23 + code from the fp32 exponent trick (one lop, no
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


# Decode body (SPLIT): both products transposed as in attend_fast (keys / value dims fill the
# MMA's 16-row side, the GQA rows its 8-column side: BLOCK_M = 8 at GQA <= 8), code operands made
# with the bf16 exponent trick instead of int -> float conversions: bits 0x4300 | x are 128 + x,
# so a masked code field ORed under that exponent is BODY_OFS + code * scale exactly (one lop3 per
# two codes, attend_fast._quarter_v; 4-bit nibbles and 3-bit codes below). The offsets are removed
# per tile: for keys through the (q * s) . m row constant, for values from the accumulators before
# each tile's MMA (attend_fast).
# ROWC, the keys' row constant per tile (since 2026-11-27; offline sm_90 SASS, B=8, L=32K,
# 3-bit planes: 1,531 -> 1,462 instructions a body tile with byte reads, 1,386 -> 1,321 with
# words): q is divided once per program by each key quarter's operand scale ks (its place value:
# a power of two, so exactly), which makes q * s a single product per dim; the mins' term is
# summed per dim as (q / ks) . m, multiplied up between quarters (Horner, walking quarter 3 down
# to 0: ks_{J+1} / ks_J is a power of two); the operands' offsets come off as KOFS * sum(w * qs)
# from a second per-dim sum (w: the offset's weight, 1 + HI_QMUL for the planes), after the loop of
# eighths or quarters instead of once per term.
# VONES, the values' offsets: each tile's sum(p * sc) per row comes from the tensor cores as
# ones @ (p * sc), the same [accumulator rows, keys] x [keys, rows] product as the tile's values,
# so it lands in the value accumulators' layout (1,581 -> 1,531 instructions with byte reads,
# 1,444 -> 1,386 with words): no conversion of p * sc back to fp32, no cross-lane sums.
# ROWC and VONES on the H100, one call against abc5d06's kernels (bench/results/kernels/
# 2026-11-27_2044_channel-before-rowc-vones_h100.json / _2045_channel-rowc-vones_h100.json, k3c64,
# 8 x 32K / 64 x 8K / 512 x 2K / 1 x 128K): bytes 110.6 / 221.8 / 497.7 / 64.8 -> 109.4 / 215.8 /
# 486.0 / 63.3 us, words 103.6 / 206.7 / 466.7 / 59.4 -> 101.8 / 197.5 / 458.1 / 57.6 us.
# VMID, the values' mid-code: the accumulators sum p * sc * (code - VMID), with VMID * sc added to
# the group's min in the fp32 row sums instead. Each value is sc * code + mn, and a group's codes
# spread over 0..3, so summed over a split's keys sc * code grows with the keys while the output
# (a weighted mean of values that may cancel) does not: the tensor cores' accumulation then drops
# low bits of a sum up to ~100x the output. Centred, the accumulators stay of the output's order.
# H100, flat attention over 32K zero-mean keys in one split (bench/kernel_error.py's flat rows,
# 2026-11-27_2059_ -> _2107_kernel-error_h100.json): words 2.6e-2 -> 1.5e-3, bytes 1.0e-2 -> 4.3e-3
# relative error (BF16 flash arithmetic 2.6e-3). Offline sm_90: +30 instructions a 3-bit body tile
# with words (1,321 -> 1,351), +40 with bytes; not timed on its own.
VMID = tl.constexpr(1.5)
BODY_OFS = tl.constexpr(128.0)
# fp16 key operands (CHANNEL_KEY_OPERANDS), as PTX pieces (source move, field mask, exponent)
# per variant, index 0 "fp16", 1 "fp16-shifted" (tests/kernels/test_channel_kernels.py emulates
# every one on all byte pairs). "fp16": the bf16 idioms' fields under 1024 (fp16 mantissa ulp 1 as
# bf16's at 128): BODY_OFS_FP16 + code * place. "fp16-shifted": each field moved up 3 bits (a
# widened byte's bits 8-15 are zero, so a shift left of up to 8 cannot carry into the other half)
# under 128 (ulp 1/8): BODY_OFS + code * place, the bf16 operand's value in fp16.
BODY_OFS_FP16 = tl.constexpr(1024.0)
# 2-bit quarter J, place _k_place(J, KEYOP): "fp16" reads every quarter where it lies (quarter 3
# at bits 6-7, place 64: 1024 + 3 * 64 fits fp16's 10-bit mantissa), "fp16-shifted" brings quarter
# 3 down to place 16 as bf16 must (its 7-bit mantissa holds 128 + 3 * 16, not 128 + 3 * 64); a
# shift less per two codes of quarter 3 (offline sm_90 SASS: 80 -> 32 shifts a 3-bit body tile)
# (flat tuples, variant-major: entry 4 * variant + J; Triton indexes constexpr tuples of strings
# one level deep)
LO16_SRC = tl.constexpr(("mov.b32 w, $1;", "mov.b32 w, $1;", "mov.b32 w, $1;", "mov.b32 w, $1;",
                         "shl.b32 w, $1, 3;", "shl.b32 w, $1, 3;", "shl.b32 w, $1, 3;", "shl.b32 w, $1, 1;"))
LO16_MASK = tl.constexpr(("0x00030003", "0x000C000C", "0x00300030", "0x00C000C0",
                          "0x00180018", "0x00600060", "0x01800180", "0x01800180"))
# place value of key quarter 3 per KEYOP (bf16, fp16, fp16-shifted); quarters 0-2: 4^J
KEY_PLACE3 = tl.constexpr((16.0, 64.0, 16.0))
KEY16_EXP = tl.constexpr(("0x64006400", "0x58005800"))
# 4-bit nibble (low: quarters 0-1, high: quarters 2-3), place 1; entry 2 * variant + high
NIB16_SRC = tl.constexpr(("mov.b32 w, $1;", "shr.b32 w, $1, 4;", "shl.b32 w, $1, 3;", "shr.b32 w, $1, 1;"))
NIB16_MASK = tl.constexpr(("0x000F000F", "0x00780078"))
# a packed 3-bit code c in [0, 8) as int16 bits: c | 0x6400 (1024 + c) or c << 3 | 0x5800 (128 + c)
PACK16_SHIFT = tl.constexpr((0, 3))
PACK16_BASE = tl.constexpr((0x6400, 0x5800))


@triton.jit
def _v_place(J: tl.constexpr, USE_ASM: tl.constexpr):
    """Place value of value quarter J's code in its byte-read operand (1 without USE_ASM: bare codes)."""
    if USE_ASM:
        r = _v_scale(J)
    else:
        r = 1.0
    return r


@triton.jit
def _k_place(J: tl.constexpr, KEYOP: tl.constexpr):
    """Place value of 2-bit key quarter J's code in its operand (KEYOP: CHANNEL_KEY_OPERANDS index)."""
    if J == 3:
        r = KEY_PLACE3[KEYOP]
    else:
        r = 4.0 ** J
    return r


@triton.jit
def _lo_operand(c16, J: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr, KEYOP: tl.constexpr):
    """Quarter J of uint16-widened 2-bit codes as a key operand in DT, code * _k_place(J, KEYOP)
    plus the operand's offset: with DT fp16 on CUDA the fp16 variant of KEYOP (1 "fp16", 2
    "fp16-shifted"), else attend_fast._quarter_v (its bf16 trick converted to DT, or the exact
    code * _v_scale(J) without USE_ASM; quarter 3 of "fp16" exactly at place 64)."""
    V16: tl.constexpr = KEYOP - 1 if KEYOP > 0 else 0
    if DT == tl.float16 and USE_ASM:
        # one lop3 per two codes: (SRC(c16) & MASK) | EXP as two fp16 halves
        r = tl.inline_asm_elementwise(
            "{.reg .b32 m, w; mov.b32 m, " + KEY16_EXP[V16] + "; " + LO16_SRC[4 * V16 + J]
            + " lop3.b32 $0, w, " + LO16_MASK[4 * V16 + J] + ", m, 0xEA;}",
            "=r,r", [c16], dtype=tl.float16, is_pure=True, pack=2)
    elif J == 3 and KEY_PLACE3[KEYOP] == 64.0:
        tl.static_assert(not USE_ASM, "place-64 key operands are fp16's")
        r = (c16.to(tl.int32) & 0xC0).to(DT)
    else:
        r = _quarter_v(c16, J, DT, USE_ASM)
    return r


@triton.jit
def _k_scale_ch(J: tl.constexpr, BITS: tl.constexpr, KEYOP: tl.constexpr, NIBBLES: tl.constexpr = False):
    """Scale of key quarter J's operand (its code field's place value)."""
    if NIBBLES:
        r = 16.0 if J >= 2 else 1.0
    elif BITS == 2:
        r = _k_place(J, KEYOP)
    else:
        r = 1.0
    return r


# prmt selectors of _widen: bytes 0, 1 (then 2, 3) of a register into the low bytes of two 16-bit
# halves, their high bytes from the zero operand (selector digit 4: byte 0 of the second source)
WIDEN_PRMT = tl.constexpr(("0x4140", "0x4342"))


@triton.jit
def _widen(c8, USE_ASM: tl.constexpr):
    """uint8 codes as uint16 (the operand idioms' input). USE_ASM: one prmt per two bytes (each
    register of four bytes into two of two halves); a plain cast has sm_90 extract every byte with
    its own prmt and pack the pairs with a third (1.5 a byte). Offline sm_90 SASS (B=8, L=32K),
    instructions per body tile: 3-bit planes 1,898 -> 1,802, 2-bit 1,694 -> 1,630, 4-bit 1,821 ->
    1,693, registers unchanged, no spills. H100, same call (bench/results/kernels/
    2026-11-27_0452_channel-widen-*): k3c64-v2t64-s4-w128 8 x 32K 125.0 -> 117.9 us, 64 x 8K
    241.6 -> 232.5, 512 x 2K 547.9 -> 517.6, 1 x 128K 81.6 -> 77.6, 1 x 4K unchanged; 2-bit keys
    1-4% faster; 4-bit keys not timed. Value codes keep the cast: they arrive one byte a load
    (transposed), and the cast packs those pairs with one prmt already."""
    if USE_ASM:
        r = tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, 0, " + WIDEN_PRMT[0] + "; prmt.b32 $1, $2, 0, " + WIDEN_PRMT[1] + ";",
            "=r,=r,r", [c8], dtype=tl.uint16, is_pure=True, pack=4)
    else:
        r = c8.to(tl.uint16)
    return r


@triton.jit
def _key_operand(kc, kc2, hb, J: tl.constexpr, BITS: tl.constexpr, QD: tl.constexpr, DT: tl.constexpr,
                 USE_ASM: tl.constexpr, KEYOP: tl.constexpr):
    """Key quarter J as an MMA operand [BLK, D/4] in DT: BODY_OFS + code * _k_scale_ch(J, BITS)
    with USE_ASM (bf16; fp16: the fp16 variant of KEYOP, LO16_SRC's note), the exact code without
    (interpreter). kc / kc2 / hb: _key_quarter's."""
    V16: tl.constexpr = KEYOP - 1 if KEYOP > 0 else 0
    if USE_ASM:
        if BITS == 2:
            r = _lo_operand(_widen(kc, USE_ASM), J, DT, USE_ASM, KEYOP)
        elif BITS == 4:
            src = kc if J % 2 == 0 else kc2
            if DT == tl.float16:
                r = tl.inline_asm_elementwise(
                    "{.reg .b32 m, w; mov.b32 m, " + KEY16_EXP[V16] + "; " + NIB16_SRC[2 * V16 + J // 2]
                    + " lop3.b32 $0, w, " + NIB16_MASK[V16] + ", m, 0xEA;}",
                    "=r,r", [_widen(src, USE_ASM)], dtype=tl.float16, is_pure=True, pack=2)
            elif J // 2 == 0:
                r = tl.inline_asm_elementwise(
                    "{.reg .b32 m; mov.b32 m, 0x43004300; lop3.b32 $0, $1, 0x000F000F, m, 0xEA;}",
                    "=r,r", [_widen(src, USE_ASM)], dtype=tl.bfloat16, is_pure=True, pack=2)
            else:
                r = tl.inline_asm_elementwise(
                    "{.reg .b32 m, w; mov.b32 m, 0x43004300; shr.b32 w, $1, 4; lop3.b32 $0, w, 0x000F000F, m, 0xEA;}",
                    "=r,r", [_widen(src, USE_ASM)], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            c = _key_quarter(kc.to(tl.int32), kc2, hb.to(tl.int32), J, BITS, QD)
            if DT == tl.float16:
                r = ((c << PACK16_SHIFT[V16]) | PACK16_BASE[V16]).to(tl.int16).to(tl.float16, bitcast=True)
            else:
                r = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return r.to(DT)
    else:
        return _key_quarter(kc.to(tl.int32), kc2.to(tl.int32), hb.to(tl.int32), J, BITS, QD).to(DT)


# 3-bit "planes" decode (PLANES): the 2-bit plane (bytes 0..D/4-1) is read exactly as 2-bit keys,
# one eighth of the row (D/8 dims, the MMA's K of 16 at D=128) at a time: eighth E is quarter
# E // 2 of bytes (E % 2) * D/8 .. +D/8-1, operand BODY_OFS + code * _v_scale(E // 2). The 1-bit
# plane (bytes D/4..3D/8-1, "eighth split": byte i holds bit 2 of dim i + E * D/8 at bit E) gives
# eighth E's operand with one lop3 per two codes: bit E masked under the bf16 exponent of 128 is
# BODY_OFS + bit * 2^E (E = 7 shifted down to bit 6 first: 2^6). The bit's weight 4 relative to
# the 2-bit plane's operand of the same dims (place value _v_scale(E // 2)) is
# HI_QMUL[E] = 4 * _v_scale(E // 2) / 2^min(E, 6), a power of two 2^h: the mask goes under the
# exponent of 2^(7 + h) instead (HI_EXP[E]), which makes the operand HI_QMUL[E] * (BODY_OFS + bit *
# 2^min(E, 6)) exactly, so both planes multiply the same q operand (q * s / _v_scale) and the
# 1-bit plane's offset is HI_QMUL[E] * BODY_OFS. Until 2026-11-27 q was scaled by HI_QMUL[E]
# instead, a second operand per eighth (6 more conversions to the MMA layout a tile).
# With "fp16" key operands (quarter 3 at place 64, LO16_SRC's note) eighth 7's bit stays at bit 7
# (2^7 under fp16's 1024 is exact), and HI_QMUL[E] = 4 * _k_place(E // 2, KEYOP) / 2^E is 4 or 2
# for every eighth. HI_QMUL: entry 8 * KEYOP + E (bf16, fp16, fp16-shifted).
HI_MASK = tl.constexpr(("0x00010001", "0x00020002", "0x00040004", "0x00080008",
                        "0x00100010", "0x00200020", "0x00400040", "0x00400040"))
HI_QMUL = tl.constexpr((4.0, 2.0, 4.0, 2.0, 4.0, 2.0, 1.0, 1.0,
                        4.0, 2.0, 4.0, 2.0, 4.0, 2.0, 4.0, 2.0,
                        4.0, 2.0, 4.0, 2.0, 4.0, 2.0, 1.0, 1.0))
HI_EXP = tl.constexpr(("0x44004400", "0x43804380", "0x44004400", "0x43804380",
                       "0x44004400", "0x43804380", "0x43004300", "0x43004300"))
# the same under fp16 exponents (CHANNEL_KEY_OPERANDS; index as LO16_SRC): "fp16" under 2^(10 + h)
# (mantissa ulp 2^h as bf16's), HI_QMUL[8 + E] * (BODY_OFS_FP16 + bit * 2^E); "fp16-shifted"
# with the bit moved up 3 under 2^(7 + h) (ulp 2^(h - 3)), bf16's HI_QMUL[E] * (BODY_OFS + ...)
# (entry 8 * variant + E)
HI16_SRC = tl.constexpr(("mov.b32 w, $1;",) * 8
                        + ("shl.b32 w, $1, 3;",) * 7 + ("shl.b32 w, $1, 2;",))
HI16_MASK = tl.constexpr(("0x00010001", "0x00020002", "0x00040004", "0x00080008",
                          "0x00100010", "0x00200020", "0x00400040", "0x00800080",
                          "0x00080008", "0x00100010", "0x00200020", "0x00400040",
                          "0x00800080", "0x01000100", "0x02000200", "0x02000200"))
HI16_EXP = tl.constexpr(("0x6C006C00", "0x68006800", "0x6C006C00", "0x68006800",
                         "0x6C006C00", "0x68006800", "0x6C006C00", "0x68006800",
                         "0x60006000", "0x5C005C00", "0x60006000", "0x5C005C00",
                         "0x60006000", "0x5C005C00", "0x58005800", "0x58005800"))


@triton.jit
def _hi_plane(h16, E: tl.constexpr, DT: tl.constexpr, USE_ASM: tl.constexpr, KEYOP: tl.constexpr):
    """Eighth E of the 1-bit plane (uint16-widened bytes) as an MMA operand [BLK, D/8] in DT:
    HI_QMUL[8 * KEYOP + E] * (offset + bit * w), w = 2^E with "fp16" key operands (KEYOP 1), else
    2^min(E, 6): with USE_ASM the bf16 exponent trick under HI_EXP[E] (KEYOP 0) or the fp16 variant
    KEYOP - 1 of HI16_*; HI_QMUL[8 * KEYOP + E] * bit * w without."""
    V16: tl.constexpr = KEYOP - 1 if KEYOP > 0 else 0
    if USE_ASM:
        if DT == tl.float16:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 m, w; mov.b32 m, " + HI16_EXP[8 * V16 + E] + "; " + HI16_SRC[8 * V16 + E]
                + " lop3.b32 $0, w, " + HI16_MASK[8 * V16 + E] + ", m, 0xEA;}",
                "=r,r", [h16], dtype=tl.float16, is_pure=True, pack=2)
        elif E < 7:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 m; mov.b32 m, " + HI_EXP[E] + "; lop3.b32 $0, $1, " + HI_MASK[E] + ", m, 0xEA;}",
                "=r,r", [h16], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            r = tl.inline_asm_elementwise(
                "{.reg .b32 m, w; mov.b32 m, " + HI_EXP[E] + "; shr.b32 w, $1, 1; lop3.b32 $0, w, 0x00400040, m, 0xEA;}",
                "=r,r", [h16], dtype=tl.bfloat16, is_pure=True, pack=2)
        return r.to(DT)
    else:
        hi = h16.to(tl.int32)
        bit = ((hi >> 1) & 64) if E == 7 and KEYOP != 1 else (hi & (1 << E))
        return (bit * HI_QMUL[8 * KEYOP + E]).to(DT)


# PAIRED (planes with "fp16" key operands; key_operands "fp16-paired"): the two planes'
# operands of an eighth carry opposite offsets, so their MMAs cancel them and the row constant has
# no offset term (no per-dim sum of the rounded q * s: 8 conversions and multiply-adds per eighth
# and lane). The 2-bit plane's operand takes bit 2J + 2 of the mantissa as a constant,
# 1024 + 4 * place + code * place (place = _k_place(J, 1) = 4^J, quarter 3's 64 included: the
# constant sits right above the code field); the 1-bit plane's is -(1024 + (1 - bit) * 4 * place)
# = -(1024 + 4 * place) + bit * 4 * place: the bit moved up to 2J + 2 (a shift left of 2 - E % 2,
# each widened register shifted once per parity), inverted and masked by one lop3
# ((~w & mask) | exp, LUT 0xAE) under the negative exponent of 1024. Summed, the eighth's operands
# are (code + 4 * bit) * place, the 3-bit code's: both multiply the same q * s / place.
PAIR_LO_EXP = tl.constexpr(("0x64046404", "0x64106410", "0x64406440", "0x65006500"))
PAIR_HI_MASK = tl.constexpr(("0x00040004", "0x00100010", "0x00400040", "0x01000100"))
PAIR_HI_EXP = tl.constexpr("0xE400E400")
PAIR_HI_LUT = tl.constexpr("0xAE")  # lop3's table of (~a & b) | c


@triton.jit
def _paired_operands(lo, hi1, hi2, E: tl.constexpr):
    """Eighth E's two fp16 operands (PAIRED): the 2-bit plane's quarter E // 2 of lo, the 1-bit
    plane's bit E of the widened bytes shifted left by 2 - E % 2 (hi1: by 1, hi2: by 2)."""
    J: tl.constexpr = E // 2
    a = tl.inline_asm_elementwise(
        "{.reg .b32 m; mov.b32 m, " + PAIR_LO_EXP[J] + "; lop3.b32 $0, $1, " + LO16_MASK[J] + ", m, 0xEA;}",
        "=r,r", [lo], dtype=tl.float16, is_pure=True, pack=2)
    b = tl.inline_asm_elementwise(
        "{.reg .b32 m; mov.b32 m, " + PAIR_HI_EXP + "; lop3.b32 $0, $1, " + PAIR_HI_MASK[J] + ", m, " + PAIR_HI_LUT + ";}",
        "=r,r", [hi2 if E % 2 == 0 else hi1], dtype=tl.float16, is_pure=True, pack=2)
    return a, b


# SUB3 (3-bit planes, key_operands "fp16-subnormal", the default since 2026-11-29): NIBBLES' idea for
# the planes. Eighth E's 2-bit field (quarter J = E // 2 of the widened 2-bit plane, bits 2J..2J+1)
# and its 1-bit plane bit (bit E of the widened bytes, shifted to bit 2J + 2: the hi2 / hi1 that
# PAIRED makes) are merged by an and and a lop3 per two codes into one fp16 with no exponent bits:
# the subnormal (code + 4 * bit) * 4^J * 2^-24, exact (bits up to 8 < fp16's 10 mantissa bits). One
# MMA an eighth instead of PAIRED's two, and no offsets (no per-dim sum of the rounded q * s); q is
# divided by 4^J as for PAIRED and the tile's sums, in units of 2^-24, are scaled by NIB_SCALE with
# the softmax scale. Offline sm_90 (B=8, L=32K, D=128): 1,281 -> 1,247 instructions a body tile
# (32 fewer HMMA), 254 -> 240 registers, no spills. H200, one run against fp16-paired (bench/
# results/kernels/2026-11-29_0555_channel-3bit-subnormal-operands_h200.json, k3c64-v2t64-s4-w128):
# 8 x 32K 95.4 -> 88.8 us, 64 x 8K 174.0 -> 165.6, 512 x 2K 395.3 -> 382.2, 1 x 128K 55.7 -> 52.7;
# outputs within 7.1e-5 of fp16-paired's.
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
            "{.reg .b32 t; and.b32 t, $2, " + PAIR_HI_MASK[J] + "; lop3.b32 $0, $1, " + LO16_MASK[J] + ", t, 0xEA;}",
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


# NIBBLES (4-bit keys with fp16 key operands, the default): the quarter body
# (_key_quarter's half split: quarter J is nibble J // 2 of bytes (J % 2) * D/4 .. +D/4-1) with
# each nibble masked in place and no exponent: the fp16 subnormal code * place * 2^-24 (place 1
# low, 16 high), exact, one `and` per two codes. So there is no operand offset to take off (no
# per-dim sum of the rounded q * s) and no shift of the high nibble; q is divided by the place
# (exact) and the tile's sums, in units of 2^-24, are scaled by NIB_SCALE with the rest of the
# scores. The edge blocks get their own masked loop, as 3-bit keys do, pipelined NIB_EDGE_STAGES
# deep, where its copy buffers share the body loop's shared memory (18,432 B a program at sm_90;
# at the body's INT2_STAGES they took 28,696 B, 7 programs an SM). Offline sm_90 (B=8, L=32K,
# D=128): 1,196 instructions a body tile against the offset operands' masked 1,416, 231 registers,
# no spills. The tensor cores take the subnormals exactly (a one-off probe on the H200: tl.dot of
# such operands within 5e-7 of float64; the GPU decode tests pass). H200, one call (bench/results/
# kernels/2026-11-29_0313_channel-4bit-nibbles_h200.json against _0314_, b93d2bf's kernels):
# k4c64-v2t64-s4-w128 at B=8 x 32K 92.3 -> 83.7 us (the other shapes were cut by the run's
# timeout); error on kernel_error.py's outlier inputs 2.09e-3 max against 2.12e-3 (same seed,
# _0316_ / _0255_kernel-error-*). Tried and not kept: walking 4-bit keys in eighths as the 3-bit
# planes do (1,099 instructions a tile, the fewest), 101-104 us at 8 x 32K whether the operands
# were subnormal or under 1024's exponent (_0259_, _0307_, _0308_); why is not established.
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


# INT8 (3-bit planes, key_operands "int8"): quarter J's 32 dims as one int8 MMA operand (m16n8k32),
# the 3-bit code (code + 4 * bit) times place value 1, 4, 16, 16 (quarter 3's field shifted down
# to bits 4-5: 7 * 64 would not fit an int8) in each byte, two instructions per four codes; the
# block's q * s rounded to int8 per query row (_decode_body). The 1-bit plane's bytes are read
# twice a quarter, so the two loops' int8 buffers took 28,696 B of shared memory a program
# (7 programs an SM): the edge loop runs fp16-paired, and the program takes 18,432 B.
I8_LO_MASK = tl.constexpr(("0x03030303", "0x0C0C0C0C", "0x30303030", "0x30303030"))
I8_HI_MASK = tl.constexpr(("0x04040404", "0x10101010", "0x40404040", "0x40404040"))
I8_MAGIC16 = tl.constexpr(1536.0)  # fp16 x + 1536 (|x| <= 127.5) holds round(x) in its low byte


@triton.jit
def _i8_hi_shifts(hi):
    """The 1-bit plane's bytes [keys, D/4] (each byte twice: dims k and 16 + k of a quarter) with
    quarter J's bit moved right above its 2-bit field: (hi << 2 for dims k < 16, hi << 1 from 16)
    and, for quarter 3 (field at bits 4-5 after its shift), (hi, hi >> 1). One instance takes 16
    bytes of a lane, the MMA operand's registers a0-a3 (a0, a1: k < 16; a2, a3: k >= 16)."""
    return tl.inline_asm_elementwise(
        "shl.b32 $0, $8, 2; shl.b32 $1, $9, 2; shl.b32 $2, $10, 1; shl.b32 $3, $11, 1;"
        " mov.b32 $4, $8; mov.b32 $5, $9; shr.b32 $6, $10, 1; shr.b32 $7, $11, 1;",
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [hi], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=16)


@triton.jit
def _i8_operand(lo, hs, J: tl.constexpr):
    """Quarter J's int8 operand from the 2-bit plane's bytes lo and the 1-bit plane's bytes hs with
    quarter J's bit right above its 2-bit field (quarter 3: lo shifted right by 2 first)."""
    return tl.inline_asm_elementwise(
        "{.reg .b32 t; and.b32 t, $2, " + I8_HI_MASK[J] + "; lop3.b32 $0, $1, " + I8_LO_MASK[J] + ", t, 0xEA;}",
        "=r,r,r", [lo, hs], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _rcp(x, USE_ASM: tl.constexpr):
    """1 / x; on CUDA the approximate reciprocal (no range fix-ups: the int8 scales are far from
    fp32's limits, and 1 / 0 = inf is what the callers clamp)."""
    if USE_ASM:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        r = 1.0 / x
    return r


@triton.jit
def _i8_round(y):
    """fp16 y + I8_MAGIC16 (|y| <= 127) -> int8 round(y): the low bytes of four halves in one word."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x6420;", "=r,r,r", [y], dtype=tl.int8, is_pure=True,
                                     pack=4)


@triton.jit
def _pick8(E: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7):
    if E < 4:
        r = _pick4(E, a0, a1, a2, a3)
    else:
        r = _pick4(E - 4, a4, a5, a6, a7)
    return r


# SCORE_FOLD: a tile's scores are its MMA sums st plus a row constant rcv (the keys' mins term, a
# per-block constant), times the softmax scale for the 3-bit planes. The max is taken over st and
# rcv added to the row's max (rounding is monotonic: the same maximum as over st + rcv), and
# exp2's argument is one multiply-add of st with the per-row (rcv * scale - max), instead of an
# add and a multiply per score before the max and a subtraction after it. Offline sm_90, 3-bit
# planes, B=64, L=32K: 1,317 -> 1,281 instructions a body tile (238 -> 254 registers, no spills;
# 2-bit keys 1,146 -> 1,134). H100, one call against the kernels before it (bench/results/kernels/
# 2026-11-28_0429_channel-before-score-fold_h100.json / _0430_channel-score-fold_h100.json,
# k3c64-v2t64-s4-w128): 8 x 32K 96.8 -> 95.8 us (71% -> 72% of copy), 64 x 8K 184.9 -> 182.1
# (78% -> 79%), 512 x 2K 433.3 -> 427.3 (80% -> 81%), 1 x 128K 57.4 -> 57.1; error on
# kernel_error.py's outlier inputs unchanged (4.35e-3 max, same seed as before; _0450_).
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
                 KEYOP: tl.constexpr, MASKED: tl.constexpr, PAIRED: tl.constexpr, NIBBLES: tl.constexpr,
                 SUB3: tl.constexpr = False):
    """Decode's quantised body blocks (see _key_operand's note), continuing the BF16 loops' softmax
    state (row-major a0..a3 [rows, Dv/4]); returns it in the same form. Blocks: jb in [t_lo, t_hi)
    whose every position is a body position, without masks (MASKED False); or, MASKED, the edge
    blocks t in [t_lo, t_hi) -> jb = t below n_head, jz + t - n_head from there, every position
    masked to the body's (attend_channel_kernel's split of the blocks). PLANES
    (3 bits, D >= 128): the two-plane key operands (HI_QMUL's note), q^T read again in eighths
    from qrow (pointers to the rows' q) and kept in PV_DT, the softmax scale applied per tile.
    VWORDS (Dv >= 128) / KWORDS (2-bit keys, D >= 128): VCh / KCh are int16 views of the value /
    key codes (strides in words), read as attend_fast's code words (CHANNEL_CODE_READS' note); with
    KWORDS q^T is read in the 8 extractions' dims from qrow. KEYOP: the key side's q * s and code
    operands, index of CHANNEL_KEY_OPERANDS (0: PV_DT; 1, 2: the fp16 variants; 4: int8, PLANES
    only, the INT8 branch). NIBBLES (4-bit keys, fp16 KDT): the quarter body with subnormal nibble
    operands (NIBBLES' note). SUB3 (PLANES with KEYOP 1): one subnormal operand an eighth for both
    planes (SUB3's note), instead of PAIRED's two."""
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
    # the key side's operands (q * s and the codes): PV_DT, or fp16 with its own offset; fp32 in
    # the interpreter for every variant, as PV_DT (the CPU tests' float64 bounds stay tight)
    KDT: tl.constexpr = tl.float16 if KEYOP > 0 and PV_DT != tl.float32 else PV_DT
    KOFS: tl.constexpr = (BODY_OFS_FP16 if KEYOP == 1 else BODY_OFS) if USE_ASM else 0.0
    QSC = 1.0 if LOGIT_CAP else sm_scale_log2
    # the scores' scale: the 3-bit planes apply the softmax scale per tile (their q stays q / place
    # value), the other bodies fold it into q; the subnormal operands' sums (NIBBLES, SUB3) are in
    # units of 2^-24 on CUDA
    SUB: tl.constexpr = NIBBLES or (SUB3 and PLANES and KEYOP == 1)  # subnormal key operands
    NSC: tl.constexpr = NIB_SCALE if SUB and USE_ASM else 1.0
    # the quarter body's q carries its operands' places on CUDA (NIBBLES: in the interpreter too,
    # whose nibble operands carry the same places)
    PLC: tl.constexpr = USE_ASM or NIBBLES
    SSC = NSC if NIBBLES else (QSC * NSC if PLANES else 1.0)
    TILE_SC: tl.constexpr = PLANES or NIBBLES  # SSC is applied per tile (else it is 1)
    PAIR: tl.constexpr = PAIRED and PLANES and USE_ASM and KEYOP == 1 and KDT == tl.float16 and not SUB
    INT8: tl.constexpr = PLANES and KEYOP == 4
    if INT8:
        # q^T quarters [D/4, rows] in fp16
        d32 = tl.arange(0, QD)
        qi = qrow[None, :] + d32[:, None]
        qi0 = tl.load(qi).to(tl.float16)
        qi1 = tl.load(qi + QD).to(tl.float16)
        qi2 = tl.load(qi + 2 * QD).to(tl.float16)
        qi3 = tl.load(qi + 3 * QD).to(tl.float16)
    elif PLANES:
        # q^T eighths [D/8, rows] in PV_DT, each divided by its key quarter's place value (a power
        # of two: exact), so that q * s needs no scale of its own (ROWC's note)
        d8 = tl.arange(0, D8)
        qe = qrow[None, :] + d8[:, None]
        qe0 = (tl.load(qe).to(tl.float32) * (1.0 / _k_place(0, KEYOP))).to(PV_DT)
        qe1 = (tl.load(qe + D8).to(tl.float32) * (1.0 / _k_place(0, KEYOP))).to(PV_DT)
        qe2 = (tl.load(qe + 2 * D8).to(tl.float32) * (1.0 / _k_place(1, KEYOP))).to(PV_DT)
        qe3 = (tl.load(qe + 3 * D8).to(tl.float32) * (1.0 / _k_place(1, KEYOP))).to(PV_DT)
        qe4 = (tl.load(qe + 4 * D8).to(tl.float32) * (1.0 / _k_place(2, KEYOP))).to(PV_DT)
        qe5 = (tl.load(qe + 5 * D8).to(tl.float32) * (1.0 / _k_place(2, KEYOP))).to(PV_DT)
        qe6 = (tl.load(qe + 6 * D8).to(tl.float32) * (1.0 / _k_place(3, KEYOP))).to(PV_DT)
        qe7 = (tl.load(qe + 7 * D8).to(tl.float32) * (1.0 / _k_place(3, KEYOP))).to(PV_DT)
    elif KWORDS:
        # q^T at the 8 extractions' dims [D/8, rows] in fp32, the softmax scale folded in
        qw0 = tl.load(qrow[None, :] + _word_dims(0, QW)[:, None]).to(tl.float32) * QSC
        qw1 = tl.load(qrow[None, :] + _word_dims(1, QW)[:, None]).to(tl.float32) * QSC
        qw2 = tl.load(qrow[None, :] + _word_dims(2, QW)[:, None]).to(tl.float32) * QSC
        qw3 = tl.load(qrow[None, :] + _word_dims(3, QW)[:, None]).to(tl.float32) * QSC
        qw4 = tl.load(qrow[None, :] + _word_dims(4, QW)[:, None]).to(tl.float32) * QSC
        qw5 = tl.load(qrow[None, :] + _word_dims(5, QW)[:, None]).to(tl.float32) * QSC
        qw6 = tl.load(qrow[None, :] + _word_dims(6, QW)[:, None]).to(tl.float32) * QSC
        qw7 = tl.load(qrow[None, :] + _word_dims(7, QW)[:, None]).to(tl.float32) * QSC
    else:
        # q^T quarters [D/4, rows] in fp32, the softmax scale folded in (unless capped) and each
        # divided by its key operands' scale (a power of two: exact; ROWC's note)
        q0t = tl.trans(q0.to(tl.float32) * (QSC / _k_scale_ch(0, BITS, KEYOP, NIBBLES) if PLC else QSC))
        q1t = tl.trans(q1.to(tl.float32) * (QSC / _k_scale_ch(1, BITS, KEYOP, NIBBLES) if PLC else QSC))
        q2t = tl.trans(q2.to(tl.float32) * (QSC / _k_scale_ch(2, BITS, KEYOP, NIBBLES) if PLC else QSC))
        q3t = tl.trans(q3.to(tl.float32) * (QSC / _k_scale_ch(3, BITS, KEYOP, NIBBLES) if PLC else QSC))
    # value accumulators transposed, in operand units (attend_fast): bytes [Dv/4, rows] per quarter
    # (a'_j = vs_j a_j), or code words [Dv/8, rows] per extraction (x_j: quarter j's even dims,
    # x_{4+j}: its odd dims, scale 1); per quarter the per-row sums sum(p * mn), sum(p * sc) of its
    # value group, added after the loop
    if VWORDS:
        x0, x4 = _words_of_quarter(a0, QWV, BLOCK_M)
        x1, x5 = _words_of_quarter(a1, QWV, BLOCK_M)
        x2, x6 = _words_of_quarter(a2, QWV, BLOCK_M)
        x3, x7 = _words_of_quarter(a3, QWV, BLOCK_M)
    else:
        a0 = tl.trans(a0 * _v_scale(0) if USE_ASM else a0)
        a1 = tl.trans(a1 * _v_scale(1) if USE_ASM else a1)
        a2 = tl.trans(a2 * _v_scale(2) if USE_ASM else a2)
        a3 = tl.trans(a3 * _v_scale(3) if USE_ASM else a3)
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
        if INT8:
            lo = tl.load(kcb + d32[None, :])  # [keys, D/4]: the 2-bit plane, four quarters a byte
            hi = tl.load(kcb + QD + (d32 % D8)[None, :])  # [keys, D/4]: the 1-bit plane, twice
            kpb = KPh + page * stride_kpn + d32
            sc0, mn0 = _unpack_params(tl.load(kpb))
            sc1, mn1 = _unpack_params(tl.load(kpb + QD))
            sc2, mn2 = _unpack_params(tl.load(kpb + 2 * QD))
            sc3, mn3 = _unpack_params(tl.load(kpb + 3 * QD))
            # q * s in fp16 (one rounding: a product of two fp16 values is exact in fp32)
            kx0 = (qi0.to(tl.float32) * sc0[:, None]).to(tl.float16)
            kx1 = (qi1.to(tl.float32) * sc1[:, None]).to(tl.float16)
            kx2 = (qi2.to(tl.float32) * sc2[:, None]).to(tl.float16)
            kx3 = (qi3.to(tl.float32) * sc3[:, None]).to(tl.float16)
            qc = (qi0.to(tl.float32) * mn0[:, None] + qi1.to(tl.float32) * mn1[:, None]
                  + qi2.to(tl.float32) * mn2[:, None] + qi3.to(tl.float32) * mn3[:, None])
            # one int8 scale a row, 127 / max |q * s|, kept in fp16 (the scale used)
            amax = tl.max(tl.maximum(tl.maximum(tl.abs(kx0), tl.abs(kx1)), tl.maximum(tl.abs(kx2), tl.abs(kx3))), 0)
            rq = tl.minimum(127.0 * _rcp(amax.to(tl.float32), USE_ASM), 32768.0).to(tl.float16)
            # quarter J's operand is its code times its place (1, 4, 16, 16): the int32 sums go
            # from the lowest place up, times 4 between places (exact: they are integers), so the
            # tile's sums are 16 * sum(code * round(q * s * rq)), every quarter on the row's grid
            if USE_ASM:
                hs, hs3 = _i8_hi_shifts(hi)
                lo3 = tl.inline_asm_elementwise("shr.b32 $0, $1, 2;", "=r,r", [lo], dtype=tl.uint8, is_pure=True,
                                                pack=4)
                acc = tl.zeros([BLK, BLOCK_M], tl.int32)
                acc = tl.dot(_i8_operand(lo, hs, 0), _i8_round(kx0 * rq[None, :] + I8_MAGIC16), acc,
                             out_dtype=tl.int32) * 4
                acc = tl.dot(_i8_operand(lo, hs, 1), _i8_round(kx1 * rq[None, :] + I8_MAGIC16), acc,
                             out_dtype=tl.int32) * 4
                acc = tl.dot(_i8_operand(lo, hs, 2), _i8_round(kx2 * rq[None, :] + I8_MAGIC16), acc, out_dtype=tl.int32)
                acc = tl.dot(_i8_operand(lo3, hs3, 3), _i8_round(kx3 * rq[None, :] + I8_MAGIC16), acc, out_dtype=tl.int32)
                st = acc.to(tl.float32)
            else:
                # the same integers in fp32 (exact: |sum| < 2^24), codes at place 1
                l32 = lo.to(tl.int32)
                h32 = hi.to(tl.int32)
                up = (d32 >= D8).to(tl.int32)[None, :]
                st = tl.zeros([BLK, BLOCK_M], tl.float32)
                for j in tl.static_range(4):
                    a = ((l32 >> (2 * j)) & 3) + 4 * ((h32 >> (2 * j + up)) & 1)
                    yj = (_pick4(j, kx0, kx1, kx2, kx3) * rq[None, :]).to(tl.float32)
                    bq = tl.where(yj >= 0, tl.floor(yj + 0.5), -tl.floor(0.5 - yj))
                    st += tl.dot(a.to(tl.float32), bq)
                st = st * 16.0
            # scores (st + rcv) * SSC with st = 16 * rq * (q * s) . code: the row scale goes with SSC
            rq16 = 16.0 * rq.to(tl.float32)
            ssc_r = _rcp(rq16, USE_ASM)
            rcv = tl.sum(qc, 0) * rq16
        elif PLANES:
            # the two halves of the 2-bit plane and the 1-bit plane, D/8 bytes each per key
            d8 = tl.arange(0, D8)
            lo_a = _widen(tl.load(kcb + d8[None, :]), USE_ASM)
            lo_b = _widen(tl.load(kcb + D8 + d8[None, :]), USE_ASM)
            hi16 = _widen(tl.load(kcb + QD + d8[None, :]), USE_ASM)
            if PAIR or (SUB and USE_ASM):
                hi1 = _shl16(hi16, 1)
                hi2 = _shl16(hi16, 2)
            elif SUB:
                hi1 = (hi16.to(tl.int32) << 1)
                hi2 = (hi16.to(tl.int32) << 2)
            kpb = KPh + page * stride_kpn + d8
            # per-dim terms of the row constant: (q / place) . m, Horner over the quarters' place
            # values, and the operands' offsets' (1 + HI_QMUL) * qs, times KOFS after the loop
            # (qo stays zero with PAIR: the planes' offsets cancel in the MMAs; SUB has none)
            qc = tl.zeros([D8, BLOCK_M], tl.float32)
            qo = tl.zeros([D8, BLOCK_M], tl.float32)
            part = tl.zeros([BLK, BLOCK_M], tl.float32)
            for e in tl.static_range(7, -1, -1):  # quarters 3 to 0
                if e % 2 == 1 and e < 7:
                    qc = qc * (_k_place(e // 2 + 1, KEYOP) / _k_place(e // 2, KEYOP))
                sc, mn = _unpack_params(tl.load(kpb + e * D8))
                qet = _pick8(e, qe0, qe1, qe2, qe3, qe4, qe5, qe6, qe7).to(tl.float32)  # q / place value
                qs = (qet * sc[:, None]).to(KDT)  # both planes: q * s / place value
                lo = lo_a if e % 2 == 0 else lo_b
                if SUB:  # one subnormal operand for both planes (SUB3)
                    part = tl.dot(_sub3_operand(lo, hi2, hi1, e, USE_ASM).to(KDT), qs, part)
                elif PAIR:  # offsets cancel between the planes (PAIRED)
                    op_lo, op_hi = _paired_operands(lo, hi1, hi2, e)
                    part = tl.dot(op_lo, qs, part)
                    part = tl.dot(op_hi, qs, part)
                else:
                    part = tl.dot(_lo_operand(lo, e // 2, KDT, USE_ASM, KEYOP), qs, part)
                    part = tl.dot(_hi_plane(hi16, e, KDT, USE_ASM, KEYOP), qs, part)
                    # from the rounded qs: exact removal ((1 + HI_QMUL) * qs is exact in fp32)
                    qo += (1.0 + HI_QMUL[8 * KEYOP + e]) * qs.to(tl.float32)
                qc += qet * mn[:, None]
            st = part
            if SUB:
                rcv = tl.sum(qc, 0) * (1.0 / NSC)  # in the sums' units
            else:
                rcv = tl.sum(qc - KOFS * qo, 0)
        elif KWORDS:
            kw = tl.load(kcb + tl.arange(0, QW)[None, :])  # [keys, D/8 words]
            kpb = KPh + page * stride_kpn
            # s^T = sum_P extraction_P @ (q_P * s_P)^T + row constant (extraction scale 1)
            qc = tl.zeros([QW, BLOCK_M], tl.float32)  # q . m
            qo = tl.zeros([QW, BLOCK_M], tl.float32)  # the offsets' share
            part = tl.zeros([BLK, BLOCK_M], tl.float32)
            for e in tl.static_range(8):
                sc, mn = _unpack_params(tl.load(kpb + _word_dims(e, QW)))
                qpt = _pick8(e, qw0, qw1, qw2, qw3, qw4, qw5, qw6, qw7)
                qs = (qpt * sc[:, None]).to(WDT)
                part = tl.dot(_word_code(kw, e, WDT, USE_ASM), qs, part)
                qc += qpt * mn[:, None]
                qo += _word_ofs(e, USE_ASM) * qs.to(tl.float32)  # from the rounded qs: exact removal
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
                    if _k_scale_ch(j + 1, BITS, KEYOP, NIBBLES) != _k_scale_ch(j, BITS, KEYOP, NIBBLES):
                        qc = qc * (_k_scale_ch(j + 1, BITS, KEYOP, NIBBLES) / _k_scale_ch(j, BITS, KEYOP, NIBBLES))
                sc, mn = _unpack_params(tl.load(kpb + j * QD))
                qjt = _pick4(j, q0t, q1t, q2t, q3t)  # q / ks
                qs = (qjt * sc[:, None]).to(KDT)
                if NIBBLES:  # no offsets (NIBBLES' note)
                    op = _nibble_operand(_widen(kc if j % 2 == 0 else kc2, USE_ASM), j // 2, KDT, USE_ASM)
                    part = tl.dot(op, qs, part)
                else:
                    part = tl.dot(_key_operand(kc, kc2, hb, j, BITS, QD, KDT, USE_ASM, KEYOP), qs, part)
                    qo += qs.to(tl.float32)  # from the rounded qs: exact removal
                qc += qjt * mn[:, None]
            st = part
            if NIBBLES:
                rcv = tl.sum(qc, 0) * (1.0 / NSC)  # in the sums' units
            else:
                rcv = tl.sum(qc - KOFS * qo, 0)
        # scores: (st + rcv) * SSC, rcv the tile's row constant (SCORE_FOLD)
        if LOGIT_CAP:
            st = _cap_and_scale(_scaled(st + rcv[None, :], NSC, SUB), sm_scale_log2, logit_cap, LOGIT_CAP)
            if MASKED:
                st = tl.where(body[:, None], st, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(st, 0))
            pt = tl.exp2(st - m_new[None, :])
        else:
            if MASKED:
                st = tl.where(body[:, None], st, float("-inf"))
            if INT8:  # the row's int8 scale times the softmax scale
                srow = ssc_r * SSC
                m_new = tl.maximum(m_i, (tl.max(st, 0) + rcv) * srow)
                pt = tl.exp2(st * srow[None, :] + (rcv * srow - m_new)[None, :])
            else:
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
                vsc, vmn = _unpack_params(tl.load(VPh + slot * stride_vpn + (j * QDV) // GV))
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
                # sc) come off each accumulator before the tile's MMA adds them. Removed once after
                # the loop (before 2026-11-26) they left fp32 sums 64-128x the output to cancel: the
                # error grew with the tiles a split walks, to 0.14 (peaked) and 4.4 (flat
                # attention) relative at 32K keys in one split (H100; tests/gpu/test_long_decode.py).
                # The sums come from the tensor cores (VONES' note).
                gs = tl.dot(ones_v, pst)
            if VWORDS:  # quarter j = extractions j (even dims) and 4 + j (odd dims)
                if j == 0:
                    x0 = tl.dot(_word_code(vct, 0, VDT, USE_ASM), pst, x0 * al - (_word_ofs(0, USE_ASM) + VMID) * gs)
                    x4 = tl.dot(_word_code(vct, 4, VDT, USE_ASM), pst, x4 * al - (_word_ofs(4, USE_ASM) + VMID) * gs)
                elif j == 1:
                    x1 = tl.dot(_word_code(vct, 1, VDT, USE_ASM), pst, x1 * al - (_word_ofs(1, USE_ASM) + VMID) * gs)
                    x5 = tl.dot(_word_code(vct, 5, VDT, USE_ASM), pst, x5 * al - (_word_ofs(5, USE_ASM) + VMID) * gs)
                elif j == 2:
                    x2 = tl.dot(_word_code(vct, 2, VDT, USE_ASM), pst, x2 * al - (_word_ofs(2, USE_ASM) + VMID) * gs)
                    x6 = tl.dot(_word_code(vct, 6, VDT, USE_ASM), pst, x6 * al - (_word_ofs(6, USE_ASM) + VMID) * gs)
                else:
                    x3 = tl.dot(_word_code(vct, 3, VDT, USE_ASM), pst, x3 * al - (_word_ofs(3, USE_ASM) + VMID) * gs)
                    x7 = tl.dot(_word_code(vct, 7, VDT, USE_ASM), pst, x7 * al - (_word_ofs(7, USE_ASM) + VMID) * gs)
            else:
                if USE_ASM:
                    op = _quarter_v(v16, j, PV_DT, USE_ASM)
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
        a0 = _quarter_of_words(x0, x4, bm0, QDV, BLOCK_M)
        a1 = _quarter_of_words(x1, x5, bm1, QDV, BLOCK_M)
        a2 = _quarter_of_words(x2, x6, bm2, QDV, BLOCK_M)
        a3 = _quarter_of_words(x3, x7, bm3, QDV, BLOCK_M)
    else:
        # a_j = a'_j / vs_j + sum(p mn) (offsets taken off per tile), back to row-major [rows, Dv/4]
        a0 = tl.trans(a0 * (1.0 / _v_scale(0) if USE_ASM else 1.0) + bm0[None, :])
        a1 = tl.trans(a1 * (1.0 / _v_scale(1) if USE_ASM else 1.0) + bm1[None, :])
        a2 = tl.trans(a2 * (1.0 / _v_scale(2) if USE_ASM else 1.0) + bm2[None, :])
        a3 = tl.trans(a3 * (1.0 / _v_scale(3) if USE_ASM else 1.0) + bm3[None, :])
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _quarter_of_words(ev, od, bm, QDV: tl.constexpr, BLOCK_M: tl.constexpr):
    """Value quarter [rows, Dv/4] (row-major) from its two code-word accumulators [Dv/8, rows]
    (even dims: extraction J, odd dims: J + 4; offsets already taken off per tile) plus sum(p mn)."""
    ev = tl.trans(ev + bm[None, :])
    od = tl.trans(od + bm[None, :])
    return tl.reshape(tl.join(ev, od), [BLOCK_M, QDV])


# num_mb (query blocks per KV head, extend only) follows the longest new-token run of the batch: a
# runtime argument, as in attend.attend_kernel (a constexpr would compile a kernel per chunk length);
# MAX_SPLITS too (an extend splits its prefix only sometimes: 1 would otherwise compile another
# kernel on the first split call, a cold start in the middle of serving)
NOT_SPECIALIZED = ("num_mb", "MAX_SPLITS")


@triton.jit(do_not_specialize=list(NOT_SPECIALIZED))
def attend_channel_kernel(
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
    EXT_DQ: tl.constexpr = False, VWORDS: tl.constexpr = False, KWORDS: tl.constexpr = False,
    KEYOP: tl.constexpr = 0, BF16_LAST: tl.constexpr = False, PAIRED: tl.constexpr = False,
    MERGE: tl.constexpr = False, MERGE_ROWS: tl.constexpr = 1, SPLITS_P2: tl.constexpr = 1,
    NIBBLES: tl.constexpr = False, Final=None, stride_fb=0, stride_fh=0, Arrived=None,
    SUB3: tl.constexpr = False,
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
    # the dequantising extend's MMA operands (q, dequantised keys and values, p): fp16 on CUDA. As
    # bf16 they left 2.3-3.3% of error in the output against float64 on the tests' outlier channels
    # (3 of 23 extend tests over 2% on the H100, 2026-11-27; a float64 emulation: max 4.2% bf16,
    # 0.13% fp16), for 1.5-3.7% of extend time (bench/results/kernels/
    # 2026-11-27_0743_channel-extend-*_h100.json). |q|, |k|, |v| stay far below fp16's 65504.
    # The `codes` body's q * s, p * s and code operands too (since 2026-11-27, not yet timed; with
    # bf16 its error was 1.8-2.9% on the outlier inputs of bench/kernel_error.py).
    DQ_DT: tl.constexpr = tl.float16 if PV_DT == tl.bfloat16 else PV_DT
    b = tl.program_id(0)
    if SPLIT:
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        if BF16_LAST:  # grid z runs the body splits first, the BF16 splits last (launch order)
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
        # list A) go to BF16 split 0, masked. Offline sm_90 SASS (3-bit planes, B=8, L=32K): the
        # masks were ~140 of a tile's 1,721 instructions, 1,581 without; the two loops in
        # different programs' branches take 236 registers, no spills (both loops in every program:
        # 255 and spills). 4-bit keys with offset operands keep one masked loop over every block
        # in the body splits (EDGE_LOOP): their second loop's copy buffers took the program's shared
        # memory from 18,432 to 28,696 B, 7 programs an SM instead of 8, and the decode 3-18% slower
        # (H100, bench/results/kernels/2026-11-27_1808_channel-4bit-*); with NIBBLES the edge loop
        # is pipelined less deep and fits (NIBBLES' note).
        EDGE_LOOP: tl.constexpr = BITS != 4 or NIBBLES
        if EDGE_LOOP:
            fa = tl.minimum(tl.maximum(n_a + tl.cdiv(sink_hi, BLK) - start_b, n_a), n_blk)
            fz = tl.minimum(tl.maximum(n_a + ring_lo // BLK - start_b, fa), n_blk)
        else:
            fa = n_blk * 0
            fz = n_blk
        chunk = tl.cdiv(fz - fa, n_splits - NB16)
        j_lo = tl.where(split >= NB16, tl.minimum(fa + (split - NB16) * chunk, fz), 0)
        j_hi = tl.where(split >= NB16, tl.minimum(j_lo + chunk, fz), 0)
        n_edge = tl.where(split == 0, fa + n_blk - fz, 0)  # 0 without EDGE_LOOP
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

    # ---- BF16 sink and ring (attend.py's loops) ------------------------------------------------
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
        if EDGE_LOOP and split < NB16:  # the edge blocks (split 0's), masked
            m_i, l_i, a0, a1, a2, a3 = _decode_body(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, 0, n_edge, fa, fz, n_a, start_b, ring_lo,
                sink_lo, sink_hi, idx_base, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                sm_scale_log2, logit_cap, Q + tok * stride_qt + hq * stride_qh,
                D, DV, BITS, BLK, GV, BLOCK_M, LOGIT_CAP, PV_DT, USE_ASM,
                NIB_EDGE_STAGES if NIBBLES else STAGES, PLANES, VWORDS, KWORDS,
                # int8 key operands: the edge blocks (few) take fp16-paired's (INT8's note: the two
                # loops' int8 buffers would leave 7 programs an SM)
                1 if KEYOP == 4 else KEYOP, True, PAIRED or KEYOP == 4, NIBBLES, SUB3)
        else:
            m_i, l_i, a0, a1, a2, a3 = _decode_body(
                q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, j_lo, j_hi, 0, 0, n_a, start_b, ring_lo,
                sink_lo, sink_hi, idx_base, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn, VPh, stride_vpn,
                sm_scale_log2, logit_cap, Q + tok * stride_qt + hq * stride_qh,
                D, DV, BITS, BLK, GV, BLOCK_M, LOGIT_CAP, PV_DT, USE_ASM, STAGES, PLANES, VWORDS, KWORDS, KEYOP,
                not EDGE_LOOP, PAIRED, NIBBLES, SUB3)  # without the edge loop these blocks include the edges: masked
        j_hi = j_lo  # the extend loop below walks nothing
    if EXT_DQ:  # its q operands, converted once for every page
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
        qm = tl.zeros([BLOCK_M], tl.float32)
        for j in tl.static_range(4):
            sc, mn = _unpack_params(tl.load(KPh + page * stride_kpn + j * QD + dq))
            if EXT_DQ:
                # the page's keys dequantised once ([BLK, D/4] per quarter), then q . k: the cost
                # is the tile's keys, not the tile's query rows (BLOCK_M >= BLK)
                kj = _dequant(_key_quarter(kc, kc2, hb, j, BITS, QD), sc, mn, 0, DQ_DT)
                qk = tl.dot(_pick4(j, q0, q1, q2, q3), tl.trans(kj), qk)  # q: DQ_DT already
            else:
                qj = _pick4(j, q0, q1, q2, q3).to(tl.float32)
                # (q * s) . code + q . m: q scaled once per block, one constant per row; q * s in
                # DQ_DT (fp16 on CUDA): rounded once for the block's keys, bf16's error does not
                # average out (the decode's key operands, CHANNEL_KEY_OPERANDS)
                qs = (qj * sc[None, :]).to(DQ_DT)
                cj = _code_operand(_key_quarter(kc, kc2, hb, j, BITS, QD), DQ_DT)
                qk += tl.dot(qs, tl.trans(cj))
                qm += tl.sum(qj * mn[None, :], 1)
        qk += qm[:, None]
        s = _cap_and_scale(qk, sm_scale_log2, logit_cap, LOGIT_CAP)
        s = tl.where(body[None, :], s, float("-inf"))
        pr, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)

        vc = tl.load(VCh + slot[:, None] * stride_vcn + dv[None, :])
        a0 = a0 * alpha[:, None]
        a1 = a1 * alpha[:, None]
        a2 = a2 * alpha[:, None]
        a3 = a3 * alpha[:, None]
        if EXT_DQ:
            prd = pr.to(DQ_DT)
        for j in tl.static_range(4):
            if (j * QDV) % GV == 0:  # first quarter of a value group: its per-token params
                vsc, vmn = _unpack_params(tl.load(VPh + slot * stride_vpn + (j * QDV) // GV))
                # masked lanes (the page's sink / ring positions) get p = 0; zeroed params keep
                # anything non-finite there out of the output (0 * NaN)
                vsc = tl.where(body, vsc, 0.0)
                vmn = tl.where(body, vmn, 0.0)
                if not EXT_DQ:  # codes: the group's (p * scale, p @ min)
                    ps = (pr * vsc[None, :]).to(DQ_DT)
                    pm = tl.sum(pr * vmn[None, :], 1)[:, None]
            if EXT_DQ:  # the page's values dequantised once, then p @ v
                vj = _dequant((vc.to(tl.int32) >> (2 * j)) & 3, vsc, vmn, 1, DQ_DT)
                upd = tl.dot(prd, vj)
            else:
                upd = tl.dot(ps, _code_operand((vc.to(tl.int32) >> (2 * j)) & 3, DQ_DT)) + pm
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
        _merge_if_last(b, kvh, n_splits, Out, stride_ot, stride_oh, stride_os,
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


def decode_attention_channel(
    q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_bits, k_block, v_group, sm_scale,
    sink_start=None, num_kv_splits=None, max_kv_splits=None, attn_logits=None, attn_lse=None,
    logit_cap=0.0, min_chunk=None, bf16_keys_per_split=None, num_warps=None, num_stages=2,
    num_int2_stages=None, k3_variant=None, code_reads=None, key_operands=None, maxnreg=None,
    merge_chunk=None, merge_warps=None, bf16_last=True, fused_merge=None, arrived=None,
):
    """See ops.decode_attention_channel; min_chunk / bf16_keys_per_split / num_warps /
    num_stages / maxnreg / merge_chunk / merge_warps / bf16_last are tuning knobs (decode.py's meaning;
    maxnreg caps registers per thread: the one-warp body takes 245-255 at sm_90, 8 programs per
    SM, 168 would fit 12; merge_*: the split merge's splits a step and warps; bf16_last: the
    launch order, BF16_LAST's note). fused_merge: the last program of each (request, KV head)
    merges the splits (FMERGE's note; default: up to FUSED_MERGE_MAX_SPLITS splits), or (False)
    decode's merge kernel does; arrived: its int32 counters, >= batch x KV heads zeros, left zero
    (default: attend_fast.split_arrivals).
    k3_variant: 'packed' / 'planes' (3-bit keys; None: OSCAR_CHANNEL_DECODE_3BIT, default
    'planes'; planes needs head_dim >= 128 and runs packed below). code_reads: 'bytes' / 'words'
    (None: OSCAR_CHANNEL_DECODE_READS, default 'words'; words reads value codes and 2-bit key codes
    as 16-bit words where the dim is >= 128). key_operands: 'fp16-subnormal' / 'fp16-paired' /
    'fp16' / 'bf16' / 'fp16-shifted' / 'int8' (None: OSCAR_CHANNEL_DECODE_KEYS, default
    'fp16-subnormal'; the body's q * s and key code operands, CHANNEL_KEY_OPERANDS' note; 'int8'
    needs the planes decode and is refused without it)."""
    check_channel_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_bits, k_block, v_group)
    planes = (channel_3bit_variant(k3_variant) == "planes" and k_bits == 3
              and q.shape[-1] >= PLANES_MIN_DIM)
    words = channel_code_reads(code_reads) == "words"
    vwords = words and v_codes.shape[-1] * 4 >= WORDS_MIN_DIM
    kwords = words and k_bits == 2 and q.shape[-1] >= WORDS_MIN_DIM
    keyop = CHANNEL_KEY_OPERANDS.index(channel_key_operands(key_operands))
    if keyop == 4 and not planes:
        raise ValueError("key_operands 'int8' is the 3-bit planes decode's (k_bits 3, head_dim >= 128, "
                         "k3_variant 'planes'); use 'fp16-subnormal' (the default) for this pool")
    paired = keyop == 3  # "fp16-paired": "fp16" operands, the planes' offsets cancelling (PAIRED)
    sub3 = keyop == 5 and planes  # "fp16-subnormal": one subnormal operand an eighth (SUB3)
    # 4-bit keys' subnormal operands (NIBBLES) where their fp16 operands are asked for; bf16 /
    # fp16-shifted operands keep the offset operands and one masked loop
    nibbles = k_bits == 4 and keyop in (1, 3, 5)
    keyop = 1 if keyop in (3, 5) else keyop
    sink_start = own_start if sink_start is None else sink_start
    B, Hq, D = q.shape
    Hkv = k_codes.shape[1]
    gqa = Hq // Hkv
    max_kv_splits, nb16, attn_logits, attn_lse = plan_decode(
        q, o, k_codes, v_codes, sink_k, ring_k, kv_indptr, max_kv_splits, attn_logits, attn_lse,
        bf16_keys_per_split, default_decode_splits)
    min_chunk = min_chunk or DECODE_MIN_CHUNK
    kp = as_param_words(k_params)
    vp = as_param_words(v_params)
    if fused_merge is None:
        fused_merge = max_kv_splits <= FUSED_MERGE_MAX_SPLITS
    if fused_merge and arrived is None:
        arrived = split_arrivals(q.device, B * Hkv)
    # one SPLITS_P2 for every fused split count: a batch size's own would compile a variant each
    merge = dict(MERGE=True, MERGE_ROWS=triton.next_power_of_2(gqa),
                 SPLITS_P2=triton.next_power_of_2(max(max_kv_splits, FUSED_MERGE_MAX_SPLITS)),
                 Final=o, stride_fb=o.stride(0), stride_fh=o.stride(1), Arrived=arrived) if fused_merge else {}
    attend_channel_kernel[(B, Hkv, max_kv_splits)](
        q, q.stride(0), q.stride(1),
        attn_logits, attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse, attn_lse.stride(0), attn_lse.stride(1), attn_lse.stride(2),
        # words: int16 views of the codes (their strides in words)
        *pool_launch_args(k_codes.view(torch.int16) if kwords else k_codes, kp,
                          v_codes.view(torch.int16) if vwords else v_codes, vp, sink_k, sink_v, ring_k, ring_v),
        kv_indptr, kv_indices, kv_indptr, req_rows, own_start, sink_start,  # qo_indptr: unused
        num_kv_splits if num_kv_splits is not None else kv_indptr,
        sm_scale * LOG2E, float(logit_cap), int(max_kv_splits), 1,
        GQA=gqa, D=D, DV=v_codes.shape[-1] * 4, BITS=k_bits, BLK=k_block, GV=v_group,
        S=sink_k.shape[1], W=ring_k.shape[1], BLOCK_M=max(8, triton.next_power_of_2(gqa)),
        BLOCK_B=BLOCK_B, SPLIT=True, HAS_NSPLITS=num_kv_splits is not None, MIN_CHUNK=min_chunk,
        LOGIT_CAP=logit_cap > 0, PV_DT=PV_DTYPE, NB16=nb16,
        USE_ASM=USE_ASM and q.dtype == torch.bfloat16, STAGES=num_int2_stages or INT2_STAGES, PLANES=planes,
        VWORDS=vwords, KWORDS=kwords, KEYOP=keyop, BF16_LAST=bool(bf16_last), PAIRED=paired, NIBBLES=nibbles,
        SUB3=sub3, **merge,
        num_warps=num_warps or (PLANES_NUM_WARPS if planes else DECODE_NUM_WARPS[k_bits]), num_stages=num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if fused_merge:
        return o
    return merge_splits(o, attn_logits, attn_lse, kv_indptr, req_rows, own_start, sink_start,
                        num_kv_splits, max_kv_splits, nb16, min_chunk, sink_k.shape[1], ring_k.shape[1],
                        chunk=merge_chunk, num_warps=merge_warps)


EXTEND_BLOCK_M = 64  # (token, query head) rows per extend program (codes; dequant above head_dim 128)
EXTEND_BLOCK_M_DEQUANT = 128  # dequant at head_dim <= 128: a page's dequantised tile serves 2x the rows
EXTEND_BLOCK_B = 64  # BF16 sink / ring keys per extend tile
# Extend-prefix body variants (OSCAR_CHANNEL_EXTEND or extend_variant=...): "dequant" (the default)
# dequantises the page's keys and values once (BLK x D multiply-adds each, packed bf16 on CUDA) and
# multiplies q by the keys, p by the values; "codes" feeds the codes to the MMAs and folds each
# page's key scales into q (BLOCK_M x D multiplies per tile, plus the q . m row constant and per-row
# p * scale for values). H100, 2026-11-26 (bench/results/kernels/, docs/benchmarks.md): dequant
# with 128 rows 2.5x codes at 32K + 4096 (12.2 vs 30.5 ms, 1.13x SGLang BF16's prefix part),
# 2.4x at 8K + 512; results agree to 5e-3 (dequant's operands rounded to bf16 then, fp16 since 2026-11-27).
CHANNEL_EXTEND_VARIANTS = ("codes", "dequant")
CHANNEL_EXTEND_ENV = "OSCAR_CHANNEL_EXTEND"
CHANNEL_EXTEND_DEFAULT = "dequant"


def channel_extend_variant(extend_variant=None) -> str:
    """The extend-prefix body: extend_variant if given, else OSCAR_CHANNEL_EXTEND ('dequant')."""
    return _kernel_choice("extend_variant", extend_variant, CHANNEL_EXTEND_ENV, CHANNEL_EXTEND_VARIANTS,
                          CHANNEL_EXTEND_DEFAULT)


# Prefix splits (issue 19: an extend grid under one wave). One program walks a (request, KV head,
# query block)'s whole prefix, so a few new tokens over a long prefix (a chat's next turn: 100
# tokens over 32K are 7 query blocks x 8 KV heads = 56 programs, on 132 SMs) leave most SMs idle
# while each program walks 512 pages. The prefix is then split into equal chunks of body blocks,
# one program each, merged by LSE (merge_extend_splits): enough splits for
# EXTEND_SPLIT_PROGRAMS_PER_SM programs per SM, each with >= EXTEND_SPLIT_MIN_KEYS prefix keys,
# at most EXTEND_MAX_SPLITS. The longest prefix must be known on the host (max_len_prefix; the
# backend has it from SGLang's extend_prefix_lens_cpu): without it nothing is split.
EXTEND_SPLIT_PROGRAMS_PER_SM = 2  # one 8-warp program per SM fits by registers; 2 evens the tail
EXTEND_SPLIT_MIN_KEYS = 1024
EXTEND_MAX_SPLITS = 32


def extend_block_m(dequant: bool, head_dim: int) -> int:
    """Default (token, query head) rows per extend program for the body and head size."""
    return EXTEND_BLOCK_M_DEQUANT if dequant and head_dim <= 128 else EXTEND_BLOCK_M


def extend_prefix_splits(programs: int, max_len_prefix, device) -> int:
    """How many chunks the extend splits each prefix into (1 = not split): see EXTEND_*SPLIT*."""
    if not max_len_prefix or programs <= 0:
        return 1
    want = triton.cdiv(EXTEND_SPLIT_PROGRAMS_PER_SM * sm_count(device), programs)
    return max(1, min(want, int(max_len_prefix) // EXTEND_SPLIT_MIN_KEYS, EXTEND_MAX_SPLITS))


def merge_extend_splits(o_part, lse_part, o, lse):
    """o_part [T, S, Hq, Dv] / lse_part [T, S, Hq] (natural log; -inf: a split without keys) ->
    o [T, Hq, Dv], lse [T, Hq] in place, as one softmax over all the splits' keys (o = 0,
    lse = -inf where no split saw a key)."""
    m = lse_part.amax(1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_part - m[:, None])  # exp(-inf) = 0
    den = w.sum(1)
    has = den > 0
    o.copy_((o_part * w[..., None]).sum(1) / torch.where(has, den, 1.0)[..., None])
    lse.copy_(torch.where(has, m + torch.log(torch.where(has, den, 1.0)), float("-inf")))
    return o, lse


# Short extends (issue 19: --enable-mixed-chunk). SGLang folds the running decodes into a prefill
# batch as one-token extends after the prefill's requests; in one launch each of their programs
# runs the prefill's 128-row query tile for GQA (4) rows, 32x the MMA work the token needs. A
# trailing run of requests whose rows (tokens x GQA) fit SHORT_EXTEND_ROWS gets a launch of its own
# with tiles of that many rows and SHORT_EXTEND_WARPS warps (short_extend_start; needs the extend
# lengths on the host, SGLang's extend_seq_lens_cpu). Offline sm_90 (3-bit keys, D 128): 5.8K
# warp-instructions a page tile against 8.5K (the page's dequantisation dominates), 3 programs per
# SM by registers against 1. Not yet timed on a GPU.
SHORT_EXTEND_ROWS = 16  # the smallest MMA tile's rows
SHORT_EXTEND_WARPS = 4


def short_extend_start(extend_lens, gqa: int) -> int:
    """Index of the first request of the trailing run whose extends are short (len * gqa <=
    SHORT_EXTEND_ROWS): len(extend_lens) when the last one is not short, 0 when all are."""
    k = len(extend_lens)
    while k > 0 and int(extend_lens[k - 1]) * gqa <= SHORT_EXTEND_ROWS:
        k -= 1
    return k


def extend_prefix_attention_channel(
    q, qo_indptr, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v,
    kv_indptr, kv_indices, req_rows, own_start, *, k_bits, k_block, v_group, sm_scale,
    max_len_extend, sink_start=None, logit_cap=0.0, o=None, lse=None, block_m=None,
    num_warps=None, num_stages=2, extend_variant=None, max_len_prefix=None, num_splits=None,
    extend_lens=None,
):
    """See ops.extend_prefix_attention_channel; block_m / num_warps / num_stages are tuning knobs
    (block_m default: extend_block_m, or SHORT_EXTEND_ROWS where every request's rows fit it;
    rounded up to >= 16 and >= the GQA group, as extend_prefix.py does; num_warps default: 8 at
    head_dim 128, where 4 warps spill registers at sm_90 with 64 rows, else 4, and
    SHORT_EXTEND_WARPS for short tiles). extend_variant: 'codes' / 'dequant' (None:
    OSCAR_CHANNEL_EXTEND, default 'dequant'). max_len_prefix: the batch's longest cached prefix
    (host int; None: unknown, no prefix split); num_splits: the prefix split count (None:
    extend_prefix_splits' choice). extend_lens: each request's new tokens (host ints, optional):
    a trailing run of short extends is launched on its own (SHORT_EXTEND_ROWS)."""
    check_channel_pool(q, k_codes, k_params, v_codes, v_params, sink_k, ring_k, k_bits, k_block, v_group)
    dequant = channel_extend_variant(extend_variant) == "dequant"
    sink_start = own_start if sink_start is None else sink_start
    T, Hq, D = q.shape
    B = qo_indptr.shape[0] - 1
    Hkv = k_codes.shape[1]
    gqa = Hq // Hkv
    o, lse = extend_outputs(q, qo_indptr, kv_indptr, v_codes, o, lse)
    if T == 0 or B == 0:
        return o, lse
    if extend_lens is not None and block_m is None:
        if len(extend_lens) != B or sum(int(x) for x in extend_lens) != T:
            raise ValueError(f"extend_lens ({len(extend_lens)} requests, {sum(int(x) for x in extend_lens)} "
                             f"tokens) does not match the batch ({B} requests, {T} tokens)")
        k = short_extend_start(extend_lens, gqa)
        if 0 < k < B:  # the long requests, then the short run: two launches, each on its own
            # tokens (rows of q / o / lse, qo_indptr rebased), so split scratch is sized by them
            kw = dict(k_bits=k_bits, k_block=k_block, v_group=v_group, sm_scale=sm_scale, sink_start=sink_start,
                      logit_cap=logit_cap, num_warps=num_warps, num_stages=num_stages,
                      extend_variant=extend_variant, max_len_prefix=max_len_prefix, num_splits=num_splits)
            pool = (k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v)
            t_k = sum(int(x) for x in extend_lens[:k])
            for (lo, hi), (t_lo, t_hi) in (((0, k), (0, t_k)), ((k, B), (t_k, T))):
                extend_prefix_attention_channel(
                    q[t_lo:t_hi], qo_indptr[lo:hi + 1] - t_lo, *pool, kv_indptr[lo:hi + 1], kv_indices,
                    req_rows[lo:hi], own_start, max_len_extend=max(int(x) for x in extend_lens[lo:hi]),
                    o=o[t_lo:t_hi], lse=lse[t_lo:t_hi], extend_lens=extend_lens[lo:hi], **kw)
            return o, lse
    short = block_m is None and int(max_len_extend) * gqa <= SHORT_EXTEND_ROWS
    if short:
        block_m, num_warps = SHORT_EXTEND_ROWS, num_warps or SHORT_EXTEND_WARPS
    bm = max(block_m or extend_block_m(dequant, D), 16, triton.next_power_of_2(gqa))
    num_mb = triton.cdiv(max(1, int(max_len_extend)) * gqa, bm)
    splits = (extend_prefix_splits(B * Hkv * num_mb, max_len_prefix, q.device) if num_splits is None
              else int(num_splits))
    if splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # split outputs [T, S, Hq, ...] with the same stride kinds as o / lse (Triton specialises ints
    # that are 1 or multiples of 16): head strides Dv and 1, split strides Hq * Dv and Hq (unused
    # at S = 1, passed alike), token strides padded by one where S * Hq would be a multiple of 16
    # and Hq is not, so a split call compiles nothing new (a first split would otherwise compile in
    # the middle of serving)
    o_out, lse_out = o, lse
    if splits > 1:
        o_out = torch.empty(T, splits, Hq, o.shape[-1], dtype=torch.float32, device=q.device)
        row = splits * Hq + (1 if (splits * Hq) % 16 == 0 and Hq % 16 else 0)
        lse_out = torch.empty(T, row, dtype=torch.float32, device=q.device)[:, :splits * Hq].view(T, splits, Hq)
    os_, ls_ = (o_out.stride(1), lse_out.stride(1)) if splits > 1 else (Hq * o.shape[-1], Hq)
    kp = as_param_words(k_params)
    vp = as_param_words(v_params)
    attend_channel_kernel[(B, Hkv * num_mb, splits)](
        q, q.stride(0), q.stride(1),
        o_out, o_out.stride(0), o_out.stride(-2), os_,
        lse_out, lse_out.stride(0), lse_out.stride(-1), ls_,
        *pool_launch_args(k_codes, kp, v_codes, vp, sink_k, sink_v, ring_k, ring_v),
        kv_indptr, kv_indices, qo_indptr, req_rows, own_start, sink_start,
        kv_indptr,  # num_kv_splits: unused
        sm_scale * LOG2E, float(logit_cap), splits, num_mb,
        GQA=gqa, D=D, DV=v_codes.shape[-1] * 4, BITS=k_bits, BLK=k_block, GV=v_group,
        S=sink_k.shape[1], W=ring_k.shape[1], BLOCK_M=bm, BLOCK_B=EXTEND_BLOCK_B, SPLIT=False,
        HAS_NSPLITS=False, MIN_CHUNK=1, LOGIT_CAP=logit_cap > 0, PV_DT=PV_DTYPE, NB16=0, EXT_DQ=dequant,
        num_warps=num_warps or (8 if D >= 128 else 4), num_stages=num_stages,
    )
    if splits > 1:
        merge_extend_splits(o_out, lse_out, o, lse)
    return o, lse
