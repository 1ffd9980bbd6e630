"""The LSE merge kernel vs reference.merge_attention_states in float64 (TRITON_INTERPRET on CPU).

Realistic inputs: LSEs spread over tens of nats (a long prefix vs a few new tokens and the
reverse), rows whose prefix side is empty (lse -inf, output 0, as the prefix kernels return for a
request with no cached keys), a base-2 second LSE as FlashInfer returns, bf16 outputs.
"""
import math

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref

from .pool_case import DEV

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _case(T, Hq, Dv, empty_rows=()):
    """On the kernels' device (CUDA where present, else the interpreter's CPU)."""
    o_a = torch.randn(T, Hq, Dv) * (1 + 9 * (torch.rand(Dv) > 0.95))  # outlier channels
    o_b = torch.randn(T, Hq, Dv)
    lse_a = torch.randn(T, Hq) * 8 + 10
    lse_b = torch.randn(T, Hq) * 8 + 4
    for t in empty_rows:
        o_a[t] = 0.0
        lse_a[t] = float("-inf")
    return tuple(x.to(DEV) for x in (o_a, lse_a, o_b, lse_b))


@pytest.mark.parametrize("Dv", [128, 64, 96])
def test_merge_matches_the_float64_reference(seed, Dv):
    o_a, lse_a, o_b, lse_b = _case(37, 4, Dv, empty_rows=(0, 5))
    want, _ = ref.merge_attention_states(o_a.double(), lse_a.double(), o_b.double(), lse_b.double())
    got = ops.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    # the empty-prefix rows are exactly the new tokens' output
    assert torch.equal(got[0], o_b[0]) and torch.equal(got[5], o_b[5])


def test_merge_with_a_base2_lse_and_bf16_operands(seed):
    o_a, lse_a, o_b, lse_b = _case(29, 8, 128, empty_rows=(3,))
    o_b16 = o_b.bfloat16()
    want, _ = ref.merge_attention_states(o_a.double(), lse_a.double(), o_b16.double(), lse_b.double())
    got = ops.merge_attention_states(o_a, lse_a, o_b16, lse_b / math.log(2.0), lse_b_base2=True,
                                     out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # one bf16 rounding of the result per element: to nearest on GPU (2^-8 relative), truncated
    # by the interpreter (2^-7)
    excess = (got.double() - want).abs() - 2 ** -7 * want.abs()
    assert excess.max().item() <= 1e-6, excess.max().item()


def test_merge_of_two_empty_sides_is_zero_and_bad_shapes_are_refused(seed):
    o_a, lse_a, o_b, lse_b = _case(4, 2, 64, empty_rows=(1,))
    lse_b[1] = float("-inf")
    out = torch.full((4, 2, 64), float("nan"), device=DEV)
    got = ops.merge_attention_states(o_a, lse_a, o_b, lse_b, out=out)
    assert got is out and torch.equal(got[1].cpu(), torch.zeros(2, 64))
    assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match="shapes do not match"):
        ops.merge_attention_states(o_a, lse_a, o_b[:3], lse_b)


def test_merge_chains_pieces_through_its_lse_output_and_ignores_empty_sides(seed):
    """Three partial attentions merged two at a time through lse_out (base-2 inputs, as FlashInfer
    gives them) equal the float64 merge of all three; a side with LSE -inf contributes nothing even
    when its output is NaN (FlashInfer over an empty key range)."""
    o1, l1, o2, l2 = _case(23, 4, 64, empty_rows=(2,))
    o3 = torch.randn(23, 4, 64, device=DEV)
    l3 = torch.randn(23, 4, device=DEV) * 8 + 6
    o3[4] = float("nan")
    l3[4] = float("-inf")
    w12, lw12 = ref.merge_attention_states(o1.double(), l1.double(), o2.double(), l2.double())
    o3_ref = torch.where(torch.isnan(o3), 0.0, o3).double()
    want, want_l = ref.merge_attention_states(w12, lw12, o3_ref, l3.double())
    ln2 = math.log(2.0)
    l12 = torch.empty(23, 4, device=DEV)
    m12 = ops.merge_attention_states(o1, l1 / ln2, o2, l2, lse_a_base2=True, lse_out=l12)
    assert torch.allclose(l12.double(), lw12, atol=1e-4)
    got = ops.merge_attention_states(m12, l12, o3, l3 / ln2, lse_b_base2=True)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)
