"""BF16 sink copies kept with the slot of position 0, for radix hits that outlive their row.

A request's first S tokens (the attention sinks) stay in BF16 in its request row; a later request
that shares the prefix through the radix cache copies them into its own row while that row still
holds them (pool.carry_over_side_copies). Rows are handed out first-in first-out, so after enough
requests the owner's row is reused and a hit on the same cached pages read its sink as INT2: the
same prompt got different attention depending on how many requests came in between (0.53-0.57
relative change of attention in docs/design.md's experiment). The sink belongs to the cached
prefix, not to a row, so this store keeps it by the slot of the prefix's position 0:

* note_first_slots (an extend whose requests write their own position 0): each row's slot of
  position 0;
* publish (rows handed to new requests, before their bookkeeping is reset): the sink of each row
  that holds all of it, and holds the latest copy (the slot still points at the row), goes to the
  next entry, and pool.slot_entry of its position-0 slot points there (entry ids past the rows'
  sink and ring entries);
* lookup (a radix hit whose owner row no longer holds the sink): the entry that slot points to,
  if it is still that slot's (its owner matches) - the copy a cold prefill would have.

A slot written again (its page reused) gets a new pointer from the store kernel, so a stale copy
is never found. Entries are reused in turn (one a request row, within 1% of the KV budget:
sizing.sink_store_plan), so a prefix keeps its BF16 sink until about that many other sinks were
kept; after that a hit reads the sink as INT2, as before. No host
synchronisation: masked gathers / scatters, entry numbers counted on the device. Slot 0 is
SGLang's padding slot: masked-out lanes write their pointer there.
"""
from __future__ import annotations

import torch


class SlotSinkStore:
    def __init__(self, pool, entries: int):
        """entries: sizing.sink_store_plan's count, the one rows with nothing to keep write included."""
        self.pool = pool
        sk, sv = pool.sink_k_layers, pool.sink_v_layers
        L, R, S, H, D = sk.shape
        self.n = max(0, int(entries) - 1)  # kept in turn; entry n: where rows with nothing to keep write
        # ids in pool.slot_entry: after the rows' sink and ring entries (pool.entry_owner's range)
        self.base = int(pool.entry_owner.numel())
        dev = sk.device
        # (entry n is never found: its owner stays -1)
        self.k = torch.zeros((L, self.n + 1, S, H, D), dtype=sk.dtype, device=dev)
        self.v = torch.zeros((L, self.n + 1, S, H, sv.shape[-1]), dtype=sv.dtype, device=dev)
        self.owner = torch.full((self.n + 1,), -1, dtype=torch.int64, device=dev)  # slot of position 0
        self.row_slot0 = torch.full((R,), -1, dtype=torch.int64, device=dev)  # each row's, if it holds the sink
        self._next = torch.zeros((), dtype=torch.int64, device=dev)  # the next entry, counted on the device

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.owner, self.row_slot0))

    def note_first_slots(self, rows: torch.Tensor, slot0: torch.Tensor, take: torch.Tensor) -> None:
        """rows[take] hold (or are about to hold) the sink of the prefix whose position 0 is slot0."""
        rows = rows.to(torch.int64)
        self.row_slot0[rows] = torch.where(take, slot0.to(torch.int64), self.row_slot0[rows])

    def publish(self, rows: torch.Tensor) -> None:
        """Before rows are reset: keep the sink of each that holds all of it, by its position-0 slot."""
        if rows.numel() == 0 or self.n == 0:
            return
        pool = self.pool
        rows = rows.to(torch.int64)
        slot0 = self.row_slot0[rows]
        # the row holds the whole sink and is its latest holder: the slot's pointer is the row's
        # entry (a hit that copied it moved the pointer to its own row; the slot written again,
        # for another prefix, moved it anywhere else), so a stale copy is never kept for the slot
        first = rows * pool.sink
        ok = ((pool.sink_start[rows] == 0) & (slot0 > 0)
              & (pool.slot_entry[slot0.clamp(min=0)].to(torch.int64) == first)
              & (pool.entry_owner[first].to(torch.int64) == slot0))
        # only rows that hold a sink take an entry, in turn (no host sync: a device counter)
        ids = torch.where(ok, (self._next + torch.cumsum(ok, 0) - 1) % self.n, self.n)
        self._next.copy_((self._next + ok.sum()) % self.n)
        keep = ok.view(1, -1, 1, 1, 1)
        for store, sink in ((self.k, pool.sink_k_layers), (self.v, pool.sink_v_layers)):
            store[:, ids] = torch.where(keep, sink[:, rows], store[:, ids])
        self.owner[ids] = torch.where(ok, slot0, torch.full_like(slot0, -1))  # entry n: -1 again
        pool.slot_entry[torch.where(ok, slot0, 0)] = torch.where(ok, self.base + ids, -1).to(torch.int32)
        self.row_slot0[rows] = -1

    def keep_loaded(self, slot0: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Sinks that arrive with pages loaded from a host tier (runtime/host_pool.py): k [L, P, S,
        H, D], v [L, P, S, H, Dv] for the prefixes whose position 0 is now slot0 [P]; kept like a
        published row's, so the radix hit that asked for the load finds them (lookup)."""
        if slot0.numel() == 0 or self.n == 0:
            return
        slot0 = slot0.to(device=self.owner.device, dtype=torch.int64)
        ids = (self._next + torch.arange(slot0.numel(), device=slot0.device)) % self.n
        self._next.copy_((self._next + slot0.numel()) % self.n)
        self.k[:, ids] = k.to(self.k.device)
        self.v[:, ids] = v.to(self.v.device)
        self.owner[ids] = slot0
        self.pool.slot_entry[slot0] = (self.base + ids).to(torch.int32)

    def lookup(self, slot0: torch.Tensor, need: torch.Tensor):
        """For hits whose position 0 is slot0: (entry, found) where its kept copy is still there."""
        slot0 = slot0.to(torch.int64)
        e = self.pool.slot_entry[slot0].to(torch.int64) - self.base
        inside = (e >= 0) & (e < self.n)
        e = torch.where(inside, e, 0)
        return e, need & inside & (self.owner[e] == slot0)
