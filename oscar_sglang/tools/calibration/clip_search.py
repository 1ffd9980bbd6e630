"""Attention-output error of a rotation set on held-out tokens, and the per-layer clip search.

Error of one layer = sum ||o - o_ref||^2 / sum ||o_ref||^2 over the held-out samples, where
o_ref = exact attention of the last Tq queries over all T keys (causal), and o = the same
attention with K and/or V read back from INT2 (oscar_kernels.reference.fake_quant) after
rotation. The first `sink` positions stay exact, as the server keeps them in the high-precision
sink buffer; every other key is INT2 (the recent window is ignored: this measures what INT2
storage costs).

The search calls attention dozens of times per layer, so it uses a float32 batched-matmul
attention (`probs`/`apply_probs`, checked against the float64 oscar_kernels.reference.attention
in tests/tools/test_calibration.py) and reuses the exact attention probabilities when only V changes.
"""
from __future__ import annotations

import math

import torch
from oscar_kernels.format import Int2Format, clip_index
from oscar_kernels.reference import fake_quant

DEFAULT_CLIP_GRID = (1.0, 0.98, 0.96, 0.94, 0.92, 0.90, 0.88, 0.85, 0.80, 0.75, 0.70, 0.65, 0.60)


def probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) with GQA, the queries being the LAST Tq positions.

    q [Tq, Hq, D], k [T, Hkv, D] -> P [Hq, Tq, T] float32 (query head j reads KV head j // g).
    """
    Tq, Hq, D = q.shape
    T, Hkv, _ = k.shape
    g = Hq // Hkv
    s = torch.matmul(q.float().transpose(0, 1), k.float().repeat_interleave(g, 1).permute(1, 2, 0))
    s = s * (1.0 / math.sqrt(D))
    qi = torch.arange(Tq).view(-1, 1) + (T - Tq)
    s = s.masked_fill(torch.arange(T).view(1, -1) > qi, float("-inf"))
    return torch.softmax(s, dim=-1)


def apply_probs(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P [Hq, Tq, T], v [T, Hkv, Dv] -> o [Tq, Hq, Dv]."""
    g = p.shape[0] // v.shape[1]
    return torch.matmul(p, v.float().repeat_interleave(g, 1).transpose(0, 1)).transpose(0, 1)


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] @ r [H or 1, D, D] per head."""
    return torch.matmul(x.transpose(0, 1), r).transpose(0, 1)


def _int2(x: torch.Tensor, fmt: Int2Format, clip: float, sink: int) -> torch.Tensor:
    xq = fake_quant(x, fmt, clip)
    xq[:sink] = x[:sink]
    return xq


class LayerEvaluator:
    """Held-out samples of one layer with their exact attention precomputed."""

    def __init__(self, samples, fmt: Int2Format, sink: int = 64):
        self.samples, self.fmt, self.sink = samples, fmt, sink
        self.p_ref = [probs(s.q, s.k) for s in samples]
        self.o_ref = [apply_probs(p, s.v) for p, s in zip(self.p_ref, samples)]

    def error(self, rk=None, rv=None, k_clip=1.0, v_clip=1.0) -> float:
        """Relative output error with K quantised (if rk given) and/or V quantised (if rv given)."""
        num = den = 0.0
        for s, p, ref in zip(self.samples, self.p_ref, self.o_ref):
            if rk is not None:
                g = s.q.shape[1] // s.k.shape[1]
                rq = rk.repeat_interleave(g, 0) if rk.shape[0] > 1 else rk
                p = probs(_rotate(s.q, rq), _int2(_rotate(s.k, rk), self.fmt, k_clip, self.sink))
            v = s.v
            if rv is not None:
                v = _rotate(_int2(_rotate(v, rv), self.fmt, v_clip, self.sink), rv.transpose(1, 2))
            o = apply_probs(p, v)
            num += float(((o - ref).double() ** 2).sum())
            den += float((ref.double() ** 2).sum())
        return num / max(den, 1e-300)

    def search(self, r: torch.Tensor, which: str, grid=DEFAULT_CLIP_GRID):
        """Best clip ratio for K (which="k", V exact) or V (which="v", K exact).

        Ratios that give the same clip index are evaluated once; ties keep the larger ratio
        (less clipping). Returns (best ratio, {ratio: error}).
        """
        seen, errs = {}, {}
        for ratio in sorted(set(grid), reverse=True):
            idx = clip_index(ratio, self.fmt.group_size)
            if idx not in seen:
                kw = {"rk": r, "k_clip": ratio} if which == "k" else {"rv": r, "v_clip": ratio}
                seen[idx] = self.error(**kw)
            errs[ratio] = seen[idx]
        best = min(errs, key=lambda c: (errs[c], -c))
        return best, errs
