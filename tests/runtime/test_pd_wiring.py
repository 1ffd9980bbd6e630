"""PD disaggregation wiring (runtime/pd_hooks.py and pd_buffers.py, registered by runtime/hooks.py) through SGLang's
own disaggregation code, on tiny CPU pools (stores and decode reads through the real kernels,
TRITON_INTERPRET):

* setup_state_kv_args, as prefill.py and decode.py call it (hooked), registers the INT2 side rows
  as a MAMBA state component and gives both request pools the identity row mapping their
  payloads read;
* a request prefilled on one pool and moved to another by SGLang's mooncake sender code
  (_send_kvcache_generic for the pages, maybe_send_extra -> _send_mamba_state for the state; the
  transfer engine is a memmove) decodes on the decode pool exactly as on the prefill pool,
  whether the transfer lands before or after the decode server's next forward, in both layouts;
  the decode row's stale side-copy pointers are dropped, its received state is not reset;
* the pairing check (try_ensure_parallel_info, hooked) with SGLang's /route answer names both
  INT2 formats, and refuses other TP sizes.
"""
import ctypes
import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

H, D, L, CTX = 2, 64, 2, 160
LAYOUTS = {  # layout -> (format name, page size, pages a pool, prompt length)
    # 95 tokens: the decode step's token 95 completes page 2, quantised from the received ring
    "channel": ("k3c32-v2h-s4-w32", 32, 8, 95),
    "token": ("token", 4, 40, 45),
}


@pytest.fixture(scope="module")
def sgl():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.disaggregation.decode as decode
    import sglang.srt.disaggregation.prefill as prefill

    return SimpleNamespace(prefill=prefill, decode=decode)


def _pool(layout, rows):
    from oscar_sglang.runtime.kv_format import resolve
    from oscar_sglang.runtime.pool import OscarInt2KVPool, take_pending_rows, take_received_rows

    take_pending_rows()
    take_received_rows()
    name, B, pages, _ = LAYOUTS[layout]
    extra = dict(sink=4, recent=8) if layout == "token" else {}
    fmt = resolve(name, head_dim=D, v_head_dim=D, num_layers=L, group_size=64, **extra)
    return OscarInt2KVPool((pages - 1) * B, B, H, D, D, L, "cpu", req_rows=rows, kv_format=fmt,
                           k_clip=[1.0] * L, v_clip=[1.0] * L)


def _slots(pages, B):
    return (torch.tensor(pages)[:, None] * B + torch.arange(B)).reshape(-1)


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, H, D, generator=g) * 2).bfloat16(), torch.randn(n, H, D, generator=g).bfloat16())
            for _ in range(L)]


def _store(pool, row, slots, start, total, kv):
    n = len(slots)
    for layer, (k, v) in enumerate(kv):
        pool.store(layer, slots, k, v, torch.arange(start, start + n), torch.full((n,), row),
                   torch.full((n,), total))


def _prefill(pool, rtp, req, slots, kv):
    """SGLang's prefill of a fresh prompt: the row from ReqToTokenPool.alloc (hooked: a claim),
    the backend's forward (claims applied, extend noted, every token stored)."""
    rtp.alloc([req])
    row, n = req.req_pool_idx, len(kv[0][0])
    rtp.req_to_token[row, :len(slots)] = slots
    pool.apply_pending_resets(rtp.req_to_token)
    pool.note_extend(torch.tensor([row]), torch.tensor([0], dtype=torch.int32))
    _store(pool, row, slots[:n], 0, n, kv)
    return row


def _kv_args(sgl, side, pool, rtp):
    """KVArgs as `side`'s _init_kv_manager fills them, setup_state_kv_args called as it calls it."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    a = KVArgs()
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = pool.get_contiguous_buf_infos()
    a.prefill_start_layer, a.page_size, a.engine_rank = pool.start_layer, pool.page_size, 0
    if side == "prefill":
        sgl.prefill.setup_state_kv_args(a, pool, None, L, req_to_token_pool=rtp)
    else:
        sgl.decode.setup_state_kv_args(a, pool, None, total_kv_layers=L, req_to_token_pool=rtp)
    return a


def pd_page_bytes(pool, name, layer):
    """Bytes of one page of buffer `name`, layer `layer`, all heads (from the pool's own views)."""
    t = getattr(pool, name)[layer]
    rows = pool.page_size if t.shape[0] == pool.k_codes[0].shape[0] else 1
    return t[:rows].nbytes


def _memmove(session, blocks):
    """The transfer engine: (src, dst, length) blocks, copied."""
    for src, dst, n in blocks:
        ctypes.memmove(dst, src, n)
    return 0


def _sender(kv_args):
    """SGLang's MooncakeKVManager methods on a stand-in self: its addressing, no engine."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    m = SimpleNamespace(kv_args=kv_args, is_mla_backend=False, is_hybrid_mla_backend=False,
                        enable_custom_mem_pool=False, pp_size=1, attn_tp_size=1, _transfer_data=_memmove)
    m.get_mha_kv_ptrs_with_pp = functools.partial(CommonKVManager.get_mha_kv_ptrs_with_pp, m)
    for name in ("_send_kvcache_generic", "_send_mamba_state", "maybe_send_extra",
                 "_is_generic_kvcache_state_type"):
        setattr(m, name, functools.partial(getattr(MooncakeKVManager, name), m))
    return m


def _transfer(src_args, dst_args, src_rtp, dst_rtp, src_row, dst_row, n):
    """What the prefill sends for a request of n tokens (its last chunk: every page and the
    state), addressed as prefill.py / decode.py / mooncake/conn.py do."""
    from sglang.srt.disaggregation.common.utils import pack_int_lists, unpack_int_lists
    from sglang.srt.mem_cache.common import kv_to_page_indices

    B = src_args.page_size
    src_pages = kv_to_page_indices(src_rtp.req_to_token[src_row, :n], B).astype(np.int32)
    dst_pages = kv_to_page_indices(dst_rtp.req_to_token[dst_row, :n], B).astype(np.int32)
    # the payloads (prefill.py / decode.py _mamba_payload); the decode's goes through ZMQ
    src_state = [[src_rtp.req_index_to_mamba_index_mapping[src_row].cpu().numpy()]]
    dst_state = unpack_int_lists(pack_int_lists([[dst_rtp.req_index_to_mamba_index_mapping[dst_row].cpu().numpy()]], "i"), "i")
    m = _sender(src_args)
    assert m._send_kvcache_generic("s", src_args.kv_data_ptrs, dst_args.kv_data_ptrs, src_args.kv_item_lens,
                                   src_pages, dst_pages, executor=None) == 0
    reg = SimpleNamespace(dst_state_data_ptrs=dst_args.state_data_ptrs, dst_state_item_lens=dst_args.state_item_lens,
                          dst_state_dim_per_tensor=dst_args.state_dim_per_tensor,
                          dst_state_layer_ids=dst_args.state_layer_ids, dst_attn_tp_size=1)
    req = SimpleNamespace(dst_state_indices=dst_state, mooncake_session_id="s")
    assert m.maybe_send_extra(req, src_state, None, target_rank_registration_info=reg) == 0


def _decode_step(pool, row, slots, n, kv, q):
    """One decode step of a request of n tokens: store token n, read every layer (the backend's
    kernel arguments, one request)."""
    _store(pool, row, slots[n:n + 1], n, n + 1, kv)
    out = []
    for layer in range(L):
        o = torch.empty(1, H, D, dtype=torch.float32)
        pool.layout.decode(q[layer], o, **pool.layer_buffers(layer),
                           kv_indptr=torch.tensor([0, n + 1], dtype=torch.int32),
                           kv_indices=slots[:n + 1].int(), req_rows=torch.tensor([row], dtype=torch.int32),
                           own_start=pool.own_start, sink_start=pool.sink_start,
                           **pool.kernel_format_args(layer), sm_scale=D ** -0.5)
        out.append(o)
    return torch.stack(out)


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_setup_state_kv_args_registers_side_rows_on_both_sides(sgl):
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from oscar_sglang.runtime import pd_buffers as pd
    from oscar_sglang.runtime import pd_hooks as pdh
    from oscar_sglang.runtime.hooks import after_setup_state_kv_args, verify_hooks
    from oscar_sglang.runtime.hooks import _contains

    assert verify_hooks() == []
    for module in (sgl.prefill, sgl.decode):  # the by-name copies they call
        assert _contains(module.setup_state_kv_args, after_setup_state_kv_args)
    pool = _pool("token", rows=8)
    rtp = ReqToTokenPool(size=3, max_context_len=CTX, device="cpu", enable_memory_saver=False)
    a = _kv_args(sgl, "prefill", pool, rtp)
    assert a.state_types == [StateType.MAMBA]
    assert (a.state_data_ptrs[0], a.state_data_lens[0], a.state_item_lens[0]) == pool.get_state_buf_infos()
    assert len(a.state_data_ptrs[0]) == len(pd.state_buffer_names(pool)) == 4 * L + 2
    assert rtp.req_index_to_mamba_index_mapping.tolist() == list(range(4))
    # what bench/pd.py reads from the log: bytes a page and a request row move, regions registered
    a.kv_cache_dtype_str = "int2"
    line = pdh.transfer_summary(a)
    page_bytes = sum(pd_page_bytes(pool, name, i) for name, i, _ in pd.kv_buffer_names(pool)[::H])
    row_bytes = sum((getattr(pool, n) if i is None else getattr(pool, n)[i])[0].nbytes
                    for n, i in pd.state_buffer_names(pool))
    assert line == (f"oscar PD transfer: kv_cache_dtype=int2 page_size={pool.page_size} "
                    f"kv_bytes_per_page={page_bytes} kv_bytes_per_token={page_bytes / pool.page_size:.2f} "
                    f"state_bytes_per_request={row_bytes} regions={4 * L * H + 4 * L + 2}")
    # the decode side's request pool: extra rows for requests in transfer, as many side rows
    drtp = DecodeReqToTokenPool(size=3, max_context_len=CTX, device="cpu", enable_memory_saver=False,
                                pre_alloc_size=4)
    d = _kv_args(sgl, "decode", pool, drtp)
    assert d.state_types == [StateType.MAMBA] and drtp.req_index_to_mamba_index_mapping.tolist() == list(range(8))
    # a request pool with more rows than the side buffers is refused (rows past them would be
    # written out of bounds), and so is one that maps rows to Mamba state (not the identity)
    big = DecodeReqToTokenPool(size=3, max_context_len=CTX, device="cpu", enable_memory_saver=False,
                               pre_alloc_size=5)
    with pytest.raises(RuntimeError, match="9 rows, the INT2 side buffers 8"):
        _kv_args(sgl, "decode", pool, big)
    assert _kv_args(sgl, "decode", pool, drtp).state_types == [StateType.MAMBA]  # again: the same
    drtp.req_index_to_mamba_index_mapping = torch.arange(8, dtype=torch.int32).flip(0)
    with pytest.raises(RuntimeError, match="maps rows to Mamba state already"):
        _kv_args(sgl, "decode", pool, drtp)
    # other pools: SGLang's dispatch alone
    from sglang.srt.disaggregation.base.conn import KVArgs

    other = KVArgs()
    plain = ReqToTokenPool(size=3, max_context_len=CTX, device="cpu", enable_memory_saver=False)
    sgl.decode.setup_state_kv_args(other, SimpleNamespace(), None, L, req_to_token_pool=plain)
    assert other.state_types == [] and not hasattr(plain, "req_index_to_mamba_index_mapping")


@pytest.mark.parametrize("lands_before_forward", [True, False])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_transferred_request_decodes_as_on_the_prefill_server(sgl, layout, lands_before_forward):
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from oscar_sglang.runtime import pd_buffers as pd
    from oscar_sglang.runtime import pd_hooks as pdh
    from oscar_sglang.runtime.pool import note_new_rows

    _, B, n_pages, T = LAYOUTS[layout]
    need = -(-(T + 1) // B)  # pages of the prompt and the decoded token
    # prefill server: pages 1.. in order; decode server: other pages, out of order
    pre, dec = _pool(layout, rows=4), _pool(layout, rows=6)
    rtp_p = ReqToTokenPool(size=3, max_context_len=CTX, device="cpu", enable_memory_saver=False)
    rtp_d = DecodeReqToTokenPool(size=2, max_context_len=CTX, device="cpu", enable_memory_saver=False,
                                 pre_alloc_size=3)
    args_p = _kv_args(sgl, "prefill", pre, rtp_p)
    args_d = _kv_args(sgl, "decode", dec, rtp_d)
    slots_p = _slots(list(range(1, need + 1)), B)
    slots_d = _slots(list(range(n_pages - 1, n_pages - 1 - need, -1)), B)
    prompt = _kv(T, seed=1)
    row_p = _prefill(pre, rtp_p, SimpleNamespace(req_pool_idx=None), slots_p, prompt)

    # the decode row and slots held an earlier request: its side copies, pointers and starts
    row_d = rtp_d.free_slots[0]
    note_new_rows([row_d], [0])
    dec.apply_pending_resets(None)
    dec.note_extend(torch.tensor([row_d]), torch.tensor([0], dtype=torch.int32))
    _store(dec, row_d, slots_d[:T], 0, T, _kv(T, seed=2))
    entries = torch.cat([row_d * dec.sink + torch.arange(dec.sink),
                         dec.req_rows * dec.sink + row_d * dec.recent + torch.arange(dec.recent)])
    assert (dec.slot_entry[slots_d[:T]] >= 0).any() and (dec.entry_owner[entries] >= 0).any()

    # DecodePreallocQueue._pre_alloc (hooked): the row and the request's slots, before the transfer
    req = SimpleNamespace(req_pool_idx=None)

    def pre_alloc(queue, r):
        assert rtp_d.alloc([r]) == [row_d]
        r.kv_committed_len = T
        rtp_d.req_to_token[row_d, :len(slots_d)] = slots_d

    note_new_rows([row_d], [0])  # as a hooked ReqToTokenPool.alloc would: withdrawn by the receipt
    pdh.around_pre_alloc(pre_alloc, SimpleNamespace(token_to_kv_pool=dec), req)
    if not lands_before_forward:
        dec.apply_pending_resets(rtp_d.req_to_token)  # a forward of other requests first
    _transfer(args_p, args_d, rtp_p, rtp_d, row_p, row_d, T)
    dec.apply_pending_resets(rtp_d.req_to_token)  # the decode step's forward (or the next one)

    for name, i in pd.state_buffer_names(pre):  # the side state landed and stayed
        a, b = getattr(pre, name), getattr(dec, name)
        a, b = (a, b) if i is None else (a[i], b[i])
        assert torch.equal(_bytes(b[row_d]), _bytes(a[row_p])), (name, i)
    assert dec.own_start[row_d].item() == 0 and dec.sink_start[row_d].item() == 0
    assert (dec.slot_entry[slots_d[:T]] == -1).all() and (dec.entry_owner[entries] == -1).all()

    step, q = _kv(1, seed=3), [(torch.randn(1, H, D) * 2).bfloat16() for _ in range(L)]
    o_p = _decode_step(pre, row_p, slots_p, T, step, q)
    o_d = _decode_step(dec, row_d, slots_d, T, step, q)
    assert torch.isfinite(o_p).all() and torch.equal(o_d, o_p)
    # every page of the request, the one the decode step completed included, is the same bytes
    for name in ("k_codes", "k_params", "v_codes", "v_params"):
        for i in range(L):
            a, b = getattr(pre, name)[i], getattr(dec, name)[i]
            per = B if a.shape[0] == pre.k_codes[0].shape[0] else 1
            for pa, pb in zip(slots_p[::B].tolist(), slots_d[::B].tolist()):
                pa, pb = pa // B * per, pb // B * per
                assert torch.equal(_bytes(b[pb:pb + per]), _bytes(a[pa:pa + per])), (name, i, pa, pb)


def test_pairing_names_formats_and_refuses_other_tp(sgl, monkeypatch):
    """CommonKVManager.try_ensure_parallel_info (hooked) on the decode side, against the prefill's
    /route answer (requests.get stubbed): equal int2 strings pair; different formats or int2 vs
    BF16 raise naming both; another attention TP size raises saying to use the same."""
    import sglang.srt.disaggregation.common.conn as conn

    from oscar_sglang.runtime import pd_buffers as pd
    from oscar_sglang.runtime import pd_hooks as pdh
    from oscar_sglang.runtime.state import RUNTIME_INFO

    saved = dict(RUNTIME_INFO)

    def registered(fmt, sha):  # what the BEFORE hook makes of each side's KVArgs
        RUNTIME_INFO.clear()
        RUNTIME_INFO.update(kv_format=fmt, rotation_sha256=sha)
        args = SimpleNamespace(kv_cache_dtype_str="int2")
        pdh.before_kv_manager_init(None, args)
        return args.kv_cache_dtype_str

    try:
        here = registered("k4c64-v2h-s4-w128", "ab" * 32)
        other_rot = registered("k4c64-v2h-s4-w128", "cd" * 32)
        other_fmt = registered("token", "ab" * 32)
    finally:
        RUNTIME_INFO.clear()
        RUNTIME_INFO.update(saved)

    def route(dtype, tp=1):
        data = dict(attn_tp_size=tp, attn_cp_size=1, dp_size=1, pp_size=1, page_size=64,
                    kv_cache_dtype=dtype, follow_bootstrap_room=True)
        return lambda url, timeout: SimpleNamespace(status_code=200, json=lambda: data, text="")

    def decode_mgr():
        return SimpleNamespace(kv_cache_dtype_str=here, kv_args=SimpleNamespace(page_size=64), dcp_size=1,
                               attn_tp_size=1, pp_size=1, prefill_info_table={},
                               _resolve_rank_mapping=lambda info: None)

    pair = conn.CommonKVManager.try_ensure_parallel_info
    monkeypatch.setattr(conn.requests, "get", route(here))
    m = decode_mgr()
    assert pair(m, "p:1") is True and "p:1" in m.prefill_info_table
    for prefill, words in ((other_rot, ["cdcdcdcd", "abababab"]), (other_fmt, ["token", "k4c64-v2h-s4-w128"]),
                           ("auto", ["kv_cache_dtype=auto", "k4c64-v2h-s4-w128"])):
        monkeypatch.setattr(conn.requests, "get", route(prefill))
        with pytest.raises(RuntimeError, match="INT2 PD servers cannot pair") as e:
            pair(decode_mgr(), "p:1")
        assert all(w in str(e.value) for w in words), str(e.value)
    monkeypatch.setattr(conn.requests, "get", route(here, tp=2))
    m = decode_mgr()
    with pytest.raises(RuntimeError, match="different attention TP sizes") as e:
        pair(m, "p:1")
    assert "Use the same TP size" in str(e.value) and "p:1" not in m.prefill_info_table
