"""INT2 KV against FP8 (and BF16) KV through the server: the comparison table, one JSON.

For each configuration (bench/_serving_server.py CONFIGS; default int2, int2-mixed-chunk,
fp8-splits64, fp8-flashinfer, flashinfer) it starts one `sglang.launch_server` (dummy weights, the
devkit flags of bench/serving.py) and, on that server:

  1. if 1x32768+256 is among its loads: that request first, on the fresh server (fresh_ttft_s);
  2. warm-up requests, then idle + /flush_cache: the pool's start values (/v1/loads num_used_tokens,
     /server_info oscar_int2.tokens_free and any other oscar_int2 `*_free` field);
  3. every load NxIN+OUT: N random-token requests of IN tokens at once, OUT output tokens each
     (N = 1: a batch-1 row; its TPOT is the median gap between tokens); then idle + flush and the
     pool against its start values (pool_leak_tokens; the 32K row also gets warm_ttft_s, the same
     request as the fresh one);
  4. 64 aborted streams (--abort-load 64x2048+1024, each closed after 1-16 tokens), then the pool
     again (a row of kind "aborts").

Every row is written to --out as soon as it is measured (bench/_results.py document; rows keyed by
(load, kv, backend, config), a new row replaces the old one with the same key) together with the
summary: per load int2's output tok/s over FP8's best backend's, the named acceptance checks and
pool_leak_tokens overall. A call cut by the device's 10-minute limit keeps what it measured.

How long things take (H100, dummy Llama-3.1-8B): a server start 90-120 s (the first FlashInfer
server on a bare machine adds 2-3 min of JIT compile); 256x2048+256 60-90 s; 256x2048+1024 ~2-3
min; 512x2048+1024 ~3-5 min; 64x8192+512 ~1 min; the three batch-1 rows ~1 min (128K prefill
17-34 s); 64 aborted streams ~20 s. One configuration with all loads is ~10-13 min: more than one
10-minute call. --deadline-s skips (and lists under `skipped`) what its estimate says would not
finish (FlashInfer's JIT is budgeted for the run's first server that compiles it, not again);
--only-missing measures only keys without a good row, so the same command repeated fills
the table call by call. --print-commands shows the plan and the servers' commands.

Device runs (from the project root; carry .devkit/sgl_bundle.tar.xz, .devkit/device-env.sh and
.devkit/smollm2_tok.tar.xz, see bench/serving.py). Each call reads the rows already on file
(--base, default bench/results/serving_vs_fp8_h100.json) and writes them plus its own to --out;
copy that file from $OUT to bench/results/ before the next call:

  mkdir -p .devkit/models && tar -C .devkit/models -xJf .devkit/smollm2_tok.tar.xz && source .devkit/device-env.sh &&
  python -m bench.serving_vs_fp8 run --out $OUT/serving_vs_fp8_h100.json --deadline-s 570 \\
      --only-missing --logs $OUT/logs

  one GPU: repeat it (about 8 calls); or split by hand: --configs int2 --loads
      1x4096+256,1x32768+256,1x131072+256,256x2048+256,64x8192+512 then --configs int2 --loads
      256x2048+1024,512x2048+1024, and so on per configuration;
  several GPUs (nvidia-h100-x8: the table in about two calls): add --gpus 0,1,2,3,4,5,6,7
      --unit-s 300 (configurations split into 15 units of about --unit-s estimated seconds, one
      server per unit, one unit per GPU at a time; rows record side_by_side, the number of servers
      run at once, since they share the host's CPUs).

Then: python -m bench.serving_vs_fp8 report (reads bench/results/serving_vs_fp8_h100.json; prints the
table and writes docs/img/serving_vs_fp8_h100.png); docs/performance.md's tables are regenerated
from the JSON by python -m bench.render_docs.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional

from bench import _results
from bench import _vs_fp8_report as report
from bench._serving_server import CONFIGS, kv_and_backend

ROOT = Path(__file__).resolve().parent.parent
DEVKIT_MODELS = ROOT / ".devkit" / "models"
DEFAULT_OUT = _results.RESULTS / "serving_vs_fp8_h100.json"
DEFAULT_CONFIGS = "int2,int2-mixed-chunk,fp8-splits64,fp8-flashinfer,flashinfer"
DEFAULT_LOADS = ("1x4096+256,1x32768+256,1x131072+256,256x2048+256,64x8192+512,"
                 "256x2048+1024,512x2048+1024")
DEFAULT_WARMUP = "2x1024+16,1x12000+16"  # a short prompt, and one of two prefill chunks
# time estimates for --deadline-s (H100, Llama-3.1-8B; a row already on file gives its own wall_s)
# A server start with FlashInfer's JIT on a bare machine (rows' startup_s): 145-206 s on 4 x H200
# (results/serving_vs_fp8_h200_2026-11-27_*.json), 197-212 s on 4 x H100 (serving_vs_fp8_h100_2026-11-27_0700.json
# and its _2026-11-27_0008 copy); 270 s (150 for the JIT) skipped a 64 x 8K pair that would have
# fit in 272 s, so the JIT share is now what the slowest start measured.
STARTUP_S, FLASHINFER_JIT_S, STOP_S = 120.0, 95.0, 15.0
PREFILL_TOK_S = 40_000.0
# output tok/s per KV dtype at 512 x (2K + 1K), rounded down from the 2026-11-26 tables (the
# slowest of the loads with 1K outputs): int2 6,300, fp8_e4m3 5,200, BF16 on FlashInfer 4,400
OUTPUT_TOK_S = {"int2": 6_000.0, "fp8_e4m3": 5_000.0, "bf16": 4_400.0}


def estimate_s(load: str, known: Optional[dict] = None, kv: Optional[str] = None) -> float:
    """Seconds one load takes: its wall_s on file, else prefill at PREFILL_TOK_S plus output at
    OUTPUT_TOK_S[kv] (the slowest where kv is not given; batch 1: 12 ms a token, and attention's
    share of a long prefill: ~30 s at 128K)."""
    if known and known.get("wall_s"):
        return float(known["wall_s"]) + 10
    n, inp, out = report.parse_load(load)
    if n == 1:
        return inp / PREFILL_TOK_S + (inp / 131072) ** 2 * 30 + out * 0.012 + 10
    rate = OUTPUT_TOK_S.get(kv, min(OUTPUT_TOK_S.values()))
    return n * inp / PREFILL_TOK_S + n * out / rate + 10


def gpu_name() -> str:
    """The GPU's name from nvidia-smi: this process must not hold a CUDA context (torch would take
    memory on the GPU the server sizes its pool from); bench/_results.py's way as the fallback."""
    try:
        first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", first],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return _results.device_name()


def row_key(row: dict) -> tuple:
    return row["load"], row["kv"], row["backend"], row["config"]


# ------------------------------------------------------------------------------ the results file


class Table:
    """The results JSON, shared by every process of a run: each put() locks the file, re-reads it,
    replaces the row with the same key, recomputes the summary and writes it back whole."""

    def __init__(self, path: Path, model: str, base: Optional[Path] = None, device: Optional[str] = None):
        self.path, self.model = Path(path), model
        self.device = device or gpu_name()
        # outside the results folder, so that only the JSON comes back from the device
        digest = hashlib.sha1(str(self.path.resolve()).encode()).hexdigest()[:12]
        self.lock_path = Path(tempfile.gettempdir()) / f"serving_vs_fp8_{digest}.lock"
        self.call = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "pid": os.getpid(),
                     "device": self.device, "command": _results.command(),
                     "started_unix": round(time.time(), 3)}  # two calls in one second stay two
        with self._locked():
            if not self.path.exists():
                rows, extra = [], {}
                if base and Path(base).exists() and Path(base).resolve() != self.path.resolve():
                    old = json.loads(Path(base).read_text())
                    rows, extra = old["rows"], {k: old[k] for k in ("calls", "skipped") if k in old}
                self._write(rows, **extra)

    @contextlib.contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def read(self) -> dict:
        return json.loads(self.path.read_text())

    def _write(self, rows: List[dict], calls=None, skipped=None) -> None:
        doc = _results.document(self.model, rows, device=self.device)
        calls = list(calls or [])
        if self.call not in calls:
            calls.append(self.call)
        doc.update(summary=report.summary(rows), calls=calls, skipped=skipped or [])
        _results.write(self.path, doc)

    def put(self, row: Optional[dict] = None, skipped: Optional[dict] = None) -> dict:
        with self._locked():
            doc = self.read()
            rows, skips = doc["rows"], doc.get("skipped", [])
            if row is not None:
                rows = [r for r in rows if row_key(r) != row_key(row)] + [row]
                skips = [s for s in skips if (s["load"], s["config"]) != (row["load"], row["config"])]
            if skipped is not None:
                skips = [s for s in skips if (s["load"], s["config"]) != (skipped["load"], skipped["config"])]
                skips.append(skipped)
            self._write(rows, doc.get("calls"), skips)
            return doc


# ------------------------------------------------------------------------------ on one server


def _facts(url: str) -> dict:
    from bench.soak import server_facts

    from bench._launcher import get_json

    # long timeout: a FlashInfer server JIT-compiles its prefill on SGLang's own start-up warm-up
    # request, and /server_info waits on the busy scheduler (30 s was too short for fp8 + flashinfer)
    info = get_json(url + "/server_info", timeout=600)
    facts = server_facts(info, None)
    return {"max_running_requests": facts["max_running_requests"], "kv_tokens": facts["max_total_num_tokens"],
            "context_tokens": facts["context_tokens"], "server_kv_cache_dtype": facts["kv_cache_dtype"],
            "server_attention_backend": facts["attention_backend"],
            "new_token_attention": facts["new_token_attention"], "prefix_attention": facts["prefix_attention"],
            # the format an int2 server stores (None for BF16 / FP8): the default changes between
            # runs, so a row names what it measured
            "kv_format": facts["kv_format"], "body_bits_per_element": facts["body_bits_per_element"]}


def compiled_while_serving(url: str):
    """The plugin's list of Triton kernels compiled after the server's first forward (/server_info
    oscar_int2.compiled_while_serving: kernel, ms, seconds after the first forward); None where
    the server does not report it (not int2, or an older plugin)."""
    from bench._launcher import get_json

    try:
        st = ((get_json(url + "/server_info", timeout=60) or {}).get("internal_states") or [{}])[0] or {}
    except (OSError, ValueError):
        return None
    return (st.get("oscar_int2") or {}).get("compiled_while_serving")


async def _pool(url: str, idle_timeout_s: float) -> dict:
    """Idle (nothing running or waiting), /flush_cache, then the pool: soak.pool_snapshot plus any
    other oscar_int2 `*_free` field (side-buffer memory, where the plugin reports it)."""
    import aiohttp
    from bench import soak

    async with aiohttp.ClientSession() as s:
        idle = await soak.wait_idle(s, url, soak.Stats(), idle_timeout_s)
        flushed = await soak.flush_cache(s, url) if idle else False
        snap = await soak.pool_snapshot(s, url)
        try:
            info = await soak.get_json(s, url + "/server_info")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            info = None
    st = ((info or {}).get("internal_states") or [{}])[0] or {}
    other = {k: v for k, v in (st.get("oscar_int2") or {}).items()
             if k.endswith("_free") and k != "tokens_free" and isinstance(v, (int, float))}
    return {**snap, "other_free": other, "idle": idle, "flushed": flushed}


def pool_state(url: str, idle_timeout_s: float) -> dict:
    return asyncio.run(_pool(url, idle_timeout_s))


def pool_leak(start: dict, end: dict) -> dict:
    """pool_leak_tokens (soak.leak_tokens: SGLang's used tokens and int2's free tokens against the
    start; None if not measured) and side_free_leak ({field: start - end} for the other *_free)."""
    from bench.soak import leak_tokens

    leak = leak_tokens(start, end) if end.get("idle") else None
    side = {k: start["other_free"][k] - end["other_free"].get(k, 0) for k in start.get("other_free", {})
            if end.get("other_free", {}).get(k) != start["other_free"][k]}
    return {"pool_leak_tokens": leak, "side_free_leak": side, "pool_start": _brief(start), "pool_end": _brief(end)}


def _brief(snap: dict) -> dict:
    return {k: snap.get(k) for k in ("sglang_used", "oscar_tokens_free", "other_free", "idle")}


def _prompts(load: str, n: int, inp: int, vocab: int) -> List[List[int]]:
    from bench._serving_client import random_prompts

    n0, inp0, out0 = report.parse_load(load)
    return random_prompts(n, inp, vocab, seed=(n0 * 131 + inp0 * 7 + out0) % 1_000_003)


def measure(url: str, load: str, vocab: int, context: Optional[int], timeout_s: float,
            prompts: Optional[List[List[int]]] = None) -> dict:
    """One load: N requests at once; the row's numbers (batch 1: TPOT = median token gap)."""
    import numpy as np

    from bench._serving_client import inter_token_ms, run_requests, summarize

    n, inp, out = report.parse_load(load)
    sent = min(inp, context - out - 8) if context else inp  # SGLang rejects prompt + output >= context
    prompts = prompts or _prompts(load, n, sent, vocab)
    t0 = time.time()
    records = run_requests(url, prompts, out, load, timeout_s=timeout_s)
    s = summarize(records)
    row = {"n": n, "input_len": inp, "output_len": out, "input_tokens_sent": sent, "ok_requests": s["ok"],
           "errors": s.get("errors", []), "wall_s": round(time.time() - t0, 2)}
    row["ok"] = s["ok"] == n and all(r.output_tokens == out for r in records)
    if not s["ok"]:
        row.update(output_tok_s=None, ttft_p50_s=None, tpot_p50_ms=None)
        return row
    row.update(output_tok_s=s["output_tok_s"], ttft_p50_s=s["ttft_s"]["p50"], tpot_p50_ms=s["tpot_ms"]["p50"],
               ttft_p90_s=s["ttft_s"]["p90"], tpot_p90_ms=s["tpot_ms"]["p90"], duration_s=s["duration_s"],
               max_concurrent_decoding=s["max_concurrent_decoding"],
               full_occupancy_decode_tok_s=s["full_occupancy_decode"]["tok_s"])
    if n == 1:
        gaps = inter_token_ms(records[0])[4:]  # the first steps follow the prefill (graph warm-up)
        row["tpot_p50_ms"] = float(np.median(gaps)) if gaps else s["tpot_ms"]["p50"]
        row["tpot_mean_ms"] = s["tpot_ms"]["p50"]
    return row


async def _abort_streams(url: str, prompts: List[List[int]], out: int, seed: int, timeout_s: float) -> dict:
    """Stream every prompt at once and hang up on each after 1-16 tokens (SGLang aborts it)."""
    import aiohttp

    rng = random.Random(seed)
    cut = [rng.randint(1, 16) for _ in prompts]
    tally = {"streams": len(prompts), "aborted": 0, "finished": 0, "errors": 0}

    async def one(session, ids, k):
        payload = {"input_ids": ids, "stream": True,
                   "sampling_params": {"max_new_tokens": out, "temperature": 0.0, "ignore_eos": True}}
        try:
            async with session.post(url + "/generate", json=payload) as resp:
                if resp.status != 200:
                    tally["errors"] += 1
                    return
                seen = 0
                async for raw in resp.content:
                    line = raw.strip()
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        seen += 1
                        if seen >= k:
                            resp.close()
                            tally["aborted"] += 1
                            return
                tally["finished"] += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:  # noqa: F841
            tally["errors"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        await asyncio.gather(*[one(session, p, k) for p, k in zip(prompts, cut)])
    return tally


class Clock:
    def __init__(self, deadline_s: Optional[float]):
        self.t0, self.deadline_s = time.monotonic(), deadline_s
        # FlashInfer's JIT cache is per machine: once a server of this run has compiled it, later
        # starts are budgeted without it
        self.flashinfer_compiled = False

    def startup_s(self, config) -> float:
        """Seconds budgeted for starting config's server (STARTUP_S, plus FLASHINFER_JIT_S where it
        compiles FlashInfer kernels and no server of this run has yet)."""
        jit = uses_flashinfer(config) and not self.flashinfer_compiled
        return STARTUP_S + (FLASHINFER_JIT_S if jit else 0.0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def fits(self, seconds: float) -> bool:
        return not self.deadline_s or self.elapsed() + seconds + STOP_S <= self.deadline_s


def run_server(url: str, config: str, loads: List[str], args, table: Table, clock: Clock,
               extra: dict, log: Optional[Path] = None) -> None:
    """All of one server's measurements; each row goes to the table as soon as it is measured.
    log: the server's log (servers the bench started): each load's row also gets what the
    scheduler logged at its full occupancy (_serving_server.scheduler_rates), the server-side
    decode rate next to the client's."""
    from bench._serving_client import random_prompts, run_requests
    from bench._serving_server import (log_size, log_slice, parse_decode_log, parse_prefill_log, prefill_rates,
                                 scheduler_rates)

    kv, backend = kv_and_backend(CONFIGS[config])
    facts = _facts(url)
    on_file = {(r["load"], r["config"]): r for r in table.read()["rows"]}
    base = {"kv": kv, "backend": backend, "config": config,
            "mixed_chunk": "--enable-mixed-chunk" in CONFIGS[config].args, **facts, **extra}

    def put(load, kind, fields):
        row = {"load": load, "kind": kind, **base, **fields,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": table.device}
        table.put(row)
        return row

    def skip(load, why):
        print(f"  [{config}] skip {load}: {why}", flush=True)
        table.put(skipped={"load": load, "config": config, "reason": why,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})

    fresh = None
    if report.FRESH_LOAD in loads and clock.fits(estimate_s(report.FRESH_LOAD)):
        print(f"  [{config}] fresh server: {report.FRESH_LOAD} first", flush=True)
        fresh = measure(url, report.FRESH_LOAD, args.vocab, facts["context_tokens"], args.request_timeout)
        fresh["compiles"] = compiled_while_serving(url)  # what the first request waited for, if any
    for w in filter(None, args.warmup.split(",")):
        n, inp, out = report.parse_load(w)
        run_requests(url, random_prompts(n, inp, args.vocab, seed=inp), out, "warm-up")
    start = pool_state(url, args.idle_timeout)
    for load in loads:
        est = estimate_s(load, on_file.get((load, config)), kv)
        if not clock.fits(est):
            skip(load, f"estimated {est:.0f} s would end past "
                       f"--deadline-s {args.deadline_s:g} (at {clock.elapsed():.0f} s)")
            continue
        off = log_size(log) if log else 0
        fields = measure(url, load, args.vocab, facts["context_tokens"], args.request_timeout)
        if log:
            piece = log_slice(log, off)
            fields.update(scheduler_rates(parse_decode_log(piece)), **prefill_rates(parse_prefill_log(piece)))
        fields.update(pool_leak(start, pool_state(url, args.idle_timeout)))
        if load == report.FRESH_LOAD and fresh is not None:
            fields.update(fresh_ttft_s=fresh["ttft_p50_s"], warm_ttft_s=fields["ttft_p50_s"],
                          fresh_ok=fresh["ok"], fresh_compiles=fresh["compiles"])
        row = put(load, "batch1" if fields["n"] == 1 else "throughput", fields)
        print(f"  [{config}] {load}: {_f(row['output_tok_s'])} output tok/s, TTFT p50 "
              f"{_f(row['ttft_p50_s'], '{:.2f}')} s, TPOT p50 {_f(row['tpot_p50_ms'], '{:.2f}')} ms, "
              f"ok {row['ok']}, pool leak {row['pool_leak_tokens']} (t+{clock.elapsed():.0f} s)", flush=True)
    if args.abort_load:
        name = f"{args.abort_load} aborted"
        if not clock.fits(30):
            return skip(name, f"past --deadline-s {args.deadline_s:g}")
        n, inp, out = report.parse_load(args.abort_load)
        prompts = random_prompts(n, inp, args.vocab, seed=n * 17 + inp)
        t0 = time.time()
        tally = asyncio.run(_abort_streams(url, prompts, out, n * 31 + out, args.request_timeout))
        fields = {**tally, "wall_s": round(time.time() - t0, 2), **pool_leak(start, pool_state(url, args.idle_timeout))}
        fields["ok"] = tally["aborted"] == n
        put(name, "aborts", fields)
        print(f"  [{config}] {n} streams: {tally['aborted']} aborted, {tally['finished']} finished, "
              f"{tally['errors']} errors; pool leak {fields['pool_leak_tokens']}", flush=True)


def _f(x, fmt="{:,.0f}"):
    return "–" if x is None else fmt.format(x)


# ------------------------------------------------------------------------------ servers and units


def server_cmd(config: str, args, port: int) -> List[str]:
    from bench._serving_server import server_command

    return server_command(Path(args.model_dir), Path(args.tokenizer_dir), CONFIGS[config], port,
                          args.mem_fraction_static, list(args.server_arg))


def uses_flashinfer(config) -> bool:
    """Whether the server compiles FlashInfer kernels at start: SGLang's flashinfer backend, and
    int2, whose prefill runs FlashInfer's ragged prefill unless OSCAR_NEW_TOKEN_ATTENTION=triton."""
    kv, backend = kv_and_backend(config)
    return backend == "flashinfer" or (kv == "int2" and config.env.get("OSCAR_NEW_TOKEN_ATTENTION") != "triton")


def run_config(config: str, loads: List[str], args, table: Table, clock: Clock, port: int) -> None:
    """Start the configuration's server (or use its --url), measure, stop it."""
    extra = {"side_by_side": args.side_by_side}
    if config in args.urls:
        return run_server(args.urls[config], config, loads, args, table, clock,
                          {**extra, "server_started_by_bench": False})
    from bench import _launcher
    from bench._serving_server import log_size, log_slice, parse_decode_log

    startup = clock.startup_s(CONFIGS[config])
    first = min((estimate_s(ld) for ld in loads), default=0)
    if not clock.fits(startup + first):
        for ld in loads:
            table.put(skipped={"load": ld, "config": config, "reason": f"server start + first load would end "
                               f"past --deadline-s {args.deadline_s:g}", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
        print(f"  [{config}] skipped: no time for a server start ({clock.elapsed():.0f} s gone)", flush=True)
        return
    cmd = server_cmd(config, args, port)
    log = Path(args.logs) / f"{config}_{port}.log"
    print(f"=== {config}: {shlex.join(cmd)}  (t+{clock.elapsed():.0f} s)", flush=True)
    with _launcher.Server(cmd, CONFIGS[config].env, log, port, **_launcher.SPEED) as srv:
        srv.wait_ready(args.startup_timeout)
        clock.flashinfer_compiled |= uses_flashinfer(CONFIGS[config])
        extra.update(server_started_by_bench=True, startup_s=round(srv.startup_s, 1),
                     server_command=shlex.join(cmd[1:]), server_env=CONFIGS[config].env)
        off = log_size(log)
        run_server(srv.url, config, loads, args, table, clock, extra, log)
        dec = parse_decode_log(log_slice(log, off))
        print(f"  [{config}] server log: most running {max((d['running'] for d in dec), default=None)}, "
              f"cuda graph on every decode line: {all(d['cuda_graph'] for d in dec) if dec else None}", flush=True)


def units(configs: List[str], loads: List[str], unit_s: Optional[float]) -> List[tuple]:
    """(config, loads) work units: a configuration's loads in order, cut where the estimate of a
    server start plus the unit's loads would pass unit_s. FlashInfer's JIT compile is not counted
    (once per machine; each child's --deadline-s still skips what would not fit)."""
    out = []
    for c in configs:
        startup = STARTUP_S
        cur, t = [], startup
        for ld in loads:
            e = estimate_s(ld)
            if cur and unit_s and t + e > unit_s:
                out.append((c, cur))
                cur, t = [], startup
            cur.append(ld)
            t += e
        if cur:
            out.append((c, cur))
    return out


def run_parallel(work: List[tuple], args, clock: Clock) -> int:
    """One child process per unit, a unit per GPU at a time (CUDA_VISIBLE_DEVICES), all writing
    to the same --out under its lock."""
    queue, lock, rcs = list(work), threading.Lock(), []
    side = min(len(args.gpus), len(work))

    def slot(i: int, gpu: str):
        while True:
            with lock:
                if not queue:
                    return
                config, loads = queue.pop(0)
            left = (args.deadline_s - clock.elapsed()) if args.deadline_s else 0
            if args.deadline_s and left < 60:
                print(f"[gpu {gpu}] no time left for {config} {loads}", flush=True)
                continue
            cmd = [sys.executable, "-m", "bench.serving_vs_fp8", "run", "--configs", config, "--loads", ",".join(loads),
                   "--out", str(args.out), "--port", str(args.port + 10 * i), "--side-by-side", str(side),
                   "--abort-load", args.abort_load if loads == [u for c, u in work if c == config][-1] else "",
                   *(["--deadline-s", f"{left:.0f}"] if args.deadline_s else []), *args.passthrough]
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for line in p.stdout:
                print(f"[gpu {gpu}] {line}", end="", flush=True)
            rcs.append(p.wait())

    threads = [threading.Thread(target=slot, args=(i, g)) for i, g in enumerate(args.gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(rcs, default=0)


def _vocab(model_dir: Path) -> int:
    cfg = model_dir / "config.json"
    if not cfg.exists():
        raise SystemExit(f"{cfg} not found: build the devkit (see bench/serving.py) or pass --vocab")
    return int(json.loads(cfg.read_text())["vocab_size"])


def cmd_run(args) -> int:
    args.urls = dict(u.split("=", 1) for u in args.url)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown configs {bad}; choose from {', '.join(CONFIGS)}")
    loads = [ld for ld in args.loads.split(",") if ld]
    for ld in loads + ([args.abort_load] if args.abort_load else []):
        report.parse_load(ld)
    args.gpus = [g for g in (args.gpus or "").split(",") if g]
    src = next((Path(f) for f in (args.out, args.base) if f and Path(f).exists()), None)
    done = set()
    if args.only_missing and src is not None:
        done = {(r["load"], r["config"]) for r in json.loads(src.read_text())["rows"] if r.get("ok")}
    per = {c: [ld for ld in loads if (ld, c) not in done] for c in configs}
    aborts_done = {c for c in configs if (f"{args.abort_load} aborted", c) in done}
    work = []
    for c in configs:
        if per[c] or (args.abort_load and c not in aborts_done):
            work += units([c], per[c], args.unit_s if args.gpus else None) or [(c, [])]
    if args.print_commands:
        for i, (c, u) in enumerate(work):
            print(f"# {c}: {', '.join(u) or '(aborts only)'}  (about {sum(map(estimate_s, u)):.0f} s of loads)")
            print(shlex.join(server_cmd(c, args, args.port + i)) if c not in args.urls else f"  --url {args.urls[c]}")
        return 0
    if args.vocab is None:
        args.vocab = _vocab(Path(args.model_dir))
    clock = Clock(args.deadline_s)
    table = Table(Path(args.out), Path(args.model_dir).name, args.base)
    if args.gpus:
        return run_parallel(work, args, clock)
    port = args.port
    for c, u in work:
        try:
            run_config(c, u, args, table, clock, port)
        except Exception as e:  # record and go on with the next configuration
            print(f"  [{c}] FAILED: {type(e).__name__}: {e}", flush=True)
            table.put(skipped={"load": ",".join(u), "config": c, "reason": f"{type(e).__name__}: {e}"[:1000],
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
        port += 1
    s = table.read()["summary"]
    print(f"results: {args.out}  (t+{clock.elapsed():.0f} s); checks: "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in s["checks"].items()), flush=True)
    return 0


def cmd_report(args) -> int:
    docs = [json.loads(Path(p).read_text()) for p in args.results]
    doc = docs[-1]
    if len(docs) > 1:  # merged by key, a later file's row wins
        merged = {}
        for d in docs:
            for r in d["rows"]:
                merged[row_key(r)] = r
        doc = {**doc, "rows": list(merged.values())}
    doc["summary"] = report.summary(doc["rows"])
    if args.resummarize:  # the summary's rules changed since the run: store what they give now
        if len(docs) > 1:
            raise SystemExit("--resummarize rewrites one results file; give one")
        doc["summary_recomputed_by"] = "python -m bench.serving_vs_fp8 report --resummarize"
        Path(args.results[-1]).write_text(json.dumps(doc, indent=1) + "\n")
    img = report.plot(doc, Path(args.img_dir) / args.image) if doc["rows"] else None
    src = os.path.relpath(Path(args.results[-1]).resolve(), (ROOT / "docs"))
    body = report.markdown(doc, src, img.name if img else None)
    print(body)
    if args.update_doc:
        report.update_doc(Path(args.update_doc), body)
        print(f"updated {args.update_doc}")
    return 0


def cmd_scheduler_rates(args) -> int:
    """Server-side decode and prefill rates of a finished run, from its server logs (runs before
    the rows recorded them): one row per log and piece between cache flushes with decode lines."""
    from bench._serving_server import loads_of_log, parse_decode_log, parse_prefill_log, prefill_rates, scheduler_rates

    run = json.loads(Path(args.run).read_text())
    rows = []
    for path in map(Path, args.logs):
        config = path.stem.rsplit("_", 1)[0]  # <config>_<port>.log, as run_config names them
        for i, piece in enumerate(loads_of_log(path.read_text(errors="replace"))):
            rates = scheduler_rates(parse_decode_log(piece))
            if rates:
                rows.append({"config": config, "log": path.name, "piece": i, **rates,
                             **prefill_rates(parse_prefill_log(piece))})
    doc = _results.document(run["model"], rows, device=run["device"], run=os.path.relpath(args.run, ROOT),
                            run_date=run["date"])
    print(json.dumps(rows, indent=1))
    if args.out:
        print(f"wrote {_results.write(args.out, doc)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving_vs_fp8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start servers and measure (GPU machine)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma list of: {', '.join(CONFIGS)}")
    r.add_argument("--loads", default=DEFAULT_LOADS, help="NxIN+OUT list (N = 1: batch-1 rows)")
    r.add_argument("--abort-load", default="64x2048+1024",
                   help="streams hung up on after 1-16 tokens, then the pool checked ('' = none)")
    r.add_argument("--warmup", default=DEFAULT_WARMUP, help="NxIN+OUT requests before the pool's start values")
    r.add_argument("--out", default=str(DEFAULT_OUT))
    r.add_argument("--base", default=str(DEFAULT_OUT),
                   help="rows to start from when --out does not exist yet ('' = none)")
    r.add_argument("--only-missing", action="store_true", help="skip (load, config) with a good row on file")
    r.add_argument("--deadline-s", type=float, default=None,
                   help="skip what its estimate says would end after this many seconds from the start")
    r.add_argument("--gpus", default=None, help="comma list of GPU ids: units run side by side, one per GPU")
    r.add_argument("--unit-s", type=float, default=300.0, help="with --gpus: estimated seconds per unit")
    r.add_argument("--print-commands", action="store_true", help="print the units and server commands, run nothing")
    r.add_argument("--url", action="append", default=[], metavar="CONFIG=URL",
                   help="measure a running server as CONFIG instead of starting one")
    r.add_argument("--model-dir", default=str(DEVKIT_MODELS / "llama31-8b"))
    r.add_argument("--tokenizer-dir", default=str(DEVKIT_MODELS / "smollm2-135m"))
    r.add_argument("--vocab", type=int, default=None, help="default: the model's config.json")
    r.add_argument("--mem-fraction-static", type=float, default=0.85)
    r.add_argument("--server-arg", action="append", default=[], help="extra server argument (--server-arg=--flag)")
    r.add_argument("--port", type=int, default=30200)
    r.add_argument("--logs", default="bench_out/serving_vs_fp8")
    r.add_argument("--startup-timeout", type=float, default=480)
    r.add_argument("--request-timeout", type=float, default=900)
    r.add_argument("--idle-timeout", type=float, default=60)
    r.add_argument("--side-by-side", type=int, default=1, help=argparse.SUPPRESS)
    r.set_defaults(func=cmd_run)
    q = sub.add_parser("report", help="markdown table + PNG plot from the results JSON")
    q.add_argument("results", nargs="*", default=[str(DEFAULT_OUT)],
                   help="results JSON files (merged by row key, later wins); default: the kept one")
    q.add_argument("--img-dir", default=str(ROOT / "docs" / "img"))
    q.add_argument("--image", default="serving_vs_fp8_h100.png")
    q.add_argument("--update-doc", default=None, help="replace the serving_vs_fp8 block of this markdown file")
    q.add_argument("--resummarize", action="store_true",
                   help="also write the recomputed summary (checks, ratios) back into the results file")
    q.set_defaults(func=cmd_report)
    g = sub.add_parser("scheduler-rates", help="the scheduler's decode rates at each load's full occupancy "
                       "and its prefill rates, from a finished run's server logs (what newer rows record "
                       "as scheduler_*)")
    g.add_argument("logs", nargs="+", help="server logs of one run (<config>_<port>.log from run --logs)")
    g.add_argument("--run", default=str(DEFAULT_OUT), help="the run's results JSON (its model, device and date)")
    g.add_argument("--out", default=None, help="write the rows as a results JSON here")
    g.set_defaults(func=cmd_scheduler_rates)
    args = p.parse_args(argv)
    if args.cmd == "run":  # what a child of --gpus repeats
        args.passthrough = [a for k in ("warmup", "model_dir", "tokenizer_dir", "logs") for a in
                            (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
        args.passthrough += [f"--mem-fraction-static={args.mem_fraction_static}",
                             *[f"--server-arg={a}" for a in args.server_arg]]
        if args.vocab is not None:
            args.passthrough += ["--vocab", str(args.vocab)]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
