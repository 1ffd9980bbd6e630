"""ops.fill_kv_indices (many programs per request) vs reference.fill_kv_indices (one request at a
time): random slot tables, requests of length 0, 1, odd and longer than a program's block times
its pieces, req_to_token rows in any order; int64 kv_indices (SGLang's, per step and in its
CUDA-graph buffers) with int64 lengths, and int32 ones with int32 lengths (a prefill's prefix
lengths are int32). Entries past the batch stay untouched."""
import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.triton import kv_indices as ki

from .pool_case import DEV

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _case(lens, rows=9, max_len=None, idx_dtype=torch.int64, len_dtype=torch.int64):
    max_len = max_len or max(lens) + 7
    # slots as SGLang hands them out: a permutation of the pool, not position order
    req_to_token = torch.randperm(rows * max_len, dtype=torch.int64).to(torch.int32).view(rows, max_len)
    req_pool_indices = torch.randperm(rows)[: len(lens)].to(torch.int64)
    seq_lens = torch.tensor(lens, dtype=len_dtype)
    kv_indptr = torch.zeros(len(lens) + 3, dtype=torch.int32)  # longer than B + 1, as SGLang's buffer
    kv_indptr[1:len(lens) + 1] = torch.cumsum(seq_lens, 0)
    kv_indices = torch.full((sum(lens) + 50,), -1, dtype=idx_dtype)
    return [x.to(DEV) for x in (req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices)]


@pytest.mark.parametrize("lens", [[1], [40_000], [0, 3, 1025, 2048, 1], [700] * 12])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_fill_matches_the_reference(seed, lens, idx_dtype):
    r2t, rpi, sl, indptr, out = _case(lens, rows=max(9, len(lens) + 2), idx_dtype=idx_dtype,
                                      len_dtype=torch.int32 if idx_dtype == torch.int32 else torch.int64)
    want = ref.fill_kv_indices(r2t, rpi, sl, indptr, out.clone())
    got = ops.fill_kv_indices(r2t, rpi, sl, indptr, out)
    assert got is out and got.dtype == idx_dtype
    assert torch.equal(got, want)
    assert (got[sum(lens):] == -1).all()  # past the batch: untouched
    # every request's positions are its own slots, in position order
    for b, n in enumerate(lens):
        s = int(indptr[b])
        assert torch.equal(got[s:s + n].long(), r2t[int(rpi[b]), :n].long())


def test_long_request_is_cut_into_pieces_that_each_loop():
    """One 40K request on the interpreter's 8 'SMs': 32 pieces of 1,250 positions, more than one
    block each, so the in-program loop and the piece boundaries are both exercised above."""
    pieces = ki.kv_indices_pieces(1, 8)
    assert pieces == ki.TARGET_PROGRAMS_PER_SM * 8
    assert 40_000 / pieces > ki.BLOCK
    assert ki.kv_indices_pieces(10_000, 132) == 1
    assert ki.kv_indices_pieces(1, 10_000) == ki.MAX_PIECES


def test_short_tables_are_refused():
    r2t, rpi, sl, indptr, out = _case([5, 6])
    with pytest.raises(ValueError, match="kv_indptr"):
        ops.fill_kv_indices(r2t, rpi, sl, indptr[:2], out)
    with pytest.raises(ValueError, match="contiguous"):
        ops.fill_kv_indices(r2t.t(), rpi, sl, indptr, out)
