"""Whole pages between head-major pool buffers and a page-first blob (the INT2 host tier), one
launch for up to MAX_SECTIONS buffers, no host synchronisation.

Why a kernel: HiCache copies a returning prefix host -> device layer by layer and writes new pages
back after each prefill, both from the scheduler's thread, on copy streams that wait for the
compute stream. As torch gathers / scatters, checking the indices read a GPU value on the host: a
synchronisation, so the thread waited for the forward in flight (the write-back is issued while
the next forward runs, before the first token is sent): 32 ms of CPU for 100 pages of
Llama-3.1-8B behind ~32 ms of compute in an H200 probe, 3 ms as this kernel (CHANGELOG.md,
2026-12-02). Here a layer is one launch, and the indices are checked in the kernel.

Layout (reference.copy_pages is the same in torch):
* buffer s: contiguous [H, P, chunk_s] (any dtype; P pages, so a per-slot buffer [H, N, ...] is
  viewed as [H, N / B, B * row]); page p of head h is the run [h, p, :].
* blob: [pages, page_bytes]; page q holds section s from byte off_s, its H runs one after another:
  bytes [off_s + h * chunk_s, off_s + (h + 1) * chunk_s) of row q.
* host_idx / dev_idx: SGLang's slot indices, B a page, run i = slots [i * B, (i + 1) * B); a run
  must be B consecutive slots starting at a multiple of B. A run that is not is copied nowhere
  (for either side) and sets bad[0] = 1, which the caller checks later without waiting.

Everything is moved in words (int32 where every size and offset allows, else int16 / uint8).
"""
from __future__ import annotations

import triton
import triton.language as tl

MAX_SECTIONS = 4
BLOCK = 1024  # words a program moves per step


@triton.jit
def _move(dev, host, n, TO_HOST: tl.constexpr, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < n
        if TO_HOST:
            tl.store(host + o, tl.load(dev + o, mask=m), mask=m)
        else:
            tl.store(dev + o, tl.load(host + o, mask=m), mask=m)


@triton.jit
def _first_page(idx, i, B: tl.constexpr, BP2: tl.constexpr):
    """(page number of run i, whether the run is B consecutive slots from a multiple of B)."""
    r = tl.arange(0, BP2)
    first = tl.load(idx + i * B).to(tl.int64)
    run = tl.load(idx + i * B + r, mask=r < B, other=0).to(tl.int64)
    wrong = tl.sum(tl.where((r < B) & (run != first + r), 1, 0), 0)
    return first // B, (wrong == 0) & (first % B == 0) & (first >= 0)


@triton.jit
def _copy_pages_kernel(blob, host_idx, dev_idx, bad, d0, d1, d2, d3,
                       hs0, hs1, hs2, hs3, c0, c1, c2, c3, o0, o1, o2, o3, page_words, H,
                       B: tl.constexpr, BP2: tl.constexpr, TO_HOST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    sh = tl.program_id(1)
    s = sh // H
    h = (sh % H).to(tl.int64)
    hp, ok_h = _first_page(host_idx, i, B, BP2)
    dp, ok_d = _first_page(dev_idx, i, B, BP2)
    if ok_h & ok_d:
        row = blob + hp * page_words
        if s == 0:
            _move(d0 + h * hs0 + dp * c0, row + o0 + h * c0, c0, TO_HOST, BLOCK)
        elif s == 1:
            _move(d1 + h * hs1 + dp * c1, row + o1 + h * c1, c1, TO_HOST, BLOCK)
        elif s == 2:
            _move(d2 + h * hs2 + dp * c2, row + o2 + h * c2, c2, TO_HOST, BLOCK)
        else:
            _move(d3 + h * hs3 + dp * c3, row + o3 + h * c3, c3, TO_HOST, BLOCK)
    else:
        tl.store(bad, 1)


def launch(blob_words, sections, host_idx, dev_idx, bad, page_size: int, to_host: bool) -> None:
    """One launch over up to MAX_SECTIONS sections, all in the same word dtype as blob_words:
    sections = [(buffer words [H, P, chunk], host offset in words)]; checked by ops.copy_pages."""
    n_runs = host_idx.numel() // page_size
    H = sections[0][0].shape[0]
    if n_runs == 0:
        return
    bufs = [b for b, _ in sections] + [sections[0][0]] * (MAX_SECTIONS - len(sections))
    offs = [o for _, o in sections] + [0] * (MAX_SECTIONS - len(sections))
    _copy_pages_kernel[(n_runs, len(sections) * H)](
        blob_words, host_idx, dev_idx, bad, *bufs,
        *[b.stride(0) for b in bufs], *[b.shape[2] for b in bufs], *offs, blob_words.stride(0), H,
        B=page_size, BP2=triton.next_power_of_2(page_size), TO_HOST=bool(to_host), BLOCK=BLOCK)
