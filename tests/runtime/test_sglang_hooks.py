"""The plugin against the real sglang==0.5.17 package, on CPU.

Imports SGLang once (about 40 s on the CI machine) and checks: the entry point applies every
hook; `--kv-cache-dtype int2` parses and resolves to the oscar_triton backend; refusals fire
through ServerArgs; the dtype / configurator / pool hooks build an INT2 pool of the right size
with the rotation file's slice for this rank; bad rotation files are rejected; row resets,
server info and metrics work.
"""
import copy
import json
import logging
from types import SimpleNamespace

import pytest
import torch

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
    "vocab_size": 1000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def sgl():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.server_args as server_args

    return server_args


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3")
    (d / "config.json").write_text(json.dumps(TINY_QWEN3))
    return str(d)


def _prepare(sgl, tiny_model, *extra):
    return sgl.prepare_server_args(
        ["--model-path", tiny_model, "--kv-cache-dtype", "int2", "--skip-tokenizer-init",
         "--device", "cpu", *extra]
    )


# ------------------------------------------------------------------------------- hooks and CLI


def test_entry_point_applies_every_hook(sgl):
    from oscar_sglang.runtime.hooks import HOOKS, verify_hooks
    from oscar_sglang.runtime.state import hooks_ok, require_hooks

    assert verify_hooks() == []
    assert hooks_ok()
    require_hooks()
    assert len(HOOKS) == 26


def test_verify_hooks_detects_a_missing_hook(sgl, monkeypatch):
    from sglang.srt.mem_cache import kv_cache_dtype

    from oscar_sglang.runtime.hooks import verify_hooks

    wrapped = kv_cache_dtype.configure_kv_cache_dtype
    monkeypatch.setattr(kv_cache_dtype, "configure_kv_cache_dtype", wrapped.__wrapped__)
    assert verify_hooks() == ["sglang.srt.mem_cache.kv_cache_dtype.configure_kv_cache_dtype"]


def test_parser_accepts_int2_and_backend(sgl):
    import argparse

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    p = argparse.ArgumentParser()
    sgl.ServerArgs.add_cli_args(p)
    a = p.parse_args(["--model-path", "m", "--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton"])
    assert a.kv_cache_dtype == "int2" and a.attention_backend == "oscar_triton"
    assert "int2" in p._option_string_actions["--kv-cache-dtype"].choices
    assert "OSCAR" in p._option_string_actions["--kv-cache-dtype"].help
    for flag in ("--prefill-attention-backend", "--decode-attention-backend"):
        assert "oscar_triton" in p._option_string_actions[flag].choices
    assert "oscar_triton" in ATTENTION_BACKENDS
    with pytest.raises(SystemExit):  # stock choices still enforced
        p.parse_args(["--model-path", "m", "--kv-cache-dtype", "int3"])


def test_engine_style_kwargs_accept_int2(sgl, tiny_model):
    """sglang.Engine(**kw) builds ServerArgs(**kw) after load_plugins(): no argparse involved."""
    a = sgl.ServerArgs(model_path=tiny_model, kv_cache_dtype="int2", skip_tokenizer_init=True, device="cpu")
    assert a.kv_cache_dtype == "int2" and a.attention_backend == "oscar_triton"


def test_server_args_resolve_to_oscar_backend(sgl, tiny_model):
    a = _prepare(sgl, tiny_model)
    assert a.kv_cache_dtype == "int2"
    assert a.attention_backend == "oscar_triton"
    assert a.get_attention_backends() == ("oscar_triton", "oscar_triton")
    # int2 raises SGLang's default split-K cap (8) so long-context decode fills the GPU
    assert a.triton_attention_num_kv_splits == 64
    c = _prepare(sgl, tiny_model, "--triton-attention-num-kv-splits", "16")
    assert c.triton_attention_num_kv_splits == 16
    # HiCache with its defaults (page_first, io "kernel") and the file tier passes the checks
    h = _prepare(sgl, tiny_model, "--enable-hierarchical-cache", "--hicache-storage-backend", "file")
    assert h.enable_hierarchical_cache and h.hicache_mem_layout == "page_first"
    # a non-int2 server is untouched by the plugin
    b = sgl.prepare_server_args(["--model-path", tiny_model, "--skip-tokenizer-init", "--device", "cpu"])
    assert b.kv_cache_dtype == "auto" and b.attention_backend != "oscar_triton"


def test_page_size_follows_the_kv_format(sgl, tiny_model, monkeypatch):
    """Per-channel key blocks are SGLang pages: the default format sets --page-size 64, the
    per-token recipe leaves SGLang's 1, a format with blocks of 32 sets 32; a --page-size that
    does not match the blocks is refused, one that matches is kept."""
    from oscar_sglang.runtime.refusals import Int2Unsupported

    monkeypatch.delenv("OSCAR_KV_FORMAT", raising=False)
    assert _prepare(sgl, tiny_model).page_size == 64
    assert _prepare(sgl, tiny_model, "--page-size", "64").page_size == 64
    with pytest.raises(Int2Unsupported, match="--page-size 16 does not match"):
        _prepare(sgl, tiny_model, "--page-size", "16")
    monkeypatch.setenv("OSCAR_KV_FORMAT", "k2c32-v2t64")
    assert _prepare(sgl, tiny_model).page_size == 32
    monkeypatch.setenv("OSCAR_KV_FORMAT", "token")
    assert _prepare(sgl, tiny_model).page_size == 1
    assert _prepare(sgl, tiny_model, "--page-size", "16").page_size == 16


@pytest.mark.parametrize("fmt, word", [
    ("k3c64-v2t64-tn", "token-norm"),
    ("k3c64-v4t64", "2-bit"),
    ("k3c64-v2t64-cal", "OSCAR_ROTATION"),
    ("k5c64-v2t64", "5-bit keys are not supported"),
])
def test_unservable_formats_refused_at_start(sgl, tiny_model, monkeypatch, fmt, word):
    from oscar_sglang.runtime.config import OscarConfigError
    from oscar_sglang.runtime.refusals import Int2Unsupported

    monkeypatch.setenv("OSCAR_KV_FORMAT", fmt)
    with pytest.raises((Int2Unsupported, OscarConfigError)) as e:
        _prepare(sgl, tiny_model)
    assert word in str(e.value) and "OSCAR_KV_FORMAT" in str(e.value)


@pytest.mark.parametrize(
    "extra, word",
    [
        (["--attention-backend", "triton"], "only 'oscar_triton' reads the INT2 pool"),
        (["--decode-attention-backend", "triton", "--prefill-attention-backend", "oscar_triton"], "decode attention backend"),
        (["--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "4"], "NGRAM draft trees"),
        (["--speculative-algorithm", "NGRAM", "--speculative-ngram-match-type", "PROB"], "match-type PROB"),
        (["--enable-hierarchical-cache", "--hicache-mem-layout", "layer_first"], "--hicache-mem-layout layer_first"),
        (["--enable-hierarchical-cache", "--hicache-storage-backend", "nixl"], "--hicache-storage-backend nixl"),
        (["--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache"],
         "--disaggregation-decode-enable-radix-cache is not supported"),
        (["--enable-two-batch-overlap"], "two-batch"),
        (["--enable-memory-saver"], "--enable-memory-saver is not supported"),
    ],
)
def test_refusals_through_server_args(sgl, tiny_model, extra, word):
    from oscar_sglang.runtime.refusals import Int2Unsupported

    with pytest.raises(Int2Unsupported) as e:
        _prepare(sgl, tiny_model, *extra)
    assert word in str(e.value)


def test_bad_env_fails_in_the_launching_process(sgl, tiny_model, monkeypatch):
    from oscar_sglang.runtime.config import OscarConfigError

    monkeypatch.setenv("OSCAR_K_CLIP", "2")
    with pytest.raises(OscarConfigError, match="OSCAR_K_CLIP"):
        _prepare(sgl, tiny_model)


def test_a_removed_setting_fails_in_the_launching_process(sgl, tiny_model, monkeypatch):
    from oscar_sglang.runtime.config import OscarConfigError

    monkeypatch.setenv("OSCAR_CHANNEL_DECODE_KEYS", "bf16")
    with pytest.raises(OscarConfigError, match="OSCAR_CHANNEL_DECODE_KEYS was removed: .*unset it"):
        _prepare(sgl, tiny_model)


def test_stock_kv_cache_dtypes_are_read_from_sglangs_declaration(sgl):
    """SGLang 0.5.17 declares no int2 of its own: the plugin's int2 shadows nothing."""
    from oscar_sglang.runtime import hooks

    stock = hooks.stock_kv_cache_dtypes()
    assert "fp8_e4m3" in stock and "auto" in stock and "int2" not in stock
    assert hooks.upstream_int2_problem(stock) is None and hooks.install_problem() is None


def test_an_sglang_with_its_own_int2_is_refused_at_start(sgl, tiny_model, monkeypatch):
    """An SGLang whose --kv-cache-dtype already offers int2 (an upstream int2 KV cache): the plugin
    says so and refuses every int2 start instead of shadowing it; other dtypes still start."""
    import argparse
    import sys

    from oscar_sglang.runtime import hooks, state

    monkeypatch.setattr(hooks, "stock_kv_cache_dtypes", lambda: ["auto", "fp8_e4m3", "int2"])
    msg = hooks.install_problem()
    assert "has an `int2` KV cache dtype of its own" in msg and "sglang==0.5.17" in msg
    assert "pip uninstall oscar-sglang" in msg
    import sglang

    assert f"({sglang.__version__})" in msg

    monkeypatch.setitem(state._install, "error", None)
    monkeypatch.setattr(sys, "argv", ["sglang.launch_server", "--kv-cache-dtype", "int2"])
    with pytest.raises(SystemExit) as e:
        hooks._refuse(msg)
    assert e.value.code == 2
    with pytest.raises(state.HookInstallError, match="of its own"):
        _prepare(sgl, tiny_model)  # engine-style ServerArgs(kv_cache_dtype="int2") too
    a = sgl.ServerArgs(model_path=tiny_model, skip_tokenizer_init=True, device="cpu")
    assert a.kv_cache_dtype == "auto"  # a server without int2 is untouched

    # the parser route: a --kv-cache-dtype whose choices hold an int2 the plugin did not add
    monkeypatch.setitem(state._install, "error", None)
    monkeypatch.setattr(sys, "argv", ["x"])
    p = argparse.ArgumentParser()
    p.add_argument("--kv-cache-dtype", choices=["auto", "int2"], help="stock")
    hooks.after_add_cli_args(None, p)
    assert p._option_string_actions["--kv-cache-dtype"].help == "stock"  # not claimed as ours
    assert "of its own" in state._install["error"]
    # ours, added once: a second pass over the same parser is not taken for an upstream int2
    monkeypatch.setitem(state._install, "error", None)
    p = argparse.ArgumentParser()
    p.add_argument("--kv-cache-dtype", choices=["auto"])
    hooks.after_add_cli_args(None, p)
    hooks.after_add_cli_args(None, p)
    assert p._option_string_actions["--kv-cache-dtype"].choices == ["auto", "int2"]
    assert state._install["error"] is None


def test_sliding_window_model_refused(sgl, tmp_path):
    from oscar_sglang.runtime.refusals import Int2Unsupported

    cfg = dict(TINY_QWEN3, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Int2Unsupported, match="sliding-window"):
        _prepare(sgl, str(tmp_path))


def test_dtype_hook(sgl):
    from sglang.srt.mem_cache import kv_cache_dtype

    kw = dict(model=None, model_dtype=torch.bfloat16, is_draft_worker=False, is_dflash=False,
              speculative_draft_attention_backend=None)
    assert kv_cache_dtype.configure_kv_cache_dtype(server_args_kv_cache_dtype="int2", **kw) == ("int2", torch.uint8)
    name, dt = kv_cache_dtype.configure_kv_cache_dtype(server_args_kv_cache_dtype="auto", **kw)
    assert dt == torch.bfloat16
    # a draft model (EAGLE / STANDALONE) keeps a cache in its own dtype, as a default server does
    kw.update(is_draft_worker=True, model_dtype=torch.float16)
    assert kv_cache_dtype.configure_kv_cache_dtype(server_args_kv_cache_dtype="int2", **kw) == ("auto", torch.float16)


def test_speculative_chains_are_set_when_unset(sgl, tiny_model):
    args = _prepare(sgl, tiny_model, "--speculative-algorithm", "NGRAM")
    assert (args.speculative_ngram_max_bfs_breadth, args.speculative_eagle_topk) == (1, 1)
    args = _prepare(sgl, tiny_model, "--speculative-algorithm", "STANDALONE",
                    "--speculative-draft-model-path", tiny_model)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    assert args.speculative_draft_attention_backend == "triton"
    # what the user chose stays: a chain of 5 drafts
    args = _prepare(sgl, tiny_model, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                    tiny_model, "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
                    "--speculative-num-draft-tokens", "6")
    assert (args.speculative_num_steps, args.speculative_num_draft_tokens) == (5, 6)


def test_speculative_trees_are_refused(sgl, tiny_model):
    from oscar_sglang.runtime.refusals import Int2Unsupported

    with pytest.raises(Int2Unsupported) as e:
        _prepare(sgl, tiny_model, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
                 tiny_model, "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                 "--speculative-num-draft-tokens", "8")
    assert "--speculative-eagle-topk 4" in str(e.value) and "--speculative-eagle-topk 1" in str(e.value)


# ------------------------------------------------------------------------------- sizing and pool


@pytest.fixture
def kvc(sgl, tiny_model, monkeypatch):
    """A stand-in KVCacheConfigurator (the fields the int2 path reads) on a real ModelConfig."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    import oscar_sglang.runtime.configurator as cf

    args = _prepare(sgl, tiny_model)
    mc = args.get_model_config()
    par = SimpleNamespace(attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1)
    monkeypatch.setattr(cf, "_parallel", lambda: par)
    monkeypatch.setattr(cf, "_requested_max_running_requests", lambda: None)
    # the per-token recipe at page size 1 (test_channel_format_pool covers the default format)
    monkeypatch.setenv("OSCAR_KV_FORMAT", "token")
    return SimpleNamespace(
        model_config=mc, server_args=args, kv_cache_dtype_str="int2", kv_cache_dtype=torch.uint8,
        layer_info=SimpleNamespace(num_effective_layers=3, start_layer=0, end_layer=3),
        spec_algorithm=SpeculativeAlgorithm.NONE, is_draft_worker=False, ps=SimpleNamespace(pp_size=1),
        use_mla_backend=False, is_hybrid_swa=False, pool_page_size=1, device="cpu", _par=par,
    )


def _build(kvc, avail, reqs_cap=None, page_size=1, extra_rows=0):
    from sglang.srt.model_executor import pool_configurator as pc

    from oscar_sglang.runtime.configurator import Int2PoolConfigurator
    from oscar_sglang.runtime.hooks import around_build_token_to_kv_pool

    conf = pc.create_memory_pool_configurator(kvc)
    assert isinstance(conf, Int2PoolConfigurator)
    cfg = conf.calculate_pool_sizes(avail, page_size)
    cfg.max_running_requests = 4096 if reqs_cap is None else reqs_cap  # SGLang's estimate
    cfg = pc.create_memory_pool_configurator(kvc).finalize_with_max_running_requests(cfg)
    sizes = SimpleNamespace(max_total_num_tokens=cfg.max_total_num_tokens, max_running_requests=cfg.max_running_requests)
    # the request pool's table: max_running_requests + 1 rows (+ the PD decode side's extra slots)
    rows = cfg.max_running_requests + 1 + extra_rows
    req_pool = SimpleNamespace(size=cfg.max_running_requests, req_to_token=torch.zeros(rows, 1, dtype=torch.int32))
    pool = around_build_token_to_kv_pool(None, kvc, sizes=sizes, is_dsa_model=False, is_dsv4_model=False,
                                         req_to_token_pool=req_pool)
    return cfg, pool


def test_configurator_and_pool(kvc, monkeypatch, caplog):
    from oscar_sglang.runtime import sizing
    from oscar_sglang.runtime.state import RUNTIME_INFO
    from oscar_sglang.runtime.pool import OscarInt2KVPool

    monkeypatch.setenv("OSCAR_SINK_TOKENS", "4")
    monkeypatch.setenv("OSCAR_RECENT_TOKENS", "8")
    monkeypatch.setenv("OSCAR_MAX_RUNNING_REQUESTS", "5")
    avail = 64 << 20
    with caplog.at_level(logging.INFO, logger="oscar_sglang"):
        cfg, pool = _build(kvc, avail)
    shape = sizing.ModelKVShape(3, 2, 64, 64)
    per_tok = sizing.int2_bytes_per_token(shape, pool.kv_format)
    assert pool.kv_format.name == "k2t64-v2t64-kclip-vclip-s4-w8" and pool.kv_format.k_group == 64
    assert per_tok == 3 * 2 * 2 * (16 + 4) + 4
    per_req = sizing.side_bytes_per_request(shape, 4, 8)
    assert cfg.max_running_requests == 5
    # the rows' side buffers and their share of the sinks kept for radix hits, then tokens
    store = sizing.sink_store_plan(avail, shape, 4)[1]
    assert cfg.max_total_num_tokens == (avail - 6 * per_req - store) // per_tok
    assert isinstance(pool, OscarInt2KVPool)
    assert pool.k_codes[0].shape == (cfg.max_total_num_tokens + 1, 2, 16)
    assert pool.k_params[0].shape == (cfg.max_total_num_tokens + 1, 2, 1, 2)
    assert pool.sink_k[0].shape == (6, 4, 2, 64) and pool.ring_v[2].shape == (6, 8, 2, 64)
    assert pool.sink_k[0].dtype == torch.bfloat16 and pool.dtype == torch.uint8
    # the whole pool is what the plan said: INT2 bytes + side buffers
    assert pool._int2_bytes() == (cfg.max_total_num_tokens + 1) * per_tok
    assert pool._side_bytes() == 6 * per_req
    # hadamard by default: one matrix shared by both heads
    H = pool.k_rot[0]
    assert H.shape == (2, 64, 64) and torch.allclose(H[0] @ H[0].T, torch.eye(64), atol=1e-5)
    assert RUNTIME_INFO["recipe"] == "hadamard" and RUNTIME_INFO["max_total_num_tokens"] == cfg.max_total_num_tokens
    text = caplog.text
    assert "data-free hadamard rotation" in text and f"{cfg.max_total_num_tokens:,} tokens fit" in text
    assert "B/token INT2" in text and "side buffers" in text
    with pytest.raises(RuntimeError, match="only by the oscar_triton"):
        pool.set_kv_buffer(None, None, None, None)
    with pytest.raises(NotImplementedError):
        pool.get_cpu_copy([0])


def test_pd_decode_pool_has_a_side_row_per_request_row(kvc, monkeypatch, caplog):
    """The decode side of PD (SGLang's DecodeReqToTokenPool) keeps extra request rows for
    requests in transfer: the plan reserves their side buffers and the pool has a side row for
    each (a row past them would be written out of bounds)."""
    from oscar_sglang.runtime import sizing

    monkeypatch.setenv("OSCAR_SINK_TOKENS", "4")
    monkeypatch.setenv("OSCAR_RECENT_TOKENS", "8")
    monkeypatch.setenv("OSCAR_MAX_RUNNING_REQUESTS", "5")
    class DecodeArgs:  # resolved ServerArgs are read-only: the decode server's two fields over them
        disaggregation_mode, disaggregation_decode_extra_slots = "decode", 3

        def __getattr__(self, name):
            return getattr(base, name)

    base = kvc.server_args
    monkeypatch.setattr(kvc, "server_args", DecodeArgs())
    avail = 64 << 20
    with caplog.at_level(logging.INFO, logger="oscar_sglang"):
        cfg, pool = _build(kvc, avail, extra_rows=3)
    shape = sizing.ModelKVShape(3, 2, 64, 64)
    per_tok = sizing.int2_bytes_per_token(shape, pool.kv_format)
    per_req = sizing.side_bytes_per_request(shape, 4, 8)
    store = sizing.sink_store_plan(avail, shape, 4)[1]
    assert cfg.max_running_requests == 5 and pool.req_rows == 9 and pool.sink_k[0].shape[0] == 9
    assert cfg.max_total_num_tokens == (avail - 9 * per_req - store) // per_tok
    assert pool._side_bytes() == 9 * per_req
    assert "x 9 rows (max_running_requests=5 + 1 padding + 3 for PD transfers)" in caplog.text


def test_channel_format_pool(kvc, monkeypatch, caplog):
    """The default format through the configurator: keys 3-bit per channel with one (scale, min)
    row per page of 64 slots, sizes as the plan says, no key clip, what was loaded in the log."""
    from oscar_sglang.runtime import sizing
    from oscar_sglang.runtime.state import RUNTIME_INFO

    monkeypatch.delenv("OSCAR_KV_FORMAT")
    monkeypatch.setenv("OSCAR_K_CLIP", "0.9")  # a per-token recipe setting: keys per channel ignore it
    monkeypatch.setenv("OSCAR_MAX_RUNNING_REQUESTS", "3")
    kvc.pool_page_size = 64
    avail = 64 << 20
    with caplog.at_level(logging.INFO, logger="oscar_sglang"):
        cfg, pool = _build(kvc, avail, page_size=64)
    fmt = pool.kv_format
    assert pool.layout.name == "channel" and fmt.name == "k4c64-v2t64-s4-w128" and fmt.page_size == 64  # v2h on 64 dims
    shape = sizing.ModelKVShape(3, 2, 64, 64)
    per_tok = sizing.int2_bytes_per_token(shape, fmt)
    assert per_tok == 3 * 2 * ((32 + 4) + (16 + 4)) + 4
    per_req = sizing.side_bytes_per_request(shape, 4, 128)
    store = sizing.sink_store_plan(avail, shape, 4)[1]
    assert cfg.max_total_num_tokens == (avail - 4 * per_req - store) // per_tok // 64 * 64
    n = cfg.max_total_num_tokens + 64
    assert pool.k_codes[1].shape == (n, 2, 32) and pool.k_params[1].shape == (n // 64, 2, 64, 2)
    assert pool.v_codes[1].shape == (n, 2, 16) and pool.v_params[1].shape == (n, 2, 1, 2)
    assert pool._int2_bytes() == n * per_tok
    assert pool.k_clip == [1.0] * 3
    assert RUNTIME_INFO["kv_format"] == "k4c64-v2t64-s4-w128" and RUNTIME_INFO["body_bits_per_element"] == 3.5
    assert RUNTIME_INFO["key_layout"] == "channel" and RUNTIME_INFO["page_size"] == 64
    assert "format k4c64-v2t64-s4-w128: 4-bit keys per channel over blocks of 64 tokens" in caplog.text
    # a page size that does not match the blocks never builds a pool
    kvc.pool_page_size = 32
    with pytest.raises(RuntimeError, match="needs|page size is 32"):
        _build(kvc, avail, page_size=32)


def _graph_args(max_bs=256, locked=()):
    """The attributes of ServerArgs that the decode CUDA-graph sizes depend on, after SGLang's
    resolution on an H100 (batch sizes up to 256)."""
    from sglang.srt.server_args import ServerArgs

    fake = SimpleNamespace(disable_cuda_graph_padding=False, speculative_algorithm=None,
                           _cuda_graph_config_locked=set(locked))
    bs = ServerArgs._generate_decode_cuda_graph_batch_sizes(fake, max_bs)
    fake.cuda_graph_config = SimpleNamespace(decode=SimpleNamespace(bs=bs, max_bs=max_bs))
    return fake


def test_decode_graphs_cover_the_rows_int2_runs(kvc, monkeypatch, caplog):
    """The finalized max_running_requests sets the largest decode CUDA graph (SGLang's H100
    default stops at 256; int2 runs more at once), unless the user chose the graph sizes."""
    from oscar_sglang.runtime.configurator import cover_rows_with_decode_graphs

    monkeypatch.setenv("OSCAR_MAX_RUNNING_REQUESTS", "639")
    g = _graph_args()
    graphs = copy.deepcopy(kvc.server_args.cuda_graph_config)  # the CPU test args have no decode sizes
    graphs.decode.bs, graphs.decode.max_bs = g.cuda_graph_config.decode.bs, 256
    kvc.server_args.override("test: SGLang's H100 decode graphs", cuda_graph_config=graphs)
    default = list(kvc.server_args.cuda_graph_config.decode.bs)
    with caplog.at_level(logging.INFO, logger="oscar_sglang"):
        cfg, _ = _build(kvc, 1 << 30)
    rows = cfg.max_running_requests
    assert 272 < rows <= 639
    dec = kvc.server_args.cuda_graph_config.decode
    assert dec.max_bs == rows and dec.bs[-1] == rows
    assert dec.bs[:len(default)] == default  # SGLang's sizes kept, larger ones in its own steps
    assert {b for b in range(272, rows, 16)} <= set(dec.bs) and dec.bs == sorted(set(dec.bs))
    assert f"decode CUDA graphs up to batch {rows} (SGLang's default 256)" in caplog.text
    assert not cover_rows_with_decode_graphs(kvc.server_args, rows)  # idempotent
    # fewer rows than SGLang's graphs, a user's --cuda-graph-max-bs / --cuda-graph-bs, graphs off
    for args, rows in ((_graph_args(), 200), (_graph_args(locked=[("decode", "max_bs")]), 639),
                       (_graph_args(locked=[("decode", "bs")]), 639)):
        before = list(args.cuda_graph_config.decode.bs)
        assert not cover_rows_with_decode_graphs(args, rows)
        assert args.cuda_graph_config.decode.bs == before and args.cuda_graph_config.decode.max_bs == max(before)
    cpu = SimpleNamespace(cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(bs=None, max_bs=None)))
    assert not cover_rows_with_decode_graphs(cpu, 639)


def test_pool_slices_rotation_file_for_tp_rank(kvc, tmp_path, monkeypatch, seed):
    from oscar_sglang.common import rotations as R

    L, Hk, D = 3, 2, 64
    rk = torch.linalg.qr(torch.randn(L, Hk, D, D, dtype=torch.float64))[0].float()
    rv = torch.linalg.qr(torch.randn(L, 1, D, D, dtype=torch.float64))[0].float()
    rs = R.RotationSet(rk, rv, torch.full((L,), 0.96), torch.full((L,), 0.92),
                       metadata={"recipe": "oscar", "model_id": "tiny_qwen3"})
    path = tmp_path / "rot.safetensors"
    sha = R.save_rotation_file(rs, path)
    monkeypatch.setenv("OSCAR_ROTATION", str(path))
    monkeypatch.setenv("OSCAR_V_CLIP", "0.9")  # env overrides the file
    monkeypatch.setenv("OSCAR_ALLOW_MODEL_MISMATCH", "1")
    # rank 1 of attention TP 2: holds global KV head 1
    kvc._par.attn_tp_size, kvc._par.attn_tp_rank = 2, 1
    kvc.model_config.num_key_value_heads = 2
    _, pool = _build(kvc, 32 << 20)
    assert pool.head_num == 1
    assert torch.equal(pool.k_rot[2][0], rk[2, 1])
    assert torch.equal(pool.v_rot[1][0], rv[1, 0])
    assert pool.k_clip == pytest.approx([0.96] * 3) and pool.v_clip == pytest.approx([0.9] * 3)
    assert pool.info["rotation_sha256"] == sha and pool.info["rotation_file"] == str(path)
    assert pool.info["kv_heads"] == [1, 2]
    assert pool.info["group_size_from"] == "default"


def _runner(kvc):
    """A stand-in ModelRunner after load_model: the tiny Qwen3's attention modules (SGLang's
    attribute layout: attn, fused qkv_proj, o_proj) with random bf16 weights."""
    from tests.runtime.test_absorb import Attn

    mc = kvc.model_config
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([
        Attn(i, hidden=mc.hidden_size, Hq=mc.num_attention_heads, Hkv=2, D=mc.head_dim, bias=False,
             dtype=torch.bfloat16) for i in range(3)])
    return SimpleNamespace(model=model, model_config=mc, layer_info=kvc.layer_info,
                           server_args=kvc.server_args, kv_cache_dtype_str="int2", is_draft_worker=False)


def test_v_rotation_folded_into_the_weights_leaves_the_pool_without_one(kvc, monkeypatch, caplog, seed):
    import oscar_sglang.runtime.configurator as cf
    from oscar_sglang.runtime.hooks import after_runner_kv_dtype, around_weight_update

    monkeypatch.setattr(cf, "V_ABSORB", {})  # per-process state: none left for the other tests
    runner = _runner(kvc)
    before = [m.o_proj.weight.detach().clone() for m in runner.model.layers]
    with caplog.at_level(logging.INFO, logger="oscar_sglang"):
        after_runner_kv_dtype(None, runner)
        _, pool = _build(kvc, 32 << 20)
    assert "V rotation folded into the V and output projections of layers [0, 3)" in caplog.text
    assert "V rotation applied in the weights" in caplog.text
    assert all(not torch.equal(b, m.o_proj.weight) for b, m in zip(before, runner.model.layers))
    assert pool.v_rot == [None] * 3 and all(r is not None for r in pool.k_rot)
    assert pool.info["v_rotation_in"] == "weights"
    called = []
    ok, msg = around_weight_update(lambda *a, **k: called.append(1) or (True, ""), object(), "ckpt")
    assert not ok and "OSCAR_V_ABSORB=0" in msg and called == []


@pytest.mark.parametrize("why", ["env", "lora"])
def test_v_absorb_off_keeps_the_runtime_rotation(kvc, monkeypatch, seed, why):
    import oscar_sglang.runtime.configurator as cf
    from oscar_sglang.runtime.hooks import after_runner_kv_dtype, around_weight_update

    monkeypatch.setattr(cf, "V_ABSORB", {})
    runner = _runner(kvc)
    if why == "env":
        monkeypatch.setenv("OSCAR_V_ABSORB", "0")
    else:
        runner.server_args = SimpleNamespace(**{**vars(kvc.server_args), "enable_lora": True})
    note = {"env": "OSCAR_V_ABSORB=0", "lora": "LoRA adapters (--enable-lora)"}[why]
    before = [p.detach().clone() for p in runner.model.parameters()]
    after_runner_kv_dtype(None, runner)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.model.parameters()))
    _, pool = _build(kvc, 32 << 20)
    assert all(r is not None for r in pool.v_rot)
    assert pool.info["v_rotation_in"] == "backend" and pool.info["v_absorb_note"] == note
    assert around_weight_update(lambda self, path: (True, path), object(), "ckpt") == (True, "ckpt")


def test_group_size_from_rotation_file_metadata(kvc, tmp_path, monkeypatch, seed):
    """A file calibrated at group 32 sets the group unless OSCAR_GROUP_SIZE says otherwise."""
    from oscar_sglang.common import rotations as R

    rs = R.hadamard_rotation_set(3, 2, 64)
    rs.metadata["group_size"] = 32
    path = tmp_path / "g32.safetensors"
    R.save_rotation_file(rs, path)
    monkeypatch.setenv("OSCAR_ROTATION", str(path))
    _, pool = _build(kvc, 32 << 20)
    assert pool.k_format.group_size == 32 and pool.info["group_size_from"] == "rotation file metadata"
    assert pool.k_params[0].shape[2] == 2
    monkeypatch.setenv("OSCAR_GROUP_SIZE", "64")
    _, pool = _build(kvc, 32 << 20)
    assert pool.k_format.group_size == 64 and pool.info["group_size_from"] == "OSCAR_GROUP_SIZE"


def test_fork_pt_rotation_files_work_unchanged(kvc, tmp_path, monkeypatch, seed):
    L, D = 3, 64
    for name in ("k", "v"):
        layers = {i: {"layer_id": i, "rotation": torch.linalg.qr(torch.randn(D, D, dtype=torch.float64))[0].float(),
                      "eigenvalues": torch.rand(D)} for i in range(L)}
        torch.save({"format_version": 1, "objective": "qqt_r_h_pbr", "layers": layers}, tmp_path / f"{name}.pt")
    monkeypatch.setenv("SGLANG_OSCAR_K_ROTATION_PATH", str(tmp_path / "k.pt"))
    monkeypatch.setenv("SGLANG_OSCAR_V_ROTATION_PATH", str(tmp_path / "v.pt"))
    monkeypatch.setenv("SGLANG_OSCAR_K_CLIP_RATIO", "0.96")
    _, pool = _build(kvc, 32 << 20)
    want = torch.load(tmp_path / "v.pt", weights_only=True)["layers"][2]["rotation"]
    assert torch.equal(pool.v_rot[2][1], want)
    assert pool.k_clip == pytest.approx([0.96] * 3) and pool.v_clip == [1.0] * 3
    assert pool.info["recipe"] == "oscar"


@pytest.mark.parametrize("problem", ["layers", "head_dim", "not_orthogonal", "garbage", "model"])
def test_bad_rotation_files_rejected(kvc, tmp_path, monkeypatch, problem, seed):
    from oscar_sglang.common import rotations as R

    L, D = 3, 64
    if problem == "layers":
        L = 4
    if problem == "head_dim":
        D = 128
    rk = torch.linalg.qr(torch.randn(L, 1, D, D, dtype=torch.float64))[0].float()
    rs = R.RotationSet(rk, rk.clone(), torch.ones(L), torch.ones(L), metadata={"model_id": "tiny_qwen3"})
    path = tmp_path / "rot.safetensors"
    R.save_rotation_file(rs, path)
    if problem == "not_orthogonal":
        from safetensors.torch import load_file, save_file

        t = load_file(str(path))
        t["k_rotation"] = t["k_rotation"] * 1.5
        save_file(t, str(path))
    if problem == "garbage":
        path.write_bytes(b"not a safetensors file at all")
    if problem == "model":
        rs.metadata["model_id"] = "Qwen/Qwen3-8B"
        R.save_rotation_file(rs, path)
    monkeypatch.setenv("OSCAR_ROTATION", str(path))
    with pytest.raises(R.RotationFileError) as e:
        _build(kvc, 32 << 20)
    msg = str(e.value)
    assert str(path) in msg or "rotation file" in msg


def test_row_reset_hook_and_extend_bookkeeping(kvc, monkeypatch):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from oscar_sglang.runtime.pool import INT32_MAX, take_pending_rows

    monkeypatch.setenv("OSCAR_MAX_RUNNING_REQUESTS", "4")
    _, pool = _build(kvc, 64 << 20)
    take_pending_rows()  # rows queued by other tests' pools
    rtp = ReqToTokenPool(size=4, max_context_len=16, device="cpu", enable_memory_saver=False)
    pool.own_start.zero_()
    reqs = [SimpleNamespace(req_pool_idx=None) for _ in range(2)]
    rtp.alloc(reqs)
    rows = [r.req_pool_idx for r in reqs]
    assert pool.own_start.tolist() == [0] * 5  # the hook does not touch the GPU
    pool.apply_pending_resets()
    assert [pool.own_start[r].item() for r in rows] == [INT32_MAX] * 2
    # first extend: prefix (radix hit) of 3 and 0; later chunks keep the minimum
    idx = torch.tensor(rows)
    pool.note_extend(idx, torch.tensor([3, 0]))
    pool.note_extend(idx, torch.tensor([7, 5]))
    assert [pool.own_start[r].item() for r in rows] == [3, 0]
    # a chunked request reusing its row is not reset
    reqs[0].kv_committed_len = 3
    reqs[0].inflight_middle_chunks = 1
    rtp.alloc([reqs[0]])
    pool.apply_pending_resets()
    assert pool.own_start[rows[0]].item() == 3


def test_server_info_and_metrics(kvc, monkeypatch):
    from oscar_sglang.runtime import metrics
    from oscar_sglang.runtime.hooks import after_get_internal_state, after_log_stats

    _, pool = _build(kvc, 16 << 20)
    alloc = SimpleNamespace(available_size=lambda: 100)
    free_rows = [7]
    sched = SimpleNamespace(token_to_kv_pool_allocator=alloc,
                            req_to_token_pool=SimpleNamespace(available_size=lambda: free_rows[0]))
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput

    out = after_get_internal_state(GetInternalStateReqOutput(internal_state={"x": 1}), sched)
    info = out.internal_state["oscar_int2"]
    assert after_get_internal_state({"x": 1}, sched)["oscar_int2"] == info  # a bare dict too
    assert info["recipe"] == "hadamard" and info["group_size"] == 64 and info["sink_tokens"] == 64
    assert info["max_total_num_tokens"] == pool.size and info["tokens_free"] == 100
    # free request rows are free side-buffer memory (what a leak check compares at idle)
    assert info["side_rows_free"] == 7 and info["side_bytes_free"] == 7 * info["side_bytes_per_request"] > 0
    free_rows[0] = 3
    assert after_get_internal_state({"x": 1}, sched)["oscar_int2"]["side_bytes_free"] == 3 * info["side_bytes_per_request"]
    assert info["bytes_per_token"] == 3 * 2 * 2 * (16 + 4) + 4 and info["hooks_ok"]
    json.dumps(info)  # serialisable for /server_info

    set_values = {}

    class FakeGauge:
        def __init__(self, name, **kw):
            self.name = name

        def labels(self, **kw):
            return SimpleNamespace(set=lambda v, n=self.name: set_values.__setitem__(n, v))

    import prometheus_client

    monkeypatch.setattr(prometheus_client, "Gauge", FakeGauge)
    monkeypatch.setattr(metrics, "_GAUGES", {})
    after_log_stats(None, SimpleNamespace(labels={"model_name": "m"}), SimpleNamespace(full_token_usage=0.25))
    assert set_values["sglang:oscar_int2_capacity_tokens"] == pool.size
    assert set_values["sglang:oscar_int2_used_tokens"] == round(0.25 * pool.size)
    assert set_values["sglang:oscar_int2_bytes_per_token"] == info["bytes_per_token"]


def test_run_command_loads_plugin_before_module(sgl, tmp_path, monkeypatch):
    """`oscar-sglang run MODULE args`: plugins loaded, then MODULE runs as __main__ with args."""
    import sys

    from oscar_sglang.tools.commands import run

    (tmp_path / "probe_mod.py").write_text(
        "import json, sys, argparse\n"
        "from oscar_sglang.runtime.state import hooks_ok\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
        "a, rest = p.parse_known_args(sys.argv[2:])\n"
        "open(sys.argv[1], 'w').write(json.dumps({'hooks': hooks_ok(), 'kv': a.kv_cache_dtype, 'name': __name__}))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    out = tmp_path / "probe.json"
    assert run.run(SimpleNamespace(module="probe_mod", passthrough=[str(out), "--model-path", "m", "--kv-cache-dtype", "int2"])) == 0
    assert json.loads(out.read_text()) == {"hooks": True, "kv": "int2", "name": "__main__"}
