"""Page-canonical prefill (OSCAR_PREFILL_READS=cache, backend._prepare_canonical): a prompt's answer must not depend on how
its prefix reached the cache. On the default layout (per-channel keys over page blocks,
TRITON_INTERPRET on CPU, test_backend_channel.py's format: pages of 32, sink 4, ring 32):

* request A prefills L tokens cold, in one extend; request B has a radix hit of A's first P
  tokens (whole pages, sharing A's slots and A's sink, as the alloc hook queues it) and extends
  the same tokens [P, L); C, a request that A's row was handed to, then hits the same prefix
  after A's ring was overwritten. The outputs of [P, L) and of the decode steps after them are
  equal across A, B and C (rounding only: the INT2 pages are read by different kernels), and
  equal the float64 reference of the canonical reading.
* Against that, the default reading (OSCAR_PREFILL_READS=exact: a cold prompt in BF16, a hit
  reading its prefix INT2): the same outputs differ by far more than the rounding allowed here,
  so the check would see a regression.
"""
import math

import pytest
import torch

from .test_backend import Hq, H, D, _close, _decode_batch, _heavy, _reference, _rot, backend_cls, prompt  # noqa: F401
from .test_backend_channel import B, _make, _seen
from .test_speculative_verify import _forward

pytestmark = pytest.mark.slow


def _relerr(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("L,P", [(75, 64), (75, 32), (64, 32)])
def test_a_hit_answers_as_the_cold_prefill_whatever_the_rows_hold(backend_cls, seed, L, P):
    from oscar_sglang.runtime.pool import note_new_rows

    b, pool, layer, Rk, Rv = _make(backend_cls, rows=4, pages=12, reads="cache")
    rowA, rowB = 1, 2
    k, v = _heavy(L + 2, D), _heavy(L + 2, D)
    q = torch.randn(L + 2, Hq, D).bfloat16().float()
    req_to_token = torch.zeros(4, 12 * B, dtype=torch.int64)
    slotsA = torch.arange(B, B + L + 2)
    slotsB = torch.cat([slotsA[:P], torch.arange(8 * B + P % B, 8 * B + P % B + L + 2 - P)])
    req_to_token[rowA, :L + 2], req_to_token[rowB, :L + 2] = slotsA, slotsB
    b.req_to_token = req_to_token

    note_new_rows([rowA], [0], [prompt()])
    oA, _ = _forward(b, layer, req_to_token, [rowA], [0], L, q[:L], k[:L], v[:L])
    C = L // B * B
    assert pool.own_start[rowA].item() == C and pool.sink_start[rowA].item() == 0
    # the float64 reference of the canonical reading: complete pages quantised (sink BF16), the
    # last incomplete page exact
    g = Hq // H
    kr, vr = _rot(k, Rk), _rot(v, Rv)
    Ks, Vs = _seen(kr[:L], "k", L, C, 0), _seen(vr[:L], "v", L, C, 0) @ Rv.double().T
    qr = torch.einsum("thgd,hde->thge", q.reshape(-1, H, g, D), Rk).reshape(-1, Hq, D)
    for t in range(L):
        _close(oA[t], _reference(qr[t].double(), [Ks[: t + 1]], [Vs[: t + 1]]))

    note_new_rows([rowB], [P], [prompt()])  # B: a radix hit of P tokens on A's pages
    oB, _ = _forward(b, layer, req_to_token, [rowB], [P], L - P, q[P:L], k[P:L], v[P:L])
    assert pool.own_start[rowB].item() == C and pool.sink_start[rowB].item() == 0
    assert _relerr(oB, oA[P:]) < 2e-3

    # both decode a token: the same answer
    for n in (L + 1, L + 2):
        rows, lens = torch.tensor([rowA, rowB]), torch.tensor([n, n])
        fb = _decode_batch(b, req_to_token, rows, lens)
        o = b.forward_decode(q[[n - 1, n - 1]].reshape(2, Hq * D), k[[n - 1, n - 1]].reshape(2, H * D),
                             v[[n - 1, n - 1]].reshape(2, H * D), layer, fb).float().reshape(2, Hq, D)
        assert _relerr(o[1], o[0]) < 2e-3

    # A's row handed to another request, which overwrites its ring; C hits the prefix again
    rowC, rowD = 3, 1
    note_new_rows([rowD], [0], [prompt(first=5000)])  # another prompt
    other = torch.arange(5 * B, 5 * B + B)
    req_to_token[rowD, :B] = other
    _forward(b, layer, req_to_token, [rowD], [0], B, q[:B] * 0.5, _heavy(B, D), _heavy(B, D))
    slotsC = torch.cat([slotsA[:P], torch.arange(10 * B + P % B, 10 * B + P % B + L - P)])
    req_to_token[rowC, :L] = slotsC
    note_new_rows([rowC], [P], [prompt()])
    oC, _ = _forward(b, layer, req_to_token, [rowC], [P], L - P, q[P:L], k[P:L], v[P:L])
    # the sink comes from the sink store, kept by A's first tokens (A's row is gone): the same values
    assert _relerr(oC, oA[P:]) < 2e-3


def test_the_reading_before_it_differs_by_more_than_the_bound(backend_cls, seed):
    """What the bound above separates: a cold prompt read in BF16 against a hit reading its prefix
    as INT2 (OSCAR_PREFILL_READS=exact, the default) differ by tens of times 2e-3."""
    b, pool, layer, Rk, Rv = _make(backend_cls)
    L, P = 75, 64
    k, v = _heavy(L, D), _heavy(L, D)
    q = torch.randn(L, Hq, D).bfloat16().float()
    kr, vr = _rot(k, Rk), _rot(v, Rv)
    g = Hq // H
    qr = torch.einsum("thgd,hde->thge", q.reshape(-1, H, g, D), Rk).reshape(-1, Hq, D)
    Kq, Vq = _seen(kr[:L], "k", L, L // B * B, 0), _seen(vr[:L], "v", L, L // B * B, 0)
    errs = []
    for t in range(P, L):
        cold = _reference(q[t].double(), [k[: t + 1].double()], [v[: t + 1].double()])
        hit = _reference(qr[t].double(), [torch.cat([Kq[:P], kr[P:t + 1].double()])],
                         [torch.cat([Vq[:P], vr[P:t + 1].double()])]) @ Rv.double().T
        errs.append(_relerr(hit, cold))
    assert min(errs) > 10 * 2e-3, errs
