"""bench/ holds maintained benchmarks only, each named in the docs, and their results as JSON.

The rules (docs/design.md, "A new benchmark"): bench/ is a package whose scripts run as
`python -m bench.<name>` and import their helpers (leading underscore) as `from bench import ...`,
never through sys.path; no script is named after an issue or a machine, or after a package it
would shadow; no .patch files; every script that is not a private helper is named as
`bench/<name>` in docs/ or the README; every JSON under bench/results/ parses; new runs write
date, device, model, command (the `python -m bench.<name>` one), commit and one row per
configuration (bench/_results.py).
"""
import json
import re
import subprocess
import sys

import pytest

from bench import _results
from tests import ROOT

BENCH = ROOT / "bench"
SCRIPTS = sorted(p for ext in ("*.py", "*.sh") for p in BENCH.glob(ext) if not p.name.startswith("_"))


def test_no_patch_files():
    assert not sorted(BENCH.rglob("*.patch")), "bench/ keeps measurements, not patches (git history has them)"


def test_every_benchmark_is_named_in_the_docs():
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    scripts = SCRIPTS
    assert {"kernel_speed.py", "serving.py"} <= {p.name for p in scripts}
    # as a path (bench/kernel_speed.py) or as the command that runs it (python -m bench.kernel_speed)
    unnamed = [p.name for p in scripts if not re.search(rf"\bbench/{re.escape(p.name)}\b", text)
               and not (p.suffix == ".py" and re.search(rf"-m bench\.{re.escape(p.stem)}\b", text))]
    assert not unnamed, f"not named in docs/ or README.md (a one-off probe? its finding goes in docs): {unnamed}"
    # helpers and scripts live at the top level only (a sub-folder of scripts escapes the rule above)
    nested = [str(p.relative_to(BENCH)) for p in BENCH.rglob("*") if p.suffix in (".py", ".sh")
              and p.parent != BENCH and "__pycache__" not in p.parts]
    assert not nested, nested


def test_every_bench_path_the_docs_name_exists():
    """A removed script is named only as history ("was `bench/...`", or a generated table's
    command as its JSON recorded it); every other `bench/...` path in docs/ or the README must
    exist."""
    stale = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        # generated regions quote the commands the result files recorded, under the names the
        # scripts had then (bench/render_docs.py checks those regions against the JSON)
        text = re.sub(r"<!-- generated:(\S+) -->.*?<!-- /generated:\1 -->", "", doc.read_text(), flags=re.S)
        for m in re.finditer(r"(?<![\w/.-])(bench/[\w./-]*[\w/])", text):
            pattern = re.match(r"\.?[{*]", text[m.end():])  # bench/results/serving/*.json
            history = re.search(r"was\s+`$", text[max(0, m.start() - 20):m.start()])  # a removed script
            if pattern or history:
                continue
            if not (ROOT / m.group(1)).exists():
                stale.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
    assert not stale, stale


def test_every_bench_module_the_docs_run_exists():
    """Every `python -m bench.<name>` in docs/ or the README runs a script that exists."""
    stale = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for m in re.finditer(r"-m bench\.(\w+)", doc.read_text()):
            if not (BENCH / f"{m.group(1)}.py").is_file():
                stale.append(f"{doc.relative_to(ROOT)}: bench.{m.group(1)}")
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
    assert list(doc)[:6] == list(_results.KEYS) and doc["rows"] == [{"B": 8, "us": 67.9}]
    assert list(_results.KEYS) == ["date", "device", "model", "command", "commit", "rows"]
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
    from bench import serving
    from bench._serving_report import _load

    meta = {"date_utc": "2026-11-25 06:00", "gpu": "H100", "argv": [str(BENCH / "serving.py"), "run"],
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


def test_no_sys_path_edits_in_bench():
    """Scripts import their helpers from the bench package and the project from the installed one."""
    edits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted(BENCH.glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bsys\.path\b", line)]
    assert not edits, edits
    assert (BENCH / "__init__.py").is_file()


def test_no_script_named_after_an_issue_or_a_machine():
    """Names say what a script does; the machine is an argument (results files keep their names)."""
    machine = re.compile(r"(?i)issue|(?<![a-z])(h100|h200|h20|a100|a10g?|l4|l40s?|b200|gb200|mi300x?|rtx\w*)(?![a-z0-9])")
    bad = [p.name for p in BENCH.iterdir() if p.is_file() and machine.search(p.stem)]
    assert not bad, bad


def test_no_script_shadows_a_package():
    """No bench module is named after a module installed in this environment or in the standard
    library (bench/coverage.py shadowed the coverage package wherever bench/ was on sys.path)."""
    import importlib.metadata

    installed = set(importlib.metadata.packages_distributions()) | set(getattr(sys, "stdlib_module_names", ()))
    shadows = sorted(p.stem for p in BENCH.glob("*.py") if p.stem in installed)
    assert not shadows, shadows


def test_results_command_is_the_python_m_one(monkeypatch):
    """Under `python -m bench.x` sys.argv[0] is the file's path; the document records what to type."""
    monkeypatch.setattr(sys, "argv", [str(BENCH / "kernel_speed.py"), "--quick", "--json", "/tmp/a b.json"])
    assert _results.command() == "python -m bench.kernel_speed --quick --json '/tmp/a b.json'"
    assert _results.document("m", [], device="cpu")["command"] == "python -m bench.kernel_speed --quick --json '/tmp/a b.json'"
    assert _results.command("soak", ["--configs", "int2"]) == "python -m bench.soak --configs int2"
    monkeypatch.setattr(sys, "argv", ["/elsewhere/tool.py", "-x"])
    assert _results.command() == "python /elsewhere/tool.py -x"


def test_results_commit_is_head_or_none(monkeypatch):
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    doc = _results.document("m", [], device="cpu")
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
    except OSError:
        head = None
    if head is not None and head.returncode == 0:
        assert doc["commit"] == head.stdout.strip() and re.fullmatch(r"[0-9a-f]{40}", doc["commit"])
    else:
        assert doc["commit"] is None



def test_results_commit_is_null_outside_a_git_checkout(tmp_path, monkeypatch):
    """A device copy of the tree may not be a git checkout: null, not an error; unless the command
    names the commit it was sent from (BENCH_COMMIT), which wins over any checkout."""
    monkeypatch.setattr(_results, "ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    assert _results.commit() is None
    monkeypatch.setenv("BENCH_COMMIT", "c5bc2cc")
    assert _results.commit() == "c5bc2cc" and _results.document("m", [], device="cpu")["commit"] == "c5bc2cc"


@pytest.mark.slow
def test_every_bench_script_answers_help():
    """`python -m bench.<name> --help` works for every Python script (the package imports resolve)."""
    bad = []
    for p in SCRIPTS:
        if p.suffix != ".py":
            continue
        r = subprocess.run([sys.executable, "-m", f"bench.{p.stem}", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0 or "usage:" not in r.stdout:
            bad.append(f"{p.stem}: rc {r.returncode}: {(r.stderr or r.stdout)[-500:]}")
    assert not bad, bad
