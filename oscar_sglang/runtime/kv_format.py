"""The KV format a server stores: OSCAR_KV_FORMAT resolved for the served model.

Two layouts (docs/format.md):
* "channel" (the default): keys quantised per channel over page blocks of B tokens (B = SGLang's
  --page-size, set by the plugin), 2/3/4 bits, optionally more bits on some layers; values 2-bit
  per-token groups. What makes 2-bit keys retrieve (docs/accuracy.md).
* "token": the OSCAR per-token recipe (2-bit groups along head_dim for K and V, the rotation
  file's clip ratios), selected with OSCAR_KV_FORMAT=token (group from OSCAR_GROUP_SIZE / the
  rotation file) or an explicit name such as k2t64-v2t64-kclip-vclip.

The name is a KVFormat name (kernels/oscar_kernels/format.py) without a rotation tag: the rotation
is OSCAR_ROTATION's. Sink and recent sizes come from the name's s<N> / w<N> segments (none: 64 / 256, KVFormat's
names), else from OSCAR_SINK_TOKENS / OSCAR_RECENT_TOKENS (both given and different: an error).
With no OSCAR_KV_FORMAT the default's sizes (4 / 128) are defaults those variables override.

Plain Python (no torch / sglang import): unit-tested directly and used by sizing.
"""
from __future__ import annotations

from dataclasses import dataclass

from oscar_kernels.format import DEFAULT_SINK, DEFAULT_WINDOW, KVFormat, code_bytes

from ..common import settings

# 4-bit keys per channel over pages of 64 + 2-bit values in one group per token and KV head (v2h:
# v2t64 on 64-dim heads, v2t128 on 128-dim); 4 sink and 128 recent BF16 tokens per running request
# (retrieval as with 64 / 256 at 0.41x the side-buffer memory). Why this one: docs/accuracy.md and
# CHANGELOG.md. Declared with its setting (common/settings.py); sink / recent defaults of
# OscarConfig come from this name (side_sizes).
DEFAULT_KV_FORMAT = settings.KV_FORMAT.default
TOKEN_RECIPE = "token"  # the OSCAR per-token recipe, group size as before
# what the served kernels implement (the CPU study's formats are wider: docs/accuracy.md)
SERVED_CHANNEL_BITS = (2, 3, 4)
SERVED_CHANNEL_HEAD_DIMS = (64, 128)


SERVED_EXAMPLES = (f"Served formats look like {DEFAULT_KV_FORMAT} (default), k2c64-v2t64, "
                   "k4c32-v2t128-s4-w128, k2c64-v2t64@0,-1=k4, or 'token'.")


class KVFormatError(ValueError):
    """A format the server cannot store; the message says what to use instead."""


@dataclass(frozen=True)
class ServedFormat:
    name: str                  # stable name (KVFormat style), also in /server_info
    layout: str                # "token" | "channel"
    head_dim: int
    v_head_dim: int
    k_bits: tuple[int, ...]    # per model layer
    k_group: int               # token: dims per group; channel: tokens per block (= page size)
    v_group: int
    sink: int
    recent: int
    k_clip: bool               # apply the rotation file's K clip ratios
    v_clip: bool

    @property
    def page_size(self) -> int | None:
        """The --page-size this format needs (channel blocks are SGLang pages), else None."""
        return self.k_group if self.layout == "channel" else None

    def k_row_bytes(self, layer: int) -> int:
        """Bytes per (token, KV head) of K in the pool: codes + (scale, min) (per-channel params
        are one row per page, 4 * D / B bytes per token)."""
        return code_bytes(self.k_bits[layer], self.head_dim) + 4 * self.head_dim // self.k_group

    def v_row_bytes(self) -> int:
        return code_bytes(2, self.v_head_dim) + 4 * self.v_head_dim // self.v_group

    def body_bits_per_element(self) -> float:
        """All bits of the quantised body per K or V element, averaged over K, V and layers."""
        n = len(self.k_bits)
        total = sum(self.k_row_bytes(i) + self.v_row_bytes() for i in range(n))
        return 8 * total / (n * (self.head_dim + self.v_head_dim))

    def describe(self) -> str:
        keys = (f"{'/'.join(map(str, sorted(set(self.k_bits))))}-bit keys per channel over blocks of "
                f"{self.k_group} tokens" if self.layout == "channel" else
                f"2-bit keys in groups of {self.k_group} dims")
        return (f"{self.name}: {keys}, 2-bit values in groups of {self.v_group}, "
                f"{self.body_bits_per_element():.3f} bits per element")


def _token_recipe(group: int, head_dim: int, v_head_dim: int, num_layers: int, sink: int,
                  recent: int, name: str | None = None, k_clip: bool = True,
                  v_clip: bool = True) -> ServedFormat:
    kg, vg = min(group, head_dim), min(group, v_head_dim)
    return ServedFormat(
        name=name or f"k2t{kg}-v2t{vg}-kclip-vclip" + _side_suffix(sink, recent),
        layout="token", head_dim=head_dim, v_head_dim=v_head_dim, k_bits=(2,) * num_layers,
        k_group=kg, v_group=vg, sink=sink, recent=recent, k_clip=k_clip, v_clip=v_clip)


def _side_suffix(sink: int, recent: int) -> str:
    return (f"-s{sink}" if sink != DEFAULT_SINK else "") + (f"-w{recent}" if recent != DEFAULT_WINDOW else "")


def _side_sizes(name: str, env_sink: int | None, env_recent: int | None) -> tuple[int | None, int | None, str]:
    """Sink / window segments of a name (None: not given) and the name without them, so that
    sizes outside KVFormat's study grid (any OSCAR_SINK_TOKENS) still parse."""
    import re

    base, *over = name.split("@")
    parts = base.split("-")
    sink = window = None
    kept = []
    for p in parts:
        m = re.fullmatch(r"([sw])(\d+)", p)
        if m and len(kept) >= 2:
            if m[1] == "s":
                sink = int(m[2])
            else:
                window = int(m[2])
        else:
            kept.append(p)
    for what, seg, env, var in (("sink", sink, env_sink, "OSCAR_SINK_TOKENS"),
                                ("recent window", window, env_recent, "OSCAR_RECENT_TOKENS")):
        if seg is not None and env is not None and seg != env:
            raise KVFormatError(f"OSCAR_KV_FORMAT={name!r} sets a {what} of {seg} tokens but "
                                f"{var}={env}: set it in one place")
    return sink, window, "@".join(["-".join(kept), *over])


def _channel_head_dim_refusal(head_dim: int) -> str:
    return (f"per-channel keys at head_dim {head_dim} (served at {SERVED_CHANNEL_HEAD_DIMS}; "
            f"use OSCAR_KV_FORMAT=token)")


def _is_channel_name(core: str) -> bool:
    """Whether a name asks for per-channel keys (parsed at a served head_dim)."""
    try:
        return KVFormat.parse(core, SERVED_CHANNEL_HEAD_DIMS[-1]).k_layout == "channel"
    except ValueError:
        return False


def resolve(name: str, *, head_dim: int, v_head_dim: int, num_layers: int, group_size: int,
            sink: int | None = None, recent: int | None = None) -> ServedFormat:
    """OSCAR_KV_FORMAT (or its default) for a model. sink / recent: OSCAR_SINK_TOKENS /
    OSCAR_RECENT_TOKENS when set (else None); group_size: the per-token recipe's group."""
    given = (name or "").strip()
    name = given or DEFAULT_KV_FORMAT
    if name.lower() == TOKEN_RECIPE:
        return _token_recipe(group_size, head_dim, v_head_dim, num_layers,
                             DEFAULT_SINK if sink is None else sink,
                             DEFAULT_WINDOW if recent is None else recent)
    if given:
        s, w, core = _side_sizes(name, sink, recent)
    else:  # the default's sink / window give way to OSCAR_SINK_TOKENS / OSCAR_RECENT_TOKENS
        s, w, core = _side_sizes(name, None, None)
        s, w = (s if sink is None else sink), (w if recent is None else recent)
    s = s if s is not None else (sink if sink is not None else DEFAULT_SINK)
    w = w if w is not None else (recent if recent is not None else DEFAULT_WINDOW)
    try:
        fmt = KVFormat.parse(core, head_dim)
    except ValueError as e:
        if head_dim not in SERVED_CHANNEL_HEAD_DIMS and _is_channel_name(core):
            # e.g. the default's v2h on 256-dim heads: say what the server cannot do, not the grammar
            raise KVFormatError(f"OSCAR_KV_FORMAT={name!r} cannot be served: "
                                f"{_channel_head_dim_refusal(head_dim)}. {SERVED_EXAMPLES}") from None
        raise KVFormatError(f"OSCAR_KV_FORMAT={name!r}: {e}. {SERVED_EXAMPLES}") from None
    bad = []
    if fmt.rotation != "hadamard":
        bad.append("a rotation tag (id / cal): the rotation is chosen by OSCAR_ROTATION")
    if fmt.token_norm:
        bad.append("token-norm scaling (tn): studied on CPU only, not served")
    if any(fmt.layer_bits(i, num_layers)[1] != 2 for i in range(num_layers)):
        bad.append("values of other than 2 bits: served values are 2-bit")
    if v_head_dim != head_dim:
        bad.append(f"a value head_dim ({v_head_dim}) different from the key head_dim ({head_dim})")
    if fmt.k_layout == "token":
        if any(fmt.layer_bits(i, num_layers)[0] != 2 for i in range(num_layers)) or fmt.k_group != fmt.v_group:
            bad.append("per-token keys other than 2 bits with the value group (the OSCAR recipe, "
                       "e.g. k2t64-v2t64-kclip-vclip)")
    else:
        if head_dim not in SERVED_CHANNEL_HEAD_DIMS:
            bad.append(_channel_head_dim_refusal(head_dim))
        if fmt.k_clip:
            bad.append("kclip with per-channel keys (clipping keys hurts retrieval)")
        if fmt.v_group < v_head_dim // 4:
            bad.append(f"value groups of {fmt.v_group} < head_dim / 4 = {v_head_dim // 4}")
    if w < 1 or s < 0:
        bad.append(f"sink {s} / recent window {w} tokens")
    if fmt.k_layout == "channel" and w < fmt.k_group:
        bad.append(f"a recent window of {w} tokens, shorter than a key block of {fmt.k_group}: "
                   "an incomplete block is read from BF16")
    if bad:
        raise KVFormatError(f"OSCAR_KV_FORMAT={name!r} cannot be served: " + "; ".join(bad)
                            + f". {SERVED_EXAMPLES}")
    k_bits = tuple(fmt.layer_bits(i, num_layers)[0] for i in range(num_layers))
    base, *over = core.split("@")
    segs = base.split("-")
    segs[1] = f"v{fmt.v_bits}t{fmt.v_group}"  # the group spelled out (v<bits>h names head_dim's)
    served_name = "@".join(["-".join(segs) + _side_suffix(s, w), *over])  # parses back to the same format
    if fmt.k_layout == "token":
        return _token_recipe(fmt.k_group, head_dim, v_head_dim, num_layers, s, w, name=served_name,
                             k_clip=fmt.k_clip, v_clip=fmt.v_clip)
    return ServedFormat(name=served_name, layout="channel", head_dim=head_dim, v_head_dim=v_head_dim,
                        k_bits=k_bits, k_group=fmt.k_group, v_group=fmt.v_group, sink=s, recent=w,
                        k_clip=False, v_clip=fmt.v_clip)


def for_model(cfg, model_config) -> ServedFormat:
    """The format an OscarConfig asks for, resolved for a SGLang ModelConfig (or a stand-in with
    head_dim, v_head_dim and num_hidden_layers). KVFormatError says why it cannot be served."""
    hd = model_config.head_dim
    return resolve(
        cfg.kv_format if "kv_format" in cfg.sources else None, head_dim=hd, v_head_dim=getattr(model_config, "v_head_dim", None) or hd,
        num_layers=model_config.num_hidden_layers, group_size=cfg.group_size,
        sink=cfg.sink_tokens if "sink_tokens" in cfg.sources else None,
        recent=cfg.recent_tokens if "recent_tokens" in cfg.sources else None,
    )


def check_syntax(name: str) -> None:
    """Early check in the launching process (the head_dim is not known yet: 128 stands in)."""
    if (name or "").strip().lower() == TOKEN_RECIPE:
        return
    _, _, core = _side_sizes(name.strip(), None, None)
    try:
        KVFormat.parse(core, 128)
    except ValueError as e:
        raise KVFormatError(f"OSCAR_KV_FORMAT={name!r}: {e}. {SERVED_EXAMPLES}") from None


def side_sizes(name: str | None) -> tuple[int, int]:
    """(sink, recent) a format name stores when OSCAR_SINK_TOKENS / OSCAR_RECENT_TOKENS are unset:
    its s<N> / w<N> segments, else KVFormat's defaults (64 / 256, also those of 'token'). None or
    empty: the default format's."""
    name = (name or "").strip() or DEFAULT_KV_FORMAT
    if name.lower() == TOKEN_RECIPE:
        return DEFAULT_SINK, DEFAULT_WINDOW
    s, w, _ = _side_sizes(name, None, None)
    return (DEFAULT_SINK if s is None else s), (DEFAULT_WINDOW if w is None else w)


def page_size_for(name: str) -> int | None:
    """The --page-size a format name needs (channel blocks), from the name alone."""
    if (name or "").strip().lower() == TOKEN_RECIPE:
        return None
    _, _, core = _side_sizes((name or DEFAULT_KV_FORMAT).strip(), None, None)
    fmt = KVFormat.parse(core, 128)
    return fmt.k_group if fmt.k_layout == "channel" else None
