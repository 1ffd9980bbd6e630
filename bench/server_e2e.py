"""End-to-end acceptance run of `--kv-cache-dtype int2` on stock SGLang (GPU machine).

Phases (all on dummy-weight Qwen3-8B from the devkit, same --mem-fraction-static):
  bf16      stock BF16 server (triton): max_total_num_tokens, then stopped;
  int2      INT2 server, radix cache on, CUDA graphs, a rotation file (random orthogonal, per-head
            K, shared V, clip 0.96 / 0.92) loaded: capacity ratio vs bf16; /v1/chat/completions
            (streamed and not), /generate; 64 concurrent requests of mixed lengths up to 32K
            (some sharing a prefix); /server_info and /metrics show the int2 pool;
  noradix   INT2 server with --disable-radix-cache and 4K chunked prefill, debug tap on one
            layer: one 10K-token request is prefilled in 3 chunks and the server's attention
            output of the tapped layer is compared with (a) exact attention over the same BF16
            K/V and (b) the INT2 design emulated in float64; then the 64 concurrent requests.

    source .devkit/device-env.sh && python -m bench.server_e2e --out $OUT/e2e

--tp 2 (on nvidia-h200-x2) runs every phase with tensor parallelism 2; each rank taps its own KV
heads (OSCAR_DEBUG_TAP_DIR/rank<r>) and the noradix row checks every rank's attention output.

Writes OUT/results.json (bench/_results.py: date, device, model, command, one row per phase) after
every phase (a cut-off run keeps what it measured) and the logs; kept runs go to
bench/results/server_e2e/<date>_<time>.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import re
import sys
import time
import urllib.request
from pathlib import Path

from bench import _results
from bench._launcher import SPEED, Server
from bench._serving_server import post_json

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / ".devkit" / "models"
FLAGS = ["--load-format", "dummy", "--sampling-backend", "pytorch", "--grammar-backend", "none",
         "--disable-prefill-cuda-graph", "--host", "127.0.0.1"]


# Three ways in, one per phase: SGLang's module launcher, our launcher, SGLang's `sglang serve`.
LAUNCHERS = {
    "launch_server": [sys.executable, "-m", "sglang.launch_server"],
    "oscar-sglang serve": [sys.executable, "-m", "oscar_sglang.tools.cli", "serve"],
    "sglang serve": [sys.executable, "-c", "import sys; from sglang.cli.main import main; sys.exit(main())", "serve"],
}


# --skip-tokenizer (set by main): no tokenizer files needed (lets the call carry less), no chat API
NO_TOKENIZER = False
# --tp (set by main): tensor parallel size of every server
TP = 1


def server_cmd(model: str, port: int, mem: float, *extra: str, launcher: str = "launch_server") -> list[str]:
    tok = ["--skip-tokenizer-init"] if NO_TOKENIZER else ["--tokenizer-path", str(MODELS / "smollm2-135m")]
    extra = [x for x in extra if not (NO_TOKENIZER and x == "--skip-tokenizer-init")]
    tp = ["--tp-size", str(TP)] if TP > 1 else []
    return [*LAUNCHERS[launcher], "--model-path", str(MODELS / model), *tok,
            "--mem-fraction-static", str(mem), "--port", str(port), *FLAGS, *tp, *extra]


def wait_log(srv: Server, pattern: str, timeout: float = 300.0) -> re.Match:
    t0 = time.time()
    rx = re.compile(pattern)
    while time.time() - t0 < timeout:
        m = rx.search(srv.log_path.read_text(errors="replace"))
        if m:
            return m
        if srv.proc.poll() is not None:
            raise RuntimeError(f"server exited ({srv.proc.returncode}):\n{srv.tail(40)}")
        time.sleep(1)
    raise RuntimeError(f"no {pattern!r} in the log after {timeout:.0f} s:\n{srv.tail(40)}")


def scheduler_info(srv: Server) -> dict:
    info = srv.server_info()
    st = (info.get("internal_states") or [{}])[0]
    return {"max_total_num_tokens": info.get("max_total_num_tokens"),
            "max_running_requests": st.get("effective_max_running_requests_per_dp"),
            "oscar_int2": st.get("oscar_int2"), "attention_backend": info.get("attention_backend"),
            "kv_cache_dtype": info.get("kv_cache_dtype")}


def chat_checks(url: str) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = post_json(url + "/v1/chat/completions", body, timeout=120)
    ok_plain = isinstance(r, dict) and r["usage"]["completion_tokens"] > 0 and "message" in r["choices"][0]
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks, done = 0, False
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data:"):
                json.loads(line[5:])
                chunks += 1
    g = post_json(url + "/generate", {"text": "The capital of France is",
                                      "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}, timeout=120)
    ok_gen = isinstance(g, dict) and g["meta_info"]["completion_tokens"] == 16
    return {"chat": ok_plain, "chat_completion_tokens": r["usage"]["completion_tokens"] if ok_plain else None,
            "chat_stream_chunks": chunks, "chat_stream_done": done, "generate": ok_gen,
            "ok": bool(ok_plain and done and chunks >= 2 and ok_gen)}


def mixed_requests(n: int = 64, seed: int = 0) -> list[list[int]]:
    """Mixed lengths up to 32K: 6 x 32000, 6 x 16000, 12 x 4000, 40 x 64..2000; 16 of the
    short ones share a 1500-token prefix (radix sharing when the cache is on)."""
    rng = random.Random(seed)
    lens = [32000] * 6 + [16000] * 6 + [4000] * 12 + [rng.randint(64, 2000) for _ in range(n - 24)]
    shared = [rng.randrange(100, 40000) for _ in range(1500)]
    out = []
    for i, L in enumerate(lens):
        ids = [rng.randrange(100, 40000) for _ in range(L)]
        if i >= n - 16:
            ids = shared + ids
        out.append(ids)
    rng.shuffle(out)
    return out


def concurrent_run(url: str, prompts: list[list[int]], out_len: int = 32) -> dict:
    def one(ids):
        t0 = time.time()
        r = post_json(url + "/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": out_len, "ignore_eos": True, "temperature": 0}}, timeout=600)
        m = r["meta_info"]
        return (m["completion_tokens"] == out_len and m["prompt_tokens"] == len(ids)), time.time() - t0

    t0 = time.time()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        res = list(ex.map(one, prompts))
    return {"requests": len(prompts), "completed_ok": sum(ok for ok, _ in res),
            "prompt_tokens": sum(map(len, prompts)), "max_prompt": max(map(len, prompts)),
            "wall_s": round(time.time() - t0, 1), "max_latency_s": round(max(t for _, t in res), 1),
            "ok": all(ok for ok, _ in res)}


def make_rotation_file(path: Path, model: str) -> str:
    import torch

    from oscar_sglang.common import rotations as R

    cfg = json.loads((MODELS / model / "config.json").read_text())
    L, H = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    g = torch.Generator().manual_seed(1)
    rk = torch.linalg.qr(torch.randn(L, H, D, D, generator=g, dtype=torch.float64))[0].float()
    rv = torch.linalg.qr(torch.randn(L, 1, D, D, generator=g, dtype=torch.float64))[0].float()
    rs = R.RotationSet(rk, rv, torch.full((L,), 0.96), torch.full((L,), 0.92),
                       metadata={"recipe": "oscar", "model_id": model, "note": "random orthogonal, e2e test"})
    return R.save_rotation_file(rs, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--mem", type=float, default=0.85)
    ap.add_argument("--phases", default="int2,noradix,bf16")
    ap.add_argument("--tap-layer", type=int, default=5)
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--no-concurrent", action="store_true", help="skip the 64-request runs")
    ap.add_argument("--skip-tokenizer", action="store_true", help="no tokenizer: skip the chat/text API checks")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of every server (GPUs needed)")
    a = ap.parse_args()
    global NO_TOKENIZER, TP
    NO_TOKENIZER, TP = a.skip_tokenizer, a.tp
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict = _results.document(a.model, [], mem_fraction_static=a.mem, tp_size=a.tp)

    def save():
        _results.write(a.out / "results.json", res)

    def phase(name: str) -> dict:
        """This phase's row (one per phase, in run order)."""
        res["rows"].append({"phase": name})
        return res["rows"][-1]

    rot = a.out / "rot_random_orthogonal.safetensors"
    res["rotation_sha256"] = make_rotation_file(rot, a.model)
    int2_env = {"OSCAR_ROTATION": str(rot), "PYTHONUNBUFFERED": "1"}
    phases = a.phases.split(",")

    def phase_bf16():
        t0 = time.time()
        r = phase("bf16")
        try:
            cmd = server_cmd(a.model, a.port, a.mem, "--attention-backend", "triton", "--disable-cuda-graph",
                             "--skip-tokenizer-init")
            with Server(cmd, {}, a.out / "bf16.log", a.port, **SPEED) as srv:
                m = wait_log(srv, r"max_total_num_tokens=(\d+)")
                r["max_total_num_tokens"] = int(m.group(1))
        except Exception as e:  # noqa: BLE001
            r["error"] = str(e)[-3000:]
        r["phase_s"] = round(time.time() - t0)
        print("bf16:", r, flush=True)
        save()

    def phase_int2():
        t0 = time.time()
        r = phase("int2")
        try:
            # our launcher: --kv-cache-dtype int2 is its default
            cmd = server_cmd(a.model, a.port, a.mem, "--enable-metrics", launcher="oscar-sglang serve")
            r["launcher"] = "oscar-sglang serve"
            with Server(cmd, int2_env, a.out / "int2.log", a.port, **SPEED) as srv:
                srv.wait_ready(300)
                r["startup_s"] = round(srv.startup_s)
                r["info"] = scheduler_info(srv)
                oi = r["info"].get("oscar_int2") or {}
                r["server_info_ok"] = (oi.get("rotation_sha256") == res["rotation_sha256"]
                                       and oi.get("max_total_num_tokens") == r["info"]["max_total_num_tokens"])
                if not a.skip_tokenizer:
                    r["api"] = chat_checks(srv.url)
                    print("int2 api:", r["api"], flush=True)
                save()
                if not a.no_concurrent:
                    r["concurrent_64"] = concurrent_run(srv.url, mixed_requests())
                    print("int2 64:", r["concurrent_64"], flush=True)
                with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as m:
                    metrics = m.read().decode()
                r["metrics"] = [ln for ln in metrics.splitlines() if ln.startswith("sglang:oscar_int2")][:10]
                log = srv.log_path.read_text(errors="replace")
                r["cuda_graph_decode_seen"] = "cuda graph: True" in log
                r["pool_log_line"] = next((ln for ln in log.splitlines() if "OSCAR INT2 KV pool:" in ln), None)
                r["rotation_log_line"] = next((ln for ln in log.splitlines() if "OSCAR INT2 KV cache:" in ln), None)
        except Exception as e:  # noqa: BLE001
            r["error"] = str(e)[-3000:]
        r["phase_s"] = round(time.time() - t0)
        save()

    def phase_noradix():
        t0 = time.time()
        r = phase("noradix")
        tap = a.out / "tap"
        try:
            env = {**int2_env, "OSCAR_DEBUG_TAP_DIR": str(tap), "OSCAR_DEBUG_TAP_LAYER": str(a.tap_layer)}
            cmd = server_cmd(a.model, a.port, a.mem, "--kv-cache-dtype", "int2", "--disable-radix-cache",
                             "--chunked-prefill-size", "4096", launcher="sglang serve")
            r["launcher"] = "sglang serve"
            with Server(cmd, env, a.out / "noradix.log", a.port, **SPEED) as srv:
                srv.wait_ready(300)
                r["startup_s"] = round(srv.startup_s)
                time.sleep(8)  # let SGLang's own warm-up request finish: the tap wants batch size 1
                rng = random.Random(7)
                ids = [rng.randrange(100, 40000) for _ in range(10000)]
                before = set(tap.glob("rank*/extend_*.pt"))
                g = post_json(srv.url + "/generate", {"input_ids": ids, "sampling_params": {
                    "max_new_tokens": 4, "ignore_eos": True}}, timeout=300)
                r["tap_request_ok"] = g["meta_info"]["completion_tokens"] == 4
                time.sleep(1)
                accs = analyse_ranks(tap, before)
                r["tap_ranks"] = [acc["rank"] for acc in accs]
                r["accuracy"] = accs[0] if accs else None  # rank 0 (the only one without --tp)
                if TP > 1:
                    r["accuracy_other_ranks"] = accs[1:]
                r["accuracy_ok"] = len(accs) == TP and all(acc["ok"] for acc in accs)
                print("accuracy:", json.dumps(r["accuracy"])[:800], flush=True)
                save()
                if not a.no_concurrent:
                    r["concurrent_64"] = concurrent_run(srv.url, mixed_requests(seed=1))
                    print("noradix 64:", r["concurrent_64"], flush=True)
        except Exception as e:  # noqa: BLE001
            r["error"] = str(e)[-3000:]
        r["phase_s"] = round(time.time() - t0)
        save()

    runners = {"bf16": phase_bf16, "int2": phase_int2, "noradix": phase_noradix}
    for name in phases:
        runners[name]()

    rows = {r["phase"]: r for r in res["rows"]}
    bf = rows.get("bf16", {}).get("max_total_num_tokens")
    info = rows.get("int2", {}).get("info") or {}
    cap = info.get("max_total_num_tokens") or (info.get("oscar_int2") or {}).get("max_total_num_tokens")
    if bf and cap:
        res["capacity_ratio_int2_vs_bf16"] = round(cap / bf, 3)
    save()
    print(json.dumps(res, indent=1, default=str)[:6000])
    return 0


def analyse_ranks(tap: Path, before: set) -> list[dict]:
    """analyse_tap for every rank folder the tap wrote (rank order), files new since `before`."""
    dirs = sorted(tap.glob("rank*"), key=lambda d: int(d.name[len("rank"):]))
    out = []
    for d in dirs:
        acc = analyse_tap(d / "meta.pt", sorted(set(d.glob("extend_*.pt")) - before))
        out.append({"rank": int(d.name[len("rank"):]), **acc})
    return out


def analyse_tap(meta_path: Path, files: list[Path]) -> dict:
    import torch

    from oscar_sglang.runtime.debug_tap import check_request

    meta = torch.load(meta_path, weights_only=False)
    chunks = [torch.load(f, weights_only=False) for f in files]
    chunks = [c for c in chunks if c["seq_len"] <= 10000]  # the 10K tap request's prefill chunks
    out = check_request(meta, chunks)
    out["tap_files"] = len(files)
    out["chunk_sizes"] = [c["q"].shape[0] for c in chunks]
    out["rotation"] = {k: meta["info"].get(k) for k in ("recipe", "rotation_sha256", "group_size")}
    cs = out["chunks"]
    out["ok"] = bool(cs) and all(
        c["rel_err_server_vs_int2_emulation"] <= 0.03
        and c["rel_err_server_vs_bf16"] <= 1.5 * c["rel_err_int2_emulation_vs_bf16"] + 0.02
        # the stored prefix read back (per-channel formats): BF16 rounding of the dequantised body
        and c.get("rel_err_stored_k_vs_emulation", 0.0) <= 0.02
        and c.get("rel_err_stored_v_vs_emulation", 0.0) <= 0.02
        for c in cs)
    return out


if __name__ == "__main__":
    sys.exit(main())
