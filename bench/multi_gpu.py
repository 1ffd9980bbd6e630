"""The INT2 KV cache on two GPUs: tensor parallelism with today's default format, and data
parallelism (SGLang's --dp-size, dp attention, servers behind sglang-router), each against FP8
and BF16 measured in the same run, one results JSON (default bench/results/multi_gpu_h200x2.json).

Every server is bench/serving_vs_fp8.py's (dummy-weight Llama-3.1-8B, the devkit flags of
bench/_serving_server.py, its CONFIGS int2 / fp8-flashinfer (FP8 e4m3 on FlashInfer) /
flashinfer (BF16 on FlashInfer), --mem-fraction-static 0.85) with the topology's flags and
`--enable-metrics --enable-metrics-for-all-schedulers`; its measurements are serving_vs_fp8's
(measure: N random-token requests at once, output tok/s, TTFT, TPOT; its aborted streams; its
pool state after idle + /flush_cache), on the GPUs of --gpus (default 0,1). Two parts (--part,
comma-separated; default tp,dp), one job (one server, or one pair) after another:

  tp   tp-<config>  `--tp-size 2` on both GPUs (CUDA_VISIBLE_DEVICES=0,1) for int2, fp8-flashinfer
                    and flashinfer: KV tokens (/server_info max_total_num_tokens) and the loads of
                    --tp-loads (default 256x2048+256, 64x8192+512); int2 also --abort-load
                    (64 streams of 2048 + 1024 tokens hung up on after 1-16 tokens).
       tap          an int2 TP 2 server with the debug tap (OSCAR_DEBUG_TAP_DIR, OSCAR_DEBUG_TAP_LAYER
                    = --tap-layer; --disable-radix-cache --chunked-prefill-size 4096, as
                    bench/server_e2e.py's noradix phase): one 10K-token request prefilled in three
                    chunks, then every rank's attention output of the tapped layer against the INT2
                    design emulated in float64 and its stored keys and values read back
                    (server_e2e.analyse_ranks: rel_err_server_vs_int2_emulation,
                    rel_err_stored_k/v_vs_emulation, ok per rank).
  dp   dp-<config>  `--dp-size 2` (one TP 1 scheduler per GPU, SGLang's own dispatcher).
       router-<config>  two TP 1 servers, one per GPU, behind `python -m sglang_router.launch_router
                    --worker-urls <both> --policy round_robin` (--router-policy); the first server
                    alone gives the "single" rows (one server, one GPU) before the router starts.
                    Without the sglang_router module the router rows say so (failed rows) and the
                    single rows are still measured.
       dp-attention-<config>  `--tp-size 2 --dp-size 2 --enable-dp-attention`: SGLang documents dp
                    attention for DeepSeek and Qwen MoE models; if it refuses Llama, the rows are
                    failed rows holding its refusal (the server log's tail), and the flashinfer job
                    is skipped once int2 and fp8-flashinfer were both refused in this run.
       Each dp topology runs --dp-loads (default 512x2048+256: 256 requests a GPU, the TP table's
       first load per GPU), and int2 the aborted streams.

Every row keeps the pool against its job's start per rank (pool_ranks: each DP rank's /v1/loads
used tokens and /server_info oscar_int2 free tokens and request rows, each router worker's;
pool_leak_tokens the largest) and each scheduler's gauges from /metrics (schedulers:
sglang:num_used_tokens, num_running_reqs, token_usage and the plugin's sglang:oscar_int2_*, keyed
by tp_rank / dp_rank: TP rank 1 has no /server_info entry of its own, its gauges are the evidence).
After the aborts the gauges are read again until every scheduler shows 0 used tokens (up to
--metrics-wait-s). Rows record the run tag (--run, default the UTC date): a baseline counts only
from the same run.

The results file (--out) is merged like spec_decode.py's: rows already in --out (or, when it does
not exist yet, in --base) stay, a new row replaces the one with its key (part, topology, config,
load), and the summary is recomputed over all rows and written after every row: per topology and
load, int2 with its same-run fp8-flashinfer and flashinfer rows (output_tok_s and KV tokens of
each, int2 over FP8 and BF16, each dp topology over the single server); int2's pool leak 0 on
every rank after the aborts; int2's gauges from every scheduler; the tap ok on every rank; dp
attention either measured or refused by SGLang for FP8 too. A check without its numbers fails and
is named in not_measured. A server that does not start is a failed row with its log's tail.
--only-missing skips jobs whose rows of this run are on file and good; --deadline-s skips jobs
(and loads) whose estimate would end past it (they stay missing for the next call);
--print-commands prints the jobs, their estimates and the servers' commands only.

Device runs (nvidia-h200-x2), bench/run_stages.sh's `multi-gpu` stage, the same command every
call, until the summary names nothing missing:

  MG_PARTS=tp,dp MACHINE=h200x2 bash bench/run_stages.sh multi-gpu

It runs `python -m bench.multi_gpu --part $MG_PARTS --gpus 0,1 --only-missing --deadline-s 520
--out $OUT/multi_gpu_h200x2.json --base bench/results/multi_gpu_h200x2.json`; copy the file back to
bench/results/multi_gpu_h200x2.json after every call (the next call's --base). Carry
.devkit/device-env.sh and .devkit/smollm2_tok.tar.xz always; .devkit/sgl_bundle.tar.xz in the
first call (the warm machine keeps it unpacked); for the router jobs the sglang-router wheel in
.devkit/router (`pip download --no-deps --only-binary :all: sglang-router -d .devkit/router`,
0.3.2: 31 MB, so not in the bundle's call: the stage installs it into the unpacked bundle, where
it stays while the machine is warm).

Estimated (not yet timed on 2 GPUs; server starts from bench/serving_vs_fp8.py's notes: an int2
server ~280 s on a fresh machine (Triton and FlashInfer compilation), ~110 s once one started;
FlashInfer FP8 or BF16 ~170 s the first time; a TP 2 or DP 2 start budgeted like those; loads at
serving_vs_fp8.estimate_s's one-GPU rates): tp-int2 ~6.5 min, tap ~3, tp-fp8-flashinfer and
tp-flashinfer ~4 each, dp-* ~3-3.5, router-* ~4-4.5, dp-attention-* ~3-3.5 if SGLang runs it
(well under a minute if it refuses at start). With --deadline-s 520 a job starts only if its
whole estimate fits, so the calls run (--print-commands gives each job's estimate):
  (1) bundle -> tp-int2;  (2) .devkit/router -> tap, tp-fp8-flashinfer;  (3) tp-flashinfer, dp-int2;
  (4) dp-fp8-flashinfer, dp-flashinfer;  (5) router-int2, dp-attention-int2;  (6) router-fp8-flashinfer,
  dp-attention-fp8-flashinfer;  (7) router-flashinfer, dp-attention-flashinfer (skipped when refused);
about 55 minutes of device time with each call's set-up. A fresh machine (one released in between)
needs the bundle again, and the router wheel before the router jobs.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import random
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from bench import _results
from bench.spec_decode import DEVKIT_MODELS, _choices, _csv

DEFAULT_OUT = _results.RESULTS / "multi_gpu_h200x2.json"

PARTS = ("tp", "dp")
CONFIG_NAMES = ("int2", "fp8-flashinfer", "flashinfer")  # bench/_serving_server.py CONFIGS
INT2, FP8, BF16 = CONFIG_NAMES
DEFAULT_TP_LOADS = "256x2048+256,64x8192+512"
DEFAULT_DP_LOADS = "512x2048+256"
DEFAULT_ABORT_LOAD = "64x2048+1024"
METRICS_FLAGS = ["--enable-metrics", "--enable-metrics-for-all-schedulers"]
# the tap request, as bench/server_e2e.py's noradix phase: 10K tokens in three 4K chunks (its
# analyse_tap keeps the chunks of requests up to 10K tokens), four output tokens
TAP_TOKENS, TAP_OUTPUT, TAP_CHUNK = 10000, 4, 4096
TAP_SETTLE_S = 8.0  # after ready: SGLang's own warm-up request done (the tap records batch size 1)
DP_ATTENTION = "dp-attention"
# each topology's part: tp, tap (the tp part); single (the router job's first server alone), dp,
# router, dp-attention (the dp part)
PART_OF = {"tp": "tp", "tap": "tp", "single": "dp", "dp": "dp", "router": "dp", DP_ATTENTION: "dp"}

# time estimates (s) for --deadline-s: a server start on a fresh machine (compilation) and on one
# where a server of the configuration already started (marker files under /tmp); a 2-GPU start
# is budgeted like a one-GPU one (the ranks compile at once)
START_FRESH_S = {INT2: 280.0, FP8: 170.0, BF16: 170.0}
START_WARM_S = 110.0
POOL_S = 8.0       # one pool check (idle + flush) and the gauges, per row
ABORTS_S = 30.0    # the aborted streams and their pool check
TAP_S = 60.0       # the tap request and the float64 analysis of both ranks
STARTED_DIR = Path("/tmp/oscar_multi_gpu_started")  # a file per configuration started on this machine

SCHEDULER_GAUGES = ("sglang:num_used_tokens", "sglang:num_running_reqs", "sglang:token_usage")
OSCAR_GAUGE = "sglang:oscar_int2_"


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _f(x, fmt="{:,.0f}"):
    return "-" if x is None else fmt.format(x)


def abort_name(load: str) -> str:
    return f"{load} aborted"


def tap_name() -> str:
    return f"1x{TAP_TOKENS}+{TAP_OUTPUT}"


def row_key(row: dict) -> tuple:
    return row.get("part"), row.get("topology"), row.get("config"), row.get("load")


def failed(row: dict) -> bool:
    from bench.render_docs import failed as _failed

    return _failed(row)


# ------------------------------------------------------------------------------ jobs


@dataclasses.dataclass
class Job:
    """One server (or a pair behind the router) and the rows it measures."""

    name: str
    topology: str   # tp, tap, dp, router (its rows: single and router), dp-attention
    config: str     # bench/_serving_server.py CONFIGS name
    port: int

    @property
    def part(self) -> str:
        return PART_OF[self.topology]

    @property
    def kv(self) -> str:
        from bench._serving_server import CONFIGS, kv_and_backend

        return kv_and_backend(CONFIGS[self.config])[0]

    def keys(self, args) -> List[tuple]:
        """The row keys this job writes."""
        if self.topology == "tap":
            return [("tp", "tap", self.config, tap_name())]
        loads = args.tp_loads if self.topology == "tp" else args.dp_loads
        topos = ["single", "router"] if self.topology == "router" else [self.topology]
        keys = [(self.part, t, self.config, ld) for t in topos for ld in loads]
        if self.kv == "int2" and args.abort_load:
            keys.append((self.part, topos[-1], self.config, abort_name(args.abort_load)))
        return keys


def all_jobs(base_port: int) -> List[Job]:
    """Every job, in run order; each keeps its ports whichever are selected."""
    names = ([("tp", INT2), ("tap", INT2), ("tp", FP8), ("tp", BF16)]
             + [("dp", c) for c in CONFIG_NAMES] + [("router", c) for c in CONFIG_NAMES]
             + [(DP_ATTENTION, c) for c in CONFIG_NAMES])
    return [Job("tap" if t == "tap" else f"{t}-{c}", t, c, base_port + 100 * i) for i, (t, c) in enumerate(names)]


def gpu_count(args) -> int:
    return len(args.gpu_list)


def topology_flags(topology: str, n: int) -> List[str]:
    if topology in ("tp", "tap"):
        return ["--tp-size", str(n)]
    if topology == "dp":
        return ["--dp-size", str(n)]
    if topology == DP_ATTENTION:
        return ["--tp-size", str(n), "--dp-size", str(n), "--enable-dp-attention"]
    return []  # router workers and the single server: one GPU each


def _without_nccl_port(cmd: List[str]) -> List[str]:
    """The command without --nccl-port: with --dp-size every DP group would take that one port
    (PortArgs.init_new returns it for each, the DP controller binds it per group), so SGLang
    picks free ones (these servers run alone)."""
    out, skip = [], False
    for a in cmd:
        if skip:
            skip = False
            continue
        if a == "--nccl-port":
            skip = True
            continue
        out.append(a)
    return out


def server_cmd(job: Job, args, port: int) -> List[str]:
    from bench._serving_server import CONFIGS, server_command

    extra = topology_flags(job.topology, gpu_count(args))
    if job.topology == "tap":
        extra += ["--disable-radix-cache", "--chunked-prefill-size", str(TAP_CHUNK)]
    else:
        extra += METRICS_FLAGS
    cmd = server_command(Path(args.model_dir), Path(args.tokenizer_dir), CONFIGS[job.config], port,
                         args.mem_fraction_static, [*extra, *args.server_arg])
    return _without_nccl_port(cmd) if job.topology in ("dp", DP_ATTENTION) else cmd


def tap_dir(job: Job, args) -> Path:
    """The tap's files (q, k, v and outputs of every chunk, tens of MB a rank): outside --logs, so
    that a device call's $OUT brings back the logs only; the row keeps the analysis."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"oscar_multi_gpu_tap_{job.port}"


def server_env(job: Job, args, gpus: List[str]) -> Dict[str, str]:
    from bench._serving_server import CONFIGS

    env = {**CONFIGS[job.config].env, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    if job.topology == "tap":
        env.update(OSCAR_DEBUG_TAP_DIR=str(tap_dir(job, args)), OSCAR_DEBUG_TAP_LAYER=str(args.tap_layer))
    return env


def worker_ports(job: Job, args) -> List[int]:
    """Router workers: one per GPU, 10 ports apart (their NCCL ports, +5, too)."""
    return [job.port + 10 * i for i in range(gpu_count(args))]


def router_port(job: Job) -> int:
    return job.port + 50


def router_cmd(job: Job, args, worker_urls: List[str]) -> List[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--host", "127.0.0.1", "--port", str(router_port(job)), "--policy", args.router_policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(router_port(job) + 1),
            *args.router_arg]


def servers(job: Job, args) -> List[tuple]:
    """(name, cmd, env, port) of the job's SGLang servers (the router is started separately)."""
    if job.topology == "router":
        return [(f"worker{i}", server_cmd(job, args, p), server_env(job, args, [g]), p)
                for i, (p, g) in enumerate(zip(worker_ports(job, args), args.gpu_list))]
    return [("server", server_cmd(job, args, job.port), server_env(job, args, args.gpu_list), job.port)]


def router_available() -> Optional[str]:
    """None when sglang_router can be imported here; else why not (the row says it)."""
    if importlib.util.find_spec("sglang_router") is None:
        return ("the sglang_router module is not installed (carry the sglang-router wheel in "
                ".devkit/router: bench/run_stages.sh's multi-gpu stage installs it)")
    return None


def _started_marker(config: str) -> Path:
    return STARTED_DIR / config


def start_estimate_s(config: str) -> float:
    return START_WARM_S if _started_marker(config).exists() else START_FRESH_S[config]


def job_estimate_s(job: Job, args, first_only: bool = False) -> float:
    """Seconds the job takes (start, loads, pool checks, aborts), or its start and first load."""
    from bench import serving_vs_fp8 as vs

    t = start_estimate_s(job.config)
    if job.topology == "tap":
        return t + TAP_S
    loads = args.tp_loads if job.topology == "tp" else args.dp_loads
    per = [vs.estimate_s(ld, None, job.kv) + POOL_S for ld in loads]
    if job.topology == "router":
        per = per + per  # the single server, then the pair
    if first_only:
        return t + (per[0] if per else 0)
    aborts = ABORTS_S if job.kv == "int2" and args.abort_load else 0.0
    return t + sum(per) + aborts


def expected_schedulers(topology: str, n: int) -> int:
    """Scheduler processes of a server (router: of both workers): TP 2 and DP attention run one
    per TP rank, --dp-size 2 one per DP group, the router's workers one each."""
    return 1 if topology == "single" else n


def expected_pool_ranks(topology: str, n: int) -> int:
    """Pools /server_info reports (one per DP group; router: per worker); TP 2 reports rank 0's."""
    return 1 if topology in ("tp", "single") else n


# ------------------------------------------------------------------------------ pools and gauges


def rank_pools(url: str) -> Dict[str, dict]:
    """Each DP group's pool as the server reports it (call after idle + flush): /v1/loads
    num_used_tokens (by dp_rank) and /server_info internal_states[i] oscar_int2 tokens_free,
    side_rows_free and max_total_num_tokens; named dp<i>."""
    from bench._launcher import get_json

    try:
        loads = (get_json(url + "/v1/loads", timeout=30) or {}).get("loads") or []
    except (OSError, ValueError):
        loads = []
    try:
        states = (get_json(url + "/server_info", timeout=60) or {}).get("internal_states") or []
    except (OSError, ValueError):
        states = []
    used = {(i if x.get("dp_rank") is None else int(x["dp_rank"])): x.get("num_used_tokens")
            for i, x in enumerate(loads)}
    out = {}
    for i in range(max(len(states), len(loads))):
        st = (states[i] if i < len(states) else None) or {}
        oscar = st.get("oscar_int2") or {}
        snap = {"sglang_used": int(used[i]) if used.get(i) is not None else None,
                "oscar_tokens_free": oscar.get("tokens_free"),
                "oscar_side_rows_free": oscar.get("side_rows_free"),
                "kv_tokens": st.get("max_total_num_tokens") or oscar.get("max_total_num_tokens")}
        out[f"dp{i}"] = snap
    return out


def pools(urls: List[str], idle_timeout_s: float) -> dict:
    """Idle + /flush_cache on every server (serving_vs_fp8.pool_state), then every DP group's pool
    (rank_pools); servers beyond the first prefix their ranks' names with worker<i>."""
    from bench import serving_vs_fp8 as vs

    whole, ranks = [], {}
    for i, url in enumerate(urls):
        snap = vs.pool_state(url, idle_timeout_s)
        whole.append(snap)
        for name, r in rank_pools(url).items():
            ranks[f"worker{i}.{name}" if len(urls) > 1 else name] = {**r, "idle": snap.get("idle")}
    return {"servers": whole, "ranks": ranks}


def pool_fields(start: dict, end: dict) -> dict:
    """A row's pool against its job's start: per rank the leaked tokens (soak.leak_tokens, None if
    not idle) and request rows (soak.side_rows_leak); pool_leak_tokens the largest (None where a
    rank was not measured); side_free_leak as serving_vs_fp8.pool_leak per server."""
    from bench import serving_vs_fp8 as vs
    from bench.soak import leak_tokens, side_rows_leak

    per = {}
    for name, s in start["ranks"].items():
        e = end["ranks"].get(name)
        per[name] = {"pool_leak_tokens": leak_tokens(s, e) if e and e.get("idle") else None,
                     "side_rows_leak": side_rows_leak(s, e) if e else None,
                     "sglang_used": e.get("sglang_used") if e else None,
                     "oscar_tokens_free": e.get("oscar_tokens_free") if e else None}
    leaks = [p["pool_leak_tokens"] for p in per.values()]
    side = {}
    for i, (s, e) in enumerate(zip(start["servers"], end["servers"])):
        d = vs.pool_leak(s, e)["side_free_leak"]
        if d:
            side[f"worker{i}"] = d
    return {"pool_leak_tokens": max(leaks) if leaks and None not in leaks else None,
            "pool_ranks": per, "side_free_leak": side}


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_scheduler_metrics(text: str, server: int = 0) -> List[dict]:
    """The scheduler gauges of a Prometheus /metrics page (SCHEDULER_GAUGES and every
    sglang:oscar_int2_* gauge), one entry per scheduler (server, tp_rank, dp_rank, pp_rank);
    samples without a tp_rank label (the tokenizer's) are not a scheduler's."""
    found: Dict[tuple, dict] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), m.group(3)
        if "tp_rank" not in labels or not (name in SCHEDULER_GAUGES or name.startswith(OSCAR_GAUGE)):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        key = (server, labels.get("tp_rank"), labels.get("dp_rank"), labels.get("pp_rank", "0"))
        entry = found.setdefault(key, {"server": server, "tp_rank": int(labels["tp_rank"]),
                                       "dp_rank": None if key[2] is None else int(key[2]),
                                       "pp_rank": int(key[3]), "gauges": {}})
        entry["gauges"][name] = v
    return sorted(found.values(), key=lambda e: (e["server"], e["dp_rank"] or 0, e["tp_rank"]))


def used_tokens(entry: dict) -> Optional[float]:
    """A scheduler's used tokens from its gauges: SGLang's num_used_tokens, else the plugin's."""
    g = entry.get("gauges") or {}
    for name in ("sglang:num_used_tokens", OSCAR_GAUGE + "used_tokens"):
        if name in g:
            return g[name]
    return None


def scheduler_metrics(urls: List[str], wait_s: float = 0.0, expect: Optional[int] = None) -> dict:
    """Every server's /metrics as per-scheduler gauges. wait_s: read again (every 2 s, up to
    wait_s) until `expect` schedulers show and each shows 0 used tokens (an idle scheduler
    publishes its gauges when its last report is stale, at the latest 30 s after it)."""
    import urllib.request

    t0 = time.monotonic()
    while True:
        entries, errors = [], []
        for i, url in enumerate(urls):
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                    entries += parse_scheduler_metrics(r.read().decode(errors="replace"), i)
            except OSError as e:
                errors.append(f"{url}/metrics: {type(e).__name__}: {e}")
        done = (not errors and (expect is None or len(entries) >= expect)
                and all(used_tokens(e) == 0 for e in entries))
        waited = time.monotonic() - t0
        if not wait_s or done or waited >= wait_s:
            return {"schedulers": entries, "metrics_errors": errors, "metrics_waited_s": round(waited, 1)}
        time.sleep(2.0)


# ------------------------------------------------------------------------------ the checks


def _one(rows: List[dict], **match) -> Optional[dict]:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _good(r: Optional[dict]) -> Optional[dict]:
    return r if r is not None and not failed(r) else None


def _ratio(a, b) -> Optional[float]:
    return round(a / b, 3) if a and b else None


def _refusal(rows: List[dict]) -> Optional[dict]:
    """dp attention's outcome where int2's server did not start: {refused: True/False/None, ...}
    (True: FP8's did not start either, so SGLang refused it for the model, not the plugin; None:
    FP8's not tried). None when int2's started (or was not tried)."""
    def start_failures(config):
        rs = [r for r in rows if r.get("topology") == DP_ATTENTION and r.get("config") == config]
        return rs, bool(rs) and all(r.get("start_failed") for r in rs)

    i2, i2_refused = start_failures(INT2)
    if not i2_refused:
        return None
    fp, fp_refused = start_failures(FP8)
    tail = lambda rs: (rs[0].get("error") or "").strip().splitlines()[-3:] if rs else None  # noqa: E731
    return {"refused": (fp_refused if fp else None), "int2_error": tail(i2), "fp8_error": tail(fp)}


def summary(rows: List[dict]) -> dict:
    """The acceptance checks (module docstring), the values each compared, not_measured,
    all_checks_pass; and output_tok_s: per topology and load the three configurations' rates,
    int2 over FP8 and BF16, and each dp topology over the single server."""
    checks = _results.Checks()
    check = checks.check
    loads: Dict[str, List[str]] = {}
    for t, default in (("tp", DEFAULT_TP_LOADS), ("single", DEFAULT_DP_LOADS), ("dp", DEFAULT_DP_LOADS),
                       ("router", DEFAULT_DP_LOADS), (DP_ATTENTION, DEFAULT_DP_LOADS)):
        seen = [r["load"] for r in rows if r.get("topology") == t and r.get("kind") == "throughput"
                and r.get("config") == INT2]
        loads[t] = list(dict.fromkeys(_csv(default) + seen))
    refusal = _refusal(rows)
    rates: Dict[str, dict] = {}
    for t, lds in loads.items():
        if t == DP_ATTENTION and refusal is not None:
            continue
        for ld in lds:
            got = {c: _good(_one(rows, topology=t, config=c, load=ld, kind="throughput")) for c in CONFIG_NAMES}
            i2, fp, bf = (got[c] for c in CONFIG_NAMES)
            ok = None
            if i2 and fp and bf:
                ok = i2.get("run") == fp.get("run") == bf.get("run") and None not in (
                    i2.get("output_tok_s"), fp.get("output_tok_s"), bf.get("output_tok_s"))
            check(f"{t}_{ld}_int2_with_same_run_fp8_bf16", ok,
                  **{c: None if r is None else {"output_tok_s": r.get("output_tok_s"), "kv_tokens": r.get("kv_tokens"),
                                                "run": r.get("run")} for c, r in got.items()})
            entry = {c: (r or {}).get("output_tok_s") for c, r in got.items()}
            entry.update(int2_vs_fp8=_ratio(entry[INT2], entry[FP8]), int2_vs_bf16=_ratio(entry[INT2], entry[BF16]))
            if t not in ("tp", "single"):
                for c in CONFIG_NAMES:
                    one = _good(_one(rows, topology="single", config=c, load=ld, kind="throughput"))
                    entry[f"{c}_vs_single"] = _ratio(entry[c], (one or {}).get("output_tok_s"))
            rates[f"{t} {ld}"] = entry
    for t in ("tp", "dp", "router", DP_ATTENTION):
        if t == DP_ATTENTION and refusal is not None:
            continue
        r = _one(rows, topology=t, config=INT2, kind="aborts")
        n = (r or {}).get("gpus_used")
        ranks = (r or {}).get("pool_ranks") or {}
        sched = (r or {}).get("schedulers") or []
        leak_ok = None
        if r is not None and not failed(r) and n:
            leaks = [p.get("pool_leak_tokens") for p in ranks.values()]
            used = [used_tokens(e) for e in sched]
            leak_ok = (len(ranks) >= expected_pool_ranks(t, n) and len(sched) >= expected_schedulers(t, n)
                       and all(x == 0 for x in leaks) and all(u == 0 for u in used)
                       and all(p.get("side_rows_leak") in (0, None) for p in ranks.values())
                       and not r.get("side_free_leak"))
        elif r is not None and failed(r) and r.get("pool_leak_tokens") not in (None, 0):
            leak_ok = False
        check(f"{t}_int2_no_pool_leak_every_rank_after_aborts", leak_ok,
              pool_leak_tokens={k: p.get("pool_leak_tokens") for k, p in ranks.items()},
              side_rows_leak={k: p.get("side_rows_leak") for k, p in ranks.items()},
              scheduler_used_tokens=[used_tokens(e) for e in sched], aborted=(r or {}).get("aborted"),
              streams=(r or {}).get("streams"))
        with_gauges = [e for e in sched if any(k.startswith(OSCAR_GAUGE) for k in e.get("gauges", {}))]
        check(f"{t}_int2_gauges_from_every_scheduler",
              None if r is None or not n or not sched else len(with_gauges) >= expected_schedulers(t, n),
              schedulers=[{k: e.get(k) for k in ("server", "tp_rank", "dp_rank")} for e in with_gauges],
              expected=None if not n else expected_schedulers(t, n))
    if refusal is not None:
        check(f"{DP_ATTENTION}_refused_by_sglang_for_fp8_too", refusal["refused"], **refusal)
    tap = _one(rows, topology="tap", config=INT2)
    per = (tap or {}).get("rank_errors") or {}
    n = (tap or {}).get("gpus_used")
    check("tap_int2_every_rank_matches_float64_emulation",
          None if tap is None or (failed(tap) and not per) else bool(tap.get("ok")) and len(per) == n,
          ranks=per, gpus=n)
    out = checks.summary()
    out["output_tok_s"] = rates
    return out


# ------------------------------------------------------------------------------ one job


class Run:
    """What one job needs: args, the results file, the clock and the common row fields."""

    def __init__(self, args, results, clock):
        self.args, self.results, self.clock = args, results, clock
        self.written: set = set()  # row keys this command wrote

    def put(self, row: dict) -> dict:
        row = {**row, "date": _stamp(), "device": self.results.device, "run": self.args.run}
        self.results.put(row)
        self.written.add(row_key(row))
        return row


def _server(cmd: List[str], env: dict, log: Path, port: int):
    from bench._launcher import SPEED, Server

    return Server(cmd, env, log, port, **SPEED)


def _router(cmd: List[str], log: Path, port: int):
    from bench._launcher import Server

    return Server(cmd, {}, log, port, ready="health", progress=True, settle_s=1.0)


def wait_routed(url: str, timeout_s: float) -> None:
    """Until a one-token /generate through the router answers (its workers are registered after
    its /health already answers)."""
    from bench._serving_server import post_json

    t0, last = time.monotonic(), None
    while time.monotonic() - t0 < timeout_s:
        try:
            post_json(url + "/generate", {"input_ids": [1000, 1001], "sampling_params": {"max_new_tokens": 1}},
                      timeout=60)
            return
        except (OSError, ValueError) as e:
            last = e
            time.sleep(2.0)
    raise RuntimeError(f"the router did not route a request within {timeout_s:.0f} s: {last}")


def _startup_timeout(run: Run) -> float:
    left = (run.args.deadline_s - run.clock.elapsed()) if run.args.deadline_s else None
    return min(run.args.startup_timeout, max(left, 60.0)) if left is not None else run.args.startup_timeout


def _error(e: Exception, srv=None) -> str:
    tail = "" if srv is None or "last lines" in str(e) else "\n" + srv.tail(40)
    return f"{type(e).__name__}: {e}{tail}"[-4000:]


def warm_up(urls: List[str], args) -> None:
    from bench import serving_vs_fp8 as vs
    from bench._serving_client import random_prompts, run_requests

    for url in urls:
        for w in _csv(args.warmup):
            n, inp, out = vs.report.parse_load(w)
            run_requests(url, random_prompts(n, inp, args.vocab, seed=inp), out, "warm-up",
                         timeout_s=args.request_timeout, progress=False)


def measure_load(run: Run, base: dict, topology: str, load: str, url: str, pool_urls: List[str],
                 start: dict, log: Optional[Path]) -> Optional[dict]:
    """One load through url (serving_vs_fp8.measure), then every rank's pool and gauges; the row
    (None: skipped for the deadline)."""
    from bench import serving_vs_fp8 as vs
    from bench._serving_server import log_size, log_slice, parse_decode_log, parse_prefill_log, prefill_rates, \
        scheduler_rates

    args = run.args
    est = vs.estimate_s(load, None, base["kv"]) + POOL_S
    if not run.clock.fits(est):
        print(f"  [{base['job']}] skip {topology} {load}: estimated {est:.0f} s would end past --deadline-s "
              f"{args.deadline_s:g} (at {run.clock.elapsed():.0f} s)", flush=True)
        run.results.call.setdefault("skipped", []).append({"job": base["job"], "load": load, "topology": topology})
        return None
    off = log_size(log) if log else 0
    fields = vs.measure(url, load, args.vocab, base.get("context_tokens"), args.request_timeout)
    if log:  # one scheduler's log (TP: rank 0 logs; the single server): the server-side rates
        piece = log_slice(log, off)
        fields.update(scheduler_rates(parse_decode_log(piece)), **prefill_rates(parse_prefill_log(piece)))
    fields.update(pool_fields(start, pools(pool_urls, args.idle_timeout)),
                  **scheduler_metrics(pool_urls))
    row = run.put({**base, "topology": topology, "load": load,
                   "kind": "throughput", **_topology_fields(topology, base), **fields})
    print(f"  [{base['job']}] {topology} {load}: {_f(row['output_tok_s'])} output tok/s, TTFT p50 "
          f"{_f(row.get('ttft_p50_s'), '{:.2f}')} s, ok {row['ok']}, pool leak {row['pool_leak_tokens']} "
          f"(t+{run.clock.elapsed():.0f} s)", flush=True)
    return row


def measure_aborts(run: Run, base: dict, topology: str, url: str, pool_urls: List[str], start: dict) -> dict:
    """--abort-load streams hung up on (serving_vs_fp8's), then every rank's pool and, waited
    for, every scheduler's gauges."""
    import asyncio

    from bench import serving_vs_fp8 as vs
    from bench._serving_client import random_prompts

    args = run.args
    n, inp, out = vs.report.parse_load(args.abort_load)
    prompts = random_prompts(n, inp, args.vocab, seed=n * 17 + inp)
    t0 = time.time()
    tally = asyncio.run(vs._abort_streams(url, prompts, out, n * 31 + out, args.request_timeout))
    fields = {**tally, "wall_s": round(time.time() - t0, 2),
              **pool_fields(start, pools(pool_urls, args.idle_timeout)),
              **scheduler_metrics(pool_urls, args.metrics_wait_s,
                                  expected_schedulers(topology, gpu_count(args)))}
    fields["ok"] = tally["aborted"] == n
    row = run.put({**base, "topology": topology, "load": abort_name(args.abort_load), "kind": "aborts",
                   **_topology_fields(topology, base), **fields})
    print(f"  [{base['job']}] {topology} {n} streams: {tally['aborted']} aborted, {tally['errors']} errors; pool "
          f"leak per rank {({k: p['pool_leak_tokens'] for k, p in row['pool_ranks'].items()})}, used tokens per "
          f"scheduler {[used_tokens(e) for e in row['schedulers']]}", flush=True)
    return row


def _topology_fields(topology: str, base: dict) -> dict:
    """The rows of a router job: the single ones are the first worker alone."""
    n = base["gpus_used"]
    if topology == "single":
        return {"gpus_used": 1, "tp_size": 1, "dp_size": 1, "servers": 1, "gpus": base["gpus"][:1],
                "server_command": base["server_commands"][0], "kv_tokens": base["kv_tokens_per_server"][0]}
    return {"gpus_used": n}


def _facts(url: str) -> dict:
    from bench import serving_vs_fp8 as vs

    return vs._facts(url)


def run_job(job: Job, args, run: Run) -> bool:
    """Start the job's servers, measure its rows (each written as measured), stop them. A server
    that does not start: every row of the job failed, with the log's tail."""
    from bench import serving_vs_fp8 as vs

    n = gpu_count(args)
    specs = servers(job, args)
    logs = Path(args.logs)
    base = {"part": job.part, "job": job.name, "config": job.config, "kv": job.kv,
            "backend": vs.kv_and_backend(vs.CONFIGS[job.config])[1], "model": Path(args.model_dir).name,
            "gpus": list(args.gpu_list), "gpus_used": n,
            "tp_size": n if job.topology in ("tp", "tap", DP_ATTENTION) else 1,
            "dp_size": n if job.topology in ("dp", DP_ATTENTION) else 1,
            "dp_attention": job.topology == DP_ATTENTION, "servers": len(specs),
            "server_commands": [shlex.join(c[1:]) for _, c, _, _ in specs],
            "server_env": {k: v for k, v in specs[0][2].items() if k != "CUDA_VISIBLE_DEVICES"},
            "logs": [f"{job.name}_{name}_{p}.log" for name, _, _, p in specs]}
    if job.topology == "tap":
        import shutil

        shutil.rmtree(tap_dir(job, args), ignore_errors=True)  # this server's tap files only
    t_start = run.clock.elapsed()
    for name, cmd, env, _ in specs:
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        print(f"=== {job.name} {name}: {envs} {shlex.join(cmd)}  (t+{t_start:.0f} s)", flush=True)
    with contextlib.ExitStack() as stack:
        srvs, waiting = [], None
        try:
            for name, cmd, env, port in specs:  # started together, then waited for
                srvs.append(stack.enter_context(_server(cmd, env, logs / f"{job.name}_{name}_{port}.log", port)))
            for waiting in srvs:
                waiting.wait_ready(_startup_timeout(run))
        except Exception as e:  # noqa: BLE001 (a refused flag, a crash, a time-out: failed rows)
            err = _error(e, waiting)
            print(f"  [{job.name}] FAILED to start: {err}", flush=True)
            for key in job.keys(args):
                run.put({**base, "topology": key[1], "load": key[3], "kind": _kind(key[3]), "ok": False,
                         "start_failed": True, "error": err})
            return job.topology == DP_ATTENTION  # a refusal is the row's finding, not this run's failure
        _started_marker(job.config).parent.mkdir(parents=True, exist_ok=True)
        _started_marker(job.config).touch()
        base.update(startup_s=[round(s.startup_s, 1) for s in srvs])
        try:
            facts = [_facts(s.url) for s in srvs]
            base.update({k: v for k, v in facts[0].items()}, kv_tokens_per_server=[f["kv_tokens"] for f in facts])
            if job.topology == "tap":
                return tap_rows(job, args, run, base, srvs[0])
            urls = [s.url for s in srvs]
            warm_up(urls, args)
            start = pools(urls, args.idle_timeout)
            base["kv_tokens_per_rank"] = {k: r.get("kv_tokens") for k, r in start["ranks"].items()}
            loads = args.tp_loads if job.topology == "tp" else args.dp_loads
            if job.topology == "router":
                for ld in loads:  # the first server alone: the single rows
                    measure_load(run, base, "single", ld, urls[0], urls, start, srvs[0].log_path)
                return router_rows(job, args, run, base, urls, start, stack)
            log = srvs[0].log_path if job.topology == "tp" else None
            for ld in loads:
                measure_load(run, base, job.topology, ld, urls[0], urls, start, log)
            if job.kv == "int2" and args.abort_load:
                measure_aborts(run, base, job.topology, urls[0], urls, start)
            return True
        except Exception as e:  # noqa: BLE001 (the server died mid-job: the rows not yet written fail)
            err = _error(e, srvs[0])
            print(f"  [{job.name}] FAILED: {err}", flush=True)
            _fail_missing(job, args, run, base, err)
            return False


def _kind(load: str) -> str:
    return "aborts" if load.endswith(" aborted") else "tap" if load == tap_name() else "throughput"


def _fail_missing(job: Job, args, run: Run, base: dict, err: str) -> None:
    """Failed rows for the job's keys this command has not written yet."""
    for key in job.keys(args):
        if key not in run.written:
            run.put({**base, "topology": key[1], "load": key[3], "kind": _kind(key[3]), "ok": False, "error": err})


def router_rows(job: Job, args, run: Run, base: dict, urls: List[str], start: dict, stack) -> bool:
    """The pair behind sglang-router: its loads and (int2) the aborted streams through it."""
    keys = [k for k in job.keys(args) if k[1] == "router"]
    why = router_available()
    cmd = router_cmd(job, args, urls)
    rbase = {**base, "router_command": shlex.join(cmd[1:]), "router_policy": args.router_policy}
    if why is not None:
        print(f"  [{job.name}] router rows failed: {why}", flush=True)
        for key in keys:
            run.put({**rbase, "topology": "router", "load": key[3], "kind": _kind(key[3]), "ok": False,
                     "router_missing": True, "error": why})
        return False
    log = Path(args.logs) / f"{job.name}_router_{router_port(job)}.log"
    print(f"=== {job.name} router: {shlex.join(cmd)}  (t+{run.clock.elapsed():.0f} s)", flush=True)
    router = None
    try:
        router = stack.enter_context(_router(cmd, log, router_port(job)))
        router.wait_ready(min(args.startup_timeout, 120.0))
        wait_routed(router.url, 120.0)
    except Exception as e:  # noqa: BLE001
        err = _error(e, router)
        print(f"  [{job.name}] router FAILED to start: {err}", flush=True)
        for key in keys:
            run.put({**rbase, "topology": "router", "load": key[3], "kind": _kind(key[3]), "ok": False,
                     "start_failed": True, "error": err})
        return False
    rbase["router_startup_s"] = round(router.startup_s, 1)
    for ld in args.dp_loads:
        measure_load(run, rbase, "router", ld, router.url, urls, start, None)
    if job.kv == "int2" and args.abort_load:
        measure_aborts(run, rbase, "router", router.url, urls, start)
    return True


def tap_rows(job: Job, args, run: Run, base: dict, srv) -> bool:
    """One 10K-token request on the tapped TP server; every rank's tap against float64."""
    from bench import server_e2e
    from bench._serving_server import post_json

    tap = tap_dir(job, args)
    time.sleep(TAP_SETTLE_S)
    rng = random.Random(7)
    ids = [rng.randrange(100, min(40000, args.vocab - 1)) for _ in range(TAP_TOKENS)]
    before = set(tap.glob("rank*/extend_*.pt"))
    t0 = time.time()
    g = post_json(srv.url + "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": TAP_OUTPUT, "ignore_eos": True}}, timeout=args.request_timeout)
    request_ok = isinstance(g, dict) and (g.get("meta_info") or {}).get("completion_tokens") == TAP_OUTPUT
    time.sleep(1.0)
    accs = server_e2e.analyse_ranks(tap, before)
    per = {}
    for acc in accs:
        cs = acc.get("chunks") or []
        top = lambda k: max((c[k] for c in cs if c.get(k) is not None), default=None)  # noqa: E731
        per[str(acc["rank"])] = {"ok": bool(acc.get("ok")), "chunks": len(cs),
                                 "rel_err_server_vs_int2_emulation": top("rel_err_server_vs_int2_emulation"),
                                 "rel_err_stored_k_vs_emulation": top("rel_err_stored_k_vs_emulation"),
                                 "rel_err_stored_v_vs_emulation": top("rel_err_stored_v_vs_emulation"),
                                 "rel_err_server_vs_bf16": top("rel_err_server_vs_bf16"),
                                 "rel_err_int2_emulation_vs_bf16": top("rel_err_int2_emulation_vs_bf16")}
    ranks = sorted(int(r) for r in per)
    ok = request_ok and ranks == list(range(gpu_count(args))) and all(p["ok"] for p in per.values())
    row = run.put({**base, "topology": "tap", "load": tap_name(), "kind": "tap", "tap_layer": args.tap_layer,
                   "request_ok": request_ok, "wall_s": round(time.time() - t0, 1), "ok": ok,
                   "rank_errors": per, "ranks": accs})
    print(f"  [{job.name}] tap layer {args.tap_layer}: ranks {ranks}, ok {row['ok']}; "
          + "; ".join(f"rank {k}: server vs emulation {_f(p['rel_err_server_vs_int2_emulation'], '{:.4f}')}, "
                      f"stored K {_f(p['rel_err_stored_k_vs_emulation'], '{:.4f}')}, V "
                      f"{_f(p['rel_err_stored_v_vs_emulation'], '{:.4f}')}" for k, p in sorted(per.items())),
          flush=True)
    return ok


# ------------------------------------------------------------------------------ plan and main


def done(job: Job, args, rows: List[dict]) -> bool:
    """--only-missing: every row of the job is on file from this run and good (dp attention's
    start-up refusal counts as its finding)."""
    have = {row_key(r): r for r in rows if r.get("run") == args.run}
    for key in job.keys(args):
        r = have.get(key)
        if r is None or (failed(r) and not (key[1] == DP_ATTENTION and r.get("start_failed"))):
            return False
    return True


def skip_reason(job: Job, args, rows: List[dict]) -> Optional[str]:
    """Why this job need not run: dp attention refused for int2 and FP8 in this run (the BF16
    server would only repeat it)."""
    if job.topology != DP_ATTENTION or job.config != BF16:
        return None
    mine = [r for r in rows if r.get("run") == args.run]
    ref = _refusal(mine)
    if ref and ref["refused"]:
        return "SGLang refused --enable-dp-attention for int2 and FP8 in this run"
    return None


def select_jobs(args) -> List[Job]:
    jobs = [j for j in all_jobs(args.port) if j.part in args.parts]
    if args.jobs:
        names = {j.name for j in all_jobs(args.port)}
        bad = [x for x in args.jobs if x not in names]
        if bad:
            raise ValueError(f"--jobs {','.join(bad)}: choose from {', '.join(sorted(names))}")
        jobs = [j for j in all_jobs(args.port) if j.name in args.jobs]
    return jobs


def device_name(gpus: List[str]) -> str:
    import os

    from bench.serving_vs_fp8 import gpu_name

    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
    try:
        name = gpu_name()
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    return f"{len(gpus)} x {name}"


def print_commands(jobs: List[Job], args) -> None:
    for j in jobs:
        print(f"# {j.name} (part {j.part}): rows {', '.join(f'{k[1]} {k[3]}' for k in j.keys(args))}; "
              f"about {job_estimate_s(j, args):.0f} s")
        for name, cmd, env, _ in servers(j, args):
            envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            print(f"{envs} {shlex.join(cmd)}")
        if j.topology == "router":
            print(shlex.join(router_cmd(j, args, [f"http://127.0.0.1:{p}" for p in worker_ports(j, args)])))


def parse_args(argv=None):
    from bench import serving_vs_fp8 as vs
    from bench._launcher import add_server_run_args

    p = argparse.ArgumentParser(prog="python -m bench.multi_gpu", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="tp,dp", help=f"comma list of {', '.join(PARTS)} (default tp,dp)")
    p.add_argument("--jobs", default="", help="comma list of job names (overrides --part; --print-commands lists them)")
    p.add_argument("--gpus", default="0,1", help="GPU ids, at least two (default 0,1)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON, merged (default %(default)s)")
    p.add_argument("--base", default=str(DEFAULT_OUT),
                   help="rows to start from when --out does not exist yet ('' = none)")
    p.add_argument("--run", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                   help="run tag of the rows (default: the UTC date); baselines count from the same run only")
    p.add_argument("--only-missing", action="store_true", help="skip jobs whose rows of this run are on file and good")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="skip jobs and loads whose estimate would end after this many seconds from the start")
    p.add_argument("--tp-loads", default=DEFAULT_TP_LOADS, help="tp: NxIN+OUT loads (default %(default)s)")
    p.add_argument("--dp-loads", default=DEFAULT_DP_LOADS, help="dp: NxIN+OUT loads (default %(default)s)")
    p.add_argument("--abort-load", default=DEFAULT_ABORT_LOAD,
                   help="int2: streams hung up on after 1-16 tokens, then the pools ('' = none; default %(default)s)")
    p.add_argument("--warmup", default=vs.DEFAULT_WARMUP,
                   help="NxIN+OUT requests on each server before the pools' start")
    p.add_argument("--tap-layer", type=int, default=5, help="tap: the layer recorded (default 5)")
    p.add_argument("--router-policy", default="round_robin", help="sglang-router --policy (default round_robin)")
    p.add_argument("--router-arg", action="append", default=[], help="extra router argument (--router-arg=--flag)")
    p.add_argument("--metrics-wait-s", type=float, default=40.0,
                   help="after the aborts: read /metrics until every scheduler shows 0 used tokens, at most this long")
    p.add_argument("--logs", default="bench_out/multi_gpu", help="server logs (the tap's files go under the temp folder)")
    p.add_argument("--port", type=int, default=30600)
    p.add_argument("--model-dir", default=str(DEVKIT_MODELS / "llama31-8b"))
    p.add_argument("--tokenizer-dir", default=str(DEVKIT_MODELS / "smollm2-135m"))
    p.add_argument("--vocab", type=int, default=None, help="default: the model's config.json")
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument of every server (--server-arg=--flag)")
    add_server_run_args(p)
    args = p.parse_args(argv)
    try:
        args.parts = _choices("--part", args.part, PARTS)
        args.gpu_list = _csv(args.gpus)
        if len(args.gpu_list) < 2 or len(set(args.gpu_list)) != len(args.gpu_list):
            raise ValueError(f"--gpus {args.gpus!r}: two or more different GPU ids")
        args.tp_loads, args.dp_loads = _csv(args.tp_loads), _csv(args.dp_loads)
        for ld in args.tp_loads + args.dp_loads + _csv(args.abort_load) + _csv(args.warmup):
            vs.report.parse_load(ld)
        args.jobs = _csv(args.jobs)
        select_jobs(args)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    jobs = select_jobs(args)
    if args.print_commands:
        print_commands(jobs, args)
        return 0
    from bench import serving_vs_fp8 as vs
    from bench.spec_decode import ResultsFile

    if args.vocab is None:
        args.vocab = vs._vocab(Path(args.model_dir))
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    results = ResultsFile(Path(args.out), Path(args.base) if args.base else None, device_name(args.gpu_list),
                          module="multi_gpu", key=row_key, finish=summary)
    results.call.update(run=args.run, started_unix=round(time.time(), 3))  # two calls in one minute stay two
    run = Run(args, results, vs.Clock(args.deadline_s))

    def stop(signum, frame):  # a call cut by its time limit: stop the servers (the with blocks) first
        raise SystemExit(f"signal {signum}: stopping")

    old = signal.signal(signal.SIGTERM, stop)
    ok, ran = True, 0
    try:
        for job in jobs:
            rows = results.doc["rows"]
            if args.only_missing and done(job, args, rows):
                print(f"--- {job.name}: on file from run {args.run}", flush=True)
                continue
            why = skip_reason(job, args, rows)
            if why:
                print(f"--- {job.name}: skipped: {why}", flush=True)
                continue
            # the whole job (a job cut short runs again whole); the first job of a command may
            # start with only its start and first load in time (its other loads are then skipped)
            need = job_estimate_s(job, args, first_only=ran == 0)
            if not run.clock.fits(job_estimate_s(job, args)) and not (ran == 0 and run.clock.fits(need)):
                print(f"--- {job.name}: skipped: about {job_estimate_s(job, args):.0f} s would end past "
                      f"--deadline-s {args.deadline_s:g} (at {run.clock.elapsed():.0f} s)", flush=True)
                results.call.setdefault("skipped", []).append({"job": job.name, "reason": "deadline"})
                continue
            t0 = run.clock.elapsed()
            ran += 1
            ok = run_job(job, args, run) and ok
            print(f"--- {job.name}: {run.clock.elapsed() - t0:.0f} s (estimate {job_estimate_s(job, args):.0f})",
                  flush=True)
    finally:
        signal.signal(signal.SIGTERM, old)
        results._write([])  # the call's skipped jobs and loads
    print(f"results: {args.out} (t+{run.clock.elapsed():.0f} s); " + results.checks_line(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
