"""The calibrate() driver: data -> capture -> rotations -> clip search -> file."""
from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...common.rotations import (
    RECIPES,
    RotationSet,
    default_metadata,
    hadamard_rotation_set,
    identity_rotation_set,
    save_rotation_file,
)
from .clip_search import DEFAULT_CLIP_GRID

log = logging.getLogger("oscar_sglang.calibrate")


@dataclass
class CalibrationConfig:
    model: str  # HF id, local dir, .gguf file, or "smollm2"
    out: str = "."  # output directory
    recipe: str = "oscar"
    data: list = field(default_factory=list)  # .txt/.jsonl files; empty = calibration essays
    group_size: int | None = None  # INT2 quant group; None = min(128, head_dim)
    per_head: bool = False  # one rotation per KV head instead of one per layer
    seq_len: int = 1024  # tokens per calibration sequence
    max_tokens: int = 8192  # tokens used for the covariances
    heldout_sequences: int = 2  # sequences kept apart for the clip search
    sample_queries: int = 128  # queries per held-out sequence scored by the clip search
    sink: int = 64  # leading positions the server keeps exact (not quantised)
    clip_grid: tuple = DEFAULT_CLIP_GRID
    search_clip: bool | None = None  # None = yes for "oscar", no for the data-free recipes
    seed: int = 0
    device: str = "cpu"
    device_map: str | None = None  # "auto" to spread a large model over GPUs
    progress: bool = True
    filename: str | None = None  # default <model>.<recipe>.g<G>.safetensors


def _config_of(model: str):
    """The model's transformers config without loading weights. A GGUF's config is read from
    its dequantised cached copy (models.py makes it once): parsing the GGUF header itself
    (the whole tokenizer vocabulary) is slower than loading that copy's config.json."""
    from transformers import AutoConfig

    from ..models import _dequantised_copy, resolve_model

    path, gguf = resolve_model(model)
    return AutoConfig.from_pretrained(_dequantised_copy(path, gguf) if gguf else path)


def model_dims(config) -> dict:
    """Attention geometry from a transformers config (text config for multimodal models)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return {
        "num_layers": c.num_hidden_layers,
        "num_q_heads": heads,
        "num_kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "v_head_dim": getattr(c, "v_head_dim", None) or head_dim,
        "architecture": (getattr(config, "architectures", None) or [config.model_type])[0],
    }


def _model_revision(model: str, config) -> str:
    """HF commit hash when transformers knows it, else a hash of the local weights' identity."""
    from ..models import resolve_model

    rev = getattr(config, "_commit_hash", None)
    if rev:
        return str(rev)
    path, gguf = resolve_model(model)
    target = Path(path) / gguf if gguf else Path(path) / "config.json"
    if target.is_file():
        h = hashlib.sha256()
        with open(target, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return f"sha256:{h.hexdigest()}"
    return "unknown"


def _created() -> str:
    """UTC date; honours SOURCE_DATE_EPOCH so reproducible runs give byte-identical files."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    t = (_dt.datetime.fromtimestamp(int(epoch), _dt.timezone.utc) if epoch
         else _dt.datetime.now(_dt.timezone.utc))
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def token_sequences(texts, tokenizer, seq_len: int, seed: int):
    """Cut every text into consecutive seq_len-token chunks (a text's tail shorter than
    seq_len/2 is dropped), then shuffle the chunks with `seed`."""
    chunks = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=True)["input_ids"]
        for s in range(0, len(ids), seq_len):
            c = ids[s:s + seq_len]
            if len(c) >= max(16, seq_len // 2):
                chunks.append(c)
    random.Random(seed).shuffle(chunks)
    return chunks


def _split(chunks, cfg: CalibrationConfig):
    held = chunks[: cfg.heldout_sequences]
    train, total = [], 0
    for c in chunks[cfg.heldout_sequences:]:
        if total >= cfg.max_tokens:
            break
        train.append(c)
        total += len(c)
    if not train:
        raise ValueError(
            f"not enough calibration text: {len(chunks)} sequence(s) of up to {cfg.seq_len} "
            f"tokens, {cfg.heldout_sequences} of them held out; give more --data or lower "
            f"--seq-len / --heldout-sequences"
        )
    return train, held


def _default_filename(model_id: str, recipe: str, group_size: int, per_head: bool) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id.rsplit("/", 1)[-1])
    return f"{name}.{recipe}{'.perhead' if per_head else ''}.g{group_size}.safetensors"


def calibrate(cfg: CalibrationConfig, loaded=None) -> tuple[RotationSet, Path]:
    """Run the recipe, write the file, return (RotationSet, path).

    loaded: optional (model, tokenizer) already loaded from cfg.model, to skip loading it again.
    """
    from oscar_kernels.format import Int2Format

    from ..data import calibration_essays, fingerprint, read_texts
    from ..models import load_causal_lm, model_identity
    from .capture import Capture, run_sequences
    from .recipes import rotations_from_stats

    if cfg.recipe not in RECIPES:
        raise ValueError(f"unknown recipe {cfg.recipe!r}; choose one of {RECIPES}")
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    config = _config_of(cfg.model)
    dims = model_dims(config)
    G = cfg.group_size or min(128, dims["head_dim"])
    fmt = Int2Format(dims["head_dim"], G)  # refuses head_dim / group sizes INT2 cannot store
    if dims["v_head_dim"] != dims["head_dim"]:
        Int2Format(dims["v_head_dim"], G)
    model_id = model_identity(cfg.model)
    per_head = cfg.per_head and cfg.recipe == "oscar"  # the data-free matrices are shared
    search = cfg.search_clip if cfg.search_clip is not None else cfg.recipe == "oscar"
    needs_data = cfg.recipe == "oscar" or search
    md = dict(
        model_id=model_id,
        model_revision=_model_revision(cfg.model, config),
        architecture=dims["architecture"],
        group_size=G,
        per_head=per_head,
        created=_created(),
    )
    log.info("model %s: %s", model_id, dims)

    if not needs_data:
        make = hadamard_rotation_set if cfg.recipe == "hadamard" else identity_rotation_set
        rs = make(dims["num_layers"], dims["num_kv_heads"], dims["head_dim"], dims["v_head_dim"], **md)
    else:
        files = [str(p) for p in (cfg.data or calibration_essays())]
        texts = read_texts(files)
        lm, tok = loaded or load_causal_lm(cfg.model, device=cfg.device, device_map=cfg.device_map)
        chunks = token_sequences(texts, tok, cfg.seq_len, cfg.seed)
        train, held = _split(chunks, cfg)
        log.info("%d calibration sequences (%d tokens), %d held out", len(train),
                 sum(map(len, train)), len(held))
        cap = Capture(sample_queries=cfg.sample_queries)
        L = dims["num_layers"]
        if cfg.recipe == "oscar":
            run_sequences(lm, train, cap, "stats", "covariances", cfg.progress)
            missing = sorted(set(range(L)) - set(cap.stats))
            if missing:
                raise RuntimeError(f"no attention captured for layers {missing[:8]}")
            k_rot, v_rot = rotations_from_stats(cap.stats, L, G, per_head)
            rs = RotationSet(
                k_rot, v_rot, torch.ones(L), torch.ones(L),
                metadata=default_metadata("oscar", L, dims["num_kv_heads"], dims["head_dim"],
                                          dims["v_head_dim"], **md),
            )
        else:
            make = hadamard_rotation_set if cfg.recipe == "hadamard" else identity_rotation_set
            rs = make(L, dims["num_kv_heads"], dims["head_dim"], dims["v_head_dim"], **md)
        rs.metadata.update(
            data_fingerprint=fingerprint(texts),
            data_files=[Path(f).name for f in files][:64],
            calibration_tokens=sum(map(len, train)) if cfg.recipe == "oscar" else 0,
            heldout_tokens=sum(map(len, held)),
            seq_len=cfg.seq_len,
            seed=cfg.seed,
        )
        if search and held:
            run_sequences(lm, held, cap, "sample", "held-out", cfg.progress)
        del lm
        if search and held:
            # Many small tensor ops: one thread is faster (no OpenMP barriers on a busy CPU).
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                _search_clips(rs, cap, cfg, fmt)
            finally:
                torch.set_num_threads(threads)
    rs.metadata["created"] = md["created"]
    out = Path(cfg.out) / (cfg.filename or _default_filename(model_id, cfg.recipe, G, per_head))
    rs.sha256 = save_rotation_file(rs, out)
    rs.source = str(out)
    log.info("wrote %s (sha256 %s) in %.1f s", out, rs.sha256, time.time() - t0)
    return rs, out


def _search_clips(rs: RotationSet, cap, cfg: CalibrationConfig, fmt) -> None:
    """Pick k_clip/v_clip per layer on the held-out sequences; also score the data-free
    baselines on the same tokens (metadata["metrics"])."""
    from tqdm.auto import tqdm

    from .clip_search import LayerEvaluator

    L = rs.num_layers
    base = {
        "hadamard": hadamard_rotation_set(L, 1, rs.head_dim, rs.v_head_dim),
        "identity": identity_rotation_set(L, 1, rs.head_dim, rs.v_head_dim),
    }
    k_clip, v_clip, table = [], [], []
    totals = {"k": {}, "v": {}, "kv": {}}
    for layer in tqdm(range(L), desc="clip search", unit="layer", disable=not cfg.progress):
        ev = LayerEvaluator(cap.samples[layer], fmt, cfg.sink)
        rk, rv = rs.k_rotation[layer], rs.v_rotation[layer]
        kc, kerr = ev.search(rk, "k", cfg.clip_grid)
        vc, verr = ev.search(rv, "v", cfg.clip_grid)
        k_clip.append(kc)
        v_clip.append(vc)
        table.append({"layer": layer, "k_clip": kc, "v_clip": vc,
                      "k_err": {str(c): e for c, e in kerr.items()},
                      "v_err": {str(c): e for c, e in verr.items()}})
        sets = {rs.recipe: (rk, rv, kc, vc)}
        for name, b in base.items():
            if name != rs.recipe:
                sets[name] = (b.k_rotation[layer], b.v_rotation[layer], 1.0, 1.0)
        for name, (a, b, c1, c2) in sets.items():
            totals["k"].setdefault(name, []).append(ev.error(rk=a, k_clip=c1))
            totals["v"].setdefault(name, []).append(ev.error(rv=b, v_clip=c2))
            totals["kv"].setdefault(name, []).append(ev.error(rk=a, rv=b, k_clip=c1, v_clip=c2))
    rs.k_clip = torch.tensor(k_clip, dtype=torch.float32)
    rs.v_clip = torch.tensor(v_clip, dtype=torch.float32)
    rs.metadata["clip_search"] = {
        "grid": list(cfg.clip_grid), "sink": cfg.sink, "sample_queries": cfg.sample_queries,
        "objective": "relative attention-output error on held-out calibration sequences",
        "layers": table,
    }
    rs.metadata["metrics"] = {
        "heldout_rel_attn_err_mean": {
            part: {name: sum(v) / len(v) for name, v in per.items()} for part, per in totals.items()
        },
        "note": "mean over layers of sum|o-o_ref|^2/sum|o_ref|^2; K, V or both in INT2; "
                "baselines (hadamard, identity) unclipped",
    }
