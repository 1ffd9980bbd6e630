"""Compiled-kernel properties on sm_90 (no GPU): pipelined INT2 loops, shared memory that fits.

The INT2 loops of the fast decode and extend kernels keep the next tile's loads in flight.

Compiled for sm_90 without a GPU (Triton ships ptxas) by bench/kernel_sass.py and
bench/extend_fast_sass.py, in a subprocess so this process keeps its interpreter setting. With a
too-shallow software pipeline (the default depth 2), Triton loads the slot indices synchronously and
waits for every tile's code copies right after issuing them: the compiled loop then waits with 0
copy groups in flight, and on the H100 decode was 7-14% slower and extend 6-10% slower
(docs/benchmarks.md, "Kernels", 2026-11-22 13:36 / 13:53 UTC).
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests import ROOT


def _in_flight(script, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"async copy groups in flight at the INT2 loop's wait: (\d+)", out.stdout)
    assert m, out.stdout[-2000:]
    return int(m.group(1)), out.stdout


@pytest.mark.parametrize("script,args", [
    ("kernel_sass.py", ("--kernel", "fast")),
    ("extend_fast_sass.py", ()),
], ids=["decode_fast", "extend_fast"])
def test_int2_loop_overlaps_loads_with_compute(script, args):
    n, out = _in_flight(script, *args)
    # 5 = one tile's code / param copies (4 groups) + the slot indices of the tile after it
    assert n >= 5, f"the INT2 loop waits with {n} copy groups in flight (expected >= 5):\n{out}"


def test_shallow_pipeline_is_detected():
    """The check above can fail: the same decode kernel at depth 2 waits with nothing in flight."""
    n, _ = _in_flight("kernel_sass.py", "--kernel", "fast", "--int2-stages", "2")
    assert n == 0


def test_every_supported_shape_fits_h100_shared_memory():
    """Decode and extend-prefix at every head_dim / group size, as ops selects the kernels, compile
    for sm_90 within 227 KB of shared memory per block (head_dim 256 at G=32 needed 290 KB before
    its decode tile was cut to 32 keys: a launch failure on the GPU the interpreter cannot see)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "sm90_fit.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert "0 kernel(s) over" in out.stdout and out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert out.stdout.count(" ok;") == 16  # 8 (D, G) pairs x (decode, extend-prefix)


@pytest.mark.parametrize("fused", [False, True], ids=["merge_kernel", "fused_merge"])
def test_fast_decode_fits_its_programs_per_sm(fused):
    """PROGRAMS_PER_SM (12) one-warp programs of the fast decode must run at once on an H100 SM
    (64K registers, 228 KB of shared memory, 1 KB of it reserved per block): its own split policy
    aims at SPLIT_PROGRAMS_PER_SM (8) per SM and SGLang's split counts in the server go higher, and
    every grid up to 12 per SM then runs in one wave. With more registers or shared memory such
    grids would spill into a second wave."""
    from oscar_kernels.triton import attend_fast

    _, out = _in_flight("kernel_sass.py", "--kernel", "fast", *(("--fused-merge",) if fused else ()))
    regs = int(re.search(r"regs (\d+)", out).group(1))
    smem = int(re.search(r"static smem (\d+) B", out).group(1)) + int(re.search(r"dynamic smem (\d+) B", out).group(1))
    per_sm_regs = 65536 // (-(-regs // 8) * 8 * 32 * attend_fast.NUM_WARPS)
    per_sm_smem = 233472 // (smem + 1024)
    assert min(per_sm_regs, per_sm_smem) >= attend_fast.PROGRAMS_PER_SM, (regs, smem, out)
    assert attend_fast.SPLIT_PROGRAMS_PER_SM <= attend_fast.PROGRAMS_PER_SM
