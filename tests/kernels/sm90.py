"""Compile the INT2 kernels for sm_90 without a GPU (Triton ships ptxas) and report what the
schedule tests check: async copy groups in flight at the INT2 loop's wait, registers, shared memory.

Run in a subprocess (`run`): the test process has TRITON_INTERPRET=1, and triton.jit decides at
import time whether a kernel is compiled or interpreted. Each launch is captured as the op would
make it, its arguments turned into an ASTSource signature (pointers and multiples of 16 get the
runtime's divisibility specialisation, ints equal to 1 become constants), then compiled.

    python -m tests.kernels.sm90 decode [--int2-stages N] [--fused-merge]   # token decode, B=8, L=4096
    python -m tests.kernels.sm90 extend                                    # token extend, 32K + 4096
    python -m tests.kernels.sm90 fit                                       # every (head_dim, group)
    python -m tests.kernels.sm90 channel [--bits 3] [--batch 64] [--D 128] [--num-warps N] [--num-stages N]
                                         # channel-key decode (GQA 4, L=32K) + ptxas spills
    python -m tests.kernels.sm90 channel-extend [--bits 3] [--block-m 64] [--num-warps N]
                                         # channel-key extend-prefix (8K new tokens over 24K)
    python -m tests.kernels.sm90 batch '[["decode"], ["channel", "--bits", "2"]]'
                                         # several of the above in one process (run_many)

The ops pick compiled (GPU) or interpreter launch parameters from the tensors' device; the CPU
stand-in tensors here would pick the interpreter's, so `_as_gpu` makes them pick the GPU's.

Each prints one JSON object (batch: one object, each case's output under its arguments).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HQ, HKV, SINK, WINDOW = 32, 8, 64, 256
H100_SMEM_PER_BLOCK = 232448  # bytes (227 KB opt-in maximum)


def _as_gpu() -> None:
    """Launch as on CUDA tensors (bf16 operands, PTX code unpacking) from the CPU stand-ins."""
    from oscar_kernels.triton import channel_store, core, token_extend

    for m in (core, token_extend, channel_store):
        m.compiled = lambda t: True


def run(*args: str, timeout: int = 900) -> dict:
    """This module's output for `args`, from a subprocess without the Triton interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "kernels"), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "tests.kernels.sm90", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


class _Capture:
    """Stands in for a @triton.jit kernel: `k[grid](*args, **kw)` records the call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((a, kw))


def _capture(call, targets):
    """Run call() with the kernels `targets` [(module, name)] replaced by recorders; returns
    [(fn, args, kwargs)] of every recorded launch."""
    saved = {(m, n): getattr(m, n) for m, n in targets}
    caps = {key: _Capture(f) for key, f in saved.items()}
    for (m, n), c in caps.items():
        setattr(m, n, c)
    try:
        call()
    finally:
        for (m, n), f in saved.items():
            setattr(m, n, f)
    return [(c.fn, a, dict(kw)) for c in caps.values() for a, kw in c.calls]


def _compile(fn, args, kwargs):
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dt = {torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
          torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    vals = dict(zip(fn.arg_names, args))
    vals.update(kwargs)
    sig, constexprs, attrs = {}, {}, {}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        v = vals[name] if name in vals else p.default  # a parameter the launcher leaves at its default
        if p.is_constexpr or v is None:  # the runtime makes a None argument a constexpr
            sig[name], constexprs[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + dt[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:  # the runtime specialises 1 into a constant
                sig[name], constexprs[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(v)}")
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def _report(k) -> dict:
    """In-flight copy groups (the most any loop leaves at its wait; 0: every tile's loads are
    waited for right after they are issued), registers and shared memory of a compiled kernel."""
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([str(tool), "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    waits = [int(n) for n in re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)", k.asm["ttgir"])]
    return {"in_flight": max(waits, default=0), "regs": int(m.group(1)), "static_smem": int(m.group(3)),
            "dynamic_smem": int(k.metadata.shared)}


def _ptxas_spills(k) -> dict:
    """ptxas -v of the kernel's PTX for sm_90a: registers, spill store / load bytes, stack frame."""
    import tempfile

    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(k.asm["ptx"])
        res = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(src) + ".o"],
                             check=True, capture_output=True, text=True)
    log = res.stdout + res.stderr
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    r = re.search(r"Used (\d+) registers", log)
    return {"ptxas_regs": int(r.group(1)), "stack": int(m.group(1)), "spill_stores": int(m.group(2)),
            "spill_loads": int(m.group(3))}


def _sass_loops(k) -> list:
    """Loops of the kernel's SASS (a backward branch to an earlier address): for each, its
    instruction count, MMAs (HMMA), spill traffic (local: STL / LDL) and warp-level sync-free
    body, largest first. A loop's instruction count per iteration is the cost of one tile (the
    INT2 / body loops have the most)."""
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], check=True, capture_output=True, text=True).stdout
    ins = []  # (address, text)
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for i, (addr, txt) in enumerate(ins):
        b = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", txt)
        if b and int(b.group(1), 16) < addr:
            body = [t for a, t in ins if int(b.group(1), 16) <= a <= addr]
            loops.append({"instructions": len(body), "hmma": sum("HMMA" in t for t in body),
                          "hgmma": sum("HGMMA" in t for t in body), "f2f": sum("F2F" in t for t in body),
                          "lop3": sum("LOP3" in t for t in body), "prmt": sum("PRMT" in t for t in body),
                          "i2f": sum("I2F" in t for t in body), "ldg": sum("LDG" in t or "LDGSTS" in t for t in body),
                          "shfl": sum("SHFL" in t for t in body), "mufu": sum("MUFU" in t for t in body),
                          "local": sum("STL" in t or "LDL" in t for t in body)})
    return sorted(loops, key=lambda l: -l["instructions"])


def _pool(N, D, G, rows):
    import torch

    # head-major, like the plugin's pool ([H, N, ...] memory viewed as [N, H, ...])
    hm = lambda *s, dt: torch.zeros(HKV, N, *s, dtype=dt).transpose(0, 1)  # noqa: E731
    bf = lambda n: torch.zeros(rows, n, HKV, D, dtype=torch.bfloat16)  # noqa: E731
    return dict(k_codes=hm(D // 4, dt=torch.uint8), k_params=hm(D // G, 2, dt=torch.float16),
                v_codes=hm(D // 4, dt=torch.uint8), v_params=hm(D // G, 2, dt=torch.float16),
                sink_k=bf(SINK), sink_v=bf(SINK), ring_k=bf(WINDOW), ring_v=bf(WINDOW))


def decode(int2_stages=None, fused_merge=False) -> dict:
    """The fast decode's stage-1 kernel at the benchmark shape (D=128, G=128, B=8, L=4096)."""
    import torch

    from oscar_kernels.triton import core, token_decode

    D, G, B, L, ms = 128, 128, 8, 4096, 34
    meta = dict(kv_indptr=torch.arange(0, B * L + 1, L, dtype=torch.int32),
                kv_indices=torch.arange(1, B * L + 1, dtype=torch.int32),
                req_rows=torch.arange(B, dtype=torch.int32) + 1, own_start=torch.zeros(B + 1, dtype=torch.int32))
    kw = {"int2_stages": int2_stages} if int2_stages else {}
    if fused_merge:
        kw["fused_merge"] = True
    q = torch.zeros(B, HQ, D, dtype=torch.bfloat16)
    calls = _capture(lambda: token_decode.decode_attention_fast(
        q, torch.zeros_like(q), *_pool(B * L + 1, D, G, B + 1).values(), *meta.values(), k_group=G, v_group=G,
        sm_scale=D ** -0.5, max_kv_splits=ms, attn_logits=torch.zeros(B, HQ, ms, D),
        attn_lse=torch.zeros(B, HQ, ms), **kw), [(token_decode, "decode_kernel"), (core, "merge_splits_kernel")])
    (fn, a, k), = [c for c in calls if c[0] is not core.merge_splits_kernel]
    c = _compile(fn, a, k)
    return {**_report(c), "loops": _sass_loops(c)[:3]}


def extend() -> dict:
    """token_extend.extend_kernel as ops.extend_prefix_attention launches it (D=128, G=128, 32K + 4096)."""
    import torch

    from oscar_kernels.triton import token_extend as ef

    D, G, L, E = 128, 128, 32768, 4096
    meta = [torch.tensor([0, L], dtype=torch.int32), torch.arange(1, L + 1, dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.zeros(2, dtype=torch.int32)]
    q = torch.zeros(E, HQ, D, dtype=torch.bfloat16)
    (fn, a, k), = _capture(lambda: ef.extend_prefix_attention_fast(
        q, torch.tensor([0, E], dtype=torch.int32), *_pool(L + 1, D, G, 2).values(), *meta, k_group=G, v_group=G,
        sm_scale=D ** -0.5, max_len_extend=E, o=torch.zeros(E, HQ, D), lse=torch.zeros(E, HQ)),
        [(ef, "extend_kernel")])
    c = _compile(fn, a, k)
    return {**_report(c), "loops": _sass_loops(c)[:2], "block_m": k.get("BLOCK_M"), "num_warps": k.get("num_warps")}


def fit() -> dict:
    """Decode and extend-prefix through oscar_kernels.ops (default kernel selection, bf16 queries)
    at every head_dim D in {64, 128, 256} and group size G of the format (G divides D, G >= 32)."""
    import torch

    from oscar_kernels import ops
    from oscar_kernels.triton import core, token_attend, token_decode, token_extend

    targets = [(token_attend, "attend_kernel"), (token_decode, "decode_kernel"),
               (token_extend, "extend_kernel"), (core, "merge_splits_kernel")]
    L, E, out = 4096, 64, []
    for D in (64, 128, 256):
        for G in (g for g in (32, 64, 128) if g <= D and D % g == 0):
            p = _pool(L + 1, D, G, 2)
            meta = dict(kv_indptr=torch.tensor([0, L], dtype=torch.int32),
                        kv_indices=torch.arange(1, L + 1, dtype=torch.int32),
                        req_rows=torch.tensor([1], dtype=torch.int32), own_start=torch.zeros(2, dtype=torch.int32))
            kw = dict(k_group=G, v_group=G, sm_scale=D ** -0.5)
            q1, qe = torch.zeros(1, HQ, D, dtype=torch.bfloat16), torch.zeros(E, HQ, D, dtype=torch.bfloat16)
            for op, call in (("decode", lambda: ops.decode_attention(q1, torch.zeros_like(q1), **p, **meta,
                                                                     max_kv_splits=34, **kw)),
                             ("extend-prefix", lambda: ops.extend_prefix_attention(
                                 qe, torch.tensor([0, E], dtype=torch.int32), **p, **meta, max_len_extend=E, **kw))):
                for fn, a, k in _capture(call, targets):
                    if fn is core.merge_splits_kernel:
                        continue
                    c = _compile(fn, a, k)
                    out.append({"D": D, "G": G, "op": op, "kernel": fn.fn.__name__, "smem": int(c.metadata.shared)})
    return {"limit": H100_SMEM_PER_BLOCK, "kernels": out}


def _channel_pool(N, rows, bits, D, block, v_group) -> dict:
    """A per-channel pool of N slots (head-major, as the plugin's) and `rows` request rows of
    sink / ring, zeros: only the launch's shapes and strides matter for compiling."""
    import torch

    from oscar_kernels.format import code_bytes

    hm = lambda *s, dt: torch.zeros(HKV, *s, dtype=dt).transpose(0, 1)  # noqa: E731
    return dict(k_codes=hm(N, code_bytes(bits, D), dt=torch.uint8), k_params=hm(N // block, D, 2, dt=torch.float16),
                v_codes=hm(N, D // 4, dt=torch.uint8), v_params=hm(N, D // v_group, 2, dt=torch.float16),
                **{n: torch.zeros(rows, S_, HKV, D, dtype=torch.bfloat16)
                   for n, S_ in (("sink_k", SINK), ("sink_v", SINK), ("ring_k", WINDOW), ("ring_v", WINDOW))})


def channel(bits=3, batch=64, L=32768, D=128, block=64, v_group=64, **knobs) -> dict:
    """Stage 1 of ops.decode_attention_channel as the served format launches it (Llama-8B: Hq=32,
    Hkv=8, GQA 4, sink 64, ring 256, page blocks of `block`, 2-bit values in groups of v_group),
    default split plan; `knobs` go to the launcher (num_warps, num_stages, ...)."""
    import torch

    from oscar_kernels.triton import channel_decode as ch, core

    B, N = batch, batch * L + block
    pool = _channel_pool(N, B + 1, bits, D, block, v_group)
    meta = dict(kv_indptr=torch.arange(0, B * L + 1, L, dtype=torch.int32),
                kv_indices=torch.arange(block, B * L + block, dtype=torch.int32),
                req_rows=torch.arange(B, dtype=torch.int32) + 1, own_start=torch.zeros(B + 1, dtype=torch.int32))
    q = torch.zeros(B, HQ, D, dtype=torch.bfloat16)
    o = torch.zeros(B, HQ, D, dtype=torch.float32)
    calls = _capture(lambda: ch.decode_attention_channel(
        q, o, **pool, **meta, k_bits=bits, k_block=block, v_group=v_group, sm_scale=D ** -0.5,
        max_kv_splits=18, **knobs), [(ch, "channel_kernel"), (core, "merge_splits_kernel")])
    (fn, a, k), = [c for c in calls if c[0] is not core.merge_splits_kernel]
    warps, planes, words = k["num_warps"], k["PLANES"], (k["VWORDS"], k["KWORDS"])
    c = _compile(fn, a, k)
    return {**_report(c), **_ptxas_spills(c), "planes": planes, "words": words, "loops": _sass_loops(c)[:3],
            "bits": bits, "batch": batch,
            "num_warps": warps, "knobs": {k_: str(v) for k_, v in knobs.items()}}


def channel_extend(bits=3, E=8192, L=32768, D=128, block=64, v_group=64, **knobs) -> dict:
    """ops.extend_prefix_attention_channel as a chunked prefill launches it: one request, E new
    tokens over a prefix of L - E (Llama-8B heads, sink 64, ring 256); `knobs` go to the launcher
    (block_m, num_warps, num_stages)."""
    import torch

    from oscar_kernels.triton import channel_extend as ch

    N = L + block
    pool = _channel_pool(N, 2, bits, D, block, v_group)
    meta = dict(kv_indptr=torch.tensor([0, L - E], dtype=torch.int32),
                kv_indices=torch.arange(block, L - E + block, dtype=torch.int32),
                req_rows=torch.ones(1, dtype=torch.int32), own_start=torch.zeros(2, dtype=torch.int32))
    q = torch.zeros(E, HQ, D, dtype=torch.bfloat16)
    calls = _capture(lambda: ch.extend_prefix_attention_channel(
        q, torch.tensor([0, E], dtype=torch.int32), **pool, **meta, k_bits=bits, k_block=block,
        v_group=v_group, sm_scale=D ** -0.5, max_len_extend=E, **knobs),
        [(ch, "channel_kernel")])
    (fn, a, k), = calls
    warps, block_m = k["num_warps"], k["BLOCK_M"]
    c = _compile(fn, a, k)
    return {**_report(c), **_ptxas_spills(c), "loops": _sass_loops(c)[:3], "bits": bits, "block_m": block_m,
            "num_warps": warps, "knobs": {k_: str(v) for k_, v in knobs.items()}}


def run_many(*cases: tuple, timeout: int = 1800) -> dict:
    """`run` for several argument lists in one subprocess (one torch / Triton import instead of
    one per case: seconds each on 2 cores): {" ".join(args): output, or {"error": traceback}}."""
    return run("batch", json.dumps([list(c) for c in cases]), timeout=timeout)


def _one(argv: list[str]) -> dict:
    what, rest = argv[0], argv[1:]
    if what == "decode":
        stages = int(rest[rest.index("--int2-stages") + 1]) if "--int2-stages" in rest else None
        res = decode(stages, "--fused-merge" in rest)
    elif what == "extend":
        res = extend()
    elif what == "fit":
        res = fit()
    elif what == "channel":
        opt = {rest[i][2:].replace("-", "_"): int(rest[i + 1]) for i in range(0, len(rest), 2)}
        res = channel(**opt)
    elif what == "channel-extend":
        res = channel_extend(**{rest[i][2:].replace("-", "_"): int(rest[i + 1]) for i in range(0, len(rest), 2)})
    else:
        raise SystemExit(f"unknown: {what}")
    return res


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    os.environ.pop("TRITON_INTERPRET", None)  # compile for real (before anything imports triton)
    _as_gpu()
    if argv[0] == "batch":  # run_many: a JSON list of argument lists
        import traceback

        out = {}
        for case in json.loads(argv[1]):
            try:
                out[" ".join(case)] = _one(case)
            except (Exception, SystemExit):  # one case's failure fails its test only
                out[" ".join(case)] = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps(out))
        return 0
    print(json.dumps(_one(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
