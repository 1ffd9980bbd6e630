"""The PD disaggregation hooks' bodies (registered and verified by runtime/hooks.py): the
compatibility string an int2 server registers and compares, the pairing checks, the side rows
registered as a per-request state component, the decode side's received rows, and the line every
PD server logs about what a transfer moves. What they rely on and what remains:
runtime/pd_buffers.py, whose buffer and string functions they use (apart from it so that the pool,
which returns its buffer infos from pd_buffers, and these hooks, which need the pool, import no
cycle).
"""
from __future__ import annotations

import logging
import re

import torch

from .pd_buffers import INT2, compat_dtype_string, mismatch_message, pd_parallel_problems

logger = logging.getLogger("oscar_sglang")


def transfer_summary(args) -> str:
    """One line saying what a request's transfer moves, from the KVArgs the KV manager registers
    (bench/pd.py reads it for transfer_bytes_per_token, for int2 and for SGLang's own pools)."""
    page = int(getattr(args, "page_size", 1) or 1)
    per_page = sum(int(x) for x in args.kv_item_lens)
    state = sum(int(x) for comp in (getattr(args, "state_item_lens", None) or []) for x in comp)
    regions = len(args.kv_data_ptrs) + sum(len(c) for c in (getattr(args, "state_data_ptrs", None) or []))
    return (f"oscar PD transfer: kv_cache_dtype={args.kv_cache_dtype_str} page_size={page} "
            f"kv_bytes_per_page={per_page} kv_bytes_per_token={per_page / page:.2f} "
            f"state_bytes_per_request={state} regions={regions}")


def before_kv_manager_init(self, args=None, *rest, **kwargs):
    """BEFORE hook body for CommonKVManager.__init__: an int2 server's KVArgs carry
    compat_dtype_string instead of the bare "int2". Before, not after: the prefill side registers
    the string with the bootstrap server inside __init__ (register_to_bootstrap), and the decode
    side compares it with self.kv_cache_dtype_str, copied from the KVArgs there. Every PD server,
    int2 or not, logs transfer_summary (the one thing this hook does for other KV dtypes)."""
    if getattr(args, "kv_cache_dtype_str", None) == INT2:
        from .state import RUNTIME_INFO

        if not RUNTIME_INFO.get("kv_format"):
            raise RuntimeError("oscar-sglang: a PD KV manager with kv_cache_dtype int2 but no INT2 pool "
                               "in this process (configurator.build_pool did not run)")
        args.kv_cache_dtype_str = compat_dtype_string(RUNTIME_INFO)
    if args is not None and getattr(args, "kv_item_lens", None) is not None:
        logger.info(transfer_summary(args))
    return None


_MISMATCH = re.compile(r"prefill server has kv_cache_dtype=(\S+?), but decode server has kv_cache_dtype=(\S+?)\.")


def around_try_ensure_parallel_info(orig, self, bootstrap_addr, *args, **kwargs):
    """AROUND hook body for CommonKVManager.try_ensure_parallel_info (the decode side fetching a
    prefill server's info): SGLang's dtype check raises "KV cache dtype mismatch" with both
    strings; where either is an int2 one, say which formats differ instead. An int2 decode
    refuses a prefill whose attention TP or PP size differs (pd_parallel_problems): the sizes of
    both are only known here. Both raise, as SGLang's own pairing checks do."""
    try:
        ok = orig(self, bootstrap_addr, *args, **kwargs)
    except RuntimeError as e:
        m = _MISMATCH.search(str(e))
        if m is None or not any(s.startswith(INT2) for s in m.groups()):
            raise
        raise RuntimeError(mismatch_message(*m.groups())) from e
    if ok and str(getattr(self, "kv_cache_dtype_str", "")).startswith(INT2):
        info = self.prefill_info_table[bootstrap_addr]
        problems = pd_parallel_problems(info.attn_tp_size, self.attn_tp_size, info.pp_size, self.pp_size)
        if problems:
            del self.prefill_info_table[bootstrap_addr]  # not paired: a retry checks again
            raise RuntimeError(f"INT2 PD servers cannot pair (prefill at {bootstrap_addr}): " + " ".join(problems))
    return ok


# ------------------------------------------------------------------------------------ state wiring


def _is_int2_pool(pool) -> bool:
    from .pool import OscarInt2KVPool  # (at call time: hooks.py imports this module at plugin load)

    return isinstance(pool, OscarInt2KVPool)


def identity_state_mapping(req_to_token_pool) -> torch.Tensor:
    """What prefill.py and decode.py read as `req_index_to_mamba_index_mapping[req_pool_idx]` for
    a MAMBA component: the INT2 side rows are the request rows themselves. On the CPU: the payload
    calls .cpu() on the element it reads, so no device sync per request."""
    return torch.arange(req_to_token_pool.req_to_token.shape[0], dtype=torch.int32)


def after_setup_state_kv_args(result, kv_args, token_to_kv_pool, draft_token_to_kv_pool=None,
                              total_kv_layers=None, req_to_token_pool=None, *args, **kwargs):
    """AFTER hook body for disaggregation.utils.setup_state_kv_args (prefill and decode, before
    the KV manager is built): an INT2 pool's side rows as a MAMBA state component (the one kind
    SGLang sends per request, one index each) and the identity row mapping on the request pool,
    which the payloads read on both sides."""
    if not _is_int2_pool(token_to_kv_pool):
        return result
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    problem = None
    if kv_args.state_types:
        problem = f"state components {kv_args.state_types} already registered for an INT2 pool"
    elif req_to_token_pool is None:
        problem = "no request pool given (the side rows are indexed by its rows)"
    elif req_to_token_pool.req_to_token.shape[0] > token_to_kv_pool.req_rows:
        problem = (f"the request pool has {req_to_token_pool.req_to_token.shape[0]} rows, the INT2 "
                   f"side buffers {token_to_kv_pool.req_rows}")
    else:
        identity = identity_state_mapping(req_to_token_pool)
        mapped = getattr(req_to_token_pool, "req_index_to_mamba_index_mapping", None)
        if mapped is not None and not torch.equal(mapped.cpu(), identity):  # (ours: set up again)
            problem = "the request pool maps rows to Mamba state already (a hybrid model's pool)"
    if problem:
        raise RuntimeError(f"oscar-sglang: cannot register the INT2 side rows for PD: {problem}")
    append_state_component(kv_args, StateType.MAMBA, *token_to_kv_pool.get_state_buf_infos())
    req_to_token_pool.req_index_to_mamba_index_mapping = identity
    return result


def around_pre_alloc(orig, self, req, *args, **kwargs):
    """AROUND hook body for DecodePreallocQueue._pre_alloc (the decode side gives a request its
    row and slots before the transfer): the row's side state will come by transfer, so its reset
    is withdrawn and its side-copy pointers dropped (pool.note_received_rows; kv_committed_len
    is the token count the prefill sends, set by _pre_alloc)."""
    out = orig(self, req, *args, **kwargs)
    if _is_int2_pool(getattr(self, "token_to_kv_pool", None)):
        from .pool import note_received_rows

        note_received_rows([req.req_pool_idx], [req.kv_committed_len])
    return out
