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
