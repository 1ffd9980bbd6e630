"""Serving configuration of the INT2 KV cache, read from the environment.

Why the environment: SGLang's scheduler processes are spawned fresh and get only the pickled
ServerArgs, so plugin settings must travel in a way every process sees. Environment variables are
inherited by every child, and they are also what the OSCAR research fork used, so its launch
scripts keep working (its names are accepted as aliases, see ENV_VARS).

Everything here is plain Python (no torch / sglang import) so it is cheap and testable.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Mapping

from .kv_format import DEFAULT_KV_FORMAT, KVFormatError, check_syntax

INT2 = "int2"  # the --kv-cache-dtype value this plugin adds
BACKEND = "oscar_triton"  # the only attention backend that reads the INT2 pool

# name -> (fork alias or None, meaning).  The single source for docs/serving.md and --help.
ENV_VARS: dict[str, tuple[str | None, str]] = {
    "OSCAR_KV_FORMAT": (
        None,
        "what the cache stores (docs/format.md): default k4c64-v2h-s4-w128 = 4-bit keys per "
        "channel over blocks of 64 tokens (the page size, set for you) + 2-bit values in one group "
        "per token and head (v2h), 4 sink + 128 recent tokens in BF16; "
        "other served names: k3c64-v2t64-s4-w128 (the default until 2026-11-29: 12% more tokens), "
        "k2c64-v2t64, k4c32-v2t128, ...-s<sink>-w<recent>, "
        "...@0,-1=k4 (more key bits on some layers); 'token' = the OSCAR per-token recipe "
        "(2-bit groups along head_dim, clip ratios of the rotation file)",
    ),
    "OSCAR_ROTATION": (
        "SGLANG_OSCAR_K_ROTATION_PATH",
        "rotation file: our .safetensors (K and V) or the fork's K .pt; 'hadamard' (default, "
        "data-free) or 'identity' (no rotation, debugging)",
    ),
    "OSCAR_V_ROTATION": (
        "SGLANG_OSCAR_V_ROTATION_PATH",
        "the fork's V rotation .pt (only with a K .pt in OSCAR_ROTATION)",
    ),
    "OSCAR_K_CLIP": (
        "SGLANG_OSCAR_K_CLIP_RATIO",
        "K clip ratio in (0, 1]; 1 = no clipping (fork: 0 = no clipping). Default: the rotation "
        "file's per-layer values, else 1",
    ),
    "OSCAR_V_CLIP": ("SGLANG_OSCAR_V_CLIP_RATIO", "V clip ratio, as OSCAR_K_CLIP"),
    "OSCAR_SINK_TOKENS": (
        "SGLANG_MIXED_KV_PREFIX_TOKENS",
        "first tokens of each request also kept in BF16 (attention sinks); default: the "
        "format's (4 for the default format, 64 for 'token' and names without s<N>)",
    ),
    "OSCAR_RECENT_TOKENS": (
        "SGLANG_MIXED_KV_RECENT_TOKENS",
        "most recent tokens of each request also kept in BF16; default: the format's (128 for "
        "the default format, 256 for 'token' and names without w<N>)",
    ),
    "OSCAR_GROUP_SIZE": (
        None,
        "OSCAR_KV_FORMAT=token only: INT2 group along head_dim (32, 64 or 128, capped at "
        "head_dim); default: the group the rotation file was calibrated with, else 128",
    ),
    "OSCAR_MAX_RUNNING_REQUESTS": (
        None,
        "default --max-running-requests for int2 when none is given (it sizes the BF16 side "
        "buffers); default 1024, lowered so side buffers stay within OSCAR_SIDE_BUFFER_FRACTION",
    ),
    "OSCAR_ALLOW_MODEL_MISMATCH": (
        None,
        "1 = accept a rotation file calibrated for a differently named model (same shapes)",
    ),
    "OSCAR_V_ABSORB": (
        None,
        "1 (default) = fold each layer's V rotation into the model's V and output projections "
        "at load, so no V rotation runs per step (unquantised weights only; otherwise the "
        "backend rotates at run time and the startup log says why); 0 = always rotate at run time",
    ),
    "OSCAR_SIDE_BUFFER_FRACTION": (
        None,
        "largest share of the KV memory budget the BF16 sink/recent buffers may take when the "
        "running-request count is the default; default 0.2",
    ),
    "OSCAR_CHANNEL_DECODE_3BIT": (
        None,
        "decode of 3-bit per-channel keys: 'planes' (default: a 2-bit and a 1-bit plane, one "
        "warp; head_dim 128, else packed; 2x faster on the H100) or 'packed' (each code "
        "assembled in a 32-bit register, two warps). Read by the kernels "
        "(oscar_kernels/triton/attend_channel.py)",
    ),
    "OSCAR_CHANNEL_EXTEND": (
        None,
        "prefill over the per-channel INT2 prefix: 'dequant' (default: each page's keys and "
        "values dequantised once per tile, 128 query rows a program; 2.5x 'codes' at 32K + 4096 "
        "on the H100) or 'codes' (MMAs on the codes, key scales folded into the queries). Read "
        "by the kernels (oscar_kernels/triton/attend_channel.py)",
    ),
    "OSCAR_CHANNEL_DECODE_READS": (
        None,
        "how the per-channel decode reads codes: 'words' (default: value codes and 2-bit key "
        "codes as 16-bit words, as the per-token fast kernel; head_dim 128, bytes below) or 'bytes' "
        "(byte reads, 6-10% slower on the H100 and bf16 value operands). Read by the kernels "
        "(oscar_kernels/triton/attend_channel.py)",
    ),
    "OSCAR_CHANNEL_DECODE_KEYS": (
        None,
        "the per-channel decode's key-side MMA operands: 'fp16-subnormal' (default since "
        "2026-11-29: exact fp16 subnormal code operands for 3- and 4-bit keys, no offsets; 3-bit "
        "keys 3-7% faster decode than 'fp16-paired' on an H200), 'fp16-paired' (the default from "
        "2026-11-28: 'fp16' whose two 3-bit key planes cancel each other's offsets), 'fp16' (each key block's "
        "q * scale rounded to fp16; the codes under fp16 exponents, offset 1024), 'bf16' (the "
        "default until 2026-11-27: q * scale rounded to bf16, 3 bits fewer; 2.4-3.5x fp16's error "
        "on outlier keys, docs/benchmarks.md; set it if |q| * |k| reaches ~1e5, past fp16's range) "
        "'fp16-shifted' (fp16 with the codes' offset 128, as bf16's) or 'int8' (opt-in, 3-bit "
        "keys only: q * scale rounded to int8 per query row and block; 6-9% faster decode on an "
        "H200, 0.22 max error on outlier inputs: not for serving). Read by "
        "the kernels (oscar_kernels/triton/attend_channel.py)",
    ),
    "OSCAR_NEW_TOKEN_ATTENTION": (
        None,
        "attention among the new tokens of a prefill chunk (plain BF16): 'flashinfer' (default: "
        "FlashInfer's ragged prefill, as SGLang's flashinfer backend; compiled by FlashInfer's "
        "JIT at start where no prebuilt kernel exists) or 'triton' (SGLang's Triton extend "
        "kernel)",
    ),
    "OSCAR_PREFIX_ATTENTION": (
        None,
        "how a prefill chunk reads its cached prefix: 'flashinfer' (the default for per-channel "
        "key formats with OSCAR_NEW_TOKEN_ATTENTION=flashinfer: the prefix dequantised to BF16 a "
        "bounded piece at a time and read by FlashInfer's prefill, in forwards where >= 64 query "
        "rows share each cached key, the INT2 kernel in the others; 3.9-4.3x the INT2 kernel "
        "on that part on the H100) or 'int2' (always the INT2-aware prefix kernel; the default for the per-token "
        "recipe and with OSCAR_NEW_TOKEN_ATTENTION=triton)",
    ),
    "OSCAR_DECODE_STORE": (
        None,
        "how a decode step stores its tokens with per-channel key formats: 'split' (default: q and "
        "k rotated by two GEMMs in the model's dtype, one for both at batch 1 where k follows q in "
        "the qkv buffer, then the store's two launches) or 'fused' "
        "(one launch rotates k and q with the same arithmetic, writes the side copies and values, "
        "and quantises the blocks the step completes: 6.1 us a layer against 7.9 us for the split "
        "path's four kernels in a served batch-1 step on H200; opt-in because on two bare machines "
        "the first 32K request's TTFT was 1.8-2.0x a warm one's with it, 2026-11-27)",
    ),
}
NEW_TOKEN_ATTENTION = ("flashinfer", "triton")
DECODE_STORE = ("split", "fused")
PREFIX_ATTENTION = ("int2", "flashinfer")
# values of OSCAR_CHANNEL_DECODE_3BIT / OSCAR_CHANNEL_EXTEND / OSCAR_CHANNEL_DECODE_READS /
# OSCAR_CHANNEL_DECODE_KEYS (attend_channel.CHANNEL_3BIT_VARIANTS / CHANNEL_EXTEND_VARIANTS /
# CHANNEL_CODE_READS / CHANNEL_KEY_OPERANDS; checked here at start without importing the kernels)
CHANNEL_3BIT_VARIANTS = ("packed", "planes")
CHANNEL_EXTEND_VARIANTS = ("codes", "dequant")
CHANNEL_CODE_READS = ("bytes", "words")
CHANNEL_KEY_OPERANDS = ("bf16", "fp16", "fp16-shifted", "fp16-paired", "int8", "fp16-subnormal")
# (variable, its values, the kernels' default)
KERNEL_SWITCHES = (("OSCAR_CHANNEL_DECODE_3BIT", CHANNEL_3BIT_VARIANTS, "planes"),
                   ("OSCAR_CHANNEL_EXTEND", CHANNEL_EXTEND_VARIANTS, "dequant"),
                   ("OSCAR_CHANNEL_DECODE_READS", CHANNEL_CODE_READS, "words"),
                   ("OSCAR_CHANNEL_DECODE_KEYS", CHANNEL_KEY_OPERANDS, "fp16-subnormal"))

DEFAULT_SINK = 64
DEFAULT_RECENT = 256
DEFAULT_GROUP = 128
# concurrency is what int2's memory is for: up to 1024 rows, their BF16 side buffers at most a
# fifth of the KV budget (Llama-3.1-8B, H100, mem 0.85: ~640 rows with the default format)
DEFAULT_MAX_RUNNING_REQUESTS = 1024
DEFAULT_SIDE_BUFFER_FRACTION = 0.2
BUILTIN_RECIPES = ("hadamard", "identity")


class OscarConfigError(ValueError):
    """A bad INT2 setting; the message says which variable and what to do."""


@dataclass(frozen=True)
class OscarConfig:
    kv_format: str = DEFAULT_KV_FORMAT   # a KVFormat name or "token" (runtime/kv_format.py)
    rotation: str = "hadamard"           # "hadamard", "identity" or a file path
    v_rotation: str | None = None        # fork V .pt (with a fork K .pt)
    k_clip: float | None = None          # None: from the rotation file (or 1.0)
    v_clip: float | None = None
    sink_tokens: int = DEFAULT_SINK
    recent_tokens: int = DEFAULT_RECENT
    group_size: int = DEFAULT_GROUP
    default_max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    side_buffer_fraction: float = DEFAULT_SIDE_BUFFER_FRACTION
    allow_model_mismatch: bool = False
    v_absorb: bool = True
    new_token_attention: str = NEW_TOKEN_ATTENTION[0]
    prefix_attention: str | None = None  # None: resolved by resolved_prefix_attention()
    decode_store: str = DECODE_STORE[0]
    sources: dict = field(default_factory=dict, compare=False)  # setting -> env var it came from

    @property
    def recipe(self) -> str:
        """'hadamard', 'identity' or 'file'."""
        return self.rotation if self.rotation in BUILTIN_RECIPES else "file"

    def resolved_prefix_attention(self, channel: bool) -> str:
        """OSCAR_PREFIX_ATTENTION, or its default: FlashInfer for per-channel key formats (3-4x
        the INT2 prefix kernel) unless the new tokens avoid FlashInfer too; the per-token recipe
        has only the INT2 kernel."""
        if self.prefix_attention is not None:
            return self.prefix_attention
        return "flashinfer" if channel and self.new_token_attention == "flashinfer" else "int2"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["recipe"] = self.recipe
        return d


def _get(env: Mapping[str, str], name: str) -> tuple[str | None, str | None]:
    """Value of our variable or its fork alias -> (value, variable used). Both set: must agree."""
    alias = ENV_VARS[name][0]
    ours = env.get(name)
    ours = ours if ours not in (None, "") else None
    theirs = env.get(alias) if alias else None
    theirs = theirs if theirs not in (None, "") else None
    if ours is not None and theirs is not None and ours != theirs:
        raise OscarConfigError(
            f"{name}={ours!r} and {alias}={theirs!r} disagree; set only one of them"
        )
    if ours is not None:
        return ours, name
    if theirs is not None:
        return theirs, alias
    return None, None


def _int(value: str, var: str, lo: int, hi: int | None = None) -> int:
    try:
        x = int(value)
    except ValueError:
        raise OscarConfigError(f"{var}={value!r} is not an integer") from None
    if x < lo or (hi is not None and x > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise OscarConfigError(f"{var}={x} must be {rng}")
    return x


def _clip(value: str, var: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise OscarConfigError(f"{var}={value!r} is not a number") from None
    if var.startswith("SGLANG_") and x == 0.0:
        return 1.0  # the fork's "0 disables clipping"
    if not (0.0 < x <= 1.0):
        raise OscarConfigError(
            f"{var}={x} must be in (0, 1] (1 disables clipping; e.g. 0.96 for K, 0.92 for V)"
        )
    return x


def load_config(env: Mapping[str, str] | None = None) -> OscarConfig:
    """Parse and validate every OSCAR_* (and fork alias) variable. Raises OscarConfigError."""
    env = os.environ if env is None else env
    kw: dict = {}
    sources: dict = {}

    fmt, var = _get(env, "OSCAR_KV_FORMAT")
    if fmt is not None:
        try:
            check_syntax(fmt)
        except KVFormatError as e:
            raise OscarConfigError(str(e)) from None
        kw["kv_format"] = fmt.strip()
        sources["kv_format"] = var

    rot, var = _get(env, "OSCAR_ROTATION")
    if rot is not None:
        low = rot.strip().lower()
        if low in BUILTIN_RECIPES:
            kw["rotation"] = low
        else:
            path = os.path.expanduser(rot)
            if not os.path.isfile(path):
                raise OscarConfigError(
                    f"{var}={rot!r}: no such file. Give a rotation file (.safetensors from "
                    f"`oscar-sglang calibrate`/`zoo pull`, or an OSCAR fork .pt), or "
                    f"{'/'.join(BUILTIN_RECIPES)}"
                )
            kw["rotation"] = path
        sources["rotation"] = var

    vrot, vvar = _get(env, "OSCAR_V_ROTATION")
    if vrot is not None:
        if kw.get("rotation", "hadamard") in BUILTIN_RECIPES:
            raise OscarConfigError(
                f"{vvar} is set but OSCAR_ROTATION (or SGLANG_OSCAR_K_ROTATION_PATH) is not a "
                f"K rotation file; a separate V file only makes sense with the fork's K .pt"
            )
        path = os.path.expanduser(vrot)
        if not os.path.isfile(path):
            raise OscarConfigError(f"{vvar}={vrot!r}: no such file")
        kw["v_rotation"] = path
        sources["v_rotation"] = vvar

    for key, name in (("k_clip", "OSCAR_K_CLIP"), ("v_clip", "OSCAR_V_CLIP")):
        val, var = _get(env, name)
        if val is not None:
            kw[key] = _clip(val, var)
            sources[key] = var

    for key, name, lo in (
        ("sink_tokens", "OSCAR_SINK_TOKENS", 0),
        ("recent_tokens", "OSCAR_RECENT_TOKENS", 1),
    ):
        val, var = _get(env, name)
        if val is not None:
            kw[key] = _int(val, var, lo, 1 << 16)
            sources[key] = var

    val, var = _get(env, "OSCAR_GROUP_SIZE")
    if val is not None:
        g = _int(val, var, 1)
        from oscar_kernels.format import SUPPORTED_GROUP_SIZES

        if g not in SUPPORTED_GROUP_SIZES:
            raise OscarConfigError(f"{var}={g} must be one of {SUPPORTED_GROUP_SIZES}")
        kw["group_size"] = g
        sources["group_size"] = var

    val, var = _get(env, "OSCAR_MAX_RUNNING_REQUESTS")
    if val is not None:
        kw["default_max_running_requests"] = _int(val, var, 1)
        sources["default_max_running_requests"] = var

    val, var = _get(env, "OSCAR_SIDE_BUFFER_FRACTION")
    if val is not None:
        try:
            f = float(val)
        except ValueError:
            raise OscarConfigError(f"{var}={val!r} is not a number") from None
        if not (0.0 < f < 1.0):
            raise OscarConfigError(f"{var}={f} must be in (0, 1)")
        kw["side_buffer_fraction"] = f
        sources["side_buffer_fraction"] = var

    for key, name in (("allow_model_mismatch", "OSCAR_ALLOW_MODEL_MISMATCH"), ("v_absorb", "OSCAR_V_ABSORB")):
        val, var = _get(env, name)
        if val is not None:
            if val.lower() not in ("0", "1", "true", "false", "yes", "no"):
                raise OscarConfigError(f"{var}={val!r} must be 0 or 1")
            kw[key] = val.lower() in ("1", "true", "yes")
            sources[key] = var

    for key, name, choices in (("new_token_attention", "OSCAR_NEW_TOKEN_ATTENTION", NEW_TOKEN_ATTENTION),
                               ("prefix_attention", "OSCAR_PREFIX_ATTENTION", PREFIX_ATTENTION),
                               ("decode_store", "OSCAR_DECODE_STORE", DECODE_STORE)):
        val, var = _get(env, name)
        if val is not None:
            if val.strip().lower() not in choices:
                raise OscarConfigError(f"{var} must be {' or '.join(repr(c) for c in choices)}, got {val!r}")
            kw[key] = val.strip().lower()
            sources[key] = var

    # the kernel switches: the kernels read them themselves; checked here so a bad value stops the start
    for name, choices, _ in KERNEL_SWITCHES:
        val, var = _get(env, name)
        if val is not None and val not in choices:
            raise OscarConfigError(f"{var} must be {' or '.join(repr(c) for c in choices)}, got {val!r}")

    return OscarConfig(sources=sources, **kw)


def kernel_switches_set(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The kernel switches set to something other than the kernels' default ({variable: value}),
    for the start-up log: the kernels read them at each launch, nothing else reports them."""
    env = os.environ if env is None else env
    out = {}
    for name, _, default in KERNEL_SWITCHES:
        val, _ = _get(env, name)
        if val is not None and val != default:
            out[name] = val
    return out


def env_help() -> str:
    """The variables as text, for --help and the docs."""
    lines = []
    for name, (alias, meaning) in ENV_VARS.items():
        a = f" (alias: {alias})" if alias else ""
        lines.append(f"  {name}{a}\n      {meaning}")
    return "\n".join(lines)
