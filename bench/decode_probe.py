"""Is the fast INT2 decode limited by memory or by the SMs? Two probes that bracket it.

For each (B, L), in one CUDA-graph run like bench/kernels.py (same pool, same kv_indices, same
split count), it times:
  * the fast decode as benchmarked (docs/benchmarks.md "Kernels");
  * memory side: a kernel with the fast decode's grid, split ranges and INT2 loads
    (attend_fast._int2_slots / _int2_fetch, the same tl.range pipeline), whose only work is
    adding the loaded words up: how fast the access pattern itself streams;
  * SM side: the fast decode on a pool whose kv_indices all point into 4096 slots (2.4 MB, held
    in L2): the same instructions with memory (nearly) out of the way.
GB/s are on the bytes the real call reads (bench/kernels.py's count). If the memory probe is near
copy bandwidth and the L2 probe is not much faster than the real call, the SM side (instructions,
latency, occupancy) is the limit; if the memory probe is itself slow, the access pattern is.

Usage (H100, from the project root):
    source .devkit/device-env.sh && python3 bench/decode_probe.py --out $OUT/probe.md
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import pathlib
import sys

import torch
import triton
import triton.language as tl

from oscar_kernels.triton import attend_fast as fast
from oscar_kernels.triton import decode as dec
from oscar_kernels.triton.attend import INT2_STAGES, as_param_words

_spec = importlib.util.spec_from_file_location("oscar_bench_kernels", pathlib.Path(__file__).with_name("kernels.py"))
kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb)

L2_SLOTS = 4096


@triton.jit
def fetch_only_kernel(KC, stride_kcn, stride_kch, KP, stride_kpn, stride_kph,
                      VC, stride_vcn, stride_vch, VP, stride_vpn, stride_vph,
                      kv_indptr, kv_indices, Out, n_int2_splits,
                      S: tl.constexpr, W: tl.constexpr, QD: tl.constexpr, QDV: tl.constexpr,
                      BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """The INT2 loads of attend_fast_kernel's INT2 splits (fresh requests: positions S .. L-W-1),
    summed instead of attended."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_start = tl.load(kv_indptr + b)
    kv_len = tl.load(kv_indptr + b + 1) - kv_start
    n_int2 = tl.maximum(kv_len - S - W, 0)
    chunk = tl.cdiv(tl.cdiv(n_int2, n_int2_splits), BLOCK_N) * BLOCK_N
    i_lo = tl.minimum(split * chunk, n_int2)
    i_hi = tl.minimum(i_lo + chunk, n_int2)
    i_full = i_lo + (i_hi - i_lo) // BLOCK_N * BLOCK_N
    kvh64 = kvh.to(tl.int64)
    KCh = KC + kvh64 * stride_kch
    KPh = KP + kvh64 * stride_kph
    VCh = VC + kvh64 * stride_vch
    VPh = VP + kvh64 * stride_vph
    acc_k = tl.zeros([BLOCK_N, QD], tl.int32)
    acc_v = tl.zeros([QDV, BLOCK_N], tl.int32)
    acc_p = tl.zeros([BLOCK_N], tl.int32)
    # INT2 index i is position S + i (hole = S: the sink sits below every INT2 key)
    for i0 in tl.range(i_lo, i_full, BLOCK_N, num_stages=STAGES):
        slot = fast._int2_slots(i0, i_hi, 0, S, kv_indices + kv_start, BLOCK_N, True)
        kc, kpw, vct, vpw = fast._int2_fetch(slot, KCh, stride_kcn, KPh, stride_kpn, VCh, stride_vcn,
                                             VPh, stride_vpn, QD, QDV)
        acc_k += kc.to(tl.int32)
        acc_v += vct.to(tl.int32)
        acc_p ^= kpw ^ vpw
    total = tl.sum(tl.sum(acc_k, 1), 0) + tl.sum(tl.sum(acc_v, 1), 0) + tl.xor_sum(acc_p, 0)
    tl.store(Out + (b * tl.num_programs(1) + kvh) * tl.num_programs(2) + split, total)


def fetch_only_fn(case, int2_splits, stages=INT2_STAGES):
    out = torch.empty(case.B * kb.HKV * int2_splits, dtype=torch.int32, device=kb.DEV)
    kp, vp = as_param_words(case.k_params), as_param_words(case.v_params)
    state = [0]

    def run():
        c = state[0] = (state[0] + 1) % case.copies
        fetch_only_kernel[(case.B, kb.HKV, int2_splits)](
            case.k_codes, case.k_codes.stride(0), case.k_codes.stride(1), kp, kp.stride(0), kp.stride(1),
            case.v_codes, case.v_codes.stride(0), case.v_codes.stride(1), vp, vp.stride(0), vp.stride(1),
            case.indptr, case.indices[c], out, int2_splits,
            S=kb.SINK, W=kb.WINDOW, QD=kb.D // 4, QDV=kb.D // 4, BLOCK_N=fast.BLOCK_N, STAGES=stages,
            num_warps=fast.NUM_WARPS)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="markdown summary here")
    ap.add_argument("--json", help="raw numbers here")
    ap.add_argument("--shapes", default="8x32768,32x8192,64x32768")
    ap.add_argument("--l2-splits", default='{"8": [16, 22, 24, 48], "32": [4, 5, 6, 12], "64": [3, 6, 8]}',
                    help="JSON {batch: [INT2 split counts]} for the L2-resident sweep (default: %(default)s)")
    args = ap.parse_args()
    args.l2_splits = {int(k): v for k, v in json.loads(args.l2_splits).items()}
    dev = torch.cuda.get_device_name()
    copy_gbs = kb.copy_bandwidth()
    kb.log(f"device {dev}; copy bandwidth {copy_gbs:.0f} GB/s")
    rows, md = [], []
    for s in args.shapes.split(","):
        B, L = (int(v) for v in s.split("x"))
        case = kb.Int2Case(B, L)
        ms = fast.default_max_splits(B, kb.HKV, torch.device(kb.DEV))
        n_int2 = ms - dec.bf16_splits(kb.SINK, kb.WINDOW, ms)
        nbytes = case.bytes
        int2_only = kb.int2_bytes(B, L, kb.GROUP) - B * kb.HKV * (kb.SINK + kb.WINDOW) * 2 * kb.D * 2
        t_real = kb.bench_graph(case.fn(kind="fast"), case.copies)
        t_fetch = {st: kb.bench_graph(fetch_only_fn(case, n_int2, st), case.copies) for st in (2, INT2_STAGES, 8)}
        real_idx = case.indices
        case.indices = [(torch.arange(B * L, device=kb.DEV, dtype=torch.int32) % L2_SLOTS) + 1
                        for _ in range(case.copies)]
        t_l2 = kb.bench_graph(case.fn(kind="fast"), case.copies)
        # the SM side per INT2 split count (wave quantisation / balance with memory out of the way)
        l2_sweep = {}
        for n in args.l2_splits.get(B, ()):
            l2_sweep[n] = kb.bench_graph(case.fn(kind="fast", max_kv_splits=n + ms - n_int2), case.copies) * 1e3
        case.indices = real_idx
        del case
        torch.cuda.empty_cache()

        def pct(nb, t):
            return nb / t / 1e6 / copy_gbs

        row = dict(B=B, L=L, bytes=nbytes, int2_bytes=int2_only, max_kv_splits=ms, real_us=t_real * 1e3,
                   fetch_only_us={str(k): v * 1e3 for k, v in t_fetch.items()}, l2_pool_us=t_l2 * 1e3,
                   l2_pool_us_by_int2_splits={str(k): v for k, v in l2_sweep.items()})
        rows.append(row)
        kb.log(f"B={B} L={L} ({nbytes / 1e6:.1f} MB, {n_int2} INT2 splits): fast decode {t_real * 1e3:.1f} us "
               f"({pct(nbytes, t_real):.0%} of copy); fetch-only "
               + ", ".join(f"depth {st} {t * 1e3:.1f} us ({pct(int2_only, t):.0%} on its {int2_only / 1e6:.1f} MB)"
                           for st, t in t_fetch.items())
               + f"; L2-resident pool {t_l2 * 1e3:.1f} us ({t_real / t_l2:.2f}x faster than the real call)"
               + "".join(f"; L2-resident, {n} INT2 splits ({B * kb.HKV * (n + ms - n_int2)} programs) {t:.1f} us"
                         for n, t in l2_sweep.items()))
        md.append(f"| {B} | {L // 1024}K | {t_real * 1e3:.1f} ({pct(nbytes, t_real):.0%}) | "
                  + " | ".join(f"{t_fetch[st] * 1e3:.1f} ({pct(int2_only, t_fetch[st]):.0%})" for st in (2, INT2_STAGES, 8))
                  + f" | {t_l2 * 1e3:.1f} ({t_real / t_l2:.2f}x) |")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        f"{dev}, {date}; copy bandwidth {copy_gbs:.0f} GB/s (same run). us per call (% of copy bandwidth on "
        "the bytes read; the fetch-only kernel reads the INT2 bytes only).", "",
        "| B | L | fast decode | fetch-only, depth 2 | fetch-only, depth 5 | fetch-only, depth 8 | fast decode, L2-resident pool |",
        "|---:|---:|---:|---:|---:|---:|---:|", *md])
    kb.log("\n" + text)
    if args.out:
        open(args.out, "w").write(text + "\n")
    if args.json:
        json.dump(dict(device=dev, copy_gbs=copy_gbs, date=date, rows=rows), open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
