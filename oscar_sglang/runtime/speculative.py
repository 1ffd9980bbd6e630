"""Speculative decoding on the INT2 cache: chains of drafts only, and what that asks of SGLang.

Served: NGRAM, EAGLE, EAGLE3 and STANDALONE (NEXTN, SGLang's alias of EAGLE) with chains, one
draft a position (--speculative-eagle-topk 1; NGRAM --speculative-ngram-max-bfs-breadth 1). In a
tree, sibling drafts share a position, hence a ring entry, and the verify's store would write
both; chains keep every draft at its own position (L + j), in the slot SGLang keeps for that
position, so accepted drafts need no move and rejected ones are rolled back in place
(runtime/draft_rollback.py). The draft model (EAGLE / STANDALONE) keeps a BF16 KV cache of its
own on SGLang's Triton backend; sizing reserves it (runtime/configurator.py).

* chain_defaults: the settings a user gave none of, before SGLang resolves its own (which for
  EAGLE on Llama would pick trees of topk 4, and for NGRAM a breadth of 10);
* ngram_chain_mask: NGRAM at breadth 1 pads a short match with sibling nodes of the root (token
  0 at position L + 1, SGLang's fillResult); they are turned into the chain's continuation, so
  every verify is a chain. A padding node is accepted only where the target itself predicts
  token 0 there, as for any draft.
"""
from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger("oscar_sglang")

CHAIN_ALGORITHMS = ("NGRAM", "EAGLE", "EAGLE3", "STANDALONE", "NEXTN")
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "STANDALONE", "NEXTN")
SGLANG_NGRAM_DEFAULT_BREADTH = 10  # ServerArgs.speculative_ngram_max_bfs_breadth's default
DEFAULT_CHAIN = (3, 1, 4)  # steps, topk, draft tokens: three drafted tokens and the bonus one
DRAFT_ATTENTION_BACKEND = "triton"


def algorithm(args) -> str:
    return str(getattr(args, "speculative_algorithm", None) or "").upper()


def chain_defaults(args) -> list[str]:
    """Set the chain settings of an int2 server the user left unset (ServerArgs before SGLang's
    own resolution); returns what was set, for the log."""
    alg = algorithm(args)
    done: list[str] = []
    if alg in EAGLE_FAMILY:
        steps, topk, drafts = (getattr(args, k, None) for k in
                               ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"))
        if steps is None and topk is None and drafts is None and not getattr(args, "speculative_adaptive", False):
            args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = DEFAULT_CHAIN
            done.append("--speculative-num-steps %d --speculative-eagle-topk %d --speculative-num-draft-tokens %d"
                        % DEFAULT_CHAIN)
        elif topk is None:
            args.speculative_eagle_topk = 1
            done.append("--speculative-eagle-topk 1")
        if getattr(args, "speculative_draft_attention_backend", None) is None:
            args.speculative_draft_attention_backend = DRAFT_ATTENTION_BACKEND
            done.append(f"--speculative-draft-attention-backend {DRAFT_ATTENTION_BACKEND}")
    elif alg == "NGRAM" and getattr(args, "speculative_ngram_max_bfs_breadth", None) == SGLANG_NGRAM_DEFAULT_BREADTH:
        args.speculative_ngram_max_bfs_breadth = 1
        done.append("--speculative-ngram-max-bfs-breadth 1")
    return done


def ngram_chain_mask(drafts: np.ndarray, mask: np.ndarray, batch_size: int) -> np.ndarray:
    """NGRAM's draft trees of a batch (drafts [B * N] tokens, mask [B * N * N], node i's row: its
    ancestors and itself) -> the same drafts as chains (a lower-triangular mask each). Each tree
    must be a chain followed by padding (root children of token 0), what breadth 1 gives; anything
    else is a tree the plugin cannot verify and raises."""
    n = int(round((mask.size // max(batch_size, 1)) ** 0.5))
    if batch_size == 0 or mask.size != batch_size * n * n or drafts.size != batch_size * n:
        raise RuntimeError(f"oscar-sglang: NGRAM drafts of unexpected shape ({drafts.size} tokens, a "
                           f"{mask.size}-element mask, {batch_size} requests)")
    m = mask.reshape(batch_size, n, n).astype(bool)
    tok = drafts.reshape(batch_size, n)
    chain = np.tril(np.ones((n, n), dtype=bool))
    for b in range(batch_size):
        if np.array_equal(m[b], chain):
            continue
        # the chain part: node i's ancestors are 0..i-1; the rest must be padding, ancestors {0}
        depth = next(i for i in range(n) if not np.array_equal(m[b, i], chain[i]))
        pad = np.zeros(n, dtype=bool)
        pad[0] = True
        for i in range(depth, n):
            row = pad.copy()
            row[i] = True
            if not np.array_equal(m[b, i], row) or tok[b, i] != 0:
                raise RuntimeError(
                    "oscar-sglang: an NGRAM draft tree with branches reached the INT2 cache, which "
                    "verifies chains only: serve with --speculative-ngram-max-bfs-breadth 1")
    out = np.broadcast_to(chain.astype(mask.dtype), (batch_size, n, n)).reshape(mask.shape)
    return np.ascontiguousarray(out)


# SGLang's modules that call eagle_sample after a verify, by the algorithm that runs them
ACCEPT_CALLERS = {"NGRAM": "sglang.srt.speculative.ngram_worker"}
EAGLE_ACCEPT_CALLER = "sglang.srt.speculative.eagle_worker_common"


def check_accept_hook(alg: str) -> None:
    """The rollback of rejected drafts runs in the hook on eagle_utils.eagle_sample, which the
    workers import by name: a worker imported before the plugin loaded would hold the unhooked
    function and rejected drafts would stay in the ring, silently. Raise if so (at start)."""
    import importlib

    from .hooks import _contains, after_eagle_sample

    name = ACCEPT_CALLERS.get(alg.upper(), EAGLE_ACCEPT_CALLER)
    fn = getattr(importlib.import_module(name), "eagle_sample", None)
    if fn is None or not _contains(fn, after_eagle_sample):
        raise RuntimeError(
            f"oscar-sglang: {name}.eagle_sample is not the plugin's hooked function (the module was "
            f"imported before the plugin loaded, or SGLang changed), so rejected speculative drafts "
            f"would not be rolled back in the INT2 cache; this needs sglang==0.5.17 with the plugin "
            f"loaded through its entry point")
