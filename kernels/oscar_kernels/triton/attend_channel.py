"""Deprecated module name, kept so that `from oscar_kernels.triton.attend_channel import
PLANES_MIN_DIM` (the runtime's start-up check of the removed kernel switches) still imports;
the per-channel kernels are channel_attend / channel_decode / channel_extend. Remove it once
nothing imports it."""
from .channel_decode import PLANES_MIN_DIM

__all__ = ["PLANES_MIN_DIM"]
