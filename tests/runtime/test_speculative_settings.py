"""Speculative decoding's settings on the INT2 cache: chain defaults, refusals, NGRAM's padded
breadth-1 trees turned into chains, the accept hook, and what sizing reserves for it."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from oscar_sglang.runtime import refusals, sizing
from oscar_sglang.runtime.speculative import DEFAULT_CHAIN, chain_defaults, ngram_chain_mask


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


def test_ngram_padding_becomes_the_chains_continuation():
    n = 6
    chain = _tree(n, [-1, 0, 1, 2, 3, 4])
    # a match of two drafts, then SGLang's padding: token 0, children of the root
    padded = _tree(n, [-1, 0, 1, 0, 0, 0])
    drafts = np.array([[7, 11, 12, 0, 0, 0], [7, 21, 22, 23, 24, 25]], dtype=np.int64).reshape(-1)
    mask = np.concatenate([padded, chain]).reshape(-1)
    out = ngram_chain_mask(drafts, mask, 2)
    assert out.dtype == mask.dtype and out.shape == mask.shape
    assert np.array_equal(out.reshape(2, n, n), np.stack([np.tril(np.ones((n, n)))] * 2))
    # no match at all: every draft is padding
    assert np.array_equal(ngram_chain_mask(np.array([5, 0, 0, 0, 0, 0]), _tree(n, [-1, 0, 0, 0, 0, 0]).reshape(-1), 1)
                          .reshape(n, n), np.tril(np.ones((n, n))))


def test_ngram_branches_are_refused():
    n = 4
    tree = _tree(n, [-1, 0, 0, 1])  # node 2 a real sibling of node 1 (token 9, not padding)
    with pytest.raises(RuntimeError, match="--speculative-ngram-max-bfs-breadth 1"):
        ngram_chain_mask(np.array([1, 8, 9, 10]), tree.reshape(-1), 1)


def test_accept_hook_does_nothing_without_an_int2_pool(monkeypatch):
    from oscar_sglang.runtime import draft_rollback, hooks

    monkeypatch.setattr(draft_rollback, "_ACTIVE", [])
    result = ("predict", torch.tensor([2]), "index")
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False))
    assert hooks.after_eagle_sample(result, SimpleNamespace(draft_token_num=4), batch) is result
    drafts, mask = np.array([1, 2]), np.array([1, 0, 0, 1])
    assert hooks.after_ngram_batch_get((drafts, mask), None, ["r"]) == (drafts, mask)  # trees stay trees


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
    used = spec.side_bytes_total + spec.max_total_num_tokens * (spec.bytes_per_token + draft)
    assert used <= budget < used + 64 * (spec.bytes_per_token + draft) + spec.side_bytes_per_request
    assert "draft model's BF16 KV" in spec.log_line()
