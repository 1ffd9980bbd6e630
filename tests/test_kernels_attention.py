"""Decode and extend-prefix attention kernels vs the float64 reference on the same pool.

The pool (INT2 codes/params at random slots, BF16 sink/ring rows) is built with the reference
quantiser; side-buffer entries that the source rule must never read are filled with huge garbage.
The oracle is reference.pool_request_kv (what a reader of len keys sees) + reference.attention in
float64. Error bound: ||o - o_ref|| / ||o_ref|| per request <= 1e-4 where the tensor-core operands
are fp32 (Triton interpreter, CPU) and <= 2e-2 with bf16 operands (CUDA: p and p*scale are rounded
to bf16 for tl.dot, as in SGLang's own kernel); LSE abs error <= 1e-4 / 1e-2 likewise.
"""
import math

import pytest
import torch

from oscar_kernels import Int2Format, ops
from oscar_kernels import reference as ref
from oscar_kernels.triton.attend import PV_DTYPE
import triton.language as tl

# the Triton interpreter trips a numpy deprecation on every scalar index
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _base_decode_kernel(monkeypatch):
    """These tests cover the base decode kernel (attend.py); test_kernels_fast.py the fast one,
    which ops.decode_attention picks by default where it applies."""
    monkeypatch.setenv("OSCAR_INT2_DECODE_KERNEL", "base")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REL_TOL = 1e-4 if PV_DTYPE == tl.float32 else 2e-2
S, W = 4, 8  # tiny sink / ring so short requests cross every boundary
GARBAGE = 1e4


def rotated_kv(n, h, d):
    """Rows with heavy-tailed channels (per head) and low-norm sink tokens at positions 0-1."""
    x = torch.randn(n, h, d)
    for j in range(h):
        ch = torch.randperm(d)[:3]
        x[:, j, ch] *= 1 + 15 * torch.rand(3)
    x[:2] *= 1e-2
    return x


class Pool:
    """Paged INT2 pool + BF16 side buffers holding a batch of requests (slot 0 = padding)."""

    def __init__(self, lens, owns, hkv, d, g, n_rows=6, sinks=None):
        self.fmt = Int2Format(d, g)
        sinks = owns if sinks is None else sinks  # sink_start per request (default: own_start)
        self.lens, self.owns, self.sinks = lens, owns, sinks
        total = sum(lens)
        N = total + 7
        self.k_codes = torch.randint(0, 256, (N, hkv, d // 4), dtype=torch.uint8)
        self.v_codes = torch.randint(0, 256, (N, hkv, d // 4), dtype=torch.uint8)
        self.k_params = torch.rand(N, hkv, d // g, 2).half()
        self.v_params = torch.rand(N, hkv, d // g, 2).half()
        self.sink_k = torch.randn(n_rows, S, hkv, d).bfloat16() * GARBAGE
        self.sink_v = torch.randn(n_rows, S, hkv, d).bfloat16() * GARBAGE
        self.ring_k = torch.randn(n_rows, W, hkv, d).bfloat16() * GARBAGE
        self.ring_v = torch.randn(n_rows, W, hkv, d).bfloat16() * GARBAGE
        slots = (torch.randperm(N - 1)[:total] + 1).int()
        self.kv_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        self.kv_indices = slots
        # request 0 is a CUDA-graph padding request when its len is 1: row 0. The others sit at
        # shuffled rows with garbage own_start on unused rows, so a kernel that indexed per-request
        # state by batch position instead of by row would read the wrong own_start.
        others = (torch.randperm(n_rows - 1)[: len(lens) - 1] + 1).tolist()
        self.rows = torch.tensor([0] + others, dtype=torch.int32)
        self.own_start = torch.randint(0, 60, (n_rows,), dtype=torch.int32)
        self.own_start[self.rows.long()] = torch.tensor(owns, dtype=torch.int32)
        self.sink_start = torch.randint(0, 60, (n_rows,), dtype=torch.int32)
        self.sink_start[self.rows.long()] = torch.tensor(sinks, dtype=torch.int32)
        self.k, self.v = [], []
        for b, (L, own, sink0) in enumerate(zip(lens, owns, sinks)):
            k, v = rotated_kv(L, hkv, d), rotated_kv(L, hkv, d)
            self.k.append(k)
            self.v.append(v)
            sl = slots[self.kv_indptr[b]:self.kv_indptr[b + 1]].long()
            for x, codes, params, sink, ring in (
                (k, self.k_codes, self.k_params, self.sink_k, self.ring_k),
                (v, self.v_codes, self.v_params, self.sink_v, self.ring_v),
            ):
                c, p = ref.quantize(x, self.fmt)
                codes[sl], params[sl] = c, p
                r = int(self.rows[b])
                for pos in range(sink0, min(S, L)):
                    sink[r, pos] = x[pos].bfloat16()
                for pos in range(max(own, L - W), L):
                    ring[r, pos % W] = x[pos].bfloat16()

    def tensors(self):
        return [t.to(DEV) for t in (self.k_codes, self.k_params, self.v_codes, self.v_params,
                                    self.sink_k, self.sink_v, self.ring_k, self.ring_v)]

    def meta(self):
        return [t.to(DEV) for t in (self.kv_indptr, self.kv_indices, self.rows, self.own_start)]

    def kw(self):
        return {"sink_start": self.sink_start.to(DEV)}

    def request_kv(self, b):
        sl = self.kv_indices[self.kv_indptr[b]:self.kv_indptr[b + 1]]
        r = int(self.rows[b])
        own, sink0 = self.owns[b], self.sinks[b]
        K = ref.pool_request_kv(self.k_codes, self.k_params, self.sink_k, self.ring_k, sl, r, own, self.fmt, sink0)
        V = ref.pool_request_kv(self.v_codes, self.v_params, self.sink_v, self.ring_v, sl, r, own, self.fmt, sink0)
        return K, V


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


# lens/own_start/sink_start: padding request (len 1, row 0), short (< S+W: all BF16), own_start
# inside the sink (INT2 hole around the sink), own_start past the sink and the ring start (radix
# hit), and a radix hit whose sink and part of its ring copies were carried over (sink_start 0,
# own_start past the ring start: INT2 between the sink and the ring)
LENS = [1, 7, 45, 70, 60]
OWNS = [0, 0, 2, 66, 55]
SINKS = [0, 0, 2, 66, 0]
CASES = [  # (D, G, gqa)
    (128, 128, 4),
    (128, 64, 8),
    (128, 32, 1),
    (64, 32, 3),
    (64, 64, 4),
    (256, 32, 2),  # G < D/4: the explicit-dequantisation path
]


def test_pool_oracle_matches_mixed_kv(seed):
    """The pool reader equals reference.mixed_kv on the request's own rows (own_start = 0)."""
    pool = Pool([30], [0], 2, 64, 32)
    K, _ = pool.request_kv(0)
    torch.testing.assert_close(K, ref.mixed_kv(pool.k[0], pool.fmt, sink=S, window=W), rtol=0, atol=0)


@pytest.mark.parametrize("D,G,gqa", CASES)
@pytest.mark.parametrize("splits", ["auto", "given"])
def test_decode_matches_reference(seed, D, G, gqa, splits):
    hkv = 2
    pool = Pool(LENS, OWNS, hkv, D, G, sinks=SINKS)
    B, Hq = len(LENS), hkv * gqa
    q = (torch.randn(B, Hq, D) * 2).bfloat16()
    o = torch.full((B, Hq, D), float("nan"), device=DEV)
    max_splits = 4
    logits = torch.full((B, Hq, max_splits, D), float("nan"), device=DEV)
    lse = torch.full((B, Hq, max_splits), float("nan"), device=DEV)
    nsplit = torch.tensor([2, 3, 4, 4, 3], dtype=torch.int32, device=DEV) if splits == "given" else None
    ops.decode_attention(
        q.to(DEV), o, *pool.tensors(), *pool.meta(), **pool.kw(), k_group=G, v_group=G, sm_scale=1 / math.sqrt(D),
        num_kv_splits=nsplit, max_kv_splits=max_splits, attn_logits=logits, attn_lse=lse,
    )
    assert not o.isnan().any()
    for b in range(B):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V)
        err = rel_err(o[b].cpu(), o_ref[0])
        assert err <= REL_TOL, (b, err)


def test_decode_small_tiles_many_splits(seed):
    """BLOCK_N=16, in-kernel split count, 3 BF16 splits: several tiles and splits per source."""
    from oscar_kernels.triton import decode as dec

    D, G, hkv, gqa = 64, 64, 1, 4
    lens, owns = [100, 37], [0, 10]
    pool = Pool(lens, owns, hkv, D, G)
    q = torch.randn(2, hkv * gqa, D).bfloat16()
    o = torch.full((2, hkv * gqa, D), float("nan"), device=DEV)
    old = dec.MIN_CHUNK, dec.BF16_KEYS_PER_SPLIT
    dec.MIN_CHUNK = 16  # in-kernel split derivation: ceil(n_int2 / 16) splits, capped
    dec.BF16_KEYS_PER_SPLIT = 4  # S + W = 12 BF16 keys -> 3 BF16 splits
    try:
        assert dec.bf16_splits(S, W, 7) == 3
        dec.decode_attention(q.to(DEV), o, *pool.tensors(), *pool.meta(), k_group=G, v_group=G,
                             sm_scale=0.125, max_kv_splits=7, block_n=16)
    finally:
        dec.MIN_CHUNK, dec.BF16_KEYS_PER_SPLIT = old
    for b in range(2):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V, sm_scale=0.125)
        assert rel_err(o[b].cpu(), o_ref[0]) <= REL_TOL


def test_decode_logit_cap(seed):
    D, G, hkv, gqa, cap = 64, 32, 1, 2, 5.0
    pool = Pool([40], [0], hkv, D, G)
    q = (torch.randn(1, hkv * gqa, D) * 4).bfloat16()
    o = torch.full((1, hkv * gqa, D), float("nan"), device=DEV)
    ops.decode_attention(q.to(DEV), o, *pool.tensors(), *pool.meta(), k_group=G, v_group=G,
                         sm_scale=0.125, max_kv_splits=3, logit_cap=cap)
    K, V = pool.request_kv(0)
    qf = q.double()
    kk = K.double().repeat_interleave(gqa, 1)
    s = torch.einsum("thd,lhd->htl", qf, kk) * 0.125
    p = torch.softmax(cap * torch.tanh(s / cap), -1)
    o_ref = torch.einsum("htl,lhd->thd", p, V.double().repeat_interleave(gqa, 1))
    assert rel_err(o[0].cpu(), o_ref[0]) <= REL_TOL


@pytest.mark.parametrize("D,G,gqa", [CASES[0], CASES[3], CASES[5]])
def test_extend_prefix_matches_reference_and_merges(seed, D, G, gqa):
    hkv = 2
    prefix = [0, 7, 45, 70, 60]  # request 0: no prefix -> o = 0, lse = -inf
    owns = [0, 0, 2, 66, 55]
    sinks = [0, 0, 2, 66, 0]
    ext = [3, 1, 5, 2, 2]
    pool = Pool(prefix, owns, hkv, D, G, sinks=sinks)
    Hq = hkv * gqa
    qo_indptr = torch.tensor([0] + torch.tensor(ext).cumsum(0).tolist(), dtype=torch.int32)
    T = sum(ext)
    q = (torch.randn(T, Hq, D) * 2).bfloat16()
    o = torch.full((T, Hq, D), float("nan"), device=DEV)
    lse = torch.full((T, Hq), float("nan"), device=DEV)
    sm = 1 / math.sqrt(D)
    o, lse = ops.extend_prefix_attention(
        q.to(DEV), qo_indptr.to(DEV), *pool.tensors(), *pool.meta(), **pool.kw(), k_group=G, v_group=G,
        sm_scale=sm, max_len_extend=max(ext), o=o, lse=lse,
    )
    o, lse = o.cpu(), lse.cpu()
    assert not o.isnan().any() and not lse.isnan().any()
    for b in range(len(ext)):
        t0, t1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if prefix[b] == 0:
            assert torch.all(o[t0:t1] == 0) and torch.all(lse[t0:t1] == float("-inf"))
            continue
        K, V = pool.request_kv(b)
        o_ref, lse_ref = ref.attention(q[t0:t1].float(), K, V, sm_scale=sm)
        assert rel_err(o[t0:t1], o_ref) <= REL_TOL
        assert (lse[t0:t1].double() - lse_ref).abs().max() <= REL_TOL
        # the caller's merge with causal attention over the new tokens = attention over everything
        kn, vn = torch.randn(t1 - t0, hkv, D), torch.randn(t1 - t0, hkv, D)
        o_new, lse_new = ref.attention(q[t0:t1].float(), kn, vn, sm_scale=sm, causal_offset=0)
        om, _ = ref.merge_attention_states(o[t0:t1].double(), lse[t0:t1].double(), o_new, lse_new)
        o_all, _ = ref.attention(q[t0:t1].float(), torch.cat([K, kn]), torch.cat([V, vn]), sm_scale=sm,
                                 causal_offset=prefix[b])
        assert rel_err(om, o_all) <= REL_TOL
