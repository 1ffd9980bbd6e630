"""Rules that keep the tree readable, checked on every run:

- kernels take arguments: nothing under kernels/ reads the environment (settings live in the
  registry, oscar_sglang/common/settings.py, and reach the kernels as arguments);
- one kernel module per format and op, each a file one can read (at most 1,000 lines), sharing
  code only through public names (no `_name` imported from a sibling module);
- docs are reference: no docs/*.md over 800 lines, history in CHANGELOG.md, and no issue numbers
  of this project in code or docs (upstream references such as "SGLang #36121" are fine).
"""
from __future__ import annotations

import ast
import re

from tests import ROOT

KERNELS = ROOT / "kernels" / "oscar_kernels"
MAX_KERNEL_LINES = 1000
MAX_DOC_LINES = 800


def _sources(*dirs):
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def test_kernels_read_no_environment():
    readers = []
    for p in _sources("kernels"):
        text = p.read_text()
        if re.search(r"\bos\.environ\b|\bgetenv\s*\(|\benviron\s*\[", text):
            readers.append(str(p.relative_to(ROOT)))
    assert not readers, f"kernels read the environment (pass an argument instead): {readers}"


def test_kernel_files_are_readable_sizes():
    big = {str(p.relative_to(ROOT)): n for p in _sources("kernels")
           if (n := len(p.read_text().splitlines())) > MAX_KERNEL_LINES}
    assert not big, big


def test_kernel_modules_share_only_public_names():
    private = []
    for p in _sources("kernels"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("oscar_kernels")):
                private += [f"{p.relative_to(ROOT)}: {a.name} from {node.module}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert not private, private


def test_docs_are_reference_sized_and_history_is_in_the_changelog():
    long_docs = {p.name: n for p in sorted((ROOT / "docs").glob("*.md"))
                 if (n := len(p.read_text().splitlines())) > MAX_DOC_LINES}
    assert not long_docs, long_docs
    assert (ROOT / "CHANGELOG.md").is_file()


def test_no_issue_numbers_of_this_project():
    pattern = re.compile(r"\bissues? ?#?\d+\b(?!,\d{3})|\bissue[-_]\d+", re.I)  # not "issues 1,109 instructions"
    upstream = re.compile(r"(SGLang|vLLM|FlashInfer|Mooncake|NIXL|Triton|PyTorch)\S*\s*(issue\s*)?#\d+", re.I)
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *_sources("kernels", "oscar_sglang", "bench", "tests", "launch"),
             *sorted((ROOT / "bench").glob("*.sh")), *sorted((ROOT / "docker").glob("*"))]
    found = []
    for p in files:
        if p == ROOT / "tests" / "test_repo_rules.py" or not p.is_file():
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if pattern.search(upstream.sub("", line)):
                found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}")
    assert not found, found
