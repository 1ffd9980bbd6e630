"""The two KV layouts of the INT2 pool, as strategy objects: the one place that knows per-channel
keys from per-token groups. The pool picks one from its KV format (layout_for) and the pool and
the attention backend call it instead of branching on the layout.

* PerChannelLayout (the default formats, k<bits>c<B>-...): keys quantised per channel over page
  blocks of B tokens (B = the page size), (scale, min) per (page, head, channel); a page's keys
  are quantised when its last position is stored. Its kernels: ops.*_channel. It plans its own
  decode splits, can store a decode step in one launch that also rotates q and k
  (OSCAR_DECODE_STORE=fused), and can dequantise its prefix to BF16 pieces (the FlashInfer prefix
  path, the debug tap's read-back).
* PerTokenLayout (OSCAR_KV_FORMAT=token, the OSCAR recipe): 2-bit groups along head_dim for keys
  and values, the rotation file's clip ratios. Its kernels: ops.store_kv / decode_attention /
  extend_prefix_attention, SGLang's decode split counts.

Values are per-token groups in both. Each method calls the same kernel with the same arguments
as the code it replaced; ops functions are looked up at call time (tests wrap them).
"""
from __future__ import annotations

from oscar_kernels import ops
from oscar_kernels.format import Int2Format

from .kv_format import ServedFormat


class KVLayout:
    """What differs between the layouts; the capabilities say what a layout supports (the
    backend refuses the rest at start)."""

    name: str
    # OSCAR_DECODE_STORE=fused: a decode step's store launch also rotates q and k
    fused_decode_store: bool
    # the cached prefix can be dequantised to BF16 pieces (OSCAR_PREFIX_ATTENTION=flashinfer, the
    # debug tap's read-back)
    dequantises_prefix: bool
    # the decode plans its own split counts (ops.decode_splits_channel) instead of SGLang's
    plans_decode_splits: bool
    # where the weights hold R_v, the decode's merge writes the model's dtype itself
    decode_writes_model_dtype: bool

    def __init__(self, fmt: ServedFormat):
        self.fmt = fmt

    # ------------------------------------------------------------------ pool
    def check_page_size(self, page_size: int) -> None:
        pass

    def k_format(self, head_dim: int) -> Int2Format | None:
        """The per-token key format (None where keys are not per-token groups)."""
        raise NotImplementedError

    def k_param_shape(self, n: int, page_size: int, heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's key (scale, min) buffer for n slots."""
        raise NotImplementedError

    def format_args(self, layer_id: int) -> dict:
        """The format keywords of this layer's store / decode / extend ops."""
        raise NotImplementedError

    def store(self, pool, i: int, layer_id: int, k, v, loc, side: dict, **options) -> None:
        """Quantise k / v of local layer i into slots loc, side copies as `side` says."""
        raise NotImplementedError

    # ------------------------------------------------------------------ attention
    def decode(self, q, o, **kw) -> None:
        raise NotImplementedError

    def extend_prefix(self, q, qo_indptr, *, max_len_prefix, extend_lens, **kw):
        """(o, lse) of the new tokens' queries over the cached prefix."""
        raise NotImplementedError

    def decode_splits(self, backend, B: int, md) -> dict:
        """Split plan and scratch of a decode batch of B requests (the backend's metadata md)."""
        raise NotImplementedError


class PerTokenLayout(KVLayout):
    name = "token"
    fused_decode_store = False
    dequantises_prefix = False
    plans_decode_splits = False
    decode_writes_model_dtype = False

    def k_format(self, head_dim: int) -> Int2Format:
        return Int2Format(head_dim, self.fmt.k_group)

    def k_param_shape(self, n, page_size, heads, head_dim):
        return (n, heads, head_dim // self.fmt.k_group, 2)

    def format_args(self, layer_id: int) -> dict:
        return dict(k_group=self.fmt.k_group, v_group=self.fmt.v_group)

    def store(self, pool, i, layer_id, k, v, loc, side, **options):
        if options:
            raise ValueError("rot_k / q / one_token_per_request are per-channel format store options")
        ops.store_kv(
            k,
            v,
            loc,
            pool.k_codes[i],
            pool.k_params[i],
            pool.v_codes[i],
            pool.v_params[i],
            k_clip=pool.k_clip[i],
            v_clip=pool.v_clip[i],
            **self.format_args(layer_id),
            **side,
        )

    def decode(self, q, o, **kw):
        ops.decode_attention(q, o, **kw)

    def extend_prefix(self, q, qo_indptr, *, max_len_prefix, extend_lens, **kw):
        return ops.extend_prefix_attention(q, qo_indptr, **kw)

    def decode_splits(self, backend, B, md):
        """SGLang's split counts (md.num_kv_splits, its heuristic for its own kernel) up to
        max_kv_splits."""
        return dict(num_kv_splits=md.num_kv_splits, max_kv_splits=backend.max_kv_splits,
                    attn_logits=md.attn_logits, attn_lse=md.attn_lse)


class PerChannelLayout(KVLayout):
    name = "channel"
    fused_decode_store = True
    dequantises_prefix = True
    plans_decode_splits = True
    decode_writes_model_dtype = True

    def check_page_size(self, page_size: int) -> None:
        if page_size != self.fmt.k_group:
            raise ValueError(f"KV format {self.fmt.name} needs --page-size {self.fmt.k_group}, the pool "
                             f"has {page_size}")

    def k_format(self, head_dim: int) -> None:
        return None

    def k_param_shape(self, n, page_size, heads, head_dim):
        return (n // page_size, heads, head_dim, 2)

    def format_args(self, layer_id: int) -> dict:
        fmt = self.fmt
        return dict(k_bits=fmt.k_bits[layer_id], k_block=fmt.k_group, v_group=fmt.v_group)

    def store(self, pool, i, layer_id, k, v, loc, side, **options):
        """options: rot_k / q / q_out / one_token_per_request of ops.store_kv_channel (with rot_k,
        k arrives unrotated)."""
        ops.store_kv_channel(
            k, v, loc, k_codes=pool.k_codes[i], k_params=pool.k_params[i],
            v_codes=pool.v_codes[i], v_params=pool.v_params[i], v_clip=pool.v_clip[i],
            **self.format_args(layer_id), **side, **options,
        )

    def decode(self, q, o, **kw):
        ops.decode_attention_channel(q, o, **kw)

    def extend_prefix(self, q, qo_indptr, *, max_len_prefix, extend_lens, **kw):
        # the kernel may split long prefixes (it needs the longest) and launches a batch's trailing
        # one-token extends (mixed-chunk decodes) with small tiles: host-side lengths
        return ops.extend_prefix_attention_channel(q, qo_indptr, **kw, max_len_prefix=max_len_prefix,
                                                   extend_lens=extend_lens)

    def decode_splits(self, backend, B, md):
        """The kernel's own plan (ops.decode_splits_channel: about 8 programs per SM, each
        request's count derived in kernel from its length) in SGLang's scratch ([rows, Hq,
        --triton-attention-num-kv-splits, Dv], which caps it), or for batches of 1-2 requests a
        wider one of the backend's own (backend._wide_scratch). SGLang's split counts, a
        heuristic for its own kernel, made this one slower (docs/design.md)."""
        # every layer of a step asks with the same scratch: plan and slice once (otherwise ~25 us
        # of Python a layer, paid every step the decode runs without a CUDA graph)
        c = backend._split_args
        if c is not None and c[0] is md.attn_logits and c[1] is md.attn_lse and c[2] == B:
            return c[3]
        pool = backend.pool
        plan = ops.decode_splits_channel(B, pool.head_num, pool.sink, pool.recent, md.attn_logits.device)
        logits, lse = md.attn_logits, md.attn_lse
        wide = backend._wide_scratch
        if plan > min(logits.shape[2], lse.shape[2]) and wide is not None and B <= wide[0].shape[0]:
            logits, lse = wide  # batches of 1-2 requests: more splits than SGLang's scratch holds
        n = min(plan, logits.shape[2], lse.shape[2])
        args = dict(num_kv_splits=None, max_kv_splits=n, attn_logits=logits[:B, :, :n], attn_lse=lse[:B, :, :n])
        backend._split_args = (md.attn_logits, md.attn_lse, B, args)
        return args


LAYOUTS = {cls.name: cls for cls in (PerChannelLayout, PerTokenLayout)}


def layout_for(fmt: ServedFormat) -> KVLayout:
    """The layout strategy of a served KV format (chosen once, by the pool)."""
    try:
        return LAYOUTS[fmt.layout](fmt)
    except KeyError:
        raise ValueError(f"KV format {fmt.name}: unknown layout {fmt.layout!r} "
                         f"(known: {', '.join(LAYOUTS)})") from None
