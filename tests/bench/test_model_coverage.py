"""bench/model_coverage.py: the matrix's config files, the VLM tokenizer it builds, and its JSON, written
from stand-in servers on 127.0.0.1 that serve, refuse (printing the plugin's refusal) or crash."""
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pytest

from tests import free_ports

from bench import model_coverage as cov

pytestmark = [pytest.mark.slow,  # the module's cases take minutes on 2 cores: make test, not test-fast
              pytest.mark.usefixtures("fast_polls")]  # stand-in servers: see tests/conftest.py

SGLANG_MODELS = Path(importlib.util.find_spec("sglang").origin).parent / "srt" / "models"


def test_matrix_configs_are_small_valid_and_known_to_sglang():
    rows = cov.load_matrix()
    files = [p.read_text() for p in SGLANG_MODELS.glob("*.py")]

    def registered(arch):  # a file that defines the class and lists it in its EntryClass
        return any(re.search(rf"^class {arch}\(", t, re.M) and "EntryClass" in t
                   and re.search(rf"\b{arch}\b", t[t.rindex("EntryClass"):]) for t in files)

    for r in rows:
        path = cov.MODELS / r["config"] / "config.json"
        assert path.stat().st_size < 4096, path  # configs only: no weights, no tokenizers
        c = json.loads(path.read_text())
        for arch in c["architectures"]:  # a model class SGLang 0.5.17 registers
            assert registered(arch), arch
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads", heads)
        assert heads % kv == 0 and r["expect"] in ("served", "refused") and r["why"]
    assert not registered("NoSuchModelForCausalLM")
    # the kinds the issue asks for
    kinds = {r["kind"] for r in rows}
    assert {"moe", "vlm", "fp8-weights", "tp2", "mha", "dense-qknorm", "hybrid-linear", "sliding-window"} <= kinds
    dims, groups = set(), set()
    for r in rows:
        c = json.loads((cov.MODELS / r["config"] / "config.json").read_text())
        dims.add(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        groups.add(c["num_attention_heads"] // c.get("num_key_value_heads", c["num_attention_heads"]))
    assert {64, 128, 256} <= dims and {1, 4, 8} <= groups
    assert any(r["kind"] == "fp8-weights" and "--quantization" in r["args"] for r in rows)


def test_png_is_a_valid_image():
    from PIL import Image

    img = Image.open(io.BytesIO(cov.png_bytes(64, 48)))
    img.load()
    assert img.size == (64, 48) and img.mode == "RGB" and img.getpixel((63, 0))[0] > img.getpixel((0, 0))[0]


def test_vlm_tokenizer_puts_image_tokens_at_the_config_ids(tmp_path, smollm2_tokenizer):
    """The Qwen2.5-VL processor, loaded from the work folder, expands one image into image_pad
    tokens with the id the model config names (what SGLang's multimodal path looks for)."""
    from PIL import Image
    from transformers import AutoProcessor

    row = next(r for r in cov.load_matrix() if r.get("vlm"))
    d = cov.model_dir(row, tmp_path, smollm2_tokenizer)
    config = json.loads((d / "config.json").read_text())
    proc = AutoProcessor.from_pretrained(d)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colours?"}]}]
    text = proc.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in text
    ids = proc(text=[text], images=[Image.open(io.BytesIO(cov.png_bytes()))])["input_ids"][0]
    ids = list(ids)
    assert ids.count(config["image_token_id"]) >= 4 and config["vision_start_token_id"] in ids
    assert max(ids) < config["vocab_size"]


def test_a_padded_tokenizer_encodes_like_the_original_and_decodes_every_id(tmp_path, smollm2_tokenizer):
    from transformers import AutoTokenizer

    d = cov.model_dir(next(r for r in cov.load_matrix() if r["name"] == "llama31-8b"), tmp_path, smollm2_tokenizer)
    tok, full = AutoTokenizer.from_pretrained(d), AutoTokenizer.from_pretrained(smollm2_tokenizer)
    assert len(tok) == 128256 == json.loads((d / "config.json").read_text())["vocab_size"]
    text = "The capital of France is Paris. 12345 naïve 漢字"
    assert tok.encode(text) == full.encode(text)
    assert tok.decode([100000, 128255]) == "<|unused_100000|><|unused_128255|>"


STAND_IN = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
a = sys.argv[1:]
model = a[a.index("--model-path") + 1]
port = int(a[a.index("--port") + 1])
int2 = "int2" in a
cfg = json.load(open(model + "/config.json"))
# like transformers: Qwen's sliding_window only counts with use_sliding_window
if int2 and ((cfg.get("sliding_window") and cfg.get("use_sliding_window", True)) or cfg["model_type"] == "qwen3_next"):
    print("Traceback (most recent call last):\noscar_sglang.runtime.refusals.Int2Unsupported: "
          "--kv-cache-dtype int2 cannot start:\n  - sliding-window attention (sliding_window=4096) is "
          "not supported. Serve this model with the default BF16 KV cache instead.\n", flush=True)
    sys.exit(1)
if cfg["model_type"] == "gemma":
    print("RuntimeError: stand-in crash for gemma", flush=True)
    sys.exit(1)
if int2:
    print("[2026-11-29 14:30:24] OSCAR INT2: prefill kernels compiled at start (2.9 s)", flush=True)
class H(BaseHTTPRequestHandler):
    def log_message(self, *x): pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health": return self._send({})
        if self.path == "/server_info":
            oscar = {"oscar_int2": {"kv_format": "k4c64-v2t64-s4-w128", "body_bits_per_element": 3.5,
                                    "compiled_at_start": {"variants": 3, "s": 6.3, "kernels": []}}}
            return self._send({"max_total_num_tokens": 4000 if int2 else 1000,
                               "internal_states": [oscar if int2 else {}]})
        if self.path == "/v1/models": return self._send({"data": [{"id": model}]})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if cfg["model_type"] == "qwen3_moe":  # up, but every request fails
            self.send_response(500); self.send_header("Content-Length", "4"); self.end_headers()
            return self.wfile.write(b"boom")
        content = body["messages"][0]["content"]
        images = 0 if isinstance(content, str) else sum(p["type"] == "image_url" for p in content)
        self._send({"choices": [{"message": {"role": "assistant", "content": "x"}}],
                    "usage": {"prompt_tokens": 10 + 4 * images, "completion_tokens": 1}})
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_json_rows_from_stand_in_servers(tmp_path, monkeypatch, smollm2_tokenizer):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    real = cov.server_command
    seen = []

    def fake(model, kv, row, port, server_args):
        cmd = real(model, kv, row, port, server_args)
        seen.append(cmd)
        return [sys.executable, str(script), *cmd[3:]]  # drop "python -m sglang.launch_server"

    monkeypatch.setattr(cov, "server_command", fake)
    port = free_ports(2 * 6)  # an int2 and a BF16 server for each of the 6 rows
    out = tmp_path / "coverage.json"
    common = ["--tokenizer", str(smollm2_tokenizer), "--port", str(port), "--gpus", "1", "--out", str(out),
              "--work-dir", str(tmp_path / "w"), "--log-dir", str(tmp_path / "logs"), "--startup-timeout", "30"]
    rc = cov.main(["--models", "llama32-1b,qwen2.5-vl-7b,gemma2-2b,gemma-7b,llama31-8b-tp2,qwen3-30b-a3b", *common])
    doc = json.loads(out.read_text())
    for k in ("date", "device", "model", "command", "rows"):
        assert k in doc
    rows = {r["model"]: r for r in doc["rows"]}
    assert list(rows) == ["llama31-8b-tp2", "qwen3-30b-a3b", "qwen2.5-vl-7b", "llama32-1b", "gemma-7b",
                          "gemma2-2b"]  # matrix order
    m = rows["qwen3-30b-a3b"]  # came up, but the chat turn failed: not served
    assert m["status"] == "failed" and m["chat_ok"] is False and not m["as_expected"]
    assert m["message"].startswith("chat:") and "boom" in m["message"] and m["kv_tokens_int2"] == 4000
    r = rows["llama32-1b"]
    assert (r["status"], r["chat_ok"], r["image_ok"], r["kv_tokens_int2"], r["kv_tokens_bf16"]) == \
        ("served", True, None, 4000, 1000), r.get("bf16_error")
    assert r["kv_ratio_int2_vs_bf16"] == 4.0 and r["as_expected"] and r["message"] is None
    assert (r["kv_format"], r["body_bits_per_element"]) == ("k4c64-v2t64-s4-w128", 3.5)  # the plugin's report
    assert (r["int2_prefill_warmup_s"], r["int2_triton_compiled_at_start_s"]) == (2.9, 6.3)  # log line, /server_info
    v = rows["qwen2.5-vl-7b"]
    assert v["status"] == "served" and v["chat_ok"] and v["image_ok"] and v["kind"] == "vlm"
    assert v["image_detail"]["prompt_tokens"] == 14 and v["image_detail"]["prompt_tokens_without_image"] == 10
    g = rows["gemma2-2b"]
    assert g["status"] == "refused" and g["as_expected"] and g["kv_tokens_int2"] is None
    assert g["message"].startswith("--kv-cache-dtype int2 cannot start:") and "sliding-window" in g["message"]
    assert g["kv_tokens_bf16"] is None  # no BF16 start for a refused row unless asked
    assert g["kv_format"] is None  # nothing was stored
    f = rows["gemma-7b"]
    assert f["status"] == "failed" and not f["as_expected"] and "stand-in crash" in f["message"]
    t = rows["llama31-8b-tp2"]
    assert t["status"] == "skipped" and "needs 2 GPUs, 1 visible" in t["message"]
    assert rc == 1  # gemma-7b failed
    # rows ran in the order asked (results above are in matrix order)
    ran = [Path(c[c.index("--model-path") + 1]).name for c in seen if "int2" in c]
    assert ran == ["llama32-1b", "qwen2.5-vl-7b", "gemma2-2b", "gemma-7b", "qwen3-30b-a3b"]
    # the real commands: int2 flags, the row's flags, the work folder as model and tokenizer
    vlm_int2 = next(c for c in seen if "qwen2.5-vl-7b" in c[c.index("--model-path") + 1] and "int2" in c)
    assert "--mm-attention-backend" in vlm_int2 and "oscar_triton" in vlm_int2 and "dummy" in vlm_int2
    assert vlm_int2[vlm_int2.index("--tokenizer-path") + 1] == vlm_int2[vlm_int2.index("--model-path") + 1]

    # a later call adds rows and keeps the earlier ones
    assert cov.main(["--models", "mistral-7b-v0.1", "--no-bf16", *common]) == 0
    doc2 = json.loads(out.read_text())
    names = [r["model"] for r in doc2["rows"]]
    assert "mistral-7b-v0.1" in names and "llama32-1b" in names and len(names) == 7
    assert len(doc2["runs"]) == 2


def test_refusal_and_error_extraction():
    log = ("INFO start\nTraceback (most recent call last):\n  File x\n"
           "oscar_sglang.runtime.refusals.Int2Unsupported: --kv-cache-dtype int2 cannot start:\n"
           "  - one\n  - two\n[2026] other line\n")
    assert cov.refusal_message(log) == "--kv-cache-dtype int2 cannot start:\n  - one\n  - two"
    assert cov.refusal_message("RuntimeError: CUDA out of memory") is None
    assert cov.last_error("a\nValueError: bad thing\nbye\n") == "ValueError: bad thing"
    with pytest.raises(SystemExit):
        cov.main(["--models", "no-such-model"])


def test_small_vocabulary_models_get_a_tokenizer_that_stays_inside_it(tmp_path, smollm2_tokenizer):
    """Llama-2 / TinyLlama / Mistral have 32000 ids, SmolLM2's tokenizer 49152: every id of any
    text (and of the chat template) must stay below the model's vocab_size, losslessly."""
    from transformers import AutoTokenizer

    row = next(r for r in cov.load_matrix() if r["name"] == "tinyllama-1.1b")
    d = cov.model_dir(row, tmp_path, smollm2_tokenizer)
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    assert vocab == 32000
    tok = AutoTokenizer.from_pretrained(d)
    full = AutoTokenizer.from_pretrained(smollm2_tokenizer)
    text = "Quixotic zephyrs jumbled 12345 émigrés; naïve café — ünïcödé 漢字 \U0001F600 " * 3
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < vocab and tok.decode(ids) == text
    assert max(full.encode(text, add_special_tokens=False)) >= vocab  # the uncut tokenizer would not
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert max(chat) < vocab


def test_deadline_estimate_leaves_out_the_first_row_once_others_ran():
    assert cov.next_row_estimate([]) == 0.0
    assert cov.next_row_estimate([223.0]) == 223.0  # nothing else known yet
    assert cov.next_row_estimate([223.0, 59.0, 92.0]) == 92.0  # the cold start does not count
    assert cov.next_row_estimate([50.0, 190.0]) == 190.0
