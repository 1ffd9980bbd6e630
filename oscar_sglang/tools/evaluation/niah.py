"""Needle-in-a-haystack over the Paul Graham essays.

A random 7-digit "magic number" sentence is inserted at a given depth (fraction of the
haystack, moved to the next sentence boundary) of a haystack cut to a token budget; the model
is asked for the number; an answer is correct when it contains the number. Grid: context
lengths x depths x trials, each cell the fraction correct.

Backends:
* ``OpenAIChat``: POST {base_url}/chat/completions (any OpenAI-compatible server: SGLang with
  --kv-cache-dtype int2 or BF16, vLLM, llama.cpp...), greedy, bounded concurrency, retries
  with backoff on connection errors / 5xx / 429, per-request timeout.
* ``LocalChat``: transformers, greedy generate, optionally with the emulated KV cache
  (evaluation.emulation, prefill in BF16 then mixed INT2/BF16 decode, as the server does).
"""
from __future__ import annotations

import json
import logging
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger("oscar_sglang.eval")

QUESTION = ("What is the special magic number mentioned in the text above? "
            "Answer with the number only.")
NEEDLE = "The special magic number is {number}."
PROMPT_OVERHEAD_TOKENS = 64  # instruction, question and chat template around the haystack


class TokenCounter:
    """Token lengths with a real tokenizer, or ~4 characters per token ('chars')."""

    def __init__(self, tokenizer=None):
        self.tok = tokenizer

    def truncate(self, text: str, n_tokens: int) -> str:
        if self.tok is None:
            return text[: 4 * n_tokens]
        ids = self.tok(text, add_special_tokens=False).input_ids[:n_tokens]
        return self.tok.decode(ids)

    def count(self, text: str) -> int:
        if self.tok is None:
            return len(text) // 4
        return len(self.tok(text, add_special_tokens=False).input_ids)


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
    rng = random.Random(seed)
    corpus = "\n\n".join(texts)
    cases = []
    for L in lengths:
        budget = L - PROMPT_OVERHEAD_TOKENS
        if budget <= 32:
            raise ValueError(f"context length {L} is too short (needs > {PROMPT_OVERHEAD_TOKENS + 32})")
        hay = counter.truncate(corpus, budget)
        if counter.count(hay) < budget * 0.9:
            raise ValueError(f"the essays are shorter than the {L}-token context asked for")
        for d in depths:
            for t in range(trials):
                number = str(rng.randrange(1_000_000, 10_000_000))
                text = insert_needle(hay, NEEDLE.format(number=number), d)
                prompt = ("Read the text below and answer the question after it.\n\n"
                          f"{text}\n\n{QUESTION}")
                cases.append(NiahCase(L, d, t, number, prompt))
    return cases


def is_correct(answer: str | None, number: str) -> bool:
    return answer is not None and number in answer.replace(",", "").replace(" ", "")


# ----------------------------------------------------------------------------- backends


class RequestError(RuntimeError):
    pass


class OpenAIChat:
    """Minimal OpenAI-compatible chat client (stdlib only), greedy decoding."""

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 120.0,
                 retries: int = 3, max_tokens: int = 24, backoff: float = 1.0):
        self.base = base_url.rstrip("/")
        self.timeout, self.retries, self.max_tokens, self.backoff = timeout, retries, max_tokens, backoff
        self.model = model or self.first_model()

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data,
                                     headers={"Content-Type": "application/json"})
        last = None
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    return json.loads(r.read().decode())
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read()[:200]!r}"
                if e.code < 500 and e.code != 429:  # our request is wrong: retrying won't help
                    raise RequestError(f"{self.base}{path}: {last}") from e
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(self.backoff * 2**attempt)
        raise RequestError(f"{self.base}{path}: failed after {self.retries + 1} tries ({last})")

    def first_model(self) -> str:
        models = self._request("/models").get("data") or []
        if not models:
            raise RequestError(f"{self.base}/models lists no model; pass --model-name")
        return models[0]["id"]

    def __call__(self, prompt: str) -> str:
        out = self._request("/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0, "max_tokens": self.max_tokens,
        })
        return out["choices"][0]["message"]["content"] or ""


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


def run_grid(name: str, chat, cases: list[NiahCase], lengths, depths, concurrency: int = 1,
             progress=None) -> dict:
    """Ask every case, return {'cells': [len][depth] accuracy or None, 'accuracy', 'answers'}."""
    results: list[dict] = [None] * len(cases)  # type: ignore[list-item]
    bar = progress(total=len(cases), desc=f"niah {name}", unit="req") if progress else None

    def ask(i: int):
        c = cases[i]
        try:
            ans, err = chat(c.prompt), None
        except RequestError as e:
            ans, err = None, str(e)
        results[i] = {"length": c.length, "depth": c.depth, "trial": c.trial, "number": c.number,
                      "answer": ans, "error": err, "correct": is_correct(ans, c.number)}
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
    cells = []
    for L in lengths:
        row = []
        for d in depths:
            rs = [r for r in results if r["length"] == L and r["depth"] == d and r["error"] is None]
            row.append(sum(r["correct"] for r in rs) / len(rs) if rs else None)
        cells.append(row)
    ok = [r for r in results if r["error"] is None]
    errors = len(results) - len(ok)
    if errors:
        log.warning("%s: %d of %d requests failed (first: %s)", name, errors, len(results),
                    next(r["error"] for r in results if r["error"]))
    return {"cells": cells, "n": len(results), "errors": errors,
            "accuracy": sum(r["correct"] for r in ok) / len(ok) if ok else 0.0,
            "answers": results}


def main_niah(args, progress=None) -> int:
    """The `oscar-sglang eval niah` command (argument parsing lives in commands/eval.py)."""
    from ..data import essay_paths, read_texts
    from .report import niah_heatmaps, niah_markdown, write_outputs

    n_req = len(args.lengths) * len(args.depths) * args.trials
    n_grids = (1 + len((getattr(args, "recipe", None) or "x").split(","))) if args.local \
        else len(args.base_url)
    if n_req * n_grids > args.max_requests:
        log.error("error: %d requests (%d lengths x %d depths x %d trials x %d grids) exceed "
                  "--max-requests %d; shrink the grid or raise the limit", n_req * n_grids,
                  len(args.lengths), len(args.depths), args.trials, n_grids, args.max_requests)
        return 2
    texts = read_texts(essay_paths())
    model = tok = None
    if args.local:
        from ..models import load_causal_lm

        model, tok = load_causal_lm(args.local)
        counter = TokenCounter(tok)
    elif args.tokenizer == "chars":
        counter = TokenCounter(None)
    else:
        from transformers import AutoTokenizer

        from ..models import EMBEDDED_ALIASES, _dequantised_copy, resolve_model

        path, gguf = resolve_model(args.tokenizer)
        if args.tokenizer in EMBEDDED_ALIASES or gguf:
            path = str(_dequantised_copy(path, gguf))
        counter = TokenCounter(AutoTokenizer.from_pretrained(path))
    cases = build_cases(texts, counter, args.lengths, args.depths, args.trials, args.seed)
    grids = {}
    meta = {"command": "oscar-sglang eval niah", "max_tokens": args.max_tokens}
    if args.local:
        from .emulation import EmulationConfig
        from .recipes import build_rotations, parse_recipe

        cfg = model.config
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotations = {"zoo": args.rotation} if args.rotation else {}
        specs = (getattr(args, "recipe", None) or ("oscar" if args.rotation else "hadamard")).split(",")
        recipes = [r for s in specs for r in parse_recipe(s.strip(), rotations)]
        grids["unquantised"] = run_grid("unquantised", LocalChat(model, tok, None, args.max_tokens),
                                        cases, args.lengths, args.depths, 1, progress)
        for recipe in recipes:
            rs = build_rotations(recipe, cfg.num_hidden_layers, cfg.num_key_value_heads, D)
            emu = EmulationConfig(recipe, rs, group_size=args.group_size, sink=args.sink,
                                  recent=args.recent, prefill_bf16=True)
            name = f"{recipe.name} g{args.group_size} (emulated)"
            grids[name] = run_grid(name, LocalChat(model, tok, emu, args.max_tokens), cases,
                                   args.lengths, args.depths, 1, progress)
        meta.update(model=args.local, sink=args.sink, recent=args.recent, backend="transformers",
                    rotation=args.rotation, group_size=args.group_size)
    else:
        for spec in args.base_url:
            label, sep, url = spec.partition("=")
            if not sep or "://" in label:
                label, url = (args.label or spec), spec
            try:
                chat = OpenAIChat(url, args.model_name, args.timeout, args.retries, args.max_tokens)
            except RequestError as e:
                log.error("error: cannot reach %s: %s (is the server up?)", url, e)
                return 2
            log.info("%s: model %s", url, chat.model)
            grids[label] = run_grid(label, chat, cases, args.lengths, args.depths,
                                    args.concurrency, progress)
            meta.setdefault("servers", {})[label] = {"url": url, "model": chat.model}
    run = {"lengths": list(args.lengths), "depths": list(args.depths), "trials": args.trials,
           "grids": grids, "meta": meta}
    md = niah_markdown(run)
    paths = write_outputs(args.out, args.name, run, md, niah_heatmaps)
    print(md)
    log.info("wrote %s", ", ".join(map(str, paths)))
    return 0
