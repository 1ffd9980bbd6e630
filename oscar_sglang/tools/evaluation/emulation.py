"""Emulate the INT2 KV cache inside a transformers model (any model using AttentionInterface).

transformers 5.x routes attention through ``AttentionInterface`` with post-RoPE q, k, v. We
register one function, ``oscar_kv_emulation``, and switch a loaded model to it inside
``emulate_kv_cache(model, config)``. For query position t and key position j it reads

    BF16 copy  iff  j < sink  or  j > t - recent        (the served sink + recent windows)
    INT2 copy  otherwise (j <= t, causal)

which is exactly what a decode step at position t sees, so one teacher-forced forward pass
emulates a whole generation. Rotations are applied per layer and KV head (q and k by R_k, v by
R_v, the output un-rotated by R_v^T); everything is computed in float32, queries in chunks so
an 8K window stays within memory.

With ``EmulationConfig.kv_format`` (an oscar_kernels.format.KVFormat) the INT2 copies are the
format's body (oscar_kernels.reference.format_fake_quant: per-channel key blocks aligned to
position 0, K / V bits per layer, token-norm) and sink / recent are the format's; the recipe
then only supplies the rotations.

With ``EmulationConfig.key_dot = "int8"`` (a study of a kernel not built: format names ending in
``+q8`` in the format study) the per-channel body keys are scored as an int8 tensor-core decode
would score them: per query row and key block, q * s rounded to int8 with one scale (its largest
magnitude / 127), times the integer codes, plus q . m in float (``int8_key_scores``).

With ``EmulationConfig.kv_format`` a ``CastKV`` (e.g. ``FP8_E4M3``) the cache is a plain dtype
cast at every position (SGLang's ``--kv-cache-dtype fp8_e4m3`` without checkpoint scales): sink
and ring are 0, so every key a query reads (causal) is the cast copy; the recipe must not rotate.

Only unpadded sequences are supported (we build the causal mask ourselves; positions of the
queries are the last Tq of the Lk keys, which also covers generation with a KV cache).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from oscar_kernels.reference import format_fake_quant, quantize_key_blocks, unpack_bits

from .quantizers import channel_groups, token_groups
from .recipes import Recipe

ATTN_NAME = "oscar_kv_emulation"
KEY_DOTS = ("float", "int8")


@dataclass(frozen=True)
class CastKV:
    """A KV cache that stores K and V as a plain cast to ``dtype``, at every position.

    SGLang's ``--kv-cache-dtype fp8_e4m3`` on a checkpoint without KV scales: set_kv_buffer
    stores ``cache_k.to(torch.float8_e4m3fn)`` (scale 1.0, the post-RoPE K and V as the model
    computes them, no rotation) and the attention kernels read it back with descale 1.0. No BF16
    sink or ring (``sink = window = 0``): every key a query reads, its own included, is the cast
    copy. Duck-types the KVFormat fields the format study reads (name, sink, window, rotation,
    body_bits_per_element, bytes_per_token).
    """

    name: str
    dtype: torch.dtype
    bits: int
    sink: int = 0
    window: int = 0
    rotation: str = "none"

    def body_bits_per_element(self, num_layers: int | None = None) -> float:
        return float(self.bits)

    def bytes_per_token(self, num_kv_heads: int, layer: int = 0, num_layers: int | None = None,
                        head_dim: int | None = None) -> float:
        if head_dim is None:
            raise ValueError(f"{self.name}: bytes_per_token needs head_dim")
        return num_kv_heads * 2 * head_dim * self.bits / 8

    def cast(self, x: torch.Tensor) -> torch.Tensor:
        """x -> what the cache reads back (float32): ``x.to(dtype)`` then back, as SGLang's
        store and load do with scale 1.0 (torch's cast: round to nearest even; out of the
        dtype's range gives NaN for float8_e4m3fn, as on the server)."""
        return x.to(self.dtype).to(torch.float32 if x.dtype != torch.float64 else torch.float64)


FP8_E4M3 = CastKV("fp8_e4m3", torch.float8_e4m3fn, 8)
CAST_FORMATS = {FP8_E4M3.name: FP8_E4M3}


@dataclass
class EmulationConfig:
    recipe: Recipe
    rotations: object  # oscar_sglang.common.rotations.RotationSet, [L, Hk, D, D] (recipes.build_rotations)
    group_size: int = 64
    sink: int | None = None  # default 64 (the format's sink with kv_format)
    recent: int | None = None  # default 256 (the format's window with kv_format)
    hp_dtype: torch.dtype = torch.bfloat16  # dtype of the BF16 side buffers (float32: exact)
    # True: a multi-token forward without cache (a prefill) reads BF16 only, as the server does;
    # False: teacher forcing, every query reads its decode-time mix (the fidelity protocol).
    prefill_bf16: bool = False
    query_chunk: int = 512
    kv_format: object | None = None  # oscar_kernels.format.KVFormat: emulate it exactly
    # Decode-loop memo (kv_format only): layer -> quantised prefix of the previous call, reused
    # when the keys extend it (one request at a time; a fresh dict per request).
    memo: dict | None = None
    # how a query scores the quantised body keys: "float" (q . dequantised keys, what the served
    # kernels compute up to their rounding) or "int8" (int8_key_scores; per-channel keys only)
    key_dot: str = "float"

    def __post_init__(self):
        f = self.kv_format
        if self.key_dot not in KEY_DOTS:
            raise ValueError(f"key_dot must be one of {KEY_DOTS}, got {self.key_dot!r}")
        if self.key_dot != "float" and getattr(f, "k_layout", None) != "channel":
            raise ValueError(f"key_dot={self.key_dot!r} needs a per-channel key format, got "
                             f"{getattr(f, 'name', f)}")
        if f is None:
            self.sink = 64 if self.sink is None else self.sink
            self.recent = 256 if self.recent is None else self.recent
            return
        for name, mine, theirs in (("sink", self.sink, f.sink), ("recent", self.recent, f.window)):
            if mine is not None and mine != theirs:
                raise ValueError(f"{name}={mine} contradicts the format {f.name} ({theirs})")
        self.sink, self.recent = f.sink, f.window
        if isinstance(f, CastKV):
            if self.recipe.rotation != "identity":
                raise ValueError(f"{f.name} stores K and V unrotated: the recipe's rotation must be "
                                 f"identity, not {self.recipe.rotation!r}")
            self.memo = None  # a cast is cheap and position-wise: nothing to memoise


def int8_key_scores(qr: torch.Tensor, kr: torch.Tensor, cfg: EmulationConfig, layer: int) -> torch.Tensor:
    """Body scores of rotated queries qr [B, Hk, g, Tq, D] against rotated keys kr [B, Hk, Lk, D]
    as an int8 key-side MMA would compute them: for every query row and complete key block,
    a = q * s (s: the block's per-channel scales) is rounded to int8 with one scale
    alpha = max|a| / 127, and the score is alpha * (a / alpha rounded) . code + q . m (the mins
    term in float). Positions past the last complete block get 0 (they are never body reads).
    Returns [B, Hk, g, Tq, Lk] (unscaled logits, like q @ k^T)."""
    f = cfg.kv_format
    B, Hk, g, Tq, D = qr.shape
    Lk = kr.shape[2]
    bits, _ = f.layer_bits(layer, cfg.rotations.k_rotation.shape[0])
    clip = float(cfg.rotations.k_clip[layer]) if f.k_clip else 1.0
    out = torch.zeros(B, Hk, g, Tq, Lk, device=qr.device)
    for b in range(B):  # one request at a time: blocks start at its position 0
        codes, params, norms = quantize_key_blocks(kr[b].transpose(0, 1), bits, f.k_group, f.token_norm, clip)
        n = params.shape[0]
        if n == 0:
            continue
        c = unpack_bits(codes, bits).float().reshape(n, f.k_group, Hk, D).permute(2, 0, 1, 3)  # [Hk, n, blk, D]
        sc = params[..., 0].float().permute(1, 0, 2)  # [Hk, n, D]
        mn = params[..., 1].float().permute(1, 0, 2)
        q = qr[b].float()  # [Hk, g, Tq, D]
        a = q.unsqueeze(-2) * sc[:, None, None]  # [Hk, g, Tq, n, D]
        alpha = a.abs().amax(-1, keepdim=True) / 127.0
        a8 = torch.round(a / torch.where(alpha > 0, alpha, 1.0)).clamp(-127, 127) * alpha
        s = torch.einsum("hgtnd,hnkd->hgtnk", a8, c) + torch.einsum("hgtd,hnd->hgtn", q, mn)[..., None]
        s = s.reshape(Hk, g, Tq, n * f.k_group)
        if norms is not None:  # token-norm keys: the block's codes are of k / |k|
            s = s * norms.float().transpose(0, 1)[:, None, None, :]
        out[b, ..., : n * f.k_group] = s
    return out


def int2_mask(q_pos: torch.Tensor, kv_len: int, sink: int, recent: int) -> torch.Tensor:
    """[Tq, Lk] bool: True where query at position q_pos[i] reads key j from its INT2 copy."""
    j = torch.arange(kv_len, device=q_pos.device).view(1, -1)
    t = q_pos.view(-1, 1)
    return (j >= sink) & (j <= t - recent)


def quantized_kv(kr: torch.Tensor, vr: torch.Tensor, cfg: EmulationConfig, layer: int):
    """Rotated K, V [B, Hk, L, D] -> what their INT2 (or INT4) copies read back as."""
    r, G = cfg.recipe, cfg.group_size
    if isinstance(cfg.kv_format, CastKV):
        kq, vq = cfg.kv_format.cast(kr), cfg.kv_format.cast(vr)
        if not r.quantize_k:
            kq = kr.to(cfg.hp_dtype).float()
        if not r.quantize_v:
            vq = vr.to(cfg.hp_dtype).float()
        return kq, vq
    if cfg.kv_format is not None:
        return _format_kv(kr, vr, cfg, layer)
    if r.k_layout == "channel":
        if cfg.recent < G:  # a token group must be complete before its first INT2 read
            raise ValueError(f"per-channel K needs recent >= group size ({cfg.recent} < {G})")
        kq = channel_groups(kr, G, start=cfg.sink, levels=r.levels, token_scale=r.token_scale)
    else:
        kq = token_groups(kr, G, r.levels, float(cfg.rotations.k_clip[layer]))
    vq = token_groups(vr, G, r.levels, float(cfg.rotations.v_clip[layer]))
    if not r.quantize_k:  # ablations: the other tensor reads its BF16 copy everywhere
        kq = kr.to(cfg.hp_dtype).float()
    if not r.quantize_v:
        vq = vr.to(cfg.hp_dtype).float()
    return kq, vq


def _format_kv(kr: torch.Tensor, vr: torch.Tensor, cfg: EmulationConfig, layer: int):
    """kv_format body of K, V [B, Hk, L, D]: the reference applied per request (positions from 0).

    Both the per-token rows and the complete per-channel blocks never change once written, so
    with a memo only positions past the memo's (block-aligned) prefix are quantised again.
    """
    f, rs = cfg.kv_format, cfg.rotations
    n_layers = rs.k_rotation.shape[0]
    kclip = float(rs.k_clip[layer]) if f.k_clip else 1.0
    vclip = float(rs.v_clip[layer]) if f.v_clip else 1.0
    B, L = kr.shape[0], kr.shape[2]
    start, prev = 0, None
    if cfg.memo is not None and B == 1 and layer in cfg.memo:
        prev = cfg.memo[layer]
        n = prev["n"]
        if n <= L and torch.equal(kr[:, :, :n], prev["k"]) and torch.equal(vr[:, :, :n], prev["v"]):
            start = n
        else:
            prev = None
    kq = torch.empty_like(kr)
    vq = torch.empty_like(vr)
    if start:
        kq[:, :, :start], vq[:, :, :start] = prev["kq"], prev["vq"]
    for b in range(B):  # one request at a time: blocks start at its position 0
        k = kr[b, :, start:].transpose(0, 1)
        v = vr[b, :, start:].transpose(0, 1)
        kq[b, :, start:] = format_fake_quant(k, f, "k", layer, n_layers, kclip).transpose(0, 1)
        vq[b, :, start:] = format_fake_quant(v, f, "v", layer, n_layers, vclip).transpose(0, 1)
    if cfg.memo is not None and B == 1:
        # keep only what is final: complete blocks (channel keys) / every row (token layout)
        n = L // f.k_group * f.k_group if f.k_layout == "channel" else L
        if prev is None or prev["n"] != n:
            cfg.memo[layer] = {"n": n, "k": kr[:, :, :n].clone(), "v": vr[:, :, :n].clone(),
                               "kq": kq[:, :, :n].clone(), "vq": vq[:, :, :n].clone()}
    if not cfg.recipe.quantize_k:
        kq = kr.to(cfg.hp_dtype).float()
    if not cfg.recipe.quantize_v:
        vq = vr.to(cfg.hp_dtype).float()
    return kq, vq


def emulated_attention(q, k, v, scaling: float, layer: int, cfg: EmulationConfig):
    """q [B, Hq, Tq, D], k/v [B, Hk, Lk, D] (post-RoPE) -> attention output [B, Tq, Hq, D]."""
    B, Hq, Tq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    g = Hq // Hk
    Rk = cfg.rotations.k_rotation[layer].to(q.device, torch.float32)  # [Hk, D, D]
    Rv = cfg.rotations.v_rotation[layer].to(q.device, torch.float32)
    kr = torch.einsum("bhtd,hde->bhte", k.float(), Rk)
    vr = torch.einsum("bhtd,hde->bhte", v.float(), Rv)
    qr = torch.einsum("bhgtd,hde->bhgte", q.float().reshape(B, Hk, g, Tq, D), Rk)
    k_hp = kr.to(cfg.hp_dtype).float().unsqueeze(2)  # [B, Hk, 1, Lk, D]
    v_hp = vr.to(cfg.hp_dtype).float().unsqueeze(2)
    q_pos = torch.arange(Lk - Tq, Lk, device=q.device)
    quantize = cfg.recipe.quantize and not (cfg.prefill_bf16 and Tq > 1 and Tq == Lk)
    if quantize:
        kq, vq = quantized_kv(kr, vr, cfg, layer)
        kq, vq = kq.unsqueeze(2), vq.unsqueeze(2)
    kv_pos = torch.arange(Lk, device=q.device)
    out = torch.empty(B, Hk, g, Tq, D, device=q.device)
    for s in range(0, Tq, cfg.query_chunk):
        qc, pos = qr[:, :, :, s : s + cfg.query_chunk], q_pos[s : s + cfg.query_chunk]
        causal = kv_pos.view(1, -1) <= pos.view(-1, 1)
        scores = qc @ k_hp.transpose(-1, -2)
        m2 = int2_mask(pos, Lk, cfg.sink, cfg.recent) if quantize else None
        if m2 is not None and m2.any():
            body = (qc @ kq.transpose(-1, -2) if cfg.key_dot == "float"
                    else int8_key_scores(qc, kr, cfg, layer))
            scores = torch.where(m2, body, scores)
        p = torch.softmax((scores * scaling).masked_fill(~causal, float("-inf")), dim=-1)
        if m2 is not None and m2.any():
            o = torch.where(m2, 0.0, p) @ v_hp + torch.where(m2, p, 0.0) @ vq
        else:
            o = p @ v_hp
        out[:, :, :, s : s + cfg.query_chunk] = o
    out = torch.einsum("bhgte,hde->bhgtd", out, Rv)  # un-rotate: o @ R_v^T
    return out.reshape(B, Hq, Tq, D).transpose(1, 2).contiguous().to(q.dtype)


_ACTIVE: EmulationConfig | None = None


def _attention_interface_fn(module, query, key, value, attention_mask, scaling=None,
                            dropout=0.0, **kwargs):
    if _ACTIVE is None:
        raise RuntimeError(f"{ATTN_NAME} called outside emulate_kv_cache()")
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise NotImplementedError("KV-cache emulation does not support sliding-window layers")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return emulated_attention(query, key, value, scaling, module.layer_idx, _ACTIVE), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention_interface_fn)


@contextlib.contextmanager
def emulate_kv_cache(model, cfg: EmulationConfig):
    """Run ``model`` with the emulated KV cache inside the block (restores its attention after)."""
    global _ACTIVE
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    _ACTIVE = cfg
    try:
        yield model
    finally:
        _ACTIVE = None
        model.set_attn_implementation(previous)
