"""OscarInt2KVPool: SGLang's token->KV pool, with INT2 codes as the source of truth.

Per local layer (see kernels/oscar_kernels/ops.py for the exact layout), in the served KV format
(runtime/kv_format.py), whose layout strategy (runtime/layouts.py, `pool.layout`) shapes the key
buffers and runs the store:
* slot-indexed quantised K and V. "token" layout: codes uint8 [N, H, D/4] and fp16 (scale, min)
  [N, H, D/G, 2] for both. "channel" layout (the default): key codes uint8 [N, H, bits*D/8] with
  one fp16 (scale, min) per (page, head, channel) [N/B, H, D, 2] (B = the page size; a page's keys
  are quantised when its last position is stored, until then they are read from the ring), values
  as in the token layout.
  Every token is written here; it is the only per-slot content, so SGLang's radix sharing,
  dedup, eviction and retraction work unchanged (a slot means the same thing to every reader).
* request-row-indexed BF16 side buffers: sink [rows, S, H, D] (positions < S) and recent ring
  [rows, W, H, D] (position p at p % W), rows = max_running_requests + 1 (row 0 is SGLang's
  padding row, used by padded CUDA-graph slots).
* own_start / sink_start int32 [rows]: first position whose ring / sink copy the readers take.
  Normally the first position the request computed itself (with OSCAR_PREFILL_READS=cache a
  page-canonical extend moves own_start to the start of its last incomplete page:
  backend._prepare_canonical); earlier
  positions came from a cache and are read as INT2, except the sink, which a hit gets from the
  sink store (below). A hit never reads another row's ring copies: what it reads must not depend
  on whether that row still holds them.
* slot_entry int32 [N] and entry_owner int32 [rows * (S + W)]: where each slot's side copy lives
  (written by the store) and which slot each entry holds now (the speculative rollback restores
  them for rejected drafts).
* sinks (runtime/sink_store.py): BF16 sinks kept by the request's first S token ids, copied into
  the row of every request whose prefix comes from a cache.

Row bookkeeping: when SGLang hands a request a row (ReqToTokenPool.alloc, hooked), the row id,
the request's cached-prefix length and its sink key are queued here; the attention backend
applies them at the start of the next forward, on the forward stream (the alloc runs on the
scheduler stream, which may run ahead of a forward still reading that row). SGLang allocates a
batch's rows right before launching that batch's forward, on the same thread, so the forward
that applies a claim is the request's first. On the decode side of PD a row's side state arrives
with its pages, by transfer (runtime/pd_buffers.py): such rows are not reset, only their side-copy
pointers dropped (note_received_rows).

Only the oscar_triton backend reads or writes this pool; `set_kv_buffer` refuses, so nothing can
silently store unrotated BF16 bytes into it.
"""
from __future__ import annotations

import logging
import threading

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import KVCache

from oscar_kernels.format import Int2Format, code_bytes

from .device_index import to_device
from .draft_rollback import DraftRollback
from .sink_store import TokenSinkStore, sink_key
from .kv_format import ServedFormat
from .layouts import KVLayout, layout_for

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
HP_DTYPE = torch.bfloat16

# (row, cached-prefix length, sink key) handed out by ReqToTokenPool.alloc since the last forward
# (see module docstring); the sink's token count, set by the pool (the keys are its first ids)
_pending_rows: list[tuple[int, int, tuple | None]] = []
_pending_lock = threading.Lock()
# (row, tokens) of rows whose side state arrives by PD transfer (note_received_rows)
_received_rows: list[tuple[int, int]] = []
_sink_tokens = [0]


def note_new_rows(rows, prefix_lens=None, reqs=None) -> None:
    """Called from the ReqToTokenPool.alloc hook (scheduler thread): CPU only, no GPU work."""
    if rows:
        prefix_lens = prefix_lens if prefix_lens is not None else [0] * len(rows)
        keys = [None] * len(rows) if reqs is None else [sink_key(r, _sink_tokens[0]) for r in reqs]
        with _pending_lock:
            _pending_rows.extend((int(r), int(p), k) for r, p, k in zip(rows, prefix_lens, keys))


def take_pending_rows() -> list[tuple[int, int, tuple | None]]:
    with _pending_lock:
        rows = list(_pending_rows)
        _pending_rows.clear()
    return rows


def note_received_rows(rows, n_tokens) -> None:
    """Called from the DecodePreallocQueue._pre_alloc hook (the decode side of PD; scheduler
    thread, CPU only): these rows' side state (sink, ring, own_start, sink_start) comes from the
    prefill server by transfer, which may land before the next forward. A reset queued for them
    by the alloc hook would then set the received state back to "trust nothing", so it is
    withdrawn; the next forward only drops the side-copy pointers of the rows and of their first
    n_tokens slots (apply_pending_resets). (SGLang's DecodeReqToTokenPool.alloc is not
    ReqToTokenPool.alloc and queues no reset; a pool class inheriting that alloc would.)"""
    rows = [int(r) for r in rows]
    with _pending_lock:
        drop = set(rows)
        _pending_rows[:] = [c for c in _pending_rows if c[0] not in drop]
        _received_rows.extend(zip(rows, (int(n) for n in n_tokens)))


def take_received_rows() -> list[tuple[int, int]]:
    with _pending_lock:
        rows = list(_received_rows)
        _received_rows.clear()
    return rows


class OscarInt2KVPool(KVCache):
    def __init__(
        self,
        size: int,
        page_size: int,
        head_num: int,
        head_dim: int,
        v_head_dim: int,
        layer_num: int,
        device: str,
        *,
        req_rows: int,
        kv_format: ServedFormat,
        sink_store_entries: int | None = None,  # sizing.sink_store_plan's (None: one a row)
        k_clip: list[float],
        v_clip: list[float],
        k_rotation: torch.Tensor | None = None,   # [L_local, H_local, D, D] fp32 (or None)
        v_rotation: torch.Tensor | None = None,   # [L_local, H_local, Dv, Dv] fp32 (or None)
        start_layer: int | None = None,
        end_layer: int | None = None,
        enable_memory_saver: bool = False,
        info: dict | None = None,
    ):
        super().__init__(
            size,
            page_size,
            torch.uint8,  # not BF16: also keeps models' fused RoPE+KV-store paths off
            layer_num,
            device,
            enable_memory_saver,
            start_layer,
            end_layer,
            allocation_label="OSCAR INT2",
        )
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        fmt = self.kv_format = kv_format
        assert (fmt.head_dim, fmt.v_head_dim) == (head_dim, v_head_dim), (fmt, head_dim, v_head_dim)
        self.layout: KVLayout = layout_for(fmt)
        self.layout.check_page_size(page_size)
        self.k_format = self.layout.k_format(head_dim)
        self.v_format = Int2Format(v_head_dim, fmt.v_group)
        sink, recent = self.sink, self.recent = fmt.sink, fmt.recent
        self.req_rows = req_rows
        assert len(k_clip) == layer_num and len(v_clip) == layer_num
        self.k_clip = [float(c) for c in k_clip]
        self.v_clip = [float(c) for c in v_clip]
        self.info = dict(info or {})

        n = size + page_size  # slot 0 (and the first page) is SGLang's padding slot
        n = -(-n // page_size) * page_size  # whole pages (channel key params are per page)
        H, D, Dv = head_num, head_dim, v_head_dim
        first = self.start_layer
        k_bytes = [code_bytes(fmt.k_bits[first + i], D) for i in range(layer_num)]
        k_param_shape = self.layout.k_param_shape(n, page_size, H, D)
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            def z(shape, dtype):
                return torch.zeros(shape, dtype=dtype, device=device)

            def head_major(shape, dtype):
                # [N, H, ...] view of [H, N, ...] memory: a decode program reads one KV head's
                # keys, which are then contiguous (5-10% faster decode on the H100 than
                # slot-major rows; docs/format.md "Byte layout")
                return z((shape[1], shape[0], *shape[2:]), dtype).transpose(0, 1)

            self.k_codes = [head_major((n, H, k_bytes[i]), torch.uint8) for i in range(layer_num)]
            self.v_codes = [head_major((n, H, Dv // 4), torch.uint8) for _ in range(layer_num)]
            self.k_params = [head_major(k_param_shape, torch.float16) for _ in range(layer_num)]
            self.v_params = [head_major((n, H, self.v_format.n_groups, 2), torch.float16) for _ in range(layer_num)]
            # one tensor over the layers, a view per layer (the same [rows, S / W, H, D] as one
            # tensor a layer): a speculative step's rejected drafts are rolled back, and a row's
            # sink kept by page (sink_store.py), in every layer at once
            self.sink_k_layers = z((layer_num, req_rows, sink, H, D), HP_DTYPE)
            self.sink_v_layers = z((layer_num, req_rows, sink, H, Dv), HP_DTYPE)
            self.sink_k = list(self.sink_k_layers.unbind(0))
            self.sink_v = list(self.sink_v_layers.unbind(0))
            self.ring_k_layers = z((layer_num, req_rows, recent, H, D), HP_DTYPE)
            self.ring_v_layers = z((layer_num, req_rows, recent, H, Dv), HP_DTYPE)
            self.ring_k = list(self.ring_k_layers.unbind(0))
            self.ring_v = list(self.ring_v_layers.unbind(0))
            # INT32_MAX: a row nobody has claimed trusts no side buffer
            self.own_start = torch.full((req_rows,), INT32_MAX, dtype=torch.int32, device=device)
            self.sink_start = torch.full((req_rows,), INT32_MAX, dtype=torch.int32, device=device)
            self.slot_entry = torch.full((n,), -1, dtype=torch.int32, device=device)
            self.entry_owner = torch.full((req_rows * (sink + recent),), -1, dtype=torch.int32, device=device)

        def per_layer(rot, d):
            if rot is None:
                return [None] * layer_num
            rot = rot.to(device=device, dtype=torch.float32)
            assert rot.dim() == 4 and rot.shape[0] == layer_num and rot.shape[-1] == d, rot.shape
            if rot.shape[1] == 1:  # one matrix shared by all heads: broadcast view, no copy
                rot = rot.expand(layer_num, H, d, d)
            assert rot.shape[1] == H, (rot.shape, H)
            return [rot[i] for i in range(layer_num)]

        self.k_rot = per_layer(k_rotation, D)
        self.v_rot = per_layer(v_rotation, Dv)
        # speculative decoding: what rejected drafts overwrite (enable_draft_rollback)
        self.drafts: DraftRollback | None = None
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            # sinks kept by their token ids, for every request whose prefix comes from a cache
            self.sinks = TokenSinkStore(self, req_rows if sink_store_entries is None else sink_store_entries)
        _sink_tokens[0] = sink
        self._finalize_allocation_log(size)

    def enable_draft_rollback(self, num_draft_tokens: int) -> DraftRollback:
        """Buffers that let a speculative verify of up to num_draft_tokens drafts per request be
        undone for its rejected drafts (runtime/draft_rollback.py); once, by the backend."""
        if self.drafts is None or self.drafts.n < num_draft_tokens:
            with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
                self.drafts = DraftRollback(self, num_draft_tokens)
        return self.drafts

    # ---------------------------------------------------------------- sizes and info
    def _int2_bytes(self) -> int:
        """Per-slot bytes: INT2 codes and params of every layer + the slot's side-copy pointer."""
        return (sum(t.numel() * t.element_size() for ts in (self.k_codes, self.v_codes, self.k_params, self.v_params) for t in ts)
                + self.slot_entry.numel() * 4)

    def _side_bytes(self) -> int:
        bookkeeping = (self.own_start, self.sink_start, self.entry_owner)
        rollback = () if self.drafts is None else (self.drafts.saved_k, self.drafts.saved_v, self.drafts.saved_owner)
        return (sum(t.numel() * t.element_size() for ts in (self.sink_k, self.sink_v, self.ring_k, self.ring_v) for t in ts)
                + sum(t.numel() * 4 for t in bookkeeping)
                + sum(t.numel() * t.element_size() for t in rollback))

    def get_kv_size_bytes(self):
        """(K bytes, V bytes), side buffers split evenly (they hold K and V alike)."""
        k = sum(t.numel() * t.element_size() for ts in (self.k_codes, self.k_params, self.sink_k, self.ring_k) for t in ts)
        v = sum(t.numel() * t.element_size() for ts in (self.v_codes, self.v_params, self.sink_v, self.ring_v) for t in ts)
        return k, v

    def usage_bytes(self) -> dict:
        return {"int2_bytes": self._int2_bytes(), "side_buffer_bytes": self._side_bytes(),
                "sink_store_bytes": self.sinks.bytes()}

    # ---------------------------------------------------------------- row bookkeeping
    def apply_pending_resets(self, req_to_token: torch.Tensor | None = None) -> None:
        """Forward stream, eager, before the forward: keep the sinks the previous forward computed,
        then reset the rows handed out since (they trust no side copy yet) and give those with a
        cached prefix their sink from the store. Rows whose side state came by PD transfer
        (note_received_rows) keep it. req_to_token: the backend's table (the slots of received
        rows; None: their slots are left alone)."""
        self.sinks.publish()
        received = take_received_rows()
        if received:  # first: a claim queued after the receipt is a later owner of the row
            self._drop_side_pointers(received, req_to_token)
        pending = take_pending_rows()
        if not pending:
            return
        latest = {r: (p, k) for r, p, k in pending}  # a row's latest claim wins
        rows = sorted(latest)
        idx = to_device(rows, torch.int64, self.own_start.device)
        self.own_start.index_fill_(0, idx, INT32_MAX)
        self.sink_start.index_fill_(0, idx, INT32_MAX)
        restored = self.sinks.claim(rows, [latest[r][0] for r in rows], [latest[r][1] for r in rows])
        if restored:
            self.sink_start.index_fill_(0, to_device(restored, torch.int64, idx.device), 0)

    def _drop_side_pointers(self, received: list[tuple[int, int]], req_to_token) -> None:
        """Rows whose side state came by PD transfer and the slots it filled: no side-copy
        pointers (slot_entry / entry_owner are not sent, and what the decode side's rows and
        slots held belonged to earlier requests; -1 is the store's rule for a fresh write, as the
        host tier's loads). own_start / sink_start and the sink / ring copies are the transferred
        ones and stay; the row keeps no sink in the store (its request computed none here)."""
        rows = sorted({r for r, _ in received})
        self.sinks.claim(rows, [0] * len(rows), [None] * len(rows))
        dev = self.entry_owner.device
        r = to_device(rows, torch.int64, dev)[:, None]
        S, W = self.sink, self.recent
        # entry ids as the store writes them: sink r * S + p, ring R * S + r * W + p % W
        entries = torch.cat([r * S + torch.arange(S, device=dev),
                             self.req_rows * S + r * W + torch.arange(W, device=dev)], 1)
        self.entry_owner[entries.reshape(-1)] = -1
        if req_to_token is not None:
            slots = torch.cat([req_to_token[row, :n] for row, n in received])
            self.slot_entry[slots.to(device=dev, dtype=torch.int64)] = -1

    def note_extend(self, req_pool_indices: torch.Tensor, extend_prefix_lens: torch.Tensor) -> None:
        """A request computes positions >= its prefix length itself (first chunk: the cached
        prefix; a sink from the store already set sink_start to 0)."""
        rows = req_pool_indices.to(torch.int64)
        pre = extend_prefix_lens.to(torch.int32)
        for start in (self.own_start, self.sink_start):
            cur = start.index_select(0, rows)
            start.index_copy_(0, rows, torch.minimum(cur, pre))

    # ---------------------------------------------------------------- per-layer access
    def local(self, layer_id: int) -> int:
        return layer_id - self.start_layer

    def store(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        token_rows: torch.Tensor,
        token_seq_lens: torch.Tensor,
        **channel_options,
    ) -> None:
        """Quantise already-rotated k [T, H, D], v [T, H, Dv] into slots `loc`, and copy the
        sink / recent positions into the token's request row (see ops.store_kv), in the pool's
        layout. `channel_options` (per-channel formats only): rot_k / q / q_out /
        one_token_per_request of ops.store_kv_channel (with rot_k, k arrives unrotated)."""
        i = self.local(layer_id)
        side = dict(
            positions=positions,
            token_rows=token_rows,
            token_seq_lens=token_seq_lens,
            sink_k=self.sink_k[i],
            sink_v=self.sink_v[i],
            ring_k=self.ring_k[i],
            ring_v=self.ring_v[i],
            # where each token's side copy lives: the same for every layer, recorded once
            slot_entry=self.slot_entry if i == 0 else None,
            entry_owner=self.entry_owner if i == 0 else None,
        )
        self.layout.store(self, i, layer_id, k, v, loc, side, **channel_options)

    def kernel_format_args(self, layer_id: int) -> dict:
        """The format keywords of this layer's store / decode / extend ops."""
        return self.layout.format_args(layer_id)

    def layer_buffers(self, layer_id: int) -> dict:
        """Keyword arguments shared by the decode / extend-prefix ops for one layer."""
        i = self.local(layer_id)
        return dict(
            k_codes=self.k_codes[i],
            k_params=self.k_params[i],
            v_codes=self.v_codes[i],
            v_params=self.v_params[i],
            sink_k=self.sink_k[i],
            sink_v=self.sink_v[i],
            ring_k=self.ring_k[i],
            ring_v=self.ring_v[i],
        )

    # ---------------------------------------------------------------- KVCache interface
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_codes[self.local(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_codes[self.local(layer_id)]

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_v_head_dim(self) -> int:
        return self.v_head_dim

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs) -> None:
        raise RuntimeError(
            "the OSCAR INT2 KV pool is written only by the oscar_triton attention backend "
            "(something tried to store BF16 K/V directly: an unsupported model path or backend)"
        )

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(
            "the OSCAR INT2 KV pool does not copy KV slots to host memory and back one by one "
            "(SGLang's get_cpu_copy / load_cpu_copy): its keys are quantised per page and a "
            "request's sink and recent tokens live in its request row. A retracted request's KV "
            "goes through runtime/retraction.py (hooked Req.offload_kv_cache / load_kv_cache); "
            "nothing else that copies slots this way is supported"
        )

    get_cpu_copy = _unsupported
    load_cpu_copy = _unsupported

    # PD disaggregation (runtime/pd_buffers.py): what SGLang's KV managers
    # register and copy, the INT2 pages per (buffer, layer, head) and the BF16 side rows of a
    # request as per-request state
    def get_contiguous_buf_infos(self):
        from .pd_buffers import contiguous_buf_infos

        return contiguous_buf_infos(self)

    def get_state_buf_infos(self):
        from .pd_buffers import state_buf_infos

        return state_buf_infos(self)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """SGLang's move of accepted speculative tokens to their final slots (NGRAM calls it after
        every verify, EAGLE for trees). With chains, the only speculation the plugin serves (trees
        are refused at start), accepted drafts already sit in their final slots: SGLang's verify
        writes draft j of a request to the slot of its position L + j, and the move's targets are
        the slots of positions L .. L + a - 1. Nothing moves. Rejected drafts are rolled back by
        DraftRollback, not here."""
        return None
