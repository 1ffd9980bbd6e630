"""runtime/prefill_split.py on SGLang's own PrefillAdder (hooked by the entry point), with a fake
prefix cache and allocator: with OSCAR_PREFILL_READS=cache a cold prompt's complete pages and its
tail are two forwards, the tail ending where a hit of the same prompt would start; a hit of every
complete page, a one-page prompt, a server in `exact` mode or one without a radix cache are
scheduled as stock SGLang schedules them.
"""
from types import SimpleNamespace

import pytest
import torch

PAGE = 64


@pytest.fixture(scope="module")
def sp():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.managers.schedule_policy as sp

    return sp


@pytest.fixture
def cache_mode(monkeypatch):
    from oscar_sglang.runtime.state import RUNTIME_INFO

    monkeypatch.setitem(RUNTIME_INFO, "prefill_reads", "cache")


class FakeTree:
    disable = False
    page_size = PAGE

    def supports_mamba(self):
        return False

    def evictable_size(self):
        return 0

    def inc_lock_ref(self, node):
        return SimpleNamespace(to_dec_params=lambda: None)

    def dec_lock_ref(self, node, *args):
        return None

    def is_tree_cache(self):
        return True


@pytest.fixture(autouse=True)
def _no_context_parallel(sp, monkeypatch):
    # PrefillAdder asks the published parallel config, which a test process has none of
    monkeypatch.setattr(sp, "is_dsa_prefill_cp_in_seq_split", lambda: False)
    monkeypatch.setattr(sp, "is_prefill_context_parallel_enabled", lambda: False)


def _adder(sp, chunk=8192, tree=None):
    alloc = SimpleNamespace(available_size=lambda: 1 << 20, page_size=PAGE)
    return sp.PrefillAdder(PAGE, tree or FakeTree(), alloc, None, 0.0, 1 << 20, chunk)


class Range(tuple):
    """(start, end) with SGLang's ExtendRange.length."""

    @property
    def length(self):
        return self[1] - self[0]


class FakeReq:
    """What PrefillAdder.add_one_req / add_chunked_req read of SGLang's Req."""

    def __init__(self, n, prefix=0, host=0):
        self.full_untruncated_fill_ids = list(range(n))
        self.prefix_indices = torch.arange(prefix)
        self.host_hit_length = host
        self.swa_host_hit_length = self.mamba_host_hit_length = 0
        self.sampling_params = SimpleNamespace(max_new_tokens=16, ignore_eos=False)
        self.output_ids = []
        self.last_node = self.best_match_node = None
        self.mamba_pool_idx = None
        self.retracted_stain = False
        self.return_logprob = False
        self.logprob_start_len = -1
        self.extend_range = None

    def _compute_max_prefix_len(self, n):
        return max(n - 1, 0)

    def needs_host_load_back(self):
        return self.host_hit_length > 0

    def set_extend_range(self, start, end):
        self.extend_range = Range((start, end))


def _load_back(tree):
    """The host tier's load-back: the host hit joins the device prefix."""
    def init_load_back(params):
        return torch.arange(params.host_hit_length), None
    tree.init_load_back = init_load_back
    return tree


def test_a_cold_prompt_prefills_its_complete_pages_then_its_tail(sp, cache_mode):
    adder = _adder(sp)
    req = FakeReq(300)  # pages [0, 256) then the tail [256, 300)
    assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == sp.AddReqResult.OTHER
    assert req.extend_range == (0, 256) and adder.new_chunked_req is req
    assert adder.rem_chunk_tokens == 0  # the batch ends with the split

    # next batch: the tail alone, as a hit of the 256 cached tokens would compute it
    req.prefix_indices = torch.arange(256)
    nxt = _adder(sp)
    assert nxt.add_chunked_req(req) is None  # finished
    assert req.extend_range == (256, 300)


def test_the_split_ends_where_a_hit_of_the_same_prompt_starts(sp, cache_mode):
    from oscar_sglang.runtime.prefill_split import tail_start

    # a prompt of whole pages: a hit matches at most L - 1 tokens, so its last page is the tail
    assert tail_start(FakeReq(256), PAGE) == 192
    assert tail_start(FakeReq(257), PAGE) == 256
    assert tail_start(FakeReq(64), PAGE) == 0
    req = FakeReq(256)
    _adder(sp).add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req.extend_range == (0, 192)


def test_hits_of_every_complete_page_and_one_page_prompts_are_one_forward(sp, cache_mode):
    adder = _adder(sp)
    hit = FakeReq(300, prefix=256)
    short = FakeReq(50)
    for req in (hit, short):
        assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == sp.AddReqResult.CONTINUE
    assert hit.extend_range == (256, 300) and short.extend_range == (0, 50)
    assert adder.new_chunked_req is None and adder.can_run_list == [hit, short]


def test_a_host_hit_counts_as_cached(sp, cache_mode):
    # 128 tokens on the device, 128 loaded back from host: every complete page is cached
    adder = _adder(sp, tree=_load_back(FakeTree()))
    req = FakeReq(300, prefix=128, host=128)
    assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == sp.AddReqResult.CONTINUE
    assert req.extend_range == (256, 300)
    # half of the pages cached (device + host): the rest of the pages first, then the tail
    adder = _adder(sp, tree=_load_back(FakeTree()))
    req = FakeReq(300, prefix=64, host=64)
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req.extend_range == (128, 256) and adder.new_chunked_req is req


def test_one_split_a_batch_and_none_while_another_request_is_chunked(sp, cache_mode):
    adder = _adder(sp)
    first, second = FakeReq(300), FakeReq(400)
    adder.add_one_req(first, has_chunked_req=False, truncation_align_size=None)
    assert adder.add_one_req(second, has_chunked_req=False, truncation_align_size=None) == sp.AddReqResult.OTHER
    assert second.extend_range is None and adder.can_run_list == [first]
    # a batch that carries a chunked request: a request that needs a split waits, a full hit goes
    adder = _adder(sp)
    assert adder.add_one_req(FakeReq(300), has_chunked_req=True, truncation_align_size=None) == sp.AddReqResult.OTHER
    hit = FakeReq(300, prefix=256)
    assert adder.add_one_req(hit, has_chunked_req=True, truncation_align_size=None) == sp.AddReqResult.CONTINUE
    assert adder.can_run_list == [hit]


def test_a_long_prompts_last_chunk_stops_before_its_tail(sp, cache_mode):
    req = FakeReq(10_000)
    adder = _adder(sp, chunk=8192)
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req.extend_range == (0, 8192)  # SGLang's own chunk
    req.prefix_indices = torch.arange(8192)
    adder = _adder(sp, chunk=8192)
    assert adder.add_chunked_req(req) is req  # still chunked: the complete pages only
    assert req.extend_range == (8192, 9984)
    assert adder.rem_chunk_tokens == 8192 - 1792  # the budget is SGLang's less what it used
    req.prefix_indices = torch.arange(9984)
    assert _adder(sp, chunk=8192).add_chunked_req(req) is None
    assert req.extend_range == (9984, 10_000)


def test_chunked_prefill_off_still_splits_and_keeps_it_off(sp, cache_mode):
    adder = _adder(sp, chunk=None)
    req = FakeReq(300)
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req.extend_range == (0, 256) and adder.rem_chunk_tokens is None
    req.prefix_indices = torch.arange(256)
    adder = _adder(sp, chunk=None)
    assert adder.add_chunked_req(req) is None and req.extend_range == (256, 300)
    assert adder.rem_chunk_tokens is None


@pytest.mark.parametrize("mode", ["exact", None, "no radix cache"])
def test_stock_scheduling_outside_page_canonical_prefill(sp, monkeypatch, mode):
    from oscar_sglang.runtime.state import RUNTIME_INFO

    tree = FakeTree()
    if mode == "no radix cache":
        monkeypatch.setitem(RUNTIME_INFO, "prefill_reads", "cache")
        tree.disable = True
    elif mode is None:
        monkeypatch.delitem(RUNTIME_INFO, "prefill_reads", raising=False)
    else:
        monkeypatch.setitem(RUNTIME_INFO, "prefill_reads", mode)
    adder = _adder(sp, tree=tree)
    req = FakeReq(300)
    assert adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) == sp.AddReqResult.CONTINUE
    assert req.extend_range == (0, 300) and adder.new_chunked_req is None
