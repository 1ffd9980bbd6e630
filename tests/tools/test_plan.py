"""`oscar-sglang plan`: the plugin's sizing for a model's config.json and a KV budget, next to
SGLang's BF16 and FP8 pools, recomputed here from the format's bytes and checked against what
the benchmarks' KV-token columns use."""
from __future__ import annotations

import importlib.util
import json
import random
import sys

import pytest

from oscar_sglang.tools import cli
from oscar_sglang.tools.commands import plan as P

from tests import ROOT

GIB = 1 << 30
LLAMA = {"_name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 32, "head_dim": 128}


def _config(tmp_path, cfg: dict, name: str = "m"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _bench_niah():
    spec = importlib.util.spec_from_file_location("oscar_bench_niah_server_for_plan", ROOT / "bench" / "niah_server.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_llama_rows_are_the_benchmarks_kv_token_columns(tmp_path):
    """The dummy Llama-3.1-8B on the H100 budget the benchmarks use: 1,581,888 tokens and 639 rows
    for the default (1,601,920 in bench/results recorded before 2026-12-01: the sinks kept by token
    ids for cache hits now take 1% of the budget), and bench/niah_server.py's llama8b_plan, which
    now reads these rows, agrees."""
    b = _bench_niah()
    geom = P.model_geometry(str(_config(tmp_path, LLAMA)))
    assert geom == {"model": LLAMA["_name_or_path"], "num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                    "v_head_dim": 128}
    d = _config(tmp_path, {k: v for k, v in LLAMA.items() if k != "_name_or_path"}, name="Llama-local")
    assert P.model_geometry(str(d / "config.json"))["model"] == "Llama-local"
    rows = P.plan_rows(b.LLAMA8B_KV_BUDGET, geom, ["default", "k3c64-v2t64-s4-w128", "token"])
    by = {r["format_requested"] if r["kv_cache"] == "int2" else r["kv_cache"]: r for r in rows}
    assert (by["default"]["kv_tokens"], by["default"]["max_running_requests"]) == (1_581_888, 639)
    assert by["default"]["format"] == "k4c64-v2t128-s4-w128"
    for asked in ("default", "k3c64-v2t64-s4-w128"):
        want = b.llama8b_plan("int2", by[asked]["format"])
        assert (by[asked]["kv_tokens"], by[asked]["max_running_requests"]) == want, asked
    assert by["bf16"]["kv_tokens"] == b.llama8b_plan("bf16", None)[0]
    assert by["fp8_e4m3"]["kv_tokens"] == b.llama8b_plan("fp8_e4m3", None)[0]
    assert by["token"]["format"] == "k2t128-v2t128-kclip-vclip" and by["token"]["bits_per_element"] == 2.25
    assert by["default"]["x_fp8"] == pytest.approx(1_581_888 / by["fp8_e4m3"]["kv_tokens"])


def test_random_geometries_against_the_format_arithmetic(tmp_path):
    """Bytes per token from the format's definition (codes + fp16 scale/min per group, per-channel
    key params once a page, one int32 a token), side buffers of (rows + 1) x (sink + window) BF16
    K and V + int32 bookkeeping, within 20% of the budget and at most 1,024 rows."""
    rng = random  # seeded by tests/conftest.py (OSCAR_TEST_SEED replays it)
    for _ in range(20):
        L, H, D = rng.randint(2, 80), rng.choice([1, 2, 4, 8, 16]), rng.choice([64, 128])
        tp = rng.choice([t for t in (1, 2, 4, 8) if H % t == 0 or t % H == 0])
        budget = rng.randint(2 * GIB, 120 * GIB)
        kb, B = rng.choice([2, 3, 4]), 64
        name = f"k{kb}c{B}-v2h-s4-w128"
        geom = {"model": "x", "num_layers": L, "num_kv_heads": H, "head_dim": D, "v_head_dim": D}
        rows = P.plan_rows(budget, geom, [name], tp_size=tp)
        h = max(1, H // tp)
        per_tok = L * h * ((kb * D // 8 + 4 * D // B) + (2 * D // 8 + 4)) + 4
        side = L * h * 132 * 2 * D * 2 + 4 * (2 + 132)
        reqs = min(1024, int(0.2 * budget) // side - 1)
        entry = L * h * 4 * 2 * D * 2  # sinks kept by token ids for cache hits: 1% of the budget
        store = max(1, min(4096, int(0.01 * budget) // entry)) * entry
        want = (budget - (reqs + 1) * side - store) // per_tok // B * B
        r = rows[2]
        assert (r["bytes_per_token"], r["max_running_requests"], r["kv_tokens"]) == (per_tok, reqs, want), (geom, tp)
        assert rows[0]["kv_tokens"] == budget // (L * h * 2 * D * 2)
        assert rows[1]["kv_tokens"] == budget // (L * h * 2 * D)
        assert r["bits_per_element"] == pytest.approx(8 * (per_tok - 4) / (L * h * 2 * D))


def test_what_the_server_refuses_is_a_row_with_its_reason(tmp_path):
    gemma = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
             "hidden_size": 3072}
    rows = P.plan_rows(40 * GIB, P.model_geometry(str(_config(tmp_path, gemma))), ["default", "token"])
    assert "refused" in rows[2] and "token" in rows[2]["refused"] and "kv_tokens" not in rows[2]
    assert rows[3]["format"] == "k2t128-v2t128-kclip-vclip" and rows[3]["kv_tokens"] > 0
    assert "refused" in P.table(rows).splitlines()[4]


def test_cli_table_json_and_environment(tmp_path, capsys, monkeypatch):
    d = _config(tmp_path, {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
                           "text_config": {**LLAMA, "_name_or_path": None}})
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model-path", str(d / "config.json"), "--kv-budget-gib", "40", "--tp-size", "2",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8 KV heads of 128 dims, TP 2" in text and "| int2 `default` | k4c64-v2t128-s4-w128 |" in text
    assert "Running requests: the server's default, at most 1,024" in text
    doc = json.loads(out.read_text())
    assert doc["tp_size"] == 2 and doc["kv_budget_bytes"] == 40 * GIB and len(doc["rows"]) == 6
    assert doc["command"].startswith("oscar-sglang plan --model-path")
    base = {r["format_requested"]: r for r in doc["rows"] if r["kv_cache"] == "int2"}

    monkeypatch.setenv("OSCAR_SIDE_BUFFER_FRACTION", "0.05")  # as a server started with it would size
    assert cli.main(["plan", "--model-path", str(d), "--kv-budget-gib", "40", "--tp-size", "2",
                     "--json", str(out)]) == 0
    assert "OSCAR_SIDE_BUFFER_FRACTION" in capsys.readouterr().out
    low = {r["format_requested"]: r for r in json.loads(out.read_text())["rows"] if r["kv_cache"] == "int2"}
    assert low["default"]["max_running_requests"] < base["default"]["max_running_requests"]
    assert low["default"]["kv_tokens"] > base["default"]["kv_tokens"]

    monkeypatch.setenv("OSCAR_KV_FORMAT", "token")  # 'default' is what a server started here stores
    assert cli.main(["plan", "--model-path", str(d), "--kv-budget-gib", "40", "--formats", "default",
                     "--json", str(out)]) == 0
    (row,) = [r for r in json.loads(out.read_text())["rows"] if r["kv_cache"] == "int2"]
    assert row["format"] == "k2t128-v2t128-kclip-vclip"
    assert "OSCAR_KV_FORMAT" in capsys.readouterr().out


@pytest.mark.parametrize("case, args, message", [
    ("missing", ["--kv-budget-gib", "10"], "no config.json there"),
    ("mla", ["--kv-budget-gib", "10"], "MLA"),
    ("geometry", ["--kv-budget-gib", "10"], "attention geometry"),
    ("budget", ["--kv-budget-gib", "0"], "--kv-budget-gib must be > 0"),
    ("tp", ["--kv-budget-gib", "10", "--tp-size", "3"], "does not divide"),
    ("env", ["--kv-budget-gib", "10"], "OSCAR_SIDE_BUFFER_FRACTION"),
])
def test_bad_input_is_a_clear_error(tmp_path, capsys, monkeypatch, case, args, message):
    cfgs = {"mla": {**LLAMA, "kv_lora_rank": 512}, "geometry": {"num_hidden_layers": 2}}
    path = str(tmp_path / "nothing") if case == "missing" else str(_config(tmp_path, cfgs.get(case, LLAMA)))
    if case == "env":
        monkeypatch.setenv("OSCAR_SIDE_BUFFER_FRACTION", "2")
    assert cli.main(["plan", "--model-path", path, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan: ") and message in err, err


def test_the_serving_doc_example_is_what_plan_prints(tmp_path):
    """docs/serving.md's example table is plan's output on Llama-3.1-8B's config (its columns but
    bytes / token), so it changes when the sizing or the default does."""
    readme = (ROOT / "docs" / "serving.md").read_text()
    assert "oscar-sglang plan --model-path /models/Llama-3.1-8B-Instruct --kv-budget-gib 51.567" in readme
    geom = P.model_geometry(str(_config(tmp_path, LLAMA)))
    rows = P.plan_rows(int(51.567 * GIB), geom, ["default", "k3c64-v2t64-s4-w128", "token"])
    for line in P.table(rows).splitlines()[2:]:
        cells = line.split(" | ")
        del cells[3]  # bytes / token
        assert " | ".join(cells) in readme, line


def test_speculative_decoding_is_counted_as_the_servers_size_it(tmp_path):
    """A draft model's cache (BF16 beside the INT2 pool, SGLang's cell scaled by layers beside
    BF16 / FP8) and the rollback buffers of the verify's drafts come off the KV tokens; the rows
    are what the servers' own sizing gives (runtime/sizing.plan_pool with the same terms)."""
    from oscar_sglang.runtime import sizing
    from oscar_sglang.runtime.draft_rollback import DraftRollback
    from oscar_sglang.runtime.kv_format import resolve

    model = _config(tmp_path, LLAMA)
    geom = P.model_geometry(str(model))
    budget = int(51.567 * GIB)
    base = {r["kv_cache"] if r["kv_cache"] != "int2" else "int2": r
            for r in P.plan_rows(budget, geom, ["default"])}
    spec = {r["kv_cache"] if r["kv_cache"] != "int2" else "int2": r
            for r in P.plan_rows(budget, geom, ["default"], draft_layers=1, draft_tokens=4)}
    elems = 32 * 8 * 256
    assert spec["bf16"]["kv_tokens"] == budget // ((elems + 8 * 256) * 2) < base["bf16"]["kv_tokens"]
    assert spec["fp8_e4m3"]["kv_tokens"] == budget // (elems + 8 * 256)
    shape = sizing.ModelKVShape(32, 8, 128, 128)
    fmt = resolve("", head_dim=128, v_head_dim=128, num_layers=32, group_size=128)
    want = sizing.plan_pool(budget, shape, fmt=fmt, page_size=fmt.page_size,
                            draft_bytes_per_token=8 * 256 * 2,
                            rollback_bytes_per_request=DraftRollback.bytes_per_row(32, 8, 128, 128, 4))
    assert (spec["int2"]["kv_tokens"], spec["int2"]["max_running_requests"]) == \
        (want.max_total_num_tokens, want.max_running_requests)
    assert spec["int2"]["kv_tokens"] < base["int2"]["kv_tokens"]
    # the command line takes them
    out = tmp_path / "rows.json"
    assert cli.main(["plan", "--model-path", str(model), "--kv-budget-gib", "51.567",
                     "--formats", "default", "--speculative-draft-layers", "1",
                     "--speculative-num-draft-tokens", "4", "--json", str(out)]) == 0
    assert [r["kv_tokens"] for r in json.loads(out.read_text())["rows"]] == [r["kv_tokens"] for r in spec.values()]
    assert cli.main(["plan", "--model-path", str(model), "--kv-budget-gib", "1",
                     "--speculative-draft-layers", "-1"]) == 2


def test_host_tokens_of_a_hicache_tier(tmp_path, capsys):
    """--hicache-size / --hicache-ratio: the host tier as SGLang's HostKVCache sizes it, INT2 pages
    at the device's bytes a token less its 4-byte slot pointer (what Int2HostPool stores)."""
    model = _config(tmp_path, LLAMA)
    geom = P.model_geometry(str(model))
    budget = int(51.567 * GIB)
    by = {r["kv_cache"] if r["kv_cache"] != "int2" else "int2": r
          for r in P.plan_rows(budget, geom, ["default"], hicache_size_gb=200)}
    assert by["bf16"]["host_bytes_per_token"] == 32 * 8 * 256 * 2
    assert by["int2"]["host_bytes_per_token"] == by["int2"]["bytes_per_token"] - 4
    for r in by.values():
        assert r["host_tokens"] == int(200e9 // r["host_bytes_per_token"])
    assert by["int2"]["host_tokens"] / by["bf16"]["host_tokens"] > 4.5  # <= 0.25 x BF16's bytes
    ratio = P.plan_rows(budget, geom, ["default"], hicache_ratio=2.0)
    assert all(r["host_tokens"] == int(2 * r["kv_tokens"]) for r in ratio)
    assert "host tokens (GiB)" in P.table(ratio)
    assert "host tokens" not in P.table(P.plan_rows(budget, geom, ["default"]))  # not asked: unchanged
    import argparse

    from oscar_sglang.tools.commands import plan as cmd

    parser = argparse.ArgumentParser()
    cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", "--model-path", str(model), "--kv-budget-gib", "51.567",
                              "--formats", "default", "--hicache-ratio", "2"])
    args.argv = ["plan"]
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "Host tokens" in out and "refused at start" in out
    args.hicache_ratio = -1
    assert args.func(args) == 2
