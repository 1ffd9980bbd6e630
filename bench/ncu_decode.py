"""One eager fast-decode call at a benchmark shape, for Nsight Compute (warp stall reasons,
occupancy, memory throughput of attend_fast_kernel):

    ncu --kernel-name regex:attend_fast --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis python3 bench/ncu_decode.py 8x32768
"""
import importlib.util
import pathlib
import sys

import torch

_spec = importlib.util.spec_from_file_location("oscar_bench_kernels", pathlib.Path(__file__).with_name("kernels.py"))
kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb)

B, L = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "8x32768").split("x"))
run = kb.Int2Case(B, L).fn(kind="fast")
for _ in range(5):
    run()
torch.cuda.synchronize()
print(f"ran the fast decode 5 times at B={B}, L={L}")
