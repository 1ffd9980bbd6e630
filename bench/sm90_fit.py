"""Does every supported shape compile for the H100 within its shared memory? (no GPU needed)

For each head_dim D in {64, 128, 256} and group size G (G divides D, G >= 32), the decode and
extend-prefix ops are called exactly as the plugin calls them (oscar_kernels.ops, default kernel
selection, bf16 queries, Hq=32, Hkv=8) with their kernels intercepted; each intercepted launch is
compiled for sm_90 by bench/kernel_sass.py's helpers and its shared memory, registers and spill
stack are printed. A kernel needing more than the H100's 227 KB of shared memory per block would
fail at its first launch on the GPU (the CPU interpreter never sees this); the exit status is 1 if
any does. tests/kernels/test_schedule.py runs this.

Usage:  python bench/sm90_fit.py
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, not for the interpreter
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import kernel_sass as ks  # noqa: E402
from oscar_kernels import ops  # noqa: E402
from oscar_kernels.triton import attend, attend_fast, decode, extend_fast  # noqa: E402

H100_SMEM_PER_BLOCK = 232448  # bytes (227 KB opt-in maximum)
HQ, HKV, S, W, L, E = 32, 8, 64, 256, 4096, 64


def _capture(call):
    """Run call() with every INT2 attention kernel replaced by a recorder; returns [(fn, args, kw)]."""
    targets = [(attend, "attend_kernel"), (attend_fast, "attend_fast_kernel"),
               (extend_fast, "extend_fast_kernel"), (decode, "_merge_splits_kernel")]
    saved = {(m, n): getattr(m, n) for m, n in targets}
    caps = {(m, n): ks._Capture(f) for (m, n), f in saved.items()}
    for (m, n), c in caps.items():
        setattr(m, n, c)
    try:
        call()
    finally:
        for (m, n), f in saved.items():
            setattr(m, n, f)
    return [(c.fn, a, dict(kw)) for (m, n), c in caps.items() if n != "_merge_splits_kernel" for a, kw in c.calls]


def _pool(D, G):
    N = L + 1
    hm = lambda *s, dt: torch.zeros(HKV, N, *s, dtype=dt).transpose(0, 1)  # noqa: E731 (head-major)
    return dict(k_codes=hm(D // 4, dt=torch.uint8), k_params=hm(D // G, 2, dt=torch.float16),
                v_codes=hm(D // 4, dt=torch.uint8), v_params=hm(D // G, 2, dt=torch.float16),
                sink_k=torch.zeros(2, S, HKV, D, dtype=torch.bfloat16),
                sink_v=torch.zeros(2, S, HKV, D, dtype=torch.bfloat16),
                ring_k=torch.zeros(2, W, HKV, D, dtype=torch.bfloat16),
                ring_v=torch.zeros(2, W, HKV, D, dtype=torch.bfloat16))


def launches(D, G):
    """(op name, captured launches) of decode and extend-prefix at head_dim D, group G."""
    p = _pool(D, G)
    meta = dict(kv_indptr=torch.tensor([0, L], dtype=torch.int32), kv_indices=torch.arange(1, L + 1, dtype=torch.int32),
                req_rows=torch.tensor([1], dtype=torch.int32), own_start=torch.zeros(2, dtype=torch.int32))
    kw = dict(k_group=G, v_group=G, sm_scale=D ** -0.5)
    q1 = torch.zeros(1, HQ, D, dtype=torch.bfloat16)
    dec = _capture(lambda: ops.decode_attention(q1, torch.zeros(1, HQ, D, dtype=torch.bfloat16), **p, **meta,
                                                max_kv_splits=34, **kw))
    qe = torch.zeros(E, HQ, D, dtype=torch.bfloat16)
    ext = _capture(lambda: ops.extend_prefix_attention(qe, torch.tensor([0, E], dtype=torch.int32), **p, **meta,
                                                       max_len_extend=E, **kw))
    return [("decode", dec), ("extend-prefix", ext)]


def main():
    print(__doc__.splitlines()[0])
    bad = 0
    for D in (64, 128, 256):
        for G in (g for g in (32, 64, 128) if g <= D and D % g == 0):  # the format's group sizes
            for op, calls in launches(D, G):
                for fn, a, kw in calls:
                    k = ks.compile_call(fn, a, kw)
                    smem = k.metadata.shared
                    ok = smem <= H100_SMEM_PER_BLOCK
                    bad += not ok
                    print(f"D={D:3d} G={G:3d} {op:13s} {fn.fn.__name__:20s} shared {smem:6d} B "
                          f"{'ok' if ok else 'TOO MUCH'}; {ks.resource_usage(k.asm['cubin'])}", flush=True)
    print(f"{bad} kernel(s) over the H100's {H100_SMEM_PER_BLOCK} B of shared memory per block")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
