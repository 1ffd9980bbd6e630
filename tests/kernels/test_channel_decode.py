"""Decode over per-channel keys (triton/channel_decode.py) vs the float64 reference, and the
PTX operand idioms of its body emulated bit for bit (the interpreter never runs them).

Pool, oracle and bound: tests/kernels/channel_case.py.
"""
import inspect

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref

from .channel_case import REQS_32, REQS_64, ChannelPool, channel_fmt, run_decode
from .pool_case import DEV, REL_TOL, rel_err

pytestmark = pytest.mark.slow  # the module's cases take minutes on 2 cores: make test, not test-fast


# every key width at both served head dims: at 128 3-bit keys run the planes, 2-bit keys and all
# values code words; at 64 3-bit keys run the packed quarter body and every code is read as bytes;
# value groups of 32, 64 and 128
@pytest.mark.parametrize("D,bits,B,vg,gqa,splits", [
    (128, 3, 32, 128, 4, "auto"),
    (128, 3, 32, 64, 2, "given"),
    (128, 2, 32, 64, 4, "auto"),
    (128, 2, 64, 128, 2, "given"),
    (128, 4, 32, 32, 2, "given"),
    (128, 4, 64, 64, 4, "auto"),
    (128, 4, 64, 128, 4, "auto"),
    (64, 2, 32, 64, 3, "given"),
    (64, 2, 32, 16 * 2, 1, "auto"),
    (64, 4, 32, 64, 2, "given"),
    (64, 3, 64, 64, 2, "auto"),
    (64, 3, 32, 32, 4, "given"),
])
def test_decode_channel_matches_reference(seed, D, bits, B, vg, gqa, splits):
    hkv = 2
    reqs = REQS_32 if B == 32 else REQS_64
    fmt = channel_fmt(D, bits, B, vg)
    pool = ChannelPool(fmt, *map(list, zip(*reqs)), hkv=hkv)
    nb = len(reqs)
    q = (torch.randn(nb, hkv * gqa, D) * 2).bfloat16()
    # given: a few splits per request (more splits than body blocks for some); auto: the body's
    # key count in chunks of 32 keys (min_chunk), so the longer requests use several body splits
    nsplit = torch.randint(2, 6, (nb,), dtype=torch.int32).to(DEV) if splits == "given" else None
    o = run_decode(pool, q, 5, nsplit, min_chunk=32)
    assert not o.isnan().any()
    for b in range(nb):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V)
        assert rel_err(o[b], o_ref[0]) <= REL_TOL, (b, rel_err(o[b], o_ref[0]))


# the split merge (fused into the last program of each (request, KV head), or the merge kernel),
# with split counts per request given (some above a request's body blocks) and derived
@pytest.mark.parametrize("fused,splits", [(True, "given"), (True, "auto"), (False, "auto"), (False, "given")])
def test_decode_channel_fused_merge(seed, fused, splits):
    D, bits, B, vg, gqa, hkv = 128, 3, 64, 64, 4, 2
    pool = ChannelPool(channel_fmt(D, bits, B, vg), *map(list, zip(*REQS_64)), hkv=hkv)
    nb = len(REQS_64)
    q = (torch.randn(nb, hkv * gqa, D) * 2).bfloat16()
    nsplit = torch.randint(2, 6, (nb,), dtype=torch.int32).to(DEV) if splits == "given" else None
    arrived = torch.zeros(nb * hkv + 3, dtype=torch.int32, device=DEV)
    o = run_decode(pool, q, 5, nsplit, min_chunk=32, fused_merge=fused, arrived=arrived, launcher=True)
    assert not o.isnan().any()
    assert not arrived.any()  # the merging programs left their counters at zero for the next call
    for b in range(nb):
        K, V = pool.request_kv(b)
        o_ref, _ = ref.attention(q[b:b + 1].float(), K, V)
        assert rel_err(o[b], o_ref[0]) <= REL_TOL, (b, rel_err(o[b], o_ref[0]))


@pytest.mark.parametrize("D,bits", [(64, 3), (128, 3), (128, 4)])
def test_decode_channel_logit_cap_and_default_plan(seed, D, bits):
    """Logit cap; split count and scratch from the defaults (no max_kv_splits, no scratch). At
    head_dim 128 with the 3-bit planes, which apply the softmax scale per tile, and with 4-bit
    keys' subnormal operands (NIBBLES: the cap sees the sums scaled back)."""
    gqa, cap = 2, 5.0
    fmt = channel_fmt(D, bits, 32, 64)
    pool = ChannelPool(fmt, [1, 110], [0, 0], [0, 0], hkv=1)
    q = (torch.randn(2, gqa, D) * 4).bfloat16()
    o = torch.full((2, gqa, D), float("nan"), device=DEV)
    ops.decode_attention_channel(q.to(DEV), o, *pool.args(), **pool.kw(), sm_scale=0.125, logit_cap=cap)
    for b in range(2):
        K, V = pool.request_kv(b)
        s = torch.einsum("thd,lhd->htl", q[b:b + 1].double(), K.double().repeat_interleave(gqa, 1)) * 0.125
        p = torch.softmax(cap * torch.tanh(s / cap), -1)
        o_ref = torch.einsum("htl,lhd->thd", p, V.double().repeat_interleave(gqa, 1))
        assert rel_err(o[b].cpu(), o_ref[0]) <= REL_TOL


class _Launched(Exception):
    pass


def _launch(monkeypatch, D, bits, **kw):
    """(positional args, keywords) of the decode launch ops.decode_attention_channel makes (the
    kernel replaced by a recorder that stops the call)."""
    from oscar_kernels.triton import channel_decode

    class Rec:
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise _Launched(a, k)
            return launch

    monkeypatch.setattr(channel_decode, "channel_kernel", Rec())
    fmt = channel_fmt(D, bits, 32, 64)
    pool = ChannelPool(fmt, [1, 40], [0, 0], [0, 0], hkv=1)
    q = torch.randn(2, 2, D).bfloat16().to(DEV)
    with pytest.raises(_Launched) as e:
        ops.decode_attention_channel(q, torch.empty(2, 2, D, device=DEV), *pool.args(), **pool.kw(),
                                     sm_scale=0.1, **kw)
    return e.value.args


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_decode_channel_path_per_key_width_and_head_dim(monkeypatch, D, bits):
    """The body each served format runs: 3-bit keys as planes at head_dim >= PLANES_MIN_DIM (one
    warp), packed below (DECODE_NUM_WARPS[3] warps); value codes (and 2-bit key codes) as int16
    code words at a dim >= 128, as bytes below; 4-bit keys with subnormal nibble operands."""
    from oscar_kernels.triton import channel_decode as ch

    i16, u8 = torch.int16, torch.uint8
    a, k = _launch(monkeypatch, D, bits)
    planes = bits == 3 and D >= ch.PLANES_MIN_DIM
    assert k["PLANES"] == planes and k["NIBBLES"] == (bits == 4)
    assert k["num_warps"] == (ch.PLANES_NUM_WARPS if planes else ch.DECODE_NUM_WARPS[bits])
    words = D >= 128
    assert (k["VWORDS"], k["KWORDS"]) == (words, words and bits == 2)
    assert (a[17].dtype, a[11].dtype) == (i16 if words else u8, i16 if words and bits == 2 else u8)  # VC, KC


def test_sub3_operands_are_exact_subnormals():
    """SUB3's PTX (CUDA only) emulated on every (2-bit plane byte, 1-bit plane byte) pair in each
    half: `and` of the 1-bit plane's widened bytes, shifted left by 2 - E % 2, with HI_BIT_MASK[J],
    then lop3 0xEA with the 2-bit plane's under LO16_MASK[J] (J = E // 2), leaves two fp16 halves
    that are the subnormals (code + 4 * bit) * 4^J * 2^-24 exactly (code: bits 2J..2J+1 of the
    2-bit plane's byte, bit: bit E of the 1-bit plane's), no exponent bit set; NIB_SCALE undoes the
    2^-24."""
    from oscar_kernels.triton import channel_attend as ch

    a, b = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    lo_reg = a | b << 16  # the 2-bit plane's byte pair (a, b)
    hi_bytes = torch.stack([b, a], -1)  # the 1-bit plane's pair (b, a): every combination per half
    hi_reg = b | a << 16
    lo_bytes = torch.stack([a, b], -1)
    for E in range(8):
        J = E // 2
        h = (hi_reg << (2 - E % 2)) & 0xFFFFFFFF  # _shl16: no carry between the halves
        t = h & int(ch.HI_BIT_MASK.value[J], 16)
        r = (lo_reg & int(ch.LO16_MASK.value[J], 16)) | t  # lop3 0xEA: (a & b) | c
        halves = torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16).view(torch.float16).double()
        code = ((lo_bytes >> 2 * J) & 3) + 4 * ((hi_bytes >> E) & 1)
        assert torch.equal(halves, code.double() * 4.0 ** J * 2.0 ** -24), E
        assert torch.equal(halves * ch.NIB_SCALE.value, code.double() * 4.0 ** J), E
        assert int((r & 0x7C007C00).max()) == 0, E  # no exponent bit: subnormal or zero
    # the emulated sequence is the kernel's
    src = inspect.getsource(ch._sub3_operand.fn)
    assert ('"{.reg .b32 t; and.b32 t, $2, " + HI_BIT_MASK[J] + "; lop3.b32 $0, $1, " + LO16_MASK[J]'
            ' + ", t, 0xEA;}"') in src


def test_fp16_key_operand_constants():
    """The quarter body's fp16 key operands' PTX (CUDA only) emulated on every byte pair: 2-bit
    quarter J under KEY16_EXP (1024's exponent, mantissa ulp 1) is BODY_OFS_FP16 + code * 4^J
    (quarter 3 read in place at bits 6-7: 1024 + 3 * 64 fits fp16's 10-bit mantissa), and a packed
    3-bit code c under PACK16_BASE is 1024 + c."""
    from oscar_kernels.triton import channel_attend as ch

    lo, hi = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    w = lo | hi << 16  # two widened bytes (bits 8-15 of each half zero)
    both = torch.stack([lo, hi], -1)
    ofs = ch.BODY_OFS_FP16.value
    for J in range(4):
        r = (w & int(ch.LO16_MASK.value[J], 16)) | int(ch.KEY16_EXP.value, 16)  # lop3 0xEA
        got = torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16).view(torch.float16).double()
        assert torch.equal(got, ofs + ((both >> 2 * J) & 3).double() * 4.0 ** J), J
    c = torch.arange(8, dtype=torch.int32)
    bits = c | ch.PACK16_BASE.value
    assert torch.equal(bits.to(torch.int16).view(torch.float16).double(), ofs + c.double())
    # the emulated sequence is the kernel's
    src = inspect.getsource(ch._lo_operand.fn)
    assert '"{.reg .b32 m, w; mov.b32 m, " + KEY16_EXP + "; mov.b32 w, $1;"' in src
    assert '" lop3.b32 $0, w, " + LO16_MASK[J] + ", m, 0xEA;}"' in src


def test_nibble_operands_are_exact_subnormals():
    """NIBBLES' PTX (CUDA only) emulated on every pair of widened bytes: `and` with NIB_MASK[H]
    leaves two fp16 halves that are the subnormals code * 16^H * 2^-24 (code: nibble H of each
    byte) exactly, for every byte pair; NIB_SCALE undoes the 2^-24. The high nibble's place 16
    keeps every code below 2^10 (no exponent bits)."""
    from oscar_kernels.triton import channel_attend as ch

    lo, hi = torch.meshgrid(torch.arange(256), torch.arange(256), indexing="ij")
    w = lo | hi << 16
    both = torch.stack([lo, hi], -1)
    for H in (0, 1):
        r = w & int(ch.NIB_MASK.value[H], 16)
        halves = torch.stack([r & 0xFFFF, r >> 16], -1).to(torch.int16).view(torch.float16).double()
        code = ((both >> 4 * H) & 15).double()
        assert torch.equal(halves * ch.NIB_SCALE.value, code * 16.0 ** H), H
        assert torch.equal(halves, code * 16.0 ** H * 2.0 ** -24), H
        assert int((r & 0x7C007C00).max()) == 0, H  # no exponent bit set: subnormal or zero


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i is byte (sel >> 4i) & 7 of b:a (a bytes 0-3),
    replicated sign if bit 3 of that digit is set."""
    src, out = a | b << 32, 0
    for i in range(4):
        d = (sel >> 4 * i) & 15
        byte = (src >> 8 * (d & 7)) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if d & 8 else byte) << 8 * i
    return out


def test_fp16_code_bits():
    """The dequantising extend's fp16 operands (CUDA): code c in [0, 128) under FP16_CODE_BASE,
    shifted by FP16_CODE_SHIFT, is exactly 128 + c, and minus 128 gives c back (the interpreter
    runs fp32, so the bits are checked here)."""
    from oscar_kernels.triton import core_codes as ch

    c = torch.arange(128, dtype=torch.int32)
    bits = ((c << ch.FP16_CODE_SHIFT.value) | ch.FP16_CODE_BASE.value).to(torch.int16)
    x = bits.view(torch.float16)
    assert torch.equal(x.double(), 128.0 + c.double())
    assert torch.equal((x - 128.0).double(), c.double())  # exact in fp16


def test_widen_prmt_selectors(seed):
    """core_codes.widen's PTX (CUDA only) emulated on registers of four random bytes: the two outputs hold
    bytes 0, 1 and 2, 3 zero-extended in their 16-bit halves, low half first (Triton's packing of
    elements into registers), i.e. exactly the uint16 cast."""
    from oscar_kernels.triton import core_codes as ch

    sel = [int(x, 16) for x in ch.WIDEN_PRMT.value]
    for w in torch.randint(0, 2**32, (2000,), dtype=torch.int64).tolist() + [0, 0xFFFFFFFF, 0x80808080]:
        elems = [(w >> 8 * i) & 0xFF for i in range(4)]
        halves = [(r >> 16 * h) & 0xFFFF for r in (_prmt(w, 0, sel[0]), _prmt(w, 0, sel[1])) for h in (0, 1)]
        assert halves == elems, hex(w)


def test_decode_channel_rejects_unsupported(seed):
    fmt = channel_fmt(64, 2, 32, 64)
    pool = ChannelPool(fmt, [1, 40], [0, 0], [0, 0], hkv=1)
    q = torch.randn(2, 2, 64).bfloat16().to(DEV)
    o = torch.empty(2, 2, 64, device=DEV)
    args, kw = pool.args(), pool.kw()
    with pytest.raises(ValueError, match="k_codes must be uint8"):
        ops.decode_attention_channel(q, o, *args, **dict(kw, k_bits=3), sm_scale=0.1)
    with pytest.raises(ValueError, match="not a page size"):
        ops.decode_attention_channel(q, o, *args, **dict(kw, k_block=16), sm_scale=0.1)
    with pytest.raises(ValueError, match="k_params must be float16"):
        ops.decode_attention_channel(q, o, args[0], args[1][:, :, :32], *args[2:], **kw, sm_scale=0.1)
    with pytest.raises(ValueError, match="head_dim 32"):
        ops.decode_attention_channel(q[..., :32], o, *args, **kw, sm_scale=0.1)


def test_decode_split_policy(monkeypatch):
    """Decode splits without max_kv_splits: the BF16 splits of the sink and ring
    (core.bf16_splits: one per 160 BF16 keys) and body splits for DECODE_SPLIT_PROGRAMS_PER_SM
    programs per SM over the (request, KV head) pairs, rounded down, >= 1, <= DECODE_MAX_SPLITS
    splits in all (8 SMs off CUDA; an H100's 132 below)."""
    from oscar_kernels.triton import channel_decode as ch

    per, most = ch.DECODE_SPLIT_PROGRAMS_PER_SM, ch.DECODE_MAX_SPLITS
    cpu = torch.device("cpu")
    assert ch.default_decode_splits(1, 1, cpu, 1) == min(most - 1, per * 8) + 1
    assert ch.default_decode_splits(2, 8, cpu, 1) == per * 8 // 16 + 1
    assert ch.default_decode_splits(3, 8, cpu, 2) == max(1, per * 8 // 24) + 2  # no extra wave
    assert ch.default_decode_splits(512, 8, cpu, 1) == 2  # one body split however large the batch
    assert ops.decode_splits_channel(4, 2, 4, 128, cpu) == per * 8 // 8 + 1  # 132 BF16 keys: 1 split
    assert ops.decode_splits_channel(4, 2, 64, 256, cpu) == per * 8 // 8 + 2  # 320: 2
    monkeypatch.setattr(ch, "sm_count", lambda device: 132)
    assert ch.default_decode_splits(1, 8, cpu, 1) == most  # 132 wanted: the cap, BF16 split included
    assert ch.default_decode_splits(1, 8, cpu, 2) == most
    assert ch.default_decode_splits(8, 8, cpu, 1) == per * 132 // 64 + 1
    assert ch.default_decode_splits(64, 8, cpu, 1) == 2 + 1
