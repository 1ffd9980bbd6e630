"""The generated tables in README.md and docs/*.md are what bench/render_docs.py writes from the
bench/results files they cite, and their figures are those files' numbers, recomputed here
independently of the renderer (results are data: a figure typed by hand, or left behind when a file
is replaced, fails)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from tests import ROOT
from tests.bench import load_render_docs

render_docs = load_render_docs("oscar_render_docs")

README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
ACCURACY = ROOT / "docs" / "accuracy.md"


def _load(rel: str) -> dict:
    return json.loads((ROOT / rel).read_text())


def _region(path, name: str) -> str:
    text = path.read_text()
    m = re.search(rf"<!-- generated:{name} -->\n(.*?)<!-- /generated:{name} -->", text, re.S)
    assert m, f"{path.relative_to(ROOT)} has no generated region {name}"
    return m.group(1)


def _table_rows(text: str) -> dict[str, list[str]]:
    """Markdown table rows of `text` by their first cell (header and rule rows included)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_every_generated_region_is_up_to_date():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "render_docs.py"), "--check"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_the_check_sees_a_changed_figure():
    text = README.read_text()
    region = _region(README, "readme-today")
    changed = text.replace(region, region.replace("3,953", "3,954", 1))
    assert changed != text
    rendered, names = render_docs.render_text(changed, README)
    assert names == ["readme-today"] and rendered == text


def test_each_region_names_its_file_date_device_and_command():
    seen = set()
    for path in render_docs.documents():
        for m in render_docs.REGION.finditer(path.read_text()):
            name, body = m.group(2), m.group(3)
            seen.add(name)
            files = re.findall(r"\]\(((?:\.\./)?bench/results/[^)]+\.json)\)", body)
            assert files, (path.name, name)
            for link in files:
                rel = link.removeprefix("../")
                assert (path.parent / link).resolve() == (ROOT / rel).resolve(), link
                doc = _load(rel)
                assert doc["date"][:10] in body and doc["device"].split(",")[0] in body, (name, rel)
                commands = [c["command"] for c in doc.get("calls", []) if "--loads" not in c["command"]]
                for cmd in commands or [doc["command"]]:
                    assert cmd in body, (name, cmd)
    # every renderer is placed, except spec-decode, path-invariance and pd-h200x2 while their results
    # files do not exist yet (each region goes into the docs with its first measured file)
    unplaced = set(render_docs.RENDERERS) - seen
    waiting = {"spec-decode": render_docs.SPEC_DECODE, "path-invariance": render_docs.PATH_INVARIANCE,
               "pd-h200x2": render_docs.PD_X2}
    assert seen <= set(render_docs.RENDERERS) and unplaced <= set(waiting), seen
    assert not [name for name in unplaced if (ROOT / waiting[name]).exists()], unplaced


SPEED_FILE = "bench/results/serving_vs_fp8_h200_2026-11-29.json"
SPEED_LOADS = {"output tok/s, 256 requests x (2K in + 256 out)": "256x2048+256", "256 x (2K + 1K)": "256x2048+1024",
               "512 x (2K + 1K)": "512x2048+1024", "64 x (8K + 512)": "64x8192+512"}
COLUMNS = ("int2", "fp8-flashinfer", "flashinfer")  # int2, FP8 KV, BF16: the README's column order


def test_the_readme_speed_rows_are_their_file():
    text = _region(README, "readme-today")
    assert SPEED_FILE in text
    rows = {(r["config"], r["load"]): r for r in _load(SPEED_FILE)["rows"]}
    table = _table_rows(text)
    assert table[""] == ["int2", "FP8 KV", "BF16", "int2 / FP8"]
    assert {rows[c, "1x4096+256"]["backend"] for c in COLUMNS[1:]} == {"flashinfer"}
    # the README's text: "for FP8 the faster of FlashInfer and Triton on every row of this run"
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
    assert leaks and not any(leaks)  # the README: "no request's KV blocks leaked"
    assert "No request's KV blocks leaked" in README.read_text()


def test_the_readme_needle_row_is_its_file():
    text = _region(README, "readme-today")
    rows = {r["name"]: r for r in _load("bench/results/niah_server_h200.json")["rows"]}
    assert rows["int2"]["default"]  # the int2 column is today's default
    (cells,) = [v for k, v in _table_rows(text).items() if k.startswith("needle in a haystack")]
    assert cells[:3] == [f"{rows[n]['niah']:.3f}" for n in ("int2", "fp8_e4m3", "bf16")]
    assert cells[3] == f"{rows['int2']['niah'] / rows['fp8_e4m3']['niah']:.2f}x"
    assert {rows[n]["trials"] for n in rows} == {200} and "exact match of 200" in text


def test_the_full_serving_table_is_its_file():
    table = _table_rows(_region(PERFORMANCE, "serving-h200"))
    rows = {(r["config"], r["load"]): r for r in _load(SPEED_FILE)["rows"]}
    configs = ("int2", "int2-mixed-chunk", "fp8-flashinfer", "fp8-splits64", "flashinfer")
    assert len(table[""]) == len(configs) + 1
    assert table["64 x (8K + 512)"][:5] == [f"{rows[c, '64x8192+512']['output_tok_s']:,.0f}" for c in configs]
    assert table["max running requests"][:5] == [f"{rows[c, '1x4096+256']['max_running_requests']:,}"
                                                 for c in configs]


KERNEL_FILE = "bench/results/kernels/2026-11-29_1712_issue18-default-vs-previous_h200.json"


def test_the_kernel_table_is_its_file():
    text = _region(PERFORMANCE, "kernel-decode-h200")
    assert KERNEL_FILE in text
    doc = _load(KERNEL_FILE)
    default = re.search(r"`(k\w+-v\w+-s\d+-w\d+)`", README.read_text()).group(1)  # the README's first format
    table = _table_rows(text)
    header = table["requests x context"]
    col = header.index(f"`{default}` (us, x BF16, % of copy)")
    assert header[0] == "SGLang BF16 Triton (us)"
    for r in doc["rows"]:
        cells = table[f"{r['B']} x {r['L'] // 1024}K"]
        c = r["channel"][default]
        us, speedup, pct = (x.strip() for x in cells[col].split(","))
        assert float(us) == round(c["ms"] * 1e3, 1) and speedup == f"{c['speedup_vs_bf16']:.2f}x"
        assert pct == f"{c['pct_copy']:.0f}%" and float(cells[0]) == round(r["bf16_ms"] * 1e3, 1)


NIAH_FILES = ("bench/results/niah_server_h200.json", "bench/results/niah_server_h100.json")


def test_the_retrieval_table_is_its_files():
    table = _table_rows(_region(ACCURACY, "niah-served"))
    header = table.pop("KV cache (stored format)")
    table.pop("---")
    docs = [_load(f) for f in NIAH_FILES]
    assert [h.split(",")[0] for h in header[1:]] == [d["device"].split(",")[0] for d in docs]
    labels = {"bf16": "BF16", "fp8_e4m3": "FP8 (`fp8_e4m3`)"}
    for i, doc in enumerate(docs):
        for r in doc["rows"]:
            label = labels.get(r["kv"]) or f"`{r['format']}`"
            cells = table[label]
            assert float(cells[0]) == r["body_bits_per_element"], label
            assert cells[1 + i].split(" ")[0] == f"{r['niah']:.3f}", (label, i)
            assert ("(default)" in cells[1 + i]) == bool(r.get("default")), (label, i)
    # today's default (the README's first format name) is the H200 run's default row
    (default,) = [r for r in docs[0]["rows"] if r.get("default")]
    assert default["format"] == "k4c64-v2t64-s4-w128"  # k4c64-v2h-s4-w128 on SmolLM2's 64-dim heads


def test_the_table_reader_reads_cells():
    assert _table_rows("| a | 1 | 2 |\n|---|---:|\ntext | x\n") == {"a": ["1", "2"], "---": ["---:"]}


def test_the_two_gpu_pd_region_is_its_file(tmp_path, monkeypatch):
    """pd-h200x2 (docs/deploy.md's PD section, once pd_h200x2.json exists): the placeholder before
    the run, then the file's two-GPU rows, each load's int2 / FP8 / BF16 rows, int2 against FP8
    per load from the summary bench/pd.py writes, and its checks."""
    from bench import pd

    mod = load_render_docs("oscar_render_docs_pd_x2")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    deploy = tmp_path / "docs" / "deploy.md"
    assert mod.render_pd_x2(deploy) == [f"Not measured yet: `{mod.PD_X2}` does not exist (`python -m bench.pd "
                                        "--help` has the two-GPU plan of calls)."]
    gpus = {"prefill": "0", "decode": "1"}
    base = {"engine": "mooncake-tcp", "front": "router", "gpus": gpus, "ok": True}
    rates = {("int2", "64x8192+512"): (1800.0, 4.0, 29760.0), ("fp8", "64x8192+512"): (1200.0, 5.0, 65544.0),
             ("bf16", "64x8192+512"): (1000.0, 6.0, 131072.0), ("int2", "256x2048+256"): (4000.0, 2.0, 34784.0),
             ("fp8", "256x2048+256"): (3200.0, 2.5, 65544.0), ("bf16", "256x2048+256"): (3000.0, 2.6, 131072.0)}
    rows = [{"part": "real", "config": c, "kv": c, "model": "HuggingFaceTB/SmolLM2-135M-Instruct", **base,
             "prompt_tokens": [184, 4969], "max_new_tokens": 64, "prompts": 64, "identical": 64,
             "greedy_identical_vs_single_server": 1.0, "gpus": {"single": "0", **gpus}} for c in ("int2", "bf16")]
    rows += [{"part": "load", "config": c, "kv": {"fp8": "fp8_e4m3"}.get(c, c), "load": ld, **base,
              "output_tok_s": tok, "ttft_p50_s": ttft, "ttft_p90_s": 2 * ttft, "transfer_bytes_per_token": tb}
             for (c, ld), (tok, ttft, tb) in rates.items()]
    doc = {"date": "2026-12-03 10:00 UTC", "device": "2 x NVIDIA H200", "commit": "abc", "model": "m",
           "command": "python -m bench.pd --part load --gpus 0,1", "rows": rows, "summary": pd.summary(rows),
           "calls": [{"command": "python -m bench.pd --part load --gpus 0,1 --load-configs int2"}]}
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / mod.PD_X2).write_text(json.dumps(doc))
    text = "\n".join(mod.render_pd_x2(deploy))
    assert text.startswith("[pd_h200x2.json](../bench/results/pd_h200x2.json): 2 x NVIDIA H200, 2026-12-03 10:00 UTC")
    assert "python -m bench.pd --part load --gpus 0,1 --load-configs int2" in text
    assert "(prefill server -> transfer -> decode server, prefill on GPU 0, decode on GPU 1)" in text
    lines = [x for x in text.splitlines() if x.startswith("| 64x8192+512 |") or x.startswith("| 256x2048+256 |")]
    assert len(lines) == 6
    assert "| 256x2048+256 | fp8_e4m3 | mooncake-tcp / router | 2.50 | 3200 | 65,544 |" in lines
    assert ("int2 against FP8 on the same pair (prefill on GPU 0, decode on GPU 1), 64x8192+512: 1.50x the output "
            "tok/s, 0.80x the TTFT p50.") in text
    assert "256x2048+256: 1.25x the output tok/s, 0.80x the TTFT p50." in text
    assert "`load_256x2048+256_bf16_ttft_and_output_rate_measured` pass" in text
    assert "`load_transfer_bytes_per_token_int2_le_0.25x_bf16` pass" in text


def test_which_prefill_a_row_ran():
    mode = render_docs.prefill_mode
    assert mode({"kv": "bf16", "prefill_reads": "cache"}) == "BF16"
    assert mode({"kv": "int2", "prefill_reads": "cache"}) == "cache"  # annotated by hand
    assert mode({"kv": "int2", "oscar_int2": {"prefill_reads": "cache"}}) == "cache"  # /server_info
    assert mode({"kv": "int2", "server_env": {"OSCAR_PREFILL_READS": "cache"}}) == "cache"
    assert mode({"kv": "int2", "server_env": {}}) == "exact"  # the plugin's default
