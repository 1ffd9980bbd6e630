"""KV-cache recipes compared by the accuracy harness, and their per-layer rotations.

A recipe = a rotation per (layer, KV head) for K and V + a quantiser for K and V + clip ratios.
Names accepted on the command line (``--recipe a,b,c``):

  bf16          nothing quantised; only the BF16 rounding of the side buffers (the floor)
  identity      no rotation, served INT2 layout (groups along head_dim), no clip
  kivi          no rotation, K per-channel (groups of G tokens), V served layout  [emulation only]
  hadamard      per-head Walsh-Hadamard on K and V, served layout, no clip
  hadamard-ts   Hadamard + OScaR token scaling (K / ||k_t||) + per-channel K    [emulation only]
  int4          Hadamard, served layout with 16 levels (4-bit reference)          [emulation only]
  oscar         the rotation file(s) given with --rotation (calibrated R, per-layer clips)

Options appended with "+": ``clip=K/V`` fixes the clip ratios of every layer
(``hadamard+clip=0.96/0.92``); ``k-only`` / ``v-only`` quantise only K or only V (ablations that
show which of the two costs the accuracy; the other stays BF16).
A rotation file given as ``--rotation LABEL=FILE`` yields the recipe ``oscar:LABEL``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

BASE_RECIPES = ("bf16", "identity", "kivi", "hadamard", "hadamard-ts", "int4", "oscar")


@dataclass
class Recipe:
    name: str
    rotation: str = "identity"  # identity | hadamard | path of a rotation file
    k_layout: str = "token"  # token (served) | channel (KIVI-style)
    token_scale: bool = False
    levels: int = 4
    quantize: bool = True
    clip_override: tuple[float, float] | None = None
    quantize_k: bool = True
    quantize_v: bool = True

    def supports(self, group_size: int, head_dim: int) -> bool:
        """Token-wise groups must divide head_dim; per-channel K groups can be any size."""
        return not self.quantize or head_dim % group_size == 0

    def bits_per_element(self, group_size: int) -> float:
        """Code bits + fp16 (scale, min) per group, averaged over K and V (the INT2/INT4 body)."""
        if not self.quantize:
            return 16.0
        code = {4: 2, 16: 4}[self.levels]
        return code + 32 / group_size


def parse_recipe(spec: str, rotation_files: dict[str, str]) -> list[Recipe]:
    """One --recipe entry -> recipes (``oscar`` expands to one per rotation file)."""
    name, *options = spec.split("+")
    clip_override, only = None, {}
    for opt in options:
        if opt.startswith("clip="):
            try:
                k, v = (float(c) for c in opt[5:].split("/"))
            except ValueError:
                raise ValueError(f"recipe {spec!r}: clips are written +clip=K/V, e.g. +clip=0.96/0.92")
            clip_override = (k, v)
        elif opt in ("k-only", "v-only"):
            only = {"quantize_v": False} if opt == "k-only" else {"quantize_k": False}
        else:
            raise ValueError(f"recipe {spec!r}: unknown option {opt!r} (clip=K/V, k-only, v-only)")
    suffix = "".join("+" + o for o in options)
    if name == "oscar":
        if not rotation_files:
            raise ValueError("recipe 'oscar' needs at least one --rotation [LABEL=]FILE")
        return [
            Recipe(f"oscar:{label}{suffix}", rotation=path, clip_override=clip_override, **only)
            for label, path in rotation_files.items()
        ]
    table = {
        "bf16": Recipe("bf16", quantize=False),
        "identity": Recipe("identity"),
        "kivi": Recipe("kivi", k_layout="channel"),
        "hadamard": Recipe("hadamard", rotation="hadamard"),
        "hadamard-ts": Recipe("hadamard-ts", rotation="hadamard", k_layout="channel", token_scale=True),
        "int4": Recipe("int4", rotation="hadamard", levels=16),
    }
    if name not in table:
        raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(BASE_RECIPES)}")
    r = table[name]
    return [replace(r, name=spec, clip_override=clip_override, **only)]


def parse_rotation_args(values: list[str] | None) -> dict[str, str]:
    """['cal=/tmp/a.pt', '/tmp/b.safetensors'] -> {'cal': ..., 'b': ...}."""
    out: dict[str, str] = {}
    for v in values or []:
        label, sep, path = v.partition("=")
        if not sep:
            path = v
            label = path.rsplit("/", 1)[-1].split(".")[0]
        out[label] = path
    return out


def build_rotations(recipe: Recipe, num_layers: int, num_kv_heads: int, head_dim: int):
    """The recipe's RotationSet with one rotation per (layer, KV head): [L, Hk, D, D] float32."""
    from oscar_sglang.common.rotations import hadamard_rotation_set, identity_rotation_set

    L, H, D = num_layers, num_kv_heads, head_dim
    if recipe.rotation == "identity":
        rs = identity_rotation_set(L, H, D)
    elif recipe.rotation == "hadamard":
        rs = hadamard_rotation_set(L, H, D)
    else:
        rs = load_rotation_file_for_eval(recipe.rotation, L, H, D)
    rs = replace(rs, k_rotation=rs.k_rotation.expand(-1, H, -1, -1).contiguous(),
                 v_rotation=rs.v_rotation.expand(-1, H, -1, -1).contiguous())
    if recipe.clip_override is not None:
        k, v = recipe.clip_override
        rs = replace(rs, k_clip=torch.full((L,), k), v_clip=torch.full((L,), v))
    return rs


def tuned_group_size(rs) -> int | None:
    """Group size a calibrated file's clips were searched for (None: any)."""
    g = rs.metadata.get("group_size")
    return int(g) if g and rs.recipe == "oscar" else None


def load_rotation_file_for_eval(path: str, num_layers: int, num_kv_heads: int, head_dim: int):
    """Read a rotation file through oscar_sglang.common.rotations and check it fits the model."""
    from oscar_sglang.common.rotations import load_rotation_file

    rs = load_rotation_file(path)
    want = (num_layers, num_kv_heads, head_dim, head_dim)
    for name, t in (("k_rotation", rs.k_rotation), ("v_rotation", rs.v_rotation)):
        shape = tuple(t.shape)
        if len(shape) != 4 or shape[0] != num_layers or shape[1] not in (1, num_kv_heads) \
                or shape[2:] != (head_dim, head_dim):
            raise ValueError(
                f"rotation file {path}: {name} has shape {shape}, the model needs {want} "
                "(layers, kv heads or 1, head_dim, head_dim): was it calibrated for another model?"
            )
    return rs


def format_recipe(fmt, rotation_file: str | None = None) -> Recipe:
    """The Recipe that supplies a KVFormat's rotations (the format itself goes into
    EmulationConfig.kv_format). ``rotation_file``: the calibrated file for rotation='calibrated'.
    A format stored unrotated (rotation 'none': emulation.CastKV, e.g. fp8_e4m3) gets the identity."""
    if fmt.rotation == "none":
        if rotation_file:
            raise ValueError(f"format {fmt.name} stores K and V unrotated: no rotation file")
        return Recipe(fmt.name, rotation="identity")
    if fmt.rotation == "calibrated":
        if not rotation_file:
            raise ValueError(f"format {fmt.name} uses a calibrated rotation: give its file")
        rotation = rotation_file
    else:
        if rotation_file:
            raise ValueError(f"format {fmt.name} uses the {fmt.rotation} rotation, not a file "
                             "(add '-cal' to the name to use one)")
        rotation = fmt.rotation
    return Recipe(fmt.name, rotation=rotation)
