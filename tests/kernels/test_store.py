"""store_kv kernel vs reference.quantize: bit-exact codes/params, exact side-buffer writes.

Bounds: without rotation codes and params equal the reference bit for bit (same fp32 operations,
IEEE division, no FMA contraction). With an in-kernel rotation the rotated values differ from
torch's matmul by fp32 summation order only, so a code can flip at a rounding tie: at most 0.5 %
of codes may differ (by one level), params within 1e-3 relative.
"""
import pytest
import torch

from oscar_kernels import Int2Format, ops
from oscar_kernels import reference as ref
from oscar_kernels.hadamard import hadamard

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
S, W = 4, 8


def heavy_tailed(t, h, d):
    x = torch.randn(t, h, d)
    for j in range(h):
        ch = torch.randperm(d)[:3]
        x[:, j, ch] *= 1 + 20 * torch.rand(3)
    x[:2] *= 1e-3  # low-norm sink-like tokens
    return x.bfloat16()


def batch(hkv, dk, dv):
    """Tokens of 3 requests (seq_len, n new tokens): a prefill longer than W, a decode token and a
    short chunk, at random distinct slots of a pool with 2 free slots per token."""
    reqs = [(13, 13), (30, 1), (9, 3)]
    pos, rows, seq = [], [], []
    for r, (L, E) in enumerate(reqs):
        pos += list(range(L - E, L))
        rows += [r + 1] * E
        seq += [L] * E
    T = len(pos)
    N = 2 * T + 1
    loc = torch.randperm(N - 1)[:T] + 1
    t = dict(
        k=heavy_tailed(T, hkv, dk), v=heavy_tailed(T, hkv, dv), loc=loc,
        positions=torch.tensor(pos), token_rows=torch.tensor(rows, dtype=torch.int32),
        token_seq_lens=torch.tensor(seq, dtype=torch.int32),
    )
    return t, N


def poisoned_pool(N, R, hkv, dk, dv, gk, gv):
    return dict(
        k_codes=torch.randint(0, 256, (N, hkv, dk // 4), dtype=torch.uint8),
        k_params=torch.full((N, hkv, dk // gk, 2), float("nan")).half(),
        v_codes=torch.randint(0, 256, (N, hkv, dv // 4), dtype=torch.uint8),
        v_params=torch.full((N, hkv, dv // gv, 2), float("nan")).half(),
        sink_k=torch.full((R, S, hkv, dk), float("nan")).bfloat16(),
        sink_v=torch.full((R, S, hkv, dv), float("nan")).bfloat16(),
        ring_k=torch.full((R, W, hkv, dk), float("nan")).bfloat16(),
        ring_v=torch.full((R, W, hkv, dv), float("nan")).bfloat16(),
    )


def run_store(tok, pool, **kw):
    dev = {k: v.to(DEV) for k, v in pool.items()}
    kw = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}  # rotations too
    ops.store_kv(**{k: v.to(DEV) for k, v in tok.items()}, **dev, **kw)
    return {k: v.cpu() for k, v in dev.items()}


def check_side_buffers(tok, before, after, xk, xv):
    """Exactly the rule's entries are written, with bf16(x); everything else untouched."""
    for name, x in (("k", xk), ("v", xv)):
        sink, ring = after[f"sink_{name}"], after[f"ring_{name}"]
        exp_sink, exp_ring = before[f"sink_{name}"].clone(), before[f"ring_{name}"].clone()
        for i, (p, r, L) in enumerate(zip(tok["positions"].tolist(), tok["token_rows"].tolist(),
                                          tok["token_seq_lens"].tolist())):
            if p < S:
                exp_sink[r, p] = x[i].bfloat16()
            if p >= L - W:
                exp_ring[r, p % W] = x[i].bfloat16()
        assert torch.equal(sink.view(torch.int16), exp_sink.view(torch.int16))
        assert torch.equal(ring.view(torch.int16), exp_ring.view(torch.int16))


@pytest.mark.parametrize("dk,gk,dv,gv", [(128, 128, 128, 32), (128, 64, 64, 64), (64, 32, 64, 32)])
@pytest.mark.parametrize("clip", [(1.0, 1.0), (0.9, 0.85)])
def test_store_bit_exact(seed, dk, gk, dv, gv, clip):
    hkv = 2
    tok, N = batch(hkv, dk, dv)
    pool = poisoned_pool(N, 4, hkv, dk, dv, gk, gv)
    out = run_store(tok, pool, k_group=gk, v_group=gv, k_clip=clip[0], v_clip=clip[1])
    loc = tok["loc"]
    for name, x, g, c in (("k", tok["k"], gk, clip[0]), ("v", tok["v"], gv, clip[1])):
        codes, params = ref.quantize(x, Int2Format(x.shape[-1], g), c)
        assert torch.equal(out[f"{name}_codes"][loc], codes)
        assert torch.equal(out[f"{name}_params"][loc].view(torch.int16), params.view(torch.int16))
        untouched = torch.ones(N, dtype=torch.bool)
        untouched[loc] = False
        assert torch.equal(out[f"{name}_codes"][untouched], pool[f"{name}_codes"][untouched])
        assert out[f"{name}_params"][untouched].isnan().all()
    check_side_buffers(tok, pool, out, tok["k"].float(), tok["v"].float())


def test_store_without_side_buffers(seed):
    tok, N = batch(1, 64, 64)
    pool = poisoned_pool(N, 4, 1, 64, 64, 64, 64)
    for k in ("sink_k", "sink_v", "ring_k", "ring_v"):
        pool.pop(k)
    for k in ("positions", "token_rows", "token_seq_lens"):
        tok.pop(k)
    out = run_store(tok, pool, k_group=64, v_group=64)
    codes, _ = ref.quantize(tok["k"], Int2Format(64, 64))
    assert torch.equal(out["k_codes"][tok["loc"]], codes)
    with pytest.raises(ValueError, match="together"):
        run_store(tok, dict(pool, sink_k=torch.zeros(4, S, 1, 64).bfloat16()), k_group=64, v_group=64)


@pytest.mark.parametrize("d,g", [(128, 32), (64, 64)])
def test_store_with_rotation(seed, d, g):
    hkv = 2
    tok, N = batch(hkv, d, d)
    pool = poisoned_pool(N, 4, hkv, d, d, g, g)
    # per-head rotations: Hadamard times a random sign flip / random orthogonal
    rk = torch.stack([hadamard(d).float() * torch.sign(torch.randn(d)) for _ in range(hkv)])
    rv = torch.stack([torch.linalg.qr(torch.randn(d, d))[0] for _ in range(hkv)]).float()
    out = run_store(tok, pool, k_group=g, v_group=g, k_clip=0.95, k_rot=rk, v_rot=rv)
    loc = tok["loc"]
    for name, x, rot, c in (("k", tok["k"], rk, 0.95), ("v", tok["v"], rv, 1.0)):
        xr = torch.einsum("thd,hde->the", x.double(), rot.double()).float()
        codes, params = ref.quantize(xr, Int2Format(d, g), c)
        got = ref.unpack_codes(out[f"{name}_codes"][loc]).int()
        exp = ref.unpack_codes(codes).int()
        assert (got - exp).abs().max() <= 1
        assert (got != exp).float().mean() <= 5e-3
        torch.testing.assert_close(out[f"{name}_params"][loc].float(), params.float(), rtol=1e-3, atol=1e-6)
        for buf in ("sink", "ring"):
            b = out[f"{buf}_{name}"].float()
            assert not b[~b.isnan()].isinf().any()
    xk = torch.einsum("thd,hde->the", tok["k"].double(), rk.double())
    xv = torch.einsum("thd,hde->the", tok["v"].double(), rv.double())
    # side buffers hold bf16(rotated x): equal up to one bf16 rounding of the fp32 product
    for name, x in (("k", xk), ("v", xv)):
        for i, (p, r) in enumerate(zip(tok["positions"].tolist(), tok["token_rows"].tolist())):
            if p < S:
                torch.testing.assert_close(out[f"sink_{name}"][r, p].double(), x[i], rtol=8e-3, atol=1e-5)
