"""Compiled-kernel properties on sm_90 (no GPU): pipelined INT2 loops, shared memory that fits.

The INT2 loops of the fast decode and extend kernels keep the next tile's loads in flight.

Compiled for sm_90 without a GPU (Triton ships ptxas) by tests/kernels/sm90.py, in a subprocess so
this process keeps its interpreter setting. With a too-shallow software pipeline (the default
depth 2), Triton loads the slot indices synchronously and waits for every tile's code copies right
after issuing them: the compiled loop then waits with 0 copy groups in flight, and on the H100
decode was 7-14% slower and extend 6-10% slower (docs/benchmarks.md, "Kernels", 2026-11-22
13:36 / 13:53 UTC).
"""
import pytest

from tests.kernels import sm90


@pytest.mark.parametrize("what", ["decode", "extend"], ids=["decode_fast", "extend_fast"])
def test_int2_loop_overlaps_loads_with_compute(what):
    res = sm90.run(what)
    # 5 = one tile's code / param copies (4 groups) + the slot indices of the tile after it
    assert res["in_flight"] >= 5, f"the INT2 loop waits with {res['in_flight']} copy groups in flight: {res}"


def test_shallow_pipeline_is_detected():
    """The check above can fail: the same decode kernel at depth 2 waits with nothing in flight."""
    assert sm90.run("decode", "--int2-stages", "2")["in_flight"] == 0


def test_every_supported_shape_fits_h100_shared_memory():
    """Decode and extend-prefix at every head_dim / group size, as ops selects the kernels, compile
    for sm_90 within 227 KB of shared memory per block (head_dim 256 at G=32 needed 290 KB before
    its decode tile was cut to 32 keys: a launch failure on the GPU the interpreter cannot see)."""
    res = sm90.run("fit")
    over = [k for k in res["kernels"] if k["smem"] > res["limit"]]
    assert not over, over
    assert len(res["kernels"]) == 16, res  # 8 (D, G) pairs x (decode, extend-prefix)
    assert {(k["D"], k["G"], k["op"]) for k in res["kernels"]} == {
        (D, G, op) for D in (64, 128, 256) for G in (32, 64, 128) if G <= D
        for op in ("decode", "extend-prefix")}


@pytest.mark.parametrize("fused", [False, True], ids=["merge_kernel", "fused_merge"])
def test_fast_decode_fits_its_programs_per_sm(fused):
    """PROGRAMS_PER_SM (12) one-warp programs of the fast decode must run at once on an H100 SM
    (64K registers, 228 KB of shared memory, 1 KB of it reserved per block): its own split policy
    aims at SPLIT_PROGRAMS_PER_SM (8) per SM and SGLang's split counts in the server go higher, and
    every grid up to 12 per SM then runs in one wave. With more registers or shared memory such
    grids would spill into a second wave."""
    from oscar_kernels.triton import attend_fast

    res = sm90.run("decode", *(("--fused-merge",) if fused else ()))
    regs, smem = res["regs"], res["static_smem"] + res["dynamic_smem"]
    per_sm_regs = 65536 // (-(-regs // 8) * 8 * 32 * attend_fast.NUM_WARPS)
    per_sm_smem = 233472 // (smem + 1024)
    assert min(per_sm_regs, per_sm_smem) >= attend_fast.PROGRAMS_PER_SM, res
    assert attend_fast.SPLIT_PROGRAMS_PER_SM <= attend_fast.PROGRAMS_PER_SM


@pytest.mark.parametrize("bits,reads,fused", [(b, r, False) for b in ("3", "2", "4") for r in ("words", "bytes")]
                         + [("3", "words", True)])
def test_channel_decode_fits_its_programs_per_sm(bits, reads, fused):
    """One-warp per-channel decode programs (B=8, L=32K, D=128; 3-bit keys as planes; code words,
    the default, and byte reads) fit DECODE_SPLIT_PROGRAMS_PER_SM on an H100 SM by registers and by
    shared memory (1 KB reserved per block), with no spill traffic in any loop: the split plan
    sizes its grid for that many, so a kernel that grew past them would run a second, nearly empty
    wave. The words bodies sit at 254-255 registers (2026-11-27): one more live value spills.
    fused: the variant that merges the splits in its last program (batches of 9 requests and more
    with 8 KV heads on an H100)."""
    args = ("--bits", bits, "--code-reads", reads) + (("--fused-merge", "1") if fused else ())
    from oscar_kernels.triton import attend_channel as ch

    res = sm90.run("channel", "--batch", "8", *args)
    assert res["num_warps"] == 1, res
    per_sm_regs = 65536 // (-(-res["regs"] // 8) * 8 * 32)
    per_sm_smem = 233472 // (res["static_smem"] + res["dynamic_smem"] + 1024)
    assert min(per_sm_regs, per_sm_smem) >= ch.DECODE_SPLIT_PROGRAMS_PER_SM, res
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res
    assert all(loop["local"] == 0 for loop in res["loops"]), res


def test_channel_3bit_planes_fewer_instructions_no_spills():
    """The per-channel decode's 3-bit 'planes' body (attend_channel.PLANES_NUM_WARPS warps) at the
    served shape (D=128, B=8, L=32K): no register spills, and fewer SASS instructions issued per
    body tile than the 'packed' body at its DECODE_NUM_WARPS (a loop's instructions run
    once per warp, so the count per tile is the loop's instructions times the warps). Both are
    compiled here; the only fixed number is a sanity bound on what the loop census found."""
    packed = sm90.run("channel", "--bits", "3", "--batch", "8", "--k3-variant", "packed")
    planes = sm90.run("channel", "--bits", "3", "--batch", "8", "--k3-variant", "planes")
    assert not packed["planes"] and planes["planes"], (packed, planes)
    for r in (packed, planes):
        body = r["loops"][0]  # the largest loop: a quantised-body loop (the edge blocks' since 2026-11-27)
        assert body["hmma"] >= 32 and 200 < body["instructions"] < 20000, r
    assert planes["spill_stores"] == 0 and planes["spill_loads"] == 0 and planes["stack"] == 0, planes
    per_tile = {n: r["loops"][0]["instructions"] * r["num_warps"] for n, r in (("packed", packed), ("planes", planes))}
    assert per_tile["planes"] < per_tile["packed"], (per_tile, packed, planes)


def test_channel_4bit_nibbles_fewer_instructions_no_spills():
    """4-bit keys at the served shape (D=128, B=8, L=32K): the body with subnormal nibble operands
    (NIBBLES: the default with fp16 key operands, the edge blocks in their own loop) issues fewer
    SASS instructions per body tile than the offset operands' one masked loop ('fp16-shifted'
    keeps it), at the same warps, with no spills. Both are compiled here; no fixed count is
    assumed."""
    nibbles = sm90.run("channel", "--bits", "4", "--batch", "8")
    offsets = sm90.run("channel", "--bits", "4", "--batch", "8", "--key-operands", "fp16-shifted")
    assert nibbles["num_warps"] == offsets["num_warps"] == 1, (nibbles, offsets)
    for r in (nibbles, offsets):
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, r
        assert r["loops"][0]["hmma"] >= 32 and 200 < r["loops"][0]["instructions"] < 20000, r
    # NIBBLES' two largest loops are its edge loop (masked) and its body loop: both are smaller
    assert nibbles["loops"][0]["instructions"] < offsets["loops"][0]["instructions"], (nibbles, offsets)


def test_channel_3bit_subnormal_operands_fewer_mmas_no_spills():
    """3-bit keys at the served shape (D=128, B=8, L=32K): the planes body with one subnormal
    operand an eighth (SUB3, key_operands 'fp16-subnormal', the default) issues fewer SASS
    instructions and half the key MMAs per body tile of 'fp16-paired' (two operands an eighth),
    with no spills, at one warp. Both are compiled here; no fixed count is assumed."""
    sub = sm90.run("channel", "--bits", "3", "--batch", "8")
    paired = sm90.run("channel", "--bits", "3", "--batch", "8", "--key-operands", "fp16-paired")
    assert sub["planes"] and paired["planes"] and sub["num_warps"] == paired["num_warps"] == 1, (sub, paired)
    for r in (sub, paired):
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, r
        assert r["loops"][0]["hmma"] >= 32 and 200 < r["loops"][0]["instructions"] < 20000, r
    # the two largest loops, the edge blocks' (masked) and the body's: the key MMAs halve (8
    # eighths x 4 row tiles fewer), the values' stay
    for s, p in zip(sub["loops"][:2], paired["loops"][:2]):
        assert s["instructions"] < p["instructions"] and p["hmma"] - s["hmma"] == 32, (s, p)


def test_channel_decode_word_reads_fewer_instructions_no_spills():
    """The per-channel decode reading codes as 16-bit words (2-bit keys and values, D=128, B=8,
    L=32K): no register spills, MMAs in the body loop, and fewer SASS instructions per body tile
    than the byte reads at the same warps. Both are compiled here; no fixed count is assumed."""
    byte_reads = sm90.run("channel", "--bits", "2", "--batch", "8", "--code-reads", "bytes")
    word_reads = sm90.run("channel", "--bits", "2", "--batch", "8", "--code-reads", "words")
    assert byte_reads["words"] == [False, False] and word_reads["words"] == [True, True], (byte_reads, word_reads)
    assert byte_reads["num_warps"] == word_reads["num_warps"]
    for r in (byte_reads, word_reads):
        body = r["loops"][0]
        assert body["hmma"] >= 32 and 200 < body["instructions"] < 20000, r
    assert word_reads["spill_stores"] == 0 and word_reads["spill_loads"] == 0 and word_reads["stack"] == 0, word_reads
    assert word_reads["loops"][0]["instructions"] < byte_reads["loops"][0]["instructions"], (byte_reads, word_reads)


def test_channel_extend_dequant_fewer_instructions_no_spills():
    """The per-channel extend-prefix's 'dequant' body (keys and values dequantised once per page
    tile) at a chunked prefill's shape (D=128, 3-bit keys, 8K new tokens over 24K): no register
    spills, MMAs in the body loop, and fewer SASS instructions per body tile than the 'codes'
    body at the same rows and warps; and 'dequant' at its default rows (128, the launcher's since
    it became the default) without spills either. All are compiled here; no fixed count is assumed."""
    codes = sm90.run("channel-extend", "--bits", "3", "--variant", "codes")
    dequant = sm90.run("channel-extend", "--bits", "3", "--variant", "dequant", "--block-m", str(codes["block_m"]))
    default = sm90.run("channel-extend", "--bits", "3", "--variant", "dequant")
    assert not codes["dequant"] and dequant["dequant"] and default["dequant"], (codes, dequant, default)
    assert (codes["block_m"], codes["num_warps"]) == (dequant["block_m"], dequant["num_warps"])
    assert default["block_m"] == 2 * codes["block_m"] and default["num_warps"] == codes["num_warps"], default
    for r in (codes, dequant, default):
        body = r["loops"][0]
        assert body["hmma"] + body["hgmma"] > 0 and 200 < body["instructions"] < 20000, r
    for r in (dequant, default):
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, r
    assert dequant["loops"][0]["instructions"] < codes["loops"][0]["instructions"], (codes, dequant)
