"""Timing inside a CUDA graph, how SGLang replays decode steps: shared by the kernel benchmarks."""
from __future__ import annotations

import math

import torch


def bench_graph(fn, copies=1, min_calls=24, replays=7):
    """Per-call time of fn inside a CUDA graph (how SGLang runs decode), median of `replays`.

    The graph holds n calls (a multiple of `copies`); fn cycles through the input copies, so
    back-to-back calls never find their inputs in L2. Returns milliseconds per call.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    n = copies * max(1, math.ceil(min_calls / copies))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / n)
    del g
    return sorted(times)[len(times) // 2]
