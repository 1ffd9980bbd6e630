"""What a request with a cached prefix gets in its row (pool.apply_pending_resets and the sink
store, runtime/sink_store.py), on a tiny CPU pool: the BF16 sink kept by the prompt's first S token
ids, the same however many requests came in between; never another row's ring copies. The stores
go through the real store kernel (TRITON_INTERPRET on CPU).
"""
from types import SimpleNamespace

import pytest
import torch

from oscar_sglang.runtime.pool import OscarInt2KVPool, note_new_rows, take_pending_rows
from oscar_sglang.runtime.sink_store import sink_key

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

H, D, S, W, ROWS, SLOTS = 1, 64, 4, 8, 6, 80


def _pool():
    take_pending_rows()
    from oscar_sglang.runtime.kv_format import resolve

    fmt = resolve("token", head_dim=D, v_head_dim=D, num_layers=1, group_size=64, sink=S, recent=W)
    return OscarInt2KVPool(SLOTS, 1, H, D, D, 1, "cpu", req_rows=ROWS, kv_format=fmt,
                           k_clip=[1.0], v_clip=[1.0])


def _store(pool, row, slots, start, total):
    """Store positions start..start+len(slots)-1 of a request of `total` tokens in `row`."""
    n = len(slots)
    k = torch.randn(n, H, D).bfloat16()
    v = torch.randn(n, H, D).bfloat16()
    pool.store(0, torch.tensor(slots), k, v, torch.arange(start, start + n), torch.full((n,), row),
               torch.full((n,), total))
    return k, v


def _req(ids, **kw):
    return SimpleNamespace(origin_input_ids=list(ids), **kw)


def _claim(pool, req_to_token, row, slots, prefix, ids):
    """A new request on `row` (prompt ids) whose first `prefix` positions are the cached `slots`:
    the alloc hook's claim, applied at the next forward, then the extend's note."""
    req_to_token[row, :prefix] = torch.tensor(slots[:prefix])
    note_new_rows([row], [prefix], [_req(ids)])
    pool.apply_pending_resets(req_to_token)
    pool.note_extend(torch.tensor([row]), torch.tensor([prefix], dtype=torch.int32))


def _fresh(pool, req_to_token, row, slots, ids):
    """A request with no cached prefix on `row`, prefilled as the backend does (its sink its own)."""
    _claim(pool, req_to_token, row, slots, 0, ids)
    req_to_token[row, :len(slots)] = torch.tensor(slots)
    return _store(pool, row, slots, 0, len(slots))


def _next_forward(pool):
    pool.apply_pending_resets(None)


def test_a_hit_gets_the_sink_kept_by_its_first_tokens_whatever_came_in_between(seed):
    pool = _pool()
    r2t = torch.zeros(ROWS, 64, dtype=torch.int64)
    ids_a = [7, 8, 9, 10] + list(range(100, 116))
    slots_a = list(range(1, 21))
    kA, vA = _fresh(pool, r2t, 1, slots_a, ids_a)
    assert len(pool.sinks) == 0  # kept at the start of the next forward, after the store ran
    _next_forward(pool)
    assert len(pool.sinks) == 1

    # a hit while A's row still holds everything: the kept sink, and no ring copy (own_start = P)
    _claim(pool, r2t, 2, slots_a, 16, ids_a[:16] + [1, 2])
    assert pool.sink_start[2].item() == 0 and pool.own_start[2].item() == 16
    torch.testing.assert_close(pool.sink_k[0][2], kA[:S].view(S, H, D), rtol=0, atol=0)
    torch.testing.assert_close(pool.sink_v[0][2], vA[:S].view(S, H, D), rtol=0, atol=0)
    first = pool.sink_k[0][2].clone(), pool.sink_v[0][2].clone()

    # every row handed to other requests, whose sinks are their own (other first tokens): the
    # same hit gets the same sink
    for row, base in ((1, 30), (2, 35), (3, 40), (4, 45)):
        _fresh(pool, r2t, row, list(range(base, base + 4)), [1, 2, 3, row])
        _next_forward(pool)
    _claim(pool, r2t, 3, slots_a, 16, ids_a[:16])
    assert pool.sink_start[3].item() == 0 and pool.own_start[3].item() == 16
    torch.testing.assert_close(pool.sink_k[0][3], first[0], rtol=0, atol=0)
    torch.testing.assert_close(pool.sink_v[0][3], first[1], rtol=0, atol=0)

    # a prefix that starts with other tokens finds nothing: its sink is read as INT2, every time
    before = pool.sink_k[0][4].clone()
    _claim(pool, r2t, 4, slots_a, 16, [99] + ids_a[1:16])
    assert pool.sink_start[4].item() == 16 and torch.equal(pool.sink_k[0][4], before)


def test_a_fresh_prompt_reads_the_kept_sink_from_its_next_forward_on(seed):
    """Its own sink is read in its first forward; from its next one (its tail, its decode steps)
    it reads the copy a hit of it would get, not the bits its own forward rounded."""
    pool = _pool()
    r2t = torch.zeros(ROWS, 64, dtype=torch.int64)
    ids = [7, 8, 9, 10, 11, 12]
    kA, vA = _fresh(pool, r2t, 1, [1, 2, 3, 4, 5, 6], ids)
    _next_forward(pool)
    kB, vB = _fresh(pool, r2t, 2, [11, 12, 13, 14, 15, 16], ids[:4] + [3, 3])  # same first tokens
    torch.testing.assert_close(pool.sink_k[0][2], kB[:S].view(S, H, D), rtol=0, atol=0)
    assert not torch.equal(kA[:S], kB[:S])
    _next_forward(pool)
    assert len(pool.sinks) == 1 and pool.sink_start[2].item() == 0
    torch.testing.assert_close(pool.sink_k[0][2], kA[:S].view(S, H, D), rtol=0, atol=0)
    torch.testing.assert_close(pool.sink_v[0][2], vA[:S].view(S, H, D), rtol=0, atol=0)
    # row 1 still holds its own (it computed the kept one)
    torch.testing.assert_close(pool.sink_k[0][1], kA[:S].view(S, H, D), rtol=0, atol=0)


def test_kept_sinks_are_least_recently_used_within_their_entries(seed):
    pool = _pool()
    n = pool.sinks.n
    assert n == ROWS
    r2t = torch.zeros(ROWS, 64, dtype=torch.int64)
    for i in range(n):  # n different first tokens, kept one each
        _fresh(pool, r2t, 1 + i % (ROWS - 1), [1 + 4 * i + j for j in range(4)], [i, 0, 0, 0])
        _next_forward(pool)
    assert len(pool.sinks) == n
    _claim(pool, r2t, 2, list(range(1, 5)), 4, [0, 0, 0, 0])  # a hit uses key 0: most recent now
    _fresh(pool, r2t, 1, [60, 61, 62, 63], [n, 0, 0, 0])  # one more: key 1 (least recent) goes
    _next_forward(pool)
    _claim(pool, r2t, 3, list(range(1, 5)), 4, [0, 0, 0, 0])
    _claim(pool, r2t, 4, list(range(5, 9)), 4, [1, 0, 0, 0])
    assert pool.sink_start[3].item() == 0 and pool.sink_start[4].item() == 4


def test_a_row_claimed_again_before_its_forward_keeps_nothing_of_the_first_claim(seed):
    """The sink is kept for the row's latest claim only: a claim whose forward never ran (the row
    freed and handed on before it) computed nothing."""
    pool = _pool()
    r2t = torch.zeros(ROWS, 64, dtype=torch.int64)
    note_new_rows([1], [0], [_req([5, 5, 5, 5, 5])])
    note_new_rows([1], [0], [_req([6, 6, 6, 6, 6])])
    pool.apply_pending_resets(r2t)
    _store(pool, 1, [1, 2, 3, 4, 5], 0, 5)
    _next_forward(pool)
    assert list(pool.sinks._index) == [(None, 6, 6, 6, 6)]


def test_sink_keys():
    assert sink_key(_req([1, 2, 3, 4, 5]), 4) == (None, 1, 2, 3, 4)
    assert sink_key(_req([1, 2, 3, 4], lora_id="a"), 4) == ("a", 1, 2, 3, 4)
    assert sink_key(_req([1, 2, 3]), 4) is None  # shorter than the sink
    assert sink_key(_req([1, 2, 3, 4], input_embeds=[[0.0]]), 4) is None
    assert sink_key(_req([1, 2, 3, 4], multimodal_inputs=object()), 4) is None
    assert sink_key(_req([1, 2, 3, 4]), 0) is None


def test_pending_rows_carry_prefix_lengths_and_keys():
    take_pending_rows()
    note_new_rows([3, 5], [0, 17])
    note_new_rows([3], [9], [_req([1, 2, 3, 4])])  # row 3 freed and claimed again: latest wins
    assert take_pending_rows() == [(3, 0, None), (5, 17, None), (3, 9, (None, 1, 2, 3, 4))]
    assert take_pending_rows() == []
