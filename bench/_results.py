"""The JSON every benchmark writes: date, device, model, command, commit and one row per configuration.

Runs kept in the repository live under bench/results/ (RESULTS); docs/performance.md, docs/accuracy.md and CHANGELOG.md name the file
each table was made from.
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
KEYS = ("date", "device", "model", "command", "commit", "rows")


def command(module: str | None = None, args: list | None = None) -> str:
    """The command that reproduces this run, as typed from the project root.

    `python -m bench.<module> ARGS`: `module` defaults to the running script's (under `python -m`
    sys.argv[0] is the file's path, not what was typed), ARGS to sys.argv[1:]. A script outside
    bench/ is recorded as `python <path> ARGS`.
    """
    args = list(sys.argv[1:] if args is None else args)
    if module is None:
        first = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
        if first is not None and first.suffix == ".py" and first.resolve().parent == BENCH:
            module = first.stem
        else:
            return shlex.join(["python", *(sys.argv[:1] or []), *args])
    return shlex.join(["python", "-m", f"bench.{module}", *args])


def commit() -> str | None:
    """BENCH_COMMIT when set (a device machine's copy of the working tree carries git metadata of
    another commit, or none: the command that sends the tree names its commit, e.g.
    `BENCH_COMMIT=<git rev-parse HEAD here> bash bench/run_stages.sh ...`), else HEAD of the
    checkout, or None where it is not a git checkout."""
    named = os.environ.get("BENCH_COMMIT", "").strip()
    if named:
        return named
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    head = out.stdout.strip()
    return head if out.returncode == 0 and head else None


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
            "command": command(), "commit": commit(), "rows": rows, **extra}


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


class Checks:
    """A results file's acceptance checks: check() records each (None: not measured, which fails
    and is named), summary() is the `summary` the JSON carries."""

    def __init__(self):
        self.checks: dict = {}
        self.values: dict = {}
        self.missing: list = []

    def check(self, name: str, ok, **vals) -> None:
        self.values[name] = vals
        if ok is None:
            self.missing.append(name)
        self.checks[name] = bool(ok)

    def summary(self) -> dict:
        return {"checks": self.checks, "check_values": self.values, "not_measured": self.missing,
                "all_checks_pass": bool(self.checks) and all(self.checks.values())}
