"""SGLang glue for sizing and building the INT2 pool (runs in each scheduler process).

* Int2PoolConfigurator replaces SGLang's DefaultPoolConfigurator for kv_cache_dtype "int2":
  INT2 bytes per token, minus the fixed BF16 side buffers (sizing.plan_pool), and it caps
  max_running_requests to the rows the side buffers were sized for; the decode CUDA graphs then
  cover those rows (cover_rows_with_decode_graphs).
* build_pool() replaces SGLang's MHA pool: loads the rotations for this rank (common/rotations.py),
  checks the model, builds OscarInt2KVPool and logs what was loaded.

The resulting description (recipe, file, sha256, sizes...) is kept in state.RUNTIME_INFO for the
server-info and metrics hooks.
"""
from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator, MemoryPoolConfig

from ..common import rotations as R
from . import sizing
from .config import OscarConfig, load_config
from .kv_format import for_model
from .state import RUNTIME_INFO

logger = logging.getLogger("oscar_sglang")

# The plan of the last sizing pass in this process (the configurator is re-created between the
# sizing and the finalize steps of SGLang's resolution, so the plan cannot live on the instance).
_LAST_PLAN: dict = {}


def serving_config() -> OscarConfig:
    """load_config() plus one default taken from the rotation file: without OSCAR_GROUP_SIZE, the
    group size the file was calibrated with (its metadata "group_size"; its clip ratios were
    searched at that size)."""
    import dataclasses

    cfg = load_config()
    if "group_size" in cfg.sources or cfg.recipe != "file":
        return cfg
    g = _file_group_size(cfg.rotation)
    if g is None or g == cfg.group_size:
        return cfg
    return dataclasses.replace(cfg, group_size=g, sources={**cfg.sources, "group_size": "rotation file metadata"})


_GROUP_CACHE: dict = {}


def _file_group_size(path: str) -> int | None:
    if path not in _GROUP_CACHE:
        from oscar_kernels.format import SUPPORTED_GROUP_SIZES

        try:
            g = R.load_rotation_file(path, check=False).metadata.get("group_size")
        except R.RotationFileError:
            g = None  # reported with its reason when the pool loads the file
        _GROUP_CACHE[path] = int(g) if g in SUPPORTED_GROUP_SIZES else None
    return _GROUP_CACHE[path]


def _parallel():
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def _requested_max_running_requests() -> int | None:
    from sglang.srt.runtime_context import get_schedule

    r = get_schedule().max_running_requests
    if r is None:
        return None
    return max(1, int(r) // max(1, int(_parallel().attn_dp_size)))


def kv_shape(kvc, num_layers: int | None = None) -> sizing.ModelKVShape:
    mc = kvc.model_config
    return sizing.ModelKVShape(
        num_layers=kvc.layer_info.num_effective_layers if num_layers is None else num_layers,
        num_kv_heads=mc.get_num_kv_heads(_parallel().attn_tp_size),
        head_dim=mc.head_dim,
        v_head_dim=mc.v_head_dim,
        first_layer=int(getattr(kvc.layer_info, "start_layer", 0) or 0),
    )


class Int2PoolConfigurator(DefaultPoolConfigurator):
    """coeff = quantised bytes/token; bias = (max_running_requests + 1) x BF16 side-buffer bytes."""

    def __init__(self, kvc):
        self._oscar_cfg: OscarConfig = serving_config()
        self._fmt = for_model(self._oscar_cfg, kvc.model_config)
        self._shape = kv_shape(kvc)
        self._server_args = getattr(kvc, "server_args", None)
        self._kvc_spec_aux = getattr(kvc, "spec_aux_config", None)  # the draft model's layer count
        super().__init__(kvc)

    def _compute_cell_size(self, kvc, num_layers: int) -> int:
        return sizing.int2_bytes_per_token(kv_shape(kvc, num_layers), self._fmt)

    def _speculative_bytes(self) -> dict:
        """plan_pool's speculative terms: an EAGLE / STANDALONE draft model's cache (BF16, as many
        tokens as the target's pool; SGLang assumes the draft's layers are shaped like the
        target's, and so does this) and the rollback buffers of the verify's drafts."""
        args = self._server_args
        drafts = getattr(args, "speculative_num_draft_tokens", None) if args is not None else None
        if not getattr(args, "speculative_algorithm", None) or not drafts:
            return {}
        from .draft_rollback import DraftRollback
        from .speculative import EAGLE_FAMILY, algorithm

        shape = self._shape
        out = dict(rollback_bytes_per_request=DraftRollback.bytes_per_row(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.v_head_dim, int(drafts)))
        layers = getattr(getattr(self, "_kvc_spec_aux", None), "eagle_draft_num_layers", None)
        if algorithm(args) in EAGLE_FAMILY and layers:
            out["draft_bytes_per_token"] = sizing.bf16_bytes_per_token(
                sizing.ModelKVShape(int(layers), shape.num_kv_heads, shape.head_dim, shape.v_head_dim))
        return out

    def _pd_decode_rows(self) -> int:
        """The decode side of PD keeps request rows for requests in transfer beyond
        max_running_requests + 1 (SGLang's DecodeReqToTokenPool), each with side buffers."""
        args = self._server_args
        if getattr(args, "disaggregation_mode", None) != "decode":
            return 0
        return int(getattr(args, "disaggregation_decode_extra_slots", 0) or 0)

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        cfg = self._oscar_cfg
        plan = sizing.plan_pool(
            available_bytes,
            self._shape,
            fmt=self._fmt,
            page_size=page_size,
            requested_max_running_requests=_requested_max_running_requests(),
            default_max_running_requests=cfg.default_max_running_requests,
            side_buffer_fraction=cfg.side_buffer_fraction,
            extra_rows=self._pd_decode_rows(),
            **self._speculative_bytes(),
        )
        for note in plan.notes:
            logger.warning("OSCAR INT2: %s", note)
        _LAST_PLAN["plan"] = plan
        return MemoryPoolConfig(max_total_num_tokens=plan.max_total_num_tokens)

    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int, page_size: int) -> MemoryPoolConfig:
        # --max-total-tokens (or a PP min): fewer tokens than the budget allows; the side buffers
        # were already reserved by calculate_pool_sizes.
        config = super().calculate_pool_sizes_from_max_tokens(max_total_num_tokens, page_size)
        plan = _LAST_PLAN.get("plan")
        if plan is not None:
            plan.max_total_num_tokens = config.max_total_num_tokens
            plan.int2_bytes_total = config.max_total_num_tokens * plan.bytes_per_token
        return config

    def finalize_with_max_running_requests(self, config: MemoryPoolConfig) -> MemoryPoolConfig:
        plan = _LAST_PLAN.get("plan")
        if plan is not None and config.max_running_requests is not None:
            config.max_running_requests = min(config.max_running_requests, plan.max_running_requests)
        elif plan is not None:
            config.max_running_requests = plan.max_running_requests
        if self._server_args is not None and config.max_running_requests is not None:
            cover_rows_with_decode_graphs(self._server_args, int(config.max_running_requests))
        return config


def cover_rows_with_decode_graphs(server_args, rows: int) -> bool:
    """Extend the decode CUDA-graph batch sizes up to `rows` running requests, unless the user chose
    them (--cuda-graph-max-bs / --cuda-graph-bs / --cuda-graph-config). SGLang's default stops at
    256 on an H100, sized for BF16 / FP8 concurrency; int2 runs ~640 requests at once on
    Llama-3.1-8B, and a batch above the largest graph decodes eagerly: on the H100 at 512 rows the
    GPU was busy 60% of each eager decode step (CHANGELOG.md). Larger graphs cost start-up
    time and graph memory, which SGLang's post-capture sizing takes from the KV pool. Returns
    whether the sizes changed. Idempotent (SGLang may finalize the pool config more than once)."""
    from sglang.srt.server_args import ServerArgs

    graphs = getattr(server_args, "cuda_graph_config", None)
    dec = getattr(graphs, "decode", None)
    if dec is None or dec.bs is None or dec.max_bs is None or rows <= dec.max_bs:
        return False
    locked = getattr(server_args, "_cuda_graph_config_locked", set())
    if ("decode", "max_bs") in locked or ("decode", "bs") in locked:
        return False
    old_max = dec.max_bs
    more = [b for b in ServerArgs._generate_decode_cuda_graph_batch_sizes(server_args, rows) if b > old_max]
    new = copy.deepcopy(graphs)
    new.decode.bs = sorted(set(dec.bs) | set(more))
    new.decode.max_bs = max(new.decode.bs)
    # resolved ServerArgs are read-only; override() is SGLang's audited mutation point
    server_args.override("oscar-sglang: decode graphs for the int2 rows", cuda_graph_config=new)
    logger.info("OSCAR INT2: decode CUDA graphs up to batch %d (SGLang's default %d): int2 runs up to %d "
                "requests at once (--cuda-graph-max-bs overrides)", new.decode.max_bs, old_max, rows)
    return True


# ---------------------------------------------------------------------------------- rotations


def served_model_id(model_path: str) -> str:
    """The id a rotation file's metadata is compared with (the embedded GGUF -> its HF id)."""
    try:
        from ..common.embedded import EMBEDDED_GGUF_NAME, EMBEDDED_MODEL_ID, cache_dir, embedded_gguf_path

        p = Path(model_path).resolve()
        if p == embedded_gguf_path().resolve():
            return EMBEDDED_MODEL_ID
        # `oscar-sglang serve` serves the dequantised HF copy tools.models caches for the GGUF
        if (p.parent == (cache_dir() / "hf-from-gguf").resolve()
                and p.name.startswith(Path(EMBEDDED_GGUF_NAME).stem + "-")):
            return EMBEDDED_MODEL_ID
    except (FileNotFoundError, OSError):
        pass
    p = Path(model_path)
    return p.stem.split(".")[0] if p.suffix == ".gguf" else model_path


def load_rotations(cfg: OscarConfig, *, num_layers, num_kv_heads, head_dim, v_head_dim, model_id=None):
    """The full-model RotationSet for cfg (file, hadamard or identity), validated for the model,
    with env clip overrides applied."""
    import torch

    if cfg.recipe == "file":
        rs = R.load_rotation_file(cfg.rotation, cfg.v_rotation)
        rs.validate_for_model(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            model_id=model_id,
            allow_model_mismatch=cfg.allow_model_mismatch,
        )
    elif cfg.recipe == "hadamard":
        rs = R.hadamard_rotation_set(num_layers, num_kv_heads, head_dim, v_head_dim)
    else:
        rs = R.identity_rotation_set(num_layers, num_kv_heads, head_dim, v_head_dim)
    if cfg.k_clip is not None:
        rs.k_clip = torch.full((num_layers,), cfg.k_clip)
    if cfg.v_clip is not None:
        rs.v_clip = torch.full((num_layers,), cfg.v_clip)
    return rs


_RANK_ROTATIONS: dict = {}
# (start_layer, end_layer) -> {"layers": absorbed layer ids, "reason": why not (or None)}
V_ABSORB: dict = {}


def rank_rotations(cfg: OscarConfig, mc, start_layer: int, end_layer: int, model_id: str | None):
    """(full RotationSet, this rank's RotationSet, first local KV head, local KV heads), loaded
    and checked once per process: the weight-absorption hook and build_pool both need them."""
    ps = _parallel()
    total_kv = mc.get_total_num_kv_heads()
    kv0, local_kv = sizing.kv_head_range(total_kv, ps.attn_tp_size, ps.attn_tp_rank)
    key = (cfg, start_layer, end_layer, kv0, local_kv, model_id)
    if key not in _RANK_ROTATIONS:
        rs_full = load_rotations(
            cfg,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=total_kv,
            head_dim=mc.head_dim,
            v_head_dim=mc.v_head_dim,
            model_id=model_id,
        )
        _RANK_ROTATIONS.clear()
        _RANK_ROTATIONS[key] = (rs_full, rs_full.for_rank(start_layer, end_layer, kv0, local_kv), kv0, local_kv)
    return _RANK_ROTATIONS[key]


def prepare_model(runner) -> None:
    """After the weights load (ModelRunner.configure_kv_cache_dtype hook): fold R_v into the
    model's V and output projections (runtime/absorb.py) unless OSCAR_V_ABSORB=0 or the model
    cannot take it; build_pool then gives the pool no V rotation. Logs which one happened."""
    from .absorb import absorb_v_rotations

    cfg = serving_config()
    li = runner.layer_info
    key = (li.start_layer, li.end_layer)
    V_ABSORB.pop(key, None)
    if cfg.recipe == "identity":
        return
    off = ("OSCAR_V_ABSORB=0" if not cfg.v_absorb else
           # adapters add their own V / o terms, computed in the unrotated space
           "LoRA adapters (--enable-lora)" if getattr(runner.server_args, "enable_lora", None) else None)
    if off:
        V_ABSORB[key] = {"layers": [], "reason": off}
        logger.info("OSCAR INT2: V rotation applied by the backend at run time (%s)", off)
        return
    model_id = served_model_id(runner.server_args.model_path)
    _, rs, _, _ = rank_rotations(cfg, runner.model_config, li.start_layer, li.end_layer, model_id)
    layers, why = absorb_v_rotations(runner.model, rs.v_rotation, li.start_layer)
    V_ABSORB[key] = {"layers": layers, "reason": why}
    if torch.cuda.is_available():
        # SGLang sizes the KV pool from the free memory after this: give the fold's float32
        # temporaries back. (The cuBLAS context the fold's GEMMs create stays: 0.3-0.4% fewer
        # KV tokens, H100 05:47 / 06:06 UTC, CHANGELOG.md.)
        torch.cuda.empty_cache()
    if why is None:
        logger.info("OSCAR INT2: V rotation folded into the V and output projections of layers "
                    "[%d, %d): no V rotation per step", li.start_layer, li.end_layer)
    else:
        logger.warning("OSCAR INT2: V rotation stays in the backend (applied every step): %s", why)


def weights_hold_v_rotation() -> bool:
    return any(v.get("layers") for v in V_ABSORB.values())


# ---------------------------------------------------------------------------------- the pool


def build_pool(kvc, sizes, req_to_token_pool):
    """Build the OscarInt2KVPool for this rank (called from the _build_token_to_kv_pool hook)."""
    from .pool import OscarInt2KVPool
    from .refusals import is_hybrid_linear, model_problems, raise_if_any

    mc = kvc.model_config
    problems = model_problems(mc, hybrid_linear=is_hybrid_linear(mc))
    if kvc.use_mla_backend:
        problems.append("MLA models are not supported.")
    if kvc.is_hybrid_swa:
        problems.append("hybrid sliding-window models are not supported.")
    raise_if_any(problems)

    cfg = serving_config()
    ps = _parallel()
    li = kvc.layer_info
    model_id = served_model_id(kvc.server_args.model_path)
    rs_full, rs, kv0, local_kv = rank_rotations(cfg, mc, li.start_layer, li.end_layer, model_id)
    total_kv = mc.get_total_num_kv_heads()
    identity = cfg.recipe == "identity"
    absorbed = V_ABSORB.get((li.start_layer, li.end_layer), {})
    v_in_weights = bool(absorbed.get("layers")) and not identity

    shape = kv_shape(kvc)
    fmt = for_model(cfg, mc)
    if fmt.page_size is not None and kvc.pool_page_size != fmt.page_size:
        raise RuntimeError(
            f"OSCAR INT2: KV format {fmt.name} quantises keys per page of {fmt.page_size} tokens but "
            f"the page size is {kvc.pool_page_size}: drop --page-size (the plugin sets it) or pass "
            f"--page-size {fmt.page_size}")
    plan = _LAST_PLAN.get("plan")
    reqs = int(sizes.max_running_requests)
    if plan is None:  # draft/unusual paths: describe what we build
        plan = sizing.plan_from_max_tokens(
            sizes.max_total_num_tokens, shape, fmt=fmt, max_running_requests=reqs,
        )
    # a side row per request row: max_running_requests + 1, and on the decode side of PD the rows
    # of requests in transfer (DecodeReqToTokenPool)
    rows = int(req_to_token_pool.req_to_token.shape[0])
    plan.max_running_requests = reqs
    plan.extra_rows = max(0, rows - (reqs + 1))
    plan.side_bytes_total = rows * plan.side_bytes_per_request
    plan.sink_store_entries, plan.sink_store_bytes_total = sizing.sink_store_plan(
        plan.available_bytes, shape, fmt.sink)

    # the rotation file's clip ratios apply where the format asks for them (kclip / vclip; the
    # per-token recipe does); keys per channel are never clipped (it costs retrieval)
    k_clip = [float(c) if fmt.k_clip else 1.0 for c in rs.k_clip.tolist()]
    v_clip = [float(c) if fmt.v_clip else 1.0 for c in rs.v_clip.tolist()]
    info = {
        "kv_cache_dtype": "int2",
        "recipe": rs_full.recipe if cfg.recipe == "file" else cfg.recipe,
        "rotation_file": rs_full.source,
        "rotation_sha256": rs_full.sha256,
        "v_rotation_file": cfg.v_rotation,
        "rotation_model_id": rs_full.model_id,
        "served_model_id": model_id,
        "kv_format": fmt.name,
        "kv_format_from": cfg.sources.get("kv_format", "default"),
        "key_layout": fmt.layout,
        "key_bits": sorted(set(fmt.k_bits)),
        "body_bits_per_element": round(fmt.body_bits_per_element(), 4),
        # token layout: the group along head_dim of K and V; channel: the value group (keys are
        # per channel over blocks of page_size tokens)
        "group_size": fmt.k_group if fmt.layout == "token" else fmt.v_group,
        "group_size_from": cfg.sources.get("group_size", "default") if fmt.layout == "token" else "kv_format",
        "page_size": kvc.pool_page_size,
        "sink_tokens": fmt.sink,
        "recent_tokens": fmt.recent,
        "k_clip": sorted({round(float(c), 4) for c in k_clip}),
        "v_clip": sorted({round(float(c), 4) for c in v_clip}),
        "layers": [li.start_layer, li.end_layer],
        "kv_heads": [kv0, kv0 + local_kv],
        "attn_tp": [ps.attn_tp_rank, ps.attn_tp_size],
        "env": dict(cfg.sources),
        "v_rotation_in": "none" if identity else ("weights" if v_in_weights else "backend"),
        "v_absorb_note": absorbed.get("reason"),
        **plan.as_dict(),
    }
    info.pop("notes", None)
    pool = OscarInt2KVPool(
        sizes.max_total_num_tokens,
        page_size=kvc.pool_page_size,
        head_num=local_kv,
        head_dim=mc.head_dim,
        v_head_dim=mc.v_head_dim,
        layer_num=li.num_effective_layers,
        device=kvc.device,
        req_rows=rows,
        sink_store_entries=plan.sink_store_entries,
        kv_format=fmt,
        k_clip=k_clip,
        v_clip=v_clip,
        k_rotation=None if identity else rs.k_rotation,
        # absorbed: the model's V / o projections already apply R_v (prepare_model)
        v_rotation=None if identity or v_in_weights else rs.v_rotation,
        start_layer=li.start_layer,
        end_layer=li.end_layer,
        enable_memory_saver=False,
        info=info,
    )
    RUNTIME_INFO.clear()
    RUNTIME_INFO.update(info)
    RUNTIME_INFO["pool"] = pool
    rot = (
        f"rotation file {rs_full.source} (sha256 {rs_full.sha256[:16]}..., recipe {info['recipe']}, "
        f"made for {rs_full.model_id or 'unknown model'})"
        if cfg.recipe == "file"
        else f"data-free {cfg.recipe} rotation (no file)"
    )
    logger.info(
        "OSCAR INT2 KV cache: format %s (%s); %s; sink %d + recent %d BF16 tokens, clip K %s V %s; "
        "layers [%d, %d), KV heads [%d, %d) of %d; V rotation applied in the %s",
        fmt.describe(), info["kv_format_from"], rot, fmt.sink, fmt.recent, info["k_clip"],
        info["v_clip"], li.start_layer, li.end_layer, kv0, kv0 + local_kv, total_kv,
        info["v_rotation_in"],
    )
    logger.info(plan.log_line())
    return pool
