"""bench/_serving_trace.analyze on a synthetic torch.profiler trace: step periods, GPU idle, and
each kernel's launches a step and per-launch spread (per_kernel)."""
from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pytest

from bench import _serving_trace as tr


def _trace(tmp_path, rng, steps=6, layers=4):
    """steps decode spans of period P; each launches, per layer, a store, an attention kernel and
    a GEMM with random durations (launched eagerly: correlation ids tie kernel to launch)."""
    ev, durs, corr, t = [], {"_tokens_kernel": [], "attend_channel_kernel": [], "nvjet_gemm": []}, 0, 0.0
    period = rng.uniform(4000, 6000)
    for s in range(steps):
        t0 = s * period
        ev.append({"ph": "X", "cat": "user_annotation", "name": "step[DECODE bs=1]", "ts": t0, "dur": 1500.0})
        t = t0 + 10
        for _ in range(layers):
            for name in durs:
                d = rng.uniform(2, 60)
                corr += 1
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t, "dur": 3.0,
                           "args": {"correlation": corr}})
                ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t + 5, "dur": d,
                           "args": {"correlation": corr}})
                if s < steps - 1:  # the last span only closes the one before it
                    durs[name].append(d)
                t += d + 6
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return path, period, durs


def test_per_kernel_spread_and_step_time(tmp_path, seed):
    rng = random.Random(seed)
    path, period, durs = _trace(tmp_path, rng)
    a = tr.analyze(path)
    assert a["steps"] == 5 and a["step_period_ms"] == pytest.approx(period / 1e3)
    total = sum(sum(v) for v in durs.values())
    assert a["gpu_kernel_ms"] * 1e3 * 5 == pytest.approx(total, rel=0.35)  # a median step against the mean
    got = {k["name"]: k for k in a["per_kernel"]}
    assert set(got) == set(durs)
    for name, d in durs.items():
        k = got[name]
        assert k["launches_per_step"] == 4
        assert k["p50_us"] == pytest.approx(float(np.median(d)))
        assert k["p10_us"] <= k["p50_us"] <= k["p90_us"]
    assert got["_tokens_kernel"]["category"] == "kv_write" and got["nvjet_gemm"]["category"] == "gemm"
