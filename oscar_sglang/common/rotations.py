"""Per-layer KV rotations (+ clip ratios): the in-memory object, file I/O and validation.

A rotation file tells the INT2 KV cache how to rotate K and V before quantising them:

* ``k_rotation [L, Hk, D, D]`` float32, ``Hk`` in ``{1, num_kv_heads}`` (1 = one matrix shared
  by all KV heads of the layer). **Row-vector convention**: ``k_rot = k @ R`` and, at attention
  time, ``q_rot = q @ R`` (so ``q_rot . k_rot = q . k`` because R is orthogonal).
* ``v_rotation [L, Hv, Dv, Dv]`` float32: ``v_rot = v @ R_v``; the attention output is turned
  back with ``o = o_rot @ R_v^T``.
* ``k_clip [L]``, ``v_clip [L]`` float32 in (0, 1]: clip ratio per layer (1.0 = no clipping, see
  ``oscar_kernels.format.clip_index``).
* JSON metadata (model id, recipe, group size, data fingerprint, tool version, date...).

On disk (our format): one ``.safetensors`` file with those four tensors; the metadata is stored
as JSON under the safetensors metadata key ``"oscar_sglang"``. The OSCAR research fork's layout
(two ``torch.save`` dicts, one per K and V, one shared matrix per layer) is read and written by
``load_oscar_pt`` / ``save_oscar_pt``; those files carry no clip ratios in the fork, so we add
ours under an extra top-level key the fork ignores, which makes the round trip lossless.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

FORMAT_VERSION = 1
METADATA_KEY = "oscar_sglang"
# max |R R^T - I| accepted for float32 matrices (a float32 orthogonal matrix made in float64 and
# rounded has ~1e-7 error; 1e-3 catches any real corruption while tolerating bf16-ish sources).
ORTHOGONALITY_TOL = 1e-3
RECIPES = ("oscar", "hadamard", "identity")


class RotationFileError(ValueError):
    """A rotation file (or RotationSet) that cannot be used; the message says what to do."""


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _same_model(a: str, b: str) -> bool:
    """Model ids match if equal up to case, trailing slashes and a leading directory
    (``/models/SmolLM2-135M-Instruct`` matches ``HuggingFaceTB/SmolLM2-135M-Instruct``)."""
    na, nb = a.strip().rstrip("/").lower(), b.strip().rstrip("/").lower()
    return na == nb or na.rsplit("/", 1)[-1] == nb.rsplit("/", 1)[-1]


@dataclass
class RotationSet:
    """K/V rotations and clip ratios of every layer of one model (see module docstring)."""

    k_rotation: torch.Tensor  # [L, Hk, D, D] float32, Hk in {1, num_kv_heads}
    v_rotation: torch.Tensor  # [L, Hv, Dv, Dv] float32
    k_clip: torch.Tensor  # [L] float32 in (0, 1]
    v_clip: torch.Tensor  # [L] float32 in (0, 1]
    metadata: dict = field(default_factory=dict)
    source: str | None = None  # file it was loaded from
    sha256: str | None = None  # of that file

    def __post_init__(self) -> None:
        self.k_rotation = torch.as_tensor(self.k_rotation).detach().float().cpu().contiguous()
        self.v_rotation = torch.as_tensor(self.v_rotation).detach().float().cpu().contiguous()
        self.k_clip = torch.as_tensor(self.k_clip, dtype=torch.float32).detach().cpu().reshape(-1)
        self.v_clip = torch.as_tensor(self.v_clip, dtype=torch.float32).detach().cpu().reshape(-1)
        self.metadata = dict(self.metadata)

    # ------------------------------------------------------------------ properties
    @property
    def recipe(self) -> str:
        return str(self.metadata.get("recipe", "unknown"))

    @property
    def num_layers(self) -> int:
        return self.k_rotation.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k_rotation.shape[-1]

    @property
    def v_head_dim(self) -> int:
        return self.v_rotation.shape[-1]

    @property
    def model_id(self) -> str | None:
        return self.metadata.get("model_id")

    def _where(self) -> str:
        return f"rotation file {self.source}" if self.source else "rotation set"

    # ------------------------------------------------------------------ validation
    def check(self, tol: float = ORTHOGONALITY_TOL) -> None:
        """Model-independent checks: shapes consistent, finite, orthogonal, clips in (0, 1]."""
        w = self._where()
        fix = "recreate it with `oscar-sglang calibrate` or take one from `oscar-sglang zoo`"
        for name, r in (("k_rotation", self.k_rotation), ("v_rotation", self.v_rotation)):
            if r.dim() != 4 or r.shape[-1] != r.shape[-2] or r.shape[1] < 1:
                raise RotationFileError(
                    f"{w}: {name} must have shape [layers, heads or 1, D, D], got "
                    f"{list(r.shape)}; {fix}"
                )
            if not torch.isfinite(r).all():
                bad = (~torch.isfinite(r)).flatten(1).any(1).nonzero().flatten().tolist()
                raise RotationFileError(
                    f"{w}: {name} contains NaN/Inf (layers {bad[:8]}); the file is corrupt, {fix}"
                )
            err = (r.double() @ r.double().transpose(-1, -2)
                   - torch.eye(r.shape[-1], dtype=torch.float64)).abs().amax(dim=(-1, -2))
            if float(err.max()) > tol:
                worst = int(err.amax(1).argmax())
                raise RotationFileError(
                    f"{w}: {name} is not orthogonal (max |R R^T - I| = {float(err.max()):.3g} at "
                    f"layer {worst}, tolerance {tol:g}); an INT2 cache rotated by it would change "
                    f"attention scores. {fix}"
                )
        if self.v_rotation.shape[0] != self.num_layers:
            raise RotationFileError(
                f"{w}: k_rotation has {self.num_layers} layers but v_rotation has "
                f"{self.v_rotation.shape[0]}; {fix}"
            )
        for name, c in (("k_clip", self.k_clip), ("v_clip", self.v_clip)):
            if c.shape != (self.num_layers,):
                raise RotationFileError(
                    f"{w}: {name} must have shape [{self.num_layers}] (one ratio per layer), got "
                    f"{list(c.shape)}; {fix}"
                )
            if not (torch.isfinite(c).all() and (c > 0).all() and (c <= 1).all()):
                raise RotationFileError(
                    f"{w}: {name} values must be in (0, 1] (1.0 = no clipping), got "
                    f"{c.tolist()}; {fix}"
                )

    def validate_for_model(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        model_id: str | None = None,
        allow_model_mismatch: bool = False,
        tol: float = ORTHOGONALITY_TOL,
    ) -> None:
        """Raise RotationFileError unless this set fits the served model.

        ``num_kv_heads`` is the model's total KV head count (before tensor-parallel sharding).
        A model-id mismatch (both ids known) is refused unless ``allow_model_mismatch=True``.
        """
        self.check(tol)
        w = self._where()
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        made_for = (
            f"it was made for {self.model_id or 'an unknown model'} "
            f"(recipe {self.recipe}, {self.num_layers} layers, {self.k_rotation.shape[1]} K "
            f"head(s), head_dim {self.head_dim})"
        )
        todo = (
            "calibrate one for this model (`oscar-sglang calibrate --model <model> --out DIR`), "
            "pick a matching file from `oscar-sglang zoo list`, or use the data-free "
            "`hadamard` recipe"
        )
        if model_id and self.model_id and not _same_model(model_id, self.model_id):
            if not allow_model_mismatch:
                raise RotationFileError(
                    f"{w} was calibrated for model {self.model_id!r} but the served model is "
                    f"{model_id!r}; {todo}. If you are sure the two models share their attention "
                    f"weights (e.g. a re-upload), override explicitly "
                    f"(allow_model_mismatch=True, or the server option that maps to it)."
                )
        if self.num_layers != num_layers:
            raise RotationFileError(
                f"{w}: the model has {num_layers} attention layers but {made_for}; {todo}"
            )
        if self.head_dim != head_dim:
            raise RotationFileError(
                f"{w}: the model's head_dim is {head_dim} but {made_for}; {todo}"
            )
        if self.v_head_dim != v_head_dim:
            raise RotationFileError(
                f"{w}: the model's V head_dim is {v_head_dim} but v_rotation is "
                f"{self.v_head_dim}x{self.v_head_dim}; {todo}"
            )
        for name, r in (("k_rotation", self.k_rotation), ("v_rotation", self.v_rotation)):
            if r.shape[1] not in (1, num_kv_heads):
                raise RotationFileError(
                    f"{w}: {name} has {r.shape[1]} heads but the model has {num_kv_heads} KV "
                    f"heads (expected 1 = shared, or {num_kv_heads}); {todo}"
                )

    # ------------------------------------------------------------------ slicing
    def for_rank(
        self, start_layer: int, end_layer: int, kv_head_start: int, num_local_kv_heads: int
    ) -> "RotationSet":
        """The part one (pipeline, tensor) parallel rank needs: layers [start_layer, end_layer),
        KV heads [kv_head_start, kv_head_start + num_local_kv_heads).

        A shared head axis (size 1) is kept as size 1: the one matrix applies to every local head.
        A per-head axis is sliced to the local heads. K and V are treated independently.
        """
        if not (0 <= start_layer < end_layer <= self.num_layers):
            raise RotationFileError(
                f"{self._where()}: layer range [{start_layer}, {end_layer}) is outside its "
                f"{self.num_layers} layers"
            )

        def heads(r: torch.Tensor) -> torch.Tensor:
            r = r[start_layer:end_layer]
            if r.shape[1] == 1:
                return r.clone()
            if kv_head_start < 0 or kv_head_start + num_local_kv_heads > r.shape[1]:
                raise RotationFileError(
                    f"{self._where()}: KV heads [{kv_head_start}, "
                    f"{kv_head_start + num_local_kv_heads}) are outside its {r.shape[1]} heads"
                )
            return r[:, kv_head_start:kv_head_start + num_local_kv_heads].clone()

        return replace(
            self,
            k_rotation=heads(self.k_rotation),
            v_rotation=heads(self.v_rotation),
            k_clip=self.k_clip[start_layer:end_layer].clone(),
            v_clip=self.v_clip[start_layer:end_layer].clone(),
            metadata={**self.metadata, "layer_offset": start_layer, "kv_head_offset": kv_head_start},
        )

    def per_head(self, num_kv_heads: int) -> "RotationSet":
        """Same rotations with an explicit head axis of size num_kv_heads (shared ones repeated)."""

        def expand(r: torch.Tensor, name: str) -> torch.Tensor:
            if r.shape[1] == num_kv_heads:
                return r.clone()
            if r.shape[1] == 1:
                return r.expand(-1, num_kv_heads, -1, -1).contiguous()
            raise RotationFileError(
                f"{self._where()}: {name} has {r.shape[1]} heads, cannot expand to {num_kv_heads}"
            )

        return replace(
            self,
            k_rotation=expand(self.k_rotation, "k_rotation"),
            v_rotation=expand(self.v_rotation, "v_rotation"),
            k_clip=self.k_clip.clone(),
            v_clip=self.v_clip.clone(),
        )


# ---------------------------------------------------------------------------- constructors


def default_metadata(recipe: str, num_layers: int, num_kv_heads: int, head_dim: int,
                     v_head_dim: int, **extra) -> dict:
    from .. import __version__

    md = {
        "format_version": FORMAT_VERSION,
        "recipe": recipe,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "v_head_dim": v_head_dim,
        "tool_version": f"oscar-sglang {__version__}",
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    md.update({k: v for k, v in extra.items() if v is not None})
    return md


def _constant_set(recipe, mat_k, mat_v, num_layers, num_kv_heads, **md) -> RotationSet:
    return RotationSet(
        k_rotation=mat_k.float().expand(num_layers, 1, -1, -1).contiguous(),
        v_rotation=mat_v.float().expand(num_layers, 1, -1, -1).contiguous(),
        k_clip=torch.ones(num_layers),
        v_clip=torch.ones(num_layers),
        metadata=default_metadata(recipe, num_layers, num_kv_heads, mat_k.shape[0],
                                  mat_v.shape[0], **md),
    )


def hadamard_rotation_set(num_layers: int, num_kv_heads: int, head_dim: int,
                          v_head_dim: int | None = None, **metadata) -> RotationSet:
    """OScaR's data-free "canalized" rotation: the orthonormal Sylvester Hadamard H_D for every
    layer and head (shared head axis), no clipping. head_dim must be a power of two."""
    from oscar_kernels.hadamard import hadamard

    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    try:
        hk, hv = hadamard(head_dim), hadamard(v_head_dim)
    except ValueError as e:
        raise RotationFileError(f"hadamard recipe: {e}; use --recipe oscar or identity") from e
    return _constant_set("hadamard", hk, hv, num_layers, num_kv_heads, **metadata)


def identity_rotation_set(num_layers: int, num_kv_heads: int, head_dim: int,
                          v_head_dim: int | None = None, **metadata) -> RotationSet:
    """No rotation (the naive INT2 baseline), no clipping."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    return _constant_set("identity", torch.eye(head_dim), torch.eye(v_head_dim), num_layers,
                         num_kv_heads, **metadata)


# ---------------------------------------------------------------------------- our file format


def save_rotation_file(rs: RotationSet, path) -> str:
    """Write ``rs`` as .safetensors; returns the file's sha256."""
    from safetensors.torch import save_file

    rs.check()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    md = {**rs.metadata, "format_version": FORMAT_VERSION}
    tensors = {
        "k_rotation": rs.k_rotation.contiguous(),
        "v_rotation": rs.v_rotation.contiguous(),
        "k_clip": rs.k_clip.contiguous(),
        "v_clip": rs.v_clip.contiguous(),
    }
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(md, sort_keys=True)})
    return sha256_file(path)


def load_rotation_file(path, v_path=None, check: bool = True) -> RotationSet:
    """Load our .safetensors rotation file, or an OSCAR fork K .pt (with optional V .pt).

    Runs the model-independent checks (call ``validate_for_model`` for the rest).
    """
    path = Path(path)
    if not path.is_file():
        raise RotationFileError(
            f"rotation file not found: {path}; run `oscar-sglang calibrate` or "
            f"`oscar-sglang zoo pull <model>`"
        )
    if path.suffix == ".pt":
        return load_oscar_pt(path, v_path, check=check)
    if v_path is not None:
        raise RotationFileError(
            f"{path}: a separate V file is only meaningful for OSCAR fork .pt files"
        )
    from safetensors import SafetensorError
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw_md = f.metadata() or {}
            names = set(f.keys())
            missing = {"k_rotation", "v_rotation", "k_clip", "v_clip"} - names
            if missing:
                raise RotationFileError(
                    f"rotation file {path} lacks tensors {sorted(missing)}: not an oscar-sglang "
                    f"rotation file (convert OSCAR .pt files with `oscar-sglang convert`)"
                )
            t = {n: f.get_tensor(n) for n in ("k_rotation", "v_rotation", "k_clip", "v_clip")}
    except SafetensorError as e:
        raise RotationFileError(f"rotation file {path} is not a readable safetensors file: {e}") from e
    try:
        md = json.loads(raw_md.get(METADATA_KEY, "{}"))
    except json.JSONDecodeError as e:
        raise RotationFileError(f"rotation file {path}: metadata is not valid JSON ({e})") from e
    if int(md.get("format_version", FORMAT_VERSION)) > FORMAT_VERSION:
        raise RotationFileError(
            f"rotation file {path} has format_version {md['format_version']}, newer than this "
            f"oscar-sglang understands ({FORMAT_VERSION}); upgrade oscar-sglang"
        )
    rs = RotationSet(**t, metadata=md, source=str(path), sha256=sha256_file(path))
    if check:
        rs.check()
    return rs


# ---------------------------------------------------------------------------- OSCAR fork .pt

OSCAR_K_OBJECTIVE = "qqt_r_h_pbr"
OSCAR_V_OBJECTIVE = "sst_r_h_pbr"


def _read_oscar_pt(path: Path) -> tuple[torch.Tensor, dict]:
    """-> (rotations [L, 1, D, D] float32, the file's dict)."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors have many types
        raise RotationFileError(
            f"{path}: cannot read as an OSCAR rotation .pt with torch.load(weights_only=True): {e}"
        ) from e
    if not isinstance(state, dict) or not isinstance(state.get("layers"), dict) or not state["layers"]:
        raise RotationFileError(
            f"{path}: not an OSCAR rotation file (expected a dict with a non-empty 'layers' "
            f"mapping layer_id -> {{'rotation': [D, D]}})"
        )
    layers = {int(k): v for k, v in state["layers"].items()}
    ids = sorted(layers)
    if ids != list(range(len(ids))):
        raise RotationFileError(f"{path}: layer ids must be 0..L-1, got {ids[:5]}...{ids[-3:]}")
    mats = []
    for i in ids:
        entry = layers[i]
        rot = entry.get("rotation") if isinstance(entry, dict) else None
        if not isinstance(rot, torch.Tensor) or rot.dim() != 2 or rot.shape[0] != rot.shape[1]:
            raise RotationFileError(f"{path}: layer {i} has no square 'rotation' matrix")
        mats.append(rot.float())
    if len({m.shape for m in mats}) != 1:
        raise RotationFileError(f"{path}: rotation matrices differ in size across layers")
    return torch.stack(mats).unsqueeze(1), state


def load_oscar_pt(k_path, v_path=None, check: bool = True, k_clip=None, v_clip=None) -> RotationSet:
    """Read the OSCAR fork's rotation files (K file, optional V file; without one, V is not
    rotated). Clip ratios: ours if the file was written by ``save_oscar_pt``, else the given
    ``k_clip``/``v_clip`` (float or per-layer list), else 1.0 (the fork sets them by env var)."""
    k_path = Path(k_path)
    kr, kstate = _read_oscar_pt(k_path)
    L = kr.shape[0]
    ours = kstate.get(METADATA_KEY) if isinstance(kstate.get(METADATA_KEY), dict) else {}
    md = json.loads(ours["metadata"]) if "metadata" in ours else {}
    if v_path is not None:
        vr, _ = _read_oscar_pt(Path(v_path))
        if vr.shape[0] != L:
            raise RotationFileError(
                f"OSCAR K file {k_path} has {L} layers but V file {v_path} has {vr.shape[0]}"
            )
    else:
        vr = torch.eye(kr.shape[-1]).expand(L, 1, -1, -1).contiguous()
        md.setdefault("v_rotation_note", "no V file given: V not rotated")

    def clips(given, key):
        if given is not None:
            c = torch.as_tensor(given, dtype=torch.float32).reshape(-1)
            return c.expand(L).clone() if c.numel() == 1 else c
        if key in ours:
            return torch.as_tensor(ours[key], dtype=torch.float32)
        return torch.ones(L)

    md.setdefault("recipe", "oscar")
    md.setdefault("num_layers", L)
    md.setdefault("head_dim", kr.shape[-1])
    md.setdefault("v_head_dim", vr.shape[-1])
    md.setdefault("converted_from", "OSCAR fork .pt (" + str(kstate.get("objective", "?")) + ")")
    sha = sha256_file(k_path)
    rs = RotationSet(kr, vr, clips(k_clip, "k_clip"), clips(v_clip, "v_clip"), metadata=md,
                     source=str(k_path), sha256=sha)
    if check:
        rs.check()
    return rs


def save_oscar_pt(rs: RotationSet, k_path, v_path) -> None:
    """Write ``rs`` in the OSCAR fork's layout (one shared [D, D] matrix per layer, row-vector
    convention, int layer keys). The fork has no per-head rotations: per-head sets are refused.
    Our clips and metadata ride along under an extra key that the fork's loader ignores."""
    rs.check()
    for name, r in (("k_rotation", rs.k_rotation), ("v_rotation", rs.v_rotation)):
        if r.shape[1] != 1:
            raise RotationFileError(
                f"{name} has {r.shape[1]} per-head matrices, but the OSCAR fork's .pt layout holds "
                f"one matrix per layer shared by all heads; calibrate with --share-heads"
            )
    extra = {
        "k_clip": rs.k_clip.tolist(),
        "v_clip": rs.v_clip.tolist(),
        "metadata": json.dumps(rs.metadata, sort_keys=True),
    }
    for path, r, objective in ((k_path, rs.k_rotation, OSCAR_K_OBJECTIVE),
                               (v_path, rs.v_rotation, OSCAR_V_OBJECTIVE)):
        layers = {i: {"layer_id": i, "rotation": r[i, 0].clone()} for i in range(r.shape[0])}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format_version": 1, "objective": objective, "source_grouping": "layer",
                    "layers": layers, METADATA_KEY: extra}, str(path))
