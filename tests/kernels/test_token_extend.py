"""The per-token extend-prefix kernels (triton/token_extend.py) vs the float64 reference on the same pool.

Same pool, oracle and error bound as tests/kernels/test_attention.py (whose Pool it reuses: INT2
codes/params at random slots, heavy-tailed channels, low-norm sink tokens, side-buffer entries the
source rule must never read filled with huge garbage): per request ||o - o_ref|| / ||o_ref||
<= 1e-4 and |lse - lse_ref| <= 1e-4 with fp32 tensor-core operands (Triton interpreter, CPU),
<= 2e-2 with bf16 operands (CUDA). Outputs are poisoned with NaN before the run. Requests are
ragged and cross every source boundary: empty prefix (o = 0, lse = -inf), all-BF16 prefix, INT2
hole around the sink (own_start inside it), radix hit past the sink and the ring start, carried
sink with own_start past the ring start (sink_start 0), several full INT2 tiles + a masked tail.
"""
import inspect
import math

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.triton import token_attend, token_extend

from .pool_case import DEV, REL_TOL, Pool, rel_err

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PREFIX = [0, 7, 45, 70, 60, 150]
OWNS = [0, 0, 2, 66, 55, 0]
SINKS = [0, 0, 2, 66, 0, 0]
EXT = [3, 1, 5, 2, 2, 4]


def run(kernel, pool, q, qo_indptr, G, max_len, **kw):
    T, Hq, D = q.shape
    Dv = pool.v_codes.shape[-1] * 4
    o = torch.full((T, Hq, Dv), float("nan"), device=DEV)
    lse = torch.full((T, Hq), float("nan"), device=DEV)
    o2, lse2 = kernel(q.to(DEV), qo_indptr.to(DEV), *pool.tensors(), *pool.meta(), **pool.kw(),
                      k_group=G, v_group=G, sm_scale=kw.pop("sm_scale", 1 / math.sqrt(D)),
                      max_len_extend=max_len, o=o, lse=lse, **kw)
    assert o2 is o and lse2 is lse  # written in place
    assert not o.isnan().any() and not lse.isnan().any()
    return o.cpu(), lse.cpu()


def indptr(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


# (D, G, gqa, block_m, block_n): default tiles, and small tiles (several query blocks per request,
# several full INT2 tiles per request plus a masked tail; GQA 3 splits tokens across blocks)
CASES = [
    (128, 128, 4, None, None),
    (128, 64, 8, 16, 16),
    (128, 32, 1, None, 32),
    (64, 32, 3, 16, 16),
    (64, 64, 4, 32, 16),
]


@pytest.mark.parametrize("D,G,gqa,block_m,block_n", CASES)
def test_extend_fast_matches_reference(seed, D, G, gqa, block_m, block_n):
    hkv = 2
    pool = Pool(PREFIX, OWNS, hkv, D, G, n_rows=8, sinks=SINKS)
    qo = indptr(EXT)
    T = sum(EXT)
    q = (torch.randn(T, hkv * gqa, D) * 2).bfloat16()
    if block_n is not None and DEV == "cuda":  # the compiled kernel refuses smaller INT2 tiles
        block_n = max(block_n, token_extend.MIN_COMPILED_BLOCK_N)
    o, lse = run(token_extend.extend_prefix_attention_fast, pool, q, qo, G, max(EXT),
                 block_m=block_m, block_n=block_n)
    for b in range(len(EXT)):
        t0, t1 = int(qo[b]), int(qo[b + 1])
        if PREFIX[b] == 0:
            assert torch.all(o[t0:t1] == 0) and torch.all(lse[t0:t1] == float("-inf"))
            continue
        K, V = pool.request_kv(b)
        o_ref, lse_ref = ref.attention(q[t0:t1].float(), K, V, sm_scale=1 / math.sqrt(D))
        assert rel_err(o[t0:t1], o_ref) <= REL_TOL, b
        assert (lse[t0:t1].double() - lse_ref).abs().max() <= REL_TOL, b


def test_extend_fast_logit_cap_and_equals_base(seed):
    """tanh logit cap (SGLang's rule) vs float64; and the same result as the generic kernel."""
    D, G, hkv, gqa, cap, sm = 64, 32, 1, 2, 5.0, 0.125
    prefix, owns, ext = [40, 90], [0, 70], [3, 2]
    pool = Pool(prefix, owns, hkv, D, G)
    qo = indptr(ext)
    q = (torch.randn(sum(ext), hkv * gqa, D) * 4).bfloat16()
    o, lse = run(token_extend.extend_prefix_attention_fast, pool, q, qo, G, max(ext), sm_scale=sm,
                 logit_cap=cap, block_n=16 if DEV == "cpu" else token_extend.MIN_COMPILED_BLOCK_N)
    o_base, lse_base = run(token_extend.extend_prefix_attention_base, pool, q, qo, G, max(ext), sm_scale=sm,
                           logit_cap=cap)
    for b in range(len(ext)):
        t0, t1 = int(qo[b]), int(qo[b + 1])
        K, V = pool.request_kv(b)
        s = torch.einsum("thd,lhd->htl", q[t0:t1].double(), K.double().repeat_interleave(gqa, 1)) * sm
        s = cap * torch.tanh(s / cap)
        o_ref = torch.einsum("htl,lhd->thd", torch.softmax(s, -1), V.double().repeat_interleave(gqa, 1))
        lse_ref = torch.logsumexp(s, -1).transpose(0, 1)
        assert rel_err(o[t0:t1], o_ref) <= REL_TOL
        assert (lse[t0:t1].double() - lse_ref).abs().max() <= REL_TOL
        assert rel_err(o_base[t0:t1], o_ref) <= REL_TOL  # both kernels agree with the oracle
    assert (lse - lse_base).abs().max() <= 2 * REL_TOL


def test_ops_picks_the_extend_kernel_by_shape(seed, monkeypatch):
    """ops.extend_prefix_attention uses the large-tile kernel where D, Dv <= 128 and the generic
    one for D = 256; both match the reference."""
    calls = []
    real = token_extend.extend_prefix_attention_fast
    monkeypatch.setattr(token_extend, "extend_prefix_attention_fast",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    hkv, gqa, G = 1, 2, 32
    for D, expect in ((64, 1), (256, 0)):
        calls.clear()
        pool = Pool([20], [0], hkv, D, G)
        qo = indptr([2])
        q = torch.randn(2, hkv * gqa, D).bfloat16()
        o, lse = run(ops.extend_prefix_attention, pool, q, qo, G, 2)
        assert len(calls) == expect
        K, V = pool.request_kv(0)
        o_ref, lse_ref = ref.attention(q.float(), K, V, sm_scale=1 / math.sqrt(D))
        assert rel_err(o, o_ref) <= REL_TOL
        assert (lse.double() - lse_ref).abs().max() <= REL_TOL


def test_extend_kernels_do_not_recompile_per_chunk_length():
    """Values that follow the batch's new-token counts are runtime arguments of the extend kernels:
    as constexprs every new chunk length compiled a new kernel in the server (seconds of TTFT)."""
    for kernel in (token_extend.extend_kernel, token_attend.attend_kernel):
        # the interpreter wraps the function; the compiled path is a JITFunction (GPU machines)
        fn = getattr(kernel, "fn", kernel)
        num_mb = inspect.signature(fn).parameters["num_mb"]
        assert num_mb.annotation is inspect.Parameter.empty  # not tl.constexpr
        opts = getattr(kernel, "kwargs", None) or {"do_not_specialize": kernel.do_not_specialize}
        assert "num_mb" in opts["do_not_specialize"]



def test_compiled_kernel_refuses_tiles_too_small(monkeypatch):
    """Compiled launches refuse INT2 tiles below MIN_COMPILED_BLOCK_N before launching (checked
    here as a compiled launch would see it; the interpreter itself runs any tile)."""
    monkeypatch.setattr(token_extend, "compiled", lambda t: True)
    pool = Pool([70], [0], 2, 64, 32, n_rows=2, sinks=[0])
    q = torch.randn(2, 4, 64).bfloat16()
    with pytest.raises(ValueError, match="block_n >= 32"):
        run(token_extend.extend_prefix_attention_fast, pool, q, indptr([2]), 32, 2, block_n=16)
