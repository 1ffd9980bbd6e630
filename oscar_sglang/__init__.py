"""oscar-sglang: an INT2 KV cache for stock SGLang 0.5.17, loaded as a plugin.

Three parts (imports only go downwards; `tests/test_structure.py` checks it):

    runtime/  what the sglang.srt.plugins entry point loads into the server: hooks, config,
              the pool, the attention backend, sizing, refusals, server info, metrics
    tools/    offline: calibration, evaluation (fidelity, NIAH), the rotation zoo, the CLI
    common/   what both use: the rotation file format and loading, the embedded model's names

tools -> runtime -> common -> oscar_kernels; tools -> common. The runtime never imports tools.
"""
__version__ = "0.1.0"
