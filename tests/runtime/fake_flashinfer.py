"""A CPU stand-in for FlashInfer's BatchPrefillWithRaggedKVCacheWrapper, for the backend tests.

It checks what runtime/new_tokens.py and prefix_flashinfer.py plan (host-side int32 indptrs; causal
only over a request's own new tokens; this rank's head counts, the model dtype) and computes what
the real wrapper computes: softmax attention of each request's queries over its keys (causal or
not), here in float64, with the LSE in base 2 (FlashInfer's convention), so a missing base
conversion in the merge shows up as a wrong output; a request without keys gets NaN and -inf.
The real wrapper runs in tests/gpu/ on the H100.
"""
import math

import torch

from oscar_kernels import reference as ref


class FakeRaggedWrapper:
    def __init__(self, workspace, layout):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.indptr = None
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             causal=False, q_data_type=None, kv_data_type=None, **kw):
        for t in (qo_indptr, kv_indptr):
            assert t.device.type == "cpu" and t.dtype == torch.int32, "plan from host data"
        assert not kw and len(qo_indptr) == len(kv_indptr)
        assert not causal or torch.equal(qo_indptr, kv_indptr)  # causal: a request's own new tokens
        self.indptr, self.kv_indptr, self.causal = qo_indptr.tolist(), kv_indptr.tolist(), causal
        self.heads = (num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo)
        self.dtype = (q_data_type, kv_data_type)
        self.plans += 1

    def forward_return_lse(self, q, k, v, causal=False, sm_scale=None, logits_soft_cap=None):
        assert causal == self.causal and logits_soft_cap is None
        assert self.indptr[-1] == q.shape[0] and self.kv_indptr[-1] == k.shape[0] == v.shape[0]
        assert (q.shape[1], k.shape[1], q.shape[2], v.shape[2]) == self.heads
        assert q.dtype == self.dtype[0] and k.dtype == self.dtype[1]
        o = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        for b in range(len(self.indptr) - 1):
            s, e = self.indptr[b], self.indptr[b + 1]
            ks, ke = self.kv_indptr[b], self.kv_indptr[b + 1]
            if ke == ks:  # no keys: the worst a kernel could leave (the merge must ignore it)
                o[s:e], lse[s:e] = float("nan"), float("-inf")
                continue
            ob, lb = ref.attention(q[s:e], k[ks:ke], v[ks:ke], sm_scale, causal_offset=0 if causal else None)
            o[s:e] = ob.to(o.dtype)
            lse[s:e] = (lb / math.log(2.0)).float()
        return o, lse

    def forward(self, q, k, v, causal=False, sm_scale=None, logits_soft_cap=None):
        return self.forward_return_lse(q, k, v, causal, sm_scale, logits_soft_cap)[0]


def fake_flashinfer_new_tokens(Hq, H, D, Dv, dtype=torch.float32):
    from oscar_sglang.runtime.new_tokens import FlashInferNewTokens

    return FlashInferNewTokens(device="cpu", num_qo_heads=Hq, num_kv_heads=H, head_dim=D, v_head_dim=Dv,
                               dtype=dtype, workspace_bytes=64, wrapper_cls=FakeRaggedWrapper)


def fake_flashinfer_prefix(Hq, H, D, Dv, block, max_rows, dtype=torch.float32):
    from oscar_sglang.runtime.prefix_flashinfer import FlashInferPrefix

    return FlashInferPrefix(workspace=torch.empty(64, dtype=torch.uint8), num_qo_heads=Hq, num_kv_heads=H,
                            head_dim=D, v_head_dim=Dv, dtype=dtype, block=block, wrapper_cls=FakeRaggedWrapper,
                            max_rows=max_rows)
