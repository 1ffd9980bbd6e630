"""The INT2 format and the PyTorch reference quantiser (the oracle of the kernel tests)."""
import pytest
import torch

from oscar_kernels import Int2Format, bits_per_element
from oscar_kernels import reference as ref
from oscar_kernels.hadamard import bit_reverse_indices, hadamard


def heavy_tailed_rows(n, d, outlier_channels=4, sink_rows=2):
    """Rows with a few heavy-tailed channels and some low-norm (sink-like) rows."""
    x = torch.randn(n, d)
    ch = torch.randperm(d)[:outlier_channels]
    x[:, ch] *= 20 * torch.rand(outlier_channels)
    x[:sink_rows] *= 1e-3
    return x


@pytest.mark.parametrize("D", [64, 128, 256])
def test_pack_unpack_roundtrip(seed, D):
    q = torch.randint(0, 4, (7, 3, D), dtype=torch.uint8)
    packed = ref.pack_codes(q)
    assert packed.shape == (7, 3, D // 4) and packed.dtype == torch.uint8
    assert torch.equal(ref.unpack_codes(packed), q)
    # quarter split: byte j holds dims j, j+D/4, j+D/2, j+3D/4 at bits 0,2,4,6
    j = 5
    expect = q[..., j] | (q[..., j + D // 4] << 2) | (q[..., j + D // 2] << 4) | (q[..., j + 3 * D // 4] << 6)
    assert torch.equal(packed[..., j], expect)


@pytest.mark.parametrize("D,G", [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128), (256, 128)])
def test_quantize_error_within_half_step(seed, D, G):
    fmt = Int2Format(D, G)
    x = heavy_tailed_rows(50, D)
    codes, params = ref.quantize(x, fmt)
    assert codes.shape == (50, D // 4) and params.shape == (50, D // G, 2)
    assert params.dtype == torch.float16
    xh = ref.dequantize(codes, params, fmt)
    scale = params[..., 0].float().repeat_interleave(G, dim=-1)
    # without clipping every value is within half a step (+ fp16 rounding of the grid) of its code
    err = (xh - x).abs()
    assert torch.all(err <= 0.5 * scale + 1e-3 * scale + 1e-6), (err / scale).max()


def test_exactly_representable_values_roundtrip(seed):
    fmt = Int2Format(64, 32)
    base = torch.randint(-4, 4, (10, 2, 1)).float()
    step = 2.0 ** torch.randint(-3, 3, (10, 2, 1)).float()
    q = torch.randint(0, 4, (10, 2, 32)).float()
    q[..., 0], q[..., 1] = 0, 3  # pin min and max so the grid is exactly base + step*q
    x = (base + step * q).reshape(10, 64)
    assert torch.equal(ref.fake_quant(x, fmt), x)


def test_clip_clamps_to_quantile(seed):
    fmt = Int2Format(128, 128)
    x = torch.randn(4, 128)
    x[:, 0] = 100.0
    thr = x.abs().sort(-1).values[:, int(0.9 * 128)]
    xh = ref.fake_quant(x, fmt, clip_ratio=0.9)
    assert torch.all(xh.abs().amax(-1) <= thr * (1 + 1e-2) + 1e-3)
    assert torch.equal(ref.fake_quant(x, fmt, 1.0), ref.fake_quant(x, fmt, None))
    with pytest.raises(ValueError):
        ref.quantize(x, fmt, clip_ratio=0.0)


def test_clipping_reduces_error_on_heavy_tails(seed):
    fmt = Int2Format(128, 128)
    x = torch.randn(2000, 128)
    x[:, :2] *= 30
    e_no = (ref.fake_quant(x, fmt) - x).pow(2).mean()
    e_clip = (ref.fake_quant(x, fmt, 0.96) - x).pow(2).mean()
    assert e_clip < e_no


def test_bits_per_element():
    assert bits_per_element(128) == 2.25 and Int2Format(128, 128).bits_per_element == 2.25
    assert bits_per_element(64) == 2.5 and bits_per_element(32) == 3.0
    assert Int2Format(128, 64).bytes_per_row == 32 + 8
    with pytest.raises(ValueError):
        Int2Format(96, 32)
    with pytest.raises(ValueError):
        Int2Format(64, 128)


def test_source_masks_rule():
    s, r, i = ref.source_masks(400, sink=64, window=256, own_start=0)
    assert s[:64].all() and not s[64:].any()
    assert r[144:].all() and not r[:144].any()
    assert i[64:144].all() and i.sum() == 80
    # positions inherited from the radix cache (p < own_start) read INT2
    s, r, i = ref.source_masks(400, 64, 256, own_start=200)
    assert not s.any() and r[200:].all() and i[:200].all()
    # short request: everything is BF16, sink and ring never both claim a position
    s, r, i = ref.source_masks(100, 64, 256)
    assert not i.any() and not (s & r).any()


def test_attention_reference_matches_sdpa(seed):
    q = torch.randn(3, 8, 64)
    k = torch.randn(20, 2, 64)
    v = torch.randn(20, 2, 64)
    o, lse = ref.attention(q, k, v)
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    exp = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).double(), kk.transpose(0, 1).double(), vv.transpose(0, 1).double()
    ).transpose(0, 1)
    torch.testing.assert_close(o, exp)
    # merging two halves equals the whole
    o1, l1 = ref.attention(q, k[:7], v[:7])
    o2, l2 = ref.attention(q, k[7:], v[7:])
    om, lm = ref.merge_attention_states(o1, l1, o2, l2)
    torch.testing.assert_close(om, o)
    torch.testing.assert_close(lm, lse)


@pytest.mark.parametrize("n", [1, 2, 64, 128, 256])
def test_hadamard_orthonormal(n):
    h = hadamard(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64))
    torch.testing.assert_close(h, h.T)
    perm = bit_reverse_indices(n)
    assert sorted(perm.tolist()) == list(range(n))


def test_source_masks_carried_sink():
    # a radix hit whose sink copies were carried over: sink from 0, ring from own_start
    s, r, i = ref.source_masks(400, 64, 256, own_start=300, sink_start=0)
    assert s[:64].all() and not s[64:].any()
    assert r[300:].all() and not r[:300].any()
    assert i[64:300].all() and not i[:64].any() and not i[300:].any()
    # sink_start defaults to own_start
    s2, _, _ = ref.source_masks(400, 64, 256, own_start=10)
    assert not s2[:10].any() and s2[10:64].all()
