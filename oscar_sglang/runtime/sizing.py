"""Memory sizing of the INT2 KV pool: how many tokens fit and how many requests may run.

Two kinds of memory (per attention-TP rank, local layers only):
* per token: the quantised body of the KV format (runtime/kv_format.py: codes + fp16 (scale, min)
  per group, per-channel key params amortised over their page), for K and V, every layer and KV
  head, plus one int32 per token (not per layer): where the slot's BF16 side copy lives
  (pool.slot_entry).
  This is SGLang's "cell size"; the token count is budget // cell size.
* per running request (fixed): the BF16 side buffers, sink (S tokens) + recent ring (W tokens),
  K and V, every layer and KV head, plus int32 bookkeeping (own_start, sink_start and the owner
  slot of each of the S + W entries). They exist for every row of the
  request pool (max_running_requests + 1 padding row, + the rows the decode side of PD keeps for
  requests in transfer), whether a request uses them or not, so they are subtracted from the
  budget before dividing (SGLang's own sizing has no such term).

Plain arithmetic, no torch / sglang import: unit-tested directly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..common import settings
from .kv_format import ServedFormat

BF16_BYTES = 2
INT32_BYTES = 4
# A request count the user asked for explicitly is honoured unless its side buffers would take
# more than this share of the budget (then it is lowered, with a warning).
USER_REQUEST_MAX_FRACTION = 0.5


@dataclass(frozen=True)
class ModelKVShape:
    num_layers: int      # layers held by this rank (pipeline stage)
    num_kv_heads: int    # KV heads held by this rank (after attention TP)
    head_dim: int
    v_head_dim: int
    first_layer: int = 0  # the stage's first layer (per-layer key bits)


def int2_bytes_per_token(shape: ModelKVShape, fmt: ServedFormat) -> int:
    """Quantised bytes of one token over all local layers and KV heads (K and V), plus its int32
    side-copy pointer (pool.slot_entry)."""
    layers = range(shape.first_layer, shape.first_layer + shape.num_layers)
    return shape.num_kv_heads * sum(fmt.k_row_bytes(i) + fmt.v_row_bytes() for i in layers) + INT32_BYTES


def bf16_bytes_per_token(shape: ModelKVShape) -> int:
    """What SGLang's BF16 pool spends per token (for the ratio in the log)."""
    return shape.num_layers * shape.num_kv_heads * (shape.head_dim + shape.v_head_dim) * BF16_BYTES


# sinks kept by their token ids for cache hits (runtime/sink_store.py): as many as this share of
# the KV budget holds, up to SINK_STORE_MAX_ENTRIES. A row count is not enough: between two turns
# of a chat, more requests with other first tokens than there are rows may come and go, and a
# least-recently-used store would lose the chat's sink (bench/path_invariance.py's
# warm_after_others, 2026-12-02: 65 entries, 128 such requests)
SINK_STORE_MAX_FRACTION = 0.01
SINK_STORE_MAX_ENTRIES = 4096


def side_bytes_per_request(shape: ModelKVShape, sink: int, recent: int) -> int:
    """BF16 sink + ring bytes of one request row (all local layers, K and V) + its int32
    bookkeeping: own_start, sink_start and the owner slot of each of its S + W entries."""
    return (
        shape.num_layers
        * shape.num_kv_heads
        * (sink + recent)
        * (shape.head_dim + shape.v_head_dim)
        * BF16_BYTES
        + INT32_BYTES * (2 + sink + recent)
    )


def sink_store_plan(available_bytes: int, shape: ModelKVShape, sink: int) -> tuple[int, int]:
    """(entries, bytes) of the sinks kept by their token ids for cache hits (runtime/sink_store.py):
    entries of S BF16 tokens of every layer, as many as fit in SINK_STORE_MAX_FRACTION of the
    budget, at least 1 and at most SINK_STORE_MAX_ENTRIES. Taken from the token budget, not the
    rows' (a cache: it never limits concurrency)."""
    entry = shape.num_layers * shape.num_kv_heads * sink * (shape.head_dim + shape.v_head_dim) * BF16_BYTES
    if not entry:
        return 0, 0
    entries = max(1, min(SINK_STORE_MAX_ENTRIES, int(SINK_STORE_MAX_FRACTION * available_bytes) // entry))
    return entries, entries * entry


def kv_head_range(total_kv_heads: int, attn_tp_size: int, attn_tp_rank: int) -> tuple[int, int]:
    """(first global KV head, number of local KV heads) of an attention-TP rank.

    Mirrors QKVParallelLinear: with more ranks than KV heads, heads are replicated and rank r
    holds head r // (tp / total); otherwise each rank holds total / tp consecutive heads.
    """
    local = max(1, total_kv_heads // attn_tp_size)
    replicas = attn_tp_size // total_kv_heads if attn_tp_size >= total_kv_heads else 1
    return (attn_tp_rank // replicas) * local, local


class PoolSizingError(RuntimeError):
    pass


@dataclass
class PoolPlan:
    available_bytes: int
    bytes_per_token: int              # quantised body, all local layers
    bf16_bytes_per_token: int
    side_bytes_per_request: int
    max_running_requests: int
    side_bytes_total: int             # (max_running_requests + 1 + extra_rows) rows
    max_total_num_tokens: int
    int2_bytes_total: int
    notes: list[str] = field(default_factory=list)
    # speculative decoding: the draft model's BF16 KV a token (EAGLE / STANDALONE; SGLang gives
    # its pool as many tokens as the target's) and the rejected-draft rollback a request row
    draft_bytes_per_token: int = 0
    rollback_bytes_per_request: int = 0
    sink_store_entries: int = 0        # sink_store_plan
    sink_store_bytes_total: int = 0
    extra_rows: int = 0                # the PD decode side's rows for requests in transfer

    @property
    def compression(self) -> float:
        return self.bf16_bytes_per_token / self.bytes_per_token

    def as_dict(self) -> dict:
        d = asdict(self)
        d["compression_vs_bf16"] = round(self.compression, 3)
        return d

    def log_line(self) -> str:
        gib = 1 << 30
        return (
            f"OSCAR INT2 KV pool: {self.max_total_num_tokens:,} tokens fit; "
            f"{self.bytes_per_token:,} B/token INT2 ({self.compression:.2f}x less than BF16's "
            f"{self.bf16_bytes_per_token:,} B/token) = {self.int2_bytes_total / gib:.2f} GiB; "
            f"BF16 sink+recent side buffers {self.side_bytes_per_request / (1 << 20):.1f} MiB "
            f"per request x {self.max_running_requests + 1 + self.extra_rows} rows "
            f"(max_running_requests={self.max_running_requests} + 1 padding"
            + (f" + {self.extra_rows} for PD transfers" if self.extra_rows else "") + ") = "
            f"{self.side_bytes_total / gib:.2f} GiB; sinks kept by token ids for cache hits "
            f"{self.sink_store_bytes_total / gib:.2f} GiB; budget {self.available_bytes / gib:.2f} GiB"
            + self._speculative_part()
        )

    def _speculative_part(self) -> str:
        """What speculative decoding took of the budget (empty without it)."""
        parts = []
        if self.draft_bytes_per_token:
            parts.append(f"the draft model's BF16 KV {self.draft_bytes_per_token:,} B/token")
        if self.rollback_bytes_per_request:
            parts.append(f"rejected-draft rollback {self.rollback_bytes_per_request / (1 << 20):.2f} MiB per request")
        return f"; speculative decoding, included: {', '.join(parts)}" if parts else ""


def plan_pool(
    available_bytes: int,
    shape: ModelKVShape,
    *,
    fmt: ServedFormat,
    page_size: int = 1,
    requested_max_running_requests: int | None = None,
    # the server's defaults, so offline callers (benchmarks' KV-token columns) size as it does
    default_max_running_requests: int = settings.MAX_RUNNING_REQUESTS.default,
    side_buffer_fraction: float = settings.SIDE_BUFFER_FRACTION.default,
    draft_bytes_per_token: int = 0,
    rollback_bytes_per_request: int = 0,
    extra_rows: int = 0,
) -> PoolPlan:
    """Split a KV byte budget between the fixed side buffers and the INT2 token pool.

    requested_max_running_requests: what the user asked for (per DP worker) or None. None means
    default_max_running_requests, lowered until the side buffers take at most
    side_buffer_fraction of the budget; an explicit request is lowered only past
    USER_REQUEST_MAX_FRACTION. draft_bytes_per_token / rollback_bytes_per_request: speculative
    decoding's (a draft model's cache a token, the rejected-draft rollback a row): counted in.
    extra_rows: request rows beyond max_running_requests + 1 (the decode side of PD:
    --disaggregation-decode-extra-slots), side buffers counted in.
    """
    per_tok = int2_bytes_per_token(shape, fmt)
    per_req = side_bytes_per_request(shape, fmt.sink, fmt.recent) + rollback_bytes_per_request
    notes: list[str] = []

    if requested_max_running_requests is None:
        fit = int(side_buffer_fraction * available_bytes) // per_req - 1 - extra_rows
        reqs = max(1, min(default_max_running_requests, fit))
        if reqs < default_max_running_requests:
            notes.append(
                f"max_running_requests defaults to {reqs} (not {default_max_running_requests}) so "
                f"the BF16 side buffers stay within {side_buffer_fraction:.0%} of the KV budget; "
                f"pass --max-running-requests N to choose (each request costs "
                f"{per_req / (1 << 20):.1f} MiB)"
            )
    else:
        reqs = int(requested_max_running_requests)
        cap = int(USER_REQUEST_MAX_FRACTION * available_bytes) // per_req - 1 - extra_rows
        if reqs > cap:
            notes.append(
                f"--max-running-requests {reqs} lowered to {max(cap, 1)}: its BF16 side buffers "
                f"({per_req / (1 << 20):.1f} MiB each) would take more than "
                f"{USER_REQUEST_MAX_FRACTION:.0%} of the KV budget"
            )
            reqs = max(cap, 1)

    side_total = (reqs + 1 + extra_rows) * per_req
    store_entries, store_total = sink_store_plan(available_bytes, shape, fmt.sink)
    cell = per_tok + draft_bytes_per_token
    fixed = side_total + store_total
    tokens = (available_bytes - fixed) // cell if available_bytes > fixed else 0
    tokens = tokens // page_size * page_size
    if tokens <= 0:
        raise PoolSizingError(
            f"INT2 KV cache: the budget of {available_bytes / (1 << 30):.2f} GiB cannot hold the "
            f"BF16 side buffers of {reqs} requests ({side_total / (1 << 30):.2f} GiB). Raise "
            f"--mem-fraction-static, lower --max-running-requests, or shrink OSCAR_SINK_TOKENS / "
            f"OSCAR_RECENT_TOKENS."
        )
    return PoolPlan(
        available_bytes=int(available_bytes),
        bytes_per_token=per_tok,
        bf16_bytes_per_token=bf16_bytes_per_token(shape),
        side_bytes_per_request=per_req,
        max_running_requests=reqs,
        side_bytes_total=side_total,
        max_total_num_tokens=int(tokens),
        int2_bytes_total=int(tokens) * per_tok,
        notes=notes,
        draft_bytes_per_token=int(draft_bytes_per_token),
        rollback_bytes_per_request=int(rollback_bytes_per_request),
        sink_store_entries=store_entries,
        sink_store_bytes_total=int(store_total),
        extra_rows=int(extra_rows),
    )


def plan_from_max_tokens(
    max_total_num_tokens: int,
    shape: ModelKVShape,
    *,
    fmt: ServedFormat,
    max_running_requests: int,
    page_size: int = 1,
) -> PoolPlan:
    """The plan when the token count is fixed (--max-total-tokens): report-only arithmetic."""
    per_tok = int2_bytes_per_token(shape, fmt)
    per_req = side_bytes_per_request(shape, fmt.sink, fmt.recent)
    tokens = max_total_num_tokens // page_size * page_size
    side_total = (max_running_requests + 1) * per_req
    store_entries, store_total = sink_store_plan(tokens * per_tok + side_total, shape, fmt.sink)
    return PoolPlan(
        available_bytes=tokens * per_tok + side_total + store_total,
        bytes_per_token=per_tok,
        bf16_bytes_per_token=bf16_bytes_per_token(shape),
        side_bytes_per_request=per_req,
        max_running_requests=max_running_requests,
        side_bytes_total=side_total,
        max_total_num_tokens=tokens,
        int2_bytes_total=tokens * per_tok,
        sink_store_entries=store_entries,
        sink_store_bytes_total=store_total,
    )
