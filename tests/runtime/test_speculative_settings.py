"""Speculative decoding's settings on the INT2 cache: chain defaults, refusals, NGRAM's breadth-1
trees turned into chains, the accept hook, and what sizing reserves for it."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from oscar_sglang.runtime import refusals, sizing
from oscar_sglang.runtime.speculative import DEFAULT_CHAIN, chain_defaults, ngram_chains


def _spec(**kw):
    base = dict(speculative_algorithm=None, speculative_num_steps=None, speculative_eagle_topk=None,
                speculative_num_draft_tokens=None, speculative_adaptive=False,
                speculative_draft_attention_backend=None, speculative_ngram_max_bfs_breadth=10,
                speculative_ngram_match_type="BFS", speculative_ngram_external_corpus_path=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_chain_defaults():
    a = _spec(speculative_algorithm="EAGLE3")
    assert chain_defaults(a) and (a.speculative_num_steps, a.speculative_eagle_topk,
                                  a.speculative_num_draft_tokens) == DEFAULT_CHAIN == (3, 1, 4)
    assert a.speculative_draft_attention_backend == "triton"
    a = _spec(speculative_algorithm="STANDALONE", speculative_num_steps=5,
              speculative_draft_attention_backend="flashinfer")
    chain_defaults(a)
    assert (a.speculative_num_steps, a.speculative_eagle_topk) == (5, 1)
    assert a.speculative_draft_attention_backend == "flashinfer"  # the user's choice stays
    a = _spec(speculative_algorithm="NGRAM")
    assert chain_defaults(a) == ["--speculative-ngram-max-bfs-breadth 1"] and a.speculative_ngram_max_bfs_breadth == 1
    assert chain_defaults(_spec()) == []


@pytest.mark.parametrize("kw, words", [
    (dict(speculative_algorithm="DFLASH"), ["--speculative-algorithm DFLASH", "NGRAM", "STANDALONE"]),
    (dict(speculative_algorithm="FROZEN_KV_MTP"), ["not supported"]),
    (dict(speculative_algorithm="EAGLE", speculative_eagle_topk=4), ["--speculative-eagle-topk 4", "topk 1"]),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=3), ["--speculative-ngram-max-bfs-breadth 1"]),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=1, speculative_ngram_match_type="PROB"),
     ["match-type PROB"]),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=1,
          speculative_ngram_external_corpus_path="/c.jsonl"), ["external-corpus"]),
    (dict(speculative_algorithm="STANDALONE", speculative_eagle_topk=1, speculative_adaptive=True), ["--speculative-adaptive"]),
    (dict(speculative_algorithm="STANDALONE", speculative_eagle_topk=1, speculative_draft_attention_backend="oscar_triton"),
     ["draft model's KV cache is BF16"]),
])
def test_speculative_refusals(kw, words):
    problems = refusals.speculative_problems(_spec(**kw), env={})
    assert len(problems) == 1 and all(w in problems[0] for w in words), problems


def test_chains_pass():
    for alg in ("NGRAM", "EAGLE", "EAGLE3", "STANDALONE", "nextn"):
        a = _spec(speculative_algorithm=alg)
        chain_defaults(a)
        assert refusals.speculative_problems(a, env={}) == []


def _tree(n, parents):
    """Mask rows of a draft tree: node i's ancestors and itself."""
    m = np.zeros((n, n), dtype=np.uint8)
    for i in range(n):
        j = i
        while j != -1:
            m[i, j] = 1
            j = parents[j]
    return m


def test_ngram_trees_become_chains_of_the_same_drafts():
    n = 7
    chain = _tree(n, [-1, 0, 1, 2, 3, 4, 5])
    # a match of two drafts, then SGLang's padding: token 0, children of the root
    padded = _tree(n, [-1, 0, 1, 0, 0, 0, 0])
    # two anchors: 11 12 13 from the first, 21 22 from the second (branching at the root), and
    # a third continuing the first's 11 with 31 (branching at node 1)
    branched = _tree(n, [-1, 0, 0, 1, 2, 3, 1])
    drafts = np.array([[7, 11, 12, 0, 0, 0, 0], [7, 21, 22, 23, 24, 25, 26], [7, 11, 21, 12, 22, 13, 31]],
                      dtype=np.int64).reshape(-1)
    mask = np.concatenate([padded, chain, branched]).reshape(-1).astype(np.uint8)
    out_d, out_m = ngram_chains(drafts, mask, 3)
    assert out_m.dtype == mask.dtype and out_m.shape == mask.shape and out_d.shape == drafts.shape
    assert np.array_equal(out_m.reshape(3, n, n), np.stack([np.tril(np.ones((n, n)))] * 3))
    assert out_d.reshape(3, n).tolist() == [[7, 11, 12, 0, 0, 0, 0],        # already a chain + padding
                                            [7, 21, 22, 23, 24, 25, 26],    # unchanged
                                            [7, 11, 12, 13, 21, 22, 31]]    # first anchor's chain first
    assert sorted(out_d.reshape(3, n)[2]) == sorted(drafts.reshape(3, n)[2])  # the same drafts


def test_ngram_drafts_of_a_wrong_shape_are_refused():
    with pytest.raises(RuntimeError, match="unexpected shape"):
        ngram_chains(np.array([1, 8, 9]), np.ones(16, dtype=np.uint8), 1)


def test_accept_hook_does_nothing_without_an_int2_pool(monkeypatch):
    from oscar_sglang.runtime import draft_rollback, hooks

    monkeypatch.setattr(draft_rollback, "_ACTIVE", [])
    result = ("predict", torch.tensor([2]), "index")
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False))
    assert hooks.after_eagle_sample(result, SimpleNamespace(draft_token_num=4), batch) is result
    drafts, mask = np.array([1, 2]), np.array([1, 0, 0, 1])
    result = (drafts, mask)
    assert hooks.after_ngram_batch_get(result, None, ["r"]) is result  # a BF16 server's trees stay trees


def test_accept_hook_rolls_back_through_the_active_pool(monkeypatch):
    from oscar_sglang.runtime import draft_rollback, hooks

    calls = []
    fake = SimpleNamespace(restore=lambda *a: calls.append(a))
    monkeypatch.setattr(draft_rollback, "_ACTIVE", [fake])
    rows, lens, acc = torch.tensor([3, 5]), torch.tensor([40, 70]), torch.tensor([1, 4])
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False), req_pool_indices=rows, seq_lens=lens)
    hooks.after_eagle_sample(("p", acc, "i"), SimpleNamespace(draft_token_num=4), batch)
    assert len(calls) == 1 and calls[0][0] is rows and calls[0][1] is lens and calls[0][2] is acc and calls[0][3] == 4


def test_sizing_reserves_the_draft_cache_and_the_rollback():
    from oscar_sglang.runtime.draft_rollback import DraftRollback
    from oscar_sglang.runtime.kv_format import resolve

    shape = sizing.ModelKVShape(num_layers=32, num_kv_heads=8, head_dim=128, v_head_dim=128)
    fmt = resolve("k4c64-v2h-s4-w128", head_dim=128, v_head_dim=128, num_layers=32, group_size=128)
    budget = 40 << 30
    base = sizing.plan_pool(budget, shape, fmt=fmt, page_size=64, requested_max_running_requests=48)
    draft = sizing.bf16_bytes_per_token(sizing.ModelKVShape(1, 8, 128, 128))
    roll = DraftRollback.bytes_per_row(32, 8, 128, 128, 4)
    assert roll == 4 * (32 * 8 * 256 * 2 + 4)
    spec = sizing.plan_pool(budget, shape, fmt=fmt, page_size=64, requested_max_running_requests=48,
                            draft_bytes_per_token=draft, rollback_bytes_per_request=roll)
    assert spec.side_bytes_per_request == base.side_bytes_per_request + roll
    used = spec.side_bytes_total + spec.sink_store_bytes_total + spec.max_total_num_tokens * (spec.bytes_per_token + draft)
    assert used <= budget < used + 64 * (spec.bytes_per_token + draft) + spec.side_bytes_per_request
    assert "the draft model's BF16 KV" in spec.log_line() and "rollback" in spec.log_line()
    assert "speculative" not in base.log_line()


def test_the_accept_hook_check_sees_an_unhooked_worker(monkeypatch):
    """A worker module that bound eagle_sample before the plugin hooked it is refused at start."""
    import sys
    import types

    from oscar_sglang.runtime import hooks

    def unhooked(*a, **k):
        return None

    def wrap(fn, hook):  # what HookRegistry builds: the hook in the wrapper's closure
        def wrapper(*a, **k):
            return hook(fn(*a, **k), *a, **k)
        return wrapper

    wrapper = wrap(unhooked, hooks.after_eagle_sample)

    fake = types.ModuleType("fake_ngram_worker")
    fake.eagle_sample = unhooked
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.ngram_worker", fake)
    with pytest.raises(RuntimeError, match="not the plugin's hooked function"):
        hooks.check_accept_hook("NGRAM")
    fake.eagle_sample = wrapper
    hooks.check_accept_hook("ngram")
