"""bench/ holds maintained benchmarks only, each named in the docs, and their results as JSON.

The rules (docs/design.md, "A new benchmark"): no .patch files; every script that is not a
private helper (leading underscore) is named as `bench/<name>` in docs/ or the README; every JSON
under bench/results/ parses; new runs write date, device, model, command and one row per
configuration (bench/_results.py).
"""
import importlib.util
import json
import re
import sys

from tests import ROOT

BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import _results  # noqa: E402


def test_no_patch_files():
    assert not sorted(BENCH.rglob("*.patch")), "bench/ keeps measurements, not patches (git history has them)"


def test_every_benchmark_is_named_in_the_docs():
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    scripts = sorted(p for ext in ("*.py", "*.sh") for p in BENCH.glob(ext) if not p.name.startswith("_"))
    assert {"kernels.py", "serving.py"} <= {p.name for p in scripts}
    unnamed = [p.name for p in scripts if not re.search(rf"\bbench/{re.escape(p.name)}\b", text)]
    assert not unnamed, f"not named in docs/ or README.md (a one-off probe? its finding goes in docs): {unnamed}"
    # helpers and scripts live at the top level only (a sub-folder of scripts escapes the rule above)
    nested = [str(p.relative_to(BENCH)) for p in BENCH.rglob("*") if p.suffix in (".py", ".sh")
              and p.parent != BENCH and "__pycache__" not in p.parts]
    assert not nested, nested


def test_every_bench_path_the_docs_name_exists():
    """A removed script is named only as history ("was `bench/...`", docs/benchmarks.md
    "Findings"); every other `bench/...` path in docs/ or the README must exist."""
    stale = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = doc.read_text()
        for m in re.finditer(r"(?<![\w/.-])(bench/[\w./-]*[\w/])", text):
            pattern = re.match(r"\.?[{*]", text[m.end():])  # bench/results/serving/*.json
            history = re.search(r"was\s+`$", text[max(0, m.start() - 20):m.start()])  # a removed script
            if pattern or history:
                continue
            if not (ROOT / m.group(1)).exists():
                stale.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
    assert not stale, stale


def test_every_result_json_parses():
    files = sorted((BENCH / "results").rglob("*.json"))
    assert len(files) >= 20  # the kept runs (serving, kernels, extend, server_e2e, accuracy)
    bad = []
    for p in files:
        try:
            json.loads(p.read_text())
        except ValueError as e:
            bad.append(f"{p.relative_to(ROOT)}: {e}")
    assert not bad, bad


def test_result_document_has_the_keys(tmp_path):
    doc = _results.document("synthetic", [{"B": 8, "us": 67.9}], device="H100", copy_gbs=3002.0)
    assert list(doc)[:5] == list(_results.KEYS) and doc["rows"] == [{"B": 8, "us": 67.9}]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", doc["date"]) and doc["command"].startswith("python ")
    path = _results.write(tmp_path / "k" / "run.json", doc)
    assert json.loads(path.read_text()) == doc
    assert _results.default_path("kernels").parent == BENCH / "results" / "kernels"
    try:
        _results.write(tmp_path / "bad.json", {"date": "x", "rows": []})
    except AssertionError as e:
        assert "device" in str(e)
    else:
        raise AssertionError("a document without device / model / command was written")


def test_serving_results_file_is_a_document_the_report_reads(tmp_path):
    """serving.py's results.json: the common keys, one row per (model, config); the report merges
    it like the older {"runs": {...}} files under bench/results/serving/."""
    spec = importlib.util.spec_from_file_location("oscar_bench_serving", BENCH / "serving.py")
    serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving)
    from _serving_report import _load

    meta = {"date_utc": "2026-11-25 06:00", "gpu": "H100", "argv": ["bench/serving.py", "run"],
            "mem_fraction_static": 0.85, "configs": ["bf16", "int2"], "quick": False}
    res = serving.Results(tmp_path / "results.json", meta, ["llama31-8b"])
    res.run("llama31-8b", "bf16")["capacity"] = {"max_total_num_tokens": 100}
    res.run("llama31-8b", "int2")["capacity"] = {"max_total_num_tokens": 669}
    res.run("llama31-8b", "bf16")["latency"] = [{"context": 8192}]  # same row again
    res.save()
    doc = json.loads((tmp_path / "results.json").read_text())
    assert all(k in doc for k in _results.KEYS) and doc["model"] == "llama31-8b" and doc["device"] == "H100"
    assert [(r["model"], r["config"]) for r in doc["rows"]] == [("llama31-8b", "bf16"), ("llama31-8b", "int2")]
    old = sorted((BENCH / "results" / "serving").glob("*.json"))
    merged = _load([old[0], tmp_path / "results.json"])
    assert merged["runs"]["llama31-8b/int2"]["capacity"] == {"max_total_num_tokens": 669}
    assert merged["runs"]["llama31-8b/bf16"]["latency"] == [{"context": 8192}]
    assert merged["runs"]["llama31-8b/bf16"]["_dates"]["capacity"] == "2026-11-25 06:00"
