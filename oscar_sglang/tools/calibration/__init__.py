"""Offline calibration of KV rotations and clip ratios for any transformers causal LM.

    from oscar_sglang.tools.calibration import CalibrationConfig, calibrate
    rs, path = calibrate(CalibrationConfig(model="smollm2", out="rotations/"))

Steps (recipe "oscar"): tokenize the texts into sequences; split off a few held-out sequences;
run the others through the model capturing post-RoPE Q/K and attention outputs (capture.py),
accumulating float64 covariances; eigen-decompose into rotations (recipes.py); choose each
layer's K and V clip ratio on the held-out sequences (clip_search.py); save (rotations.py).
Recipes "hadamard" and "identity" need no data (their clips are 1.0 unless search_clip=True).
"""
from __future__ import annotations

from .pipeline import CalibrationConfig, calibrate, model_dims

__all__ = ["CalibrationConfig", "calibrate", "model_dims"]
