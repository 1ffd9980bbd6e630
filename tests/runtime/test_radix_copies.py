"""Radix-hit carry-over of BF16 side copies (pool.carry_over_side_copies), on a tiny CPU pool.

A request that inherits slots from the radix cache gets the BF16 sink / ring copies of those
slots into its own row while they are intact (no newer token has overwritten the entry), all of
the sink or none of it, the ring from the newest position backwards; otherwise it reads them as
INT2 (sink_start / own_start = the radix-hit length). The stores go through the real store kernel
(TRITON_INTERPRET on CPU), which records where each slot's copy lives.
"""
import pytest
import torch

from oscar_sglang.runtime.pool import INT32_MAX, OscarInt2KVPool, note_new_rows, take_pending_rows

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


def _claim(pool, req_to_token, row, slots, prefix):
    """A new request on `row` whose first `prefix` positions are the radix-cached `slots`."""
    req_to_token[row, :prefix] = torch.tensor(slots[:prefix])
    note_new_rows([row], [prefix])
    pool.apply_pending_resets(req_to_token)


def test_carry_over_sink_and_ring_then_invalidation(seed):
    pool = _pool()
    req_to_token = torch.zeros(ROWS, 64, dtype=torch.int64)
    # A: 20 tokens on row 1 (sink copies of 0..3, ring copies of 12..19)
    slots_a = list(range(1, 21))
    note_new_rows([1], [0])
    pool.apply_pending_resets(req_to_token)
    kA, vA = _store(pool, 1, slots_a, 0, 20)
    assert pool.sink_start[1] == INT32_MAX  # note_extend (backend) sets it; untouched here

    # E inherits all of A: everything carries over -> sink from 0, ring from 12
    _claim(pool, req_to_token, 2, slots_a, 20)
    assert pool.sink_start[2].item() == 0 and pool.own_start[2].item() == 12
    torch.testing.assert_close(pool.sink_k[0][2], kA[:S].view(S, H, D), rtol=0, atol=0)
    torch.testing.assert_close(pool.sink_v[0][2], vA[:S].view(S, H, D), rtol=0, atol=0)
    ring_pos = torch.arange(12, 20)
    torch.testing.assert_close(pool.ring_k[0][2, ring_pos % W], kA[12:20], rtol=0, atol=0)
    torch.testing.assert_close(pool.ring_v[0][2, ring_pos % W], vA[12:20], rtol=0, atol=0)

    # B inherits A's first 16: ring copies of 8..11 are gone (overwritten by 16..19), 12..15 are
    # intact -> own_start 12; the sink carries over
    _claim(pool, req_to_token, 3, slots_a, 16)
    assert pool.sink_start[3].item() == 0 and pool.own_start[3].item() == 12
    torch.testing.assert_close(pool.ring_k[0][3, torch.arange(12, 16) % W], kA[12:16], rtol=0, atol=0)
    torch.testing.assert_close(pool.sink_k[0][3], kA[:S].view(S, H, D), rtol=0, atol=0)

    # rows 1, 2 and 3 are reused by new requests that overwrite their sink entries: nothing of
    # A's sink is left, so C (radix hit of 3 on A) reads it as INT2 and its row stays untouched
    for row, base in ((1, 40), (2, 50), (3, 60)):
        note_new_rows([row], [0])
        pool.apply_pending_resets(req_to_token)
        _store(pool, row, list(range(base, base + 4)), 0, 4)
    before = pool.sink_k[0][4].clone()
    _claim(pool, req_to_token, 4, slots_a, 3)
    assert pool.sink_start[4].item() == 3 and pool.own_start[4].item() == 3
    assert torch.equal(pool.sink_k[0][4], before)


def test_partial_sink_does_not_carry(seed):
    """The sink carries over all together or not at all (the kernels read one sink range)."""
    pool = _pool()
    req_to_token = torch.zeros(ROWS, 64, dtype=torch.int64)
    note_new_rows([1], [0])
    pool.apply_pending_resets(req_to_token)
    _store(pool, 1, list(range(1, 11)), 0, 10)
    # slot 3 (position 2) is freed and reused elsewhere at a non-side position: its pointer says -1
    _store(pool, 5, [3], 30, 100)
    _claim(pool, req_to_token, 2, list(range(1, 11)), 10)
    assert pool.sink_start[2].item() == 10
    # ring copies of positions 4..9 are intact and carry over independently
    assert pool.own_start[2].item() == 4


def test_pending_rows_carry_prefix_lengths():
    take_pending_rows()
    note_new_rows([3, 5], [0, 17])
    note_new_rows([3], [9])  # row 3 freed and claimed again before the forward: latest wins
    assert take_pending_rows() == [(3, 0), (5, 17), (3, 9)]
    assert take_pending_rows() == []


def _fresh(pool, req_to_token, row, slots, total):
    """A request with no radix hit on `row`, prefilled as the backend does (its sink is its own)."""
    req_to_token[row, :len(slots)] = torch.tensor(slots)
    note_new_rows([row], [0])
    pool.apply_pending_resets(req_to_token)
    rows, pre = torch.tensor([row]), torch.tensor([0], dtype=torch.int32)
    pool.note_extend(rows, pre)
    pool.note_first_positions(rows, pre, req_to_token)
    return _store(pool, row, slots, 0, total)


def test_a_hit_finds_the_sink_after_its_owners_row_was_reused(seed):
    """The same radix hit gets the same BF16 sink whether or not the owner's row has been handed
    to another request in between (the copy kept by the slot of position 0, sink_store.py); a
    slot written again, or a copy pushed out by later ones, gives INT2 as before."""
    pool = _pool()
    req_to_token = torch.zeros(ROWS, 64, dtype=torch.int64)
    slots_a = list(range(1, 21))
    kA, vA = _fresh(pool, req_to_token, 1, slots_a, 20)

    # a hit while A's row still holds the sink, then the same hit after that row was reused
    _claim(pool, req_to_token, 2, slots_a, 16)
    assert pool.sink_start[2].item() == 0
    first = pool.sink_k[0][2].clone()
    _fresh(pool, req_to_token, 1, list(range(40, 44)), 4)  # row 1 reused (row 2 holds A's sink now)
    assert 1 not in pool.sinks.owner.tolist()
    _fresh(pool, req_to_token, 2, list(range(44, 48)), 4)  # row 2 reused: A's sink kept
    assert pool.sinks.owner.tolist().count(1) == 1
    _claim(pool, req_to_token, 3, slots_a, 16)
    assert pool.sink_start[3].item() == 0  # the ring entries of 12..15 are intact: own_start 12
    torch.testing.assert_close(pool.sink_k[0][3], first, rtol=0, atol=0)
    torch.testing.assert_close(pool.sink_k[0][3], kA[:S].view(S, H, D), rtol=0, atol=0)
    torch.testing.assert_close(pool.sink_v[0][3], vA[:S].view(S, H, D), rtol=0, atol=0)
    # the row that took the kept copy points A's sink slots at itself (a later hit finds it there)
    assert pool.entry_owner[3 * S + torch.arange(S)].tolist() == slots_a[:S]

    # A's position-0 slot written again (its page reused): nobody finds the old copy, and the row
    # that held it does not keep it for the slot when it is reused
    _store(pool, 5, [slots_a[0]], 7, 8)
    _fresh(pool, req_to_token, 3, list(range(50, 54)), 4)  # row 3, which held A's sink, reused
    assert pool.sinks.owner.tolist().count(1) == 1  # only the copy kept before (the slot moved on)
    before = pool.sink_k[0][4].clone()
    _claim(pool, req_to_token, 4, slots_a, 16)
    assert pool.sink_start[4].item() == 16 and torch.equal(pool.sink_k[0][4], before)


def test_kept_sinks_are_reused_in_turn(seed):
    """A kept copy lasts until as many more sinks were kept as the store has entries (one a row
    but the one rows with nothing to keep write); those rows take no entry."""
    pool = _pool()
    n = pool.sinks.n
    assert n == ROWS - 1
    req_to_token = torch.zeros(ROWS, 64, dtype=torch.int64)
    slots_a = list(range(1, 9))
    _fresh(pool, req_to_token, 1, slots_a, 8)
    _fresh(pool, req_to_token, 1, [9, 10, 11, 12], 4)  # row 1 reused: A's sink kept
    assert pool.sinks.owner.tolist().count(1) == 1
    kept, i = 0, 0
    while kept < n:  # rows 2 and 3 in turn; each reuse after the first keeps one sink
        row = 2 + i % 2
        _fresh(pool, req_to_token, row, [13 + 4 * i + j for j in range(4)], 4)
        kept += i >= 2
        i += 1
        assert (1 in pool.sinks.owner.tolist()) == (kept < n), (kept, n)
