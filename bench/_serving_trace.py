"""Attribute a decode step's time from a torch.profiler chrome trace (SGLang /start_profile or
`sglang.bench_one_batch --profile`).

SGLang wraps every forward in a CPU span named `step[DECODE bs=N]` (model_runner.py). For each
decode span we take the GPU kernels launched from its start up to the next span (so sampling and
bookkeeping kernels launched after the forward count too), sum their durations per category, and
compare with the step period (start to start): the remainder is time the GPU sat idle waiting for
the CPU (scheduler, Python, launches, synchronisations).
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import numpy as np

# First match wins; kernel names from SGLang's triton backend, cuBLAS/nvjet, flashinfer, torch.
CATEGORIES = [
    # before "attention": flashinfer's RMSNorm kernels would otherwise match "flash"
    ("norm_rope_act", re.compile(r"norm|rope|rotary|silu|act_and_mul|gelu|swiglu", re.I)),
    # SGLang triton decode/extend kernels, flashinfer, and oscar_kernels' attend/merge kernels
    ("attention", re.compile(r"_fwd_|stage[12]|attn|attention|attend|merge_splits|flash", re.I)),
    # KV-cache writes: SGLang's set_kv_buffer copies and store_kvcache, its FP8 casts, oscar_kernels'
    # quantise-and-store kernels (per-token _store_kernel; per-channel _tokens_kernel, _key_blocks_kernel)
    ("kv_write", re.compile(r"set_kv|store_kv|_store_kernel|kv_buffer|store_cache|quantiz|_tokens_kernel|"
                            r"_key_blocks_kernel|float8_copy", re.I)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|splitk|sm90_|sm80_", re.I)),
    ("sampling", re.compile(r"sort|softmax|multinomial|argmax|argmin|topk|cumsum|exponential|"
                            r"distribution|philox|random|max_|reduce", re.I)),
]


def categorize(name: str) -> str:
    for cat, rx in CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


def load_trace(path: Path) -> List[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def analyze(path: Path, stage: str = "DECODE") -> Dict:
    events = load_trace(path)
    steps = sorted((e for e in events if e.get("ph") == "X"
                    and str(e.get("name", "")).startswith(f"step[{stage}")
                    and e.get("cat") in ("user_annotation", "cpu_op", "python_function")),
                   key=lambda e: e["ts"])
    if len(steps) < 2:
        return {"trace": str(path), "error": f"fewer than 2 step[{stage}] spans in trace"}
    launch_ts = {}  # correlation id -> CPU timestamp of the launch call
    graph_launches = []
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("ph") == "X":
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launch_ts[corr] = e["ts"]
            if "GraphLaunch" in e.get("name", ""):
                graph_launches.append(e["ts"])
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    starts = [s["ts"] for s in steps]

    per_step = []
    by_name = defaultdict(float)
    durs = defaultdict(list)  # kernel name -> each launch's duration (us), for per_kernel
    for i in range(len(steps) - 1):
        per_step.append({"period_us": starts[i + 1] - starts[i],
                         "cpu_forward_us": steps[i]["dur"], "cats": defaultdict(float),
                         "n_kernels": 0, "graph_launches": 0})
    for k in kernels:
        corr = k.get("args", {}).get("correlation")
        t = launch_ts.get(corr, k["ts"])
        i = bisect.bisect_right(starts, t) - 1
        if 0 <= i < len(per_step):
            per_step[i]["cats"][categorize(k["name"])] += k["dur"]
            per_step[i]["n_kernels"] += 1
            by_name[k["name"]] += k["dur"]
            durs[k["name"]].append(k["dur"])
    for t in graph_launches:
        i = bisect.bisect_right(starts, t) - 1
        if 0 <= i < len(per_step):
            per_step[i]["graph_launches"] += 1

    n = len(per_step)
    cats = sorted({c for s in per_step for c in s["cats"]})
    mean_cat_ms = {c: float(np.mean([s["cats"].get(c, 0.0) for s in per_step])) / 1e3
                   for c in cats}
    period_ms = float(np.median([s["period_us"] for s in per_step])) / 1e3
    gpu_ms = float(np.median([sum(s["cats"].values()) for s in per_step])) / 1e3
    total_k = sum(by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {
        "trace": str(path),
        "steps": n,
        "step_period_ms": period_ms,
        "gpu_kernel_ms": gpu_ms,
        "gpu_idle_ms": period_ms - gpu_ms,
        "cpu_forward_span_ms": float(np.median([s["cpu_forward_us"] for s in per_step])) / 1e3,
        "kernels_per_step": float(np.median([s["n_kernels"] for s in per_step])),
        "graph_launches_per_step": float(np.median([s["graph_launches"] for s in per_step])),
        "category_ms": mean_cat_ms,
        "top_kernels": [{"name": k[:120], "ms_per_step": v / n / 1e3,
                         "share": v / total_k if total_k else 0.0,
                         "category": categorize(k)} for k, v in top],
        # each of the 25 costliest kernels: launches a step and the spread of one launch's time
        # (a layer's kernel at batch 1: its per-layer cost, where ms_per_step sums the layers)
        "per_kernel": [{"name": k[:120], "launches_per_step": len(durs[k]) / n,
                        "p10_us": float(np.percentile(durs[k], 10)), "p50_us": float(np.median(durs[k])),
                        "p90_us": float(np.percentile(durs[k], 90)), "category": categorize(k)}
                       for k, _ in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]],
    }


def find_traces(folder: Path) -> List[Path]:
    return sorted(Path(folder).rglob("*.trace.json*"), key=lambda p: p.stat().st_mtime)


def format_attribution(a: Dict) -> str:
    if "error" in a:
        return f"  trace {a['trace']}: {a['error']}"
    lines = [f"  step period {a['step_period_ms']:.2f} ms = GPU kernels {a['gpu_kernel_ms']:.2f} ms"
             f" + GPU idle {a['gpu_idle_ms']:.2f} ms  ({a['steps']} steps, "
             f"{a['kernels_per_step']:.0f} kernels/step, {a['graph_launches_per_step']:.0f} "
             f"graph launches/step, CPU forward span {a['cpu_forward_span_ms']:.2f} ms)"]
    lines.append("  by category (ms/step): " + ", ".join(
        f"{c} {v:.2f}" for c, v in sorted(a["category_ms"].items(), key=lambda kv: -kv[1])))
    for k in a["top_kernels"][:8]:
        lines.append(f"    {k['ms_per_step']:7.3f} ms  {k['share'] * 100:5.1f}%  "
                     f"[{k['category']}] {k['name']}")
    return "\n".join(lines)
