"""bench/pd.py without a GPU: the servers' and the router's command lines per part, engine and
configuration, on one GPU and across two (--gpus: each server's CUDA_VISIBLE_DEVICES and memory
fraction, which start together), the direct front's fan-out (the same bootstrap fields to both
servers, one room per request, a hang-up reaching both), the transfer line (TRANSFER_LOG_RE, on
the exact line and on what runtime/pd_hooks.py writes), greedy comparisons, the checks (pass, fail,
not measured; per load with several loads), the merged results file (row keys apart per load and
GPU layout), and whole jobs against stub PD servers (separate processes that check the bootstrap
fields and hand a "transfer" from the prefill stub to the decode stub through a file): engines,
load (two loads, two GPUs) and aborts, a server that refuses to start, a missing router."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import types
from pathlib import Path

import pytest

from bench import pd
from bench._serving_client import RequestRecord
from bench.spec_decode import ResultsFile

INT2_LINE = ("[2026-12-02 10:00:00 TP0] oscar PD transfer: kv_cache_dtype=int2:k2c64-v2t64-s4-w128:1a2b3c4d "
             "page_size=64 kv_bytes_per_page=1286144 kv_bytes_per_token=20096.00 state_bytes_per_request=65536 regions=97")


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


# ------------------------------------------------------------------------------ commands


def test_engine_job_commands_and_env():
    args = pd.parse_args(["--model-dir", "/m/llama31-8b", "--tokenizer-dir", "/t", "--engine-model-dir", "/m/smol"])
    jobs = {j.name: j for j in pd.all_jobs(args.port)}
    job = jobs["engines-mooncake-tcp"]
    roles = pd.job_servers(job, pd.ENGINES["mooncake-tcp"], args, {})
    assert list(roles) == ["single", "prefill", "decode"]
    (single, senv, sport), (pre, penv, pport), (dec, denv, dport) = roles.values()
    assert (pport, dport, sport) == (28000, 28100, 28300)
    for cmd in (single, pre, dec):  # dummy SmolLM2 int2, side by side: 0.9 of what is free, pools capped
        assert cmd[1:3] == ["-m", "sglang.launch_server"] and _flag(cmd, "--model-path") == "/m/smol"
        assert _flag(cmd, "--load-format") == "dummy" and _flag(cmd, "--kv-cache-dtype") == "int2"
        assert _flag(cmd, "--mem-fraction-static") == "0.9" and _flag(cmd, "--max-total-tokens") == "131072"
    assert "--disaggregation-mode" not in single and senv == {}
    assert (_flag(pre, "--disaggregation-mode"), _flag(pre, "--disaggregation-transfer-backend"),
            _flag(pre, "--disaggregation-bootstrap-port")) == ("prefill", "mooncake", "28030")
    assert (_flag(dec, "--disaggregation-mode"), _flag(dec, "--disaggregation-transfer-backend")) == ("decode", "mooncake")
    assert "--disaggregation-bootstrap-port" not in dec  # only the prefill side runs the bootstrap server
    for env in (penv, denv):
        assert env["MOONCAKE_PROTOCOL"] == "tcp" and env["MC_FORCE_TCP"] == "1"
        assert env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] == env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == "120"
    nixl = pd.job_servers(jobs["engines-nixl"], pd.ENGINES["nixl"], pd.parse_args(["--server-env", "UCX_TLS=tcp"]), {})
    assert _flag(nixl["prefill"][0], "--disaggregation-transfer-backend") == "nixl"
    assert "MOONCAKE_PROTOCOL" not in nixl["decode"][1] and nixl["decode"][1]["UCX_TLS"] == "tcp"


def test_load_and_real_job_commands():
    args = pd.parse_args(["--model-dir", "/m/llama31-8b", "--tokenizer-dir", "/t", "--server-arg=--enable-metrics"])
    jobs = {j.name: j for j in pd.all_jobs(args.port)}
    eng = pd.ENGINES["mooncake-tcp"]
    kv = {}
    for c in pd.LOAD_CONFIGS:
        roles = pd.job_servers(jobs[f"load-{c}"], eng, args, {})
        assert list(roles) == ["prefill", "decode"]
        pre, dec = roles["prefill"][0], roles["decode"][0]
        # the prefill server takes 0.35 of the free memory, the decode one 0.54 of what is left after it
        assert (_flag(pre, "--mem-fraction-static"), _flag(dec, "--mem-fraction-static")) == ("0.35", "0.54")
        assert pre[-1] == dec[-1] == "--enable-metrics" and _flag(pre, "--model-path") == "/m/llama31-8b"
        assert roles["decode"][2] - roles["prefill"][2] == 100
        kv[c] = (_flag(pre, "--kv-cache-dtype"), _flag(dec, "--attention-backend"))
    assert kv == {"int2": ("int2", "oscar_triton"), "fp8": ("fp8_e4m3", "flashinfer"), "bf16": (None, "flashinfer")}
    ctx = {"model_path": "/hf/smollm2", "served": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    i2 = pd.job_servers(jobs["real-int2"], eng, args, ctx)
    bf = pd.job_servers(jobs["real-bf16"], eng, args, ctx)
    assert all(c[1:4] == ["-m", "oscar_sglang.tools.cli", "serve"] for c, _, _ in i2.values())  # as shipped
    assert all(c[1:3] == ["-m", "sglang.launch_server"] and _flag(c, "--model-path") == "/hf/smollm2" for c, _, _ in bf.values())
    for roles in (i2, bf):
        assert _flag(roles["prefill"][0], "--disaggregation-mode") == "prefill"
        assert _flag(roles["decode"][0], "--disaggregation-mode") == "decode"
        assert "--disaggregation-mode" not in roles["single"][0] and "--enable-metrics" not in roles["single"][0]
    # every port of every job distinct, below the ephemeral range, servers 100 apart
    ports = []
    for j in pd.all_jobs(args.port):
        ports += [j.ports.prefill, j.ports.bootstrap, j.ports.decode, j.ports.front, j.ports.front + 1, j.ports.single]
    assert len(ports) == len(set(ports)) and max(ports) < 32768


def test_router_command_and_print_commands(capsys):
    args = pd.parse_args(["--router-arg=--log-level=debug"])
    job = pd.all_jobs(args.port)[0]
    cmd = pd.router_command(job, args)
    assert cmd[1:4] == ["-m", "sglang_router.launch_router", "--pd-disaggregation"]
    i = cmd.index("--prefill")
    assert cmd[i + 1:i + 3] == ["http://127.0.0.1:28000", "28030"] and _flag(cmd, "--decode") == "http://127.0.0.1:28100"
    assert (_flag(cmd, "--port"), _flag(cmd, "--prometheus-port"), cmd[-1]) == ("28200", "28201", "--log-level=debug")
    assert pd.main(["--print-commands", "--model-path", "/hf/smollm2"]) == 0
    out = capsys.readouterr().out
    # two engines, two real, three load jobs (the aborts on the int2 load pair): 3 servers, 3, 2 each
    assert out.count("sglang_router.launch_router") == 7
    assert out.count("sglang.launch_server") + out.count("oscar_sglang.tools.cli serve") == 2 * 3 + 2 * 3 + 3 * 2
    assert "# load-int2 (then the aborts)" in out and "MOONCAKE_PROTOCOL=tcp" in out
    assert pd.main(["--print-commands", "--part", "aborts", "--front", "direct", "--engine", "nixl"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# aborts-int2: engine nixl, front direct") and "direct front" in out
    assert "sglang_router" not in out and out.count("--disaggregation-transfer-backend nixl") == 2


def test_bad_arguments_stop_before_any_work():
    for argv in (["--part", "load,warp"], ["--engines", "mooncake,ucx"], ["--load-configs", "int2,int3"],
                 ["--real-configs", "fp8"], ["--load", "64x8192"], ["--server-env", "UCX_TLS"], ["--front", "lb"],
                 ["--concurrency", "0"]):
        with pytest.raises(SystemExit) as e:
            pd.parse_args(argv)
        assert e.value.code == 2, argv
    args = pd.parse_args(["--part", "aborts", "--pd-timeout-s", "30"])
    assert args.abort_idle_timeout == 90 and [j.name for j in pd.select_jobs(args)] == ["aborts-int2"]
    both = pd.parse_args(["--part", "load,aborts", "--load-configs", "fp8"])  # no int2 load pair: its own
    assert [j.name for j in pd.select_jobs(both)] == ["load-fp8", "aborts-int2"]
    args = pd.parse_args(["--engines", "nixl,mooncake-tcp"])
    assert [j.name for j in pd.select_jobs(args)][:2] == ["engines-nixl", "engines-mooncake-tcp"]
    for argv in (["--gpus", "0,1,2"], ["--gpus", "0,"], ["--gpus", ","], ["--load", "64x8192+512,64x8192+512"],
                 ["--load", "64x8192+512,256x2048"], ["--load", ","]):
        with pytest.raises(SystemExit) as e:
            pd.parse_args(argv)
        assert e.value.code == 2, argv


def test_two_gpu_commands_env_and_memory():
    args = pd.parse_args(["--gpus", "0,1", "--model-dir", "/m/llama31-8b", "--tokenizer-dir", "/t",
                          "--engine-model-dir", "/m/smol"])
    # the two-GPU loads and its own file to start from, unless given
    assert args.loads == ["64x8192+512", "256x2048+256"] and Path(args.base).name == "pd_h200x2.json"
    assert Path(args.out).name == "pd_h200.json"  # the default --out stays; run_stages passes pd_h200x2.json
    jobs = {j.name: j for j in pd.all_jobs(args.port)}
    eng = pd.ENGINES["mooncake-tcp"]
    for c in pd.LOAD_CONFIGS:
        job = jobs[f"load-{c}"]
        roles = pd.job_servers(job, eng, args, {})
        (pre, penv, _), (dec, denv, _) = roles["prefill"], roles["decode"]
        assert (penv["CUDA_VISIBLE_DEVICES"], denv["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
        assert penv["MOONCAKE_PROTOCOL"] == denv["MOONCAKE_PROTOCOL"] == "tcp"  # the engine's env kept
        # each alone on its GPU: the whole-GPU fraction, not the shared GPU's 0.35 / 0.54
        assert _flag(pre, "--mem-fraction-static") == _flag(dec, "--mem-fraction-static") == "0.85"
        assert "--base-gpu-id" not in pre + dec  # placed by CUDA_VISIBLE_DEVICES: each sees GPU 0 only
        assert pd.starts_together(job, args) and pd.job_gpus(job, args) == {"prefill": "0", "decode": "1"}
    for name in ("engines-mooncake-tcp", "real-int2"):  # the single server beside the prefill one
        roles = pd.job_servers(jobs[name], eng, args, {"model_path": "/hf/smollm2", "served": "smol"})
        assert {r: env["CUDA_VISIBLE_DEVICES"] for r, (_, env, _) in roles.items()} == {
            "single": "0", "prefill": "0", "decode": "1"}
        for cmd, _, _ in roles.values():  # capped pools: two SmolLM2 servers on GPU 0 over-commit nothing
            assert _flag(cmd, "--mem-fraction-static") == "0.9" and _flag(cmd, "--max-total-tokens") == "131072"
        assert pd.starts_together(jobs[name], args)
    mine = pd.parse_args(["--gpus", "1,0", "--own-gpu-mem-fraction", "0.8", "--load", "64x8192+512"])
    roles = pd.job_servers(jobs["load-int2"], eng, mine, {})
    assert (roles["prefill"][1]["CUDA_VISIBLE_DEVICES"], roles["decode"][1]["CUDA_VISIBLE_DEVICES"]) == ("1", "0")
    assert _flag(roles["prefill"][0], "--mem-fraction-static") == "0.8" and mine.loads == ["64x8192+512"]
    # one GPU named (N or N,N): all on it, the shared GPU's fractions, the decode server after the prefill one
    for gpus in ("1", "1,1"):
        one = pd.parse_args(["--gpus", gpus])
        roles = pd.job_servers(jobs["load-int2"], eng, one, {})
        assert [e["CUDA_VISIBLE_DEVICES"] for _, e, _ in roles.values()] == ["1", "1"]
        assert [_flag(c, "--mem-fraction-static") for c, _, _ in roles.values()] == ["0.35", "0.54"]
        assert not pd.starts_together(jobs["load-int2"], one) and one.loads == ["64x8192+512"]
        assert Path(one.base).name == "pd_h200.json"
    # the default: nothing set, as before --gpus
    default = pd.parse_args([])
    assert all("CUDA_VISIBLE_DEVICES" not in env for j in jobs.values()
               for _, env, _ in pd.job_servers(j, eng, default, {"model_path": "/hf", "served": "s"}).values())
    assert not pd.starts_together(jobs["load-int2"], default) and pd.starts_together(jobs["real-bf16"], default)
    assert pd.job_gpus(jobs["load-int2"], default) == {"prefill": None, "decode": None}


def test_start_servers_together_or_one_after_another(monkeypatch, tmp_path):
    import contextlib

    events = []

    class Fake:
        def __init__(self, cmd, env, log, port):
            self.role, self.startup_s = cmd[0], 1.0

        def __enter__(self):
            events.append(("start", self.role))
            return self

        def __exit__(self, *exc):
            events.append(("stop", self.role))

        def wait_ready(self, timeout_s):
            events.append(("ready", self.role))
            if self.role == os.environ.get("FAKE_REFUSE"):
                raise RuntimeError("refused")

    monkeypatch.setattr(pd, "_server", Fake)
    roles = {r: ([r], {}, port) for r, port in (("prefill", 1), ("decode", 2))}
    logs = {r: tmp_path / r for r in roles}
    args = pd.parse_args([])
    p_, d_ = "prefill", "decode"
    for together, want in ((True, [("start", p_), ("start", d_), ("ready", p_), ("ready", d_)]),
                           (False, [("start", p_), ("ready", p_), ("start", d_), ("ready", d_)])):
        events.clear()
        with contextlib.ExitStack() as stack:
            srvs, errs = pd.start_servers(stack, roles, logs, together, args)
            assert events == want and set(srvs) == {"prefill", "decode"} and not errs
        assert events[-2:] == [("stop", "decode"), ("stop", "prefill")]
    monkeypatch.setenv("FAKE_REFUSE", "prefill")  # one after another: no decode server after a failed prefill one
    events.clear()
    with contextlib.ExitStack() as stack:
        srvs, errs = pd.start_servers(stack, roles, logs, False, args)
    assert list(srvs) == ["prefill"] and "prefill: RuntimeError: refused" in errs["prefill"]
    assert ("start", "decode") not in events


def test_two_gpu_print_commands(capsys):
    assert pd.main(["--print-commands", "--gpus", "0,1", "--part", "load,aborts", "--load-configs", "int2,fp8",
                    "--model-dir", "/m/llama31-8b"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = [x for x in out if x.startswith("# load-")]
    assert heads == [
        "# load-int2 (then the aborts): engine mooncake-tcp, front router; prefill on GPU 0, decode on GPU 1; "
        "started together; loads 64x8192+512, 256x2048+256",
        "# load-fp8: engine mooncake-tcp, front router; prefill on GPU 0, decode on GPU 1; started together; "
        "loads 64x8192+512, 256x2048+256"]
    servers = [x for x in out if "sglang.launch_server" in x]
    assert [x.split()[0] for x in servers] == ["CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1"] * 2
    assert all("--mem-fraction-static 0.85" in x for x in servers)
    assert pd.main(["--print-commands", "--part", "load", "--load-configs", "int2"]) == 0
    out = capsys.readouterr().out
    assert ("prefill on GPU (first visible), decode on GPU (first visible); each waited for before the next; "
            "loads 64x8192+512") in out and "CUDA_VISIBLE_DEVICES" not in out


# ------------------------------------------------------------------------------ transfer bytes


def test_transfer_log_re_on_the_exact_line():
    line = ("oscar PD transfer: kv_cache_dtype=bf16 page_size=64 kv_bytes_per_page=8388608 "
            "kv_bytes_per_token=131072.00 state_bytes_per_request=0 regions=64")
    m = pd.TRANSFER_LOG_RE.fullmatch(line)
    assert m and m.group("kv_cache_dtype") == "bf16" and m.group("regions") == "64"
    assert pd.transfer_log(f"noise\n{INT2_LINE}\nmore\n{line}\n") == {
        "kv_cache_dtype": "int2:k2c64-v2t64-s4-w128:1a2b3c4d", "page_size": 64, "kv_bytes_per_page": 1286144,
        "kv_bytes_per_token": 20096.0, "state_bytes_per_request": 65536, "regions": 97}
    assert pd.transfer_log("oscar PD transfer: kv_cache_dtype=bf16 page_size=64") is None


def test_transfer_log_re_reads_what_pd_hooks_writes():
    from oscar_sglang.runtime.pd_hooks import transfer_summary

    kv_args = types.SimpleNamespace(kv_cache_dtype_str="fp8_e4m3", page_size=64, kv_item_lens=[65536] * 64,
                                    kv_data_ptrs=[0] * 64, state_item_lens=[[4096, 4096]], state_data_ptrs=[[0, 0]])
    got = pd.transfer_log(f"[2026-12-02 10:00:00 TP0] {transfer_summary(kv_args)}")
    assert got == {"kv_cache_dtype": "fp8_e4m3", "page_size": 64, "kv_bytes_per_page": 64 * 65536,
                   "kv_bytes_per_token": 65536.0, "state_bytes_per_request": 8192, "regions": 66}


def test_transfer_bytes_per_token():
    f = pd.transfer_fields(INT2_LINE, INT2_LINE, 8192)
    assert f["transfer_bytes_per_token"] == round(20096 + 65536 / 8192, 2) == 20104.0
    assert "8192" in f["transfer_bytes_per_token_from"] and f["decode_transfer_log"]["regions"] == 97
    missing = pd.transfer_fields("no such line", "", 8192)
    assert missing["transfer_bytes_per_token"] is None and missing["transfer_log"] is None
    assert missing["transfer_bytes_per_token_from"].startswith("not found")
    assert pd.transfer_fields(INT2_LINE, "", None)["transfer_bytes_per_token"] is None


# ------------------------------------------------------------------------------ answers and checks


def _rec(ids, error=None):
    return RequestRecord(prompt_len=4, sent=0.0, output_ids=list(ids), output_tokens=len(ids), error=error)


def test_compare_answers():
    single = [_rec([1, 2, 3]), _rec([4, 5]), _rec([6, 7, 8])]
    c = pd.compare_answers(single, [_rec([1, 2, 3]), _rec([4, 9]), _rec([6, 7])])
    assert c["greedy_identical_vs_single_server"] == pytest.approx(1 / 3) and c["identical"] == 1
    assert c["divergence_positions"] == [None, 1, 2] and c["pd_output_tokens"] == [3, 2, 2] and c["moved"]
    assert c["pd_output_sha1"][0] == c["single_output_sha1"][0] != c["pd_output_sha1"][1]
    bad = pd.compare_answers(single, [_rec([1, 2, 3]), _rec([], error="HTTP 500"), _rec([6, 7, 8])])
    assert bad["greedy_identical_vs_single_server"] is None and not bad["moved"] and "pd 1: HTTP 500" in bad["errors"]


def _row(part, config, front="router", engine="mooncake-tcp", **more):
    return {"part": part, "config": config, "front": front, "engine": engine, "ok": True, **more}


def _aborts(prefill=(0, 0), decode=(0, 0), **more):
    srv = lambda leak, side: {"pool_leak_tokens": leak, "side_rows_leak": side, "side_free_leak": {}}  # noqa: E731
    return _row("aborts", "int2", servers={"prefill": srv(*prefill), "decode": srv(*decode)}, aborted=32, streams=32,
                **more)


def _rows(int2_id=0.95, bf16_id=0.96, int2_bytes=20104.0, bf16_bytes=131072.0, aborts=None):
    load = lambda c, b: _row("load", c, load="64x8192+512", ttft_p50_s=0.5, ttft_p90_s=0.9,  # noqa: E731
                             output_tok_s=3000.0, transfer_bytes_per_token=b)
    return [_row("engines", "int2", moved=True, greedy_identical_vs_single_server=1.0),
            _row("engines", "int2", engine="nixl", ok=False, error="prefill: ServerError: ...\nImportError: nixl"),
            _row("real", "int2", greedy_identical_vs_single_server=int2_id, prompts=64),
            _row("real", "bf16", greedy_identical_vs_single_server=bf16_id, prompts=64),
            load("int2", int2_bytes), load("fp8", 65544.0), load("bf16", bf16_bytes), aborts or _aborts()]


def test_checks_pass_at_their_limits():
    s = pd.summary(_rows(int2_id=0.94, bf16_id=0.96, int2_bytes=32768.0))
    assert s["all_checks_pass"] and not s["not_measured"], s
    assert set(s["checks"]) == {
        "engines_one_moves_kv_and_matches_single_server",
        "real_greedy_identical_vs_single_server_int2_ge_bf16_minus_0.02",
        "real_greedy_identical_vs_single_server_int2_ge_0.9", "load_transfer_bytes_per_token_int2_le_0.25x_bf16",
        "load_int2_ttft_and_output_rate_measured", "load_fp8_ttft_and_output_rate_measured",
        "load_bf16_ttft_and_output_rate_measured", "aborts_int2_no_pool_leak_on_prefill_and_decode"}
    v = s["check_values"]
    assert v["engines_one_moves_kv_and_matches_single_server"]["engines"]["nixl / router"]["error"] == ["ImportError: nixl"]
    assert v["load_transfer_bytes_per_token_int2_le_0.25x_bf16"] == {"int2": 32768.0, "bf16": 131072.0, "fp8": 65544.0,
                                                                     "load": "64x8192+512"}
    # int2 against FP8 on the same pair of GPUs (informative): equal rates here
    assert (v["load_int2_ttft_and_output_rate_measured"]["output_tok_s_vs_fp8"],
            v["load_int2_ttft_and_output_rate_measured"]["ttft_p50_s_vs_fp8"]) == (1.0, 1.0)
    assert list(s["loads"]) == ["64x8192+512"] and s["loads"]["64x8192+512"] == s["load"]
    assert s["load"]["fp8"]["at"] == "mooncake-tcp / router" and s["load"]["int2"]["output_tok_s"] == 3000.0


def test_checks_fail_past_their_limits():
    c = pd.summary(_rows(int2_id=0.89, bf16_id=0.90, int2_bytes=32769.0, aborts=_aborts(decode=(0, 1))))["checks"]
    assert not c["real_greedy_identical_vs_single_server_int2_ge_0.9"]
    assert c["real_greedy_identical_vs_single_server_int2_ge_bf16_minus_0.02"]  # 0.89 >= 0.90 - 0.02
    assert not c["load_transfer_bytes_per_token_int2_le_0.25x_bf16"]
    assert not c["aborts_int2_no_pool_leak_on_prefill_and_decode"]
    c = pd.summary(_rows(int2_id=0.93, bf16_id=0.96, aborts=_aborts(prefill=(64, 0))))["checks"]
    assert not c["real_greedy_identical_vs_single_server_int2_ge_bf16_minus_0.02"]
    assert not c["aborts_int2_no_pool_leak_on_prefill_and_decode"]
    rows = _rows()
    rows[0] = {**rows[0], "ok": False, "error": "1 of 8 answers differ"}  # no engine ok: a failure, not missing
    assert pd.summary(rows)["checks"]["engines_one_moves_kv_and_matches_single_server"] is False
    assert "engines_one_moves_kv_and_matches_single_server" not in pd.summary(rows)["not_measured"]


def test_checks_without_their_numbers_are_not_measured():
    rows = _rows(aborts=_aborts(decode=(0, None)))  # a decode server that reports no side rows
    rows[3] = {**rows[3], "ok": False, "error": "ServerError: exited with 1"}  # bf16 real pair did not start
    rows[4] = {**rows[4], "transfer_bytes_per_token": None}  # no transfer line in the int2 prefill log
    rows = [r for r in rows if not (r["part"] == "load" and r["config"] == "fp8")]
    s = pd.summary(rows)
    assert s["not_measured"] == ["real_greedy_identical_vs_single_server_int2_ge_bf16_minus_0.02",
                                 "load_transfer_bytes_per_token_int2_le_0.25x_bf16",
                                 "load_fp8_ttft_and_output_rate_measured",
                                 "aborts_int2_no_pool_leak_on_prefill_and_decode"]
    assert s["checks"]["real_greedy_identical_vs_single_server_int2_ge_0.9"] and not s["all_checks_pass"]
    empty = pd.summary([])
    assert len(empty["not_measured"]) == 8 and not any(empty["checks"].values())


def test_pairs_come_from_one_engine_and_front():
    rows = [_row("load", "int2", front="direct", transfer_bytes_per_token=20000.0),
            _row("load", "bf16", front="direct", transfer_bytes_per_token=131072.0),
            _row("load", "int2", transfer_bytes_per_token=21000.0),
            _row("load", "bf16", engine="nixl", transfer_bytes_per_token=130000.0)]
    # the router rows are of two engines: the direct pair is the one of one engine and front
    got = pd.pick(rows, "load", ["int2", "bf16"])
    assert {c: r["front"] for c, r in got.items()} == {"int2": "direct", "bf16": "direct"}
    rows.append(_row("load", "bf16", transfer_bytes_per_token=131000.0))
    got = pd.pick(rows, "load", ["int2", "bf16"])  # now the router has both of one engine: first
    assert [got["int2"]["transfer_bytes_per_token"], got["bf16"]["transfer_bytes_per_token"]] == [21000.0, 131000.0]
    assert pd.pick(rows[:1], "load", ["int2", "bf16"]) == {"int2": rows[0], "bf16": None}


TWO = {"prefill": "0", "decode": "1"}


def _load(config, load, tok_s, ttft, tbytes=None, gpus=TWO, **more):
    return _row("load", config, load=load, gpus=gpus, ttft_p50_s=ttft, ttft_p90_s=2 * ttft, output_tok_s=tok_s,
                transfer_bytes_per_token=tbytes, **more)


def test_checks_per_load_on_two_gpus():
    big, small = "64x8192+512", "256x2048+256"
    rows = [_load("int2", small, 4000.0, 2.0, 40000.0), _load("fp8", small, 3200.0, 2.5, 70000.0),
            _load("bf16", small, 3000.0, 2.6, 132000.0),
            _load("int2", big, 1800.0, 4.0, 32000.0), _load("fp8", big, 1200.0, 5.0, 65544.0),
            _load("bf16", big, 1000.0, 6.0, 131072.0)]
    s = pd.summary(rows)
    c, v = s["checks"], s["check_values"]
    assert pd.summary_loads(rows) == [big, small]  # the 8K load is the main one, whatever the file order
    # the transfer check reads the 8K rows (the 2K int2 row's 40000 > 0.25 x 132000 would fail it)
    assert c["load_transfer_bytes_per_token_int2_le_0.25x_bf16"]
    assert v["load_transfer_bytes_per_token_int2_le_0.25x_bf16"] == {"int2": 32000.0, "bf16": 131072.0,
                                                                     "fp8": 65544.0, "load": big}
    # the 8K load keeps the one-load names, the 2K load's carry it; all three configs measured per load
    for cfg in ("int2", "fp8", "bf16"):
        assert c[f"load_{cfg}_ttft_and_output_rate_measured"] and c[f"load_{small}_{cfg}_ttft_and_output_rate_measured"]
    assert v[f"load_{small}_fp8_ttft_and_output_rate_measured"]["output_tok_s"] == 3200.0
    assert (v["load_int2_ttft_and_output_rate_measured"]["output_tok_s_vs_fp8"],
            v["load_int2_ttft_and_output_rate_measured"]["ttft_p50_s_vs_fp8"]) == (1.5, 0.8)
    assert v[f"load_{small}_int2_ttft_and_output_rate_measured"]["output_tok_s_vs_fp8"] == 1.25
    assert list(s["loads"]) == [big, small] and s["load"] == s["loads"][big]
    assert s["loads"][small]["bf16"]["ttft_p50_s"] == 2.6 and "output_tok_s_vs_fp8" not in s["loads"][small]["bf16"]
    assert s["not_measured"] == ["engines_one_moves_kv_and_matches_single_server",
                                 "real_greedy_identical_vs_single_server_int2_ge_bf16_minus_0.02",
                                 "real_greedy_identical_vs_single_server_int2_ge_0.9",
                                 "aborts_int2_no_pool_leak_on_prefill_and_decode"]
    # two-GPU rows of the 8K load only: the 2K load's checks are there, not measured
    s = pd.summary(rows[3:])
    assert [n for n in s["not_measured"] if n.startswith("load_")] == [
        f"load_{small}_{cfg}_ttft_and_output_rate_measured" for cfg in ("int2", "fp8", "bf16")]
    assert s["check_values"][f"load_{small}_int2_ttft_and_output_rate_measured"]["output_tok_s_vs_fp8"] is None
    # a one-GPU file: only the loads it holds; the longest prompts are the main load without 8192 ones
    one = [_load(cfg, ld, 100.0, 1.0, 1.0, gpus=None) for ld in ("1x64+4", "4x128+6")
           for cfg in ("int2", "fp8", "bf16")]
    assert pd.summary_loads(one) == ["4x128+6", "1x64+4"] and pd.summary_loads([]) == [big]
    assert set(pd.summary(one)["checks"]) >= {"load_int2_ttft_and_output_rate_measured",
                                              "load_1x64+4_bf16_ttft_and_output_rate_measured"}
    assert not [n for n in pd.summary(one)["not_measured"] if n.startswith("load_")]


def test_one_gpu_and_two_gpu_rows_are_never_paired():
    ld = "64x8192+512"
    one = [_load("int2", ld, 900.0, 27.0, 29760.0, gpus={"prefill": None, "decode": None}),
           _load("fp8", ld, 700.0, 30.0, 65544.0, gpus=None)]
    two = [_load("int2", ld, 1800.0, 4.0, 32000.0), _load("fp8", ld, 1200.0, 5.0, 65544.0),
           _load("bf16", ld, 1000.0, 6.0, 131072.0)]
    got = pd.pick(one + two, "load", pd.LOAD_CONFIGS, ld)  # the one-GPU rows first, without bf16
    assert {c: pd.gpu_layout(r) for c, r in got.items()} == {c: "two GPUs" for c in pd.LOAD_CONFIGS}
    # no layout has them all: the first layout's rows, a gap where it has none (not the other's bf16)
    got = pd.pick(one + two[2:], "load", pd.LOAD_CONFIGS, ld)
    assert got["int2"] is one[0] and got["fp8"] is one[1] and got["bf16"] is None
    assert pd.gpu_layout({"gpus": {"prefill": "1", "decode": "1"}}) == pd.gpu_layout({}) == "one GPU"
    # the engine the other parts use comes from engines rows of this run's layout
    rows = [_row("engines", "int2", engine="nixl", gpus=TWO)]
    args = pd.parse_args(["--engines", "mooncake-tcp,nixl"])
    assert pd.chosen_engine(args, rows)[0] == "mooncake-tcp"
    assert pd.chosen_engine(pd.parse_args(["--engines", "mooncake-tcp,nixl", "--gpus", "0,1"]), rows)[0] == "nixl"


def test_results_merge_by_part_config_engine_and_front(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/pd.py", "--part", "engines,load"])
    f = ResultsFile(tmp_path / "pd.json", None, "GPU X", module="pd", key=pd.row_key, finish=pd.summary)
    rows = _rows()
    for r in rows[:2] + rows[4:7]:
        f.put(r)
    f.put(_row("load", "int2", front="direct", ttft_p50_s=0.4, output_tok_s=1.0))  # another front: kept beside
    f.put({**rows[4], "ttft_p50_s": 0.45})  # the same key: replaced
    monkeypatch.setattr("sys.argv", ["bench/pd.py", "--part", "real,aborts"])
    g = ResultsFile(tmp_path / "second.json", tmp_path / "pd.json", "GPU X", module="pd", key=pd.row_key,
                    finish=pd.summary)
    for r in rows[2:4] + rows[7:]:
        g.put(r)
    doc = json.loads((tmp_path / "second.json").read_text())
    one, ld = "one GPU", "64x8192+512"
    assert [pd.row_key(r) for r in doc["rows"]] == [
        ("engines", "int2", "mooncake-tcp", "router", None, one), ("engines", "int2", "nixl", "router", None, one),
        ("load", "int2", "mooncake-tcp", "router", ld, one), ("load", "fp8", "mooncake-tcp", "router", ld, one),
        ("load", "bf16", "mooncake-tcp", "router", ld, one), ("load", "int2", "mooncake-tcp", "direct", None, one),
        ("real", "int2", "mooncake-tcp", "router", None, one), ("real", "bf16", "mooncake-tcp", "router", None, one),
        ("aborts", "int2", "mooncake-tcp", "router", None, one)]
    assert doc["rows"][2]["ttft_p50_s"] == 0.45 and doc["summary"]["all_checks_pass"]
    assert [c["command"] for c in doc["calls"]] == ["python -m bench.pd --part engines,load",
                                                    "python -m bench.pd --part real,aborts"]


def test_row_keys_keep_loads_and_gpu_layouts_apart(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/pd.py", "--part", "load"])
    f = ResultsFile(tmp_path / "pd.json", None, "GPU X", module="pd", key=pd.row_key, finish=pd.summary)
    big, small = "64x8192+512", "256x2048+256"
    f.put(_load("int2", big, 1800.0, 4.0, 32000.0))
    f.put(_load("int2", small, 4000.0, 2.0, 40000.0))  # another load of the same pair: beside it
    f.put(_load("int2", big, 900.0, 27.0, 29760.0, gpus=None))  # the same load on one GPU: beside it
    f.put(_load("int2", small, 4100.0, 1.9, 40000.0))  # the same key: replaced
    f.put(_row("aborts", "int2", gpus=TWO, load=big))  # an aborts row's key has no load
    f.put(_row("aborts", "int2", gpus=TWO))  # so this one replaces it
    rows = json.loads((tmp_path / "pd.json").read_text())["rows"]
    assert [pd.row_key(r) for r in rows] == [
        ("load", "int2", "mooncake-tcp", "router", big, "two GPUs"),
        ("load", "int2", "mooncake-tcp", "router", small, "two GPUs"),
        ("load", "int2", "mooncake-tcp", "router", big, "one GPU"),
        ("aborts", "int2", "mooncake-tcp", "router", None, "two GPUs")]
    assert rows[1]["output_tok_s"] == 4100.0 and rows[0]["output_tok_s"] == 1800.0 and "load" not in rows[3]


def test_the_engine_the_other_parts_use():
    args = pd.parse_args(["--engines", "mooncake-tcp,nixl"])
    rows = _rows()
    assert pd.chosen_engine(args, rows) == ("mooncake-tcp", "the first engine whose engines row is ok")
    rows[0] = {**rows[0], "ok": False, "error": "differ"}
    assert pd.chosen_engine(args, rows)[0] == "mooncake-tcp"  # moved answers, not all equal
    rows[0]["moved"] = False
    assert pd.chosen_engine(args, rows) == ("mooncake-tcp", "no engine tried works yet: the first of --engines")
    rows.append(_row("engines", "int2", engine="nixl", front="direct", moved=True))
    assert pd.chosen_engine(args, rows)[0] == "nixl"
    assert pd.chosen_engine(pd.parse_args(["--engine", "mooncake"]), rows) == ("mooncake", "--engine")


# ------------------------------------------------------------------------------ stub PD servers

PD_STUB = r'''
import hashlib, json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]


def flag(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


port, mode = int(flag("--port")), flag("--disaggregation-mode", "null")
kv, boot = flag("--kv-cache-dtype", "bf16"), flag("--disaggregation-bootstrap-port")
state = os.environ["PD_STUB_DIR"]
token_s = float(os.environ.get("PD_STUB_TOKEN_S", "0"))
prefill_s = float(os.environ.get("PD_STUB_PREFILL_S", "0"))
if os.environ.get("PD_STUB_REFUSE") == mode:
    print(f"ValueError: --kv-cache-dtype int2 cannot start: PD disaggregation is not supported yet ({mode})")
    sys.exit(3)


def note(name, rec):
    with open(os.path.join(state, f"{mode}_{name}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


note("started", {"t": time.time(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
                 "mem": flag("--mem-fraction-static")})
if os.environ.get("PD_STUB_SLOW_START") == mode:
    time.sleep(1.0)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *a):
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/loads":
            return self._send(200, {"loads": [{"num_used_tokens": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]})
        st = {"oscar_int2": {"tokens_free": 90000, "side_rows_free": 64}} if kv == "int2" else {}
        return self._send(200, {"max_total_num_tokens": 90000, "internal_states": [st]})

    def _chunk(self, text):
        self.wfile.write(text.encode())
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/flush_cache":
            return self._send(200, {})
        note("bodies", body)
        ids, n, room = body["input_ids"], body["sampling_params"]["max_new_tokens"], body.get("bootstrap_room")
        digest = hashlib.sha1(json.dumps(ids).encode()).hexdigest()
        if mode != "null" and (body.get("bootstrap_host") != "127.0.0.1" or room is None):
            return self._send(400, {"error": "no bootstrap fields"})
        if mode == "prefill" and str(body.get("bootstrap_port")) != boot:
            return self._send(400, {"error": f"bootstrap port {body.get('bootstrap_port')} is not {boot}"})
        stream = bool(body.get("stream"))
        if stream:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
        try:
            if mode == "prefill":  # "prefill" for a while, then hand the "KV" over
                n, until = 1, time.time() + float(body.get("stub_prefill_s", prefill_s))
                while time.time() < until:
                    if stream:
                        self._chunk(": prefilling\n\n")
                    time.sleep(0.02)
                with open(os.path.join(state, f"room_{room}"), "w") as f:
                    f.write(digest)
            elif mode == "decode":  # until the prefill side's "transfer" of this room came
                path, t0 = os.path.join(state, f"room_{room}"), time.time()
                while not os.path.exists(path):
                    if time.time() - t0 > 5:
                        raise RuntimeError(f"room {room}: nothing transferred")
                    if stream:
                        self._chunk(": waiting\n\n")
                    time.sleep(0.02)
                time.sleep(0.01)
                if open(path).read() != digest:
                    raise RuntimeError(f"room {room}: the prefill side had other input ids")
            out = [(sum(ids) + k) % 900 + 100 for k in range(n)]
            if not stream:
                return self._send(200, {"output_ids": out, "meta_info": {"completion_tokens": n}})
            for k in range(1, n + 1):
                self._chunk("data: " + json.dumps({"output_ids": out[k - 1:k], "meta_info": {"completion_tokens": k}}) + "\n\n")
                time.sleep(token_s)
            self._chunk("data: [DONE]\n\n")
        except OSError:  # the client hung up
            note("disconnects", {"room": room})
        except RuntimeError as e:
            if stream:
                self._chunk("data: " + json.dumps({"error": str(e)}) + "\n\n")
            else:
                self._send(500, {"error": str(e)})


class S(ThreadingHTTPServer):
    daemon_threads = True


srv = S(("127.0.0.1", port), H)
if mode != "null":
    per_page, st = {"int2": (1286144, 65536), "fp8_e4m3": (4194304, 0), "bf16": (8388608, 0)}[kv]
    print(f"[2026-12-02 10:00:00 TP0] oscar PD transfer: kv_cache_dtype={kv} page_size=64 "
          f"kv_bytes_per_page={per_page} kv_bytes_per_token={per_page / 64:.2f} state_bytes_per_request={st} "
          f"regions=65", flush=True)
note("ready", {"t": time.time()})
print(f"{mode} on {port}: The server is fired up and ready to roll!", flush=True)
srv.serve_forever()
'''


@pytest.fixture
def stubs(tmp_path, monkeypatch):
    """Every server the bench starts is the stub (its flags kept); fast readiness polls and stops."""
    from bench import _launcher, serving_vs_fp8

    stub = tmp_path / "pd_stub.py"
    stub.write_text(PD_STUB)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("PD_STUB_DIR", str(state))
    monkeypatch.setitem(_launcher.SPEED, "settle_s", 0.0)
    wait = _launcher.Server.wait_ready
    monkeypatch.setattr(_launcher.Server, "wait_ready", lambda self, t, poll_s=0.1: wait(self, t, poll_s))
    real = pd.dummy_command
    monkeypatch.setattr(pd, "dummy_command", lambda *a, **k: [sys.executable, str(stub), *real(*a, **k)[3:]])
    monkeypatch.setattr(serving_vs_fp8, "gpu_name", lambda: "cpu (stub)")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 5000}))
    return types.SimpleNamespace(stub=stub, state=state, model=model, tmp=tmp_path)


def _jsonl(state: Path, name: str) -> list:
    """What a stub noted (state/<mode>_<name>.jsonl), one record a line."""
    path = state / f"{name}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _argv(s, *more):
    return ["--out", str(s.tmp / "pd.json"), "--base", "", "--logs", str(s.tmp / "logs"), "--front", "direct",
            "--engine-model-dir", str(s.model), "--model-dir", str(s.model), "--tokenizer-dir", str(s.model),
            "--startup-timeout", "30", "--request-timeout", "30", "--route-timeout", "20", *more]


def test_engines_job_against_stub_pairs(stubs, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/pd.py", "--part", "engines"])
    rc = pd.main(_argv(stubs, "--part", "engines", "--engines", "mooncake-tcp", "--port", "26000",
                       "--engine-prompts", "3", "--engine-prompt-tokens", "64", "--engine-output-tokens", "5"))
    assert rc == 0
    doc = json.loads((stubs.tmp / "pd.json").read_text())
    (row,) = doc["rows"]
    assert row["ok"] and row["moved"] and row["greedy_identical_vs_single_server"] == 1.0, row
    assert (row["engine"], row["backend"], row["front"], row["kv"]) == ("mooncake-tcp", "mooncake", "direct", "int2")
    assert row["server_env"]["decode"]["MOONCAKE_PROTOCOL"] == "tcp" and row["server_env"]["single"] == {}
    assert row["transfer_log"]["kv_bytes_per_token"] == 20096.0 and row["pd_output_tokens"] == [5, 5, 5]
    assert set(row["startup_s"]) == {"single", "prefill", "decode"} and row["kv_tokens"]["decode"] == 90000
    # the fan-out: each request (the route check and the 3 prompts) reached both stubs with the same
    # bootstrap fields, a room of its own
    pre, dec = _jsonl(stubs.state, "prefill_bodies"), _jsonl(stubs.state, "decode_bodies")
    assert len(pre) == len(dec) == 4
    key = lambda b: (b["bootstrap_host"], b["bootstrap_port"], b["bootstrap_room"], json.dumps(b["input_ids"]))  # noqa: E731
    assert sorted(map(key, pre)) == sorted(map(key, dec))
    assert len({b["bootstrap_room"] for b in pre}) == 4 and {b["bootstrap_port"] for b in pre} == {26030}
    assert len(_jsonl(stubs.state, "null_bodies")) == 3  # the single server: no bootstrap fields
    assert doc["summary"]["checks"]["engines_one_moves_kv_and_matches_single_server"]


def test_load_and_aborts_against_a_stub_pair(stubs, monkeypatch):
    monkeypatch.setenv("PD_STUB_TOKEN_S", "0.01")
    monkeypatch.setenv("PD_STUB_PREFILL_S", "0.2")
    monkeypatch.setattr("sys.argv", ["bench/pd.py", "--part", "load,aborts"])
    rc = pd.main(_argv(stubs, "--part", "load,aborts", "--load-configs", "int2", "--engine", "nixl", "--port", "26400",
                       "--load", "4x128+6", "--warmup", "1x64+2", "--abort-early", "3", "--abort-mid", "2",
                       "--abort-prompt-tokens", "64", "--abort-output-tokens", "40", "--abort-early-max-s", "0.1"))
    assert rc == 0
    doc = json.loads((stubs.tmp / "pd.json").read_text())
    load, aborts = doc["rows"]
    assert load["part"] == "load" and load["ok"] and load["n"] == 4 and load["ttft_p50_s"] > 0 and load["output_tok_s"] > 0
    assert load["transfer_bytes_per_token"] == 20096 + 65536 / 128 and load["transfer_log"]["regions"] == 65
    assert (load["engine"], load["engine_chosen_by"], load["front"]) == ("nixl", "--engine", "direct")
    assert aborts["part"] == "aborts" and aborts["ok"], aborts
    assert aborts["streams"] == aborts["aborted"] == 5 and aborts["early"]["aborted"] == 3
    assert aborts["servers"]["prefill"]["pool_leak_tokens"] == aborts["servers"]["decode"]["pool_leak_tokens"] == 0
    assert aborts["pool_leak_tokens"] == 0 and aborts["side_rows_leak"] == 0
    c = doc["summary"]["checks"]
    assert c["load_int2_ttft_and_output_rate_measured"] and c["aborts_int2_no_pool_leak_on_prefill_and_decode"]
    assert "load_bf16_ttft_and_output_rate_measured" in doc["summary"]["not_measured"]


@pytest.mark.parametrize("gpus", ["0,1", ""])
def test_two_loads_against_a_stub_pair_on_two_gpus_or_one(stubs, monkeypatch, gpus):
    monkeypatch.setenv("PD_STUB_TOKEN_S", "0.005")
    monkeypatch.setenv("PD_STUB_SLOW_START", "prefill")  # the prefill stub takes 1 s to listen
    monkeypatch.setattr("sys.argv", ["bench/pd.py"])
    port = "22000" if gpus else "22600"  # load-int2 (the 6th job) on 24000 or 24600: no other test's ports
    rc = pd.main(_argv(stubs, "--part", "load,aborts", "--load-configs", "int2", "--engine", "mooncake-tcp",
                       "--gpus", gpus, "--port", port, "--load", "4x128+6,2x64+4", "--warmup", "1x64+2",
                       "--abort-early", "2", "--abort-mid", "1", "--abort-prompt-tokens", "64",
                       "--abort-output-tokens", "40", "--abort-early-max-s", "0.1"))
    assert rc == 0
    doc = json.loads((stubs.tmp / "pd.json").read_text())
    assert [(r["part"], r.get("load")) for r in doc["rows"]] == [("load", "4x128+6"), ("load", "2x64+4"),
                                                                ("aborts", None)]
    assert all(r["ok"] for r in doc["rows"]), doc["rows"]
    first, second, aborts = doc["rows"]
    assert (first["n"], second["n"]) == (4, 2) and first["ttft_p50_s"] > 0 and second["output_tok_s"] > 0
    # each load's transfer bytes per token over its own mean prompt tokens (the one pair's line)
    assert (first["transfer_bytes_per_token"], second["transfer_bytes_per_token"]) == (20096 + 65536 / 128,
                                                                                      20096 + 65536 / 64)
    started = {m: _jsonl(stubs.state, f"{m}_started") for m in ("prefill", "decode")}
    ready = {m: _jsonl(stubs.state, f"{m}_ready") for m in ("prefill", "decode")}
    assert len(started["prefill"]) == len(started["decode"]) == 1  # one pair for both loads and the aborts
    checks = doc["summary"]["checks"]
    if gpus:  # prefill on GPU 0, decode on GPU 1, each with the whole-GPU fraction, started together
        assert first["gpus"] == aborts["gpus"] == {"prefill": "0", "decode": "1"} and doc["device"] == "2 x cpu (stub)"
        assert (started["prefill"][0]["gpu"], started["decode"][0]["gpu"]) == ("0", "1")
        assert started["prefill"][0]["mem"] == started["decode"][0]["mem"] == "0.85"
        assert (first["prefill_mem_fraction"], first["decode_mem_fraction"]) == (0.85, 0.85)
        assert started["decode"][0]["t"] < ready["prefill"][0]["t"]
        assert first["server_env"]["decode"]["CUDA_VISIBLE_DEVICES"] == "1"
        # two-GPU rows: the two-GPU loads are checked (not measured here), the stub loads beside them
        assert checks["load_4x128+6_int2_ttft_and_output_rate_measured"]
        assert checks["load_2x64+4_int2_ttft_and_output_rate_measured"]
        assert {"load_int2_ttft_and_output_rate_measured", "load_256x2048+256_int2_ttft_and_output_rate_measured",
                "load_transfer_bytes_per_token_int2_le_0.25x_bf16"} <= set(doc["summary"]["not_measured"])
    else:  # one GPU, as before --gpus: nothing set, the shared fractions, the decode stub after the prefill one
        assert first["gpus"] == {"prefill": None, "decode": None} and doc["device"] == "cpu (stub)"
        assert started["prefill"][0]["gpu"] is None and started["decode"][0]["gpu"] is None
        assert (started["prefill"][0]["mem"], started["decode"][0]["mem"]) == ("0.35", "0.54")
        assert started["decode"][0]["t"] > ready["prefill"][0]["t"]
        assert checks["load_int2_ttft_and_output_rate_measured"]  # the longest prompts: the main load
        assert doc["summary"]["check_values"]["load_int2_ttft_and_output_rate_measured"]["load"] == "4x128+6"
        assert checks["load_2x64+4_int2_ttft_and_output_rate_measured"]


def test_a_prefill_server_that_refuses_is_a_failed_row(stubs, monkeypatch):
    monkeypatch.setenv("PD_STUB_REFUSE", "prefill")
    monkeypatch.setattr("sys.argv", ["bench/pd.py"])
    rc = pd.main(_argv(stubs, "--part", "engines,load,aborts", "--engines", "nixl", "--load-configs", "int2",
                       "--port", "26800", "--load", "64x8192+512,256x2048+256"))
    assert rc == 1
    rows = {(r["part"], r["job"]): r for r in json.loads((stubs.tmp / "pd.json").read_text())["rows"]
            if r.get("load") != "256x2048+256"}
    loads = [r["load"] for r in json.loads((stubs.tmp / "pd.json").read_text())["rows"] if r["part"] == "load"]
    assert loads == ["64x8192+512", "256x2048+256"]  # a failed row per load
    assert set(rows) == {("engines", "engines-nixl"), ("load", "load-int2"), ("aborts", "load-int2")}
    for r in rows.values():
        assert not r["ok"] and r["start_failed"] and "prefill: ServerError" in r["error"]
        assert "PD disaggregation is not supported yet" in r["log_tails"]["prefill"]
    # engines: the three started together (the others came up); load: the decode server never started
    assert rows[("engines", "engines-nixl")]["startup_s"]["decode"] is not None
    assert set(rows[("load", "load-int2")]["log_tails"]) == {"prefill"}
    assert rows[("load", "load-int2")]["engine_chosen_by"] == "no engine tried works yet: the first of --engines"


def test_a_load_that_fails_midway_keeps_the_rows_before_it(stubs, monkeypatch):
    from bench import serving_vs_fp8

    measure = serving_vs_fp8.measure

    def dies_on_the_second(url, load, *a, **k):
        if load == "2x64+4":
            raise RuntimeError("the decode server died")
        return measure(url, load, *a, **k)

    monkeypatch.setattr(serving_vs_fp8, "measure", dies_on_the_second)
    monkeypatch.setattr("sys.argv", ["bench/pd.py"])
    rc = pd.main(_argv(stubs, "--part", "load,aborts", "--load-configs", "int2", "--engine", "mooncake-tcp",
                       "--gpus", "0,1", "--port", "23200", "--load", "4x128+6,2x64+4", "--warmup", "1x64+2"))
    assert rc == 1
    rows = json.loads((stubs.tmp / "pd.json").read_text())["rows"]
    assert [(r["part"], r.get("load"), r["ok"]) for r in rows] == [
        ("load", "4x128+6", True), ("load", "2x64+4", False), ("aborts", None, False)]
    assert "RuntimeError: the decode server died" in rows[1]["error"]
    assert rows[2]["gpus"] == {"prefill": "0", "decode": "1"}
    assert rows[0]["output_tok_s"] > 0 and "error" not in rows[0]


def test_a_missing_router(stubs, monkeypatch):
    from bench import multi_gpu

    monkeypatch.setattr(multi_gpu, "router_available", lambda: "the sglang_router module is not installed")
    args = pd.parse_args(_argv(stubs, "--front", "router", "--port", "27200"))
    jobs = {j.name: j for j in pd.all_jobs(args.port)}
    assert pd.front_kind(jobs["engines-nixl"], args) == (
        "direct", "the sglang_router module is not installed: the bench fanned out (--front direct)")
    with pytest.raises(pd.FrontMissing):
        pd.front_kind(jobs["load-int2"], args)
    monkeypatch.setattr("sys.argv", ["bench/pd.py"])
    results = ResultsFile(stubs.tmp / "pd.json", None, "cpu", module="pd", key=pd.row_key, finish=pd.summary)
    assert pd.run_job(jobs["load-int2"], pd.ENGINES["mooncake-tcp"], args, {"vocab": 5000}, results, "test") is False
    rows = json.loads((stubs.tmp / "pd.json").read_text())["rows"]
    assert [(r["part"], r["front"], r["router_missing"]) for r in rows] == [("load", "router", True), ("aborts", "router", True)]
    assert "not installed" in rows[0]["error"] and not list(stubs.state.iterdir())  # no server was started


def test_direct_front_fans_out_and_hangs_up_on_both(stubs):
    from bench._launcher import Server
    from bench._serving_client import random_prompts, run_requests
    from bench._serving_server import post_json

    port = 27600
    cmds = {m: [sys.executable, str(stubs.stub), "--port", str(p), "--disaggregation-mode", m,
                "--disaggregation-bootstrap-port", str(port + 30)] for m, p in (("prefill", port), ("decode", port + 100))}
    with Server(cmds["prefill"], {}, stubs.tmp / "p.log", port) as pre, \
            Server(cmds["decode"], {}, stubs.tmp / "d.log", port + 100) as dec:
        pre.wait_ready(20, 0.05)
        dec.wait_ready(20, 0.05)
        with pd.DirectFront(pre.url, port + 30, dec.url, port + 200) as front:
            recs = run_requests(front.url, random_prompts(3, 32, 5000, 1), 4, "t", timeout_s=20, progress=False)
            assert [len(r.output_ids) for r in recs] == [4, 4, 4] and not any(r.error for r in recs)
            plain = post_json(front.url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
            assert plain["output_ids"] == [118, 119]

            async def hang_up():  # before the first token: the prefill stub is still "prefilling"
                import aiohttp

                async with aiohttp.ClientSession() as s:
                    body = {"input_ids": [9] * 8, "stream": True, "stub_prefill_s": 3.0,
                            "sampling_params": {"max_new_tokens": 4}}
                    async with s.post(front.url + "/generate", json=body) as r:
                        await asyncio.sleep(0.2)
                        r.close()

            asyncio.run(hang_up())
            room = front.rooms[-1]
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5:
                gone = {m for m in ("prefill", "decode")
                        if room in [x["room"] for x in _jsonl(stubs.state, f"{m}_disconnects")]}
                if gone == {"prefill", "decode"}:
                    break
                time.sleep(0.05)
            assert gone == {"prefill", "decode"}
            assert len(front.rooms) == len(set(front.rooms)) == 5 and not front.prefill_errors
    pre_b, dec_b = _jsonl(stubs.state, "prefill_bodies"), _jsonl(stubs.state, "decode_bodies")
    assert sorted(b["bootstrap_room"] for b in pre_b) == sorted(b["bootstrap_room"] for b in dec_b) == sorted(front.rooms)
    assert all(b["bootstrap_port"] == port + 30 and b["bootstrap_host"] == "127.0.0.1" for b in pre_b + dec_b)


def test_bootstrap_fields_of_a_batch():
    rooms = iter(range(100, 200))
    one = pd.bootstrap_fields({"input_ids": [1, 2], "stream": True}, "127.0.0.1", 9000, lambda: next(rooms))
    assert (one["bootstrap_host"], one["bootstrap_port"], one["bootstrap_room"]) == ("127.0.0.1", 9000, 100)
    batch = pd.bootstrap_fields({"input_ids": [[1], [2], [3]]}, "h", 1, lambda: next(rooms))
    assert batch["bootstrap_room"] == [101, 102, 103] and batch["bootstrap_port"] == [1, 1, 1]
    text = pd.bootstrap_fields({"text": "hi"}, "h", 1, lambda: next(rooms))
    assert text["bootstrap_room"] == 104
