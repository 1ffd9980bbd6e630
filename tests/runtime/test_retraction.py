"""Retraction on the decode side (runtime/retraction.py, through SGLang's hooked Req methods), on
tiny CPU pools with the real kernels (TRITON_INTERPRET): a request retracted to host memory, its
row and pages then overwritten by another request, and resumed in a new row on other pages,
decodes exactly as the same request on a pool that never retracted it, in both layouts (the
per-channel one with the open page's keys in the ring). Slots that are not the request's pages in
order are refused; another pool's requests go SGLang's own way."""
from types import SimpleNamespace

import pytest
import torch

from .test_pd_wiring import CTX, D, H, LAYOUTS, _decode_step, _kv, _pool, _prefill, _slots, _store, sgl  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _request_pool():
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(size=4, max_context_len=CTX, device="cpu", enable_memory_saver=False)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_retracted_request_decodes_as_if_never_retracted(sgl, layout):
    from sglang.srt.managers.schedule_batch import Req

    from oscar_sglang.runtime import pd_hooks as pdh
    from oscar_sglang.runtime.pool import note_new_rows
    from oscar_sglang.runtime.retraction import RetractedKV

    _, B, n_pages, T = LAYOUTS[layout]
    need = -(-(T + 1) // B)  # pages of the prompt and the decoded token
    ref, dec = _pool(layout, rows=6), _pool(layout, rows=6)
    rtp_r, rtp_d = _request_pool(), _request_pool()
    first = _slots(list(range(1, need + 1)), B)
    prompt = _kv(T, seed=1)
    row_r = _prefill(ref, rtp_r, SimpleNamespace(req_pool_idx=None), first, prompt)
    req = SimpleNamespace(req_pool_idx=None, seqlen=T + 1)  # seqlen - 1 = T slots are copied
    row_1 = _prefill(dec, rtp_d, req, first, prompt)
    alloc = SimpleNamespace(get_kvcache=lambda: dec)

    Req.offload_kv_cache(req, rtp_d, alloc)
    assert isinstance(req.kv_cache_cpu, RetractedKV) and req.kv_cache_cpu.tokens == T
    assert req.kv_cache_cpu.pages.device.type == "cpu" and req.kv_cache_cpu.pages.shape[0] == -(-T // B)

    # another request takes the row and the pages: its own tokens, side copies and starts
    note_new_rows([row_1], [0])
    dec.apply_pending_resets(None)
    dec.note_extend(torch.tensor([row_1]), torch.tensor([0], dtype=torch.int32))
    _store(dec, row_1, first[:T], 0, T, _kv(T, seed=7))

    # resumed: DecodePreallocQueue._pre_alloc (hooked) gives a new row and other pages, out of order
    later = _slots(list(range(n_pages - 1, n_pages - 1 - need, -1)), B)
    req.req_pool_idx = None

    def pre_alloc(queue, r):
        rtp_d.alloc([r])
        r.kv_committed_len = T
        rtp_d.req_to_token[r.req_pool_idx, :len(later)] = later

    pdh.around_pre_alloc(pre_alloc, SimpleNamespace(token_to_kv_pool=dec), req)
    row_2 = req.req_pool_idx
    assert row_2 != row_1
    Req.load_kv_cache(req, rtp_d, alloc)
    assert not hasattr(req, "kv_cache_cpu")
    dec.apply_pending_resets(rtp_d.req_to_token)  # the next forward

    step, q = _kv(1, seed=3), [(torch.randn(1, H, D) * 2).bfloat16() for _ in range(len(prompt))]
    o_r = _decode_step(ref, row_r, first, T, step, q)
    o_d = _decode_step(dec, row_2, later, T, step, q)
    assert torch.isfinite(o_r).all() and torch.equal(o_d, o_r)


def test_slots_must_be_the_requests_pages_in_order(sgl):
    from oscar_sglang.runtime.retraction import load, offload

    _, B, _, T = LAYOUTS["token"]
    pool = _pool("token", rows=4)
    rtp = _request_pool()
    slots = _slots([1, 2, 3], B)
    row = _prefill(pool, rtp, SimpleNamespace(req_pool_idx=None), slots, _kv(3 * B, seed=1))
    copy = offload(pool, row, slots[:3 * B - 1])
    for bad in (slots[1:3 * B], slots[:3 * B - 1][torch.tensor([1, 0] + list(range(2, 3 * B - 1)))]):
        with pytest.raises(RuntimeError, match="not whole pages of 4 in request order"):
            load(pool, copy, row, bad)
    with pytest.raises(RuntimeError, match="comes back with 4 slots, 11 were copied"):
        load(pool, copy, row, slots[:B])


def test_other_pools_go_sglangs_way(sgl):
    from sglang.srt.managers.schedule_batch import Req

    calls = []
    alloc = SimpleNamespace(get_kvcache=lambda: object(),
                            get_cpu_copy=lambda idx, mamba_indices=None: calls.append(len(idx)) or "theirs")
    rtp = _request_pool()
    req = SimpleNamespace(req_pool_idx=0, seqlen=5, mamba_pool_idx=None)
    Req.offload_kv_cache(req, rtp, alloc)
    assert calls == [4] and req.kv_cache_cpu == "theirs"
