"""A retracted request's INT2 KV to host memory and back (the decode side of PD).

When a decode server runs short of KV slots it retracts requests: SGLang copies each one's KV to
host memory (Req.offload_kv_cache -> the pool's get_cpu_copy) and, once slots are free again,
gives it a new request row and new slots and copies the KV back (Req.load_kv_cache ->
load_cpu_copy). SGLang's copy is per slot; INT2 keys are quantised per page (per-channel
parameters for a whole page) and a request's sink and recent tokens live in BF16 side rows of its
request row, which get_cpu_copy is never told. So for an INT2 pool the two Req methods are
replaced (AROUND hooks, runtime/hooks.py) by `offload` / `load` below, which copy the request's
whole pages (every section of every layer, as the host tier lays them out: host_pool.page_sections)
and its side row (pd_buffers.state_buffer_names: what PD sends for a request). The pool's own
get_cpu_copy / load_cpu_copy stay refused for any other caller.

A request's slots are whole pages in request order (SGLang's paged allocator: token j at offset
j % page_size of the request's (j // page_size)-th page), before and after: checked, since the
per-page parameters only mean something for the same tokens in the same places. The last page may
be partly filled: copied whole (its unused slots are never read); in the per-channel layout its
keys are not quantised yet and live in the ring, which is in the side row.

The new row's side state is the copied one: DecodePreallocQueue._pre_alloc, which gives the
resumed request its row, is hooked (pd_hooks.around_pre_alloc) to withdraw the row's reset and
drop its side-copy pointers, as for a row whose state comes by transfer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .host_pool import copy_plans, copy_sections, page_sections, page_slots, raise_if_bad
from .pd_buffers import state_buffer_names


@dataclass
class RetractedKV:
    """What `offload` keeps on the host for one request."""
    tokens: int                      # slots copied (SGLang's seqlen - 1)
    pages: torch.Tensor              # uint8 [n_pages, page bytes], the host tier's page blobs
    side_row: list[torch.Tensor]     # the request row of each state_buffer_names entry


def request_pages(pool, token_indices: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages, their slots) of a request whose slots are `token_indices`, checked to be whole
    pages in request order (module docstring)."""
    B = pool.page_size
    idx = token_indices.reshape(-1).to(torch.int64)
    n = idx.numel()
    pages = torch.div(idx[::B], B, rounding_mode="floor")
    expect = pages.repeat_interleave(B)[:n] * B + torch.arange(n, device=idx.device) % B
    if not torch.equal(idx, expect):
        raise RuntimeError(f"oscar-sglang: {what}: the request's {n} slots are not whole pages of "
                           f"{B} in request order; its INT2 pages cannot be copied")
    return pages, page_slots(pages, B)


def _copy(pool, blob, sections, slots, to_host: bool) -> None:
    """The request's pages (slots: whole pages, request_pages) to or from the rows of `blob`,
    in order, as the host tier copies them (checked here: a retraction is no hot path)."""
    bad = torch.zeros(1, dtype=torch.int32, device=slots.device)
    rows = page_slots(torch.arange(blob.shape[0], device=slots.device), pool.page_size)
    copy_sections(pool, copy_plans(pool, blob, sections), rows, slots, bad, to_host)
    raise_if_bad(bad, "retraction")


def _side_rows(pool):
    for name, layer in state_buffer_names(pool):
        t = getattr(pool, name)
        yield t if layer is None else t[layer]


def offload(pool, req_pool_idx: int, token_indices: torch.Tensor) -> RetractedKV:
    """The request's pages and side row, copied to host memory."""
    pages, slots = request_pages(pool, token_indices, "retraction")
    sections, page_bytes = page_sections(pool)
    blob = torch.zeros(len(pages), page_bytes, dtype=torch.uint8, device=slots.device)
    _copy(pool, blob, sections, slots, to_host=True)
    # copies even on a CPU pool (.cpu() of a CPU view would alias the row the next request reuses)
    row = [t[int(req_pool_idx)].to("cpu", copy=True) for t in _side_rows(pool)]
    return RetractedKV(int(token_indices.numel()), blob.cpu(), row)


def load(pool, copy: RetractedKV, req_pool_idx: int, token_indices: torch.Tensor) -> None:
    """`copy` into the request's new row and slots."""
    if int(token_indices.numel()) != copy.tokens:
        raise RuntimeError(f"oscar-sglang: a retracted request comes back with {token_indices.numel()} "
                           f"slots, {copy.tokens} were copied")
    pages, slots = request_pages(pool, token_indices, "resumption")
    sections, _ = page_sections(pool)
    _copy(pool, copy.pages.to(slots.device), sections, slots, to_host=False)
    for t, saved in zip(_side_rows(pool), copy.side_row):
        t[int(req_pool_idx)] = saved.to(t.device)


# ------------------------------------------------------------------------------------ hook bodies


def _int2_pool(allocator):
    from .pool import OscarInt2KVPool

    pool = allocator.get_kvcache() if hasattr(allocator, "get_kvcache") else None
    return pool if isinstance(pool, OscarInt2KVPool) else None


def _request_slots(req, req_to_token_pool) -> torch.Tensor:
    # the slots SGLang's Req.offload_kv_cache / load_kv_cache copy: all but the last token's,
    # whose KV the next decode step writes
    return req_to_token_pool.req_to_token[req.req_pool_idx, : req.seqlen - 1]


def around_offload_kv_cache(orig, self, req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs):
    """AROUND hook body for Req.offload_kv_cache: an INT2 pool's request goes through `offload`."""
    pool = _int2_pool(token_to_kv_pool_allocator)
    if pool is None:
        return orig(self, req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs)
    self.kv_cache_cpu = offload(pool, self.req_pool_idx, _request_slots(self, req_to_token_pool))
    return None


def around_load_kv_cache(orig, self, req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs):
    """AROUND hook body for Req.load_kv_cache: an INT2 pool's request comes back through `load`."""
    pool = _int2_pool(token_to_kv_pool_allocator)
    if pool is None:
        return orig(self, req_to_token_pool, token_to_kv_pool_allocator, *args, **kwargs)
    load(pool, self.kv_cache_cpu, self.req_pool_idx, _request_slots(self, req_to_token_pool))
    del self.kv_cache_cpu
    return None
