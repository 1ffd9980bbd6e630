"""The emulation running a KVFormat exactly as the served cache would (EmulationConfig.kv_format),
and the format study's command line."""
import subprocess
import sys

import pytest
import torch

from oscar_kernels import reference as ref
from oscar_kernels.format import KVFormat
from oscar_sglang.tools.evaluation import format_study
from oscar_sglang.tools.evaluation.emulation import EmulationConfig, _format_kv, emulated_attention
from oscar_sglang.tools.evaluation.recipes import build_rotations, format_recipe
from tests import ROOT
from tests.tools.test_eval_fidelity import heavy_qkv, random_orthogonal


def format_config(name, L, Hk, D, **kw):
    fmt = KVFormat.parse(name, D)
    recipe = format_recipe(fmt)
    rs = build_rotations(recipe, L, Hk, D)
    from dataclasses import replace

    rs = replace(rs, k_rotation=random_orthogonal(L, Hk, D), v_rotation=random_orthogonal(L, Hk, D))
    return fmt, EmulationConfig(recipe, rs, kv_format=fmt, **kw)


@pytest.mark.parametrize("name,layer", [
    ("k2c32-v2t64-tn-s4-w64", 0),
    ("k3c32-v4t32-s0-w32", 0),
    ("k2t32-v2t64-id-s4-w128", 0),
    ("k2c32-v2t64-s4-w64@0,-1=k4v4", 2),  # layer 2 of 3 = -1: 4-bit K and V
    ("k2c32-v2t64-s4-w64@0,-1=k4v4", 1),  # not overridden
])
def test_format_emulation_matches_per_query_reader(seed, name, layer):
    B, Hq, Hk, T, D = 1, 4, 2, 150, 64
    q, k, v = heavy_qkv(B, Hq, Hk, T, D)
    fmt, cfg = format_config(name, 3, Hk, D, query_chunk=13)
    assert (cfg.sink, cfg.recent) == (fmt.sink, fmt.window)
    out = emulated_attention(q, k, v, D**-0.5, layer, cfg)[0]
    Rk, Rv = cfg.rotations.k_rotation[layer], cfg.rotations.v_rotation[layer]
    kr = torch.einsum("bhtd,hde->bhte", k, Rk)[0].transpose(0, 1)  # [T, Hk, D]
    vr = torch.einsum("bhtd,hde->bhte", v, Rv)[0].transpose(0, 1)
    qr = torch.einsum("bhgtd,hde->bhgte", q.reshape(B, Hk, Hq // Hk, T, D), Rk).reshape(B, Hq, T, D)
    n_quantised = 0
    for t in range(T):
        k_eff = ref.format_request_kv(kr, fmt, "k", t + 1, layer, 3)
        v_eff = ref.format_request_kv(vr, fmt, "v", t + 1, layer, 3)
        n_quantised += int(ref.format_source_masks(t + 1, fmt)[2].sum())
        o, _ = ref.attention(qr[0, :, t : t + 1].transpose(0, 1), k_eff, v_eff)
        o = torch.einsum("thd,hed->the", o.float(), Rv.repeat_interleave(Hq // Hk, 0))
        torch.testing.assert_close(out[t : t + 1], o, atol=2e-4, rtol=1e-3, msg=f"query {t}")
    assert n_quantised > 0  # the check covered reads of the quantised body


def test_override_changes_only_its_layers(seed):
    _, cfg = format_config("k2c32-v2t64-s4-w64@0,-1=k4", 3, 2, 64)
    _, base = format_config("k2c32-v2t64-s4-w64", 3, 2, 64)
    kr, vr = torch.randn(1, 2, 96, 64), torch.randn(1, 2, 96, 64)
    for layer, same in ((0, False), (1, True), (2, False)):
        a, b = _format_kv(kr, vr, cfg, layer)[0], _format_kv(kr, vr, base, layer)[0]
        assert torch.equal(a, b) == same
        if not same:  # 4-bit keys: closer to the input
            assert (a - kr).abs().mean() < (b - kr).abs().mean()


@pytest.mark.parametrize("name", ["k2c64-v2t64-tn", "k3c32-v4t64@0=k4", "k2t64-v2t64"])
def test_decode_memo_gives_the_same_body(seed, name):
    """The decode loop's memo (only new rows / new complete blocks quantised) changes nothing."""
    _, with_memo = format_config(name, 2, 3, 64, memo={})
    _, without = format_config(name, 2, 3, 64)
    without.rotations = with_memo.rotations
    k, v = torch.randn(1, 3, 300, 64), torch.randn(1, 3, 300, 64)
    k[..., 3] *= 20
    for L in (200, 201, 256, 257, 300):
        a = _format_kv(k[:, :, :L], v[:, :, :L], with_memo, 0)
        b = _format_kv(k[:, :, :L], v[:, :, :L], without, 0)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert with_memo.memo[0]["n"] in (256, 288, 300)  # a prefix was kept
    # keys that do not extend the memo's prefix are quantised afresh
    k2 = k.clone()
    k2[:, :, 5] += 1.0
    a, b = _format_kv(k2, v, with_memo, 0), _format_kv(k2, v, without, 0)
    assert torch.equal(a[0], b[0])


def test_format_config_errors():
    fmt = KVFormat.parse("k2c64-v2t64-s4-w128", 64)
    recipe = format_recipe(fmt)
    rs = build_rotations(recipe, 1, 1, 64)
    with pytest.raises(ValueError, match="contradicts the format"):
        EmulationConfig(recipe, rs, sink=64, kv_format=fmt)
    with pytest.raises(ValueError, match="calibrated rotation"):
        format_recipe(KVFormat.parse("k2c64-v2t64-cal", 64))
    with pytest.raises(ValueError, match="not a file"):
        format_recipe(fmt, "/tmp/r.safetensors")
    assert EmulationConfig(recipe, rs).sink == 64  # recipes without a format keep the defaults


def test_study_help_and_format_list():
    out = subprocess.run([sys.executable, "-m", "oscar_sglang.tools.evaluation.format_study", "--help"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "--merge" in out.stdout and "--max-minutes" in out.stdout
    fmts = format_study._formats(format_study.DEFAULT_FORMATS, 64)
    names = [format_study._label(f) for f in fmts]
    assert names == list(format_study.DEFAULT_FORMATS)  # every default name parses back to itself
    with pytest.raises(ValueError, match="unknown segment"):
        format_study._formats(["k2c64-v2t64-zz"], 64)


def test_study_cases_run_in_whole_rounds_of_depths():
    from oscar_sglang.tools.evaluation.niah import NiahCase

    depths = [0.1, 0.4, 0.7]
    cases = [NiahCase(1024, d, t, str(t), "") for d in depths for t in range(4)]  # depth-major
    order = format_study._case_order(cases, depths)
    for r in range(4):  # every prefix of whole rounds has each depth equally often
        rnd = order[3 * r: 3 * r + 3]
        assert [c.depth for c in rnd] == depths and {c.trial for c in rnd} == {r}


def test_study_merge_adds_rows_and_refuses_other_windows():
    base = {"model": "m", "device": "cpu", "fidelity": {"windows": 2}, "rows": [{"format": "bf16"}],
            "answers": {"bf16": ["a"]}, "command": "c1", "date": "d1", "seconds": 1.0}
    new = {"model": "m", "device": "cpu", "fidelity": {"windows": 2}, "rows": [{"format": "x"}],
           "answers": {"x": ["b"]}, "command": "c2", "date": "d2", "seconds": 2.0}
    out = format_study._merged(base, new)
    assert [r["format"] for r in out["rows"]] == ["bf16", "x"]
    assert out["command"] == ["c1", "c2"] and out["seconds"] == 3.0 and set(out["answers"]) == {"bf16", "x"}
    with pytest.raises(SystemExit, match="fidelity"):
        format_study._merged(base, dict(new, fidelity={"windows": 3}))


def test_study_markdown_table_from_rows():
    rows = [{"format": "k2c64-v2t64", "body_bits_per_element": 2.5, "niah": 0.5, "trials": 40,
             "kld": 0.02, "top1": 0.95, "sink": 64, "recent": 256},
            {"format": "bf16", "body_bits_per_element": 16.0, "niah": 0.8, "trials": 40,
             "kld": 0.0001, "top1": 0.999, "sink": None, "recent": None}]
    lines = format_study.markdown_table({"rows": rows}).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| `k2c64-v2t64` | 2.500 | 0.500 (20/40) | 0.62 |")
    assert lines[3].startswith("| `bf16` | 16.000 | 0.800 (32/40) | 1.00 |")


def test_pareto_plot_and_the_capacity_arithmetic(tmp_path):
    """The computed capacity matches what the H100 int2 server measured for the served 2.25-bit
    format (2,823,617 tokens, 05:47 UTC), and --plot writes a PNG from a study JSON."""
    from oscar_sglang.tools.evaluation import format_study as fs

    assert abs(fs.llama8b_kv_tokens(2.25) / 2_823_617 - 1) < 1e-3
    assert fs.llama8b_kv_tokens(3.0) < fs.llama8b_kv_tokens(2.5)
    rows = [{"format": "bf16", "body_bits_per_element": 16.0, "niah": 1.0, "trials": 8},
            {"format": "k3c64-v2t64", "body_bits_per_element": 3.0, "niah": 0.875, "trials": 8},
            {"format": "k2c64-v2t64", "body_bits_per_element": 2.5, "niah": None, "trials": 8}]
    png = tmp_path / "p.png"
    fs.pareto_plot({"rows": rows, "model": "m", "date": "d"}, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
