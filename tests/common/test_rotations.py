"""RotationSet: invariance, validation errors, file formats (ours and the OSCAR fork's .pt)."""
import json

import pytest
import torch
from oscar_kernels.reference import attention
from safetensors.torch import save_file

from oscar_sglang.tools.calibration.recipes import oscar_rotation
from oscar_sglang.common.rotations import (
    METADATA_KEY,
    RotationFileError,
    RotationSet,
    hadamard_rotation_set,
    identity_rotation_set,
    load_oscar_pt,
    load_rotation_file,
    save_oscar_pt,
    save_rotation_file,
)

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def heavy_tailed(*shape, outlier_channels=(3, 17), scale=30.0):
    """Student-t-like activations with a few large-magnitude channels and a low-norm sink row."""
    x = torch.distributions.StudentT(3.0).sample(shape)
    x[..., list(outlier_channels)] *= scale
    x[0] *= 0.05  # attention-sink-like low-norm first token
    return x


def random_orthogonal(n, D):
    q, r = torch.linalg.qr(torch.randn(n, D, D, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


def random_set(L=4, H=1, D=64, recipe="oscar", model_id=MODEL):
    """A calibrated-looking set: random orthogonal rotations, random clips in [0.7, 1)."""
    return RotationSet(random_orthogonal(L * H, D).reshape(L, H, D, D),
                       random_orthogonal(L * H, D).reshape(L, H, D, D),
                       torch.rand(L) * 0.3 + 0.7, torch.rand(L) * 0.3 + 0.7,
                       metadata={"recipe": recipe, "model_id": model_id, "group_size": 32})


def test_rotations_orthogonal(seed):
    for rs in (random_set(), random_set(H=3), hadamard_rotation_set(3, 2, 128),
               identity_rotation_set(2, 4, 64)):
        for r in (rs.k_rotation, rs.v_rotation):
            eye = torch.eye(r.shape[-1], dtype=torch.float64)
            err = (r.double() @ r.double().transpose(-1, -2) - eye).abs().max()
            assert err < 1e-5
        rs.check()


def test_scores_and_attention_invariant_under_rotation(seed):
    """q.k is unchanged by R_k, and o = attn(qR_k, kR_k, vR_v) R_v^T equals plain attention."""
    Hq, Hkv, D, T = 6, 2, 64, 40
    q, k, v = heavy_tailed(T, Hq, D), heavy_tailed(T, Hkv, D), heavy_tailed(T, Hkv, D)
    # calibrated rotations (the oscar recipe) from these very activations, one per KV head
    qg = q.double().reshape(T, Hkv, 3, D).transpose(0, 1).reshape(Hkv, -1, D)
    rk = torch.stack([oscar_rotation(a.T @ a, group_size=32) for a in qg]).float().double()
    rv = torch.stack([oscar_rotation(a.T @ a, group_size=64)
                      for a in v.double().transpose(0, 1)]).float().double()
    rq = rk.repeat_interleave(Hq // Hkv, 0)
    qr = torch.einsum("thd,hde->the", q.double(), rq)
    kr = torch.einsum("thd,hde->the", k.double(), rk)
    vr = torch.einsum("thd,hde->the", v.double(), rv)
    s_plain = torch.einsum("thd,lhd->htl", q.double(), k.double().repeat_interleave(3, 1))
    s_rot = torch.einsum("thd,lhd->htl", qr, kr.repeat_interleave(3, 1))
    assert torch.allclose(s_rot, s_plain, rtol=1e-5, atol=1e-5 * s_plain.abs().max())
    o_ref, lse_ref = attention(q, k, v, causal_offset=0)
    o_rot, lse_rot = attention(qr, kr, vr, causal_offset=0)
    o_back = torch.einsum("thd,hed->the", o_rot, rv.repeat_interleave(Hq // Hkv, 0))
    assert torch.allclose(lse_rot, lse_ref, atol=1e-4)
    assert torch.allclose(o_back, o_ref, atol=1e-4 * o_ref.abs().max())


def test_safetensors_round_trip(tmp_path, seed):
    rs = random_set(H=3)
    sha = save_rotation_file(rs, tmp_path / "r.safetensors")
    back = load_rotation_file(tmp_path / "r.safetensors")
    assert back.sha256 == sha and back.source.endswith("r.safetensors")
    for name in ("k_rotation", "v_rotation", "k_clip", "v_clip"):
        assert torch.equal(getattr(back, name), getattr(rs, name))
    assert back.metadata["model_id"] == MODEL and back.recipe == "oscar"
    back.validate_for_model(num_layers=4, num_kv_heads=3, head_dim=64, model_id=MODEL)


def test_oscar_pt_round_trip(tmp_path, seed):
    rs = random_set()
    save_oscar_pt(rs, tmp_path / "k.pt", tmp_path / "v.pt")
    # The fork's loader reads state["layers"][gid]["rotation"]: check the layout it expects.
    state = torch.load(tmp_path / "k.pt", weights_only=True)
    assert state["format_version"] == 1 and state["objective"] == "qqt_r_h_pbr"
    assert torch.equal(state["layers"][2]["rotation"], rs.k_rotation[2, 0])
    back = load_rotation_file(tmp_path / "k.pt", tmp_path / "v.pt")
    for name in ("k_rotation", "v_rotation", "k_clip", "v_clip"):
        assert torch.equal(getattr(back, name), getattr(rs, name))
    assert back.metadata["model_id"] == MODEL
    # ... and back to our format and to .pt again, unchanged.
    save_rotation_file(back, tmp_path / "r.safetensors")
    again = load_rotation_file(tmp_path / "r.safetensors")
    assert torch.equal(again.k_rotation, rs.k_rotation) and torch.equal(again.v_clip, rs.v_clip)


def test_fork_native_pt_without_our_extras(tmp_path, seed):
    """A file as the fork's compute_kv_rotation.py writes it (str layer keys work too)."""
    rs = random_set(L=3)
    for name, r in (("k.pt", rs.k_rotation), ("v.pt", rs.v_rotation)):
        torch.save({"format_version": 1, "objective": "x", "source_grouping": "layer",
                    "layers": {str(i): {"layer_id": i, "rotation": r[i, 0],
                                        "eigenvalues": torch.rand(64)} for i in range(3)}},
                   tmp_path / name)
    back = load_oscar_pt(tmp_path / "k.pt", tmp_path / "v.pt")
    assert torch.equal(back.k_rotation, rs.k_rotation) and torch.equal(back.v_rotation, rs.v_rotation)
    assert back.k_clip.tolist() == [1.0] * 3  # the fork keeps clips in env vars
    given = load_oscar_pt(tmp_path / "k.pt", k_clip=0.96, v_clip=0.92)
    assert torch.allclose(given.k_clip, torch.full((3,), 0.96))
    assert torch.equal(given.v_rotation, torch.eye(64).expand(3, 1, 64, 64))  # no V file


def test_per_head_set_cannot_become_fork_pt(tmp_path, seed):
    with pytest.raises(RotationFileError, match="shared by all heads"):
        save_oscar_pt(random_set(H=2), tmp_path / "k.pt", tmp_path / "v.pt")


def test_pt_loading_is_weights_only(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"layers": {0: {"rotation": Evil()}}}, tmp_path / "evil.pt")
    with pytest.raises(RotationFileError, match="weights_only"):
        load_rotation_file(tmp_path / "evil.pt")


def _write_raw(path, k, v, kc, vc, md=None):
    save_file({"k_rotation": k, "v_rotation": v, "k_clip": kc, "v_clip": vc}, str(path),
              metadata={METADATA_KEY: json.dumps(md or {"model_id": MODEL, "recipe": "oscar"})})


@pytest.mark.parametrize("fault, message", [
    ("nan", "NaN/Inf"),
    ("non_orthogonal", "not orthogonal"),
    ("clip", "must be in \\(0, 1\\]"),
    ("clip_len", "one ratio per layer"),
    ("layers_kv_differ", "v_rotation has"),
    ("not_square", "must have shape"),
])
def test_bad_files_refused(tmp_path, seed, fault, message):
    rs = random_set()
    k, v, kc, vc = rs.k_rotation.clone(), rs.v_rotation.clone(), rs.k_clip.clone(), rs.v_clip.clone()
    if fault == "nan":
        k[1, 0, 5, 7] = float("nan")
    elif fault == "non_orthogonal":
        v[2, 0] = v[2, 0] * 1.01
    elif fault == "clip":
        kc[0] = 1.5
    elif fault == "clip_len":
        vc = vc[:2]
    elif fault == "layers_kv_differ":
        v = v[:3]
    elif fault == "not_square":
        k = k[..., :32]
    _write_raw(tmp_path / "bad.safetensors", k.contiguous(), v.contiguous(), kc, vc)
    with pytest.raises(RotationFileError, match=message) as e:
        load_rotation_file(tmp_path / "bad.safetensors")
    assert "bad.safetensors" in str(e.value)  # says which file
    assert "calibrate" in str(e.value)  # and what to do


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=30), "30 attention layers"),
    (dict(head_dim=128), "head_dim is 128"),
    (dict(num_kv_heads=4), "4 KV heads"),
    (dict(v_head_dim=128), "V head_dim is 128"),
    (dict(model_id="Qwen/Qwen3-8B"), "calibrated for model"),
])
def test_wrong_model_refused(seed, kwargs, message):
    rs = random_set(H=3)
    args = dict(num_layers=4, num_kv_heads=3, head_dim=64, model_id=MODEL) | kwargs
    with pytest.raises(RotationFileError, match=message) as e:
        rs.validate_for_model(**args)
    assert "oscar-sglang" in str(e.value)


def test_model_id_matching_and_override(seed):
    rs = random_set(H=1)
    # Same model under a local path or different case: accepted.
    rs.validate_for_model(num_layers=4, num_kv_heads=7, head_dim=64,
                          model_id="/models/smollm2-135m-instruct/")
    rs.validate_for_model(num_layers=4, num_kv_heads=7, head_dim=64, model_id="Other/Model",
                          allow_model_mismatch=True)
    # Unknown on either side: nothing to compare.
    rs.validate_for_model(num_layers=4, num_kv_heads=7, head_dim=64, model_id=None)


def test_for_rank_and_per_head(seed):
    shared, per = random_set(L=6, H=1), random_set(L=6, H=4)
    a = shared.for_rank(2, 5, kv_head_start=2, num_local_kv_heads=2)
    assert a.k_rotation.shape == (3, 1, 64, 64)  # shared axis kept as 1
    assert torch.equal(a.k_rotation, shared.k_rotation[2:5]) and torch.equal(a.v_clip, shared.v_clip[2:5])
    b = per.for_rank(0, 3, kv_head_start=2, num_local_kv_heads=2)
    assert torch.equal(b.v_rotation, per.v_rotation[:3, 2:4])
    assert b.metadata["layer_offset"] == 0 and b.metadata["kv_head_offset"] == 2
    with pytest.raises(RotationFileError, match="outside"):
        per.for_rank(0, 3, kv_head_start=3, num_local_kv_heads=2)
    with pytest.raises(RotationFileError, match="outside"):
        per.for_rank(4, 8, 0, 1)
    e = shared.per_head(5)
    assert e.k_rotation.shape == (6, 5, 64, 64) and torch.equal(e.k_rotation[:, 4], shared.k_rotation[:, 0])
    with pytest.raises(RotationFileError, match="cannot expand"):
        per.per_head(5)


def test_hadamard_set_needs_power_of_two():
    with pytest.raises(RotationFileError, match="power of two"):
        hadamard_rotation_set(2, 2, 96)


def test_missing_file_message(tmp_path):
    with pytest.raises(RotationFileError, match="zoo pull"):
        load_rotation_file(tmp_path / "nope.safetensors")


def test_convert_cli_both_ways(tmp_path, seed, capsys):
    from oscar_sglang.tools.cli import main as cli

    rs = random_set()
    save_rotation_file(rs, tmp_path / "r.safetensors")
    assert cli(["convert", str(tmp_path / "r.safetensors"), "--out-dir", str(tmp_path / "pt")]) == 0
    k, v = tmp_path / "pt" / "k_rotation_qqt_r_h_pbr.pt", tmp_path / "pt" / "v_rotation_sst_r_h_pbr.pt"
    assert cli(["convert", str(k), "--v-file", str(v), "--out", str(tmp_path / "back.safetensors")]) == 0
    back = load_rotation_file(tmp_path / "back.safetensors")
    assert torch.equal(back.k_rotation, rs.k_rotation) and torch.equal(back.v_rotation, rs.v_rotation)
    assert torch.equal(back.k_clip, rs.k_clip) and torch.equal(back.v_clip, rs.v_clip)
    # A corrupt input gives exit code 1 and the reason on stderr.
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    capsys.readouterr()
    assert cli(["convert", str(tmp_path / "junk.safetensors"), "--out-dir", str(tmp_path)]) == 1
    assert "not a readable safetensors file" in capsys.readouterr().err
