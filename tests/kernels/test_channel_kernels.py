"""Kernels for per-channel keys over page blocks (KVFormat k_layout="channel") vs the references.

Decode: a paged pool built with reference.quantize_key_blocks / quantize_rows at random
page-aligned slots (pages shuffled, page 0 = padding), shuffled request rows, garbage in every
side-buffer entry the source rule must not read, NaN params for the pages of incomplete blocks
(a kernel that read them would return NaN). Oracle: reference.format_request_kv (the reader's
view of the KVFormat, computed from the request's own keys, not from the pool) + float64
reference.attention. Bound: ||o - o_ref|| / ||o_ref|| <= 1e-4 with fp32 tensor-core operands
(Triton interpreter, CPU), 2e-2 with bf16 operands (CUDA: q * scale and p are rounded to bf16).

Store: codes and params bit-identical to reference.quantize_key_blocks of the request's whole
key sequence (as the ring holds it), blocks quantised exactly when their last position is stored,
values bit-identical to reference.quantize_rows, side buffers exact.
"""
import math

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.format import KVFormat, code_bytes

from .pool_case import DEV, REL_TOL, rel_err, rotated_kv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
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
        self.k_params[0] = torch.rand(hkv, D, 2).half()  # padding page: finite, never used
        self.v_codes = torch.randint(0, 256, (N, hkv, D // 4), dtype=torch.uint8)
        self.v_params = torch.rand(N, hkv, D // fmt.v_group, 2).half()
        self.sink_k = (torch.randn(n_rows, S, hkv, D) * GARBAGE).bfloat16()
        self.sink_v = (torch.randn(n_rows, S, hkv, D) * GARBAGE).bfloat16()
        self.ring_k = (torch.randn(n_rows, W, hkv, D) * GARBAGE).bfloat16()
        self.ring_v = (torch.randn(n_rows, W, hkv, D) * GARBAGE).bfloat16()
        perm = (torch.randperm(n_pages - 1) + 1).tolist()
        slots, self.k, self.v, self.slots = [], [], [], []
        # request 0 (len 1) is a CUDA-graph padding request at row 0; the others at shuffled rows
        others = (torch.randperm(n_rows - 1)[: len(lens) - 1] + 1).tolist()
        self.rows = torch.tensor([0] + others, dtype=torch.int32)
        self.own_start = torch.randint(0, 60, (n_rows,), dtype=torch.int32)
        self.own_start[self.rows.long()] = torch.tensor(owns, dtype=torch.int32)
        self.sink_start = torch.randint(0, 60, (n_rows,), dtype=torch.int32)
        self.sink_start[self.rows.long()] = torch.tensor(sinks, dtype=torch.int32)
        for b, L in enumerate(lens):
            pg = torch.tensor([perm.pop() for _ in range(pages[b])])
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


def run_decode(pool, q, max_splits, nsplit=None, **kw):
    B, Hq, D = q.shape
    o = torch.full((B, Hq, D), float("nan"), device=DEV)
    logits = torch.full((B, Hq, max_splits, D), float("nan"), device=DEV)
    lse = torch.full((B, Hq, max_splits), float("nan"), device=DEV)
    ops.decode_attention_channel(q.to(DEV), o, *pool.args(), **pool.kw(), sm_scale=1 / math.sqrt(D),
                                 num_kv_splits=nsplit, max_kv_splits=max_splits, attn_logits=logits,
                                 attn_lse=lse, **kw)
    return o.cpu()


@pytest.mark.parametrize("D,bits,B,vg,gqa,splits", [
    (128, 3, 32, 128, 4, "auto"),
    (128, 3, 32, 64, 2, "given"),
    (64, 2, 32, 64, 3, "given"),
    (64, 2, 32, 16 * 2, 1, "auto"),
    (64, 4, 32, 64, 2, "given"),
    (64, 3, 64, 64, 2, "auto"),
])
def test_decode_channel_matches_reference(seed, D, bits, B, vg, gqa, splits):
    hkv = 2
    reqs = REQS_32 if B == 32 else REQS_64
    fmt = channel_fmt(D, bits, B, vg)
    pool = ChannelPool(fmt, *map(list, zip(*reqs)), hkv=hkv)
    nb = len(reqs)
    q = (torch.randn(nb, hkv * gqa, D) * 2).bfloat16()
    # given: a few splits per request (more splits than body blocks for some); auto: the body's
    # key count in chunks of 32 keys (min_chunk), so the longer requests use several body splits
    nsplit = torch.randint(2, 6, (nb,), dtype=torch.int32).to(DEV) if splits == "given" else None
    o = run_decode(pool, q, 5, nsplit, min_chunk=32)
    assert not o.isnan().any()
    for b in range(nb):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V)
        assert rel_err(o[b], o_ref[0]) <= REL_TOL, (b, rel_err(o[b], o_ref[0]))


def test_decode_channel_logit_cap_and_default_plan(seed):
    """Logit cap; split count and scratch from the defaults (no max_kv_splits, no scratch)."""
    D, gqa, cap = 64, 2, 5.0
    fmt = channel_fmt(D, 3, 32, 64)
    pool = ChannelPool(fmt, [1, 110], [0, 0], [0, 0], hkv=1)
    q = (torch.randn(2, gqa, D) * 4).bfloat16()
    o = torch.full((2, gqa, D), float("nan"), device=DEV)
    ops.decode_attention_channel(q.to(DEV), o, *pool.args(), **pool.kw(), sm_scale=0.125, logit_cap=cap)
    for b in range(2):
        K, V = pool.request_kv(b)
        s = torch.einsum("thd,lhd->htl", q[b:b + 1].double(), K.double().repeat_interleave(gqa, 1)) * 0.125
        p = torch.softmax(cap * torch.tanh(s / cap), -1)
        o_ref = torch.einsum("htl,lhd->thd", p, V.double().repeat_interleave(gqa, 1))
        assert rel_err(o[b].cpu(), o_ref[0]) <= REL_TOL


def test_decode_channel_rejects_unsupported(seed):
    fmt = channel_fmt(64, 2, 32, 64)
    pool = ChannelPool(fmt, [1, 40], [0, 0], [0, 0], hkv=1)
    q = torch.randn(2, 2, 64).bfloat16().to(DEV)
    o = torch.empty(2, 2, 64, device=DEV)
    args, kw = pool.args(), pool.kw()
    with pytest.raises(ValueError, match="k_codes must be uint8"):
        ops.decode_attention_channel(q, o, *args, **dict(kw, k_bits=3), sm_scale=0.1)
    with pytest.raises(ValueError, match="not a page size"):
        ops.decode_attention_channel(q, o, *args, **dict(kw, k_block=16), sm_scale=0.1)
    with pytest.raises(ValueError, match="k_params must be float16"):
        ops.decode_attention_channel(q, o, args[0], args[1][:, :, :32], *args[2:], **kw, sm_scale=0.1)
    with pytest.raises(ValueError, match="head_dim 32"):
        ops.decode_attention_channel(q[..., :32], o, *args, **kw, sm_scale=0.1)
