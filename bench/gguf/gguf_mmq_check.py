# Investigation script for the GGUF chat problem; findings in docs/deploy.md section 6.
"""GPU check (bundle only, no GGUF transfer): is sgl-kernel's batched GGUF GEMM (MMQ, used by
SGLang for Q4_1 weights when a forward has > 6 tokens) wrong, while the batch<=6 path (MMVQ,
prompts of <= 6 tokens and every decode step) is right? That split matches what SGLang's GGUF
server did: 5-token plain prompts fine, 35-37-token chat prompts garbage.

    source .devkit/device-env.sh && python3 /path/to/gguf_mmq_check.py
"""
import gguf
import numpy as np
import torch
from sgl_kernel.quantization import ggml_dequantize, ggml_mul_mat_a8, ggml_mul_mat_vec_a8

torch.manual_seed(0)
T = gguf.GGMLQuantizationType
for qt in (T.Q4_1, T.Q8_0):
    for out_f, in_f in ((576, 576), (1536, 576), (576, 1536)):
        w = np.random.randn(out_f, in_f).astype(np.float32) * 0.05
        qw_np = gguf.quants.quantize(w, qt)                      # [out, bytes per row]
        qw = torch.from_numpy(qw_np).cuda()
        w_deq = torch.from_numpy(gguf.quants.dequantize(qw_np, qt)).cuda()
        for dtype in (torch.float16, torch.bfloat16):
            for n in (5, 37):
                x = torch.randn(n, in_f, device="cuda") * 0.5
                x[0, 7] = 2500.0                                   # a massive activation, like token 0's
                x = x.to(dtype)
                ref = x.float() @ w_deq.T
                deq = ggml_dequantize(qw, int(qt), out_f, in_f, dtype)
                y_deq = (x @ deq.T).float()
                y_mmq = ggml_mul_mat_a8(qw, x, int(qt), out_f).float()
                y_vec = torch.cat([ggml_mul_mat_vec_a8(qw, x[i:i + 1], int(qt), out_f).float()
                                   for i in range(n)])
                rel = lambda y: ((y - ref).norm() / ref.norm()).item()
                print(f"{qt.name} {out_f}x{in_f} {str(dtype)[6:]:8s} n={n:2d}: rel err "
                      f"dequant+matmul {rel(y_deq):.2e}  MMQ {rel(y_mmq):.2e}  MMVQ {rel(y_vec):.2e}  "
                      f"finite MMQ={torch.isfinite(y_mmq).all().item()}")
