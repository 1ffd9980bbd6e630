"""End-to-end serving benchmark: INT2 KV cache vs BF16 on the same GPU, in one run.

For every model and configuration (bf16 = stock SGLang, triton attention; int2 = oscar_sglang's
`--kv-cache-dtype int2 --attention-backend oscar_triton`; flashinfer = stock BF16 flashinfer) it
starts `python -m sglang.launch_server` with dummy weights and measures, over HTTP on 127.0.0.1:

  capacity     max_total_num_tokens and how many 32K-token requests fit at once;
  latency      batch-1 TTFT and TPOT at 8K / 32K / 128K context (as far as the model allows);
  attribution  a torch.profiler trace of decode steps (GPU kernel time per category vs GPU idle;
               --profile-batch requests decoding together);
  attribution_prefill  the same for the prefill steps of --profile-batch prompts sent at once;
  throughput   N requests at once (e.g. 64 x 32K prompt + 256 output): output tok/s, TTFT, TPOT;
  one_batch    `sglang.bench_one_batch` in-process batch-1 decode step (no scheduler, no HTTP).

Results go to OUT/results.json (bench/_results.py: date, device, model, command, one row per
(model, config) with its parts; rewritten after every measurement, so a cut-off run keeps what it
measured) plus server logs and, for throughput loads, OUT/<model>_<config>_timelines.json (every
request's token timestamps). `report` renders the markdown section and PNG plots from those files.
To keep a run, copy results.json to bench/results/serving/<date>_<time>_<configs>_<model>.json and
the timelines, gzipped as {"model/config": {...}}, to the same name with .timelines.json.gz.

The working tree plus the devkit carry must stay under 64 MiB: `bash bench/device_kit.sh` (once
after building the bundle) recompresses .devkit/sgl_bundle.tar.xz to fit, packs the SmolLM2
tokenizer and the dummy models' configs as .devkit/smollm2_tok.tar.xz (0.45 MB, instead of
carrying .devkit/models: 3.5 MB; .devkit/ is ignored, so nothing in it travels uncarried) and
prints the total. Carry .devkit/sgl_bundle.tar.xz, .devkit/device-env.sh and
.devkit/smollm2_tok.tar.xz, and unpack the last on the device (`mkdir -p .devkit/models && tar -C
.devkit/models -xJf .devkit/smollm2_tok.tar.xz`).

Run on the GPU machine from the project root (see ../shared/devkit/README.md):

    source .devkit/device-env.sh && python -m bench.serving run --configs bf16,int2 --out $OUT/serving
    python -m bench.serving report $OUT/serving/results.json   # tables + plots; --update-doc FILE writes them between its markers
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from bench import _results

ROOT = Path(__file__).resolve().parent.parent
DEVKIT_MODELS = ROOT / ".devkit" / "models"


def _parse_loads(text: str) -> List[tuple]:
    """'64x32768x256,128x8192x256' -> [(64, 32768, 256), (128, 8192, 256)]."""
    loads = []
    for item in filter(None, text.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"load {item!r} must be NxPROMPTxOUTPUT, e.g. 64x32768x256")
        loads.append(tuple(int(p) for p in parts))
    return loads


def _ints(text: str) -> List[int]:
    return [int(x) for x in filter(None, text.split(","))]


def _model_config(model: str) -> dict:
    path = DEVKIT_MODELS / model / "config.json"
    if not path.exists():
        raise SystemExit(f"model {model!r}: {path} not found; build the devkit "
                         "(bash ../shared/devkit/build-bundle.sh) or pass --models-dir")
    return json.loads(path.read_text())


class Results:
    """results.json, rewritten after every measurement: bench/_results.py's document (one row per
    (model, config)) plus `meta`, the run-wide settings the report prints."""

    def __init__(self, path: Path, meta: dict, models: List[str]):
        self.path = path
        self.data = _results.document(",".join(models), [], device=meta["gpu"], meta=meta)
        self.save()

    def run(self, model: str, config: str) -> dict:
        for row in self.data["rows"]:
            if (row["model"], row["config"]) == (model, config):
                return row
        self.data["rows"].append({"model": model, "config": config})
        return self.data["rows"][-1]

    def save(self) -> None:
        _results.write(self.path, self.data)


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:
        return "unknown"


# ---------------------------------------------------------------------------------------- parts

def part_capacity(server, info: dict, rec: dict, max_pos: int) -> None:
    tokens = int(info.get("max_total_num_tokens") or info["internal_states"][0].get(
        "max_total_num_tokens", 0))
    mrr = (rec.get("oscar_int2") or {}).get("max_running_requests") or info.get(
        "max_running_requests")
    fit = tokens // (32768 + 256)
    rec["capacity"] = {
        "max_total_num_tokens": tokens,
        "max_running_requests": mrr,
        "context_length": info.get("context_length") or max_pos,
        # KV-limited count, and the scheduler's request cap when one is set (int2 sizes one)
        "fit_32k_requests": min(fit, mrr) if mrr else fit,
        "startup_s": server.startup_s,
    }
    print(f"  capacity: {tokens:,} KV tokens -> {fit} requests of 32K+256 by KV "
          f"(max_running_requests={mrr})", flush=True)


def part_latency(server, rec: dict, contexts: List[int], out_len: int, vocab: int) -> None:
    from bench._serving_client import inter_token_ms, random_prompts, run_requests
    from bench._serving_server import log_size, log_slice, parse_decode_log

    import numpy as np

    rec.setdefault("latency", {})
    for ctx in contexts:
        off = log_size(server.log_path)
        # prompt + output stays a few tokens inside the context window (SGLang rejects == limit)
        prompt = random_prompts(1, ctx - out_len - 8, vocab, seed=ctx)[0]
        r = run_requests(server.url, [prompt], out_len, f"batch-1 {ctx // 1024}K")[0]
        if r.error or r.first_token is None:
            rec["latency"][str(ctx)] = {"error": r.error or "no token"}
            print(f"  batch-1 at {ctx}: FAILED {r.error}", flush=True)
            continue
        gaps = inter_token_ms(r)[4:]  # skip the first few steps (graph warm-up after prefill)
        dec = parse_decode_log(log_slice(server.log_path, off))
        rec["latency"][str(ctx)] = {
            "ttft_s": r.ttft, "tpot_ms_mean": r.tpot * 1e3,
            "tpot_ms_median": float(np.median(gaps)) if gaps else None,
            "tpot_ms_p90": float(np.percentile(gaps, 90)) if gaps else None,
            "output_tokens": r.output_tokens,
            "cuda_graph": all(d["cuda_graph"] for d in dec) if dec else None,
        }
        print(f"  batch-1 at {ctx:>6}: TTFT {r.ttft:6.2f} s, TPOT median "
              f"{rec['latency'][str(ctx)]['tpot_ms_median']:.2f} ms (mean {r.tpot * 1e3:.2f}), "
              f"cuda graph {rec['latency'][str(ctx)]['cuda_graph']}", flush=True)


def part_fresh(server, rec: dict, ctx: int, vocab: int, when: str) -> None:
    """TTFT of one ctx-token prompt: `fresh` = the first request the server sees (kernels that
    compile on first use show here), `warm` = the same size after the warm-up requests."""
    from bench._serving_client import random_prompts, run_requests

    prompt = random_prompts(1, ctx - 16, vocab, seed=ctx + (when == "warm"))[0]
    r = run_requests(server.url, [prompt], 8, f"{when} {ctx // 1024}K")[0]
    d = rec.setdefault("fresh_ttft", {"context": ctx})
    d[f"{when}_ttft_s"] = None if r.error else r.ttft
    if r.error:
        d[f"{when}_error"] = r.error
    print(f"  {when} TTFT at {ctx}: {r.ttft if not r.error else r.error}", flush=True)


def _wait_for_trace(folder: Path, timeout_s: float) -> list:
    """The scheduler exports the trace asynchronously: wait until a file exists and stops growing."""
    from bench._serving_trace import find_traces

    deadline, last = time.time() + timeout_s, None
    while time.time() < deadline:
        traces = find_traces(folder)
        sizes = [t.stat().st_size for t in traces]
        if traces and sizes == last:
            return traces
        last = sizes if traces else None
        time.sleep(1.5)
    return find_traces(folder)


def _start_profile(server, prof_dir: Path, prefix: str, num_steps: int) -> None:
    """Ask the server to profile its next num_steps forward steps into prof_dir."""
    from bench._serving_server import post_json

    try:
        post_json(server.url + "/start_profile", {
            "output_dir": str(prof_dir), "num_steps": num_steps, "activities": ["CPU", "GPU"],
            "with_stack": False, "record_shapes": False, "profile_prefix": prefix})
    except Exception as e:
        print(f"  start_profile failed: {e}", flush=True)


def _analyze_profile(prof_dir: Path, keep_traces: bool, stage: str, label: str) -> dict:
    """The step attribution of the trace the server wrote into prof_dir (its `stage` spans:
    DECODE or EXTEND), or {"error": ...}, printed under `label`; the traces are deleted unless
    keep_traces."""
    from bench._serving_trace import analyze, format_attribution

    traces = _wait_for_trace(prof_dir, timeout_s=90)
    a = analyze(traces[-1], stage=stage) if traces else {"error": "no trace written"}
    if "error" in a:
        print(f"  {label}: {a['error']}", flush=True)
    else:
        print(f"  {label}:\n{format_attribution(a)}", flush=True)
    if not keep_traces:
        for t in traces:
            t.unlink()
    return a


def part_attribution(server, rec: dict, contexts: List[int], vocab: int, out_dir: Path,
                     tag: str, keep_traces: bool, batch: int = 1) -> None:
    """Profile ~30 decode steps of `batch` requests in the live server and split the step time."""
    import threading

    from bench._serving_client import random_prompts, run_requests

    rec.setdefault("attribution", {})
    if batch > 1:
        rec["attribution_batch"] = batch
    for ctx in contexts:
        prof_dir = out_dir / "traces" / f"{tag}_{ctx}"
        prof_dir.mkdir(parents=True, exist_ok=True)
        prompts = random_prompts(batch, ctx - 308, vocab, seed=ctx + 1)
        # A batch's prefills run one after another while the earlier requests decode: each asks
        # for enough tokens that none finishes before the last has started (~30 ms a prefill
        # chunk and a step each, at most)
        out_len = 300 if batch == 1 else 300 + 2 * batch * max(1, ctx // 8192) * 8
        started = threading.Semaphore(0)
        th = threading.Thread(target=run_requests, args=(server.url, prompts, out_len,
                              f"profile {batch} x {ctx // 1024}K"), kwargs={"on_first_token": started.release})
        th.start()
        # Profile decode steps only: start once every request's first token (end of its prefill)
        # has arrived
        t_wait = time.time()
        for _ in range(batch):
            started.acquire(timeout=max(1.0, 600 - (time.time() - t_wait)))
        time.sleep(0.5)
        _start_profile(server, prof_dir, f"{tag}_{ctx}", 30)
        th.join()
        rec["attribution"][str(ctx)] = _analyze_profile(prof_dir, keep_traces, "DECODE",
                                                        f"attribution at {ctx} (server, batch {batch})")


def part_attribution_prefill(server, rec: dict, contexts: List[int], vocab: int, out_dir: Path,
                             tag: str, keep_traces: bool, batch: int = 8) -> None:
    """Profile the prefill steps of `batch` prompts of each context sent at once (the scheduler
    runs their prefills before any decode step) and split a prefill step's time."""
    from bench._serving_client import random_prompts, run_requests

    rec.setdefault("attribution_prefill", {})
    rec["attribution_prefill_batch"] = batch
    for ctx in contexts:
        prof_dir = out_dir / "traces" / f"{tag}_prefill_{ctx}"
        prof_dir.mkdir(parents=True, exist_ok=True)
        # armed before the prompts arrive: its steps are their prefill chunks
        _start_profile(server, prof_dir, f"{tag}_prefill_{ctx}", min(batch, 12))
        run_requests(server.url, random_prompts(batch, ctx, vocab, seed=ctx + 2), 2,
                     f"profile prefill {batch} x {ctx // 1024}K")
        rec["attribution_prefill"][str(ctx)] = _analyze_profile(
            prof_dir, keep_traces, "EXTEND", f"prefill attribution at {ctx} (server, {batch} prompts)")


def part_throughput(server, rec: dict, loads: List[tuple], vocab: int, out_dir: Path,
                    tag: str) -> None:
    from bench._serving_client import random_prompts, run_requests, summarize, timelines
    from bench._serving_server import log_size, log_slice, parse_decode_log

    rec.setdefault("throughput", {})
    for n, p, o in loads:
        key = f"{n}x{p}x{o}"
        off = log_size(server.log_path)
        prompts = random_prompts(n, p, vocab, seed=n * 7 + p)
        t0 = time.time()
        records = run_requests(server.url, prompts, o, f"load {key}", timeout_s=1200)
        s = summarize(records)
        dec = parse_decode_log(log_slice(server.log_path, off))
        s["server_max_running"] = max((d["running"] for d in dec), default=None)
        s["server_peak_gen_tok_s"] = max((d["gen_tok_s"] for d in dec), default=None)
        s["cuda_graph_all"] = all(d["cuda_graph"] for d in dec) if dec else None
        s["wall_s"] = time.time() - t0
        rec["throughput"][key] = s
        # every request's token timestamps, for the phase split and the timeline plot
        tl_path = out_dir / f"{tag}_timelines.json"
        tl = json.loads(tl_path.read_text()) if tl_path.exists() else {}
        tl[key] = timelines(records)
        tl_path.write_text(json.dumps(tl, separators=(",", ":")))
        ps = s.get("phase_split") or {}
        if ps:
            print(f"  load {key}: {ps['decode_s']:.1f} s decoding, {ps['other_s']:.1f} s prefill/other "
                  f"(gaps > {ps['max_step_s'] * 1e3:.0f} ms between tokens)", flush=True)
        if s.get("ok"):
            print(f"  load {key}: {s['ok']}/{n} ok, {s['output_tok_s']:.0f} output tok/s overall, "
                  f"{(s['full_occupancy_decode']['tok_s'] or float('nan')):.0f} tok/s at full occupancy "
                  f"({s['full_occupancy_decode']['requests']} decoding), TTFT p50 {s['ttft_s']['p50']:.1f} s"
                  f", TPOT p50 {s['tpot_ms']['p50']:.1f} ms, max concurrent {s['max_concurrent_decoding']}"
                  f" (server max running {s['server_max_running']})", flush=True)
        else:
            print(f"  load {key}: all failed: {s.get('errors')}", flush=True)


def part_one_batch(model_dir: Path, tok_dir: Path, config, rec: dict, contexts: List[int],
                   mem_fraction: float, out_dir: Path, tag: str, keep_traces: bool,
                   timeout_s: float) -> None:
    """Batch-1 decode step measured in-process by sglang.bench_one_batch (no scheduler/HTTP)."""
    from bench._serving_trace import analyze, find_traces, format_attribution

    prof_dir = out_dir / "traces" / f"{tag}_one_batch"
    prof_dir.mkdir(parents=True, exist_ok=True)
    result_file = out_dir / f"{tag}_one_batch.jsonl"
    launcher = [sys.executable, "-m", "sglang.bench_one_batch"]
    if config.name.startswith("int2"):  # bench_one_batch parses args before plugins load (integration map §1.2)
        launcher = ["oscar-sglang", "run", "sglang.bench_one_batch"]
    cmd = launcher + [
        "--model-path", str(model_dir), "--tokenizer-path", str(tok_dir),
        "--load-format", "dummy", "--sampling-backend", "pytorch", "--grammar-backend", "none",
        "--disable-prefill-cuda-graph", "--mem-fraction-static", str(mem_fraction),
        *config.args, "--batch-size", "1", "--input-len", *map(str, contexts),
        "--output-len", "64", "--result-filename", str(result_file),
        "--profile", "--profile-stage", "decode", "--profile-start-step", "40",
        "--profile-steps", "10",
    ]
    env = {**os.environ, **config.env, "SGLANG_TORCH_PROFILER_DIR": str(prof_dir)}
    log = out_dir / f"{tag}_one_batch.log"
    print(f"  bench_one_batch: {' '.join(cmd[:6])} ... (log {log.name})", flush=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = {"returncode": rc, "runs": []}
    if result_file.exists():
        out["runs"] = [json.loads(line) for line in result_file.read_text().splitlines() if line]
    for r in out["runs"]:
        print(f"  one_batch in={r['input_len']}: median decode step "
              f"{r.get('median_decode_latency', float('nan')) * 1e3:.2f} ms", flush=True)
    traces = find_traces(prof_dir)
    out["attribution"] = [analyze(t) for t in traces]
    for a in out["attribution"]:
        print(format_attribution(a), flush=True)
    if not keep_traces:
        for t in traces:
            t.unlink()
    if rc != 0:
        print(f"  bench_one_batch exited {rc}; log tail:\n" +
              "\n".join(log.read_text(errors="replace").splitlines()[-15:]), flush=True)
    rec["one_batch"] = out


# ---------------------------------------------------------------------------------------- main

def cmd_run(args) -> int:
    from bench._launcher import SPEED, Server
    from bench._serving_server import CONFIGS, server_command

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; choose from {', '.join(CONFIGS)}")
    default_parts = set(args.parts.split(","))
    part_overrides = {}  # "config" or "model/config" -> parts
    for item in args.config_parts:
        key, _, val = item.partition("=")
        part_overrides[key] = set(filter(None, val.split(",")))
    extra_env = dict(kv.split("=", 1) for kv in args.int2_env)
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "gpu": _gpu_name(), "argv": sys.argv, "mem_fraction_static": args.mem_fraction_static,
        "configs": configs, "quick": args.quick,
    }
    res = Results(out_dir / "results.json", meta, args.models.split(","))
    t_begin = time.time()
    port = args.port
    for model in args.models.split(","):
        cfg = _model_config(model)
        vocab, max_pos = cfg["vocab_size"], cfg["max_position_embeddings"]
        lat_ctx = [c for c in _ints(args.latency_contexts) if c <= max_pos]
        prof_ctx = [c for c in _ints(args.profile_contexts) if c <= max_pos]
        loads = [ld for ld in _parse_loads(args.loads) if ld[1] + ld[2] <= max_pos] \
            if model in args.throughput_models.split(",") else []
        for name in configs:
            config = CONFIGS[name]
            parts = part_overrides.get(f"{model}/{name}", part_overrides.get(name, default_parts))
            if not parts:
                continue
            rec = res.run(model, name)
            tag = f"{model}_{name}"
            print(f"\n=== {model} / {config.label}  (t+{time.time() - t_begin:.0f} s)", flush=True)
            env = dict(config.env)
            if name.startswith("int2"):
                env.update(extra_env)
            extra = list(args.server_arg)
            if "server" in parts or parts & {"capacity", "fresh", "latency", "attribution",
                                             "attribution_prefill", "throughput"}:
                cmd = server_command(DEVKIT_MODELS / model, DEVKIT_MODELS / args.tokenizer,
                                     config, port, args.mem_fraction_static, extra)
                rec["server_cmd"] = " ".join(cmd[1:])
                rec["server_env"] = env
                try:
                    with Server(cmd, env, out_dir / f"{tag}_server.log", port, **SPEED) as server:
                        server.wait_ready(args.startup_timeout)
                        info = server.server_info()
                        rec["server_info_subset"] = {k: info.get(k) for k in (
                            "max_total_num_tokens", "max_running_requests", "chunked_prefill_size",
                            "cuda_graph_max_bs", "context_length", "kv_cache_dtype",
                            "triton_attention_num_kv_splits", "stream_interval",
                            "attention_backend", "disable_overlap_schedule", "page_size")}
                        states = info.get("internal_states") or [{}]
                        if isinstance(states[0], dict) and "oscar_int2" in states[0]:
                            rec["oscar_int2"] = states[0]["oscar_int2"]  # plugin's own report
                        part_capacity(server, info, rec, max_pos)
                        res.save()
                        if "fresh" in parts:  # before any warm-up request: the first long prompt
                            part_fresh(server, rec, args.fresh_context, vocab, "fresh")
                        if parts & {"latency", "attribution", "attribution_prefill", "throughput", "fresh"}:
                            # warm-up, so Triton JIT compiles stay out of the numbers: a short
                            # prompt, and one of two prefill chunks (the cached-prefix path)
                            from bench._serving_client import random_prompts, run_requests
                            run_requests(server.url, random_prompts(2, 1024, vocab, 0), 16,
                                         "warm-up")
                            run_requests(server.url, random_prompts(1, 12000, vocab, 1), 16,
                                         "warm-up prefix")
                        if "fresh" in parts:
                            part_fresh(server, rec, args.fresh_context, vocab, "warm")
                            res.save()
                        if "latency" in parts and lat_ctx:
                            part_latency(server, rec, lat_ctx, args.latency_output, vocab)
                            res.save()
                        if "attribution" in parts and prof_ctx:
                            part_attribution(server, rec, prof_ctx, vocab, out_dir, tag,
                                             args.keep_traces, args.profile_batch)
                            res.save()
                        if "attribution_prefill" in parts and prof_ctx:
                            part_attribution_prefill(server, rec, prof_ctx, vocab, out_dir, tag,
                                                     args.keep_traces, max(2, args.profile_batch))
                            res.save()
                        if "throughput" in parts and loads:
                            part_throughput(server, rec, loads, vocab, out_dir, tag)
                            res.save()
                except Exception as e:  # record and go on with the next configuration
                    rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                    print(f"  FAILED: {rec['error']}", flush=True)
                    res.save()
            port += 1
            if "one_batch" in parts and prof_ctx:
                part_one_batch(DEVKIT_MODELS / model, DEVKIT_MODELS / args.tokenizer, config, rec,
                               prof_ctx, args.mem_fraction_static, out_dir, tag, args.keep_traces,
                               args.one_batch_timeout)
                res.save()
    res.data["meta"]["wall_s"] = time.time() - t_begin
    res.save()
    print(f"\nresults: {res.path}  (total {time.time() - t_begin:.0f} s)", flush=True)
    return 0


def cmd_report(args) -> int:
    from bench._serving_report import render

    return render([Path(p) for p in args.results], Path(args.img_dir), args.update_doc)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch servers and measure (GPU machine)")
    r.add_argument("--configs", default="bf16",
                   help="comma list of bench/_serving_server.py CONFIGS (e.g. int2, fp8-flashinfer, flashinfer, "
                        "int2-fused-store; an unknown name lists them all)")
    r.add_argument("--models", default="qwen3-8b,llama31-8b",
                   help="devkit model folders under .devkit/models (dummy weights)")
    r.add_argument("--tokenizer", default="smollm2-135m")
    r.add_argument("--parts", default="capacity,latency,attribution,throughput",
                   help="comma list of: capacity, fresh, latency, attribution (decode steps), "
                        "attribution_prefill (prefill steps), throughput, one_batch")
    r.add_argument("--config-parts", action="append", default=[], metavar="[MODEL/]CONFIG=PARTS",
                   help="parts for one configuration instead of --parts, e.g. "
                        "bf16-splits64=latency or qwen3-8b/int2=capacity (empty = skip it)")
    r.add_argument("--mem-fraction-static", type=float, default=0.85)
    r.add_argument("--latency-contexts", default="8192,32768,131072",
                   help="batch-1 contexts (prompt + output); those above the model's limit are skipped")
    r.add_argument("--latency-output", type=int, default=128)
    r.add_argument("--fresh-context", type=int, default=32768,
                   help="part `fresh`: TTFT of the first prompt of this length on a fresh server, "
                        "and of one more after the warm-up requests (default 32768)")
    r.add_argument("--profile-contexts", default="1024,32768")
    r.add_argument("--profile-batch", type=int, default=1,
                   help="requests decoding together while the attribution part profiles (each of "
                        "the context's length; sent at once, profiled once all have started)")
    r.add_argument("--loads", default="64x32768x256,128x8192x256", help="NxPROMPTxOUTPUT list")
    r.add_argument("--throughput-models", default="qwen3-8b")
    r.add_argument("--quick", action="store_true",
                   help="smaller loads (16x32768x256,32x8192x256) to fit one 600 s device call")
    r.add_argument("--int2-env", action="append", default=[], metavar="KEY=VAL",
                   help="environment for the int2 server (see docs/serving.md)")
    r.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for every server (repeat; use --server-arg=--flag)")
    r.add_argument("--port", type=int, default=30100)
    r.add_argument("--startup-timeout", type=float, default=420)
    r.add_argument("--one-batch-timeout", type=float, default=300)
    r.add_argument("--keep-traces", action="store_true")
    r.add_argument("--out", default="bench_out/serving")
    r.set_defaults(func=cmd_run)
    q = sub.add_parser("report", help="markdown tables + PNG plots from results.json")
    q.add_argument("results", nargs="+",
                   help="results.json files, merged in order (a later (model, config) entry wins)")
    q.add_argument("--img-dir", default=str(ROOT / "docs" / "img"))
    q.add_argument("--update-doc", default=None,
                   help="replace the '## Serving' section of this markdown file")
    q.set_defaults(func=cmd_report)
    args = p.parse_args(argv)
    if getattr(args, "quick", False) and args.loads == "64x32768x256,128x8192x256":
        args.loads = "16x32768x256,32x8192x256"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
