"""Needle-in-a-haystack over the Paul Graham essays.

A random 7-digit "magic number" sentence is inserted at a given depth (fraction of the
haystack, moved to the next sentence boundary) of a haystack cut to a token budget; the model
is asked for the number. Grid: context lengths x depths x trials, each cell the fraction correct.

Scoring is **exact match**: the first integer of the answer (digits, optionally grouped by
commas: "7,463,343") must equal the needle. "The number is 7463343." and "7463343 and 12" are
right; "74633431" and "746." are wrong. The looser "the answer contains the number" score of
earlier versions is kept next to it (``contains``) for comparison.

Every trial has its own needle (distinct numbers from ``seed``) and its own haystack (the essays
rotated to a seeded start, shared by the depths of that trial), so the same seed gives the same
prompts for every server: results of two servers are paired prompt by prompt (``prompts_sha256``
in the JSON says so).

Backends:
* ``OpenAIChat``: POST {base_url}/chat/completions (any OpenAI-compatible server: SGLang with
  --kv-cache-dtype int2 or BF16, vLLM, llama.cpp...), greedy, bounded concurrency, retries
  with backoff on connection errors / 5xx / 429, per-request timeout.
* ``LocalChat``: transformers, greedy generate, optionally with the emulated KV cache
  (evaluation.emulation, prefill in BF16 then mixed INT2/BF16 decode, as the server does).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import random
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger("oscar_sglang.eval")

QUESTION = ("What is the special magic number mentioned in the text above? "
            "Answer with the number only.")
NEEDLE = "The special magic number is {number}."
PROMPT_OVERHEAD_TOKENS = 64  # instruction, question and chat template around the haystack

# Defaults of the served harness (the issue: 10 depths, lengths up to the context, >= 100 trials
# per configuration). Depths are the centres of the ten deciles of the haystack: every tenth of
# the context counts once, and neither end (the INT2 cache's BF16 sink and recent windows) is
# over-weighted.
DEFAULT_DEPTHS = [round(0.05 + 0.1 * i, 2) for i in range(10)]
DEFAULT_BASE_LENGTHS = (1024, 2048, 4096)
DEFAULT_MIN_TRIALS = 100
LENGTH_STEP = 256  # the longest default length is rounded down to this
# --local runs generate on the CPU: keep its old, small defaults
LOCAL_LENGTHS, LOCAL_DEPTHS, LOCAL_TRIALS = [1024, 2048, 4096], [0.0, 0.25, 0.5, 0.75, 1.0], 1


class TokenCounter:
    """Token lengths with a real tokenizer, or ~4 characters per token ('chars')."""

    def __init__(self, tokenizer=None):
        self.tok = tokenizer

    def truncate(self, text: str, n_tokens: int) -> str:
        if self.tok is None:
            return text[: 4 * n_tokens]
        # tokenise a generous character prefix only (English BPE: ~4 characters per token), not
        # the whole corpus for every trial; fall back to all of it when the prefix is too short
        head = text[: 8 * n_tokens + 1000]
        ids = self.tok(head, add_special_tokens=False).input_ids
        if len(ids) < n_tokens and len(head) < len(text):
            ids = self.tok(text, add_special_tokens=False).input_ids
        return self.tok.decode(ids[:n_tokens])

    def count(self, text: str) -> int:
        if self.tok is None:
            return len(text) // 4
        return len(self.tok(text, add_special_tokens=False).input_ids)

    def prompt_tokens(self, prompt: str) -> int | None:
        """Tokens of the chat-formatted prompt, when the tokenizer has a chat template."""
        if self.tok is None or not getattr(self.tok, "chat_template", None):
            return None
        try:
            enc = self.tok.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)
            return len(enc["input_ids"])
        except Exception as e:  # a template that needs more than one user turn: skip the check
            log.debug("chat template not applied: %s", e)
            return None


def insert_needle(haystack: str, needle: str, depth: float) -> str:
    """Insert ``needle`` at ``depth`` (0 = start, 1 = end) of the haystack, at a sentence end."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    pos = int(depth * len(haystack))
    if 0 < pos < len(haystack):
        nxt = haystack.find(". ", pos)
        pos = nxt + 2 if nxt >= 0 else len(haystack)
    sep = "" if pos == 0 or haystack[pos - 1].isspace() else " "
    return haystack[:pos] + sep + needle + " " + haystack[pos:]


@dataclass
class NiahCase:
    length: int
    depth: float
    trial: int
    number: str
    prompt: str


def build_cases(texts: list[str], counter: TokenCounter, lengths, depths, trials: int,
                seed: int = 0) -> list[NiahCase]:
    """lengths x trials x depths prompts; distinct needles; trial t of a length reads the essays
    from a seeded start (the same haystack for all depths of that trial)."""
    if len(lengths) * len(depths) * trials > 9_000_000 // 2:
        raise ValueError("too many prompts for distinct 7-digit needles")
    rng = random.Random(seed)
    used: set[str] = set()
    cases = []
    for L in lengths:
        budget = L - PROMPT_OVERHEAD_TOKENS
        if budget <= 32:
            raise ValueError(f"context length {L} is too short (needs > {PROMPT_OVERHEAD_TOKENS + 32})")
        for t in range(trials):
            k = rng.randrange(len(texts))  # a different haystack per trial: independent trials
            hay = counter.truncate("\n\n".join(texts[k:] + texts[:k]), budget)
            if counter.count(hay) < budget * 0.9:
                raise ValueError(f"the essays are shorter than the {L}-token context asked for")
            for d in depths:
                number = str(rng.randrange(1_000_000, 10_000_000))
                while number in used or number in hay:  # bounded: < half of the range is used
                    number = str(rng.randrange(1_000_000, 10_000_000))
                used.add(number)
                text = insert_needle(hay, NEEDLE.format(number=number), d)
                prompt = ("Read the text below and answer the question after it.\n\n"
                          f"{text}\n\n{QUESTION}")
                cases.append(NiahCase(L, d, t, number, prompt))
    return cases


def prompts_sha256(cases: list[NiahCase]) -> str:
    """Fingerprint of the prompts and needles in order: equal for two runs = paired prompts."""
    h = hashlib.sha256()
    for c in cases:
        h.update(f"{c.length}|{c.depth}|{c.trial}|{c.number}|".encode())
        h.update(hashlib.sha256(c.prompt.encode()).digest())
    return h.hexdigest()


_INT = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)|\d+")  # 7,463,343 (thousands groups) or 7463343


def first_integer(answer: str | None) -> str | None:
    """The first integer in the answer, thousands separators removed; None if there is none."""
    if not answer:
        return None
    m = _INT.search(answer)
    return m.group(0).replace(",", "") if m else None


def exact_match(answer: str | None, number: str) -> bool:
    """The score: the answer's first integer is the needle, digit for digit."""
    return first_integer(answer) == number


def is_correct(answer: str | None, number: str) -> bool:
    """The looser score of earlier versions: the answer contains the number somewhere."""
    return answer is not None and number in answer.replace(",", "").replace(" ", "")


def default_depths(n: int = 10) -> list[float]:
    """n depths at the centres of n equal slices of the haystack (n=10: 0.05, 0.15 .. 0.95)."""
    return [round((i + 0.5) / n, 4) for i in range(n)]


def default_lengths(context: int | None, max_tokens: int) -> list[int]:
    """1K, 2K, 4K (those that fit) and the longest prompt that still leaves room for the answer."""
    if not context:
        return list(DEFAULT_BASE_LENGTHS)
    longest = (context - max_tokens) // LENGTH_STEP * LENGTH_STEP
    if longest <= PROMPT_OVERHEAD_TOKENS + 32:
        raise ValueError(f"context {context} leaves no room for a haystack")
    return [L for L in DEFAULT_BASE_LENGTHS if L < longest] + [longest]


def trials_for(n_cells: int, min_total: int = DEFAULT_MIN_TRIALS) -> int:
    """Trials per cell so that a grid has at least min_total prompts."""
    return max(1, math.ceil(min_total / max(n_cells, 1)))


# ----------------------------------------------------------------------------- backends


class RequestError(RuntimeError):
    pass


class ServerUnreachable(RequestError):
    """No HTTP answer at all (refused, DNS, timeout): the server is down or the URL is wrong."""


def normalise_url(url: str) -> str:
    """'http://host:port' or '.../v1' -> the OpenAI base URL; ValueError with what is wrong."""
    u = urllib.parse.urlsplit(url.strip())
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"bad server URL {url!r}: expected http(s)://HOST:PORT[/v1], e.g. "
                         "http://127.0.0.1:30000/v1")
    try:
        u.port  # noqa: B018  (raises on a non-numeric port)
    except ValueError as e:
        raise ValueError(f"bad server URL {url!r}: {e}") from None
    path = u.path.rstrip("/")
    if not path:
        path = "/v1"  # a bare host: OpenAI-compatible servers answer under /v1
    return urllib.parse.urlunsplit((u.scheme, u.netloc, path, "", ""))


def parse_server_specs(specs: list[str], label: str | None = None) -> list[tuple[str, str]]:
    """['[LABEL=]URL', ...] -> [(label, base url)]; the one unlabelled server may take --label."""
    out = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:  # no label (an '=' inside the URL's query is not one)
            name, url = (label if label and len(specs) == 1 else spec), spec
        out.append((name, normalise_url(url)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"server labels must differ: {names}")
    return out


class OpenAIChat:
    """Minimal OpenAI-compatible chat client (stdlib only), greedy decoding."""

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 120.0,
                 retries: int = 3, max_tokens: int = 24, backoff: float = 1.0):
        self.base = base_url.rstrip("/")
        self.timeout, self.retries, self.max_tokens, self.backoff = timeout, retries, max_tokens, backoff
        self.models: list[dict] = []
        self.model = model or self.first_model()

    @property
    def root(self) -> str:
        """The server root (SGLang's /server_info, /health live there, not under /v1)."""
        return self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base

    def _request(self, path: str, body: dict | None = None, base: str | None = None,
                 retries: int | None = None) -> dict:
        url = (base or self.base) + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        retries = self.retries if retries is None else retries
        last, answered = None, False
        for attempt in range(retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read().decode())
            except urllib.error.HTTPError as e:
                last, answered = f"HTTP {e.code}: {e.read()[:200]!r}", True
                if e.code < 500 and e.code != 429:  # our request is wrong: retrying won't help
                    raise RequestError(f"{url}: {last}") from e
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            except json.JSONDecodeError as e:
                raise RequestError(f"{url}: the answer is not JSON ({e})") from e
            if attempt < retries:
                time.sleep(self.backoff * 2**attempt)
        err = RequestError if answered else ServerUnreachable
        raise err(f"{url}: failed after {retries + 1} tries ({last})")

    def first_model(self) -> str:
        self.models = self._request("/models").get("data") or []
        if not self.models:
            raise RequestError(f"{self.base}/models lists no model; pass --model-name")
        return self.models[0]["id"]

    def probe(self) -> None:
        """Fail fast on a dead server (connection errors after the retry policy); a server
        without /models (404) is fine when the model name is given."""
        if self.models:
            return
        try:
            self.models = self._request("/models").get("data") or []
        except ServerUnreachable:
            raise
        except RequestError as e:
            log.info("%s: no model list (%s); using model %r", self.base, e, self.model)

    def server_info(self) -> dict | None:
        """SGLang's /server_info (or /get_server_info); None when the server has neither."""
        for path in ("/server_info", "/get_server_info"):
            try:
                info = self._request(path, base=self.root, retries=0)
                if isinstance(info, dict):
                    return info
            except RequestError:
                continue
        return None

    def context_length(self, info: dict | None = None) -> int | None:
        """The served context: /v1/models max_model_len (SGLang, vLLM) or /server_info
        context_length; None when the server says neither."""
        for m in self.models:
            if m.get("id") == self.model and m.get("max_model_len"):
                return int(m["max_model_len"])
        if info and info.get("context_length"):
            return int(info["context_length"])
        return None

    def __call__(self, prompt: str) -> str:
        out = self._request("/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0, "max_tokens": self.max_tokens,
        })
        return out["choices"][0]["message"]["content"] or ""


def kv_info(info: dict | None) -> dict:
    """KV pool facts of an SGLang /server_info: tokens that fit, and our plugin's report."""
    if not info:
        return {"kv_tokens": None, "oscar_int2": None, "kv_cache_dtype": None}
    states = info.get("internal_states") or [{}]
    oscar = states[0].get("oscar_int2") if isinstance(states[0], dict) else None
    tokens = info.get("max_total_num_tokens") or (oscar or {}).get("max_total_num_tokens")
    if tokens is None and isinstance(states[0], dict):
        tokens = states[0].get("max_total_num_tokens")
    return {"kv_tokens": int(tokens) if tokens else None, "oscar_int2": oscar,
            "kv_cache_dtype": info.get("kv_cache_dtype"),
            "attention_backend": info.get("attention_backend"),
            "mem_fraction_static": info.get("mem_fraction_static")}


class LocalChat:
    """transformers greedy chat, optionally through the emulated KV cache (prefill in BF16)."""

    def __init__(self, model, tokenizer, emulation=None, max_tokens: int = 24):
        self.model, self.tok, self.emulation, self.max_tokens = model, tokenizer, emulation, max_tokens

    def __call__(self, prompt: str) -> str:
        import contextlib

        import torch

        from .emulation import emulate_kv_cache

        enc = self.tok.apply_chat_template([{"role": "user", "content": prompt}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
        ids = enc["input_ids"].to(self.model.device)
        ctx = emulate_kv_cache(self.model, self.emulation) if self.emulation else contextlib.nullcontext()
        with ctx, torch.no_grad():
            # explicit all-ones mask: the emulation supports unpadded sequences only
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=self.max_tokens, do_sample=False,
                                      pad_token_id=self.tok.eos_token_id)
        return self.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


# ----------------------------------------------------------------------------- grid


def _cells(results: list[dict], lengths, depths, key: str) -> list[list[float | None]]:
    cells = []
    for L in lengths:
        row = []
        for d in depths:
            rs = [r for r in results if r["length"] == L and r["depth"] == d and r["error"] is None]
            row.append(sum(r[key] for r in rs) / len(rs) if rs else None)
        cells.append(row)
    return cells


def run_grid(name: str, chat, cases: list[NiahCase], lengths, depths, concurrency: int = 1,
             progress=None, max_errors: int | None = None) -> dict:
    """Ask every case -> {'cells': [len][depth] exact-match accuracy or None, 'accuracy',
    'cells_contains', 'accuracy_contains', 'n', 'errors', 'aborted', 'answers'}.

    After max_errors failed requests the rest are not sent (a dead server must not cost
    n x retries x backoff): they count as errors and 'aborted' is set."""
    results: list[dict] = [None] * len(cases)  # type: ignore[list-item]
    bar = progress(total=len(cases), desc=f"niah {name}", unit="req") if progress else None
    lock, stop, n_err = threading.Lock(), threading.Event(), [0]

    def ask(i: int):
        c = cases[i]
        if stop.is_set():
            ans, err = None, f"not sent: {max_errors} requests had failed"
        else:
            try:
                ans, err = chat(c.prompt), None
            except RequestError as e:
                ans, err = None, str(e)
                with lock:
                    n_err[0] += 1
                    if max_errors is not None and n_err[0] >= max_errors:
                        stop.set()
        results[i] = {"length": c.length, "depth": c.depth, "trial": c.trial, "number": c.number,
                      "answer": ans, "error": err, "extracted": first_integer(ans),
                      "correct": exact_match(ans, c.number), "contains": is_correct(ans, c.number)}
        if bar:
            bar.update(1)

    if concurrency > 1:
        with ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(ask, range(len(cases))))
    else:
        for i in range(len(cases)):
            ask(i)
    if bar:
        bar.close()
    ok = [r for r in results if r["error"] is None]
    errors = len(results) - len(ok)
    if errors:
        log.warning("%s: %d of %d requests failed (first: %s)", name, errors, len(results),
                    next(r["error"] for r in results if r["error"]))
    return {"cells": _cells(results, lengths, depths, "correct"),
            "cells_contains": _cells(results, lengths, depths, "contains"),
            "n": len(results), "errors": errors, "aborted": stop.is_set(),
            "n_correct": sum(r["correct"] for r in ok),
            "accuracy": sum(r["correct"] for r in ok) / len(ok) if ok else 0.0,
            "accuracy_contains": sum(r["contains"] for r in ok) / len(ok) if ok else 0.0,
            "answers": results}


def _tokenizer(spec: str, chat: OpenAIChat | None, info: dict | None,
               local_only: bool = False) -> tuple[TokenCounter, str]:
    """--tokenizer -> (counter, what was used). 'auto': the server's tokenizer_path if it is a
    directory here, the embedded SmolLM2 when that is the served model, the served model id if
    transformers has it locally, else ~4 characters per token (with a warning)."""
    from pathlib import Path

    if spec == "chars":
        return TokenCounter(None), "chars"
    from transformers import AutoTokenizer

    from ..models import EMBEDDED_ALIASES, EMBEDDED_MODEL_ID, _dequantised_copy, resolve_model

    if spec == "auto":
        cands = []
        tp = (info or {}).get("tokenizer_path") or (info or {}).get("model_path")
        if tp and Path(tp).is_dir():
            cands.append(tp)
        model = chat.model if chat else None
        if model == EMBEDDED_MODEL_ID:
            cands.append(EMBEDDED_ALIASES[0])
        elif model:
            cands.append(model)
        for c in cands:
            try:
                # guessed from the server: only what is here, no download mid-evaluation
                return _tokenizer(c, chat, info, local_only=True)[0], c
            except Exception as e:  # not available here: try the next one
                log.debug("tokenizer %s: %s", c, e)
        log.warning("warning: no tokenizer found for %s; lengths are approximate (4 characters "
                    "per token). Pass --tokenizer HF_ID_OR_DIR for exact lengths.", model)
        return TokenCounter(None), "chars"
    path, gguf = resolve_model(spec)
    if spec in EMBEDDED_ALIASES or gguf:
        path = str(_dequantised_copy(path, gguf))
    local_only = local_only and not Path(path).is_dir()
    return TokenCounter(AutoTokenizer.from_pretrained(path, local_files_only=local_only)), spec


def _grid_params(args, context: int | None, local: bool) -> tuple[list, list, int]:
    lengths = args.lengths or (LOCAL_LENGTHS if local else default_lengths(context, args.max_tokens))
    depths = args.depths or (LOCAL_DEPTHS if local else list(DEFAULT_DEPTHS))
    if args.trials:
        trials = args.trials
    else:
        trials = LOCAL_TRIALS if local else trials_for(len(lengths) * len(depths),
                                                       getattr(args, "min_trials", DEFAULT_MIN_TRIALS))
    return list(lengths), list(depths), trials


def _command_line(args) -> str:
    return getattr(args, "command_line", None) or "oscar-sglang eval niah"


def main_niah(args, progress=None) -> int:
    """The `oscar-sglang eval niah` command (argument parsing lives in commands/eval.py)."""
    from ..data import essay_paths, read_texts
    from .report import niah_heatmaps, niah_markdown, write_outputs

    servers = list(getattr(args, "base_url", None) or []) + list(getattr(args, "url", None) or [])
    local = bool(getattr(args, "local", None))
    # --- servers first: a bad URL or a dead server fails before anything slow happens
    chats: dict[str, OpenAIChat] = {}
    infos: dict[str, dict | None] = {}
    if not local:
        try:
            specs = parse_server_specs(servers, getattr(args, "label", None))
        except ValueError as e:
            log.error("error: %s", e)
            return 2
        for label, url in specs:
            try:
                chat = OpenAIChat(url, args.model_name, args.timeout, args.retries, args.max_tokens)
                chat.probe()
            except ServerUnreachable as e:
                log.error("error: cannot reach the server at %s: %s (is it up? is the port "
                          "right? the URL should look like http://127.0.0.1:30000/v1)", url, e)
                return 2
            except RequestError as e:
                log.error("error: %s does not answer like an OpenAI-compatible server: %s", url, e)
                return 2
            chats[label] = chat
            infos[label] = chat.server_info()
            log.info("%s: %s, model %s", label, url, chat.model)
    # --- grid: the context is the smallest any server reports (all servers get the same prompts)
    context = getattr(args, "context_length", None)
    if not context and chats:
        known = [c for c in (chats[k].context_length(infos[k]) for k in chats) if c]
        context = min(known) if known else None
        if context:
            log.info("context length %d tokens (from the server)", context)
    try:
        lengths, depths, trials = _grid_params(args, context, local)
    except ValueError as e:
        log.error("error: %s", e)
        return 2
    if context and max(lengths) + args.max_tokens > context:
        log.error("error: length %d + %d answer tokens is above the context of %d tokens; "
                  "use --lengths up to %d", max(lengths), args.max_tokens, context,
                  context - args.max_tokens)
        return 2
    if any(not 0.0 <= d <= 1.0 for d in depths):
        log.error("error: depths must be in [0, 1], got %s", depths)
        return 2
    n_req = len(lengths) * len(depths) * trials
    n_grids = (1 + len((getattr(args, "recipe", None) or "x").split(","))) if local else len(chats)
    if n_req * n_grids > args.max_requests:
        log.error("error: %d requests (%d lengths x %d depths x %d trials x %d grids) exceed "
                  "--max-requests %d; shrink the grid or raise the limit", n_req * n_grids,
                  len(lengths), len(depths), trials, n_grids, args.max_requests)
        return 2
    texts = read_texts(essay_paths())
    model = tok = None
    if local:
        from ..models import load_causal_lm

        model, tok = load_causal_lm(args.local)
        counter, tok_name = TokenCounter(tok), args.local
    else:
        first = next(iter(chats))
        try:
            counter, tok_name = _tokenizer(args.tokenizer, chats[first], infos[first])
        except (OSError, ValueError) as e:
            log.error("error: tokenizer %r: %s", args.tokenizer, e)
            return 2
    try:
        cases = build_cases(texts, counter, lengths, depths, trials, args.seed)
    except ValueError as e:
        log.error("error: %s", e)
        return 2
    # the real chat-formatted size of one prompt per length, when the template is known
    prompt_tokens = {L: counter.prompt_tokens(next(c.prompt for c in cases if c.length == L))
                     for L in lengths}
    longest = max(lengths)
    if context and prompt_tokens[longest] and prompt_tokens[longest] + args.max_tokens > context:
        log.error("error: the %d-token prompt (length %d) + %d answer tokens exceeds the "
                  "context of %d; use a smaller length", prompt_tokens[longest], longest,
                  args.max_tokens, context)
        return 2
    grids = {}
    meta = {"command": _command_line(args), "max_tokens": args.max_tokens, "temperature": 0.0,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seed": args.seed, "tokenizer": tok_name, "context_length": context,
            "prompt_tokens": {str(L): n for L, n in prompt_tokens.items()},  # chat-formatted
            "scoring": "exact: the first integer of the answer equals the needle "
                       "(contains: the answer contains it, for comparison)",
            "prompts_sha256": prompts_sha256(cases)}
    if local:
        from .emulation import EmulationConfig
        from .recipes import build_rotations, parse_recipe

        cfg = model.config
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotations = {"zoo": args.rotation} if args.rotation else {}
        specs = (getattr(args, "recipe", None) or ("oscar" if args.rotation else "hadamard")).split(",")
        recipes = [r for s in specs for r in parse_recipe(s.strip(), rotations)]
        grids["unquantised"] = run_grid("unquantised", LocalChat(model, tok, None, args.max_tokens),
                                        cases, lengths, depths, 1, progress)
        for recipe in recipes:
            rs = build_rotations(recipe, cfg.num_hidden_layers, cfg.num_key_value_heads, D)
            emu = EmulationConfig(recipe, rs, group_size=args.group_size, sink=args.sink,
                                  recent=args.recent, prefill_bf16=True)
            name = f"{recipe.name} g{args.group_size} (emulated)"
            grids[name] = run_grid(name, LocalChat(model, tok, emu, args.max_tokens), cases,
                                   lengths, depths, 1, progress)
        meta.update(model=args.local, sink=args.sink, recent=args.recent, backend="transformers",
                    rotation=args.rotation, group_size=args.group_size)
    else:
        max_errors = getattr(args, "max_errors", None)
        for label, chat in chats.items():
            grid = run_grid(label, chat, cases, lengths, depths, args.concurrency, progress,
                            max_errors=max_errors)
            grid.update(url=chat.base, model=chat.model)
            if getattr(args, "kv_tokens_from_server", False):
                grid.update(kv_info(infos[label]))
                if infos[label] is None:
                    grid["kv_tokens_note"] = "the server has no /server_info (not SGLang?)"
            grids[label] = grid
            meta.setdefault("servers", {})[label] = {"url": chat.base, "model": chat.model}
    run = {"lengths": lengths, "depths": depths, "trials": trials, "trials_per_grid": n_req,
           "grids": grids, "meta": meta}
    md = niah_markdown(run)
    paths = write_outputs(args.out, args.name, run, md, niah_heatmaps)
    print(md)
    log.info("wrote %s", ", ".join(map(str, paths)))
    aborted = [k for k, g in grids.items() if g.get("aborted")]
    if aborted:
        log.error("error: %s stopped after %s failed requests; the results are incomplete",
                  ", ".join(aborted), max_errors)
        return 1
    return 0
