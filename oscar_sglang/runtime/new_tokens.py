"""Attention among the new tokens of an extend: causal, plain BF16, un-rotated (q.k is
rotation-invariant), before it is merged by LSE with the INT2-aware prefix kernel's part.

Two implementations, chosen by OSCAR_NEW_TOKEN_ATTENTION (config.NEW_TOKEN_ATTENTION):

* 'flashinfer' (default): FlashInfer's ragged prefill (`BatchPrefillWithRaggedKVCacheWrapper`,
  what SGLang's flashinfer backend runs for the same part; FA3 on the H100). Planned once per
  forward from the host-side lengths SGLang already has (no device sync). Its LSE is in base 2;
  the merge kernel scales it.
* 'triton': SGLang's `extend_attention_fwd` with `skip_prefix` (the triton backend's kernel).

Why it matters: at 8K-token prefill chunks this part is ~20% of the prefill's FLOPs; on the H100
FlashInfer's kernel is 2.5-3.0x the Triton one, and int2 serves 64 x (8K + 512) 15% faster with it
(CHANGELOG.md, 2026-11-26).
"""
from __future__ import annotations

import torch
from sglang.srt.layers.attention.triton_backend import logit_capping_mod

LSE_NATURAL, LSE_BASE2 = False, True


class NewTokenAttentionError(RuntimeError):
    pass


class TritonNewTokens:
    """SGLang's Triton extend kernel over the new tokens only (prefix length 0 for every request)."""

    name = "triton"
    lse_base2 = LSE_NATURAL

    def __init__(self, extend_attention_fwd, zero_kv_indptr: torch.Tensor):
        self._fwd = extend_attention_fwd
        self._zero = zero_kv_indptr
        self._no_indices = zero_kv_indptr[:0].long()  # no cached keys: an empty kv_indices
        self._qo_indptr = None
        self._max_len = 0

    def plan(self, qo_indptr: torch.Tensor, extend_lens_cpu, max_extend_len: int) -> None:
        self._qo_indptr, self._max_len = qo_indptr, int(max_extend_len)

    def run(self, q3, k3, v3, layer, cap: float, want_lse: bool):
        """-> (o [T, Hq, Dv], lse [T, Hq] natural log or None). With want_lse, o is float32."""
        T, Hq, Dv = q3.shape[0], q3.shape[1], v3.shape[-1]
        zero = self._zero[: self._qo_indptr.shape[0]]
        empty = self._no_indices
        capm = logit_capping_mod(layer.logit_capping_method, cap)
        if not want_lse:
            o = q3.new_empty((T, Hq, Dv))
            self._fwd(q3, k3, v3, o, k3, v3, self._qo_indptr, zero, empty, None, True, None,
                      self._max_len, 1.0, 1.0, sm_scale=layer.scaling, logit_cap=capm)
            return o, None
        o = torch.empty((T, Hq, Dv), dtype=torch.float32, device=q3.device)
        lse = torch.empty((T, Hq), dtype=torch.float32, device=q3.device)
        self._fwd(q3, k3, v3, o, k3, v3, self._qo_indptr, zero, empty, None, True, None,
                  self._max_len, 1.0, 1.0, sm_scale=layer.scaling, logit_cap=capm,
                  lse_extend=lse, skip_prefix=True)
        return o, lse


class FlashInferNewTokens:
    """FlashInfer's ragged prefill, causal, keys = the request's own new tokens."""

    name = "flashinfer"
    lse_base2 = LSE_BASE2

    def __init__(self, *, device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, workspace_bytes: int, wrapper_cls=None):
        if wrapper_cls is None:
            try:
                from flashinfer import BatchPrefillWithRaggedKVCacheWrapper as wrapper_cls
            except Exception as e:  # noqa: BLE001 - any import failure means the same to the user
                raise NewTokenAttentionError(
                    f"OSCAR_NEW_TOKEN_ATTENTION=flashinfer (the default) needs FlashInfer, which "
                    f"SGLang installs (flashinfer-python), but it did not import: {e}. Reinstall "
                    f"SGLang's dependencies, or set OSCAR_NEW_TOKEN_ATTENTION=triton"
                ) from e
        # FlashInfer's float workspace; OSCAR_PREFIX_ATTENTION=flashinfer's wrappers share it
        self.workspace = torch.empty(int(workspace_bytes), dtype=torch.uint8, device=device)
        self._wrapper = wrapper_cls(self.workspace, "NHD")
        self._heads = (int(num_qo_heads), int(num_kv_heads), int(head_dim), int(v_head_dim))
        self._dtype = dtype

    def plan(self, qo_indptr: torch.Tensor, extend_lens_cpu, max_extend_len: int) -> None:
        if extend_lens_cpu is None:  # SGLang fills it for every extend; a sync only if it did not
            indptr = qo_indptr.to("cpu", torch.int32)
        else:
            lens = torch.tensor([int(x) for x in extend_lens_cpu], dtype=torch.int32)
            indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
            torch.cumsum(lens, 0, out=indptr[1:])
        Hq, H, D, Dv = self._heads
        # host-side indptrs: plan() copies them to the device, so no device -> host sync
        self._wrapper.plan(indptr, indptr, Hq, H, D, head_dim_vo=Dv, causal=True,
                           q_data_type=self._dtype, kv_data_type=self._dtype)

    def run(self, q3, k3, v3, layer, cap: float, want_lse: bool):
        """-> (o [T, Hq, Dv] in q's dtype, lse [T, Hq] base 2 or None)."""
        if cap and cap > 0 and layer.logit_capping_method != "tanh":
            raise NotImplementedError(
                f"oscar_triton: FlashInfer's prefill caps logits with tanh only, this layer uses "
                f"{layer.logit_capping_method!r}; set OSCAR_NEW_TOKEN_ATTENTION=triton"
            )
        soft_cap = cap if cap and cap > 0 else None
        if want_lse:
            return self._wrapper.forward_return_lse(q3, k3, v3, causal=True, sm_scale=layer.scaling,
                                                    logits_soft_cap=soft_cap)
        return self._wrapper.forward(q3, k3, v3, causal=True, sm_scale=layer.scaling,
                                     logits_soft_cap=soft_cap), None


def workspace_bytes() -> int:
    """FlashInfer's float workspace: the size SGLang's flashinfer backend uses."""
    from sglang.srt.environ import envs

    return int(envs.SGLANG_FLASHINFER_WORKSPACE_SIZE.get())
