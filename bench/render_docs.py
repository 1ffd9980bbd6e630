"""Rewrite the generated tables in README.md and docs/*.md from the JSON files under bench/results/.

A generated region is the text between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->`;
everything else in the file is left as written. Each table's caption names its JSON file, the
date, the device and the command that made it, all read from the file.

    python bench/render_docs.py            # rewrite every region
    python bench/render_docs.py --check    # exit 1 if any region differs from what it would write

Standard library only (it runs where nothing else is installed).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SERVING = "bench/results/serving_vs_fp8_h200_2026-11-29.json"
NIAH_H200 = "bench/results/niah_server_h200.json"
NIAH_H100 = "bench/results/niah_server_h100.json"
KERNELS = "bench/results/kernels/2026-11-29_1712_issue18-default-vs-previous_h200.json"
SPEC_DECODE = "bench/results/spec_decode_h200.json"  # python -m bench.spec_decode; may not exist yet
PATH_INVARIANCE = "bench/results/path_invariance_h200.json"  # python -m bench.path_invariance; may not exist yet
NIAH_PREFILL = "bench/results/niah_prefill_reads_h200.json"  # python -m bench.niah_server, both OSCAR_PREFILL_READS
HICACHE = "bench/results/hicache_h200.json"  # python -m bench.hicache
PD = "bench/results/pd_h200.json"  # python -m bench.pd
PD_X2 = "bench/results/pd_h200x2.json"  # python -m bench.pd --gpus 0,1; may not exist yet

LOADS = (  # (row label, load key): the four throughput loads, N requests x (prompt + output tokens)
    ("output tok/s, 256 requests x (2K in + 256 out)", "256x2048+256"),
    ("256 x (2K + 1K)", "256x2048+1024"),
    ("512 x (2K + 1K)", "512x2048+1024"),
    ("64 x (8K + 512)", "64x8192+512"),
)
BATCH1 = ("1x4096+256", "1x32768+256", "1x131072+256")
README_COLUMNS = ("int2", "fp8-flashinfer", "flashinfer")  # int2, FP8 KV, BF16
FULL_COLUMNS = (  # (header, config) of docs/performance.md's serving table
    ("int2", "int2"), ("int2 + `--enable-mixed-chunk`", "int2-mixed-chunk"),
    ("FP8 on FlashInfer", "fp8-flashinfer"), ("FP8 on Triton (64 splits)", "fp8-splits64"),
    ("BF16 on FlashInfer", "flashinfer"))


def load(rel: str) -> dict:
    return json.loads((ROOT / rel).read_text())


def link(rel: str, doc: Path) -> str:
    """A markdown link to `rel` (a path from the root) written from inside `doc`."""
    depth = len(doc.relative_to(ROOT).parts) - 1
    return f"[{Path(rel).name}]({'../' * depth}{rel})"


def day(date: str) -> str:
    return date[:10]


def top_commands(doc: dict) -> list[str]:
    """The commands a person ran: a multi-call file's top-level calls (they start the per-GPU
    children, which carry --loads), else the file's own command."""
    calls = [c["command"] for c in doc.get("calls", []) if "--loads" not in c["command"]]
    return calls or [doc["command"]]


def commands_block(doc: dict) -> list[str]:
    return ["", "```", *top_commands(doc), "```"]


def serving_rows() -> dict[tuple[str, str], dict]:
    return {(r["config"], r["load"]): r for r in load(SERVING)["rows"]}


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def _speed_rows(rows: dict, columns: tuple[str, ...], ratio_to: tuple[str, str] | None) -> list[str]:
    """Table body rows shared by the README table and the full one: KV tokens, the four loads,
    batch-1 time per output token, time to first token (warm, then a fresh server's first)."""
    out = []

    def line(label: str, cells: list[str], r: str) -> None:
        out.append(f"| {label} | " + " | ".join(cells) + (f" | {r} |" if ratio_to else " |"))

    def rat(values: dict[str, float]) -> str:
        return ratio(values[ratio_to[0]], values[ratio_to[1]]) if ratio_to else ""

    kv = {c: rows[c, "1x4096+256"]["kv_tokens"] for c in columns}
    line("KV tokens in the pool", [f"{kv[c]:,}" for c in columns], rat(kv))
    for label, ld in LOADS:
        tok = {c: rows[c, ld]["output_tok_s"] for c in columns}
        line(label, [f"{tok[c]:,.0f}" for c in columns], rat(tok))
    tpot = {c: [rows[c, ld]["tpot_p50_ms"] for ld in BATCH1] for c in columns}
    r = (" / ".join(f"{a / b:.2f}x" for a, b in zip(tpot[ratio_to[0]], tpot[ratio_to[1]]))
         if ratio_to else "")
    line("batch 1, ms per output token at 4K / 32K / 128K context",
         [" / ".join(f"{t:.2f}" for t in tpot[c]) for c in columns], r)
    warm = {c: rows[c, "1x32768+256"]["ttft_p50_s"] for c in columns}
    line("first token of a 32K prompt, warm server", [f"{warm[c]:.2f} s" for c in columns], rat(warm))
    fresh = {c: rows[c, "1x32768+256"]["fresh_ttft_s"] for c in columns}
    line("the same, a new server's first request", [f"{fresh[c]:.2f} s" for c in columns], "")
    return out


def niah_by_name(rel: str) -> dict[str, dict]:
    return {r["name"]: r for r in load(rel)["rows"]}


def render_readme_today(doc: Path) -> list[str]:
    s, n = load(SERVING), load(NIAH_H200)
    rows = serving_rows()
    niah = niah_by_name(NIAH_H200)
    cap = (f"Speed rows: {link(SERVING, doc)}, {s['device']}, {s['date']}, dummy-weight "
           f"{s['model']}; needle row: {link(NIAH_H200, doc)}, {n['device'].split(',')[0]}, "
           f"{day(n['date'])}, SmolLM2-135M-Instruct (real weights); the commands that made them are under the table.")
    out = [cap, "", "| | int2 | FP8 KV | BF16 | int2 / FP8 |", "|---|---:|---:|---:|---:|"]
    out += _speed_rows(rows, README_COLUMNS, ("int2", "fp8-flashinfer"))
    cells = [niah[k]["niah"] for k in ("int2", "fp8_e4m3", "bf16")]
    out.append("| needle in a haystack, exact match of 200 (1K-8K tokens) | "
               + " | ".join(f"{v:.3f}" for v in cells) + f" | {ratio(cells[0], cells[1])} |")
    out += ["", "```", *top_commands(s), n["command"], "```"]
    return out


def render_serving_full(doc: Path) -> list[str]:
    s = load(SERVING)
    rows = serving_rows()
    cols = tuple(c for _, c in FULL_COLUMNS)
    out = [f"{link(SERVING, doc)}: {s['device']}, {s['date']} (commit `{s['commit']}`), dummy-weight "
           f"{s['model']}, each configuration alone on one GPU; int2 / FP8 is int2 over FP8 on "
           "FlashInfer. Made by:", *commands_block(s), "",
           "| | " + " | ".join(h for h, _ in FULL_COLUMNS) + " | int2 / FP8 |",
           "|---|" + "---:|" * (len(cols) + 1)]
    body = _speed_rows(rows, cols, ("int2", "fp8-flashinfer"))
    mrr = {c: rows[c, "1x4096+256"]["max_running_requests"] for c in cols}
    body.insert(1, "| max running requests | " + " | ".join(f"{mrr[c]:,}" for c in cols) + " | |")
    leak = max(r.get("pool_leak_tokens", 0) or 0 for r in rows.values())
    out += body + ["", f"Largest pool leak after any load (tokens): {leak}."]
    return out


def _niah_label(row: dict) -> str:
    if row["kv"] != "int2":
        return {"bf16": "BF16", "fp8_e4m3": "FP8 (`fp8_e4m3`)"}[row["kv"]]
    return f"`{row['format']}`"


def render_niah(doc: Path) -> list[str]:
    h200, h100 = load(NIAH_H200), load(NIAH_H100)

    def key(r: dict) -> str:  # the same stored format, whatever each run named its row
        return r["kv"] if r["kv"] != "int2" else r["format"]

    a = {key(r): r for r in h200["rows"]}
    b = {key(r): r for r in h100["rows"]}
    keys = list(a) + [k for k in b if k not in a]
    keys.sort(key=lambda k: -(a.get(k) or b[k])["body_bits_per_element"])
    d1, d2 = h200["device"].split(",")[0], h100["device"].split(",")[0]
    out = [f"H200: {link(NIAH_H200, doc)}, {d1}, {day(h200['date'])}; H100: {link(NIAH_H100, doc)}, "
           f"{d2}, {day(h100['date'])}. SmolLM2-135M-Instruct, {a['bf16']['trials']} prompts per row "
           "(1K-8K tokens, 10 depths), exact match; \"default\" marks the row each run served "
           "without `OSCAR_KV_FORMAT`. Made by:",
           "", "```", h200["command"], h100["command"], "```", "",
           f"| KV cache (stored format) | bits per element | {d1}, {day(h200['date'])} | "
           f"{d2}, {day(h100['date'])} |", "|---|---:|---:|---:|"]
    for k in keys:
        r = a.get(k) or b[k]

        def cell(x: dict | None) -> str:
            if x is None:
                return "-"
            return f"{x['niah']:.3f}" + (" (default)" if x.get("default") else "")

        out.append(f"| {_niah_label(r)} | {r['body_bits_per_element']:g} | {cell(a.get(k))} | "
                   f"{cell(b.get(k))} |")
    return out


def render_kernel_decode(doc: Path) -> list[str]:
    k = load(KERNELS)
    fmts = list(k["rows"][0]["channel"])
    out = [f"{link(KERNELS, doc)}: {k['device']}, {k['date']} (commit `{k['commit']}`), {k['model']}; "
           f"copy bandwidth {k['copy_gbs']:,.0f} GB/s measured in the same run. Made by:",
           "", "```", k["command"], "```", "",
           "| requests x context | SGLang BF16 Triton (us) | "
           + " | ".join(f"`{f}` (us, x BF16, % of copy)" for f in fmts) + " |",
           "|---|---:|" + "---:|" * len(fmts)]
    for r in k["rows"]:
        cells = [f"{r['channel'][f]['ms'] * 1e3:.1f}, {r['channel'][f]['speedup_vs_bf16']:.2f}x, "
                 f"{r['channel'][f]['pct_copy']:.0f}%" for f in fmts]
        out.append(f"| {r['B']} x {r['L'] // 1024}K | {r['bf16_ms'] * 1e3:.1f} | " + " | ".join(cells) + " |")
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def failed(row: dict) -> bool:
    """A results row whose server died or whose requests failed: its numbers are not measurements
    (bench.spec_decode uses it too; this file also runs as a script, so it imports no bench module)."""
    return bool(row.get("error")) or row.get("ok") is False


def render_spec_decode(doc: Path) -> list[str]:
    """bench/spec_decode.py's file: acceptance and greedy identity on real weights, verify-step
    time on the dummy 8B, pool leaks after aborted speculative streams, and the file's checks.
    A placeholder line while the file does not exist (the region may be placed before the run)."""
    if not (ROOT / SPEC_DECODE).exists():
        return [f"Not measured yet: `{SPEC_DECODE}` does not exist (`python -m bench.spec_decode --help` "
                "says how to make it)."]
    s = load(SPEC_DECODE)
    rows = s["rows"]
    out = [f"{link(SPEC_DECODE, doc)}: {s['device']}, {s['date']} (commit `{s['commit']}`). Made by:",
           *commands_block(s)]
    real = [r for r in rows if r.get("part") == "real"]
    if real:
        algs = ("none", "ngram", "standalone")
        real.sort(key=lambda r: (algs.index(r["algorithm"]) if r["algorithm"] in algs else 9, r["kv"]))
        n = max(r.get("prompts") or 0 for r in real)
        out += ["", f"{real[0].get('model')}, real weights, {n} greedy chat prompts: accept length = "
                "output tokens / verify steps; identical = share of prompts whose greedy text equals the "
                "same server's without speculation.", "",
                "| speculation | KV | accept length | identical to no speculation | TPOT p50 (ms) |",
                "|---|---|---:|---:|---:|"]
        for r in real:
            ident = r.get("greedy_identical_vs_nospec")
            why = r.get("error") or r.get("errors")
            cells = ["failed: " + " ".join(str(why).split())[:120].replace("|", "/"), "", ""] \
                if failed(r) else [_ms(r.get("accept_len_mean")),
                                        "-" if ident is None else f"{ident:.3f}", _ms(r.get("tpot_p50_ms"))]
            out.append(f"| {r['algorithm']} | {r['kv']} | " + " | ".join(cells) + " |")
    verify = [r for r in rows if r.get("part") == "verify"]
    if verify:
        kvs = [kv for kv in ("int2", "fp8_e4m3", "bf16") if any(r["kv"] == kv for r in verify)]
        loads = sorted({(r["batch"], r["context"]) for r in verify})
        cell = {(r["kv"], r["batch"], r["context"]): r for r in verify}

        def fmt(r: dict | None) -> str:
            if r is None:
                return "-"
            if r.get("fits") is False:
                return "does not fit"
            return "error" if r.get("error") or r.get("verify_step_ms") is None else _ms(r["verify_step_ms"])

        names = {"int2": "int2", "fp8_e4m3": "FP8", "bf16": "BF16"}
        out += ["", f"Time of one speculative step (ms: (e2e - TTFT) / verify steps), {verify[0].get('model')} "
                f"(dummy weights), STANDALONE with a dummy 1-layer draft, {verify[0].get('output_tokens')} output "
                "tokens a request:", "",
                "| requests x context | " + " | ".join(f"{names[k]} ({next(r['backend'] for r in verify if r['kv'] == k)})"
                                                     for k in kvs) + " |",
                "|---|" + "---:|" * len(kvs)]
        for b, c in loads:
            out.append(f"| {b} x {c // 1024}K | " + " | ".join(fmt(cell.get((k, b, c))) for k in kvs) + " |")
    aborts = [r for r in rows if r.get("part") == "aborts"]
    if aborts:
        out += ["", "| aborted streams (int2) | aborted / streams | pool leak (tokens) | side rows leaked |",
                "|---|---:|---:|---:|"]
        for r in aborts:
            out.append(f"| {r['algorithm']} | " + ("failed (the server had stopped) | | |" if failed(r) else
                       f"{r.get('aborted', '-')} / {r.get('streams', '-')} | "
                       f"{r.get('pool_leak_tokens', '-')} | {r.get('side_rows_leak', '-')} |"))
    return out + _checks_line(s)


# (column header, row metric) of the path-invariance table: bench/path_invariance.py's COMPARISONS
PATH_COLUMNS = (("radix hit", "greedy_identical_radix_vs_cold"), ("sibling hit", "greedy_identical_sibling_vs_cold"),
                ("batch 1", "greedy_identical_batch_vs_cold"), ("batch 2", "greedy_identical_batch2_vs_cold"),
                ("batch 1 = batch 2", "greedy_identical_batch1_vs_batch2"),
                ("after rows reused", "greedy_identical_after_others_vs_cold"), ("host tier", "greedy_identical_host_vs_cold"),
                ("host tier = device cache", "greedy_identical_host_vs_device"))


def render_path_invariance(doc: Path) -> list[str]:
    """bench/path_invariance.py's file: per server and output length, the share of prompts whose
    greedy answer on each path equals the cold prefill's, the passes' radix-hit shares, and the
    file's checks. A placeholder line while the file does not exist."""
    if not (ROOT / PATH_INVARIANCE).exists():
        return [f"Not measured yet: `{PATH_INVARIANCE}` does not exist (`python -m bench.path_invariance --help` "
                "says how to make it)."]
    s = load(PATH_INVARIANCE)
    rows = sorted(s["rows"], key=lambda r: (r.get("max_new_tokens") or 0, bool(r.get("ignore_eos")),
                                            bool(r.get("hicache")), r.get("kv") != "int2", r.get("config", "")))
    n = max((r.get("prompts") or 0 for r in rows), default=0)
    out = [f"{link(PATH_INVARIANCE, doc)}: {s['device']}, {s['date']} (commit `{s['commit']}`). Made by:",
           *commands_block(s), "",
           f"{rows[0].get('model') if rows else '-'}, real weights, {n} greedy chat prompts: the share of prompts "
           "whose answer on the path equals the same server's cold answer (radix cache flushed before it); "
           "batch 1 = batch 2 compares the two batch passes with each other; '-' not measured.", "",
           "| server | output tokens | " + " | ".join(h for h, _ in PATH_COLUMNS) + " |",
           "|---|---|" + "---:|" * len(PATH_COLUMNS)]
    for r in rows:
        tokens = f"{r.get('max_new_tokens')}" + (" (no EOS)" if r.get("ignore_eos") else "") \
            + (", HiCache" if r.get("hicache") else "")
        if r.get("error"):
            cells = ["error: " + " ".join(str(r["error"]).split())[:120].replace("|", "/")] + [""] * (len(PATH_COLUMNS) - 1)
        else:
            cells = ["-" if r.get(k) is None else f"{r[k]:.3f}" for _, k in PATH_COLUMNS]
        out.append(f"| {_server(r)} | {tokens} | " + " | ".join(cells) + " |")
    hits = [r for r in rows if r.get("passes")]
    if hits:
        names = [p for p in ("cold", "warm_serial", "sibling_serial", "warm_batch_1", "warm_batch_2",
                             "warm_after_others", "host") if any(p in r["passes"] for r in hits)]
        out += ["", "Share of requests that hit the radix cache (cached_tokens > 0), per pass:", "",
                "| server | output tokens | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
        for r in hits:
            cells = [_ms(r["passes"][p].get("hit_share")) if p in r["passes"] else "-" for p in names]
            out.append(f"| {_server(r)} | {r.get('max_new_tokens')} | " + " | ".join(cells) + " |")
    return out + _checks_line(s)


def _checks_line(s: dict) -> list[str]:
    """The file's checks: pass, FAIL, or not measured (a check without its numbers)."""
    summary = s.get("summary") or {}
    checks, missing = summary.get("checks") or {}, set(summary.get("not_measured") or [])

    def word(k: str, v) -> str:
        return "not measured" if k in missing else ("pass" if v else "FAIL")

    return ["", "Checks: " + ", ".join(f"`{k}` {word(k, v)}" for k, v in checks.items()) + "."] if checks else []


def render_hicache(doc: Path) -> list[str]:
    """bench/hicache.py's file: the multi-turn load with and without the host tier against FP8 and
    BF16, the file tier across a restart and against BF16, pool leaks after aborted load-backs, and
    the file's checks (the path-invariance rows are in their own table)."""
    s = load(HICACHE)
    rows = s["rows"]
    out = [f"{link(HICACHE, doc)}: {s['device']}, {s['date']} (commit `{s['commit']}`). Made by:",
           *commands_block(s)]
    load_rows = [r for r in rows if r.get("part") == "load"]
    if load_rows:
        order = ("int2-hicache", "int2-radix", "fp8-hicache", "bf16-hicache", "int2-device", "bf16-device")
        load_rows.sort(key=lambda r: order.index(r["config"]) if r["config"] in order else 9)
        r0 = load_rows[0]
        out += ["", f"{r0.get('model')} (dummy weights), device pool {r0.get('device_tokens'):,} tokens: "
                f"{r0.get('conversations')} conversations of {r0.get('history_tokens'):,} + {r0.get('turn1_tokens')} "
                f"tokens, {r0.get('output_tokens')} answered, then each one's returning turn (+{r0.get('returning_tokens')} "
                f"tokens), {r0.get('returning_at_once')} at a time; by then every history is on host (HiCache) or gone"
                + (" (a -device row's pool holds them all: device hits)." if any(
                    r["config"].endswith("-device") for r in load_rows) else "."),
                "", "| server | returning TTFT p50 / p90 (s) | host hit tokens | output tok/s (returning) | "
                "host bytes / token | turn 1 wall (s) |", "|---|---:|---:|---:|---:|---:|"]
        for r in load_rows:
            if failed(r):
                out.append(f"| {r['config']} | failed: " + " ".join(str(r.get("error")).split())[:120].replace("|", "/")
                           + " | | | | |")
                continue
            hb = r.get("host_bytes_per_token")
            ttft = " / ".join("-" if r.get(k) is None else f"{r[k]:.3f}" for k in ("returning_ttft_p50_s", "returning_ttft_p90_s"))
            out.append(f"| {r['config']} | {ttft} | "
                       f"{r.get('host_hit_tokens', 0):,} | {r.get('output_tok_s', 0):.0f} | "
                       f"{'-' if hb is None else f'{hb:,.0f}'} | {r.get('turn1_wall_s', '-')} |")
    files = {r["config"]: r for r in rows if r.get("part") == "file"}
    if files:
        w, b = files.get("int2-store", {}), files.get("bf16-store", {})
        out += ["", f"File tier: an int2 server wrote {w.get('store_files', '-')} page files for "
                f"{w.get('conversations', '-')} conversations and stopped; a new int2 server on the same store "
                f"served their returning turns with {w.get('storage_hit_tokens', '-'):,} tokens from storage; a "
                f"BF16 server on that store read {b.get('cross_format_hits', '-')} of them."]
    for r in (r for r in rows if r.get("part") == "aborts"):
        out += ["", f"Aborts with the host tier on ({r.get('config')}): {r.get('aborted', '-')} of "
                f"{r.get('streams', '-')} returning turns hung up on (before the first token or mid-stream); "
                f"pool leak {r.get('pool_leak_tokens', '-')} tokens, {r.get('side_rows_leak', '-')} side rows."]
    return out + _checks_line(s)


def render_pd(doc: Path) -> list[str]:
    """bench/pd.py's one-GPU file (pd_h200.json)."""
    return _render_pd(PD, doc)


def render_pd_x2(doc: Path) -> list[str]:
    """bench/pd.py's two-GPU file (pd_h200x2.json: prefill server on one GPU, decode server on the
    other); a placeholder line while it does not exist (the region may be placed before the run)."""
    if not (ROOT / PD_X2).exists():
        return [f"Not measured yet: `{PD_X2}` does not exist (`python -m bench.pd --help` has the two-GPU plan "
                "of calls)."]
    return _render_pd(PD_X2, doc)


def _pd_placement(rows: list[dict]) -> str:
    """Where a pd file's pairs ran: 'one GPU', or the prefill and decode GPUs of its two-GPU rows."""
    for r in rows:
        g = r.get("gpus") or {}
        if g.get("prefill") is not None and g.get("decode") is not None and g["prefill"] != g["decode"]:
            return f"prefill on GPU {g['prefill']}, decode on GPU {g['decode']}"
    return "one GPU"


def _render_pd(rel: str, doc: Path) -> list[str]:
    """A bench/pd.py file: which transfer engine moved the cache (and the answers through the pair
    against one server's), then whichever of the real / load / aborts parts it holds (int2 against
    FP8 per load where the summary has both), and its checks."""
    s = load(rel)
    rows = s["rows"]
    out = [f"{link(rel, doc)}: {s['device']}, {s['date']} (commit `{s['commit']}`). Made by:", *commands_block(s)]

    def error(r: dict) -> str:
        return "failed: " + " ".join(str(r.get("error") or r.get("errors")).split())[:120].replace("|", "/")

    def share(r: dict) -> str:
        v = r.get("greedy_identical_vs_single_server")
        return error(r) if failed(r) and v is None else ("-" if v is None else
                                                          f"{v:.3f} ({r.get('identical', '-')} of {r.get('prompts', '-')})")

    pairs = [r for r in rows if r.get("part") in ("engines", "real")]
    if pairs:
        out += ["", f"Greedy answers through a PD pair (prefill server -> transfer -> decode server, "
                f"{_pd_placement(pairs)}) against one server with the same weights and KV cache: the share of "
                "prompts whose output tokens are the same.", "",
                "| part | model | KV | engine | front | prompts x (prompt tokens -> output tokens) | identical to one server |",
                "|---|---|---|---|---|---|---:|"]
        for r in pairs:
            toks = r.get("prompt_tokens") or []
            size = (f"{len(toks)} x ({min(toks)}-{max(toks)} -> {r.get('max_new_tokens')})" if toks else "-")
            out.append(f"| {r['part']} | {r.get('model', '-')} | {r.get('kv', '-')} | {r.get('engine', '-')} | "
                       f"{r.get('front', '-')} | {size} | {share(r)} |")
    loads = [r for r in rows if r.get("part") == "load"]
    if loads:
        out += ["", "| load | KV | engine / front | TTFT p50 (s) | output tok/s | transfer bytes / token |",
                "|---|---|---|---:|---:|---:|"]
        for r in loads:
            cells = [error(r), "", ""] if failed(r) else [
                _ms(r.get("ttft_p50_s")), "-" if r.get("output_tok_s") is None else f"{r['output_tok_s']:.0f}",
                "-" if r.get("transfer_bytes_per_token") is None else f"{r['transfer_bytes_per_token']:,.0f}"]
            out.append(f"| {r.get('load', '-')} | {r.get('kv', '-')} | {r.get('engine', '-')} / {r.get('front', '-')} | "
                       + " | ".join(cells) + " |")
        for ld, table in ((s.get("summary") or {}).get("loads") or {}).items():
            i2 = table.get("int2") or {}
            if i2.get("output_tok_s_vs_fp8") is not None and i2.get("ttft_p50_s_vs_fp8") is not None:
                out += ["", f"int2 against FP8 on the same pair ({_pd_placement(loads)}), {ld}: "
                        f"{i2['output_tok_s_vs_fp8']:.2f}x the output tok/s, "
                        f"{i2['ttft_p50_s_vs_fp8']:.2f}x the TTFT p50."]
    for r in (r for r in rows if r.get("part") == "aborts"):
        out += ["", f"Aborts ({r.get('config')}, {r.get('engine')}): {r.get('aborted', '-')} of {r.get('streams', '-')} "
                f"streams hung up on; pool leak {r.get('pool_leak_tokens', '-')} tokens, "
                f"{r.get('side_rows_leak', '-')} side rows (the larger of the two servers')."]
    logged = next((r.get("transfer_log") for r in rows if r.get("kv") == "int2" and r.get("transfer_log")), None)
    if logged:
        out += ["", f"What one int2 transfer moves ({next(r.get('model') for r in rows if r.get('transfer_log') is logged)}, "
                f"from the prefill server's log): {logged['kv_bytes_per_token']:,.0f} bytes a token of pages and "
                f"{logged['state_bytes_per_request']:,} bytes a request of side rows, over {logged['regions']} "
                "registered regions."]
    return out + _checks_line(s)


def _server(row: dict) -> str:
    """A results row's server: its config, and for int2 which prefill it ran (OSCAR_PREFILL_READS)."""
    return row.get("config", "-") + (f" (prefill reads {row['prefill_reads']})" if row.get("prefill_reads") else "")


def prefill_mode(r: dict) -> str | None:
    """BF16, or which OSCAR_PREFILL_READS an int2 row's server ran: the row's own word (rows
    annotated by hand), /server_info's, the server's environment, else the plugin's default."""
    if r.get("kv") == "bf16":
        return "BF16"
    from oscar_sglang.common.settings import PREFILL_READS

    return (r.get("prefill_reads") or (r.get("oscar_int2") or {}).get("prefill_reads")
            or (r.get("server_env") or {}).get(PREFILL_READS.name) or PREFILL_READS.default)


def render_prefill_reads(doc: Path) -> list[str]:
    """OSCAR_PREFILL_READS' trade-off: served NIAH (cold prompts) from the NIAH file and the greedy
    identity of cache hits with cold answers from the HiCache file's paths part (the default,
    page-canonical prefill and BF16 servers of one run), int2 in each mode beside BF16."""
    niah, hc = load(NIAH_PREFILL), load(HICACHE)
    paths = [r for r in hc["rows"] if r.get("part") == "paths" and not failed(r)]
    n = {prefill_mode(r): r for r in niah["rows"] if not failed(r)}
    pth = {prefill_mode(r): r for r in paths}
    first = min(paths, key=lambda r: r.get("date", ""), default={})
    cols = (("radix hit = cold", "greedy_identical_radix_vs_cold"), ("host tier = cold", "greedy_identical_host_vs_cold"),
            ("host tier = device cache", "greedy_identical_host_vs_device"),
            ("sibling's pages = cold", "greedy_identical_sibling_vs_cold"),
            ("warm batch = cold", "greedy_identical_batch_vs_cold"))
    out = [f"{link(NIAH_PREFILL, doc)} ({niah['device'].split(',')[0]}, {day(niah['date'])}; its commit_note "
           f"says what each server ran) and the paths part of {link(HICACHE, doc)} ({first.get('device', '-')}, "
           f"{day(first.get('date', '-'))}, its `--part paths` call: the three servers side by side, 48 "
           "greedy chat prompts of 64 tokens on real SmolLM2 weights, HiCache on). NIAH: exact match over "
           "the file's prompts, cold "
           "prefills (radix cache off); the other columns: share of the path-invariance prompts whose "
           "greedy answer on the path equals the same server's cold answer. Made by:",
           *commands_block(niah)[:-1], *top_commands(hc), "```", "",
           "| KV cache | NIAH | " + " | ".join(h for h, _ in cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for m, label in (("BF16", "BF16"), ("exact", "int2, `OSCAR_PREFILL_READS=exact` (default)"),
                     ("cache", "int2, `OSCAR_PREFILL_READS=cache`")):
        row, ids = n.get(m), pth.get(m) or {}
        out.append(f"| {label} | {'-' if row is None else format(row['niah'], '.3f')} | "
                   + " | ".join("-" if ids.get(k) is None else f"{ids[k]:.3f}" for _, k in cols) + " |")
    return out


RENDERERS = {
    "readme-today": render_readme_today,
    "serving-h200": render_serving_full,
    "niah-served": render_niah,
    "kernel-decode-h200": render_kernel_decode,
    "spec-decode": render_spec_decode,
    "path-invariance": render_path_invariance,
    "prefill-reads": render_prefill_reads,
    "hicache": render_hicache,
    "pd": render_pd,
    "pd-h200x2": render_pd_x2,
}
REGION = re.compile(r"(<!-- generated:([\w-]+) -->\n)(.*?)(<!-- /generated:\2 -->)", re.S)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def render_text(text: str, path: Path) -> tuple[str, list[str]]:
    """`text` (the contents of `path`) with every region regenerated, and the regions' names."""
    names = []

    def sub(m: re.Match) -> str:
        name = m.group(2)
        if name not in RENDERERS:
            raise SystemExit(f"{path.relative_to(ROOT)}: unknown generated region {name!r}")
        names.append(name)
        body = "\n".join(RENDERERS[name](path))
        return f"{m.group(1)}{body}\n{m.group(4)}"

    return REGION.sub(sub, text), names


def render(path: Path) -> tuple[str, list[str]]:
    return render_text(path.read_text(), path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a region is not what it would write")
    args = ap.parse_args(argv)
    stale = []
    for path in documents():
        new, names = render(path)
        if new != path.read_text():
            stale.append(f"{path.relative_to(ROOT)} ({', '.join(names)})")
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("generated regions out of date (run python bench/render_docs.py):\n  " + "\n  ".join(stale),
              file=sys.stderr)
        return 1
    if not args.check:
        print("rewrote: " + (", ".join(stale) if stale else "nothing (all up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
