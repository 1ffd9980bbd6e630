"""The README stays true to the code: its two commands exist, come first and CI runs the test one,
every command and the settings a user sets are documented, every path and link it names exists."""
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


# The README lists only the settings a user sets; every setting is in docs/settings.md, the table
# generated from the settings registry (its own test checks that table against the registry).
USER_SETTINGS = ("OSCAR_KV_FORMAT", "OSCAR_ROTATION", "OSCAR_SINK_TOKENS", "OSCAR_RECENT_TOKENS")


def test_the_user_settings_are_documented_and_the_full_table_linked():
    settings = README.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    for name in USER_SETTINGS:
        assert name in ENV_VARS, f"{name} is not a setting the plugin reads"
        assert f"`{name}`" in settings, name
    named = set(re.findall(r"`(OSCAR_[A-Z_]+)`", settings))
    assert named <= set(ENV_VARS), named - set(ENV_VARS)
    assert "](docs/settings.md)" in settings


def test_the_two_commands_come_first():
    lines = README.splitlines()
    start = lines.index("## The two commands")
    assert start < 60, start
    assert len(lines) <= 200, len(lines)
    assert "make test-fast" in README


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
