"""Prometheus gauges for the INT2 pool, exported next to SGLang's own (`--enable-metrics`).

The `metrics` hook runs after SGLang's SchedulerMetricsCollector.log_stats in the scheduler
process, so the gauges carry the same labels and land in the same multiprocess registry.
Names: sglang:oscar_int2_<what>.
"""
from __future__ import annotations

_GAUGES: dict = {}

_DEFS = {
    "capacity_tokens": "INT2 KV pool capacity in tokens.",
    "used_tokens": "Tokens held in the INT2 KV pool (running requests + radix cache).",
    "token_usage": "INT2 KV pool usage ratio (0-1).",
    "bytes_per_token": "INT2 KV bytes per token (all local layers, K and V).",
    "compression_vs_bf16": "BF16 bytes per token / INT2 bytes per token.",
    "side_buffer_bytes": "Bytes of the BF16 sink + recent side buffers.",
    "pool_bytes": "Bytes of the INT2 codes and scales.",
    "max_running_requests": "Request rows the BF16 side buffers were sized for.",
}


def _gauges(labelnames):
    if not _GAUGES:
        from prometheus_client import Gauge

        for name, doc in _DEFS.items():
            _GAUGES[name] = Gauge(
                name=f"sglang:oscar_int2_{name}",
                documentation=doc,
                labelnames=list(labelnames),
                multiprocess_mode="mostrecent",
            )
    return _GAUGES


def values(info: dict, stats) -> dict:
    total = int(info.get("max_total_num_tokens") or 0)
    usage = float(getattr(stats, "full_token_usage", 0.0) or getattr(stats, "token_usage", 0.0) or 0.0)
    return {
        "capacity_tokens": total,
        "used_tokens": int(round(usage * total)),
        "token_usage": usage,
        "bytes_per_token": info.get("bytes_per_token", 0),
        "compression_vs_bf16": info.get("compression_vs_bf16", 0.0),
        "side_buffer_bytes": info.get("side_bytes_total", 0),
        "pool_bytes": info.get("int2_bytes_total", 0),
        "max_running_requests": info.get("max_running_requests", 0),
    }


def export(collector, stats, info: dict) -> None:
    labels = dict(getattr(collector, "labels", {}) or {})
    g = _gauges(labels.keys())
    for name, val in values(info, stats).items():
        g[name].labels(**labels).set(val)
