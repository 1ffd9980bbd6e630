"""Fold each layer's V rotation into the model's weights at load, so no V rotation runs per step.

The backend stores v' = v R_v (per KV head h) and un-rotates the attention output o = o' R_v^T.
Both sit next to linear layers, so they can live in the weights instead (nn.Linear: y = x W^T):

    W_v[rows of h]           <- R_v[h]^T W_v[rows of h]      b_v[h] <- b_v[h] R_v[h]
    W_o[:, cols of q head j] <- W_o[:, cols of j] R_v[h(j)]   (h(j) = j // (Hq / Hkv))

Then qkv_proj produces rotated values and o_proj consumes rotated outputs: exact up to rounding
the new weights to their dtype. It applies to every attention module with SGLang's fused
`qkv_proj` ([q | k | v] rows, this rank's heads) and `o_proj` (this rank's q-head columns),
both unquantised; anything else keeps the runtime rotation, and `reason` says why.
"""
from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def attention_modules(model) -> list:
    """Modules holding an `attn` (RadixAttention: layer_id, tp head counts, head dims) with
    `qkv_proj` and `o_proj`, in layer order."""
    found = []
    for m in model.modules():
        a = getattr(m, "attn", None)
        if a is None or not hasattr(a, "layer_id") or not hasattr(a, "tp_k_head_num"):
            continue
        if hasattr(m, "qkv_proj") and hasattr(m, "o_proj"):
            found.append(m)
    return sorted(found, key=lambda m: m.attn.layer_id)


def _unsupported(m) -> str | None:
    a = m.attn
    Hq, Hkv, D, Dv = a.tp_q_head_num, a.tp_k_head_num, a.qk_head_dim, a.v_head_dim
    for name in ("qkv_proj", "o_proj"):
        lin = getattr(m, name)
        qm = getattr(lin, "quant_method", None)
        if qm is not None and type(qm).__name__ != "UnquantizedLinearMethod":
            return f"layer {a.layer_id}: {name} is quantised ({type(qm).__name__})"
        w = getattr(lin, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dtype not in _FLOAT_DTYPES or w.dim() != 2:
            return f"layer {a.layer_id}: {name} has no plain floating-point weight"
    if m.qkv_proj.weight.shape[0] != Hq * D + Hkv * D + Hkv * Dv:
        return f"layer {a.layer_id}: qkv_proj rows are not [q | k | v] for {Hq} q / {Hkv} KV heads"
    if m.o_proj.weight.shape[1] != Hq * Dv:
        return f"layer {a.layer_id}: o_proj has {m.o_proj.weight.shape[1]} inputs, not {Hq} x {Dv}"
    if Hq % Hkv:
        return f"layer {a.layer_id}: {Hq} q heads are not a multiple of {Hkv} KV heads"
    return None


@torch.no_grad()
def _absorb_layer(m, R: torch.Tensor) -> None:
    """R [Hkv, Dv, Dv] (or [1, Dv, Dv], shared) in float32, this rank's KV heads of this layer."""
    a = m.attn
    Hq, Hkv, D, Dv = a.tp_q_head_num, a.tp_k_head_num, a.qk_head_dim, a.v_head_dim
    R = R.to(device=m.qkv_proj.weight.device, dtype=torch.float32).expand(Hkv, Dv, Dv)
    W = m.qkv_proj.weight
    v0 = (Hq + Hkv) * D
    wv = W.data[v0:v0 + Hkv * Dv].float().view(Hkv, Dv, -1)
    W.data[v0:v0 + Hkv * Dv] = torch.einsum("hde,hdk->hek", R, wv).reshape(Hkv * Dv, -1).to(W.dtype)
    b = getattr(m.qkv_proj, "bias", None)
    if isinstance(b, torch.Tensor):
        bv = b.data[v0:v0 + Hkv * Dv].float().view(Hkv, Dv)
        b.data[v0:v0 + Hkv * Dv] = torch.einsum("hd,hde->he", bv, R).reshape(-1).to(b.dtype)
    Wo = m.o_proj.weight
    wo = Wo.data.float().view(Wo.shape[0], Hkv, Hq // Hkv, Dv)
    Wo.data.copy_(torch.einsum("nhgd,hde->nhge", wo, R).reshape(Wo.shape).to(Wo.dtype))


def absorb_v_rotations(model, v_rotation: torch.Tensor, start_layer: int) -> tuple[list[int], str | None]:
    """Fold v_rotation [L_local, H_local or 1, Dv, Dv] into every attention module of `model`.

    All or nothing: -> (absorbed global layer ids, None), or ([], why none was changed).
    """
    mods = attention_modules(model)
    if not mods:
        return [], "no attention module with qkv_proj / o_proj found (model layout not recognised)"
    L = v_rotation.shape[0]
    ids = [m.attn.layer_id for m in mods]
    expected = list(range(start_layer, start_layer + L))
    if ids != expected:
        return [], f"attention layers {ids[:4]}... do not match this rank's layers {expected[:4]}..."
    for m in mods:
        why = _unsupported(m)
        if why is None and v_rotation.shape[1] not in (1, m.attn.tp_k_head_num):
            why = f"layer {m.attn.layer_id}: {v_rotation.shape[1]} V rotations for {m.attn.tp_k_head_num} KV heads"
        if why is not None:
            return [], why
    for m in mods:
        _absorb_layer(m, v_rotation[m.attn.layer_id - start_layer])
    return ids, None
