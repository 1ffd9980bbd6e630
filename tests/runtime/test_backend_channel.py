"""The oscar_triton backend on the default layout, per-channel keys over page blocks (TRITON_INTERPRET
on CPU, tiny shapes), against a float64 reference (oscar_kernels.reference.format_request_kv).

Format k3c32-v2t32-s4-w32: 3-bit keys per channel over pages of B = 32 slots, 2-bit values in
groups of 32, sink 4, ring 32 (one block). Slots are page-aligned as SGLang's paged allocator
gives them (position p of a request at page * 32 + p % 32). Scenario, one layer, GQA 4/2, D 64:
  1. request A prefills 62 tokens in two chunks, 40 then 22: block 0 completes inside chunk 1
     (OSCAR_PREFILL_READS=cache, page-canonical: its new tokens read block 0 back quantised,
     own_start 32; exact, the default: they read each other in BF16, own_start 0), chunk 1 ends
     inside block 1 (chunk 2 starts off a page boundary: it reads that block from the ring and
     its new tokens in BF16), and block 1 completes only in decode (3.);
  2. request B shares A's first page (a page-aligned radix hit of 32 tokens) and prefills 10
     more; A's sink copies carry over (sink_start 0); its ring copies of positions 30, 31 are
     not read (own_start 32: a hit reads its prefix as the cache holds it, whatever the ring
     still has);
  3. both decode 3 tokens as one batch: A's position 63 completes block 1 inside a decode step;
  4. both take one more token as a batched extend with their whole cache as prefix.
Every output is compared with softmax attention in float64 over what the format says each
reader sees (BF16 sink / ring copies where valid, the complete blocks' quantised keys elsewhere;
a page-canonical extend's new tokens in complete blocks as quantised, the others exact); stored
codes and params are bit-exact with the reference quantiser.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from oscar_kernels import reference as ref
from oscar_kernels.format import KVFormat

from .fake_flashinfer import fake_flashinfer_new_tokens, fake_flashinfer_prefix
from .test_backend import (  # noqa: F401
    Hq, H, D, _close, _decode_batch, _heavy, _reference, _rot, _signed_perm, backend_cls, prompt,
)

pytestmark = pytest.mark.slow  # the module's cases take minutes on 2 cores: make test, not test-fast

B, S, W = 32, 4, 32
FMT = KVFormat(D, k_bits=3, k_layout="channel", k_group=B, v_group=32, sink=S, window=W)


def _make(backend_cls, rows=4, pages=8, new_tokens="triton", prefix="int2", absorbed=False, reads="exact"):
    """A one-layer backend on the format above; reads: OSCAR_PREFILL_READS (exact, the default, or
    cache: page-canonical prefill)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from oscar_sglang.runtime.new_tokens import TritonNewTokens

    from oscar_sglang.runtime.kv_format import resolve
    from oscar_sglang.runtime.pool import OscarInt2KVPool, take_pending_rows

    take_pending_rows()
    fmt = resolve(FMT.name, head_dim=D, v_head_dim=D, num_layers=1, group_size=128)
    assert (fmt.layout, fmt.k_bits, fmt.k_group, fmt.sink, fmt.recent) == ("channel", (3,), B, S, W)
    rk, rv = _signed_perm(1, H), _signed_perm(1, 1)
    pool = OscarInt2KVPool((pages - 1) * B, B, H, D, D, 1, "cpu", req_rows=rows, kv_format=fmt,
                           k_clip=[0.9], v_clip=[1.0], k_rotation=rk, v_rotation=rv)
    if absorbed:  # o_proj holds R_v (runtime/absorb.py): V stored as projected, no un-rotation
        pool.v_rot = [None]
        rv = torch.eye(D).expand(1, 1, D, D)
    b = backend_cls.__new__(backend_cls)
    b.pool, b.v_head_dim, b.max_kv_splits = pool, D, 4
    b._canonical_prefill = reads == "cache"
    b._prepare_rotations(torch.bfloat16)
    b._new_tokens = (TritonNewTokens(extend_attention_fwd, torch.zeros(rows + 1, dtype=torch.int32))
                     if new_tokens == "triton" else fake_flashinfer_new_tokens(Hq, H, D, D))
    # OSCAR_PREFIX_ATTENTION=flashinfer: pieces of at most 64 rows, so prefixes span several
    b._prefix_fi = None if prefix == "int2" else fake_flashinfer_prefix(Hq, H, D, D, B, max_rows=64)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=Hq, tp_k_head_num=H, qk_head_dim=D, v_head_dim=D,
                            scaling=1 / math.sqrt(D), logit_cap=0.0, logit_capping_method="tanh",
                            k_scale=None, v_scale=None, sliding_window_size=-1)
    return b, pool, layer, rk[0], rv[0, 0]


def _seen(x_rot, which, kv_len, own, sink_start):
    """What a reader of kv_len keys sees of rotated K or V (float64)."""
    return ref.format_request_kv(x_rot.float(), FMT, which, kv_len, own_start=own,
                                 sink_start=sink_start).double()


# the new tokens' attention: SGLang's Triton
# kernel, FlashInfer's ragged prefill (a CPU stand-in with base-2 LSEs; the real one in tests/gpu)
# OSCAR_PREFIX_ATTENTION=flashinfer: the prefix as BF16 pieces through the stand-in, several pieces a call
# absorbed: R_v in the weights, so the decode's merge writes the model's dtype directly
# store: OSCAR_DECODE_STORE, a decode step's q and k rotated by GEMMs and stored in two launches
# (split) or all in one store launch (fused)
# reads: OSCAR_PREFILL_READS (exact: a prompt reads its own tokens in BF16; cache: page-canonical)
@pytest.mark.parametrize("new_tokens,prefix,absorbed,store,reads", [
    ("triton", "int2", False, "split", "exact"), ("flashinfer", "int2", False, "split", "cache"),
    ("flashinfer", "flashinfer", False, "split", "exact"), ("flashinfer", "flashinfer", True, "split", "cache"),
    ("triton", "int2", False, "fused", "cache"), ("flashinfer", "flashinfer", True, "fused", "exact")])
def test_channel_layout_chunks_radix_share_decode_and_mixed_extend(backend_cls, seed, new_tokens,
                                                                  prefix, absorbed, store, reads, monkeypatch):
    from oscar_sglang.runtime.pool import note_new_rows

    if prefix == "flashinfer":  # every forward with a prefix through FlashInfer, however short its extends
        import oscar_sglang.runtime.backend as backend_module

        monkeypatch.setattr(backend_module, "PREFIX_FI_MIN_ROWS_PER_KEY", 1)

    b, pool, layer, Rk, Rv = _make(backend_cls, new_tokens=new_tokens, prefix=prefix, absorbed=absorbed,
                                   reads=reads)
    monkeypatch.setenv("OSCAR_PREFILL_READS", reads)
    assert b._prefill_reads() is (reads == "cache")
    canonical = reads == "cache"
    assert pool.layout.name == "channel" and pool.k_codes[0].shape[-1] == 3 * D // 8
    monkeypatch.setenv("OSCAR_DECODE_STORE", store)
    assert b._decode_store() is (store == "fused")
    b._fused_store = store == "fused"
    gemm_rotations = []  # q rotations by GEMM (the decode's, with store="fused", are the store's)
    rot_q = b._rot_q
    monkeypatch.setattr(b, "_rot_q", lambda q3, i: gemm_rotations.append(q3.shape[0]) or rot_q(q3, i))
    req_to_token = torch.zeros(4, 128, dtype=torch.int64)
    rowA, rowB = 1, 2
    LA, LB_new, share = 62, 10, 32
    kA, vA = _heavy(LA + 4, D), _heavy(LA + 4, D)
    qA = torch.randn(LA + 4, Hq, D).bfloat16().float()
    kB, vB = torch.cat([kA[:share], _heavy(LB_new + 4, D)]), torch.cat([vA[:share], _heavy(LB_new + 4, D)])
    qB = torch.randn(share + LB_new + 4, Hq, D).bfloat16().float()
    # page-aligned slots: A on pages 1, 2, 3; B shares page 1, then pages 5, 6
    slotsA = torch.arange(B, B + LA + 4)
    slotsB = torch.cat([slotsA[:share], torch.arange(5 * B, 5 * B + LB_new + 4)])
    req_to_token[rowA, : LA + 4] = slotsA
    req_to_token[rowB, : share + LB_new + 4] = slotsB
    assert torch.equal(slotsA % B, torch.arange(LA + 4) % B) and torch.equal(slotsB % B, torch.arange(len(slotsB)) % B)
    kAr, vAr, kBr, vBr = _rot(kA, Rk), _rot(vA, Rv), _rot(kB, Rk), _rot(vB, Rv)
    RvT = Rv.double().T
    b.req_to_token = req_to_token
    # (own_start, sink_start) each reader should have: a page-canonical extend trusts its ring from
    # its last incomplete page on (A: 40 // 32 * 32; B: 42 // 32 * 32); an exact one from the first
    # position it computed (A: 0, B: its prefix 32). B's carried ring copies of positions 30, 31 are
    # read in neither.
    state = {rowA: (32 if canonical else 0, 0), rowB: (32, 0)}
    g = Hq // H

    def extend(reqs):
        """reqs: (row, k, v, q, start, end, new_request) -> outputs [T, Hq, D] float32."""
        ext = torch.tensor([e - s for _, _, _, _, s, e, _ in reqs])
        pre = torch.tensor([s for _, _, _, _, s, _, _ in reqs])
        rows = torch.tensor([r for r, *_ in reqs])
        fb = SimpleNamespace(
            batch_size=len(reqs), req_pool_indices=rows, seq_lens=pre + ext, extend_seq_lens=ext,
            extend_prefix_lens=pre, extend_prefix_lens_cpu=pre.tolist(), extend_seq_lens_cpu=ext.tolist(),
            positions=torch.cat([torch.arange(s, e) for *_, s, e, _ in reqs]),
            out_cache_loc=torch.cat([req_to_token[r, s:e] for r, _, _, _, s, e, _ in reqs]),
            forward_mode=SimpleNamespace(is_extend=lambda: True),
        )
        for r, *_, s, e, new in reqs:
            if new:  # the alloc hook queued its row and radix-hit length
                note_new_rows([r], [s], [prompt()])
        b.forward_metadata = SimpleNamespace(
            qo_indptr=torch.cat([torch.zeros(1, dtype=torch.int64), ext.cumsum(0)]),
            kv_indptr=torch.cat([torch.zeros(1, dtype=torch.int32), pre.cumsum(0).int()]),
            kv_indices=torch.cat([req_to_token[r, :s] for r, _, _, _, s, _, _ in reqs] + [torch.zeros(0, dtype=torch.int64)]),
            max_extend_len=int(ext.max()),
        )
        b._prepare_forward(fb)
        cat = lambda i: torch.cat([x[i][x[4]:x[5]] for x in reqs])  # noqa: E731
        o = b.forward_extend(cat(3).reshape(-1, Hq * D), cat(1).reshape(-1, H * D), cat(2).reshape(-1, H * D), layer, fb)
        return o.float().reshape(-1, Hq, D)

    def check_extend(o, req, kr, vr):
        row, k, v, q, s, e, _ = req
        own, ss = state[row]
        qr = torch.einsum("thgd,hde->thge", q.reshape(-1, H, g, D), Rk).reshape(-1, Hq, D)
        if canonical and s % B == 0:  # page-canonical: every reader of [0, e) sees the cache's reading of it
            assert own == e // B * B
            Ks, Vs = _seen(kr[:e], "k", e, own, ss), _seen(vr[:e], "v", e, own, ss) @ RvT
            for i, t in enumerate(range(s, e)):
                _close(o[i], _reference(qr[t].double(), [Ks[: t + 1]], [Vs[: t + 1]]))
            return
        if s:
            Kp, Vp = _seen(kr[:s], "k", s, own, ss), _seen(vr[:s], "v", s, own, ss) @ RvT
        for i, t in enumerate(range(s, e)):
            if s:
                sp = torch.einsum("hd,nhd->hn", qr[t].double(), Kp.repeat_interleave(g, 1))
                sn = torch.einsum("hd,nhd->hn", q[t].double(), k[s: t + 1].double().repeat_interleave(g, 1))
                vv = torch.cat([Vp, v[s: t + 1].double()]).repeat_interleave(g, 1)
                want = torch.einsum("hn,nhd->hd", torch.softmax(torch.cat([sp, sn], 1) / math.sqrt(D), -1), vv)
            else:
                want = _reference(q[t].double(), [k[: t + 1].double()], [v[: t + 1].double()])
            _close(o[i], want)

    # 1. A: chunk 1 ends inside block 1 (positions 32..39 have no key codes yet), chunk 2 reads
    # that incomplete block from the ring
    a1, a2 = (rowA, kA, vA, qA, 0, 40, True), (rowA, kA, vA, qA, 40, LA, False)
    check_extend(extend([a1]), a1, kAr, vAr)
    codes, params, _ = ref.quantize_key_blocks(kAr[:40].float(), 3, B)
    assert torch.equal(pool.k_codes[0][slotsA[:32]], codes) and torch.equal(pool.k_params[0][1], params[0])
    check_extend(extend([a2]), a2, kAr, vAr)
    assert torch.equal(pool.k_params[0][2], torch.zeros_like(pool.k_params[0][2]))  # block 1 incomplete
    # values: per-token 2-bit rows at every stored slot
    vc, vp = ref.quantize_rows(vAr[:LA].float(), 2, 32)
    assert torch.equal(pool.v_codes[0][slotsA[:LA]], vc) and torch.equal(pool.v_params[0][slotsA[:LA]], vp)

    # 2. B: page-aligned radix hit on A's first page; the sink carries over, the ring is not read
    bx = (rowB, kB, vB, qB, share, share + LB_new, True)
    o = extend([bx])
    assert (pool.own_start[rowB].item(), pool.sink_start[rowB].item()) == state[rowB]
    check_extend(o, bx, kBr, vBr)

    # 3. decode 3 steps, batch [A, B]; A's position 63 completes block 1
    gemm_rotations.clear()
    lens = torch.tensor([LA, share + LB_new])
    seqs = [(rowA, kA, vA, kAr, vAr, qA), (rowB, kB, vB, kBr, vBr, qB)]
    for step in range(3):
        lens = lens + 1
        pos = lens - 1
        rows = torch.tensor([rowA, rowB])
        fb = _decode_batch(b, req_to_token, rows, lens)
        pick = lambda i: torch.stack([s[i][p] for s, p in zip(seqs, pos.tolist())])  # noqa: E731
        o = b.forward_decode(pick(5).reshape(2, Hq * D), pick(1).reshape(2, H * D), pick(2).reshape(2, H * D), layer, fb)
        o = o.float().reshape(2, Hq, D)
        for i, (row, _, _, kr, vr, q) in enumerate(seqs):
            n = int(lens[i])
            own, ss = state[row]
            qr = torch.einsum("hgd,hde->hge", q[n - 1].reshape(H, g, D), Rk).reshape(Hq, D)
            want = _reference(qr.double(), [_seen(kr[:n], "k", n, own, ss)], [_seen(vr[:n], "v", n, own, ss)])
            _close(o[i], want @ RvT)
    codes, params, _ = ref.quantize_key_blocks(kAr[:64].float(), 3, B)
    assert torch.equal(pool.k_codes[0][slotsA[32:64]], codes[32:]) and torch.equal(pool.k_params[0][2], params[1])
    assert gemm_rotations == ([] if store == "fused" else [2, 2, 2])

    # 4. one more token each as a batched extend (mixed-chunk style): prefix = the whole cache
    nA, nB = LA + 3, share + LB_new + 3
    ma, mb = (rowA, kA, vA, qA, nA, nA + 1, False), (rowB, kB, vB, qB, nB, nB + 1, False)
    o = extend([ma, mb])
    check_extend(o[:1], ma, kAr, vAr)
    check_extend(o[1:], mb, kBr, vBr)


def test_channel_pool_refuses_a_page_size_that_is_not_the_block(backend_cls):
    from oscar_sglang.runtime.kv_format import resolve
    from oscar_sglang.runtime.pool import OscarInt2KVPool

    fmt = resolve(FMT.name, head_dim=D, v_head_dim=D, num_layers=1, group_size=128)
    with pytest.raises(ValueError, match="needs --page-size 32"):
        OscarInt2KVPool(128, 16, H, D, D, 1, "cpu", req_rows=2, kv_format=fmt, k_clip=[1.0], v_clip=[1.0])


def test_decode_splits_use_the_kernels_plan_within_sglangs_scratch(backend_cls, monkeypatch):
    """Per-channel decode: the kernel's split plan (ops.decode_splits_channel), each request's count
    derived in kernel (no num_kv_splits), in SGLang's scratch ([rows, Hq, max_kv_splits, Dv]),
    whose split dimension caps it. Per-token formats keep SGLang's split counts and scratch."""
    from oscar_kernels import ops

    b, pool, *_ = _make(backend_cls)
    graph = SimpleNamespace(attn_logits=torch.zeros(16, Hq, 64, D), attn_lse=torch.zeros(16, Hq, 64),
                            num_kv_splits=torch.zeros(16, dtype=torch.int32))
    for B in (1, 2, 16):
        plan = ops.decode_splits_channel(B, H, S, W, torch.device("cpu"))
        got = b._decode_splits(B, Hq, D, graph)
        assert got["num_kv_splits"] is None and got["max_kv_splits"] == plan <= 64
        assert got["attn_logits"].shape == (B, Hq, plan, D) and got["attn_lse"].shape == (B, Hq, plan)
        assert got["attn_logits"].data_ptr() == graph.attn_logits.data_ptr()  # views of SGLang's
        assert got["attn_lse"].data_ptr() == graph.attn_lse.data_ptr()
    assert ops.decode_splits_channel(1, H, S, W, torch.device("cpu")) > 4
    small = SimpleNamespace(attn_logits=torch.zeros(2, Hq, 4, D), attn_lse=torch.zeros(2, Hq, 4), num_kv_splits=None)
    got = b._decode_splits(1, Hq, D, small)  # --triton-attention-num-kv-splits 4
    assert got["max_kv_splits"] == 4 and got["attn_logits"].shape == (1, Hq, 4, D)
    # the other layers of a step reuse the first one's plan and views; new scratch or B replans
    calls, real = [], ops.decode_splits_channel
    monkeypatch.setattr(ops, "decode_splits_channel", lambda *a: calls.append(a) or real(*a))
    first = b._decode_splits(2, Hq, D, graph)
    assert all(b._decode_splits(2, Hq, D, graph) is first for _ in range(31)) and len(calls) == 1
    assert b._decode_splits(1, Hq, D, graph)["attn_logits"].shape[0] == 1 and len(calls) == 2
    fresh = SimpleNamespace(attn_logits=torch.zeros(16, Hq, 64, D), attn_lse=torch.zeros(16, Hq, 64))
    got = b._decode_splits(1, Hq, D, fresh)
    assert got["attn_logits"].data_ptr() == fresh.attn_logits.data_ptr() and len(calls) == 3
    from oscar_sglang.runtime.layouts import PerTokenLayout

    pool.layout = PerTokenLayout(pool.kv_format)  # a per-token pool: SGLang's plan as given
    got = b._decode_splits(2, Hq, D, graph)
    assert got["num_kv_splits"] is graph.num_kv_splits and got["max_kv_splits"] == b.max_kv_splits
    assert got["attn_logits"] is graph.attn_logits and got["attn_lse"] is graph.attn_lse


def test_decode_splits_of_small_batches_use_the_backends_wider_scratch(backend_cls, monkeypatch):
    """Where the kernel's plan for a batch exceeds SGLang's scratch (the plugin's 64 splits), the
    backend's own scratch ([rows, Hq, plan(1), Dv], allocated at start) holds it: at 132 SMs batch
    1 plans 128 splits. Larger batches stay in SGLang's; a user's other split count caps the plan
    (no scratch of the backend's own)."""
    from oscar_kernels import ops
    from oscar_kernels.triton import channel_decode as ch

    from oscar_sglang.runtime.hooks import INT2_DEFAULT_KV_SPLITS

    monkeypatch.setattr(ch, "sm_count", lambda device: 132)
    b, *_ = _make(backend_cls)
    b.max_kv_splits = INT2_DEFAULT_KV_SPLITS
    plan = lambda n: ops.decode_splits_channel(n, H, S, W, torch.device("cpu"))  # noqa: E731
    rows = max(n for n in range(1, 65) if plan(n) > INT2_DEFAULT_KV_SPLITS)
    b._wide_scratch = wide = b._wide_split_scratch(Hq, D, "cpu")
    assert plan(1) == ch.DECODE_MAX_SPLITS == 128 and rows >= 1
    assert wide[0].shape == (rows, Hq, 128, D) and wide[1].shape == (rows, Hq, 128)
    graph = SimpleNamespace(attn_logits=torch.zeros(16, Hq, 64, D), attn_lse=torch.zeros(16, Hq, 64))
    for n in range(1, rows + 1):
        got = b._decode_splits(n, Hq, D, graph)
        assert got["num_kv_splits"] is None and got["max_kv_splits"] == plan(n) > 64
        assert got["attn_logits"].shape == (n, Hq, plan(n), D) and got["attn_lse"].shape == (n, Hq, plan(n))
        assert got["attn_logits"].data_ptr() == wide[0].data_ptr() and got["attn_lse"].data_ptr() == wide[1].data_ptr()
    got = b._decode_splits(rows + 1, Hq, D, graph)
    assert got["max_kv_splits"] == plan(rows + 1) <= 64
    assert got["attn_logits"].data_ptr() == graph.attn_logits.data_ptr()
    b.max_kv_splits = 32  # --triton-attention-num-kv-splits 32 from the user
    assert b._wide_split_scratch(Hq, D, "cpu") is None
    b._wide_scratch, b._split_args = None, None
    assert b._decode_splits(1, Hq, D, graph)["max_kv_splits"] == 64  # SGLang's scratch caps it


def test_flashinfer_reads_the_prefix_only_where_many_rows_share_each_cached_key():
    """A prefill chunk over its prompt's earlier chunks goes through FlashInfer; a batch whose cached
    keys belong mostly to one-token rows (decodes folded in by --enable-mixed-chunk, a short new
    turn over a long radix hit) stays on the INT2 kernel, which reads the codes in place."""
    from oscar_sglang.runtime.backend import PREFIX_FI_MIN_ROWS_PER_KEY as MIN, prefix_worth_flashinfer

    assert prefix_worth_flashinfer([8192], [24576])  # the 4th chunk of a 32K prompt
    assert prefix_worth_flashinfer([8192, 1, 1], [24576, 2048, 2048])  # that chunk + 2 decodes
    assert not prefix_worth_flashinfer([2048] + [1] * 255, [0] + [2048] * 255)  # mixed chunk, 255 decodes
    assert not prefix_worth_flashinfer([1, 1], [4096, 4096])
    assert not prefix_worth_flashinfer([40], [0]) and not prefix_worth_flashinfer([], [])
    assert prefix_worth_flashinfer([MIN], [100]) and not prefix_worth_flashinfer([MIN - 1], [100])


def test_prefix_pieces_cover_every_prefix_in_bounded_block_aligned_pieces():
    from oscar_sglang.runtime.prefix_flashinfer import plan_pieces

    for lens, block, max_rows in (([0, 130, 64, 1000], 64, 256), ([5000], 32, 1024), ([3] * 40, 64, 256)):
        pieces = plan_pieces(lens, block, max_rows)
        assert [sum(n[b] for _, n in pieces) for b in range(len(lens))] == lens
        for lo, n in pieces:
            assert lo % block == 0 and all(0 <= x <= max(block, max_rows) for x in n)
            assert sum(n) <= max(max_rows, block * sum(1 for x in lens if x))
    assert plan_pieces([0, 0], 64) == []


def test_warm_up_compiles_both_prefix_readers_when_flashinfer_reads_the_prefix(backend_cls, monkeypatch):
    """With FlashInfer for the prefix, forwards that prefix_worth_flashinfer turns down still run the
    INT2 prefix kernel: warm_up compiles the FlashInfer prefix path, the INT2 one and the path
    without a prefix, and restores the per-forward state."""
    from oscar_kernels import ops

    from .test_backend import warm_up_model

    b, pool, layer, _, _ = _make(backend_cls, new_tokens="flashinfer", prefix="flashinfer")
    model = warm_up_model(layer)
    calls = []
    real_int2, real_fi = ops.extend_prefix_attention_channel, b._prefix_fi.run
    monkeypatch.setattr(ops, "extend_prefix_attention_channel",
                        lambda *a, **k: calls.append("int2 prefix") or real_int2(*a, **k))
    b._prefix_fi.run = lambda *a, **k: calls.append("flashinfer prefix") or real_fi(*a, **k)
    from oscar_sglang.runtime.backend import Int2ForwardMetadata

    imd = Int2ForwardMetadata(has_prefix=False)
    b.forward_metadata, b.int2_md = "sentinel", imd
    b.warm_up(model, torch.float32)  # the stand-in wrappers' dtype
    assert calls == ["flashinfer prefix", "int2 prefix"]
    assert b.forward_metadata == "sentinel" and b.int2_md is imd and not imd.has_prefix and not imd.use_prefix_fi


def test_a_one_request_decode_rotates_q_and_k_with_one_gemm(backend_cls, seed, monkeypatch, caplog):
    """Batch 1, one R_k for both KV heads (the data-free recipe's case), q and k adjacent in one
    qkv buffer as SGLang's fused qkv_proj leaves them: q @ R_k and k @ R_k come from one GEMM (no
    _rot_q call) and the steps store and attend bit for bit as when q and k are separate tensors
    (two GEMMs; a signed permutation makes both exact), and as float64 attention over the
    rotated keys. Five tokens from position 0 (a decode-only stand-in for a request whose prefill
    left own_start = sink_start = 0): sink and ring only, every key a BF16 copy."""
    import logging

    caplog.set_level(logging.INFO, logger="oscar_sglang")
    monkeypatch.delenv("OSCAR_DECODE_STORE", raising=False)
    gen = torch.Generator().manual_seed(seed)
    shared = _signed_perm(1)[0]
    row, n = 1, 5
    qkvs = [(torch.randn(1, (Hq + 2 * H) * D, generator=gen) * (1 + 7 * (torch.rand(Hq + 2 * H, D, generator=gen)
             > 0.9)).reshape(1, -1)).bfloat16() for _ in range(n)]
    runs = {}
    for joint in (True, False):
        b, pool, layer, _, _ = _make(backend_cls, absorbed=True)
        pool.k_rot = [shared.expand(H, D, D)]  # one matrix for every head, stride 0 (as hadamard)
        b._prepare_rotations(torch.bfloat16)
        assert b._k_rot[0].dim() == 2
        calls = []
        rot_q = b._rot_q
        monkeypatch.setattr(b, "_rot_q", lambda q3, i, rot_q=rot_q: calls.append(q3.shape[0]) or rot_q(q3, i))
        req_to_token = torch.zeros(4, 128, dtype=torch.int64)
        req_to_token[row, :n] = torch.arange(B, B + n)
        # the row's state after a prefill of its own (no radix hit): sink and ring are its own
        pool.own_start[row], pool.sink_start[row] = 0, 0
        outs = []
        caplog.clear()
        for t, qkv in enumerate(qkvs):
            q, k, v = qkv[:, :Hq * D], qkv[:, Hq * D:(Hq + H) * D], qkv[:, (Hq + H) * D:]
            if not joint:
                q, k, v = q.clone(), k.clone(), v.clone()  # three buffers: nothing adjacent
            fb = _decode_batch(b, req_to_token, torch.tensor([row]), torch.tensor([t + 1]), splits=(4,))
            outs.append(b.forward_decode(q, k, v, layer, fb).float().reshape(Hq, D))
        assert calls == ([] if joint else [1] * n)
        said = [r.getMessage() for r in caplog.records if "one-request decode step" in r.getMessage()]
        assert len(said) == 1 and ("with one GEMM" if joint else "with two GEMMs") in said[0]
        runs[joint] = (outs, pool.sink_k[0].clone(), pool.ring_k[0].clone(), pool.sink_v[0].clone())
    for a, c in zip(runs[True][0], runs[False][0]):
        assert torch.equal(a, c)
    for a, c in zip(runs[True][1:], runs[False][1:]):
        assert torch.equal(a, c)
    for t, out in enumerate(runs[True][0]):
        qs = [x[:, :Hq * D].reshape(Hq, D) for x in qkvs[: t + 1]]
        ks = torch.stack([x[0, Hq * D:(Hq + H) * D].reshape(H, D) for x in qkvs[: t + 1]]).double() @ shared.double()
        vs = torch.stack([x[0, (Hq + H) * D:].reshape(H, D) for x in qkvs[: t + 1]]).double()
        qr = qs[t].double() @ shared.double()
        # bf16 probabilities and a bf16 output, each cast truncating under TRITON_INTERPRET (up to
        # 2^-8 relative): 0.55% the worst of 60 steps over 12 seeds
        _close(out, _reference(qr, [ks], [vs]), tol=1e-2)
