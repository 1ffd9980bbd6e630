"""What /server_info (and /get_server_info) reports about the INT2 KV cache.

SGLang's /server_info includes each scheduler's get_internal_state(); the `info` hook adds an
"oscar_int2" entry there: the KV format, recipe, rotation file and sha256, group size, windows,
bytes per token, tokens that fit, and the live pool usage (free tokens, and free request rows with
their side-buffer bytes), and the Triton kernels compiled while serving (compile_watch).
"""
from __future__ import annotations

from .compile_watch import compiled_at_start, compiled_while_serving
from .state import hooks_ok

_STATIC_KEYS = (
    "kv_cache_dtype", "kv_format", "kv_format_from", "key_layout", "key_bits",
    "body_bits_per_element", "page_size", "recipe", "rotation_file", "rotation_sha256", "v_rotation_file",
    "rotation_model_id", "served_model_id", "group_size", "group_size_from", "sink_tokens", "recent_tokens",
    "k_clip", "v_clip", "v_rotation_in", "v_absorb_note", "layers", "kv_heads", "attn_tp", "env", "bytes_per_token",
    "bf16_bytes_per_token", "compression_vs_bf16", "side_bytes_per_request",
    "max_running_requests", "side_bytes_total", "max_total_num_tokens", "int2_bytes_total",
    "available_bytes", "new_token_attention", "prefix_attention", "decode_store", "prefill_reads",
)


def describe(info: dict, scheduler=None) -> dict:
    out = {k: info.get(k) for k in _STATIC_KEYS if k in info}
    out["hooks_ok"] = hooks_ok()
    # Triton kernels this scheduler compiled after its first forward (each one a request's wait)
    out["compiled_while_serving"] = compiled_while_serving()
    out["compiled_at_start"] = compiled_at_start()  # the warm-up's and capture's, per kernel
    if scheduler is not None:
        try:
            alloc = scheduler.token_to_kv_pool_allocator
            free = int(alloc.available_size())
            total = int(info.get("max_total_num_tokens") or 0)
            out["tokens_free"] = free
            out["tokens_used_or_cached"] = max(0, total - free)
        except Exception:  # a scheduler without the usual allocator: static info only
            pass
        try:
            # side buffers are one BF16 sink + ring per request row: free rows are free side-buffer
            # memory, so a leak check at idle compares these with their start values too
            rows_free = int(scheduler.req_to_token_pool.available_size())
            out["side_rows_free"] = rows_free
            if info.get("side_bytes_per_request"):
                out["side_bytes_free"] = rows_free * int(info["side_bytes_per_request"])
        except Exception:
            pass
    return out
