"""The INT2 KV storage format (see docs/format.md for the full description).

One *row* is the K (or V) vector of one token for one KV head: ``head_dim`` values.
The row is cut into groups of ``group_size`` consecutive dims; each group gets an
asymmetric min-max quantiser with 4 levels (2 bits) and an fp16 (scale, min) pair.

Byte layout of a row (chosen for wide, coalesced decode loads):

* codes: ``uint8[head_dim // 4]``, "quarter split": byte ``j`` holds the codes of dims
  ``j, j + D/4, j + D/2, j + 3D/4`` at bit offsets 0, 2, 4, 6. A decode program loads the whole
  row as contiguous bytes (32 B at D=128: two 16-byte vectors) and gets four *contiguous*
  quarter vectors back with one shift and one mask each, no shuffles.
* params: ``float16[n_groups, 2]`` = (scale, min) per group, interleaved, 4 bytes per group.

Codes and params of a pool live in two tensors indexed by slot:
``codes[N, H, D//4] uint8`` and ``params[N, H, D//G, 2] float16``.

Dequantisation of dim ``d``: ``x = code * scale[d // G] + min[d // G]`` (fp32 arithmetic).
Bits per element: ``2 + 32 / G`` (2.25 at G=128, 2.5 at G=64, 3.0 at G=32).
"""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
PARAM_BITS = 16  # fp16 scale and fp16 minimum per group
CODE_BITS = 2
LEVELS = 4
# Smallest scale we store: keeps 1/scale finite for constant groups (exactly representable in fp16).
MIN_SCALE = 2.0**-20
FP16_MAX = 65504.0


@dataclass(frozen=True)
class Int2Format:
    head_dim: int
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"INT2 KV cache: head_dim={self.head_dim} is not supported "
                f"(supported: {SUPPORTED_HEAD_DIMS})"
            )
        if self.group_size not in SUPPORTED_GROUP_SIZES or self.head_dim % self.group_size:
            raise ValueError(
                f"INT2 KV cache: group size {self.group_size} must be one of "
                f"{SUPPORTED_GROUP_SIZES} and divide head_dim={self.head_dim}"
            )

    @property
    def n_groups(self) -> int:
        return self.head_dim // self.group_size

    @property
    def code_bytes(self) -> int:
        """Bytes of packed codes per row (4 codes per byte)."""
        return self.head_dim // 4

    @property
    def param_bytes(self) -> int:
        """Bytes of (scale, min) per row."""
        return self.n_groups * 2 * PARAM_BITS // 8

    @property
    def bytes_per_row(self) -> int:
        return self.code_bytes + self.param_bytes

    @property
    def bits_per_element(self) -> float:
        """2 + 2*16/G."""
        return CODE_BITS + 2 * PARAM_BITS / self.group_size


def bits_per_element(group_size: int) -> float:
    return CODE_BITS + 2 * PARAM_BITS / group_size


def normalize_clip_ratio(ratio: float | None) -> float:
    """Clip ratio r in (0, 1]; 1.0 (or None) means no clipping."""
    if ratio is None:
        return 1.0
    ratio = float(ratio)
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"clip ratio must be in (0, 1], got {ratio} (1.0 disables clipping)")
    return ratio


def clip_index(ratio: float, group_size: int) -> int:
    """Index into the ascending-sorted |x| of a group that gives the clip threshold.

    ``thr = sorted(|x_group|)[clip_index]``, values are clamped to [-thr, thr] before min-max.
    ``ratio == 1`` gives ``G - 1`` (the max), i.e. no clipping.
    """
    return min(group_size - 1, int(ratio * group_size))


# --------------------------------------------------------------------------------------------
# KVFormat: a full KV format (key layout, bits of K and V, per-layer overrides, token-norm,
# rotation kind, sink and ring sizes). docs/format.md, "KVFormat".
# --------------------------------------------------------------------------------------------

KEY_BITS = (2, 3, 4)
VALUE_BITS = (2, 4)
KEY_LAYOUTS = ("token", "channel")
PAGE_SIZES = (32, 64)  # SGLang --page-size values a per-channel key block may take
SINK_SIZES = (0, 4, 64)
RING_SIZES = (32, 64, 128, 256)  # one block (32 / 64), 128 or 256
ROTATIONS = ("hadamard", "identity", "calibrated")
NORM_BITS = 16  # fp16 per-(token, KV head) L2 norm with token-norm scaling
DEFAULT_SINK, DEFAULT_WINDOW = 64, 256
_ROTATION_TAGS = {"identity": "id", "calibrated": "cal"}  # hadamard (the default) has no tag


def code_bytes(bits: int, head_dim: int) -> int:
    """Packed code bytes of one row of ``head_dim`` codes of ``bits`` bits (see pack_bits)."""
    if bits not in (2, 3, 4):
        raise ValueError(f"no packing for {bits}-bit codes (2, 3 or 4)")
    return bits * head_dim // 8


@dataclass(frozen=True)
class LayerBits:
    """Per-layer override: ``k_bits`` / ``v_bits`` replace the format's bits (None: keep)."""

    layers: tuple[int, ...]  # layer indices; negative counts from the end (-1: last layer)
    k_bits: int | None = None
    v_bits: int | None = None

    def __post_init__(self) -> None:
        # a list would make the frozen format unhashable and its name order-dependent on input
        layers = (self.layers,) if isinstance(self.layers, int) else tuple(self.layers)
        if not all(isinstance(i, int) for i in layers):
            raise ValueError(f"layer override: layers must be integers, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)


@dataclass(frozen=True)
class KVFormat:
    """A full KV-cache format. ``name`` / ``KVFormat.parse`` give its short stable name.

    Keys: ``k_layout="token"`` = groups of ``k_group`` consecutive dims of one token's row (the
    served INT2 layout); ``"channel"`` = per (block, KV head, channel) over blocks of ``k_group``
    consecutive tokens aligned to the request's positions 0, B, 2B... (B = the page size).
    Values: always per-token groups of ``v_group`` dims. ``token_norm`` (channel keys only):
    each (token, KV head) key row is divided by its fp16 L2 norm before quantisation and the norm
    is stored. ``k_clip`` / ``v_clip``: apply the rotation file's per-layer clip ratios.
    ``sink`` first tokens and the last ``window`` tokens are also kept in BF16.
    """

    head_dim: int
    k_bits: int = 2
    k_layout: str = "channel"
    k_group: int = 64
    v_bits: int = 2
    v_group: int = 128
    token_norm: bool = False
    rotation: str = "hadamard"
    k_clip: bool = False
    v_clip: bool = False
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    overrides: tuple[LayerBits, ...] = ()

    def __post_init__(self) -> None:
        D = self.head_dim
        err = f"KV format {self._name_or_fields()}: "
        if D not in SUPPORTED_HEAD_DIMS:
            raise ValueError(err + f"head_dim={D} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
        if self.k_layout not in KEY_LAYOUTS:
            raise ValueError(err + f"key layout {self.k_layout!r} is not one of {KEY_LAYOUTS}")
        for b in [self.k_bits] + [o.k_bits for o in self.overrides if o.k_bits is not None]:
            if b not in KEY_BITS:
                raise ValueError(err + f"{b}-bit keys are not supported (key bits: {KEY_BITS})")
        for b in [self.v_bits] + [o.v_bits for o in self.overrides if o.v_bits is not None]:
            if b not in VALUE_BITS:
                raise ValueError(err + f"{b}-bit values are not supported (value bits: {VALUE_BITS})")
        if self.k_layout == "channel":
            if self.k_group not in PAGE_SIZES:
                raise ValueError(err + f"key block {self.k_group} is not a supported page size "
                                 f"{PAGE_SIZES} (blocks are SGLang pages)")
            if self.window < self.k_group:
                raise ValueError(err + f"ring of {self.window} tokens is shorter than a key block "
                                 f"({self.k_group}): an incomplete block must be read from BF16")
        else:
            self._check_group("key", self.k_group, err)
            if self.token_norm:
                raise ValueError(err + "token-norm scaling needs per-channel keys (k_layout='channel'): "
                                 "per-token groups already have their own scale")
        self._check_group("value", self.v_group, err)
        if self.rotation not in ROTATIONS:
            raise ValueError(err + f"rotation {self.rotation!r} is not one of {ROTATIONS}")
        if self.sink not in SINK_SIZES:
            raise ValueError(err + f"sink of {self.sink} tokens is not one of {SINK_SIZES}")
        if self.window not in RING_SIZES:
            raise ValueError(err + f"ring of {self.window} tokens is not one of {RING_SIZES}")
        seen: set[int] = set()
        for o in self.overrides:
            if not o.layers or (o.k_bits is None and o.v_bits is None):
                raise ValueError(err + f"empty layer override {o}")
            if seen & set(o.layers):
                raise ValueError(err + f"layer(s) {sorted(seen & set(o.layers))} overridden twice")
            seen |= set(o.layers)

    def _check_group(self, what: str, g: int, err: str) -> None:
        if g not in SUPPORTED_GROUP_SIZES or self.head_dim % g:
            raise ValueError(err + f"{what} group size {g} must be one of {SUPPORTED_GROUP_SIZES} "
                             f"and divide head_dim={self.head_dim}")

    def _name_or_fields(self) -> str:
        try:
            return self.name
        except Exception:  # invalid fields: name the raw values instead
            return (f"(k{self.k_bits} {self.k_layout} {self.k_group}, v{self.v_bits} t{self.v_group}, "
                    f"sink {self.sink}, window {self.window})")

    # ---------------------------------------------------------------- per-layer bits

    def _resolved(self, num_layers: int | None) -> dict[int, LayerBits]:
        out: dict[int, LayerBits] = {}
        for o in self.overrides:
            for i in o.layers:
                if i < 0 or num_layers is not None:
                    if num_layers is None:
                        raise ValueError(f"KV format {self.name}: layer {i} counts from the end; "
                                         "pass num_layers")
                    j = i + num_layers if i < 0 else i
                    if not 0 <= j < num_layers:
                        raise ValueError(f"KV format {self.name}: layer {i} does not exist in a "
                                         f"{num_layers}-layer model")
                    i = j
                if i in out:
                    raise ValueError(f"KV format {self.name}: layer {i} overridden twice")
                out[i] = o
        return out

    def layer_bits(self, layer: int, num_layers: int | None = None) -> tuple[int, int]:
        """(key bits, value bits) of ``layer`` (0-based)."""
        o = self._resolved(num_layers).get(layer)
        kb = o.k_bits if o is not None and o.k_bits is not None else self.k_bits
        vb = o.v_bits if o is not None and o.v_bits is not None else self.v_bits
        return kb, vb

    # ---------------------------------------------------------------- sizes

    def k_row_bytes(self, layer: int = 0, num_layers: int | None = None) -> float:
        """Bytes per (token, KV head) of K: codes + params (per-channel params amortised over
        the block) + the token norm."""
        kb, _ = self.layer_bits(layer, num_layers)
        D = self.head_dim
        # token: D/G groups of fp16 (scale, min) per row; channel: D channels x (scale, min) per
        # block of k_group tokens. Both are 4*D/k_group bytes per token.
        params = 4 * D / self.k_group
        norm = NORM_BITS // 8 if self.token_norm else 0
        return code_bytes(kb, D) + params + norm

    def v_row_bytes(self, layer: int = 0, num_layers: int | None = None) -> float:
        _, vb = self.layer_bits(layer, num_layers)
        return code_bytes(vb, self.head_dim) + 4 * self.head_dim / self.v_group

    def bytes_per_token(self, num_kv_heads: int, layer: int = 0, num_layers: int | None = None) -> float:
        """Bytes the pool holds per token of one layer (K and V, all KV heads; BF16 side buffers
        not included: they do not grow with the context)."""
        return num_kv_heads * (self.k_row_bytes(layer, num_layers) + self.v_row_bytes(layer, num_layers))

    def body_bits_per_element(self, num_layers: int | None = None) -> float:
        """All bits of the quantised body (codes, fp16 scales / mins, token norms) per K or V
        element, averaged over K and V (and over layers when some are overridden)."""
        if self.overrides and num_layers is None:
            raise ValueError(f"KV format {self.name} has per-layer overrides: pass num_layers")
        layers = range(num_layers or 1)
        total = sum(self.k_row_bytes(i, num_layers) + self.v_row_bytes(i, num_layers) for i in layers)
        return 8 * total / (2 * self.head_dim * len(layers))

    def pool_tensors(self, num_slots: int, num_kv_heads: int, layer: int = 0,
                     num_layers: int | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """Per-layer pool tensors, name -> (shape, dtype), for ``num_slots`` token slots.

        Channel-layout key params are per page: slot n's block is page n // k_group.
        """
        kb, vb = self.layer_bits(layer, num_layers)
        N, H, D = num_slots, num_kv_heads, self.head_dim
        out = {"k_codes": ((N, H, code_bytes(kb, D)), "uint8")}
        if self.k_layout == "channel":
            if N % self.k_group:
                raise ValueError(f"{N} slots are not whole pages of {self.k_group}")
            out["k_params"] = ((N // self.k_group, H, D, 2), "float16")
            if self.token_norm:
                out["k_norms"] = ((N, H), "float16")
        else:
            out["k_params"] = ((N, H, D // self.k_group, 2), "float16")
        out["v_codes"] = ((N, H, code_bytes(vb, D)), "uint8")
        out["v_params"] = ((N, H, D // self.v_group, 2), "float16")
        return out

    # ---------------------------------------------------------------- names

    @property
    def name(self) -> str:
        """Short stable name, e.g. ``k2c64-v2t128``, ``k3c64-v2t128-tn``,
        ``k2c64-v2t64-tn-s4-w128@0,-1=k4``. Segments after the K/V ones (only when not the
        default): ``tn``, ``id`` / ``cal`` (rotation; Hadamard is the default), ``kclip``,
        ``vclip``, ``s<sink>``, ``w<window>``; then ``@layers=k<b>v<b>`` per override."""
        parts = [f"k{self.k_bits}{self.k_layout[0]}{self.k_group}", f"v{self.v_bits}t{self.v_group}"]
        if self.token_norm:
            parts.append("tn")
        if self.rotation in _ROTATION_TAGS:
            parts.append(_ROTATION_TAGS[self.rotation])
        parts += [t for t, on in (("kclip", self.k_clip), ("vclip", self.v_clip)) if on]
        if self.sink != DEFAULT_SINK:
            parts.append(f"s{self.sink}")
        if self.window != DEFAULT_WINDOW:
            parts.append(f"w{self.window}")
        name = "-".join(parts)
        for o in self.overrides:
            bits = (f"k{o.k_bits}" if o.k_bits is not None else "") + \
                   (f"v{o.v_bits}" if o.v_bits is not None else "")
            name += "@" + ",".join(str(i) for i in o.layers) + "=" + bits
        return name

    @classmethod
    def parse(cls, name: str, head_dim: int) -> "KVFormat":
        """Inverse of ``name`` (``KVFormat.parse(f.name, f.head_dim) == f``); also reads the value
        segment ``v<bits>h`` (one group per token and head: ``v_group = head_dim``)."""
        import re

        def bad(why: str) -> ValueError:
            return ValueError(f"KV format name {name!r}: {why} (e.g. k2c64-v2t128, "
                              "k3c64-v2t128-tn-s4-w128, k2c64-v2t128@0,-1=k4)")

        base, *over = name.strip().split("@")
        parts = base.split("-")
        if len(parts) < 2:
            raise bad("needs a key and a value segment")
        mk = re.fullmatch(r"k(\d)([ct])(\d+)", parts[0])
        # v<bits>h: one value group per token and head (the group is head_dim), so that one name
        # means "a scale per token-head" on 64- and 128-dim heads alike; `name` spells the group
        mv = re.fullmatch(r"v(\d)(?:t(\d+)|(h))", parts[1])
        if not mk or not mv:
            raise bad("the first segments must be k<bits><c|t><size> and v<bits>t<group> or v<bits>h")
        kw: dict = dict(k_bits=int(mk[1]), k_layout={"c": "channel", "t": "token"}[mk[2]],
                        k_group=int(mk[3]), v_bits=int(mv[1]), v_group=head_dim if mv[3] else int(mv[2]))
        tags = {"tn": ("token_norm", True), "id": ("rotation", "identity"),
                "cal": ("rotation", "calibrated"), "kclip": ("k_clip", True), "vclip": ("v_clip", True)}
        for p in parts[2:]:
            if p in tags:
                k, v = tags[p]
            elif re.fullmatch(r"[sw]\d+", p):
                k, v = ("sink" if p[0] == "s" else "window"), int(p[1:])
            else:
                raise bad(f"unknown segment {p!r}")
            if k in kw:
                raise bad(f"segment {p!r} given twice")
            kw[k] = v
        overrides = []
        for o in over:
            m = re.fullmatch(r"(-?\d+(?:,-?\d+)*)=(?:k(\d))?(?:v(\d))?", o)
            if not m or (m[2] is None and m[3] is None):
                raise bad(f"override {o!r} is not <layers>=k<bits>[v<bits>]")
            overrides.append(LayerBits(tuple(int(i) for i in m[1].split(",")),
                                       int(m[2]) if m[2] else None, int(m[3]) if m[3] else None))
        return cls(head_dim=head_dim, overrides=tuple(overrides), **kw)
