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
import inspect
import math

import pytest
import torch
import triton
import triton.language as tl

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.format import KVFormat, code_bytes
from oscar_kernels.hadamard import hadamard
from oscar_kernels.triton import attend_channel as _channel

from .pool_case import DEV, REL_TOL, rel_err, request_rows, rotated_kv

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
    """launcher: call attend_channel's launcher (its tuning knobs) instead of the op."""
    B, Hq, D = q.shape
    o = torch.full((B, Hq, D), float("nan"), device=DEV)
    logits = torch.full((B, Hq, max_splits, D), float("nan"), device=DEV)
    lse = torch.full((B, Hq, max_splits), float("nan"), device=DEV)
    (_channel.decode_attention_channel if launcher else ops.decode_attention_channel)(q.to(DEV), o, *pool.args(), **pool.kw(), sm_scale=1 / math.sqrt(D),
                                 num_kv_splits=nsplit, max_kv_splits=max_splits, attn_logits=logits,
                                 attn_lse=lse, **kw)
    return o.cpu()


# k3: the 3-bit decode variant (attend_channel.CHANNEL_3BIT_VARIANTS) at head_dim 128, where both
# exist; None = the default (other widths, and head_dim 64 where 'planes' runs 'packed'). reads:
# how codes are read (attend_channel.CHANNEL_CODE_READS; None = the default, 'words'): 'words' reads
# values (and 2-bit keys) as code words at head_dim 128, value groups of 32, 64 and 128
@pytest.mark.parametrize("D,bits,B,vg,gqa,splits,k3,reads", [
    (128, 3, 32, 128, 4, "auto", "packed", None),
    (128, 3, 32, 128, 4, "auto", "planes", None),
    (128, 3, 32, 64, 2, "given", "packed", None),
    (128, 3, 32, 64, 2, "given", "planes", None),
    (128, 3, 32, 64, 2, "given", "planes", "words"),
    (128, 2, 32, 64, 4, "auto", None, "words"),
    (128, 2, 64, 128, 2, "given", None, "words"),
    (128, 4, 32, 32, 2, "given", None, "words"),
    (128, 4, 64, 64, 4, "auto", None, None),
    (128, 4, 64, 128, 4, "auto", None, None),  # the default since 2026-11-29 (k4c64-v2h) at head_dim 128
    (64, 2, 32, 64, 3, "given", None, None),
    (64, 2, 32, 16 * 2, 1, "auto", None, None),
    (64, 4, 32, 64, 2, "given", None, None),
    (64, 3, 64, 64, 2, "auto", None, None),
])
def test_decode_channel_matches_reference(seed, D, bits, B, vg, gqa, splits, k3, reads):
    hkv = 2
    reqs = REQS_32 if B == 32 else REQS_64
    fmt = channel_fmt(D, bits, B, vg)
    pool = ChannelPool(fmt, *map(list, zip(*reqs)), hkv=hkv)
    nb = len(reqs)
    q = (torch.randn(nb, hkv * gqa, D) * 2).bfloat16()
    # given: a few splits per request (more splits than body blocks for some); auto: the body's
    # key count in chunks of 32 keys (min_chunk), so the longer requests use several body splits
    nsplit = torch.randint(2, 6, (nb,), dtype=torch.int32).to(DEV) if splits == "given" else None
    o = run_decode(pool, q, 5, nsplit, min_chunk=32, k3_variant=k3, code_reads=reads)
    assert not o.isnan().any()
    for b in range(nb):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V)
        assert rel_err(o[b], o_ref[0]) <= REL_TOL, (b, rel_err(o[b], o_ref[0]))


# launch order (attend_channel BF16_LAST) x the split merge (FMERGE: fused into the last program of
# each (request, KV head), or decode's merge kernel), with split counts per request given (some
# above a request's body blocks) and derived
@pytest.mark.parametrize("bf16_last,fused,splits", [(True, True, "given"), (False, True, "auto"),
                                                    (True, False, "auto"), (False, False, "given")])
def test_decode_channel_launch_order_and_fused_merge(seed, bf16_last, fused, splits):
    D, bits, B, vg, gqa, hkv = 128, 3, 64, 64, 4, 2
    pool = ChannelPool(channel_fmt(D, bits, B, vg), *map(list, zip(*REQS_64)), hkv=hkv)
    nb = len(REQS_64)
    q = (torch.randn(nb, hkv * gqa, D) * 2).bfloat16()
    nsplit = torch.randint(2, 6, (nb,), dtype=torch.int32).to(DEV) if splits == "given" else None
    arrived = torch.zeros(nb * hkv + 3, dtype=torch.int32, device=DEV)
    o = run_decode(pool, q, 5, nsplit, min_chunk=32, bf16_last=bf16_last, fused_merge=fused,
                   arrived=arrived, launcher=True)
    assert not o.isnan().any()
    assert not arrived.any()  # the merging programs left their counters at zero for the next call
    for b in range(nb):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V)
        assert rel_err(o[b], o_ref[0]) <= REL_TOL, (b, rel_err(o[b], o_ref[0]))


# key operands (attend_channel.CHANNEL_KEY_OPERANDS): fp16 on CUDA, so the output carries fp16's
# rounding of q * s there; the interpreter runs every variant in fp32 (as PV_DT), bf16 included
@pytest.mark.parametrize("D,bits,k3,keys", [(128, 3, "planes", "fp16"), (128, 3, "packed", "fp16-shifted"),
                                            (128, 2, None, "fp16"), (128, 4, None, "fp16-shifted"),
                                            (64, 3, None, "fp16"), (128, 3, "planes", "fp16-shifted"),
                                            (128, 3, "planes", "fp16-paired"), (128, 2, None, "fp16-paired"),
                                            (128, 3, "planes", "fp16-subnormal"), (64, 3, None, "fp16-subnormal"),
                                            (128, 4, None, "fp16-subnormal")])
def test_decode_channel_fp16_key_operands(seed, D, bits, k3, keys):
    """key_operands 'fp16' / 'fp16-shifted' / 'fp16-paired' / 'fp16-subnormal' read the same pool to
    fp16's precision of q * s on CUDA (an error of its order against float64), GQA 4. The
    interpreter runs them as 'bf16' (fp32 operands, no offsets: the same output), except the
    subnormal operands (the 3-bit planes' SUB3 and 4-bit NIBBLES), whose codes carry their places
    there too and whose eighths take one MMA: the same sums in another order, to fp32's rounding;
    their PTX is checked in this file."""
    hkv, gqa = 2, 4
    fmt = channel_fmt(D, bits, 32, 64)
    pool = ChannelPool(fmt, *map(list, zip(*REQS_32)), hkv=hkv)
    nb = len(REQS_32)
    q = (torch.randn(nb, hkv * gqa, D) * 2).bfloat16()
    o16 = run_decode(pool, q, 5, min_chunk=32, k3_variant=k3, key_operands=keys)
    o32 = run_decode(pool, q, 5, min_chunk=32, k3_variant=k3, key_operands="bf16")
    assert not o16.isnan().any()
    worst = 0.0
    for b in range(nb):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V)
        worst = max(worst, rel_err(o16[b], o_ref[0]))
        assert rel_err(o16[b], o_ref[0]) <= 2e-2, (b, rel_err(o16[b], o_ref[0]))
    if DEV == "cpu":  # the interpreter's fp32 operands for every variant
        subnormal = keys == "fp16-subnormal" and (bits == 4 or (bits == 3 and k3 == "planes" and D >= 128))
        # reordered fp32 sums: 1.05e-6 on seed 959831401 (CI, 2026-11-29); fp16's q * s would be ~1e-3
        assert (rel_err(o16, o32) < 1e-5 if subnormal else torch.equal(o16, o32)) and worst < 1e-4


def test_decode_channel_key_operands_switch(seed, monkeypatch):
    """OSCAR_CHANNEL_DECODE_KEYS picks the body's key operands (unset or empty: 'fp16-subnormal',
    KEYOP 1 with SUB3 for the 3-bit planes), key_operands overrides it ('bf16' 0, 'fp16' 1,
    'fp16-shifted' 2, 'fp16-paired' 1 with PAIRED); bad values are refused."""
    monkeypatch.delenv("OSCAR_CHANNEL_DECODE_KEYS", raising=False)
    default = _launch(monkeypatch, 128, 3)[1]
    assert default["KEYOP"] == 1 and default["SUB3"] and not default["PAIRED"]
    paired = _launch(monkeypatch, 128, 3, key_operands="fp16-paired")[1]
    assert paired["KEYOP"] == 1 and paired["PAIRED"] and not paired["SUB3"]
    fp16 = _launch(monkeypatch, 128, 3, key_operands="fp16")[1]
    assert fp16["KEYOP"] == 1 and not fp16["PAIRED"] and not fp16["SUB3"]
    # SUB3 is the planes decode's: the packed 3-bit decode, head_dim 64 and other widths take fp16
    for D, bits, kw in ((128, 3, dict(k3_variant="packed")), (64, 3, {}), (128, 2, {}), (128, 4, {})):
        other = _launch(monkeypatch, D, bits, **kw)[1]
        assert other["KEYOP"] == 1 and not other["SUB3"], (D, bits, kw)
    assert _launch(monkeypatch, 128, 3, key_operands="bf16")[1]["KEYOP"] == 0
    assert _launch(monkeypatch, 128, 3, key_operands="fp16-shifted")[1]["KEYOP"] == 2
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_KEYS", "")
    assert _launch(monkeypatch, 128, 2)[1]["KEYOP"] == 1
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_KEYS", "fp16-shifted")
    assert _launch(monkeypatch, 64, 4)[1]["KEYOP"] == 2
    assert _launch(monkeypatch, 128, 3, key_operands="bf16")[1]["KEYOP"] == 0
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_KEYS", "half")
    with pytest.raises(ValueError, match="OSCAR_CHANNEL_DECODE_KEYS must be 'bf16' or 'fp16' or 'fp16-shifted' or 'fp16-paired' or 'int8' or 'fp16-subnormal', got 'half'"):
        _launch(monkeypatch, 128, 3)
    with pytest.raises(ValueError, match="key_operands must be 'bf16' or 'fp16' or 'fp16-shifted' or 'fp16-paired'"):
        _launch(monkeypatch, 128, 3, key_operands="fp32")


def test_decode_channel_int8_key_operands(seed, monkeypatch):
    """key_operands 'int8' (3-bit planes only): each block's q * s rounded to int8 on one grid per
    query row (127 / max |q * s|), the codes' int8 MMAs. The interpreter rounds as the CUDA body
    does; on Hadamard-rotated keys the output stays within 1e-1 of float64 (fp16-paired: 1e-4 in
    fp32; int8 here 1.4-3.3% max over 12 seeds, 5.8% once in CI: the rounding is shared by a
    block's keys and peaked rows amplify it; halving the grid fails this) and differs from
    fp16-paired's (the rounding is in effect). Pools without planes are refused."""
    hkv, gqa, D, B = 2, 4, 128, 32
    H = hadamard(D).float()
    monkeypatch.setitem(globals(), "rotated_kv", lambda n, h, d, _kv=rotated_kv: _kv(n, h, d) @ H)
    pool = ChannelPool(channel_fmt(D, 3, B, 64), *map(list, zip(*REQS_32)), hkv=hkv)
    nb = len(REQS_32)
    q = (torch.randn(nb, hkv * gqa, D) * 2).bfloat16()
    o8 = run_decode(pool, q, 5, min_chunk=32, k3_variant="planes", key_operands="int8")
    o16 = run_decode(pool, q, 5, min_chunk=32, k3_variant="planes", key_operands="fp16-paired")
    assert not o8.isnan().any()
    for b in range(nb):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V)
        assert rel_err(o8[b], o_ref[0]) <= 1e-1, (b, rel_err(o8[b], o_ref[0]))
    assert max(rel_err(o8[b], o16[b]) for b in range(nb)) > 1e-4
    with pytest.raises(ValueError, match="key_operands 'int8' is the 3-bit planes decode's"):
        run_decode(ChannelPool(channel_fmt(D, 2, B, 64), *map(list, zip(*REQS_32)), hkv=hkv), q, 5,
                   key_operands="int8")


@pytest.mark.parametrize("D,bits,k3", [(64, 3, None), (128, 3, "planes"), (128, 4, None)])
def test_decode_channel_logit_cap_and_default_plan(seed, D, bits, k3):
    """Logit cap; split count and scratch from the defaults (no max_kv_splits, no scratch). At
    head_dim 128 with the 3-bit 'planes' decode, which applies the softmax scale per tile, and with
    4-bit keys' subnormal operands (NIBBLES: the cap sees the sums scaled back)."""
    gqa, cap = 2, 5.0
    fmt = channel_fmt(D, bits, 32, 64)
    pool = ChannelPool(fmt, [1, 110], [0, 0], [0, 0], hkv=1)
    q = (torch.randn(2, gqa, D) * 4).bfloat16()
    o = torch.full((2, gqa, D), float("nan"), device=DEV)
    ops.decode_attention_channel(q.to(DEV), o, *pool.args(), **pool.kw(), sm_scale=0.125, logit_cap=cap,
                                 k3_variant=k3)
    for b in range(2):
        K, V = pool.request_kv(b)
        s = torch.einsum("thd,lhd->htl", q[b:b + 1].double(), K.double().repeat_interleave(gqa, 1)) * 0.125
        p = torch.softmax(cap * torch.tanh(s / cap), -1)
        o_ref = torch.einsum("htl,lhd->thd", p, V.double().repeat_interleave(gqa, 1))
        assert rel_err(o[b].cpu(), o_ref[0]) <= REL_TOL


class _Launched(Exception):
    pass


def _launch(monkeypatch, D, bits, **kw):
    """(positional args, keywords) of the decode launch ops.decode_attention_channel makes (the
    kernel replaced by a recorder that stops the call)."""
    from oscar_kernels.triton import attend_channel

    class Rec:
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise _Launched(a, k)
            return launch

    monkeypatch.setattr(attend_channel, "attend_channel_kernel", Rec())
    fmt = channel_fmt(D, bits, 32, 64)
    pool = ChannelPool(fmt, [1, 40], [0, 0], [0, 0], hkv=1)
    q = torch.randn(2, 2, D).bfloat16().to(DEV)
    with pytest.raises(_Launched) as e:
        ops.decode_attention_channel(q, torch.empty(2, 2, D, device=DEV), *pool.args(), **pool.kw(),
                                     sm_scale=0.1, **kw)
    return e.value.args


def _launch_planes(monkeypatch, D, bits, **kw):
    """PLANES and num_warps of the decode launch."""
    _, k = _launch(monkeypatch, D, bits, **kw)
    return k["PLANES"], k["num_warps"]


def _launch_words(monkeypatch, D, bits, **kw):
    """(VWORDS, KWORDS, dtype of the value codes, dtype of the key codes) of the decode launch."""
    a, k = _launch(monkeypatch, D, bits, **kw)
    return k["VWORDS"], k["KWORDS"], a[17].dtype, a[11].dtype  # VC, KC (the kernel signature)


def test_decode_channel_code_reads_switch(seed, monkeypatch):
    """OSCAR_CHANNEL_DECODE_READS picks how decode reads codes (unset or empty: 'words'),
    code_reads overrides it; 'words' passes int16 views of the value codes (value dim >= 128) and
    of 2-bit key codes (head_dim >= 128) and reads bytes elsewhere; bad values are refused."""
    i16, u8 = torch.int16, torch.uint8
    monkeypatch.delenv("OSCAR_CHANNEL_DECODE_READS", raising=False)
    assert _launch_words(monkeypatch, 128, 2) == (True, True, i16, i16)
    assert _launch_words(monkeypatch, 128, 2, code_reads="bytes") == (False, False, u8, u8)
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_READS", "")
    assert _launch_words(monkeypatch, 128, 3) == (True, False, i16, u8)
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_READS", "bytes")
    assert _launch_words(monkeypatch, 128, 3) == (False, False, u8, u8)
    assert _launch_words(monkeypatch, 128, 2, code_reads="words") == (True, True, i16, i16)
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_READS", "words")
    assert _launch_words(monkeypatch, 128, 3) == (True, False, i16, u8)
    assert _launch_words(monkeypatch, 128, 4) == (True, False, i16, u8)
    assert _launch_words(monkeypatch, 64, 2) == (False, False, u8, u8)
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_READS", "word")
    with pytest.raises(ValueError, match="OSCAR_CHANNEL_DECODE_READS must be 'bytes' or 'words', got 'word'"):
        _launch_words(monkeypatch, 128, 2)
    with pytest.raises(ValueError, match="code_reads must be 'bytes' or 'words'"):
        _launch_words(monkeypatch, 128, 2, code_reads="int16")


def test_decode_channel_3bit_variant_switch(seed, monkeypatch):
    """OSCAR_CHANNEL_DECODE_3BIT picks the 3-bit decode (unset or empty, as docker compose passes
    it: 'planes'), k3_variant overrides it; 'planes' only at 3 bits and head_dim >= 128, at one
    warp; bad values are refused."""
    from oscar_kernels.triton import attend_channel as ch

    monkeypatch.delenv("OSCAR_CHANNEL_DECODE_3BIT", raising=False)
    assert _launch_planes(monkeypatch, 128, 3) == (True, ch.PLANES_NUM_WARPS)
    assert _launch_planes(monkeypatch, 128, 3, k3_variant="packed") == (False, ch.DECODE_NUM_WARPS[3])
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_3BIT", "")
    assert _launch_planes(monkeypatch, 128, 3) == (True, ch.PLANES_NUM_WARPS)
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_3BIT", "packed")
    assert _launch_planes(monkeypatch, 128, 3) == (False, ch.DECODE_NUM_WARPS[3])
    assert _launch_planes(monkeypatch, 128, 3, k3_variant="planes") == (True, ch.PLANES_NUM_WARPS)
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_3BIT", "planes")
    assert _launch_planes(monkeypatch, 64, 3) == (False, ch.DECODE_NUM_WARPS[3])
    assert _launch_planes(monkeypatch, 128, 2) == (False, ch.DECODE_NUM_WARPS[2])
    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_3BIT", "fast")
    with pytest.raises(ValueError, match="OSCAR_CHANNEL_DECODE_3BIT must be 'packed' or 'planes', got 'fast'"):
        _launch_planes(monkeypatch, 128, 3)
    with pytest.raises(ValueError, match="k3_variant must be 'packed' or 'planes'"):
        _launch_planes(monkeypatch, 128, 3, k3_variant="plane")


def test_planes_hi_operand_constants():
    """The 'planes' 1-bit operand's PTX (CUDA only, not run by the interpreter) emulated on every
    byte pair: lop3 0xEA = (w & mask) | HI_EXP[E] on two uint16-widened bytes (eighth 7 shifted
    right by 1 first) is bf16 HI_QMUL[E] * (BODY_OFS + bit * 2^min(E, 6)) per half, and the bit's
    weight relative to the 2-bit plane's operand of the same dims (place value _v_scale(E // 2))
    is 4: both planes multiply the same q operand."""
    from oscar_kernels.triton import attend_channel as ch

    lo, hi = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    w = lo | hi << 16  # two uint16 lanes in one 32-bit register, each a widened byte
    for E in range(8):
        mask, exp = int(ch.HI_MASK.value[E], 16), int(ch.HI_EXP.value[E], 16)
        r = (((w >> 1) if E == 7 else w) & mask) | exp
        halves = torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16).view(torch.bfloat16).float()
        place, mul = 2.0 ** min(E, 6), ch.HI_QMUL.value[E]
        expect = (torch.stack([(lo >> E) & 1, (hi >> E) & 1], -1).float() * place + ch.BODY_OFS.value) * mul
        assert torch.equal(halves, expect), E
        assert mul * place / (4.0 ** (E // 2) if E // 2 < 3 else 16.0) == 4.0, E



@triton.jit
def _code_operand_probe(C, O, DT: tl.constexpr):
    i = tl.arange(0, 128)
    tl.store(O + i, _channel._code_operand(tl.load(C + i), DT).to(tl.float32))


def test_code_operand_fp16_is_exact():
    """The `codes` extend's fp16 code operands (1024's exponent, minus 1024) are the codes exactly,
    every code in [0, 128); the interpreter runs the fp16 bit trick as CUDA does (its bf16 one
    cannot run there)."""
    c = torch.arange(128, dtype=torch.int32, device=DEV)
    o = torch.full((128,), float("nan"), device=DEV)
    _code_operand_probe[(1,)](c, o, DT=tl.float16)
    assert torch.equal(o, c.float())


def test_fp16_key_operand_constants():
    """The fp16 key operands' PTX (CUDA only) emulated on every byte pair, as the bf16 ones above.
    Variant 0 ("fp16", 1024's exponent, ulp 1) gives BODY_OFS_FP16 + code * place, variant 1
    ("fp16-shifted": the field moved up 3 bits first, 128's exponent, ulp 1/8) BODY_OFS + code *
    place, bf16's own values: 2-bit quarters with place _k_place(J, KEYOP) (4^J; quarter 3 from bits
    6-7 at place 64 for "fp16", 16 for "fp16-shifted"), 4-bit nibbles with place 1, a packed 3-bit
    code, and the 1-bit plane's HI_QMUL[8 * KEYOP + E] * (offset + bit * wt) (wt = 2^E for "fp16",
    2^min(E, 6) for "fp16-shifted") whose bit weighs 4 places of its eighth's 2-bit code, so the
    planes keep their q operand and the row constant removes KOFS * (1 + HI_QMUL) * qs, exact in
    fp32 for any fp16 qs."""
    from oscar_kernels.triton import attend_channel as ch

    lo, hi = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    w = lo | hi << 16  # two widened bytes (bits 8-15 of each half zero)
    both = torch.stack([lo, hi], -1)

    def ptx(src: str, mask: str, exp: str) -> torch.Tensor:
        """lop3 0xEA = (SRC(w) & mask) | exp, SRC one of the sources the tables use, as fp16 halves."""
        x = {"mov.b32 w, $1;": w, "shr.b32 w, $1, 1;": w >> 1, "shr.b32 w, $1, 2;": w >> 2,
             "shr.b32 w, $1, 4;": w >> 4, "shl.b32 w, $1, 1;": w << 1, "shl.b32 w, $1, 2;": w << 2,
             "shl.b32 w, $1, 3;": w << 3}[src]
        r = ((x & 0xFFFFFFFF) & int(mask, 16)) | int(exp, 16)
        return torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16).view(torch.float16).double()

    for v, ofs in enumerate((ch.BODY_OFS_FP16.value, ch.BODY_OFS.value)):
        exp, keyop = ch.KEY16_EXP.value[v], v + 1
        places = [4.0 ** J if J < 3 else ch.KEY_PLACE3.value[keyop] for J in range(4)]
        assert places[3] == (64.0 if keyop == 1 else 16.0)
        for J in range(4):
            place = places[J]
            got = ptx(ch.LO16_SRC.value[4 * v + J], ch.LO16_MASK.value[4 * v + J], exp)
            assert torch.equal(got, ofs + ((both >> 2 * J) & 3).double() * place), (v, J)
        for high in (0, 1):
            got = ptx(ch.NIB16_SRC.value[2 * v + high], ch.NIB16_MASK.value[v], exp)
            assert torch.equal(got, ofs + ((both >> 4 * high) & 15).double()), (v, high)
        c = torch.arange(8, dtype=torch.int32)
        bits = (c << ch.PACK16_SHIFT.value[v]) | ch.PACK16_BASE.value[v]
        assert torch.equal(bits.to(torch.int16).view(torch.float16).double(), ofs + c.double()), v
        for E in range(8):
            k = 8 * v + E
            got = ptx(ch.HI16_SRC.value[k], ch.HI16_MASK.value[k], ch.HI16_EXP.value[k])
            wt, mul = 2.0 ** (E if keyop == 1 else min(E, 6)), ch.HI_QMUL.value[8 * keyop + E]
            expect = (((both >> E) & 1).double() * wt + ofs) * mul
            assert torch.equal(got, expect), (v, E)
            assert mul * wt == 4.0 * places[E // 2], (v, E)
        qs = torch.randn(4096).half().float()
        for m in set(ch.HI_QMUL.value):
            assert torch.equal(((ofs * (1.0 + m)) * qs).double(), (ofs * (1.0 + m)) * qs.double())


def test_paired_plane_operands_cancel_offsets():
    """PAIRED's PTX (CUDA only) emulated on every pair of widened bytes: the 2-bit plane's operand
    of eighth E (lop3 0xEA: (w & LO16_MASK[J]) | PAIR_LO_EXP[J], J = E // 2) is 1024 + 4 * place +
    code * place, the 1-bit plane's (w shifted left by 2 - E % 2, lop3 0xAE: (~w & mask) | exp) is
    -(1024 + (1 - bit) * 4 * place), and their sum is the 3-bit code times place (4^J; quarter 3 at
    64, the "fp16" operands' place) for every code and bit: the offsets cancel in the MMAs."""
    from oscar_kernels.triton import attend_channel as ch

    lo, hi = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    w = lo | hi << 16
    both = torch.stack([lo, hi], -1)

    def halves(r):
        return torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16).view(torch.float16).double()

    def lop3(a, b, c, lut):  # bitwise: bit i of the result is bit (a_i << 2 | b_i << 1 | c_i) of lut
        out = torch.zeros_like(a)
        for k in range(8):
            if lut >> k & 1:
                sel = ((a if k & 4 else ~a) & (b if k & 2 else ~b) & (c if k & 1 else ~c))
                out |= sel
        return out & 0xFFFFFFFF

    assert ch.SHL16.value[1].endswith("1;") and ch.SHL16.value[2].endswith("2;")
    hi_exp = torch.tensor(int(ch.PAIR_HI_EXP.value, 16))
    for E in range(8):
        J = E // 2
        place = 4.0 ** J if J < 3 else ch.KEY_PLACE3.value[1]
        a = lop3(w, torch.tensor(int(ch.LO16_MASK.value[J], 16)), torch.tensor(int(ch.PAIR_LO_EXP.value[J], 16)), 0xEA)
        # the 1-bit plane's register holds the byte pair shifted (lo / hi stand for its bytes too)
        x = (w << (2 - E % 2)) & 0xFFFFFFFF
        b = lop3(x, torch.tensor(int(ch.PAIR_HI_MASK.value[J], 16)), hi_exp, int(ch.PAIR_HI_LUT.value, 16))
        code = ((both >> 2 * J) & 3).double()
        bit = ((both >> E) & 1).double()
        assert torch.equal(halves(a), 1024 + 4 * place + code * place), E
        assert torch.equal(halves(b), -(1024 + (1 - bit) * 4 * place)), E
        # every (code, bit) pair (the planes' bytes are independent): the sum is the 3-bit code's
        c4, b2 = torch.arange(4.0).double()[:, None], torch.arange(2.0).double()[None, :]
        ops_sum = (1024 + 4 * place + c4 * place) - (1024 + (1 - b2) * 4 * place)
        assert torch.equal(ops_sum, (c4 + 4 * b2) * place), E


def test_sub3_operands_are_exact_subnormals():
    """SUB3's PTX (CUDA only) emulated on every (2-bit plane byte, 1-bit plane byte) pair in each
    half: `and` of the 1-bit plane's widened bytes, shifted left by 2 - E % 2, with PAIR_HI_MASK[J],
    then lop3 0xEA with the 2-bit plane's under LO16_MASK[J] (J = E // 2), leaves two fp16 halves
    that are the subnormals (code + 4 * bit) * 4^J * 2^-24 exactly (code: bits 2J..2J+1 of the
    2-bit plane's byte, bit: bit E of the 1-bit plane's), no exponent bit set; NIB_SCALE undoes the
    2^-24."""
    from oscar_kernels.triton import attend_channel as ch

    a, b = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    lo_reg = a | b << 16  # the 2-bit plane's byte pair (a, b)
    hi_bytes = torch.stack([b, a], -1)  # the 1-bit plane's pair (b, a): every combination per half
    hi_reg = b | a << 16
    lo_bytes = torch.stack([a, b], -1)
    for E in range(8):
        J = E // 2
        h = (hi_reg << (2 - E % 2)) & 0xFFFFFFFF  # _shl16: no carry between the halves
        t = h & int(ch.PAIR_HI_MASK.value[J], 16)
        r = (lo_reg & int(ch.LO16_MASK.value[J], 16)) | t  # lop3 0xEA: (a & b) | c
        halves = torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16).view(torch.float16).double()
        code = ((lo_bytes >> 2 * J) & 3) + 4 * ((hi_bytes >> E) & 1)
        assert torch.equal(halves, code.double() * 4.0 ** J * 2.0 ** -24), E
        assert torch.equal(halves * ch.NIB_SCALE.value, code.double() * 4.0 ** J), E
        assert int((r & 0x7C007C00).max()) == 0, E  # no exponent bit: subnormal or zero
    # the emulated sequence is the kernel's
    src = inspect.getsource(ch._sub3_operand.fn)
    assert ('"{.reg .b32 t; and.b32 t, $2, " + PAIR_HI_MASK[J] + "; lop3.b32 $0, $1, " + LO16_MASK[J]'
            ' + ", t, 0xEA;}"') in src


def test_decode_channel_4bit_nibbles_launch(seed, monkeypatch):
    """4-bit keys decode with subnormal nibble operands (NIBBLES) when their key operands are fp16
    ('fp16-subnormal', the default, 'fp16-paired' or 'fp16'), at every head_dim and either code
    read, the edge blocks in their own loop; 'bf16' / 'fp16-shifted' operands keep the offset
    operands; other widths never take it."""
    monkeypatch.delenv("OSCAR_CHANNEL_DECODE_KEYS", raising=False)
    for D in (64, 128):
        assert _launch(monkeypatch, D, 4)[1]["NIBBLES"], D
        assert _launch(monkeypatch, D, 4, key_operands="fp16")[1]["NIBBLES"], D
        assert _launch(monkeypatch, D, 4, key_operands="fp16-paired")[1]["NIBBLES"], D
        assert _launch(monkeypatch, D, 4, code_reads="bytes")[1]["NIBBLES"], D
        for keys in ("bf16", "fp16-shifted"):
            assert not _launch(monkeypatch, D, 4, key_operands=keys)[1]["NIBBLES"], (D, keys)
        assert not _launch(monkeypatch, D, 3)[1]["NIBBLES"], D
        assert not _launch(monkeypatch, D, 2)[1]["NIBBLES"], D


def test_nibble_operands_are_exact_subnormals():
    """NIBBLES' PTX (CUDA only) emulated on every pair of widened bytes: `and` with NIB_MASK[H]
    leaves two fp16 halves that are the subnormals code * 16^H * 2^-24 (code: nibble H of each
    byte) exactly, for every byte pair; NIB_SCALE undoes the 2^-24. The high nibble's place 16
    keeps every code below 2^10 (no exponent bits)."""
    from oscar_kernels.triton import attend_channel as ch

    lo, hi = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    w = lo | hi << 16
    both = torch.stack([lo, hi], -1)
    for H in (0, 1):
        r = w & int(ch.NIB_MASK.value[H], 16)
        halves = torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16).view(torch.float16).double()
        code = ((both >> 4 * H) & 15).double()
        assert torch.equal(halves * ch.NIB_SCALE.value, code * 16.0 ** H), H
        assert torch.equal(halves, code * 16.0 ** H * 2.0 ** -24), H
        assert int((r & 0x7C007C00).max()) == 0, H  # no exponent bit set: subnormal or zero


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i is byte (sel >> 4i) & 7 of b:a (a bytes 0-3),
    replicated sign if bit 3 of that digit is set."""
    src, out = a | b << 32, 0
    for i in range(4):
        d = (sel >> 4 * i) & 15
        byte = (src >> 8 * (d & 7)) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if d & 8 else byte) << 8 * i
    return out


def test_fp16_code_bits():
    """The dequantising extend's fp16 operands (CUDA): code c in [0, 128) under FP16_CODE_BASE,
    shifted by FP16_CODE_SHIFT, is exactly 128 + c, and minus 128 gives c back (the interpreter
    runs fp32, so the bits are checked here)."""
    from oscar_kernels.triton import attend_channel as ch

    c = torch.arange(128, dtype=torch.int32)
    bits = ((c << ch.FP16_CODE_SHIFT.value) | ch.FP16_CODE_BASE.value).to(torch.int16)
    x = bits.view(torch.float16)
    assert torch.equal(x.double(), 128.0 + c.double())
    assert torch.equal((x - 128.0).double(), c.double())  # exact in fp16


def test_widen_prmt_selectors(seed):
    """_widen's PTX (CUDA only) emulated on registers of four random bytes: the two outputs hold
    bytes 0, 1 and 2, 3 zero-extended in their 16-bit halves, low half first (Triton's packing of
    elements into registers), i.e. exactly the uint16 cast."""
    from oscar_kernels.triton import attend_channel as ch

    sel = [int(x, 16) for x in ch.WIDEN_PRMT.value]
    for w in torch.randint(0, 2**32, (2000,), dtype=torch.int64).tolist() + [0, 0xFFFFFFFF, 0x80808080]:
        elems = [(w >> 8 * i) & 0xFF for i in range(4)]
        halves = [(r >> 16 * h) & 0xFFFF for r in (_prmt(w, 0, sel[0]), _prmt(w, 0, sel[1])) for h in (0, 1)]
        assert halves == elems, hex(w)

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



# ----------------------------------------------------------------------------- extend-prefix

# (prefix len, own_start, sink_start, new tokens) with B = 32, S = 4, W = 32 (64 for B = 64):
#   padding request, empty prefix (o = 0, lse = -inf); prefix shorter than the sink; prefix ending
#   mid-block (the incomplete last block from the ring, body hole after the sink); the most new
#   tokens (several query blocks at block_m = 16); own_start inside the sink; radix hits whose
#   side copies were not carried over (own_start = sink_start = 64, positions 0-3 from the body)
#   or whose sink was (sink_start 0)
EXT_32 = [(0, 0, 0, 3), (3, 0, 0, 2), (75, 0, 0, 5), (96, 0, 0, 20), (75, 2, 2, 1),
          (100, 64, 64, 6), (130, 64, 0, 9)]
EXT_64 = [(0, 0, 0, 4), (2, 0, 0, 3), (150, 0, 0, 13), (140, 64, 64, 2), (200, 64, 0, 7)]


def run_extend(pool, q, ext, sm, block_m=None, **kw):
    """The extend-prefix kernel with NaN-filled outputs; block_m given: the launcher's knob."""
    T, Hq, D = q.shape
    qo_indptr = torch.tensor([0] + torch.tensor(ext).cumsum(0).tolist(), dtype=torch.int32).to(DEV)
    o = torch.full((T, Hq, D), float("nan"), device=DEV)
    lse = torch.full((T, Hq), float("nan"), device=DEV)
    if block_m is None:
        res = ops.extend_prefix_attention_channel(
            q.to(DEV), qo_indptr, *pool.args(), **pool.kw(), sm_scale=sm, max_len_extend=max(ext),
            o=o, lse=lse, **kw)
    else:
        from oscar_kernels.triton import attend_channel

        res = attend_channel.extend_prefix_attention_channel(
            q.to(DEV), qo_indptr, *pool.args(), **pool.kw(), sm_scale=sm, max_len_extend=max(ext),
            o=o, lse=lse, block_m=block_m, **kw)
    assert res[0] is o and res[1] is lse
    return o.cpu(), lse.cpu(), qo_indptr.cpu()


def check_extend(o, lse, qo_indptr, prefix, q, request_kv, sm, scores=None):
    """Each request's rows vs float64 attention over the reader's view of its prefix."""
    assert not o.isnan().any() and not lse.isnan().any()
    for b, L in enumerate(prefix):
        t0, t1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if L == 0:
            assert torch.all(o[t0:t1] == 0) and torch.all(lse[t0:t1] == float("-inf")), b
            continue
        K, V = request_kv(b)
        o_ref, lse_ref = ref.attention(q[t0:t1].float(), K, V, sm_scale=sm)
        assert rel_err(o[t0:t1], o_ref) <= REL_TOL, (b, rel_err(o[t0:t1], o_ref))
        assert (lse[t0:t1].double() - lse_ref).abs().max() <= REL_TOL * max(1.0, lse_ref.abs().max()), b


# variant: the extend body (attend_channel.CHANNEL_EXTEND_VARIANTS); None = the default
@pytest.mark.parametrize("D,bits,B,vg,gqa,block_m,variant", [
    (64, 2, 32, 64, 1, 16, None),
    (64, 4, 32, 32, 3, 16, None),  # 16 rows = 5 1/3 tokens: a token's heads straddle query blocks
    (128, 3, 32, 128, 2, None, None),
    (64, 3, 64, 64, 2, 16, None),
    (128, 2, 64, 64, 4, None, None),
    (64, 2, 32, 64, 1, 16, "dequant"),
    (64, 4, 32, 32, 3, 16, "dequant"),
    (128, 3, 32, 64, 2, None, "dequant"),
    (128, 3, 64, 128, 4, 32, "dequant"),
    (128, 4, 64, 128, 4, None, None),  # the default since 2026-11-29 (k4c64-v2h) at head_dim 128
])
def test_extend_prefix_channel_matches_reference(seed, D, bits, B, vg, gqa, block_m, variant):
    hkv = 2
    reqs = EXT_32 if B == 32 else EXT_64
    prefix, owns, sinks, ext = map(list, zip(*reqs))
    pool = ChannelPool(channel_fmt(D, bits, B, vg), prefix, owns, sinks, hkv=hkv)
    q = (torch.randn(sum(ext), hkv * gqa, D) * 2).bfloat16()
    sm = 1 / math.sqrt(D)
    o, lse, qo_indptr = run_extend(pool, q, ext, sm, block_m, extend_variant=variant)
    check_extend(o, lse, qo_indptr, prefix, q, pool.request_kv, sm)


def _extend_launches(monkeypatch, pool, q, ext, **kw):
    """[(grid, positional args, keywords)] of the kernel launches an extend-prefix call makes, the
    kernel replaced by a recorder for the call (it computes nothing: outputs are not checked)."""
    from oscar_kernels.triton import attend_channel as ch

    seen, kern = [], ch.attend_channel_kernel

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append((grid, a, k))
    monkeypatch.setattr(ch, "attend_channel_kernel", Rec())
    try:
        run_extend(pool, q, ext, 0.1, **kw)
    finally:
        monkeypatch.setattr(ch, "attend_channel_kernel", kern)
    return seen


# a prefill's requests, then mixed-chunk decodes (one new token over a cached prefix), one of them
# a padding request (empty prefix), and a decode whose prefix ends mid-block
EXT_MIXED = [(0, 0, 0, 9), (96, 0, 0, 20), (75, 2, 2, 9),
             (130, 64, 0, 1), (0, 0, 0, 1), (100, 64, 64, 1), (75, 0, 0, 1)]


@pytest.mark.parametrize("D,bits,gqa,variant", [(64, 2, 4, None), (128, 3, 4, "dequant"), (64, 4, 2, "codes")])
def test_extend_prefix_channel_short_tail_gets_its_own_launch(seed, monkeypatch, D, bits, gqa, variant):
    """With the extend lengths on the host, a batch that ends in short extends (the decodes that
    --enable-mixed-chunk folds in) is two launches, the tail's with SHORT_EXTEND_ROWS-row tiles;
    every token still matches the float64 reference, as without the lengths; a batch of short
    extends only is one launch of short tiles; lengths that do not match the batch are refused."""
    from oscar_kernels.triton import attend_channel as ch

    hkv = 2
    prefix, owns, sinks, ext = map(list, zip(*EXT_MIXED))
    pool = ChannelPool(channel_fmt(D, bits, 32, 64), prefix, owns, sinks, hkv=hkv)
    q = (torch.randn(sum(ext), hkv * gqa, D) * 2).bfloat16()
    sm = 1 / math.sqrt(D)
    k = ch.short_extend_start(ext, gqa)
    assert k == 3 and ch.short_extend_start([1, 1], gqa) == 0 and ch.short_extend_start([1, 9], gqa) == 2
    o, lse, qo_indptr = run_extend(pool, q, ext, sm, extend_variant=variant, extend_lens=ext)
    check_extend(o, lse, qo_indptr, prefix, q, pool.request_kv, sm)
    o1, lse1, _ = run_extend(pool, q, ext, sm, extend_variant=variant)  # one launch, the same answer
    assert rel_err(o, o1) <= REL_TOL and torch.allclose(lse, lse1, atol=REL_TOL, rtol=REL_TOL)
    launches = _extend_launches(monkeypatch, pool, q, ext, extend_variant=variant, extend_lens=ext)
    assert [(g[0], a[-1]) for g, a, _ in launches] == [(k, ch.triton.cdiv(20 * gqa, launches[0][2]["BLOCK_M"])),
                                                       (len(ext) - k, 1)]
    assert launches[1][2]["BLOCK_M"] == ch.SHORT_EXTEND_ROWS and launches[1][2]["num_warps"] == ch.SHORT_EXTEND_WARPS
    # each launch sees only its own tokens: split scratch is sized by them, not by the batch
    assert [a[0].shape[0] for _, a, _ in launches] == [sum(ext[:k]), sum(ext[k:])]
    o3, lse3, _ = run_extend(pool, q, ext, sm, extend_variant=variant, extend_lens=ext, num_splits=3)
    check_extend(o3, lse3, qo_indptr, prefix, q, pool.request_kv, sm)
    tail = [1, 1, 1]
    pool2 = ChannelPool(channel_fmt(D, bits, 32, 64), [130, 0, 75], [64, 0, 0], [0, 0, 0], hkv=hkv)
    q2 = (torch.randn(3, hkv * gqa, D) * 2).bfloat16()
    (launch,) = _extend_launches(monkeypatch, pool2, q2, tail, extend_variant=variant)  # no lengths needed
    assert launch[2]["BLOCK_M"] == ch.SHORT_EXTEND_ROWS
    o2, lse2, qo2 = run_extend(pool2, q2, tail, sm, extend_variant=variant)
    check_extend(o2, lse2, qo2, [130, 0, 75], q2, pool2.request_kv, sm)
    with pytest.raises(ValueError, match=r"extend_lens \(2 requests, 2 tokens\) does not match the batch \(7 requests"):
        run_extend(pool, q, ext, sm, extend_lens=[1, 1])
    with pytest.raises(ValueError, match="does not match the batch"):
        run_extend(pool, q, ext, sm, extend_lens=ext[:-1] + [2])


# splits: the prefix split count forced (num_splits; 7 > the body blocks of some requests, so
# some splits see no key) or chosen from max_len_prefix by the policy (8 SMs off CUDA)
@pytest.mark.parametrize("D,bits,B,variant,splits", [
    (64, 3, 32, None, 3),
    (64, 2, 32, "dequant", 7),
    (128, 3, 64, None, 2),
    (64, 4, 32, None, "policy"),
])
def test_extend_prefix_channel_split_prefix_matches_reference(seed, D, bits, B, variant, splits):
    """The prefix split into chunks of body blocks (split 0 also reads the sink and the ring),
    each chunk's normalised partial output and LSE merged: the same attention as the float64
    reference over the whole prefix, for every request (empty prefix: o = 0, lse = -inf)."""
    from oscar_kernels.triton import attend_channel as ch

    hkv, gqa = 2, 2
    reqs = EXT_32 if B == 32 else EXT_64
    prefix, owns, sinks, ext = map(list, zip(*reqs))
    pool = ChannelPool(channel_fmt(D, bits, B, 64), prefix, owns, sinks, hkv=hkv)
    q = (torch.randn(sum(ext), hkv * gqa, D) * 2).bfloat16()
    sm = 1 / math.sqrt(D)
    if splits == "policy":
        dequant = ch.channel_extend_variant(variant) == "dequant"
        num_mb = math.ceil(max(ext) * gqa / ch.extend_block_m(dequant, D))
        kw = dict(max_len_prefix=max(prefix) * ch.EXTEND_SPLIT_MIN_KEYS // 64)  # as if 16x longer
        assert ch.extend_prefix_splits(len(ext) * hkv * num_mb, kw["max_len_prefix"], DEV) > 1
    else:
        kw = dict(num_splits=splits)
    o, lse, qo_indptr = run_extend(pool, q, ext, sm, extend_variant=variant, **kw)
    check_extend(o, lse, qo_indptr, prefix, q, pool.request_kv, sm)


@pytest.mark.parametrize("gqa,hkv", [(3, 3), (4, 8)])  # Hq 9 (S * Hq = 144 at 16 splits) and 32
def test_extend_prefix_split_launch_compiles_nothing_new(seed, monkeypatch, gqa, hkv):
    """A split extend launch passes arguments of the same specialisation kinds as an unsplit one
    (Triton compiles one kernel per kind: ints equal to 1 or multiples of 16, 16-byte aligned
    pointers), so the first split call of a warm server compiles nothing."""
    from oscar_kernels.triton import attend_channel as ch

    kern = ch.attend_channel_kernel
    names, skip = kern.arg_names, set(ch.NOT_SPECIALIZED)  # the interpreter keeps no such list
    assert {"MAX_SPLITS", "num_mb"} <= skip and set(getattr(kern, "do_not_specialize", skip)) == skip
    pool = ChannelPool(channel_fmt(64, 3, 32, 64), [200], [0], [0], hkv=hkv)
    q = torch.randn(3, hkv * gqa, 64).bfloat16()

    def kinds(**kw):
        (grid, a, k), = _extend_launches(monkeypatch, pool, q, [3], **kw)
        out = []
        for name, v in zip(names, a):
            if name in skip:
                continue
            if isinstance(v, torch.Tensor):
                out.append((name, v.dtype, v.data_ptr() % 16 == 0))
            elif isinstance(v, bool) or not isinstance(v, int):
                out.append((name, type(v)))
            else:
                out.append((name, v == 1, v % 16 == 0))
        return grid, out, k

    g1, one, k1 = kinds()
    g16, split, k16 = kinds(num_splits=16)
    assert g1[2] == 1 and g16[2] == 16 and k1 == k16
    assert one == split, [(x, y) for x, y in zip(one, split) if x != y]


def test_extend_prefix_split_policy():
    """Splits only when the grid is under EXTEND_SPLIT_PROGRAMS_PER_SM programs per SM and the
    longest prefix is known and long: chunks of >= EXTEND_SPLIT_MIN_KEYS keys, at most
    EXTEND_MAX_SPLITS (8 SMs off CUDA)."""
    from oscar_kernels.triton import attend_channel as ch

    per, mink, most = ch.EXTEND_SPLIT_PROGRAMS_PER_SM, ch.EXTEND_SPLIT_MIN_KEYS, ch.EXTEND_MAX_SPLITS
    cpu = torch.device("cpu")  # decode.sm_count: 8
    assert ch.extend_prefix_splits(4, None, cpu) == 1  # prefix length unknown
    assert ch.extend_prefix_splits(4, 0, cpu) == 1
    assert ch.extend_prefix_splits(per * 8, 10**6, cpu) == 1  # a full wave already
    assert ch.extend_prefix_splits(4, mink - 1, cpu) == 1  # too short to split
    assert ch.extend_prefix_splits(4, 2 * mink, cpu) == 2  # limited by the chunk size
    assert ch.extend_prefix_splits(4, 10**6, cpu) == math.ceil(per * 8 / 4)  # by the grid
    assert ch.extend_prefix_splits(1, 10**7, cpu) == min(most, per * 8)


def test_decode_split_policy(monkeypatch):
    """Decode splits without max_kv_splits: the BF16 splits of the sink and ring
    (decode.bf16_splits: one per 160 BF16 keys) and body splits for DECODE_SPLIT_PROGRAMS_PER_SM
    programs per SM over the (request, KV head) pairs, rounded down, >= 1, <= DECODE_MAX_SPLITS
    splits in all (8 SMs off CUDA; an H100's 132 below)."""
    from oscar_kernels.triton import attend_channel as ch

    per, most = ch.DECODE_SPLIT_PROGRAMS_PER_SM, ch.DECODE_MAX_SPLITS
    cpu = torch.device("cpu")
    assert ch.default_decode_splits(1, 1, cpu, 1) == min(most - 1, per * 8) + 1
    assert ch.default_decode_splits(2, 8, cpu, 1) == per * 8 // 16 + 1
    assert ch.default_decode_splits(3, 8, cpu, 2) == max(1, per * 8 // 24) + 2  # no extra wave
    assert ch.default_decode_splits(512, 8, cpu, 1) == 2  # one body split however large the batch
    assert ops.decode_splits_channel(4, 2, 4, 128, cpu) == per * 8 // 8 + 1  # 132 BF16 keys: 1 split
    assert ops.decode_splits_channel(4, 2, 64, 256, cpu) == per * 8 // 8 + 2  # 320: 2
    monkeypatch.setattr(ch, "sm_count", lambda device: 132)
    assert ch.default_decode_splits(1, 8, cpu, 1) == most  # 132 wanted: the cap, BF16 split included
    assert ch.default_decode_splits(1, 8, cpu, 2) == most
    assert ch.default_decode_splits(8, 8, cpu, 1) == per * 132 // 64 + 1
    assert ch.default_decode_splits(64, 8, cpu, 1) == 2 + 1


def test_merge_extend_splits_is_one_softmax(seed):
    """Partial attentions over disjoint key chunks (one chunk empty) merged by LSE equal the
    float64 attention over all keys; rows whose chunks are all empty get o = 0, lse = -inf."""
    from oscar_kernels.triton.attend_channel import merge_extend_splits

    T, Hq, D, L = 5, 3, 16, 40
    q, k, v = torch.randn(T, Hq, D), torch.randn(L, Hq, D) * 3, torch.randn(L, Hq, D)
    cuts = [0, 7, 7, 31, L]  # chunk 1 is empty
    parts, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a == b:
            parts.append(torch.zeros(T, Hq, D))
            lses.append(torch.full((T, Hq), float("-inf")))
            continue
        o_c, lse_c = ref.attention(q.float(), k[a:b], v[a:b], sm_scale=0.3)
        parts.append(o_c.float())
        lses.append(lse_c.float())
    o_part, lse_part = torch.stack(parts, 1), torch.stack(lses, 1)  # [T, S, Hq, D], [T, S, Hq]
    lse_part[0] = float("-inf")  # token 0: no split saw a key
    o = torch.full((T, Hq, D), float("nan"))
    lse = torch.full((T, Hq), float("nan"))
    merge_extend_splits(o_part, lse_part, o, lse)
    o_ref, lse_ref = ref.attention(q.float(), k, v, sm_scale=0.3)
    assert torch.all(o[0] == 0) and torch.all(lse[0] == float("-inf"))
    assert rel_err(o[1:], o_ref[1:]) <= 1e-5
    assert (lse[1:].double() - lse_ref[1:]).abs().max() <= 1e-5 * lse_ref.abs().max()


def test_extend_channel_variant_switch(seed, monkeypatch):
    """OSCAR_CHANNEL_EXTEND picks the extend body (unset or empty: 'dequant'), extend_variant
    overrides it, bad values are refused before anything runs."""
    fmt = channel_fmt(64, 2, 32, 64)
    pool = ChannelPool(fmt, [70], [0], [0], hkv=1)
    q = torch.randn(2, 2, 64).bfloat16()

    def launched(**kw):
        return [k["EXT_DQ"] for _, _, k in _extend_launches(monkeypatch, pool, q, [2], **kw)]

    monkeypatch.delenv("OSCAR_CHANNEL_EXTEND", raising=False)
    assert launched() == [True] and launched(extend_variant="codes") == [False]
    monkeypatch.setenv("OSCAR_CHANNEL_EXTEND", "")
    assert launched() == [True]
    monkeypatch.setenv("OSCAR_CHANNEL_EXTEND", "codes")
    assert launched() == [False] and launched(extend_variant="dequant") == [True]
    monkeypatch.setenv("OSCAR_CHANNEL_EXTEND", "fast")
    with pytest.raises(ValueError, match="OSCAR_CHANNEL_EXTEND must be 'codes' or 'dequant', got 'fast'"):
        launched()
    monkeypatch.delenv("OSCAR_CHANNEL_EXTEND")
    with pytest.raises(ValueError, match="extend_variant must be 'codes' or 'dequant'"):
        launched(extend_variant="dq")


def test_extend_prefix_channel_logit_cap_and_merge(seed):
    """Logit cap (tanh of the scaled scores, as SGLang); the caller's LSE merge with causal
    attention over the new tokens equals attention over prefix + new tokens."""
    D, gqa, cap, hkv, sm = 64, 2, 5.0, 1, 0.125
    prefix, ext = [0, 110, 40], [2, 4, 3]
    pool = ChannelPool(channel_fmt(D, 3, 32, 64), prefix, [0, 0, 0], [0, 0, 0], hkv=hkv)
    q = (torch.randn(sum(ext), hkv * gqa, D) * 4).bfloat16()
    o, lse, qo = run_extend(pool, q, ext, sm, logit_cap=cap)
    assert not o.isnan().any()
    for b, L in enumerate(prefix):
        t0, t1 = int(qo[b]), int(qo[b + 1])
        if L == 0:
            assert torch.all(o[t0:t1] == 0) and torch.all(lse[t0:t1] == float("-inf"))
            continue
        K, V = pool.request_kv(b)
        s = torch.einsum("thd,lhd->htl", q[t0:t1].double(), K.double().repeat_interleave(gqa, 1)) * sm
        s = cap * torch.tanh(s / cap)
        lse_ref = torch.logsumexp(s, -1).T
        o_ref = torch.einsum("htl,lhd->thd", torch.softmax(s, -1), V.double().repeat_interleave(gqa, 1))
        assert rel_err(o[t0:t1], o_ref) <= REL_TOL
        assert (lse[t0:t1].double() - lse_ref).abs().max() <= REL_TOL * max(1.0, lse_ref.abs().max())
    b, L = 2, prefix[2]  # no cap: merge with the new tokens' own attention
    o, lse, qo = run_extend(pool, q, ext, sm)
    t0, t1 = int(qo[b]), int(qo[b + 1])
    K, V = pool.request_kv(b)
    kn, vn = torch.randn(t1 - t0, hkv, D), torch.randn(t1 - t0, hkv, D)
    o_new, lse_new = ref.attention(q[t0:t1].float(), kn, vn, sm_scale=sm, causal_offset=0)
    om, _ = ref.merge_attention_states(o[t0:t1].double(), lse[t0:t1].double(), o_new, lse_new)
    o_all, _ = ref.attention(q[t0:t1].float(), torch.cat([K, kn]), torch.cat([V, vn]), sm_scale=sm,
                             causal_offset=L)
    assert rel_err(om, o_all) <= REL_TOL


def test_extend_prefix_channel_rejects_unsupported(seed):
    pool = ChannelPool(channel_fmt(64, 2, 32, 64), [1, 40], [0, 0], [0, 0], hkv=1)
    q = torch.randn(3, 2, 64).bfloat16().to(DEV)
    qo = torch.tensor([0, 1, 3], dtype=torch.int32).to(DEV)
    args, kw = pool.args(), pool.kw()
    with pytest.raises(ValueError, match="k_codes must be uint8"):
        ops.extend_prefix_attention_channel(q, qo, *args, **dict(kw, k_bits=4), sm_scale=0.1,
                                            max_len_extend=2)
    with pytest.raises(ValueError, match="not a page size"):
        ops.extend_prefix_attention_channel(q, qo, *args, **dict(kw, k_block=16), sm_scale=0.1,
                                            max_len_extend=2)
    with pytest.raises(ValueError, match="kv_indptr has 2 entries"):
        ops.extend_prefix_attention_channel(q, qo, *args[:8], args[8][:2], *args[9:], **kw,
                                            sm_scale=0.1, max_len_extend=2)
    # no tokens: nothing launched, empty outputs
    o, lse = ops.extend_prefix_attention_channel(q[:0], qo[:1], *args, **kw, sm_scale=0.1,
                                                 max_len_extend=0)
    assert o.shape == (0, 2, 64) and lse.shape == (0, 2)



def test_extend_prefix_channel_does_not_recompile_per_chunk_length():
    """num_mb follows the batch's new-token counts: a runtime argument, never specialised (as a
    constexpr every new chunk length compiled a new kernel in the server)."""
    import inspect

    from oscar_kernels.triton import attend_channel

    kernel = attend_channel.attend_channel_kernel
    fn = getattr(kernel, "fn", kernel)  # the interpreter wraps the JITFunction
    assert inspect.signature(fn).parameters["num_mb"].annotation is inspect.Parameter.empty
    opts = getattr(kernel, "kwargs", None) or {"do_not_specialize": kernel.do_not_specialize}
    assert "num_mb" in opts["do_not_specialize"]


# ------------------------------------------------------------------------------------ store


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
    """windows: the block quantiser's programs take windows of B tokens (store_channel.
    KEY_BLOCK_WINDOWS_MIN_T, prefill chunks) instead of one token each, in every call."""
    from oscar_kernels.triton import store_channel

    if windows:
        monkeypatch.setattr(store_channel, "KEY_BLOCK_WINDOWS_MIN_T", 0)
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
    from oscar_kernels.triton import store_channel

    out = []
    for one, windows in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(store_channel, "KEY_BLOCK_WINDOWS_MIN_T", 0 if windows else 1 << 30)
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
