"""The oscar_triton backend's store / extend / decode path on tiny shapes (TRITON_INTERPRET on
CPU), against a float64 reference built from oscar_kernels.reference.

Scenario (one layer, GQA 4 q heads / 2 KV heads, D = 64, sink 4, recent 8, random orthogonal
per-head K rotation and shared V rotation (signed permutations), K clip 0.9):
  1. request A prefills 20 tokens in two chunks (12, then 8 with a 12-token prefix);
  2. request B shares A's first 8 tokens through the "radix cache" (same slots) and prefills 7
     more; A's sink copies of those tokens are still intact, so they are carried over into B's
     row (sink_start 0) while its ring copies of positions 4..7 are not (own_start 8);
  3. both decode 3 tokens as one batch;
  4. both take one more token as a batched extend with their whole cache as prefix (what SGLang's
     --enable-mixed-chunk does with decoding requests: extend mode, 1 new token each).
Model tensors are float32 holding bf16-representable values: SGLang's stock extend kernel gives
garbage for bf16 under TRITON_INTERPRET (numpy has no bf16; fine on GPU), and the GPU run covers
bf16 end to end. Side buffers are BF16 as in serving.
Every attention output is compared with softmax attention in float64 over the keys the design
says each reader sees: BF16 sink / ring copies where valid, INT2 (quantised rotated bf16 K/V)
elsewhere, exact BF16 for the new tokens of an extend.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from oscar_kernels import reference as ref
from oscar_kernels.format import Int2Format

from .fake_flashinfer import fake_flashinfer_new_tokens

pytestmark = pytest.mark.slow  # the module's cases take minutes on 2 cores: make test, not test-fast

Hq, H, D, S, W = 4, 2, 64, 4, 8
K_CLIP, V_CLIP = 0.9, 1.0


@pytest.fixture(scope="module")
def backend_cls():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from oscar_sglang.runtime.backend import OscarInt2TritonBackend

    return OscarInt2TritonBackend


def _close(got, want, tol=2e-3):
    """Relative L2 error per query: BF16 side-buffer copies round to nearest on GPU but truncate
    under TRITON_INTERPRET (one bf16 ulp), so elementwise bounds would be brittle."""
    err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err <= tol, err


def _orth(*shape):
    return torch.linalg.qr(torch.randn(*shape, dtype=torch.float64))[0].float()


def _signed_perm(*lead):
    """Random signed permutation matrices [*lead, D, D]: orthogonal, and they map bf16 values to
    bf16 values exactly, so the interpreter's float->bf16 truncation cannot blur the check."""
    out = torch.zeros(*lead, D, D)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in lead]).reshape(-1, len(lead)):
        m = torch.zeros(D, D)
        m[torch.arange(D), torch.randperm(D)] = torch.where(torch.rand(D) < 0.5, -1.0, 1.0)
        out[tuple(idx.tolist())] = m
    return out


def _make(backend_cls, rows=4, slots=64, exact=False, new_tokens="triton"):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from oscar_sglang.runtime.new_tokens import TritonNewTokens

    from oscar_sglang.runtime.pool import OscarInt2KVPool, take_pending_rows

    take_pending_rows()
    rk, rv = (_signed_perm(1, H), _signed_perm(1, 1)) if exact else (_orth(1, H, D, D), _orth(1, 1, D, D))
    from oscar_sglang.runtime.kv_format import resolve

    fmt = resolve("token", head_dim=D, v_head_dim=D, num_layers=1, group_size=128, sink=S, recent=W)
    pool = OscarInt2KVPool(slots, 1, H, D, D, 1, "cpu", req_rows=rows, kv_format=fmt,
                           k_clip=[K_CLIP], v_clip=[V_CLIP], k_rotation=rk, v_rotation=rv)
    b = backend_cls.__new__(backend_cls)  # the metadata half (ModelRunner) is SGLang's, tested on GPU
    b.pool, b.v_head_dim, b.max_kv_splits = pool, D, 4
    b._prepare_rotations(torch.bfloat16)
    b._new_tokens = (TritonNewTokens(extend_attention_fwd, torch.zeros(rows + 1, dtype=torch.int32))
                     if new_tokens == "triton" else fake_flashinfer_new_tokens(Hq, H, D, D))
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=Hq, tp_k_head_num=H, qk_head_dim=D, v_head_dim=D,
                            scaling=1 / math.sqrt(D), logit_cap=0.0, logit_capping_method="tanh",
                            k_scale=None, v_scale=None, sliding_window_size=-1)
    return b, pool, layer, rk[0], rv[0, 0]


def _heavy(n, d):
    """Realistic K/V: heavy-tailed outlier channels, a low-norm sink token at position 0."""
    x = torch.randn(n, H, d) * (1 + 4 * (torch.rand(d) > 0.9))
    x[0] *= 0.05
    return x.bfloat16().float()


def _ref_mixed(x_rot_bf16, kv_len, own, clip, sink_start=None):
    fmt = Int2Format(D, 64)
    return ref.mixed_kv(x_rot_bf16.float(), fmt, kv_len=kv_len, sink=S, window=W, own_start=own, clip_ratio=clip,
                        sink_start=sink_start).double()


def prompt(first=1000, n=64):
    """A stand-in for SGLang's Req as the alloc hook sees it: prompt token ids (their first S name
    the sink the store keeps; requests sharing a prefix share them)."""
    return SimpleNamespace(origin_input_ids=list(range(first, first + n)))


def _reference(q, keys, vals):
    """q [Hq, D] float64; keys/vals list of [n, H, D] float64 in one space (already matched)."""
    k = torch.cat(keys)
    v = torch.cat(vals)
    g = Hq // H
    s = torch.einsum("hd,nhd->hn", q, k.repeat_interleave(g, 1)) / math.sqrt(D)
    p = torch.softmax(s, -1)
    return torch.einsum("hn,nhd->hd", p, v.repeat_interleave(g, 1))


def _decode_batch(b, req_to_token, rows, lens, splits=(4, 3)):
    """One decode step's ForwardBatch stand-in and metadata (the last position of each row's
    lens), prepared on backend b as SGLang would; -> the batch."""
    pos = lens - 1
    fb = SimpleNamespace(batch_size=len(rows), req_pool_indices=rows, seq_lens=lens, positions=pos,
                         out_cache_loc=torch.stack([req_to_token[r, p] for r, p in zip(rows.tolist(), pos.tolist())]),
                         forward_mode=SimpleNamespace(is_extend=lambda: False))
    b.forward_metadata = SimpleNamespace(
        kv_indptr=torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()]),
        kv_indices=torch.cat([req_to_token[r, :n] for r, n in zip(rows.tolist(), lens.tolist())]),
        num_kv_splits=torch.tensor(splits, dtype=torch.int32),
        attn_logits=torch.empty(len(rows), Hq, max(splits), D), attn_lse=torch.empty(len(rows), Hq, max(splits)),
    )
    b._prepare_forward(fb)
    return fb


def _rot(x, R):  # x [n, H, D] -> rotated like the backend (fp32 GEMM, result in x's dtype)
    return torch.einsum("thd,hde->the", x.float(), R.expand(H, D, D) if R.dim() == 2 else R).to(x.dtype)


# the new tokens' attention: SGLang's Triton kernel, and FlashInfer's ragged prefill (a CPU
# stand-in with base-2 LSEs; the real one in tests/gpu)
@pytest.mark.parametrize("new_tokens", ["triton", "flashinfer"])
def test_extend_chunks_radix_share_and_decode(backend_cls, seed, new_tokens):
    b, pool, layer, Rk, Rv = _make(backend_cls, exact=True, new_tokens=new_tokens)
    req_to_token = torch.zeros(4, 64, dtype=torch.int64)
    rowA, rowB = 1, 2
    LA, LB_new, share = 20, 7, 8
    kA, vA, qA = _heavy(LA + 4, D), _heavy(LA + 4, D), torch.randn(LA + 4, Hq, D).bfloat16().float()
    kB = torch.cat([kA[:share], _heavy(LB_new + 4, D)])
    vB = torch.cat([vA[:share], _heavy(LB_new + 4, D)])
    qB = torch.randn(share + LB_new + 4, Hq, D).bfloat16().float()
    slotsA = torch.arange(1, 1 + LA + 4)
    slotsB = torch.cat([slotsA[:share], torch.arange(40, 40 + LB_new + 4)])
    req_to_token[rowA, : LA + 4] = slotsA
    req_to_token[rowB, : share + LB_new + 4] = slotsB
    # rotated K/V as stored (bf16) and the un-rotation of V outputs
    kAr, vAr, kBr, vBr = _rot(kA, Rk), _rot(vA, Rv), _rot(kB, Rk), _rot(vB, Rv)
    RvT = Rv.double().T
    b.req_to_token = req_to_token
    sink0 = {rowA: 0, rowB: 0}  # B's sink comes from the sink store (A's first tokens)

    def extend(reqs):
        """reqs: list of (row, k, v, q, start, end, own) -> outputs per request (float32)."""
        from oscar_sglang.runtime.pool import note_new_rows

        ext = torch.tensor([e - s for _, _, _, _, s, e, _ in reqs])
        pre = torch.tensor([s for _, _, _, _, s, _, _ in reqs])
        rows = torch.tensor([r for r, *_ in reqs])
        fb = SimpleNamespace(
            batch_size=len(reqs), req_pool_indices=rows, seq_lens=pre + ext, extend_seq_lens=ext,
            extend_prefix_lens=pre, extend_prefix_lens_cpu=pre.tolist(), extend_seq_lens_cpu=ext.tolist(),
            positions=torch.cat([torch.arange(s, e) for *_, s, e, _ in reqs]),
            out_cache_loc=torch.cat([req_to_token[r, s:e] for r, _, _, _, s, e, _ in reqs]),
        )
        fb.forward_mode = SimpleNamespace(is_extend=lambda: True)
        for r, *_, s, e, own in reqs:
            if s == own:  # a new request: the alloc hook queued its row and radix-hit length
                note_new_rows([r], [s], [prompt()])
        b.forward_metadata = SimpleNamespace(
            qo_indptr=torch.cat([torch.zeros(1, dtype=torch.int64), ext.cumsum(0)]),
            kv_indptr=torch.cat([torch.zeros(1, dtype=torch.int32), pre.cumsum(0).int()]),
            kv_indices=torch.cat([req_to_token[r, :s] for r, _, _, _, s, _, _ in reqs] + [torch.zeros(0, dtype=torch.int64)]),
            max_extend_len=int(ext.max()),
        )
        b._prepare_forward(fb)
        q = torch.cat([qq[s:e] for _, _, _, qq, s, e, _ in reqs])
        k = torch.cat([kk[s:e] for _, kk, _, _, s, e, _ in reqs])
        v = torch.cat([vv[s:e] for _, _, vv, _, s, e, _ in reqs])
        o = b.forward_extend(q.reshape(-1, Hq * D), k.reshape(-1, H * D), v.reshape(-1, H * D), layer, fb)
        return o.float().reshape(-1, Hq, D), ext.tolist()

    def check_extend(o, req, kr, vr, k, v, q):
        _, _, _, _, s, e, own = req
        qr = torch.einsum("thgd,hde->thge", q.float().reshape(-1, H, Hq // H, D), Rk).reshape(-1, Hq, D).to(q.dtype)
        if s:
            Kp = _ref_mixed(kr[:s], s, own, K_CLIP, sink0[req[0]])
            Vp = _ref_mixed(vr[:s], s, own, V_CLIP, sink0[req[0]]) @ RvT
        for i, t in enumerate(range(s, e)):
            keys, vals, qs = [], [], []
            # prefix in rotated space with rotated q, new tokens with plain q: same scores
            if s:
                g = Hq // H
                sp = torch.einsum("hd,nhd->hn", qr[t].double(), Kp.repeat_interleave(g, 1))
                sn = torch.einsum("hd,nhd->hn", q[t].double(), k[s : t + 1].double().repeat_interleave(g, 1))
                sc = torch.cat([sp, sn], 1) / math.sqrt(D)
                vv = torch.cat([Vp, v[s : t + 1].double()]).repeat_interleave(g, 1)
                want = torch.einsum("hn,nhd->hd", torch.softmax(sc, -1), vv)
            else:
                want = _reference(q[t].double(), [k[: t + 1].double()], [v[: t + 1].double()])
            _close(o[i], want)

    # 1. A chunk 1 (no prefix: stock path), then chunk 2 (INT2 prefix + BF16 new tokens)
    a1 = (rowA, kA, vA, qA, 0, 12, 0)
    o, _ = extend([a1])
    check_extend(o, a1, kAr, vAr, kA, vA, qA)
    a2 = (rowA, kA, vA, qA, 12, LA, 0)
    o, _ = extend([a2])
    check_extend(o, a2, kAr, vAr, kA, vA, qA)
    assert pool.own_start[rowA].item() == 0
    # stored INT2 codes are the reference quantiser's on the rotated bf16 keys
    fmt = Int2Format(D, 64)
    codes, params = ref.quantize(kAr[:LA].float(), fmt, K_CLIP)
    assert torch.equal(pool.k_codes[0][slotsA[:LA]], codes)
    assert torch.equal(pool.k_params[0][slotsA[:LA]], params)
    ulp = dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(pool.sink_k[0][rowA].float(), kAr[:S], **ulp)
    ring_pos = torch.arange(LA - W, LA)
    torch.testing.assert_close(pool.ring_k[0][rowA, ring_pos % W].float(), kAr[ring_pos], **ulp)

    # 2. B: radix hit on A's first 8 tokens (own_start = 8), prefill 7 more
    bx = (rowB, kB, vB, qB, share, share + LB_new, share)
    o, _ = extend([bx])
    assert pool.own_start[rowB].item() == share and pool.sink_start[rowB].item() == 0
    torch.testing.assert_close(pool.sink_k[0][rowB], pool.sink_k[0][rowA], rtol=0, atol=0)
    check_extend(o, bx, kBr, vBr, kB, vB, qB)

    # 3. decode 3 steps, batch [A, B]
    lens = torch.tensor([LA, share + LB_new])
    seqs = [(rowA, kAr, vAr, qA, 0), (rowB, kBr, vBr, qB, share)]
    src = [(kA, vA), (kB, vB)]
    for step in range(3):
        lens = lens + 1
        pos = lens - 1
        rows = torch.tensor([rowA, rowB])
        fb = _decode_batch(b, req_to_token, rows, lens)
        q = torch.stack([qA[pos[0]], qB[pos[1]]])
        k = torch.stack([src[0][0][pos[0]], src[1][0][pos[1]]])
        v = torch.stack([src[0][1][pos[0]], src[1][1][pos[1]]])
        o = b.forward_decode(q.reshape(2, Hq * D), k.reshape(2, H * D), v.reshape(2, H * D), layer, fb)
        o = o.float().reshape(2, Hq, D)
        for i, (row, kr, vr, qq, own) in enumerate(seqs):
            n = int(lens[i])
            qr = torch.einsum("hgd,hde->hge", qq[n - 1].float().reshape(H, Hq // H, D), Rk).reshape(Hq, D).to(qq.dtype)
            want = _reference(qr.double(), [_ref_mixed(kr[:n], n, own, K_CLIP, sink0[row])],
                              [_ref_mixed(vr[:n], n, own, V_CLIP, sink0[row])])
            _close(o[i], want @ RvT)


    # 4. one more token each as a batched extend (mixed-chunk style): prefix = the whole cache
    nA, nB = LA + 3, share + LB_new + 3
    ma = (rowA, kA, vA, qA, nA, nA + 1, 0)
    mb = (rowB, kB, vB, qB, nB, nB + 1, share)
    o, ext = extend([ma, mb])
    assert pool.own_start[rowA].item() == 0 and pool.own_start[rowB].item() == share
    check_extend(o[:1], ma, kAr, vAr, kA, vA, qA)
    check_extend(o[1:], mb, kBr, vBr, kB, vB, qB)

def test_fused_decode_store_is_refused_for_the_per_token_recipe(backend_cls, monkeypatch):
    b, pool, *_ = _make(backend_cls)
    monkeypatch.setenv("OSCAR_DECODE_STORE", "fused")
    with pytest.raises(ValueError, match="OSCAR_DECODE_STORE=fused needs a per-channel key format"):
        b._decode_store()
    monkeypatch.setenv("OSCAR_DECODE_STORE", "split")
    assert b._decode_store() is False
    # page-canonical prefill reads a request's pages back: the per-token recipe cannot
    monkeypatch.setenv("OSCAR_PREFILL_READS", "cache")
    with pytest.raises(ValueError, match="OSCAR_PREFILL_READS=cache needs a per-channel key format"):
        b._prefill_reads()
    monkeypatch.setenv("OSCAR_PREFILL_READS", "exact")
    assert b._prefill_reads() is False
    with pytest.raises(ValueError, match="per-channel format store options"):
        z = torch.zeros(1, H, D)
        pool.store(0, torch.zeros(1, dtype=torch.int64), z, z, torch.zeros(1, dtype=torch.int64),
                   torch.ones(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), rot_k=torch.eye(D))


def test_rotations_preserve_attention_scores(backend_cls, seed):
    """q rotated per KV head and k rotated by the same matrix give the same q.k; o un-rotates."""
    b, pool, layer, Rk, Rv = _make(backend_cls)
    q = torch.randn(5, Hq, D).bfloat16()
    k = torch.randn(5, H, D).bfloat16()
    qr = b._rot_q(q, 0).double()
    kr, vr = b._rot_kv(k, k, 0)
    g = Hq // H
    s0 = torch.einsum("thd,thd->th", q.double(), k.double().repeat_interleave(g, 1))
    s1 = torch.einsum("thd,thd->th", qr, kr.double().repeat_interleave(g, 1))
    torch.testing.assert_close(s1, s0, atol=0.15, rtol=2e-2)  # bf16 rounding of rotated q/k
    o = torch.randn(5, Hq, D)
    back = b._unrot_o(torch.einsum("thd,de->the", o, Rv), 0)
    torch.testing.assert_close(back, o, atol=1e-4, rtol=1e-4)


def test_rotations_run_in_the_model_dtype(backend_cls, seed):
    """The hot path rotates q / k / v with one GEMM in the model's dtype (fp32 accumulation): the
    per-head path (K here) and the shared-matrix path (V, one [D, D] for both heads) agree with a
    float64 rotation within bf16 rounding, and return the model's dtype."""
    b, pool, layer, Rk, Rv = _make(backend_cls)
    assert b._v_rot[0].dim() == 2 and b._k_rot[0].dim() == 3  # V shared by both heads, K per head
    assert b._k_rot[0].dtype == torch.bfloat16 and b._v_unrot[0].dtype == torch.float32
    x = (torch.randn(6, Hq, D) * (1 + 9 * (torch.rand(D) > 0.9))).bfloat16()
    qr = b._rot_q(x, 0)
    kr, vr = b._rot_kv(x[:, :H], x[:, :H], 0)
    assert qr.dtype == kr.dtype == vr.dtype == torch.bfloat16
    g = Hq // H
    want_q = torch.einsum("thgd,hde->thge", x.double().view(6, H, g, D), Rk.double()).reshape(6, Hq, D)
    want_v = torch.einsum("thd,de->the", x[:, :H].double(), Rv.double())
    for got, want in ((qr, want_q), (vr, want_v)):
        assert ((got.double() - want).norm() / want.norm()) < 1e-2


def test_no_v_rotation_when_the_weights_hold_it(backend_cls, seed):
    """Absorbed R_v (pool without V rotation): V is stored as the projection made it and the
    output is not un-rotated; K and q are still rotated."""
    b, pool, layer, Rk, Rv = _make(backend_cls)
    pool.v_rot = [None]
    b._prepare_rotations(torch.bfloat16)
    k = torch.randn(3, H, D).bfloat16()
    kr, vr = b._rot_kv(k, k, 0)
    assert vr is k and not torch.equal(kr, k)
    o = torch.randn(3, Hq, D)
    assert torch.equal(b._unrot_o(o, 0), o)


def warm_up_model(layer):
    """A one-layer model whose attention module looks like `layer` (what warm_up looks for)."""
    from tests.runtime.test_absorb import Attn

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Attn(0, hidden=32, Hq=Hq, Hkv=H, D=D, bias=False, dtype=torch.float32)])
    for name in ("scaling", "logit_cap", "logit_capping_method", "k_scale", "v_scale", "sliding_window_size"):
        setattr(model.layers[0].attn, name, getattr(layer, name))
    return model


def test_warm_up_runs_the_cached_prefix_path_and_stores_nothing(backend_cls, monkeypatch, seed):
    """warm_up compiles what the first long prompt used to compile (the INT2 prefix kernel and
    the new tokens' kernel with LSE) and the path without a prefix, by running forward_extend
    twice on padding slot 0 / row 0, with no store and the backend's per-forward state restored."""
    from oscar_kernels import ops

    b, pool, layer, Rk, Rv = _make(backend_cls)
    model = warm_up_model(layer)
    calls = []
    real_prefix, real_ext = ops.extend_prefix_attention, b._new_tokens._fwd
    monkeypatch.setattr(ops, "extend_prefix_attention", lambda *a, **k: calls.append("prefix") or real_prefix(*a, **k))
    b._new_tokens._fwd = lambda *a, **k: calls.append(("extend", k.get("skip_prefix"))) or real_ext(*a, **k)
    # the kv_indices fill, for both length dtypes (decode's int64 seq_lens, a prefill's int32
    # prefix lengths), into a scratch table read from row 0
    real_fill = ops.fill_kv_indices
    fills = []

    def fill(r2t, rows, lens, indptr, out):
        got = real_fill(r2t, rows, lens, indptr, out)
        fills.append((lens.dtype, out.dtype, torch.equal(got, r2t[0, :int(lens[0])].long())))
        return got

    monkeypatch.setattr(ops, "fill_kv_indices", fill)
    b.req_to_token = torch.randperm(4 * 64).to(torch.int32).view(4, 64)
    table = b.req_to_token.clone()
    before = [t.clone() for t in (*pool.k_codes, *pool.v_codes, *pool.ring_k, *pool.sink_k)]
    from oscar_sglang.runtime.backend import Int2ForwardMetadata

    imd = Int2ForwardMetadata(has_prefix=False)
    b.forward_metadata, b.int2_md = "sentinel", imd
    b.warm_up(model, torch.bfloat16)
    assert calls == [("extend", True), "prefix", ("extend", None)]
    assert fills == [(torch.int64, torch.int64, True), (torch.int32, torch.int64, True)]
    assert b.forward_metadata == "sentinel" and b.int2_md is imd and imd.has_prefix is False
    after = (*pool.k_codes, *pool.v_codes, *pool.ring_k, *pool.sink_k)
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert torch.equal(b.req_to_token, table)


def test_pool_codes_are_head_major(backend_cls):
    """Codes and params live head-major ([H, N, ...] memory behind the [N, H, ...] view), so a
    decode program's keys of one KV head are contiguous (the tests above write and read it)."""
    _, pool, *_ = _make(backend_cls)
    for t in (pool.k_codes[0], pool.v_codes[0], pool.k_params[0], pool.v_params[0]):
        assert t.shape[1] == H and t.stride(0) * t.shape[0] == t.stride(1)
        assert t.transpose(0, 1).is_contiguous()


def test_flashinfer_new_tokens_refuse_what_they_cannot_do(monkeypatch):
    """Without FlashInfer the default says what to set instead; a layer whose logit cap is not
    tanh is refused by name (FlashInfer's prefill caps with tanh only)."""
    import sys

    from oscar_sglang.runtime.new_tokens import FlashInferNewTokens, NewTokenAttentionError

    from .fake_flashinfer import fake_flashinfer_new_tokens

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(NewTokenAttentionError, match="OSCAR_NEW_TOKEN_ATTENTION=triton"):
        FlashInferNewTokens(device="cpu", num_qo_heads=Hq, num_kv_heads=H, head_dim=D, v_head_dim=D,
                            dtype=torch.float32, workspace_bytes=64)
    nt = fake_flashinfer_new_tokens(Hq, H, D, D)
    nt.plan(torch.tensor([0, 3]), [3], 3)
    x = torch.randn(3, Hq, D)
    layer = SimpleNamespace(scaling=0.1, logit_capping_method="gelu")
    with pytest.raises(NotImplementedError, match="OSCAR_NEW_TOKEN_ATTENTION=triton"):
        nt.run(x, x[:, :H], x[:, :H], layer, 30.0, want_lse=True)


def test_the_per_token_recipe_takes_the_joint_rotation_too(backend_cls, seed):
    """A one-request decode step of the per-token recipe with one R_k for both KV heads, q and k
    adjacent in a qkv buffer: stores and attends bit for bit as with q and k in separate tensors
    (two GEMMs; signed permutations keep both exact), and near float64 attention over the first
    S + 2 tokens (all BF16 copies: the sink's S, then two ring slots; more ring slots take the same
    path, at about a second per decode step here)."""
    gen = torch.Generator().manual_seed(seed)
    shared = _signed_perm(1)[0]
    row, n = 1, S + 2
    qkvs = [(torch.randn(1, (Hq + 2 * H) * D, generator=gen)
             * (1 + 4 * (torch.rand(Hq + 2 * H, D, generator=gen) > 0.9)).reshape(1, -1)).bfloat16() for _ in range(n)]
    runs = {}
    for joint in (True, False):
        b, pool, layer, _, Rv = _make(backend_cls, exact=True)
        pool.k_rot = [shared.expand(H, D, D)]
        b._prepare_rotations(torch.bfloat16)
        req_to_token = torch.zeros(4, 64, dtype=torch.int64)
        req_to_token[row, :n] = torch.arange(1, n + 1)
        pool.own_start[row], pool.sink_start[row] = 0, 0  # the row's own prefill left it so
        outs = []
        for t, qkv in enumerate(qkvs):
            q, k, v = qkv[:, :Hq * D], qkv[:, Hq * D:(Hq + H) * D], qkv[:, (Hq + H) * D:]
            if not joint:
                q, k, v = q.clone(), k.clone(), v.clone()
            fb = _decode_batch(b, req_to_token, torch.tensor([row]), torch.tensor([t + 1]), splits=(4,))
            outs.append(b.forward_decode(q, k, v, layer, fb).float().reshape(Hq, D))
        runs[joint] = outs
    for t, (a, c) in enumerate(zip(runs[True], runs[False])):
        assert torch.equal(a, c)
        ks = torch.stack([x[0, Hq * D:(Hq + H) * D].reshape(H, D) for x in qkvs[: t + 1]]).double() @ shared.double()
        vs = torch.stack([x[0, (Hq + H) * D:].reshape(H, D) for x in qkvs[: t + 1]]).double()
        qr = qkvs[t][0, :Hq * D].reshape(Hq, D).double() @ shared.double()
        _close(a, _reference(qr, [ks], [vs]), tol=1e-2)  # bf16 q / k / v copies, fp32 attention


@pytest.mark.parametrize("graph_buffer", [False, True])
def test_kv_indices_fill_is_sglangs_table(backend_cls, seed, graph_buffer):
    """The backend's kv_indptr / kv_indices fill (many programs a request) gives exactly the
    table TritonAttnBackend's own fill gives (SGLang's kernel, run here on the same object):
    requests of 0 to 3,000 positions in shuffled rows, into an int64 table; with graph_buffer
    also an int32 one, and ours given the whole longer seq_lens / req_pool_indices buffers of a
    padded CUDA-graph batch (it reads the first bs; SGLang's callers slice them for its fill)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from oscar_sglang.runtime.backend import parent_fill_problem

    assert parent_fill_problem() is None
    rows, max_len = 12, 3100
    lens = [0, 1, 3000, 517, 64]
    b = backend_cls.__new__(backend_cls)
    b.req_to_token = torch.randperm(rows * max_len).to(torch.int32).view(rows, max_len)
    pad = 3 if graph_buffer else 0  # graph buffers: rows past the batch are padding
    seq_lens = torch.tensor(lens + [7] * pad, dtype=torch.int64)
    rpi = torch.cat([torch.randperm(rows)[: len(lens)], torch.zeros(pad, dtype=torch.int64)])
    dtype = torch.int32 if graph_buffer else torch.int64
    tables = []
    n = len(lens)
    for fill, whole in ((backend_cls._fill_kv_indptr_and_indices, True),
                        (TritonAttnBackend._fill_kv_indptr_and_indices, False)):
        b.kv_indptr = torch.zeros(rows + 1, dtype=torch.int32)
        kv_indices = torch.full((sum(lens) + 40,), -5, dtype=dtype)
        sl, rp = (seq_lens, rpi) if whole else (seq_lens[:n], rpi[:n])
        indptr = fill(b, n, sl, rp, kv_indices)
        tables.append((indptr.clone(), kv_indices))
    (ours_ptr, ours), (theirs_ptr, theirs) = tables
    assert torch.equal(ours_ptr, theirs_ptr) and ours_ptr[-1] == sum(lens)
    assert torch.equal(ours, theirs)
    assert (ours[sum(lens):] == -5).all()


def test_a_changed_parent_fill_is_refused(monkeypatch):
    """Were SGLang's fill renamed, ours would silently never run: the backend refuses to start."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from oscar_sglang.runtime import backend as be

    monkeypatch.delattr(TritonAttnBackend, "_fill_kv_indptr_and_indices")
    assert "sglang==0.5.17" in be.parent_fill_problem()
    monkeypatch.undo()
    monkeypatch.setattr(TritonAttnBackend, "_fill_kv_indptr_and_indices", lambda self, bs, seq_lens, rows: None)
    assert "gone or changed" in be.parent_fill_problem()
