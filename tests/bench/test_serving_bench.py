"""bench/serving.py helpers that turn measurements into the numbers of its report:
the client-side split of a load's wall time into decoding vs prefill, and the report's merge of
several results files (part by part, with pre-fix int2 runs relabelled)."""
import json
import random
from pathlib import Path

import pytest


from bench._serving_client import RequestRecord, full_occupancy_decode, phase_split
from bench._serving_report import _load, targets


def _simulate(rng: random.Random, n: int, capacity: int, out_len: int):
    """SGLang-like schedule: admit up to `capacity` requests, prefill each (0.25-1.0 s, no decode
    meanwhile), then decode all admitted ones together (steps of 10-60 ms) until they finish.
    Returns the records and the true decode seconds."""
    records = [RequestRecord(prompt_len=1000, sent=0.0) for _ in range(n)]
    t, decode_true = 0.0, 0.0
    for start in range(0, n, capacity):
        wave = records[start:start + capacity]
        for r in wave:
            t += rng.uniform(0.25, 1.0)  # prefill; its first token comes out at its end
            r.first_token = t
            r.chunks.append((t, 1))
        for step in range(2, out_len + 1):
            dt = rng.uniform(0.010, 0.060)
            t += dt
            decode_true += dt
            for r in wave:
                r.chunks.append((t + rng.uniform(0, 0.002), step))  # client receive jitter
        for r in wave:
            r.finished = r.chunks[-1][0]
            r.output_tokens = out_len
    return records, decode_true, t


def test_phase_split_recovers_decode_time(seed):
    rng = random.Random(seed)
    n, cap, out = rng.randint(5, 30), rng.randint(2, 8), rng.randint(8, 40)
    records, decode_true, t_end = _simulate(rng, n, cap, out)
    ps = phase_split(records, max_step_s=0.15)
    # jitter of <= 2 ms per step may move a little time between the two buckets
    assert ps["decode_s"] == pytest.approx(decode_true, abs=0.002 * n * out + 1e-6)
    assert ps["decode_s"] + ps["other_s"] == pytest.approx(max(r.finished for r in records))
    assert ps["decode_tokens"] == n * (out - 1)
    # the stretch with the most requests decoding is a full wave, at its own decode rate
    fo = full_occupancy_decode(records, min_span_s=0.0)
    assert fo["requests"] == min(cap, n)


def _results(tmp_path: Path, name: str, date: str, runs: dict) -> Path:
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps({"meta": {"date_utc": date, "gpu": "test", "argv": [name],
                                      "mem_fraction_static": 0.85}, "runs": runs}))
    return p


def _tp(tok_s: float, full: float, reqs: int) -> dict:
    return {"n": 4, "ok": 4, "output_tok_s": tok_s, "duration_s": 1.0,
            "full_occupancy_decode": {"tok_s": full, "requests": reqs}}


def test_report_merges_parts_and_relabels_pre_fix_int2(tmp_path, seed):
    rng = random.Random(seed)
    lat_old, lat_new = rng.uniform(5, 20), rng.uniform(5, 20)
    cap_b, ratio = rng.randint(10_000, 500_000), rng.uniform(6, 7.5)
    old = _results(tmp_path, "a", "2026-11-22 07:54", {
        "m/bf16": {"model": "m", "config": "bf16", "capacity": {"max_total_num_tokens": cap_b},
                   "latency": {"32768": {"tpot_ms_median": 2 * lat_old}},
                   "throughput": {"4x32768x8": _tp(10, 40, 2)}},
        "m/int2": {"model": "m", "config": "int2",  # before the split fix: 8 splits
                   "capacity": {"max_total_num_tokens": int(cap_b * ratio)},
                   "latency": {"32768": {"tpot_ms_median": lat_old}},
                   "throughput": {"4x32768x8": _tp(12, 60, 4)}}})
    lat_only = _results(tmp_path, "b", "2026-11-22 08:09", {
        "m/bf16-splits64": {"model": "m", "config": "bf16-splits64",
                            "latency": {"32768": {"tpot_ms_median": 1.5 * lat_new}}},
        "m/int2": {"model": "m", "config": "int2", "latency": {"32768": {"tpot_ms_median": lat_new}}}})
    tp_only = _results(tmp_path, "c", "2026-11-22 09:43", {
        "m/int2": {"model": "m", "config": "int2",
                   "server_info_subset": {"triton_attention_num_kv_splits": 64},
                   "capacity": {"max_total_num_tokens": int(cap_b * ratio)},
                   "throughput": {"4x32768x8": _tp(30, 300, 4)}}})
    runs = _load([old, lat_only, tp_only])["runs"]
    # the pre-fix int2 keeps its own numbers under its own name
    assert runs["m/int2-splits8"]["latency"]["32768"]["tpot_ms_median"] == lat_old
    # a later run that measured only throughput keeps the earlier run's latency
    assert runs["m/int2"]["latency"]["32768"]["tpot_ms_median"] == lat_new
    assert runs["m/int2"]["throughput"]["4x32768x8"]["output_tok_s"] == 30
    assert runs["m/int2"]["_dates"] == {"latency": "2026-11-22 08:09",
                                         "throughput": "2026-11-22 09:43",
                                         "throughput:4x32768x8": "2026-11-22 09:43",
                                         "capacity": "2026-11-22 09:43"}
    # throughput merges load by load: a later run with another load keeps the earlier loads
    other = _results(tmp_path, "d", "2026-11-22 10:24", {
        "m/int2": {"model": "m", "config": "int2",
                   "server_info_subset": {"triton_attention_num_kv_splits": 64},
                   "throughput": {"2x32768x8": _tp(7, 70, 2)}}})
    runs2 = _load([old, lat_only, tp_only, other])["runs"]
    assert set(runs2["m/int2"]["throughput"]) == {"4x32768x8", "2x32768x8"}
    assert runs2["m/int2"]["_dates"]["throughput:4x32768x8"] == "2026-11-22 09:43"
    assert runs2["m/int2"]["_dates"]["throughput:2x32768x8"] == "2026-11-22 10:24"
    table = targets(runs)
    # each int2 is compared with the BF16 of the same split cap
    assert f"| int2-splits8 vs bf16 | {lat_old:.2f} ms vs {2 * lat_old:.2f} ms | yes |" in table
    assert f"| int2 vs bf16-splits64 | {lat_new:.2f} ms vs {1.5 * lat_new:.2f} ms" in table
    assert f"| int2-splits8 vs bf16 | {12 / 10:.2f}x | no |" in table
    assert f"{int(cap_b * ratio) / cap_b:.2f}x" in table


def test_a_started_server_is_ready_only_after_sglangs_own_start_up_request(tmp_path, monkeypatch):
    """/server_info answers while SGLang's start-up request still runs; a measured request sent
    then waits behind it (a "fresh" TTFT of 5.3 s instead of 2.0 s at 32K on the H100). The bench
    waits for the line SGLang logs when that request is done (server status Up)."""
    from types import SimpleNamespace

    from bench import _launcher as ss

    log = tmp_path / "server.log"
    log.write_text("Uvicorn running on http://127.0.0.1:1\n")
    srv = ss.Server(["sglang"], {}, log, 1, **ss.SPEED)
    srv.proc = SimpleNamespace(poll=lambda: None)
    polls = []
    monkeypatch.setattr(ss, "get_json", lambda url, timeout=10.0: polls.append(url) or {})

    def sleep(_):
        if len(polls) == 3:  # SGLang finishes its start-up request after the third poll
            log.write_text(log.read_text() + ss.READY_LINE + "\n")

    monkeypatch.setattr(ss.time, "sleep", sleep)
    srv.wait_ready(60)
    assert len(polls) == 4 and all(u.endswith("/server_info") for u in polls)
    assert srv.startup_s is not None
