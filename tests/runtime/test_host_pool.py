"""Int2HostPool (runtime/host_pool.py) on tiny CPU pools: whole pages device -> host -> another
device pool at other page indices, byte for byte; flat pages; refusals.

Pools are filled by the real store kernel (TRITON_INTERPRET on CPU) in three formats: per-channel
keys with different bits per layer (2 then 3), per-channel 3-bit keys, and the per-token recipe.
(The page-0 sink travels with no page: the device's sink store keeps it by token ids,
tests/runtime/test_radix_copies.py.)
"""
import inspect

import pytest
import torch

import sglang.srt.mem_cache.pool_host.base as host_base
from sglang.srt.mem_cache.pool_host.base import HostKVCache

from oscar_sglang.runtime import host_pool as hp
from oscar_sglang.runtime.host_pool import Int2HostPool, storage_salt
from oscar_sglang.runtime.pool import OscarInt2KVPool, note_new_rows, take_pending_rows

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

H, D, ROWS, PAGES = 2, 64, 5, 7
# (format name, layers, page size, token-recipe group); sink 4 everywhere
FORMATS = [("k2c32-v2t32-s4-w32@1=k3", 2, 32, None), ("k3c32-v2t32-s4-w32", 1, 32, None),
           ("token", 2, 8, 32)]
SECTIONS = ("k_codes", "k_params", "v_codes", "v_params")


@pytest.fixture(autouse=True)
def _no_host_reserve(monkeypatch):
    # HostKVCache keeps 10 GB of host RAM free; these pools are a few KB
    monkeypatch.setattr(host_base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 0)


def _pool(name, layers, B, group, device="cpu"):
    from oscar_sglang.runtime.kv_format import resolve

    take_pending_rows()
    fmt = resolve(name, head_dim=D, v_head_dim=D, num_layers=layers, group_size=group or 64,
                  sink=4, recent=8 if group else None)
    assert fmt.sink == 4
    return OscarInt2KVPool((PAGES - 1) * B, B, H, D, D, layers, device, req_rows=ROWS, kv_format=fmt,
                           k_clip=[0.9] * layers, v_clip=[1.0] * layers)


def _slots(pages, B):
    return (torch.tensor(pages)[:, None] * B + torch.arange(B)).reshape(-1)


def _prefill(pool, req_to_token, row, pages):
    """A request on `row` computes positions 0..len(pages)*B-1 itself, into `pages`."""
    B, dev = pool.page_size, pool.slot_entry.device
    slots = _slots(pages, B).to(dev)
    n = len(slots)
    req_to_token[row, :n] = slots
    note_new_rows([row], [0])
    pool.apply_pending_resets(req_to_token)
    rows, pre = torch.tensor([row], device=dev), torch.tensor([0], device=dev)
    pool.note_extend(rows, pre)
    for layer in range(pool.layer_num):
        k = (torch.randn(n, H, D) * 2).bfloat16().to(dev)
        v = torch.randn(n, H, D).bfloat16().to(dev)
        pool.store(layer, slots, k, v, torch.arange(n, device=dev), torch.full((n,), row, device=dev),
                   torch.full((n,), n, device=dev))


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _page_bytes(pool, layer, name, pages):
    buf = getattr(pool, name)[layer]
    if name == "k_params" and pool.layout.name == "channel":
        return _bits(buf[torch.tensor(pages, device=buf.device)])
    # head-major, as the host blob holds a page: [H, slots, ...]
    return _bits(buf[_slots(pages, pool.page_size).to(buf.device)].transpose(0, 1))


def _filled(spec, device="cpu"):
    pool = _pool(*spec, device=device)
    r2t = torch.zeros(ROWS, 128, dtype=torch.int64, device=device)
    _prefill(pool, r2t, 1, [1, 2, 3])
    _prefill(pool, r2t, 2, [4])
    return pool


def round_trip(spec, device="cpu"):
    """Pages of a pool filled by the store kernel -> host -> another pool at other page numbers,
    checked byte for byte, in the host blob itself as well (what the file tier writes)."""
    src = _filled(spec, device)
    B, L = src.page_size, src.layer_num
    host = Int2HostPool(src, 2.0, 0, B)
    # page sizes: every section of every layer, nothing else but alignment
    want = sum(_page_bytes(src, i, n, [1]).numel() for i in range(L) for n in SECTIONS)
    assert host.page_bytes == want  # (these shapes need no padding)
    assert host.get_size_per_token() == want / B
    per_slot = (src._int2_bytes() - src.slot_entry.numel() * 4) / src.k_codes[0].shape[0]
    assert host.size_per_token == per_slot
    assert host.kv_buffer.is_pinned() == torch.cuda.is_available()
    assert host.kv_buffer.device.type == "cpu"
    assert host.host_view.device.type == torch.device(device).type
    assert host.host_view.data_ptr() == host.kv_buffer.data_ptr()

    dev_pages, host_pages = [1, 2, 3, 4], [5, 2, 7, 0]
    slots = lambda pages: _slots(pages, B).to(device)  # noqa: E731
    host.backup_from_device_all_layer(src, slots(host_pages), slots(dev_pages), "kernel")
    if device != "cpu":
        torch.cuda.synchronize()
    for sec in host.sections:  # the host memory itself holds the device's bytes
        for a, h in zip(dev_pages, host_pages):
            got = host.kv_buffer[h, sec.offset:sec.offset + sec.nbytes]
            assert torch.equal(got, _page_bytes(src, sec.layer, sec.name, [a]).reshape(-1).cpu()), (sec, a)

    dst = _pool(*spec, device=device)
    dst_pages = [5, 3, 1, 2]
    dst.slot_entry[slots(dst_pages)] = 7  # stale pointers the load must clear
    for layer in range(L):
        host.load_to_device_per_layer(dst, slots(host_pages), slots(dst_pages), layer, "kernel")
    for layer in range(L):
        for name in SECTIONS:
            for a, b in zip(dev_pages, dst_pages):
                assert torch.equal(_page_bytes(dst, layer, name, [b]), _page_bytes(src, layer, name, [a])), \
                    (layer, name, a, b)
    # nothing else written: page 4 of dst (not a target) still zero
    assert not any(_page_bytes(dst, i, n, [4]).any() for i in range(L) for n in SECTIONS)
    assert (dst.slot_entry[slots(dst_pages)] == -1).all()


@pytest.mark.parametrize("spec", FORMATS, ids=[f[0] for f in FORMATS])
def test_pages_round_trip_byte_exact(spec, seed):
    round_trip(spec)


def test_a_run_that_is_not_a_page_is_not_copied_and_stops_the_pool(seed):
    """Indices are checked in the copy kernel (no host synchronisation on a GPU): a run that is not
    a whole page is copied nowhere, the other runs are, and the pool raises (on a CPU pool at
    once; on a GPU one at its next copy, once the flag reached host memory) and keeps raising."""
    src = _filled(FORMATS[0])
    B, L = src.page_size, src.layer_num
    host = Int2HostPool(src, 2.0, 0, B)
    host.backup_from_device_all_layer(src, _slots([5, 2], B), _slots([1, 2], B), "kernel")
    dst = _pool(*FORMATS[0])
    bad_dev = _slots([3, 1], B)
    bad_dev[:B] += 1  # run 0 starts mid-page
    with pytest.raises(ValueError, match="page-aligned"):
        host.load_to_device_per_layer(dst, _slots([5, 2], B), bad_dev, 1, "kernel")
    for name in SECTIONS:
        assert torch.equal(_page_bytes(dst, 1, name, [1]), _page_bytes(src, 1, name, [2]))  # run 1
        assert not _page_bytes(dst, 1, name, [3, 4]).any()  # run 0's pages: nothing written
    with pytest.raises(ValueError, match="an earlier HiCache copy"):
        host.load_to_device_per_layer(dst, _slots([5], B), _slots([2], B), 0, "kernel")


@pytest.mark.parametrize("spec", FORMATS[::2], ids=[f[0] for f in FORMATS[::2]])
def test_its_own_device_pool_is_planned_once(monkeypatch, spec, seed):
    """HiCache copies between the host tier and one device pool: that pool's copy plans (views,
    word size, checks) are made at the first copy, one a layer, and serve every later copy, each
    layer its own; another pool gets plans of its own per copy."""
    src = _filled(spec)
    B, L = src.page_size, src.layer_num
    host = Int2HostPool(src, 2.0, 0, B)
    made = []
    real = hp.copy_plans
    monkeypatch.setattr(hp, "copy_plans", lambda *a: made.append(len(a[2])) or real(*a))
    host.backup_from_device_all_layer(src, _slots([5, 2], B), _slots([1, 2], B), "kernel")
    for layer in range(L):  # back into the same pool, over pages 4 and 5
        host.load_to_device_per_layer(src, _slots([5, 2], B), _slots([4, 5], B), layer, "kernel")
    assert made == [len(host.sections)] and len(host._own_plans) == L
    for layer in range(L):
        for name in SECTIONS:
            assert torch.equal(_page_bytes(src, layer, name, [4]), _page_bytes(src, layer, name, [1]))
            assert torch.equal(_page_bytes(src, layer, name, [5]), _page_bytes(src, layer, name, [2]))
    dst = _pool(*spec)
    host.load_to_device_per_layer(dst, _slots([5], B), _slots([3], B), L - 1, "kernel")
    assert made == [len(host.sections), len(host.layer_sections[L - 1])]


@pytest.mark.parametrize("spec", FORMATS[::2], ids=[f[0] for f in FORMATS[::2]])
def test_flat_pages(spec, seed):
    src = _filled(spec)
    B = src.page_size
    host = Int2HostPool(src, 2.0, 0, B)
    host.backup_from_device_all_layer(src, _slots([1, 2], B), _slots([1, 2], B), "kernel")

    dummy = host.get_dummy_flat_data_page()
    assert dummy.dtype == torch.uint8 and dummy.shape == (host.page_bytes,) and not dummy.any()
    first = host.get_data_page(1 * B)
    assert torch.equal(first, host.kv_buffer[1])

    # the file backend's read path: a dummy page filled from storage, set at another host page
    dummy.copy_(first)
    host.set_from_flat_data_page(5 * B, dummy)
    assert torch.equal(host.get_data_page(5 * B), first)
    host.set_from_flat_data_page(6 * B, host.get_data_page(2 * B).clone())

    # loaded from the stored copies: the same bytes as from the original host pages
    dst = _pool(*spec)
    for layer in range(src.layer_num):
        host.load_to_device_per_layer(dst, _slots([5, 6], B), _slots([3, 4], B), layer, "kernel")
        for name in SECTIONS:
            assert torch.equal(_page_bytes(dst, layer, name, [3, 4]), _page_bytes(src, layer, name, [1, 2]))


def test_refusals(seed):
    src = _filled(FORMATS[2])
    B = src.page_size
    host = Int2HostPool(src, 2.0, 0, B)
    good = _slots([1], B)
    for bad in (good + 1, good[:-1], torch.cat([good[1:], good[:1]])):
        with pytest.raises(ValueError, match="whole pages|page-aligned"):
            host.backup_from_device_all_layer(src, good, bad, "kernel")
        with pytest.raises(ValueError, match="whole pages|page-aligned"):
            host.load_to_device_per_layer(src, bad, good, 0, "kernel")
    for bad_page in (B + 1, host.page_num * B, -B):  # not a page's first slot; past the end
        with pytest.raises(ValueError, match="not the first slot of a host page"):
            host.get_data_page(bad_page)
    with pytest.raises(ValueError, match="--hicache-io-backend kernel"):
        host.backup_from_device_all_layer(src, good, good, "direct")
    with pytest.raises(ValueError, match="--hicache-io-backend kernel"):
        host.load_to_device_per_layer(src, good, good, 0, "kernel_ascend")
    with pytest.raises(ValueError, match="--hicache-mem-layout page_first"):
        Int2HostPool(src, 2.0, 0, B, layout="layer_first")
    with pytest.raises(ValueError, match="--hicache-storage-backend file"):
        Int2HostPool(src, 2.0, 0, B, allocator_type="shm")
    with pytest.raises(ValueError, match="flat INT2 page"):
        host.set_from_flat_data_page(B, torch.zeros(host.page_bytes - 1, dtype=torch.uint8))


def test_is_a_host_kv_cache_with_its_signatures():
    assert issubclass(Int2HostPool, HostKVCache)
    assert not getattr(Int2HostPool, "__abstractmethods__", None)
    for name in ("get_size_per_token", "init_kv_buffer", "load_to_device_per_layer",
                 "backup_from_device_all_layer", "get_data_page", "get_dummy_flat_data_page",
                 "set_from_flat_data_page"):
        assert (list(inspect.signature(getattr(Int2HostPool, name)).parameters)
                == list(inspect.signature(getattr(HostKVCache, name)).parameters)), name


def test_storage_salt_and_hook(monkeypatch):
    from types import SimpleNamespace

    from oscar_sglang.runtime import state

    a = storage_salt("k4c64-v2t64-s4-w128", "ab" * 32)
    assert a == storage_salt("k4c64-v2t64-s4-w128", "ab" * 32)
    assert a != storage_salt("k2c64-v2t64-s4-w128", "ab" * 32)
    assert a != storage_salt("k4c64-v2t64-s4-w128", "cd" * 32)
    assert a.replace("-", "").isalnum() and len(a) < 32

    monkeypatch.setattr(state, "RUNTIME_INFO", {"kv_format": "k4c64-v2t64-s4-w128", "rotation_sha256": "ab" * 32})
    pool = _pool(*FORMATS[2])
    cfg = SimpleNamespace(model_name="org/model")
    out = hp.after_generate_storage_config(cfg, SimpleNamespace(mem_pool_device=pool))
    assert out.model_name == f"org/model_{a}"
    cfg = SimpleNamespace(model_name="org/model")
    assert hp.after_generate_storage_config(cfg, SimpleNamespace(mem_pool_device=object())).model_name == "org/model"
