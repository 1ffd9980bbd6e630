"""Base of the tests' stub HTTP servers: quiet, and one helper that answers with JSON."""
from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JSONHandler(BaseHTTPRequestHandler):
    def log_message(self, *a):  # keep pytest output quiet
        pass

    def _json(self, code: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class PoolStub(JSONHandler):
    """A stub SGLang server's idle pool: /v1/loads (nothing running) and /server_info (its token
    count and the plugin's oscar_int2 report, `pool_info`), what the bench's leak checks read."""
    protocol_version = "HTTP/1.0"
    max_total_num_tokens = 100000
    pool_info: dict = {"tokens_free": 100000, "side_rows_free": 8}

    def do_GET(self):
        if self.path == "/v1/loads":
            return self._json(200, {"loads": [{"num_used_tokens": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]})
        return self._json(200, {"max_total_num_tokens": self.max_total_num_tokens,
                                "internal_states": [{"oscar_int2": dict(self.pool_info)}]})


# serve_forever's keyword arguments for a stub served from a thread: shutdown() returns once the
# loop next wakes, every 0.5 s by default (seconds per test that starts several stubs)
STUB_POLL = {"poll_interval": 0.05}
