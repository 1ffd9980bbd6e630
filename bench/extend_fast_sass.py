"""SASS of the fast extend-prefix kernel (kernels/oscar_kernels/triton/extend_fast.py) on sm_90, no GPU.

Compiles extend_fast_kernel exactly as ops.extend_prefix_attention launches it at the benchmark
shape (Hq=32, Hkv=8, D=128, prefix 32K + 4096 new tokens) with bench/kernel_sass.py's helpers,
then prints: wgmma (PTX) / HGMMA (SASS) counts, registers and spills, and for every loop that
holds tensor-core instructions its size and opcode mix. The INT2 loop is the last one; the two
others are the BF16 sink / ring loops (<= 320 keys; their fp16 saturation is the FMNMX count).

Usage:  python bench/extend_fast_sass.py [--group 128] [--dequant asm|join|gather] [--block-n 128]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, not for the interpreter
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import kernel_sass as ks  # noqa: E402
from oscar_kernels.triton import extend_fast as ef  # noqa: E402

HQ, HKV, D, SINK, WINDOW, E, L = 32, 8, 128, 64, 256, 4096, 32768


def capture(group, **kw):
    """Launch arguments of extend_fast_kernel at the benchmark shape."""
    N = L + 1
    pool = [torch.zeros(N, HKV, D // 4, dtype=torch.uint8), torch.zeros(N, HKV, D // group, 2, dtype=torch.float16),
            torch.zeros(N, HKV, D // 4, dtype=torch.uint8), torch.zeros(N, HKV, D // group, 2, dtype=torch.float16),
            torch.zeros(2, SINK, HKV, D, dtype=torch.bfloat16), torch.zeros(2, SINK, HKV, D, dtype=torch.bfloat16),
            torch.zeros(2, WINDOW, HKV, D, dtype=torch.bfloat16), torch.zeros(2, WINDOW, HKV, D, dtype=torch.bfloat16)]
    meta = [torch.tensor([0, L], dtype=torch.int32), torch.arange(1, N, dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)]
    q = torch.zeros(E, HQ, D, dtype=torch.bfloat16)
    real, cap = ef.extend_fast_kernel, ks._Capture(ef.extend_fast_kernel)
    ef.extend_fast_kernel = cap
    try:
        ef.extend_prefix_attention_fast(q, torch.tensor([0, E], dtype=torch.int32), *pool, *meta, k_group=group,
                                        v_group=group, sm_scale=D ** -0.5, max_len_extend=E,
                                        o=torch.zeros(E, HQ, D), lse=torch.zeros(E, HQ), **kw)
    finally:
        ef.extend_fast_kernel = real
    args, kwargs = cap.calls[0]
    return real, args, dict(kwargs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--dequant", choices=("asm", "join", "gather"))
    ap.add_argument("--block-n", type=int)
    ap.add_argument("--num-stages", type=int)
    args = ap.parse_args()
    fn, a, kw = capture(args.group, dequant=args.dequant, block_n=args.block_n, num_stages=args.num_stages)
    warps, block_n = kw.get("num_warps", ef.NUM_WARPS), kw["BLOCK_N"]
    print(f"extend_fast_kernel sm_90, G={args.group}, dequant={args.dequant or ef.DEQUANT}, BLOCK_M={kw['BLOCK_M']}, "
          f"BLOCK_N={block_n}, {warps} warps, MMA dtype {kw['DT']}")
    k = ks.compile_call(fn, a, kw)
    ptx = k.asm["ptx"]
    instrs = ks.parse_sass(ks.disassemble(k.asm["cubin"]))
    print(f"PTX: {ptx.count('wgmma.mma_async')} wgmma.mma_async, {ptx.count('mma.sync')} mma.sync; "
          f"SASS: {sum(o.startswith('HGMMA') for _, o, _ in instrs)} HGMMA, "
          f"{sum(o.startswith('HMMA') for _, o, _ in instrs)} HMMA; {ks.resource_usage(k.asm['cubin'])}")
    print(ks.in_flight_line(k.asm["ttgir"]))
    index = {addr: i for i, (addr, _, _) in enumerate(instrs)}
    loops = []  # tensor-core loops in program order: sink, ring (BLOCK_B keys a tile), INT2 (BLOCK_N)
    for i, (addr, op, rest) in enumerate(instrs):
        m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if not m or int(m.group(1), 16) > addr or int(m.group(1), 16) not in index:
            continue
        body = [o for _, o, _ in instrs[index[int(m.group(1), 16)]:i + 1]]
        if any(o.startswith("HGMMA") for o in body):
            loops.append(body)
    names = ["BF16 sink loop", "BF16 ring loop", "INT2 loop (full tiles)"]
    for name, body in zip(names[-len(loops):], loops):
        keys = block_n if name.startswith("INT2") else kw["BLOCK_B"]
        groups = collections.Counter(ks.group_of(o) or "other" for o in body)
        ops = collections.Counter(o.split(".")[0] for o in body)
        print(f"{name}: {len(body)} instructions per warp per {keys}-key tile = {len(body) * warps / keys:.1f} "
              f"warp-instructions per (key, KV head) for {kw['BLOCK_M']} query rows")
        print(f"    groups: {dict(groups)}")
        print(f"    opcodes: {ops.most_common(20)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
