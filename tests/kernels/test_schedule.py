"""Compiled-kernel properties on sm_90 (no GPU): pipelined INT2 loops, shared memory that fits.

The INT2 loops of the per-token decode and extend kernels keep the next tile's loads in flight.

Compiled for sm_90 without a GPU (Triton ships ptxas) by tests/kernels/sm90.py, in a subprocess so
this process keeps its interpreter setting. With a too-shallow software pipeline (the default
depth 2), Triton loads the slot indices synchronously and waits for every tile's code copies right
after issuing them: the compiled loop then waits with 0 copy groups in flight (slower on the GPU:
docs/design.md "Kernel design choices").
"""
import pytest

from tests.kernels import sm90

# one worker runs the whole module under pytest-xdist (tests/conftest.py ONE_WORKER_MODULES)
pytestmark = pytest.mark.slow  # the module's cases take minutes on 2 cores: make test, not test-fast

# Every compile the tests below read, made in one subprocess (`sm90`), not one each: a subprocess
# spends seconds importing torch and Triton before its first compile, and 14 tests read 13 compiles.
CHANNEL_DECODE = [("3", False), ("2", False), ("4", False), ("3", True)]  # (bits, fused)
CASES = [("decode",), ("extend",), ("decode", "--int2-stages", "2"), ("fit",), ("decode", "--fused-merge"),
         *(("channel", "--batch", "8", "--bits", b, *(("--fused-merge", "1") if f else ())) for b, f in CHANNEL_DECODE),
         *(("channel", "--batch", "8", "--bits", b, "--D", "64") for b in ("2", "3", "4")),
         ("channel-extend", "--bits", "3")]


@pytest.fixture(scope="module")
def sm90_runs():
    runs = sm90.run_many(*CASES)

    def get(*args: str) -> dict:
        res = runs[" ".join(args)]  # a KeyError: add the case to CASES
        assert "error" not in res, res["error"]
        return res

    return get


@pytest.mark.parametrize("what", ["decode", "extend"], ids=["token_decode", "token_extend"])
def test_int2_loop_overlaps_loads_with_compute(sm90_runs, what):
    res = sm90_runs(what)
    # 5 = one tile's code / param copies (4 groups) + the slot indices of the tile after it
    assert res["in_flight"] >= 5, f"the INT2 loop waits with {res['in_flight']} copy groups in flight: {res}"


def test_shallow_pipeline_is_detected(sm90_runs):
    """The check above can fail: the same decode kernel at depth 2 waits with nothing in flight."""
    assert sm90_runs("decode", "--int2-stages", "2")["in_flight"] == 0


def test_every_supported_shape_fits_h100_shared_memory(sm90_runs):
    """Decode and extend-prefix at every head_dim / group size, as ops selects the kernels, compile
    for sm_90 within 227 KB of shared memory per block (head_dim 256 at G=32 needed 290 KB before
    its decode tile was cut to 32 keys: a launch failure on the GPU the interpreter cannot see)."""
    res = sm90_runs("fit")
    over = [k for k in res["kernels"] if k["smem"] > res["limit"]]
    assert not over, over
    assert len(res["kernels"]) == 16, res  # 8 (D, G) pairs x (decode, extend-prefix)
    assert {(k["D"], k["G"], k["op"]) for k in res["kernels"]} == {
        (D, G, op) for D in (64, 128, 256) for G in (32, 64, 128) if G <= D
        for op in ("decode", "extend-prefix")}


@pytest.mark.parametrize("fused", [False, True], ids=["merge_kernel", "fused_merge"])
def test_fast_decode_fits_its_programs_per_sm(sm90_runs, fused):
    """PROGRAMS_PER_SM (12) one-warp programs of the fast decode must run at once on an H100 SM
    (64K registers, 228 KB of shared memory, 1 KB of it reserved per block): its own split policy
    aims at SPLIT_PROGRAMS_PER_SM (8) per SM and SGLang's split counts in the server go higher, and
    every grid up to 12 per SM then runs in one wave. With more registers or shared memory such
    grids would spill into a second wave."""
    from oscar_kernels.triton import token_decode

    res = sm90_runs("decode", *(("--fused-merge",) if fused else ()))
    regs, smem = res["regs"], res["static_smem"] + res["dynamic_smem"]
    per_sm_regs = 65536 // (-(-regs // 8) * 8 * 32 * token_decode.NUM_WARPS)
    per_sm_smem = 233472 // (smem + 1024)
    assert min(per_sm_regs, per_sm_smem) >= token_decode.PROGRAMS_PER_SM, res
    assert token_decode.SPLIT_PROGRAMS_PER_SM <= token_decode.PROGRAMS_PER_SM


@pytest.mark.parametrize("bits,fused", CHANNEL_DECODE)
def test_channel_decode_fits_its_programs_per_sm(sm90_runs, bits, fused):
    """One-warp per-channel decode programs (B=8, L=32K, D=128: 3-bit keys as planes, 2-bit keys
    and values as code words, 4-bit keys as nibbles) fit DECODE_SPLIT_PROGRAMS_PER_SM on an H100 SM
    by registers and by shared memory (1 KB reserved per block), with no spill traffic in any
    loop: the split plan sizes its grid for that many, so a kernel that grew past them would run a
    second, nearly empty wave. The bodies sit near 255 registers: one more live value spills.
    fused: the variant that merges the splits in its last program (batches of 9 requests and more
    with 8 KV heads on an H100)."""
    args = ("--bits", bits) + (("--fused-merge", "1") if fused else ())
    from oscar_kernels.triton import channel_decode as ch

    res = sm90_runs("channel", "--batch", "8", *args)
    assert res["num_warps"] == 1, res
    assert res["planes"] == (bits == "3") and res["words"] == [True, bits == "2"], res
    per_sm_regs = 65536 // (-(-res["regs"] // 8) * 8 * 32)
    per_sm_smem = 233472 // (res["static_smem"] + res["dynamic_smem"] + 1024)
    assert min(per_sm_regs, per_sm_smem) >= ch.DECODE_SPLIT_PROGRAMS_PER_SM, res
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res
    assert all(loop["local"] == 0 for loop in res["loops"]), res
    body = res["loops"][0]  # the largest loop: a quantised-body loop
    assert body["hmma"] >= 32 and 200 < body["instructions"] < 20000, res


@pytest.mark.parametrize("bits", ["2", "3", "4"])
def test_channel_decode_head_dim_64_compiles_without_spills(sm90_runs, bits):
    """head_dim 64 (byte reads; 3-bit keys as the packed quarter body at DECODE_NUM_WARPS[3] warps,
    one spills): no spill traffic at the served shape's batch."""
    from oscar_kernels.triton import channel_decode as ch

    res = sm90_runs("channel", "--batch", "8", "--bits", bits, "--D", "64")
    assert not res["planes"] and res["words"] == [False, False], res
    assert res["num_warps"] == ch.DECODE_NUM_WARPS[int(bits)], res
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res


def test_channel_extend_compiles_without_spills(sm90_runs):
    """The per-channel extend-prefix (keys and values dequantised once per page tile, 128 rows) at
    a chunked prefill's shape (D=128, 3-bit keys, 8K new tokens over 24K): no register spills, MMAs
    in the body loop."""
    res = sm90_runs("channel-extend", "--bits", "3")
    assert res["block_m"] == 128, res
    body = res["loops"][0]
    assert body["hmma"] + body["hgmma"] > 0 and 200 < body["instructions"] < 20000, res
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0 and res["stack"] == 0, res
