"""The README stays true to the code: its two commands exist and CI runs the test one, every
command and environment variable is documented, every path and link it names exists."""
from __future__ import annotations

import re
import shlex

from oscar_sglang.tools.cli import COMMAND_MODULES
from oscar_sglang.runtime.config import ENV_VARS

from tests import ROOT

README = (ROOT / "README.md").read_text()


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*):", text, re.M)}


def test_the_two_commands_exist_and_ci_runs_the_test_command():
    assert "make test" in README and "make serve" in README
    assert {"test", "serve"} <= _make_targets()
    ci = [ln.split("#", 1)[0].strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "make test" in ci, ci
    serve_recipe = (ROOT / "Makefile").read_text().split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "oscar-sglang serve" in serve_recipe


def test_every_command_is_documented():
    for name in COMMAND_MODULES:
        assert f"oscar-sglang {name}" in README, f"`oscar-sglang {name}` is not in the README"


def test_every_plugin_environment_variable_is_documented():
    for name, (alias, _) in ENV_VARS.items():
        assert f"`{name}`" in README, name
        if alias:
            assert alias in README, alias


def test_every_relative_link_and_named_path_exists():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README)
    paths = re.findall(r"(?<![\w/.-])((?:docs|docker|launch|bench|kernels|rotation_zoo|tests|"
                       r"oscar_sglang)/[\w./-]*[\w/])", README)
    assert links and paths
    for rel in links + paths:
        assert (ROOT / rel).exists(), f"README names {rel}, which does not exist"


def test_no_placeholder_is_left():
    assert "PLACEHOLDER" not in README and "TODO" not in README


def test_launch_commands_in_the_readme_name_real_recipes():
    for m in re.finditer(r"launch/launch\.py ([\w.-]+)", README):
        name = m.group(1)
        if not name.startswith("-"):
            assert (ROOT / "launch" / f"{name}.yaml").is_file(), name


def test_docker_commands_use_the_files_that_exist():
    for m in re.finditer(r"docker (?:build|compose) [^\n]*", README):
        words = shlex.split(m.group(0))
        for flag in ("-f", "--file"):
            if flag in words:
                assert (ROOT / words[words.index(flag) + 1]).is_file(), m.group(0)
