"""The speed harnesses' server configurations and what a server's log says.

CONFIGS names each KV-cache / attention configuration; server_command turns a (model,
configuration) pair into a `python -m sglang.launch_server` command on 127.0.0.1 (bench/_launcher.py
starts and stops it). The flags are the devkit ones (dummy weights, no tokenizer in the request
path) so that the numbers measure the serving engine, not tokenisation. The log parsers read the
scheduler's periodic decode and prefill lines.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import sys
import urllib.request
from pathlib import Path
from typing import Dict, List

# Server flags shared by every configuration (see ../shared/devkit/README.md for why each is there).
COMMON_FLAGS = [
    "--load-format", "dummy",
    "--skip-tokenizer-init",
    "--sampling-backend", "pytorch",
    "--grammar-backend", "none",
    "--disable-prefill-cuda-graph",
    # each streamed chunk carries only its new token ids: by default SGLang sends a request's whole
    # output so far in every chunk (O(n^2) JSON per request), why the client received only ~7.7K
    # tok/s on 256 x 2K + 1024 while int2's scheduler decoded 11.5-13.4K tok/s
    # (results/serving_vs_fp8_h100_2026-11-27_0253_scheduler_rates.json); with this flag the
    # client's rate matches the scheduler's (results/serving_vs_fp8_h200_2026-11-27_0428.json)
    "--incremental-streaming-output",
    "--host", "127.0.0.1",
]


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """One KV-cache / attention configuration under test."""

    name: str
    label: str
    args: List[str]
    env: Dict[str, str] = dataclasses.field(default_factory=dict)


# `int2` is the oscar_sglang plugin (entry point loaded by stock SGLang); its tuning knobs are
# environment variables documented in docs/serving.md, passed with --int2-env KEY=VAL.
CONFIGS: Dict[str, ServingConfig] = {
    "bf16": ServingConfig("bf16", "BF16 KV, triton", ["--attention-backend", "triton"]),
    # Same kernel with more KV splits: at batch 1 the default 8 splits leave most SMs idle.
    "bf16-splits64": ServingConfig(
        "bf16-splits64", "BF16 KV, triton, 64 KV splits",
        ["--attention-backend", "triton", "--triton-attention-num-kv-splits", "64"],
    ),
    "int2-splits64": ServingConfig(
        "int2-splits64", "INT2 KV, oscar_triton, 64 KV splits",
        ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton",
         "--triton-attention-num-kv-splits", "64"],
    ),
    "flashinfer": ServingConfig(
        "flashinfer", "BF16 KV, flashinfer", ["--attention-backend", "flashinfer"]
    ),
    # SGLang's own FP8 KV cache, the peer int2 is compared with (same kernel family as int2)
    "fp8-splits64": ServingConfig(
        "fp8-splits64", "FP8 e4m3 KV, triton, 64 KV splits",
        ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "triton",
         "--triton-attention-num-kv-splits", "64"],
    ),
    # the OSCAR per-token recipe (the default until 2026-11-25), same kernels' family and splits
    "int2-token-splits64": ServingConfig(
        "int2-token-splits64", "INT2 KV (OSCAR per-token recipe), oscar_triton, 64 KV splits",
        ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton",
         "--triton-attention-num-kv-splits", "64"], {"OSCAR_KV_FORMAT": "token"},
    ),
    # the default format until 2026-11-29 (3-bit keys, two value groups a 128-dim head)
    "int2-k3c64-v2t64": ServingConfig(
        "int2-k3c64-v2t64", "INT2 KV (k3c64-v2t64-s4-w128, the default until 2026-11-29), oscar_triton",
        ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton"],
        {"OSCAR_KV_FORMAT": "k3c64-v2t64-s4-w128"},
    ),
    # int2 with the V rotation applied by the backend every step instead of folded into W_v / W_o
    "int2-vruntime": ServingConfig(
        "int2-vruntime", "INT2 KV, oscar_triton, V rotation at run time",
        ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton"], {"OSCAR_V_ABSORB": "0"},
    ),
    "int2": ServingConfig(
        "int2",
        "INT2 KV, oscar_triton",
        ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton"],
    ),
    # int2 with the new tokens of a prefill chunk on SGLang's Triton extend kernel (the default
    # until 2026-11-26; OSCAR_NEW_TOKEN_ATTENTION, now FlashInfer's ragged prefill by default)
    "int2-triton-new-tokens": ServingConfig(
        "int2-triton-new-tokens", "INT2 KV, oscar_triton, new tokens on SGLang's Triton extend",
        ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton"],
        {"OSCAR_NEW_TOKEN_ATTENTION": "triton"},
    ),
    # int2 reading every cached prefix with the INT2 prefix kernel (OSCAR_PREFIX_ATTENTION=int2; the
    # default until 2026-11-27, now FlashInfer over BF16 pieces for long prefill chunks)
    "int2-prefix-int2": ServingConfig(
        "int2-prefix-int2", "INT2 KV, oscar_triton, cached prefix read by the INT2 prefix kernel",
        ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton"],
        {"OSCAR_PREFIX_ATTENTION": "int2"},
    ),
    # int2 with a decode step's store in one launch that also rotates q and k (OSCAR_DECODE_STORE=
    # fused: three launches a layer fewer; opt-in until timed)
    "int2-fused-store": ServingConfig(
        "int2-fused-store", "INT2 KV, oscar_triton, one fused store launch a decode layer",
        ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton"],
        {"OSCAR_DECODE_STORE": "fused"},
    ),
    # int2 with SGLang's mixed chunked prefill (prefill chunks ride along decode steps)
    "int2-mixed-chunk": ServingConfig(
        "int2-mixed-chunk", "INT2 KV, oscar_triton, --enable-mixed-chunk",
        ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton", "--enable-mixed-chunk"],
    ),
    # SGLang's FP8 KV cache on its FlashInfer backend (FP8's other peer)
    "fp8-flashinfer": ServingConfig(
        "fp8-flashinfer", "FP8 e4m3 KV, flashinfer",
        ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "flashinfer"],
    ),
}


def kv_and_backend(config: ServingConfig) -> tuple:
    """(KV dtype, attention backend) a configuration runs: bf16 unless --kv-cache-dtype says
    otherwise; SGLang's default backend is not assumed (None when the flag is absent)."""
    def flag(name):
        return config.args[config.args.index(name) + 1] if name in config.args else None

    return flag("--kv-cache-dtype") or "bf16", flag("--attention-backend")


# Each server's torch.distributed rendezvous port, as an offset from its HTTP port. Left to SGLang,
# it is a free port found by binding and releasing one (get_free_port), which servers started side
# by side can race for: on 2026-11-27 (4 x H200) the FP8 server of four died at start with
# EADDRINUSE on it. Bench servers are 10 ports apart (serving_vs_fp8 --side-by-side).
NCCL_PORT_OFFSET = 5


def server_command(model_dir: Path, tokenizer_dir: Path, config: ServingConfig, port: int,
                   mem_fraction: float, extra: List[str]) -> List[str]:
    given = "--nccl-port" in config.args or "--nccl-port" in extra
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_dir),
        "--tokenizer-path", str(tokenizer_dir),
        "--mem-fraction-static", str(mem_fraction),
        "--port", str(port),
        *([] if given else ["--nccl-port", str(port + NCCL_PORT_OFFSET)]),
        *COMMON_FLAGS, *config.args, *extra,
    ]


def post_json(url: str, payload: dict, timeout: float = 60.0):
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read().decode()
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body



_DECODE_LINE = re.compile(r"(?:\[([\d-]+ [\d:]+)\] )?Decode batch.*?#running-req: (\d+), #token: (\d+)"
                          r".*?cuda graph: (\w+).*?gen throughput \(token/s\): ([\d.]+)")


def parse_decode_log(text: str) -> List[dict]:
    """The periodic 'Decode batch' lines (every 40 steps): time (the log's stamp, or None),
    running requests, tokens held, CUDA graph on/off, the scheduler's gen throughput."""
    out = []
    for m in _DECODE_LINE.finditer(text):
        out.append({"time": m.group(1), "running": int(m.group(2)), "tokens": int(m.group(3)),
                    "cuda_graph": m.group(4) == "True", "gen_tok_s": float(m.group(5))})
    return out


def scheduler_rates(dec: List[dict]) -> dict:
    """What the scheduler logged at a load's full occupancy (its lines with the most running
    requests): the median of their gen throughput (the first such line also spans the prefill
    before it, hence the median), the first and last of them after that one, and the time of the
    last decode line. Empty dict without decode lines."""
    if not dec:
        return {}
    most = max(d["running"] for d in dec)
    full = [d["gen_tok_s"] for d in dec if d["running"] == most]
    rest = full[1:] or full
    return {"scheduler_running": most, "scheduler_decode_tok_s": statistics.median(full),
            "scheduler_decode_tok_s_first": rest[0], "scheduler_decode_tok_s_last": rest[-1],
            "scheduler_last_decode_at": dec[-1]["time"], "scheduler_tokens_at_last": dec[-1]["tokens"]}


_PREFILL_LINE = re.compile(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)"
                           r".*?input throughput \(token/s\): ([\d.]+)")


PREFILL_FULL_SHARE = 0.9  # a prefill line this close to the chunk size is a full chunk (prefill_rates)


def parse_prefill_log(text: str) -> List[dict]:
    """The 'Prefill batch' lines (one per prefill forward): new and cached tokens, and the
    scheduler's input throughput (the new tokens over the time since its previous prefill line,
    so decode forwards in between count against it)."""
    return [{"new": int(m.group(1)), "cached": int(m.group(2)), "tok_s": float(m.group(3))}
            for m in _PREFILL_LINE.finditer(text)]


def prefill_rates(pre: List[dict]) -> dict:
    """A load's prefill as the scheduler logged it: the new tokens of all its prefill lines, and
    the median input throughput of its full chunks and how many there were. Full: at least
    PREFILL_FULL_SHARE of the most new tokens of a line (the chunked-prefill size; with
    --enable-mixed-chunk a chunk gives up one token per decode folded in). What bounds a load's
    wall time where every configuration prefills the same prompts. Empty dict without prefill
    lines."""
    if not pre:
        return {}
    chunk = max(p["new"] for p in pre)
    full = [p["tok_s"] for p in pre if p["new"] >= PREFILL_FULL_SHARE * chunk]
    return {"scheduler_prefill_tokens": sum(p["new"] for p in pre), "scheduler_prefill_chunk": chunk,
            "scheduler_prefill_tok_s": statistics.median(full), "scheduler_prefill_chunks": len(full)}


def loads_of_log(text: str) -> List[str]:
    """A finished server log cut where the bench flushed the cache (before the pool's start
    values and after every load), so each piece after the first holds one load's lines."""
    return text.split("Cache flushed successfully")


def log_slice(path: Path, start: int) -> str:
    """Text appended to the log since byte offset `start`."""
    with open(path, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")


def log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0
