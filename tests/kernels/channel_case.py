"""The paged per-channel pool the channel kernel tests share (decode, extend, store end to end).

A paged pool built with reference.quantize_key_blocks / quantize_rows at random page-aligned slots
(pages shuffled, page 0 = padding), shuffled request rows, garbage in every side-buffer entry the
source rule must not read, NaN params for the pages of incomplete blocks (a kernel that read them
would return NaN). Oracle: reference.format_request_kv (the reader's view of the KVFormat, computed
from the request's own keys, not from the pool) + float64 reference.attention. Bound:
||o - o_ref|| / ||o_ref|| <= 1e-4 with fp32 tensor-core operands (Triton interpreter, CPU), 2e-2
with 16-bit operands (CUDA).
"""
import math

import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.format import KVFormat, code_bytes

from .pool_case import DEV, request_rows, rotated_kv

S = 4  # KVFormat sinks are 0 / 4 / 64, rings 32..256 and >= one block
GARBAGE = 1e4


class ChannelPool:
    """Paged pool of one layer in a channel-key KVFormat holding a batch of requests.

    Request b owns whole pages (slot = page * B + offset, pages shuffled); its keys are
    quantised per block with the reference, only its complete blocks have params."""

    def __init__(self, fmt, lens, owns, sinks, hkv, n_rows=7):
        self.fmt, self.lens, self.owns, self.sinks = fmt, lens, owns, sinks
        D, B, W, kb = fmt.head_dim, fmt.k_group, fmt.window, fmt.k_bits
        pages = [math.ceil(L / B) for L in lens]
        n_pages = sum(pages) + 3
        N = n_pages * B
        self.k_codes = torch.randint(0, 256, (N, hkv, code_bytes(kb, D)), dtype=torch.uint8)
        self.k_params = torch.full((n_pages, hkv, D, 2), float("nan")).half()
        self.v_codes = torch.randint(0, 256, (N, hkv, D // 4), dtype=torch.uint8)
        self.v_params = torch.rand(N, hkv, D // fmt.v_group, 2).half()
        self.v_params[:B] = float("nan")  # page 0 (padding): no tile may read it
        self.sink_k = (torch.randn(n_rows, S, hkv, D) * GARBAGE).bfloat16()
        self.sink_v = (torch.randn(n_rows, S, hkv, D) * GARBAGE).bfloat16()
        self.ring_k = (torch.randn(n_rows, W, hkv, D) * GARBAGE).bfloat16()
        self.ring_v = (torch.randn(n_rows, W, hkv, D) * GARBAGE).bfloat16()
        perm = (torch.randperm(n_pages - 1) + 1).tolist()
        self.k, self.v, self.slots = [], [], []
        self.rows, self.own_start, self.sink_start = request_rows(n_rows, owns, sinks)
        for b, L in enumerate(lens):
            pg = torch.tensor([perm.pop() for _ in range(pages[b])], dtype=torch.long)
            sl = (pg.repeat_interleave(B) * B + torch.arange(B).repeat(pages[b]))[:L]
            self.slots.append(sl)
            k, v = rotated_kv(L, hkv, D), rotated_kv(L, hkv, D)
            self.k.append(k)
            self.v.append(v)
            codes, params, _ = ref.quantize_key_blocks(k, kb, B)
            n = params.shape[0]
            self.k_codes[sl[: n * B]] = codes
            self.k_params[pg[:n]] = params
            self.v_codes[sl], self.v_params[sl] = ref.quantize_rows(v, 2, fmt.v_group)
            r = int(self.rows[b])
            for x, sink, ring in ((k, self.sink_k, self.ring_k), (v, self.sink_v, self.ring_v)):
                for p in range(sinks[b], min(S, L)):
                    sink[r, p] = x[p].bfloat16()
                for p in range(max(owns[b], L - W), L):
                    ring[r, p % W] = x[p].bfloat16()
        self.kv_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        self.kv_indices = torch.cat(self.slots).int()

    def args(self):
        t = (self.k_codes, self.k_params, self.v_codes, self.v_params, self.sink_k, self.sink_v,
             self.ring_k, self.ring_v, self.kv_indptr, self.kv_indices, self.rows, self.own_start)
        return [x.to(DEV) for x in t]

    def kw(self):
        return dict(k_bits=self.fmt.k_bits, k_block=self.fmt.k_group, v_group=self.fmt.v_group,
                    sink_start=self.sink_start.to(DEV))

    def request_kv(self, b):
        """The reader's view from the request's own keys (reference.format_request_kv)."""
        kw = dict(own_start=self.owns[b], sink_start=self.sinks[b])
        return (ref.format_request_kv(self.k[b], self.fmt, "k", **kw),
                ref.format_request_kv(self.v[b], self.fmt, "v", **kw))


# (len, own_start, sink_start) with B = 32, S = 4, W = 32 (64 for B = 64):
#   padding request (len 1, row 0); all BF16 (len < S + W); own_start inside the sink (body hole
#   [2, 4) inside block 0, incomplete block 2 in the ring); body + incomplete last block from the
#   ring; radix hit past the sink (own_start 64: positions 0-3 read from the body); radix hit with
#   the sink carried over (sink_start 0, own_start 64 < len - W)
REQS_32 = [(1, 0, 0), (20, 0, 0), (75, 2, 2), (110, 0, 0), (100, 64, 64), (130, 64, 0)]
REQS_64 = [(1, 0, 0), (50, 0, 0), (150, 0, 0), (140, 64, 64), (200, 64, 0)]


def channel_fmt(D, bits, B, vg):
    return KVFormat(D, bits, "channel", B, 2, vg, sink=S, window=max(32, B))


def run_decode(pool, q, max_splits, nsplit=None, launcher=False, **kw):
    """launcher: call channel_decode's launcher (its tuning knobs) instead of the op."""
    from oscar_kernels.triton import channel_decode

    B, Hq, D = q.shape
    o = torch.full((B, Hq, D), float("nan"), device=DEV)
    logits = torch.full((B, Hq, max_splits, D), float("nan"), device=DEV)
    lse = torch.full((B, Hq, max_splits), float("nan"), device=DEV)
    (channel_decode.decode_attention_channel if launcher else ops.decode_attention_channel)(q.to(DEV), o, *pool.args(), **pool.kw(), sm_scale=1 / math.sqrt(D),
                                 num_kv_splits=nsplit, max_kv_splits=max_splits, attn_logits=logits,
                                 attn_lse=lse, **kw)
    return o.cpu()
