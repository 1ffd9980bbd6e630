"""Prefill-decode disaggregation (PD) with the INT2 pool: its buffers in the form SGLang's KV
managers register and copy, the per-request BF16 side rows as per-request state, the string the
two sides compare, the decode side's row bookkeeping, and the PD settings it cannot serve (hooks.py
registers and verifies the hooks below at start). Measured by bench/pd.py
(bench/results/pd_h200.json): Mooncake's TCP transport moves the INT2 pages and side rows between
two servers on one H200, and the decode server answers as a single server does.

How SGLang 0.5.17 moves KV (disaggregation/prefill.py, decode.py, utils.py, mooncake/conn.py,
nixl/conn.py):
* both sides register `pool.get_contiguous_buf_infos()` -> (ptrs, lens, item_lens), one entry per
  buffer; a request's pages are sent as `ptr + page * item_len` for `item_len` bytes (runs of
  consecutive pages as one block), page = slot // page_size, for every entry;
* the MHA sender (`_send_kvcache_generic` with `get_mha_kv_ptrs_with_pp`) cuts the list in two
  equal halves, K then V, pairs source entry i with destination entry i (same layer count on both
  sides) and uses item_lens[i] for entry i of the K half and item_lens[n + i] for the V half;
* per-request state travels as state components (`setup_state_kv_args` fills kv_args.state_*):
  for MAMBA, entry i of the component is copied from `ptr + index * item_len` for `item_len`
  bytes (`_send_mamba_state`), with one index per request on each side,
  `req_to_token_pool.req_index_to_mamba_index_mapping[req_pool_idx]` (prefill.py's and decode.py's
  `_mamba_payload`); it is sent with the request's last chunk, after its forward.

Head-major buffers: the INT2 pool stores each layer's codes and params as [H, N, ...] memory
viewed as [N, H, ...], so one head's page is contiguous but a page's heads are N slots apart.
One entry per buffer cannot say that with `ptr + page * item_len`, so the list has one entry per
(layer, head) of each buffer: ptr = the head's base, item_len = one page of that head. The
contract allows it (entries are opaque byte regions; nothing but the half split and the
per-layer PP slicing reads their count) and it is what `send_kvcache` does for any entry. Costs:
H times as many transfer blocks per page run (and registered regions), and a prefill and decode
with different PP sizes would be sliced by "layer" index into the wrong entries
(pd_parallel_problems refuses that).

Wired (the hooks' bodies are in pd_hooks.py; hooks.py registers them):
* pool.get_contiguous_buf_infos / get_state_buf_infos return contiguous_buf_infos /
  state_buf_infos (pool.py);
* setup_state_kv_args (AFTER, after_setup_state_kv_args): on both sides, for an INT2 pool, appends
  a MAMBA state component of state_buf_infos (SGLang's own dispatch appends nothing for a pool
  class it does not know) and gives the ReqToTokenPool / DecodeReqToTokenPool the identity
  `req_index_to_mamba_index_mapping` (the side rows are the request rows), so a request's sink,
  ring, own_start and sink_start travel with its last chunk; the ring holds the open page's keys;
* DecodePreallocQueue._pre_alloc (AROUND, around_pre_alloc): the decode side's row of a request
  is noted as received (pool.note_received_rows): no reset after the state lands, and the next
  forward drops the side-copy pointers of the row and its slots (they are not sent);
* CommonKVManager.__init__ (BEFORE, before_kv_manager_init): an int2 server registers (prefill,
  inside __init__) and compares (decode) compat_dtype_string, "int2:<format>:<rotation sha256
  prefix>", instead of the bare "int2";
* CommonKVManager.try_ensure_parallel_info (AROUND, around_try_ensure_parallel_info): the decode
  side's pairing check names both INT2 formats when the strings differ, and refuses a prefill
  with another attention TP or PP size (only known at pairing: the two servers start apart);
* refused at start (refusals.server_args_problems via pd_start_problems): decode-side radix cache
  and offload, speculative decoding with a draft model, transfer backends other than mooncake /
  nixl, SGLANG_DISAGG_STAGING_BUFFER;
* retraction on the decode side (a decode server short of KV slots): a request's pages and side
  row go to host memory and back through runtime/retraction.py (hooked Req.offload_kv_cache /
  load_kv_cache), not the pool's per-slot get_cpu_copy;
* the decode side's side rows: DecodeReqToTokenPool has max_running_requests +
  disaggregation_decode_extra_slots + 1 rows, and the pool has as many side rows (configurator.py,
  sized by sizing.plan_pool's extra_rows).

Open:
* the side rows travel whole (sink + the full ring of every layer: 3.0 MB a request on
  SmolLM2-135M as logged, about 17 MB on Llama-3.1-8B by its shapes) whatever the prompt's length, since SGLang sends a
  state component's item as one block; short prompts pay for it in transfer bytes per token;
* SGLang writes the transferred state with no ordering against the decode server's forward stream
  (as for Mamba state): a row freed by a request whose last forward is still in flight (overlap
  scheduling) could be written by a transfer while that forward reads it; not measured.
"""
from __future__ import annotations

import torch

INT2 = "int2"
# the rotation hash's prefix in the compatibility string: enough to tell files apart, short
# enough for an error message
ROTATION_PREFIX = 16


# ------------------------------------------------------------------------------------ KV pages


def _head_entries(t: torch.Tensor, rows_per_item: int) -> list[tuple[int, int, int]]:
    """(ptr, len, item_len) of each head of a head-major [R, H, ...] view: item = rows_per_item
    consecutive rows of one head (a page of slots, or one per-page parameter row)."""
    es = t.element_size()
    inner = t[0, 0].numel()
    # the layout this relies on: a head's rows are contiguous and heads are R rows apart
    assert t.stride(0) == inner and t.stride(1) == t.shape[0] * inner and t[0, 0].is_contiguous(), \
        (tuple(t.shape), t.stride())
    row_bytes = inner * es
    return [(t.data_ptr() + h * t.stride(1) * es, t.shape[0] * row_bytes, rows_per_item * row_bytes)
            for h in range(t.shape[1])]


def _slot_rows_per_item(pool, t: torch.Tensor) -> int:
    """Rows of t that make one page: page_size for slot-indexed buffers, 1 for per-page ones
    (per-channel key params, one row per page)."""
    n_slots = pool.k_codes[0].shape[0]
    if t.shape[0] == n_slots:
        return pool.page_size
    assert t.shape[0] * pool.page_size == n_slots, (tuple(t.shape), n_slots, pool.page_size)
    return 1


def kv_buffer_names(pool) -> list[tuple[str, int, int]]:
    """(buffer, local layer, head) of each entry of contiguous_buf_infos, in its order: the K half
    (key codes then key params, layer by layer, head by head) and the V half (value codes and
    params) in the same order, so both halves have 2 * layers * heads entries."""
    L, H = len(pool.k_codes), pool.head_num
    names = []
    for half in (("k_codes", "k_params"), ("v_codes", "v_params")):
        names += [(name, i, h) for i in range(L) for name in half for h in range(H)]
    return names


def contiguous_buf_infos(pool) -> tuple[list[int], list[int], list[int]]:
    """(ptrs, lens, item_lens) of the pool's INT2 buffers for the KV managers: one entry per
    (buffer, layer, head), listed as kv_buffer_names says, page-granular (entry e of page p is
    ptrs[e] + p * item_lens[e], item_lens[e] bytes).

    Key codes, value codes, per-token params: item = page_size slots of one head. Per-channel key
    params: item = the page's one row of (scale, min) per channel of one head. The open (not yet
    full) page of a request has no key codes or params yet in the per-channel layout; its keys
    travel in the ring (state_buf_infos)."""
    ptrs, lens, items = [], [], []
    for name, i, h in kv_buffer_names(pool):
        t = getattr(pool, name)[i]
        ptr, n, item = _head_entries(t, _slot_rows_per_item(pool, t))[h]
        ptrs.append(ptr)
        lens.append(n)
        items.append(item)
    return ptrs, lens, items


# ------------------------------------------------------------------------------------ request rows


def state_buffer_names(pool) -> list[tuple[str, int | None]]:
    """(buffer, local layer or None) of each entry of state_buf_infos, in its order."""
    L = len(pool.k_codes)
    names = [(name, i) for name in ("sink_k_layers", "sink_v_layers", "ring_k_layers", "ring_v_layers")
             for i in range(L)]
    return names + [("own_start", None), ("sink_start", None)]


def state_buf_infos(pool) -> tuple[list[int], list[int], list[int]]:
    """(ptrs, lens, item_lens) of each request row's side state, in the form of SGLang's
    `get_state_buf_infos` for Mamba (one entry per tensor and layer, item = one request row; the
    row of entry e is ptrs[e] + row * item_lens[e]). The index is the request's row in the pool,
    its req_pool_idx (state_index).

    Entries (state_buffer_names): BF16 sink K / V and ring K / V of every layer, then own_start and
    sink_start (int32, first position whose ring / sink copy the row holds: without them the decode
    side would trust nothing, or stale rows).

    Why the ring covers the open page: in the per-channel layout a page's keys are quantised only
    when its last position is stored, so after a prefill of T tokens the page holding T-1 (unless
    T is a multiple of the page size) has no key codes or params yet; readers take those keys from
    the ring, which holds the last W >= page_size positions (the formats require it). Sending the
    ring with own_start sends exactly those keys, and the decode side's store of the page's last
    position quantises the page from the same ring entries. Values are per token, in the page.

    Not sent: slot_entry / entry_owner (which slot's copy sits in which row entry). They serve radix
    hits carrying side copies into a new row; the decode side inherits no radix hits (its radix
    cache is refused, pd_decode_cache_problems), and decode steps read the ring by position."""
    ptrs, lens, items = [], [], []
    for name, i in state_buffer_names(pool):
        t = getattr(pool, name)
        t = t if i is None else t[i]
        assert t.is_contiguous(), name
        ptrs.append(t.data_ptr())
        lens.append(t.nbytes)
        items.append(t[0].nbytes)
    return ptrs, lens, items


def state_index(req_pool_idx: int) -> list[int]:
    """The state index list of one request, as the prefill side sends Mamba's: the pool's request
    rows are SGLang's req_to_token rows, so the index is the request's req_pool_idx."""
    return [int(req_pool_idx)]


# ------------------------------------------------------------------------------------ pairing


def compat_dtype_string(info: dict) -> str:
    """The kv_cache_dtype the two sides of PD compare (`CommonKVManager.kv_cache_dtype_str`,
    registered with the bootstrap server and checked by `try_ensure_parallel_info`): "int2", the KV
    format and a prefix of the rotation file's sha256, so that servers whose bytes mean different
    things do not pair. info: the pool's info / RUNTIME_INFO (configurator.build_pool)."""
    rot = str(info.get("rotation_sha256") or "none")[:ROTATION_PREFIX]
    return f"{INT2}:{info['kv_format']}:{rot}"


def parse_compat(value: str | None) -> tuple[str, str] | None:
    """(format, rotation prefix) of a compat_dtype_string, None for anything else (a BF16 / FP8
    server, or an int2 server that does not send the format)."""
    if not value or not str(value).startswith(INT2 + ":"):
        return None
    parts = str(value).split(":")
    return (parts[1], parts[2]) if len(parts) == 3 else None


def mismatch_message(prefill: str | None, decode: str | None) -> str | None:
    """Why a prefill with kv_cache_dtype `prefill` and a decode with `decode` cannot pair, naming
    both INT2 formats; None when they can (equal strings)."""
    if prefill == decode:
        return None
    p, d = parse_compat(prefill), parse_compat(decode)

    def side(s, parsed):
        if parsed is None:
            return f"kv_cache_dtype={s}"
        return f"INT2 KV format {parsed[0]} with rotation sha256 {parsed[1]}..."

    return (f"INT2 PD servers cannot pair: the prefill server serves {side(prefill, p)} and the decode "
            f"server {side(decode, d)}. Both must use the same --kv-cache-dtype, OSCAR_KV_FORMAT and "
            f"rotation file (INT2 pages are only meaningful in the format and rotation that wrote them).")


# ------------------------------------------------------------------------------------ refusals


def pd_parallel_problems(prefill_attn_tp: int, decode_attn_tp: int,
                         prefill_pp: int = 1, decode_pp: int = 1) -> list[str]:
    """Parallel layouts the INT2 transfer cannot serve (as refusals.py: a list of problems)."""
    p = []
    if int(prefill_attn_tp) != int(decode_attn_tp):
        p.append(f"PD with different attention TP sizes (prefill {prefill_attn_tp}, decode "
                 f"{decode_attn_tp}) is not supported with the INT2 KV cache: SGLang's head-sliced "
                 f"transfer (send_kvcache_slice) assumes token-major BF16 rows, while INT2 pages are "
                 f"head-major codes with per-page parameters and BF16 side rows. Use the same TP size "
                 f"on both sides.")
    if int(prefill_pp) != int(decode_pp):
        p.append(f"PD with different PP sizes (prefill {prefill_pp}, decode {decode_pp}) is not "
                 f"supported with the INT2 KV cache: its buffer list has one entry per (layer, head), "
                 f"which SGLang's PP slicing reads as one entry per layer. Use the same PP size.")
    return p


def pd_decode_cache_problems(args) -> list[str]:
    """Decode-side options the INT2 pool cannot serve with PD (ServerArgs or a stand-in)."""
    if getattr(args, "disaggregation_mode", "null") != "decode":
        return []
    p = []
    if getattr(args, "disaggregation_decode_enable_radix_cache", False):
        p.append("--disaggregation-decode-enable-radix-cache is not supported with the INT2 KV cache: "
                 "transferred rows carry no record of which slot's BF16 copy they hold, so a radix hit "
                 "on the decode side would read its sink and recent tokens as INT2. Drop the flag.")
    if getattr(args, "disaggregation_decode_enable_offload_kvcache", False):
        p.append("--disaggregation-decode-enable-offload-kvcache is not supported with the INT2 KV "
                 "cache: host offload copies KV slots in SGLang's BF16 layout and not the side rows. "
                 "Drop the flag.")
    return p


def pd_draft_problems(args) -> list[str]:
    """Speculative decoding with PD: SGLang appends the draft pool's BF16 entries to the INT2 list
    and cuts the whole list in K / V halves, which no longer fall on the INT2 K / V boundary."""
    alg = getattr(args, "speculative_algorithm", None)
    if getattr(args, "disaggregation_mode", "null") in (None, "null") or not alg or str(alg).upper() == "NGRAM":
        return []
    return [f"PD with --speculative-algorithm {alg} is not supported with the INT2 KV cache: the draft "
            f"model's BF16 KV would be transferred in one list with the INT2 buffers, split into K and V "
            f"halves that do not match either pool. Use NGRAM (no draft model) or no speculation."]


# transfer backends whose KV and state addressing was read for the INT2 entries (per-entry item
# lengths, one state index a request); "fake" (decode-side warmup) moves nothing
PD_TRANSFER_BACKENDS = ("mooncake", "nixl", "fake")


def pd_transfer_problems(args, env) -> list[str]:
    """Transfer settings the INT2 entries are not known to work with."""
    p = []
    backend = getattr(args, "disaggregation_transfer_backend", None)
    if backend is not None and backend not in PD_TRANSFER_BACKENDS:
        p.append(f"--disaggregation-transfer-backend {backend} is not supported with the INT2 KV cache: "
                 f"only mooncake and nixl were checked to copy its per-(layer, head) page entries and its "
                 f"side rows as SGLang registers them. Use --disaggregation-transfer-backend mooncake or nixl.")
    if str(env.get("SGLANG_DISAGG_STAGING_BUFFER", "")).lower() in ("1", "true", "yes"):
        p.append("SGLANG_DISAGG_STAGING_BUFFER is not supported with the INT2 KV cache: the staging path "
                 "gathers K / V rows of SGLang's BF16 pool layout. Unset it (the INT2 transfer needs the "
                 "same TP size on both sides anyway).")
    return p


def pd_start_problems(args, env) -> list[str]:
    """Everything about a PD server (ServerArgs or a stand-in) the INT2 pool refuses at start; the
    other side's parallel sizes are checked at pairing (around_try_ensure_parallel_info)."""
    if getattr(args, "disaggregation_mode", "null") in (None, "null"):
        return []
    return pd_decode_cache_problems(args) + pd_draft_problems(args) + pd_transfer_problems(args, env)
