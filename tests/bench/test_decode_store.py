"""bench/decode_store.py on CPU (--check-only, the Triton interpreter): the split and fused decode
stores agree on a decode batch that completes a block, and a fused store that differs is caught."""
import json

import pytest

from bench import decode_store as ds

pytestmark = pytest.mark.slow  # the module's cases take minutes on 2 cores: make test, not test-fast


def test_split_and_fused_agree(tmp_path):
    out = tmp_path / "s.json"
    assert ds.main(["--check-only", "--batches", "1,65", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"date", "device", "model", "command", "rows"} <= set(doc) and doc["timed"] is False
    assert [r["batch"] for r in doc["rows"]] == [1, 65]
    for r in doc["rows"]:
        assert r["agree"] and r["q_max_ulps"] <= 1.0 and "split_us" not in r
    # request 63 of the 65 completes a block: its codes were written by both paths alike
    step = ds.DecodeStep(ds.KVFormat.parse("k3c64-v2t64-s4-w128", head_dim=ds.D), 65, ds.torch.Generator().manual_seed(1))
    assert int((step.pos % 64 == 63).sum()) == 1


def test_a_fused_store_without_the_rotation_disagrees(tmp_path, monkeypatch):
    real = ds.DecodeStep.fused

    def unrotated(self, pool):  # forgets R_k for the keys
        R = self.R
        self.R = ds.torch.eye(ds.D, dtype=R.dtype, device=R.device)
        try:
            return real(self, pool)
        finally:
            self.R = R

    monkeypatch.setattr(ds.DecodeStep, "fused", unrotated)
    out = tmp_path / "s.json"
    assert ds.main(["--check-only", "--batches", "2", "--out", str(out)]) == 1
    row = json.loads(out.read_text())["rows"][0]
    assert not row["agree"] and row["q_max_ulps"] > 1 and row["differing_bytes"]["ring_k"] > 0


def test_timing_needs_a_gpu():
    if ds.DEV == "cuda":
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit, match="timing needs a GPU"):
        ds.main(["--batches", "1"])
