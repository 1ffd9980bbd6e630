"""bench/multi_gpu.py without GPUs: its arguments, the commands of every job, the checks, the merged
results file, and the tp and dp parts against stub SGLang-like servers on 127.0.0.1.

The stub speaks /generate (streamed or not), /server_info (one internal state per DP group, the
plugin's oscar_int2 pool on int2 servers), /v1/loads (by dp_rank), /flush_cache, /health and
/metrics (one set of scheduler gauges per TP rank and DP group, and a tokenizer sample without
tp_rank), and keeps a token account per DP group: a request holds prompt + output tokens while it
runs. A router stub hands its requests to the worker stubs' accounts in turn. Servers are "started"
by a stand-in for bench/_launcher.Server that maps each command to a new stub.
"""
import json
import shlex
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from tests.http_stub import STUB_POLL, JSONHandler

from bench import multi_gpu as mg

pytestmark = pytest.mark.usefixtures("fast_polls")  # stand-in servers: see tests/conftest.py

TOTAL, CTX, MRR, VOCAB = 100_000, 40_000, 8, 5000


# ------------------------------------------------------------------------------ stubs


def _state(kv="int2", ranks=1, tp=1, dp_attention=False, **kw):
    schedulers = ([(r, r) for r in range(ranks)] if dp_attention else
                  [(t, r if ranks > 1 else None) for r in range(ranks) for t in range(tp)])
    return {"lock": threading.Lock(), "kv": kv, "ranks": ranks, "schedulers": schedulers,
            "active": [0] * ranks, "leaked": [0] * ranks, "inflight": [0] * ranks, "next": 0,
            "requests": 0, "leak_on_abort_rank": None, "stale_used": None, "tpot_s": 0.0005, **kw}


def make_handler(targets, router=False):
    class Stub(JSONHandler):
        protocol_version = "HTTP/1.0"

        def do_GET(self):
            st = targets[0]
            if self.path == "/health":
                return self._json(200, {})
            if router:
                return self._json(404, {})
            with st["lock"]:
                used = [a + b for a, b in zip(st["active"], st["leaked"])]
                inflight = list(st["inflight"])
            if self.path == "/server_info":
                states = [{"effective_max_running_requests_per_dp": MRR,
                           **({"oscar_int2": {"tokens_free": TOTAL - u, "side_rows_free": MRR,
                                              "max_total_num_tokens": TOTAL, "kv_format": "k4c64-v2t128-s4-w128"}}
                              if st["kv"] == "int2" else {})} for u in used]
                return self._json(200, {"max_total_num_tokens": TOTAL, "context_length": CTX,
                                        "kv_cache_dtype": st["kv"], "attention_backend": "stub",
                                        "disable_radix_cache": False, "internal_states": states})
            if self.path == "/v1/loads":
                return self._json(200, {"loads": [{"dp_rank": r, "num_used_tokens": used[r],
                                                   "num_running_reqs": inflight[r], "num_waiting_reqs": 0}
                                                  for r in range(st["ranks"])]})
            if self.path == "/metrics":
                lines = ['# HELP sglang:prompt_tokens_total x', 'sglang:prompt_tokens_total{model_name="m"} 5.0']
                for tp, dp in st["schedulers"]:
                    lab = f'model_name="m",pp_rank="0",tp_rank="{tp}"' + ("" if dp is None else f',dp_rank="{dp}"')
                    u = used[dp or 0] if st["stale_used"] is None else st["stale_used"]
                    lines.append(f"sglang:num_used_tokens{{{lab}}} {float(u)}")
                    lines.append(f"sglang:num_running_reqs{{{lab}}} 0.0")
                    if st["kv"] == "int2":
                        lines.append(f"sglang:oscar_int2_capacity_tokens{{{lab}}} {float(TOTAL)}")
                body = ("\n".join(lines) + "\n").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
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
            with targets[0]["lock"]:
                st = targets[targets[0]["next"] % len(targets)] if router else targets[0]
                targets[0]["next"] += router
            with st["lock"]:
                r = st["requests"] % st["ranks"]
                st["requests"] += 1
                st["inflight"][r] += 1
                st["active"][r] += hold
            keep = 0
            try:
                if not body.get("stream"):
                    return self._json(200, {"output_ids": [7] * out, "meta_info": {"completion_tokens": out}})
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
                except (BrokenPipeError, ConnectionResetError):
                    keep = hold if st["leak_on_abort_rank"] == r else 0
            finally:
                with st["lock"]:
                    st["inflight"][r] -= 1
                    st["active"][r] -= hold
                    st["leaked"][r] += keep

    return Stub


class Fleet:
    """Stub servers made on demand from the bench's commands (a stand-in for _launcher.Server)."""

    def __init__(self, monkeypatch, refuse=(), faults=None):
        self.servers, self.by_url, self.commands, self.refuse = [], {}, [], refuse
        self.faults = faults or {}
        monkeypatch.setattr(mg, "_server", self.start)
        monkeypatch.setattr(mg, "_router", lambda cmd, log, port: self.start(cmd, {}, log, port))

    def start(self, cmd, env, log, port):
        fleet = self

        class Started:
            def __init__(self):
                self.cmd, self.env, self.log_path, self.port, self.proc = cmd, env, log, port, None
                self.startup_s, self.url = None, None

            def __enter__(self):
                fleet.commands.append((self.cmd, self.env))
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self.log_path.write_text("$ " + shlex.join(self.cmd) + "\n")
                return self

            def __exit__(self, *exc):
                return False

            def wait_ready(self, timeout_s=480.0):
                refused = [w for w in fleet.refuse if w(self.cmd)]
                if refused:
                    self.log_path.write_text(self.log_path.read_text() + "AssertionError: dp attention needs MoE\n")
                    raise mg_server_error(f"server exited with 1 during start-up (log {self.log_path}); last "
                                          f"lines:\n{self.tail(5)}")
                self.url = fleet.stub(self.cmd)
                self.startup_s = 0.01

            def tail(self, n=30):
                return "\n".join(self.log_path.read_text().splitlines()[-n:])

        return Started()

    def stub(self, cmd):
        if "sglang_router.launch_router" in cmd:
            i = cmd.index("--worker-urls") + 1
            urls = []
            while i < len(cmd) and not cmd[i].startswith("--"):
                urls.append(cmd[i])
                i += 1
            targets, handler = [self.by_url[u] for u in urls], None
            handler = make_handler(targets, router=True)
            st = None
        else:
            flag = lambda f, d: int(cmd[cmd.index(f) + 1]) if f in cmd else d  # noqa: E731
            kv = cmd[cmd.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in cmd else "bf16"
            dp, tp = flag("--dp-size", 1), flag("--tp-size", 1)
            st = _state(kv, ranks=dp, tp=tp, dp_attention="--enable-dp-attention" in cmd)
            for key, fault in self.faults.items():
                if key(cmd):
                    st.update(fault)
            handler = make_handler([st])
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs=STUB_POLL, daemon=True).start()
        self.servers.append(srv)
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        if st is not None:
            self.by_url[url] = st
        return url

    def close(self):
        for s in self.servers:
            s.shutdown()
            s.server_close()


def mg_server_error(msg):
    from bench._launcher import ServerError

    return ServerError(msg)


@pytest.fixture
def fleet(monkeypatch, tmp_path):
    made = []

    def make(**kw):
        made.append(Fleet(monkeypatch, **kw))
        return made[-1]

    monkeypatch.setattr(mg, "device_name", lambda gpus: f"{len(gpus)} x stub")
    monkeypatch.setattr(mg, "TAP_SETTLE_S", 0.0)
    monkeypatch.setattr(mg, "STARTED_DIR", tmp_path / "started")
    yield make
    for f in made:
        f.close()


def run(tmp_path, *extra, out=None):
    out = out or tmp_path / "mg.json"
    argv = ["--out", str(out), "--base", "", "--vocab", str(VOCAB), "--warmup", "1x32+2",
            "--tp-loads", "4x64+8,2x128+8", "--dp-loads", "6x64+8", "--abort-load", "6x64+400",
            "--idle-timeout", "5", "--request-timeout", "30", "--metrics-wait-s", "3",
            "--logs", str(tmp_path / "logs"), "--run", "r1", *extra]
    rc = mg.main(argv)
    return rc, json.loads(out.read_text())


def _rows(doc, **match):
    return [r for r in doc["rows"] if all(r.get(k) == v for k, v in match.items())]


# ------------------------------------------------------------------------------ arguments, commands


def test_defaults_parts_and_jobs():
    args = mg.parse_args([])
    assert args.parts == ["tp", "dp"] and args.gpu_list == ["0", "1"]
    assert args.tp_loads == ["256x2048+256", "64x8192+512"] and args.dp_loads == ["512x2048+256"]
    assert args.abort_load == "64x2048+1024" and args.out.endswith("bench/results/multi_gpu_h200x2.json")
    names = [j.name for j in mg.select_jobs(args)]
    assert names == ["tp-int2", "tap", "tp-fp8-flashinfer", "tp-flashinfer", "dp-int2", "dp-fp8-flashinfer",
                     "dp-flashinfer", "router-int2", "router-fp8-flashinfer", "router-flashinfer",
                     "dp-attention-int2", "dp-attention-fp8-flashinfer", "dp-attention-flashinfer"]
    assert [j.name for j in mg.select_jobs(mg.parse_args(["--part", "tp"]))] == names[:4]
    assert [j.name for j in mg.select_jobs(mg.parse_args(["--jobs", "tap,router-int2"]))] == ["tap", "router-int2"]
    # every job keeps its ports whichever are selected; no two jobs' ports overlap
    ports = {j.name: j.port for j in mg.all_jobs(30600)}
    assert mg.select_jobs(mg.parse_args(["--part", "dp"]))[0].port == ports["dp-int2"]
    assert len(set(ports.values())) == len(ports) and min(b - a for a, b in zip(sorted(ports.values()),
                                                                                 sorted(ports.values())[1:])) == 100


@pytest.mark.parametrize("argv, says", [
    (["--part", "tp,pp"], "--part"), (["--part", ""], "--part"), (["--gpus", "0"], "--gpus"),
    (["--gpus", "0,0"], "--gpus"), (["--tp-loads", "256x2048"], "NxIN+OUT"), (["--jobs", "tp-bf16"], "--jobs"),
])
def test_bad_arguments_stop_before_any_work(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        mg.parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def _job(name, args):
    return next(j for j in mg.all_jobs(args.port) if j.name == name)


def test_tp_and_tap_commands():
    args = mg.parse_args(["--server-arg=--foo"])
    tp = _job("tp-int2", args)
    [(name, cmd, env, port)] = mg.servers(tp, args)
    s = shlex.join(cmd)
    assert "-m sglang.launch_server" in s and "--tp-size 2" in s and "--kv-cache-dtype int2" in s
    assert "--enable-metrics --enable-metrics-for-all-schedulers" in s and s.endswith("--foo")
    assert f"--nccl-port {port + 5}" in s and "--load-format dummy" in s and "--dp-size" not in s
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert tp.keys(args) == [("tp", "tp", "int2", "256x2048+256"), ("tp", "tp", "int2", "64x8192+512"),
                             ("tp", "tp", "int2", "64x2048+1024 aborted")]
    fp8 = _job("tp-fp8-flashinfer", args)
    s = shlex.join(mg.servers(fp8, args)[0][1])
    assert "--kv-cache-dtype fp8_e4m3 --attention-backend flashinfer" in s and "--tp-size 2" in s
    assert all(k[3] != "64x2048+1024 aborted" for k in fp8.keys(args))  # aborts: int2 only
    bf16 = mg.servers(_job("tp-flashinfer", args), args)[0][1]
    assert "--kv-cache-dtype" not in bf16 and "flashinfer" in bf16
    tap = _job("tap", args)
    [(_, cmd, env, _)] = mg.servers(tap, args)
    s = shlex.join(cmd)
    assert "--tp-size 2" in s and "--disable-radix-cache --chunked-prefill-size 4096" in s
    assert "--enable-metrics" not in s and "--kv-cache-dtype int2" in s
    assert env["OSCAR_DEBUG_TAP_LAYER"] == "5" and env["OSCAR_DEBUG_TAP_DIR"].endswith(f"tap_{tap.port}")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert tap.keys(args) == [("tp", "tap", "int2", "1x10000+4")]


def test_dp_router_and_dp_attention_commands():
    args = mg.parse_args(["--gpus", "2,3", "--router-arg=--log-level=info"])
    dp = _job("dp-int2", args)
    [(_, cmd, env, _)] = mg.servers(dp, args)
    s = shlex.join(cmd)
    # no --nccl-port: every DP group would take that one port
    assert "--dp-size 2" in s and "--tp-size" not in s and "--nccl-port" not in s
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "--enable-metrics-for-all-schedulers" in s
    att = shlex.join(mg.servers(_job("dp-attention-fp8-flashinfer", args), args)[0][1])
    assert "--tp-size 2 --dp-size 2 --enable-dp-attention" in att and "--nccl-port" not in att
    r = _job("router-int2", args)
    workers = mg.servers(r, args)
    assert [w[2]["CUDA_VISIBLE_DEVICES"] for w in workers] == ["2", "3"]
    assert [w[3] for w in workers] == [r.port, r.port + 10]
    for _, cmd, _, port in workers:  # side by side: their own rendezvous ports
        s = shlex.join(cmd)
        assert f"--port {port} --nccl-port {port + 5}" in s and "--tp-size" not in s and "--dp-size" not in s
    rc = mg.router_cmd(r, args, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert shlex.join(rc[1:]) == ("-m sglang_router.launch_router --worker-urls http://127.0.0.1:1 http://127.0.0.1:2 "
                                  f"--host 127.0.0.1 --port {r.port + 50} --policy round_robin --prometheus-host "
                                  f"127.0.0.1 --prometheus-port {r.port + 51} --log-level=info")
    assert r.keys(args) == [("dp", "single", "int2", "512x2048+256"), ("dp", "router", "int2", "512x2048+256"),
                            ("dp", "router", "int2", "64x2048+1024 aborted")]


def test_print_commands_runs_nothing(capsys, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a server was started")

    monkeypatch.setattr(mg, "_server", boom)
    assert mg.main(["--print-commands", "--part", "dp"]) == 0
    out = capsys.readouterr().out
    assert out.count("# ") == 9 and "sglang_router.launch_router" in out and "--enable-dp-attention" in out
    assert "# router-int2 (part dp): rows single 512x2048+256, router 512x2048+256, router 64x2048+1024 aborted" in out


def test_estimates_and_the_started_markers(tmp_path, monkeypatch):
    monkeypatch.setattr(mg, "STARTED_DIR", tmp_path)
    args = mg.parse_args([])
    tp = _job("tp-int2", args)
    fresh = mg.job_estimate_s(tp, args)
    (tmp_path / "int2").touch()
    warm = mg.job_estimate_s(tp, args)
    assert fresh - warm == pytest.approx(mg.START_FRESH_S["int2"] - mg.START_WARM_S)
    assert mg.job_estimate_s(tp, args, first_only=True) < warm
    r = _job("router-int2", args)
    d = _job("dp-int2", args)
    # the router job measures the dp load twice (the single server, then the pair)
    assert mg.job_estimate_s(r, args) > mg.job_estimate_s(d, args)
    assert mg.job_estimate_s(_job("tap", args), args) == mg.START_WARM_S + mg.TAP_S


# ------------------------------------------------------------------------------ gauges and pools


def test_scheduler_gauges_per_rank():
    text = "\n".join([
        "# HELP sglang:num_used_tokens The number of used tokens.",
        'sglang:num_used_tokens{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0",dp_rank="1"} 12.0',
        'sglang:num_used_tokens{engine_type="unified",model_name="m",pp_rank="0",tp_rank="1",dp_rank="1"} 0.0',
        'sglang:oscar_int2_capacity_tokens{engine_type="unified",model_name="m",pp_rank="0",tp_rank="1",'
        'dp_rank="1"} 5e+06',
        'sglang:oscar_int2_used_tokens{model_name="m",tp_rank="0",pp_rank="0"} 3',
        'sglang:prompt_tokens_total{model_name="m"} 7.0',  # the tokenizer's: no tp_rank
        'sglang:gen_throughput{model_name="m",tp_rank="0",pp_rank="0"} 100.0',  # not kept
    ])
    got = mg.parse_scheduler_metrics(text, server=1)
    assert [(e["server"], e["tp_rank"], e["dp_rank"]) for e in got] == [(1, 0, None), (1, 0, 1), (1, 1, 1)]
    assert got[0]["gauges"] == {"sglang:oscar_int2_used_tokens": 3.0}
    assert [mg.used_tokens(e) for e in got] == [3.0, 12.0, 0.0]
    assert got[2]["gauges"]["sglang:oscar_int2_capacity_tokens"] == 5e6


@pytest.mark.slow
def test_a_leak_on_one_dp_rank_is_named(fleet, tmp_path):
    f = fleet()
    url = f.stub(["launch_server", "--kv-cache-dtype", "int2", "--dp-size", "2"])
    st = f.by_url[url]
    start = mg.pools([url], 5)
    assert sorted(start["ranks"]) == ["dp0", "dp1"] and start["ranks"]["dp1"]["kv_tokens"] == TOTAL
    st["leaked"][1] = 64
    fields = mg.pool_fields(start, mg.pools([url], 5))
    assert fields["pool_leak_tokens"] == 64
    assert {k: p["pool_leak_tokens"] for k, p in fields["pool_ranks"].items()} == {"dp0": 0, "dp1": 64}
    two = [url, f.stub(["launch_server", "--kv-cache-dtype", "int2"])]
    assert sorted(mg.pools(two, 5)["ranks"]) == ["worker0.dp0", "worker0.dp1", "worker1.dp0"]
    m = mg.scheduler_metrics([url])
    assert [(e["tp_rank"], e["dp_rank"]) for e in m["schedulers"]] == [(0, 0), (0, 1)]
    assert [mg.used_tokens(e) for e in m["schedulers"]] == [0.0, 64.0]
    t0 = time.monotonic()
    waited = mg.scheduler_metrics([url], wait_s=2.5, expect=2)  # never 0 on dp1: read until the wait is over
    assert time.monotonic() - t0 >= 2.0 and waited["metrics_waited_s"] >= 2.0


# ------------------------------------------------------------------------------ checks


def _tp(config, load, tok_s, run="r1", **kw):
    return {"part": "tp", "topology": "tp", "config": config, "load": load, "kind": "throughput", "ok": True,
            "output_tok_s": tok_s, "kv_tokens": 1000, "run": run, "gpus_used": 2, **kw}


def _aborts(topology, ranks=None, schedulers=2, used=0.0, **kw):
    ranks = ranks if ranks is not None else ({"dp0": 0} if topology == "tp" else {"dp0": 0, "dp1": 0})
    return {"part": mg.PART_OF[topology], "topology": topology, "config": "int2", "load": "64x2048+1024 aborted",
            "kind": "aborts", "ok": True, "run": "r1", "gpus_used": 2, "aborted": 64, "streams": 64,
            "pool_ranks": {k: {"pool_leak_tokens": v, "side_rows_leak": 0} for k, v in ranks.items()},
            "pool_leak_tokens": max(ranks.values()), "side_free_leak": {},
            "schedulers": [{"server": 0, "tp_rank": i, "dp_rank": None,
                            "gauges": {"sglang:num_used_tokens": used, "sglang:oscar_int2_capacity_tokens": 1e6}}
                           for i in range(schedulers)], **kw}


def _all_rows():
    rows = []
    for ld in ("256x2048+256", "64x8192+512"):
        rows += [_tp("int2", ld, 9000), _tp("fp8-flashinfer", ld, 6000), _tp("flashinfer", ld, 4500)]
    for t in ("single", "dp", "router", "dp-attention"):
        scale = 1 if t == "single" else 2
        rows += [{**_tp(c, "512x2048+256", v * scale), "part": "dp", "topology": t}
                 for c, v in (("int2", 8000), ("fp8-flashinfer", 5000), ("flashinfer", 4000))]
    rows += [_aborts(t) for t in ("tp", "dp", "router", "dp-attention")]
    rows.append({"part": "tp", "topology": "tap", "config": "int2", "load": "1x10000+4", "kind": "tap", "ok": True,
                 "run": "r1", "gpus_used": 2, "rank_errors": {"0": {"ok": True}, "1": {"ok": True}}})
    return rows


def test_checks_pass_with_every_row_and_its_baselines():
    s = mg.summary(_all_rows())
    assert s["all_checks_pass"], s
    assert not s["not_measured"]
    assert "tp_256x2048+256_int2_with_same_run_fp8_bf16" in s["checks"]
    assert "router_int2_no_pool_leak_every_rank_after_aborts" in s["checks"]
    assert "dp-attention_int2_gauges_from_every_scheduler" in s["checks"]
    r = s["output_tok_s"]
    assert r["tp 256x2048+256"]["int2_vs_fp8"] == 1.5 and r["tp 256x2048+256"]["int2_vs_bf16"] == 2.0
    assert r["dp 512x2048+256"]["int2_vs_single"] == 2.0 and r["router 512x2048+256"]["fp8-flashinfer_vs_single"] == 2.0
    assert s["check_values"]["tp_64x8192+512_int2_with_same_run_fp8_bf16"]["fp8-flashinfer"]["output_tok_s"] == 6000


def test_checks_fail_and_name_what_was_not_measured():
    rows = _all_rows()
    rows = [r for r in rows if not (r["topology"] == "dp" and r["config"] == "flashinfer")]  # BF16 baseline missing
    for r in rows:
        if r["topology"] == "tp" and r["config"] == "fp8-flashinfer" and r["load"] == "64x8192+512":
            r["run"] = "r0"  # an older run's FP8: not a same-run baseline
        if r["kind"] == "aborts" and r["topology"] == "router":
            r["pool_ranks"]["dp1"]["pool_leak_tokens"] = 32
        if r["kind"] == "aborts" and r["topology"] == "tp":
            r["schedulers"] = r["schedulers"][:1]  # TP rank 1's gauges absent
        if r["kind"] == "tap":
            r.update(ok=False, rank_errors={"0": {"ok": True}, "1": {"ok": False}})
    rows = [r for r in rows if not (r["kind"] == "aborts" and r["topology"] == "dp")]
    s = mg.summary(rows)
    c = s["checks"]
    assert not s["all_checks_pass"]
    assert not c["dp_512x2048+256_int2_with_same_run_fp8_bf16"]
    assert "dp_512x2048+256_int2_with_same_run_fp8_bf16" in s["not_measured"]
    assert not c["tp_64x8192+512_int2_with_same_run_fp8_bf16"]
    assert "tp_64x8192+512_int2_with_same_run_fp8_bf16" not in s["not_measured"]  # measured, other run
    assert c["tp_256x2048+256_int2_with_same_run_fp8_bf16"]
    assert not c["router_int2_no_pool_leak_every_rank_after_aborts"]
    assert s["check_values"]["router_int2_no_pool_leak_every_rank_after_aborts"]["pool_leak_tokens"]["dp1"] == 32
    assert not c["tp_int2_no_pool_leak_every_rank_after_aborts"] and not c["tp_int2_gauges_from_every_scheduler"]
    assert {"dp_int2_no_pool_leak_every_rank_after_aborts",
            "dp_int2_gauges_from_every_scheduler"} <= set(s["not_measured"])
    assert not c["tap_int2_every_rank_matches_float64_emulation"]
    assert "tap_int2_every_rank_matches_float64_emulation" not in s["not_measured"]
    assert c["dp-attention_int2_no_pool_leak_every_rank_after_aborts"]
    empty = mg.summary([])
    assert not empty["all_checks_pass"] and set(empty["not_measured"]) == set(empty["checks"])


def test_dp_attention_refused_by_sglang_is_a_finding_not_a_failure():
    rows = [r for r in _all_rows() if r["topology"] != "dp-attention"]
    refused = lambda c, load: {"part": "dp", "topology": "dp-attention", "config": c, "load": load,  # noqa: E731
                               "kind": "throughput", "ok": False, "start_failed": True, "run": "r1",
                               "error": "ServerError: server exited with 1 during start-up; last lines:\n"
                                        "AssertionError: dp attention needs MoE"}
    both = rows + [refused("int2", "512x2048+256"), refused("int2", "64x2048+1024 aborted"),
                   refused("fp8-flashinfer", "512x2048+256")]
    s = mg.summary(both)
    assert s["all_checks_pass"], s["checks"]
    assert s["checks"]["dp-attention_refused_by_sglang_for_fp8_too"]
    assert s["check_values"]["dp-attention_refused_by_sglang_for_fp8_too"]["int2_error"][-1] == \
        "AssertionError: dp attention needs MoE"
    assert not any(k.startswith("dp-attention_5") for k in s["checks"])
    # int2 refused where FP8 ran: the plugin's failure
    fp8_ran = rows + [refused("int2", "512x2048+256"),
                      {**_tp("fp8-flashinfer", "512x2048+256", 9000), "part": "dp", "topology": "dp-attention"}]
    s = mg.summary(fp8_ran)
    assert not s["checks"]["dp-attention_refused_by_sglang_for_fp8_too"] and not s["all_checks_pass"]
    # FP8 not tried yet: not measured
    s = mg.summary(rows + [refused("int2", "512x2048+256")])
    assert "dp-attention_refused_by_sglang_for_fp8_too" in s["not_measured"]


def test_results_merge_across_calls_and_only_missing(tmp_path):
    from bench.spec_decode import ResultsFile

    path = tmp_path / "mg.json"
    rows = _all_rows()
    a = ResultsFile(path, None, "2 x stub", module="multi_gpu", key=mg.row_key, finish=mg.summary)
    for r in rows[:6]:
        a.put(r)
    b = ResultsFile(path, None, "2 x stub", module="multi_gpu", key=mg.row_key, finish=mg.summary)
    for r in rows[6:]:
        b.put(r)
    b.put({**rows[0], "output_tok_s": 9100})  # the same key again: replaced, not added
    doc = json.loads(path.read_text())
    assert len(doc["rows"]) == len(rows) and doc["rows"][0]["output_tok_s"] == 9100
    assert doc["summary"]["all_checks_pass"] and doc["calls"][-1]["device"] == "2 x stub"
    assert doc["command"].startswith("python -m bench.multi_gpu")
    args = mg.parse_args(["--run", "r1"])
    assert mg.done(_job("tp-int2", args), args, doc["rows"])
    args2 = mg.parse_args(["--run", "r2"])
    assert not mg.done(_job("tp-int2", args2), args2, doc["rows"])  # rows of another run
    bad = [dict(r) for r in doc["rows"]]
    bad[0]["ok"] = False
    assert not mg.done(_job("tp-int2", args), args, bad)
    refused = {"part": "dp", "topology": "dp-attention", "config": "fp8-flashinfer", "load": "512x2048+256",
               "ok": False, "start_failed": True, "run": "r1"}
    assert mg.done(_job("dp-attention-fp8-flashinfer", args), args, [refused])


# ------------------------------------------------------------------------------ parts against stubs


@pytest.mark.slow
def test_tp_part_against_stubs(fleet, tmp_path, monkeypatch):
    from bench import server_e2e

    f = fleet()
    seen = {}

    def analyse_ranks(tap, before):
        seen["tap"], seen["before"] = tap, before
        chunk = {"rel_err_server_vs_int2_emulation": 0.004, "rel_err_stored_k_vs_emulation": 0.001,
                 "rel_err_stored_v_vs_emulation": 0.002, "rel_err_server_vs_bf16": 0.3,
                 "rel_err_int2_emulation_vs_bf16": 0.3}
        return [{"rank": r, "ok": True, "chunks": [chunk, chunk]} for r in (0, 1)]

    monkeypatch.setattr(server_e2e, "analyse_ranks", analyse_ranks)
    rc, doc = run(tmp_path, "--part", "tp")
    assert rc == 0
    assert [(r["config"], r["topology"], r["load"]) for r in doc["rows"]] == [
        ("int2", "tp", "4x64+8"), ("int2", "tp", "2x128+8"), ("int2", "tp", "6x64+400 aborted"),
        ("int2", "tap", "1x10000+4"), ("fp8-flashinfer", "tp", "4x64+8"), ("fp8-flashinfer", "tp", "2x128+8"),
        ("flashinfer", "tp", "4x64+8"), ("flashinfer", "tp", "2x128+8")]
    for r in doc["rows"]:
        assert r["run"] == "r1" and r["device"] == "2 x stub" and r["tp_size"] == 2 and r["gpus_used"] == 2
        assert r["model"] == "llama31-8b" and r["ok"], r
    tput = _rows(doc, kind="throughput")
    assert all(r["output_tok_s"] > 0 and r["kv_tokens"] == TOTAL and r["pool_leak_tokens"] == 0 for r in tput)
    assert all(len(r["schedulers"]) == 2 for r in tput)  # TP rank 0 and 1
    ab = _rows(doc, kind="aborts")[0]
    assert ab["aborted"] == 6 and ab["pool_ranks"]["dp0"]["pool_leak_tokens"] == 0
    assert [mg.used_tokens(e) for e in ab["schedulers"]] == [0.0, 0.0]
    tap = _rows(doc, kind="tap")[0]
    assert tap["request_ok"] and tap["rank_errors"]["1"]["rel_err_stored_v_vs_emulation"] == 0.002
    args = mg.parse_args([])
    assert seen["tap"] == mg.tap_dir(_job("tap", args), args) and "logs" not in str(seen["tap"])
    tap_cmd, tap_env = next((c, e) for c, e in f.commands if "--disable-radix-cache" in c)
    assert tap_env["OSCAR_DEBUG_TAP_DIR"] == str(seen["tap"]) and "--tp-size" in tap_cmd
    s = doc["summary"]
    for name in ("tp_4x64+8_int2_with_same_run_fp8_bf16", "tp_2x128+8_int2_with_same_run_fp8_bf16",
                 "tp_int2_no_pool_leak_every_rank_after_aborts", "tp_int2_gauges_from_every_scheduler",
                 "tap_int2_every_rank_matches_float64_emulation"):
        assert s["checks"][name], name
    assert "dp_512x2048+256_int2_with_same_run_fp8_bf16" in s["not_measured"] and not s["all_checks_pass"]
    # the same command again with --only-missing: nothing to do
    n = len(f.commands)
    rc, doc2 = run(tmp_path, "--part", "tp", "--only-missing")
    assert rc == 0 and len(f.commands) == n and doc2["rows"] == doc["rows"] and len(doc2["calls"]) == 2


@pytest.mark.slow
def test_dp_part_against_stubs(fleet, tmp_path, monkeypatch):
    """dp, the router pair (its first worker alone: the single rows) and dp attention refused by
    SGLang for int2 and FP8 (its BF16 job then skipped); a leak on one DP rank after the aborts."""
    monkeypatch.setattr(mg, "router_available", lambda: None)
    f = fleet(refuse=[lambda cmd: "--enable-dp-attention" in cmd],
              faults={lambda cmd: "--dp-size" in cmd and "--kv-cache-dtype" in cmd
                      and cmd[cmd.index("--kv-cache-dtype") + 1] == "int2": {"leak_on_abort_rank": 1}})
    rc, doc = run(tmp_path, "--part", "dp")
    assert rc == 0  # dp attention's refusal is a finding
    keys = [(r["topology"], r["config"], r["load"]) for r in doc["rows"]]
    assert ("single", "int2", "6x64+8") in keys and ("router", "flashinfer", "6x64+8") in keys
    assert ("router", "int2", "6x64+400 aborted") in keys and ("dp", "int2", "6x64+400 aborted") in keys
    assert not any(t == "dp-attention" and c == "flashinfer" for t, c, _ in keys)  # skipped: refused twice
    att = _rows(doc, topology="dp-attention")
    assert {r["config"] for r in att} == {"int2", "fp8-flashinfer"}
    assert all(r["start_failed"] and not r["ok"] and "dp attention needs MoE" in r["error"] for r in att)
    single = _rows(doc, topology="single", config="int2")[0]
    assert single["servers"] == 1 and single["gpus_used"] == 1 and single["gpus"] == ["0"]
    assert "--nccl-port" in single["server_command"]
    router = _rows(doc, topology="router", config="int2", kind="throughput")[0]
    assert router["servers"] == 2 and "sglang_router.launch_router" in router["router_command"]
    # the router handed requests to both workers: both accounts were used, both pools measured
    assert sorted(router["pool_ranks"]) == ["worker0.dp0", "worker1.dp0"]
    rab = _rows(doc, topology="router", kind="aborts")[0]
    assert rab["pool_leak_tokens"] == 0 and len(rab["schedulers"]) == 2
    dab = _rows(doc, topology="dp", kind="aborts")[0]
    assert dab["pool_ranks"]["dp0"]["pool_leak_tokens"] == 0 and dab["pool_ranks"]["dp1"]["pool_leak_tokens"] > 0
    assert [e["dp_rank"] for e in dab["schedulers"]] == [0, 1]
    dp_cmd = next(c for c, _ in f.commands if "--dp-size" in c and "--enable-dp-attention" not in c)
    assert "--nccl-port" not in dp_cmd
    c = doc["summary"]["checks"]
    assert c["dp-attention_refused_by_sglang_for_fp8_too"]
    assert c["router_int2_no_pool_leak_every_rank_after_aborts"] and c["router_int2_gauges_from_every_scheduler"]
    assert not c["dp_int2_no_pool_leak_every_rank_after_aborts"] and c["dp_int2_gauges_from_every_scheduler"]
    for t in ("single", "dp", "router"):
        assert c[f"{t}_6x64+8_int2_with_same_run_fp8_bf16"], t
    assert doc["summary"]["output_tok_s"]["router 6x64+8"]["int2_vs_single"] is not None


@pytest.mark.slow
def test_router_missing_and_a_failed_server(fleet, tmp_path, monkeypatch):
    """Without sglang_router the router rows say so and the single rows are measured; a server
    that does not start is a failed row with its log's tail, and the command exits 1."""
    real = mg.importlib.util.find_spec
    monkeypatch.setattr(mg.importlib.util, "find_spec", lambda name: None if name == "sglang_router" else real(name))
    why = mg.router_available()
    monkeypatch.setattr(mg.importlib.util, "find_spec", real)
    assert "sglang_router module is not installed" in why and ".devkit/router" in why
    monkeypatch.setattr(mg, "router_available", lambda: why)
    f = fleet(refuse=[lambda cmd: "--tp-size" in cmd and "--kv-cache-dtype" not in cmd])
    rc, doc = run(tmp_path, "--jobs", "router-int2,tp-flashinfer")
    assert rc == 1
    single = _rows(doc, topology="single")
    assert len(single) == 1 and single[0]["ok"]
    router = _rows(doc, topology="router")
    assert {r["load"] for r in router} == {"6x64+8", "6x64+400 aborted"}
    assert all(r["router_missing"] and "sglang_router module is not installed" in r["error"] for r in router)
    assert not any("sglang_router.launch_router" in c for c, _ in f.commands)
    bad = _rows(doc, config="flashinfer")
    assert [r["load"] for r in bad] == ["4x64+8", "2x128+8"]
    assert all(r["start_failed"] and "last lines" in r["error"] and "dp attention needs MoE" in r["error"]
               for r in bad)


@pytest.mark.slow
def test_the_deadline_skips_whole_jobs(fleet, tmp_path, monkeypatch):
    fleet()
    monkeypatch.setattr(mg, "START_FRESH_S", {c: 100.0 for c in mg.CONFIG_NAMES})
    monkeypatch.setattr(mg, "START_WARM_S", 100.0)
    args = mg.parse_args(["--tp-loads", "4x64+8,2x128+8", "--abort-load", "6x64+400"])
    one = mg.job_estimate_s(_job("tp-int2", args), args)
    real = mg.run_job

    def as_long_as_estimated(job, args, run):  # the stub is quick: the clock moves as the estimate says
        ok = real(job, args, run)
        run.clock.t0 -= mg.job_estimate_s(job, args)
        return ok

    monkeypatch.setattr(mg, "run_job", as_long_as_estimated)
    # room for the first job only: the rest are listed as skipped, not started
    rc, doc = run(tmp_path, "--part", "tp", "--deadline-s", f"{one + 20:.0f}")
    assert rc == 0 and {r["job"] for r in doc["rows"]} == {"tp-int2"}
    assert [s["job"] for s in doc["calls"][-1]["skipped"]] == ["tap", "tp-fp8-flashinfer", "tp-flashinfer"]
