"""Store for per-channel keys (triton/channel_store.py) vs the references, and store followed by
decode / extend-prefix end to end.

Codes and params bit-identical to reference.quantize_key_blocks of the request's whole key
sequence (as the ring holds it), blocks quantised exactly when their last position is stored,
values bit-identical to reference.quantize_rows, side buffers exact; the end-to-end tests read the
stored pool with the kernels against the float64 reference.
"""
import math

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.format import code_bytes
from oscar_kernels.hadamard import hadamard

from .channel_case import GARBAGE, S, channel_fmt
from .pool_case import DEV, REL_TOL, rel_err, rotated_kv
from .test_channel_extend import check_extend

pytestmark = pytest.mark.slow  # the module's cases take minutes on 2 cores: make test, not test-fast


def store_requests(B):
    """(row, total length, [call-1 positions, call-2 positions]) of three requests:
    A: call 1 ends mid-block (block 1 not yet quantised), call 2 completes it (its first 8
       positions from the ring, which call 2 itself overwrites) and ends in an incomplete block;
    Bq: a prefill that stops one token short of block 2, then the decode token completing it
       (first token of call 2's batch: the block reaches back before the batch start);
    C: exactly one block in call 2;
    D: stored just before A in call 2 at positions B .. B+7, the positions A's block 1 must take
       from the ring: only the row tells D's tokens from A's."""
    return [
        ("A", 1, 2 * B + 11, [range(0, B + 8), range(B + 8, 2 * B + 11)]),
        ("Bq", 3, 3 * B, [range(0, 3 * B - 1), range(3 * B - 1, 3 * B)]),
        ("C", 5, B, [range(0), range(0, B)]),
        ("D", 6, B + 8, [range(0, B), range(B, B + 8)]),
    ]


CALL_ORDER = [["A", "Bq", "C", "D"], ["Bq", "D", "A", "C"]]  # batch order of each call


class StoreCase:
    """rot (optional, [hkv, D, D] float, exact in k_dtype): the store rotates the keys itself
    (rot_k; [D, D] when shared) and the queries of each call (q / q_out, gqa query heads a KV
    head); self.k holds the unrotated keys, keys() what the pool must hold."""

    def __init__(self, D, bits, B, vg, k_dtype, ring_dtype, hkv=2, n_rows=7, rot=None, shared=False, gqa=4):
        self.D, self.bits, self.B, self.vg, self.W = D, bits, B, vg, B  # the smallest ring: one block
        self.rot, self.shared, self.gqa = rot, shared, gqa
        self.reqs = store_requests(B)
        n_pages = sum(math.ceil(L / B) for _, _, L, _ in self.reqs) + 2
        N = n_pages * B
        perm = (torch.randperm(n_pages - 1) + 1).tolist()
        self.k, self.v, self.slots, self.pages = {}, {}, {}, {}
        for name, _, L, _ in self.reqs:
            # with rot: keys whose rotation is exact in fp32 (multiples of 1/4 up to 8, a few
            # channels x 16), so the pool's bf16 keys are one rounding of the exact product on
            # any summation order and the comparison can be bit for bit
            self.k[name] = (rotated_kv(L, hkv, D).to(k_dtype) if rot is None
                            else exact_outlier_rows(L, hkv, D).to(k_dtype))
            # bf16 values: store.py's value side copies cast fp32 -> bf16 with tl's cast, which
            # the Triton interpreter truncates (CUDA rounds to nearest even)
            self.v[name] = rotated_kv(L, hkv, D).bfloat16()
            pg = torch.tensor([perm.pop() for _ in range(math.ceil(L / B))])
            self.pages[name] = pg
            self.slots[name] = (pg.repeat_interleave(B) * B + torch.arange(B).repeat(len(pg)))[:L]
        self.pool = dict(
            k_codes=torch.randint(0, 256, (N, hkv, code_bytes(bits, D)), dtype=torch.uint8),
            k_params=torch.full((n_pages, hkv, D, 2), float("nan")).half(),
            v_codes=torch.randint(0, 256, (N, hkv, D // 4), dtype=torch.uint8),
            v_params=torch.full((N, hkv, D // vg, 2), float("nan")).half(),
            # never-written side entries hold garbage: a block that read one gets other params
            sink_k=(torch.randn(n_rows, S, hkv, D) * GARBAGE).to(ring_dtype),
            sink_v=(torch.randn(n_rows, S, hkv, D) * GARBAGE).bfloat16(),
            ring_k=(torch.randn(n_rows, self.W, hkv, D) * GARBAGE).to(ring_dtype),
            ring_v=(torch.randn(n_rows, self.W, hkv, D) * GARBAGE).bfloat16(),
        )
        self.initial = {n: t.clone() for n, t in self.pool.items()}
        self.pool = {n: t.to(DEV) for n, t in self.pool.items()}
        self.done = {name: 0 for name, *_ in self.reqs}

    def keys(self, name):
        """The keys the pool holds for request `name`: k @ rot[h], rounded once to k's dtype."""
        k = self.k[name]
        if self.rot is None:
            return k
        return torch.einsum("thd,hde->the", k.double(), self.rot.double()).to(k.dtype)

    def call(self, i):
        """Store the tokens of call i (0 or 1) with one store_kv_channel."""
        k, v, loc, pos, rows, seq = [], [], [], [], [], []
        by_name = {r[0]: r for r in self.reqs}
        for name in CALL_ORDER[i]:
            _, row, _, calls = by_name[name]
            ps = list(calls[i])
            if not ps:
                continue
            k.append(self.k[name][ps])
            v.append(self.v[name][ps])
            loc.append(self.slots[name][ps])
            pos += ps
            rows += [row] * len(ps)
            seq += [ps[-1] + 1] * len(ps)
            self.done[name] = ps[-1] + 1
        kw = {}
        if self.rot is not None:
            k_all = torch.cat(k)
            hkv = k_all.shape[1]
            q = exact_outlier_rows(k_all.shape[0], hkv * self.gqa, self.D).to(k_all.dtype)
            rot = (self.rot[0] if self.shared else self.rot).to(k_all.dtype)
            kw = dict(rot_k=rot.to(DEV), q=q.to(DEV), q_out=torch.full_like(q, float("nan")).to(DEV))
        ops.store_kv_channel(
            torch.cat(k).to(DEV), torch.cat(v).to(DEV), torch.cat(loc).to(DEV),
            torch.tensor(pos).to(DEV), torch.tensor(rows, dtype=torch.int32).to(DEV),
            torch.tensor(seq, dtype=torch.int32).to(DEV), **self.pool,
            k_bits=self.bits, k_block=self.B, v_group=self.vg, **kw)
        if self.rot is not None:  # each query head by its KV head's matrix, rounded once
            r = self.rot.double().repeat_interleave(self.gqa, 0)
            want = torch.einsum("thd,hde->the", q.double(), r).to(q.dtype)
            assert torch.equal(kw["q_out"].cpu(), want)

    def check(self):
        """Every request's complete blocks (of what it has stored so far) bit-equal the reference;
        slots / pages of incomplete blocks untouched; values and side buffers exact."""
        out = {n: t.cpu() for n, t in self.pool.items()}
        B, ring_dt = self.B, self.initial["ring_k"].dtype
        exp_side = {n: self.initial[n].clone() for n in ("sink_k", "sink_v", "ring_k", "ring_v")}
        for name, row, _, calls in self.reqs:
            L = self.done[name]
            if L == 0:
                continue
            sl, pg = self.slots[name][:L], self.pages[name]
            codes, params, _ = ref.quantize_key_blocks(self.keys(name)[:L].to(ring_dt), self.bits, B)
            n = params.shape[0]
            assert n == L // B
            assert torch.equal(out["k_codes"][sl[: n * B]], codes), name
            assert torch.equal(out["k_params"][pg[:n]].view(torch.int16), params.view(torch.int16)), name
            assert torch.equal(out["k_codes"][sl[n * B:]], self.initial["k_codes"][sl[n * B:]]), name
            assert out["k_params"][pg[n:]].isnan().all(), name
            vc, vp = ref.quantize_rows(self.v[name][:L], 2, self.vg)
            assert torch.equal(out["v_codes"][sl], vc) and torch.equal(out["v_params"][sl], vp), name
            # side copies: the rule of store_kv, applied call by call
            for c in calls:
                for p in c:
                    if p < S:
                        exp_side["sink_k"][row, p] = self.keys(name)[p].to(ring_dt)
                        exp_side["sink_v"][row, p] = self.v[name][p].bfloat16()
                    if p >= c[-1] + 1 - self.W and p < L:
                        exp_side["ring_k"][row, p % self.W] = self.keys(name)[p].to(ring_dt)
                        exp_side["ring_v"][row, p % self.W] = self.v[name][p].bfloat16()
        for n, e in exp_side.items():
            assert torch.equal(out[n], e), n


@pytest.mark.parametrize("D,bits,B,vg,k_dtype,ring_dtype", [
    (128, 3, 32, 128, torch.bfloat16, torch.bfloat16),
    (64, 2, 32, 64, torch.float32, torch.float32),  # fp32 ring: bit-exact on fp32 keys
    (64, 4, 32, 32, torch.float32, torch.bfloat16),  # bf16 ring: quantises bf16(k)
    (64, 3, 64, 64, torch.bfloat16, torch.bfloat16),
])
@pytest.mark.parametrize("windows", [False, True])
def test_store_channel_bit_exact_across_chunks(seed, D, bits, B, vg, k_dtype, ring_dtype, windows, monkeypatch):
    """windows: the block quantiser's programs take windows of B tokens (channel_store.
    KEY_BLOCK_WINDOWS_MIN_T, prefill chunks) instead of one token each, in every call."""
    from oscar_kernels.triton import channel_store

    if windows:
        monkeypatch.setattr(channel_store, "KEY_BLOCK_WINDOWS_MIN_T", 0)
    case = StoreCase(D, bits, B, vg, k_dtype, ring_dtype)
    case.call(0)
    case.check()  # A's block 1 and Bq's block 2 not quantised yet
    case.call(1)
    case.check()  # completed from the ring + this call's tokens


def exact_outlier_rows(n, h, d):
    """[n, h, d] rows of multiples of 1/4 in [-8, 8], 3 channels a head x 16 (outliers): with
    hadamard_rot's entries (+-1/8) every product and sum over d is exact in fp32."""
    x = torch.randint(-32, 33, (n, h, d)).float() / 4
    for j in range(h):
        x[:, j, torch.randperm(d)[:3]] *= 16
    return x


def hadamard_rot(h, d):
    """[h, d, d]: the Sylvester Hadamard matrix / 8 with random column signs per head (the
    plugin's data-free rotation up to the scale), exact in bf16."""
    signs = torch.randint(0, 2, (h, 1, d)).float() * 2 - 1
    return torch.sign(hadamard(d)).float()[None] * signs / 8


@pytest.mark.parametrize("D,bits,B,shared,gqa", [(128, 3, 32, True, 4), (64, 2, 64, False, 3), (128, 4, 32, False, 1)])
def test_store_channel_rotates_keys_and_queries_in_kernel(seed, D, bits, B, shared, gqa):
    """rot_k: the kernels rotate the unrotated keys (blocks completed from this call's keys and
    from the ring's rotated ones, side copies) and write the rotated queries (a group of 3 pads
    to 4 rows); pool and queries equal a float64 rotation rounded once, bit for bit."""
    hkv = 2
    rot = hadamard_rot(hkv, D)
    if shared:
        rot = rot[:1].expand(hkv, D, D)
    case = StoreCase(D, bits, B, 64, torch.bfloat16, torch.bfloat16, hkv=hkv, rot=rot, shared=shared, gqa=gqa)
    case.call(0)
    case.check()
    case.call(1)
    case.check()


@pytest.mark.parametrize("rotate", [False, True])
def test_store_channel_one_launch_for_a_decode_step(seed, rotate, monkeypatch):
    """one_token_per_request (a decode step): the single launch leaves the pool exactly as the two
    launches do, and so do two launches whose block quantiser takes windows of B tokens (three
    completing tokens in one window, quantised one after another). Requests prefilled to positions just before a block end (the decode token
    completes block 0 with its sink positions, or a later block, from the ring, W = B) and to
    mid-block positions, each decode token at its own row; with rot_k the keys arrive unrotated."""
    D, bits, B, hkv, gqa = 64, 3, 32, 2, 4
    lens = [B - 1, 2 * B - 1, 40, 3 * B - 1, 5]  # prefilled tokens; the decode adds one each
    case = StoreCase(D, bits, B, 64, torch.bfloat16, torch.bfloat16, hkv=hkv)
    n_pages = sum(math.ceil((L + 1) / B) for L in lens) + 1
    perm = (torch.randperm(n_pages - 1) + 1).tolist()
    slots, keys, vals = [], [], []
    for L in lens:
        pg = torch.tensor([perm.pop() for _ in range(math.ceil((L + 1) / B))])
        slots.append((pg.repeat_interleave(B) * B + torch.arange(B).repeat(len(pg)))[:L + 1])
        keys.append((rotated_kv(L + 1, hkv, D) if not rotate else exact_outlier_rows(L + 1, hkv, D)).bfloat16())
        vals.append(rotated_kv(L + 1, hkv, D).bfloat16())
    rot = hadamard_rot(hkv, D).bfloat16() if rotate else None
    held = [k if rot is None else torch.einsum("thd,hde->the", k.double(), rot.double()).bfloat16() for k in keys]
    fmt = dict(k_bits=bits, k_block=B, v_group=64)
    for b, L in enumerate(lens):  # the prefills: keys already rotated, two launches
        ops.store_kv_channel(held[b][:L].to(DEV), vals[b][:L].to(DEV), slots[b][:L].to(DEV),
                             torch.arange(L).to(DEV), torch.full((L,), b + 1, dtype=torch.int32).to(DEV),
                             torch.full((L,), L, dtype=torch.int32).to(DEV), **case.pool, **fmt)
    pos = torch.tensor(lens)
    x = torch.stack([(keys if rotate else held)[b][L] for b, L in enumerate(lens)])
    v = torch.stack([vals[b][L] for b, L in enumerate(lens)])
    q = exact_outlier_rows(len(lens), hkv * gqa, D).bfloat16()
    args = (x.to(DEV), v.to(DEV), torch.stack([slots[b][L] for b, L in enumerate(lens)]).to(DEV), pos.to(DEV),
            torch.arange(1, len(lens) + 1, dtype=torch.int32).to(DEV), (pos + 1).int().to(DEV))
    from oscar_kernels.triton import channel_store

    out = []
    for one, windows in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(channel_store, "KEY_BLOCK_WINDOWS_MIN_T", 0 if windows else 1 << 30)
        pool = {n: tt.clone() for n, tt in case.pool.items()}
        kw = {} if rot is None else dict(rot_k=rot.to(DEV), q=q.to(DEV), q_out=torch.empty_like(q).to(DEV))
        ops.store_kv_channel(*args, **pool, **fmt, **kw, one_token_per_request=one)
        out.append(({n: tt.cpu() for n, tt in pool.items()}, kw.get("q_out")))
    for other in out[1:]:
        for n in case.pool:
            assert torch.equal(out[0][0][n].view(torch.uint8), other[0][n].view(torch.uint8)), n
        if rotate:
            assert torch.equal(out[0][1].cpu(), other[1].cpu())
    # and the completed blocks are the reference's (3 of the 5 decode tokens end a block)
    for b, L in enumerate(lens):
        n_blk = (L + 1) // B
        codes, params, _ = ref.quantize_key_blocks(held[b][: n_blk * B], bits, B)
        assert torch.equal(out[1][0]["k_codes"][slots[b][: n_blk * B]], codes), b
    assert sum((L + 1) % B == 0 for L in lens) == 3


def test_store_channel_rotation_arguments_are_checked():
    case = StoreCase(64, 2, 32, 64, torch.bfloat16, torch.bfloat16)
    k = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    args = (k, k, torch.arange(3), torch.arange(3), torch.ones(3, dtype=torch.int32),
            torch.full((3,), 3, dtype=torch.int32))
    args = tuple(a.to(DEV) for a in args)
    kw = dict(**case.pool, k_bits=2, k_block=32, v_group=64)
    rot = torch.eye(64, dtype=torch.bfloat16, device=DEV)
    q = torch.zeros(3, 8, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="pass rot_k too"):
        ops.store_kv_channel(*args, **kw, q=q, q_out=q.clone())
    with pytest.raises(ValueError, match="rot_k must be"):
        ops.store_kv_channel(*args, **kw, rot_k=rot[:32])
    with pytest.raises(ValueError, match="must have k's dtype"):
        ops.store_kv_channel(*args, **kw, rot_k=rot.float())
    with pytest.raises(ValueError, match="q_out must be"):
        ops.store_kv_channel(*args, **kw, rot_k=rot, q=q)
    with pytest.raises(ValueError, match="q must be"):
        ops.store_kv_channel(*args, **kw, rot_k=rot, q=q[:, :7], q_out=q[:, :7].clone())
    # nothing was written by the refused calls
    assert all(torch.equal(case.pool[n].cpu().view(torch.uint8), case.initial[n].view(torch.uint8))
               for n in case.pool)


def test_store_then_decode_end_to_end(seed):
    """Keys stored by the store kernel in two chunks, read by the decode kernel: equals the
    reader's view of the format (reference.format_request_kv) in float64 attention."""
    D, bits, B, vg, gqa = 64, 3, 32, 64, 2
    case = StoreCase(D, bits, B, vg, torch.bfloat16, torch.bfloat16)
    case.call(0)
    case.call(1)
    fmt = channel_fmt(D, bits, B, vg)
    names = [r[0] for r in case.reqs]
    rows = torch.tensor([r[1] for r in case.reqs], dtype=torch.int32)
    lens = [case.done[n] for n in names]
    kv_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    kv_indices = torch.cat([case.slots[n] for n in names]).int()
    starts = torch.zeros(7, dtype=torch.int32)
    hkv = case.pool["k_codes"].shape[1]
    q = (torch.randn(len(names), hkv * gqa, D) * 2).bfloat16()
    o = torch.full((len(names), hkv * gqa, D), float("nan"), device=DEV)
    p = case.pool
    ops.decode_attention_channel(
        q.to(DEV), o, p["k_codes"], p["k_params"], p["v_codes"], p["v_params"], p["sink_k"],
        p["sink_v"], p["ring_k"], p["ring_v"], kv_indptr.to(DEV), kv_indices.to(DEV), rows.to(DEV),
        starts.to(DEV), k_bits=bits, k_block=B, v_group=vg, sm_scale=0.125, max_kv_splits=4,
        min_chunk=32)
    for b, n in enumerate(names):
        K = ref.format_request_kv(case.k[n].float(), fmt, "k")
        V = ref.format_request_kv(case.v[n].float(), fmt, "v")
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V, sm_scale=0.125)
        assert rel_err(o[b].cpu(), o_ref[0]) <= REL_TOL, n



def test_store_then_extend_prefix_end_to_end(seed):
    """Keys stored chunk by chunk by the store kernel, then the next chunk's extend-prefix (before
    that chunk is stored, as the backend orders it): equals float64 attention over the reader's
    view of the stored positions (reference.format_request_kv). After call 1 request A's prefix
    ends mid-block (its incomplete block from the ring), C has none; after call 2 A ends mid-block
    again and Bq's last block was completed by a single decode token."""
    D, bits, B, vg, gqa, sm = 64, 3, 32, 64, 2, 0.125
    case = StoreCase(D, bits, B, vg, torch.bfloat16, torch.bfloat16)
    fmt = channel_fmt(D, bits, B, vg)
    names = [r[0] for r in case.reqs]
    rows = torch.tensor([r[1] for r in case.reqs], dtype=torch.int32).to(DEV)
    starts = torch.zeros(7, dtype=torch.int32).to(DEV)
    hkv = case.pool["k_codes"].shape[1]
    p = case.pool
    for i in range(2):
        case.call(i)
        lens = [case.done[n] for n in names]
        ext = [3, 1, 6, 2]
        kv_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        kv_indices = torch.cat([case.slots[n][:L] for n, L in zip(names, lens)]).int()
        qo = torch.tensor([0] + torch.tensor(ext).cumsum(0).tolist(), dtype=torch.int32)
        q = (torch.randn(sum(ext), hkv * gqa, D) * 2).bfloat16()
        o, lse = ops.extend_prefix_attention_channel(
            q.to(DEV), qo.to(DEV), p["k_codes"], p["k_params"], p["v_codes"], p["v_params"],
            p["sink_k"], p["sink_v"], p["ring_k"], p["ring_v"], kv_indptr.to(DEV), kv_indices.to(DEV),
            rows, starts, k_bits=bits, k_block=B, v_group=vg, sm_scale=sm, max_len_extend=max(ext))

        def request_kv(b):
            n = names[b]
            return (ref.format_request_kv(case.k[n][:lens[b]].float(), fmt, "k"),
                    ref.format_request_kv(case.v[n][:lens[b]].float(), fmt, "v"))

        check_extend(o.cpu(), lse.cpu(), qo, lens, q, request_kv, sm)


def test_store_channel_rejects_unsupported(seed):
    case = StoreCase(64, 2, 32, 64, torch.bfloat16, torch.bfloat16)
    t = torch.zeros(1, 2, 64).bfloat16().to(DEV)
    i = torch.zeros(1, dtype=torch.int32).to(DEV)
    args = (t, t, i, i, i, i)
    with pytest.raises(ValueError, match="k_codes must be uint8"):
        ops.store_kv_channel(*args, **case.pool, k_bits=3, k_block=32, v_group=64)
    with pytest.raises(ValueError, match="not a page size"):
        ops.store_kv_channel(*args, **case.pool, k_bits=2, k_block=16, v_group=64)
    with pytest.raises(ValueError, match="one key block"):
        ops.store_kv_channel(*args, **dict(case.pool, ring_k=case.pool["ring_k"][:, :16],
                                           ring_v=case.pool["ring_v"][:, :16]),
                             k_bits=2, k_block=32, v_group=64)
