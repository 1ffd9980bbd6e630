"""Public kernel API used by the SGLang plugin (Triton on CUDA; TRITON_INTERPRET=1 on CPU).

Conventions shared by every op (see docs/format.md):
* One call = one layer. Pool tensors of that layer:
    k_codes  uint8   [N, H, D // 4]        k_params float16 [N, H, D // Gk, 2]  (scale, min)
    v_codes  uint8   [N, H, Dv // 4]       v_params float16 [N, H, Dv // Gv, 2]
    sink_k   bf16    [R, S, H, D]          sink_v   bf16    [R, S, H, Dv]   (R = request rows)
    ring_k   bf16    [R, W, H, D]          ring_v   bf16    [R, W, H, Dv]   (slot of position p = p % W)
    own_start int32  [R]  first position whose ring copy the row holds (normally the first
                          position the request computed itself)
    sink_start int32 [R]  first position whose sink copy the row holds (optional; default
                          own_start); they differ when a radix hit's side copies were carried over
* Keys of request b are positions 0..len_b-1, their slots are kv_indices[kv_indptr[b] + p]
  (SGLang Triton-backend layout, position order).
* Source of key position p for a reader that sees len keys, row r (same rule as
  reference.source_masks):  sink if p < S and p >= sink_start[r];  ring if
  p >= max(own_start[r], len - W);  INT2 otherwise.
* q, k, v given to these ops are already rotated (k by R_k, v by R_v, q by its KV head's R_k);
  outputs are in the rotated V space (the caller multiplies by R_v^T), unless a rotation is passed.
* No host synchronisation and no allocation inside decode / store: safe under CUDA-graph capture.
"""
from __future__ import annotations

from typing import Sequence

import torch


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
    k_codes: torch.Tensor,
    k_params: torch.Tensor,
    v_codes: torch.Tensor,
    v_params: torch.Tensor,
    *,
    k_group: int,
    v_group: int,
    k_clip: float = 1.0,
    v_clip: float = 1.0,
    k_rot: torch.Tensor | None = None,
    v_rot: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    token_rows: torch.Tensor | None = None,
    token_seq_lens: torch.Tensor | None = None,
    sink_k: torch.Tensor | None = None,
    sink_v: torch.Tensor | None = None,
    ring_k: torch.Tensor | None = None,
    ring_v: torch.Tensor | None = None,
    slot_entry: torch.Tensor | None = None,
    entry_owner: torch.Tensor | None = None,
) -> None:
    """Quantise T new tokens of many requests and scatter them to their slots.

    k [T, H, D], v [T, H, Dv] (model dtype); loc [T] slot indices.
    k_rot [H, D, D] / v_rot [H, Dv, Dv] (fp32, optional): rotate in-kernel first (x @ R per head).
    Side buffers (all optional, given together): token at position p of row r is also written
    in BF16 to sink[r, p] if p < S, and to ring[r, p % W] if p >= token_seq_lens - W
    (token_seq_lens[t] = length of the token's request after this forward).
    slot_entry int32 [N] / entry_owner int32 [R * (S + W)] (optional, with the side buffers): record
    where each token's side copy lives (sink entry r * S + p, ring entry R * S + r * W + p % W,
    -1 for none) and which slot owns each entry, so a request inheriting these slots from the
    radix cache can carry the copies over (pass them for one layer per forward; the entries are
    the same for every layer).
    """
    from .triton import token_store

    return token_store.store_kv(
        k, v, loc, k_codes, k_params, v_codes, v_params, k_group=k_group, v_group=v_group, k_clip=k_clip,
        v_clip=v_clip, k_rot=k_rot, v_rot=v_rot, positions=positions, token_rows=token_rows,
        token_seq_lens=token_seq_lens, sink_k=sink_k, sink_v=sink_v, ring_k=ring_k, ring_v=ring_v,
        slot_entry=slot_entry, entry_owner=entry_owner)


def decode_attention(
    q: torch.Tensor,
    o: torch.Tensor,
    k_codes: torch.Tensor,
    k_params: torch.Tensor,
    v_codes: torch.Tensor,
    v_params: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    req_rows: torch.Tensor,
    own_start: torch.Tensor,
    *,
    k_group: int,
    v_group: int,
    sm_scale: float,
    sink_start: torch.Tensor | None = None,
    num_kv_splits: torch.Tensor | None = None,
    max_kv_splits: int | None = None,
    attn_logits: torch.Tensor | None = None,
    attn_lse: torch.Tensor | None = None,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """One query token per request over sink + INT2 body + ring; split-K with an LSE reduction.

    q [B, Hq, D] (rotated), o [B, Hq, Dv] written in place and returned. GQA-aware: each K/V byte
    is read once per KV head. attn_logits [B, Hq, max_kv_splits, Dv] f32 and
    attn_lse [B, Hq, max_kv_splits] f32 are scratch (allocated if None; pass them under CUDA graphs).

    Kernels (picked by shape): where G = head_dim, token_decode's kernel, every split of a request
    reading an equal share of its INT2 body and of its BF16 sink + ring; for other group sizes the
    generic kernel, whose first splits read the BF16 keys (core.bf16_splits) and the others share
    the INT2 body.
    num_kv_splits [B] int32: n per request, clamped to [1, max_kv_splits] (G = head_dim) or
    [BF16 splits + 1, max_kv_splits] (other groups); None (recommended): n is derived in-kernel
    from the request length (>= 256 INT2 keys per split), no host sync.
    max_kv_splits: None = attn_logits.shape[2] if given, else a default that gives every SM a few
    programs for this batch size (token_decode.default_max_splits: 128 at B=1, Hkv=8 on 132 SMs;
    token_decode.base_max_splits for other groups).
    Small batches need many splits to fill the GPU: size the scratch with max_kv_splits >= 33 for
    B * Hkv <= 16.
    """
    from .triton import token_decode

    return token_decode.decode_attention(
        q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v, kv_indptr, kv_indices,
        req_rows, own_start, k_group=k_group, v_group=v_group, sm_scale=sm_scale, sink_start=sink_start,
        num_kv_splits=num_kv_splits, max_kv_splits=max_kv_splits, attn_logits=attn_logits, attn_lse=attn_lse,
        logit_cap=logit_cap)


def extend_prefix_attention(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_codes: torch.Tensor,
    k_params: torch.Tensor,
    v_codes: torch.Tensor,
    v_params: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    req_rows: torch.Tensor,
    own_start: torch.Tensor,
    *,
    k_group: int,
    v_group: int,
    sm_scale: float,
    max_len_extend: int,
    sink_start: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    o: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """E_b new query tokens of each request against its cached prefix (no mask).

    q [T, Hq, D] (rotated), tokens of request b at rows qo_indptr[b]:qo_indptr[b+1]; prefix of
    request b = kv_indptr[b]:kv_indptr[b+1] (its length is the reader's len for the source rule).
    Returns (o [T, Hq, Dv] float32, lse [T, Hq] float32, natural log); a request with an empty
    prefix gets o = 0, lse = -inf, so the caller can merge with attention over the new tokens.
    o / lse (optional): preallocated float32 outputs to write into.
    Kernels (picked by shape): token_extend's large-tile kernel where D, Dv in {64, 128} and q is
    bf16 / fp16, the generic kernel otherwise.
    """
    from .triton import token_extend

    return token_extend.extend_prefix_attention(
        q, qo_indptr, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v, kv_indptr,
        kv_indices, req_rows, own_start, k_group=k_group, v_group=v_group, sm_scale=sm_scale,
        max_len_extend=max_len_extend, sink_start=sink_start, logit_cap=logit_cap, o=o, lse=lse)


# --------------------------------------------------------------------------------------------
# Per-channel keys over page blocks (KVFormat k_layout="channel"; docs/format.md "KVFormat"),
# the served default layout.
# --------------------------------------------------------------------------------------------


def decode_attention_channel(
    q: torch.Tensor,
    o: torch.Tensor,
    k_codes: torch.Tensor,
    k_params: torch.Tensor,
    v_codes: torch.Tensor,
    v_params: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    req_rows: torch.Tensor,
    own_start: torch.Tensor,
    *,
    k_bits: int,
    k_block: int,
    v_group: int,
    sm_scale: float,
    sink_start: torch.Tensor | None = None,
    num_kv_splits: torch.Tensor | None = None,
    max_kv_splits: int | None = None,
    attn_logits: torch.Tensor | None = None,
    attn_lse: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    min_chunk: int | None = None,
) -> torch.Tensor:
    """decode_attention for per-channel keys: one query token per request over sink + body + ring.

    Pool of one layer (N slots, B = k_block = the page size, slot n is in page n // B):
      k_codes  uint8   [N, H, k_bits * D / 8]  (reference.pack_bits: 2-bit quarter split; 3 bits
                                                 = 2-bit plane + 1-bit "eighth split" plane;
                                                 4-bit half split)
      k_params float16 [N / B, H, D, 2]        (scale, min) per (page block, head, channel)
      v_codes  uint8   [N, H, Dv / 4]          2-bit values, per-token groups of v_group dims
      v_params float16 [N, H, Dv / v_group, 2]
    sink / ring / kv_indptr / kv_indices / req_rows / own_start / sink_start, q, o, the scratch and
    the split arguments as decode_attention (the generic kernel's split plan: BF16 splits + body splits,
    merged by the same stage 2; max_kv_splits None: decode_splits_channel's count). Body keys of a
    request are its complete blocks outside the sink and ring; blocks are aligned to position 0
    and are the request's pages. Head dims 64 and 128; keys 2, 3 or 4 bits; B in (32, 64); W >= B.
    min_chunk: fewest body keys per derived split (default channel_decode.DECODE_MIN_CHUNK, 64).
    How the body is decoded follows from the key width and head dim (channel_decode's docstring);
    every path reads the same pool. Returns o (rotated V space, like decode_attention).
    """
    from .triton import channel_decode

    return channel_decode.decode_attention_channel(
        q, o, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v, kv_indptr, kv_indices,
        req_rows, own_start, k_bits=k_bits, k_block=k_block, v_group=v_group, sm_scale=sm_scale,
        sink_start=sink_start, num_kv_splits=num_kv_splits, max_kv_splits=max_kv_splits,
        attn_logits=attn_logits, attn_lse=attn_lse, logit_cap=logit_cap, min_chunk=min_chunk)


def decode_splits_channel(batch: int, kv_heads: int, sink: int, window: int, device) -> int:
    """max_kv_splits that decode_attention_channel picks for a batch of `batch` requests when
    neither it nor the scratch is given (BF16 splits for a sink + ring of sink + window keys, and
    body splits for about 8 programs per SM): size attn_logits / attn_lse with it."""
    from .triton import channel_decode

    return channel_decode.decode_splits(batch, kv_heads, sink, window, device)


def extend_prefix_attention_channel(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_codes: torch.Tensor,
    k_params: torch.Tensor,
    v_codes: torch.Tensor,
    v_params: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    req_rows: torch.Tensor,
    own_start: torch.Tensor,
    *,
    k_bits: int,
    k_block: int,
    v_group: int,
    sm_scale: float,
    max_len_extend: int,
    sink_start: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    o: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    max_len_prefix: int | None = None,
    num_splits: int | None = None,
    extend_lens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """extend_prefix_attention for per-channel keys: E_b new query tokens of each request against
    its cached prefix (no mask).

    q [T, Hq, D] (rotated), tokens of request b at rows qo_indptr[b]:qo_indptr[b+1]; prefix of
    request b = kv_indptr[b]:kv_indptr[b+1] (its length is the reader's len for the source rule).
    Pool tensors, sink / ring / req_rows / own_start / sink_start and the supported shapes as
    decode_attention_channel (same checks). max_len_extend: the most new tokens of any request
    (sizes the grid). Returns (o [T, Hq, Dv] float32, lse [T, Hq] float32, natural log); the
    tokens of a request with an empty prefix get o = 0, lse = -inf, so the caller can merge with
    attention over the new tokens. o / lse (optional): preallocated float32 outputs to write into.
    Call it before storing the new tokens: the prefix's last W positions are read from the ring.
    Each page's keys and values are dequantised once per tile. max_len_prefix: the longest prefix
    of the batch (host int, optional): when the grid is under a wave of the GPU, each prefix is
    split into chunks walked by separate programs and merged by LSE
    (channel_extend.extend_prefix_splits; None: never split); num_splits forces a split count.
    extend_lens: each request's new-token count (host ints, optional; SGLang's
    extend_seq_lens_cpu): where the batch ends in a run of one-token extends (the decodes that
    --enable-mixed-chunk folds into a prefill batch) those get a launch with small query tiles
    (channel_extend.SHORT_EXTEND_ROWS); the result is the same.
    """
    from .triton import channel_extend

    return channel_extend.extend_prefix_attention_channel(
        q, qo_indptr, k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v, kv_indptr,
        kv_indices, req_rows, own_start, k_bits=k_bits, k_block=k_block, v_group=v_group, sm_scale=sm_scale,
        max_len_extend=max_len_extend, sink_start=sink_start, logit_cap=logit_cap, o=o, lse=lse,
        max_len_prefix=max_len_prefix, num_splits=num_splits, extend_lens=extend_lens)


def store_kv_channel(
    k: torch.Tensor,
    v: torch.Tensor,
    loc: torch.Tensor,
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    token_seq_lens: torch.Tensor,
    k_codes: torch.Tensor,
    k_params: torch.Tensor,
    v_codes: torch.Tensor,
    v_params: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    *,
    k_bits: int,
    k_block: int,
    v_group: int,
    v_clip: float = 1.0,
    slot_entry: torch.Tensor | None = None,
    entry_owner: torch.Tensor | None = None,
    rot_k: torch.Tensor | None = None,
    q: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
    one_token_per_request: bool = False,
) -> None:
    """store_kv for per-channel keys: T new (already rotated) tokens of many requests.

    k [T, H, D], v [T, H, Dv]; loc [T] slots, page-aligned (position p of a request at slot
    page * B + p % B, B = k_block); positions / token_rows / token_seq_lens [T] as store_kv (a
    request's tokens contiguous and in position order, as SGLang batches them). Pool tensors as
    decode_attention_channel; sink_k / ring_k [R, S / W, H, D] (W >= B), sink_v / ring_v likewise.

    Values: exactly store_kv's per-token 2-bit rows (v_group, v_clip) and side copies. Keys: BF16
    sink / ring copies as store_kv; when a token completes its block (position % B == B - 1), the
    block's B keys (this call's tokens from k, earlier ones from the ring, all rounded to the
    ring's dtype) are quantised per channel (reference.quantize_key_blocks, bit-exact) into the B
    slots' codes and k_params[loc // B]. Keys of an incomplete block get no codes yet. No key clip,
    no token-norm. slot_entry / entry_owner: as store_kv.

    rot_k (optional, [D, D] or [H, D, D] in k's dtype, bf16 or fp16 on CUDA): k arrives unrotated
    and is stored as k @ rot_k[h], computed in the kernels (MMA operands in k's dtype, fp32
    accumulation, rounded once: what a GEMM in k's dtype gives), for a decode step's few tokens
    without GEMM launches (prefill chunks: rotate with one GEMM, it reads R once). q / q_out
    (optional, with rot_k; [T, Hq, D], Hq a multiple of H): q_out = q @ rot_k[kv head of each
    query head], written by the same launch. Values are never rotated here.
    one_token_per_request: the caller guarantees that no request has more than one of the T
    tokens (a decode step); the store then runs as one launch instead of two (with several tokens
    of a request the second launch may overwrite ring entries a completing block still reads).
    """
    from .triton import channel_store

    return channel_store.store_kv_channel(
        k, v, loc, positions, token_rows, token_seq_lens, k_codes, k_params, v_codes, v_params, sink_k, sink_v,
        ring_k, ring_v, k_bits=k_bits, k_block=k_block, v_group=v_group, v_clip=v_clip, slot_entry=slot_entry,
        entry_owner=entry_owner, rot_k=rot_k, q=q, q_out=q_out, one_token_per_request=one_token_per_request)


def merge_attention_states(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    lse_a_base2: bool = False,
    lse_b_base2: bool = False,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax-merge two partial attentions over disjoint keys (reference.merge_attention_states).

    o_a, o_b [T, Hq, Dv] (any float dtypes), lse_a, lse_b [T, Hq] float32, natural log, or base 2
    where lse_a_base2 / lse_b_base2 (FlashInfer's LSEs). An LSE of -inf means no keys on that
    side: weight 0, whatever that side's output holds (no keys on either side gives 0). Returns
    the merged output in out_dtype (default o_a's) or written into out; lse_out (float32 [T, Hq],
    optional) receives the merged LSE in natural log. One pass; no allocation besides the output.
    """
    from .triton import merge as _mg

    return _mg.merge_attention_states(o_a, lse_a, o_b, lse_b, lse_a_base2=lse_a_base2,
                                      lse_b_base2=lse_b_base2, out_dtype=out_dtype, out=out,
                                      lse_out=lse_out)


def dequant_prefix_channel(
    k_codes: torch.Tensor,
    k_params: torch.Tensor,
    v_codes: torch.Tensor,
    v_params: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    req_rows: torch.Tensor,
    own_start: torch.Tensor,
    piece_lo: torch.Tensor,
    out_indptr: torch.Tensor,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
    *,
    k_bits: int,
    k_block: int,
    v_group: int,
    max_piece_len: int,
    sink_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the readers of a batch's cached prefixes see (per-channel keys), as BF16 rows.

    Pool tensors, kv_indptr / kv_indices (the prefix of request b, position order), req_rows,
    own_start, sink_start: as extend_prefix_attention_channel. A piece: request b's positions
    [piece_lo[b], piece_lo[b] + n_b), n_b = out_indptr[b + 1] - out_indptr[b], piece_lo[b] a
    multiple of k_block, written to rows out_indptr[b] .. of out_k [N, H, D] / out_v [N, H, Dv]
    (bf16); max_piece_len >= every n_b (host int, sizes the grid). Each position comes from its
    source (BF16 sink / ring copy, or the quantised body dequantised as the extend
    does, in bf16 on CUDA). Returns (out_k, out_v).
    """
    from .triton import channel_dequant

    return channel_dequant.dequant_prefix_channel(
        k_codes, k_params, v_codes, v_params, sink_k, sink_v, ring_k, ring_v, kv_indptr, kv_indices, req_rows,
        own_start, piece_lo, out_indptr, out_k, out_v, k_bits=k_bits, k_block=k_block, v_group=v_group,
        max_piece_len=max_piece_len, sink_start=sink_start)


def fill_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> torch.Tensor:
    """kv_indices[kv_indptr[b] + p] = req_to_token[req_pool_indices[b], p] for p < seq_lens[b]
    (reference.fill_kv_indices): SGLang's Triton-backend kv_indices, filled by many programs per
    request. kv_indptr [B + 1] holds the prefix sums of seq_lens [B] already; req_to_token
    [rows, max_len] int32 with contiguous rows; kv_indices of any integer dtype, written in place
    and returned. No host synchronisation: safe where SGLang refills its CUDA-graph buffers."""
    from .triton import kv_indices as _ki

    return _ki.fill_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices)


def plan_page_copy(blob: torch.Tensor, sections: Sequence[tuple[torch.Tensor, int]]) -> list:
    """The checked word views of copy_pages' blob and sections, in launch groups: what does not
    change from one copy to the next (the host tier plans each layer once)."""
    from .triton import page_copy

    if blob.dtype != torch.uint8 or blob.dim() != 2 or blob.stride(1) != 1:
        raise ValueError("copy_pages: the blob must be uint8 [pages, page_bytes] with contiguous rows")
    if not sections:
        return []
    H = sections[0][0].shape[0]
    views, sizes = [], [blob.stride(0), blob.data_ptr()]
    for buf, off in sections:
        if not buf.is_contiguous() or buf.shape[0] != H or buf.dim() < 3:
            raise ValueError("copy_pages: every buffer must be contiguous [H, P, ...] with the same H")
        raw = buf.reshape(H, buf.shape[1], -1).view(torch.uint8)
        if off + H * raw.shape[2] > blob.shape[1]:
            raise ValueError(f"copy_pages: a section at byte {off} of {H} x {raw.shape[2]} bytes "
                             f"overruns a blob row of {blob.shape[1]}")
        views.append((raw, off))
        sizes += [raw.shape[2], raw.stride(0), off, raw.data_ptr()]
    word = next(w for w in (4, 2, 1) if all(s % w == 0 for s in sizes))
    wdt = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    blob_w = blob.view(wdt)
    return [(blob_w, [(raw.view(wdt), off // word) for raw, off in views[at:at + page_copy.MAX_SECTIONS]])
            for at in range(0, len(views), page_copy.MAX_SECTIONS)]


def run_page_copy(plan: list, host_idx: torch.Tensor, dev_idx: torch.Tensor, page_size: int,
                  bad: torch.Tensor, to_host: bool) -> None:
    """copy_pages with a plan_page_copy plan."""
    from .triton import page_copy

    B = int(page_size)
    if host_idx.numel() != dev_idx.numel() or host_idx.numel() % B:
        raise ValueError(f"copy_pages: {host_idx.numel()} host and {dev_idx.numel()} device slots: "
                         f"both must be the same whole number of pages of {B}")
    for blob_w, group in plan:
        page_copy.launch(blob_w, group, host_idx.reshape(-1), dev_idx.reshape(-1), bad, B, to_host)


def copy_pages(
    blob: torch.Tensor,
    sections: Sequence[tuple[torch.Tensor, int]],
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    page_size: int,
    bad: torch.Tensor,
    to_host: bool,
) -> None:
    """Whole pages between head-major buffers and the rows of a page-first blob
    (reference.copy_pages; triton/page_copy.py has the layout). blob uint8 [pages, page_bytes]
    (for a pinned host blob, its CUDA view); sections [(buffer [H, P, ...] contiguous, byte offset
    of its section in a blob row)], every buffer with the same H; host_idx / dev_idx: slot indices,
    runs of page_size, the same count. to_host: buffer pages -> blob rows, else blob rows ->
    buffer pages. A run that is not page_size consecutive slots from a multiple of page_size is
    copied nowhere and sets bad[0] = 1 (int32 [1], the caller checks it later): no host
    synchronisation, so a copy can be enqueued on a side stream while the GPU works.
    (= run_page_copy(plan_page_copy(blob, sections), ...): a caller that copies the same buffers
    again keeps the plan.)"""
    run_page_copy(plan_page_copy(blob, sections), host_idx, dev_idx, page_size, bad, to_host)
