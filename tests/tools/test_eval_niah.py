"""Needle-in-a-haystack harness against a stub OpenAI-compatible server on 127.0.0.1.

The stub finds the magic number in the prompt and answers by where the needle sits in the
haystack: in the first 30 % with the number in a sentence (exact match), in the middle with a
wrong number, in the last 15 % with "0 or <number>" (contains the number, but the first integer is
wrong, so exact match must reject it). Its first chat request gets HTTP 503 (the client must
retry). It reports a context length and SGLang-like /server_info, so the defaults can be checked.
No traffic leaves 127.0.0.1.
"""
import importlib.util
import json
import logging
import re
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from oscar_sglang.tools import cli
from oscar_sglang.tools.evaluation import niah
from tests import ROOT, free_ports
from tests.http_stub import STUB_POLL, JSONHandler

pytestmark = pytest.mark.usefixtures("fast_polls")  # stand-in servers: see tests/conftest.py


def make_handler(state: dict):
    class Stub(JSONHandler):

        def do_GET(self):
            if self.path == "/v1/models":
                card = {"id": "fake-model"}
                if state["context"]:
                    card["max_model_len"] = state["context"]
                return self._json(200, {"object": "list", "data": [card]})
            if self.path == "/server_info" and state["server_info"]:
                return self._json(200, {
                    "context_length": state["context"], "max_total_num_tokens": 123456,
                    "kv_cache_dtype": "int2", "attention_backend": "oscar_triton",
                    "tokenizer_path": state.get("tokenizer_path"),
                    "internal_states": [{"oscar_int2": {"group_size": 64,
                                                        "max_total_num_tokens": 123456}}]})
            self._json(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/chat/completions" or body.get("model") != "fake-model":
                return self._json(400, {"error": "bad request"})
            with state["lock"]:
                state["chat"] += 1
                fail = state["fail_first"] or state["always_fail"]
                state["fail_first"] = False
                state["prompts"].append(body["messages"][0]["content"])
            if fail:
                return self._json(503, {"error": "warming up"})
            assert body["temperature"] == 0.0 and body["max_tokens"] <= 32
            prompt = body["messages"][0]["content"]
            number = re.search(r"magic number is (\d+)\.", prompt).group(1)
            text = prompt.split(niah.QUESTION)[0].split("\n\n", 1)[1]  # the haystack only
            pos = text.index("magic number is") / len(text)
            if pos < 0.3:
                answer = f"The number is {number}."
            elif pos < 0.85:
                answer = "1234567"
            else:
                answer = f"0 or {number}"
            self._json(200, {"choices": [{"message": {"role": "assistant", "content": answer}}]})

    return Stub


@pytest.fixture
def stub():
    state = {"chat": 0, "fail_first": True, "always_fail": False, "context": 2048,
             "server_info": True, "prompts": [], "lock": threading.Lock()}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    th = threading.Thread(target=srv.serve_forever, kwargs=STUB_POLL, daemon=True)
    th.start()
    state["url"] = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    yield state
    srv.shutdown()
    srv.server_close()
    th.join(timeout=5)


def args_for(url, tmp_path, **kw):
    a = SimpleNamespace(base_url=[url], url=None, local=None, label="fake", model_name=None,
                        tokenizer="chars", context_length=None, lengths=[400, 800],
                        depths=[0.0, 0.5, 1.0], trials=2, min_trials=100, max_requests=500,
                        concurrency=3, timeout=10.0, retries=2, max_errors=20, max_tokens=16,
                        seed=1, kv_tokens_from_server=False, rotation=None, group_size=64,
                        sink=64, recent=256, out=str(tmp_path), name="niah")
    a.__dict__.update(kw)
    return a


# ----------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("answer, exact, contains", [
    ("1234567", True, True),
    (" 1234567.", True, True),
    ("The number is 1234567", True, True),
    ("**1234567**", True, True),
    ("1,234,567.", True, True),            # thousands separators are one integer
    ("1234567 and 7654321", True, True),   # the first integer counts
    ("12345678", False, True),             # one digit too many: not the needle
    ("123456", False, False),
    ("123.", False, False),
    ("7654321 and 1234567", False, True),  # the needle is not the first integer
    ("0 or 1234567", False, True),
    ("", False, False),
    (None, False, False),
    ("no number at all", False, False),
])
def test_exact_match_scoring(answer, exact, contains):
    assert niah.exact_match(answer, "1234567") is exact
    assert niah.is_correct(answer, "1234567") is contains


def test_first_integer():
    assert niah.first_integer("It is 7,463,343, I think") == "7463343"
    assert niah.first_integer("746, 12") == "746"  # ', 12' is not a thousands group
    assert niah.first_integer("1,2345") == "1"
    assert niah.first_integer("none") is None


def test_needle_placement(seed):
    hay = "One. Two two. Three three three. Four."
    assert niah.insert_needle(hay, "N.", 0.0).startswith("N. One.")
    assert niah.insert_needle(hay, "N.", 1.0).endswith("Four. N. ")
    mid = niah.insert_needle(hay, "N.", 0.3)
    assert "Two two. N. Three" in mid
    with pytest.raises(ValueError):
        niah.insert_needle(hay, "N.", 1.5)


# ----------------------------------------------------------------------------- grid and seeds


def test_default_grid_meets_the_issue():
    depths = niah.DEFAULT_DEPTHS
    assert len(depths) == 10 and depths[0] == 0.05 and depths[-1] == 0.95
    assert all(b - a == pytest.approx(0.1) for a, b in zip(depths, depths[1:]))
    assert niah.default_depths(10) == depths
    assert niah.default_lengths(8192, 16) == [1024, 2048, 4096, 7936]
    assert niah.default_lengths(2048, 16) == [1024, 1792]
    assert niah.default_lengths(32768, 16) == [1024, 2048, 4096, 32512]
    assert niah.default_lengths(None, 16) == [1024, 2048, 4096]
    for ctx in (2048, 8192, 32768):
        lengths = niah.default_lengths(ctx, 16)
        assert max(lengths) + 16 <= ctx and max(lengths) > ctx - 16 - niah.LENGTH_STEP
        trials = niah.trials_for(len(lengths) * 10)
        assert len(lengths) * 10 * trials >= 100
        assert len(lengths) * 10 * (trials - 1) < 100  # not more than needed
    args = cli.build_parser().parse_args(["eval", "niah", "--url", "http://127.0.0.1:1"])
    assert (args.lengths, args.depths, args.trials, args.min_trials) == (None, None, None, 100)
    assert args.concurrency == 16 and args.max_tokens <= 32 and args.tokenizer == "auto"
    lengths, depths, trials = niah._grid_params(args, 8192, local=False)
    assert lengths == [1024, 2048, 4096, 7936] and depths == niah.DEFAULT_DEPTHS
    assert trials == 3 and len(lengths) * len(depths) * trials == 120
    assert niah._grid_params(args, 8192, local=True) == (niah.LOCAL_LENGTHS, niah.LOCAL_DEPTHS, 1)


def test_cases_are_reproducible_and_paired(seed):
    texts = ["".join(f"Essay {i} sentence {j}. " for j in range(200)) for i in range(40)]
    counter = niah.TokenCounter(None)
    a = niah.build_cases(texts, counter, [400, 800], [0.05, 0.5, 0.95], 4, seed)
    b = niah.build_cases(texts, counter, [400, 800], [0.05, 0.5, 0.95], 4, seed)
    c = niah.build_cases(texts, counter, [400, 800], [0.05, 0.5, 0.95], 4, seed + 1)
    assert [x.prompt for x in a] == [x.prompt for x in b]
    assert niah.prompts_sha256(a) == niah.prompts_sha256(b) != niah.prompts_sha256(c)
    assert len(a) == 2 * 3 * 4 and len({x.number for x in a}) == len(a)  # distinct needles
    for x in a:
        assert x.prompt.count(x.number) == 1 and abs(len(x.prompt) / 4 - x.length) < 80

    def hay(x):
        return x.prompt.replace(niah.NEEDLE.format(number=x.number) + " ", "")

    by_trial = {}
    for x in a:
        by_trial.setdefault((x.length, x.trial), set()).add(hay(x))
    assert all(len(v) == 1 for v in by_trial.values())  # depths of a trial share the haystack
    starts = {next(iter(v))[60:90] for (L, _), v in by_trial.items() if L == 800}
    assert len(starts) > 1  # trials read different haystacks (40 start essays, 4 trials)


def test_urls_and_labels():
    assert niah.normalise_url("http://127.0.0.1:30000") == "http://127.0.0.1:30000/v1"
    assert niah.normalise_url("http://127.0.0.1:30000/v1/") == "http://127.0.0.1:30000/v1"
    assert niah.normalise_url("https://h/openai/v1") == "https://h/openai/v1"
    for bad in ("127.0.0.1:30000", "localhost", "ftp://h/v1", "http://h:port/v1", "http:///v1"):
        with pytest.raises(ValueError, match="bad server URL"):
            niah.normalise_url(bad)
    assert niah.parse_server_specs(["int2=http://a:1", "bf16=http://b:2/v1"]) == [
        ("int2", "http://a:1/v1"), ("bf16", "http://b:2/v1")]
    assert niah.parse_server_specs(["http://a:1/v1?x=y"], label="one") == [
        ("one", "http://a:1/v1")]
    with pytest.raises(ValueError, match="must differ"):
        niah.parse_server_specs(["x=http://a:1", "x=http://b:1"])


# ----------------------------------------------------------------------------- against the stub


def test_niah_against_stub_server(stub, tmp_path, seed):
    assert niah.main_niah(args_for(stub["url"], tmp_path, seed=seed,
                                   kv_tokens_from_server=True)) == 0
    run = json.loads((tmp_path / "niah.json").read_text())
    grid = run["grids"]["fake"]
    assert grid["n"] == 12 and grid["errors"] == 0 and not grid["aborted"]  # the 503 was retried
    assert stub["chat"] == 13
    assert grid["cells"] == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]           # exact match
    assert grid["cells_contains"] == [[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]  # the old score
    assert grid["accuracy"] == pytest.approx(4 / 12) and grid["n_correct"] == 4
    assert grid["accuracy_contains"] == pytest.approx(8 / 12)
    assert grid["url"] == stub["url"] and grid["model"] == "fake-model"
    assert grid["kv_tokens"] == 123456 and grid["oscar_int2"]["group_size"] == 64
    assert {a["extracted"] for a in grid["answers"] if a["depth"] == 1.0} == {"0"}
    assert run["lengths"] == [400, 800] and run["depths"] == [0.0, 0.5, 1.0]
    assert run["trials"] == 2 and run["trials_per_grid"] == 12
    meta = run["meta"]
    assert meta["servers"]["fake"] == {"url": stub["url"], "model": "fake-model"}
    assert meta["temperature"] == 0.0 and meta["seed"] == seed and meta["context_length"] == 2048
    assert re.match(r"\d{4}-\d\d-\d\dT", meta["date"]) and meta["command"].startswith("oscar-sglang")
    assert len(meta["prompts_sha256"]) == 64
    assert (tmp_path / "niah.png").stat().st_size > 1000
    md = (tmp_path / "niah.md").read_text()
    assert "| 400 | 1.00 | 0.00 | 0.00 |" in md and "contains 0.67" in md


def test_defaults_through_the_cli(stub, tmp_path):
    """`eval niah --url URL` alone: 10 depths, lengths up to the reported context, >= 100
    prompts, greedy; same seed -> the same prompts; the command is recorded."""
    url = stub["url"].removesuffix("/v1")  # a bare host:port works
    argv = ["eval", "niah", "--url", f"int2={url}", "--tokenizer", "chars", "--out",
            str(tmp_path), "--quiet", "--retries", "1"]
    assert cli.main(argv) == 0
    run = json.loads((tmp_path / "niah.json").read_text())
    assert run["lengths"] == [1024, 1792] and run["depths"] == niah.DEFAULT_DEPTHS
    assert run["trials"] == 5 and run["grids"]["int2"]["n"] == 100 == run["trials_per_grid"]
    assert run["meta"]["command"] == "oscar-sglang " + " ".join(argv)
    first = list(stub["prompts"][1:])  # [0] was the 503
    assert len(first) == 100 and len(set(first)) == 100
    stub["prompts"].clear()
    assert cli.main(argv + ["--name", "again"]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert sorted(stub["prompts"]) == sorted(first)  # same seed, same prompts: paired runs
    assert again["meta"]["prompts_sha256"] == run["meta"]["prompts_sha256"]
    assert [a["number"] for a in again["grids"]["int2"]["answers"]] == \
        [a["number"] for a in run["grids"]["int2"]["answers"]]


def test_clear_errors(stub, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="oscar_sglang.eval")
    t0 = time.monotonic()
    assert niah.main_niah(args_for("localhost:30000", tmp_path)) == 2
    assert "bad server URL" in caplog.text and "http://127.0.0.1:30000/v1" in caplog.text
    caplog.clear()
    dead = args_for("http://127.0.0.1:9/v1", tmp_path, retries=1, timeout=2.0)
    assert niah.main_niah(dead) == 2  # connection refused: a message, no traceback
    assert "cannot reach the server at http://127.0.0.1:9/v1" in caplog.text
    assert "failed after 2 tries" in caplog.text
    caplog.clear()
    assert niah.main_niah(args_for(stub["url"], tmp_path, lengths=[1024, 4096])) == 2
    assert "above the context of 2048" in caplog.text
    caplog.clear()
    assert niah.main_niah(args_for(stub["url"], tmp_path, max_requests=5)) == 2
    assert "exceed --max-requests 5" in caplog.text
    assert stub["chat"] == 0  # nothing was sent for refused grids
    assert not (tmp_path / "niah.json").exists()
    assert time.monotonic() - t0 < 30


@pytest.mark.slow  # smollm2_tokenizer: converting the GGUF tokenizer costs ~10 s per session
def test_chat_formatted_prompt_must_fit_the_context(stub, tmp_path, caplog, smollm2_tokenizer):
    """With a real tokenizer and chat template the prompt is measured as the server sees it:
    1024 + 16 fits a 1045-token context on paper, the templated prompt does not."""
    caplog.set_level(logging.INFO, logger="oscar_sglang.eval")
    stub["context"] = 1045
    a = args_for(stub["url"], tmp_path, tokenizer=str(smollm2_tokenizer), lengths=[512, 1024],
                 depths=[0.5], trials=1)
    assert niah.main_niah(a) == 2
    assert re.search(r"the 10\d\d-token prompt \(length 1024\) \+ 16 answer tokens exceeds "
                     r"the context of 1045", caplog.text)
    stub["context"] = 1100
    assert niah.main_niah(a) == 0
    meta = json.loads((tmp_path / "niah.json").read_text())["meta"]
    n512, n1024 = meta["prompt_tokens"]["512"], meta["prompt_tokens"]["1024"]
    assert 1024 - 64 < n1024 <= 1100 - 16 and n1024 - n512 == pytest.approx(512, abs=8)


@pytest.mark.slow  # smollm2_tokenizer (see above)
def test_auto_tokenizer_comes_from_the_server(stub, tmp_path, caplog, smollm2_tokenizer):
    caplog.set_level(logging.WARNING, logger="oscar_sglang.eval")
    a = args_for(stub["url"], tmp_path, tokenizer="auto", lengths=[512], depths=[0.5], trials=1)
    assert niah.main_niah(a) == 0  # 'fake-model' is no tokenizer here: 4 characters per token
    assert json.loads((tmp_path / "niah.json").read_text())["meta"]["tokenizer"] == "chars"
    assert "lengths are approximate" in caplog.text
    stub["tokenizer_path"] = str(smollm2_tokenizer)  # the server's own tokenizer, on this machine
    assert niah.main_niah(a) == 0
    meta = json.loads((tmp_path / "niah.json").read_text())["meta"]
    assert meta["tokenizer"] == str(smollm2_tokenizer) and meta["prompt_tokens"]["512"] > 480


def test_dead_server_mid_run_stops_early(stub, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="oscar_sglang.eval")
    stub["always_fail"] = True
    a = args_for(stub["url"], tmp_path, trials=20, retries=0, max_errors=5, concurrency=2)
    assert niah.main_niah(a) == 1
    grid = json.loads((tmp_path / "niah.json").read_text())["grids"]["fake"]
    assert grid["aborted"] and grid["errors"] == grid["n"] == 120
    assert stub["chat"] <= 5 + 2  # stopped after 5 failures (plus requests already in flight)
    assert "stopped after 5 failed requests" in caplog.text


def test_context_unknown_and_no_server_info(stub, tmp_path):
    stub.update(context=None, server_info=False)
    a = args_for(stub["url"], tmp_path, lengths=None, depths=[0.5], trials=1,
                 kv_tokens_from_server=True)
    assert niah.main_niah(a) == 0
    run = json.loads((tmp_path / "niah.json").read_text())
    assert run["lengths"] == [1024, 2048, 4096] and run["meta"]["context_length"] is None
    grid = run["grids"]["fake"]
    assert grid["kv_tokens"] is None and "no /server_info" in grid["kv_tokens_note"]


# ----------------------------------------------------------------------------- bench/niah_server.py


def load_bench():
    spec = importlib.util.spec_from_file_location("niah_server", ROOT / "bench" / "niah_server.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["niah_server"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_bench_configs_and_server_commands():
    b = load_bench()
    cfgs = b.parse_configs("bf16,fp8_e4m3,int2,kvh:OSCAR_ROTATION=hadamard,OSCAR_GROUP_SIZE=64,"
                           "g32:OSCAR_GROUP_SIZE=32")
    assert [(c.name, c.kv, c.format, c.default) for c in cfgs] == [
        ("bf16", "bf16", None, False), ("fp8_e4m3", "fp8_e4m3", None, False),
        ("int2", "int2", "default", True), ("kvh", "int2", "kvh", False),
        ("g32", "int2", "g32", False)]
    assert cfgs[3].env == {"OSCAR_ROTATION": "hadamard", "OSCAR_GROUP_SIZE": "64"}
    assert cfgs[4].env == {"OSCAR_GROUP_SIZE": "32"} and cfgs[2].env == {}
    for bad in ("bf16,OSCAR_X=1", "fp16", "int2:OSCAR_X=1", "v:1X=2", "bf16,bf16", "",
                "v:A=1,int2,B=2"):
        with pytest.raises(ValueError):
            b.parse_configs(bad)
    args = ["--mem-fraction-static", "0.3"]
    bf16 = b.server_command(cfgs[0], "/m", "Smol", 31000, args)
    fp8 = b.server_command(cfgs[1], "/m", "Smol", 31001, args)
    int2 = b.server_command(cfgs[3], "/m", "Smol", 31003, args)
    assert bf16[1:3] == ["-m", "sglang.launch_server"] and "--kv-cache-dtype" not in bf16
    assert " ".join(bf16).count("--attention-backend triton") == 1 and "/m" in bf16
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert int2[1:4] == ["-m", "oscar_sglang.tools.cli", "serve"] and "--model-path" not in int2
    for cmd, port in ((bf16, "31000"), (fp8, "31001"), (int2, "31003")):
        assert cmd[cmd.index("--port") + 1] == port and cmd[cmd.index("--host") + 1] == "127.0.0.1"
        assert cmd[-2:] == args
        assert int(cmd[cmd.index("--nccl-port") + 1]) == int(port) + b.PORT_STRIDE // 2
    assert b.body_bits("bf16", None) == (16.0, None) and b.body_bits("fp8_e4m3", None)[0] == 8.0
    assert b.body_bits("int2", {"bytes_per_token": 3604, "bf16_bytes_per_token": 23040})[0] == \
        pytest.approx(2.5028, abs=1e-4)
    assert b.body_bits("int2", {})[0] is None


def test_bench_writes_the_acceptance_json(stub, tmp_path):
    """run_all with a runner that starts no server: each configuration runs the real harness
    (niah_argv + the CLI) against the stub; the JSON has the issue's keys for every row."""
    b = load_bench()
    cfgs = b.parse_configs("bf16,fp8_e4m3,int2,hd:OSCAR_ROTATION=hadamard")
    ns = SimpleNamespace(seed=3, concurrency=4, min_trials=100, max_tokens=16, lengths="400,800",
                         depths=None, trials=None, progress=False)
    # the default (k4c64-v2h-s4-w128) as a server of 64-dim heads reports it
    oscar = {"bytes_per_token": 3604, "bf16_bytes_per_token": 23040, "group_size": 64,
             "kv_format": "k4c64-v2t64-s4-w128", "body_bits_per_element": 3.5}

    def runner(cfg, i):
        if cfg.name == "hd":
            raise RuntimeError("server exited with 1")  # a broken server costs only its row
        argv = b.niah_argv(cfg, stub["url"], ns, "chars", tmp_path / "niah")
        assert cli.main(argv) == 0
        run = json.loads((tmp_path / "niah" / f"niah_{cfg.name}.json").read_text())
        if cfg.kv == "int2":
            run["grids"][cfg.name]["oscar_int2"] = oscar
        return {"niah": run, "server_cmd": ["python", "-m", "x", "--port", str(31000 + i)],
                "startup_s": 1.0, "niah_s": 2.0, "log": f"logs/server_{cfg.name}.log"}

    extra = tmp_path / "extra.json"
    extra.write_text(json.dumps({"k4c64-v2t64-s4-w128": {"kld": 0.05}, "bf16": {"kld": 0.0},
                                 "nonesuch": {"kld": 9}}))
    out = tmp_path / "niah_server_h100.json"
    meta = {"date": "2026-11-25T06:00:00+00:00", "device": "stub", "model": "fake-model",
            "command": "python bench/niah_server.py"}
    rows = b.run_all(cfgs, runner, out, meta, [json.loads(extra.read_text())])
    data = json.loads(out.read_text())
    assert {"date", "device", "model", "command", "rows"} <= set(data)
    assert data["extra_unmatched"] == ["nonesuch"] and data["rows"] == rows
    keys = {"kv", "format", "default", "body_bits_per_element", "kv_tokens", "niah", "trials",
            "kld", "backend", "niah_contains", "server_args"}
    for r in data["rows"]:
        assert keys <= set(r), keys - set(r)
    by = {r["name"]: r for r in data["rows"]}
    assert [r["kv"] for r in data["rows"]] == ["bf16", "fp8_e4m3", "int2", "int2"]
    # the format is the one the server reported storing
    assert by["int2"]["default"] and by["int2"]["format"] == "k4c64-v2t64-s4-w128"
    assert by["int2"]["format_requested"] == "k4c64-v2h-s4-w128" and by["bf16"]["format_requested"] is None
    assert by["bf16"]["format"] is None and not by["bf16"]["default"]
    for name in ("bf16", "fp8_e4m3", "int2"):
        r = by[name]
        assert r["trials"] == 100 and r["errors"] == 0  # 2 lengths x 10 depths x 5 trials
        assert 0.0 <= r["niah"] <= r["niah_contains"] <= 1.0
        # kv_tokens: the format on the dummy Llama-3.1-8B at mem 0.85 (the served model's own count
        # stays as kv_tokens_server)
        assert r["kv_tokens_server"] == 123456 and r["backend"] == "oscar_triton"
        # (the default's one value group per head is v2t128 on the 8B's 128-dim heads)
        fmt_8b = "k4c64-v2t128-s4-w128" if r["kv"] == "int2" else None
        assert r["kv_tokens"] == b.llama8b_kv_tokens(r["kv"], fmt_8b) and "Llama-3.1-8B" in r["kv_tokens_note"]
        assert r["server_args"].startswith("python -m x --port 3100")
        assert r["niah_command"].startswith("oscar-sglang eval niah --url")
    assert len({by[n]["prompts_sha256"] for n in ("bf16", "fp8_e4m3", "int2")}) == 1  # paired
    assert by["bf16"]["body_bits_per_element"] == 16.0
    assert by["int2"]["body_bits_per_element"] == 3.5
    assert "sized as k4c64-v2t128-s4-w128" in by["int2"]["kv_tokens_note"]
    assert b.llama8b_kv_tokens("int2", "k4c64-v2t128-s4-w128") > b.llama8b_kv_tokens("int2", "k4c64-v2t64-s4-w128")
    # FP8 holds 2x BF16's tokens; the 3.375-bit default over 1.8x FP8's after up to 20% of the
    # same budget went to the default side buffers (hundreds of running requests)
    kv = {n: by[n]["kv_tokens"] for n in ("bf16", "fp8_e4m3", "int2")}
    assert kv["fp8_e4m3"] == 2 * kv["bf16"] and kv["int2"] > 1.8 * kv["fp8_e4m3"]
    assert by["int2"]["kv_tokens_max_running_requests"] >= 256
    assert by["int2"]["kld"] == 0.05 and "kld_note" not in by["int2"]
    assert by["bf16"]["kld"] == 0.0 and by["fp8_e4m3"]["kld"] is None and by["fp8_e4m3"]["kld_note"]
    assert by["hd"]["niah"] is None and "server exited" in by["hd"]["error"]
    assert by["hd"]["server_env"] == {"OSCAR_ROTATION": "hadamard"}
    # assembling the final table later, without servers
    extra2 = tmp_path / "extra2.json"
    extra2.write_text(json.dumps({"fp8_e4m3": {"kld": 0.001}}))
    final = tmp_path / "final.json"
    assert b.main(["--from-json", str(out), "--extra-json", str(extra2), "--json", str(final)]) == 0
    f = json.loads(final.read_text())
    fb = {r["name"]: r for r in f["rows"]}
    assert fb["fp8_e4m3"]["kld"] == 0.001 and fb["int2"]["kld"] == 0.05
    assert f["date"] == meta["date"] and "--from-json" in f["merged_with"][0]
    # the capacity columns are derived from the sizing code: recomputed on request, measured
    # columns untouched, rows without a result left alone
    rows = json.loads(out.read_text())["rows"]
    for r in rows:
        r["kv_tokens"] = 1
    out.write_text(json.dumps({**meta, "rows": rows}))
    assert b.main(["--from-json", str(out), "--recompute-kv-tokens", "--json", str(final)]) == 0
    fb = {r["name"]: r for r in json.loads(final.read_text())["rows"]}
    for name in ("bf16", "fp8_e4m3", "int2"):
        assert (fb[name]["kv_tokens"], fb[name]["kv_tokens_max_running_requests"]) == \
            b.llama8b_plan(fb[name]["kv"], b.llama8b_format(fb[name])) and fb[name]["niah"] == by[name]["niah"]
        assert fb[name]["kv_tokens"] == by[name]["kv_tokens"]
    assert fb["bf16"]["kv_tokens_max_running_requests"] is None
    assert fb["int2"]["kv_tokens_max_running_requests"] > 256 and fb["hd"]["kv_tokens"] == 1


def test_bench_deadline_skips_what_would_not_finish(tmp_path):
    b = load_bench()
    now = [0.0]

    def runner(cfg, i):
        now[0] += 100.0  # every configuration takes 100 s
        return {"error": "no harness in this test"}

    rows = b.run_all(b.parse_configs("bf16,fp8_e4m3,int2"), runner, tmp_path / "r.json", {},
                     deadline_s=250, clock=lambda: now[0])
    assert [r.get("error", "").startswith("skipped") for r in rows] == [False, False, True]
    assert json.loads((tmp_path / "r.json").read_text())["rows"][2]["kv"] == "int2"


def test_bench_parallel_runs_side_by_side_and_keeps_the_order(tmp_path):
    """--parallel: configurations overlap (a barrier only opens when 3 runners are inside at
    once), rows keep the --configs order, a failing runner still gives its row."""
    import threading

    b = load_bench()
    barrier = threading.Barrier(3, timeout=30)

    def runner(cfg, i):
        barrier.wait()  # raises BrokenBarrierError if the three never overlap
        if cfg.name == "fp8_e4m3":
            raise RuntimeError("server exited with 1")
        return {"error": f"no harness in this test ({i})"}

    rows = b.run_all(b.parse_configs("bf16,fp8_e4m3,int2"), runner, tmp_path / "r.json", {},
                     deadline_s=1, parallel=3)
    assert [r["name"] for r in rows] == ["bf16", "fp8_e4m3", "int2"]
    assert rows[0]["error"].endswith("(0)") and rows[2]["error"].endswith("(2)")
    assert rows[1]["error"] == "RuntimeError: server exited with 1"
    saved = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["name"] for r in saved] == ["bf16", "fp8_e4m3", "int2"]


def test_bench_report_table_and_plot(tmp_path):
    """--report: the Pareto table (NIAH / BF16 from the bf16 row, the default marked) and a plot."""
    b = load_bench()
    rows = [dict(name="bf16", kv="bf16", format=None, default=False, body_bits_per_element=16.0,
                 kv_tokens=400, niah=0.8, trials=200, kld=0.0),
            dict(name="int2", kv="int2", format="k3c64-v2t64", default=True, body_bits_per_element=3.0,
                 kv_tokens=2000, kv_tokens_max_running_requests=639, niah=0.72, trials=200, kld=0.0046),
            dict(name="bad", kv="int2", format=None, default=False, body_bits_per_element=None,
                 kv_tokens=None, niah=None, trials=None, kld=None, error="BadStatusLine: GET /health\r\n|x")]
    data = {"date": "2026-11-25T10:00:00", "device": "cpu", "model": "m", "rows": rows}
    (tmp_path / "r.json").write_text(json.dumps(data))
    table = b.report_table(data)
    line = next(x for x in table.splitlines() if "(default)" in x)
    assert "| 639 | 0.72 | 0.90 | 0.0046 | 200 |" in line and "2,000" in line
    # an error stays on its row's line, in one cell
    bad = next(x for x in table.splitlines() if x.startswith("| bad |"))
    assert "error: BadStatusLine: GET /health /x |" in bad and len(table.splitlines()) == 5
    png = tmp_path / "p.png"
    assert b.main(["--report", str(tmp_path / "r.json"), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000


HEALTH_SERVER = """
import subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a 'scheduler' child
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
print("up", flush=True)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_bench_server_process_starts_waits_and_stops_its_group(tmp_path):
    import os
    b = load_bench()
    port = free_ports(1)
    log = tmp_path / "logs" / "server.log"
    with b.Server([sys.executable, "-c", HEALTH_SERVER, str(port)], {"OSCAR_X": "1"}, log,
                  port) as srv:
        assert srv.wait_ready(60) < 60
        pgid = srv.proc.pid
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # the server and its child are gone
    text = log.read_text()
    assert text.startswith("$ OSCAR_X=1 ") and "up" in text
    with pytest.raises(RuntimeError, match="server exited with 3"):
        with b.Server([sys.executable, "-c", "import sys; sys.exit(3)"], {}, log, port) as srv:
            srv.wait_ready(60)


OPENAI_SERVER = """
import json, re, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health": return self.send(200, {})
        if self.path == "/v1/models":
            return self.send(200, {"data": [{"id": "fake-model", "max_model_len": 1100}]})
        if self.path == "/server_info":
            return self.send(200, {"max_total_num_tokens": 4242, "attention_backend": "triton"})
        self.send(404, {})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = re.search(r"magic number is (\\d+)", body["messages"][0]["content"]).group(1)
        self.send(200, {"choices": [{"message": {"content": n + "."}}]})
print("serving", sys.argv[1], flush=True)
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


# the fast lane keeps the side-by-side run (2), which also covers starting and stopping servers
@pytest.mark.parametrize("parallel", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_bench_main_end_to_end_with_stand_in_servers(tmp_path, monkeypatch, parallel):
    """main() with the server command swapped for a stdlib stand-in (no GPU here): servers are
    started, waited for, asked, stopped; the JSON and logs land where the device run puts them
    (one after another, or side by side with --parallel)."""
    b = load_bench()
    port = free_ports(b.PORT_STRIDE + 1)  # two servers, a stride apart
    started = []

    def fake_command(cfg, model_path, served, p, server_args):
        started.append((cfg.name, p, server_args))
        return [sys.executable, "-c", OPENAI_SERVER, str(p)]

    monkeypatch.setattr(b, "server_command", fake_command)
    monkeypatch.setattr(b, "embedded_model", lambda: ("chars", "fake-model"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    rc = b.main(["--configs", "bf16,int2", "--port", str(port), "--min-trials", "100",
                 "--concurrency", "8", "--startup-timeout", "60", "--parallel", str(parallel)])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "niah_server_h100.json").read_text())
    assert sorted(s[:2] for s in started) == [("bf16", port), ("int2", port + b.PORT_STRIDE)]
    assert "--disable-radix-cache" in started[0][2]
    assert data["model"] == "fake-model" and data["command"].startswith("python -m bench.niah_server ")
    for r in data["rows"]:
        assert r["niah"] == 1.0 and r["niah_contains"] == 1.0 and r["trials"] == 100
        # bf16: the 8B capacity, the server's own count kept; int2 without a plugin report: the
        # server's count only
        server_tokens = r["kv_tokens_server"] if r["kv"] == "bf16" else r["kv_tokens"]
        assert server_tokens == 4242 and r["backend"] == "triton" and "error" not in r
        assert (tmp_path / "out" / r["log"]).read_text().startswith("$ ")
        assert (tmp_path / "out" / "niah" / f"niah_{r['name']}.png").is_file()
    assert data["rows"][1]["body_bits_per_element"] is None and data["rows"][1]["body_bits_note"]
    niah_run = json.loads((tmp_path / "out" / "niah" / "niah_int2.json").read_text())
    assert niah_run["lengths"] == [1024] and len(niah_run["depths"]) == 10  # context 1100


def test_bench_hits_runs_every_prompt_twice_with_the_radix_cache_on(tmp_path, monkeypatch):
    """--hits: the radix cache flag dropped, the pool raised to keep every prompt, the harness run
    twice on the same prompts; the row has niah_hit beside niah."""
    b = load_bench()
    port = free_ports(1)
    started = []

    def fake_command(cfg, model_path, served, p, server_args):
        started.append(server_args)
        return [sys.executable, "-c", OPENAI_SERVER, str(p)]

    monkeypatch.setattr(b, "server_command", fake_command)
    monkeypatch.setattr(b, "embedded_model", lambda: ("chars", "fake-model"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    rc = b.main(["--configs", "int2", "--port", str(port), "--min-trials", "100", "--concurrency", "8",
                 "--startup-timeout", "60", "--parallel", "2", "--hits"])
    assert rc == 0
    (flags,) = started
    assert "--disable-radix-cache" not in flags
    assert flags[flags.index("--max-total-tokens") + 1] == str(b.HIT_POOL_TOKENS)
    data = json.loads((tmp_path / "out" / "niah_server_h100.json").read_text())
    (r,) = data["rows"]
    assert r["niah"] == 1.0 and r["niah_hit"] == 1.0 and r["niah_hit_same_prompts"] and "niah_hit" in data["notes"]
    assert (tmp_path / "out" / "niah_hit" / "niah_int2.json").is_file()
    assert b.hit_server_args(["--max-total-tokens", "9999999", "--disable-radix-cache"]) == ["--max-total-tokens", "9999999"]


def test_side_by_side_ports_stay_below_the_ephemeral_range(capsys):
    """SGLang's NCCL port comes from the OS (ephemeral range): HTTP ports of servers started side by
    side must stay below it, or a server started first can hold a later one's port."""
    b = load_bench()
    ports = [b.server_port(31000, i) for i in range(16)]
    assert len(set(ports)) == 16 and max(ports) < b.EPHEMERAL_PORTS_FROM == 32768
    configs = ",".join(f"c{i}:OSCAR_KV_FORMAT=k2c64-v2t64" for i in range(20))
    assert b.main(["--configs", configs, "--parallel", "20", "--print-commands", "--model-path", "m"]) == 0
    out = capsys.readouterr()
    assert "ephemeral range" in out.err and f"--port {b.server_port(31000, 19)}" in out.out
