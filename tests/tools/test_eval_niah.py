"""Needle-in-a-haystack harness against a fake OpenAI-compatible server on 127.0.0.1.

The fake server finds the magic number in the prompt and answers it, except for needles placed
at depth 0.5 (answers a wrong number) and the very first chat request (HTTP 503, so the client
must retry). The grid must show exactly that pattern.
"""
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from oscar_sglang.tools.evaluation import niah


class FakeOpenAI(BaseHTTPRequestHandler):
    calls = {"chat": 0, "fail_first": True}
    lock = threading.Lock()

    def log_message(self, *a):  # keep pytest output quiet
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "fake-model"}]})
        self._send(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions" or body.get("model") != "fake-model":
            return self._send(400, {"error": "bad request"})
        with self.lock:
            self.calls["chat"] += 1
            fail = self.calls["fail_first"]
            self.calls["fail_first"] = False
        if fail:
            return self._send(503, {"error": "warming up"})
        prompt = body["messages"][0]["content"]
        assert body["temperature"] == 0.0
        number = re.search(r"magic number is (\d+)\.", prompt).group(1)
        text = prompt.split(QUESTION_MARK)[0].split("\n\n", 1)[1]  # the haystack only
        pos = text.index("magic number is") / len(text)
        answer = "1234567" if 0.3 < pos < 0.7 else f"The number is {number}."
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": answer}}]})


QUESTION_MARK = niah.QUESTION


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    FakeOpenAI.calls.update(chat=0, fail_first=True)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()
    srv.server_close()


def args_for(url, tmp_path, **kw):
    a = SimpleNamespace(base_url=[url], local=None, label="fake", model_name=None,
                        tokenizer="chars", lengths=[300, 600], depths=[0.0, 0.5, 1.0], trials=2,
                        max_requests=50, concurrency=3, timeout=10.0, retries=2, max_tokens=16,
                        seed=1, rotation=None, group_size=64, sink=64, recent=256,
                        out=str(tmp_path), name="niah")
    a.__dict__.update(kw)
    return a


def test_niah_against_fake_openai_server(server, tmp_path, seed):
    assert niah.main_niah(args_for(server, tmp_path, seed=seed)) == 0
    run = json.loads((tmp_path / "niah.json").read_text())
    grid = run["grids"]["fake"]
    assert grid["n"] == 12 and grid["errors"] == 0  # the 503 was retried
    assert FakeOpenAI.calls["chat"] == 13
    assert grid["cells"] == [[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]
    assert grid["accuracy"] == pytest.approx(8 / 12)
    assert run["meta"]["servers"]["fake"]["model"] == "fake-model"
    assert (tmp_path / "niah.png").stat().st_size > 1000
    assert "| 300 | 1.00 | 0.00 | 1.00 |" in (tmp_path / "niah.md").read_text()


def test_niah_bounded_requests_and_unreachable_server(tmp_path):
    assert niah.main_niah(args_for("http://127.0.0.1:9/v1", tmp_path, max_requests=5)) == 2
    bad = args_for("http://127.0.0.1:9/v1", tmp_path, retries=0, timeout=2.0)
    assert niah.main_niah(bad) == 2  # connection refused: clear error, no traceback


def test_needle_placement_and_scoring(seed):
    hay = "One. Two two. Three three three. Four."
    assert niah.insert_needle(hay, "N.", 0.0).startswith("N. One.")
    assert niah.insert_needle(hay, "N.", 1.0).endswith("Four. N. ")
    mid = niah.insert_needle(hay, "N.", 0.3)
    assert "Two two. N. Three" in mid
    with pytest.raises(ValueError):
        niah.insert_needle(hay, "N.", 1.5)
    assert niah.is_correct("It is 7,463,343.", "7463343")
    assert not niah.is_correct("746334", "7463343") and not niah.is_correct(None, "1")
    cases = niah.build_cases(["word " * 3000], niah.TokenCounter(None), [400], [0.25, 0.75], 2, seed)
    assert len(cases) == 4 and len({c.number for c in cases}) == 4
    for c in cases:
        assert c.prompt.count(c.number) == 1 and abs(len(c.prompt) / 4 - 400) < 80
