"""Plugin pieces that need no SGLang import: env config, pool sizing arithmetic, refusal rules,
TP head ranges, serve/run command building."""
from types import SimpleNamespace

import pytest

from oscar_sglang.runtime import config as C
from oscar_sglang.runtime import kv_format as KF
from oscar_sglang.runtime import refusals as F
from oscar_sglang.runtime import sizing as Z

# ----------------------------------------------------------------------------- config


def test_defaults():
    cfg = C.load_config({})
    assert cfg.recipe == "hadamard"
    # the default format's sizes (its s4 / w128), not a second copy that could disagree
    assert (cfg.sink_tokens, cfg.recent_tokens, cfg.group_size) == (4, 128, 128)
    assert (cfg.sink_tokens, cfg.recent_tokens) == KF.side_sizes(KF.DEFAULT_KV_FORMAT) == (4, 128)
    assert (C.OscarConfig().sink_tokens, C.OscarConfig().recent_tokens) == (4, 128)
    assert cfg.kv_format == KF.DEFAULT_KV_FORMAT == "k4c64-v2h-s4-w128"
    assert (cfg.default_max_running_requests, cfg.side_buffer_fraction) == (1024, 0.2)
    assert cfg.k_clip is None and cfg.v_clip is None
    assert cfg.sources == {}


def test_our_names_and_fork_aliases(tmp_path):
    rot = tmp_path / "k.pt"
    rot.write_bytes(b"x")
    vrot = tmp_path / "v.pt"
    vrot.write_bytes(b"x")
    cfg = C.load_config({
        "SGLANG_OSCAR_K_ROTATION_PATH": str(rot),
        "SGLANG_OSCAR_V_ROTATION_PATH": str(vrot),
        "SGLANG_OSCAR_K_CLIP_RATIO": "0.96",
        "SGLANG_OSCAR_V_CLIP_RATIO": "0",  # fork: 0 disables clipping
        "SGLANG_MIXED_KV_PREFIX_TOKENS": "32",
        "SGLANG_MIXED_KV_RECENT_TOKENS": "128",
    })
    assert cfg.recipe == "file" and cfg.rotation == str(rot) and cfg.v_rotation == str(vrot)
    assert cfg.k_clip == 0.96 and cfg.v_clip == 1.0
    assert (cfg.sink_tokens, cfg.recent_tokens) == (32, 128)
    assert cfg.sources["k_clip"] == "SGLANG_OSCAR_K_CLIP_RATIO"

    cfg = C.load_config({"OSCAR_ROTATION": "IDENTITY", "OSCAR_GROUP_SIZE": "64", "OSCAR_K_CLIP": "0.9",
                         "OSCAR_MAX_RUNNING_REQUESTS": "32", "OSCAR_SIDE_BUFFER_FRACTION": "0.1",
                         "OSCAR_ALLOW_MODEL_MISMATCH": "1"})
    assert cfg.recipe == "identity" and cfg.group_size == 64 and cfg.k_clip == 0.9
    assert cfg.default_max_running_requests == 32 and cfg.side_buffer_fraction == 0.1
    assert cfg.allow_model_mismatch
    # both names, same value: fine
    assert C.load_config({"OSCAR_SINK_TOKENS": "16", "SGLANG_MIXED_KV_PREFIX_TOKENS": "16"}).sink_tokens == 16


@pytest.mark.parametrize(
    "env, words",
    [
        ({"OSCAR_ROTATION": "/no/such/file.safetensors"}, ["OSCAR_ROTATION", "no such file"]),
        ({"OSCAR_V_ROTATION": "/tmp"}, ["OSCAR_V_ROTATION", "K rotation file"]),
        ({"OSCAR_K_CLIP": "1.5"}, ["OSCAR_K_CLIP", "(0, 1]"]),
        ({"OSCAR_V_CLIP": "0"}, ["OSCAR_V_CLIP", "(0, 1]"]),  # our name: 0 is an error, not "off"
        ({"SGLANG_OSCAR_K_CLIP_RATIO": "abc"}, ["SGLANG_OSCAR_K_CLIP_RATIO", "not a number"]),
        ({"OSCAR_SINK_TOKENS": "-1"}, ["OSCAR_SINK_TOKENS", "[0, 65536]"]),
        ({"OSCAR_RECENT_TOKENS": "0"}, ["OSCAR_RECENT_TOKENS"]),
        ({"OSCAR_RECENT_TOKENS": "1.5"}, ["not an integer"]),
        ({"OSCAR_GROUP_SIZE": "48"}, ["OSCAR_GROUP_SIZE", "one of"]),
        ({"OSCAR_SINK_TOKENS": "16", "SGLANG_MIXED_KV_PREFIX_TOKENS": "64"}, ["disagree"]),
        ({"OSCAR_SIDE_BUFFER_FRACTION": "1.0"}, ["OSCAR_SIDE_BUFFER_FRACTION"]),
        ({"OSCAR_ALLOW_MODEL_MISMATCH": "maybe"}, ["0 or 1"]),
        # removed settings stop the start whatever their value (the former default too)
        ({"OSCAR_CHANNEL_DECODE_3BIT": "planes"}, ["OSCAR_CHANNEL_DECODE_3BIT was removed", "unset it"]),
        ({"OSCAR_CHANNEL_EXTEND": "codes"}, ["OSCAR_CHANNEL_EXTEND was removed", "unset it"]),
        ({"OSCAR_CHANNEL_DECODE_READS": "words"}, ["OSCAR_CHANNEL_DECODE_READS was removed"]),
        ({"OSCAR_CHANNEL_DECODE_KEYS": "fp16-subnormal"}, ["OSCAR_CHANNEL_DECODE_KEYS was removed"]),
        ({"OSCAR_INT2_NO_ASM": "1"}, ["OSCAR_INT2_NO_ASM was removed"]),
        ({"OSCAR_NEW_TOKEN_ATTENTION": "fa3"}, ["OSCAR_NEW_TOKEN_ATTENTION", "'flashinfer' or 'triton'"]),
        ({"OSCAR_PREFIX_ATTENTION": "bf16"}, ["OSCAR_PREFIX_ATTENTION", "'int2' or 'flashinfer'"]),
        ({"OSCAR_DECODE_STORE": "kernel"}, ["OSCAR_DECODE_STORE", "'split' or 'fused'"]),
    ],
)
def test_bad_env_is_refused_with_the_variable_name(env, words):
    with pytest.raises(C.OscarConfigError) as e:
        C.load_config(env)
    for w in words:
        assert w in str(e.value)


def test_format_sizes_are_the_chosen_formats_unless_set():
    """Without OSCAR_SINK_TOKENS / OSCAR_RECENT_TOKENS the config carries the chosen format's
    sizes: its s<N> / w<N>, else 64 / 256 (the per-token recipe and names without them)."""
    for fmt, want in (("token", (64, 256)), ("k2c64-v2t64", (64, 256)), ("k4c32-v2t128-s8-w64", (8, 64)),
                      ("k3c64-v2t64-s4-w128", (4, 128))):
        cfg = C.load_config({"OSCAR_KV_FORMAT": fmt})
        assert (cfg.sink_tokens, cfg.recent_tokens) == want, fmt
        assert "sink_tokens" not in cfg.sources and "recent_tokens" not in cfg.sources
    cfg = C.load_config({"OSCAR_KV_FORMAT": "token", "OSCAR_SINK_TOKENS": "16"})
    assert (cfg.sink_tokens, cfg.recent_tokens, cfg.sources["sink_tokens"]) == (16, 256, "OSCAR_SINK_TOKENS")


def test_new_token_attention_defaults_to_flashinfer():
    assert C.load_config({}).new_token_attention == "flashinfer"
    cfg = C.load_config({"OSCAR_NEW_TOKEN_ATTENTION": "Triton"})
    assert cfg.new_token_attention == "triton" and cfg.sources["new_token_attention"] == "OSCAR_NEW_TOKEN_ATTENTION"


def test_decode_store_defaults_to_split():
    assert C.load_config({}).decode_store == "split"
    cfg = C.load_config({"OSCAR_DECODE_STORE": " Fused"})
    assert cfg.decode_store == "fused" and cfg.sources["decode_store"] == "OSCAR_DECODE_STORE"


def test_prefill_reads_defaults_to_exact():
    assert C.load_config({}).prefill_reads == "exact"
    cfg = C.load_config({"OSCAR_PREFILL_READS": "Cache"})
    assert cfg.prefill_reads == "cache" and cfg.sources["prefill_reads"] == "OSCAR_PREFILL_READS"
    with pytest.raises(C.OscarConfigError, match="OSCAR_PREFILL_READS"):
        C.load_config({"OSCAR_PREFILL_READS": "bf16"})


def test_prefix_attention_defaults_to_flashinfer_for_per_channel_formats():
    cfg = C.load_config({})
    assert cfg.prefix_attention is None and "prefix_attention" not in cfg.sources
    assert cfg.resolved_prefix_attention(channel=True) == "flashinfer"
    assert cfg.resolved_prefix_attention(channel=False) == "int2"  # the per-token recipe has one kernel
    # a server told to avoid FlashInfer for the new tokens does not get it for the prefix either
    assert C.load_config({"OSCAR_NEW_TOKEN_ATTENTION": "triton"}).resolved_prefix_attention(channel=True) == "int2"
    for val, want in (("int2", "int2"), (" FlashInfer ", "flashinfer")):
        cfg = C.load_config({"OSCAR_PREFIX_ATTENTION": val})
        assert cfg.resolved_prefix_attention(channel=True) == want
        assert cfg.sources["prefix_attention"] == "OSCAR_PREFIX_ATTENTION"
    # an explicit choice is kept, also where it cannot run (the backend refuses it at start)
    assert C.load_config({"OSCAR_PREFIX_ATTENTION": "flashinfer"}).resolved_prefix_attention(channel=False) == "flashinfer"


def test_env_help_lists_every_variable():
    text = C.env_help()
    for name, (alias, _) in C.ENV_VARS.items():
        assert name in text
        if alias:
            assert alias in text


# ----------------------------------------------------------------------------- sizing

QWEN3_8B = Z.ModelKVShape(num_layers=36, num_kv_heads=8, head_dim=128, v_head_dim=128)


def token_fmt(shape, G, sink=64, recent=256):
    """The OSCAR per-token recipe (OSCAR_KV_FORMAT=token) at group G for a shape."""
    return KF.resolve("token", head_dim=shape.head_dim, v_head_dim=shape.v_head_dim,
                      num_layers=shape.first_layer + shape.num_layers, group_size=G, sink=sink, recent=recent)


def test_bytes_per_token_formula():
    # per layer, per head: K and V each D/4 code bytes + D/G groups x (fp16 scale + fp16 min)
    for G, per_row in ((128, 32 + 4), (64, 32 + 8), (32, 32 + 16)):
        assert Z.int2_bytes_per_token(QWEN3_8B, token_fmt(QWEN3_8B, G)) == 36 * 8 * 2 * per_row + 4  # + slot_entry
    assert Z.bf16_bytes_per_token(QWEN3_8B) == 36 * 8 * 256 * 2
    # the map's worked example: Llama-3-8B, G=128 -> 18432 B/token, 7.1x
    llama = Z.ModelKVShape(32, 8, 128, 128)
    assert Z.int2_bytes_per_token(llama, token_fmt(llama, 128)) == 18432 + 4
    assert Z.bf16_bytes_per_token(llama) / (18432 + 4) == pytest.approx(7.11, abs=0.01)
    # head_dim 64 with the default group 128: the group is the whole head
    small = Z.ModelKVShape(2, 2, 64, 64)
    assert Z.int2_bytes_per_token(small, token_fmt(small, 128)) == 2 * 2 * 2 * (16 + 4) + 4
    assert Z.side_bytes_per_request(QWEN3_8B, 64, 256) == 36 * 8 * 320 * 256 * 2 + 4 * (2 + 320)
    # the sinks kept by token ids for cache hits (runtime/sink_store.py): entries of a sink of every
    # layer, as many as 1% of the budget holds, at least one, at most SINK_STORE_MAX_ENTRIES
    entry = 36 * 8 * 64 * 256 * 2
    assert Z.sink_store_plan(100 * entry, QWEN3_8B, 64) == (1, entry)
    assert Z.sink_store_plan(1_000 * entry, QWEN3_8B, 64) == (10, 10 * entry)
    assert Z.sink_store_plan(550 * entry, QWEN3_8B, 64) == (5, 5 * entry)
    most = Z.SINK_STORE_MAX_ENTRIES
    assert Z.sink_store_plan(1000 * most * entry, QWEN3_8B, 64) == (most, most * entry)
    assert Z.sink_store_plan(10_000 * entry, QWEN3_8B, 0) == (0, 0)  # no sink, no store


def test_bytes_per_token_of_channel_formats():
    """Per-channel keys: bits*D/8 code bytes + one (scale, min) per channel per page of B tokens
    (4*D/B bytes per token); per-layer key bits are summed over the stage's own layers."""
    llama = Z.ModelKVShape(32, 8, 128, 128)
    fmt = KF.resolve("k3c64-v2t64", head_dim=128, v_head_dim=128, num_layers=32, group_size=128)
    assert Z.int2_bytes_per_token(llama, fmt) == 32 * 8 * ((48 + 8) + (32 + 8)) + 4
    assert fmt.body_bits_per_element() == 3.0
    over = KF.resolve("k2c32-v2t128@0,-1=k4", head_dim=128, v_head_dim=128, num_layers=32, group_size=128)
    per_layer = [(32 + 16) + (32 + 4)] * 32
    per_layer[0] = per_layer[-1] = (64 + 16) + (32 + 4)
    assert Z.int2_bytes_per_token(llama, over) == 8 * sum(per_layer) + 4
    # a pipeline stage holding layers 16..31 pays for its own last layer only
    stage = Z.ModelKVShape(16, 8, 128, 128, first_layer=16)
    assert Z.int2_bytes_per_token(stage, over) == 8 * sum(per_layer[16:]) + 4


def test_plan_default_requests_capped_by_fraction():
    avail = 55 * (1 << 30)
    plan = Z.plan_pool(avail, QWEN3_8B, fmt=token_fmt(QWEN3_8B, 128),
                       default_max_running_requests=256, side_buffer_fraction=0.06)
    per_req = Z.side_bytes_per_request(QWEN3_8B, 64, 256)
    assert plan.max_running_requests == int(0.06 * avail) // per_req - 1
    assert plan.side_bytes_total == (plan.max_running_requests + 1) * per_req <= 0.06 * avail
    assert plan.max_total_num_tokens == (avail - plan.side_bytes_total - plan.sink_store_bytes_total) \
        // plan.bytes_per_token
    assert plan.notes and "max_running_requests defaults to" in plan.notes[0]
    # capacity vs a BF16 pool of the same budget: >= 6.5x
    bf16_tokens = avail // Z.bf16_bytes_per_token(QWEN3_8B)
    assert plan.max_total_num_tokens / bf16_tokens >= 6.5
    line = plan.log_line()
    assert f"{plan.max_total_num_tokens:,} tokens fit" in line and "B/token INT2" in line and "side buffers" in line


def test_plan_defaults_are_the_servers():
    # offline sizing (the NIAH table's kv_tokens) must match what a default int2 server plans
    from oscar_sglang.runtime.config import OscarConfig

    avail = int(55.37e9)
    llama = Z.ModelKVShape(32, 8, 128, 128)
    fmt = token_fmt(llama, 128)
    cfg = OscarConfig()
    plain = Z.plan_pool(avail, llama, fmt=fmt)
    explicit = Z.plan_pool(avail, llama, fmt=fmt, default_max_running_requests=cfg.default_max_running_requests,
                           side_buffer_fraction=cfg.side_buffer_fraction)
    assert plain == explicit
    assert plain.side_bytes_total <= cfg.side_buffer_fraction * avail


def test_plan_small_default_not_capped_and_page_alignment():
    avail = 10 * (1 << 30)
    shape = Z.ModelKVShape(2, 2, 64, 64)
    plan = Z.plan_pool(avail, shape, fmt=token_fmt(shape, 64, 4, 8), page_size=16,
                       default_max_running_requests=7)
    assert plan.max_running_requests == 7 and not plan.notes
    assert plan.max_total_num_tokens % 16 == 0
    assert plan.max_total_num_tokens * plan.bytes_per_token + plan.side_bytes_total <= avail


def test_plan_user_requests_honoured_then_capped():
    avail = 20 * (1 << 30)
    per_req = Z.side_bytes_per_request(QWEN3_8B, 64, 256)
    plan = Z.plan_pool(avail, QWEN3_8B, fmt=token_fmt(QWEN3_8B, 128),
                       requested_max_running_requests=100)
    assert plan.max_running_requests == 100 and not plan.notes  # 100 x 45 MiB < 50%
    plan = Z.plan_pool(avail, QWEN3_8B, fmt=token_fmt(QWEN3_8B, 128),
                       requested_max_running_requests=4096)
    assert plan.max_running_requests == int(0.5 * avail) // per_req - 1
    assert "lowered" in plan.notes[0]


def test_plan_refuses_when_side_buffers_do_not_fit():
    with pytest.raises(Z.PoolSizingError, match="mem-fraction-static"):
        Z.plan_pool(10 << 20, QWEN3_8B, fmt=token_fmt(QWEN3_8B, 128))


def test_plan_from_max_tokens():
    plan = Z.plan_from_max_tokens(1001, QWEN3_8B, fmt=token_fmt(QWEN3_8B, 128),
                                  max_running_requests=8, page_size=4)
    assert plan.max_total_num_tokens == 1000 and plan.int2_bytes_total == 1000 * plan.bytes_per_token


@pytest.mark.parametrize(
    "total, tp, expect",
    [
        (8, 1, [(0, 8)]),
        (8, 2, [(0, 4), (4, 4)]),
        (8, 8, [(i, 1) for i in range(8)]),
        (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # heads replicated across ranks
        (1, 2, [(0, 1), (0, 1)]),
    ],
)
def test_kv_head_range(total, tp, expect):
    assert [Z.kv_head_range(total, tp, r) for r in range(tp)] == expect


# ----------------------------------------------------------------------------- refusals


def _args(**kw):
    base = dict(attention_backend="oscar_triton", prefill_attention_backend=None,
                decode_attention_backend=None, speculative_algorithm=None,
                enable_hierarchical_cache=False, disaggregation_mode="null", dcp_size=1)
    base.update(kw)
    return SimpleNamespace(**base)


def test_good_args_pass():
    assert F.server_args_problems(_args(), env={}) == []
    hicache = dict(enable_hierarchical_cache=True, hicache_mem_layout="page_first", hicache_io_backend="kernel")
    assert F.server_args_problems(_args(**hicache), env={}) == []
    assert F.server_args_problems(_args(**hicache, hicache_storage_backend="file"), env={}) == []
    assert F.server_args_problems(_args(prefill_attention_backend="oscar_triton"), env={}) == []
    assert F.server_args_problems(_args(triton_attention_num_kv_splits=2), env={}) == []


@pytest.mark.parametrize(
    "kw, env, words",
    [
        (dict(attention_backend="triton"), {}, ["'triton'", "oscar_triton"]),
        (dict(attention_backend="fa3"), {}, ["'fa3'"]),
        (dict(decode_attention_backend="flashinfer"), {}, ["decode attention backend", "flashinfer"]),
        (dict(prefill_attention_backend="fa3"), {}, ["prefill attention backend"]),
        (dict(speculative_algorithm="DFLASH"), {}, ["--speculative-algorithm DFLASH", "NGRAM"]),
        (dict(enable_hierarchical_cache=True, hicache_mem_layout="layer_first"), {},
         ["--hicache-mem-layout layer_first", "page_first"]),
        (dict(enable_hierarchical_cache=True, hicache_io_backend="direct"), {},
         ["--hicache-io-backend direct", "kernel"]),
        (dict(enable_hierarchical_cache=True, hicache_storage_backend="mooncake"), {},
         ["--hicache-storage-backend mooncake", "file"]),
        (dict(enable_hisparse=True), {}, ["HiSparse", "--enable-hierarchical-cache"]),
        (dict(disaggregation_mode="prefill", disaggregation_transfer_backend="mori"), {},
         ["--disaggregation-transfer-backend mori", "mooncake or nixl"]),
        (dict(dcp_size=2), {}, ["--dcp-size"]),
        (dict(attn_cp_size=2), {}, ["--attn-cp-size"]),
        (dict(enable_two_batch_overlap=True), {}, ["two-batch"]),
        (dict(enable_single_batch_overlap=True), {}, ["single-batch"]),
        (dict(enable_pdmux=True), {}, ["pdmux"]),
        (dict(enable_lmcache=True), {}, ["LMCache"]),
        (dict(enable_flexkv=True), {}, ["FlexKV"]),
        (dict(enable_unified_memory=True), {}, ["unified-memory"]),
        (dict(enable_page_major_kv_layout=True), {}, ["page-major"]),
        (dict(prefill_only_disable_kv_cache=True), {}, ["prefill-only"]),
        (dict(enable_deterministic_inference=True), {}, ["deterministic"]),
        (dict(dllm_algorithm="x"), {}, ["diffusion"]),
        (dict(is_embedding=True), {}, ["embedding"]),
        (dict(enable_torch_compile=True), {}, ["torch-compile"]),
        (dict(enable_memory_saver=True), {}, ["--enable-memory-saver is not supported", "Drop the flag"]),
        (dict(triton_attention_num_kv_splits=1), {}, ["--triton-attention-num-kv-splits 1", "2 or more"]),
        ({}, {"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "1"}, ["POST_CAPTURE"]),
    ],
)
def test_every_server_arg_refusal(kw, env, words):
    problems = F.server_args_problems(_args(**kw), env=env)
    assert len(problems) == 1
    for w in words:
        assert w in problems[0]
    with pytest.raises(F.Int2Unsupported) as e:
        F.raise_if_any(problems)
    assert "--kv-cache-dtype int2 cannot start" in str(e.value)


def test_page_size_refusal_suggests_formats_that_match_it():
    """A --page-size the format's key blocks do not match is refused; every format the message
    names instead parses and has the page size it is named for."""
    import re

    assert F.server_args_problems(_args(page_size=64), env={}) == []  # the default's block
    (msg,) = F.server_args_problems(_args(page_size=32), env={})
    assert "--page-size 32 does not match" in msg and "'token'" in msg
    named = {int(p): n for n, p in re.findall(r"(k\d+c\d+[\w-]*)(?: \(the default\))? for (\d+)", msg)}
    assert named.get(64) == KF.DEFAULT_KV_FORMAT and set(named) == {32, 64}, named
    for page, name in named.items():
        assert KF.page_size_for(name) == page
        assert F.server_args_problems(_args(page_size=page), env={"OSCAR_KV_FORMAT": name}) == []


def _model(**kw):
    base = dict(attention_arch=SimpleNamespace(name="MHA"), hf_config=SimpleNamespace(architectures=["Qwen3ForCausalLM"]),
                is_hybrid_swa=False, sliding_window_size=None, is_encoder_decoder=False, head_dim=128, v_head_dim=128)
    base.update(kw)
    return SimpleNamespace(**base)


def test_model_refusals():
    assert F.model_problems(_model()) == []
    cases = [
        (dict(attention_arch=SimpleNamespace(name="MLA")), "MLA"),
        (dict(is_hybrid_swa=True), "sliding-window models"),
        (dict(sliding_window_size=4096), "sliding-window attention"),
        (dict(is_encoder_decoder=True), "encoder-decoder"),
        (dict(hf_config=SimpleNamespace(architectures=["DeepseekV32ForCausalLM"])), "DSA"),
        (dict(hf_config=SimpleNamespace(architectures=["MiniMaxM2ForCausalLM"])), "sparse"),
        (dict(head_dim=96, v_head_dim=96), "head_dim=96"),
    ]
    for kw, word in cases:
        probs = F.model_problems(_model(**kw))
        assert probs and any(word in p for p in probs), (kw, probs)
    assert any("mamba" in p for p in F.model_problems(_model(), hybrid_linear=True))


# ----------------------------------------------------------------------------- commands


def test_serve_command_passes_args_through_and_defaults_int2():
    from oscar_sglang.tools.commands import serve

    argv, env = serve.build_command(["--model-path", "m", "--port", "3"])
    assert argv == ["--model-path", "m", "--port", "3", "--kv-cache-dtype", "int2"] and env == {}
    argv, _ = serve.build_command(["--model-path=m", "--kv-cache-dtype", "auto"])
    assert argv == ["--model-path=m", "--kv-cache-dtype", "auto"]


def test_serve_print_command_via_cli(capsys):
    from oscar_sglang.tools.cli import main

    assert main(["serve", "--print-command", "--model-path", "m", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "-m sglang.launch_server --model-path m --tp 2 --kv-cache-dtype int2" in out


def test_run_aliases():
    from oscar_sglang.tools.commands import run

    assert run.resolve("one_batch") == "sglang.benchmark.one_batch"
    assert run.resolve("bench_one_batch") == "sglang.bench_one_batch"
    assert run.resolve("my.module") == "my.module"
