"""Every hook that teaches stock SGLang 0.5.17 `--kv-cache-dtype int2`, in one table (HOOKS),
and install(), which registers them with SGLang's HookRegistry, applies and verifies them.

Each hook does nothing unless the KV cache dtype is "int2", so a server started without it is
unchanged. SGLang only logs hook failures, so install() checks each target itself: a hook that
did not apply keeps an error that every int2 code path raises (state.require_hooks), and if
"int2" is on the command line the process stops at once.

  cli        ServerArgs.add_cli_args            AFTER   "int2" becomes a valid --kv-cache-dtype
  defaults   ServerArgs.__post_init__           BEFORE  attention backend oscar_triton, page size = key block
  refusals   ServerArgs.__post_init__           AFTER   unsupported options / models refused
  dtype      configure_kv_cache_dtype           AROUND  "int2" -> ("int2", torch.uint8)
  weights    ModelRunner.configure_kv_cache_dtype AFTER  fold R_v into the V / output projections
  reload     WeightUpdater.update_weights_from_*  AROUND refused while the weights hold R_v
  sizing     create_memory_pool_configurator    AROUND  Int2PoolConfigurator
  pool       KVCacheConfigurator._build_token_to_kv_pool  AROUND  OscarInt2KVPool
  rows       ReqToTokenPool.alloc               AROUND  new request rows -> reset, stored sink
  split      PrefillAdder.add_one_req / add_chunked_req AROUND  OSCAR_PREFILL_READS=cache: a prompt's
                                                         tail after its complete pages in a forward
                                                         of its own (prefill_split.py)
  hicache    HiRadixCache.__init__              AROUND  an INT2 pool gets the INT2 host pool
  salt       HiCacheController._generate_storage_config AFTER  storage keys name format + rotation
  accept     eagle_sample (EAGLE family, NGRAM)  AFTER   rejected drafts' ring entries rolled back
  chains     NgramCorpus.batch_get              AFTER   NGRAM's breadth-1 trees -> chains
  info       Scheduler.get_internal_state       AFTER   /server_info shows what was loaded
  metrics    SchedulerMetricsCollector.log_stats AFTER  int2 pool gauges (--enable-metrics)
  PD (pd_hooks.py):
  pd-state   setup_state_kv_args                AFTER   side rows sent as a per-request state component
  pd-rows    DecodePreallocQueue._pre_alloc     AROUND  received rows keep the transferred side state
  pd-dtype   CommonKVManager.__init__           BEFORE  "int2" -> "int2:<format>:<rotation>" both sides compare
  pd-pair    CommonKVManager.try_ensure_parallel_info AROUND  format / TP / PP mismatches named at pairing
  retract    Req.offload_kv_cache / load_kv_cache AROUND  a retracted request's pages and side row to
                                                         host and back (retraction.py; decode side of PD)
"""
from __future__ import annotations

import logging
import sys

from .config import BACKEND, INT2
from .pd_hooks import (
    after_setup_state_kv_args,
    around_pre_alloc,
    around_try_ensure_parallel_info,
    before_kv_manager_init,
)
from .prefill_split import around_add_chunked_req, around_add_one_req
from .retraction import around_load_kv_cache, around_offload_kv_cache
from .state import RUNTIME_INFO, mark_installed, require_hooks

logger = logging.getLogger("oscar_sglang")

SGLANG_DEFAULT_KV_SPLITS = 8
INT2_DEFAULT_KV_SPLITS = 64


# ------------------------------------------------------------------------------------ CLI


def after_add_cli_args(result, parser, *args, **kwargs):
    action = parser._option_string_actions.get("--kv-cache-dtype")
    if action is None or action.choices is None or getattr(action, "_oscar_int2", False):
        return result
    if INT2 in action.choices:  # not ours (we mark the action): SGLang has an int2 of its own
        _refuse(upstream_int2_problem(action.choices))
        return result
    action.choices = [*action.choices, INT2]
    action._oscar_int2 = True
    action.help = (action.help or "") + (
        ' "int2": OSCAR INT2 KV cache (oscar-sglang plugin; configured by OSCAR_* '
        "environment variables, see `oscar-sglang serve --help` and docs/settings.md)."
    )
    return result


def stock_kv_cache_dtypes() -> list[str] | None:
    """SGLang's own --kv-cache-dtype choices, from ServerArgs' field declaration (our hook adds
    int2 to each parser's copy, never to the declaration). None: not declared there."""
    import typing

    from sglang.srt.server_args import ServerArgs

    hint = typing.get_type_hints(ServerArgs, include_extras=True).get("kv_cache_dtype")
    for meta in typing.get_args(hint)[1:]:
        choices = getattr(meta, "choices", None)
        if choices is not None:
            return list(choices)
    return None


def upstream_int2_problem(choices) -> str | None:
    """Why the plugin must not serve int2 when SGLang's own choices already hold it (an upstream
    int2 KV cache): the plugin would shadow it, and a user could not tell which one runs."""
    if choices is None or INT2 not in choices:
        return None
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    return (f"oscar-sglang: this SGLang ({version}) has an `int2` KV cache dtype of its own; the "
            f"plugin refuses to shadow it, so --kv-cache-dtype int2 cannot start with the plugin "
            f"loaded. To use OSCAR's int2, install the SGLang it is built for (pip install "
            f"'sglang==0.5.17'); to use SGLang's own, uninstall oscar-sglang (pip uninstall "
            f"oscar-sglang) or exclude its plugin (SGLANG_PLUGINS).")


# ------------------------------------------------------------------------------------ ServerArgs


def before_post_init(self, *args, **kwargs):
    if getattr(self, "kv_cache_dtype", None) != INT2:
        return None
    require_hooks()
    if self.attention_backend is None:
        # both prefill and decode must read the INT2 pool: one backend for both
        self.attention_backend = BACKEND
    if getattr(self, "page_size", None) is None:
        # per-channel key blocks are SGLang pages: the format's block is the page size (a bad
        # OSCAR_KV_FORMAT is reported by after_post_init, with every other problem)
        from .config import OscarConfigError, load_config
        from .kv_format import KVFormatError, page_size_for

        try:
            need = page_size_for(load_config().kv_format)
        except (OscarConfigError, KVFormatError):
            need = None
        if need is not None:
            self.page_size = need
            logger.info("oscar-sglang: --page-size %d for int2 (the KV format's key block)", need)
    if getattr(self, "speculative_algorithm", None):
        from .refusals import raise_if_any, speculative_problems
        from .speculative import chain_defaults

        for setting in chain_defaults(self):
            logger.info("oscar-sglang: %s for int2 (speculative decoding verifies chains of drafts)", setting)
        # before SGLang's own checks, whose messages (e.g. "only supported for flashinfer") would
        # send an int2 user the wrong way
        raise_if_any(speculative_problems(self))
    if self.triton_attention_num_kv_splits == SGLANG_DEFAULT_KV_SPLITS:
        # SGLang's default of 8 splits leaves most of the H100 idle at small batch and long
        # context (1 request x 8 KV heads x 8 splits = 64 programs on 132 SMs): the INT2 decode
        # then reads at ~140 GB/s in the server instead of ~1 TB/s. Raise the cap (it sizes the
        # split scratch); the per-channel decode plans its splits itself within it, per-token
        # formats take SGLang's heuristic (backend._decode_splits).
        self.triton_attention_num_kv_splits = INT2_DEFAULT_KV_SPLITS
        logger.info(
            "oscar-sglang: --triton-attention-num-kv-splits %d for int2 (SGLang default %d; "
            "pass another value to override)", INT2_DEFAULT_KV_SPLITS, SGLANG_DEFAULT_KV_SPLITS,
        )
    return None


def after_post_init(result, self, *args, **kwargs):
    if getattr(self, "kv_cache_dtype", None) != INT2:
        return result
    if str(getattr(self, "model_path", "")).lower() in ("none", "dummy"):
        return result
    from .config import load_config
    from .refusals import format_problems, is_hybrid_linear, model_problems, raise_if_any, server_args_problems

    cfg = load_config()  # bad OSCAR_* variables fail here, in the launching process
    problems = server_args_problems(self)
    try:
        mc = self.get_model_config()
    except Exception as e:  # SGLang reports unloadable configs itself, later
        logger.debug("oscar: model config not available for the early check: %s", e)
        mc = None
    if mc is not None:
        problems += model_problems(mc, hybrid_linear=is_hybrid_linear(mc))
        problems += format_problems(cfg, mc)
    raise_if_any(problems)
    return result


# ------------------------------------------------------------------------------------ scheduler


def around_configure_kv_cache_dtype(orig, *args, **kwargs):
    if kwargs.get("server_args_kv_cache_dtype") == INT2:
        import torch

        if kwargs.get("is_draft_worker"):
            # the draft model (EAGLE / STANDALONE) keeps a cache in the model's dtype, as a server
            # started without --kv-cache-dtype does; the plugin's sizing reserves it
            return "auto", kwargs.get("model_dtype") or torch.bfloat16
        # uint8 (not bf16) also keeps models' fused RoPE+KV-store path off
        return INT2, torch.uint8
    return orig(*args, **kwargs)


def after_runner_kv_dtype(result, self, *args, **kwargs):
    # runs after the weights loaded and the layer range is known, before pools, backends and
    # CUDA graphs: the only point where the weights can still take R_v
    if getattr(self, "kv_cache_dtype_str", None) == INT2 and not getattr(self, "is_draft_worker", False):
        from .configurator import prepare_model

        prepare_model(self)
    return result


def around_weight_update(orig, self, *args, **kwargs):
    from .configurator import weights_hold_v_rotation

    if weights_hold_v_rotation():
        # new weights would arrive without R_v while the cache holds rotated values
        return False, ("oscar-sglang: weight updates are refused while the V rotation is folded "
                       "into the weights; restart the server with OSCAR_V_ABSORB=0 to update weights")
    return orig(self, *args, **kwargs)


def around_create_memory_pool_configurator(orig, kvc, *args, **kwargs):
    if getattr(kvc, "kv_cache_dtype_str", None) == INT2:
        from .configurator import Int2PoolConfigurator

        return Int2PoolConfigurator(kvc)
    return orig(kvc, *args, **kwargs)


def around_build_token_to_kv_pool(orig, self, *args, **kwargs):
    if getattr(self, "kv_cache_dtype_str", None) != INT2:
        return orig(self, *args, **kwargs)
    from .configurator import build_pool

    if kwargs.get("is_dsa_model") or kwargs.get("is_dsv4_model"):
        from .refusals import raise_if_any

        raise_if_any(["DeepSeek DSA / V4 models are not supported."])
    return build_pool(self, kwargs["sizes"], kwargs["req_to_token_pool"])


def around_req_to_token_alloc(orig, self, reqs, *args, **kwargs):
    fresh = [r for r in reqs if getattr(r, "req_pool_idx", None) is None]
    out = orig(self, reqs, *args, **kwargs)
    if out is not None and fresh:
        from .pool import note_new_rows

        # cached-prefix length of each new request (prefix_indices is set before the alloc) and
        # its sink key: its row is reset, and given the stored sink, at the next forward
        note_new_rows([r.req_pool_idx for r in fresh],
                      [len(p) if (p := getattr(r, "prefix_indices", None)) is not None else 0 for r in fresh],
                      fresh)
    return out


def around_hiradix_init(orig, self, params, server_args, *args, **kwargs):
    """HiRadixCache.__init__ builds its host pool from the device pool's class (MHA, MLA, ...) and
    refuses others; an INT2 pool gets runtime/host_pool.Int2HostPool. Its two lookups (the
    isinstance of MHATokenToKVPool and get_mha_host_pool_cls, module globals of hiradix_cache)
    admit the INT2 pool for this call only, then are put back; every other pool goes through
    unchanged."""
    from .pool import OscarInt2KVPool

    pool = params.token_to_kv_pool_allocator.get_kvcache()
    if not isinstance(pool, OscarInt2KVPool):
        return orig(self, params, server_args, *args, **kwargs)
    import sglang.srt.mem_cache.hiradix_cache as hiradix

    from .host_pool import Int2HostPool

    mha, pick = hiradix.MHATokenToKVPool, hiradix.get_mha_host_pool_cls
    hiradix.MHATokenToKVPool = (mha, OscarInt2KVPool)
    hiradix.get_mha_host_pool_cls = lambda device_pool: (
        Int2HostPool if isinstance(device_pool, OscarInt2KVPool) else pick(device_pool))
    try:
        return orig(self, params, server_args, *args, **kwargs)
    finally:
        hiradix.MHATokenToKVPool, hiradix.get_mha_host_pool_cls = mha, pick


def after_generate_storage_config(result, controller, *args, **kwargs):
    from .host_pool import after_generate_storage_config as salted

    return salted(result, controller, *args, **kwargs)


def after_eagle_sample(result, verify_input, batch, *args, **kwargs):
    # (predict, accept_lens, accept_index): roll back the rejected drafts of an int2 pool
    from .draft_rollback import active, after_accept

    if active() is not None and not batch.forward_mode.is_idle():
        after_accept(batch, result[1], verify_input.draft_token_num)
    return result


# SGLang's modules that call eagle_sample after a verify, by the algorithm that runs them
ACCEPT_CALLERS = {"NGRAM": "sglang.srt.speculative.ngram_worker"}
EAGLE_ACCEPT_CALLER = "sglang.srt.speculative.eagle_worker_common"


def check_accept_hook(alg: str) -> None:
    """The rollback of rejected drafts runs in the hook on eagle_utils.eagle_sample, which the
    workers import by name: a worker imported before the plugin loaded would hold the unhooked
    function and rejected drafts would stay in the ring, silently. Raise if so (at start)."""
    import importlib

    name = ACCEPT_CALLERS.get(alg.upper(), EAGLE_ACCEPT_CALLER)
    fn = getattr(importlib.import_module(name), "eagle_sample", None)
    if fn is None or not _contains(fn, after_eagle_sample):
        raise RuntimeError(
            f"oscar-sglang: {name}.eagle_sample is not the plugin's hooked function (the module was "
            f"imported before the plugin loaded, or SGLang changed), so rejected speculative drafts "
            f"would not be rolled back in the INT2 cache; this needs sglang==0.5.17 with the plugin "
            f"loaded through its entry point")


def after_ngram_batch_get(result, self, req_ids, *args, **kwargs):
    from .draft_rollback import active

    if active() is None:  # not an int2 server: its trees stay trees
        return result
    from .speculative import ngram_chains

    return ngram_chains(*result, len(req_ids))


def after_get_internal_state(result, self, *args, **kwargs):
    # 0.5.17 returns GetInternalStateReqOutput(internal_state=dict); accept a bare dict too
    state = result if isinstance(result, dict) else getattr(result, "internal_state", None)
    if RUNTIME_INFO and isinstance(state, dict):
        from .server_info import describe

        state["oscar_int2"] = describe(RUNTIME_INFO, self)
    return result


def after_log_stats(result, self, stats, *args, **kwargs):
    if RUNTIME_INFO:
        from .metrics import export

        export(self, stats, RUNTIME_INFO)
    return result


# (target, HookType name, function)
HOOKS = [
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER", after_add_cli_args),
    ("sglang.srt.server_args.ServerArgs.__post_init__", "BEFORE", before_post_init),
    ("sglang.srt.server_args.ServerArgs.__post_init__", "AFTER", after_post_init),
    ("sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype", "AROUND", around_configure_kv_cache_dtype),
    ("sglang.srt.model_executor.model_runner.ModelRunner.configure_kv_cache_dtype", "AFTER", after_runner_kv_dtype),
    ("sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_disk", "AROUND", around_weight_update),
    ("sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_tensor", "AROUND", around_weight_update),
    ("sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_distributed", "AROUND", around_weight_update),
    ("sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.update_weights_from_ipc", "AROUND", around_weight_update),
    ("sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator", "AROUND",
     around_create_memory_pool_configurator),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool", "AROUND",
     around_build_token_to_kv_pool),
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc", "AROUND", around_req_to_token_alloc),
    # page-canonical prefill: a cold prompt's last forward is the one its hits repeat
    ("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", "AROUND", around_add_one_req),
    ("sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req", "AROUND", around_add_chunked_req),
    # defined here, imported by name by the EAGLE and NGRAM workers (imported after the plugin
    # loads, so they bind the hooked function: speculative.check_accept_hook verifies it at start)
    ("sglang.srt.speculative.eagle_utils.eagle_sample", "AFTER", after_eagle_sample),
    ("sglang.srt.speculative.cpp_ngram.ngram_corpus.NgramCorpus.batch_get", "AFTER", after_ngram_batch_get),
    # HiCache: an INT2 pool gets the INT2 host pool, and storage keys name the INT2 format and
    # rotation (what the host tier cannot serve is refused at start: refusals.hicache_problems)
    ("sglang.srt.mem_cache.hiradix_cache.HiRadixCache.__init__", "AROUND", around_hiradix_init),
    ("sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config", "AFTER",
     after_generate_storage_config),
    ("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "AFTER", after_get_internal_state),
    ("sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats", "AFTER", after_log_stats),
    # PD disaggregation (runtime/pd_hooks.py)
    ("sglang.srt.disaggregation.utils.setup_state_kv_args", "AFTER", after_setup_state_kv_args),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc", "AROUND", around_pre_alloc),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.__init__", "BEFORE", before_kv_manager_init),
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.try_ensure_parallel_info", "AROUND",
     around_try_ensure_parallel_info),
    # retraction (the decode side of PD): a request's INT2 pages and side row to host and back
    ("sglang.srt.managers.schedule_batch.Req.offload_kv_cache", "AROUND", around_offload_kv_cache),
    ("sglang.srt.managers.schedule_batch.Req.load_kv_cache", "AROUND", around_load_kv_cache),
]

# functions SGLang's modules import by name (`from ... import f`): HookRegistry rebinds the copies
# of modules imported before it applied; verify_hooks checks that they hold the hooked function
BY_NAME = [
    ("sglang.srt.disaggregation.prefill", "setup_state_kv_args", after_setup_state_kv_args),
    ("sglang.srt.disaggregation.decode", "setup_state_kv_args", after_setup_state_kv_args),
]


def _contains(fn, hook, depth: int = 8) -> bool:
    """Is `hook` somewhere in the __wrapped__ chain HookRegistry built around `fn`?"""
    seen = 0
    while fn is not None and seen < depth:
        closure = getattr(fn, "__closure__", None) or ()
        if any(getattr(c, "cell_contents", None) is hook for c in closure):
            return True
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def verify_hooks() -> list[str]:
    """Targets whose hook is not in place (empty list: all applied)."""
    import pkgutil

    missing = []
    for target, _, hook in HOOKS:
        owner, attr = target.rsplit(".", 1)
        try:
            obj = pkgutil.resolve_name(owner)
            raw = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
            fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            if not _contains(fn, hook):
                missing.append(target)
        except Exception as e:  # unresolvable target: SGLang moved it
            missing.append(f"{target} ({type(e).__name__}: {e})")
    for module, name, hook in BY_NAME:
        try:
            if not _contains(getattr(pkgutil.resolve_name(module), name), hook):
                missing.append(f"{module}.{name} (imported by name)")
        except Exception as e:
            missing.append(f"{module}.{name} ({type(e).__name__}: {e})")
    return missing


def install_problem() -> str | None:
    """What keeps this process from serving int2 once the hooks are registered (None: nothing):
    a hook that did not apply, or an int2 KV cache dtype that SGLang has itself."""
    missing = verify_hooks()
    if missing:
        return ("oscar-sglang: these SGLang hooks did not apply, so --kv-cache-dtype int2 cannot "
                "work (is this sglang==0.5.17?):\n  " + "\n  ".join(missing))
    return upstream_int2_problem(stock_kv_cache_dtypes())


def _refuse(msg: str) -> None:
    """Every int2 code path raises msg from now on (state.require_hooks: the hooks stay in place
    so that a ServerArgs with int2 reaches before_post_init and fails there); an int2 command
    line stops here."""
    mark_installed(msg)
    logger.error(msg)
    if INT2 in sys.argv:
        # SGLang would only log an exception: stop the start here, loudly.
        print(msg, file=sys.stderr)
        raise SystemExit(2)


def install() -> None:
    """Register every hook of HOOKS, apply them now and verify each one."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, kind, fn in HOOKS:
        HookRegistry.register(target, fn, HookType[kind])
    # Apply now (idempotent: load_plugins' own apply_hooks skips patched targets) so we can
    # check the result here instead of trusting a log line.
    HookRegistry.apply_hooks()
    problem = install_problem()
    if problem is None:
        mark_installed(None)
        logger.info("oscar-sglang: %d hooks applied, oscar_triton backend registered", len(HOOKS))
        return
    _refuse(problem)
