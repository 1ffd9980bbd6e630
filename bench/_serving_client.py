"""Load generator for bench/serving.py: stream token-id requests to SGLang's /generate.

One responsibility: send N requests at once (or one), timestamp every streamed chunk, and turn
the timestamps into TTFT / TPOT / throughput. Prompts are random token ids, distinct per request,
so the radix cache never shares a prefix between them (each request really holds its own KV).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from typing import List, Optional

import numpy as np


@dataclasses.dataclass
class RequestRecord:
    prompt_len: int
    sent: float
    first_token: Optional[float] = None
    finished: Optional[float] = None
    output_tokens: int = 0
    # (time, cumulative output tokens) per streamed chunk
    chunks: List[tuple] = dataclasses.field(default_factory=list)
    error: Optional[str] = None
    # the last chunk's meta_info (speculative servers put spec_verify_ct there) and the output
    # token ids, whether the server streams only new ids (--incremental-streaming-output) or all
    meta_info: Optional[dict] = None
    output_ids: List[int] = dataclasses.field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first one."""
        if self.output_tokens < 2:
            return float("nan")
        return (self.finished - self.first_token) / (self.output_tokens - 1)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    """Distinct random prompts; token 0..999 and the top of the vocab are avoided (specials)."""
    rng = random.Random(seed)
    hi = vocab - 1000
    # the first token differs per (seed, i), so no two prompts share even one radix-cache token
    return [[1000 + (seed * 104729 + i * 7919) % (hi - 1000)]
            + [rng.randrange(1000, hi) for _ in range(length - 1)] for i in range(n)]


async def _one(session, url: str, ids: List[int], out_len: int, rec: RequestRecord, tick,
               ignore_eos: bool = True) -> None:
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": ignore_eos},
        "stream": True,
    }
    rec.sent = time.perf_counter()
    try:
        async with session.post(url + "/generate", json=payload) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            buf = b""
            async for piece in resp.content.iter_any():
                buf += piece
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    now = time.perf_counter()
                    msg = json.loads(data)
                    if "error" in msg:
                        rec.error = str(msg["error"])[:300]
                        continue
                    # completion_tokens counts the whole output so far, with or without
                    # --incremental-streaming-output (with it a chunk's output_ids are only its
                    # new tokens, so their length is no count)
                    n = msg.get("meta_info", {}).get("completion_tokens")
                    if n is None:
                        rec.error = "a streamed chunk without meta_info.completion_tokens"
                        continue
                    rec.meta_info = msg["meta_info"]
                    ids_now = msg.get("output_ids") or []
                    # all ids so far (len == completion_tokens), or only this chunk's new ones
                    rec.output_ids = list(ids_now) if len(ids_now) == n else rec.output_ids + list(ids_now)
                    if n > 0 and rec.first_token is None:
                        rec.first_token = now
                        tick(started=True)
                    if n > rec.output_tokens:
                        rec.output_tokens = n
                        rec.chunks.append((now, n))
    except Exception as e:  # a failed request is recorded, never silently counted
        rec.error = f"{type(e).__name__}: {e}"
    rec.finished = time.perf_counter()
    tick(done=True)


async def _run(url: str, prompts: List[List[int]], out_len: int, label: str,
               timeout_s: float, on_first_token=None, ignore_eos: bool = True,
               progress: bool = True) -> List[RequestRecord]:
    import aiohttp

    records = [RequestRecord(prompt_len=len(p), sent=0.0) for p in prompts]
    state = {"started": 0, "done": 0, "last": 0.0}
    t0 = time.perf_counter()

    def tick(started=False, done=False):
        state["started"] += started
        state["done"] += done
        if started and on_first_token is not None:
            on_first_token()
        now = time.perf_counter()
        if progress and (now - state["last"] > 10 or state["done"] == len(prompts)):
            state["last"] = now
            print(f"    [{label}] {now - t0:6.1f} s: first token {state['started']}/{len(prompts)}, "
                  f"finished {state['done']}/{len(prompts)}", flush=True)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        await asyncio.gather(*[_one(session, url, p, out_len, r, tick, ignore_eos)
                               for p, r in zip(prompts, records)])
    return records


def run_requests(url: str, prompts: List[List[int]], out_len: int, label: str,
                 timeout_s: float = 900.0, on_first_token=None, ignore_eos: bool = True,
                 progress: bool = True) -> List[RequestRecord]:
    """Send all prompts at once and wait for every one to finish (ignore_eos=False: greedy
    answers that stop at EOS, out_len being their cap). progress=False: no progress lines (a
    caller sending one request at a time prints its own)."""
    return asyncio.run(_run(url, prompts, out_len, label, timeout_s, on_first_token, ignore_eos, progress))


def _pct(values, qs=(50, 90, 99)) -> dict:
    v = np.asarray([x for x in values if x == x])
    if v.size == 0:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(np.percentile(v, q)) for q in qs}


def max_concurrent_decoding(records: List[RequestRecord]) -> int:
    """Largest number of requests that were between first token and finish at the same time."""
    events = []
    for r in records:
        if r.first_token is not None and r.finished is not None:
            events += [(r.first_token, 1), (r.finished, -1)]
    best = cur = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        cur += d
        best = max(best, cur)
    return best


def full_occupancy_decode(records: List[RequestRecord], min_span_s: float = 0.5) -> dict:
    """Output rate in the longest stretch where the most requests were decoding together and none
    started or finished (so no prefill ran in it): the decode throughput at full KV occupancy."""
    events = sorted({t for r in records for t in (r.first_token, r.finished)})
    best = None
    peak = max_concurrent_decoding(records)
    for a, b in zip(events, events[1:]):
        mid = (a + b) / 2
        live = sum(1 for r in records if r.first_token <= mid < r.finished)
        if live == peak and (best is None or b - a > best[1] - best[0]):
            best = (a, b)
    if best is None or best[1] - best[0] < min_span_s:
        return {"tok_s": None, "span_s": None, "requests": peak}
    a, b = best
    tokens = 0
    for r in records:
        prev = None
        for t, n in r.chunks:
            if a < t <= b and prev is not None:
                tokens += n - prev
            prev = n
    return {"tok_s": tokens / (b - a), "span_s": b - a, "requests": peak}


def phase_split(records: List[RequestRecord], max_step_s: float = 0.15) -> dict:
    """Split a load's wall time into decoding and prefill (and everything else) from the client's
    token timestamps. SGLang runs prefill chunks between decode steps, never inside one, so the
    gaps between consecutive streamed tokens (of any request) are decode steps (tens of ms) or
    stretches that also hold a prefill chunk (an 8K chunk of Llama-3.1-8B takes ~0.5 s). A gap
    counts as decoding when it is at most `max_step_s` long and some request was decoding in it."""
    ok = [r for r in records if r.first_token is not None and r.finished is not None]
    if not ok:
        return {}
    t_start, t_end = min(r.sent for r in ok), max(r.finished for r in ok)
    times = sorted({t for r in ok for t, _ in r.chunks} | {t_start, t_end})
    spans = sorted((r.first_token, r.finished) for r in ok)
    decode_s, steps = 0.0, 0
    for a, b in zip(times, times[1:]):
        if b - a <= max_step_s and any(f <= a < e for f, e in spans):
            decode_s += b - a
            steps += 1
    decode_tokens = sum(max(r.output_tokens - 1, 0) for r in ok)
    return {"max_step_s": max_step_s, "decode_s": decode_s, "other_s": (t_end - t_start) - decode_s,
            "decode_tokens": decode_tokens,
            "decode_tok_s_while_decoding": decode_tokens / decode_s if decode_s else None}


def timelines(records: List[RequestRecord]) -> List[dict]:
    """Per-request timestamps (s, relative to the first send) for later analysis and plots."""
    t0 = min(r.sent for r in records)
    rel = lambda t: None if t is None else round(t - t0, 4)  # noqa: E731
    return [{"prompt_len": r.prompt_len, "sent": rel(r.sent), "first_token": rel(r.first_token),
             "finished": rel(r.finished), "error": r.error,
             "chunks": [[rel(t), n] for t, n in r.chunks]} for r in records]


def summarize(records: List[RequestRecord]) -> dict:
    ok = [r for r in records if r.error is None and r.first_token is not None]
    errors = [r.error for r in records if r.error is not None]
    if not ok:
        return {"n": len(records), "ok": 0, "errors": errors[:5]}
    t_start = min(r.sent for r in ok)
    t_end = max(r.finished for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    # Decode-phase throughput: output tokens after each request's first, over the span in which
    # some request was decoding (prefill-only stretches at the start are excluded).
    first_decode = min(r.first_token for r in ok)
    decode_tokens = sum(max(r.output_tokens - 1, 0) for r in ok)
    return {
        "n": len(records),
        "ok": len(ok),
        "errors": errors[:5],
        "duration_s": t_end - t_start,
        "output_tokens": out_tokens,
        "input_tokens": sum(r.prompt_len for r in ok),
        "output_tok_s": out_tokens / (t_end - t_start),
        "decode_span_s": t_end - first_decode,
        "decode_tok_s": decode_tokens / max(t_end - first_decode, 1e-9),
        "ttft_s": _pct([r.ttft for r in ok]),
        "tpot_ms": {k: (v * 1e3 if v is not None else None)
                    for k, v in _pct([r.tpot for r in ok]).items()},
        "max_concurrent_decoding": max_concurrent_decoding(ok),
        "full_occupancy_decode": full_occupancy_decode(ok),
        "phase_split": phase_split(ok),
    }


def inter_token_ms(record: RequestRecord) -> List[float]:
    """Per-token gaps of one streamed request (ms), spreading multi-token chunks evenly."""
    gaps = []
    for (t0, n0), (t1, n1) in zip(record.chunks, record.chunks[1:]):
        if n1 > n0:
            gaps += [(t1 - t0) * 1e3 / (n1 - n0)] * (n1 - n0)
    return gaps
