"""Rejected speculative drafts leave the INT2 pool as if they had never been written.

A speculative verify (ForwardMode.TARGET_VERIFY, chains only: the plugin refuses trees at start)
stores the K / V of each request's N draft tokens at positions L .. L+N-1 (L = its verified
length) like any extend: INT2 codes in the drafts' slots, BF16 copies in the request's recent
ring at position % W, and each copy's owner slot (pool.entry_owner). Then SGLang accepts the
first a of them (a >= 1: the bonus token of the previous step is always kept) and the rest are
rejected. What that leaves behind, and what undoes it:

* ring entries: position L + j lands in entry (L + j) % W, which held position L + j - W, still
  inside the next reader's window [L' - W, L'). Rejected drafts would leave BF16 copies of wrong
  keys there. DraftRollback.save copies the N entries of every layer (and their owners) before
  the verify stores, restore puts back those of rejected drafts after the accept step. The
  entries of accepted drafts keep their new contents: exactly what a plain decode of the
  accepted tokens writes.
* key blocks (per-channel formats): a rejected draft at a page's last position makes the store
  quantise that page from keys that include rejected ones. Nothing reads them: a page's codes
  are read only once the request is past the page (before that its positions are read from the
  ring, W >= the page size), and the accepted token at that last position quantises the page
  again, from the ring and that step's accepted drafts only. A radix insert takes whole pages
  below the verified length, so it never takes such a page.
* the drafts' INT2 value codes and slot_entry pointers: in slots SGLang keeps for the same
  positions (spec v2 reserves them per request) and rewrites when the next drafts land there;
  readers never read a slot at or past a request's length. The restored owners make any stale
  pointer of a rejected slot fail the owner check of the radix carry-over.
* sink entries: a verify writes one only for positions < S, i.e. a prompt shorter than the sink
  (4 tokens by default); a rejected one is rewritten, like its slot, before it is read.

The save runs in the verify's first layer (inside its CUDA graph), the restore after SGLang's
accept step (hooks.after_eagle_sample), both on the forward stream, in that order, with no host
synchronisation: gathers / scatters over [layers, batch, N] entries, a few launches per step.
"""
from __future__ import annotations

import torch


class DraftRollback:
    """The ring entries a verify of up to `num_draft_tokens` drafts per request overwrites,
    saved per request row: K / V [layers, rows, N, H, D] in the ring's dtype, owners [rows, N]."""

    def __init__(self, pool, num_draft_tokens: int):
        if num_draft_tokens > pool.recent:
            raise ValueError(f"{num_draft_tokens} speculative draft tokens per step exceed the recent "
                             f"window of {pool.recent} tokens: lower --speculative-num-draft-tokens")
        self.pool = pool
        self.n = int(num_draft_tokens)
        rk, rv = pool.ring_k_layers, pool.ring_v_layers
        L, R, _, H, D = rk.shape
        self.saved_k = torch.zeros((L, R, self.n, H, D), dtype=rk.dtype, device=rk.device)
        self.saved_v = torch.zeros((L, R, self.n, H, rv.shape[-1]), dtype=rv.dtype, device=rv.device)
        self.saved_owner = torch.full((R, self.n), -1, dtype=torch.int32, device=rk.device)
        self._j = torch.arange(self.n, device=rk.device)

    @staticmethod
    def bytes_per_row(num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                      num_draft_tokens: int) -> int:
        """What one request row costs (sizing counts it with the side buffers)."""
        return num_draft_tokens * (num_layers * num_kv_heads * (head_dim + v_head_dim) * 2 + 4)

    def _entries(self, rows: torch.Tensor, seq_lens: torch.Tensor, n: int):
        """Ring positions [B, n] of positions L .. L+n-1 and their entry ids in entry_owner."""
        pool = self.pool
        W = pool.recent
        rows = rows.to(torch.int64)
        ring_pos = (seq_lens.to(torch.int64)[:, None] + self._j[None, :n]) % W
        entry = pool.req_rows * pool.sink + rows[:, None] * W + ring_pos
        return rows[:, None], ring_pos, entry

    def save(self, rows: torch.Tensor, seq_lens: torch.Tensor, n: int) -> None:
        """Before a verify of n drafts per request stores: keep the entries it will overwrite."""
        if n > self.n:
            raise ValueError(f"a verify of {n} drafts per request; the rollback buffers hold {self.n}")
        r, ring_pos, entry = self._entries(rows, seq_lens, n)
        j = self._j[None, :n]
        pool = self.pool
        self.saved_k[:, r, j] = pool.ring_k_layers[:, r, ring_pos]
        self.saved_v[:, r, j] = pool.ring_v_layers[:, r, ring_pos]
        self.saved_owner[r, j] = pool.entry_owner[entry]

    def restore(self, rows: torch.Tensor, seq_lens: torch.Tensor, accept_lens: torch.Tensor, n: int) -> None:
        """After the accept step: drafts j >= accept_lens[b] of request b were rejected; their ring
        entries and owners get back what save() kept. seq_lens: the lengths before the verify."""
        r, ring_pos, entry = self._entries(rows, seq_lens, n)
        j = self._j[None, :n]
        rejected = j >= accept_lens.to(torch.int64)[:, None]  # [B, n]
        pool = self.pool
        for ring, saved in ((pool.ring_k_layers, self.saved_k), (pool.ring_v_layers, self.saved_v)):
            keep = rejected[None, :, :, None, None]
            ring[:, r, ring_pos] = torch.where(keep, saved[:, r, j], ring[:, r, ring_pos])
        pool.entry_owner[entry] = torch.where(rejected, self.saved_owner[r, j], pool.entry_owner[entry])


# The rollback of this process's INT2 pool (one target pool per scheduler process), for the hook
# on SGLang's accept step, which sees the batch but not the pool.
_ACTIVE: list[DraftRollback] = []


def activate(rollback: DraftRollback) -> None:
    _ACTIVE[:] = [rollback]


def active() -> DraftRollback | None:
    return _ACTIVE[0] if _ACTIVE else None


def after_accept(batch, accept_lens: torch.Tensor, num_draft_tokens: int) -> None:
    """SGLang accepted accept_lens[b] of request b's num_draft_tokens drafts (the bonus token
    included): give the rejected ones' ring entries back. batch: the verified ScheduleBatch
    (req_pool_indices, seq_lens = the lengths before the verify)."""
    rollback = active()
    if rollback is None or accept_lens is None or accept_lens.numel() == 0:
        return
    rollback.restore(batch.req_pool_indices, batch.seq_lens, accept_lens, int(num_draft_tokens))
