"""Speculative verify on the INT2 cache (TRITON_INTERPRET on CPU, tiny shapes).

* The verify's attention against float64: a chain of N drafts over a cached prefix (sink, INT2
  body, ring as a reader of the prefix length sees them) and causal among themselves, with the
  verify stored after attention; then, after rejected drafts are rolled back, the next verify
  sees exactly the accepted sequence.
* Rejected drafts leave the pool as if never written: after rounds of verify + accept/reject
  (a draft rejected at a key block's last position, rejections whose ring entries sat at the
  window's old edge, rounds right after a radix hit), the pool equals one that stored only the
  accepted tokens, one decode step at a time: key codes and parameters of every complete block,
  value codes, the whole ring and sink of the request, their owners and the slots' pointers.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from oscar_kernels import reference as ref

from .test_backend import Hq, H, D, _close, _heavy, _rot, backend_cls  # noqa: F401
from .test_backend_channel import B, FMT, S, W, _make, _seen

N = 4  # drafts a verify (three drafted tokens and the bonus one)


def _verify_mode():
    return SimpleNamespace(is_extend=lambda: True, is_target_verify=lambda: True)


def _forward(b, layer, req_to_token, rows, starts, n, q, k, v, mode=None):
    """One extend (mode None: a prefill chunk of n tokens a request) or verify of n tokens per
    request at positions starts[i] .. starts[i] + n - 1, through the backend as SGLang calls it."""
    rows_t, pre = torch.tensor(rows), torch.tensor(starts)
    ext = torch.full((len(rows),), n)
    fb = SimpleNamespace(
        batch_size=len(rows), req_pool_indices=rows_t, seq_lens=pre + (0 if mode else ext),
        extend_seq_lens=None if mode else ext, extend_prefix_lens=None if mode else pre,
        extend_prefix_lens_cpu=None if mode else pre.tolist(), extend_seq_lens_cpu=None if mode else ext.tolist(),
        positions=torch.cat([torch.arange(s, s + n) for s in starts]),
        out_cache_loc=torch.cat([req_to_token[r, s:s + n] for r, s in zip(rows, starts)]),
        forward_mode=mode or SimpleNamespace(is_extend=lambda: True),
        spec_info=SimpleNamespace(draft_token_num=n) if mode else None,
    )
    b.forward_metadata = SimpleNamespace(
        qo_indptr=torch.arange(len(rows) + 1) * n,
        kv_indptr=torch.cat([torch.zeros(1, dtype=torch.int32), pre.cumsum(0).int()]),
        kv_indices=torch.cat([req_to_token[r, :s] for r, s in zip(rows, starts)] + [torch.zeros(0, dtype=torch.int64)]),
        max_extend_len=n,
    )
    b._prepare_forward(fb)
    return b.forward_extend(q.reshape(-1, Hq * D), k.reshape(-1, H * D), v.reshape(-1, H * D), layer, fb) \
        .float().reshape(-1, Hq, D), fb


def _backend(backend_cls, reads="exact"):
    b, pool, layer, Rk, Rv = _make(backend_cls, rows=4, pages=8, reads=reads)
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    from oscar_sglang.runtime.new_tokens import TritonNewTokens

    b._verify_new_tokens = TritonNewTokens(extend_attention_fwd, torch.zeros(5, dtype=torch.int32))
    b._verify_bufs, b.num_draft_tokens, b.max_context_len = None, N, 8 * B
    pool.enable_draft_rollback(N)
    return b, pool, layer, Rk, Rv


@pytest.mark.parametrize("reads", ["exact", "cache"])  # OSCAR_PREFILL_READS of the prefill before it
def test_verify_attends_to_the_int2_prefix_and_causally_to_its_drafts(backend_cls, seed, reads):
    from oscar_sglang.runtime.draft_rollback import DraftRollback

    b, pool, layer, Rk, Rv = _backend(backend_cls, reads)
    assert isinstance(pool.drafts, DraftRollback) and pool.drafts.n == N
    row, L0 = 1, 45  # block 0 complete, block 1 (32..63) in the ring
    n_all = L0 + 3 * N
    k, v = _heavy(n_all, D), _heavy(n_all, D)
    junk_k, junk_v = _heavy(N, D), _heavy(N, D)
    q = torch.randn(n_all, Hq, D).bfloat16().float()
    req_to_token = torch.zeros(4, 8 * B, dtype=torch.int64)
    req_to_token[row, :n_all] = torch.arange(B, B + n_all)  # page-aligned, pages 1..
    b.req_to_token = req_to_token
    from oscar_sglang.runtime.pool import note_new_rows

    note_new_rows([row], [0])
    _forward(b, layer, req_to_token, [row], [0], L0, q[:L0], k[:L0], v[:L0])
    kr, vr, g, RvT = _rot(k, Rk), _rot(v, Rv), Hq // H, Rv.double().T

    def check(o, L, dk, dv):
        """o: the verify's outputs at L; dk / dv: the drafts' K / V (un-rotated)."""
        # a page-canonical prefill's ring is read from its last page on, an exact one's from 0
        own = L0 // B * B if reads == "cache" else 0
        assert pool.own_start[row].item() == own
        Kp, Vp = _seen(kr[:L], "k", L, own, 0), _seen(vr[:L], "v", L, own, 0) @ RvT
        qr = torch.einsum("thgd,hde->thge", q[L:L + N].reshape(-1, H, g, D), Rk).reshape(-1, Hq, D)
        for j in range(N):
            sp = torch.einsum("hd,nhd->hn", qr[j].double(), Kp.repeat_interleave(g, 1))
            sn = torch.einsum("hd,nhd->hn", q[L + j].double(), dk[: j + 1].double().repeat_interleave(g, 1))
            vv = torch.cat([Vp, dv[: j + 1].double()]).repeat_interleave(g, 1)
            want = torch.einsum("hn,nhd->hd", torch.softmax(torch.cat([sp, sn], 1) / math.sqrt(D), -1), vv)
            _close(o[j], want)

    # verify 1 at L0: two drafts accepted, the last two (junk) rejected
    L = L0
    dk, dv = torch.cat([k[L:L + 2], junk_k[:2]]), torch.cat([v[L:L + 2], junk_v[:2]])
    o, fb = _forward(b, layer, req_to_token, [row], [L], N, q[L:L + N], dk, dv, _verify_mode())
    check(o, L, dk, dv)
    pool.drafts.restore(fb.req_pool_indices, fb.seq_lens, torch.tensor([2]), N)
    # verify 2 at L0 + 2 reads the accepted sequence only (its ring entries, its INT2 codes)
    L = L0 + 2
    dk, dv = torch.cat([k[L:L + 3], junk_k[:1]]), torch.cat([v[L:L + 3], junk_v[:1]])
    o, fb = _forward(b, layer, req_to_token, [row], [L], N, q[L:L + N], dk, dv, _verify_mode())
    check(o, L, dk, dv)
    pool.drafts.restore(fb.req_pool_indices, fb.seq_lens, torch.tensor([3]), N)
    # verify 3 at L0 + 5 = 50, all accepted
    L = L0 + 5
    o, fb = _forward(b, layer, req_to_token, [row], [L], N, q[L:L + N], k[L:L + N], v[L:L + N], _verify_mode())
    check(o, L, k[L:L + N], v[L:L + N])


def _pool_pair(backend_cls):
    """Two identical pools (one layer) and their request table: `spec` takes verify rounds,
    `plain` the accepted tokens one decode step at a time."""
    pools = []
    for _ in range(2):
        _, pool, _, _, _ = _make(backend_cls, rows=4, pages=8)
        pool.enable_draft_rollback(N)
        pools.append(pool)
    return pools


def _store(pool, req_to_token, row, start, k, v, seq_len):
    n = k.shape[0]
    pool.store(0, req_to_token[row, start:start + n], k, v, torch.arange(start, start + n),
               torch.full((n,), row), torch.full((n,), seq_len))


def _readable(pool, req_to_token, row, L):
    """What any reader of the request (length L) or a radix hit on it can read."""
    slots = req_to_token[row, :L]
    full = L // B * B
    pages = slots[:full:B] // B
    R = pool.req_rows
    ring_entries = R * S + row * W + torch.arange(W)
    return dict(
        k_codes=pool.k_codes[0][slots[:full]], k_params=pool.k_params[0][pages],
        v_codes=pool.v_codes[0][slots], v_params=pool.v_params[0][slots],
        ring_k=pool.ring_k_layers[:, row], ring_v=pool.ring_v_layers[:, row],
        sink_k=pool.sink_k[0][row], sink_v=pool.sink_v[0][row],
        owners=pool.entry_owner[torch.cat([row * S + torch.arange(S), ring_entries])],
        slot_entry=pool.slot_entry[slots],
    )


# accepted drafts a round (>= 1: SGLang always keeps the bonus token), starting at L0: round 2 of
# the first schedule starts at 60 and rejects the drafts at 62 and 63, a block's last position; the
# second rejects 61-63 at once, then drafts whose ring entries held the window's
# oldest positions; both run right after a radix hit of one page when `hit` is set.
@pytest.mark.parametrize("L0,accepts", [(53, [3, 4, 2, 4, 1, 3, 2]), (60, [1, 2, 4, 4, 1, 3, 2, 2])])
@pytest.mark.parametrize("hit", [False, True])
def test_rejected_drafts_leave_the_pool_as_if_never_written(backend_cls, seed, L0, accepts, hit):
    spec, plain = _pool_pair(backend_cls)
    total = L0 + sum(accepts) + N
    k, v = _heavy(total, D), _heavy(total, D)
    req_to_token = torch.zeros(4, 8 * B, dtype=torch.int64)
    owner, row = 3, 1
    req_to_token[owner, :B] = torch.arange(B, 2 * B)  # page 1: a finished request's first page
    req_to_token[row, :total] = torch.arange(2 * B, 2 * B + total)  # pages 2..
    from oscar_sglang.runtime.pool import note_new_rows

    for pool in (spec, plain):
        if hit:  # the owner wrote page 1 (+ side copies); the request inherits it as a radix hit
            _store(pool, req_to_token, owner, 0, k[:B], v[:B], B)
            req_to_token[row, :B] = req_to_token[owner, :B]
            note_new_rows([row], [B])
            pool.apply_pending_resets(req_to_token)
        first = B if hit else 0
        _store(pool, req_to_token, row, first, k[first:L0], v[first:L0], L0)
    assert torch.equal(spec.own_start, plain.own_start) and torch.equal(spec.sink_start, plain.sink_start)

    L, rejected_at = L0, []
    for acc in accepts:
        junk_k, junk_v = _heavy(N, D) * 3, _heavy(N, D) * 3  # wrong drafts, larger than the true keys
        dk = torch.cat([k[L:L + acc], junk_k[acc:]])
        dv = torch.cat([v[L:L + acc], junk_v[acc:]])
        spec.drafts.save(torch.tensor([row]), torch.tensor([L]), N)
        _store(spec, req_to_token, row, L, dk, dv, L + N)
        spec.drafts.restore(torch.tensor([row]), torch.tensor([L]), torch.tensor([acc]), N)
        rejected_at += list(range(L + acc, L + N))
        for p in range(L, L + acc):
            _store(plain, req_to_token, row, p, k[p:p + 1], v[p:p + 1], p + 1)
        L += acc
        a, b_ = _readable(spec, req_to_token, row, L), _readable(plain, req_to_token, row, L)
        for name in a:
            assert torch.equal(a[name], b_[name]), (name, L)
    # the schedules did reject a draft at a block's last position, and drafts that landed on the
    # ring entries of the window's oldest positions
    assert any(p % B == B - 1 for p in rejected_at)
    # the complete blocks are those of the accepted keys, bit for bit
    full = L // B * B
    first = B if hit else 0
    codes, params, _ = ref.quantize_key_blocks(k[first:full].float(), FMT.k_bits, B)
    assert torch.equal(spec.k_codes[0][req_to_token[row, first:full]], codes)
    assert torch.equal(spec.k_params[0][req_to_token[row, first:full:B] // B], params)


def test_pool_move_is_a_no_op_for_chains(backend_cls):
    spec, _ = _pool_pair(backend_cls)
    before = [t.clone() for t in (spec.k_codes[0], spec.v_codes[0], spec.ring_k_layers)]
    spec.move_kv_cache(torch.tensor([70, 71]), torch.tensor([70, 71]))
    assert all(torch.equal(a, b) for a, b in zip(before, (spec.k_codes[0], spec.v_codes[0], spec.ring_k_layers)))


def test_rollback_refuses_more_drafts_than_the_window(backend_cls):
    _, pool, _, _, _ = _make(backend_cls, rows=2, pages=4)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens"):
        pool.enable_draft_rollback(W + 1)
