"""Smoke tests of the `oscar-sglang` console script: every command has working --help, and
building the parser imports neither torch nor sglang (so --help answers at once)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from oscar_sglang.tools.cli import COMMAND_MODULES

from tests import ROOT, load_toml



def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oscar_sglang.tools.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_console_script_points_at_the_cli():
    scripts = load_toml()["project"]["scripts"]
    assert scripts["oscar-sglang"] == "oscar_sglang.tools.cli:main"


def test_every_command_module_exists():
    # the dispatcher skips a missing module silently (so work in progress still runs);
    # the shipped package must have all of them
    for name in COMMAND_MODULES:
        assert (ROOT / "oscar_sglang" / "tools" / "commands" / f"{name}.py").is_file(), name


def test_top_level_help_lists_every_command():
    res = _run("--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: oscar-sglang")
    for name in COMMAND_MODULES:
        assert name in res.stdout, f"{name} missing from oscar-sglang --help"


def test_version():
    from oscar_sglang import __version__

    res = _run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"oscar-sglang {__version__}"


@pytest.mark.parametrize("name", COMMAND_MODULES)
def test_command_help(name):
    res = _run(name, "--help")
    assert res.returncode == 0, res.stderr
    assert f"usage: oscar-sglang {name}" in res.stdout
    # a help text says something beyond the usage line
    assert len(res.stdout.splitlines()) > 3, res.stdout


def test_building_the_parser_imports_no_heavy_module():
    code = (
        "import sys; from oscar_sglang.tools.cli import build_parser; build_parser(); "
        "heavy = sorted(m for m in ('torch', 'sglang', 'transformers', 'triton') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"--help imports {res.stdout.strip()}: move them into functions"


def test_no_command_prints_help_and_fails():
    res = _run()
    assert res.returncode == 2 and "usage: oscar-sglang" in res.stdout


def test_unknown_option_is_refused_with_usage():
    res = _run("zoo", "--no-such-option-xyz")
    assert res.returncode == 2
    assert "unrecognized arguments" in res.stderr or "no-such-option-xyz" in res.stderr
