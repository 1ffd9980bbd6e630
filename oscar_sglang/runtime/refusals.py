"""What `--kv-cache-dtype int2` refuses, and why (checked at startup, before any weight loads).

The INT2 pool keeps exactly one layout per KV slot (INT2 codes) plus per-request BF16 side
buffers, and only the `oscar_triton` attention backend can read it. Anything that would hand that
pool to a stock kernel, copy KV slots to another pool/host/process, or give one KV slot two
meanings is refused with a message that says what to change.

Functions take any object with the right attributes (ServerArgs, ModelConfig, or a stand-in in
tests) and return the list of problems; `raise_if_any` turns them into one error.
"""
from __future__ import annotations

import os

from .config import BACKEND


# what every model refusal ends with: the model itself is fine, only the INT2 cache is not
INSTEAD = "Serve this model with the default BF16 KV cache or --kv-cache-dtype fp8_e4m3 instead."


class Int2Unsupported(ValueError):
    """An option or model that the INT2 KV cache cannot serve."""


def _on(args, name) -> bool:
    return bool(getattr(args, name, False))


def hicache_problems(args) -> list[str]:
    """HiCache with the INT2 pool: the host tier (runtime/host_pool.py) copies whole pages of its
    own page_first blob with the "kernel" io backend and keeps its memory in torch pinned tensors,
    so the file storage backend is the one whose pages it can hand over."""
    if _on(args, "enable_hisparse"):
        return ["HiSparse (--enable-hisparse) is not supported with --kv-cache-dtype int2: its "
                "sparse host pool copies KV in SGLang's BF16 layout. Use --enable-hierarchical-cache "
                "(the INT2 host tier) instead."]
    if not _on(args, "enable_hierarchical_cache"):
        return []
    from .host_pool import IO_BACKEND, LAYOUT, STORAGE_BACKENDS

    p = []
    layout = getattr(args, "hicache_mem_layout", LAYOUT)
    if layout != LAYOUT:
        p.append(f"--hicache-mem-layout {layout} is not supported with --kv-cache-dtype int2: the "
                 f"INT2 host tier keeps one blob per page. Use --hicache-mem-layout {LAYOUT} (the default).")
    io = getattr(args, "hicache_io_backend", IO_BACKEND)
    if io != IO_BACKEND:
        p.append(f"--hicache-io-backend {io} is not supported with --kv-cache-dtype int2: the INT2 host "
                 f"tier copies whole pages itself. Use --hicache-io-backend {IO_BACKEND} (the default).")
    storage = getattr(args, "hicache_storage_backend", None)
    if storage is not None and storage not in STORAGE_BACKENDS:
        p.append(f"--hicache-storage-backend {storage} is not supported with --kv-cache-dtype int2 (it "
                 "needs zero-copy page buffers or shared host memory the INT2 host tier does not "
                 f"provide). Use --hicache-storage-backend {' or '.join(STORAGE_BACKENDS)}, or none.")
    return p


def server_args_problems(args, env=None) -> list[str]:
    """Problems with resolved ServerArgs for kv_cache_dtype == "int2"."""
    env = os.environ if env is None else env
    p: list[str] = []
    attn = getattr(args, "attention_backend", None)
    pre = getattr(args, "prefill_attention_backend", None) or attn
    dec = getattr(args, "decode_attention_backend", None) or attn
    for what, name in (
        ("attention backend (--attention-backend)", attn),
        ("prefill attention backend (--prefill-attention-backend)", pre),
        ("decode attention backend (--decode-attention-backend)", dec),
    ):
        if name is not None and name != BACKEND:
            p.append(
                f"the {what} is {name!r}: only {BACKEND!r} reads the INT2 pool "
                f"(stock kernels would read packed bytes as BF16). Drop the flag or set "
                f"--attention-backend {BACKEND}."
            )
            break
    p += speculative_problems(args, env)
    p += hicache_problems(args)
    if getattr(args, "disaggregation_mode", "null") not in (None, "null"):
        from .pd_buffers import pd_start_problems

        p += pd_start_problems(args, env)
    if int(getattr(args, "dcp_size", 1) or 1) > 1:
        p.append("decode context parallelism (--dcp-size > 1) is not supported.")
    if int(getattr(args, "attn_cp_size", 1) or 1) > 1:
        p.append("attention context parallelism (--attn-cp-size > 1) is not supported.")
    if _on(args, "enable_two_batch_overlap") or _on(args, "enable_single_batch_overlap"):
        p.append(
            "two-batch / single-batch overlap is not supported: its child backends would apply "
            "the per-forward INT2 bookkeeping twice."
        )
    if _on(args, "enable_pdmux"):
        p.append("--enable-pdmux is not supported with the INT2 KV cache.")
    if _on(args, "enable_lmcache") or _on(args, "enable_flexkv"):
        p.append("LMCache / FlexKV offload is not supported: they copy KV in SGLang's layout.")
    if _on(args, "enable_unified_memory"):
        p.append("--enable-unified-memory is not supported (it replaces the KV pool).")
    if _on(args, "enable_page_major_kv_layout"):
        p.append("--enable-page-major-kv-layout is not supported (the INT2 pool has its own layout).")
    if _on(args, "prefill_only_disable_kv_cache"):
        p.append("--prefill-only-disable-kv-cache makes no sense with a KV cache dtype.")
    if _on(args, "enable_deterministic_inference"):
        p.append(
            "--enable-deterministic-inference is not supported: the INT2 kernels do not "
            "guarantee batch-invariant results."
        )
    if getattr(args, "dllm_algorithm", None):
        p.append("diffusion LLMs (--dllm-algorithm) are not supported.")
    if _on(args, "is_embedding"):
        p.append("embedding models (--is-embedding) keep no KV cache to quantise.")
    splits = getattr(args, "triton_attention_num_kv_splits", None)
    if splits is not None and int(splits) < 2:
        p.append(
            f"--triton-attention-num-kv-splits {splits} is too few: the INT2 decode reads the BF16 "
            f"sink and ring in split(s) of their own and the quantised body in at least one more. "
            f"Drop the flag (the plugin raises SGLang's default to 64) or pass 2 or more."
        )
    if _on(args, "enable_memory_saver"):
        p.append(
            "--enable-memory-saver is not supported: the INT2 pool and its BF16 side buffers are not "
            "allocated in the memory saver's region, so releasing memory would not free them (and "
            "the side buffers' bookkeeping would not survive a release). Drop the flag."
        )
    if _on(args, "enable_torch_compile"):
        p.append(
            "--enable-torch-compile is not supported yet with the INT2 backend (untested); "
            "CUDA graphs are supported and on by default."
        )
    page = getattr(args, "page_size", None)
    try:
        from .config import load_config
        from .kv_format import page_size_for

        need = page_size_for(load_config(env).kv_format)
    except ValueError:  # a bad OSCAR_KV_FORMAT: load_config reports it
        need = None
    if need is not None and page not in (None, need):
        p.append(
            f"--page-size {page} does not match the KV format's key block of {need} tokens (keys are "
            f"quantised per page): drop --page-size, or choose a format whose blocks match it "
            f"(OSCAR_KV_FORMAT=k4c32-v2h-s4-w128 for 32, k4c64-v2h-s4-w128 (the default) for 64, "
            f"'token' for any page size)."
        )
    if str(env.get("SGLANG_ENABLE_POST_CAPTURE_KV_SIZING", "")).lower() in ("1", "true", "yes"):
        p.append(
            "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING is not supported: the INT2 pool is sized once, "
            "with its BF16 side buffers; unset it."
        )
    return p


def speculative_problems(args, env=None) -> list[str]:
    """Speculative settings the INT2 cache cannot serve: anything but chains of drafts
    (runtime/speculative.py says why) from NGRAM, EAGLE, EAGLE3 or STANDALONE."""
    from .speculative import CHAIN_ALGORITHMS, algorithm

    alg = algorithm(args)
    if not alg:
        return []
    flag = f"--speculative-algorithm {alg}"
    if alg not in CHAIN_ALGORITHMS:
        return [f"{flag} is not supported with the INT2 KV cache; use NGRAM (no draft model), EAGLE / "
                f"EAGLE3 (a draft head) or STANDALONE (a small draft model), with chains of drafts."]
    p: list[str] = []
    topk = getattr(args, "speculative_eagle_topk", None)
    if alg == "NGRAM":
        breadth = getattr(args, "speculative_ngram_max_bfs_breadth", None)
        if breadth not in (None, 1) or topk not in (None, 1):
            p.append(f"NGRAM draft trees (--speculative-ngram-max-bfs-breadth {breadth}) are not supported "
                     f"with the INT2 KV cache: pass --speculative-ngram-max-bfs-breadth 1 (chains; the "
                     f"plugin sets it when the flag is left at SGLang's default).")
        if str(getattr(args, "speculative_ngram_match_type", "BFS") or "BFS").upper() != "BFS":
            p.append("--speculative-ngram-match-type PROB is not supported with the INT2 KV cache: leave it "
                     "at BFS (chains at breadth 1).")
        if getattr(args, "speculative_ngram_external_corpus_path", None):
            p.append("--speculative-ngram-external-corpus-path is not supported with the INT2 KV cache: its "
                     "drafts merge into trees. Drop the flag.")
    elif topk not in (None, 1):
        p.append(f"draft trees (--speculative-eagle-topk {topk}) are not supported with the INT2 KV "
                 f"cache: pass --speculative-eagle-topk 1 (chains), or leave the speculative settings "
                 f"unset for the plugin's chain of 3 drafts.")
    if getattr(args, "speculative_adaptive", False):
        p.append("--speculative-adaptive is not supported with the INT2 KV cache (the draft count must "
                 "stay fixed); drop the flag.")
    if str(getattr(args, "speculative_draft_attention_backend", None) or "") == BACKEND:
        p.append(f"--speculative-draft-attention-backend {BACKEND}: the draft model's KV cache is BF16; "
                 f"use triton (the plugin's default) or flashinfer.")
    # more drafts a step than the recent window holds: the backend refuses at start
    # (DraftRollback), once the model's format is resolved
    return p


def model_problems(model_config, hybrid_linear: bool = False) -> list[str]:
    """Problems with the model architecture (a SGLang ModelConfig or a stand-in).

    hybrid_linear: the caller's answer to "is this a mamba / linear-attention hybrid" (SGLang
    decides that with functions of the config, see is_hybrid_linear).
    """
    p: list[str] = []
    arch = getattr(model_config, "attention_arch", None)
    if arch is not None and str(getattr(arch, "name", arch)).upper().endswith("MLA"):
        p.append(
            "MLA models (DeepSeek-V2/V3, Kimi, ...) are not supported: the INT2 pool stores "
            f"per-head K and V, not a compressed latent. {INSTEAD}"
        )
    hf = getattr(model_config, "hf_config", None)
    archs = list(getattr(hf, "architectures", None) or [])
    if getattr(model_config, "is_hybrid_swa", False):
        p.append(f"hybrid sliding-window models (SWA pools, e.g. gpt-oss, Llama 4) are not supported. {INSTEAD}")
    sw = getattr(model_config, "sliding_window_size", None)
    if sw not in (None, -1, 0):
        p.append(f"sliding-window attention (sliding_window={sw} in the model config, e.g. Gemma 2/3, "
                 f"Mistral-7B-v0.1) is not supported: the INT2 kernels attend to all keys. {INSTEAD}")
    if getattr(model_config, "attention_chunk_size", None):
        p.append(
            "chunked local attention (attention_chunk_size, Llama 4) is not supported: the INT2 "
            f"kernels attend to all keys. {INSTEAD}"
        )
    if getattr(model_config, "has_attention_sinks", False):
        p.append(
            "attention sinks (learned per-head sink logits, e.g. gpt-oss) are not supported by the "
            f"INT2 kernels. {INSTEAD}"
        )
    if hybrid_linear:
        p.append("hybrid mamba / linear-attention models (e.g. Qwen3-Next, Jamba, Nemotron-H) are not "
                 f"supported: their full-attention layers share a pool with recurrent state. {INSTEAD}")
    if getattr(model_config, "is_encoder_decoder", False):
        p.append(f"encoder-decoder models (cross attention) are not supported. {INSTEAD}")
    for a in archs:
        low = a.lower()
        if "deepseekv3" in low or "deepseekv32" in low or "deepseekv4" in low or "minimax" in low:
            p.append(f"{a} (DSA / DSv4 / sparse attention) is not supported.")
            break
    hd = getattr(model_config, "head_dim", None)
    vd = getattr(model_config, "v_head_dim", hd)
    from oscar_kernels.format import SUPPORTED_HEAD_DIMS

    for name, d in (("head_dim", hd), ("v_head_dim", vd)):
        if d is not None and d not in SUPPORTED_HEAD_DIMS:
            p.append(f"{name}={d} is not supported by the INT2 kernels (supported: {SUPPORTED_HEAD_DIMS}). "
                     f"{INSTEAD}")
    return p


def format_problems(cfg, model_config) -> list[str]:
    """The KV format (OSCAR_KV_FORMAT or its default) for this model's head dims and layers."""
    from .kv_format import KVFormatError, for_model

    if getattr(model_config, "head_dim", None) is None or getattr(model_config, "num_hidden_layers", None) is None:
        return []
    try:
        for_model(cfg, model_config)
    except KVFormatError as e:
        return [str(e)]
    return []


def kv_scale_problems(model) -> list[str]:
    """FP8 KV-cache scales that the INT2 cache would drop (checked once the weights are loaded).

    With FP8 weights (--quantization fp8, FP8 checkpoints) SGLang gives every RadixAttention a
    k_scale / v_scale for an FP8 KV cache, 1.0 when the checkpoint has none. Attention still reads
    BF16 q / k / v and the INT2 pool quantises unscaled K / V with its own scales, so unit scales
    change nothing; other values were calibrated for an FP8 cache that this is not.
    """
    scaled = []
    for m in model.modules():
        if not hasattr(m, "layer_id") or not hasattr(m, "k_scale"):
            continue
        if m.k_scale is None and getattr(m, "v_scale", None) is None:
            continue
        ks, vs = getattr(m, "k_scale_float", None), getattr(m, "v_scale_float", None)
        if ks != 1.0 or vs != 1.0:
            scaled.append((m.layer_id, ks, vs))
    if not scaled:
        return []
    lid, ks, vs = scaled[0]
    return [
        f"{len(scaled)} attention layers carry FP8 KV-cache scales from the checkpoint (layer {lid}: "
        f"k_scale={ks}, v_scale={vs}); the INT2 cache stores unscaled K/V and would ignore them. "
        "Serve this checkpoint with --kv-cache-dtype fp8_e4m3 (or the default BF16 cache), or use "
        "a copy without KV scales (FP8 weights alone are fine with int2)."
    ]


def unit_kv_scales_for_dummy_weights(model) -> int:
    """--load-format dummy fills every float parameter with uniform(-1e-3, 1e-3), the KV scales
    of FP8 weights included, and SGLang keeps a positive pair as real scales. They mean nothing
    (no checkpoint calibrated them) and the INT2 path never applies a KV scale, so set them to the
    neutral 1.0 instead of refusing the model. -> how many layers were changed."""
    n = 0
    for m in model.modules():
        if not hasattr(m, "layer_id") or getattr(m, "k_scale", None) is None:
            continue
        if getattr(m, "k_scale_float", None) != 1.0 or getattr(m, "v_scale_float", None) != 1.0:
            for name in ("k_scale", "v_scale"):
                t = getattr(m, name, None)
                if hasattr(t, "fill_"):
                    t.data.fill_(1.0)
            m.k_scale_float = m.v_scale_float = 1.0
            n += 1
    return n


def is_hybrid_linear(model_config) -> bool:
    """SGLang's own tests for mamba / linear-attention hybrids (functions of the config)."""
    from sglang.srt.configs import hybrid_arch

    for name in ("mambaish_config", "hybrid_gdn_config", "kimi_linear_config", "linear_attn_model_spec"):
        fn = getattr(hybrid_arch, name, None)
        if fn is not None:
            try:
                if fn(model_config):
                    return True
            except Exception:  # a config these helpers do not understand is not a hybrid
                continue
    return False


def raise_if_any(problems: list[str], what: str = "--kv-cache-dtype int2") -> None:
    if problems:
        lines = "\n".join(f"  - {x}" for x in problems)
        raise Int2Unsupported(f"{what} cannot start:\n{lines}")
