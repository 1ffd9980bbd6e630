"""Capture post-RoPE Q, K, V (and attention outputs) of every layer of a transformers model.

Model-agnostic: transformers (>= 4.48, incl. 5.x) attention modules call the function registered
under ``config._attn_implementation`` in ``AttentionInterface`` with
``(module, query [B, Hq, T, D], key [B, Hkv, T, D], value [B, Hkv, T, Dv], attention_mask, ...)``
*after* RoPE (and after any QK-norm). We register ``"oscar_capture"``, which hands the tensors to
the active ``Capture`` and then runs the stock SDPA implementation, so the model's output is
unchanged and no model-specific code is needed.

The capture keeps only float64 running sums (never all activations) plus, for a few held-out
sequences, a small sample used by the clip search.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

CAPTURE_IMPL = "oscar_capture"
_ACTIVE: "Capture | None" = None


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if _ACTIVE is not None:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise RuntimeError(
                f"{type(module).__name__} has no layer_idx: cannot tell which layer is being "
                f"captured; this architecture is not supported by `calibrate`"
            )
        _ACTIVE.observe(int(layer), query, key, value, out, attention_mask)
    return out, weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(CAPTURE_IMPL, _capture_attention)
    # Same masks as SDPA (causal, sliding window...), built by transformers.
    ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE_IMPL, sdpa_mask)


@dataclass
class LayerStats:
    """Float64 running sums of one layer (per KV head)."""

    qq: torch.Tensor  # [Hkv, D, D]   sum over tokens and the query heads of the group of q q^T
    oo: torch.Tensor  # [Hkv, Dv, Dv] same for the attention outputs o = softmax(q K^T) V
    n: int = 0  # tokens x query heads per group


@dataclass
class Sample:
    """Held-out post-RoPE tensors of one sequence and layer (float32, CPU)."""

    q: torch.Tensor  # [Tq, Hq, D]  the last Tq query positions
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, Dv]


@dataclass
class Capture:
    """Accumulates statistics (mode "stats") or keeps samples (mode "sample")."""

    sample_queries: int = 256
    mode: str = "stats"
    stats: dict = field(default_factory=dict)  # layer -> LayerStats
    samples: dict = field(default_factory=dict)  # layer -> list[Sample]
    shapes: dict = field(default_factory=dict)  # layer -> (Hq, Hkv, D, Dv)

    def observe(self, layer, query, key, value, out, attention_mask) -> None:
        B, Hq, T, D = query.shape
        Hkv, Dv = key.shape[1], value.shape[-1]
        if B != 1:
            raise RuntimeError("calibration feeds one sequence at a time (batch size 1)")
        self.shapes[layer] = (Hq, Hkv, D, Dv)
        g = Hq // Hkv
        with torch.no_grad():
            if self.mode == "stats":
                # Query heads j*g .. j*g+g-1 read KV head j (GQA), the same grouping as
                # oscar_kernels.reference.attention.
                q = query[0].reshape(Hkv, g * T, D).double()
                o = out[0].transpose(0, 1).reshape(Hkv, g * T, Dv).double()
                st = self.stats.get(layer)
                if st is None:
                    st = self.stats[layer] = LayerStats(
                        torch.zeros(Hkv, D, D, dtype=torch.float64, device=q.device),
                        torch.zeros(Hkv, Dv, Dv, dtype=torch.float64, device=q.device),
                    )
                st.qq += q.transpose(1, 2) @ q
                st.oo += o.transpose(1, 2) @ o
                st.n += g * T
            else:
                tq = min(self.sample_queries, T)
                self.samples.setdefault(layer, []).append(
                    Sample(
                        q=query[0, :, T - tq:].transpose(0, 1).float().cpu().clone(),
                        k=key[0].transpose(0, 1).float().cpu().clone(),
                        v=value[0].transpose(0, 1).float().cpu().clone(),
                    )
                )


@contextmanager
def capturing(model, capture: Capture):
    """Route the model's attention through the capture for the duration of the block."""
    global _ACTIVE
    _register()
    before = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_IMPL)
    if model.config._attn_implementation != CAPTURE_IMPL:
        raise RuntimeError(
            f"{type(model).__name__} does not dispatch attention through transformers' "
            f"AttentionInterface, so its post-RoPE Q/K/V cannot be captured"
        )
    _ACTIVE = capture
    try:
        yield capture
    finally:
        _ACTIVE = None
        model.set_attn_implementation(before)


def run_sequences(model, sequences, capture: Capture, mode: str, desc: str, progress=True):
    """Feed token sequences (lists of ids) one by one through the model body (no LM head)."""
    from tqdm.auto import tqdm

    capture.mode = mode
    body = getattr(model, "base_model", model)  # skip the LM head: we only need attention
    device = next(model.parameters()).device
    with capturing(model, capture), torch.inference_mode():
        for ids in tqdm(sequences, desc=desc, unit="seq", disable=not progress):
            body(input_ids=torch.tensor([ids], device=device), use_cache=False)
    return capture
