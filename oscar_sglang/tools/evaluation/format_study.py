"""CPU Pareto study of KV formats (oscar_kernels.format.KVFormat) on a small model.

For every format: needle-in-a-haystack accuracy with the needle inside the quantised body, and
KLD / top-1 agreement vs the unquantised model on held-out essays (teacher forcing), next to the
format's body_bits_per_element. Writes one JSON (default bench/results/niah_cpu_formats.json).

Besides KVFormat names, ``fp8_e4m3`` is SGLang's ``--kv-cache-dtype fp8_e4m3`` without checkpoint
scales (emulation.CastKV: K and V cast to float8_e4m3fn and back at every position, unrotated,
no BF16 sink or ring, 8 bits). ``-cal`` formats (e.g. the old served recipe
``k2t64-v2t64-cal-kclip-vclip``) take their rotation file, and its per-layer clip ratios with
``kclip`` / ``vclip``, from ``--rotation``.

NIAH protocol (the server's): the prompt is prefilled once in BF16 (the same for every format,
so it is computed once per case), then each format decodes greedily through the emulated cache
(evaluation.emulation with EmulationConfig.kv_format: sink and ring from the format, per-channel
key blocks aligned to position 0). Every case's needle tokens are checked to lie in the body of
every format (after the sink, before the ring) or the run stops. A case is correct when the
answer contains the number (niah.is_correct); decoding stops at EOS, at max_tokens, or as soon as
the number has appeared (which cannot change the verdict).

Cases run in rounds (one case per depth); ``--max-minutes`` stops after a whole round and the
JSON is rewritten after every round, so every row always has the same trials at every depth.
``--merge`` adds rows for more formats (e.g. sink / window variants of the best format of a
first run) on the same cases and windows, reusing the first run's BF16 answers as guesses.

    python -m oscar_sglang.tools.evaluation.format_study --help
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BF16 = "bf16"
DEFAULT_FORMATS = (
    "bf16",
    "k2t64-v2t64",  # the served per-token layout (g128 does not divide SmolLM2's head_dim 64)
    "k2c32-v2t64-id", "k2c32-v2t64", "k2c32-v2t64-tn",
    "k2c64-v2t64-id", "k2c64-v2t64", "k2c64-v2t64-tn",
    "k3c64-v2t64", "k3c64-v2t64-tn",
    "k4c64-v2t64", "k2c64-v4t64", "k2c64-v2t64-tn@0,-1=k4",
)
FID_FIRST = 64 + 256  # KLD scored from here: past the largest sink + window of the table


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m oscar_sglang.tools.evaluation.format_study",
        description="CPU Pareto study of KV formats: NIAH (needle in the quantised body) and "
                    "KLD/top-1 vs the unquantised model, per format (see the module docstring).")
    p.add_argument("--model", default="smollm2", help="model for load_causal_lm (default: smollm2)")
    p.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), metavar="NAME",
                   help="KVFormat names, space-separated ('bf16': no quantisation; 'fp8_e4m3': "
                        "SGLang's FP8 KV cache, scale 1.0, every position; names may hold "
                        "commas: k2c64-v2t64@0,-1=k4; a per-channel name ending in '+q8': its "
                        "body keys scored as an int8 key-side MMA would, a study of a kernel "
                        "not built)")
    p.add_argument("--merge", action="store_true",
                   help="add the formats' rows to the existing --out JSON (same cases and "
                        "windows; e.g. sink/window variants of the best format of a first run)")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="stop starting new rounds of NIAH cases (one per depth) after this long")
    p.add_argument("--rotation", default=None,
                   help="calibrated rotation file for '-cal' formats (its clip ratios serve "
                        "'kclip' / 'vclip'), e.g. rotation_zoo/SmolLM2-135M-Instruct.oscar.g64.safetensors")
    p.add_argument("--length", type=int, default=1024, help="NIAH context length in tokens")
    p.add_argument("--depths", default="0.1,0.25,0.4,0.55,0.7",
                   help="needle depths (fractions of the haystack)")
    p.add_argument("--trials", type=int, default=8, help="trials per depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--fid-windows", type=int, default=2, help="held-out windows for KLD/top-1")
    p.add_argument("--fid-length", type=int, default=1024, help="tokens per KLD window")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--out", default="bench/results/niah_cpu_formats.json")
    p.epilog = ("--table JSON (alone) prints the markdown Pareto table of an earlier run; "
                "--plot JSON PNG draws it (NIAH vs bits, and vs the KV tokens each format would "
                "hold on the dummy Llama-3.1-8B).")
    return p.parse_args(argv)


INT8_KEYS = "+q8"  # name suffix: the format's body keys scored as an int8 key-side MMA would


@dataclass(frozen=True)
class Int8Keys:
    """A per-channel KVFormat studied with emulation's key_dot="int8" (no kernel does this yet:
    it asks what an int8 tensor-core decode of the keys would cost in retrieval and KLD). Named
    like the format plus INT8_KEYS; every other attribute is the format's."""
    fmt: object

    @property
    def name(self) -> str:
        return self.fmt.name + INT8_KEYS

    def __getattr__(self, attr):
        if attr == "fmt":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(attr)
        return getattr(self.fmt, attr)


def _key_dot(fmt) -> str:
    """emulation's key_dot for a study format: "int8" for an Int8Keys name, else "float"."""
    return "int8" if isinstance(fmt, Int8Keys) else "float"


def _formats(names, head_dim):
    from oscar_kernels.format import KVFormat

    from .emulation import CAST_FORMATS

    out = []
    for n in names:
        n = n.strip()
        if not n:
            continue
        base = n.removesuffix(INT8_KEYS)
        f = None if base == BF16 else CAST_FORMATS[base] if base in CAST_FORMATS else KVFormat.parse(base, head_dim)
        if base != n:
            if getattr(f, "k_layout", None) != "channel":
                raise SystemExit(f"{n}: '{INT8_KEYS}' (int8 key scores) needs a per-channel key format")
            f = Int8Keys(f)
        out.append(f)
    return out


def _check_rotation(names, rotation):
    """A '-cal' format needs --rotation (checked before the model loads); the file must exist."""
    cal = [n for n in names if "cal" in n.strip().removesuffix(INT8_KEYS).split("@")[0].split("-")[2:]]
    if cal and not rotation:
        raise SystemExit(f"{', '.join(cal)}: a calibrated rotation needs --rotation FILE "
                         "(e.g. rotation_zoo/SmolLM2-135M-Instruct.oscar.g64.safetensors)")
    if cal and not Path(rotation).is_file():
        raise SystemExit(f"--rotation {rotation}: no such file")


def _label(fmt):
    return BF16 if fmt is None else fmt.name


class Study:
    def __init__(self, model, tok, args):
        from .recipes import Recipe, build_rotations

        self.model, self.tok, self.args = model, tok, args
        c = model.config
        self.L, self.Hk = c.num_hidden_layers, c.num_key_value_heads
        self.D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self._build_rotations = build_rotations
        self._rot_cache = {}
        self.bf16_recipe = Recipe(BF16, quantize=False)

    def config(self, fmt, prefill_bf16: bool, memo=None):
        """EmulationConfig of a format (None: BF16 everywhere, sink/recent irrelevant)."""
        from .emulation import EmulationConfig
        from .recipes import format_recipe

        if fmt is None:
            rs = self._rotations(self.bf16_recipe)
            return EmulationConfig(self.bf16_recipe, rs, prefill_bf16=prefill_bf16)
        key_dot = _key_dot(fmt)
        fmt = fmt.fmt if isinstance(fmt, Int8Keys) else fmt
        recipe = format_recipe(fmt, self.args.rotation if fmt.rotation == "calibrated" else None)
        return EmulationConfig(recipe, self._rotations(recipe), prefill_bf16=prefill_bf16,
                               kv_format=fmt, memo=memo, key_dot=key_dot)

    def _rotations(self, recipe):
        if recipe.rotation not in self._rot_cache:
            self._rot_cache[recipe.rotation] = self._build_rotations(recipe, self.L, self.Hk, self.D)
        return self._rot_cache[recipe.rotation]

    # ------------------------------------------------------------------ NIAH

    def cases(self):
        from ..data import essay_paths, read_texts
        from .niah import TokenCounter

        depths = [float(d) for d in self.args.depths.split(",")]
        texts = read_texts(essay_paths())
        cases = study_cases(texts, TokenCounter(self.tok), self.args.length, depths,
                            self.args.trials, self.args.seed)
        return cases, depths

    def encode(self, case):
        """Prompt ids [1, P] and the needle's token span [a, b) (found by the number's tokens)."""
        from .niah import NEEDLE

        enc = self.tok.apply_chat_template([{"role": "user", "content": case.prompt}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
        ids = enc["input_ids"]
        seq = ids[0].tolist()
        num = self.tok(case.number, add_special_tokens=False).input_ids
        hits = [i for i in range(len(seq) - len(num) + 1) if seq[i:i + len(num)] == num]
        if len(hits) != 1:
            raise SystemExit(f"needle number {case.number}: found {len(hits)} times in the prompt tokens")
        prefix = NEEDLE.split("{number}")[0]
        n_prefix = len(self.tok(" " + prefix.strip(), add_special_tokens=False).input_ids)
        return ids, (hits[0] - n_prefix, hits[0] + len(num) + 1)

    def prefill(self, ids):
        """BF16 prefill (as the server) -> (cache, first generated token id)."""
        import torch

        from .emulation import emulate_kv_cache

        with emulate_kv_cache(self.model, self.config(None, True)), torch.no_grad():
            out = self.model(ids, use_cache=True)
        return out.past_key_values, int(out.logits[0, -1].argmax())

    def decode(self, cache, prompt_len, first, fmt, number, guess=None):
        """Greedy answer through the format's emulated cache; the cache is cropped back after.

        guess: a likely answer (token ids starting with ``first``, e.g. the BF16 answer). It is
        teacher-forced in one forward pass; the answer keeps its tokens up to the first position
        where the format's argmax differs, takes that argmax, and decodes on from there. This is
        the same greedy answer as decoding token by token (the emulation reads, for every query,
        its decode-time mix), only with fewer sequential steps.
        """
        import torch

        from .emulation import emulate_kv_cache
        from .niah import is_correct

        cfg = self.config(fmt, True, memo={})
        toks = [first]
        eos = self.stop_ids()
        try:
            with emulate_kv_cache(self.model, cfg), torch.no_grad():
                if guess is not None and len(guess) > 1 and guess[0] == first:
                    out = self.model(torch.tensor([guess[:-1]]), past_key_values=cache, use_cache=True)
                    pred = out.logits[0].argmax(-1).tolist()  # pred[i] follows guess[: i + 1]
                    i = 0
                    while i < len(pred) and pred[i] == guess[i + 1]:
                        i += 1
                    toks = list(guess) if i == len(pred) else list(guess[: i + 1]) + [pred[i]]
                    cache.crop(prompt_len + len(toks) - 1)  # the cache holds toks[:-1]
                while len(toks) < self.args.max_tokens and toks[-1] not in eos:
                    if is_correct(self.tok.decode(toks, skip_special_tokens=True), number):
                        break
                    out = self.model(torch.tensor([[toks[-1]]]), past_key_values=cache,
                                     use_cache=True)
                    toks.append(int(out.logits[0, -1].argmax()))
        finally:
            cache.crop(prompt_len)
        return toks

    def stop_ids(self) -> set:
        """Tokens that end an answer: the tokenizer's EOS and the generation config's (the chat
        end-of-turn token), as model.generate would stop."""
        ids = {self.tok.eos_token_id}
        gen = getattr(self.model, "generation_config", None)
        e = getattr(gen, "eos_token_id", None)
        ids |= set(e) if isinstance(e, (list, tuple)) else {e}
        return {i for i in ids if i is not None}

    # ------------------------------------------------------------------ fidelity

    def fidelity(self, fmts, first, bar):
        """KLD / top-1 per format over the held-out windows, positions first..end-1 scored."""
        import torch

        from ..data import heldout_essays, read_texts
        from .emulation import emulate_kv_cache
        from .fidelity import Scores, _logits, make_windows

        windows = make_windows(self.tok, read_texts(heldout_essays()), self.args.fid_windows,
                               self.args.fid_length)
        end = windows.shape[1] - 1
        sums = {_label(f): Scores() for f in fmts}
        for ids in windows:
            targets = ids[first + 1: end + 1]
            with torch.no_grad():
                ref = torch.log_softmax(_logits(self.model, ids, first, end), dim=-1)
            bar.update(1)
            for f in fmts:
                with emulate_kv_cache(self.model, self.config(f, False)), torch.no_grad():
                    logits = _logits(self.model, ids, first, end)
                sums[_label(f)].add(ref, logits, targets)
                bar.set_postfix_str(f"kld {_label(f)}")
                bar.update(1)
        return {k: v.summary() for k, v in sums.items()}, windows.shape


def study_cases(texts, counter, length: int, depths, trials: int, seed: int = 0):
    """The study's NIAH cases: ONE haystack (the essays joined from the first, cut to
    ``length - PROMPT_OVERHEAD_TOKENS`` tokens) shared by every case, needle numbers drawn from
    ``random.Random(seed)`` depth by depth, trial by trial. These are the cases of
    bench/results/niah_cpu_formats.json (niah.build_cases at f92b9a6, its first run). niah.build_cases,
    the server grid's, has since given every trial its own haystack and other numbers; the study
    keeps its own so that --merge adds rows on the cases the file was measured on."""
    import random

    from .niah import NEEDLE, PROMPT_OVERHEAD_TOKENS, QUESTION, NiahCase, insert_needle

    rng = random.Random(seed)
    budget = length - PROMPT_OVERHEAD_TOKENS
    hay = counter.truncate("\n\n".join(texts), budget)
    if counter.count(hay) < budget * 0.9:
        raise ValueError(f"the essays are shorter than the {length}-token context asked for")
    cases = []
    for d in depths:
        for t in range(trials):
            number = str(rng.randrange(1_000_000, 10_000_000))
            prompt = ("Read the text below and answer the question after it.\n\n"
                      f"{insert_needle(hay, NEEDLE.format(number=number), d)}\n\n{QUESTION}")
            cases.append(NiahCase(length, d, t, number, prompt))
    return cases


def _check_same_cases(base: dict, cases) -> None:
    """--merge: the cases rebuilt now must be the file's. Its prompts' fingerprint when it has
    one; else every stored answer must score against the rebuilt needles as its row says."""
    from .niah import is_correct, prompts_sha256

    if base["niah"].get("prompts_sha256"):
        if base["niah"]["prompts_sha256"] != prompts_sha256(cases):
            raise SystemExit("--merge: the NIAH prompts differ from the file's (prompts_sha256)")
        return
    for r in base["rows"]:
        ans = base.get("answers", {}).get(r["format"])
        if ans is None or r.get("niah") is None:
            continue
        # a row stopped by --max-minutes holds whole rounds: the first `trials` cases
        ok = sum(is_correct(a, c.number) for a, c in zip(ans, cases))
        if len(ans) != r["trials"] or len(ans) > len(cases) or ok != round(r["niah"] * r["trials"]):
            raise SystemExit(f"--merge: the stored {r['format']} answers score {ok}/{len(ans)} "
                             f"against the needles rebuilt now, the file says "
                             f"{round(r['niah'] * r['trials'])}/{r['trials']}: other NIAH cases")


def _case_order(cases, depths):
    """Trial-major order: every complete round covers each depth once, so a run stopped by
    --max-minutes after whole rounds has the same trials at every depth."""
    return sorted(cases, key=lambda c: (c.trial, depths.index(c.depth)))


def run(args, write) -> dict:
    """The study; ``write(result)`` is called after every round of cases (partial results)."""
    import torch
    from tqdm import tqdm

    from ..models import load_causal_lm, model_identity
    from .emulation import CastKV
    from .niah import is_correct, prompts_sha256

    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.time()
    _check_rotation(args.formats, args.rotation)  # fail before the model loads
    model, tok = load_causal_lm(args.model)
    st = Study(model, tok, args)
    fmts = _formats(args.formats, st.D)
    base = None
    if args.merge:
        base = json.loads(Path(args.out).read_text())
        have = {r["format"] for r in base["rows"]}
        fmts = [f for f in fmts if _label(f) not in have]
    elif BF16 not in [_label(f) for f in fmts]:
        fmts.insert(0, None)  # the reference row
    cases, depths = st.cases()
    cases = _case_order(cases, depths)
    if base is not None:  # the same cases as the run merged into
        if base["niah"]["seed"] != args.seed or base["niah"]["length"] != args.length \
                or base["niah"]["depths"] != depths:
            raise SystemExit(f"--merge: {args.out} used other NIAH settings: {base['niah']}")
        cases = cases[: base["rows"][0]["trials"]]
        _check_same_cases(base, cases)
    first = FID_FIRST
    bar = tqdm(total=args.fid_windows * (1 + len(fmts)) + len(cases) * (1 + len(fmts)),
               desc="format study", unit="step")
    fid, wshape = st.fidelity(fmts, first, bar)

    answers = {_label(f): [] for f in fmts}
    done, positions = [], []
    result = None

    def make_result():
        rows = []
        for f in fmts:
            label = _label(f)
            ok = [is_correct(tok.decode(a, skip_special_tokens=True), c.number)
                  for a, c in zip(answers[label], done)]
            by_depth = {str(d): (sum(o for o, c in zip(ok, done) if c.depth == d)
                                 / max(1, sum(1 for c in done if c.depth == d))) for d in depths}
            row = {"format": label,
                   "body_bits_per_element": 16.0 if f is None else round(f.body_bits_per_element(st.L), 4),
                   "niah": sum(ok) / len(ok) if ok else None, "trials": len(ok),
                   "niah_by_depth": by_depth,
                   "kld": fid[label]["kld"], "top1": fid[label]["top1"], "ppl": fid[label]["ppl"],
                   "sink": None if f is None else f.sink, "recent": None if f is None else f.window,
                   "rotation": "none" if f is None else f.rotation}
            if isinstance(f, CastKV):
                row.update(kv_dtype=str(f.dtype).replace("torch.", ""), kv_scale=1.0,
                           bytes_per_token_per_layer=f.bytes_per_token(st.Hk, head_dim=st.D))
            elif f is not None:
                if f.rotation == "calibrated":
                    row.update(rotation_file=args.rotation)
                row.update(k_layout=f.k_layout, k_bits=f.k_bits, v_bits=f.v_bits,
                           k_block_or_group=f.k_group, v_group=f.v_group, token_norm=f.token_norm,
                           bytes_per_token_per_layer=f.bytes_per_token(st.Hk, 0, st.L),
                           key_dot=_key_dot(f))
            rows.append(row)
        command = "python -m oscar_sglang.tools.evaluation.format_study " + " ".join(sys.argv[1:])
        res = {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "device": "cpu",
            "model": model_identity(args.model),
            "command": command,
            "niah": {"length": args.length, "depths": depths, "seed": args.seed,
                     "trials": len(done), "max_tokens": args.max_tokens, "prefill": "bf16",
                     "needle_tokens_min_start": min((a for a, _b, _p in positions), default=None),
                     "needle_tokens_max_end": max((b for _a, b, _p in positions), default=None),
                     "prompt_tokens_min": min((p for *_x, p in positions), default=None),
                     "prompt_tokens_max": max((p for *_x, p in positions), default=None),
                     "prompts_sha256": prompts_sha256(done)},
            "fidelity": {"windows": int(wshape[0]), "length": int(wshape[1]), "scored_from": first,
                         "positions": fid[_label(fmts[0])]["positions"], "texts": "held-out essays",
                         "ppl_ref": fid[_label(fmts[0])]["ppl_ref"]},
            "model_shape": {"layers": st.L, "kv_heads": st.Hk, "head_dim": st.D},
            "seconds": round(time.time() - t_start, 1),
            "rows": rows,
            "answers": {k: [tok.decode(a, skip_special_tokens=True) for a in v] for k, v in answers.items()},
        }
        if BF16 in answers:
            res["bf16_answer_tokens"] = answers[BF16]
        if base is not None:
            res = _merged(base, res)
        return res

    per_round = len(depths)
    for i, c in enumerate(cases):
        if i % per_round == 0 and args.max_minutes and time.time() - t_start > 60 * args.max_minutes:
            break  # only whole rounds: every depth keeps the same number of trials
        ids, (a, b) = st.encode(c)
        for f in fmts:
            if f is not None and (a < f.sink or b > ids.shape[1] - f.window):
                raise SystemExit(f"needle tokens [{a}, {b}) of a {ids.shape[1]}-token prompt are "
                                 f"not in the body of {f.name}: adjust --depths")
        cache, first_tok = st.prefill(ids)
        bar.update(1)
        guess = base["bf16_answer_tokens"][i] if base is not None else None
        for f in sorted(fmts, key=lambda f: f is not None):  # BF16 first: its answer is the guess
            toks = st.decode(cache, ids.shape[1], first_tok, f, c.number, guess)
            guess = toks if f is None else guess
            answers[_label(f)].append(toks)
            bar.set_postfix_str(_label(f))
            bar.update(1)
        done.append(c)
        positions.append((a, b, ids.shape[1]))
        if len(done) % per_round == 0:
            result = make_result()
            write(result)
    bar.close()
    return make_result()


def _merged(base: dict, new: dict) -> dict:
    """Rows of a --merge run added to the earlier run's JSON (same cases, same windows)."""
    for k in ("model", "device"):
        if base[k] != new[k]:
            raise SystemExit(f"--merge: {k} differs ({base[k]} vs {new[k]})")
    bf, nf = dict(base["fidelity"]), dict(new["fidelity"])
    # the reference perplexity is recomputed by every run: its float sums may differ in the last
    # digits (23.0643037 then 23.0643057 on this CPU); anything more is another setting
    b_ppl, n_ppl = bf.pop("ppl_ref", None), nf.pop("ppl_ref", None)
    if bf != nf or (b_ppl is None) != (n_ppl is None) or (
            b_ppl is not None and not math.isclose(b_ppl, n_ppl, rel_tol=1e-5)):
        raise SystemExit("--merge: other fidelity windows or settings")
    out = dict(base)
    bn, nn = base.get("niah") or {}, new.get("niah") or {}
    if not bn.get("prompts_sha256") and nn.get("prompts_sha256") and nn["trials"] == bn.get("trials"):
        # an older file (checked by re-scoring its answers): record the prompts' fingerprint
        out["niah"] = {**bn, "prompts_sha256": nn["prompts_sha256"]}
    out["rows"] = base["rows"] + new["rows"]
    out["answers"] = {**base["answers"], **new["answers"]}
    cmds = base["command"] if isinstance(base["command"], list) else [base["command"]]
    out["command"] = cmds + [new["command"]]
    out["date"] = new["date"]
    out["seconds"] = base["seconds"] + new["seconds"]
    return out


def markdown_table(result: dict) -> str:
    """The Pareto table of a study JSON (docs/accuracy.md), rows by body bits per element."""
    bf = next((r for r in result["rows"] if r["format"] == BF16), None)
    lines = ["| format | body bits/elem | NIAH (correct/trials) | NIAH / BF16 | KLD | top-1 | sink | ring |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["body_bits_per_element"], r["format"])):
        n, t = r["niah"], r["trials"]
        rel = "" if not bf or not bf["niah"] or n is None else f"{n / bf['niah']:.2f}"
        niah = "n/a" if n is None else f"{n:.3f} ({round(n * t)}/{t})"
        lines.append(f"| `{r['format']}` | {r['body_bits_per_element']:.3f} | {niah} | {rel} | "
                     f"{r['kld']:.4f} | {r['top1']:.3f} | {r['sink'] if r['sink'] is not None else '-'} | "
                     f"{r['recent'] if r['recent'] is not None else '-'} |")
    return "\n".join(lines)


# Capacity on the H100 (dummy Llama-3.1-8B, --mem-fraction-static 0.85, CHANGELOG.md):
# the int2 server's KV budget and BF16 side buffers (05:47 UTC log: 51.57 GiB, 3.09 GiB for 78
# running requests) and the measured BF16 / FP8 pools of the same day (423,494 / 846,988 tokens).
LLAMA8B_KV_ELEMENTS = 2 * 32 * 8 * 128  # K and V, layers x KV heads x head_dim, per token
LLAMA8B_BUDGET_GIB, LLAMA8B_SIDE_GIB = 51.57, 3.09
LLAMA8B_BF16_TOKENS, LLAMA8B_FP8_TOKENS = 423_494, 846_988


def llama8b_kv_tokens(bits_per_element: float) -> int:
    """KV tokens a format's body would hold on the dummy Llama-3.1-8B at mem 0.85, side buffers
    as today: arithmetic from the measured budget, not a server measurement."""
    per_token = bits_per_element / 8 * LLAMA8B_KV_ELEMENTS
    return int((LLAMA8B_BUDGET_GIB - LLAMA8B_SIDE_GIB) * 2**30 / per_token)


def pareto_plot(result: dict, png: str) -> None:
    """Two panels: NIAH / BF16 against body bits per element, and against the KV tokens each
    format would hold on the dummy Llama-3.1-8B (BF16 and FP8 pools as reference lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf = next(r for r in result["rows"] if r["format"] == BF16)
    rows = [r for r in result["rows"] if r["format"] != BF16 and r["niah"] is not None]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for r in rows:
        y = r["niah"] / bf["niah"]
        for ax, x in ((a, r["body_bits_per_element"]), (b, llama8b_kv_tokens(r["body_bits_per_element"]) / 1e6)):
            ax.scatter(x, y, s=18, color="tab:green" if r["format"].startswith("k3") else "tab:blue")
            ax.annotate(r["format"], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    for ax in (a, b):
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="BF16 (CPU study)")
        ax.axhline(0.9, color="grey", lw=0.6, ls=":", label="0.9 x BF16")
        ax.set_ylabel(f"NIAH / BF16 ({rows[0]['trials']} trials per format)")
        ax.set_ylim(0, 1.08)
    a.set_xlabel("body bits per K/V element (codes + fp16 scales / minimums + norms)")
    b.axvline(LLAMA8B_BF16_TOKENS / 1e6, color="tab:red", lw=0.8, label="BF16 pool (measured)")
    b.axvline(LLAMA8B_FP8_TOKENS / 1e6, color="tab:orange", lw=0.8, label="FP8 e4m3 pool (measured)")
    b.set_xlabel("KV tokens on the dummy Llama-3.1-8B at mem 0.85, millions (computed from the budget)")
    a.legend(fontsize=7, loc="lower right")
    b.legend(fontsize=7, loc="center left")
    fig.suptitle(f"{result['model']}, CPU emulation of the served cache ({result['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=130)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(markdown_table(json.loads(Path(sys.argv[2]).read_text())))
        return 0
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--plot":
        pareto_plot(json.loads(Path(sys.argv[2]).read_text()), sys.argv[3])
        print(f"wrote {sys.argv[3]}")
        return 0
    args = parse_args(argv)
    out = Path(args.out)

    def write(result):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(out)

    result = run(args, write)
    write(result)
    w = max(len(r["format"]) for r in result["rows"])
    print(f"{'format':{w}}  bits   niah (n)      kld     top1")
    for r in result["rows"]:
        niah = "  n/a" if r["niah"] is None else f"{r['niah']:.3f}"
        print(f"{r['format']:{w}}  {r['body_bits_per_element']:5.3f}  {niah} ({r['trials']})"
              f"  {r['kld']:.4f}  {r['top1']:.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
