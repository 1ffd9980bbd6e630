"""tools.models._dequantised_copy: servers started side by side each make the GGUF's Hugging Face
copy; the first to finish keeps it and the others drop theirs instead of failing their start (on
2026-12-02 two of three bench processes died on `rename` onto the folder a third had just made)."""
from __future__ import annotations

import json

import transformers

from oscar_sglang.tools import models


class _Saved:
    def __init__(self, on_save=None):
        self.on_save = on_save

    def save_pretrained(self, d):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps({"mine": True}))
        if self.on_save:
            self.on_save()


def _fake_transformers(monkeypatch, on_save=None):
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Saved())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: _Saved(on_save))


def test_a_copy_made_by_another_process_meanwhile_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_SGLANG_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    out = models.dequantised_copy_dir(gguf)

    def other_process_finishes_first():
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"mine": False}))

    _fake_transformers(monkeypatch, other_process_finishes_first)
    assert models._dequantised_copy(str(tmp_path), gguf.name) == out
    assert json.loads((out / "config.json").read_text()) == {"mine": False}  # the first one's, untouched
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # this process's folder dropped


def test_a_fresh_copy_is_made_once_and_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_SGLANG_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    _fake_transformers(monkeypatch)
    out = models._dequantised_copy(str(tmp_path), gguf.name)
    assert json.loads((out / "config.json").read_text()) == {"mine": True}
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("converted twice")))
    assert models._dequantised_copy(str(tmp_path), gguf.name) == out
