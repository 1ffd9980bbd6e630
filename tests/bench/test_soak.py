"""bench/soak.py against a stub SGLang-like server on 127.0.0.1: each check must catch what it is for.

The stub speaks /v1/chat/completions (SSE streaming and plain JSON), /server_info (with an
oscar_int2.tokens_free), /v1/loads, /v1/models, /health and /flush_cache, and keeps a token
account: a request holds prompt + max_tokens tokens while it runs. Faults are switched on per
test: every Nth chat answers 500, an aborted stream keeps its tokens (a leak), probe answers are
garbled while other requests run, /health fails for a few polls. Runs take ~2 s each.
"""
import json
import sys
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from tests import ROOT, free_ports
from tests.http_stub import STUB_POLL, JSONHandler

from bench import soak

pytestmark = [pytest.mark.slow,  # the module's cases take minutes on 2 cores: make test, not test-fast
              pytest.mark.usefixtures("fast_polls")]  # stand-in servers: see tests/conftest.py

MRR, CTX, TOTAL = 4, 4096, 200_000


def make_handler(st: dict):
    class Stub(JSONHandler):

        def do_GET(self):
            with st["lock"]:
                used = st["active"] + st["leaked"]
                running = min(st["inflight"], MRR)
                waiting = max(0, st["inflight"] - MRR)
            if self.path == "/metrics":  # a "retraction" per burst request beyond the cap
                data = f'sglang:num_retracted_reqs_total{{model="stub"}} {st["retracted"]}\n'.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                return self.wfile.write(data)
            if self.path in ("/health", "/health_generate"):
                with st["lock"]:
                    st["health_calls"] += 1
                    bad = st["health_fail"][0] <= st["health_calls"] < st["health_fail"][1]
                return self._json(503 if bad else 200, {})
            if self.path == "/server_info":
                return self._json(200, {
                    "max_total_num_tokens": TOTAL, "context_length": CTX, "kv_cache_dtype": "int2",
                    "attention_backend": "oscar_triton", "disable_radix_cache": False,
                    "internal_states": [{"effective_max_running_requests_per_dp": MRR,
                                         "oscar_int2": {"tokens_free": TOTAL - used,
                                                        "side_rows_free": MRR + 1 - st["leaked_rows"]}}]})
            if self.path == "/v1/loads":
                return self._json(200, {"loads": [{"num_used_tokens": used, "num_running_reqs": running,
                                                   "num_waiting_reqs": waiting}]})
            if self.path == "/v1/models":
                return self._json(200, {"data": [{"id": "stub", "max_model_len": CTX}]})
            self._json(404, {})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else {}
            if self.path == "/flush_cache":
                return self._json(200, {})
            if self.path != "/v1/chat/completions" or body.get("model") != "stub":
                return self._json(400, {"error": "bad request"})
            prompt = body["messages"][-1]["content"]
            hold = len(" ".join(m["content"] for m in body["messages"]).split()) + body["max_tokens"]
            with st["lock"]:
                st["chats"] += 1
                fail = st["fail_every"] and st["chats"] % st["fail_every"] == 0
                bad_request = st["fail_4xx_every"] and st["chats"] % st["fail_4xx_every"] == 0
                stream_error = st["stream_error_every"] and st["chats"] % st["stream_error_every"] == 0
                broken = st["broken_after"] and st["chats"] > st["broken_after"]
                # load in flight (probes excluded: a probe's handler may not have finished its
                # bookkeeping when the client, answered, sends the next probe)
                others = st["inflight"] - st["probes_inflight"]
                st["inflight"] += 1
                st["probes_inflight"] += prompt in soak.PROBES
                st["max_inflight"] = max(st["max_inflight"], st["inflight"])
                st["retracted"] += st["inflight"] > MRR
                st["active"] += hold
            keep = False
            try:
                if prompt not in soak.PROBES:
                    time.sleep(0.1)  # load requests take a while, so a burst overlaps even on a busy CPU
                if fail:
                    return self._json(500, {"error": "injected"})
                if bad_request:
                    return self._json(400, {"error": "injected bad request"})
                answer = "answer: " + prompt[::-1][:40]  # a deterministic "greedy" answer
                if st["garble"] and others > 0 and prompt in soak.PROBES:
                    answer = "#garbled#"
                if broken and prompt in soak.PROBES:  # corrupted for good once the load has run
                    answer = "#broken#"
                if not body.get("stream"):
                    time.sleep(0.002)
                    return self._json(200, {"choices": [{"message": {"role": "assistant", "content": answer}}],
                                            "usage": {"prompt_tokens": hold - body["max_tokens"],
                                                      "completion_tokens": body["max_tokens"]}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    if stream_error:  # SGLang reports some failures inside a 200 stream
                        err = {"error": {"message": "injected", "code": 500}}
                        self.wfile.write(f"data: {json.dumps(err)}\n\n".encode())
                    for k in range(body["max_tokens"]):
                        chunk = {"choices": [{"delta": {"content": f"t{k} "}}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        if k % 16 == 0:
                            time.sleep(0.001)
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    with st["lock"]:
                        st["aborts_seen"] += 1
                    keep = st["leak_on_abort"]  # the injected bug: an aborted request keeps its KV
            finally:
                with st["lock"]:
                    st["inflight"] -= 1
                    st["probes_inflight"] -= prompt in soak.PROBES
                    st["active"] -= hold
                    if keep:
                        st["leaked"] += hold
                        st["leaked_rows"] += 1  # and its request row (with its side buffers)

    return Stub


@pytest.fixture
def stub():
    st = {"lock": threading.Lock(), "active": 0, "leaked": 0, "leaked_rows": 0, "inflight": 0, "probes_inflight": 0,
          "max_inflight": 0,
          "chats": 0, "fail_every": 0, "garble": False, "leak_on_abort": False, "aborts_seen": 0,
          "health_calls": 0, "health_fail": (0, 0), "retracted": 0,
          "fail_4xx_every": 0, "stream_error_every": 0, "broken_after": 0}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(st))
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs=STUB_POLL, daemon=True)
    t.start()
    st["url"] = f"http://127.0.0.1:{srv.server_address[1]}"
    yield st
    srv.shutdown()
    srv.server_close()


def run_soak(stub, tmp_path, *extra):
    out = tmp_path / "soak.json"
    rc = soak.main(["--url", f"stub={stub['url']}", "--duration", "2", "--concurrency", "2",
                    "--burst-every", "0.5", "--abort-fraction", "0.5", "--max-prompt-tokens", "600",
                    "--probe-interval", "0.02", "--health-interval", "0.1", "--health-timeout", "2",
                    "--drain-timeout", "20", "--idle-timeout", "10", "--request-timeout", "20",
                    "--quiet", "--out", str(out), *extra])
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["rows"]] == ["stub"]
    return rc, doc, doc["rows"][0]


def test_clean_server_passes_every_check(stub, tmp_path):
    rc, doc, row = run_soak(stub, tmp_path)
    assert rc == 0 and row["ok"] and doc["ok"], row["checks"]
    assert all(row["checks"].values())
    for k in ("date", "device", "model", "command", "rows", "duration_s", "requests", "aborted",
              "errors_4xx", "errors_5xx", "crashes", "pool_leak_tokens"):
        assert k in doc, k
    assert row["requests"] > 0 and row["aborted"] > 0 and row["bursts"] >= 2
    assert row["errors_4xx"] == row["errors_5xx"] == row["errors_conn"] == row["crashes"] == 0
    # bursts really went above max_running_requests (the stub saw it)
    assert row["max_running_requests"] == MRR and row["burst_size"] == 6
    assert stub["max_inflight"] > MRR and row["max_in_flight"] > MRR
    assert isinstance(row["max_waiting_seen"], int)  # sampled from /v1/loads (timing-dependent)
    assert row["pool_leak_tokens"] == 0 and row["idle_reached"]
    assert row["retracted_reqs"] == stub["retracted"] > 0 and row["cancelled_at_drain"] == 0
    assert row["pool_start"] == {"sglang_used": 0, "oscar_tokens_free": TOTAL,
                                 "oscar_side_rows_free": MRR + 1} == row["pool_end"]
    assert row["side_rows_leak"] == 0 and row["checks"]["no_side_buffer_leak"] is True
    assert row["probe_accuracy_alone"] == row["probe_accuracy_loaded"] == row["probe_accuracy_after"] == 1.0
    assert row["probes_loaded"] > 0 and row["probes_alone"] == len(soak.PROBES)
    # every prompt fits the cap (prompt tokens as the stub counts them: words)
    assert row["prompt_tokens"]["max"] <= 600 and row["prompt_tokens"]["min"] >= 1
    assert row["radix_cache"] is True and row["kv_cache_dtype"] == "int2"
    # the server saw the client's aborts as dropped connections
    assert stub["aborts_seen"] > 0


def test_5xx_are_counted_and_fail_the_run(stub, tmp_path):
    stub["fail_every"] = 5
    rc, doc, row = run_soak(stub, tmp_path)
    assert rc == 1 and not row["ok"] and not doc["ok"]
    assert row["errors_5xx"] > 0 and doc["errors_5xx"] == row["errors_5xx"]
    assert row["checks"]["no_5xx"] is False
    assert any("HTTP 500" in s for s in row["error_samples"])


def test_4xx_and_errors_inside_a_stream_are_counted(stub, tmp_path):
    stub["fail_4xx_every"], stub["stream_error_every"] = 7, 5
    rc, doc, row = run_soak(stub, tmp_path)
    assert row["errors_4xx"] > 0 and row["checks"]["no_4xx"] is False
    assert row["errors_in_stream"] > 0 and row["errors_5xx"] >= row["errors_in_stream"]  # code 500
    assert row["checks"]["no_5xx"] is False and rc == 1
    assert any("in stream" in e for e in row["error_samples"])


def test_answers_wrong_for_good_after_the_load_are_caught(stub, tmp_path):
    stub["broken_after"] = 60  # the idle passes at the start are done by then (16 probes)
    rc, doc, row = run_soak(stub, tmp_path)
    assert row["probe_accuracy_alone"] == 1.0 and row["probe_accuracy_after"] == 0.0
    assert row["probe_mismatches_after"][0]["got"] == "#broken#"
    assert row["checks"]["probes_right_after"] is False and rc == 1


def test_a_pool_leak_is_measured_in_tokens(stub, tmp_path):
    stub["leak_on_abort"] = True
    rc, doc, row = run_soak(stub, tmp_path)
    assert stub["leaked"] > 0, "the stub never noticed an abort"
    assert row["pool_leak_tokens"] == stub["leaked"] == doc["pool_leak_tokens"]
    assert row["pool_end"]["oscar_tokens_free"] == TOTAL - stub["leaked"]
    assert row["pool_end"]["sglang_used"] == stub["leaked"]
    assert row["checks"]["no_pool_leak"] is False and rc == 1
    # the leaked requests kept their rows too: side-buffer memory that never came back
    assert row["side_rows_leak"] == stub["leaked_rows"] > 0 and row["checks"]["no_side_buffer_leak"] is False


def test_answers_garbled_under_load_are_caught(stub, tmp_path):
    stub["garble"] = True
    rc, doc, row = run_soak(stub, tmp_path)
    assert row["probe_accuracy_alone"] == 1.0 and row["probe_accuracy_after"] == 1.0
    # a probe counts as loaded when ours were in flight as it left; the stub garbles it only if
    # they were still running when it arrived, so a few may come back right
    assert row["probes_loaded"] > 0 and row["probe_accuracy_loaded"] < 0.5
    assert {m["got"] for m in row["probe_mismatches_loaded"]} == {"#garbled#"}
    assert row["checks"]["probes_not_garbled_loaded"] is False and rc == 1


def test_health_failures_count_as_one_crash_per_episode(stub, tmp_path):
    stub["health_fail"] = (4, 8)  # the 4th..7th /health polls fail: one episode
    rc, doc, row = run_soak(stub, tmp_path)
    assert row["crashes"] == 1 == doc["crashes"]
    assert row["crash_events"][0]["what"] == "/health failed"
    assert row["checks"]["no_crash"] is False and rc == 1


def test_plan_is_a_function_of_the_seed_and_respects_the_context():
    def seq(seed, n=300, cap=32768):
        rng = soak.plan_rng(seed, "worker0")
        return [soak.make_spec(rng, cap) for _ in range(n)]

    a, b, c = seq(1), seq(1), seq(2)
    assert a == b and a != c
    assert soak.messages_of(a[0], 1) == soak.messages_of(b[0], 1)
    streams = [s for s in a if s.stream]
    aborts = [s for s in streams if s.abort_after is not None]
    assert 0.03 < len(aborts) / len(streams) < 0.2  # ~10 % of streams
    assert all(s.abort_after < max(1, s.max_tokens // 2) for s in aborts)
    assert any(s.system is not None for s in a) and any(s.system is None for s in a)
    assert min(s.prompt_words for s in a) < 300 and max(s.prompt_words for s in a) > 8000
    assert len({s.max_tokens for s in a}) >= 5
    for s in seq(3, cap=4096):  # prompt + system + output fit a 4K context (1.3 tokens / word)
        sys_tok = soak.SYSTEM_WORDS * soak.TOKENS_PER_WORD if s.system is not None else 0
        assert s.prompt_words * soak.TOKENS_PER_WORD + sys_tok + s.max_tokens + soak.TEMPLATE_TOKENS <= 4096


def test_leak_arithmetic_and_server_facts():
    assert soak.leak_tokens({"sglang_used": 0, "oscar_tokens_free": 100}, {"sglang_used": 0, "oscar_tokens_free": 90}) == 10
    assert soak.leak_tokens({"sglang_used": 5, "oscar_tokens_free": None}, {"sglang_used": 12, "oscar_tokens_free": None}) == 7
    assert soak.leak_tokens({"sglang_used": None, "oscar_tokens_free": None}, {}) is None
    f = soak.server_facts({"max_running_requests": None, "context_length": None, "max_req_input_len": 8000,
                           "disable_radix_cache": True,
                           "internal_states": [{"effective_max_running_requests_per_dp": 48}]},
                          {"data": [{"id": "m", "max_model_len": 131072}]})
    assert f["max_running_requests"] == 48 and f["context_tokens"] == 131072
    assert f["radix_cache"] is False and f["model"] == "m"
    assert f["kv_format"] is None and f["body_bits_per_element"] is None  # not an int2 server
    g = soak.server_facts({"internal_states": [{"oscar_int2": {"kv_format": "k4c64-v2t128-s4-w128",
                                                               "body_bits_per_element": 3.375}}]}, None)
    assert (g["kv_format"], g["body_bits_per_element"]) == ("k4c64-v2t128-s4-w128", 3.375)


def test_cli_modes_and_commands(capsys):
    with pytest.raises(SystemExit):
        soak.main(["--help"])
    text = capsys.readouterr().out
    assert "--url NAME=URL" in text and "--configs" in text and "noradix" in text
    assert soak.main(["--configs", "int2,bf16-noradix", "--print-commands", "--model-path", "/m",
                      "--tokenizer-path", "/t"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "--kv-cache-dtype int2" in lines[0] and "--disable-radix-cache" not in lines[0]
    assert "--disable-radix-cache" in lines[1] and "--kv-cache-dtype" not in lines[1]
    assert all("--host 127.0.0.1" in ln for ln in lines)
    with pytest.raises(SystemExit):
        soak.main(["--configs", "fp4"])
    with pytest.raises(SystemExit):
        soak.main([])
    assert soak.parse_urls(["a=http://127.0.0.1:1"]) == [("a", "http://127.0.0.1:1")]
    with pytest.raises(ValueError):
        soak.parse_urls(["http://127.0.0.1:1"])


DYING_SERVER = """
import sys, threading, os, time
sys.path.insert(0, {root!r})
from http.server import ThreadingHTTPServer
from tests.bench.test_soak import make_handler
st = {{"lock": threading.Lock(), "active": 0, "leaked": 0, "leaked_rows": 0, "inflight": 0, "max_inflight": 0,
      "chats": 0, "fail_every": 0, "garble": False, "leak_on_abort": False, "aborts_seen": 0,
      "health_calls": 0, "health_fail": (0, 0), "retracted": 0,
      "fail_4xx_every": 0, "stream_error_every": 0, "broken_after": 0}}
srv = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), make_handler(st))
srv.daemon_threads = True
def die():  # the server process dies once the load has run a while
    while st["chats"] < 40:
        time.sleep(0.05)
    os._exit(3)
threading.Thread(target=die, daemon=True).start()
srv.serve_forever()
"""


def test_a_started_server_that_dies_is_a_crash(tmp_path, monkeypatch):
    """--configs: the script starts the server itself (here a stub that exits mid-load); the row
    records the crash, the remaining requests fail, and the process group is gone afterwards."""
    script = tmp_path / "dying.py"
    script.write_text(DYING_SERVER.format(root=str(ROOT)))
    monkeypatch.setattr(soak, "managed_command", lambda config, args, port: [sys.executable, str(script), str(port)])
    port = free_ports(1)
    out = tmp_path / "soak.json"
    rc = soak.main(["--configs", "int2", "--port", str(port), "--duration", "3", "--concurrency", "2",
                    "--burst-every", "0.5", "--max-prompt-tokens", "600", "--health-interval", "0.1",
                    "--health-timeout", "2", "--idle-timeout", "3", "--request-timeout", "5",
                    "--drain-timeout", "5", "--startup-timeout", "30", "--quiet", "--out", str(out),
                    "--log-dir", str(tmp_path / "logs"), "--tokenizer-path", str(tmp_path)])
    row = json.loads(out.read_text())["rows"][0]
    assert rc == 1 and row["managed"] and row["crashes"] == 1
    assert row["crash_events"][0]["what"] == "process exited"
    assert row["checks"]["no_crash"] is False and row["ok"] is False
    assert row["pool_leak_tokens"] is None and row["idle_reached"] is False  # nothing to compare with
    assert row["startup_s"] >= 0 and (tmp_path / "logs" / "soak_int2.log").is_file()


def test_ctrl_c_stops_the_load_and_still_writes_the_row(stub, tmp_path):
    import os
    import signal

    timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        rc, doc, row = run_soak(stub, tmp_path, "--duration", "60")
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 30
    assert row["interrupted"] is True and row["duration_s"] < 10 and row["requests"] > 0
    assert rc == 1 and row["pool_leak_tokens"] is None  # no idle wait after an interrupt: not measured


def test_started_servers_get_a_tokenizer_fitted_to_the_model(tmp_path, capsys, smollm2_tokenizer):
    dst = soak.fitted_tokenizer(ROOT / "launch" / "models" / "llama31-8b", smollm2_tokenizer, tmp_path / "tok")
    vocab = json.loads((dst / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 128256 and (dst / "chat_template.jinja").is_file()
    assert soak.main(["--configs", "int2", "--print-commands", "--log-dir", str(tmp_path / "l")]) == 0
    line = capsys.readouterr().out
    assert f"--tokenizer-path {tmp_path / 'l' / 'tokenizer'}" in line and "launch/models/llama31-8b" in line


def _fake_row(rng, name, cmd, alone, loaded, n):
    return {"name": name, "server_command": cmd, "model": "m", "requests": int(rng.integers(10, 900)),
            "aborted": int(rng.integers(1, 50)), "errors_4xx": 0, "errors_5xx": 0, "crashes": 0,
            "duration_s": float(rng.uniform(100, 500)), "pool_leak_tokens": 0, "ok": True,
            "probe_accuracy_alone": alone, "probes_alone": n, "probe_accuracy_loaded": loaded,
            "probes_loaded": n}


def test_side_by_side_runs_merge_into_one_document(tmp_path):
    import numpy as np

    rng = np.random.default_rng()
    int2 = "python -m sglang.launch_server --kv-cache-dtype int2 --attention-backend oscar_triton"
    rows = [_fake_row(rng, "int2", int2, 1.0, 0.9, 20), _fake_row(rng, "int2-noradix", int2 + " --disable-radix-cache", 1.0, 0.6, 60),
            _fake_row(rng, "bf16", "python -m sglang.launch_server --attention-backend triton", 1.0, 0.95, 40)]
    paths = []
    for i, r in enumerate(rows):  # one file per server, as the side-by-side processes write them
        p = tmp_path / f"soak_{i}.json"
        p.write_text(json.dumps({"date": "d", "device": "H100", "model": "m", "command": f"cmd{i}", "rows": [r]}))
        paths.append(p)
    out = tmp_path / "merged.json"
    assert soak.main(["--merge", *map(str, paths), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["rows"]] == ["int2", "int2-noradix", "bf16"]
    assert doc["duration_s"] == pytest.approx(sum(r["duration_s"] for r in rows), abs=0.1)
    assert doc["requests"] == sum(r["requests"] for r in rows) and doc["pool_leak_tokens"] == 0
    # pooled over the int2 rows, each probe once: (0.9 * 20 + 0.6 * 60) / 80
    assert doc["probe_accuracy_int2_loaded"] == pytest.approx(0.675)
    assert doc["probe_accuracy_int2_alone"] == 1.0 and doc["probe_accuracy_bf16_loaded"] == 0.95
    assert doc["int2_loaded_minus_alone_points"] == pytest.approx(-32.5)
    assert doc["command"] == "cmd0 ; cmd1 ; cmd2" and len(doc["merged_from"]) == 3
    # a row that never got idle leaves the leak unmeasured (not zero), and the same name twice is refused
    rows[1]["pool_leak_tokens"] = None
    assert soak.summary(rows)["pool_leak_tokens"] is None
    with pytest.raises(ValueError, match="repeat"):
        soak.merge([paths[0], paths[0]], out)
    # a second run (another seed) with the same server names adds up; its rows keep seed and date
    again = tmp_path / "soak_again.json"
    again.write_text(json.dumps({"date": "d2", "device": "H100", "model": "m", "command": "cmd9", "seed": 7,
                                 "rows": [rows[0]]}))
    doc = soak.merge([*paths, again], out)
    assert [(r["name"], r["seed"], r["run_date"]) for r in doc["rows"]][-2:] == [("bf16", None, "d"), ("int2", 7, "d2")]
    assert doc["requests"] == sum(r["requests"] for r in rows) + rows[0]["requests"]
