"""The new tokens' attention of an extend with FlashInfer's real ragged prefill (CUDA only), vs
float64, and merged with a prefix part as the backend does.

The CPU tests run the backend against a stand-in wrapper (tests/runtime/fake_flashinfer.py) that
assumes FlashInfer's LSE is in base 2; this checks that assumption, the plan from host-side
lengths, GQA head mapping and the merge kernel on the real library. Requests of 1 token (a
mixed-chunk decode), odd lengths and one long request; keys with outlier channels.
Bounds: bf16 operands and output, 1e-2 relative per request, LSE 1e-2 absolute (natural log).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref

from oscar_sglang.runtime.new_tokens import FlashInferNewTokens, TritonNewTokens, workspace_bytes

LENS = [1, 37, 300, 1030]
HQ, H, D = 8, 2, 128


def _inputs():
    T = sum(LENS)
    out = 1 + 6 * (torch.rand(D) > 0.95)
    q = (torch.randn(T, HQ, D) * out).bfloat16().cuda()
    k = (torch.randn(T, H, D) * out).bfloat16().cuda()
    v = torch.randn(T, H, D).bfloat16().cuda()
    qo = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int64)
    return q, k, v, qo


@pytest.mark.parametrize("impl", ["flashinfer", "triton"])
def test_new_tokens_match_float64_and_merge_with_a_prefix(seed, impl):
    q, k, v, qo = _inputs()
    layer = SimpleNamespace(scaling=D ** -0.5, logit_capping_method="tanh")
    if impl == "flashinfer":
        nt = FlashInferNewTokens(device="cuda", num_qo_heads=HQ, num_kv_heads=H, head_dim=D, v_head_dim=D,
                                 dtype=torch.bfloat16, workspace_bytes=workspace_bytes())
    else:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

        nt = TritonNewTokens(extend_attention_fwd, torch.zeros(len(LENS) + 1, dtype=torch.int32, device="cuda"))
    nt.plan(qo.cuda(), LENS, max(LENS))
    o, lse = nt.run(q, k, v, layer, 0.0, want_lse=True)
    o_only, none = nt.run(q, k, v, layer, 0.0, want_lse=False)
    assert none is None
    lse_nat = lse * (math.log(2.0) if nt.lse_base2 else 1.0)
    # a prefix part with its own LSE, merged as the backend does
    o_pre = torch.randn_like(o, dtype=torch.float32)
    l_pre = torch.randn(lse.shape, device="cuda") * 3 + 5
    l_pre[: LENS[0]] = float("-inf")  # request 0: no cached prefix
    merged = ops.merge_attention_states(o_pre, l_pre, o, lse, lse_b_base2=nt.lse_base2, out_dtype=torch.bfloat16)
    for s, e in zip(qo[:-1].tolist(), qo[1:].tolist()):
        o_ref, l_ref = ref.attention(q[s:e], k[s:e], v[s:e], D ** -0.5, causal_offset=0)
        err = ((o[s:e].double() - o_ref).norm() / o_ref.norm()).item()
        assert err <= 1e-2, (e - s, err)
        assert ((o_only[s:e].double() - o_ref).norm() / o_ref.norm()).item() <= 1e-2
        assert (lse_nat[s:e].double() - l_ref).abs().max().item() <= 1e-2, (e - s, "LSE")
        m_ref, _ = ref.merge_attention_states(o_pre[s:e].double(), l_pre[s:e].double(), o_ref, l_ref)
        m_err = ((merged[s:e].double() - m_ref).norm() / m_ref.norm()).item()
        assert m_err <= 1e-2, (e - s, "merge", m_err)
