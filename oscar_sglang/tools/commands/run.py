"""`oscar-sglang run MODULE [args]`: run an SGLang module with the plugin loaded first.

Some SGLang entry points parse `--kv-cache-dtype` before loading plugins (bench_one_batch,
bench_offline_throughput, ...), so "int2" is rejected there. This loads the plugins (hooks
applied), then runs the module as `python -m MODULE args`.
Short names: one_batch, offline_throughput, one_batch_server, serving (sglang.benchmark.*),
bench_one_batch, bench_offline_throughput, bench_serving (sglang.*).
"""
from __future__ import annotations

import argparse
import sys

ALIASES = {
    "one_batch": "sglang.benchmark.one_batch",
    "offline_throughput": "sglang.benchmark.offline_throughput",
    "one_batch_server": "sglang.benchmark.one_batch_server",
    "serving": "sglang.benchmark.serving",
    "bench_one_batch": "sglang.bench_one_batch",
    "bench_offline_throughput": "sglang.bench_offline_throughput",
    "bench_one_batch_server": "sglang.bench_one_batch_server",
    "bench_serving": "sglang.bench_serving",
}


def resolve(module: str) -> str:
    return ALIASES.get(module, module)


def run(args) -> int:
    import runpy

    from sglang.srt.plugins import load_plugins

    load_plugins()
    from ...runtime.state import require_hooks

    require_hooks()
    module = resolve(args.module)
    sys.argv = [module, *args.passthrough]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="run an SGLang module (bench_one_batch, offline throughput, ...) with the plugin loaded",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("module", help="module to run, e.g. sglang.bench_one_batch or one_batch")
    p.set_defaults(func=run, accepts_passthrough=True)
