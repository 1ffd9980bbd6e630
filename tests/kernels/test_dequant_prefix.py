"""ops.dequant_prefix_channel vs the reader's view of the reference pool (TRITON_INTERPRET on CPU).

The pool (tests/kernels/channel_case.ChannelPool: shuffled pages, sink / ring rows with huge
garbage wherever the source rule must not read, NaN params on pages without a complete block)
holds a request with an incomplete last block, one whose own ring starts late (own_start 40), one
shorter than the ring, and a radix hit whose sink and ring copies were not carried (sink_start =
own_start = 64, as a one-page hit leaves them); the prefixes are cut into pieces of whole blocks,
some requests' pieces empty. Every written
row must equal reference.format_request_kv's view up to one bf16 rounding; rows outside the
pieces stay untouched.
"""
import pytest
import torch

from oscar_kernels import ops

from .pool_case import DEV
from .channel_case import ChannelPool, channel_fmt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("bits", [3, 2, 4])
def test_pieces_of_the_prefix_match_the_readers_view(seed, bits):
    fmt = channel_fmt(64, bits, 32, 32)
    lens, owns, sinks = [150, 70, 33, 130], [0, 40, 0, 64], [0, 0, 0, 64]
    pool = ChannelPool(fmt, lens, owns, sinks, hkv=2)
    H, D, B = 2, 64, 32
    want = [pool.request_kv(b) for b in range(len(lens))]
    for lo in (0, 64, 128):  # pieces of 64 positions: request 2 has none from 64 on
        n = [max(0, min(64, L - lo)) for L in lens]
        indptr = torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)
        rows = int(indptr[-1])
        out_k = torch.full((rows + 5, H, D), 7.0).bfloat16()
        out_v = torch.full((rows + 5, H, D), 7.0).bfloat16()
        out_k, out_v = out_k.to(DEV), out_v.to(DEV)
        ops.dequant_prefix_channel(*pool.args(), torch.full((len(lens),), lo, dtype=torch.int32).to(DEV),
                                   indptr.to(DEV), out_k, out_v, **pool.kw(), max_piece_len=max(n))
        out_k, out_v = out_k.cpu(), out_v.cpu()
        for b in range(len(lens)):
            s, e = int(indptr[b]), int(indptr[b + 1])
            for got, ref in ((out_k, want[b][0]), (out_v, want[b][1])):
                r = ref[lo:lo + n[b]].float()
                # one rounding to bf16 of the fp32 code * scale + min (channel_attend.dequant_codes'
                # fp32 branch): half an ulp, 2^-8 relative (the interpreter truncates: 2^-7), plus
                # the fp32 rounding's 2^-24 of |min| where code * scale and min cancel (slack). The
                # bf16 arithmetic before 2026-11-27 needed 2^-6 of the block's channel maximum
                if e > s:
                    rel = 2 ** -7 if DEV == "cpu" else 2 ** -8
                    slack = 2 ** -20 * r.abs().amax(0, keepdim=True)
                    excess = (got[s:e].float() - r).abs() - rel * r.abs() - slack
                    assert excess.max().item() <= 0, (b, lo, excess.max().item())
        assert torch.equal(out_k[rows:].float(), torch.full((5, H, D), 7.0))
