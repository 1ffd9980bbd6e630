"""bench/serving_vs_fp8.py's arithmetic and rendering: the summary (int2 against FP8's best
backend, the acceptance checks, pool leaks) and the markdown table / PNG plot made from the
results JSON. Pure functions of the rows; nothing here measures.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

INT2, INT2_MIXED = "int2", "int2-mixed-chunk"  # configuration names (bench/_serving_server.py)
# The int2 column is the default configuration's row: "int2", else the same server with the
# 3-bit decode named explicitly ("int2-planes" = the default since 2026-11-26, measured as such
# before it became the default); per_load's int2_config says which one a load used.
INT2_DEFAULT_CONFIGS = (INT2, "int2-planes")
BF16_BACKEND = "flashinfer"                    # the BF16 column: SGLang's strongest BF16 backend here
# the acceptance checks: int2 output tok/s over FP8's best backend's, per throughput load
TOK_S_TARGETS = {"256x2048+256": 1.05, "256x2048+1024": 1.3, "512x2048+1024": 1.5, "64x8192+512": 1.5}
# batch 1: int2 TPOT at most this times FP8's (best backend's) TPOT; TTFT likewise
TPOT_TARGETS = {"1x4096+256": 1.0, "1x32768+256": 1.0, "1x131072+256": 0.8}
TTFT_TARGETS = {"1x32768+256": 1.0}
FRESH_LOAD, FRESH_MAX = "1x32768+256", 1.1  # fresh_ttft_s <= 1.1 x warm_ttft_s on int2's row

_LOAD = re.compile(r"^(\d+)x(\d+)\+(\d+)$")


def parse_load(name: str) -> tuple:
    """'256x2048+256' -> (256, 2048, 256): N requests at once, IN prompt tokens, OUT output tokens."""
    m = _LOAD.match(name.strip())
    if not m:
        raise ValueError(f"load {name!r} must be NxIN+OUT, e.g. 256x2048+256")
    return tuple(int(g) for g in m.groups())


def load_name(n: int, inp: int, out: int) -> str:
    return f"{n}x{inp}+{out}"


def _measured(r: dict) -> bool:
    return r.get("kind") in ("throughput", "batch1") and bool(r.get("ok")) \
        and r.get("output_tok_s") is not None


def _ratio(a, b) -> Optional[float]:
    return a / b if a is not None and b else None


def _pick(rows: List[dict], key: str, best=max) -> Optional[dict]:
    vals = [r for r in rows if r.get(key) is not None]
    return best(vals, key=lambda r: r[key]) if vals else None


def summary(rows: List[dict]) -> dict:
    """Per load: int2's numbers over FP8's best backend's (and FP8 triton's, BF16 flashinfer's);
    the named acceptance checks (False where a number is missing, and named in `not_measured`);
    pool_leak_tokens overall (the largest of the rows'; None if no row measured it)."""
    good = [r for r in rows if _measured(r)]
    loads = sorted({r["load"] for r in good}, key=lambda s: parse_load(s))
    per_load: Dict[str, dict] = {}
    for load in loads:
        here = [r for r in good if r["load"] == load]
        int2 = next((r for c in INT2_DEFAULT_CONFIGS for r in here if r["config"] == c), None)
        mixed = next((r for r in here if r["config"] == INT2_MIXED), None)
        fp8 = [r for r in here if r["kv"] == "fp8_e4m3"]
        fp8_triton = next((r for r in fp8 if r["backend"] == "triton"), None)
        bf16 = next((r for r in here if r["kv"] == "bf16" and r["backend"] == BF16_BACKEND), None)
        best = _pick(fp8, "output_tok_s")
        e = {"int2_config": int2 and int2["config"],
             "int2_output_tok_s": int2 and int2["output_tok_s"],
             "fp8_best_backend": best and best["backend"],
             "fp8_best_output_tok_s": best and best["output_tok_s"],
             "bf16_flashinfer_output_tok_s": bf16 and bf16["output_tok_s"],
             "int2_vs_fp8_best": _ratio(int2 and int2["output_tok_s"], best and best["output_tok_s"]),
             "int2_vs_fp8_triton": _ratio(int2 and int2["output_tok_s"],
                                          fp8_triton and fp8_triton["output_tok_s"]),
             "int2_vs_bf16_flashinfer": _ratio(int2 and int2["output_tok_s"], bf16 and bf16["output_tok_s"]),
             "int2_mixed_chunk_vs_fp8_best": _ratio(mixed and mixed["output_tok_s"],
                                                    best and best["output_tok_s"])}
        if parse_load(load)[0] == 1:  # batch 1: latency, FP8's best = its lowest
            tp, tt = _pick(fp8, "tpot_p50_ms", min), _pick(fp8, "ttft_p50_s", min)
            e.update({"fp8_best_tpot_backend": tp and tp["backend"],
                      "int2_tpot_vs_fp8_best": _ratio(int2 and int2["tpot_p50_ms"], tp and tp["tpot_p50_ms"]),
                      "fp8_best_ttft_backend": tt and tt["backend"],
                      "int2_ttft_vs_fp8_best": _ratio(int2 and int2["ttft_p50_s"], tt and tt["ttft_p50_s"])})
            if int2 and int2.get("fresh_ttft_s") is not None:
                e["int2_fresh_over_warm_ttft"] = _ratio(int2["fresh_ttft_s"], int2.get("warm_ttft_s"))
        per_load[load] = e

    checks, missing = {}, []

    def check(name, value, limit, le=False):
        if value is None:
            checks[name] = False
            missing.append(name)
        else:
            checks[name] = value <= limit if le else value >= limit

    for load, t in TOK_S_TARGETS.items():
        check(f"output_tok_s_{load}_int2_ge_{t:g}x_fp8", per_load.get(load, {}).get("int2_vs_fp8_best"), t)
    for load, t in TPOT_TARGETS.items():
        check(f"tpot_{load}_int2_le_{t:g}x_fp8", per_load.get(load, {}).get("int2_tpot_vs_fp8_best"), t, le=True)
    for load, t in TTFT_TARGETS.items():
        check(f"ttft_{load}_int2_le_{t:g}x_fp8", per_load.get(load, {}).get("int2_ttft_vs_fp8_best"), t, le=True)
    check(f"fresh_ttft_{FRESH_LOAD}_int2_le_{FRESH_MAX:g}x_warm",
          per_load.get(FRESH_LOAD, {}).get("int2_fresh_over_warm_ttft"), FRESH_MAX, le=True)

    leaks = [r.get("pool_leak_tokens") for r in rows]
    known = [x for x in leaks if x is not None]
    side = [r for r in rows if r.get("side_free_leak")]
    overall = max(known) if known else None
    unmeasured = sum(x is None for x in leaks)
    aborts = [r for r in rows if r.get("kind") == "aborts"]
    checks["no_pool_leak"] = bool(known) and unmeasured == 0 and overall == 0 and not side \
        and bool(aborts)
    if not known or unmeasured or not aborts:
        missing.append("no_pool_leak")
    return {"per_load": per_load, "checks": checks, "not_measured": missing,
            "pool_leak_tokens": overall, "pool_leak_rows_unmeasured": unmeasured,
            "side_free_leak_rows": len(side), "aborts_rows": len(aborts),
            "all_checks_pass": bool(checks) and all(checks.values())}


# ------------------------------------------------------------------------------ rendering


def _compiles(entries) -> str:
    """A fresh row's fresh_compiles (the plugin's compiled_while_serving after the first request):
    '–' where the server does not report it (not int2, or rows measured before 2026-11-27)."""
    if entries is None:
        return "–"
    if not entries:
        return "none"
    return ", ".join(f"`{e['kernel'].rsplit('.', 1)[-1]}` ({e['ms']:.0f} ms)" for e in entries)


def _f(x, fmt="{:,.0f}", none="–"):
    return none if x is None else fmt.format(x)


def _row(rows, load, config=None, kv=None, backend=None):
    for r in rows:
        if r["load"] == load and _measured(r) and (config is None or r["config"] == config) \
                and (kv is None or r["kv"] == kv) and (backend is None or r["backend"] == backend):
            return r
    return None


def _configs(per_load: dict) -> str:
    names = sorted({e.get("int2_config") for e in per_load.values() if e.get("int2_config")})
    return ", ".join(f"`{n}`" for n in names) or "none measured"


def _stored_formats(rows: List[dict]) -> str:
    """The int2 formats the servers reported storing (rows since 2026-11-29 record them)."""
    seen = sorted({(r["kv_format"], r.get("body_bits_per_element")) for r in rows
                   if r.get("kv") == "int2" and r.get("kv_format")})
    return ", ".join(f"`{f}`" + (f" ({b:g} bits)" if b else "") for f, b in seen)


def markdown(doc: dict, source: str, image: Optional[str]) -> str:
    rows, s = doc["rows"], doc.get("summary") or summary(doc["rows"])
    pl = s["per_load"]
    stored = _stored_formats(rows)
    dates = sorted({r.get("date", doc["date"]) for r in rows})
    devices = sorted({str(r.get("device", doc["device"])) for r in rows})
    out = [f"Generated by `python -m bench.serving_vs_fp8 report` from [{Path(source).name}]({source}) "
           f"(model {doc['model']}; {', '.join(devices)}; rows measured {dates[0] if dates else '–'} to "
           f"{dates[-1] if dates else '–'}). Columns: int2 = `--kv-cache-dtype int2` on oscar_triton "
           f"(default format{', stored as ' + stored if stored else ''}; configuration {_configs(pl)}); FP8 best = the faster of `fp8_e4m3` on triton (64 KV splits) and on "
           f"flashinfer (backend named); BF16 = `{BF16_BACKEND}`. Ratios are int2 over the column.", "",
           "| load | int2 tok/s | int2 + mixed chunk | FP8 best tok/s (backend) | BF16 flashinfer tok/s "
           "| int2 / FP8 best | target | met | int2 / FP8 triton | int2 / BF16 |",
           "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for load, e in pl.items():
        if parse_load(load)[0] == 1:
            continue
        t = TOK_S_TARGETS.get(load)
        r = e["int2_vs_fp8_best"]
        mixed = _row(rows, load, config=INT2_MIXED)
        out.append(f"| {load} | {_f(e['int2_output_tok_s'])} | {_f(mixed and mixed['output_tok_s'])} | "
                   f"{_f(e['fp8_best_output_tok_s'])} ({e['fp8_best_backend'] or '–'}) | "
                   f"{_f(e['bf16_flashinfer_output_tok_s'])} | {_f(r, '{:.2f}x')} | "
                   f"{_f(t, '>= {:g}x')} | {'–' if t is None or r is None else ('yes' if r >= t else 'no')} | "
                   f"{_f(e['int2_vs_fp8_triton'], '{:.2f}x')} | {_f(e['int2_vs_bf16_flashinfer'], '{:.2f}x')} |")
    out += ["", "Batch 1 (TTFT / median TPOT; FP8 best = its lowest TPOT):", "",
            "| load | int2 | FP8 best (backend) | BF16 flashinfer | int2 / FP8 TPOT | target | met "
            "| int2 / FP8 TTFT |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    for load, e in pl.items():
        if parse_load(load)[0] != 1:
            continue
        i2 = _row(rows, load, config=e.get("int2_config") or INT2)
        fp = _row(rows, load, kv="fp8_e4m3", backend=e.get("fp8_best_tpot_backend"))
        bf = _row(rows, load, kv="bf16", backend=BF16_BACKEND)
        cell = (lambda r: "–" if r is None else f"{r['ttft_p50_s']:.2f} s / {_f(r['tpot_p50_ms'], '{:.2f}')} ms")
        t, r = TPOT_TARGETS.get(load), e.get("int2_tpot_vs_fp8_best")
        out.append(f"| {load} | {cell(i2)} | {cell(fp)} ({e.get('fp8_best_tpot_backend') or '–'}) | {cell(bf)} | "
                   f"{_f(r, '{:.2f}x')} | {_f(t, '<= {:g}x')} | "
                   f"{'–' if t is None or r is None else ('yes' if r <= t else 'no')} | "
                   f"{_f(e.get('int2_ttft_vs_fp8_best'), '{:.2f}x')} |")
    fresh = [r for r in rows if r.get("fresh_ttft_s") is not None and _measured(r)]
    if fresh:
        out += ["", "| configuration | fresh 32K TTFT (first request) | warm | Triton kernels it compiled |",
                "|---|---:|---:|---|"]
        out += [f"| {r['config']} | {r['fresh_ttft_s']:.2f} s | {_f(r.get('warm_ttft_s'), '{:.2f} s')} | "
                f"{_compiles(r.get('fresh_compiles'))} |" for r in fresh]
    cfgs = {}
    for r in rows:
        cfgs.setdefault(r["config"], r)
    out += ["", "| configuration | KV | backend | max running requests | KV tokens | largest pool leak (tokens) |",
            "|---|---|---|---:|---:|---:|"]
    for name, r in cfgs.items():
        leaks = [x.get("pool_leak_tokens") for x in rows if x["config"] == name]
        known = [x for x in leaks if x is not None]
        out.append(f"| {name} | {r['kv']} | {r['backend']} | {_f(r.get('max_running_requests'))} | "
                   f"{_f(r.get('kv_tokens'))} | {_f(max(known) if known else None, '{:d}')}"
                   f"{' (' + str(len(leaks) - len(known)) + ' rows unmeasured)' if len(known) < len(leaks) else ''} |")
    out += ["", "Checks: " + ", ".join(f"`{k}` {'yes' if v else 'no'}" for k, v in s["checks"].items())
            + (f". Not measured: {', '.join(s['not_measured'])}." if s["not_measured"] else ".")
            + f" Pool leak overall: {_f(s['pool_leak_tokens'], '{:d}')} tokens."]
    if image:
        out += ["", f"![output tok/s vs concurrency](img/{image})"]
    return "\n".join(out) + "\n"


def plot(doc: dict, path: Path) -> Optional[Path]:
    """Output tok/s against concurrency (N) for int2, FP8's best backend and BF16 flashinfer; one
    line per prompt/output shape (IN+OUT)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    pl = (doc.get("summary") or summary(doc["rows"]))["per_load"]
    series = {"int2 (oscar_triton)": "int2_output_tok_s", "FP8 e4m3 (best backend)": "fp8_best_output_tok_s",
              f"BF16 ({BF16_BACKEND})": "bf16_flashinfer_output_tok_s"}
    shapes = sorted({parse_load(ld)[1:] for ld in pl})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = "osD^v<>"
    for (label, key), color in zip(series.items(), ("C0", "C1", "C2")):
        for shape, mk in zip(shapes, markers * 4):
            pts = sorted((parse_load(ld)[0], e[key]) for ld, e in pl.items()
                         if parse_load(ld)[1:] == shape and e.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=mk, color=color,
                        label=f"{label}, {shape[0]}+{shape[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests sent at once (N)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{doc['model']}, {doc['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


BEGIN, END = "<!-- serving_vs_fp8:begin -->", "<!-- serving_vs_fp8:end -->"


def update_doc(doc_path: Path, body: str) -> None:
    """Replace the block between BEGIN and END in doc_path (the placeholder section holds them)."""
    text = doc_path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc_path} has no {BEGIN} ... {END} block to replace")
    a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc_path.write_text(text[:a] + "\n" + body + text[b:])
