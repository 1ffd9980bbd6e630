"""bench/decode_profile.py: proton's PC-sampling tree summarised into a results row (CPU; the
sampling itself needs a GPU, and without one the script says so and runs nothing)."""
import random

import pytest

from tests import ROOT

from bench import decode_profile as dp

SRC = ROOT / "kernels" / "oscar_kernels" / "triton" / "channel_attend.py"
TRITON_SRC = "/opt/venv/lib/python3.12/site-packages/triton/language/standard.py"
REASONS = ("selected", "wait", "long_scoreboard", "math_pipe_throttle")


def _line(path, line, kernel, samples, stalled):
    metrics = {"num_samples": samples, "num_stalled_samples": sum(stalled.values())}
    metrics.update({f"stalled_{r}": stalled.get(r, 0) for r in REASONS})
    return {"frame": {"name": f"{path}:{line}@{kernel}"}, "metrics": metrics}


def _tree(rng):
    """A proton hatchet document: ROOT -> kernels -> lines, the decode kernel sampled in two
    contexts (its lines must add up), the merge kernel beside it, a kernel without lines."""
    lines = []
    for i in range(40):
        stalled = {r: rng.randrange(0, 50) for r in REASONS}
        lines.append((SRC if i % 3 else TRITON_SRC, 100 + i, 200 + sum(stalled.values()) + rng.randrange(0, 90), stalled))
    first, second = lines[:25], lines[20:]  # lines 20-24 in both contexts
    node = lambda part, t: {"frame": {"name": dp.KERNEL}, "metrics": {"time (ns)": t, "count": 5},  # noqa: E731
                            "children": [_line(p, ln, dp.KERNEL, n, s) for p, ln, n, s in part]}
    merge = {"frame": {"name": "merge_splits_kernel"}, "metrics": {"time (ns)": 700},
             "children": [_line(SRC, 9, "merge_splits_kernel", 33, {"wait": 3})]}
    tree = {"frame": {"name": "ROOT"}, "metrics": {},
            "children": [node(first, 1000), {"frame": {"name": "scope"}, "metrics": {},
                                              "children": [node(second, 2000), merge]},
                         {"frame": {"name": "copy_kernel"}, "metrics": {"time (ns)": 5}, "children": []}]}
    return [tree, {"CUDA": {"0": {"arch": "90"}}}], lines, first, second


def test_summarise_sums_the_kernels_lines_and_reads_their_sources():
    rng = random.Random()  # fresh counts every run
    doc, lines, first, second = _tree(rng)
    expect = {}
    for p, ln, n, s in first + second:
        e = expect.setdefault((p, ln), {"n": 0, **{r: 0 for r in REASONS}})
        e["n"] += n
        for r in REASONS:
            e[r] += s.get(r, 0)
    total = sum(e["n"] for e in expect.values())
    stalled = sum(e[r] for e in expect.values() for r in REASONS)
    row = dp.summarise(doc, top=10)

    assert row["samples"] == total
    assert row["no_reason_pct"] == round(100 * (total - stalled) / total, 1)
    for r in REASONS:
        assert row["stall_reason_pct"][r] == round(100 * sum(e[r] for e in expect.values()) / total, 1)
    assert row["kernels"] == {dp.KERNEL: {"time_ns": 3000, "samples": total},
                              "merge_splits_kernel": {"time_ns": 700, "samples": 33}}
    # the ten lines with most samples, most first, each with its own share and states >= 3%
    ranked = sorted(expect.items(), key=lambda kv: -kv[1]["n"])[:10]
    assert [t["pct_samples"] for t in row["top_lines"]] == [round(100 * e["n"] / total, 2) for _, e in ranked]
    for t, ((p, ln), e) in zip(row["top_lines"], ranked):
        if p == SRC:
            assert t["line"] == f"kernels/oscar_kernels/triton/channel_attend.py:{ln}"
            assert t["source"] == SRC.read_text().splitlines()[ln - 1].strip()
        else:  # a triton file not on this machine: named from triton/, no text
            assert t["line"] == f"triton/language/standard.py:{ln}" and t["source"] == ""
        assert t["stall_pct"] == {r: round(100 * e[r] / e["n"], 1) for r in sorted(REASONS, key=lambda r: -e[r])
                                  if 100 * e[r] / e["n"] >= dp.LINE_REASON_MIN_PCT}


def test_summarise_refuses_a_profile_without_the_kernel():
    doc, *_ = _tree(random.Random())
    with pytest.raises(ValueError, match="no samples of channel_kernel.*merge_splits_kernel"):
        dp.summarise([{"frame": {"name": "ROOT"}, "children": [doc[0]["children"][1]["children"][1]]}, {}])


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "p.json"
    assert dp.main(["--json", str(out)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not out.exists()
