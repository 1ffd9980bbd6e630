"""Offline tools: calibration, evaluation, the rotation zoo and the `oscar-sglang` CLI.
They may import oscar_sglang.common and oscar_sglang.runtime; never the other way round."""
