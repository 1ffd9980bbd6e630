"""INT2 KV kernels on the GPU: correctness check, then decode / store / extend timings.

One run measures, on the same device:
  * device-to-device copy bandwidth (torch copy_, counted read + write, like the devkit figure);
  * INT2 decode (oscar_kernels.ops.decode_attention) vs SGLang's BF16 Triton decode
    (sglang.kernels.ops.attention.decode_attention.decode_attention_fwd) on the same kv_indices
    layout, Hq=32, Hkv=8, D=128, for (B, L) in SHAPES; SGLang gets the best of several
    num_kv_splits values (its own kernel at its best);
  * the store kernel (quantise + pack + scatter + side buffers) and extend-prefix attention.

Timing: decode and store run inside a CUDA graph (as SGLang runs decode), median over replays of
a graph of >= 24 back-to-back calls; every call reads a different copy of the inputs (pool
slots, indices, q) until the set of copies is >= 256 MB, so nothing is served from L2.
Extend-prefix (milliseconds long) uses triton.testing.do_bench (median, L2 flushed).

Usage (H100, from the project root):
    source .devkit/device-env.sh && python -m bench.kernel_speed --out $OUT/kernels.md --json $OUT/kernels.json
The JSON (bench/_results.py: date, device, model, command, one row per decode shape / store size /
extend shape) goes to bench/results/kernels/<UTC date_time>.json when --json is not given.
Options: --tune (also sweep BLOCK_N / num_stages / split count), --quick (two shapes), --no-fast
(skip the G = head_dim INT2 decode kernel, token_decode.py, timed by default next to the generic one),
--skip-store-extend (decode only), --flashinfer (FlashInfer's BF16 paged decode as a second
baseline, where its JIT build works; see --help for the rest).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time

import torch
import triton
from triton.testing import do_bench

from bench import _results
from bench._timing import bench_graph  # noqa: E402

from oscar_kernels import Int2Format, KVFormat, ops  # noqa: E402
from oscar_kernels.format import code_bytes  # noqa: E402
from oscar_kernels import reference as ref  # noqa: E402
from oscar_kernels.triton import channel_decode, channel_extend  # noqa: E402
from oscar_kernels.triton import core as int2_core  # noqa: E402
from oscar_kernels.triton import token_decode as int2_fast  # noqa: E402
from oscar_kernels.triton import token_decode as int2_decode  # noqa: E402 (its generic kernel: *_base)
from oscar_sglang.runtime.kv_format import DEFAULT_KV_FORMAT  # noqa: E402 (the served default)

HQ, HKV, D = 32, 8, 128
SINK, WINDOW = 64, 256
GROUP = 128  # 2.25 bits/element
SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 32768), (32, 8192), (64, 32768)]
ROTATE_BYTES = 256 << 20
DEV = "cuda"


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------
# correctness on realistic shapes (asserts; the CPU test-suite covers the edge cases)
# ------------------------------------------------------------------------------------------------


def heavy_tailed(t, h, d, gen):
    x = torch.randn(t, h, d, device=DEV, generator=gen)
    ch = torch.randint(0, d, (h, 4), device=DEV, generator=gen)
    for j in range(h):
        x[:, j, ch[j]] *= 12
    x[:2] *= 1e-2  # low-norm sink tokens
    return x.bfloat16()


def head_major(t):
    """[N, H, ...] view of [H, N, ...] memory: the INT2 pool layout of the plugin (oscar_sglang.runtime.pool)."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def check_correctness(group: int, lens=(3000, 700, 150, 1), owns=(0, 40, 2000, 0), d=D):
    """Store a few requests with the store kernel, then decode / extend vs the float64 reference
    (head_dim d: the benchmark's 128, and 256 for the shapes only that head size has)."""
    gen = torch.Generator(device=DEV).manual_seed(1234 + group)
    fmt = Int2Format(d, group)
    B, N, R = len(lens), sum(lens) + 1, len(lens) + 1
    pool = dict(
        k_codes=head_major(torch.zeros(N, HKV, d // 4, dtype=torch.uint8, device=DEV)),
        k_params=head_major(torch.zeros(N, HKV, d // group, 2, dtype=torch.float16, device=DEV)),
        v_codes=head_major(torch.zeros(N, HKV, d // 4, dtype=torch.uint8, device=DEV)),
        v_params=head_major(torch.zeros(N, HKV, d // group, 2, dtype=torch.float16, device=DEV)),
    )
    side = dict(
        sink_k=torch.full((R, SINK, HKV, d), 1e4, dtype=torch.bfloat16, device=DEV),
        sink_v=torch.full((R, SINK, HKV, d), 1e4, dtype=torch.bfloat16, device=DEV),
        ring_k=torch.full((R, WINDOW, HKV, d), 1e4, dtype=torch.bfloat16, device=DEV),
        ring_v=torch.full((R, WINDOW, HKV, d), 1e4, dtype=torch.bfloat16, device=DEV),
    )
    slots = (torch.randperm(N - 1, device=DEV, generator=gen) + 1).int()
    kv_indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    rows = torch.tensor([1, 2, 3, 0], dtype=torch.int32, device=DEV)  # last = CUDA-graph padding row 0
    # own_start is per request row (ops.py): row rows[b] holds request b's value
    own = torch.zeros(R, dtype=torch.int32, device=DEV)
    own[rows.long()] = torch.tensor(owns, dtype=torch.int32, device=DEV)
    ks, vs = [], []
    worst = {}
    for b, L in enumerate(lens):
        k, v = heavy_tailed(L, HKV, d, gen), heavy_tailed(L, HKV, d, gen)
        ks.append(k)
        vs.append(v)
        sl = slots[kv_indptr[b]:kv_indptr[b + 1]]
        # tokens the request computed itself (p >= own_start) are stored with side buffers; the
        # radix-cache part (p < own_start) only as INT2 (what the plugin does)
        o_ = min(owns[b], L)
        pos = torch.arange(L, device=DEV)
        ops.store_kv(k[:o_], v[:o_], sl[:o_], **pool, k_group=group, v_group=group, k_clip=0.96, v_clip=0.92)
        ops.store_kv(k[o_:], v[o_:], sl[o_:], **pool, k_group=group, v_group=group, k_clip=0.96,
                     v_clip=0.92, positions=pos[o_:], token_rows=rows[b].repeat(L - o_),
                     token_seq_lens=torch.full((L - o_,), L, dtype=torch.int32, device=DEV), **side)
        ck, pk = ref.quantize(k, fmt, 0.96)
        cv, pv = ref.quantize(v, fmt, 0.92)
        for name, got, exp in (("k_codes", pool["k_codes"][sl.long()], ck), ("v_codes", pool["v_codes"][sl.long()], cv),
                               ("k_params", pool["k_params"][sl.long()], pk), ("v_params", pool["v_params"][sl.long()], pv)):
            mism = (got.view(torch.uint8) != exp.view(torch.uint8)).float().mean().item()
            worst[name] = max(worst.get(name, 0.0), mism)
    log(f"  D={d} G={group} store vs reference.quantize (clip 0.96/0.92), mismatching bytes: {worst}")
    assert all(v == 0.0 for v in worst.values()), "store is not bit-exact on the GPU"

    q = torch.randn(B, HQ, d, device=DEV, generator=gen).bfloat16()
    sm = 1 / math.sqrt(d)
    # float64 oracle per request: what a reader sees in the pool (sink / ring / INT2 by the rule)
    oracle = []
    for b in range(B):
        sl = slots[kv_indptr[b]:kv_indptr[b + 1]]
        K = ref.pool_request_kv(pool["k_codes"], pool["k_params"], side["sink_k"], side["ring_k"], sl, int(rows[b]), owns[b], fmt)
        V = ref.pool_request_kv(pool["v_codes"], pool["v_params"], side["sink_v"], side["ring_v"], sl, int(rows[b]), owns[b], fmt)
        # and the mixed K the oracle reads really is the stored data (sink/ring/INT2 by the rule)
        exp_k = ref.mixed_kv(ks[b].float(), fmt, sink=SINK, window=WINDOW, own_start=owns[b], clip_ratio=0.96)
        assert torch.equal(K, exp_k), "pool contents differ from reference.mixed_kv"
        oracle.append(ref.attention(q[b:b + 1], K, V, sm_scale=sm)[0][0])

    def rel_errors(out):
        return [((out[b].double() - o_ref).norm() / o_ref.norm()).item() for b, o_ref in enumerate(oracle)]

    def check_decode(name, decode):
        out = torch.full((B, HQ, d), float("nan"), device=DEV)
        decode(q, out, *pool.values(), *side.values(), kv_indptr, slots, rows, own,
               k_group=group, v_group=group, sm_scale=sm)
        errs = rel_errors(out)
        log(f"  D={d} G={group} {name} rel. error vs float64 per request: {[f'{e:.1e}' for e in errs]}")
        assert max(errs) < 2e-2

    check_decode("decode", int2_decode.decode_attention_base)
    if int2_fast.supports(d, d, group, group):
        check_decode("FAST decode", int2_fast.decode_attention_fast)
        for fused in (True, False):  # both merges, whatever the default picks at this batch
            check_decode(f"FAST decode fused_merge={fused}",
                         lambda *a, **k: int2_fast.decode_attention_fast(*a, fused_merge=fused, **k))

        # the fused merge under CUDA-graph replays (its arrival counters must return to zero)
        out = torch.full((B, HQ, d), float("nan"), device=DEV)

        def call():
            int2_fast.decode_attention_fast(q, out, *pool.values(), *side.values(), kv_indptr, slots, rows, own,
                                            k_group=group, v_group=group, sm_scale=sm, fused_merge=True)
        call()  # eager first: allocates the counters outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        for _ in range(3):
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            errs = rel_errors(out)
            assert max(errs) < 2e-2, errs
        assert not int2_fast.split_arrivals(q.device, 1).any()
        log(f"  D={d} G={group} FAST decode fused_merge=True, 3 CUDA-graph replays: rel. error {[f'{e:.1e}' for e in errs]}")

    E = [64, 16, 1, 3][:B]
    qo = torch.tensor([0] + list(torch.tensor(E).cumsum(0)), dtype=torch.int32, device=DEV)
    qe = torch.randn(sum(E), HQ, d, device=DEV, generator=gen).bfloat16()
    oe, lse = ops.extend_prefix_attention(qe, qo, *pool.values(), *side.values(), kv_indptr, slots, rows, own,
                                          k_group=group, v_group=group, sm_scale=sm, max_len_extend=max(E))
    errs = []
    for b in range(B):
        sl = slots[kv_indptr[b]:kv_indptr[b + 1]]
        K = ref.pool_request_kv(pool["k_codes"], pool["k_params"], side["sink_k"], side["ring_k"], sl, int(rows[b]), owns[b], fmt)
        V = ref.pool_request_kv(pool["v_codes"], pool["v_params"], side["sink_v"], side["ring_v"], sl, int(rows[b]), owns[b], fmt)
        o_ref, l_ref = ref.attention(qe[qo[b]:qo[b + 1]], K, V, sm_scale=sm)
        errs.append(((oe[qo[b]:qo[b + 1]].double() - o_ref).norm() / o_ref.norm()).item())
        assert (lse[qo[b]:qo[b + 1]].double() - l_ref).abs().max() < 1e-2
    log(f"  D={d} G={group} extend-prefix rel. error vs float64 per request: {[f'{e:.1e}' for e in errs]}")
    assert max(errs) < 2e-2


# ------------------------------------------------------------------------------------------------
# timing helpers
# ------------------------------------------------------------------------------------------------


def bench(fn, warmup=10, rep=60):
    """Eager timing (median, L2 flushed before each call): for the long extend kernel."""
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth():
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    del x, y
    return 2 * n / ms / 1e6  # GB/s, read + write


def contiguous_indices(B, L, copies, offset=1, dtype=torch.int32):
    """kv_indices of `copies` independent batches: request b of copy c owns slots
    offset + (c*B + b)*L + [0, L) (what a fresh SGLang pool with page_size 1 hands out)."""
    base = torch.arange(B * L, device=DEV, dtype=dtype)
    return [base + offset + c * B * L for c in range(copies)]


def n_copies(bytes_per_call):
    return max(1, min(64, math.ceil(ROTATE_BYTES / bytes_per_call)))


def int2_bytes(B, L, group):
    """Bytes the INT2 decode reads: codes + params (K and V) of INT2 positions, the BF16 sink and
    ring rows, and one int32 index per INT2 position."""
    n_bf = min(L, SINK + WINDOW)
    n_int2 = L - n_bf
    row = D // 4 + 4 * (D // group)
    return B * (HKV * (n_int2 * 2 * row + n_bf * 2 * D * 2) + n_int2 * 4)


def bf16_bytes(B, L, idx_bytes=4):
    return B * (HKV * L * 2 * D * 2 + L * idx_bytes)


class Int2Case:
    def __init__(self, B, L, group=GROUP):
        self.B, self.L, self.group = B, L, group
        self.bytes = int2_bytes(B, L, group)
        self.copies = n_copies(self.bytes)
        N = B * L * self.copies + 1
        # head-major like the plugin's pool (row_major() gives the slot-major layout for comparison)
        self.k_codes = head_major(torch.randint(0, 256, (N, HKV, D // 4), dtype=torch.uint8, device=DEV))
        self.v_codes = head_major(torch.randint(0, 256, (N, HKV, D // 4), dtype=torch.uint8, device=DEV))
        prm = torch.stack([torch.full((N, HKV, D // group), 0.02), torch.full((N, HKV, D // group), -0.03)], -1)
        self.k_params = head_major(prm.half().to(DEV))
        self.v_params = head_major(prm.half().to(DEV))
        R = B * self.copies + 1
        self.sink_k = torch.randn(R, SINK, HKV, D, device=DEV).bfloat16()
        self.sink_v = torch.randn(R, SINK, HKV, D, device=DEV).bfloat16()
        self.ring_k = torch.randn(R, WINDOW, HKV, D, device=DEV).bfloat16()
        self.ring_v = torch.randn(R, WINDOW, HKV, D, device=DEV).bfloat16()
        self.indices = contiguous_indices(B, L, self.copies)
        self.indptr = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=DEV)
        self.rows = [torch.arange(B, dtype=torch.int32, device=DEV) + 1 + c * B for c in range(self.copies)]
        self.own = torch.zeros(R, dtype=torch.int32, device=DEV)  # per request row, like ops.py
        self.q = [torch.randn(B, HQ, D, device=DEV).bfloat16() for _ in range(self.copies)]
        self.o = torch.empty(B, HQ, D, dtype=torch.bfloat16, device=DEV)

    def row_major(self):
        """The same pool slot-major ([N, H, ...] contiguous), the layout the pool had until 2026-11-22 12:15 UTC."""
        return tuple(t.contiguous() for t in (self.k_codes, self.k_params, self.v_codes, self.v_params))

    def fn(self, max_kv_splits=None, kind="base", row_major=False, **kw):
        splits_of = int2_fast.default_max_splits if kind == "fast" else int2_decode.base_max_splits
        kc, kp, vc, vp = self.row_major() if row_major else (self.k_codes, self.k_params, self.v_codes, self.v_params)
        decode = int2_fast.decode_attention_fast if kind == "fast" else int2_decode.decode_attention_base
        ms = max_kv_splits or splits_of(self.B, HKV, torch.device(DEV))
        logits = torch.empty(self.B, HQ, ms, D, dtype=torch.float32, device=DEV)
        lse = torch.empty(self.B, HQ, ms, dtype=torch.float32, device=DEV)
        state = [0]

        def run():
            c = state[0] = (state[0] + 1) % self.copies
            decode(
                self.q[c], self.o, kc, kp, vc, vp,
                self.sink_k, self.sink_v, self.ring_k, self.ring_v, self.indptr, self.indices[c],
                self.rows[c], self.own, k_group=self.group, v_group=self.group, sm_scale=D ** -0.5,
                max_kv_splits=ms, attn_logits=logits, attn_lse=lse, **kw)
        return run


def channel_bytes(B, L, fmt):
    """Bytes the per-channel decode reads (KVFormat fmt): key codes at fmt.k_bits, one (scale, min)
    FP16 pair per channel per page block, 2-bit value codes + per-token value params, the BF16 sink
    and ring rows, one int32 index per body position."""
    n_bf = min(L, fmt.sink + fmt.window)
    n_body = L - n_bf
    k_row = code_bytes(fmt.k_bits, D) + 4 * D / fmt.k_group
    v_row = D // 4 + 4 * (D // fmt.v_group)
    return int(B * (HKV * (n_body * (k_row + v_row) + n_bf * 2 * D * 2) + n_body * 4))


class ChannelCase:
    """The served per-channel layout (runtime/kv_format.py): pages of fmt.k_group slots, request b
    owns whole contiguous pages (page 0 = padding, as SGLang's paged allocator)."""

    def __init__(self, B, L, fmt):
        self.B, self.L, self.fmt = B, L, fmt
        blk = fmt.k_group
        self.bytes = channel_bytes(B, L, fmt)
        self.copies = n_copies(self.bytes)
        N = B * L * self.copies + blk
        u8 = lambda *s: head_major(torch.randint(0, 256, (N, HKV, *s), dtype=torch.uint8, device=DEV))  # noqa: E731
        self.k_codes, self.v_codes = u8(code_bytes(fmt.k_bits, D)), u8(D // 4)
        kp = torch.stack([torch.full((N // blk, HKV, D), 0.02), torch.full((N // blk, HKV, D), -0.03)], -1)
        vp = torch.stack([torch.full((N, HKV, D // fmt.v_group), 0.02), torch.full((N, HKV, D // fmt.v_group), -0.03)], -1)
        self.k_params, self.v_params = head_major(kp.half().to(DEV)), head_major(vp.half().to(DEV))
        R = B * self.copies + 1
        side = lambda S: torch.randn(R, S, HKV, D, device=DEV).bfloat16()  # noqa: E731
        self.sink_k, self.sink_v = side(max(fmt.sink, 1)), side(max(fmt.sink, 1))
        self.ring_k, self.ring_v = side(fmt.window), side(fmt.window)
        self.indices = contiguous_indices(B, L, self.copies, offset=blk)
        self.indptr = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=DEV)
        self.rows = [torch.arange(B, dtype=torch.int32, device=DEV) + 1 + c * B for c in range(self.copies)]
        self.own = torch.zeros(R, dtype=torch.int32, device=DEV)
        self.q = [torch.randn(B, HQ, D, device=DEV).bfloat16() for _ in range(self.copies)]
        self.o = torch.empty(B, HQ, D, dtype=torch.bfloat16, device=DEV)

    def fn(self, sglang_splits=False, **kw):
        """The decode as a closure over rotating input copies; kw: launcher knobs. sglang_splits:
        the split plan the server used until 2026-11-27 (SGLang's heuristic for its own kernel,
        num_kv_splits per request up to 64) instead of the kernel's default plan."""
        f, state = self.fmt, [0]
        if sglang_splits:
            kw = dict(kw, **sglang_split_plan(self.B, self.L))

        def run():
            c = state[0] = (state[0] + 1) % self.copies
            # tuning knobs (num_warps, num_stages, ...) exist on the Triton launcher only
            (channel_decode.decode_attention_channel if kw else ops.decode_attention_channel)(
                self.q[c], self.o, self.k_codes, self.k_params, self.v_codes, self.v_params,
                self.sink_k, self.sink_v, self.ring_k, self.ring_v, self.indptr, self.indices[c],
                self.rows[c], self.own, k_bits=f.k_bits, k_block=f.k_group, v_group=f.v_group,
                sm_scale=D ** -0.5, **kw)
        return run


def sglang_split_plan(B, L, max_kv_splits=64):
    """num_kv_splits / max_kv_splits / scratch as SGLang's Triton backend plans them for B
    requests of L keys (its get_num_kv_splits_triton, the SMs of this GPU)."""
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    n = torch.empty(B, dtype=torch.int32, device=DEV)
    lens = torch.full((B,), L, dtype=torch.int32, device=DEV)
    get_num_kv_splits_triton[(1,)](n, lens, B, 1, HQ, HKV, max_kv_splits, int2_decode.sm_count(DEV),
                                   MAX_NUM_SEQ=max(256, triton.next_power_of_2(B)))
    return dict(num_kv_splits=n, max_kv_splits=max_kv_splits,
                attn_logits=torch.empty(B, HQ, max_kv_splits, D, dtype=torch.float32, device=DEV),
                attn_lse=torch.empty(B, HQ, max_kv_splits, dtype=torch.float32, device=DEV))


class Bf16Case:
    def __init__(self, B, L):
        self.B, self.L = B, L
        self.bytes = bf16_bytes(B, L)
        self.copies = n_copies(self.bytes)
        N = B * L * self.copies + 1
        self.k = torch.empty(N, HKV, D, device=DEV, dtype=torch.bfloat16).normal_()
        self.v = torch.empty(N, HKV, D, device=DEV, dtype=torch.bfloat16).normal_()
        # SGLang's kernel computes slot * row_stride in the index dtype: int32 indices overflow
        # past 2^31 elements, so pools that large get int64 indices (4 more bytes per key)
        self.idx_dtype = torch.int64 if N * HKV * D >= 2**31 else torch.int32
        self.bytes = bf16_bytes(B, L, self.idx_dtype.itemsize)
        self.indices = contiguous_indices(B, L, self.copies, dtype=self.idx_dtype)
        self.indptr = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=DEV)
        self.q = [torch.randn(B, HQ, D, device=DEV).bfloat16() for _ in range(self.copies)]
        self.o = torch.empty(B, HQ, D, dtype=torch.bfloat16, device=DEV)

    def fn(self, splits):
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

        logits = torch.empty(self.B, HQ, splits, D, dtype=torch.float32, device=DEV)
        lse = torch.empty(self.B, HQ, splits, dtype=torch.float32, device=DEV)
        nks = torch.full((self.B,), splits, dtype=torch.int32, device=DEV)
        state = [0]

        def run():
            c = state[0] = (state[0] + 1) % self.copies
            decode_attention_fwd(self.q[c], self.k, self.v, self.o, self.indptr, self.indices[c], logits, lse,
                                 nks, splits, D ** -0.5, 1.0, 1.0)

        def first_copy():  # output for input copy 0 (checks other kernels on the same inputs)
            state[0] = -1
            run()
            return self.o.float()
        run.first_copy = first_copy
        return run


def flashinfer_decode_fn(bc, tensor_cores):
    """FlashInfer's BF16 paged decode (BatchDecodeWithPagedKVCacheWrapper, page size 1, NHD) over
    Bf16Case bc's pool and kv_indices: one CUDA-graph-ready wrapper per input copy (planned once,
    outside the graph), so back-to-back calls rotate through the copies like the other kernels.
    tensor_cores: FlashInfer's tensor-core decode (its prefill kernel; SGLang's choice for GQA >= 4)."""
    import flashinfer

    B = bc.B
    indptr = bc.indptr
    last = torch.ones(B, dtype=torch.int32, device=DEV)
    kc, vc = bc.k.unsqueeze(1), bc.v.unsqueeze(1)  # [pages, page_size=1, Hkv, D]
    wrappers = []
    for c in range(bc.copies):
        idx = bc.indices[c].to(torch.int32)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(128 << 20, dtype=torch.uint8, device=DEV), "NHD", use_cuda_graph=True,
            use_tensor_cores=tensor_cores, paged_kv_indptr_buffer=indptr.clone(),
            paged_kv_indices_buffer=idx.clone(), paged_kv_last_page_len_buffer=last.clone())
        w.plan(indptr, idx, last, HQ, HKV, D, 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
               sm_scale=D ** -0.5)
        wrappers.append(w)
    o = torch.empty(B, HQ, D, dtype=torch.bfloat16, device=DEV)
    state = [0]

    def run():
        c = state[0] = (state[0] + 1) % bc.copies
        wrappers[c].run(bc.q[c], (kc, vc), out=o)

    def first_copy():  # output for input copy 0 (the correctness check against SGLang's kernel)
        wrappers[0].run(bc.q[0], (kc, vc), out=o)
        return o.float()
    run.first_copy = first_copy
    return run


# ------------------------------------------------------------------------------------------------
# store and extend
# ------------------------------------------------------------------------------------------------


def bench_store(T, rotate):
    L = T
    k = torch.randn(T, HKV, D, device=DEV).bfloat16()
    v = torch.randn(T, HKV, D, device=DEV).bfloat16()
    N = T + 1
    pool = dict(
        k_codes=head_major(torch.empty(N, HKV, D // 4, dtype=torch.uint8, device=DEV)),
        k_params=head_major(torch.empty(N, HKV, D // GROUP, 2, dtype=torch.float16, device=DEV)),
        v_codes=head_major(torch.empty(N, HKV, D // 4, dtype=torch.uint8, device=DEV)),
        v_params=head_major(torch.empty(N, HKV, D // GROUP, 2, dtype=torch.float16, device=DEV)),
        sink_k=torch.empty(2, SINK, HKV, D, dtype=torch.bfloat16, device=DEV),
        sink_v=torch.empty(2, SINK, HKV, D, dtype=torch.bfloat16, device=DEV),
        ring_k=torch.empty(2, WINDOW, HKV, D, dtype=torch.bfloat16, device=DEV),
        ring_v=torch.empty(2, WINDOW, HKV, D, dtype=torch.bfloat16, device=DEV),
    )
    meta = dict(
        loc=torch.arange(1, T + 1, device=DEV),
        positions=torch.arange(T, device=DEV),
        token_rows=torch.ones(T, dtype=torch.int32, device=DEV),
        token_seq_lens=torch.full((T,), L, dtype=torch.int32, device=DEV),
    )
    rot = {}
    if rotate:
        rot = dict(k_rot=torch.linalg.qr(torch.randn(HKV, D, D, device=DEV))[0].float().contiguous(),
                   v_rot=torch.linalg.qr(torch.randn(HKV, D, D, device=DEV))[0].float().contiguous())
    ms = bench_graph(lambda: ops.store_kv(k, v, **meta, **pool, **rot, k_group=GROUP, v_group=GROUP,
                                          k_clip=0.96, v_clip=0.92))
    n_side = min(T, SINK) + min(T, WINDOW)
    nbytes = (2 * T * HKV * D * 2  # read K, V
              + 2 * T * HKV * (D // 4 + 4 * (D // GROUP))  # write codes + params
              + 2 * n_side * HKV * D * 2  # write BF16 sink / ring rows
              + T * (8 + 8 + 4 + 4))  # loc, positions, rows, seq lens
    return ms, nbytes


def bench_store_channel(T, fmt):
    """ops.store_kv_channel (the served per-channel store: key codes + per-page channel params
    written when a page completes, value codes + per-token params, BF16 sink / ring) for T new
    tokens of one request at positions 0..T-1 (whole pages), inside a CUDA graph like bench_store.
    Bytes: K and V read in BF16, codes and params written, the BF16 side rows written."""
    blk = fmt.k_group
    k = torch.randn(T, HKV, D, device=DEV).bfloat16()
    v = torch.randn(T, HKV, D, device=DEV).bfloat16()
    N = T + blk  # page 0 is padding, as SGLang's paged allocator
    kb = code_bytes(fmt.k_bits, D)
    pool = dict(
        k_codes=head_major(torch.empty(N, HKV, kb, dtype=torch.uint8, device=DEV)),
        k_params=head_major(torch.empty(N // blk, HKV, D, 2, dtype=torch.float16, device=DEV)),
        v_codes=head_major(torch.empty(N, HKV, D // 4, dtype=torch.uint8, device=DEV)),
        v_params=head_major(torch.empty(N, HKV, D // fmt.v_group, 2, dtype=torch.float16, device=DEV)),
        sink_k=torch.empty(2, max(fmt.sink, 1), HKV, D, dtype=torch.bfloat16, device=DEV),
        sink_v=torch.empty(2, max(fmt.sink, 1), HKV, D, dtype=torch.bfloat16, device=DEV),
        ring_k=torch.empty(2, fmt.window, HKV, D, dtype=torch.bfloat16, device=DEV),
        ring_v=torch.empty(2, fmt.window, HKV, D, dtype=torch.bfloat16, device=DEV),
    )
    meta = dict(loc=torch.arange(blk, T + blk, device=DEV), positions=torch.arange(T, device=DEV),
                token_rows=torch.ones(T, dtype=torch.int32, device=DEV),
                token_seq_lens=torch.full((T,), T, dtype=torch.int32, device=DEV))
    ms = bench_graph(lambda: ops.store_kv_channel(k, v, **meta, **pool, k_bits=fmt.k_bits, k_block=blk,
                                                  v_group=fmt.v_group))
    n_side = min(T, fmt.sink) + min(T, fmt.window)
    nbytes = (2 * T * HKV * D * 2  # read K, V
              + T * HKV * (kb + D // 4 + 4 * (D // fmt.v_group)) + (T // blk) * HKV * D * 4  # codes, params
              + 2 * n_side * HKV * D * 2  # BF16 sink / ring rows
              + T * (8 + 8 + 4 + 4))  # loc, positions, rows, seq lens
    return ms, nbytes


# (prefix, new tokens), one request; 32K + 128: a chat's next turn, where the per-channel extend's
# grid is under a wave and its prefix split applies
EXTEND_SHAPES = ((32768, 4096), (8192, 512), (32768, 128))
# token_extend settings also timed with --tune-extend (defaults: block_m 128, block_n 128, 8 warps,
# 2 stages for the BF16 loops, core.INT2_STAGES for the INT2 loop; int2_stages=2: each tile's loads
# waited for right after issue)
EXTEND_TUNE = (dict(int2_stages=2), dict(int2_stages=3), dict(int2_stages=7), dict(int2_stages=5, block_n=64))


def check_extend(group, lens=(3000, 700, 150, 40), owns=(0, 40, 2000, 0), sinks=(0, 40, 0, 0), E=(64, 16, 3, 5)):
    """Both extend-prefix kernels (fast: token_extend's, base: the generic token_attend one) vs float64 on a pool
    written with reference.quantize (heavy-tailed channels, low-norm sink tokens) and side buffers
    filled by the source rule (garbage where the rule must not read); ragged requests cross the sink /
    ring / radix-hit boundaries. Bound: rel. error <= 2e-2, |lse error| <= 1e-2 (bf16 operands)."""
    from oscar_kernels.triton import token_extend

    gen = torch.Generator(device=DEV).manual_seed(4321 + group)
    fmt = Int2Format(D, group)
    B, N, R = len(lens), sum(lens) + 1, len(lens) + 1
    codes = {n: head_major(torch.zeros(N, HKV, D // 4, dtype=torch.uint8, device=DEV)) for n in "kv"}
    params = {n: head_major(torch.zeros(N, HKV, D // group, 2, dtype=torch.float16, device=DEV)) for n in "kv"}
    sink = {n: torch.full((R, SINK, HKV, D), 3e4, dtype=torch.bfloat16, device=DEV) for n in "kv"}
    ring = {n: torch.full((R, WINDOW, HKV, D), 3e4, dtype=torch.bfloat16, device=DEV) for n in "kv"}
    slots = (torch.randperm(N - 1, device=DEV, generator=gen) + 1).int()
    kv_indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    rows = torch.arange(1, B + 1, dtype=torch.int32, device=DEV)
    own = torch.zeros(R, dtype=torch.int32, device=DEV)
    own[1:] = torch.tensor(owns, dtype=torch.int32)
    sink_start = torch.zeros(R, dtype=torch.int32, device=DEV)
    sink_start[1:] = torch.tensor(sinks, dtype=torch.int32)
    for b, L in enumerate(lens):
        sl = slots[kv_indptr[b]:kv_indptr[b + 1]].long()
        r = b + 1
        for n in "kv":
            x = heavy_tailed(L, HKV, D, gen)
            codes[n][sl], params[n][sl] = ref.quantize(x, fmt)
            is_sink, is_ring, _ = ref.source_masks(L, SINK, WINDOW, owns[b], DEV, sinks[b])
            p = torch.arange(L, device=DEV)
            sink[n][r, p[is_sink]] = x[is_sink]
            ring[n][r, p[is_ring] % WINDOW] = x[is_ring]
    qo = torch.tensor([0] + list(torch.tensor(E).cumsum(0)), dtype=torch.int32, device=DEV)
    q = torch.randn(sum(E), HQ, D, device=DEV, generator=gen).bfloat16()
    sm = D ** -0.5
    args = (q, qo, codes["k"], params["k"], codes["v"], params["v"], sink["k"], sink["v"], ring["k"], ring["v"],
            kv_indptr, slots, rows, own)
    kw = dict(k_group=group, v_group=group, sm_scale=sm, max_len_extend=max(E), sink_start=sink_start)
    wrong = []
    variants = [("fast", {}), ("base", None)]
    for name, extra in variants:
        o = torch.full((sum(E), HQ, D), float("nan"), device=DEV)
        lse = torch.full((sum(E), HQ), float("nan"), device=DEV)
        if extra is None:
            token_extend.extend_prefix_attention_base(*args, **kw, o=o, lse=lse)
        else:
            token_extend.extend_prefix_attention_fast(*args, **kw, o=o, lse=lse, **extra)
        errs, lerr = [], 0.0
        for b in range(B):
            sl = slots[kv_indptr[b]:kv_indptr[b + 1]]
            K = ref.pool_request_kv(codes["k"], params["k"], sink["k"], ring["k"], sl, b + 1, owns[b], fmt, sinks[b])
            V = ref.pool_request_kv(codes["v"], params["v"], sink["v"], ring["v"], sl, b + 1, owns[b], fmt, sinks[b])
            o_ref, l_ref = ref.attention(q[qo[b]:qo[b + 1]], K, V, sm_scale=sm)
            errs.append(((o[qo[b]:qo[b + 1]].double() - o_ref).norm() / o_ref.norm()).item())
            lerr = max(lerr, (lse[qo[b]:qo[b + 1]].double() - l_ref).abs().max().item())
        ok = max(errs) < 2e-2 and lerr < 1e-2 and not o.isnan().any()
        log(f"  G={group} extend-prefix {name}: rel. error vs float64 per request "
            f"{[f'{e:.1e}' for e in errs]}, max |lse error| {lerr:.1e}{'' if ok else '  WRONG'}")
        if not ok:
            wrong.append(name)
    # a wrong fast variant is reported (WRONG here and in the table) and its tuning runs skipped
    assert "base" not in wrong, "the base extend-prefix kernel is wrong on the GPU"
    return wrong


def extend_io(E):
    """One request's E new query tokens and float32 outputs: (q, qo_indptr, o, lse)."""
    return (torch.randn(E, HQ, D, device=DEV).bfloat16(), torch.tensor([0, E], dtype=torch.int32, device=DEV),
            torch.empty(E, HQ, D, dtype=torch.float32, device=DEV), torch.empty(E, HQ, dtype=torch.float32, device=DEV))


def extend_args(c, q, qo):
    """Positional arguments of the extend-prefix launchers for case c (Int2Case / ChannelCase,
    request 0 of its first copy)."""
    return (q, qo, c.k_codes, c.k_params, c.v_codes, c.v_params, c.sink_k, c.sink_v, c.ring_k, c.ring_v,
            c.indptr, c.indices[0], c.rows[0], c.own)


def bench_extend(prefix, E, tune=False, skip=()):
    """One request: E new tokens over a cached prefix of `prefix` keys. Times (ms, median, L2 flushed):
    base = the generic token_attend kernel, fast = token_extend's (ops' choice here), and, as the
    same-run baseline, SGLang's BF16 Triton extend kernel over the same prefix held in BF16
    (skip_extend=True: prefix part only, like ours; and the whole call, prefix + causal new tokens)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from oscar_kernels.triton import token_extend

    c = Int2Case(1, prefix)
    q, qo, o, lse = extend_io(E)
    args = extend_args(c, q, qo)
    kw = dict(k_group=GROUP, v_group=GROUP, sm_scale=D ** -0.5, max_len_extend=E, o=o, lse=lse)
    r = dict(prefix=prefix, E=E, flops=4 * E * HQ * prefix * D)
    r["base_ms"] = bench(lambda: token_extend.extend_prefix_attention_base(*args, **kw))
    r["fast_ms"] = bench(lambda: token_extend.extend_prefix_attention_fast(*args, **kw))
    r["tune"] = {}
    for cfg in EXTEND_TUNE if tune else ():
        try:
            r["tune"][str(cfg)] = t = bench(lambda: token_extend.extend_prefix_attention_fast(*args, **kw, **cfg))
            log(f"  tune-extend prefix={prefix} E={E} {cfg}: {t:.2f} ms ({r['flops'] / t / 1e9:.0f} TFLOP/s)")
        except Exception as e:  # a config that does not compile/fit: report, go on
            log(f"  tune-extend {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
    del c
    torch.cuda.empty_cache()
    # group size 32 (3 bits/element: four (scale, min) pairs per row) on the same shape
    c = Int2Case(1, prefix, group=32)
    args32 = extend_args(c, q, qo)
    kw32 = dict(kw, k_group=32, v_group=32)
    r["base_g32_ms"] = bench(lambda: token_extend.extend_prefix_attention_base(*args32, **kw32))
    r["fast_g32_ms"] = bench(lambda: token_extend.extend_prefix_attention_fast(*args32, **kw32))
    log(f"  G=32 prefix={prefix} E={E}: base {r['base_g32_ms']:.2f} ms, fast {r['fast_g32_ms']:.2f} ms "
        f"({r['flops'] / r['fast_g32_ms'] / 1e9:.0f} TFLOP/s)")
    del c
    torch.cuda.empty_cache()
    # SGLang BF16: the prefix in a BF16 pool (slots 1..prefix), the new tokens' K/V
    kb = torch.randn(prefix + 1, HKV, D, device=DEV).bfloat16()
    vb = torch.randn(prefix + 1, HKV, D, device=DEV).bfloat16()
    ke = torch.randn(E, HKV, D, device=DEV).bfloat16()
    ve = torch.randn(E, HKV, D, device=DEV).bfloat16()
    kv_indptr = torch.tensor([0, prefix], dtype=torch.int32, device=DEV)
    kv_indices = torch.arange(1, prefix + 1, dtype=torch.int32, device=DEV)
    ob = torch.empty(E, HQ, D, dtype=torch.bfloat16, device=DEV)
    lb = torch.empty(E, HQ, dtype=torch.float32, device=DEV)

    def sgl(skip_extend):
        extend_attention_fwd(q, ke, ve, ob, kb, vb, qo, kv_indptr, kv_indices, None, True, None, E, 1.0, 1.0,
                             sm_scale=D ** -0.5, lse_extend=lb, skip_extend=skip_extend)
    r["sglang_prefix_ms"] = bench(lambda: sgl(True))
    r["sglang_full_ms"] = bench(lambda: sgl(False))
    # the new-token part alone (what the INT2 backend runs next to ours, then merges by LSE)
    r["sglang_new_ms"] = bench(lambda: extend_attention_fwd(
        q, ke, ve, ob, kb, vb, qo, kv_indptr, kv_indices, None, True, None, E, 1.0, 1.0,
        sm_scale=D ** -0.5, lse_extend=lb, skip_prefix=True))
    for k in ("base", "fast", "sglang_prefix"):
        r[k + "_tflops"] = r["flops"] / r[k + "_ms"] / 1e9
    log(f"extend-prefix prefix={prefix} E={E}: base {r['base_ms']:.2f} ms ({r['base_tflops']:.0f} TFLOP/s), "
        f"fast {r['fast_ms']:.2f} ms ({r['fast_tflops']:.0f} TFLOP/s, {r['base_ms'] / r['fast_ms']:.2f}x base), "
        f"SGLang BF16 prefix part {r['sglang_prefix_ms']:.2f} ms ({r['sglang_prefix_tflops']:.0f} TFLOP/s), "
        f"SGLang BF16 whole call {r['sglang_full_ms']:.2f} ms, its new-token part alone {r['sglang_new_ms']:.2f} ms")
    del kb, vb
    torch.cuda.empty_cache()
    return r


# batches of the new tokens' attention: one prefill chunk of 8K tokens as one request, four, sixteen
NEW_TOKEN_BATCHES = ((8192,), (2048,) * 4, (512,) * 16, (4096,))


def bench_new_tokens(lens):
    """The new tokens' attention of an extend (runtime/new_tokens.py, causal, BF16, with the LSE the
    prefix merge needs) on one batch of requests of `lens` new tokens: SGLang's Triton extend kernel
    and FlashInfer's ragged prefill, their outputs checked against each other (LSEs both in natural
    log), then timed (ms, median, L2 flushed). Also the LSE merge at this T: the PyTorch one the
    backend used before vs ops.merge_attention_states (float32 prefix part + BF16 new part -> BF16)."""
    from types import SimpleNamespace

    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from oscar_sglang.runtime.new_tokens import FlashInferNewTokens, TritonNewTokens, workspace_bytes

    T = sum(lens)
    qo_cpu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    qo = qo_cpu.to(DEV)
    out = torch.randn(D, device=DEV) * (1 + 6 * (torch.rand(D, device=DEV) > 0.95))  # outlier channels
    q = (torch.randn(T, HQ, D, device=DEV) * out).bfloat16()
    k = (torch.randn(T, HKV, D, device=DEV) * out).bfloat16()
    v = torch.randn(T, HKV, D, device=DEV).bfloat16()
    layer = SimpleNamespace(scaling=D ** -0.5, logit_capping_method="tanh")
    r = dict(lens=list(lens), T=T, flops=sum(2 * HQ * D * n * n for n in lens))
    tri = TritonNewTokens(extend_attention_fwd, torch.zeros(len(lens) + 1, dtype=torch.int32, device=DEV))
    tri.plan(qo, list(lens), max(lens))
    o_t, l_t = tri.run(q, k, v, layer, 0.0, want_lse=True)
    r["triton_ms"] = bench(lambda: tri.run(q, k, v, layer, 0.0, want_lse=True))
    try:
        fi = FlashInferNewTokens(device=DEV, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, v_head_dim=D,
                                 dtype=torch.bfloat16, workspace_bytes=workspace_bytes())
        fi.plan(qo, list(lens), max(lens))
        o_f, l_f = fi.run(q, k, v, layer, 0.0, want_lse=True)
        r["rel_err_vs_triton"] = ((o_f.float() - o_t).norm() / o_t.norm()).item()
        r["lse_abs_err_vs_triton"] = (l_f * math.log(2.0) - l_t).abs().max().item()
        r["flashinfer_ms"] = bench(lambda: fi.run(q, k, v, layer, 0.0, want_lse=True))
    except Exception as e:  # no FlashInfer JIT here: report it, keep the Triton row
        log(f"  new tokens {lens[0]}x{len(lens)}: FlashInfer failed: {type(e).__name__}: {str(e)[:300]}")
        r["flashinfer_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    # the merge with a float32 prefix part
    o_pre = torch.randn(T, HQ, D, device=DEV)
    l_pre = torch.randn(T, HQ, device=DEV) * 4 + 8

    def torch_merge():
        lse = torch.logaddexp(l_pre, l_t)
        wa = torch.exp(l_pre - lse).nan_to_num_(0.0).unsqueeze(-1)
        wb = torch.exp(l_t - lse).nan_to_num_(0.0).unsqueeze(-1)
        return (o_pre * wa + o_t.bfloat16() * wb).bfloat16()

    r["merge_torch_ms"] = bench(torch_merge)
    r["merge_kernel_ms"] = bench(lambda: ops.merge_attention_states(o_pre, l_pre, o_t.bfloat16(), l_t,
                                                                    out_dtype=torch.bfloat16))
    r["merge_rel_err"] = ((ops.merge_attention_states(o_pre, l_pre, o_t.bfloat16(), l_t, out_dtype=torch.bfloat16)
                           .float() - torch_merge().float()).norm() / torch_merge().float().norm()).item()
    fi_txt = (f"FlashInfer {r['flashinfer_ms']:.2f} ms ({r['flops'] / r['flashinfer_ms'] / 1e9:.0f} TFLOP/s, "
              f"{r['triton_ms'] / r['flashinfer_ms']:.2f}x; vs Triton rel. error {r['rel_err_vs_triton']:.1e}, "
              f"LSE {r['lse_abs_err_vs_triton']:.1e})" if "flashinfer_ms" in r else "FlashInfer failed")
    log(f"new tokens {lens[0]}x{len(lens)}: Triton {r['triton_ms']:.2f} ms "
        f"({r['flops'] / r['triton_ms'] / 1e9:.0f} TFLOP/s), {fi_txt}; merge torch {r['merge_torch_ms']:.3f} ms, "
        f"kernel {r['merge_kernel_ms']:.3f} ms")
    del q, k, v, o_t, l_t, o_pre, l_pre
    torch.cuda.empty_cache()
    return r


def time_channel_variant(cc, ref_kw, var_kw, copy_gbs):
    """A per-channel decode variant (launcher knobs var_kw) checked against the ref_kw launch's
    output on the same inputs (fresh closures read the same input copy), then timed in a CUDA
    graph: ms, GB/s, % of copy bandwidth, relative error. A variant that disagrees (>= 2e-2) is
    not timed: ms None and `disagrees` (the run goes on; one such failure once cost a whole run)."""
    cc.fn(**ref_kw)()
    o_ref = cc.o.float().clone()
    cc.fn(**var_kw)()
    err = ((cc.o.float() - o_ref).norm() / o_ref.norm()).item()
    if not err < 2e-2:
        log(f"  per-channel decode {var_kw} and {ref_kw or 'the default'} DISAGREE: rel. error {err:.1e}; not timed")
        return dict(ms=None, gbs=None, pct_copy=None, rel_err=err, disagrees=True)
    tt = bench_graph(cc.fn(**var_kw), cc.copies)
    return dict(ms=tt, gbs=cc.bytes / tt / 1e6, pct_copy=100 * cc.bytes / tt / 1e6 / copy_gbs, rel_err=err)


def prefix_flashinfer_run(c, fmt, q, E, prefix, o, lse):
    """OSCAR_PREFIX_ATTENTION=flashinfer over case c's request 0 (runtime/prefix_flashinfer.py):
    BF16 pieces of the prefix, FlashInfer's ragged prefill over each, LSE merges; writes o (float32)
    and lse (natural log) as the INT2 prefix kernel does. Returns the per-layer call."""
    from types import SimpleNamespace

    from oscar_sglang.runtime.new_tokens import workspace_bytes
    from oscar_sglang.runtime.prefix_flashinfer import FlashInferPrefix

    fp = FlashInferPrefix(workspace=torch.empty(workspace_bytes(), dtype=torch.uint8, device=DEV),
                          num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, v_head_dim=D, dtype=torch.bfloat16,
                          block=fmt.k_group)
    fp.plan([E], [prefix], DEV)
    kv = dict(k_codes=c.k_codes, k_params=c.k_params, v_codes=c.v_codes, v_params=c.v_params, sink_k=c.sink_k,
              sink_v=c.sink_v, ring_k=c.ring_k, ring_v=c.ring_v, kv_indptr=c.indptr, kv_indices=c.indices[0],
              req_rows=c.rows[0], own_start=c.own, sink_start=c.own, k_bits=fmt.k_bits, k_block=fmt.k_group,
              v_group=fmt.v_group)
    layer = SimpleNamespace(scaling=D ** -0.5)

    def run():
        acc = None
        for o_p, l_p in fp.run(q, layer, kv, None):
            if acc is None:
                acc = (o_p, l_p, True)
                continue
            nl = torch.empty_like(l_p)
            acc = (ops.merge_attention_states(acc[0], acc[1], o_p, l_p, lse_a_base2=acc[2], lse_b_base2=True,
                                              out_dtype=torch.float32, lse_out=nl), nl, False)
        o.copy_(acc[0])
        lse.copy_(acc[1] * (math.log(2.0) if acc[2] else 1.0))
    return run


def bench_channel_extend(prefix, E, formats, variants):
    """Per-channel extend-prefix (ops.extend_prefix_attention_channel) on the served layouts
    (formats: {name: KVFormat}, page blocks, sink / ring of the format), one request, E new tokens over
    `prefix` keys, every launch variant after checking its output against the first variant's on
    the same inputs. ms (median, L2 flushed) and TFLOP/s by
    the same count as bench_extend, so the rows sit next to its SGLang BF16 baseline."""
    out = {}
    flops = 4 * E * HQ * prefix * D
    for name, fmt in formats.items():
        c = ChannelCase(1, prefix, fmt)
        q, qo, o, lse = extend_io(E)
        args = extend_args(c, q, qo)
        kw = dict(k_bits=fmt.k_bits, k_block=fmt.k_group, v_group=fmt.v_group, sm_scale=D ** -0.5,
                  max_len_extend=E, o=o, lse=lse)
        res, first = {}, None
        for v in variants:  # "default[:ROWS][+split]" (the launcher's block_m knob; +split: the prefix
            # length given, so the launcher may split the prefix, as the backend does); "flashinfer":
            # OSCAR_PREFIX_ATTENTION=flashinfer's pieces (planned once, outside the timing: per forward)
            if v == "flashinfer":
                try:
                    run = prefix_flashinfer_run(c, fmt, q, E, prefix, o, lse)
                except Exception as e:  # no FlashInfer JIT here: report it, go on
                    log(f"  channel extend {name} flashinfer failed: {type(e).__name__}: {str(e)[:300]}")
                    res[v] = dict(ms=None, tflops=None, error=f"{type(e).__name__}: {str(e)[:300]}")
                    continue
            else:
                spec, plus, _ = v.partition("+split")
                body, _, rows = spec.partition(":")
                if body != "default":
                    raise SystemExit(f"--channel-extend-variants: {v!r} is not default[:ROWS][+split] or flashinfer")
                extra = dict(**({"block_m": int(rows)} if rows else {}), **({"max_len_prefix": prefix} if plus else {}))
                run = lambda: channel_extend.extend_prefix_attention_channel(*args, **kw, **extra)  # noqa: E731
            run()
            if first is None:
                first = o.clone()
            err = ((o - first).norm() / first.norm().clamp_min(1e-30)).item()
            if not err < 2e-2:  # not timed; the run goes on (time_channel_variant's note)
                log(f"  channel extend {name} {v} and {variants[0]} DISAGREE: rel. error {err:.1e}; not timed")
                res[v] = dict(ms=None, tflops=None, rel_err_vs_first=err, disagrees=True)
                continue
            t = bench(run)
            res[v] = dict(ms=t, tflops=flops / t / 1e9, rel_err_vs_first=err)
            log(f"  channel extend {name} {v} prefix={prefix} E={E}: {t:.2f} ms ({flops / t / 1e9:.0f} TFLOP/s), "
                f"rel. error vs {variants[0]} {err:.1e}")
        out[name] = res
        del c
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--json", help="write the result JSON here (default: bench/results/kernels/<UTC date_time>.json)")
    ap.add_argument("--tune", action="store_true", help="also sweep INT2 decode tile/split settings")
    ap.add_argument("--channel-formats", default=f"{DEFAULT_KV_FORMAT},k3c64-v2t64-s4-w128",
                    help="served per-channel KV formats also timed at every decode shape, same run "
                    "(comma list of KVFormat names; '' = none). Default: the served default "
                    f"({DEFAULT_KV_FORMAT}) and the default before 2026-11-29 (k3c64-v2t64-s4-w128)")
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--shapes", help="comma list of BxL, e.g. 8x32768,64x32768 (default: all)")
    ap.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the G = head_dim INT2 decode kernel (token_decode.py, ops' choice here)")
    ap.add_argument("--tune-channel", action="store_true", help="also time the per-channel decode at a few "
                    "num_warps / body-loop pipeline depths / register caps")
    ap.add_argument("--channel-max-splits", default="", help="comma list: also time the per-channel decode "
                    "at these max_kv_splits (BF16 splits + body splits) for every shape")
    ap.add_argument("--sglang-splits", action="store_true", help="also time the per-channel decode at "
                    "SGLang's split plan (its heuristic for its own kernel, up to 64 splits)")
    ap.add_argument("--channel-knobs", default="[]", help='JSON list of launcher knob sets to also time the '
                    'per-channel decode with, e.g. \'[{"min_chunk": 64}]\'')
    ap.add_argument("--tune-fast", action="store_true", help="also sweep a few settings of the fast kernel")
    ap.add_argument("--skip-store-extend", action="store_true", help="decode only (no store / extend timings)")
    ap.add_argument("--extend-only", action="store_true", help="only the extend-prefix check and timings "
                    "(no decode / store)")
    ap.add_argument("--new-tokens-only", action="store_true", help="only the new tokens' attention "
                    "(SGLang Triton vs FlashInfer ragged prefill) and the LSE merge")
    ap.add_argument("--extend-shapes", default=",".join(f"{p}x{e}" for p, e in EXTEND_SHAPES),
                    help="extend-prefix shapes, comma list of PREFIXxNEW (e.g. 131072x8192)")
    ap.add_argument("--tune-extend", action="store_true", help="also time a few token_extend tile settings")
    ap.add_argument("--channel-extend-variants", default="default,default:64,default+split",
                    help="per-channel extend-prefix launches ('default', or "
                    "default:ROWS for a block_m other than the launcher's, +split to let the launcher split the "
                    "prefix as served; 'flashinfer': OSCAR_PREFIX_ATTENTION=flashinfer's BF16 pieces through "
                    "FlashInfer) timed for every --channel-formats format at every extend shape, same "
                    "run, each checked against the first ('' = none)")
    ap.add_argument("--fast-max-splits", default="", help="comma list: also time the fast kernel at these "
                    "max_kv_splits (BF16 splits + INT2 splits) for every shape")
    ap.add_argument("--bf16-splits", default="8,16,32,64", help="num_kv_splits values tried for SGLang BF16")
    ap.add_argument("--flashinfer", action="store_true", help="also time FlashInfer's BF16 paged decode "
                    "(JIT-compiled on first use; best of its CUDA-core and tensor-core decode)")
    args = ap.parse_args()
    if args.new_tokens_only:
        args.extend_only = args.skip_store_extend = True
    t_start = time.time()
    dev_name = torch.cuda.get_device_name()
    log(f"device: {dev_name}, torch {torch.__version__}, triton {triton.__version__}")

    log("correctness (GPU, vs float64 reference):")
    for g in () if args.extend_only else (128, 32):
        check_correctness(g)
    for g in () if args.extend_only else (128, 32):  # head_dim 256: its own decode tile (BLOCK_N_D256)
        check_correctness(g, lens=(1500, 700, 150, 1), d=256)

    copy_gbs = copy_bandwidth()
    log(f"copy bandwidth (read+write): {copy_gbs:.0f} GB/s")

    shapes = SHAPES[:2] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    shapes = [] if args.extend_only else shapes
    channel_formats = {n: KVFormat.parse(n, head_dim=D) for n in filter(None, args.channel_formats.split(","))}
    # registers: the one-warp body takes 245-255 at sm_90 (8 programs per SM); 192 / 168 / 128 fit
    # 10 / 12 / 16 (168: a 16-32 B spill on the sm_90 census, 128: ~300 B)
    channel_tune = ([dict(num_warps=w) for w in (2, 4)] + [dict(num_int2_stages=3)]
                    + [dict(maxnreg=r) for r in (192, 168, 128)] + [dict(maxnreg=168, num_int2_stages=3)]
                    if args.tune_channel else [])
    # total splits (the format's BF16 splits + body splits): the in-kernel plan then gives every
    # request of these shapes that many (their bodies hold >= min_chunk keys per split)
    channel_splits = [int(v) for v in args.channel_max_splits.split(",") if v]
    bf_splits = [int(s) for s in args.bf16_splits.split(",")]
    rows, raw = [], {"copy_gbs": copy_gbs, "device": dev_name, "decode": [], "tune": []}
    for B, L in shapes:
        bc = Bf16Case(B, L)
        bf = {s: bench_graph(bc.fn(s), bc.copies) for s in bf_splits}
        fi = {}
        for tc in (False, True) if args.flashinfer else ():
            try:
                run_fi = flashinfer_decode_fn(bc, tc)
                ref_o = bc.fn(8).first_copy()
                err = ((run_fi.first_copy() - ref_o).norm() / ref_o.norm()).item()
                assert err < 2e-2, f"FlashInfer and SGLang BF16 decode disagree: rel. error {err:.1e}"
                fi[tc] = bench_graph(run_fi, bc.copies)
                log(f"  FlashInfer BF16 decode B={B} L={L} tensor_cores={tc}: {fi[tc] * 1e3:.1f} us "
                    f"(output vs SGLang's BF16 kernel: rel. error {err:.1e})")
            except Exception as e:  # JIT compilation may not be possible on the machine: report, go on
                log(f"  FlashInfer BF16 decode tensor_cores={tc} failed: {type(e).__name__}: {str(e)[:300]}")
        bf_b = bc.bytes
        del bc
        torch.cuda.empty_cache()
        best_s = min(bf, key=bf.get)
        ic = Int2Case(B, L)
        t_int2 = bench_graph(ic.fn(), ic.copies)
        t_fast = bench_graph(ic.fn(kind="fast"), ic.copies) if args.fast else None
        if args.tune_fast:
            base = int2_fast.default_max_splits(B, HKV, torch.device(DEV))  # INT2 splits, BF16 keys spread
            slots = min(128, int2_fast.PROGRAMS_PER_SM * int2_decode.sm_count(DEV) // (B * HKV))
            # one change at a time from the defaults
            for cfg in (dict(max_kv_splits=slots), dict(max_kv_splits=max(2, base * 3 // 4)),
                        dict(max_kv_splits=base * 3 // 2),
                        dict(fused_merge=base > int2_fast.FUSED_MERGE_MAX_SPLITS), dict(block_b=16),
                        dict(int2_stages=3), dict(block_n=128)):
                try:
                    t = bench_graph(ic.fn(kind="fast", **cfg), ic.copies)
                    log(f"  tune-fast B={B} L={L} {cfg}: {t * 1e3:.1f} us (default {t_fast * 1e3:.1f} us)")
                    raw["tune"].append({"B": B, "L": L, "fast": str(cfg), "ms": t})
                except Exception as e:  # a config that does not compile/fit: report, go on
                    log(f"  tune-fast {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
        for ms in [int(x) for x in args.fast_max_splits.split(",") if x]:
            t = bench_graph(ic.fn(kind="fast", max_kv_splits=ms), ic.copies)
            log(f"  fast B={B} L={L} max_kv_splits={ms}: {t * 1e3:.1f} us (default {t_fast * 1e3:.1f} us)")
            raw["tune"].append({"B": B, "L": L, "fast": f"max_kv_splits={ms}", "ms": t})
        tuned = {}
        if args.tune:
            base = int2_decode.base_max_splits(B, HKV, torch.device(DEV))
            nb16 = int2_core.bf16_splits(SINK, WINDOW, base)
            more = (base - nb16) * 2 + nb16
            cfgs = [dict(block_n=bn, num_stages=st, num_warps=nw)
                    for bn, st, nw in ((128, 2, 4), (128, 2, 2), (128, 3, 2), (64, 3, 2))]
            cfgs += [dict(maxnreg=128), dict(maxnreg=168), dict(maxnreg=128, num_stages=3),
                     dict(max_kv_splits=more), dict(max_kv_splits=(base - nb16) // 2 + nb16)]
            for cfg in cfgs:
                key = tuple(sorted(cfg.items()))
                try:
                    tuned[key] = bench_graph(ic.fn(**cfg), ic.copies)
                except Exception as e:  # a config that does not compile/fit: report, go on
                    log(f"  tune {key} failed: {type(e).__name__}: {str(e)[:200]}")
            for cfg, t in sorted(tuned.items(), key=lambda kv: kv[1]):
                log(f"  tune B={B} L={L} {dict(cfg)}: {t * 1e3:.1f} us")
            raw["tune"].append({"B": B, "L": L, "results": {str(k): v for k, v in tuned.items()}})
        del ic
        torch.cuda.empty_cache()
        chan = {}
        for name in channel_formats:  # the served per-channel layouts, same run, same shape
            cc = ChannelCase(B, L, channel_formats[name])
            t = bench_graph(cc.fn(), cc.copies)
            chan[name] = dict(ms=t, bytes=cc.bytes, gbs=cc.bytes / t / 1e6, pct_copy=100 * cc.bytes / t / 1e6 / copy_gbs,
                              speedup_vs_bf16=bf[best_s] / t)
            log(f"  channel {name} B={B} L={L}: {t * 1e3:.1f} us, {cc.bytes / 1e6:.1f} MB, "
                f"{chan[name]['gbs']:.0f} GB/s ({chan[name]['pct_copy']:.0f}% of copy), {bf[best_s] / t:.2f}x SGLang BF16")
            for knobs in channel_tune:
                try:
                    tt = bench_graph(cc.fn(**knobs), cc.copies)
                    log(f"  tune channel {name} B={B} L={L} {knobs}: {tt * 1e3:.1f} us ({cc.bytes / tt / 1e6 / copy_gbs:.0%} of copy)")
                    raw["tune"].append({"B": B, "L": L, "channel": name, "knobs": str(knobs), "ms": tt})
                except Exception as e:  # a setting that does not compile / fit: report, go on
                    log(f"  tune channel {knobs} failed: {type(e).__name__}: {str(e)[:200]}")
            # other split plans and launcher knobs: the same attention, so each is checked against
            # the main column's output first (time_channel_variant), then timed
            plans = ([dict(max_kv_splits=m) for m in channel_splits]
                     + ([dict(sglang_splits=True)] if args.sglang_splits else []) + json.loads(args.channel_knobs))
            for knobs in plans:
                try:
                    res = time_channel_variant(cc, {}, knobs, copy_gbs)
                except Exception as e:  # a setting that does not compile / fit: report, go on
                    log(f"  channel plan {knobs} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                if res["ms"] is not None:
                    log(f"  tune channel {name} B={B} L={L} {knobs}: {res['ms'] * 1e3:.1f} us "
                        f"({res['pct_copy']:.0f}% of copy), rel_err_vs_default {res['rel_err']:.1e}")
                raw["tune"].append({"B": B, "L": L, "channel": name, "knobs": str(knobs), **res})
            del cc
            torch.cuda.empty_cache()
        r = dict(B=B, L=L, bf16_ms=bf[best_s], bf16_splits=best_s, bf16_all=bf, int2_ms=t_int2, channel=chan,
                 flashinfer_ms=min(fi.values()) if fi else None, flashinfer_all={str(k): v for k, v in fi.items()},
                 int2_bytes=int2_bytes(B, L, GROUP), bf16_bytes=bf_b,
                 int2_tuned_ms=min(tuned.values()) if tuned else None)
        r["int2_gbs"] = r["int2_bytes"] / t_int2 / 1e6
        r["bf16_gbs"] = r["bf16_bytes"] / r["bf16_ms"] / 1e6
        r["speedup"] = r["bf16_ms"] / t_int2
        if t_fast is not None:
            r["fast_ms"] = t_fast
            r["fast_gbs"] = r["int2_bytes"] / t_fast / 1e6
            r["fast_speedup"] = r["bf16_ms"] / t_fast
        if r["flashinfer_ms"]:
            r["flashinfer_gbs"] = r["bf16_bytes"] / r["flashinfer_ms"] / 1e6
            r["best_int2_vs_flashinfer"] = r["flashinfer_ms"] / min(t_int2, t_fast or float("inf"))
            log(f"  FlashInfer BF16 best {r['flashinfer_ms'] * 1e3:.1f} us ({r['flashinfer_gbs']:.0f} GB/s): "
                f"INT2 {r['best_int2_vs_flashinfer']:.2f}x faster")
        rows.append(r)
        raw["decode"].append(r)
        log(f"B={B:3d} L={L:6d}  BF16 {r['bf16_ms'] * 1e3:8.1f} us ({r['bf16_gbs']:5.0f} GB/s, splits {best_s})"
            f"  INT2 {t_int2 * 1e3:7.1f} us ({r['int2_gbs']:5.0f} GB/s, {100 * r['int2_gbs'] / copy_gbs:3.0f}% of copy)"
            f"  speedup {r['speedup']:.2f}x"
            + (f"  FAST {t_fast * 1e3:7.1f} us ({r['fast_gbs']:5.0f} GB/s, {100 * r['fast_gbs'] / copy_gbs:3.0f}% of copy)"
               f"  speedup {r['fast_speedup']:.2f}x" if t_fast is not None else ""))

    st = []
    for T, rot in () if args.skip_store_extend or args.extend_only else ((16384, False), (16384, True), (64, False)):
        ms, nb = bench_store(T, rot)
        st.append(dict(T=T, rotate=rot, ms=ms, bytes=nb, gbs=nb / ms / 1e6))
        log(f"store T={T} rotate={rot}: {ms * 1e3:.1f} us, {nb / ms / 1e6:.0f} GB/s")
    for T in () if args.skip_store_extend or args.extend_only else (16384, 64):
        for name, fmt in channel_formats.items():  # the served per-channel store, same run
            ms, nb = bench_store_channel(T, fmt)
            st.append(dict(T=T, rotate=False, format=name, ms=ms, bytes=nb, gbs=nb / ms / 1e6,
                           pct_copy=100 * nb / ms / 1e6 / copy_gbs))
            log(f"store {name} T={T}: {ms * 1e3:.1f} us, {nb / ms / 1e6:.0f} GB/s "
                f"({100 * nb / ms / 1e6 / copy_gbs:.0f}% of copy)")
    raw["store"] = st
    ex = []
    if not args.skip_store_extend:
        log("extend-prefix correctness (GPU, vs float64 reference):")
        wrong = [w for g in (128, 32) for w in check_extend(g)]
    extend_shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.extend_shapes.split(",") if sh]
    for prefix, E in () if args.skip_store_extend else extend_shapes:
        ex.append(bench_extend(prefix, E, tune=args.tune_extend, skip=wrong))
        ex[-1]["fast_check_failed"] = "fast" in wrong
        ext_variants = [v for v in args.channel_extend_variants.split(",") if v]
        if channel_formats and ext_variants:
            ex[-1]["channel"] = bench_channel_extend(prefix, E, channel_formats, ext_variants)
    raw["extend"] = ex
    nt = [bench_new_tokens(lens) for lens in
          (NEW_TOKEN_BATCHES if args.new_tokens_only or not args.skip_store_extend else ())]

    # acceptance checks: the per-token layout's kernels, and each per-channel format's decode at
    # 8 x 32K
    acc = []
    for r in rows:  # acceptance on the faster INT2 kernel of this run (both are in the table)
        r["best_ms"] = min(r["int2_ms"], r.get("fast_ms") or float("inf"))
        r["best_speedup"] = r["bf16_ms"] / r["best_ms"]
        r["best_gbs"] = r["int2_bytes"] / r["best_ms"] / 1e6
    ok1 = all(r["best_speedup"] >= 4 for r in rows if r["L"] >= 32768 and r["B"] >= 8)
    acc.append(("per-token INT2 >= 4x SGLang BF16 at every L >= 32K with B >= 8", ok1))
    ok2 = all(r["best_speedup"] > 1 for r in rows if r["B"] == 1 and r["L"] >= 8192)
    acc.append(("per-token INT2 faster than SGLang BF16 at B=1 for every L >= 8K", ok2))
    ok3 = all(r["best_gbs"] >= 0.75 * copy_gbs for r in rows if r["B"] * r["L"] >= 262144)
    acc.append(("per-token INT2 >= 75% of copy bandwidth on its bytes when B*L >= 256K", ok3))
    for name in channel_formats:  # the served per-channel layout keeps the bandwidth
        at = [r["channel"][name]["pct_copy"] >= 80 for r in rows if (r["B"], r["L"]) == (8, 32768)]
        if at:
            acc.append((f"per-channel {name} decode >= 80% of copy bandwidth at B=8, L=32K", all(at)))
    acc = [] if args.extend_only else acc
    for name, ok in acc:
        log(f"ACCEPTANCE {'PASS' if ok else 'FAIL'}: {name}")
    raw["acceptance"] = acc

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [
        f"Device: {dev_name}; torch {torch.__version__}, triton {triton.__version__}, Python "
        f"{platform.python_version()}; {date}. Hq={HQ}, Hkv={HKV}, D={D}, INT2 group {GROUP} "
        f"(K and V, 2.25 bits/element), sink {SINK} + ring {WINDOW} BF16 keys per request, "
        f"page size 1, contiguous slots per request (same kv_indices layout for both kernels). "
        f"Decode timed in CUDA graphs, inputs rotated through >= 256 MB of copies (no L2 reuse).",
        f"Copy bandwidth measured in the same run: **{copy_gbs:.0f} GB/s** (torch copy_, read + write).",
    ]
    if rows:  # (none with --extend-only; tables only for what this run measured)
        md += ["",
               "| B | L | SGLang BF16 Triton (best splits) | BF16 GB/s | INT2 (ours) | INT2 bytes read | INT2 GB/s "
               "| % of copy BW | speedup |" + (" INT2 fast | fast GB/s | fast % of copy | fast speedup |" if args.fast else ""),
               "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if args.fast else "")]
    for r in rows:
        md.append(
            f"| {r['B']} | {r['L'] // 1024}K | {r['bf16_ms'] * 1e3:.1f} us ({r['bf16_splits']}) | {r['bf16_gbs']:.0f} "
            f"| {r['int2_ms'] * 1e3:.1f} us | {r['int2_bytes'] / 1e6:.1f} MB | {r['int2_gbs']:.0f} "
            f"| {100 * r['int2_gbs'] / copy_gbs:.0f}% | **{r['speedup']:.2f}x** |"
            + (f" {r['fast_ms'] * 1e3:.1f} us | {r['fast_gbs']:.0f} | {100 * r['fast_gbs'] / copy_gbs:.0f}% "
               f"| **{r['fast_speedup']:.2f}x** |" if "fast_ms" in r else ""))
    if rows and channel_formats:
        md += ["", "Per-channel key layouts (the served formats; pages of 64, sink 64 + ring 256 BF16), same run:", "",
               "| B | L | " + " | ".join(f"{n} | GB/s | % of copy | vs BF16" for n in channel_formats) + " |",
               "|---:|---:|" + "---:|---:|---:|---:|" * len(channel_formats)]
        for r in rows:
            md.append(f"| {r['B']} | {r['L'] // 1024}K | " + " | ".join(
                f"{c['ms'] * 1e3:.1f} us | {c['gbs']:.0f} | {c['pct_copy']:.0f}% | {c['speedup_vs_bf16']:.2f}x"
                for c in (r["channel"][n] for n in channel_formats)) + " |")
    fi_rows = [r for r in rows if r.get("flashinfer_ms")]
    if fi_rows:  # the second BF16 baseline, same run
        md += ["", "| B | L | FlashInfer BF16 decode (best of CUDA-core / tensor-core) | FlashInfer GB/s | "
               "INT2 (faster of ours) | INT2 vs FlashInfer |", "|---:|---:|---:|---:|---:|---:|"]
    for r in fi_rows:
        t = min(r["int2_ms"], r.get("fast_ms") or float("inf"))
        md.append(f"| {r['B']} | {r['L'] // 1024}K | {r['flashinfer_ms'] * 1e3:.1f} us | {r['flashinfer_gbs']:.0f} | "
                  f"{t * 1e3:.1f} us | **{r['best_int2_vs_flashinfer']:.2f}x** |")
    if st:
        md += ["", "| store (K+V, clip 0.96/0.92, side buffers) | time | GB/s |", "|---|---:|---:|"]
    for s in st:
        what = f"`{s['format']}` " if s.get("format") else ""
        pct = f" ({s['pct_copy']:.0f}% of copy)" if s.get("pct_copy") else ""
        md.append(f"| {what}T={s['T']} tokens{', in-kernel rotation' if s['rotate'] else ''} | {s['ms'] * 1e3:.1f} us "
                  f"| {s['gbs']:.0f}{pct} |")
    if ex:
        md += ["", "| extend-prefix (1 request, Hq=32, Hkv=8, D=128, G=128) | INT2 base (generic kernel) "
               "| INT2 fast (token_extend.py, ops' choice) | fast vs base | SGLang BF16 Triton extend, prefix part "
               "| fast vs SGLang BF16 | SGLang BF16 whole call (+ causal new tokens) | its new-token part alone |",
               "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in ex:
        md.append(f"| prefix {e['prefix'] // 1024}K, {e['E']} new tokens | {e['base_ms']:.2f} ms, "
                  f"{e['base_tflops']:.0f} TFLOP/s | {e['fast_ms']:.2f} ms, {e['fast_tflops']:.0f} TFLOP/s"
                  f"{' (FAILED the float64 check)' if e['fast_check_failed'] else ''} "
                  f"| **{e['base_ms'] / e['fast_ms']:.2f}x** | {e['sglang_prefix_ms']:.2f} ms, "
                  f"{e['sglang_prefix_tflops']:.0f} TFLOP/s | {e['sglang_prefix_ms'] / e['fast_ms']:.2f}x "
                  f"| {e['sglang_full_ms']:.2f} ms | {e['sglang_new_ms']:.2f} ms |")
    for e in ex:
        for name, res in (e.get("channel") or {}).items():
            md.append(f"\nPer-channel extend-prefix `{name}`, prefix {e['prefix'] // 1024}K + {e['E']}: "
                      + ", ".join(f"{v} {r['ms']:.2f} ms ({r['tflops']:.0f} TFLOP/s, "
                                  f"{e['sglang_prefix_ms'] / r['ms']:.2f}x SGLang BF16's prefix part)"
                                  if r["ms"] is not None else f"{v} not timed ({r.get('error') or 'differs by %.1e' % r['rel_err_vs_first']})"
                                  for v, r in res.items()) + ".")
    for e in ex:
        md.append(f"\nG=32 (same shape, 3 bits/element), prefix {e['prefix'] // 1024}K + {e['E']}: base "
                  f"{e['base_g32_ms']:.2f} ms, fast {e['fast_g32_ms']:.2f} ms "
                  f"({e['flops'] / e['fast_g32_ms'] / 1e9:.0f} TFLOP/s, {e['base_g32_ms'] / e['fast_g32_ms']:.2f}x).")
    if nt:
        md += ["", "| new tokens' attention (causal, BF16, with LSE) | SGLang Triton extend | FlashInfer ragged "
               "prefill | FlashInfer vs Triton | LSE merge: PyTorch | merge kernel |", "|---|---:|---:|---:|---:|---:|"]
    for n in nt:
        fi = (f"{n['flashinfer_ms']:.2f} ms, {n['flops'] / n['flashinfer_ms'] / 1e9:.0f} TFLOP/s | "
              f"**{n['triton_ms'] / n['flashinfer_ms']:.2f}x**" if "flashinfer_ms" in n else "failed | -")
        md.append(f"| {len(n['lens'])} x {n['lens'][0]} tokens | {n['triton_ms']:.2f} ms, "
                  f"{n['flops'] / n['triton_ms'] / 1e9:.0f} TFLOP/s | {fi} | {n['merge_torch_ms']:.3f} ms "
                  f"| {n['merge_kernel_ms']:.3f} ms |")
    if acc:
        md += ["", "Acceptance checks, this run:", ""]
        md += [f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in acc]
    text = "\n".join(md)
    log("\n" + text)
    if args.out:
        open(args.out, "w").write(text + "\n")
    doc = _results.document(
        f"synthetic: Hq={HQ}, Hkv={HKV}, D={D}, INT2 group {GROUP}, sink {SINK} + ring {WINDOW} BF16 keys",
        [{"part": "decode", **r} for r in raw["decode"]] + [{"part": "store", **s} for s in st]
        + [{"part": "extend", **e} for e in ex] + [{"part": "new_tokens", **n} for n in nt],
        device=dev_name, copy_gbs=copy_gbs, tune=raw["tune"],
        acceptance=acc, versions={"torch": torch.__version__, "triton": triton.__version__,
                                  "python": platform.python_version()})
    log(f"wrote {_results.write(args.json or _results.default_path('kernels'), doc)}")
    log(f"total {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
