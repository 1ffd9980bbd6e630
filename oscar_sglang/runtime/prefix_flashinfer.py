"""The cached prefix of an extend read through BF16 pieces and FlashInfer's prefill
(OSCAR_PREFIX_ATTENTION=flashinfer; per-channel key formats only).

The INT2-aware prefix kernel runs its MMAs at ~180 TFLOP/s on the H100 where FlashInfer's prefill
runs 540-670 (CHANGELOG.md), and long prompts spend most of their prefill there. Here each
layer's prefix is instead written out as BF16 rows (ops.dequant_prefix_channel: what the reader
sees, sink / ring copies included) a bounded piece at a time, FlashInfer's ragged prefill attends
over each piece (non-causal, LSE out), and the pieces are merged with the new tokens' part by LSE.
Piece c holds positions [c * C, (c + 1) * C) of every request's prefix, C a multiple of the page
block chosen so a piece has at most MAX_PIECE_ROWS rows (the scratch: 2 x rows x H x D bf16, 128
MiB at 32768 rows, 8 KV heads, head_dim 128). Planned once per forward from host-side lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .device_index import to_device

MAX_PIECE_ROWS = 32768


def piece_len(prefix_lens: list[int], block: int, max_rows: int = MAX_PIECE_ROWS) -> int:
    """Positions per piece: a multiple of `block`, so that the requests holding a prefix fill at
    most max_rows rows (one block each at least)."""
    n = sum(1 for x in prefix_lens if x > 0)
    return max(block, (max_rows // max(n, 1)) // block * block)


def plan_pieces(prefix_lens: list[int], block: int, max_rows: int = MAX_PIECE_ROWS) -> list[tuple[int, list[int]]]:
    """[(first position, [positions of request b in this piece])] covering every prefix."""
    C = piece_len(prefix_lens, block, max_rows)
    longest = max(prefix_lens, default=0)
    return [(lo, [max(0, min(C, x - lo)) for x in prefix_lens]) for lo in range(0, longest, C)]


@dataclass
class Piece:
    wrapper: object
    lo: torch.Tensor        # [B] int32, first position of each request's range (device)
    indptr: torch.Tensor    # [B + 1] int32, rows of each request (device)
    rows: int
    max_len: int


class FlashInferPrefix:
    """Per-forward plan (one FlashInfer ragged wrapper per piece) and the per-layer run."""

    name = "flashinfer"

    def __init__(self, *, workspace: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, block: int, wrapper_cls=None,
                 max_rows: int = MAX_PIECE_ROWS):
        if wrapper_cls is None:
            try:
                from flashinfer import BatchPrefillWithRaggedKVCacheWrapper as wrapper_cls
            except Exception as e:  # noqa: BLE001 - any import failure means the same to the user
                raise RuntimeError(f"OSCAR_PREFIX_ATTENTION=flashinfer needs FlashInfer (SGLang's "
                                   f"flashinfer-python), which did not import: {e}; unset it") from e
        self._cls, self._ws = wrapper_cls, workspace
        self._wrappers: list = []   # reused across forwards: plan() re-plans them
        self._heads = (int(num_qo_heads), int(num_kv_heads), int(head_dim), int(v_head_dim))
        self._dtype, self._block, self._max_rows = dtype, int(block), int(max_rows)
        self.pieces: list[Piece] = []

    def plan(self, extend_lens_cpu, prefix_lens_cpu, device) -> None:
        Hq, H, D, Dv = self._heads
        qo = _indptr(extend_lens_cpu)
        self.pieces = []
        for i, (lo, lens) in enumerate(plan_pieces([int(x) for x in prefix_lens_cpu], self._block, self._max_rows)):
            if i == len(self._wrappers):
                self._wrappers.append(self._cls(self._ws, "NHD"))
            w = self._wrappers[i]
            kv = _indptr(lens)
            w.plan(qo, kv, Hq, H, D, head_dim_vo=Dv, causal=False, q_data_type=self._dtype,
                   kv_data_type=self._dtype)
            self.pieces.append(Piece(w, to_device([lo] * len(lens), torch.int32, device),
                                     to_device(kv, torch.int32, device), int(kv[-1]), max(lens)))

    def run(self, q_rot, layer, cached_kv_args: dict, soft_cap):
        """Yields (o [T, Hq, Dv] in q's dtype, rotated V space; lse [T, Hq] base 2) per piece."""
        from oscar_kernels import ops

        _, H, D, Dv = self._heads
        kw = {k: v for k, v in cached_kv_args.items() if k != "sm_scale"}
        for p in self.pieces:
            kb = torch.empty((p.rows, H, D), dtype=self._dtype, device=q_rot.device)
            vb = torch.empty((p.rows, H, Dv), dtype=self._dtype, device=q_rot.device)
            ops.dequant_prefix_channel(piece_lo=p.lo, out_indptr=p.indptr, out_k=kb, out_v=vb,
                                       max_piece_len=p.max_len, **kw)
            yield p.wrapper.forward_return_lse(q_rot, kb, vb, causal=False, sm_scale=layer.scaling,
                                               logits_soft_cap=soft_cap)


def _indptr(lens) -> torch.Tensor:
    t = torch.zeros(len(lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor([int(x) for x in lens], dtype=torch.int32), 0, out=t[1:])
    return t
