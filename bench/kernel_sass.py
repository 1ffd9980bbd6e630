"""Count SASS instructions per (key, KV head) in the INT2 decode loop, without a GPU.

Triton compiles for sm_90 on any machine (ptxas ships in the wheel), so every decode-kernel idea
gets an instruction count before it costs device time. The kernel is compiled exactly as the
decode op would launch it at the benchmark shape (Hq=32, Hkv=8, D=128, G=128, B=8): the launch
is intercepted, its arguments become an ASTSource signature (pointers and multiples of 16 get the
same specialisation the runtime gives them), and the SASS is disassembled.

The hot loop is the largest SASS loop (a backward branch) that holds tensor-core instructions
(the BF16 sink/ring loops are much shorter); its instruction count x num_warps / BLOCK_N = warp-instructions per
(key, KV head). Opcodes are grouped so the split (unpack, MMA, moves, shared memory, softmax...)
is visible.

Usage:  python bench/kernel_sass.py [--kernel base|fast|both] [--dump DIR] [--ops]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, not for the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HQ, HKV, D, GROUP, SINK, WINDOW, B, L = 32, 8, 128, 128, 64, 256, 8, 4096
TARGET = GPUTarget("cuda", 90, 32)
_DT = {torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
       torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


class _Capture:
    """Stands in for a @triton.jit kernel: `k[grid](*args, **kw)` records the call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((a, kw))


def compile_call(fn, args, kwargs):
    """Compile one captured launch of the @triton.jit `fn` for sm_90; returns the CompiledKernel."""
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    names = fn.arg_names
    vals = dict(zip(names, args))
    vals.update(kwargs)
    sig, constexprs, attrs = {}, {}, {}
    for i, (name, p) in enumerate(zip(names, fn.params)):
        v = vals[name]
        if p.is_constexpr:
            sig[name] = "constexpr"
            constexprs[name] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _DT[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:  # the runtime specialises 1 into a constant
                sig[name] = "constexpr"
                constexprs[name] = 1
            else:
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(v)}")
    src = ASTSource(fn, sig, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=opts)


def capture_decode(kind: str, **kw):
    """Launch args of the stage-1 decode kernel (`kind` base|fast) at the benchmark shape."""
    from oscar_kernels.triton import attend, decode

    N = B * L + 1
    t = dict(
        # head-major like the plugin's pool ([H, N, ...] memory viewed as [N, H, ...])
        k_codes=torch.zeros(HKV, N, D // 4, dtype=torch.uint8).transpose(0, 1),
        k_params=torch.zeros(HKV, N, D // GROUP, 2, dtype=torch.float16).transpose(0, 1),
        v_codes=torch.zeros(HKV, N, D // 4, dtype=torch.uint8).transpose(0, 1),
        v_params=torch.zeros(HKV, N, D // GROUP, 2, dtype=torch.float16).transpose(0, 1),
        sink_k=torch.zeros(B + 1, SINK, HKV, D, dtype=torch.bfloat16),
        sink_v=torch.zeros(B + 1, SINK, HKV, D, dtype=torch.bfloat16),
        ring_k=torch.zeros(B + 1, WINDOW, HKV, D, dtype=torch.bfloat16),
        ring_v=torch.zeros(B + 1, WINDOW, HKV, D, dtype=torch.bfloat16),
    )
    meta = dict(kv_indptr=torch.arange(0, B * L + 1, L, dtype=torch.int32),
                kv_indices=torch.arange(1, B * L + 1, dtype=torch.int32),
                req_rows=torch.arange(B, dtype=torch.int32) + 1,
                own_start=torch.zeros(B + 1, dtype=torch.int32))
    q = torch.zeros(B, HQ, D, dtype=torch.bfloat16)
    o = torch.zeros(B, HQ, D, dtype=torch.bfloat16)
    ms = 34
    logits = torch.zeros(B, HQ, ms, D)
    lse = torch.zeros(B, HQ, ms)
    mods = [attend]
    if kind == "fast":
        from oscar_kernels.triton import attend_fast
        mods = [attend_fast]
    cap = {}
    saved = {}
    for m in mods:
        for name in ("attend_kernel", "attend_fast_kernel"):
            if hasattr(m, name):
                saved[(m, name)] = getattr(m, name)
                cap[name] = _Capture(getattr(m, name))
                setattr(m, name, cap[name])
    saved_merge = decode._merge_splits_kernel
    decode._merge_splits_kernel = _Capture(saved_merge)
    try:
        if kind == "fast":
            attend_fast.decode_attention_fast(
                q, o, *t.values(), *meta.values(), k_group=GROUP, v_group=GROUP, sm_scale=D ** -0.5,
                max_kv_splits=ms, attn_logits=logits, attn_lse=lse, **kw)
        else:
            decode.decode_attention(q, o, *t.values(), *meta.values(), k_group=GROUP, v_group=GROUP,
                                    sm_scale=D ** -0.5, max_kv_splits=ms, attn_logits=logits,
                                    attn_lse=lse, **kw)
    finally:
        for (m, name), f in saved.items():
            setattr(m, name, f)
        decode._merge_splits_kernel = saved_merge
    (c,) = [c for c in cap.values() if c.calls]
    args, kwargs = c.calls[0]
    return c.fn, args, dict(kwargs)


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def disassemble(cubin: bytes) -> str:
    """cuobjdump -sass of a cubin (Triton's own asm["sass"] drops instructions past 0xffff)."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> str:
    """Registers, spills and shared memory per program (cuobjdump -res-usage)."""
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return f"regs {m.group(1)}, stack {m.group(2)} B, local {m.group(4)} B, static smem {m.group(3)} B" if m else out.strip()


def parse_sass(sass: str):
    """[(address, opcode, operands)] in program order."""
    return [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _LINE.finditer(sass)]


def hot_loop(instrs):
    """[(opcode, operands)] of the largest loop (backward branch) that holds MMAs."""
    index = {a: k for k, (a, _, _) in enumerate(instrs)}
    best = None
    for k, (a, op, rest) in enumerate(instrs):
        m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if not m or int(m.group(1), 16) > a or int(m.group(1), 16) not in index:
            continue
        body = [(o, r) for _, o, r in instrs[index[int(m.group(1), 16)]:k + 1]]
        n_mma = sum(o.startswith(("HMMA", "IMMA", "HGMMA")) for o, _ in body)
        key = (n_mma > 0, len(body))  # the INT2 loop is the largest loop with tensor-core work
        if best is None or key > best[0]:
            best = (key, body)
    return best[1] if best else []


GROUPS = [  # (name, opcode prefixes)
    ("mma", ("HMMA", "IMMA", "HGMMA")),
    ("unpack/int", ("PRMT", "LOP3", "SHF", "IADD3", "IMAD", "LEA", "SEL", "ISETP", "I2F", "F2I", "IMNMX", "VIMNMX", "VIADD")),
    ("mov", ("MOV", "UMOV", "SHFL", "S2R", "CS2R", "S2UR", "R2UR")),
    ("shared mem", ("LDS", "STS", "LDSM", "STSM")),
    ("global mem", ("LDG", "STG", "LDGSTS", "LDGDEPBAR", "DEPBAR")),
    ("fp32 math", ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "MUFU", "F2F", "F2FP", "FCHK", "HADD2", "HFMA2", "HMUL2")),
    ("control", ("BRA", "BAR", "BSYNC", "BSSY", "WARPSYNC", "EXIT", "NOP", "YIELD", "PLOP3", "P2R", "R2P", "VOTE")),
]


def group_of(op):
    for name, prefixes in GROUPS:
        if op.startswith(prefixes):
            return name
    return "other"


def in_flight_line(ttgir: str) -> str:
    """The most cp.async groups any loop leaves in flight at its wait (0: every tile's loads are
    waited for right after they are issued, nothing overlaps the compute). tests/ check this."""
    waits = [int(n) for n in re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)", ttgir)]
    return f"async copy groups in flight at the INT2 loop's wait: {max(waits, default=0)}"


def report(label, compiled, num_warps, block_n, show_ops=False, dump=None):
    sass = disassemble(compiled.asm["cubin"])
    if dump:
        os.makedirs(dump, exist_ok=True)
        for k in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"{label}.{k}"), "w") as f:
                f.write(compiled.asm[k])
        with open(os.path.join(dump, f"{label}.sass"), "w") as f:
            f.write(sass)
    body = [(op, r) for op, r in hot_loop(parse_sass(sass)) if op != "NOP"]
    n = len(body)
    per_key = n * num_warps / block_n
    ttgir = compiled.asm["ttgir"]
    smem = compiled.metadata.shared if hasattr(compiled.metadata, "shared") else "?"
    print(f"{label}: hot loop {n} instructions/warp/tile x {num_warps} warps / {block_n} keys = "
          f"{per_key:.1f} warp-instructions per (key, KV head); {resource_usage(compiled.asm['cubin'])}, "
          f"dynamic smem {smem} B; TTGIR: {ttgir.count('convert_layout')} convert_layout, "
          f"{ttgir.count('local_alloc')} local_alloc, {ttgir.count('local_load')} local_load")
    print(f"   {in_flight_line(ttgir)}")
    grp = collections.Counter(group_of(op) for op, _ in body)
    print("   " + ", ".join(f"{g} {c} ({c * num_warps / block_n:.1f}/key)" for g, c in grp.most_common()))
    if show_ops:
        ops = collections.Counter(op.split(".")[0] for op, _ in body)
        print("   " + ", ".join(f"{o} {c}" for o, c in ops.most_common()))
    return per_key


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", default="both", choices=["base", "fast", "both"])
    ap.add_argument("--dump", help="write ttgir/ptx/sass of each compiled kernel here")
    ap.add_argument("--ops", action="store_true", help="also list opcodes")
    ap.add_argument("--num-warps", type=int, help="override num_warps (both kernels)")
    ap.add_argument("--block-n", type=int, help="override BLOCK_N (both kernels)")
    ap.add_argument("--block-m", type=int, help="override BLOCK_M (fast kernel)")
    ap.add_argument("--num-stages", type=int, help="override num_stages (both kernels)")
    ap.add_argument("--int2-stages", type=int, help="override the INT2 loop's pipeline depth (fast kernel)")
    ap.add_argument("--maxnreg", type=int, help="register cap per thread (both kernels)")
    ap.add_argument("--fused-merge", action="store_true", help="fast kernel with the split merge fused in")
    ap.add_argument("--bytes", action="store_true", help="fast kernel reading the codes as bytes (words=False; "
                    "the default at head_dim 128 reads 16-bit code words)")
    args = ap.parse_args()
    from oscar_kernels.triton import attend

    attend.USE_ASM = True  # this process imported triton without the interpreter: CUDA path
    attend.PV_DTYPE = triton.language.bfloat16
    res = {}
    kinds = ["base", "fast"] if args.kernel == "both" else [args.kernel]
    for kind in kinds:
        over = {k: v for k, v in (("num_warps", args.num_warps), ("block_n", args.block_n),
                                                 ("num_stages", args.num_stages)) if v}
        if kind == "fast" and args.block_m:
            over["block_m"] = args.block_m
        if kind == "fast" and args.int2_stages:
            over["int2_stages"] = args.int2_stages
        if args.maxnreg:
            over["maxnreg"] = args.maxnreg
        if kind == "fast" and args.fused_merge:
            over["fused_merge"] = True
        if kind == "fast" and args.bytes:
            over["words"] = False
        fn, a, kw = capture_decode(kind, **over)
        nw, bn = kw["num_warps"], kw["BLOCK_N"]
        ck = compile_call(fn, a, kw)
        res[kind] = report(kind, ck, nw, bn, args.ops, args.dump)
    if len(res) == 2:
        print(f"fast / base: {res['fast'] / res['base']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
