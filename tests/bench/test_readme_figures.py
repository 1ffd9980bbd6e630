"""The README's "Measured" tables are the numbers of the bench/results files they cite, recomputed
here (results are data: a figure typed by hand, or left behind when a file is replaced, fails)."""
from __future__ import annotations

import json
import re

from tests import ROOT

README = (ROOT / "README.md").read_text()
MEASURED = README.split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]


def _load(rel: str) -> dict:
    return json.loads((ROOT / rel).read_text())


def _table_rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows of `text` by their first cell (header and rule rows included)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def _paragraph(start: str) -> str:
    i = MEASURED.index(start)
    return MEASURED[i:MEASURED.index("\n\n", i)]


SPEED_FILE = "bench/results/serving_vs_fp8_h200_2026-11-29.json"
SPEED_LOADS = {"output tok/s, 256 requests x (2K in + 256 out)": "256x2048+256", "256 x (2K + 1K)": "256x2048+1024",
               "512 x (2K + 1K)": "512x2048+1024", "64 x (8K + 512)": "64x8192+512"}
COLUMNS = ("int2", "fp8-flashinfer", "flashinfer")  # int2, FP8 KV, BF16: the README's column order


def test_the_speed_table_is_its_file():
    assert SPEED_FILE in MEASURED
    rows = {(r["config"], r["load"]): r for r in _load(SPEED_FILE)["rows"]}
    table = _table_rows(_paragraph("| | int2 | FP8 KV | BF16 | int2 / FP8 |"))
    assert {rows[c, "1x4096+256"]["backend"] for c in COLUMNS[1:]} == {"flashinfer"}
    # "for FP8 the faster of FlashInfer and Triton on every row"
    for load in SPEED_LOADS.values():
        assert rows["fp8-flashinfer", load]["output_tok_s"] > rows["fp8-splits64", load]["output_tok_s"], load
    for load in ("1x4096+256", "1x32768+256", "1x131072+256"):
        assert rows["fp8-flashinfer", load]["tpot_p50_ms"] < rows["fp8-splits64", load]["tpot_p50_ms"], load

    def expect(values: list[float], fmt: str, ratio: bool = True) -> list[str]:
        return [fmt.format(v) for v in values] + ([f"{values[0] / values[1]:.2f}x"] if ratio else [""])

    kv = [rows[c, "1x4096+256"]["kv_tokens"] for c in COLUMNS]
    assert table["KV tokens in the pool"] == expect(kv, "{:,}")
    for label, load in SPEED_LOADS.items():
        assert table[label] == expect([rows[c, load]["output_tok_s"] for c in COLUMNS], "{:,.0f}"), label
    b1 = ["1x4096+256", "1x32768+256", "1x131072+256"]
    tpot = [[rows[c, ld]["tpot_p50_ms"] for ld in b1] for c in COLUMNS]
    assert table["batch 1, ms per output token at 4K / 32K / 128K context"] == [
        " / ".join(f"{t:.2f}" for t in ts) for ts in tpot] + [
        " / ".join(f"{a / b:.2f}x" for a, b in zip(tpot[0], tpot[1]))]
    warm = [rows[c, "1x32768+256"]["ttft_p50_s"] for c in COLUMNS]
    assert table["first token of a 32K prompt, warm server"] == expect(warm, "{:.2f} s")
    fresh = [rows[c, "1x32768+256"]["fresh_ttft_s"] for c in COLUMNS]
    assert table["the same, a new server's first request"] == expect(fresh, "{:.2f} s", ratio=False)
    leaks = [r["pool_leak_tokens"] for r in rows.values() if "pool_leak_tokens" in r]
    assert leaks and not any(leaks)  # "no request's KV blocks leaked"


NIAH_FILES = {"H200, 2026-11-29": "bench/results/niah_server_h200.json",
              "H100, 2026-11-27": "bench/results/niah_server_h100.json"}
# README row label (its start) -> the row's name in each file (H200, H100)
NIAH_ROWS = {"BF16": ("bf16", "bf16"), "FP8": ("fp8_e4m3", "fp8_e4m3"),
             "**int2 default**": ("int2", "k4c64-s4-w128"), "`k3c64-v2t64-s4-w128`": ("k3c64-s4-w128", "int2"),
             "`k2c64-v2t64-s4-w128@": ("k2c64-k3x6-s4-w128", "k2c64-k3x6-s4-w128"),
             "`k2c64-v2t64-s4-w128`": ("k2c64-s4-w128", "k2c64-s4-w128"), "`token`": ("int2-token", "int2-token")}


def test_the_retrieval_table_is_its_files():
    table = _table_rows(_paragraph("| KV cache | bits per element"))
    header = table.pop("KV cache")
    assert header[1:] == list(NIAH_FILES)
    table.pop("---")
    files = [{r["name"]: r for r in _load(f)["rows"]} for f in NIAH_FILES.values()]
    assert all(f in MEASURED for f in NIAH_FILES.values())
    assert len(table) == len(NIAH_ROWS)
    for start, names in NIAH_ROWS.items():
        (label, cells), = [(k, v) for k, v in table.items() if k.startswith(start)]
        got = [files[i][n] for i, n in enumerate(names)]
        assert {r["body_bits_per_element"] for r in got} == {float(cells[0])}, label
        for cell, row in zip(cells[1:], got):
            assert re.sub(r"[*]", "", cell).split(" ")[0] == f"{row['niah']:.3f}", (label, cell)
        fmt = got[0].get("format")  # a format named in the label is what the H200 server stored
        if fmt and "`k" in label and "default" not in label:
            assert f"`{fmt}`" in label, (label, fmt)
    default = files[0]["int2"]
    (default_label,) = [k for k in table if k.startswith("**int2 default**")]
    assert default["default"] and f"stores `{default['format']}`" in default_label
    assert f"{default['niah'] / files[0]['bf16']['niah']:.2f}x BF16" in table[default_label][1]


KERNEL_FILE = "bench/results/kernels/2026-11-29_1712_issue18-default-vs-previous_h200.json"


def test_the_kernel_figures_are_its_file():
    text = _paragraph("**Decode attention kernel.**")
    assert KERNEL_FILE in text
    doc = _load(KERNEL_FILE)
    default = re.search(r"`(k\w+-v\w+-s\d+-w\d+)`", README).group(1)  # the README's first format name
    cells = [r["channel"][default] for r in doc["rows"]]
    speedups = re.findall(r"(\d+\.\d+)x at", text)
    assert speedups == [f"{c['speedup_vs_bf16']:.2f}" for c in cells]
    assert re.findall(r"(\d+)%", text) == [f"{c['pct_copy']:.0f}" for c in cells]
    assert f"({cells[0]['ms'] * 1e3:.1f} us)" in text


def test_the_table_reader_reads_cells():
    assert _table_rows("| a | 1 | 2 |\n|---|---:|\ntext | x\n") == {"a": ["1", "2"], "---": ["---:"]}
