"""Every OSCAR_* environment variable, declared once: name, type, default, meaning, allowed values
and the OSCAR research fork's names for it (deprecated aliases). Modelled on SGLang's
``sglang/srt/environ.py``: one typed object per variable, read through it and nowhere else.

Why the environment: SGLang's scheduler processes are spawned fresh and get only the pickled
ServerArgs, so plugin settings must travel in a way every process sees. Environment variables are
inherited by every child, and they are also what the fork used, so its launch scripts keep
working (its names are accepted, with a warning, and mapped to ours).

    from oscar_sglang.common import settings
    settings.KV_FORMAT.get()             # the value (typed), or the default when unset / empty
    settings.KV_FORMAT.lookup(env)       # (value or None, the variable it came from or None)
    settings.validate(env)               # every setting at once; SettingError lists every problem

``docs/settings.md`` is generated from this module (``python -m oscar_sglang.common.settings
--markdown > docs/settings.md``; tests/common/test_settings.py checks it is current).

Plain Python, no torch / sglang import: the CLI's --help and the launching process read it.
Checks that need the KV format grammar or the model (OSCAR_KV_FORMAT's name, the head dims) are
the runtime's (runtime/config.py, runtime/kv_format.py).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

logger = logging.getLogger("oscar_sglang")

SERVER, DEBUG, TOOLS = "server", "debug", "tools"
GROUP_TITLES = {
    SERVER: "Server (read by the plugin in every SGLang process)",
    DEBUG: "Debugging (read by the plugin)",
    TOOLS: "Offline tools (the `oscar-sglang` CLI)",
}
BUILTIN_ROTATIONS = ("hadamard", "identity")


class SettingError(ValueError):
    """A bad setting; the message names the variable and what it accepts."""


@dataclass(frozen=True, eq=False)
class Setting:
    """One environment variable. Subclasses parse a type; `parser` (value, variable) -> typed
    value replaces the subclass's parse where a setting needs its own rule."""

    name: str
    default: Any
    doc: str
    group: str = SERVER
    aliases: tuple[str, ...] = ()
    # what the docs show as the default where `default` is None or depends on another setting
    default_doc: str | None = None
    # what the docs show as the allowed values where the type alone says too little
    values: str | None = None
    parser: Callable[[str, str], Any] | None = field(default=None, repr=False)

    kind = "str"

    # --------------------------------------------------------------- reading
    def raw(self, env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
        """(value, variable it came from) of our name or an alias; (None, None) when unset or
        empty. Our name and an alias both set to different values: SettingError."""
        env = os.environ if env is None else env
        found = [(n, env.get(n)) for n in (self.name, *self.aliases)]
        found = [(n, v) for n, v in found if v not in (None, "")]
        if not found:
            return None, None
        name, value = found[0]
        for other, val in found[1:]:
            if val != value:
                raise SettingError(f"{name}={value!r} and {other}={val!r} disagree; set only "
                                   f"{self.name}")
        if name != self.name:
            _warn_alias(name, self.name)
        return value, name

    def lookup(self, env: Mapping[str, str] | None = None) -> tuple[Any, str | None]:
        """(typed value, variable it came from), or (None, None) when unset."""
        value, var = self.raw(env)
        if value is None:
            return None, None
        return (self.parser or self.parse)(value, var), var

    def get(self, env: Mapping[str, str] | None = None) -> Any:
        """The typed value, or the default when unset or empty."""
        value, var = self.lookup(env)
        return self.default if var is None else value

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        return self.raw(env)[1] is not None

    def parse(self, value: str, var: str) -> Any:
        return value.strip()

    # --------------------------------------------------------------- docs
    def values_text(self) -> str:
        return self.values if self.values is not None else self.values_doc()

    def values_doc(self) -> str:
        return "text"

    def default_text(self) -> str:
        if self.default_doc is not None:
            return self.default_doc
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return str(self.default)


@dataclass(frozen=True, eq=False)
class Choice(Setting):
    choices: tuple[str, ...] = ()

    kind = "choice"

    def parse(self, value: str, var: str) -> str:
        v = value.strip().lower()
        if v not in self.choices:
            raise SettingError(f"{var} must be {' or '.join(repr(c) for c in self.choices)}, got {value!r}")
        return v

    def values_doc(self) -> str:
        return " / ".join(f"`{c}`" for c in self.choices)


@dataclass(frozen=True, eq=False)
class Int(Setting):
    lo: int | None = None
    hi: int | None = None
    choices: tuple[int, ...] = ()

    kind = "int"

    def parse(self, value: str, var: str) -> int:
        try:
            x = int(value)
        except ValueError:
            raise SettingError(f"{var}={value!r} is not an integer") from None
        if self.choices and x not in self.choices:
            raise SettingError(f"{var}={x} must be one of {self.choices}")
        if (self.lo is not None and x < self.lo) or (self.hi is not None and x > self.hi):
            rng = f">= {self.lo}" if self.hi is None else f"in [{self.lo}, {self.hi}]"
            raise SettingError(f"{var}={x} must be {rng}")
        return x

    def values_doc(self) -> str:
        if self.choices:
            return " / ".join(f"`{c}`" for c in self.choices)
        if self.hi is None:
            return f"integer >= {self.lo}" if self.lo is not None else "integer"
        return f"integer in [{self.lo}, {self.hi}]"


@dataclass(frozen=True, eq=False)
class Float(Setting):
    lo: float = float("-inf")
    hi: float = float("inf")
    lo_open: bool = True
    hi_open: bool = True
    hint: str = ""

    kind = "float"

    def interval(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def parse(self, value: str, var: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise SettingError(f"{var}={value!r} is not a number") from None
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        if not (above and below):
            raise SettingError(f"{var}={x} must be in {self.interval()}{self.hint}")
        return x

    def values_doc(self) -> str:
        return f"number in {self.interval()}"


@dataclass(frozen=True, eq=False)
class Bool(Setting):
    kind = "bool"

    TRUE = ("1", "true", "yes")
    FALSE = ("0", "false", "no")

    def parse(self, value: str, var: str) -> bool:
        v = value.strip().lower()
        if v not in self.TRUE + self.FALSE:
            raise SettingError(f"{var}={value!r} must be 0 or 1")
        return v in self.TRUE

    def values_doc(self) -> str:
        return "`0` / `1`"


@dataclass(frozen=True, eq=False)
class PathSetting(Setting):
    kind = "path"

    def parse(self, value: str, var: str) -> str:
        return os.path.expanduser(value.strip())

    def get(self, env: Mapping[str, str] | None = None) -> Any:
        """The path, `~` expanded in the default as in a set value (a default of "~/.cache/..."
        used as is made a folder named "~" in the working directory)."""
        value = super().get(env)
        return os.path.expanduser(value) if isinstance(value, str) else value

    def values_doc(self) -> str:
        return "path"


# ------------------------------------------------------------------------------------ parsers


def _rotation(value: str, var: str) -> str:
    low = value.strip().lower()
    if low in BUILTIN_ROTATIONS:
        return low
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise SettingError(
            f"{var}={value!r}: no such file. Give a rotation file (.safetensors from "
            f"`oscar-sglang calibrate`/`zoo pull`, or an OSCAR fork .pt), or "
            f"{'/'.join(BUILTIN_ROTATIONS)}")
    return path


def _existing_file(value: str, var: str) -> str:
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise SettingError(f"{var}={value!r}: no such file")
    return path


def _clip(value: str, var: str) -> float:
    """A clip ratio in (0, 1]; the fork's names take 0 for "no clipping" (1 here)."""
    try:
        x = float(value)
    except ValueError:
        raise SettingError(f"{var}={value!r} is not a number") from None
    if var.startswith("SGLANG_") and x == 0.0:
        return 1.0
    if not (0.0 < x <= 1.0):
        raise SettingError(f"{var}={x} must be in (0, 1] (1 disables clipping; e.g. 0.96 for K, "
                           f"0.92 for V)")
    return x


def _kv_format(value: str, var: str) -> str:
    # the grammar (docs/format.md) is checked by runtime/kv_format.check_syntax, which needs the
    # kernels' format module; here only what any name must be
    name = value.strip()
    if any(c.isspace() for c in name):
        raise SettingError(f"{var}={value!r}: a KV format name has no spaces (e.g. k4c64-v2h-s4-w128 "
                           f"or token; docs/format.md)")
    return name


# ------------------------------------------------------------------------------------ registry

REGISTRY: dict[str, Setting] = {}


def _declare(s: Setting) -> Setting:
    for n in (s.name, *s.aliases):
        if n in REGISTRY or any(n in x.aliases for x in REGISTRY.values()):
            raise AssertionError(f"{n} declared twice")
    REGISTRY[s.name] = s
    return s


# what the default format stores beside the quantised body (its s<N> / w<N>; the runtime derives
# OscarConfig's defaults from the name, runtime/kv_format.side_sizes)
_DEFAULT_KV_FORMAT = "k4c64-v2h-s4-w128"

KV_FORMAT = _declare(Setting(
    "OSCAR_KV_FORMAT", _DEFAULT_KV_FORMAT, parser=_kv_format,
    values="a served format name (docs/format.md) or `token`",
    doc="What the cache stores (docs/format.md). The default: 4-bit keys per channel over blocks "
        "of 64 tokens (the page size, set for you) + 2-bit values in one group per token and head "
        "(v2h), 4 sink + 128 recent tokens in BF16. Other served names: k3c64-v2t64-s4-w128, "
        "k2c64-v2t64, k4c32-v2t128, ...-s<sink>-w<recent>, ...@0,-1=k4 (more key bits on some "
        "layers); `token` = the OSCAR per-token recipe (2-bit groups along head_dim, clip ratios "
        "of the rotation file)."))
ROTATION = _declare(Setting(
    "OSCAR_ROTATION", "hadamard", aliases=("SGLANG_OSCAR_K_ROTATION_PATH",), parser=_rotation,
    values="`hadamard` / `identity` / a rotation file",
    doc="Rotation: a rotation file (our .safetensors with K and V, or the fork's K .pt), "
        "`hadamard` (data-free) or `identity` (no rotation, for debugging)."))
V_ROTATION = _declare(PathSetting(
    "OSCAR_V_ROTATION", None, aliases=("SGLANG_OSCAR_V_ROTATION_PATH",), parser=_existing_file,
    values="a .pt file",
    doc="The fork's V rotation .pt (only with the fork's K .pt in OSCAR_ROTATION)."))
K_CLIP = _declare(Float(
    "OSCAR_K_CLIP", None, aliases=("SGLANG_OSCAR_K_CLIP_RATIO",), parser=_clip, lo=0.0, hi=1.0,
    hi_open=False, default_doc="the rotation file's per-layer values, else 1",
    doc="K clip ratio; 1 = no clipping (the fork's name takes 0 for no clipping). Applies where the "
        "format clips keys (the `token` recipe)."))
V_CLIP = _declare(Float(
    "OSCAR_V_CLIP", None, aliases=("SGLANG_OSCAR_V_CLIP_RATIO",), parser=_clip, lo=0.0, hi=1.0,
    hi_open=False, default_doc="the rotation file's per-layer values, else 1",
    doc="V clip ratio, as OSCAR_K_CLIP."))
SINK_TOKENS = _declare(Int(
    "OSCAR_SINK_TOKENS", None, aliases=("SGLANG_MIXED_KV_PREFIX_TOKENS",), lo=0, hi=1 << 16,
    default_doc="the format's s<N>: 4 for the default format; 64 for `token` and names without s<N>",
    doc="First tokens of each request also kept in BF16 (attention sinks). Set in the format name "
        "or here, not both with different values."))
RECENT_TOKENS = _declare(Int(
    "OSCAR_RECENT_TOKENS", None, aliases=("SGLANG_MIXED_KV_RECENT_TOKENS",), lo=1, hi=1 << 16,
    default_doc="the format's w<N>: 128 for the default format; 256 for `token` and names without w<N>",
    doc="Most recent tokens of each request also kept in BF16. Set in the format name or here, not "
        "both with different values."))
GROUP_SIZE = _declare(Int(
    "OSCAR_GROUP_SIZE", 128, choices=(32, 64, 128),  # oscar_kernels.format.SUPPORTED_GROUP_SIZES
    default_doc="the group the rotation file was calibrated with, else 128",
    doc="OSCAR_KV_FORMAT=token only: the 2-bit group along head_dim (capped at head_dim)."))
MAX_RUNNING_REQUESTS = _declare(Int(
    "OSCAR_MAX_RUNNING_REQUESTS", 1024, lo=1,
    doc="--max-running-requests for int2 when none is given (it sizes the BF16 side buffers); "
        "lowered so that the side buffers stay within OSCAR_SIDE_BUFFER_FRACTION."))
SIDE_BUFFER_FRACTION = _declare(Float(
    "OSCAR_SIDE_BUFFER_FRACTION", 0.2, lo=0.0, hi=1.0,
    doc="Largest share of the KV memory budget the BF16 sink / recent buffers may take when the "
        "running-request count is the default."))
ALLOW_MODEL_MISMATCH = _declare(Bool(
    "OSCAR_ALLOW_MODEL_MISMATCH", False,
    doc="1 = accept a rotation file calibrated for a differently named model (same shapes)."))
V_ABSORB = _declare(Bool(
    "OSCAR_V_ABSORB", True,
    doc="1 = fold each layer's V rotation into the model's V and output projections at load, so no "
        "V rotation runs per step (unquantised weights only; otherwise the backend rotates at run "
        "time and the start-up log says why; weight updates are then refused). 0 = always rotate "
        "at run time."))
NEW_TOKEN_ATTENTION = _declare(Choice(
    "OSCAR_NEW_TOKEN_ATTENTION", "flashinfer", choices=("flashinfer", "triton"),
    doc="Attention among the new tokens of a prefill chunk (plain BF16): `flashinfer` (FlashInfer's "
        "ragged prefill, as SGLang's flashinfer backend; compiled by FlashInfer's JIT at start "
        "where no prebuilt kernel exists) or `triton` (SGLang's Triton extend kernel, no JIT)."))
PREFIX_ATTENTION = _declare(Choice(
    "OSCAR_PREFIX_ATTENTION", None, choices=("int2", "flashinfer"),
    default_doc="`flashinfer` for per-channel key formats with OSCAR_NEW_TOKEN_ATTENTION=flashinfer, "
                "else `int2`",
    doc="How a prefill chunk reads its cached prefix: `flashinfer` (the prefix dequantised to BF16 "
        "a bounded piece at a time and read by FlashInfer's prefill in forwards where >= 64 query "
        "rows share each cached key, the INT2 kernel in the others; per-channel key formats only) "
        "or `int2` (always the INT2-aware prefix kernel)."))
DECODE_STORE = _declare(Choice(
    "OSCAR_DECODE_STORE", "split", choices=("split", "fused"),
    doc="How a decode step stores its tokens with per-channel key formats: `split` (q and k rotated "
        "by GEMMs in the model's dtype, then the store's two launches) or `fused` (one launch "
        "rotates q and k, writes the side copies and values and quantises the blocks the step "
        "completes; faster per step, but opt-in: its first long request on a fresh machine was "
        "measured up to 2x slower to first token while kernels compiled)."))
PREFILL_READS = _declare(Choice(
    "OSCAR_PREFILL_READS", "exact", choices=("exact", "cache"),
    doc="What a prompt's tokens read of the prompt's own earlier positions during prefill "
        "(per-channel key formats): `exact` (the BF16 values just computed, the best answers; a "
        "request whose prefix comes from a cache (radix, host tier) reads that prefix as stored, "
        "so its greedy answer can differ from the same prompt's cold one) or `cache` (every "
        "complete page read as the cache stores it, the sink in BF16, BF16 only for the last "
        "incomplete page: a cold prompt and a cache hit read the same values, at lower retrieval "
        "accuracy; a cold prompt's tail after its complete pages is prefilled in a forward of its "
        "own, the one a hit of the prompt repeats, so cold prompts enter prefill one per batch). "
        "docs/design.md (\"What a prefill reads\") has the measured trade-off."))

DEBUG_TAP_DIR = _declare(PathSetting(
    "OSCAR_DEBUG_TAP_DIR", None, group=DEBUG,
    doc="Record one layer's attention inputs and outputs in eager prefill forwards under "
        "<dir>/rank<r> (runtime/debug_tap.py, used by bench/server_e2e.py). Needs "
        "OSCAR_DEBUG_TAP_LAYER."))
DEBUG_TAP_LAYER = _declare(Int(
    "OSCAR_DEBUG_TAP_LAYER", None, group=DEBUG, lo=0,
    doc="The global layer id OSCAR_DEBUG_TAP_DIR records."))

CACHE_DIR = _declare(PathSetting(
    "OSCAR_SGLANG_CACHE", os.path.join("~", ".cache", "oscar-sglang"), group=TOOLS,
    doc="Cache of the tools: the embedded model's Hugging Face copy, downloaded zoo files."))
ZOO_DIR = _declare(PathSetting(
    "OSCAR_SGLANG_ZOO_DIR", None, group=TOOLS,
    default_doc="the source tree's rotation_zoo/, else <OSCAR_SGLANG_CACHE>/zoo",
    doc="The rotation zoo directory `oscar-sglang zoo` and `serve` read (index.json + files)."))
ZOO_REPO = _declare(Setting(
    "OSCAR_SGLANG_ZOO_REPO", "oscar-sglang/rotation-zoo", group=TOOLS, values="a Hugging Face repo id",
    doc="Hugging Face repo `oscar-sglang zoo pull` downloads from (--repo overrides)."))


# Settings that are gone: set to anything, the start fails with the reason (never ignored).
REMOVED: dict[str, str] = {
    "OSCAR_CHANNEL_DECODE_3BIT": "the per-channel decode has one way to read 3-bit keys now (what "
                                 "was its default, 'planes')",
    "OSCAR_CHANNEL_EXTEND": "the per-channel prefill over the cached prefix has one kernel body now "
                            "(what was its default, 'dequant')",
    "OSCAR_CHANNEL_DECODE_READS": "the per-channel decode has one way to read codes now (what was its "
                                  "default, 'words')",
    "OSCAR_CHANNEL_DECODE_KEYS": "the per-channel decode has one kind of key operands now (what was "
                                 "its default, 'fp16-subnormal')",
    "OSCAR_INT2_DECODE_KERNEL": "the kernels read no environment; the per-token decode runs its fast "
                                "kernel where it applies (what was the default)",
    "OSCAR_INT2_EXTEND_KERNEL": "the kernels read no environment; the per-token prefix kernel runs "
                                "its fast form where it applies (what was the default)",
    "OSCAR_INT2_NO_ASM": "the kernels read no environment; the code unpacking follows the device "
                         "(inline PTX on CUDA, plain Triton under the interpreter)",
}


def removed_message(name: str) -> str:
    return f"{name} was removed: {REMOVED[name]}; unset it"


def removed_set(env: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if env is None else env
    return [n for n in REMOVED if env.get(n) not in (None, "")]


def _cross_checks(values: dict[str, Any], sources: dict[str, str]) -> list[str]:
    """Rules between settings (sources: every setting given, values: those that parsed)."""
    p = []
    k_builtin = values.get("OSCAR_ROTATION", ROTATION.default) in BUILTIN_ROTATIONS
    if "OSCAR_V_ROTATION" in sources and k_builtin and ("OSCAR_ROTATION" in values or "OSCAR_ROTATION" not in sources):
        p.append(f"{sources['OSCAR_V_ROTATION']} is set but OSCAR_ROTATION (or "
                 f"SGLANG_OSCAR_K_ROTATION_PATH) is not a K rotation file; a separate V file only "
                 f"makes sense with the fork's K .pt")
    if ("OSCAR_DEBUG_TAP_DIR" in sources) != ("OSCAR_DEBUG_TAP_LAYER" in sources):
        p.append("OSCAR_DEBUG_TAP_DIR and OSCAR_DEBUG_TAP_LAYER go together: set both (a directory "
                 "and a layer id) or neither")
    return p


def validate(env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse every setting in env (default os.environ) -> ({name: value} of those set, {name:
    variable it came from}). Raises one SettingError listing every problem: removed settings,
    bad values (with what is allowed), our name and an alias disagreeing, settings that need
    each other."""
    env = os.environ if env is None else env
    problems = [removed_message(n) for n in removed_set(env)]
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, s in REGISTRY.items():
        try:
            raw, var = s.raw(env)
            if var is None:
                continue
            sources[name] = var
            values[name] = (s.parser or s.parse)(raw, var)
        except SettingError as e:
            problems.append(str(e))
    problems += _cross_checks(values, sources)
    if len(problems) == 1:
        raise SettingError(problems[0])
    if problems:
        raise SettingError("bad OSCAR settings:\n" + "\n".join(f"  - {p}" for p in problems))
    return values, sources


_WARNED: set[str] = set()


def _warn_alias(alias: str, name: str) -> None:
    if alias not in _WARNED:
        _WARNED.add(alias)
        logger.warning("oscar-sglang: %s is the OSCAR fork's name for %s; read as %s (set %s "
                       "instead)", alias, name, name, name)


def group(name: str) -> list[Setting]:
    return [s for s in REGISTRY.values() if s.group == name]


# ------------------------------------------------------------------------------------ docs


def env_help(groups: tuple[str, ...] = (SERVER,)) -> str:
    """The settings as text, for `oscar-sglang serve --help`."""
    lines = []
    for g in groups:
        for s in group(g):
            a = f" (alias: {', '.join(s.aliases)})" if s.aliases else ""
            lines.append(f"  {s.name}{a}\n      {s.values_text().replace('`', '')}; default "
                         f"{s.default_text().replace('`', '')}. {s.doc.replace('`', '')}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table() -> str:
    """docs/settings.md: every setting by group, then the removed ones."""
    out = [
        "# Settings",
        "",
        "<!-- Generated from oscar_sglang/common/settings.py by",
        "     `python -m oscar_sglang.common.settings --markdown > docs/settings.md`; do not edit by",
        "     hand (tests/common/test_settings.py checks that it is current). -->",
        "",
        "The plugin and the tools are configured by environment variables: SGLang's scheduler "
        "processes are spawned fresh and see only the environment and SGLang's own arguments. "
        "An empty value is the same as unset. A bad value stops the server at start with the "
        "variable's name and what it accepts. Names of the OSCAR research fork are accepted as "
        "aliases (with a warning); our name and an alias set to different values is an error.",
        "",
    ]
    for g, title in GROUP_TITLES.items():
        out += [f"## {title}", "", "| Variable | Default | Values | Meaning |", "| --- | --- | --- | --- |"]
        for s in group(g):
            alias = f"<br>alias: {', '.join(f'`{a}`' for a in s.aliases)}" if s.aliases else ""
            default = s.default_text()
            default = default if "`" in default or " " in default or s.default is None else f"`{default}`"
            out.append(f"| `{s.name}`{alias} | {_cell(default)} | {_cell(s.values_text())} | {_cell(s.doc)} |")
        out.append("")
    out += ["## Removed", "", "Set to anything, these stop the start with the reason.", "",
            "| Variable | Why |", "| --- | --- |"]
    out += [f"| `{n}` | {_cell(why)}; unset it |" for n, why in REMOVED.items()]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m oscar_sglang.common.settings",
                                description="Print the OSCAR settings, or check the environment.")
    p.add_argument("--markdown", action="store_true", help="print docs/settings.md")
    p.add_argument("--check", action="store_true", help="validate the current environment")
    a = p.parse_args(argv)
    if a.check:
        try:
            _, sources = validate()
        except SettingError as e:
            print(e)
            return 1
        print("OSCAR settings OK" + (": " + ", ".join(f"{n} (from {v})" for n, v in sources.items())
                                     if sources else " (none set)"))
        return 0
    print(markdown_table() if a.markdown else env_help(tuple(GROUP_TITLES)), end="\n" if not a.markdown else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
