"""Where the per-channel decode's time goes, line by line: CUPTI PC sampling through Triton's proton.

For each KV format it builds bench/kernel_speed.py's synthetic pool at one shape (Llama-3.1-8B's
attention: Hq 32, Hkv 8, D 128; pages of the format's block, BF16 sink and ring), starts a proton
session (backend "cupti", mode "pcsampling") before the decode kernel is first loaded (PC sampling
maps PCs to source lines through the modules it sees loaded), runs the decode --calls times
outside CUDA graphs, then times it in a CUDA graph as bench/kernel_speed.py does (graph_us).

Rows (one per format): format, B, L, graph_us, calls_sampled, samples (of the decode kernel),
stall_reason_pct (each warp state's share of those samples: "selected" = the sampled warp was
issuing, "wait" = a fixed-latency dependency, "long_scoreboard" = memory, ...), no_reason_pct (the
samples CUPTI gave no state), kernels (every sampled kernel's time and samples: the split merge
when it is not fused) and top_lines (the --top source lines with most samples: path relative to
the project or to triton, the line's text, its share, and its states >= 3% of its samples).

    python -m bench.decode_profile                                      # GPU: the default format, 8 x 32K
    python -m bench.decode_profile --formats k3c64-v2t64-s4-w128,k4c64-v2t64-s4-w128 --json $OUT/p.json

First run 2026-11-29 on an H200 (CHANGELOG.md, "where the 3-bit body's time goes"): the body
issues and waits on its own ALU work, memory is 3.5% of the samples; the 3-bit planes' key operands
take 17.6% of them against 8.2% for 4-bit nibbles (that run was a probe whose calls this script
repeats; the probe took ~40 s on a started machine).
"""
from __future__ import annotations

import argparse
import collections
import json
import linecache
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench import _results
from oscar_sglang.runtime.kv_format import DEFAULT_KV_FORMAT  # noqa: E402 (the served default)

KERNEL = "channel_kernel"
LINE_REASON_MIN_PCT = 3.0


def _kernel_nodes(node, out):
    """Every node below `node` that is a kernel (has source-line children) -> out[name] list."""
    for child in node.get("children", []):
        kids = child.get("children", [])
        if kids and all("@" in k.get("frame", {}).get("name", "") for k in kids):
            out[child["frame"]["name"]].append(child)
        else:
            _kernel_nodes(child, out)
    return out


def _relative(path: str) -> str:
    """A sampled source path as the project or triton names it."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        parts = p.parts
        return "/".join(parts[parts.index("triton"):]) if "triton" in parts else path


def summarise(tree: list, kernel: str = KERNEL, top: int = 25) -> dict:
    """proton's hatchet document (a list: the call tree, then device info) -> one row's sample
    fields for `kernel` (its lines summed over every context it was sampled in)."""
    nodes = _kernel_nodes(tree[0], collections.defaultdict(list))
    if kernel not in nodes:
        raise ValueError(f"no samples of {kernel} in the profile (kernels sampled: {sorted(nodes)})")
    kernels = {}
    for name, found in nodes.items():
        kernels[name] = {"time_ns": sum(n.get("metrics", {}).get("time (ns)", 0) for n in found),
                         "samples": sum(k["metrics"].get("num_samples", 0) for n in found for k in n["children"])}
    lines = collections.defaultdict(collections.Counter)
    for n in nodes[kernel]:
        for k in n["children"]:
            lines[k["frame"]["name"].split("@")[0]].update(
                {m: v for m, v in k["metrics"].items() if isinstance(v, (int, float))})
    total = sum(c["num_samples"] for c in lines.values())
    if total == 0:
        raise ValueError(f"{kernel} was profiled but has no PC samples")
    reasons = collections.Counter()
    for c in lines.values():
        reasons.update({m[len("stalled_"):]: v for m, v in c.items() if m.startswith("stalled_")})
    stalled = sum(c["num_stalled_samples"] for c in lines.values())
    top_lines = []
    for loc, c in sorted(lines.items(), key=lambda kv: -kv[1]["num_samples"])[:top]:
        path, _, line = loc.rpartition(":")
        n = c["num_samples"]
        top_lines.append({
            "line": f"{_relative(path)}:{line}",
            "source": linecache.getline(path, int(line)).strip() if line.isdigit() else "",
            "pct_samples": round(100 * n / total, 2),
            "stall_pct": {r: round(100 * v / n, 1) for r, v in sorted(
                ((m[len("stalled_"):], v) for m, v in c.items() if m.startswith("stalled_")), key=lambda x: -x[1])
                if n and 100 * v / n >= LINE_REASON_MIN_PCT},
        })
    return {"samples": total,
            "stall_reason_pct": {r: round(100 * v / total, 1) for r, v in reasons.most_common() if v},
            "no_reason_pct": round(100 * (total - stalled) / total, 1),
            "kernels": kernels, "top_lines": top_lines}


def profile(fmt_name: str, B: int, L: int, calls: int, interval: int, top: int, keep: Path | None) -> dict:
    import torch
    import triton.profiler as proton

    from bench import kernel_speed as kb
    from bench._timing import bench_graph
    from oscar_kernels import KVFormat

    case = kb.ChannelCase(B, L, KVFormat.parse(fmt_name, head_dim=kb.D))
    run = case.fn()
    with tempfile.TemporaryDirectory() as tmp:
        name = str((keep or Path(tmp)) / fmt_name)
        proton.start(name, backend="cupti", mode=f"pcsampling:interval={interval}")
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
        proton.finalize()
        tree = json.loads(Path(name + ".hatchet").read_text())
    row = {"format": fmt_name, "B": B, "L": L,
           "graph_us": round(bench_graph(run, copies=case.copies) * 1e3, 2), "calls_sampled": calls}
    row.update(summarise(tree, top=top))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=DEFAULT_KV_FORMAT,
                    help="comma list of KV format names (default: the served default)")
    ap.add_argument("--shape", default="8x32768", help="B x L (requests x context)")
    ap.add_argument("--calls", type=int, default=205, help="decode calls sampled per format")
    ap.add_argument("--interval", type=int, default=1000, help="CUPTI sampling interval (proton's knob)")
    ap.add_argument("--top", type=int, default=25, help="source lines kept per format")
    ap.add_argument("--keep-hatchet", type=Path, default=None, help="keep proton's raw files in this folder")
    ap.add_argument("--json", type=Path, default=None, help="default: bench/results/decode_profile/<UTC date_time>.json")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("python -m bench.decode_profile needs a CUDA GPU (CUPTI PC sampling); nothing was run", file=sys.stderr)
        return 2
    B, L = (int(x) for x in args.shape.lower().split("x"))
    if args.keep_hatchet:
        args.keep_hatchet.mkdir(parents=True, exist_ok=True)
    rows = []
    for f in filter(None, args.formats.split(",")):
        rows.append(profile(f, B, L, args.calls, args.interval, args.top, args.keep_hatchet))
        r = rows[-1]
        print(f"{f} {B}x{L}: {r['graph_us']} us; " + ", ".join(
            f"{k} {v}%" for k, v in list(r["stall_reason_pct"].items())[:6]), flush=True)
        for t in r["top_lines"][:8]:
            print(f"  {t['pct_samples']:5.1f}%  {t['line']}  {t['source'][:80]}", flush=True)
    doc = _results.document(f"synthetic per-channel pool at Llama-3.1-8B's attention shapes "
                            f"(Hq 32, Hkv 8, D 128; bench/kernel_speed.py ChannelCase), {B} x {L}", rows,
                            interval=args.interval)
    print("wrote", _results.write(args.json or _results.default_path("decode_profile"), doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
