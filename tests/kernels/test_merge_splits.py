"""core.merge_splits (stage 2 of every INT2 decode) vs a float64 LSE merge (TRITON_INTERPRET on CPU).

Each request uses its own number of splits (num_kv_splits, clamped to [NB16 + 1, max_kv_splits] as
stage 1 does); the merge reads them all at once (a small grid) or walks 1 to 5 chunks of them (a
large grid's MERGE_CHUNK, forced here); some splits saw no key (lse -inf, their partial output
never written: NaN garbage here), one request has no key at all, and the slots past a request's
splits hold garbage too. Partial outputs carry outlier channels, LSEs spread
over tens of nats.
"""
import pytest
import torch

from oscar_kernels.triton import core
from oscar_kernels.triton.token_decode import BASE_MIN_CHUNK

from .pool_case import DEV

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("out_dtype,chunk", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.float32, core.MERGE_CHUNK), (torch.bfloat16, 4)])
def test_merge_walks_each_requests_splits_in_chunks(seed, out_dtype, chunk):
    Hq, Dv, max_splits, nb16 = 4, 64, 2 * core.MERGE_CHUNK + 3, 2
    want_splits = [1, 3, core.MERGE_CHUNK, core.MERGE_CHUNK + 1, max_splits, 100]
    B = len(want_splits)
    n = [min(max(w, nb16 + 1), max_splits) for w in want_splits]  # what stage 1 used
    part = torch.full((B, Hq, max_splits, Dv), float("nan"))
    lse = torch.full((B, Hq, max_splits), float("nan"))
    for b in range(B):
        part[b, :, : n[b]] = torch.randn(Hq, n[b], Dv) * (1 + 20 * (torch.rand(Dv) > 0.9))
        lse[b, :, : n[b]] = torch.randn(Hq, n[b]) * 10
        empty = torch.rand(Hq, n[b]) < 0.3
        lse[b, :, : n[b]][empty] = float("-inf")
        part[b, :, : n[b]][empty] = float("nan")
    lse[1] = float("-inf")  # a request whose splits saw no key at all
    part[1] = float("nan")

    # float64 reference over each request's own splits
    want = torch.zeros(B, Hq, Dv, dtype=torch.float64)
    for b in range(B):
        l = lse[b, :, : n[b]].double()
        w = torch.softmax(l, -1).nan_to_num(0.0)  # all -inf: no weight
        p = part[b, :, : n[b]].double().nan_to_num(0.0)
        want[b] = (w[..., None] * p).sum(1)

    o = torch.full((B, Hq, Dv), 7.0, dtype=out_dtype, device=DEV)
    kv_len = torch.full((B,), 1000, dtype=torch.int32)
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), kv_len.cumsum(0).int()]).to(DEV)
    rows = torch.arange(B, dtype=torch.int64, device=DEV)
    zeros = torch.zeros(B, dtype=torch.int32, device=DEV)
    num_kv_splits = torch.tensor(want_splits, dtype=torch.int32, device=DEV)
    core.merge_splits(o, part.to(DEV), lse.to(DEV), kv_indptr, rows, zeros, zeros, num_kv_splits,
                        max_splits, nb16, BASE_MIN_CHUNK, 4, 128, chunk=chunk)
    got = o.cpu().double()
    assert torch.isfinite(got).all()
    assert torch.equal(got[1], torch.zeros(Hq, Dv, dtype=torch.float64))
    tol = 1e-5 if out_dtype == torch.float32 else 2 ** -7  # one bf16 rounding (truncated in the interpreter)
    err = ((got - want).abs() / want.abs().amax(-1, keepdim=True).clamp_min(1e-6)).max().item()
    assert err <= tol, err


def test_merge_chunk_reads_everything_at_once_only_in_small_grids():
    sms = core.sm_count("cpu")
    small = core.MERGE_ONE_SHOT_PROGRAMS_PER_SM * sms
    assert core.merge_chunk(1, small, 66, "cpu") == 128
    assert core.merge_chunk(2, small, 66, "cpu") == core.MERGE_CHUNK
    assert core.merge_chunk(512, 32, 3, "cpu") == 4  # never more than the splits allowed
