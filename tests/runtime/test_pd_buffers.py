"""runtime/pd_buffers.py on tiny CPU pools (stores through the real store kernels, TRITON_INTERPRET):

* pages copied through nothing but the returned (ptrs, lens, item_lens), as SGLang's senders
  address them (ptr + page * item_len), land byte for byte in the other pool's pages, for every
  buffer, layer and head, in both layouts, and nothing else of the other pool changes;
* one request row's side state copied the same way (ptr + row * item_len);
* the compatibility string, its mismatch message, the hook bodies and the PD refusals.
(tests/runtime/test_pd_wiring.py: the hooks through SGLang's own disaggregation code.)
"""
import ctypes
from types import SimpleNamespace

import pytest
import torch

from oscar_sglang.runtime import pd_buffers as pd
from oscar_sglang.runtime import pd_hooks as pdh

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

H, D, L, ROWS, PAGES = 2, 64, 2, 4, 6
LAYOUTS = {  # layout -> (format name, page size)
    "channel": ("k3c32-v2h-s4-w32", 32),
    "token": ("token", 4),
}


def _pool(layout):
    from oscar_sglang.runtime.kv_format import resolve
    from oscar_sglang.runtime.pool import OscarInt2KVPool, take_pending_rows, take_received_rows

    take_pending_rows()
    take_received_rows()
    name, B = LAYOUTS[layout]
    extra = dict(sink=4, recent=8) if layout == "token" else {}
    fmt = resolve(name, head_dim=D, v_head_dim=D, num_layers=L, group_size=64, **extra)
    assert fmt.layout == layout
    return OscarInt2KVPool((PAGES - 1) * B, B, H, D, D, L, "cpu", req_rows=ROWS, kv_format=fmt,
                           k_clip=[1.0] * L, v_clip=[1.0] * L)


def _fill(pool, row, n_tokens):
    """A prefill of n_tokens random tokens in `row`, on slots from page 1 on, every layer."""
    slots = torch.arange(pool.page_size, pool.page_size + n_tokens)
    for layer in range(L):
        k, v = torch.randn(n_tokens, H, D).bfloat16(), torch.randn(n_tokens, H, D).bfloat16()
        pool.store(layer, slots, k, v, torch.arange(n_tokens), torch.full((n_tokens,), row),
                   torch.full((n_tokens,), n_tokens))
    pool.own_start[row] = 0
    pool.sink_start[row] = 0


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _copy(src_infos, dst_infos, pairs):
    """SGLang's sender, reduced to its addressing: item `s` of every source entry to item `d` of
    the matching destination entry."""
    for e, (sp, sl, si, dp, dl, di) in enumerate(zip(*src_infos, *dst_infos)):
        assert si == di and sl == dl, e
        for s, d in pairs:
            assert (s + 1) * si <= sl and (d + 1) * di <= dl
            ctypes.memmove(dp + d * di, sp + s * si, si)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pages_copied_through_buf_infos_arrive_byte_for_byte(layout, seed):
    a, b = _pool(layout), _pool(layout)
    B = a.page_size
    _fill(a, row=1, n_tokens=int(torch.randint(3 * B + 1, 4 * B, ()).item()))  # last page open
    infos_a, infos_b = a.get_contiguous_buf_infos(), b.get_contiguous_buf_infos()
    names = pd.kv_buffer_names(a)
    assert len(infos_a[0]) == len(names) == 4 * L * H
    half = len(names) // 2  # SGLang's K / V split
    assert {n for n, _, _ in names[:half]} == {"k_codes", "k_params"}
    assert {n for n, _, _ in names[half:]} == {"v_codes", "v_params"}
    # entry e of the K half pairs with entry e of the V half: same layer and head
    assert [(i, h) for _, i, h in names[:half]] == [(i, h) for _, i, h in names[half:]]
    src = torch.randperm(4)[:2] + 1  # two of the filled pages 1..4
    dst = torch.randperm(PAGES)[:2]
    pairs = list(zip(src.tolist(), dst.tolist()))
    _copy(infos_a, infos_b, pairs)

    for name in ("k_codes", "k_params", "v_codes", "v_params"):
        for i in range(L):
            ta, tb = getattr(a, name)[i], getattr(b, name)[i]
            per = B if ta.shape[0] == a.k_codes[0].shape[0] else 1  # rows a page
            assert ta.shape[0] // per == PAGES
            moved = set()
            for s, d in pairs:
                got, want = _bytes(tb[d * per:(d + 1) * per]), _bytes(ta[s * per:(s + 1) * per])
                assert torch.equal(got, want), (name, i, s, d)
                moved.add(d)
            if name in ("k_codes", "v_codes", "v_params"):  # the source pages were written
                assert any(_bytes(ta[s * per:(s + 1) * per]).any() for s, _ in pairs), name
            for p in set(range(PAGES)) - moved:  # nothing spilled into other pages
                assert not _bytes(tb[p * per:(p + 1) * per]).any(), (name, i, p)
    if layout == "channel":  # the full pages' key params travelled (quantised, non-zero)
        full = [s for s, _ in pairs if s < 4]
        assert all(_bytes(a.k_params[0][s]).any() for s in full)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_request_rows_side_state_copied_through_state_infos(layout, seed):
    a, b = _pool(layout), _pool(layout)
    row_a, row_b = int(torch.randint(1, ROWS, ()).item()), int(torch.randint(1, ROWS, ()).item())
    n = int(torch.randint(a.recent + a.sink + 1, (PAGES - 1) * a.page_size + 1, ()).item())  # past the ring
    _fill(a, row=row_a, n_tokens=n)
    a.own_start[row_a], a.sink_start[row_a] = int(torch.randint(0, n, ()).item()), 0
    infos_a, infos_b = a.get_state_buf_infos(), b.get_state_buf_infos()
    assert len(infos_a[0]) == len(pd.state_buffer_names(a)) == 4 * L + 2
    assert pd.state_index(row_a) == [row_a]
    before = {name: getattr(b, name).clone() for name, _ in pd.state_buffer_names(b)}
    _copy(infos_a, infos_b, [(row_a, row_b)])

    for name, i in pd.state_buffer_names(a):
        ta, tb = getattr(a, name), getattr(b, name)
        if i is not None:
            ta, tb, old = ta[i], tb[i], before[name][i]
        else:
            old = before[name]
        assert torch.equal(_bytes(tb[row_b]), _bytes(ta[row_a])), (name, i)
        others = [r for r in range(ROWS) if r != row_b]
        assert torch.equal(_bytes(tb[others]), _bytes(old[others])), (name, i)
    assert a.ring_k[0][row_a].any() and a.sink_v[L - 1][row_a].any()


def test_compat_string_tells_formats_and_rotations_apart():
    sha = "".join(f"{x:02x}" for x in torch.randint(0, 256, (32,)).tolist())
    other = sha[:15] + ("0" if sha[15] != "0" else "1") + sha[16:]
    base = pd.compat_dtype_string({"kv_format": "k4c64-v2h-s4-w128", "rotation_sha256": sha})
    assert base == pd.compat_dtype_string({"kv_format": "k4c64-v2h-s4-w128", "rotation_sha256": sha})
    assert base != pd.compat_dtype_string({"kv_format": "k3c64-v2h-s4-w128", "rotation_sha256": sha})
    assert base != pd.compat_dtype_string({"kv_format": "k4c64-v2h-s4-w128", "rotation_sha256": other})
    assert pd.parse_compat(base) == ("k4c64-v2h-s4-w128", sha[:pd.ROTATION_PREFIX])
    assert pd.parse_compat("bfloat16") is None and pd.parse_compat("int2") is None
    assert pd.mismatch_message(base, base) is None
    b2 = pd.compat_dtype_string({"kv_format": "token", "rotation_sha256": sha})
    msg = pd.mismatch_message(base, b2)
    assert "k4c64-v2h-s4-w128" in msg and "token" in msg
    assert "kv_cache_dtype=auto" in pd.mismatch_message(base, "auto")


def test_hook_bodies_rewrite_the_dtype_and_name_both_formats():
    from oscar_sglang.runtime.state import RUNTIME_INFO

    saved = dict(RUNTIME_INFO)
    try:
        RUNTIME_INFO.clear()
        RUNTIME_INFO.update(kv_format="k4c64-v2h-s4-w128", rotation_sha256="ab" * 32)
        kv_args = SimpleNamespace(kv_cache_dtype_str="int2")  # CommonKVManager(args, mode, ...)
        assert pdh.before_kv_manager_init(None, kv_args, "prefill", None) is None
        assert kv_args.kv_cache_dtype_str == "int2:k4c64-v2h-s4-w128:" + "ab" * 8
        pdh.before_kv_manager_init(None, kv_args, "prefill", None)  # once rewritten, left alone
        assert kv_args.kv_cache_dtype_str == "int2:k4c64-v2h-s4-w128:" + "ab" * 8
        bf16 = SimpleNamespace(kv_cache_dtype_str="auto")
        pdh.before_kv_manager_init(None, args=bf16)
        assert bf16.kv_cache_dtype_str == "auto"
        RUNTIME_INFO.clear()  # no INT2 pool in this process: loud
        with pytest.raises(RuntimeError, match="no INT2 pool"):
            pdh.before_kv_manager_init(None, SimpleNamespace(kv_cache_dtype_str="int2"))
    finally:
        RUNTIME_INFO.clear()
        RUNTIME_INFO.update(saved)

    prefill, decode = "int2:token:" + "cd" * 8, "int2:k4c64-v2h-s4-w128:" + "ab" * 8

    def sglang_check(self, addr):  # the text SGLang's try_ensure_parallel_info raises
        raise RuntimeError(f"KV cache dtype mismatch: prefill server has kv_cache_dtype={prefill}, "
                           f"but decode server has kv_cache_dtype={decode}. Both servers must use the "
                           f"same --kv-cache-dtype value.")

    with pytest.raises(RuntimeError, match="INT2 PD servers cannot pair") as e:
        pdh.around_try_ensure_parallel_info(sglang_check, None, "host:1")
    assert "token" in str(e.value) and "k4c64-v2h-s4-w128" in str(e.value)
    assert pdh.around_try_ensure_parallel_info(lambda self, addr: True, None, "host:1") is True

    def other_error(self, addr):
        raise RuntimeError("Page size mismatch")

    with pytest.raises(RuntimeError, match="Page size mismatch"):
        pdh.around_try_ensure_parallel_info(other_error, None, "host:1")


def test_pd_refusals():
    assert pd.pd_parallel_problems(2, 2, 1, 1) == []
    tp = pd.pd_parallel_problems(2, 4)
    assert len(tp) == 1 and "prefill 2, decode 4" in tp[0] and "TP" in tp[0]
    pp = pd.pd_parallel_problems(1, 1, 2, 1)
    assert len(pp) == 1 and "PP" in pp[0]
    args = SimpleNamespace(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True,
                           disaggregation_decode_enable_offload_kvcache=True)
    p = pd.pd_decode_cache_problems(args)
    assert len(p) == 2 and "radix" in p[0] and "offload" in p[1]
    args.disaggregation_decode_enable_radix_cache = False
    assert len(pd.pd_decode_cache_problems(args)) == 1
    args.disaggregation_mode = "prefill"  # decode-side options only
    args.disaggregation_decode_enable_radix_cache = True
    assert pd.pd_decode_cache_problems(args) == []
    spec = SimpleNamespace(disaggregation_mode="prefill", speculative_algorithm="EAGLE")
    assert len(pd.pd_draft_problems(spec)) == 1
    spec.speculative_algorithm = "NGRAM"
    assert pd.pd_draft_problems(spec) == []
    spec.disaggregation_mode, spec.speculative_algorithm = "null", "EAGLE"
    assert pd.pd_draft_problems(spec) == []


def test_pd_start_refusals_name_what_to_do_instead():
    from oscar_sglang.runtime import refusals as F

    def args(**kw):
        base = dict(attention_backend="oscar_triton", disaggregation_mode="decode", dcp_size=1,
                    disaggregation_transfer_backend="mooncake")
        return SimpleNamespace(**{**base, **kw})

    assert pd.pd_start_problems(args(), {}) == []
    assert pd.pd_start_problems(args(disaggregation_mode="null", disaggregation_transfer_backend="mori",
                                     disaggregation_decode_enable_radix_cache=True), {}) == []
    (mori,) = pd.pd_start_problems(args(disaggregation_transfer_backend="mori"), {})
    assert "--disaggregation-transfer-backend mori" in mori and "mooncake or nixl" in mori
    (staging,) = pd.pd_start_problems(args(), {"SGLANG_DISAGG_STAGING_BUFFER": "1"})
    assert "SGLANG_DISAGG_STAGING_BUFFER" in staging and "Unset it" in staging
    (radix,) = pd.pd_start_problems(args(disaggregation_decode_enable_radix_cache=True), {})
    assert "Drop the flag" in radix
    # through server_args_problems: each problem; PD itself is served
    problems = F.server_args_problems(args(disaggregation_decode_enable_radix_cache=True,
                                           disaggregation_decode_enable_offload_kvcache=True,
                                           speculative_algorithm="EAGLE", speculative_eagle_topk=1,
                                           disaggregation_transfer_backend="ascend"), env={})
    assert len(problems) == 4 and "--disaggregation-transfer-backend ascend" in problems[-1]
    assert F.server_args_problems(args(), env={}) == []


def test_pairing_refuses_other_tp_or_pp_sizes():
    """around_try_ensure_parallel_info on an int2 decode: SGLang's check has cached the prefill's
    info; other attention TP / PP sizes are refused there, and the info is dropped again."""
    addr = "10.0.0.1:8998"

    def manager(tp, pp, dtype="int2:token:" + "ab" * 8):
        return SimpleNamespace(kv_cache_dtype_str=dtype, attn_tp_size=tp, pp_size=pp, prefill_info_table={})

    def fetch(prefill_tp, prefill_pp):
        def orig(self, bootstrap_addr):
            self.prefill_info_table[bootstrap_addr] = SimpleNamespace(attn_tp_size=prefill_tp, pp_size=prefill_pp)
            return True
        return orig

    ok = manager(2, 1)
    assert pdh.around_try_ensure_parallel_info(fetch(2, 1), ok, addr) is True and addr in ok.prefill_info_table
    for (ptp, ppp), word in (((4, 1), "prefill 4, decode 2"), ((2, 2), "PP sizes (prefill 2, decode 1)")):
        m = manager(2, 1)
        with pytest.raises(RuntimeError, match="INT2 PD servers cannot pair") as e:
            pdh.around_try_ensure_parallel_info(fetch(ptp, ppp), m, addr)
        assert word in str(e.value) and addr in str(e.value) and addr not in m.prefill_info_table
    bf16 = manager(2, 1, dtype="auto")  # not ours: SGLang decides
    assert pdh.around_try_ensure_parallel_info(fetch(4, 1), bf16, addr) is True
