"""Rotation zoo: index, verify (tamper detection), CLI, and `pull` from a local HF-layout mirror."""
import hashlib
import http.server
import threading
from pathlib import Path

import pytest
import torch

from oscar_sglang.tools import zoo
from tests import ROOT
from tests.http_stub import STUB_POLL
from oscar_sglang.tools.cli import main as cli
from oscar_sglang.common.rotations import RotationSet, save_rotation_file

REPO_ZOO = ROOT / "rotation_zoo"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def make_zoo(d: Path, seed_layers=3) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for recipe in ("oscar", "hadamard"):
        q, _ = torch.linalg.qr(torch.randn(seed_layers, 1, 64, 64, dtype=torch.float64))
        rs = RotationSet(q, q, torch.full((seed_layers,), 0.9), torch.ones(seed_layers),
                         metadata={"model_id": MODEL, "recipe": recipe, "group_size": 64})
        save_rotation_file(rs, d / f"m.{recipe}.safetensors")
        zoo.add_to_index(d / f"m.{recipe}.safetensors", d, command="test")
    return d


def tamper(path: Path):
    b = bytearray(path.read_bytes())
    b[-5] ^= 0x01  # one bit in the last tensor's data
    path.write_bytes(bytes(b))


def test_index_and_verify(tmp_path, seed, capsys):
    d = make_zoo(tmp_path / "zoo")
    idx = zoo.read_index(d)
    assert {e["recipe"] for e in idx["entries"]} == {"oscar", "hadamard"}
    e = zoo.find_entries(idx, "smollm2-135m-instruct", "oscar")[0]  # case/prefix-insensitive
    assert e["sha256"] == hashlib.sha256((d / e["file"]).read_bytes()).hexdigest()
    assert cli(["zoo", "--zoo", str(d), "verify"]) == 0
    assert "2/2 files verified" in capsys.readouterr().out
    assert zoo.resolve(MODEL, "oscar", d).k_clip.tolist() == pytest.approx([0.9] * 3)


def test_verify_catches_tampered_file(tmp_path, seed, capsys):
    d = make_zoo(tmp_path / "zoo")
    tamper(d / "m.oscar.safetensors")
    assert cli(["zoo", "--zoo", str(d), "verify"]) == 1
    out = capsys.readouterr().out
    assert "m.oscar.safetensors: SHA256 MISMATCH" in out and "1/2 files verified" in out
    with pytest.raises(zoo.ZooError, match="SHA256 MISMATCH"):
        zoo.resolve(MODEL, "oscar", d)
    (d / "m.hadamard.safetensors").unlink()
    ok, msg = zoo.verify_entry(zoo.find_entries(zoo.read_index(d), MODEL, "hadamard")[0], d)
    assert not ok and "MISSING" in msg


def test_cli_list_and_show(tmp_path, seed, capsys):
    d = make_zoo(tmp_path / "zoo")
    assert cli(["zoo", "--zoo", str(d), "list"]) == 0
    out = capsys.readouterr().out
    assert "m.oscar.safetensors" in out and "hadamard" in out
    assert cli(["zoo", "--zoo", str(d), "show", "smollm2", "--recipe", "oscar"]) == 0
    out = capsys.readouterr().out
    assert '"sha256"' in out and "k_clip: [0.9, 0.9, 0.9]" in out
    assert cli(["zoo", "--zoo", str(d), "show", "Qwen/Qwen3-8B"]) == 1


# ------------------------------------------------------------------ pull from a local HF mirror

class _HFMirror(http.server.BaseHTTPRequestHandler):
    """Serves <root>/<file> at /<repo_id>/resolve/<revision>/<file>, with the headers
    huggingface_hub reads (X-Repo-Commit, ETag, Content-Length)."""

    root: Path
    repo: str

    def _file(self):
        prefix = f"/{self.repo}/resolve/"
        if not self.path.startswith(prefix):
            return None
        rest = self.path[len(prefix):].split("?")[0]
        _revision, _, name = rest.partition("/")
        f = self.root / name
        return f if f.is_file() else None

    def _head(self, f):
        data = f.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
        self.send_header("X-Repo-Commit", "0" * 40)
        self.end_headers()
        return data

    def do_HEAD(self):
        f = self._file()
        if f is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.end_headers()
            return
        self._head(f)

    def do_GET(self):
        f = self._file()
        if f is None:
            self.send_response(404)
            self.end_headers()
            return
        self.wfile.write(self._head(f))

    def log_message(self, *a):
        pass


@pytest.fixture
def mirror(tmp_path):
    root = make_zoo(tmp_path / "remote")
    handler = type("H", (_HFMirror,), {"root": root, "repo": "org/zoo"})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, kwargs=STUB_POLL, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_pull_from_mirror(tmp_path, mirror, seed):
    root, url = mirror
    dest = tmp_path / "local"
    got = zoo.pull("smollm2-135m-instruct", "oscar", repo="org/zoo", endpoint=url, dest=dest,
                   cache_dir=tmp_path / "hfcache")
    assert [p.name for p in got] == ["m.oscar.safetensors"]
    assert (dest / "m.oscar.safetensors").read_bytes() == (root / "m.oscar.safetensors").read_bytes()
    assert [e["file"] for e in zoo.read_index(dest)["entries"]] == ["m.oscar.safetensors"]
    ok, _ = zoo.verify_entry(zoo.read_index(dest)["entries"][0], dest)
    assert ok
    with pytest.raises(zoo.ZooError, match="no 'oscar' rotation for 'Qwen/Qwen3-8B'"):
        zoo.pull("Qwen/Qwen3-8B", repo="org/zoo", endpoint=url, dest=dest,
                 cache_dir=tmp_path / "hfcache")


def test_pull_refuses_tampered_remote(tmp_path, mirror, seed):
    root, url = mirror
    tamper(root / "m.hadamard.safetensors")
    dest = tmp_path / "local"
    with pytest.raises(zoo.ZooError, match="refusing it"):
        zoo.pull(MODEL, "hadamard", repo="org/zoo", endpoint=url, dest=dest,
                 cache_dir=tmp_path / "hfcache")
    assert not (dest / "m.hadamard.safetensors").exists()


def test_pull_cli_missing_repo(tmp_path, mirror, capsys):
    _root, url = mirror
    rc = cli(["zoo", "--zoo", str(tmp_path / "local"), "pull", "smollm2", "--repo", "org/absent",
              "--endpoint", url])
    assert rc == 1 and "cannot fetch index.json from Hugging Face repo 'org/absent'" in capsys.readouterr().err


# ------------------------------------------------------------------ the shipped zoo

def test_shipped_zoo_verifies(capsys):
    idx = zoo.read_index(REPO_ZOO)
    assert idx["entries"], "rotation_zoo/index.json lists no files"
    for e in idx["entries"]:
        ok, msg = zoo.verify_entry(e, REPO_ZOO)
        assert ok, msg
        assert (REPO_ZOO / e["file"]).stat().st_size < 5 * 2**20  # keep the tree small
    smol = {e["recipe"]: e for e in zoo.find_entries(idx, MODEL)}
    assert {"oscar", "hadamard", "identity"} <= set(smol)
    rs = zoo.resolve(MODEL, "oscar", REPO_ZOO)
    rs.validate_for_model(num_layers=30, num_kv_heads=3, head_dim=64, model_id=MODEL)
    assert rs.metadata["data_files"] and "command" in smol["oscar"]
