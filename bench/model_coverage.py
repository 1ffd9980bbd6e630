"""Model coverage matrix: does `--kv-cache-dtype int2` serve each architecture, or refuse it clearly?

For each row of launch/models/matrix.json (a dummy-weight config.json of a published model, its
kind, extra server flags, the GPUs it needs, what int2 is expected to do and why), one after
another, each server alone on the GPU:
  1. start `sglang.launch_server --kv-cache-dtype int2 --attention-backend oscar_triton
     --load-format dummy` on a work copy of the config with the devkit's SmolLM2 tokenizer (for the
     VLM row: that tokenizer padded to Qwen's ids plus the vision tokens, the Qwen2-VL chat
     template and the image processor config, so image requests are processed for real; every
     tokenizer is fitted to the model's vocab_size: cut, or padded so every generated id decodes);
  2. if it comes up: kv_tokens_int2 (max_total_num_tokens), one /v1/chat/completions (chat_ok:
     HTTP 200, a message and at least one completion token) and, for the VLM, a turn with a small
     PNG made here (image_ok: 200 and more prompt tokens than the same turn without the image);
     if it exits: status "refused" when the plugin's refusal ("--kv-cache-dtype int2 cannot
     start") is in its log (message = that refusal), else "failed" (message = the log's last error);
  3. the same model with the stock BF16 cache (--attention-backend triton) for kv_tokens_bf16
     (for refused rows only with --bf16-for-refused: they may not fit, e.g. Qwen3-Next 80B).
Rows that need more GPUs than are visible are "skipped". The JSON is rewritten after each row;
rows of an existing --out file are kept and replaced by name, so the matrix can be filled over
several device calls (--models picks rows and the order they run in; the JSON keeps matrix order).

Device run (H100; see ../shared/devkit/README.md). Carry .devkit/sgl_bundle.tar.xz,
.devkit/device-env.sh and .devkit/smollm2_tok.tar.xz (bench/serving.py says how to make it), and
(bench/results/coverage_h100.json, once committed, travels with the tree); then, per call
(10 minutes each):

  mkdir -p .devkit/models && tar -C .devkit/models -xJf .devkit/smollm2_tok.tar.xz && source .devkit/device-env.sh &&
  cp bench/results/coverage_h1*.json $OUT/ 2>/dev/null;  # the kept rows, if any
  python -m bench.model_coverage --models llama31-8b,llama31-8b-fp8,qwen3-8b,llama32-1b --out $OUT/coverage_h100.json

About 1.5-2 minutes per served row (two server starts, dummy weights, CUDA graphs up to batch 8)
and 20-40 s per refused row; the first start on a fresh machine also JIT-compiles flashinfer's
rmsnorm (~1 minute). Four calls cover the 13 single-GPU rows; llama31-8b-tp2 needs
--kind nvidia-h200-x2. Copy $OUT/coverage_h100.json to bench/results/ after each call.
"""
from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import re
import shlex
import shutil
import struct
import sys
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from bench import _results
from bench._launcher import Server

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "launch" / "models"
MATRIX = MODELS / "matrix.json"
DEFAULT_JSON = "coverage_h100.json"
SMOLLM2 = ROOT / ".devkit" / "models" / "smollm2-135m"
DEFAULT_SERVER_ARGS = ("--load-format dummy --sampling-backend pytorch --grammar-backend none "
                       "--disable-prefill-cuda-graph --cuda-graph-max-bs 8 --mem-fraction-static 0.85")
KV_ARGS = {"int2": ["--kv-cache-dtype", "int2", "--attention-backend", "oscar_triton"],
           "bf16": ["--attention-backend", "triton"]}
REFUSAL = re.compile(r"--kv-cache-dtype int2 cannot start:\n(?:[ \t]+- .*\n?)+")
WARMUP = re.compile(r"OSCAR INT2: prefill kernels compiled at start \(([\d.]+) s\)")  # the backend's warm-up line
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Qwen2-VL's special tokens and ids (the same in every Qwen2 / Qwen2.5 tokenizer)
QWEN_VISION_TOKENS = (("<|vision_start|>", 151652), ("<|vision_end|>", 151653), ("<|vision_pad|>", 151654),
                      ("<|image_pad|>", 151655), ("<|video_pad|>", 151656))
# Qwen2-VL's chat template, images only (no video)
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ----------------------------------------------------------------------------- inputs


def load_matrix(path: Path = MATRIX) -> list[dict]:
    rows = json.loads(Path(path).read_text())["rows"]
    names = [r["name"] for r in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: row names must be unique")
    return rows


def png_bytes(w: int = 64, h: int = 64) -> bytes:
    """A small RGB gradient PNG, made here (no image library needed)."""
    raw = b"".join(b"\x00" + bytes(v for x in range(w) for v in (x * 255 // w, y * 255 // h, 128))
                   for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def fit_tokenizer(src: Path, dst: Path, vocab_size: int, added: tuple = ()) -> None:
    """SmolLM2's tokenizer fitted to a model's vocab_size, written to dst.

    Smaller vocabulary (Llama-2, TinyLlama, Mistral: 32000): cut to ids < vocab_size. SGLang
    0.5.17 never checks prompt ids against the embedding, so a larger id would index past it on
    the GPU; byte-level BPE keeps every byte symbol in the first few hundred ids, so any text still
    tokenises. Larger vocabulary: padded with unreachable `<|unused_N|>` entries, so every id a
    dummy-weight model generates decodes to visible text (an id the tokenizer lacks decodes to
    nothing, which would hide garbled output). `added`: (token, id) special tokens that must land
    at these ids (Qwen's vision tokens); the padding stops below the first of them, because
    tokenizers numbers added tokens after the vocabulary."""
    tok = json.loads((src / "tokenizer.json").read_text())
    m = tok["model"]
    ids = [i for _, i in added]
    if ids and ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"added token ids must be consecutive: {ids}")
    top = ids[0] if ids else vocab_size
    if len(m["vocab"]) > top:
        m["vocab"] = {t: i for t, i in m["vocab"].items() if i < top}
        keep = m["vocab"]

        def ok(merge) -> bool:
            a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
            return a in keep and b in keep and a + b in keep

        m["merges"] = [x for x in m["merges"] if ok(x)]
        tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < top]
    for i in range(len(m["vocab"]), top):
        m["vocab"][f"<|unused_{i}|>"] = i
    tok["added_tokens"] += [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for t, i in added]
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    for f in TOKENIZER_FILES[1:]:
        shutil.copy(src / f, dst / f)


def vlm_tokenizer(src: Path, dst: Path, config: dict) -> None:
    """The fitted tokenizer with Qwen's vision tokens at the ids the Qwen2.5-VL config names, its
    chat template (images) and the processor's names for the image and video tokens."""
    ids = dict(QWEN_VISION_TOKENS)
    for key, name in (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                      ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>")):
        if key in config and config[key] != ids[name]:
            raise ValueError(f"{key}={config[key]}: expected Qwen's {ids[name]}")
    fit_tokenizer(src, dst, config["vocab_size"], QWEN_VISION_TOKENS)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)
    cfg["image_token"] = "<|image_pad|>"
    cfg["video_token"] = "<|video_pad|>"
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)


def model_dir(row: dict, work: Path, tokenizer_src: Path) -> Path:
    """A work folder with the row's config (and VLM processor config) and a tokenizer."""
    src = MODELS / row["config"]
    dst = work / row["name"]
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    missing = [f for f in TOKENIZER_FILES if not (tokenizer_src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{tokenizer_src} lacks {missing}: unpack the devkit's smollm2 folder "
                                "(tar -C .devkit/models -xJf .devkit/smollm2_tok.tar.xz) or pass --tokenizer")
    if row.get("vlm"):
        vlm_tokenizer(tokenizer_src, dst, config)
    else:
        fit_tokenizer(tokenizer_src, dst, config["vocab_size"])
    return dst


# ----------------------------------------------------------------------------- HTTP


def _get(url: str, timeout: float = 30.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def _post(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:500]
    except (urllib.error.URLError, OSError, ValueError) as e:
        return 0, f"{type(e).__name__}: {e}"


def chat(url: str, model: str, content, max_tokens: int = 16) -> dict:
    """One greedy chat turn -> {ok, status, prompt_tokens, completion_tokens, error}."""
    status, body = _post(url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0.0})
    if status != 200 or not isinstance(body, dict):
        return {"ok": False, "status": status, "error": str(body)[:300]}
    usage = body.get("usage") or {}
    msg = ((body.get("choices") or [{}])[0]).get("message")
    ok = isinstance(msg, dict) and isinstance(msg.get("content"), str) and (usage.get("completion_tokens") or 0) >= 1
    return {"ok": ok, "status": status, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            **({} if ok else {"error": f"no message or no completion token: {str(body)[:300]}"})}


def probe_server(url: str, vlm: bool) -> dict:
    """What one running server does: KV tokens, a chat turn, and for a VLM an image turn."""
    info = _get(url + "/server_info")
    models = _get(url + "/v1/models")
    model = models["data"][0]["id"]
    out = {"kv_tokens": info.get("max_total_num_tokens"), "server_model": model}
    # what the plugin says it stores (an int2 server's internal state; absent for BF16)
    oscar = ((info.get("internal_states") or [{}])[0] or {}).get("oscar_int2") or {}
    out["kv_format"], out["body_bits_per_element"] = oscar.get("kv_format"), oscar.get("body_bits_per_element")
    out["triton_compiled_at_start_s"] = (oscar.get("compiled_at_start") or {}).get("s")
    text = chat(url, model, "What is the capital of France?")
    out["chat"] = text
    if vlm:
        question = [{"type": "text", "text": "What colours does this image have?"}]
        image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                     + base64.b64encode(png_bytes()).decode()}}]
        with_image, without = chat(url, model, image + question), chat(url, model, question)
        # the image was really turned into tokens: the same turn is longer with it
        grew = (with_image.get("prompt_tokens") or 0) > (without.get("prompt_tokens") or 0) > 0
        out["image"] = {**with_image, "ok": with_image["ok"] and grew,
                        "prompt_tokens_without_image": without.get("prompt_tokens")}
        out["chat_text_only_turn"] = without
    return out


# ----------------------------------------------------------------------------- servers


def server_command(model: Path, kv: str, row: dict, port: int, server_args: str) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--tokenizer-path", str(model), "--host", "127.0.0.1", "--port", str(port),
            *KV_ARGS[kv], *shlex.split(server_args), *row.get("args", [])]


def refusal_message(log: str) -> str | None:
    m = REFUSAL.search(log)
    return m.group(0).strip() if m else None


def last_error(log: str) -> str:
    lines = [ln for ln in log.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"Error|Exception|error:", ln)]
    return (errs[-1] if errs else (lines[-1] if lines else "no output")).strip()[:500]


def run_server(model: Path, kv: str, row: dict, port: int, args, log_dir: Path) -> dict:
    """Start one server, probe it, stop it -> {up, startup_s, probe | refusal | error, log}."""
    cmd = server_command(model, kv, row, port, args.server_args)
    log = log_dir / f"{row['name']}_{kv}.log"
    env = row.get("env", {}) if kv == "int2" else {}  # plugin settings (e.g. OSCAR_KV_FORMAT)
    res = {"command": shlex.join(cmd), "env": env, "log": str(log)}
    print(f"== {row['name']} {kv}: {' '.join(f'{k}={v}' for k, v in env.items())} {res['command']}",
          file=sys.stderr, flush=True)
    with Server(cmd, env, log, port) as srv:
        try:
            res["startup_s"] = round(srv.wait_ready(args.startup_timeout, poll_s=0.5), 1)
        except RuntimeError as e:
            text = log.read_text(errors="replace") if log.exists() else str(e)
            res.update(up=False, refusal=refusal_message(text), error=last_error(text))
            return res
        res["up"] = True
        # where a long start went: the plugin's prefill warm-up (its log line; not in /server_info)
        m = WARMUP.search(log.read_text(errors="replace")) if log.exists() else None
        res["prefill_warmup_s"] = float(m.group(1)) if m else None
        try:
            res["probe"] = probe_server(srv.url, bool(row.get("vlm")))
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
            res["error"] = f"probe failed: {type(e).__name__}: {e}"
        if srv.proc.poll() is not None:  # it answered (or not) and then died
            text = log.read_text(errors="replace")
            res["error"] = f"the server exited after the requests: {last_error(text)}"
    return res


def build_row(row: dict, int2: dict | None, bf16: dict | None, skipped: str | None = None) -> dict:
    """One results row from the int2 and bf16 server results."""
    out = {"model": row["name"], "kind": row["kind"], "config": f"launch/models/{row['config']}/config.json",
           "args": row.get("args", []), "expect": row["expect"], "why": row.get("why"),
           "status": None, "chat_ok": None, "image_ok": None, "kv_tokens_int2": None, "kv_tokens_bf16": None,
           "kv_format": None, "body_bits_per_element": None, "message": None}
    if skipped:
        out.update(status="skipped", message=skipped)
    elif int2 is not None:
        if int2.get("up"):
            p = int2.get("probe") or {}
            chat_ok = (p.get("chat") or {}).get("ok")
            # served = it came up, answered the chat turn and is still alive
            served = bool(chat_ok) and not int2.get("error")
            out.update(status="served" if served else "failed", kv_tokens_int2=p.get("kv_tokens"),
                       kv_format=p.get("kv_format"), body_bits_per_element=p.get("body_bits_per_element"),
                       chat_ok=chat_ok, message=int2.get("error") or (
                           None if served else f"chat: {(p.get('chat') or {}).get('error')}"))
            if row.get("vlm"):
                out["image_ok"] = (p.get("image") or {}).get("ok")
                out["image_detail"] = p.get("image")
            if not out["chat_ok"] and p.get("chat"):
                out["chat_error"] = p["chat"].get("error")
        elif int2.get("refusal"):
            out.update(status="refused", message=int2["refusal"])
        else:
            out.update(status="failed", message=int2.get("error"))
        out["int2_startup_s"] = int2.get("startup_s")
        out["int2_prefill_warmup_s"] = int2.get("prefill_warmup_s")
        out["int2_triton_compiled_at_start_s"] = (int2.get("probe") or {}).get("triton_compiled_at_start_s")
        out["int2_log"] = int2.get("log")
    if bf16 is not None:
        p = bf16.get("probe") or {}
        out["kv_tokens_bf16"] = p.get("kv_tokens")
        out["bf16_chat_ok"] = (p.get("chat") or {}).get("ok") if bf16.get("up") else False
        if not bf16.get("up"):
            out["bf16_error"] = bf16.get("error")
        out["bf16_log"] = bf16.get("log")
    if out["kv_tokens_int2"] and out["kv_tokens_bf16"]:
        out["kv_ratio_int2_vs_bf16"] = round(out["kv_tokens_int2"] / out["kv_tokens_bf16"], 3)
    out["as_expected"] = out["status"] == row["expect"] and (
        not row.get("vlm") or out["status"] != "served" or bool(out["image_ok"]))
    return out


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 (no torch / no CUDA: no GPU)
        return 0


def next_row_estimate(took: list[float]) -> float:
    """How long the next row may take: the longest row so far, leaving out the first one once
    others have run (it pays the machine's one-time compiles: on a bare H200 on 2026-11-29 the
    first start took 223 s, 88 s of it the prefill warm-up's compiles, and most later rows
    55-92 s)."""
    return max(took[1:] or took or [0.0])


def merge_rows(old: list[dict], new: list[dict], order: list[str]) -> list[dict]:
    """Rows of an earlier file, replaced by name with this run's, in matrix order."""
    by = {r["model"]: r for r in old}
    by.update({r["model"]: r for r in new})
    return sorted(by.values(), key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))


def write(path: Path, rows: list[dict], command: str, device: str, runs: list) -> None:
    doc = _results.document("coverage matrix (dummy weights)", rows, device=device, runs=runs,
                            notes={"status": "served | refused (the plugin's startup refusal) | failed "
                                             "(any other startup or request error) | skipped",
                                   "kv_tokens": "max_total_num_tokens at the same --mem-fraction-static",
                                   "served": "up, answered the chat turn (HTTP 200, >= 1 completion "
                                             "token) and still alive afterwards",
                                   "as_expected": "status == expect, and a served VLM also answered "
                                                  "the image turn"})
    doc["command"] = command
    _results.write(path, doc)


def main(argv: list[str] | None = None) -> int:
    env_out = os.environ.get("OUT")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="", help="comma-separated row names (default: every row)")
    p.add_argument("--matrix", default=str(MATRIX))
    p.add_argument("--tokenizer", default=str(SMOLLM2), help="folder with tokenizer.json, "
                   "tokenizer_config.json, chat_template.jinja (default: the devkit's smollm2-135m)")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help=f"default: {DEFAULT_SERVER_ARGS}")
    p.add_argument("--no-bf16", action="store_true", help="do not start the BF16 servers (no kv_tokens_bf16)")
    p.add_argument("--bf16-for-refused", action="store_true", help="also start BF16 for rows int2 refused")
    p.add_argument("--port", type=int, default=31400)
    p.add_argument("--startup-timeout", type=float, default=420.0)
    p.add_argument("--deadline-s", type=float, default=570.0,
                   help="skip a row that would end after this, judged by the longest row so far "
                        "after the first (which pays the one-time compiles)")
    p.add_argument("--work-dir", default=str(Path(env_out or ROOT / "bench_out") / "coverage_models"))
    p.add_argument("--log-dir", default=str(Path(env_out or ROOT / "bench_out") / "coverage_logs"))
    p.add_argument("--out", default=str(Path(env_out) / DEFAULT_JSON) if env_out else str(_results.RESULTS / DEFAULT_JSON),
                   help=f"results JSON, updated in place (default $OUT/{DEFAULT_JSON}, else bench/results/{DEFAULT_JSON})")
    p.add_argument("--gpus", type=int, default=None, help="GPUs available (default: torch.cuda.device_count())")
    p.add_argument("--print-commands", action="store_true")
    args = p.parse_args(argv)
    try:
        matrix = load_matrix(Path(args.matrix))
        want = [m for m in (x.strip() for x in args.models.split(",")) if m]
        unknown = [m for m in want if m not in {r["name"] for r in matrix}]
        if unknown:
            raise ValueError(f"unknown --models {unknown}; rows: {[r['name'] for r in matrix]}")
    except (ValueError, OSError, KeyError) as e:
        p.error(str(e))
    # run in the order asked (quick rows first fit more into one device call); results stay in matrix order
    by_name = {r["name"]: r for r in matrix}
    rows = [by_name[m] for m in dict.fromkeys(want)] if want else matrix
    if args.print_commands:
        for r in rows:
            for kv in ("int2", "bf16"):
                print(f"{r['name']} {kv}: {shlex.join(server_command(Path(args.work_dir) / r['name'], kv, r, args.port, args.server_args))}")
        return 0
    out = Path(args.out)
    command = _results.command("model_coverage", sys.argv[1:] if argv is None else argv)
    old = json.loads(out.read_text()) if out.is_file() else {"rows": [], "runs": []}
    device = _results.device_name()
    runs = old.get("runs", []) + [{"command": command, "device": device, "models": [r["name"] for r in rows],
                                   "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}]
    gpus = visible_gpus() if args.gpus is None else args.gpus
    work, logs = Path(args.work_dir), Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    done, t0, took = [], time.monotonic(), []
    for i, row in enumerate(rows):
        start = time.monotonic()
        if start - t0 + next_row_estimate(took) > args.deadline_s:
            res = build_row(row, None, None, skipped=f"not run: it would end past --deadline-s {args.deadline_s:g}")
        elif row.get("gpus", 1) > gpus:
            res = build_row(row, None, None, skipped=f"needs {row.get('gpus')} GPUs, {gpus} visible")
        else:
            try:
                model = model_dir(row, work, Path(args.tokenizer))
                int2 = run_server(model, "int2", row, args.port + 2 * i, args, logs)
                bf16 = None
                if not args.no_bf16 and (int2.get("up") or args.bf16_for_refused):
                    bf16 = run_server(model, "bf16", row, args.port + 2 * i + 1, args, logs)
                res = build_row(row, int2, bf16)
            except Exception as e:  # one broken row must not lose the others
                res = {**build_row(row, None, None), "status": "failed", "message": f"{type(e).__name__}: {e}",
                       "as_expected": False}
            took.append(time.monotonic() - start)
        done.append(res)
        write(out, merge_rows(old.get("rows", []), done, [r["name"] for r in matrix]), command, device, runs)
        print(f"{res['model']:>20} {res['kind']:<15} {res['status']:<8} expect {res['expect']:<8} chat {res['chat_ok']} "
              f"image {res['image_ok']} kv int2 {res['kv_tokens_int2']} bf16 {res['kv_tokens_bf16']}"
              + (f"\n{'':>21}{res['message']}" if res.get("message") else ""), flush=True)
    print(f"wrote {out}")
    return 0 if all(r.get("as_expected") or r["status"] == "skipped" for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
