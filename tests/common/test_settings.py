"""The settings registry (oscar_sglang/common/settings.py): every OSCAR_* name in the source is
declared there, the docs' table is generated from it, and it parses, defaults and refuses as it
says."""
from __future__ import annotations

import ast
import logging
import os
import re
import tokenize

import pytest

from oscar_sglang.common import settings as S

from tests import ROOT

SOURCE = ROOT / "oscar_sglang"
NAME = re.compile(r"(?<![A-Za-z0-9_])OSCAR_[A-Z0-9_]*[A-Z0-9]")
# OSCAR_* strings in the source that are not environment variables (name: why); none today
NOT_SETTINGS: dict[str, str] = {}


def _string_literals(path):
    """Every string literal token of a module (f-strings included), not comments."""
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.STRING:
                yield tok.string
            elif getattr(tokenize, "FSTRING_MIDDLE", None) == tok.type:  # Python 3.12+
                yield tok.string


def _names_in_strings() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        for lit in _string_literals(path):
            for name in NAME.findall(lit):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_oscar_name_in_the_source_is_declared_in_the_registry():
    found = _names_in_strings()
    assert {"OSCAR_KV_FORMAT", "OSCAR_DEBUG_TAP_DIR", "OSCAR_SGLANG_ZOO_DIR"} <= set(found)  # the scan works
    unknown = {n: sorted(p) for n, p in found.items()
               if n not in S.REGISTRY and n not in S.REMOVED and n not in NOT_SETTINGS}
    assert not unknown, f"OSCAR_* names used but not declared in common/settings.py: {unknown}"
    # a removed setting is named only by the registry (which refuses it)
    stale = {n: sorted(p) for n, p in found.items() if n in S.REMOVED and p != {"oscar_sglang/common/settings.py"}}
    assert not stale, stale


def _reads_outside_the_registry(path) -> list[str]:
    """os.environ / os.getenv reads of a declared name, an alias or a removed name."""
    names = set(S.REGISTRY) | set(S.REMOVED) | {a for s in S.REGISTRY.values() for a in s.aliases}
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = node.func.value
            owner_name = getattr(owner, "attr", None) or getattr(owner, "id", None)
            if (node.func.attr in ("get", "pop") and owner_name == "environ") or node.func.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if (getattr(node.value, "attr", None) or getattr(node.value, "id", None)) == "environ":
                key = node.slice
        if isinstance(key, ast.Constant) and key.value in names:
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {key.value}")
    return bad


def test_only_the_registry_reads_the_environment_for_oscar_settings():
    bad = [b for p in sorted(SOURCE.rglob("*.py")) if p.name != "settings.py" or p.parent.name != "common"
           for b in _reads_outside_the_registry(p)]
    assert not bad, bad


def test_docs_settings_table_is_generated_from_the_registry():
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert doc == S.markdown_table(), (
        "docs/settings.md is stale: python -m oscar_sglang.common.settings --markdown > docs/settings.md")
    for name, s in S.REGISTRY.items():
        assert f"`{name}`" in doc and all(f"`{a}`" in doc for a in s.aliases)
    for name in S.REMOVED:
        assert f"`{name}`" in doc


def test_markdown_command_prints_the_table(capsys):
    assert S.main(["--markdown"]) == 0
    assert capsys.readouterr().out == S.markdown_table()


def test_defaults_when_unset_or_empty():
    assert S.KV_FORMAT.get({}) == "k4c64-v2h-s4-w128"
    assert S.KV_FORMAT.get({"OSCAR_KV_FORMAT": ""}) == "k4c64-v2h-s4-w128"  # empty = unset
    assert S.ROTATION.get({}) == "hadamard" and S.V_ABSORB.get({}) is True
    assert S.ALLOW_MODEL_MISMATCH.get({}) is False and S.MAX_RUNNING_REQUESTS.get({}) == 1024
    assert S.SIDE_BUFFER_FRACTION.get({}) == 0.2 and S.GROUP_SIZE.get({}) == 128
    assert S.NEW_TOKEN_ATTENTION.get({}) == "flashinfer" and S.DECODE_STORE.get({}) == "split"
    assert S.PREFIX_ATTENTION.get({}) is None and S.SINK_TOKENS.get({}) is None
    assert S.DEBUG_TAP_DIR.get({}) is None and S.DEBUG_TAP_LAYER.get({}) is None
    assert S.ZOO_REPO.get({}) == "oscar-sglang/rotation-zoo"
    assert S.validate({}) == ({}, {})
    assert not S.KV_FORMAT.is_set({"OSCAR_KV_FORMAT": ""}) and S.KV_FORMAT.is_set({"OSCAR_KV_FORMAT": "token"})


def test_typed_values():
    env = {"OSCAR_SINK_TOKENS": "16", "OSCAR_V_ABSORB": "no", "OSCAR_ALLOW_MODEL_MISMATCH": "TRUE",
           "OSCAR_SIDE_BUFFER_FRACTION": "0.1", "OSCAR_DECODE_STORE": " Fused ", "OSCAR_GROUP_SIZE": "64",
           "OSCAR_SGLANG_CACHE": "~/x", "OSCAR_ROTATION": "Identity"}
    assert S.SINK_TOKENS.get(env) == 16 and S.V_ABSORB.get(env) is False
    assert S.ALLOW_MODEL_MISMATCH.get(env) is True and S.SIDE_BUFFER_FRACTION.get(env) == 0.1
    assert S.DECODE_STORE.get(env) == "fused" and S.GROUP_SIZE.get(env) == 64
    assert S.CACHE_DIR.get(env).endswith("/x") and "~" not in S.CACHE_DIR.get(env)
    assert S.ROTATION.get(env) == "identity"
    values, sources = S.validate(env)
    assert values["OSCAR_SINK_TOKENS"] == 16 and sources == {n: n for n in env}


def test_group_size_choices_are_the_kernels():
    from oscar_kernels.format import SUPPORTED_GROUP_SIZES

    assert S.GROUP_SIZE.choices == SUPPORTED_GROUP_SIZES


@pytest.mark.parametrize("env, words", [
    ({"OSCAR_NEW_TOKEN_ATTENTION": "fa3"}, ["OSCAR_NEW_TOKEN_ATTENTION", "'flashinfer' or 'triton'", "'fa3'"]),
    ({"OSCAR_PREFIX_ATTENTION": "bf16"}, ["OSCAR_PREFIX_ATTENTION", "'int2' or 'flashinfer'"]),
    ({"OSCAR_GROUP_SIZE": "48"}, ["OSCAR_GROUP_SIZE=48", "one of (32, 64, 128)"]),
    ({"OSCAR_MAX_RUNNING_REQUESTS": "0"}, ["OSCAR_MAX_RUNNING_REQUESTS=0", ">= 1"]),
    ({"OSCAR_RECENT_TOKENS": "x"}, ["OSCAR_RECENT_TOKENS", "not an integer"]),
    ({"OSCAR_SINK_TOKENS": "70000"}, ["OSCAR_SINK_TOKENS=70000", "[0, 65536]"]),
    ({"OSCAR_SIDE_BUFFER_FRACTION": "0"}, ["OSCAR_SIDE_BUFFER_FRACTION", "(0, 1)"]),
    ({"OSCAR_K_CLIP": "2"}, ["OSCAR_K_CLIP", "(0, 1]"]),
    ({"OSCAR_V_ABSORB": "maybe"}, ["OSCAR_V_ABSORB", "0 or 1"]),
    ({"OSCAR_ROTATION": "/no/such.safetensors"}, ["OSCAR_ROTATION", "no such file", "hadamard/identity"]),
    ({"OSCAR_KV_FORMAT": "k4c64 v2h"}, ["OSCAR_KV_FORMAT", "no spaces"]),
    ({"OSCAR_DEBUG_TAP_DIR": "/tmp/tap"}, ["OSCAR_DEBUG_TAP_DIR and OSCAR_DEBUG_TAP_LAYER go together"]),
    ({"OSCAR_DEBUG_TAP_DIR": "/tmp/tap", "OSCAR_DEBUG_TAP_LAYER": "-1"}, ["OSCAR_DEBUG_TAP_LAYER=-1", ">= 0"]),
    ({"OSCAR_V_ROTATION": "/no/v.pt"}, ["OSCAR_V_ROTATION", "no such file", "K rotation file"]),
])
def test_bad_values_name_the_variable_and_what_it_accepts(env, words):
    with pytest.raises(S.SettingError) as e:
        S.validate(env)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_every_problem_is_reported_at_once():
    with pytest.raises(S.SettingError) as e:
        S.validate({"OSCAR_GROUP_SIZE": "48", "OSCAR_DECODE_STORE": "x", "OSCAR_CHANNEL_EXTEND": "codes"})
    msg = str(e.value)
    assert msg.startswith("bad OSCAR settings:") and msg.count("\n  - ") == 3
    assert "OSCAR_GROUP_SIZE" in msg and "OSCAR_DECODE_STORE" in msg and "OSCAR_CHANNEL_EXTEND was removed" in msg


@pytest.mark.parametrize("name", sorted(S.REMOVED))
def test_removed_settings_stop_the_start_whatever_their_value(name):
    for value in ("1", "planes", "anything"):
        with pytest.raises(S.SettingError, match=f"{name} was removed: .*; unset it"):
            S.validate({name: value})
    S.validate({name: ""})  # empty is unset (docker compose passes every name, empty)
    assert name not in S.REGISTRY


def test_fork_aliases_map_to_our_names_and_warn_once(caplog, monkeypatch):
    monkeypatch.setattr(S, "_WARNED", set())
    env = {"SGLANG_MIXED_KV_PREFIX_TOKENS": "32", "SGLANG_OSCAR_K_CLIP_RATIO": "0"}
    with caplog.at_level(logging.WARNING, logger="oscar_sglang"):
        assert S.SINK_TOKENS.lookup(env) == (32, "SGLANG_MIXED_KV_PREFIX_TOKENS")
        assert S.SINK_TOKENS.get(env) == 32
        assert S.K_CLIP.get(env) == 1.0  # the fork's 0 = no clipping
        values, sources = S.validate(env)
    assert values == {"OSCAR_SINK_TOKENS": 32, "OSCAR_K_CLIP": 1.0}
    assert sources == {"OSCAR_SINK_TOKENS": "SGLANG_MIXED_KV_PREFIX_TOKENS", "OSCAR_K_CLIP": "SGLANG_OSCAR_K_CLIP_RATIO"}
    warned = [r.getMessage() for r in caplog.records if "fork's name" in r.getMessage()]
    assert len(warned) == 2, warned  # once per alias however often it is read
    assert any("SGLANG_MIXED_KV_PREFIX_TOKENS is the OSCAR fork's name for OSCAR_SINK_TOKENS" in w for w in warned)
    # our name for clipping: 0 is an error, not "off"
    with pytest.raises(S.SettingError, match=r"OSCAR_K_CLIP=0.0 must be in \(0, 1\]"):
        S.K_CLIP.get({"OSCAR_K_CLIP": "0"})


def test_our_name_and_an_alias_must_agree():
    assert S.SINK_TOKENS.get({"OSCAR_SINK_TOKENS": "16", "SGLANG_MIXED_KV_PREFIX_TOKENS": "16"}) == 16
    with pytest.raises(S.SettingError, match="OSCAR_SINK_TOKENS='16' and SGLANG_MIXED_KV_PREFIX_TOKENS='64' disagree"):
        S.validate({"OSCAR_SINK_TOKENS": "16", "SGLANG_MIXED_KV_PREFIX_TOKENS": "64"})


def test_rotation_file_is_kept_as_a_path(tmp_path):
    k = tmp_path / "k.pt"
    k.write_bytes(b"x")
    v = tmp_path / "v.pt"
    v.write_bytes(b"x")
    values, _ = S.validate({"OSCAR_ROTATION": str(k), "OSCAR_V_ROTATION": str(v)})
    assert values == {"OSCAR_ROTATION": str(k), "OSCAR_V_ROTATION": str(v)}


def test_every_setting_is_documented_and_typed():
    for name, s in S.REGISTRY.items():
        assert name.startswith("OSCAR_") and s.doc.strip() and s.group in S.GROUP_TITLES, name
        assert all(not a.startswith("OSCAR_") for a in s.aliases), name  # aliases are the fork's names
        if s.default is not None:  # the default is a valid value of the setting
            raw = ("1" if s.default else "0") if isinstance(s.default, bool) else str(s.default)
            want = os.path.expanduser(s.default) if s.kind == "path" else s.default
            assert s.get({name: raw}) == want, name


def test_env_help_lists_the_server_settings_and_their_aliases():
    text = S.env_help()
    for s in S.group(S.SERVER):
        assert s.name in text and all(a in text for a in s.aliases)
    assert "OSCAR_DEBUG_TAP_DIR" not in text  # debugging and tools settings: docs/settings.md
    from oscar_sglang.runtime.config import env_help

    assert env_help() == text


def test_the_registry_imports_nothing_heavy():
    tree = ast.parse((SOURCE / "common" / "settings.py").read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert mods <= {"__future__", "argparse", "dataclasses", "logging", "os", "typing"}, mods


def test_string_scan_sees_fstrings_and_skips_comments(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('# OSCAR_IN_A_COMMENT\nx = f"set OSCAR_IN_FSTRING={1}"\ny = "SGLANG_OSCAR_K_CLIP_RATIO"\n')
    names = {n for lit in _string_literals(p) for n in NAME.findall(lit)}
    assert names == {"OSCAR_IN_FSTRING"}


def test_a_path_default_is_home_expanded(monkeypatch, tmp_path):
    """The cache default "~/.cache/oscar-sglang" names the home folder, never a folder "~" in the
    working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    got = S.CACHE_DIR.get({})
    assert got == str(tmp_path / ".cache" / "oscar-sglang") and "~" not in got
    assert S.CACHE_DIR.get({"OSCAR_SGLANG_CACHE": "~/x"}) == str(tmp_path / "x")
