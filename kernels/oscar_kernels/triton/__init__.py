"""Triton implementations of the ops in ``oscar_kernels.ops``.

Common core (both formats):
* ``core``: source rule, split plan, online softmax, the BF16 sink + ring loop, split merges,
  launch helpers (compiled on CUDA tensors, the Triton interpreter on CPU ones).
* ``core_codes``: packed codes -> tensor-core operands, (scale, min) parameter words.
* ``merge``: LSE merge of two partial attentions (prefix + new tokens); ``kv_indices``: SGLang's
  kv_indices fill; ``page_copy``: whole pages between the pool and a page-first blob (the host
  tier), indices checked in the kernel.

The per-token recipe (KVFormat k_layout="token"):
* ``token_store``: rotate (optional) + clip + quantise + pack + scatter, and the BF16 sink/ring.
* ``token_decode``: split-K decode (G = head_dim kernel, or the generic one for other groups).
* ``token_extend``: extend-prefix (large-tile kernel, or the generic one for other shapes).
* ``token_attend``: the generic kernel of both modes.

Per-channel keys over page blocks (KVFormat k_layout="channel", the served default):
* ``channel_store``, ``channel_decode``, ``channel_extend``, ``channel_dequant``, on the kernel of
  ``channel_attend``.
"""
