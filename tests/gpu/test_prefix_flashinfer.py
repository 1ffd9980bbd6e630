"""OSCAR_PREFIX_ATTENTION=flashinfer on the real FlashInfer (CUDA only): the cached prefix
dequantised to BF16 pieces, FlashInfer's ragged prefill over each piece (non-causal), merged by
LSE, vs float64 attention over what the reader sees (reference.format_request_kv).

Pieces of 64 positions, so the long request spans many of them and the short ones have empty key
ranges in most: FlashInfer's output for a request without keys must be dropped by the merge (LSE
-inf). Heavy-tailed rotated keys as in the kernel tests. Bounds: 3e-2 relative per request and
6e-2 absolute on the LSE: the keys are rounded to bf16 (as the `dequant` extend body rounds them),
which on these outlier channels moves scores by up to ~3e-2 (the same test on the CPU stand-in,
whose bf16 conversion truncates: 9.8e-3 / 3.0e-2).
"""
import math

import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref

from oscar_sglang.runtime.new_tokens import workspace_bytes
from oscar_sglang.runtime.prefix_flashinfer import FlashInferPrefix

from ..kernels.channel_case import ChannelPool, channel_fmt

NAMES = ("k_codes", "k_params", "v_codes", "v_params", "sink_k", "sink_v", "ring_k", "ring_v", "kv_indptr",
         "kv_indices", "req_rows", "own_start")


def test_prefix_pieces_through_flashinfer_match_float64(seed):
    fmt = channel_fmt(128, 3, 64, 64)
    lens, ext = [700, 64, 130], [5, 3, 7]
    pool = ChannelPool(fmt, lens, [0, 0, 0], [0, 0, 0], hkv=2)
    Hq, H, D = 8, 2, 128
    q = torch.randn(sum(ext), Hq, D).bfloat16().cuda()
    ws = torch.empty(workspace_bytes(), dtype=torch.uint8, device="cuda")
    fp = FlashInferPrefix(workspace=ws, num_qo_heads=Hq, num_kv_heads=H, head_dim=D,
                          v_head_dim=D, dtype=torch.bfloat16, block=64, max_rows=128)
    fp.plan(ext, lens, "cuda")
    assert len(fp.pieces) == math.ceil(700 / 64)
    args = dict(zip(NAMES, pool.args()), **pool.kw())
    layer = type("L", (), {"scaling": D ** -0.5})()
    o = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    lse = torch.full(q.shape[:2], float("-inf"), device="cuda")
    for o_p, lse_p in fp.run(q, layer, args, None):
        nxt = torch.empty_like(lse)
        o = ops.merge_attention_states(o, lse, o_p, lse_p, lse_b_base2=True, lse_out=nxt)
        lse = nxt
    assert torch.isfinite(o).all()
    t0 = 0
    for b, (L, E) in enumerate(zip(lens, ext)):
        K, V = pool.request_kv(b)
        o_ref, l_ref = ref.attention(q[t0:t0 + E].double(), K.cuda().double(), V.cuda().double(), D ** -0.5)
        err = ((o[t0:t0 + E].double() - o_ref).norm() / o_ref.norm()).item()
        assert err <= 3e-2, (L, err)
        assert (lse[t0:t0 + E].double() - l_ref).abs().max().item() <= 6e-2, (L, "LSE")
        t0 += E
