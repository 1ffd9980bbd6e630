"""ops.copy_pages (one launch per four sections, indices checked in the kernel) vs
reference.copy_pages: random bytes in head-major buffers of several dtypes and page sizes, runs
in shuffled page order on both sides, both directions, more sections than one launch takes, sizes
that force 2- and 1-byte words; a run that is not a page is copied nowhere and flagged."""
import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.triton import page_copy

from .pool_case import DEV

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

H, P = 3, 9  # heads, pages of every buffer


def _buffers(B, rows):
    """Head-major buffers like the INT2 pool's, random bits: (buffer, per_page) for each row shape
    in `rows` (uint8 codes, fp16 parameter pairs); per-page ones hold one row a page."""
    out = []
    for shape, dtype, per_page in rows:
        n = P if per_page else P * B
        if dtype == torch.uint8:
            t = torch.randint(0, 256, (H, n, *shape), dtype=torch.uint8)
        else:  # parameters with outliers: any fp16 bit pattern must survive
            t = (torch.randn(H, n, *shape) * torch.where(torch.rand(H, n, *shape) < 0.05, 3e3, 1.0)).to(dtype)
        out.append(t.to(DEV))
    return out


def _page_views(bufs, B, rows):
    return [b if per_page else b.reshape(H, P, B, *b.shape[2:]) for b, (_, _, per_page) in zip(bufs, rows)]


def _layout(views):
    """(sections with 16-byte aligned offsets, row bytes), like the host tier's."""
    secs, off = [], 0
    for v in views:
        secs.append((v, off))
        n = H * v[0, 0].numel() * v.element_size()
        off += -(-n // 16) * 16
    return secs, off


def _slots(pages, B):
    return (torch.tensor(pages)[:, None] * B + torch.arange(B)).reshape(-1).to(DEV)


ROWS = {
    "int2-channel": [((8,), torch.uint8, False), ((4, 2), torch.float16, True),
                     ((4,), torch.uint8, False), ((2, 2), torch.float16, False)],
    "odd-bytes": [((3,), torch.uint8, False), ((1, 2), torch.float16, False), ((5,), torch.uint8, True)],
    "two-launches": [((8,), torch.uint8, False), ((2, 2), torch.float16, False)] * 3,
}


@pytest.mark.parametrize("B", [8, 16])
@pytest.mark.parametrize("case", list(ROWS))
def test_round_trip_matches_the_reference(seed, B, case):
    rows = ROWS[case]
    src = _page_views(_buffers(B, rows), B, rows)
    secs, row_bytes = _layout(src)
    dev_pages, host_pages = [4, 1, 7, 2, 8], [6, 0, 3, 9, 2]
    got = torch.zeros(11, row_bytes, dtype=torch.uint8, device=DEV)
    want = got.clone()
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    ops.copy_pages(got, secs, _slots(host_pages, B), _slots(dev_pages, B), B, bad, to_host=True)
    ref.copy_pages(want, secs, _slots(host_pages, B), _slots(dev_pages, B), B, to_host=True)
    assert torch.equal(got, want)
    assert int(bad) == 0
    untouched = [q for q in range(11) if q not in host_pages]
    assert not got[untouched].any()

    # back into zeroed buffers at other pages: those pages equal the source's, nothing else written
    dst = [torch.zeros_like(v) for v in src]
    dsecs = [(d, off) for d, (_, off) in zip(dst, secs)]
    new_pages = [0, 5, 3, 6, 1]
    ops.copy_pages(got, dsecs, _slots(host_pages, B), _slots(new_pages, B), B, bad, to_host=False)
    assert int(bad) == 0
    for d, s in zip(dst, src):
        for a, b in zip(dev_pages, new_pages):
            assert torch.equal(d[:, b], s[:, a])
        others = [p for p in range(P) if p not in new_pages]
        assert not d[:, others].reshape(-1).view(torch.uint8).any()
    # and the reference reads the blob back the same way
    ref_dst = [torch.zeros_like(v) for v in src]
    ref.copy_pages(got, [(d, off) for d, (_, off) in zip(ref_dst, secs)], _slots(host_pages, B),
                   _slots(new_pages, B), B, to_host=False)
    assert all(torch.equal(a, b) for a, b in zip(dst, ref_dst))


def test_sizes_pick_the_word(monkeypatch):
    """The odd case moves single bytes, the INT2 one 4-byte words (what the launch gets)."""
    seen = []
    monkeypatch.setattr(page_copy, "launch", lambda blob, group, *a, **k: seen.append(blob.dtype))
    for case in ("odd-bytes", "int2-channel"):
        rows = ROWS[case]
        src = _page_views(_buffers(8, rows), 8, rows)
        secs, row_bytes = _layout(src)
        blob = torch.zeros(2, row_bytes, dtype=torch.uint8, device=DEV)
        ops.copy_pages(blob, secs, _slots([0], 8), _slots([1], 8), 8,
                       torch.zeros(1, dtype=torch.int32, device=DEV), True)
    assert seen == [torch.uint8, torch.int32]


@pytest.mark.parametrize("broken", ["unaligned", "not-consecutive", "host-unaligned"])
def test_a_run_that_is_not_a_page_is_flagged_and_not_copied(seed, broken):
    B, rows = 8, ROWS["int2-channel"]
    src = _page_views(_buffers(B, rows), B, rows)
    secs, row_bytes = _layout(src)
    host, dev = _slots([1, 2], B), _slots([3, 5], B)
    if broken == "unaligned":
        dev[B:] += 1  # run 1 starts mid-page
    elif broken == "not-consecutive":
        dev[B + 3], dev[B + 4] = dev[B + 4].clone(), dev[B + 3].clone()
    else:
        host[:B] += 2
    blob = torch.zeros(4, row_bytes, dtype=torch.uint8, device=DEV)
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    ops.copy_pages(blob, secs, host, dev, B, bad, to_host=True)
    assert int(bad) == 1
    good_q = 2 if broken == "host-unaligned" else 1  # the run that is whole pages on both sides
    assert blob[good_q].any()
    assert not blob[[q for q in range(4) if q != good_q]].any()
    with pytest.raises(ValueError, match="page-aligned"):
        ref.copy_pages(blob, secs, host, dev, B, to_host=True)


def test_bad_shapes_are_refused():
    B, rows = 8, ROWS["int2-channel"]
    src = _page_views(_buffers(B, rows), B, rows)
    secs, row_bytes = _layout(src)
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    blob = torch.zeros(2, row_bytes, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="same whole number"):
        ops.copy_pages(blob, secs, _slots([0], B), _slots([0, 1], B), B, bad, True)
    with pytest.raises(ValueError, match="overruns"):
        ops.copy_pages(blob[:, :row_bytes - 16], secs, _slots([0], B), _slots([1], B), B, bad, True)
    with pytest.raises(ValueError, match="contiguous"):
        ops.copy_pages(blob, [(src[0].transpose(0, 1), 0)], _slots([0], B), _slots([1], B), B, bad, True)
