"""Fidelity of emulated KV-cache recipes vs the unquantised model (teacher forcing).

For each window of held-out text, the unquantised model's logits are computed once; each
(recipe, group size) then runs the same window through the emulated cache
(evaluation.emulation). Only positions that read at least one INT2 key are scored, i.e.
t >= sink + recent (the query at t reads INT2 for keys sink .. t - recent); the last position
has no next token and is dropped too.

Metrics, averaged over scored positions of all windows:
  KLD    mean KL(P_ref || P_recipe) of the next-token distributions (nats)
  top-1  fraction of positions where both argmaxes agree
  PPL    exp(mean NLL of the true next token), for the recipe and for the reference
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .emulation import EmulationConfig, emulate_kv_cache
from .recipes import Recipe, build_rotations, tuned_group_size


@dataclass
class Scores:
    """Running sums over scored positions (add windows with +=)."""

    kld: float = 0.0
    top1: float = 0.0
    nll: float = 0.0
    nll_ref: float = 0.0
    count: int = 0

    def add(self, ref_logprobs: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """ref_logprobs, logits: [N, V] at scored positions; targets [N] the true next tokens."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        ref = ref_logprobs.float()
        self.kld += (ref.exp() * (ref - lp)).sum(-1).sum().item()
        self.top1 += (ref.argmax(-1) == lp.argmax(-1)).sum().item()
        self.nll -= lp.gather(-1, targets.view(-1, 1)).sum().item()
        self.nll_ref -= ref.gather(-1, targets.view(-1, 1)).sum().item()
        self.count += targets.numel()

    def summary(self) -> dict:
        n = max(self.count, 1)
        return {
            "kld": self.kld / n,
            "top1": self.top1 / n,
            "ppl": math.exp(self.nll / n),
            "ppl_ref": math.exp(self.nll_ref / n),
            "positions": self.count,
        }


def scored_range(length: int, sink: int, recent: int) -> tuple[int, int]:
    """[first, end) of scored positions in a window: reads an INT2 key and has a next token."""
    first = sink + recent
    if first >= length - 1:
        raise ValueError(
            f"window of {length} tokens has no position reading INT2 keys with sink={sink}, "
            f"recent={recent}: use --length > {sink + recent + 1}"
        )
    return first, length - 1


def make_windows(tok, texts: list[str], n_windows: int, length: int) -> torch.Tensor:
    """Consecutive, non-overlapping windows [n, length] of the concatenated texts' tokens."""
    ids = tok("\n\n".join(texts), return_tensors="pt", add_special_tokens=False).input_ids[0]
    n_avail = ids.numel() // length
    if n_avail < n_windows:
        raise ValueError(
            f"the texts give {ids.numel()} tokens: only {n_avail} windows of {length} "
            f"(asked for {n_windows}); lower --windows or --length"
        )
    return ids[: n_windows * length].view(n_windows, length)


@dataclass
class FidelityRun:
    model: str
    length: int
    windows: int
    sink: int
    recent: int
    results: list[dict] = field(default_factory=list)
    reference: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def _logits(model, ids: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Logits at positions first..end-1 (only those go through the LM head)."""
    out = model(ids.view(1, -1), logits_to_keep=ids.numel() - first)
    return out.logits[0, : end - first].float()


@torch.no_grad()
def run_fidelity(model, windows: torch.Tensor, recipes: list[Recipe], group_sizes: list[int],
                 sink: int = 64, recent: int = 256, query_chunk: int = 512, progress=None,
                 model_name: str = "", ref_cache=None) -> FidelityRun:
    """Score every (recipe, group size) on every window; see the module docstring.

    ref_cache: a directory where the reference log-probs of each window are kept between runs
    (keyed by model name and window tokens), so adding a recipe later costs no reference pass.
    """
    cfg = model.config
    L, Hk = cfg.num_hidden_layers, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n, length = windows.shape
    first, end = scored_range(length, sink, recent)
    run = FidelityRun(model_name, length, n, sink, recent)
    jobs = []
    for r in recipes:
        rs = build_rotations(r, L, Hk, D)
        for G in ([0] if not r.quantize else group_sizes):
            skip = None
            if r.quantize and not r.supports(G, D):
                skip = f"group {G} does not divide head_dim {D}"
            elif tuned_group_size(rs) not in (None, G):
                skip = f"rotation file tuned for group {tuned_group_size(rs)}"
            if skip:
                run.results.append({"recipe": r.name, "group_size": G, "skipped": skip})
                continue
            jobs.append((r, rs, G))
    total = n * (1 + len(jobs))
    bar = progress(total=total, desc="fidelity", unit="fwd") if progress else None
    sums = {i: Scores() for i in range(len(jobs))}
    ref_sum = Scores()
    seconds = {i: 0.0 for i in range(len(jobs))}
    for w in range(n):
        ids = windows[w]
        targets = ids[first + 1 : end + 1]
        ref_lp = _reference_logprobs(model, ids, first, end, model_name, ref_cache)
        ref_sum.add(ref_lp, ref_lp, targets)
        if bar:
            bar.update(1)
        for i, (r, rs, G) in enumerate(jobs):
            ecfg = EmulationConfig(r, rs, group_size=G or 64, sink=sink, recent=recent,
                                   query_chunk=query_chunk)
            t0 = time.time()
            with emulate_kv_cache(model, ecfg):
                logits = _logits(model, ids, first, end)
            seconds[i] += time.time() - t0
            sums[i].add(ref_lp, logits, targets)
            if bar:
                bar.set_postfix_str(f"{r.name} g{G}")
                bar.update(1)
        del ref_lp
    if bar:
        bar.close()
    run.reference = ref_sum.summary()
    for i, (r, rs, G) in enumerate(jobs):
        row = {"recipe": r.name, "group_size": G or None,
               "bits_per_element": r.bits_per_element(G) if r.quantize else 16.0,
               "k_layout": r.k_layout, "rotation": rs.source or r.rotation,
               "k_clip_mean": float(rs.k_clip.mean()), "v_clip_mean": float(rs.v_clip.mean()),
               "seconds": round(seconds[i], 1)}
        row.update(sums[i].summary())
        run.results.append(row)
    return run


def _reference_logprobs(model, ids, first, end, model_name, ref_cache):
    path = None
    if ref_cache:
        key = hashlib.sha256(f"{model_name}:{first}:{end}".encode() + ids.cpu().numpy().tobytes())
        path = Path(ref_cache) / f"ref-logprobs-{key.hexdigest()[:16]}.pt"
        if path.is_file():
            return torch.load(path)
    lp = torch.log_softmax(_logits(model, ids, first, end), dim=-1)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(lp, path)
    return lp


def merge_runs(run: dict, others: list[dict]) -> dict:
    """Add the result rows of earlier runs on the same windows (same model, length, windows,
    sink, recent and reference perplexity) to ``run``; rows already present are kept."""
    keys = ("model", "length", "windows", "sink", "recent")
    have = {(r["recipe"], r["group_size"]) for r in run["results"]}
    for o in others:
        if any(o[k] != run[k] for k in keys) or abs(o["reference"]["ppl"] - run["reference"]["ppl"]) > 1e-3:
            raise ValueError("--merge: results come from different windows or settings: "
                             + ", ".join(f"{k} {o[k]} vs {run[k]}" for k in keys))
        for r in o["results"]:
            if (r["recipe"], r["group_size"]) not in have:
                run["results"].append(r)
                have.add((r["recipe"], r["group_size"]))
    return run


def as_dict(run: FidelityRun) -> dict:
    return asdict(run)
