"""Page-canonical prefill's scheduling half (OSCAR_PREFILL_READS=cache): a prompt's tokens after
its last complete page are prefilled in a forward of their own, after the complete pages.

Why: a radix or host-tier hit of a prompt's complete pages computes only the positions after
them, [C, L), in a forward of L - C rows over a C-token cached prefix. A cold prefill computed the
same positions inside one forward of L rows. The backend makes both read the same values
(backend._prepare_canonical), but the layers' GEMMs and the attention kernels round a row
differently in a forward of another size, and once those rows are quantised (the page they finish
during decode) a one-ulp difference can move a 2-bit code a whole step. Prefilling [0, C) first and
[C, L) alone makes the cold prompt's last forward the very computation its hits repeat: the same
rows, the same cached pages, the same kernels and plans.

C is where SGLang's prefix match of the same prompt stops: its longest matchable prefix
(Req._compute_max_prefix_len: at most L - 1 tokens, so that one is computed) rounded down to a
page. Two hooks on SGLang's PrefillAdder (the policy that picks each prefill batch):
* add_one_req: a request whose cached prefix (device + host tier) ends before C is admitted as a
  chunked request of [prefix, C) (SGLang's own chunked-prefill path, its budget lowered to C -
  prefix for the call); its tail [C, L) is its next chunk. SGLang carries one chunked request at a
  time, so a request that needs a split while another is chunked waits for the next batch, and a
  split ends the batch (the requests after it would need one too).
* add_chunked_req: a chunked request's next chunk stops at C (a long prompt's last chunk would
  otherwise take its complete pages and its tail together).
Cost: one more forward per cold prompt (its tail, at most one page of rows), and cold prompts enter
prefill one per batch. Without a radix cache nothing is split (no hit can repeat a forward).
"""
from __future__ import annotations

from .state import RUNTIME_INFO


def active(adder) -> bool:
    """This scheduler serves int2 with page-canonical prefill and a prefix cache."""
    return (RUNTIME_INFO.get("prefill_reads") == "cache"
            and not getattr(getattr(adder, "tree_cache", None), "disable", False))


def tail_start(req, page: int) -> int:
    """C: where a hit of this request's own prompt would end (its longest matchable prefix,
    page-aligned)."""
    n = len(req.full_untruncated_fill_ids)
    limit = getattr(req, "_compute_max_prefix_len", None)
    longest = limit(n) if limit is not None else n - 1
    return max(longest, 0) // page * page


def _cached(req) -> int:
    """Tokens the request will not compute: its device prefix and its host-tier hit."""
    return len(req.prefix_indices) + int(getattr(req, "host_hit_length", 0) or 0)


def _with_chunk_budget(adder, limit: int, call):
    """Run call() with adder.rem_chunk_tokens lowered to `limit`; afterwards the budget is what it
    was less what the call used (None stays None: chunked prefill off)."""
    saved = adder.rem_chunk_tokens
    adder.rem_chunk_tokens = limit if saved is None else min(saved, limit)
    before = adder.rem_chunk_tokens
    try:
        return call()
    finally:
        used = before - adder.rem_chunk_tokens
        adder.rem_chunk_tokens = None if saved is None else saved - used


def around_add_one_req(orig, self, req, has_chunked_req, truncation_align_size=None, *args, **kwargs):
    call = lambda: orig(self, req, has_chunked_req, truncation_align_size, *args, **kwargs)  # noqa: E731
    if not active(self):
        return call()
    c = tail_start(req, self.page_size)
    need = c - _cached(req)
    if need <= 0:  # a hit of every complete page, or a prompt of one page: one forward
        return call()
    from sglang.srt.managers.schedule_policy import AddReqResult

    if has_chunked_req or self.new_chunked_req is not None:
        return AddReqResult.OTHER  # one chunked request at a time: next batch
    result = _with_chunk_budget(self, need, call)
    if self.new_chunked_req is req:
        # split: no more requests in this batch (each would need a split of its own)
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens = 0
        return AddReqResult.OTHER
    return result


def around_add_chunked_req(orig, self, req, *args, **kwargs):
    call = lambda: orig(self, req, *args, **kwargs)  # noqa: E731
    if not active(self):
        return call()
    done = len(req.prefix_indices)
    need = tail_start(req, self.page_size) - done
    if need <= 0:  # the tail: the rest in one forward
        if self.rem_chunk_tokens is not None:
            return call()
        # chunked prefill off: SGLang gives a chunked request no budget; the tail is what is left
        need = len(req.full_untruncated_fill_ids) - done
    return _with_chunk_budget(self, need, call)
