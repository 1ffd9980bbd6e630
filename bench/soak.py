"""Soak test: mixed chat load against OpenAI-compatible SGLang servers, with leak, crash and garble checks.

For each server (one after another), for --duration seconds:
  - steady load: --concurrency workers send /v1/chat/completions with prompt lengths from 100 to
    32K tokens (capped by the server's context), mixed output lengths, greedy and sampled, streamed
    and not; about half share one of a few long system prompts (radix-cache hits);
  - aborts: --abort-fraction (default 10 %) of the streams are cut at a random chunk (the client
    closes the connection mid-stream, which makes SGLang abort the request);
  - bursts: every --burst-every seconds, --burst-factor x max_running_requests (read from
    /server_info) requests at once, above what the server runs together (queueing, retraction);
  - probes: fixed prompts whose greedy answers were recorded from the same server idle at the
    start; one probe at a time is sent throughout the load (probe_accuracy_loaded), and again when
    idle before (probe_accuracy_alone: determinism) and after (probe_accuracy_after);
  - /health_generate (and, for a server this script started, its process) every --health-interval
    seconds: each run of failures is one crash; SGLang's retraction counter from /metrics
    (--enable-metrics) before and after: retracted_reqs.
After the load it waits for the server to be idle, flushes the radix cache and compares the pool
with its idle value from the start: pool_leak_tokens is the largest of (SGLang's /v1/loads
num_used_tokens now - at the start) and (oscar_int2.tokens_free in /server_info at the start - now).

Two ways to name servers (both may be given; each row is named):
  --url NAME=URL        a running server (URL = its root, e.g. http://127.0.0.1:30000); the radix
                        cache state is read from /server_info (disable_radix_cache)
  --configs LIST        servers this script starts itself, one after another, each alone on the
                        GPU: int2, bf16, int2-noradix, bf16-noradix (noradix = --disable-radix-cache)
                        with --model-path / --tokenizer-path / --server-args; logs under --log-dir

The request plan is a function of --seed and max_running_requests (workers and burst size follow
it; the started servers share one), so the int2 and bf16 rows get the same requests and are
paired; timing, and so batching, is not deterministic. Ctrl-C (or SIGTERM)
stops the load, finishes the row with "interrupted": true, stops started servers and writes the JSON.

Device run (H100; see ../shared/devkit/README.md). Carry .devkit/sgl_bundle.tar.xz,
.devkit/device-env.sh and .devkit/smollm2_tok.tar.xz (see bench/serving.py), then, per call:

  mkdir -p .devkit/models && tar -C .devkit/models -xJf .devkit/smollm2_tok.tar.xz && source .devkit/device-env.sh &&
  python -m bench.soak --configs int2,bf16 --duration 90 --out $OUT/soak_h100.json --log-dir $OUT/logs
  (a second call with --configs int2-noradix,bf16-noradix --out $OUT/soak_h100_noradix.json)

About 4 minutes per server (start-up 60-90 s, load 90 s, drain, idle checks); --deadline-s skips a
server that would end after it. Copy the JSON files to bench/results/.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import shlex
import signal
import sys
import time
from pathlib import Path

from bench import _results

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = "soak_h100.json"
DEVKIT = ROOT / ".devkit" / "models"
# the devkit's flags (shared/devkit/README.md): dummy weights, no FA3, no grammar backend
# plus the same small pool and request cap for int2 and bf16, so bursts queue and the pool fills
# (retraction) in both; --enable-metrics for SGLang's retraction counter
DEFAULT_SERVER_ARGS = ("--load-format dummy --sampling-backend pytorch --grammar-backend none "
                       "--disable-prefill-cuda-graph --mem-fraction-static 0.85 --enable-metrics "
                       "--max-running-requests 64 --max-total-tokens 262144")
CONFIGS = {
    "int2": ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton"],
    "bf16": ["--attention-backend", "triton"],
    "int2-noradix": ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton",
                     "--disable-radix-cache"],
    "bf16-noradix": ["--attention-backend", "triton", "--disable-radix-cache"],
}
# common English words that are one token each in the Llama / Qwen / SmolLM2 tokenizers (with a
# leading space), so a prompt's token count is close to its word count
WORDS = ("the of and to in is was for on are with as at be by this had not but from or have an "
         "they which one you were her all she there would their we him been has when who will more "
         "no if out so said what up its about into than them can only other new some could time "
         "these two may then do first any my now such like our over man me even most made after "
         "also did many before must through back years where much your way well down should "
         "because each just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while "
         "last might us great old year off come since against go came right used take three").split()
TOKENS_PER_WORD = 1.3  # a margin: some tokenizers split a few of these words
TEMPLATE_TOKENS = 64    # the chat template's own tokens, and "You are assistant number i."
SYSTEM_PROMPTS = 4      # shared prefixes (radix hits)
SYSTEM_WORDS = 1500
PROBES = (
    "List the numbers from 1 to 12, separated by commas.",
    "What is the capital of France? Answer in one sentence.",
    "Write the English alphabet in capital letters.",
    "Name three primary colours.",
    "Translate 'good morning' into French.",
    "What is 17 plus 25?",
    "Write a haiku about the sea.",
    "Spell the word 'computer' backwards.",
)
OUTPUT_CHOICES = (1, 8, 32, 128, 512, 1024, 2048)


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Spec:
    prompt_words: int
    system: int | None     # index of the shared system prompt, or None
    max_tokens: int
    stream: bool
    temperature: float
    abort_after: int | None  # close the stream after this many content chunks
    text_seed: int


def make_spec(rng: random.Random, max_prompt_tokens: int, min_prompt_tokens: int = 100,
              abort_fraction: float = 0.1) -> Spec:
    """One request: prompt length log-uniform in [min, max] tokens, output from OUTPUT_CHOICES."""
    room = max_prompt_tokens - TEMPLATE_TOKENS - min_prompt_tokens * TOKENS_PER_WORD
    max_tokens = rng.choice([c for c in OUTPUT_CHOICES if c <= room] or [1])
    system = rng.randrange(SYSTEM_PROMPTS) if rng.random() < 0.5 else None
    if system is not None and SYSTEM_WORDS * TOKENS_PER_WORD + max_tokens > room:
        system = None  # a small context: no room for the shared prefix
    budget = (max_prompt_tokens - TEMPLATE_TOKENS - max_tokens
              - (SYSTEM_WORDS * TOKENS_PER_WORD if system is not None else 0))
    hi = max(min_prompt_tokens, int(budget / TOKENS_PER_WORD))
    lo = min(min_prompt_tokens, hi)
    words = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
    stream = rng.random() < 0.9
    abort = rng.random() < abort_fraction if stream else False
    return Spec(prompt_words=max(1, words), system=system, max_tokens=max_tokens, stream=stream,
                temperature=rng.choice((0.0, 0.8)),
                abort_after=rng.randrange(max(1, max_tokens // 2)) if abort else None,
                text_seed=rng.randrange(1 << 30))


def plan_rng(seed: int, stream: str) -> random.Random:
    """A request stream of the plan; the same for every server (paired rows)."""
    return random.Random(f"soak:{seed}:{stream}")


def words_text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_prompt(i: int, seed: int) -> str:
    return f"You are assistant number {i}. " + words_text(SYSTEM_WORDS, seed * 1000 + i)


def messages_of(spec: Spec, seed: int) -> list[dict]:
    msgs = [{"role": "system", "content": system_prompt(spec.system, seed)}] if spec.system is not None else []
    return msgs + [{"role": "user", "content": words_text(spec.prompt_words, spec.text_seed)}]


# ----------------------------------------------------------------------------- HTTP


class Stats:
    def __init__(self):
        self.requests = self.aborted = self.errors_4xx = self.errors_5xx = self.errors_conn = 0
        self.errors_stream = 0
        self.error_samples: list[str] = []
        self.in_flight = self.max_in_flight = 0
        self.prompt_tokens: list[int] = []
        self.output_tokens = 0
        self.bursts = 0
        self.cancelled = 0  # still running when the drain time ran out (the client hung up)

    def error(self, kind: str, msg: str):
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.error_samples) < 8:
            self.error_samples.append(f"{kind}: {msg[:300]}")


def _bucket(code: int) -> str:
    return "errors_5xx" if code >= 500 else "errors_4xx"


async def chat_request(session, root: str, model: str, spec: Spec, seed: int, stats: Stats,
                       timeout_s: float) -> None:
    import aiohttp

    payload = {"model": model, "messages": messages_of(spec, seed), "max_tokens": spec.max_tokens,
               "temperature": spec.temperature, "stream": spec.stream, "ignore_eos": True}
    if spec.stream:
        payload["stream_options"] = {"include_usage": True}
    stats.in_flight += 1
    stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
    try:
        async with session.post(root + "/v1/chat/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                stats.error(_bucket(resp.status), f"HTTP {resp.status}: {await resp.text()}")
                return
            if not spec.stream:
                body = await resp.json()
                _usage(body.get("usage"), stats)
                stats.requests += 1
                return
            chunks = 0
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:  # SGLang reports a failure inside a 200 stream
                    err = msg["error"]
                    code = int(err.get("code") or 500) if isinstance(err, dict) else 500
                    stats.errors_stream += 1
                    stats.error(_bucket(code), f"in stream: {err}")
                    return
                _usage(msg.get("usage"), stats)
                if msg.get("choices") and (msg["choices"][0].get("delta") or {}).get("content"):
                    chunks += 1
                    if spec.abort_after is not None and chunks > spec.abort_after:
                        resp.close()  # drop the connection mid-stream: the server must abort
                        stats.aborted += 1
                        return
            stats.requests += 1
    except asyncio.CancelledError:
        stats.cancelled += 1
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        stats.error("errors_conn", f"{type(e).__name__}: {e}")
    finally:
        stats.in_flight -= 1


def _usage(usage, stats: Stats) -> None:
    if usage:
        if usage.get("prompt_tokens"):
            stats.prompt_tokens.append(int(usage["prompt_tokens"]))
        stats.output_tokens += int(usage.get("completion_tokens") or 0)


async def get_json(session, url: str, timeout_s: float = 20.0):
    import aiohttp

    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        if r.status != 200:
            return None
        return await r.json(content_type=None)


async def probe_answer(session, root: str, model: str, prompt: str, max_tokens: int,
                       timeout_s: float) -> str | None:
    """The greedy answer to a probe (None: the request failed)."""
    import aiohttp

    payload = {"model": model, "messages": [{"role": "user", "content": prompt}],
               "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    try:
        async with session.post(root + "/v1/chat/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return None
            body = await r.json(content_type=None)
            return body["choices"][0]["message"].get("content") or ""
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError):
        return None


def common_prefix_fraction(ref: str, got: str) -> float:
    if not ref:
        return 1.0 if not got else 0.0
    n = 0
    for a, b in zip(ref, got):
        if a != b:
            break
        n += 1
    return n / len(ref)


class ProbeScore:
    def __init__(self, refs: list[str | None]):
        self.refs, self.n, self.exact, self.prefix, self.failed = refs, 0, 0, 0.0, 0
        self.mismatches: list[dict] = []

    def add(self, i: int, got: str | None):
        if self.refs[i] is None:
            return  # no reference (its idle request failed): not scored
        if got is None:
            self.failed += 1
            return
        self.n += 1
        self.exact += got == self.refs[i]
        self.prefix += common_prefix_fraction(self.refs[i], got)
        if got != self.refs[i] and len(self.mismatches) < 5:
            self.mismatches.append({"probe": i, "expected": self.refs[i][:200], "got": got[:200]})

    @property
    def accuracy(self):
        return round(self.exact / self.n, 4) if self.n else None

    @property
    def prefix_mean(self):
        return round(self.prefix / self.n, 4) if self.n else None


async def probe_pass(session, root, model, refs, args) -> ProbeScore:
    score = ProbeScore(refs)
    for i, p in enumerate(PROBES):
        score.add(i, await probe_answer(session, root, model, p, args.probe_tokens, args.request_timeout))
    return score


# ----------------------------------------------------------------------------- server facts


def server_facts(info: dict | None, models: dict | None) -> dict:
    """max_running_requests, context, KV pool size and settings from /server_info and /v1/models."""
    info = info or {}
    st = (info.get("internal_states") or [{}])[0] or {}
    oscar = st.get("oscar_int2") or {}
    mrr = (st.get("effective_max_running_requests_per_dp") or oscar.get("max_running_requests")
           or info.get("max_running_requests"))
    ctx = None
    for m in (models or {}).get("data") or []:
        ctx = ctx or m.get("max_model_len")
    ctx = ctx or info.get("context_length") or info.get("max_req_input_len")
    model = ((models or {}).get("data") or [{}])[0].get("id") or info.get("served_model_name")
    return {"max_running_requests": int(mrr) if mrr else None, "context_tokens": int(ctx) if ctx else None,
            "max_total_num_tokens": info.get("max_total_num_tokens") or oscar.get("max_total_num_tokens"),
            "kv_cache_dtype": info.get("kv_cache_dtype"), "attention_backend": info.get("attention_backend"),
            "radix_cache": (not info["disable_radix_cache"]) if "disable_radix_cache" in info else None,
            "model": model,
            # int2 only: the kernels of a prefill chunk's new tokens and cached prefix, and the
            # format the cache stores
            "new_token_attention": oscar.get("new_token_attention"),
            "prefix_attention": oscar.get("prefix_attention"),
            "kv_format": oscar.get("kv_format"), "body_bits_per_element": oscar.get("body_bits_per_element")}


async def pool_snapshot(session, root: str) -> dict:
    """Idle pool state: SGLang's used tokens (/v1/loads: excludes evictable radix entries) and our
    plugin's free tokens (/server_info oscar_int2.tokens_free), whichever the server reports."""
    snap = {"sglang_used": None, "oscar_tokens_free": None}
    loads = await _try_json(session, root + "/v1/loads")
    if loads and loads.get("loads"):
        snap["sglang_used"] = sum(int(x.get("num_used_tokens") or 0) for x in loads["loads"])
    info = await _try_json(session, root + "/server_info")
    st = ((info or {}).get("internal_states") or [{}])[0] or {}
    free = (st.get("oscar_int2") or {}).get("tokens_free")
    if free is not None:
        snap["oscar_tokens_free"] = int(free)
    rows_free = (st.get("oscar_int2") or {}).get("side_rows_free")
    if rows_free is not None:  # request rows, each with its BF16 side buffers (int2 servers only)
        snap["oscar_side_rows_free"] = int(rows_free)
    return snap


async def _try_json(session, url):
    import aiohttp

    try:
        return await get_json(session, url)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


def leak_tokens(start: dict, end: dict) -> int | None:
    parts = []
    if start.get("sglang_used") is not None and end.get("sglang_used") is not None:
        parts.append(end["sglang_used"] - start["sglang_used"])
    if start.get("oscar_tokens_free") is not None and end.get("oscar_tokens_free") is not None:
        parts.append(start["oscar_tokens_free"] - end["oscar_tokens_free"])
    return max(parts) if parts else None


def side_rows_leak(start: dict, end: dict) -> int | None:
    """Request rows (each holding BF16 side buffers) free at the start but not at the end; None
    where the server does not report them (BF16 servers have no side buffers)."""
    if start.get("oscar_side_rows_free") is None or end.get("oscar_side_rows_free") is None:
        return None
    return start["oscar_side_rows_free"] - end["oscar_side_rows_free"]


async def retracted_total(session, root: str) -> float | None:
    """SGLang's retraction counter from /metrics (--enable-metrics); None without metrics."""
    import aiohttp

    try:
        async with session.get(root + "/metrics", timeout=aiohttp.ClientTimeout(total=20)) as r:
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None
    vals = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith("sglang:num_retracted_reqs_total")]
    return sum(vals) if vals else None


IDLE_POLL_S = 0.5  # between wait_idle's /v1/loads reads (the tests' stub servers set it shorter)


async def wait_idle(session, root: str, stats: Stats, timeout_s: float) -> bool:
    """No request of ours in flight and /v1/loads shows none running or waiting, twice in a row
    (IDLE_POLL_S apart)."""
    t0, quiet = time.monotonic(), 0
    while time.monotonic() - t0 < timeout_s:
        loads = await _try_json(session, root + "/v1/loads")
        busy = stats.in_flight
        if loads and loads.get("loads"):
            busy += sum(int(x.get("num_running_reqs") or 0) + int(x.get("num_waiting_reqs") or 0)
                        for x in loads["loads"])
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= 2:
            return True
        await asyncio.sleep(IDLE_POLL_S)
    return False


async def flush_cache(session, root: str) -> bool:
    import aiohttp

    try:
        async with session.post(root + "/flush_cache", timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


# ----------------------------------------------------------------------------- one server


class Monitor:
    """/health (and the process, when we started it) every interval; each run of failures is one
    crash. Also samples /v1/loads for the queue depth reached (proof that bursts queued)."""

    def __init__(self, session, root, interval, timeout, proc=None, path="/health_generate"):
        self.session, self.root, self.interval, self.timeout, self.proc = session, root, interval, timeout, proc
        self.path = path
        self.crashes, self.events, self.failing, self.dead = 0, [], False, False
        self.max_waiting = self.max_running = self.max_retracted = 0
        self.t0 = time.monotonic()

    async def check(self) -> bool:
        import aiohttp

        if self.proc is not None and self.proc.poll() is not None:
            self.dead = True
            return False
        try:
            async with self.session.get(self.root + self.path,
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok = False
        if not ok and self.proc is not None:
            for _ in range(20):  # a dying process closes its socket before it can be reaped
                if self.proc.poll() is not None:
                    self.dead = True
                    return False
                await asyncio.sleep(0.05)
        loads = await _try_json(self.session, self.root + "/v1/loads")
        for x in (loads or {}).get("loads") or []:
            self.max_waiting = max(self.max_waiting, int(x.get("num_waiting_reqs") or 0))
            self.max_running = max(self.max_running, int(x.get("num_running_reqs") or 0))
            self.max_retracted = max(self.max_retracted, int((x.get("queues") or {}).get("retracted") or 0))
        return ok

    async def run(self, stop: asyncio.Event):
        while not stop.is_set():
            ok = await self.check()
            if not ok and not self.failing:
                self.crashes += 1
                what = "process exited" if self.dead else "/health failed"
                self.events.append({"t_s": round(time.monotonic() - self.t0, 1), "what": what})
            self.failing = not ok
            if self.dead:
                return
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass


class Progress:
    def __init__(self, name, duration, quiet):
        self.name, self.duration, self.quiet = name, duration, quiet
        self.tty, self.last = sys.stderr.isatty(), 0.0

    def show(self, elapsed, stats: Stats, probes: ProbeScore, final=False):
        if self.quiet:
            return
        now = time.monotonic()
        if not final and now - self.last < (1.0 if self.tty else 10.0):
            return
        self.last = now
        frac = min(1.0, elapsed / self.duration) if self.duration else 1.0
        bar = "#" * int(frac * 20)
        line = (f"[{self.name}] [{bar:<20}] {elapsed:5.0f}/{self.duration:.0f} s  done {stats.requests}"
                f"  aborted {stats.aborted}  4xx {stats.errors_4xx}  5xx {stats.errors_5xx}"
                f"  conn {stats.errors_conn}  in flight {stats.in_flight}  probes {probes.exact}/{probes.n}")
        print(("\r" + line) if self.tty else line, end="\n" if (final or not self.tty) else "",
              file=sys.stderr, flush=True)


async def soak_server(name: str, root: str, args, proc=None, stop_all: asyncio.Event | None = None) -> dict:
    import aiohttp

    root = root.rstrip("/")
    if root.endswith("/v1"):
        root = root[:-3]
    stats = Stats()
    row = {"name": name, "url": root, "managed": proc is not None}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        info = await _try_json(session, root + "/server_info")
        models = await _try_json(session, root + "/v1/models")
        facts = server_facts(info, models)
        row.update(facts)
        if info is None:
            row["error"] = f"{root}/server_info did not answer: is this an SGLang server?"
        mrr = facts["max_running_requests"] or args.max_running_requests
        if not mrr:
            raise RuntimeError(f"{name}: /server_info reports no max_running_requests; pass "
                               "--max-running-requests")
        ctx = min(args.max_prompt_tokens, facts["context_tokens"] or args.max_prompt_tokens)
        model = args.model_name or facts["model"]
        if not model:
            raise RuntimeError(f"{name}: /v1/models lists no model; pass --model-name")
        concurrency = args.concurrency or max(2, min(64, mrr // 2))
        burst = max(mrr + 1, math.ceil(args.burst_factor * mrr))
        row.update(max_running_requests=mrr, prompt_tokens_cap=ctx, concurrency=concurrency,
                   burst_size=burst, model=model)

        # idle at the start: references, a second pass (determinism), the pool's idle value
        refs = [await probe_answer(session, root, model, p, args.probe_tokens, args.request_timeout)
                for p in PROBES]
        alone = await probe_pass(session, root, model, refs, args)
        await flush_cache(session, root)
        start_pool = await pool_snapshot(session, root)

        stop = asyncio.Event()
        mon = Monitor(session, root, args.health_interval, args.health_timeout, proc, args.health_path)
        retracted0 = await retracted_total(session, root)
        loaded = ProbeScore(refs)
        prog = Progress(name, args.duration, args.quiet)
        t0 = time.monotonic()

        def over():
            return (time.monotonic() - t0 >= args.duration or stop.is_set()
                    or (stop_all is not None and stop_all.is_set()) or mon.dead)

        async def worker(w: int):
            rng = plan_rng(args.seed, f"worker{w}")
            while not over():
                spec = make_spec(rng, ctx, args.min_prompt_tokens, args.abort_fraction)
                await chat_request(session, root, model, spec, args.seed, stats, args.request_timeout)

        async def bursts():
            rng, k = plan_rng(args.seed, "burst"), 0
            while True:
                k += 1
                wake = t0 + k * args.burst_every
                while time.monotonic() < wake:
                    if over():
                        return
                    await asyncio.sleep(min(0.2, max(0.0, wake - time.monotonic())))
                specs = [make_spec(rng, ctx, args.min_prompt_tokens, args.abort_fraction) for _ in range(burst)]
                stats.bursts += 1
                await asyncio.gather(*[chat_request(session, root, model, s, args.seed, stats,
                                                    args.request_timeout) for s in specs])

        async def probes():
            i = 0
            while not over():
                # only probes that run while other requests are in flight measure "loaded"
                busy = stats.in_flight > 0
                got = await probe_answer(session, root, model, PROBES[i % len(PROBES)], args.probe_tokens,
                                         args.request_timeout)
                if busy and not over():
                    loaded.add(i % len(PROBES), got)
                i += 1
                await asyncio.sleep(args.probe_interval)

        async def progress():
            while not over():
                prog.show(time.monotonic() - t0, stats, loaded)
                await asyncio.sleep(0.25)

        mon_task = asyncio.create_task(mon.run(stop))
        load = [asyncio.create_task(worker(w)) for w in range(concurrency)]
        load += [asyncio.create_task(bursts()), asyncio.create_task(probes()),
                 asyncio.create_task(progress())]
        # the load stops at the duration; in-flight requests get --drain-timeout to finish
        done, pending = await asyncio.wait(load, timeout=args.duration + args.drain_timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        load_s = time.monotonic() - t0
        prog.show(load_s, stats, loaded, final=True)
        interrupted = stop_all is not None and stop_all.is_set()

        # idle again: the pool must be back where it was, and the probes must still be right
        idle = (not mon.dead) and await wait_idle(session, root, stats, 0 if interrupted else args.idle_timeout)
        if idle:
            await flush_cache(session, root)
        end_pool = await pool_snapshot(session, root) if not mon.dead else {}
        after = await probe_pass(session, root, model, refs, args) if not mon.dead and not interrupted else ProbeScore(refs)
        # a crash in the drain or the idle phase counts too
        if not await mon.check() and not mon.failing:
            mon.crashes += 1
            mon.events.append({"t_s": round(time.monotonic() - mon.t0, 1), "what": "/health failed after the load"})
        stop.set()
        await mon_task
        retracted1 = await retracted_total(session, root) if not mon.dead else None

    leak = leak_tokens(start_pool, end_pool) if idle else None
    pt = stats.prompt_tokens
    row.update({
        "duration_s": round(load_s, 1), "interrupted": interrupted,
        "requests": stats.requests, "aborted": stats.aborted, "errors_4xx": stats.errors_4xx,
        "errors_5xx": stats.errors_5xx, "errors_conn": stats.errors_conn, "errors_in_stream": stats.errors_stream,
        "error_samples": stats.error_samples, "crashes": mon.crashes, "crash_events": mon.events,
        "pool_leak_tokens": leak, "idle_reached": idle,
        "side_rows_leak": side_rows_leak(start_pool, end_pool) if idle else None,
        "pool_start": start_pool, "pool_end": end_pool,
        "probe_accuracy_alone": alone.accuracy, "probe_accuracy_loaded": loaded.accuracy,
        "probe_accuracy_after": after.accuracy, "probe_prefix_loaded": loaded.prefix_mean,
        "probes_alone": alone.n, "probes_loaded": loaded.n, "probes_after": after.n,
        "probes_failed": alone.failed + loaded.failed + after.failed,
        "probes_without_reference": sum(r is None for r in refs),
        "probe_mismatches_loaded": loaded.mismatches, "probe_mismatches_after": after.mismatches,
        "max_in_flight": stats.max_in_flight, "bursts": stats.bursts,
        "max_waiting_seen": mon.max_waiting, "max_running_seen": mon.max_running,
        "max_retracted_seen": mon.max_retracted, "output_tokens": stats.output_tokens,
        "retracted_reqs": (retracted1 - retracted0) if retracted0 is not None and retracted1 is not None else None,
        "cancelled_at_drain": stats.cancelled,
        "prompt_tokens": ({"n": len(pt), "min": min(pt), "max": max(pt), "mean": round(sum(pt) / len(pt))}
                          if pt else None),
    })
    row["checks"] = checks(row, args)
    row["ok"] = all(row["checks"].values())
    return row


def checks(row: dict, args) -> dict:
    """Pass / fail per check; a check with nothing measured fails (never passes by default)."""
    alone, loaded, after = row["probe_accuracy_alone"], row["probe_accuracy_loaded"], row["probe_accuracy_after"]
    # only servers that report side-buffer rows get this check (BF16 has none to leak)
    side = ({"no_side_buffer_leak": row.get("side_rows_leak") == 0}
            if (row.get("pool_start") or {}).get("oscar_side_rows_free") is not None else {})
    return {**side,
        "no_crash": row["crashes"] == 0,
        "no_5xx": row["errors_5xx"] == 0,
        "no_connection_errors": row["errors_conn"] == 0,
        "no_4xx": row["errors_4xx"] == 0,
        "requests_done": row["requests"] > 0,
        "aborts_sent": row["aborted"] > 0,
        "burst_above_max_running": row["max_in_flight"] > row["max_running_requests"],
        "no_pool_leak": row["pool_leak_tokens"] == 0,
        "probes_deterministic_alone": alone == 1.0,
        "probes_not_garbled_loaded": (loaded is not None and alone is not None
                                      and loaded >= alone - args.garble_tolerance),
        "probes_right_after": after is not None and alone is not None and after >= alone - args.garble_tolerance,
    }


# ----------------------------------------------------------------------------- servers we start


def managed_command(config: str, args, port: int) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path,
            "--tokenizer-path", args.tokenizer_path, "--host", "127.0.0.1", "--port", str(port),
            *CONFIGS[config], *shlex.split(args.server_args)]


def fitted_tokenizer(model: Path, source: Path, dst: Path) -> Path:
    from bench.model_coverage import fit_tokenizer

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    fit_tokenizer(source, dst, vocab)
    return dst


def log_findings(path: Path) -> dict:
    """What a started server's log says: SGLang's idle leak check and tracebacks."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    return {"log_leak_warnings": text.count("memory leak detected"),
            "log_tracebacks": text.count("Traceback (most recent call last)")}


def parse_urls(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for it in items:
        name, sep, url = it.partition("=")
        if not sep or not name or not url.startswith("http"):
            raise ValueError(f"--url {it!r}: expected NAME=http://HOST:PORT")
        out.append((name, url))
    return out


async def run_all(args, targets: list[tuple], out: Path, meta: dict) -> list[dict]:
    """targets: (name, url) for running servers, (name, None) for a config to start."""
    stop_all = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop_all.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        return await _run_targets(args, targets, out, meta, stop_all)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):
                pass


async def _run_targets(args, targets, out, meta, stop_all) -> list[dict]:
    rows, t_start, longest = [], time.monotonic(), 0.0
    for i, (name, url) in enumerate(targets):
        if stop_all.is_set():
            break
        t0 = time.monotonic()
        if args.deadline_s and t0 - t_start + max(longest, args.duration) > args.deadline_s:
            rows.append({"name": name, "error": f"skipped: would end past --deadline-s {args.deadline_s:g}"})
            _write(out, meta, rows, args)
            continue
        try:
            if url is not None:
                row = await soak_server(name, url, args, stop_all=stop_all)
            else:
                row = await _managed(name, args, i, stop_all)
        except Exception as e:  # one broken server must not lose the other rows
            row = {"name": name, "error": f"{type(e).__name__}: {e}", "ok": False}
        longest = max(longest, time.monotonic() - t0)
        rows.append(row)
        _write(out, meta, rows, args)
    return rows


async def _managed(name: str, args, i: int, stop_all) -> dict:
    from bench._launcher import Server

    port = args.port + i
    cmd = managed_command(name, args, port)
    log = Path(args.log_dir) / f"soak_{name}.log"
    print(f"== {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = ({"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(args.force_retract)}
           if args.force_retract else {})
    with Server(cmd, env, log, port) as srv:
        startup = await asyncio.to_thread(srv.wait_ready, args.startup_timeout)
        row = await soak_server(name, srv.url, args, proc=srv.proc, stop_all=stop_all)
    row.update(startup_s=round(startup, 1), server_command=shlex.join(cmd), server_env=env, log=str(log),
               **log_findings(log))
    if row.get("log_leak_warnings"):
        row["checks"]["no_leak_in_log"] = False
        row["ok"] = False
    return row


def kv_kind(row: dict) -> str | None:
    """int2 / bf16 / fp8_e4m3 of a row: from the server's command when this script started it,
    else from the name (int2..., bf16..., fp8...)."""
    cmd = row.get("server_command") or ""
    if "--kv-cache-dtype int2" in cmd:
        return "int2"
    if "--kv-cache-dtype fp8_e4m3" in cmd:
        return "fp8_e4m3"
    if cmd:
        return "bf16"
    name = str(row.get("name", ""))
    return next((k for k in ("int2", "bf16", "fp8_e4m3") if name.startswith(k[:4])), None)


def pooled_accuracy(rows: list[dict], kind: str, phase: str) -> float | None:
    """Probe accuracy of one phase (alone / loaded / after) over every row of a KV kind, each
    probe counted once (rows weighted by their probe counts)."""
    n = right = 0
    for r in rows:
        acc, k = r.get(f"probe_accuracy_{phase}"), r.get(f"probes_{phase}") or 0
        if kv_kind(r) == kind and acc is not None and k:
            n, right = n + k, right + acc * k
    return round(right / n, 4) if n else None


def summary(rows: list[dict]) -> dict:
    """Run-wide values of the result document (the soak's acceptance keys): totals over every row, the
    pooled probe accuracies per KV kind."""
    done = [r for r in rows if "requests" in r]
    leaks = [r["pool_leak_tokens"] for r in done if r.get("pool_leak_tokens") is not None]
    out = dict(duration_s=round(sum(r.get("duration_s") or 0 for r in done), 1),
               requests=sum(r["requests"] for r in done),
               aborted=sum(r["aborted"] for r in done),
               errors_4xx=sum(r["errors_4xx"] for r in done),
               errors_5xx=sum(r["errors_5xx"] for r in done),
               crashes=sum(r["crashes"] for r in done),
               # a row that never got idle has no leak figure: that is not a pass
               pool_leak_tokens=(max(leaks) if leaks and len(leaks) == len(done) else None))
    for kind in ("int2", "bf16"):
        for phase in ("alone", "loaded"):
            out[f"probe_accuracy_{kind}_{phase}"] = pooled_accuracy(done, kind, phase)
    a, b = out["probe_accuracy_int2_alone"], out["probe_accuracy_int2_loaded"]
    out["int2_loaded_minus_alone_points"] = round(100 * (b - a), 2) if a is not None and b is not None else None
    return out


def _write(out: Path, meta: dict, rows: list[dict], args) -> None:
    done = [r for r in rows if "requests" in r]
    model = ", ".join(sorted({str(r.get("model")) for r in done})) or meta.get("model_hint") or "unknown"
    doc = _results.document(model, rows, device=meta["device"], load_s_per_server=args.duration,
                            seed=args.seed, **summary(rows),
                            ok=bool(rows) and all(r.get("ok") for r in rows),
                            notes=NOTES)
    doc["command"] = meta["command"]
    _results.write(out, doc)


def merge(paths: list[Path], out: Path) -> dict:
    """One document from soak runs: servers soaked side by side (one process per server, each its
    own --out) and runs made one after another (other seeds, other machines). Every row keeps
    its run's date and seed; the run-wide values are recomputed over all rows; every command."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    seen: dict[tuple, Path] = {}
    for p, d in zip(paths, docs):
        key = (d.get("date"), d.get("command"))
        if key in seen:  # the same result file (or a copy) twice would count its requests twice
            raise ValueError(f"{p} repeats the run of {seen[key]} (same date and command)")
        seen[key] = p
    rows = [{**r, "run_date": d["date"], "seed": r.get("seed", d.get("seed"))} for d in docs for r in d["rows"]]
    ids = [(r.get("name"), r["seed"], r["run_date"]) for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"rows repeat (name, seed, date) across {[str(p) for p in paths]}: {ids}")
    model = ", ".join(sorted({d["model"] for d in docs}))
    doc = _results.document(model, rows, device=", ".join(sorted({d["device"] for d in docs})),
                            **summary(rows),
                            ok=all(r.get("ok") for r in rows), notes=NOTES,
                            merged_from=[{"file": Path(p).name, "date": d["date"], "command": d["command"]}
                                         for p, d in zip(paths, docs)])
    doc["command"] = " ; ".join(d["command"] for d in docs)
    _results.write(out, doc)
    return doc


NOTES = {
    "requests": "completed requests (not aborted, no error)",
    "pool_leak_tokens": "idle after the load and a radix flush vs idle at the start: max of "
                        "SGLang /v1/loads num_used_tokens growth and oscar_int2.tokens_free loss",
    "duration_s": "seconds each server was under traffic (--duration of load, then up to "
                  "--drain-timeout for the requests still in flight), summed over the rows",
    "probe_accuracy_<kv>_<phase>": "pooled over every row of that KV kind, each probe once",
    "probe_accuracy": "exact match with the greedy answer the same server gave idle at the start; "
                      "alone = second idle pass, loaded = during the load, after = idle after it. "
                      "SGLang is not batch-invariant: with dummy (random) weights greedy answers flip "
                      "easily, so compare int2 with bf16 of the same run",
}


def main(argv: list[str] | None = None) -> int:
    env_out = os.environ.get("OUT")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="a running server to soak (repeatable)")
    p.add_argument("--configs", default="", help=f"servers to start, comma-separated: {', '.join(CONFIGS)}")
    p.add_argument("--model-path", default=str(ROOT / "launch" / "models" / "llama31-8b"),
                   help="for --configs (default: launch/models/llama31-8b, dummy weights)")
    p.add_argument("--tokenizer-path", default="",
                   help="for --configs (default: the devkit's SmolLM2 tokenizer fitted to the model's "
                   "vocab_size by bench/model_coverage.py's fit_tokenizer, so every generated id decodes "
                   "to text and garbled probe answers are visible; written under --log-dir)")
    p.add_argument("--tokenizer-source", default=str(DEVKIT / "smollm2-135m"))
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help=f"for --configs (default: {DEFAULT_SERVER_ARGS})")
    p.add_argument("--port", type=int, default=31200, help="first port for --configs")
    p.add_argument("--log-dir", default=str(Path(env_out or ROOT / "bench_out") / "soak_logs"))
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--out", default=str(Path(env_out) / DEFAULT_JSON) if env_out else str(_results.RESULTS / DEFAULT_JSON),
                   help=f"results JSON (default $OUT/{DEFAULT_JSON}, else bench/results/{DEFAULT_JSON})")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load per server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=0, help="steady workers (default: max_running_requests / 2, at most 64)")
    p.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts")
    p.add_argument("--burst-factor", type=float, default=1.5, help="burst size / max_running_requests")
    p.add_argument("--abort-fraction", type=float, default=0.1, help="streams closed mid-way")
    p.add_argument("--min-prompt-tokens", type=int, default=100)
    p.add_argument("--max-prompt-tokens", type=int, default=32768, help="also capped by the server's context")
    p.add_argument("--max-running-requests", type=int, default=0, help="when /server_info does not say")
    p.add_argument("--model-name", default=None, help="default: the first of /v1/models")
    p.add_argument("--probe-tokens", type=int, default=32)
    p.add_argument("--probe-interval", type=float, default=0.5)
    p.add_argument("--garble-tolerance", type=float, default=0.25,
                   help="probe accuracy may drop this much under load before the check fails")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="for in-flight requests after --duration; the rest are cancelled (cancelled_at_drain)")
    p.add_argument("--idle-timeout", type=float, default=120.0)
    p.add_argument("--health-path", default="/health_generate",
                   help="/health_generate (default) answers only when the scheduler produces output; "
                   "SGLang's /health answers 200 while the HTTP process lives")
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--health-timeout", type=float, default=30.0)
    p.add_argument("--force-retract", type=int, default=0, metavar="N",
                   help="started servers only: SGLANG_TEST_RETRACT=1, SGLANG_TEST_RETRACT_INTERVAL=N "
                   "(SGLang retracts running requests every N decode steps; 0: off)")
    p.add_argument("--deadline-s", type=float, default=0.0, help="skip a server that would end after this (0: none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--print-commands", action="store_true", help="print the --configs server commands and exit")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="no load: merge result files (servers soaked side by side, or runs made one after "
                   "another) into --out")
    args = p.parse_args(argv)
    if args.merge:
        doc = merge([Path(x) for x in args.merge], Path(args.out))
        print(json.dumps({k: v for k, v in doc.items() if k not in ("rows", "notes", "merged_from")}, indent=1))
        print(f"wrote {args.out}")
        return 0 if doc["ok"] else 1
    try:
        targets = [(n, u) for n, u in parse_urls(args.url)]
        configs = [c for c in (x.strip() for x in args.configs.split(",")) if c]
        bad = [c for c in configs if c not in CONFIGS]
        if bad:
            raise ValueError(f"unknown --configs {bad}: use {', '.join(CONFIGS)}")
        targets += [(c, None) for c in configs]
        if not targets:
            raise ValueError("nothing to soak: give --url NAME=URL and/or --configs")
        names = [n for n, _ in targets]
        if len(set(names)) != len(names):
            raise ValueError(f"names must be unique: {names}")
    except ValueError as e:
        p.error(str(e))
    if configs and not args.tokenizer_path:
        args.tokenizer_path = str(Path(args.log_dir) / "tokenizer")
        if not args.print_commands:
            try:
                fitted_tokenizer(Path(args.model_path), Path(args.tokenizer_source), Path(args.tokenizer_path))
            except (OSError, ValueError, KeyError) as e:
                p.error(f"cannot make the tokenizer: {e} (unpack .devkit/smollm2_tok.tar.xz or pass --tokenizer-path)")
    if args.print_commands:
        for i, c in enumerate(configs):
            print(f"{c}: {shlex.join(managed_command(c, args, args.port + i))}")
        return 0
    meta = {"device": _results.device_name(),
            "command": _results.command("soak", sys.argv[1:] if argv is None else argv)}
    out = Path(args.out)
    rows = asyncio.run(run_all(args, targets, out, meta))
    for r in rows:
        if "requests" in r:
            print(f"{r['name']:>14}  ok {r['ok']}  requests {r['requests']}  aborted {r['aborted']}  "
                  f"4xx {r['errors_4xx']}  5xx {r['errors_5xx']}  crashes {r['crashes']}  "
                  f"leak {r['pool_leak_tokens']}  probes alone {r['probe_accuracy_alone']} loaded "
                  f"{r['probe_accuracy_loaded']} after {r['probe_accuracy_after']}  failed: "
                  f"{[k for k, v in r['checks'].items() if not v]}")
        else:
            print(f"{r['name']:>14}  ERROR {r.get('error')}")
    print(f"wrote {out}")
    return 0 if rows and all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
