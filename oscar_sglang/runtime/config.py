"""Serving configuration of the INT2 KV cache: the server settings of the registry
(common/settings.py, where every OSCAR_* variable is declared) resolved into one OscarConfig.

Everything here is plain Python (no torch / sglang import) so it is cheap and testable.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Mapping

from ..common import settings as S
from .kv_format import DEFAULT_KV_FORMAT, KVFormatError, check_syntax, side_sizes

INT2 = "int2"  # the --kv-cache-dtype value this plugin adds
BACKEND = "oscar_triton"  # the only attention backend that reads the INT2 pool

NEW_TOKEN_ATTENTION = S.NEW_TOKEN_ATTENTION.choices
DECODE_STORE = S.DECODE_STORE.choices
PREFILL_READS = S.PREFILL_READS.choices
PREFIX_ATTENTION = S.PREFIX_ATTENTION.choices
BUILTIN_RECIPES = S.BUILTIN_ROTATIONS
# the default format's sink / recent sizes: OscarConfig's defaults cannot disagree with it
DEFAULT_SINK, DEFAULT_RECENT = side_sizes(DEFAULT_KV_FORMAT)

# name -> (fork alias or None, meaning) of the server settings, derived from the registry for
# callers that list them (the CLI's --help, the deploy tests)
ENV_VARS: dict[str, tuple[str | None, str]] = {
    s.name: (s.aliases[0] if s.aliases else None, s.doc) for s in S.group(S.SERVER)}

OscarConfigError = S.SettingError  # a bad INT2 setting; the message says which variable and what to do


@dataclass(frozen=True)
class OscarConfig:
    kv_format: str = DEFAULT_KV_FORMAT   # a KVFormat name or "token" (runtime/kv_format.py)
    rotation: str = S.ROTATION.default   # "hadamard", "identity" or a file path
    v_rotation: str | None = None        # fork V .pt (with a fork K .pt)
    k_clip: float | None = None          # None: from the rotation file (or 1.0)
    v_clip: float | None = None
    # the format's (side_sizes); load_config sets those of the chosen format
    sink_tokens: int = DEFAULT_SINK
    recent_tokens: int = DEFAULT_RECENT
    group_size: int = S.GROUP_SIZE.default
    default_max_running_requests: int = S.MAX_RUNNING_REQUESTS.default
    side_buffer_fraction: float = S.SIDE_BUFFER_FRACTION.default
    allow_model_mismatch: bool = S.ALLOW_MODEL_MISMATCH.default
    v_absorb: bool = S.V_ABSORB.default
    new_token_attention: str = S.NEW_TOKEN_ATTENTION.default
    prefix_attention: str | None = None  # None: resolved by resolved_prefix_attention()
    decode_store: str = S.DECODE_STORE.default
    prefill_reads: str = S.PREFILL_READS.default
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


# OscarConfig field <- setting
FIELDS = {
    "kv_format": S.KV_FORMAT, "rotation": S.ROTATION, "v_rotation": S.V_ROTATION,
    "k_clip": S.K_CLIP, "v_clip": S.V_CLIP, "sink_tokens": S.SINK_TOKENS,
    "recent_tokens": S.RECENT_TOKENS, "group_size": S.GROUP_SIZE,
    "default_max_running_requests": S.MAX_RUNNING_REQUESTS,
    "side_buffer_fraction": S.SIDE_BUFFER_FRACTION, "allow_model_mismatch": S.ALLOW_MODEL_MISMATCH,
    "v_absorb": S.V_ABSORB, "new_token_attention": S.NEW_TOKEN_ATTENTION,
    "prefix_attention": S.PREFIX_ATTENTION, "decode_store": S.DECODE_STORE,
    "prefill_reads": S.PREFILL_READS,
}


def load_config(env: Mapping[str, str] | None = None) -> OscarConfig:
    """Validate every OSCAR_* (and fork alias) variable (settings.validate: removed settings, bad
    values, disagreeing aliases) and the KV format's name -> OscarConfig. Raises OscarConfigError."""
    env = os.environ if env is None else env
    values, sources = S.validate(env)
    kw: dict = {}
    src: dict = {}
    for key, setting in FIELDS.items():
        if setting.name in sources:
            kw[key], src[key] = values[setting.name], sources[setting.name]
    if "kv_format" in kw:
        try:
            check_syntax(kw["kv_format"])
        except KVFormatError as e:
            raise OscarConfigError(str(e)) from None
    # sink / recent not set: the chosen format's own (resolve() applies the same rule)
    sink, recent = side_sizes(kw.get("kv_format"))
    kw.setdefault("sink_tokens", sink)
    kw.setdefault("recent_tokens", recent)
    return OscarConfig(sources=src, **kw)


def env_help() -> str:
    """The server settings as text, for `oscar-sglang serve --help` (from the registry)."""
    return S.env_help()
