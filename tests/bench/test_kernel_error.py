"""bench/kernel_error.py on CPU (Triton interpreter, small shapes): every per-channel kernel's row
lands in the JSON with errors at the interpreter's fp32 level, and a kernel that errs is caught."""
import json

import pytest

from bench import kernel_error as ke

pytestmark = pytest.mark.slow  # the module's cases take minutes on 2 cores: make test, not test-fast
SMALL = ["--head-dim", "128", "--kv-heads", "1", "--gqa", "4", "--decode-lens", "150,70,1",
         "--extend-case", "130:5,64:2,40:1,3:1"]
# the tests of the bench's own checks (a kernel made to err, the LSE bound) read rows, not kernel
# accuracy: fewer, shorter requests (one with body blocks past sink + ring, one sink-only), half
# SMALL's interpreter time; SMALL's run above is the accuracy check
CHECKS = ["--head-dim", "128", "--kv-heads", "1", "--gqa", "4", "--decode-lens", "70,1", "--extend-case", "70:3,3:1"]


def test_rows_for_every_kernel_within_fp32_error(tmp_path):
    out = tmp_path / "e.json"
    assert ke.main(["--formats", "k3c32-v2t32-s4-w32", *SMALL, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"date", "device", "model", "command", "rows", "seed"} <= set(doc)
    got = {(r["kernel"], r["variant"]) for r in doc["rows"]}
    assert got == {("decode", "default splits"), ("decode", "fewest splits"), ("decode", "flat q, fewest splits"),
                   ("extend", "one launch"), ("extend", "prefix split"), ("extend", "short tail"),
                   ("prefix_pieces", "pieces of 4096"), ("bf16_baseline", ke.BASELINE),
                   ("bf16_baseline", ke.BASELINE + "; flat q"), ("arith_emulation", ke.EMULATION)}
    for r in doc["rows"]:
        assert r["format"] == "k3c32-v2t32-s4-w32"
        if r["kernel"] == "decode" and not r["variant"].startswith("flat q"):
            assert 1e-4 < r["rel_diff_vs_arith_emulation"] < 1e-1, r  # fp32 kernel vs bf16-rounded model
        if r["kernel"] in ("bf16_baseline", "arith_emulation"):
            # bf16 operands: errors of bf16's order (2^-9 a rounding), no tolerance applied; the
            # emulation's q * s is rounded once for a block's keys, so its errors do not average
            # out (2.7e-2 max on the H100's outlier inputs, 3.04e-2 once in CI with a fresh seed,
            # 6.22e-2 once in a fresh-clone CI run on 2026-11-29, seed 1710821503, which passed when
            # replayed here). Its tail on these inputs, 700 seeds of this test's shapes on CPU
            # (2026-11-29): median 8.5e-3, 99th percentile 3.9e-2, largest 6.1e-2 (one seed over
            # 6e-2, none over 1e-1): the bound only says the emulation is of bf16's order
            bound = 1e-1 if r["kernel"] == "arith_emulation" else 3e-2
            assert 1e-4 < r["rel_err_max"] < bound and "within_test_tolerance" not in r, r
        elif r["kernel"] == "prefix_pieces":
            # the interpreter truncates to bf16: under one ulp (CUDA rounds: 0.5)
            assert 0 < r["max_ulps"] <= 1.0 and 0 < r["rel_err"] < 1e-2
        else:
            # fp32 operands in the interpreter: far under the tests' 1e-4 (an error there is a bug)
            assert 0 <= r["rel_err_max"] < 1e-5 and r["within_test_tolerance"], r
    assert all(r["lse_err_max"] < 1e-4 and r["lse_ref_abs_max"] > 0 for r in doc["rows"] if r["kernel"] == "extend")


def test_bf16_baseline_matches_a_float64_emulation():
    """The baseline's arithmetic: bf16-rounded q, k, v and probabilities, fp32 sums. Its fp32
    scores are within fp32 summation's bound of float64's; from its probabilities rounded to bf16
    (a score near a bf16 rounding boundary may round the other way than float64's would, about one
    seed in 300, so the emulation takes the fp32 ones) the output differs from float64 only by fp32
    summation; against exact attention by bf16's order."""
    g = ke.torch.Generator().manual_seed(ke.random.randrange(2**31))
    q, k, v = (ke.outlier_rows(n, h, 64, g).float() for n, h in ((3, 4), (200, 2), (200, 2)))
    o, lse = ke.bf16_attention(q, k, v, 0.125)
    r = lambda x: x.bfloat16().double()  # noqa: E731
    k2, v2 = r(k).repeat_interleave(2, dim=1), r(v).repeat_interleave(2, dim=1)
    s = ke.torch.einsum("thd,lhd->htl", r(q), k2) * 0.125
    s32 = ke.torch.einsum("thd,lhd->htl", r(q).float(), k2.float()) * 0.125
    # 64 exact products summed in fp32: at most 64 * 2^-24 of the sum of their magnitudes
    bound = 64 * 2.0**-24 * ke.torch.einsum("thd,lhd->htl", r(q).abs(), k2.abs()) * 0.125
    assert ((s32.double() - s).abs() <= bound).all()
    p32 = ke.torch.exp(s32 - s32.amax(-1, keepdim=True))
    want = ke.torch.einsum("htl,lhd->thd", r(p32), v2) / p32.double().sum(-1).T.unsqueeze(-1)
    # fp32 sums over 200 keys, numerator and denominator: up to ~2 * 200 * 2^-24 = 2.4e-5 relative
    assert (o.double() - want).abs().max() <= 3e-5 * want.abs().max()
    exact_o, exact_lse = ke.ref.attention(q, k, v, sm_scale=0.125)
    assert (lse.double() - exact_lse).abs().max() < 1e-2 * exact_lse.abs().max()
    err = ((o.double() - exact_o).norm() / exact_o.norm()).item()
    assert 1e-5 < err < 3e-2


def test_arith_emulation_is_exact_attention_without_its_roundings():
    """arith_emulation with the identity for its roundings recovers each body key's code and
    params from the pool (the reader's view, the store's fp16 params, the masks) and so equals
    float64 attention over the view; with bf16 roundings it differs by bf16's order."""
    fmt = ke.KVFormat.parse("k3c32-v2t32-s4-w32", head_dim=64)
    g = ke.torch.Generator().manual_seed(ke.random.randrange(2**31))
    st = ke.StoredBatch(fmt, [150, 30], 2, g)  # 30 <= sink 4 + ring 32
    q = ke.queries(2, 4, 64, g).to(ke.DEV)
    for b in range(2):
        K, V = st.view(b)
        want = ke.ref.attention(q[b:b + 1], K, V, sm_scale=0.125)[0][0]
        exact = ke.arith_emulation(st, b, q[b], 0.125, rnd=lambda x: x)
        assert (exact - want).abs().max() <= 1e-9 * want.abs().max()
        err = ((ke.arith_emulation(st, b, q[b], 0.125) - want).norm() / want.norm()).item()
        assert (1e-5 < err < 5e-2) if b == 0 else err < 1e-12  # request 1: all in sink + ring


@pytest.mark.parametrize("times", [0.5, 2.0])
def test_lse_bound_is_relative_to_the_reference(tmp_path, monkeypatch, times):
    """The LSE bound is the kernel tests' (tolerance x the reference's largest |lse|), not an
    absolute one: an extend LSE off by half of it passes, off by twice it is reported."""
    real = ke.ops.extend_prefix_attention_channel
    tol = ke.test_tolerance()

    def lse_off(*a, **kw):
        o, lse = real(*a, **kw)
        return o, lse + times * tol * lse.abs().max()

    monkeypatch.setattr(ke.ops, "extend_prefix_attention_channel", lse_off)
    out = tmp_path / "e.json"
    rc = ke.main(["--formats", "k2c32-v2t32-s4-w32", *CHECKS, "--out", str(out)])
    ext = [r for r in json.loads(out.read_text())["rows"] if r["kernel"] == "extend"]
    assert ext and all(r["lse_err_max"] > 0.4 * tol * r["lse_ref_abs_max"] for r in ext)
    assert rc == (1 if times > 1 else 0)
    assert all(r["within_test_tolerance"] == (times < 1) for r in ext)


def test_a_kernel_that_errs_is_reported(tmp_path, monkeypatch):
    real = ke.ops.decode_attention_channel

    def off_by_a_bit(q, o, *a, **kw):  # 3% off on every output
        real(q, o, *a, **kw)
        o.mul_(1.03)
        return o

    monkeypatch.setattr(ke.ops, "decode_attention_channel", off_by_a_bit)
    out = tmp_path / "e.json"
    rc = ke.main(["--formats", "k2c32-v2t32-s4-w32", *CHECKS, "--out", str(out), "--seed", "7"])
    rows = json.loads(out.read_text())["rows"]
    dec = [r for r in rows if r["kernel"] == "decode"]
    assert rc == 1 and dec and all(not r["within_test_tolerance"] and abs(r["rel_err_max"] - 0.03) < 1e-3 for r in dec)
    assert all(r["within_test_tolerance"] for r in rows if r["kernel"] == "extend")
    assert json.loads(out.read_text())["seed"] == 7


def test_a_token_layout_format_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not a per-channel key format"):
        ke.main(["--formats", "k2t64-v2t64", *SMALL, "--out", str(tmp_path / "e.json")])
    assert not (tmp_path / "e.json").exists()
