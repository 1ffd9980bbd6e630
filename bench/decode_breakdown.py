"""Where the fast INT2 decode's time goes at the bandwidth shapes, and which split count / tile fits.

For each (B, L) it times, in one CUDA-graph run like bench/kernels.py:
  * the whole op (stage 1 with the merge fused into it, the default), the stage-1 kernel alone and
    the merge kernel alone (the merge as its own kernel, fused_merge=False);
  * the whole op on a one-tile-per-split context (fixed cost of the grid: launch, prologue,
    epilogue, merge) at the default split count;
  * the whole op over a sweep of INT2 split counts x kernel settings (CONFIGS; default marked).
Bytes and GB/s use bench/kernels.py's count (codes + params + BF16 sink/ring + int32 indices).

Usage (H100, from the project root):
    source .devkit/device-env.sh && python bench/decode_breakdown.py --out $OUT/breakdown.md --json $OUT/breakdown.json
The JSON (bench/_results.py: date, device, model, command, one row per (B, L) with its sweep) goes
to bench/results/decode_breakdown/<UTC date_time>.json when --json is not given.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

import importlib.util
import pathlib

import torch

import _results
from oscar_kernels.triton import token_decode as fast

# bench/kernels.py (cases, graph timer, byte counts), loaded under its own name: a module called
# `kernels` would shadow the `kernels` package SGLang depends on
_spec = importlib.util.spec_from_file_location("oscar_bench_kernels", pathlib.Path(__file__).with_name("kernels.py"))
kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb)

SWEEP = {  # INT2 splits per (request, KV head) tried per batch size
    8: (12, 16, 20, 24),  # 16: 8 x 8 x 16 = 1024 programs, 7.8 per SM (SPLIT_PROGRAMS_PER_SM = 8)
    32: (3, 4, 5, 6),
    64: (2, 3, 4, 6),
}
# kernel settings swept (decode_attention_fast keyword arguments; {} = the defaults)
CONFIGS = [{}, dict(block_b=16), dict(int2_stages=7)]


def stage1_only(case, **kw):
    """case.fn(kind='fast') with the merge kernel (not fused) replaced by nothing."""
    run = case.fn(kind="fast", fused_merge=False, **kw)

    def go():
        saved = fast.merge_splits
        fast.merge_splits = lambda *a, **k: None
        try:
            run()
        finally:
            fast.merge_splits = saved
    return go


def merge_only(case):
    """The merge kernel alone on the partials of one stage-1 call."""
    ms = fast.default_max_splits(case.B, kb.HKV, torch.device(kb.DEV))
    captured = {}
    saved = fast.merge_splits

    def grab(*a, **k):
        captured["a"], captured["k"] = a, k
        return saved(*a, **k)
    fast.merge_splits = grab
    try:
        case.fn(kind="fast", max_kv_splits=ms, fused_merge=False)()
    finally:
        fast.merge_splits = saved
    a, k = captured["a"], captured["k"]
    return lambda: fast.merge_splits(*a, **k)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="markdown summary here")
    ap.add_argument("--json", help="the result JSON here (default: bench/results/decode_breakdown/<UTC date_time>.json)")
    ap.add_argument("--shapes", default="8x32768,32x8192,64x32768")
    ap.add_argument("--configs", default=json.dumps(CONFIGS),
                    help="JSON list of decode_attention_fast keyword dicts to sweep (default: %(default)s)")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    copy_gbs = kb.copy_bandwidth()
    kb.log(f"device {dev}; copy bandwidth {copy_gbs:.0f} GB/s")
    rows = []  # one per (B, L)
    md = []
    for s in args.shapes.split(","):
        B, L = (int(v) for v in s.split("x"))
        case = kb.Int2Case(B, L)
        nbytes = kb.int2_bytes(B, L, kb.GROUP)
        default = fast.default_max_splits(B, kb.HKV, torch.device(kb.DEV))
        nb16 = 0  # the default spreads the BF16 keys over the INT2 splits
        t_full = kb.bench_graph(case.fn(kind="fast"), case.copies)
        t_s1 = kb.bench_graph(stage1_only(case), case.copies)
        t_mg = kb.bench_graph(merge_only(case), case.copies)
        del case
        torch.cuda.empty_cache()
        # fixed cost: one BLOCK_N tile of INT2 keys per split (plus the BF16 sink and ring)
        L1 = kb.SINK + kb.WINDOW + (default - nb16) * fast.BLOCK_N
        small = kb.Int2Case(B, L1)
        t_fixed = kb.bench_graph(small.fn(kind="fast"), small.copies)
        del small
        torch.cuda.empty_cache()
        row = dict(B=B, L=L, bytes=nbytes, default_splits=default, full_us=t_full * 1e3, stage1_us=t_s1 * 1e3,
                   merge_us=t_mg * 1e3, fixed_us=t_fixed * 1e3, fixed_L=L1, sweep=[])
        kb.log(f"B={B} L={L}: whole op {t_full * 1e3:.1f} us ({nbytes / t_full / 1e6 / copy_gbs:.0%} of copy), "
               f"stage 1 alone {t_s1 * 1e3:.1f} us, merge alone {t_mg * 1e3:.1f} us, "
               f"one tile per split (L={L1}) {t_fixed * 1e3:.1f} us; default max_kv_splits {default}")
        case = kb.Int2Case(B, L)
        for cfg in json.loads(args.configs):
            cfg_nb16 = 0  # the BF16 keys are spread over the INT2 splits
            for n in sorted(set(SWEEP.get(B, ())) | {default - nb16}):
                ms = n + cfg_nb16
                try:
                    t = kb.bench_graph(case.fn(kind="fast", max_kv_splits=ms, **cfg), case.copies)
                except Exception as e:  # noqa: BLE001  (a config that does not fit: report, go on)
                    kb.log(f"  {cfg} splits={n}: failed {type(e).__name__}: {str(e)[:160]}")
                    continue
                mark = " (default)" if n == default - nb16 and not cfg else ""
                kb.log(f"  {str(cfg):45s} INT2 splits={n:3d} programs={B * kb.HKV * ms:5d}: {t * 1e3:7.1f} us "
                       f"({nbytes / t / 1e6 / copy_gbs:.0%} of copy){mark}")
                row["sweep"].append(dict(cfg=cfg, int2_splits=n, us=t * 1e3, frac=nbytes / t / 1e6 / copy_gbs))
        del case
        torch.cuda.empty_cache()
        best = min(row["sweep"], key=lambda r: r["us"]) if row["sweep"] else None
        rows.append(row)
        md.append(f"| {B} | {L // 1024}K | {t_full * 1e3:.1f} | {t_s1 * 1e3:.1f} | {t_mg * 1e3:.1f} | "
                  f"{t_fixed * 1e3:.1f} (L={L1}) | "
                  + (f"{best['us']:.1f} ({best['cfg'] or 'defaults'}, {best['int2_splits']} splits, "
                     f"{best['frac']:.0%} of copy) |" if best else "- |"))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        f"{dev}, {date}; copy bandwidth {copy_gbs:.0f} GB/s (same run). Times in us per decode call.", "",
        "| B | L | whole op | stage 1 alone | merge alone | one tile per split | best of the sweep |",
        "|---:|---:|---:|---:|---:|---:|---|", *md])
    kb.log("\n" + text)
    if args.out:
        open(args.out, "w").write(text + "\n")
    doc = _results.document(f"synthetic: Hq={kb.HQ}, Hkv={kb.HKV}, D={kb.D}, INT2 group {kb.GROUP}, "
                            f"sink {kb.SINK} + ring {kb.WINDOW} BF16 keys", rows, device=dev,
                            copy_gbs=copy_gbs, configs=json.loads(args.configs))
    kb.log(f"wrote {_results.write(args.json or _results.default_path('decode_breakdown'), doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
