"""A decode step's rotation and store, per layer: the split path against OSCAR_DECODE_STORE=fused.

What the backend runs for one layer of a decode step with a per-channel format (R_v in the
weights): `split` = k @ R_k and q @ R_k as two GEMMs in the model's dtype, then
ops.store_kv_channel's two launches; `fused` = one ops.store_kv_channel launch with rot_k, q and
one_token_per_request. Each is timed inside a CUDA graph (as SGLang replays decode), both in the
same run, per batch size; before timing, the two paths' pools and rotated queries are compared
(the GEMM and the kernel's MMA may sum in different orders, so a rare element can differ in its
last bit: `agree` allows one bf16 ulp in q and 0.1% of differing pool bytes; the counts are in
each row). Each path is also timed with a cold L2 (`*_cold_us`: every call after a write of 4x
the L2, whose own time is subtracted), as in a model where the layers' weights evict R_k, q, k and
the pool between one layer's store and the next.
Request b decodes position 64 * (8 + b) + b % 64, so one request in 64 completes a block each
step, as in steady decode. Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128).

    python -m bench.decode_store                       # H100: ~1 minute
    python -m bench.decode_store --batches 1,64 --out /tmp/s.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench import _results
from oscar_sglang.runtime.kv_format import DEFAULT_KV_FORMAT  # noqa: E402 (the served default)
from bench._timing import bench_graph  # noqa: E402
from oscar_kernels import ops  # noqa: E402
from oscar_kernels.format import KVFormat, code_bytes  # noqa: E402
from oscar_kernels.hadamard import hadamard  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, D = 32, 8, 128
BATCHES = "1,8,64,256,512"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class DecodeStep:
    """One layer's pool and one decode step's inputs for `batch` requests (request b at row b + 1
    on its own pages), in the model's dtype (bf16)."""

    def __init__(self, fmt, batch, gen):
        self.fmt, self.B = fmt, batch
        blk = fmt.k_group
        self.pos = torch.tensor([blk * (8 + b) + b % blk for b in range(batch)])
        pages = int(self.pos.max()) // blk + 1
        N = (batch * pages + 1) * blk
        hm = lambda *s, dt: torch.zeros(HKV, *s, dtype=dt, device=DEV).transpose(0, 1)  # noqa: E731
        R = batch + 1
        side = lambda s: (torch.randn(R, s, HKV, D, generator=gen) * 2).bfloat16().to(DEV)  # noqa: E731
        self.pool = dict(
            k_codes=hm(N, code_bytes(fmt.k_bits, D), dt=torch.uint8),
            k_params=hm(N // blk, D, 2, dt=torch.float16),
            v_codes=hm(N, D // 4, dt=torch.uint8),
            v_params=hm(N, D // fmt.v_group, 2, dt=torch.float16),
            sink_k=side(max(fmt.sink, 1)), sink_v=side(max(fmt.sink, 1)),
            ring_k=side(fmt.window), ring_v=side(fmt.window))  # earlier tokens: rotated keys in the ring
        self.loc = (torch.arange(batch) * pages * blk + blk + self.pos).to(DEV)
        self.rows = torch.arange(1, batch + 1, dtype=torch.int32, device=DEV)
        self.k = torch.randn(batch, HKV, D, generator=gen).bfloat16().to(DEV)
        self.v = torch.randn(batch, HKV, D, generator=gen).bfloat16().to(DEV)
        # q as the model hands it over: a view into the fused qkv output
        qkv = torch.randn(batch, HQ + 2 * HKV, D, generator=gen).bfloat16().to(DEV)
        self.q = qkv[:, :HQ]
        signs = torch.randint(0, 2, (D,), generator=gen).double() * 2 - 1
        self.R = (hadamard(D) * signs).bfloat16().to(DEV)  # the data-free rotation, shared by heads
        self.q_out = torch.empty(batch, HQ, D, dtype=torch.bfloat16, device=DEV)
        self.meta = dict(positions=self.pos.to(DEV), token_rows=self.rows, token_seq_lens=(self.pos + 1).int().to(DEV))
        self.kw = dict(k_bits=fmt.k_bits, k_block=blk, v_group=fmt.v_group)

    def split(self, pool):
        k_r = (self.k.reshape(-1, D) @ self.R).view(self.B, HKV, D)
        q_r = (self.q.reshape(-1, D) @ self.R).view(self.B, HQ, D)
        ops.store_kv_channel(k_r, self.v, self.loc, **self.meta, **pool, **self.kw)
        return q_r

    def fused(self, pool):
        ops.store_kv_channel(self.k, self.v, self.loc, **self.meta, **pool, **self.kw, rot_k=self.R,
                             q=self.q, q_out=self.q_out, one_token_per_request=True)
        return self.q_out

    def compare(self) -> dict:
        """Both paths on copies of the pool: differing bytes of each pool tensor, the rotated
        queries' largest difference in bf16 ulps, and whether they agree (see the docstring)."""
        out = []
        for run in (self.split, self.fused):
            pool = {n: t.clone() for n, t in self.pool.items()}
            q = run(pool).clone()
            out.append((pool, q))
        diff = {n: int((out[0][0][n].view(torch.uint8) != out[1][0][n].view(torch.uint8)).sum())
                for n in self.pool}
        a, b = out[0][1].double(), out[1][1].double()
        ulp = torch.exp2(torch.floor(torch.log2(a.abs().clamp_min(2.0 ** -126))) - 7)
        q_ulps = float(((a - b).abs() / ulp).max())
        frac = sum(diff.values()) / sum(t.numel() * t.element_size() for t in self.pool.values())
        return dict(differing_bytes=diff, q_max_ulps=q_ulps, agree=q_ulps <= 1.0 and frac <= 1e-3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default=DEFAULT_KV_FORMAT, help="per-channel KV format (default: the served default)")
    ap.add_argument("--batches", default=BATCHES, help="comma list of decode batch sizes")
    ap.add_argument("--check-only", action="store_true", help="compare the two paths, time nothing (CPU)")
    ap.add_argument("--out", help="JSON path (default bench/results/kernels/<UTC date_time>_decode-store.json)")
    args = ap.parse_args(argv)
    fmt = KVFormat.parse(args.format, head_dim=D)
    if fmt.k_layout != "channel":
        raise SystemExit(f"{args.format}: the fused store is for per-channel key formats")
    if not args.check_only and DEV != "cuda":
        raise SystemExit("timing needs a GPU (use --check-only here)")
    gen = torch.Generator().manual_seed(0)
    rows = []
    t0 = time.time()
    if not args.check_only:
        # cold: each call after a write of 4x the L2, as a decode layer runs after the previous
        # layers' weights went through L2 (R_k, q, k and the pool evicted); the write's own time,
        # timed alone in the same way, is subtracted
        flush = torch.empty(4 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device=DEV)
        flush_us = 1e3 * bench_graph(lambda: flush.fill_(1), min_calls=32)
    for B in (int(x) for x in args.batches.split(",")):
        step = DecodeStep(fmt, B, gen)
        row = dict(batch=B, format=fmt.name, **step.compare())
        if not args.check_only:
            row["split_us"] = 1e3 * bench_graph(lambda: step.split(step.pool), min_calls=32)
            row["fused_us"] = 1e3 * bench_graph(lambda: step.fused(step.pool), min_calls=32)
            row["saved_us_per_layer"] = row["split_us"] - row["fused_us"]
            row["fused_vs_split"] = row["fused_us"] / row["split_us"]
            for path in ("split", "fused"):
                run = getattr(step, path)
                row[f"{path}_cold_us"] = 1e3 * bench_graph(lambda: (flush.fill_(1), run(step.pool)), min_calls=32) - flush_us
            row["cold_saved_us_per_layer"] = row["split_cold_us"] - row["fused_cold_us"]
        rows.append(row)
        log(f"B={B:4d} agree={row['agree']} (q {row['q_max_ulps']:.1f} ulps, pool bytes differing "
            f"{sum(row['differing_bytes'].values())}) " + (f"split {row['split_us']:.1f} us, fused "
            f"{row['fused_us']:.1f} us ({row['fused_vs_split']:.2f}x); L2 cold: split {row['split_cold_us']:.1f}, "
            f"fused {row['fused_cold_us']:.1f} us" if "split_us" in row else ""))
    doc = _results.document("synthetic (Llama-3.1-8B attention shapes, one layer)", rows,
                            seconds=round(time.time() - t0, 1), timed=not args.check_only,
                            **({} if args.check_only else {"l2_flush_bytes": flush.numel(), "l2_flush_us": flush_us}))
    out = args.out or str(_results.default_path("kernels")).replace(".json", "_decode-store.json")
    log(f"wrote {_results.write(out, doc)}")
    return 0 if all(r["agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
