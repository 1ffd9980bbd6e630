"""BF16 attention sinks kept by the request's first S token ids, for every request that starts with them.

A request's first S tokens (the attention sinks) are read in BF16 from its request row; read as
INT2 they change attention by about half (docs/design.md). Their keys and values depend on those
S token ids alone (causal attention over positions 0..S-1), not on the rest of the prompt, the
row, the slot, or the tier the prefix came back from. So once a request has computed its sink the
store keeps a copy under those ids (the LoRA adapter is part of the key), and a request whose
prefix comes from a cache (a radix hit on the device pool; a host or storage tier) copies it into
its row: it reads the sink as a cold prefill computes it, whatever happened to the rows, slots or
tiers in between. Chat templates start every prompt with the same tokens, so one entry usually
serves every chat request.

Host-side index, device-side copies, both on the forward stream's thread (pool.before_forward, at
the start of each forward; no host synchronisation):
* claim(row, prefix_len, key) for each row handed to a new request (the alloc hook's queue): a
  fresh prompt (prefix 0) computes its sink in this forward, so the row is kept under its key at
  the start of the next one (`publish`: the store kernel has run by then, in stream order, and a
  row handed on in between still holds it, since nothing writes a row before its next forward);
  a request with a cached prefix gets the stored sink copied into its row, if any.
* A fresh prompt whose key is already stored reads the stored copy too, from its next forward on
  (publish copies it over the row's own): the same values up to rounding, but the GEMMs that
  computed them round a row differently in a forward of another size, and a later hit of this
  prompt reads the stored copy. So every forward after a prompt's first, and every decode step,
  reads the sink bits its hits read (what makes a hit repeat a cold prompt's last forward exactly,
  runtime/prefill_split.py).
* Entries are least-recently-used within `entries` (sizing.sink_store_plan: as many as 1% of the
  KV budget holds, at most 4,096). A key that is not stored (evicted, or no key: a prompt shorter than
  the sink, embeddings instead of token ids) leaves a hit reading its sink as INT2, every time
  alike.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .device_index import to_device

Key = tuple


def sink_key(req, sink: int) -> Key | None:
    """The store key of a request (SGLang's Req): its first `sink` token ids and LoRA adapter; None
    where they do not name its sink (fewer tokens, input embeddings, multimodal inputs)."""
    ids = getattr(req, "origin_input_ids", None)
    if sink <= 0 or ids is None or len(ids) < sink or getattr(req, "input_embeds", None) is not None \
            or getattr(req, "multimodal_inputs", None) is not None:
        return None
    return (getattr(req, "lora_id", None), *(int(t) for t in ids[:sink]))


class TokenSinkStore:
    def __init__(self, pool, entries: int):
        self.pool = pool
        sk, sv = pool.sink_k_layers, pool.sink_v_layers
        L, R, S, H, D = sk.shape
        self.n = max(0, int(entries))
        self.k = torch.zeros((L, self.n, S, H, D), dtype=sk.dtype, device=sk.device)
        self.v = torch.zeros((L, self.n, S, H, sv.shape[-1]), dtype=sv.dtype, device=sv.device)
        self._index: OrderedDict[Key, int] = OrderedDict()  # key -> entry, least recently used first
        self._free = list(range(self.n))
        self._to_publish: dict[int, Key] = {}  # row -> key of the sink it computes this forward

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    def __len__(self) -> int:
        return len(self._index)

    def publish(self) -> None:
        """Keep the sinks the previous forward computed, or give their rows the stored copy where
        the key is stored (start of a forward, before any reset)."""
        pending, self._to_publish = self._to_publish, {}
        adopt_rows, adopt_entries = [], []
        for row, key in pending.items():
            if self.n == 0:
                continue
            if key in self._index:
                self._index.move_to_end(key)
                adopt_rows.append(row)
                adopt_entries.append(self._index[key])
                continue
            if self._free:
                e = self._free.pop()
            else:  # evict the least recently used
                _, e = self._index.popitem(last=False)
            self._index[key] = e
            self.k[:, e] = self.pool.sink_k_layers[:, row]
            self.v[:, e] = self.pool.sink_v_layers[:, row]
        self._copy_to_rows(adopt_rows, adopt_entries)

    def _copy_to_rows(self, rows: list[int], entries: list[int]) -> None:
        if rows:
            r = to_device(rows, torch.int64, self.k.device)
            e = to_device(entries, torch.int64, self.k.device)
            self.pool.sink_k_layers[:, r] = self.k[:, e]
            self.pool.sink_v_layers[:, r] = self.v[:, e]

    def claim(self, rows: list[int], prefix_lens: list[int], keys: list[Key | None]) -> list[int]:
        """Rows handed to new requests (their latest claim each): queue fresh prompts' sinks for
        the next publish, copy stored sinks into rows with a cached prefix. -> the rows that got one."""
        restored, entries = [], []
        for row, p, key in zip(rows, prefix_lens, keys):
            self._to_publish.pop(row, None)  # the row's previous claim computed nothing it keeps
            if key is None:
                continue
            if p == 0:
                self._to_publish[row] = key
            elif key in self._index:
                self._index.move_to_end(key)
                restored.append(row)
                entries.append(self._index[key])
        self._copy_to_rows(restored, entries)
        return restored
