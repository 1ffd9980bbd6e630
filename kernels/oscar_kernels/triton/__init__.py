"""Triton implementations of the ops in ``oscar_kernels.ops`` (one module per op).

* ``store``: rotate (optional) + clip + quantise + pack + scatter, and the BF16 sink/ring writes.
* ``attend``: the shared stage-1 kernel "query rows x cached keys of one request" that reads each
  key position from the BF16 sink, the BF16 ring or the INT2 pool (three separate loops).
* ``decode``: split-K decode (stage 1 = ``attend``, stage 2 = LSE merge of the splits).
* ``extend_prefix``: E new tokens per request against the cached prefix, returns (o, lse).
* ``attend_channel`` / ``store_channel``: decode stage 1 + extend-prefix (one kernel, as
  ``attend``) and store for per-channel keys over page blocks (KVFormat k_layout="channel";
  docs/format.md "KVFormat"), not served yet.
"""
