"""HiCache wiring of the INT2 pool (runtime/hooks.py, backend._wait_for_layer), on CPU:

* HiRadixCache.__init__'s host-pool choice: an INT2 device pool gets Int2HostPool through the
  module's own lookups (its isinstance of MHATokenToKVPool and get_mha_host_pool_cls), which are
  put back afterwards, also when the constructor fails; any other pool goes through untouched;
* the hooks are in the table install() registers (and so in verify_hooks' check at start);
* the backend waits for each layer's host -> device load before reading it, decode and extend,
  and does nothing when no HiCache registered a counter.
"""
import math
from types import SimpleNamespace

import pytest
import torch

import sglang.srt.mem_cache.hiradix_cache as hiradix

from oscar_sglang.runtime import hooks
from oscar_sglang.runtime.host_pool import Int2HostPool

from .test_backend import Hq, H, D, _decode_batch, _heavy, backend_cls, prompt  # noqa: F401
from .test_backend_channel import B, _make


def _params(pool):
    return SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool))


def _as_sglang_picks(self, params, server_args):
    """The lookups HiRadixCache.__init__ makes before anything else (hiradix_cache.py), in its
    module's namespace at call time."""
    kv = params.token_to_kv_pool_allocator.get_kvcache()
    if not isinstance(kv, hiradix.MHATokenToKVPool):
        raise ValueError("HiRadixCache only supports MHA, MLA, DSA, and MSA models")
    return hiradix.get_mha_host_pool_cls(kv)


def test_an_int2_pool_gets_the_int2_host_pool_and_the_module_is_restored(backend_cls):
    _, pool, *_ = _make(backend_cls)
    mha, pick = hiradix.MHATokenToKVPool, hiradix.get_mha_host_pool_cls
    with pytest.raises(ValueError, match="only supports MHA"):  # unhooked: SGLang refuses it
        _as_sglang_picks(None, _params(pool), None)
    assert hooks.around_hiradix_init(_as_sglang_picks, None, _params(pool), None) is Int2HostPool
    assert (hiradix.MHATokenToKVPool, hiradix.get_mha_host_pool_cls) == (mha, pick)

    def failing(self, params, server_args):
        _as_sglang_picks(self, params, server_args)
        raise RuntimeError("a later step of the constructor failed")

    with pytest.raises(RuntimeError, match="later step"):
        hooks.around_hiradix_init(failing, None, _params(pool), None)
    assert (hiradix.MHATokenToKVPool, hiradix.get_mha_host_pool_cls) == (mha, pick)


def test_other_pools_go_through_untouched():
    seen = []

    def orig(self, params, server_args):
        seen.append((hiradix.MHATokenToKVPool, hiradix.get_mha_host_pool_cls))
        return "orig"

    other = object()
    assert hooks.around_hiradix_init(orig, None, _params(other), None) == "orig"
    assert seen == [(hiradix.MHATokenToKVPool, hiradix.get_mha_host_pool_cls)]


def test_the_hicache_hooks_are_registered():
    table = {(target, kind): fn for target, kind, fn in hooks.HOOKS}
    assert table[("sglang.srt.mem_cache.hiradix_cache.HiRadixCache.__init__", "AROUND")] is hooks.around_hiradix_init
    salt = table[("sglang.srt.managers.cache_controller.HiCacheController._generate_storage_config", "AFTER")]
    assert salt is hooks.after_generate_storage_config


class _Counter:
    """LayerDoneCounter's consumer side: records the layers waited for."""

    def __init__(self):
        self.waited = []

    def wait_until(self, threshold):
        self.waited.append(threshold)


def test_the_backend_waits_for_each_layers_load(backend_cls, seed):
    from .test_speculative_verify import _forward

    from oscar_sglang.runtime.pool import note_new_rows

    b, pool, layer, *_ = _make(backend_cls)
    req_to_token = torch.zeros(4, 8 * B, dtype=torch.int64)
    req_to_token[1, :40] = torch.arange(B, B + 40)
    b.req_to_token = req_to_token
    q, k, v = torch.randn(40, Hq, D).bfloat16().float(), _heavy(40, D), _heavy(40, D)
    assert pool.layer_transfer_counter is None  # no HiCache: nothing to wait for
    note_new_rows([1], [0], [prompt()])
    _forward(b, layer, req_to_token, [1], [0], 39, q[:39], k[:39], v[:39])

    counter = _Counter()
    pool.register_layer_transfer_counter(counter)
    fb = _decode_batch(b, req_to_token, torch.tensor([1]), torch.tensor([40]))
    b.forward_decode(q[39:].reshape(1, Hq * D), k[39:].reshape(1, H * D), v[39:].reshape(1, H * D), layer, fb)
    assert counter.waited == [layer.layer_id - pool.start_layer]
    note_new_rows([2], [0], [prompt()])
    req_to_token[2, :8] = torch.arange(6 * B, 6 * B + 8)
    _forward(b, layer, req_to_token, [2], [0], 8, q[:8], k[:8], v[:8])
    assert counter.waited == [0, 0]
    assert math.isfinite(float(pool.own_start[2]))
