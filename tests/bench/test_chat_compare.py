"""bench/chat_compare.py against two stand-in chat servers on 127.0.0.1: the result document has
the benchmark keys and one row per prompt with each server's answer and the pairwise checks."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import chat_compare
from tests.http_stub import STUB_POLL


def _server(answer_for):
    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["messages"][0]["content"]
            out = {"model": "stub-model", "usage": {"prompt_tokens": len(prompt.split())},
                   "choices": [{"message": {"content": answer_for(prompt)}, "logprobs": {"content": [
                       {"token": "A", "logprob": -0.5, "top_logprobs": [{"token": "A", "logprob": -0.5},
                                                                        {"token": "B", "logprob": -1.0}]}]}}]}
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, kwargs=STUB_POLL, daemon=True).start()
    return srv


@pytest.fixture
def servers():
    a = _server(lambda p: "same answer")
    b = _server(lambda p: "same answer" if "capital" in p else "another answer")
    yield [f"x=http://127.0.0.1:{a.server_port}/v1", f"ref=http://127.0.0.1:{b.server_port}/v1"]
    a.shutdown()
    b.shutdown()


def test_writes_the_benchmark_document(servers, tmp_path):
    out = tmp_path / "chat.json"
    assert chat_compare.main(["--base-url", *servers, "--long-words", "", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc)[:6] == ["date", "device", "model", "command", "commit", "rows"]
    assert doc["model"] == "stub-model" and doc["servers"]["x"].startswith("http://127.0.0.1:")
    rows = doc["rows"]
    assert len(rows) == len(chat_compare.SHORT) and all(set(r["servers"]) == {"x", "ref"} for r in rows)
    same = {r["prompt"]: r["servers"]["x"]["same_answer_as_ref"] for r in rows}
    assert same["What is the capital of France?"] is True
    assert sum(same.values()) == sum("capital" in p for p in same)  # the stub differs elsewhere
    assert all(r["servers"]["x"]["repeat_same"] for r in rows)
