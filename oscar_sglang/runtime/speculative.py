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
* ngram_chains: NGRAM at breadth 1 still builds trees (one chain per match anchor, branching
  where their continuations differ, padded with root children); each becomes one chain of the
  same drafts, so every verify is a chain.
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


def ngram_chains(drafts: np.ndarray, mask: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """NGRAM's draft trees of a batch (drafts [B * N] tokens, node 0 the last verified token;
    mask [B * N * N], node i's row: its ancestors and itself) -> chains of the same N tokens.

    At breadth 1 each match anchor (a suffix of the context found in the corpus) adds one chain
    from the root, and anchors whose continuations differ branch; short matches are padded with
    root children of token 0 (SGLang's Trie::buildRecency and fillResult). The chain kept is the
    first anchor's (the root's first child, then each node's first child: the order the tree was
    built in); the other nodes follow it, in their order, as drafts of the next positions. Any
    token sequence is a valid chain of drafts: the target accepts a draft only where it predicts
    that token itself, so this changes which drafts are tried, never what is generated."""
    n = int(round((mask.size // max(batch_size, 1)) ** 0.5))
    if batch_size == 0 or mask.size != batch_size * n * n or drafts.size != batch_size * n:
        raise RuntimeError(f"oscar-sglang: NGRAM drafts of unexpected shape ({drafts.size} tokens, a "
                           f"{mask.size}-element mask, {batch_size} requests)")
    m = mask.reshape(batch_size, n, n).astype(bool)
    tok = drafts.reshape(batch_size, n)
    out = tok.copy()
    chain = np.tril(np.ones((n, n), dtype=bool))
    # already chains (full matches): nothing to reorder; this runs on the host every NGRAM step
    for b in np.flatnonzero(~(m == chain).all(axis=(1, 2))):
        # parent of node i: its nearest ancestor (nodes come after their parents)
        parent = [-1] + [max(j for j in range(i) if m[b, i, j]) if m[b, i, :i].any() else 0 for i in range(1, n)]
        path, node = [0], 0
        while True:
            kids = [i for i in range(1, n) if parent[i] == node]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        rest = [i for i in range(1, n) if i not in set(path)]
        out[b] = tok[b, path + rest]
    return out.reshape(drafts.shape), np.ascontiguousarray(
        np.broadcast_to(chain.astype(mask.dtype), (batch_size, n, n))).reshape(mask.shape)
