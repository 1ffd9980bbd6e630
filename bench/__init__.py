"""Benchmark harnesses: run each from the project root as `python -m bench.<name> ...`.

Scripts import their shared helpers (the `_`-prefixed modules: results documents, the server
launcher, CUDA-graph timing, serving client/report) as `from bench import ...`; `oscar_sglang` and
`oscar_kernels` come from the installed package (`pip install -e .`).
"""
