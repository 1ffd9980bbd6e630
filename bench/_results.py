"""The JSON every benchmark writes: date, device, model, command and one row per configuration.

Runs kept in the repository live under bench/results/ (RESULTS); docs/benchmarks.md names the file
each table was made from.
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ("date", "device", "model", "command", "rows")


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001 (no CUDA: say so in the file rather than fail the run)
        return f"unknown ({type(e).__name__})"


def document(model: str, rows: list, device: str | None = None, **extra) -> dict:
    """The result document; `extra` keys (run-wide values such as copy bandwidth) follow `rows`."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device if device is not None else device_name(), "model": model,
            "command": "python " + " ".join(sys.argv), "rows": rows, **extra}


def default_path(bench: str) -> Path:
    """bench/results/<bench>/<UTC date_time>.json, where a run lands when no output is given."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M")
    return RESULTS / bench / f"{stamp}.json"


def write(path, doc: dict) -> Path:
    missing = [k for k in KEYS if k not in doc]
    assert not missing, f"result document lacks {missing}"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)  # a cut-off run leaves the previous complete file, never half of one
    return path
