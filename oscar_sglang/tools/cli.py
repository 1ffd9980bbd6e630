"""`oscar-sglang` console script: one sub-command per module in oscar_sglang.tools.commands.

Each command module exposes ``add_parser(subparsers)``, which registers its sub-parser and sets
``func`` (called with the parsed namespace; its return value is the exit code). Command modules
keep heavy imports (torch, sglang, transformers) inside their functions so `--help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "serve",      # launch an SGLang server with the plugin and --kv-cache-dtype int2
    "run",        # run any SGLang module (bench_one_batch, offline_throughput...) with the plugin
    "calibrate",  # produce a rotation file for a model
    "zoo",        # list / show / verify / pull rotation files
    "convert",    # convert rotation files to / from the OSCAR fork's .pt layout
    "eval",       # accuracy: fidelity vs BF16, needle-in-a-haystack
    "plan",       # KV tokens and running requests per KV format for a model and KV budget
)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="oscar-sglang",
        description="INT2 KV cache for SGLang: serve, plan capacity, calibrate rotations, evaluate accuracy.",
    )
    parser.add_argument("--version", action="version", version=f"oscar-sglang {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(f"oscar_sglang.tools.commands.{name}")
        except ModuleNotFoundError as e:  # a command whose module is not written yet
            if e.name != f"oscar_sglang.tools.commands.{name}":
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if rest and not getattr(args, "accepts_passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.passthrough = rest
    args.argv = list(argv)  # what was typed, for results that record their command
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
