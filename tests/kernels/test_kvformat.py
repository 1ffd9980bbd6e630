"""KVFormat (names, validation, sizes) and its float64-checkable references: 2/3/4-bit packing,
per-channel keys over page blocks, token-norm, per-token values, the reader's view of a request."""
import math

import pytest
import torch

from oscar_kernels import Int2Format
from oscar_kernels import reference as ref
from oscar_kernels.format import KVFormat, LayerBits


def keys_with_outliers(L, H, D, sink=4, dtype=torch.float64):
    """K of one request: a few channels 10-30x larger, low-norm sink tokens first."""
    k = torch.randn(L, H, D, dtype=dtype)
    ch = torch.randperm(D)[:3]
    k[..., ch] *= 10 + 20 * torch.rand(3, dtype=dtype)
    k[:sink] *= 1e-2
    return k


def fp16(x):
    return x.to(torch.float16).to(torch.float64)


def minmax_float64(g, bits):
    """Straightforward float64 min-max over the last dim: (codes, scale, min) with fp16 params."""
    top = 2**bits - 1
    mn = fp16(g.min(-1, keepdim=True).values)
    sc = fp16(((g.max(-1, keepdim=True).values - mn) / top).clamp(min=2.0**-20))
    q = torch.floor((g - mn) / sc + 0.5).clamp(0, top)
    return q, sc, mn


# ------------------------------------------------------------------------------------ names


@pytest.mark.parametrize("fmt,name", [
    (KVFormat(128, 2, "channel", 64, 2, 128), "k2c64-v2t128"),
    (KVFormat(128, 3, "channel", 64, 2, 128, token_norm=True), "k3c64-v2t128-tn"),
    (KVFormat(64, 2, "token", 64, 2, 64, rotation="calibrated", k_clip=True, v_clip=True),
     "k2t64-v2t64-cal-kclip-vclip"),
    (KVFormat(64, 4, "channel", 32, 4, 32, rotation="identity", sink=4, window=128),
     "k4c32-v4t32-id-s4-w128"),
    (KVFormat(128, 2, "channel", 64, 2, 128, token_norm=True, sink=0, window=64,
              overrides=(LayerBits((0, -1), k_bits=4), LayerBits((5,), 3, 4))),
     "k2c64-v2t128-tn-s0-w64@0,-1=k4@5=k3v4"),
])
def test_name_is_stable_and_parses_back(fmt, name):
    assert fmt.name == name
    assert KVFormat.parse(name, fmt.head_dim) == fmt


def test_value_group_per_head_spelling():
    """v<bits>h: one value group per token and head, whatever head_dim is (one name for 64- and
    128-dim heads); the canonical name spells the group, and parses back to the same format."""
    for D in (64, 128):
        f = KVFormat.parse("k4c64-v2h-s4-w128@0=k3", D)
        assert f == KVFormat(D, 4, "channel", 64, 2, D, sink=4, window=128, overrides=(LayerBits((0,), 3),))
        assert f.name == f"k4c64-v2t{D}-s4-w128@0=k3" and KVFormat.parse(f.name, D) == f
    with pytest.raises(ValueError, match="value group size 256"):  # no 256-value groups
        KVFormat.parse("k3c64-v2h", 256)
    with pytest.raises(ValueError, match=r"v<bits>t<group> or v<bits>h"):
        KVFormat.parse("k3c64-v2g", 128)


@pytest.mark.parametrize("name,msg", [
    ("k5c64-v2t128", "5-bit keys"),
    ("k2c64-v3t128", "3-bit values"),
    ("k2c48-v2t128", "not a supported page size"),
    ("k2c128-v2t128", "not a supported page size"),
    ("k2c64-v2t128-w32", "shorter than a key block"),
    ("k2t128-v2t128-tn", "token-norm scaling needs per-channel keys"),
    ("k2c64-v2t96", "value group size 96"),
    ("k2c64-v2t128-s8", "sink of 8"),
    ("k2c64-v2t128-w100", "ring of 100"),
    ("k2c64-v2t128-xx", "unknown segment"),
    ("k2c64", "needs a key and a value segment"),
    ("k2c64-v2t128@0=", "is not <layers>="),
    ("k2c64-v2t128@0=k5", "5-bit keys"),
    ("k2c64-v2t128@0=k4@0=k3", "overridden twice"),
    ("k2c64-v2t128-tn-tn", "given twice"),
])
def test_bad_formats_are_rejected_clearly(name, msg):
    with pytest.raises(ValueError, match=msg):
        KVFormat.parse(name, 128)


def test_layer_overrides_are_normalised():
    a = KVFormat(64, v_group=64, overrides=(LayerBits([0, -1], k_bits=4),))
    b = KVFormat(64, v_group=64, overrides=(LayerBits((0, -1), k_bits=4),))
    assert a == b and hash(a) == hash(b) and a.name == "k2c64-v2t64@0,-1=k4"
    assert LayerBits(3, v_bits=4).layers == (3,)
    with pytest.raises(ValueError, match="must be integers"):
        LayerBits(["0"], k_bits=4)


def test_head_dim_and_layer_resolution_errors():
    with pytest.raises(ValueError, match="head_dim=96"):
        KVFormat(96, v_group=32)
    f = KVFormat.parse("k2c64-v2t64@0,-1=k4", 64)
    assert f.layer_bits(0, 30) == (4, 2) and f.layer_bits(29, 30) == (4, 2)
    assert f.layer_bits(1, 30) == (2, 2)
    with pytest.raises(ValueError, match="pass num_layers"):
        f.layer_bits(3)
    with pytest.raises(ValueError, match="overridden twice"):
        f.layer_bits(0, 1)  # 0 and -1 are the same layer of a 1-layer model
    with pytest.raises(ValueError, match="does not exist"):
        KVFormat.parse("k2c64-v2t64@40=k4", 64).layer_bits(0, 30)


# ------------------------------------------------------------------------------------ packing


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("D", [64, 128])
def test_pack_bits_layout(seed, bits, D):
    q = torch.randint(0, 2**bits, (5, 2, D), dtype=torch.uint8)
    p = ref.pack_bits(q, bits)
    assert p.dtype == torch.uint8 and p.shape == (5, 2, bits * D // 8)
    assert torch.equal(ref.unpack_bits(p, bits), q)
    j = 3
    if bits == 4:  # half split
        assert torch.equal(p[..., j], q[..., j] | (q[..., j + D // 2] << 4))
    if bits == 3:  # 2-bit plane (quarter split of the low bits) + 1-bit plane (eighth split)
        assert torch.equal(p[..., : D // 4], ref.pack_codes(q & 3))
        expect = sum(((q[..., j + k * D // 8] >> 2) & 1).int() << k for k in range(8))
        assert torch.equal(p[..., D // 4 + j].int(), expect)


def test_two_bit_rows_are_the_served_int2_format(seed):
    x = keys_with_outliers(40, 3, 128, dtype=torch.float32)
    for G in (32, 64, 128):
        c, p = ref.quantize_rows(x, 2, G)
        c2, p2 = ref.quantize(x, Int2Format(128, G))
        assert torch.equal(c, c2) and torch.equal(p, p2)


# ------------------------------------------------------------------------------------ keys


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("block", [32, 64])
def test_key_blocks_match_float64_math(seed, bits, block):
    L, H, D = 3 * block + 17, 2, 64
    k = keys_with_outliers(L, H, D)
    codes, params, norms = ref.quantize_key_blocks(k, bits, block)
    n = L // block
    assert norms is None and codes.shape == (n * block, H, bits * D // 8)
    assert params.shape == (n, H, D, 2) and params.dtype == torch.float16
    g = k[: n * block].reshape(n, block, H, D).permute(0, 2, 3, 1)  # [n, H, D, block]
    q, sc, mn = minmax_float64(g, bits)
    got = ref.unpack_bits(codes, bits).reshape(n, block, H, D).permute(0, 2, 3, 1)
    assert torch.equal(got.double(), q)
    assert torch.equal(params[..., 0].double(), sc[..., 0])
    assert torch.equal(params[..., 1].double(), mn[..., 0])
    xh = ref.dequantize_key_blocks(codes, params, None, bits, torch.float64)
    xh_g = xh.reshape(n, block, H, D).permute(0, 2, 3, 1)
    # every value is on its channel's grid mn + i*sc, i in 0..2^bits-1 ...
    assert torch.equal(xh_g, q * sc + mn)
    # ... and within half a step of the input (the fp16 min moves the grid by < 2^-10 relative)
    err = (xh_g - g).abs()
    assert torch.all(err <= 0.5 * sc + mn.abs() * 2**-10 + 1e-12)
    # the group's min is reconstructed (code 0), and its max up to the fp16 scale
    assert torch.all(q.min(-1).values == 0) and torch.all(q.max(-1).values == 2**bits - 1)


def test_error_shrinks_with_bits_and_outlier_channels_do_not_spread(seed):
    L, H, D, B = 128, 2, 64, 64
    k = keys_with_outliers(L, H, D, sink=0)
    big = k.abs().amax((0, 1)) > 5  # the outlier channels
    errs = []
    for bits in (2, 3, 4):
        xh = ref.dequantize_key_blocks(*ref.quantize_key_blocks(k, bits, B), bits, torch.float64)
        errs.append((xh - k).pow(2).mean().item())
        # per-channel: the normal channels' error does not grow with the outliers' size
        normal = (xh - k)[..., ~big].abs().max().item()
        assert normal < 0.5 * (k[..., ~big].max() - k[..., ~big].min()).item() / (2**bits - 1) + 1e-3
    assert errs[0] > errs[1] > errs[2]


def test_blocks_are_aligned_to_position_zero_and_independent(seed):
    L, H, D, B = 5 * 32 + 9, 2, 64, 32
    k = keys_with_outliers(L, H, D)
    fmt = KVFormat(64, 2, "channel", B, 2, 64, window=64)
    full = ref.format_fake_quant(k, fmt, "k")
    # blocks start at 0, B, 2B...: quantising from any block boundary gives the same body
    for start in (B, 3 * B):
        assert torch.equal(ref.format_fake_quant(k[start:], fmt, "k"), full[start:])
    # a change inside block 2 changes block 2 only
    k2 = k.clone()
    k2[2 * B + 5, :, 7] += 50.0
    full2 = ref.format_fake_quant(k2, fmt, "k")
    changed = (full2 != full).any(-1).any(-1).nonzero().flatten()
    assert changed.min() >= 2 * B and changed.max() < 3 * B
    # the partial last block (positions 160..168) is untouched: no params exist for it yet
    assert torch.equal(full[5 * B:], k[5 * B:])
    assert not torch.equal(full[: 5 * B], k[: 5 * B])


def test_token_norm_equivariance_and_low_norm_sink_tokens(seed):
    L, H, D, B = 64, 2, 64, 64
    k = keys_with_outliers(L, H, D, sink=4)
    tn = KVFormat(64, 2, "channel", B, 2, 64, token_norm=True)
    plain = KVFormat(64, 2, "channel", B, 2, 64)
    codes, params, norms = ref.quantize_key_blocks(k, 2, B, token_norm=True)
    assert norms.shape == (L, H) and norms.dtype == torch.float16
    assert torch.equal(norms.double(), fp16(k.norm(dim=-1)))
    base = ref.format_fake_quant(k, tn, "k")
    # scaling one token by a power of two scales its read-back row exactly and leaves the other
    # tokens of its block bit-identical (the normalised rows, hence the block's grid, are equal)
    k2 = k.clone()
    k2[10] *= 2.0**6
    out = ref.format_fake_quant(k2, tn, "k")
    assert torch.equal(out[10], base[10] * 2.0**6)
    others = torch.arange(L) != 10
    assert torch.equal(out[others], base[others])
    # without token-norm the same change moves the other tokens' grid
    assert not torch.equal(ref.format_fake_quant(k2, plain, "k")[others],
                           ref.format_fake_quant(k, plain, "k")[others])
    # low-norm sink tokens: relative error bounded by the normalised grid with token-norm,
    # dominated by the big tokens' range without it
    rel = lambda f: ((ref.format_fake_quant(k, f, "k") - k)[:4].norm(dim=-1)  # noqa: E731
                     / k[:4].norm(dim=-1)).max().item()
    assert rel(tn) < 1.0 < rel(plain)


def test_token_norm_is_rotation_invariant(seed):
    k = keys_with_outliers(64, 2, 64)
    R, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))
    n0 = k.norm(dim=-1)
    n1 = (k @ R).norm(dim=-1)
    assert torch.allclose(n0, n1, rtol=1e-12)
    # the stored fp16 norms agree except where float64 noise straddles an fp16 rounding edge
    same = ref.token_norms(k) == ref.token_norms(k @ R)
    assert same.float().mean() > 0.99


# ------------------------------------------------------------------------------------ values


@pytest.mark.parametrize("bits", [2, 4])
def test_values_per_token_groups(seed, bits):
    v = keys_with_outliers(20, 2, 128)
    codes, params = ref.quantize_rows(v, bits, 64)
    assert codes.shape == (20, 2, bits * 16) and params.shape == (20, 2, 2, 2)
    q, sc, mn = minmax_float64(v.reshape(20, 2, 2, 64), bits)
    assert torch.equal(ref.unpack_bits(codes, bits).reshape(20, 2, 2, 64).double(), q)
    back = ref.dequantize_rows(codes, params, bits, torch.float64)
    assert torch.equal(back.reshape(20, 2, 2, 64), q * sc + mn)


# ------------------------------------------------------------------------------------ bits


@pytest.mark.parametrize("name", ["k2c64-v2t128", "k2c32-v2t128-tn", "k3c64-v2t64", "k4c32-v4t32",
                                  "k2t128-v2t128", "k3t64-v4t128", "k2c64-v2t128-tn@0,-1=k4",
                                  "k3c32-v2t128@1=k2v4"])
def test_bits_accounting_counts_packed_bytes(seed, name):
    D, H, L, layers = 128, 2, 128, 4  # L: whole blocks of 32 and 64
    fmt = KVFormat.parse(name, D)
    total = 0
    for layer in range(layers):
        kb, vb = fmt.layer_bits(layer, layers)
        k, v = keys_with_outliers(L, H, D), torch.randn(L, H, D, dtype=torch.float64)
        if fmt.k_layout == "channel":
            ks = [t for t in ref.quantize_key_blocks(k, kb, fmt.k_group, fmt.token_norm) if t is not None]
        else:
            ks = list(ref.quantize_rows(k, kb, fmt.k_group))
        vs = list(ref.quantize_rows(v, vb, fmt.v_group))
        nbytes = sum(t.numel() * t.element_size() for t in ks + vs)
        assert nbytes == L * fmt.bytes_per_token(H, layer, layers)
        shapes = {n: s for n, (s, _dt) in fmt.pool_tensors(L, H, layer, layers).items()}
        assert sorted(tuple(t.shape) for t in ks + vs) == sorted(shapes.values())
        total += nbytes
    assert math.isclose(8 * total / (2 * L * H * D * layers), fmt.body_bits_per_element(layers))


def test_bits_per_element_values():
    f = lambda n: KVFormat.parse(n, 128).body_bits_per_element()  # noqa: E731
    assert f("k2t128-v2t128") == Int2Format(128, 128).bits_per_element == 2.25
    assert f("k2c64-v2t128") == (2.5 + 2.25) / 2
    assert f("k3c64-v2t128-tn") == (3.5 + 16 / 128 + 2.25) / 2
    with pytest.raises(ValueError, match="pass num_layers"):
        KVFormat.parse("k2c64-v2t128@0=k4", 128).body_bits_per_element()


# ------------------------------------------------------------------------------------ reader


def test_reader_view_of_one_request(seed):
    fmt = KVFormat.parse("k2c32-v2t64-tn-s4-w64", 64)
    L, H, D = 150, 2, 64
    k = keys_with_outliers(L, H, D, dtype=torch.float32)
    for kv_len in (100, 128, 150):
        is_sink, is_ring, is_body = ref.format_source_masks(kv_len, fmt)
        p = torch.arange(kv_len)
        assert torch.equal(is_sink, p < 4)
        assert torch.equal(is_ring, p >= kv_len - 64)
        # every body position lies in a complete block of the first kv_len positions
        assert torch.all((p[is_body] // 32 + 1) * 32 <= kv_len)
        eff = ref.format_request_kv(k, fmt, "k", kv_len)
        body = ref.format_fake_quant(k[:kv_len], fmt, "k")
        hp = k[:kv_len].to(torch.bfloat16).float()
        assert torch.equal(eff[is_sink | is_ring], hp[is_sink | is_ring])
        assert torch.equal(eff[is_body], body[is_body])
        assert not torch.equal(eff[is_body], hp[is_body])
    # a radix prefix without ring copies (own_start) that ends mid-block cannot be served
    with pytest.raises(ValueError, match="incomplete block"):
        ref.format_source_masks(150, fmt, own_start=140)
