"""bench/serving_vs_fp8.py against stub SGLang-like servers on 127.0.0.1 (no GPU, no network).

The stub speaks /generate (token ids in, SSE stream out with meta_info.completion_tokens),
/server_info (max_total_num_tokens, context_length, effective_max_running_requests_per_dp,
oscar_int2.tokens_free and side_bytes_free), /v1/loads and /flush_cache, and keeps a token
account: a request holds prompt + output tokens while it runs. Faults per test: tokens kept after
every request or after an aborted stream (a leak), a slow first request (a cold server).
"""
import json
import random
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from tests import ROOT
from tests.http_stub import STUB_POLL, JSONHandler

from bench import serving_vs_fp8 as vs

pytestmark = [pytest.mark.slow,  # the module's cases take minutes on 2 cores: make test, not test-fast
              pytest.mark.usefixtures("fast_polls")]  # stand-in servers: see tests/conftest.py
report = vs.report

TOTAL, CTX, MRR, SIDE = 100_000, 40_000, 8, 1 << 20
VOCAB = 5000
# what the plugin reports an int2 server stores (other caches report no format)
STORED = {"int2": {"kv_format": "k4c64-v2t128-s4-w128", "body_bits_per_element": 3.375}}


def make_handler(st: dict):
    class Stub(JSONHandler):
        protocol_version = "HTTP/1.0"


        def do_GET(self):
            with st["lock"]:
                used, inflight = st["active"] + st["leaked"], st["inflight"]
            if self.path == "/server_info":
                return self._json(200, {
                    "max_total_num_tokens": TOTAL, "context_length": CTX, "kv_cache_dtype": st["kv"],
                    "attention_backend": "stub", "disable_radix_cache": False,
                    "internal_states": [{"effective_max_running_requests_per_dp": MRR,
                                         "oscar_int2": {"tokens_free": TOTAL - used, **STORED.get(st["kv"], {}),
                                                        "side_bytes_free": SIDE - st["side_leaked"],
                                                        "compiled_while_serving": list(st["compiles"])}}]})
            if self.path == "/v1/loads":
                return self._json(200, {"loads": [{"num_used_tokens": used, "num_running_reqs": inflight,
                                                   "num_waiting_reqs": 0}]})
            self._json(404, {})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else {}
            if self.path == "/flush_cache":
                return self._json(200, {})
            if self.path != "/generate":
                return self._json(404, {})
            ids, out = body["input_ids"], body["sampling_params"]["max_new_tokens"]
            hold = len(ids) + out
            with st["lock"]:
                first = st["requests"] == 0
                if first:  # what the plugin lists once its first request compiled something
                    st["compiles"].extend(st["first_compiles"])
                st["requests"] += 1
                st["inflight"] += 1
                st["active"] += hold
                st["prompts"].append(ids[:4])
            keep = 0
            try:
                time.sleep(st["ttft_s"] + (st["cold_s"] if first else 0))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                try:
                    for k in range(1, out + 1):
                        msg = {"output_ids": [7], "meta_info": {"completion_tokens": k}}
                        self.wfile.write(f"data: {json.dumps(msg)}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(st["tpot_s"])
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                    keep = st["leak_per_request"]
                except (BrokenPipeError, ConnectionResetError):
                    with st["lock"]:
                        st["aborts_seen"] += 1
                    keep = hold if st["leak_on_abort"] else 0
            finally:
                with st["lock"]:
                    st["inflight"] -= 1
                    st["active"] -= hold
                    st["leaked"] += keep
                    st["side_leaked"] += st["side_leak_on_abort"] if keep and st["leak_on_abort"] else 0

    return Stub


def start_stub(kv="int2", **kw):
    st = {"lock": threading.Lock(), "active": 0, "leaked": 0, "side_leaked": 0, "inflight": 0, "requests": 0,
          "aborts_seen": 0, "prompts": [], "kv": kv, "ttft_s": 0.005, "tpot_s": 0.0005, "cold_s": 0.0,
          "leak_per_request": 0, "leak_on_abort": False, "side_leak_on_abort": 0, "compiles": [],
          "first_compiles": [], **kw}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(st))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs=STUB_POLL, daemon=True).start()
    st["url"], st["server"] = f"http://127.0.0.1:{srv.server_address[1]}", srv
    return st


@pytest.fixture
def stubs():
    made = []

    def make(**kw):
        made.append(start_stub(**kw))
        return made[-1]

    yield make
    for st in made:
        st["server"].shutdown()
        st["server"].server_close()


def run(out, urls, loads, *extra, configs=None):
    """The bench's `run` against the stubs in urls ({config: stub}); configs (default: urls' keys)
    not in urls are servers the bench starts itself."""
    argv = ["run", "--out", str(out), "--base", str(out.with_name("none.json")), "--loads", loads, "--vocab", str(VOCAB), "--warmup", "1x32+2",
            "--abort-load", "6x64+400", "--idle-timeout", "5", "--request-timeout", "30",
            "--configs", configs or ",".join(urls), *extra]
    for c, st in urls.items():
        argv += ["--url", f"{c}={st['url']}"]
    assert vs.main(argv) == 0
    return json.loads(out.read_text())


def test_load_names_and_config_keys(seed):
    rng = random.Random(seed)
    for _ in range(20):
        n, i, o = rng.randint(1, 999), rng.randint(1, 200_000), rng.randint(1, 4096)
        assert report.parse_load(report.load_name(n, i, o)) == (n, i, o)
    for bad in ("256x2048x256", "x2048+1", "256x2048"):
        with pytest.raises(ValueError):
            report.parse_load(bad)
    kb = {c: vs.kv_and_backend(vs.CONFIGS[c]) for c in vs.DEFAULT_CONFIGS.split(",")}
    assert kb == {"int2": ("int2", "oscar_triton"), "int2-mixed-chunk": ("int2", "oscar_triton"),
                  "fp8-splits64": ("fp8_e4m3", "triton"), "fp8-flashinfer": ("fp8_e4m3", "flashinfer"),
                  "flashinfer": ("bf16", "flashinfer")}
    assert "--enable-mixed-chunk" in vs.CONFIGS["int2-mixed-chunk"].args
    assert "64" in vs.CONFIGS["fp8-splits64"].args
    loads = vs.DEFAULT_LOADS.split(",")
    assert {"256x2048+256", "256x2048+1024", "512x2048+1024", "64x8192+512", "1x4096+256", "1x32768+256",
            "1x131072+256"} == set(loads)
    # units keep every load once, in order, per configuration
    units = vs.units(["int2", "flashinfer"], loads, 300)
    for c in ("int2", "flashinfer"):
        assert [ld for cc, u in units if cc == c for ld in u] == loads


def test_rows_written_after_each_measurement_and_merged_across_calls(stubs, tmp_path, monkeypatch):
    a, b = stubs(kv="int2"), stubs(kv="fp8_e4m3")
    out = tmp_path / "vs.json"
    writes = []
    real = vs._results.write
    monkeypatch.setattr(vs._results, "write", lambda p, d: (writes.append(len(d["rows"])), real(p, d))[1])
    doc = run(out, {"int2": a}, "3x64+8,1x256+16")
    assert writes == [0, 1, 2, 3]  # the file is rewritten after every row (2 loads + the aborts)
    for k in ("date", "device", "model", "command", "rows", "summary"):
        assert k in doc
    keys = [vs.row_key(r) for r in doc["rows"]]
    assert keys == [("3x64+8", "int2", "oscar_triton", "int2"), ("1x256+16", "int2", "oscar_triton", "int2"),
                    ("6x64+400 aborted", "int2", "oscar_triton", "int2")]
    thr, b1, ab = doc["rows"]
    assert thr["kind"] == "throughput" and b1["kind"] == "batch1" and ab["kind"] == "aborts"
    for r in (thr, b1):
        assert r["ok"] and r["n"] == report.parse_load(r["load"])[0]
        for f in ("output_tok_s", "ttft_p50_s", "tpot_p50_ms", "max_running_requests", "kv_tokens"):
            assert r[f] is not None, f
        assert r["max_running_requests"] == MRR and r["kv_tokens"] == TOTAL and r["pool_leak_tokens"] == 0
        assert (r["kv_format"], r["body_bits_per_element"]) == ("k4c64-v2t128-s4-w128", 3.375)
    assert thr["output_tok_s"] == pytest.approx(3 * 8 / thr["duration_s"])
    assert ab["streams"] == 6 and ab["aborted"] == 6 == a["aborts_seen"] and ab["pool_leak_tokens"] == 0
    assert ab["side_free_leak"] == {} and ab["pool_end"]["other_free"] == {"side_bytes_free": SIDE}
    assert doc["summary"]["pool_leak_tokens"] == 0
    # a second call (another server) adds its rows; the first call's stay
    doc2 = run(out, {"fp8-splits64": b}, "3x64+8")
    assert {vs.row_key(r) for r in doc2["rows"]} == set(keys) | {
        ("3x64+8", "fp8_e4m3", "triton", "fp8-splits64"), ("6x64+400 aborted", "fp8_e4m3", "triton", "fp8-splits64")}
    assert len(doc2["calls"]) == 2
    fp8_row = next(r for r in doc2["rows"] if vs.row_key(r) == ("3x64+8", "fp8_e4m3", "triton", "fp8-splits64"))
    assert fp8_row["kv_format"] is None and fp8_row["body_bits_per_element"] is None
    e = doc2["summary"]["per_load"]["3x64+8"]
    assert e["fp8_best_backend"] == "triton"
    assert e["int2_vs_fp8_best"] == pytest.approx(thr["output_tok_s"] / doc2["rows"][-2]["output_tok_s"])
    # the same key measured again replaces its row
    doc3 = run(out, {"int2": a}, "3x64+8")
    assert len(doc3["rows"]) == len(doc2["rows"])
    new = next(r for r in doc3["rows"] if vs.row_key(r) == keys[0])
    assert new["date"] >= thr["date"] and new["output_tok_s"] != thr["output_tok_s"]
    # --only-missing measures nothing that is on file
    before = a["requests"]
    run(out, {"int2": a}, "3x64+8,1x256+16", "--only-missing")
    assert a["requests"] == before


def test_a_leak_is_caught_per_row_and_overall(stubs, tmp_path):
    a = stubs(leak_per_request=5)
    doc = run(tmp_path / "leak.json", {"int2": a}, "3x64+8,2x64+8")
    thr1, thr2, ab = doc["rows"]
    # pool against its start values (after warm-up): cumulative over the server's loads
    assert thr1["pool_leak_tokens"] == 3 * 5 and thr2["pool_leak_tokens"] == 5 * 5
    assert ab["pool_leak_tokens"] == 5 * 5 + 5 * ab["finished"]
    assert thr1["pool_end"]["oscar_tokens_free"] == thr1["pool_start"]["oscar_tokens_free"] - 15
    assert doc["summary"]["pool_leak_tokens"] == a["leaked"] - 5  # the warm-up's leak is before the start
    assert doc["summary"]["checks"]["no_pool_leak"] is False


def test_a_leak_on_aborted_streams_and_side_buffers_is_caught(stubs, tmp_path):
    a = stubs(leak_on_abort=True, side_leak_on_abort=4096)
    doc = run(tmp_path / "abort.json", {"int2": a}, "2x64+8")
    thr, ab = doc["rows"]
    assert thr["pool_leak_tokens"] == 0
    assert a["aborts_seen"] == 6 and ab["pool_leak_tokens"] == a["leaked"] == 6 * (64 + 400)
    assert ab["side_free_leak"] == {"side_bytes_free": 6 * 4096}
    assert doc["summary"]["checks"]["no_pool_leak"] is False and doc["summary"]["side_free_leak_rows"] == 1


def test_fresh_and_warm_ttft_of_the_32k_row(stubs, tmp_path, seed):
    cold = random.Random(seed).uniform(0.3, 0.5)
    compiled = [{"kernel": "oscar_kernels.triton.store_channel._tokens_kernel", "ms": round(cold * 1e3, 1),
                 "after_start_s": 0.1}]
    a = stubs(cold_s=cold, first_compiles=compiled)
    doc = run(tmp_path / "fresh.json", {"int2": a}, "1x32768+256", "--abort-load", "")
    (row,) = doc["rows"]
    assert row["load"] == report.FRESH_LOAD and row["input_tokens_sent"] == 32768
    assert row["fresh_ttft_s"] >= cold and row["warm_ttft_s"] == row["ttft_p50_s"] < cold
    assert row["fresh_compiles"] == compiled  # what the fresh request waited for, as the server said
    # the fresh request was the server's first, and the warm one the same prompt again
    assert a["prompts"][0] == a["prompts"][-1] and len(a["prompts"]) == 3  # fresh, warm-up, warm
    e = doc["summary"]["per_load"][report.FRESH_LOAD]
    assert e["int2_fresh_over_warm_ttft"] == pytest.approx(row["fresh_ttft_s"] / row["warm_ttft_s"])
    name = "fresh_ttft_1x32768+256_int2_le_1.1x_warm"
    assert doc["summary"]["checks"][name] is False and name not in doc["summary"]["not_measured"]


def test_prompt_clipped_to_the_context(stubs, tmp_path):
    a = stubs()
    doc = run(tmp_path / "ctx.json", {"int2": a}, f"1x{CTX}+16", "--abort-load", "")
    assert doc["rows"][0]["input_tokens_sent"] == CTX - 16 - 8 and doc["rows"][0]["input_len"] == CTX


def test_deadline_skips_and_lists_what_would_not_finish(stubs, tmp_path):
    a = stubs()
    doc = run(tmp_path / "dl.json", {"int2": a}, "3x64+8,512x2048+1024", "--deadline-s", "60")
    assert [r["load"] for r in doc["rows"]] == ["3x64+8", "6x64+400 aborted"]
    assert [s["load"] for s in doc["skipped"]] == ["512x2048+1024"] and "deadline" in doc["skipped"][0]["reason"]


def _random_rows(rng):
    rows = []
    loads = list(report.TOK_S_TARGETS) + list(report.TPOT_TARGETS)
    for load in loads:
        for config, kv, backend in (("int2", "int2", "oscar_triton"), ("int2-mixed-chunk", "int2", "oscar_triton"),
                                    ("fp8-splits64", "fp8_e4m3", "triton"),
                                    ("fp8-flashinfer", "fp8_e4m3", "flashinfer"), ("flashinfer", "bf16", "flashinfer")):
            r = {"load": load, "kv": kv, "backend": backend, "config": config, "ok": True,
                 "kind": "batch1" if load.startswith("1x") else "throughput",
                 "output_tok_s": rng.uniform(100, 9000), "ttft_p50_s": rng.uniform(0.05, 30),
                 "tpot_p50_ms": rng.uniform(5, 80), "pool_leak_tokens": 0, "max_running_requests": 600,
                 "kv_tokens": 10 ** 6}
            if load == report.FRESH_LOAD:
                r.update(fresh_ttft_s=rng.uniform(1, 3), warm_ttft_s=rng.uniform(1, 3))
            rows.append(r)
    for config, kv, backend in (("int2", "int2", "oscar_triton"), ("fp8-splits64", "fp8_e4m3", "triton")):
        rows.append({"load": "64x2048+1024 aborted", "kind": "aborts", "kv": kv, "backend": backend,
                     "config": config, "ok": True, "pool_leak_tokens": 0, "side_free_leak": {}})
    return rows


def test_summary_ratios_and_checks_match_a_recomputation(seed):
    rng = random.Random(seed)
    rows = _random_rows(rng)
    s = report.summary(rows)
    get = {(r["load"], r["config"]): r for r in rows}
    for load, target in report.TOK_S_TARGETS.items():
        i2 = get[(load, "int2")]["output_tok_s"]
        f_t, f_f = get[(load, "fp8-splits64")]["output_tok_s"], get[(load, "fp8-flashinfer")]["output_tok_s"]
        best = max(f_t, f_f)
        e = s["per_load"][load]
        assert e["fp8_best_backend"] == ("triton" if f_t > f_f else "flashinfer")
        assert e["int2_vs_fp8_best"] == pytest.approx(i2 / best)
        assert e["int2_vs_fp8_triton"] == pytest.approx(i2 / f_t)
        assert e["int2_vs_bf16_flashinfer"] == pytest.approx(i2 / get[(load, "flashinfer")]["output_tok_s"])
        assert e["int2_mixed_chunk_vs_fp8_best"] == pytest.approx(get[(load, "int2-mixed-chunk")]["output_tok_s"] / best)
        assert s["checks"][f"output_tok_s_{load}_int2_ge_{target:g}x_fp8"] is (i2 / best >= target)
    for load, target in report.TPOT_TARGETS.items():
        tp = min(get[(load, c)]["tpot_p50_ms"] for c in ("fp8-splits64", "fp8-flashinfer"))
        r = get[(load, "int2")]["tpot_p50_ms"] / tp
        assert s["per_load"][load]["int2_tpot_vs_fp8_best"] == pytest.approx(r)
        assert s["checks"][f"tpot_{load}_int2_le_{target:g}x_fp8"] is (r <= target)
    tt = min(get[(report.FRESH_LOAD, c)]["ttft_p50_s"] for c in ("fp8-splits64", "fp8-flashinfer"))
    r = get[(report.FRESH_LOAD, "int2")]["ttft_p50_s"] / tt
    assert s["checks"]["ttft_1x32768+256_int2_le_1x_fp8"] is (r <= 1.0)
    i2 = get[(report.FRESH_LOAD, "int2")]
    assert s["checks"]["fresh_ttft_1x32768+256_int2_le_1.1x_warm"] is (i2["fresh_ttft_s"] <= 1.1 * i2["warm_ttft_s"])
    assert s["pool_leak_tokens"] == 0 and s["checks"]["no_pool_leak"] is True and s["not_measured"] == []
    assert s["all_checks_pass"] is all(s["checks"].values())
    # a leak anywhere fails the check; a missing number fails its check and is named
    leak = rng.randint(1, 999)
    rows = [r for r in rows if (r["load"], r["config"]) != ("64x8192+512", "int2")]
    rows[rng.randrange(len(rows))]["pool_leak_tokens"] = leak  # on a row that stays (one in ~30 was removed)
    s2 = report.summary(rows)
    assert s2["pool_leak_tokens"] == leak and s2["checks"]["no_pool_leak"] is False
    assert s2["checks"]["output_tok_s_64x8192+512_int2_ge_1.5x_fp8"] is False
    assert s2["not_measured"] == ["output_tok_s_64x8192+512_int2_ge_1.5x_fp8"]


def test_int2_column_is_the_default_configuration(seed):
    """The int2 column takes the "int2" row, else "int2-planes" (the same server with the default
    3-bit decode named explicitly), never another int2 variant, and says which it took."""
    rng = random.Random(seed)
    rows = [r for r in _random_rows(rng) if r["config"] != "int2-mixed-chunk"]
    planes = [dict(r, config="int2-planes", output_tok_s=rng.uniform(100, 9000))
              for r in rows if r["config"] == "int2"]
    both = report.summary(rows + planes)
    for load, e in both["per_load"].items():
        i2 = next(r for r in rows if (r["load"], r["config"]) == (load, "int2"))
        assert e["int2_config"] == "int2" and e["int2_output_tok_s"] == i2["output_tok_s"]
    only = [r for r in rows if r["config"] != "int2"] + planes
    s = report.summary(only)
    for load, e in s["per_load"].items():
        p = next(r for r in planes if r["load"] == load)
        assert e["int2_config"] == "int2-planes" and e["int2_output_tok_s"] == p["output_tok_s"]
    doc = {"date": "d", "device": "H100", "model": "m", "rows": only}
    assert "configuration `int2-planes`" in report.markdown(doc, "x.json", None)
    other = [r for r in rows if r["config"] != "int2"] + [dict(r, config="int2-token") for r in planes]
    assert all(e["int2_output_tok_s"] is None for e in report.summary(other)["per_load"].values())


def test_report_renders_table_plot_and_doc_block(tmp_path, seed):
    rng = random.Random(seed)
    rows = _random_rows(rng)
    doc = {"date": "2026-11-27 10:00 UTC", "device": "NVIDIA H100 80GB HBM3", "model": "llama31-8b",
           "command": "python -m bench.serving_vs_fp8 run", "rows": rows}
    res = tmp_path / "serving_vs_fp8_h100.json"
    res.write_text(json.dumps(doc))
    md = tmp_path / "benchmarks.md"
    md.write_text(f"# B\n\n## vs FP8\n\n{report.BEGIN}\nnot measured yet\n{report.END}\n\n## Next\n")
    assert vs.main(["report", str(res), "--img-dir", str(tmp_path / "img"), "--update-doc", str(md)]) == 0
    png = tmp_path / "img" / "serving_vs_fp8_h100.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    text = md.read_text()
    assert "not measured yet" not in text and text.endswith(f"{report.END}\n\n## Next\n")
    s = report.summary(rows)
    for load in report.TOK_S_TARGETS:
        e = s["per_load"][load]
        i2 = next(r for r in rows if (r["load"], r["config"]) == (load, "int2"))
        met = "yes" if e["int2_vs_fp8_best"] >= report.TOK_S_TARGETS[load] else "no"
        assert (f"| {load} | {i2['output_tok_s']:,.0f} |" in text
                and f"({e['fp8_best_backend']}) | {e['bf16_flashinfer_output_tok_s']:,.0f} | "
                    f"{e['int2_vs_fp8_best']:.2f}x | >= {report.TOK_S_TARGETS[load]:g}x | {met} |" in text)
    for load in report.TPOT_TARGETS:
        assert f"| {load} | " in text and f"{s['per_load'][load]['int2_tpot_vs_fp8_best']:.2f}x" in text
    assert "![output tok/s vs concurrency](img/serving_vs_fp8_h100.png)" in text
    assert "stored as" not in text  # these rows record no format (runs before 2026-11-29)
    # rows that record the stored format name it in the header (the default changes between runs)
    fmt = rng.choice(["k4c64-v2t128-s4-w128", "k3c64-v2t64-s4-w128"])
    named = [{**r, "kv_format": fmt, "body_bits_per_element": 3.375} if r["kv"] == "int2" else r for r in rows]
    head = report.markdown({**doc, "rows": named}, "x.json", None).split("\n")[0]
    assert f"(default format, stored as `{fmt}` (3.375 bits); configuration `int2`)" in head
    # --resummarize stores the summary the current rules give (the run's own may be older)
    res.write_text(json.dumps({**doc, "summary": {"checks": {}}}))
    assert vs.main(["report", str(res), "--img-dir", str(tmp_path / "img"), "--resummarize"]) == 0
    assert json.loads(res.read_text())["summary"] == json.loads(json.dumps(s))


def _decode_line(t, running, tokens, rate, graph=True):
    return (f"[2026-11-27 02:58:{t:02d}] Decode batch, #running-req: {running}, #token: {tokens}, token usage: "
            f"0.31, cuda graph: {graph}, gen throughput (token/s): {rate:.2f}, #queue-req: 0\n")


def test_scheduler_rates_per_load_from_a_server_log(tmp_path, seed):
    """The scheduler's own decode lines, cut at the bench's cache flushes: per load, the median
    rate of the lines at the most running requests (the first of them spans the prefill before
    it), the first and last after it, the last line's time and tokens; `scheduler-rates` writes
    them from a finished run's logs."""
    import statistics

    from bench._serving_server import loads_of_log, parse_decode_log, scheduler_rates

    rng = random.Random(seed)
    text, want = "[2026-11-27 02:57:00] Cache flushed successfully!\n", []
    for running in (rng.randint(2, 64), rng.randint(65, 512)):
        t = 0
        text += _decode_line(t, running // 2, 1000, rng.uniform(10, 100))  # requests still arriving
        rates = [rng.uniform(100, 20_000) for _ in range(rng.randint(2, 9))]
        for r in rates:
            t += 1
            text += _decode_line(t, running, running * 100 + t, r)
        text += "[2026-11-27 02:59:00] INFO: POST /flush_cache\n[2026-11-27 02:59:00] Cache flushed successfully!\n"
        want.append({"scheduler_running": running, "scheduler_decode_tok_s": statistics.median(round(r, 2) for r in rates),
                     "scheduler_decode_tok_s_first": round(rates[1], 2), "scheduler_decode_tok_s_last": round(rates[-1], 2),
                     "scheduler_last_decode_at": f"2026-11-27 02:58:{t:02d}", "scheduler_tokens_at_last": running * 100 + t})
    pieces = loads_of_log(text)
    got = [scheduler_rates(parse_decode_log(p)) for p in pieces]
    assert [g for g in got if g] == want and got[0] == {} and got[-1] == {}
    log = tmp_path / "int2_30200.log"
    log.write_text(text)
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"date": "2026-11-27 03:01 UTC", "device": "H100", "model": "m", "command": "x", "rows": []}))
    out = tmp_path / "rates.json"
    assert vs.main(["scheduler-rates", str(log), "--run", str(run), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert all(k in doc for k in ("date", "device", "model", "command", "rows")) and doc["device"] == "H100"
    assert [{k: v for k, v in r.items() if k.startswith("scheduler_")} for r in doc["rows"]] == want
    assert {r["config"] for r in doc["rows"]} == {"int2"}


def test_side_by_side_servers_get_their_own_rendezvous_ports(seed):
    """Servers started together must not race for SGLang's bind-and-release NCCL port: each
    command names one derived from its HTTP port (distinct for the --side-by-side ports), and a
    port the configuration names itself is kept."""
    from bench._serving_server import NCCL_PORT_OFFSET, server_command

    base = random.Random(seed).randrange(20000, 40000)
    ports = [base + 10 * i for i in range(4)]
    cfg = vs.CONFIGS["int2"]
    nccl = []
    for p in ports:
        cmd = server_command(ROOT, ROOT, cfg, p, 0.85, [])
        assert cmd[cmd.index("--port") + 1] == str(p)
        nccl.append(int(cmd[cmd.index("--nccl-port") + 1]))
    assert nccl == [p + NCCL_PORT_OFFSET for p in ports]
    assert not set(nccl) & set(ports)
    cmd = server_command(ROOT, ROOT, cfg, base, 0.85, ["--nccl-port", "41000"])
    assert cmd.count("--nccl-port") == 1 and cmd[cmd.index("--nccl-port") + 1] == "41000"


def _prefill_line(t, seqs, new, cached, rate):
    return (f"[2026-11-27 07:04:{t:02d}] Prefill batch, #new-seq: {seqs}, #new-token: {new}, #cached-token: "
            f"{cached}, token usage: 0.01, #running-req: 0, #queue-req: 3, #pending-token: 0, "
            f"cuda graph: False, input throughput (token/s): {rate:.2f}\n")


def test_prefill_rates_per_load_from_a_server_log(tmp_path, seed):
    """The scheduler's prefill lines of a load: all their new tokens, and the median input
    throughput of the full chunks only (a load's last, partial chunk and the warm-up's short
    prompt are not its rate; a mixed chunk short of a few folded-in decodes is); recorded next
    to the decode rates by `scheduler-rates`."""
    import statistics

    from bench._serving_server import parse_prefill_log, prefill_rates

    rng = random.Random(seed)
    chunk = rng.choice([4096, 8192, 16384])
    full = [rng.uniform(20_000, 40_000) for _ in range(rng.randint(3, 12))]
    folded = [0] + [rng.randint(1, chunk // 10) for _ in full[1:]]  # decodes in a mixed chunk
    tail = rng.randint(1, int(0.9 * chunk) - 1)
    text = _prefill_line(0, 1, 64, 0, 30.0)  # a short request: not a full chunk
    for t, (r, d) in enumerate(zip(full, folded), 1):
        text += _prefill_line(t, rng.randint(1, 4), chunk - d, rng.choice([0, chunk]), r)
    text += _prefill_line(59, 1, tail, chunk, 1_000.0)
    text += _decode_line(59, 4, 1000, 500.0)
    got = prefill_rates(parse_prefill_log(text))
    assert got == {"scheduler_prefill_tokens": 64 + chunk * len(full) - sum(folded) + tail, "scheduler_prefill_chunk": chunk,
                   "scheduler_prefill_tok_s": statistics.median(round(r, 2) for r in full),
                   "scheduler_prefill_chunks": len(full)}
    assert prefill_rates(parse_prefill_log(_decode_line(1, 4, 10, 5.0))) == {}
    log = tmp_path / "fp8-flashinfer_30210.log"
    log.write_text("[x] Cache flushed successfully!\n" + text)
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"date": "2026-11-27 07:09 UTC", "device": "H100", "model": "m", "command": "x", "rows": []}))
    out = tmp_path / "rates.json"
    assert vs.main(["scheduler-rates", str(log), "--run", str(run), "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["config"] == "fp8-flashinfer" and {k: row[k] for k in got} == got


def test_fresh_table_names_the_kernels_the_first_request_compiled(seed):
    rng = random.Random(seed)
    ms = rng.uniform(200, 1500)
    base = {"load": report.FRESH_LOAD, "kind": "batch1", "ok": True, "n": 1, "output_tok_s": 90.0,
            "ttft_p50_s": 1.2, "tpot_p50_ms": 7.0, "warm_ttft_s": 1.2}
    rows = [dict(base, config="int2", kv="int2", backend="oscar_triton", fresh_ttft_s=2.3,
                 fresh_compiles=[{"kernel": "oscar_kernels.triton.store_channel._tokens_kernel", "ms": ms,
                                  "after_start_s": 0.2}]),
            dict(base, config="int2-mixed-chunk", kv="int2", backend="oscar_triton", fresh_ttft_s=1.2,
                 fresh_compiles=[]),
            dict(base, config="fp8-flashinfer", kv="fp8_e4m3", backend="flashinfer", fresh_ttft_s=11.0)]
    text = report.markdown({"date": "d", "device": "H100", "model": "m", "rows": rows}, "x.json", None)
    assert f"| int2 | 2.30 s | 1.20 s | `_tokens_kernel` ({ms:.0f} ms) |" in text
    assert "| int2-mixed-chunk | 1.20 s | 1.20 s | none |" in text
    assert "| fp8-flashinfer | 11.00 s | 1.20 s | – |" in text  # not reported by that server


def test_server_start_budget_counts_flashinfer_jit_once_per_run():
    """--deadline-s budgets FlashInfer's JIT compile for the first server of a run that uses it,
    not again once a server of the run has compiled it (the cache is per machine): a second
    server with 250 s left used to be skipped although a warm start takes ~70 s."""
    clock = vs.Clock(deadline_s=600)
    int2, fp8_triton = vs.CONFIGS["int2"], vs.CONFIGS["fp8-splits64"]
    assert vs.uses_flashinfer(int2) and not vs.uses_flashinfer(fp8_triton)
    assert clock.startup_s(int2) == vs.STARTUP_S + vs.FLASHINFER_JIT_S
    assert clock.startup_s(fp8_triton) == vs.STARTUP_S
    clock.flashinfer_compiled = True
    assert clock.startup_s(int2) == vs.STARTUP_S == clock.startup_s(fp8_triton)


def test_second_server_of_a_run_is_not_skipped_for_flashinfer_jit(stubs, tmp_path, monkeypatch):
    """Two int2 servers the bench starts itself (a stand-in process class pointing at the stub),
    with a deadline that fits the first start's full budget plus the load: the second start is
    budgeted without the JIT and runs (with it again it would not fit once the first is done)."""
    from bench import _launcher

    a = stubs()

    class Started:
        def __init__(self, cmd, env, log_path, port, **how):
            self.url, self.log = a["url"], log_path

        def __enter__(self):
            self.log.write_text("")
            return self

        def __exit__(self, *exc):
            return False

        def wait_ready(self, timeout_s=420.0):
            time.sleep(3.0)  # a start takes time: the second check comes >= 3 s after the first
            self.startup_s = 3.0

    monkeypatch.setattr(_launcher, "Server", Started)
    load = "3x64+8"
    # the first check (before any start) has 1.5 s of slack, the second would need 3 s more
    deadline = vs.STARTUP_S + vs.FLASHINFER_JIT_S + vs.estimate_s(load) + vs.STOP_S + 1.5
    doc = run(tmp_path / "two.json", {}, load, "--abort-load", "", "--deadline-s", f"{deadline:.3f}",
              "--logs", str(tmp_path), configs="int2,int2-token-splits64")
    assert [(r["config"], r["load"]) for r in doc["rows"]] == [("int2", load), ("int2-token-splits64", load)]
    assert not doc.get("skipped") and all(r["server_started_by_bench"] for r in doc["rows"])
