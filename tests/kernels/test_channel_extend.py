"""Extend-prefix over per-channel keys (triton/channel_extend.py) vs the float64 reference: the
new tokens of each request against its cached prefix, with query blocks, prefix splits and short
extends. Pool, oracle and bound: tests/kernels/channel_case.py.
"""
import math

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.triton.channel_attend import NOT_SPECIALIZED

from .channel_case import ChannelPool, channel_fmt
from .pool_case import DEV, REL_TOL, rel_err

pytestmark = pytest.mark.slow  # the module's cases take minutes on 2 cores: make test, not test-fast

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
        from oscar_kernels.triton import channel_extend

        res = channel_extend.extend_prefix_attention_channel(
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


# block_m given: the launcher's query tile (several query blocks per request)
@pytest.mark.parametrize("D,bits,B,vg,gqa,block_m", [
    (64, 2, 32, 64, 1, 16),
    (64, 4, 32, 32, 3, 16),  # 16 rows = 5 1/3 tokens: a token's heads straddle query blocks
    (128, 3, 32, 128, 2, None),
    (64, 3, 64, 64, 2, 16),
    (128, 2, 64, 64, 4, None),
    (128, 3, 32, 64, 2, None),
    (128, 3, 64, 128, 4, 32),
    (128, 4, 64, 128, 4, None),
])
def test_extend_prefix_channel_matches_reference(seed, D, bits, B, vg, gqa, block_m):
    hkv = 2
    reqs = EXT_32 if B == 32 else EXT_64
    prefix, owns, sinks, ext = map(list, zip(*reqs))
    pool = ChannelPool(channel_fmt(D, bits, B, vg), prefix, owns, sinks, hkv=hkv)
    q = (torch.randn(sum(ext), hkv * gqa, D) * 2).bfloat16()
    sm = 1 / math.sqrt(D)
    o, lse, qo_indptr = run_extend(pool, q, ext, sm, block_m)
    check_extend(o, lse, qo_indptr, prefix, q, pool.request_kv, sm)


def _extend_launches(monkeypatch, pool, q, ext, **kw):
    """[(grid, positional args, keywords)] of the kernel launches an extend-prefix call makes, the
    kernel replaced by a recorder for the call (it computes nothing: outputs are not checked)."""
    from oscar_kernels.triton import channel_extend as ch

    seen, kern = [], ch.channel_kernel

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append((grid, a, k))
    monkeypatch.setattr(ch, "channel_kernel", Rec())
    try:
        run_extend(pool, q, ext, 0.1, **kw)
    finally:
        monkeypatch.setattr(ch, "channel_kernel", kern)
    return seen


# a prefill's requests, then mixed-chunk decodes (one new token over a cached prefix), one of them
# a padding request (empty prefix), and a decode whose prefix ends mid-block
EXT_MIXED = [(0, 0, 0, 9), (96, 0, 0, 20), (75, 2, 2, 9),
             (130, 64, 0, 1), (0, 0, 0, 1), (100, 64, 64, 1), (75, 0, 0, 1)]


# the launch split is host code, the same for every key width: one case per head_dim (its own
# first-launch tile) and per GQA (rows per token); the short tiles' kernel (BLOCK_M 16) at 2-bit
# keys is test_extend_prefix_channel_matches_reference's block_m=16 case
@pytest.mark.parametrize("D,bits,gqa", [(128, 3, 4), (64, 4, 2)])
def test_extend_prefix_channel_short_tail_gets_its_own_launch(seed, monkeypatch, D, bits, gqa):
    """With the extend lengths on the host, a batch that ends in short extends (the decodes that
    --enable-mixed-chunk folds in) is two launches, the tail's with SHORT_EXTEND_ROWS-row tiles;
    every token still matches the float64 reference, as without the lengths; a batch of short
    extends only is one launch of short tiles; lengths that do not match the batch are refused."""
    from oscar_kernels.triton import channel_extend as ch

    hkv = 2
    prefix, owns, sinks, ext = map(list, zip(*EXT_MIXED))
    pool = ChannelPool(channel_fmt(D, bits, 32, 64), prefix, owns, sinks, hkv=hkv)
    q = (torch.randn(sum(ext), hkv * gqa, D) * 2).bfloat16()
    sm = 1 / math.sqrt(D)
    k = ch.short_extend_start(ext, gqa)
    assert k == 3 and ch.short_extend_start([1, 1], gqa) == 0 and ch.short_extend_start([1, 9], gqa) == 2
    o, lse, qo_indptr = run_extend(pool, q, ext, sm, extend_lens=ext)
    check_extend(o, lse, qo_indptr, prefix, q, pool.request_kv, sm)
    o1, lse1, _ = run_extend(pool, q, ext, sm)  # one launch, the same answer
    assert rel_err(o, o1) <= REL_TOL and torch.allclose(lse, lse1, atol=REL_TOL, rtol=REL_TOL)
    launches = _extend_launches(monkeypatch, pool, q, ext, extend_lens=ext)
    assert [(g[0], a[-1]) for g, a, _ in launches] == [(k, ch.triton.cdiv(20 * gqa, launches[0][2]["BLOCK_M"])),
                                                       (len(ext) - k, 1)]
    assert launches[1][2]["BLOCK_M"] == ch.SHORT_EXTEND_ROWS and launches[1][2]["num_warps"] == ch.SHORT_EXTEND_WARPS
    # each launch sees only its own tokens: split scratch is sized by them, not by the batch
    assert [a[0].shape[0] for _, a, _ in launches] == [sum(ext[:k]), sum(ext[k:])]
    o3, lse3, _ = run_extend(pool, q, ext, sm, extend_lens=ext, num_splits=3)
    check_extend(o3, lse3, qo_indptr, prefix, q, pool.request_kv, sm)
    tail = [1, 1, 1]
    pool2 = ChannelPool(channel_fmt(D, bits, 32, 64), [130, 0, 75], [64, 0, 0], [0, 0, 0], hkv=hkv)
    q2 = (torch.randn(3, hkv * gqa, D) * 2).bfloat16()
    (launch,) = _extend_launches(monkeypatch, pool2, q2, tail)  # no lengths needed
    assert launch[2]["BLOCK_M"] == ch.SHORT_EXTEND_ROWS
    o2, lse2, qo2 = run_extend(pool2, q2, tail, sm)
    check_extend(o2, lse2, qo2, [130, 0, 75], q2, pool2.request_kv, sm)
    with pytest.raises(ValueError, match=r"extend_lens \(2 requests, 2 tokens\) does not match the batch \(7 requests"):
        run_extend(pool, q, ext, sm, extend_lens=[1, 1])
    with pytest.raises(ValueError, match="does not match the batch"):
        run_extend(pool, q, ext, sm, extend_lens=ext[:-1] + [2])


# splits: the prefix split count forced (num_splits; 7 > the body blocks of some requests, so
# some splits see no key) or chosen from max_len_prefix by the policy (8 SMs off CUDA)
@pytest.mark.parametrize("D,bits,B,splits", [
    (64, 3, 32, 3),
    (64, 2, 32, 7),
    (128, 3, 64, 2),
    (64, 4, 32, "policy"),
])
def test_extend_prefix_channel_split_prefix_matches_reference(seed, D, bits, B, splits):
    """The prefix split into chunks of body blocks (split 0 also reads the sink and the ring),
    each chunk's normalised partial output and LSE merged: the same attention as the float64
    reference over the whole prefix, for every request (empty prefix: o = 0, lse = -inf)."""
    from oscar_kernels.triton import channel_extend as ch

    hkv, gqa = 2, 2
    reqs = EXT_32 if B == 32 else EXT_64
    prefix, owns, sinks, ext = map(list, zip(*reqs))
    pool = ChannelPool(channel_fmt(D, bits, B, 64), prefix, owns, sinks, hkv=hkv)
    q = (torch.randn(sum(ext), hkv * gqa, D) * 2).bfloat16()
    sm = 1 / math.sqrt(D)
    if splits == "policy":
        num_mb = math.ceil(max(ext) * gqa / ch.extend_block_m(D))
        kw = dict(max_len_prefix=max(prefix) * ch.EXTEND_SPLIT_MIN_KEYS // 64)  # as if 16x longer
        assert ch.extend_prefix_splits(len(ext) * hkv * num_mb, kw["max_len_prefix"], DEV) > 1
    else:
        kw = dict(num_splits=splits)
    o, lse, qo_indptr = run_extend(pool, q, ext, sm, **kw)
    check_extend(o, lse, qo_indptr, prefix, q, pool.request_kv, sm)


@pytest.mark.parametrize("gqa,hkv", [(3, 3), (4, 8)])  # Hq 9 (S * Hq = 144 at 16 splits) and 32
def test_extend_prefix_split_launch_compiles_nothing_new(seed, monkeypatch, gqa, hkv):
    """A split extend launch passes arguments of the same specialisation kinds as an unsplit one
    (Triton compiles one kernel per kind: ints equal to 1 or multiples of 16, 16-byte aligned
    pointers), so the first split call of a warm server compiles nothing."""
    from oscar_kernels.triton import channel_extend as ch

    kern = ch.channel_kernel
    names, skip = kern.arg_names, set(NOT_SPECIALIZED)  # the interpreter keeps no such list
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
    from oscar_kernels.triton import channel_extend as ch

    per, mink, most = ch.EXTEND_SPLIT_PROGRAMS_PER_SM, ch.EXTEND_SPLIT_MIN_KEYS, ch.EXTEND_MAX_SPLITS
    cpu = torch.device("cpu")  # core.sm_count: 8
    assert ch.extend_prefix_splits(4, None, cpu) == 1  # prefix length unknown
    assert ch.extend_prefix_splits(4, 0, cpu) == 1
    assert ch.extend_prefix_splits(per * 8, 10**6, cpu) == 1  # a full wave already
    assert ch.extend_prefix_splits(4, mink - 1, cpu) == 1  # too short to split
    assert ch.extend_prefix_splits(4, 2 * mink, cpu) == 2  # limited by the chunk size
    assert ch.extend_prefix_splits(4, 10**6, cpu) == math.ceil(per * 8 / 4)  # by the grid
    assert ch.extend_prefix_splits(1, 10**7, cpu) == min(most, per * 8)


def test_merge_extend_splits_is_one_softmax(seed):
    """Partial attentions over disjoint key chunks (one chunk empty) merged by LSE equal the
    float64 attention over all keys; rows whose chunks are all empty get o = 0, lse = -inf."""
    from oscar_kernels.triton.channel_extend import merge_extend_splits

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

    from oscar_kernels.triton import channel_attend

    kernel = channel_attend.channel_kernel
    fn = getattr(kernel, "fn", kernel)  # the interpreter wraps the JITFunction
    assert inspect.signature(fn).parameters["num_mb"].annotation is inspect.Parameter.empty
    opts = getattr(kernel, "kwargs", None) or {"do_not_specialize": kernel.do_not_specialize}
    assert "num_mb" in opts["do_not_specialize"]
