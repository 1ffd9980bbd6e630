"""Render bench/serving.py results (results.json) as markdown tables and PNG plots.

One responsibility: presentation. Tables are written between the markers
`<!-- serving:auto:start -->` and `<!-- serving:auto:end -->` of the document given with
--update-doc, so hand-written analysis around them survives a re-render.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

START, END = "<!-- serving:auto:start -->", "<!-- serving:auto:end -->"
SECTION = "## Serving"


PARTS = ("capacity", "latency", "attribution", "throughput", "one_batch")

# Until commit b0524ab (2026-11-22 08:04 UTC) the plugin left SGLang's default cap of 8 KV splits
# in place for int2; since then it raises it to 64. Results from before then did not record the
# cap, so their "int2" entries are shown as "int2-splits8" (the configuration they measured).
INT2_SPLITS64_SINCE = "2026-11-22 08:04"

# Which BF16 configuration each configuration is compared with (same KV-split cap).
BASELINE = {"int2": "bf16-splits64", "int2-splits64": "bf16-splits64", "int2-splits8": "bf16",
            "bf16-splits64": "bf16", "flashinfer": "bf16"}


def _config_label(config: str, run: dict, date_utc: str) -> str:
    splits = (run.get("server_info_subset") or {}).get("triton_attention_num_kv_splits")
    if config == "int2" and (splits == 8 or (splits is None and date_utc < INT2_SPLITS64_SINCE)):
        return "int2-splits8"
    return config


def _timelines(path: Path) -> dict:
    """Per-request token timestamps saved beside a results file: `<stem>.timelines.json.gz`
    ({"model/config": {load: [...]}}) or, in a run's output folder, `<model>_<config>_timelines.json`."""
    import gzip

    out = {}
    gz = path.parent / f"{path.stem}.timelines.json.gz"
    if gz.exists():
        with gzip.open(gz, "rt") as f:
            out.update(json.load(f))
    for f in path.parent.glob("*_timelines.json"):
        model, _, config = f.name[: -len("_timelines.json")].partition("_")
        out[f"{model}/{config}"] = json.loads(f.read_text())
    return out


def _load(paths: List[Path]) -> dict:
    """Merge result files part by part: a later file's (model, config, part) replaces an earlier
    one, so a run that measured only throughput keeps the latency of an earlier run. Each part
    remembers the run (UTC) it came from."""
    merged = {"metas": [], "runs": {}, "timelines": {}}
    for p in paths:
        d = json.loads(Path(p).read_text())
        date = d["meta"]["date_utc"]
        merged["metas"].append(d["meta"])
        tls = _timelines(Path(p))
        # files before 2026-11-25 keep {"model/config": run} under "runs"; later ones list "rows"
        runs = d["runs"] if "runs" in d else {f"{r['model']}/{r['config']}": r for r in d["rows"]}
        for key, run in runs.items():
            model, config = run["model"], run["config"]
            label = _config_label(config, run, date)
            dst = merged["runs"].setdefault(f"{model}/{label}", {"model": model, "config": label,
                                                                 "_dates": {}})
            for k, v in run.items():
                if k in ("model", "config"):
                    continue
                if k == "throughput":  # merged load by load: each load keeps its latest run
                    dst.setdefault(k, {}).update(v)
                    for load in v:
                        dst["_dates"][f"throughput:{load}"] = date
                else:
                    dst[k] = v
                if k in PARTS:
                    dst["_dates"][k] = date
            for load, tl in tls.get(key, {}).items():
                merged["timelines"][(model, label, load)] = tl
    return merged


def _baseline(runs: dict, model: str, cfg: str) -> Optional[str]:
    base = BASELINE.get(cfg)
    if base and f"{model}/{base}" not in runs and base != "bf16":
        base = "bf16"
    return base if base and f"{model}/{base}" in runs else None


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def _order(runs: dict) -> List[tuple]:
    pref = {"bf16": 0, "int2-splits8": 1, "bf16-splits64": 2, "int2": 3, "int2-splits64": 4,
            "flashinfer": 5}
    keys = sorted(runs, key=lambda k: (k.split("/")[0], pref.get(k.split("/")[1], 9)))
    return [(k.split("/")[0], k.split("/")[1], runs[k]) for k in keys]


def capacity_table(runs: dict) -> str:
    rows = ["| model | config | KV tokens | vs BF16 | 32K+256 requests that fit | "
            "max running requests | measured max concurrent (load) | server start (s) |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model, cfg, r in _order(runs):
        c = r.get("capacity")
        if not c:
            continue
        base = next((runs[f"{model}/{b}"]["capacity"]["max_total_num_tokens"]
                     for b in ("bf16", "bf16-splits64")
                     if runs.get(f"{model}/{b}", {}).get("capacity")), None)
        ratio = c["max_total_num_tokens"] / base if base else None
        conc = [t.get("max_concurrent_decoding") for k, t in r.get("throughput", {}).items()
                if k.split("x")[1] == "32768"]
        mrr = (r.get("oscar_int2") or {}).get("max_running_requests") or c.get(
            "max_running_requests")
        rows.append(f"| {model} | {cfg} | {c['max_total_num_tokens']:,} | {_f(ratio, '{:.2f}x')} "
                    f"| {c['fit_32k_requests']} | {_f(mrr, '{}', 'default')} "
                    f"| {_f(conc[0] if conc else None, '{}')} "
                    f"| {_f(c.get('startup_s'), '{:.0f}')} |")
    return "\n".join(rows)


def latency_table(runs: dict) -> str:
    rows = ["| model | config | run (UTC) | context | TTFT (s) | TPOT median (ms) | TPOT p90 (ms) | "
            "TPOT vs baseline | CUDA graph |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for model, cfg, r in _order(runs):
        base_name = _baseline(runs, model, cfg)
        when = r.get("_dates", {}).get("latency", "")[-5:]
        for ctx, v in sorted(r.get("latency", {}).items(), key=lambda kv: int(kv[0])):
            if "error" in v:
                rows.append(f"| {model} | {cfg} | {when} | {ctx} | failed: {v['error'][:60]} |||||")
                continue
            base = runs.get(f"{model}/{base_name}", {}).get("latency", {}).get(ctx, {})
            sp = (base.get("tpot_ms_median") / v["tpot_ms_median"]
                  if base.get("tpot_ms_median") and v.get("tpot_ms_median") else None)
            vs = f"{sp:.2f}x ({base_name})" if sp and base_name else "–"
            rows.append(f"| {model} | {cfg} | {when} | {int(ctx) // 1024}K | {_f(v['ttft_s'])} | "
                        f"{_f(v['tpot_ms_median'])} | {_f(v['tpot_ms_p90'])} | "
                        f"{vs} | {v.get('cuda_graph')} |")
    return "\n".join(rows)


def throughput_table(runs: dict) -> str:
    rows = ["| model | load (N x prompt x output) | config | run (UTC) | ok | duration (s) | "
            "decoding / prefill+other (s) | output tok/s | decode tok/s at full occupancy "
            "(requests) | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | max concurrent |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---|---|---:|"]
    items = [(model, load, cfg, r, s) for model, cfg, r in _order(runs)
             for load, s in r.get("throughput", {}).items()]
    # longest prompts first, then by N; configurations keep their order (stable sort)
    for model, load, cfg, r, s in sorted(items, key=lambda it: (
            it[0], -int(it[1].split("x")[1]), int(it[1].split("x")[0]))):
        when = r.get("_dates", {}).get(f"throughput:{load}", "")[-5:]
        if not s.get("ok"):
            rows.append(f"| {model} | {load} | {cfg} | {when} | 0/{s.get('n')} | failed: "
                        f"{str(s.get('errors'))[:80]} |||||||")
            continue
        fo = s.get("full_occupancy_decode") or {}
        ps = s.get("phase_split") or {}
        split = (f"{ps['decode_s']:.1f} / {ps['other_s']:.1f}" if ps else "–")
        t, p = s["ttft_s"], s["tpot_ms"]
        rows.append(
            f"| {model} | {load} | {cfg} | {when} | {s['ok']}/{s['n']} | {s['duration_s']:.0f} | "
            f"{split} | {s['output_tok_s']:.0f} | {_f(fo.get('tok_s'), '{:.0f}')} "
            f"({fo.get('requests')}) | "
            f"{_f(t['p50'], '{:.1f}')} / {_f(t['p90'], '{:.1f}')} / {_f(t['p99'], '{:.1f}')} | "
            f"{_f(p['p50'], '{:.0f}')} / {_f(p['p90'], '{:.0f}')} / {_f(p['p99'], '{:.0f}')} | "
            f"{s['max_concurrent_decoding']} |")
    return "\n".join(rows)


def _recategorize(a: dict) -> dict:
    """Apply the current kernel-name rules to results analysed with older ones (top kernels)."""
    from bench._serving_trace import categorize

    cats = dict(a["category_ms"])
    for k in a.get("top_kernels", []):
        new = categorize(k["name"])
        if new != k["category"]:
            cats[k["category"]] = cats.get(k["category"], 0.0) - k["ms_per_step"]
            cats[new] = cats.get(new, 0.0) + k["ms_per_step"]
            k["category"] = new
    a["category_ms"] = cats
    return a


def _attr_rows(model, cfg, where, ctx, a) -> Optional[str]:
    if not a or "error" in a:
        return None
    a = _recategorize(a)
    c = a["category_ms"]
    rest = sum(v for k, v in c.items() if k != "attention")
    return (f"| {model} | {cfg} | {where} | {ctx} | {a['step_period_ms']:.2f} | "
            f"{c.get('attention', 0):.2f} | {c.get('gemm', 0):.2f} | {rest - c.get('gemm', 0):.2f} | "
            f"{a['gpu_idle_ms']:.2f} | {a['graph_launches_per_step']:.0f} |")


def attribution_table(runs: dict) -> str:
    rows = ["| model | config | where | context | step (ms) | attention (ms) | GEMM (ms) | "
            "other kernels (ms) | GPU idle (ms) | graph launches/step |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, cfg, r in _order(runs):
        for ctx, a in sorted(r.get("attribution", {}).items(), key=lambda kv: int(kv[0])):
            row = _attr_rows(model, cfg, "server", f"{int(ctx) // 1024}K", a)
            if row:
                rows.append(row)
        ob = r.get("one_batch") or {}
        for run, a in zip(ob.get("runs", []), ob.get("attribution", [])):
            row = _attr_rows(model, cfg, "bench_one_batch", f"{run['input_len'] // 1024}K", a)
            if row:
                rows.append(row)
    return "\n".join(rows)


def top_kernels(runs: dict, limit: int = 6) -> str:
    out = []
    for model, cfg, r in _order(runs):
        for ctx, a in sorted(r.get("attribution", {}).items(), key=lambda kv: int(kv[0])):
            if not a or "error" in a:
                continue
            ks = "; ".join(f"`{k['name'][:60]}` {k['ms_per_step']:.2f} ms" for k in
                           a["top_kernels"][:limit])
            out.append(f"- {model} / {cfg} / {int(ctx) // 1024}K: {ks}")
    return "\n".join(out)


def targets(runs: dict) -> str:
    """The issue's acceptance targets, for each INT2 configuration against its BF16 baseline
    (same KV-split cap). Where the two sides come from different runs, both run times are shown."""
    rows = ["| target | int2 config vs baseline | measured | met |", "|---|---|---|---|"]
    for model in sorted({k.split("/")[0] for k in runs}):
        done_capacity = False
        for int2_name in ("int2-splits8", "int2", "int2-splits64"):
            i = runs.get(f"{model}/{int2_name}")
            base_name = _baseline(runs, model, int2_name) if i else None
            if not base_name:
                continue
            b = runs[f"{model}/{base_name}"]
            pair = f"{int2_name} vs {base_name}"

            def when(part):
                db, di = b.get("_dates", {}).get(part), i.get("_dates", {}).get(part)
                return "" if db == di else f" (runs {di[-5:]} / {db[-5:]} UTC)"

            if not done_capacity and b.get("capacity") and i.get("capacity"):
                done_capacity = True
                ratio = i["capacity"]["max_total_num_tokens"] / b["capacity"]["max_total_num_tokens"]
                rows.append(f"| {model}: int2 >= 6.5x KV tokens | {pair} | {ratio:.2f}x | "
                            f"{'yes' if ratio >= 6.5 else 'no'} |")
            for load in sorted(set(b.get("throughput", {})) & set(i.get("throughput", {})),
                               key=lambda k: [int(x) for x in k.split("x")]):
                bs, is_ = b["throughput"][load], i["throughput"][load]
                if bs.get("ok") and is_.get("ok"):
                    r1 = is_["output_tok_s"] / bs["output_tok_s"]
                    rows.append(f"| {model} {load}: int2 >= 3x output tok/s (end to end) | {pair} | "
                                f"{r1:.2f}x{when('throughput:' + load)} | {'yes' if r1 >= 3 else 'no'} |")
                    fb = bs.get("full_occupancy_decode") or {}
                    fi = is_.get("full_occupancy_decode") or {}
                    if fb.get("tok_s") and fi.get("tok_s"):
                        r2 = fi["tok_s"] / fb["tok_s"]
                        rows.append(f"| {model} {load}: decode tok/s at full occupancy "
                                    f"(informational, same 3x bar) | {pair} | {r2:.2f}x "
                                    f"({fi['requests']} vs {fb['requests']} requests decoding) | "
                                    f"{'yes' if r2 >= 3 else 'no'} |")
            for ctx, rule in (("32768", "no worse"), ("131072", "better")):
                lb = b.get("latency", {}).get(ctx, {}).get("tpot_ms_median")
                li = i.get("latency", {}).get(ctx, {}).get("tpot_ms_median")
                if lb and li:
                    ok = li <= lb * 1.02 if rule == "no worse" else li < lb
                    rows.append(f"| {model}: batch-1 TPOT at {int(ctx) // 1024}K {rule} | {pair} | "
                                f"{li:.2f} ms vs {lb:.2f} ms{when('latency')} | "
                                f"{'yes' if ok else 'no'} |")
    return "\n".join(rows) if len(rows) > 2 else "(needs bf16 and int2 in the same results)"


def plots(runs: dict, img_dir: Path, timelines: Optional[dict] = None) -> List[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots")
        return []
    img_dir.mkdir(parents=True, exist_ok=True)
    made = []
    # 1. batch-1 TPOT vs context (only when some run measured it: never overwrite with an empty plot)
    curves = []
    for model, cfg, r in _order(runs):
        pts = sorted((int(c), v["tpot_ms_median"]) for c, v in r.get("latency", {}).items()
                     if v.get("tpot_ms_median"))
        if pts:
            curves.append((f"{model} {cfg}", pts))
    fig, ax = plt.subplots(figsize=(6.4, 4)) if curves else (None, None)
    for label, pts in curves:
        ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o", label=label)
    if curves:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("batch-1 TPOT (ms)")
        ax.set_title("Decode latency at batch 1 (lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img_dir / "serving_latency.png", dpi=120)
        plt.close(fig)
        made.append("serving_latency.png")
    # 2. decode step attribution (stacked)
    bars = []
    for model, cfg, r in _order(runs):
        for ctx, a in sorted(r.get("attribution", {}).items(), key=lambda kv: int(kv[0])):
            if a and "error" not in a:
                c = _recategorize(a)["category_ms"]
                att, gemm = c.get("attention", 0), c.get("gemm", 0)
                other = sum(c.values()) - att - gemm
                bars.append((f"{model}\n{cfg} {int(ctx) // 1024}K", att, gemm, other,
                             max(a["gpu_idle_ms"], 0)))
    if bars:
        fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(bars)), 4))
        x = range(len(bars))
        bottom = [0.0] * len(bars)
        for j, (name, color) in enumerate((("attention", "tab:red"), ("GEMM", "tab:blue"),
                                           ("other kernels", "tab:gray"),
                                           ("GPU idle", "tab:olive")), start=1):
            vals = [b[j] for b in bars]
            ax.bar(x, vals, bottom=bottom, label=name, color=color)
            bottom = [u + v for u, v in zip(bottom, vals)]
        ax.set_xticks(list(x), [b[0] for b in bars], fontsize=7)
        ax.set_ylabel("ms per decode step (batch 1)")
        ax.set_title("Where a batch-1 decode step goes (server, torch.profiler)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(img_dir / "serving_attribution.png", dpi=120)
        plt.close(fig)
        made.append("serving_attribution.png")
    # 3. capacity
    caps = [(f"{m}\n{c}", r["capacity"]["max_total_num_tokens"]) for m, c, r in _order(runs)
            if r.get("capacity")]
    if caps:
        fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(caps)), 4))
        ax.bar(range(len(caps)), [c[1] / 1e3 for c in caps], color="tab:green")
        ax.set_xticks(range(len(caps)), [c[0] for c in caps], fontsize=7)
        ax.set_ylabel("KV cache capacity (K tokens)")
        ax.set_title("KV tokens at the same --mem-fraction-static")
        fig.tight_layout()
        fig.savefig(img_dir / "serving_capacity.png", dpi=120)
        plt.close(fig)
        made.append("serving_capacity.png")
    if timelines:
        made.append(throughput_timeline_plot(timelines, img_dir, plt))
    return made


def throughput_timeline_plot(timelines: dict, img_dir: Path, plt) -> str:
    """Per load: output tokens so far, and requests between first token and finish (holding KV,
    decoding whenever no prefill runs), against time; flat stretches of the token curve are
    prefill, which SGLang runs before decode steps."""
    import numpy as np

    loads = sorted({k[2] for k in timelines}, key=lambda k: [-int(x) for x in k.split("x")[1:2]])
    fig, axes = plt.subplots(2, len(loads), figsize=(5.2 * len(loads), 6), squeeze=False,
                             sharex="col")
    for col, load in enumerate(loads):
        top, bottom = axes[0][col], axes[1][col]
        for (model, cfg, ld), reqs in sorted(timelines.items()):
            if ld != load:
                continue
            ts = np.sort([t for r in reqs for t, _ in _token_times(r)])
            line, = top.plot(ts, np.arange(1, len(ts) + 1), label=f"{model} {cfg}")
            grid = np.linspace(0, ts[-1], 600)
            live = [sum(1 for r in reqs if r["first_token"] is not None
                        and r["first_token"] <= t < r["finished"]) for t in grid]
            bottom.step(grid, live, where="post", color=line.get_color())
        top.set_title(f"load {load} (all sent at t=0)", fontsize=10)
        top.set_ylabel("output tokens so far")
        bottom.set_ylabel("requests admitted, first token out")
        bottom.set_xlabel("time (s)")
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
        top.legend(fontsize=8)
    fig.tight_layout()
    name = "serving_throughput.png"
    fig.savefig(img_dir / name, dpi=120)
    plt.close(fig)
    return name


def _token_times(req: dict):
    """(time, 1) per output token of one request's timeline, spreading multi-token chunks."""
    prev = 0
    for t, n in req["chunks"]:
        for _ in range(n - prev):
            yield t, 1
        prev = n


def markdown(merged: dict, images: List[str]) -> str:
    runs = merged["runs"]
    lines = []
    for m in merged["metas"]:
        lines.append(f"- Run {m['date_utc']} UTC on {m['gpu']}, `--mem-fraction-static "
                     f"{m['mem_fraction_static']}`: `python {' '.join(m['argv'])}`")
    lines += ["", "**Capacity**", "", capacity_table(runs), "",
              "**Batch-1 decode latency** (one request, streamed; TPOT = median gap between tokens "
              "after the 5th)", "", latency_table(runs), "",
              "**Throughput under a memory-saturating load** (all requests sent at t=0)", "",
              throughput_table(runs), "",
              "**Decode-step attribution at batch 1** (torch.profiler; kernels grouped by name; "
              "GPU idle = step period minus kernel time)", "", attribution_table(runs), "",
              "Top kernels per step:", "", top_kernels(runs), "",
              "**Targets**", "", targets(runs), ""]
    for img in images:
        lines.append(f"![{img}](img/{img})")
    return "\n".join(lines) + "\n"


def update_doc(doc: Path, body: str) -> None:
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{START}\n{body}{END}"
    if START in text and END in text:
        a, b = text.index(START), text.index(END) + len(END)
        text = text[:a] + block + text[b:]
    elif SECTION in text:
        a = text.index(SECTION)
        nxt = text.find("\n## ", a + len(SECTION))
        insert_at = len(text) if nxt < 0 else nxt + 1
        text = text[:insert_at].rstrip("\n") + "\n\n" + block + "\n" + (
            "\n" + text[insert_at:] if nxt >= 0 else "")
    else:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{block}\n"
    doc.write_text(text)


def render(paths: List[Path], img_dir: Path, doc: Optional[str]) -> int:
    merged = _load(paths)
    images = plots(merged["runs"], img_dir, merged["timelines"])
    body = markdown(merged, images)
    print(body)
    if doc:
        update_doc(Path(doc), body)
        print(f"updated {doc}")
    return 0
