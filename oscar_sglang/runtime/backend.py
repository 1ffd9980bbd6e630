"""`oscar_triton`: SGLang's Triton attention backend, reading and writing the INT2 pool.

It subclasses TritonAttnBackend and keeps its metadata work (kv_indptr / kv_indices in position
order, split-K counts, CUDA-graph buffers), with kv_indices filled by a kernel of many programs a
request (_fill_kv_indptr_and_indices); the KV store and the attention over cached keys change:

* decode:  rotate q (per KV head, R_k), store the new token (rotated k by R_k, v by R_v; INT2 +
           BF16 sink/ring copies; OSCAR_DECODE_STORE=fused: one store launch rotates q and k
           and does it all), then one INT2-aware split-K decode over sink + INT2 + ring,
           then un-rotate the output by R_v^T. Graph-safe: no host sync, no data-dependent shape.
           The pool's layout strategy (runtime/layouts.py: per-channel keys or per-token groups)
           runs the store and picks the kernels.
* extend:  new tokens attend to each other in plain BF16 (runtime/new_tokens.py: FlashInfer's
           ragged prefill by default, or SGLang's Triton extend kernel; LSE out); the cached
           prefix is read by the INT2-aware prefix kernel (rotated q, LSE); one kernel merges
           the two by LSE, then the new tokens are stored. Storing after attention keeps the
           ring holding [P - W, P) for the prefix reader.

Rotations are applied after RoPE (the backend sees post-RoPE q/k), and q.k is unchanged because
R_k is orthogonal. Each TP rank holds only its KV heads' matrices (pool.k_rot / v_rot). Where the
model's weights absorbed R_v at load (runtime/absorb.py), the pool has no V rotation and the
backend neither rotates V nor un-rotates the output.

Shaped like SGLang's backends: capabilities (what is served, what is refused and where), set-up,
per-forward metadata (SGLang's ForwardMetadata from TritonAttnBackend plus Int2ForwardMetadata,
built in init_forward_metadata / init_forward_metadata_out_graph, the latter also the CUDA-graph
capture and replay entry), then one method per forward mode (forward_decode, forward_extend).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend, logit_capping_mod

from oscar_kernels import ops

from . import compile_watch, debug_tap
from .device_index import to_device
from .new_tokens import FlashInferNewTokens, TritonNewTokens, workspace_bytes
from .prefix_flashinfer import FlashInferPrefix
from .pool import OscarInt2KVPool

BACKEND_NAME = "oscar_triton"
logger = logging.getLogger("oscar_sglang")
_WARMED_UP = {"done": False}


# FlashInfer reads the prefix as BF16 rows written out per layer (~8 KB a cached token of
# Llama-3.1-8B, written and read); the INT2 kernel reads the codes in place at ~180 TFLOP/s where
# FlashInfer's prefill runs ~700 (H100). Per cached key the saving is 4 Hq D (1/180T - 1/700T) per
# query row against the round trip of its BF16 row: FlashInfer pays from ~48 query rows per cached
# key on. A prefill chunk over its prompt's earlier chunks has thousands; the one-token rows of the
# decodes that --enable-mixed-chunk folds into a prefill batch have one each: writing out their whole
# caches every layer cost int2-mixed-chunk 13-42% of its throughput in the H100 table of
# 2026-11-27 00:08; with this rule the 02:53 table had it back to 3,168 / 5,457 / 5,940 / 1,282
# output tok/s from 2,284 / 5,244 / 3,830 / 1,098 (two runs, CHANGELOG.md).
PREFIX_FI_MIN_ROWS_PER_KEY = 64


def prefix_worth_flashinfer(extend_lens, prefix_lens) -> bool:
    """Whether a forward's cached prefixes go through FlashInfer: the extend length averaged over
    its cached keys (sum e * p / sum p) is at least PREFIX_FI_MIN_ROWS_PER_KEY."""
    keys = sum(int(p) for p in prefix_lens)
    rows_x_keys = sum(int(e) * int(p) for e, p in zip(extend_lens, prefix_lens))
    return keys > 0 and rows_x_keys >= PREFIX_FI_MIN_ROWS_PER_KEY * keys


def parent_fill_problem() -> str | None:
    """Why OscarInt2TritonBackend's kv_indices fill would not replace SGLang's (None: it does): the
    override names a private TritonAttnBackend method of SGLang 0.5.17; were it renamed, SGLang's
    fill would run and ours never would, silently."""
    import inspect

    fill = getattr(TritonAttnBackend, "_fill_kv_indptr_and_indices", None)
    want = ["self", "bs", "seq_lens", "req_pool_indices", "kv_indices"]
    if fill is None or list(inspect.signature(fill).parameters) != want:
        return ("TritonAttnBackend._fill_kv_indptr_and_indices(" + ", ".join(want[1:]) + ") is gone "
                "or changed in this SGLang; oscar-sglang needs sglang==0.5.17 (pip install "
                "'sglang==0.5.17')")
    return None


@dataclass
class Int2ForwardMetadata:
    """What the INT2 path needs of a forward beyond SGLang's ForwardMetadata (built eagerly by
    _prepare_forward, before any layer runs). Decode steps use the defaults."""

    token_rows: torch.Tensor | None = None      # extend: each new token's request row (the store)
    token_seq_lens: torch.Tensor | None = None  # extend: its request's length after this forward
    has_prefix: bool = True       # some request has cached tokens (else the new tokens are all)
    use_prefix_fi: bool = False   # the prefix goes through FlashInfer (prefix_worth_flashinfer)
    max_prefix: int | None = None  # the longest cached prefix, host-side (None: unknown)
    verify: int = 0               # a speculative verify (TARGET_VERIFY): its drafts a request (a chain)
    # page-canonical prefill (_prepare_canonical): None, or the requests whose extend starts on a
    # page boundary, stored before attention and read as the cache will hold them
    canonical: "CanonicalExtend | None" = None


@dataclass
class CanonicalExtend:
    """A forward's page-canonical requests (see OscarInt2TritonBackend._prepare_canonical)."""

    first_tokens: torch.Tensor | None  # the canonical requests' new tokens (None: all of them)
    after_tokens: torch.Tensor | None  # the others' (None: none), stored after attention
    # the read-back of new tokens in complete pages (None / empty rows: no new token completes one)
    kv_indptr: torch.Tensor | None   # [B + 1]: each canonical request's whole sequence (0 elsewhere)
    kv_indices: torch.Tensor | None
    first: torch.Tensor           # [B] its first new position (a page boundary)
    out_indptr: torch.Tensor | None  # [B + 1]: its new positions in complete pages, compact rows
    rows: torch.Tensor            # [n] those positions' rows among the forward's new tokens
    max_len: int                  # host: the most such positions of one request


# a decode step's: nothing beyond SGLang's metadata (shared, never mutated: no allocation a step)
_DECODE_MD = Int2ForwardMetadata()


class OscarInt2TritonBackend(TritonAttnBackend):
    """Capabilities. Serves forward modes DECODE (CUDA graphs included), EXTEND (prefill chunks,
    --enable-mixed-chunk batches) and IDLE, for the pool's layout (pool.layout: per-channel keys or
    the per-token recipe; KVLayout's flags say what each supports). Refused at start, with what to
    do: another KV pool, sliding-window / MLA / decode context parallelism (__init__), FP8 KV
    scales other than 1 (refusals.kv_scale_problems), OSCAR_DECODE_STORE=fused or
    OSCAR_PREFIX_ATTENTION=flashinfer with a layout without them; draft-model forward modes
    (DRAFT_EXTEND: a draft model runs on its own BF16 pool and SGLang's Triton backend); layers
    sharing another layer's KV, attention sinks and score_mod at their first call (_check).
    Server options the pool cannot serve are refused before any weight loads
    (runtime/refusals.py). TARGET_VERIFY (speculative decoding, chains of drafts, CUDA graphs
    included) is served as an extend of N drafts a request over its cached prefix, causal among
    the drafts (the chain's mask), with the ring entries the drafts overwrite saved first and
    given back for rejected drafts after SGLang's accept step (runtime/draft_rollback.py)."""

    int2_md = _DECODE_MD  # replaced (never mutated) by each _prepare_forward
    _split_args = None  # (attn_logits, attn_lse, B, args): _decode_splits of the current step
    _wide_scratch = None  # _wide_split_scratch's (attn_logits, attn_lse): batches of 1-2 requests
    _fused_store = False  # OSCAR_DECODE_STORE=fused (set in __init__ by _decode_store)
    _canonical_prefill = False  # OSCAR_PREFILL_READS=cache (set in __init__ by _prefill_reads)
    _joint_logged = False  # _rot_qk_joint said which form it takes

    def __init__(self, model_runner, skip_prefill: bool = False, kv_indptr_buf=None):
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, OscarInt2KVPool):
            raise RuntimeError(
                f"attention backend {BACKEND_NAME!r} serves only the INT2 KV cache: start with "
                f"--kv-cache-dtype int2 (got a {type(pool).__name__}; for a BF16/FP8 cache use "
                f"--attention-backend triton)"
            )
        problem = parent_fill_problem()
        if problem:
            raise RuntimeError(f"oscar_triton: {problem}")
        super().__init__(model_runner, skip_prefill=skip_prefill, kv_indptr_buf=kv_indptr_buf)
        # TritonAttnBackend reads v_head_dim from the pool's value buffer, which here holds
        # packed codes (Dv / 4 bytes): set the real one.
        self.v_head_dim = pool.v_head_dim
        self.pool: OscarInt2KVPool = pool
        if self.sliding_window_size is not None and self.sliding_window_size > 0:
            raise RuntimeError("oscar_triton: sliding-window attention is not supported")
        if self.use_mla or self.dcp_size > 1:
            raise RuntimeError("oscar_triton: MLA and decode context parallelism are not supported")
        from .refusals import kv_scale_problems, raise_if_any, unit_kv_scales_for_dummy_weights

        # at start-up (the weights are loaded), not at the first forward inside CUDA-graph capture
        model = getattr(model_runner, "model", None)
        if model is not None:
            load_format = str(getattr(getattr(model_runner, "server_args", None), "load_format", ""))
            if load_format == "dummy":
                unit_kv_scales_for_dummy_weights(model)
            raise_if_any(kv_scale_problems(model))
        # prefix length 0 for every request: the stock extend kernel then sees only new tokens
        self._zero_kv_indptr = torch.zeros_like(self.kv_indptr)
        self._prepare_rotations(getattr(model_runner, "dtype", torch.bfloat16))
        compile_watch.install()  # kernels compiled while serving: a warning each (start() below)
        self._fused_store = self._decode_store()
        self._canonical_prefill = self._prefill_reads()
        self._wide_scratch = self._wide_split_scratch(self.num_head, self.v_head_dim, self.device)
        self._new_tokens = self._make_new_token_attention(model_runner)
        self._prefix_fi = self._make_prefix_attention(model_runner)
        # speculative verify: drafts attend to each other with SGLang's Triton extend kernel
        # whatever OSCAR_NEW_TOKEN_ATTENTION says (FlashInfer's plan is host-side: no CUDA graph)
        self._verify_new_tokens = TritonNewTokens(self.extend_attention_fwd, self._zero_kv_indptr)
        self._verify_bufs = None  # (rows, seq_lens) per draft token, static for CUDA graphs
        if self.num_draft_tokens:  # speculative decoding is on
            from sglang.srt.runtime_context import get_spec

            from .draft_rollback import activate
            from .hooks import check_accept_hook

            alg = get_spec().speculative_algorithm  # a name or SGLang's SpeculativeAlgorithm enum
            check_accept_hook(str(getattr(alg, "name", None) or alg or ""))
            activate(self.pool.enable_draft_rollback(int(self.num_draft_tokens)))
        if not _WARMED_UP["done"] and getattr(model_runner, "model", None) is not None:
            self.warm_up(model_runner.model, getattr(model_runner, "dtype", torch.bfloat16))
            _WARMED_UP["done"] = True
        self.int2_md = _DECODE_MD

    def _decode_store(self) -> bool:
        """OSCAR_DECODE_STORE: True where a decode step's store is one launch that rotates q and k."""
        from .config import load_config
        from .state import RUNTIME_INFO

        choice = load_config().decode_store
        fusable = self.pool.layout.fused_decode_store
        if choice == "fused" and not fusable:
            raise ValueError("OSCAR_DECODE_STORE=fused needs a per-channel key format (the per-token "
                             "recipe's store has no fused form); unset it or pick OSCAR_KV_FORMAT")
        RUNTIME_INFO["decode_store"] = choice
        if fusable:
            logger.info("OSCAR INT2: a decode step stores %s (OSCAR_DECODE_STORE)",
                        "in one launch that also rotates q and k" if choice == "fused"
                        else "after the rotation GEMMs (one for q and k at batch 1 where they share "
                             "the qkv buffer), in two launches")
        return choice == "fused"

    def _prefill_reads(self) -> bool:
        """OSCAR_PREFILL_READS: True where prefill is page-canonical (_prepare_canonical)."""
        from .config import load_config
        from .state import RUNTIME_INFO

        choice = load_config().prefill_reads
        if choice == "cache" and not self.pool.layout.dequantises_prefix:
            raise ValueError("OSCAR_PREFILL_READS=cache needs a per-channel key format (the per-token "
                             "recipe cannot read a request's pages back); unset it or pick OSCAR_KV_FORMAT")
        RUNTIME_INFO["prefill_reads"] = choice
        logger.info("OSCAR INT2: a prompt reads its own earlier positions %s (OSCAR_PREFILL_READS=%s)",
                    "as the cache stores them, complete pages quantised: a cache hit reads the same"
                    if choice == "cache" else "in BF16 as computed; a cache hit reads its prefix as stored",
                    choice)
        return choice == "cache"

    def _make_new_token_attention(self, model_runner):
        """The kernel for attention among an extend's new tokens (OSCAR_NEW_TOKEN_ATTENTION)."""
        from .config import load_config
        from .state import RUNTIME_INFO

        choice = load_config().new_token_attention
        if choice == "triton":
            impl = TritonNewTokens(self.extend_attention_fwd, self._zero_kv_indptr)
        else:
            impl = FlashInferNewTokens(
                device=self.device,
                num_qo_heads=self.num_head,      # this rank's heads (TritonAttnBackend's counts)
                num_kv_heads=self.pool.head_num,
                head_dim=self.pool.head_dim,
                v_head_dim=self.pool.v_head_dim,
                dtype=getattr(model_runner, "dtype", torch.bfloat16),
                workspace_bytes=workspace_bytes(),
            )
        RUNTIME_INFO["new_token_attention"] = impl.name
        logger.info("OSCAR INT2: an extend's new tokens attend with %s (OSCAR_NEW_TOKEN_ATTENTION)",
                    "FlashInfer's ragged prefill" if impl.name == "flashinfer" else "SGLang's Triton extend kernel")
        return impl

    def _make_prefix_attention(self, model_runner):
        """None (the INT2-aware prefix kernel) or FlashInferPrefix (OSCAR_PREFIX_ATTENTION)."""
        from .config import load_config
        from .state import RUNTIME_INFO

        cfg = load_config()
        choice = cfg.resolved_prefix_attention(self.pool.layout.dequantises_prefix)
        RUNTIME_INFO["prefix_attention"] = choice
        if choice == "int2":
            return None
        if not self.pool.layout.dequantises_prefix:
            raise RuntimeError("OSCAR_PREFIX_ATTENTION=flashinfer reads per-channel key formats only; "
                               "with OSCAR_KV_FORMAT=token leave OSCAR_PREFIX_ATTENTION unset or set it to int2")
        ws = getattr(self._new_tokens, "workspace", None)  # one FlashInfer workspace serves both
        if ws is None:
            ws = torch.empty(workspace_bytes(), dtype=torch.uint8, device=self.device)
        logger.info("OSCAR INT2: a prefill chunk reads its cached prefix as BF16 pieces through "
                    "FlashInfer's prefill (OSCAR_PREFIX_ATTENTION=flashinfer%s)",
                    "" if cfg.prefix_attention else ", the default")
        return FlashInferPrefix(workspace=ws, num_qo_heads=self.num_head, num_kv_heads=self.pool.head_num,
                                head_dim=self.pool.head_dim, v_head_dim=self.pool.v_head_dim,
                                dtype=getattr(model_runner, "dtype", torch.bfloat16),
                                block=self.pool.kv_format.k_group)

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if getattr(mode, "is_draft_extend_v2", lambda: False)() or getattr(mode, "is_draft_extend", lambda: False)():
            raise RuntimeError("oscar_triton: draft-model forwards run on the draft's own BF16 pool "
                               "(--speculative-draft-attention-backend triton), not on the INT2 pool")
        compile_watch.start()
        super().init_forward_metadata(forward_batch)
        self._prepare_forward(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        # CUDA-graph capture / replay (decode, speculative verify): eager, before the graph runs.
        if not in_capture:
            compile_watch.start()
        super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        self._prepare_forward(forward_batch, graph=True)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
        super().init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
        # a verify graph's store reads each draft's request row and final length from these
        # (filled eagerly before each replay by _prepare_verify)
        self._verify_bufs = (torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device),
                             torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device))

    def _fill_kv_indptr_and_indices(self, bs, seq_lens, req_pool_indices, kv_indices):
        """TritonAttnBackend's kv_indptr / kv_indices fill (decode steps, CUDA-graph buffers,
        extend prefixes), the same table, but filled by ops.fill_kv_indices: SGLang's kernel runs
        one program a request, 141.8 us of every decode step at 1 x 128K on the H100 (outside the
        graph). parent_fill_problem() checks at start that the parent still has this method."""
        kv_indptr = self.kv_indptr[: bs + 1]
        kv_indptr[1:] = torch.cumsum(seq_lens[:bs], dim=0)
        ops.fill_kv_indices(self.req_to_token, req_pool_indices[:bs], seq_lens[:bs], kv_indptr, kv_indices)
        return kv_indptr

    def _prepare_forward(self, fb, graph: bool = False) -> None:
        """Eager per-forward bookkeeping on the forward stream, before any layer runs."""
        # rows handed out since the last forward trust no side buffer yet, except the sink the
        # store gives a cached prefix
        self.pool.apply_pending_resets(getattr(self, "req_to_token", None))
        mode = fb.forward_mode
        if getattr(mode, "is_target_verify", bool)():  # (is_extend() is true for it too)
            self.int2_md = self._prepare_verify(fb, graph)
        else:
            self.int2_md = self._prepare_extend(fb) if mode.is_extend() else _DECODE_MD

    def _prepare_verify(self, fb, graph: bool) -> Int2ForwardMetadata:
        """A verify of N drafts a request at positions L .. L+N-1 (L = fb.seq_lens, the verified
        length; fb.positions): each draft's row and final length L + N for the store (in static
        buffers under CUDA graphs) and the Triton new-token kernel's plan. The ring entries the
        store will overwrite are saved by the first layer's forward_extend, not here: SGLang's
        EAGLE worker prepares a verify's metadata on a stream of its own, which may run before the
        forward stream has rolled back the previous step's rejected drafts."""
        spec = getattr(fb, "spec_info", None)
        n = int(getattr(spec, "draft_token_num", None) or self.num_draft_tokens)
        rows = fb.req_pool_indices.to(torch.int64).repeat_interleave(n)
        lens = (fb.seq_lens.to(torch.int64) + n).repeat_interleave(n)
        if graph and self._verify_bufs is not None and rows.shape[0] <= self._verify_bufs[0].shape[0]:
            t = rows.shape[0]
            rows = self._verify_bufs[0][:t].copy_(rows)
            lens = self._verify_bufs[1][:t].copy_(lens)
        md = self.forward_metadata
        self._verify_new_tokens.plan(md.qo_indptr, None, n)
        if self.pool.drafts is None:
            raise RuntimeError("oscar_triton: a speculative verify without the draft rollback buffers "
                               "(speculative decoding was not configured when the backend started)")
        # prefix lengths are device-only here: let the prefix kernel plan its splits for the
        # longest context a request may have (chunks follow each request's own length)
        return Int2ForwardMetadata(token_rows=rows, token_seq_lens=lens, verify=n,
                                   max_prefix=int(self.max_context_len))

    def _prepare_extend(self, fb) -> Int2ForwardMetadata:
        """Per-token request row and final length (for the store), own_start update, the plans of
        the new tokens' attention and of the FlashInfer prefix path."""
        n = fb.out_cache_loc.shape[0] if fb.out_cache_loc is not None else int(fb.extend_seq_lens.sum())
        lens = fb.extend_seq_lens
        imd = Int2ForwardMetadata(
            token_rows=torch.repeat_interleave(fb.req_pool_indices, lens, output_size=n),
            token_seq_lens=torch.repeat_interleave(fb.seq_lens, lens, output_size=n))
        self.pool.note_extend(fb.req_pool_indices, fb.extend_prefix_lens)
        if self._canonical_prefill and getattr(self, "req_to_token", None) is not None:
            imd.canonical = self._prepare_canonical(fb)
        md = self.forward_metadata
        self._new_tokens.plan(md.qo_indptr, getattr(fb, "extend_seq_lens_cpu", None), md.max_extend_len)
        cpu = fb.extend_prefix_lens_cpu
        imd.has_prefix = True if cpu is None else any(int(x) > 0 for x in cpu)
        if getattr(self, "_prefix_fi", None) is not None and imd.has_prefix:
            ext = getattr(fb, "extend_seq_lens_cpu", None)
            ext = fb.extend_seq_lens.tolist() if ext is None else ext
            pre = fb.extend_prefix_lens.tolist() if cpu is None else cpu
            imd.use_prefix_fi = prefix_worth_flashinfer(ext, pre)
            if imd.use_prefix_fi:
                self._prefix_fi.plan(ext, pre, md.qo_indptr.device)
        # the longest cached prefix, host-side: lets the per-channel prefix kernel split long
        # prefixes when its grid is small (None: unknown, never split)
        imd.max_prefix = None if cpu is None else max((int(x) for x in cpu), default=0)
        return imd

    def _prepare_canonical(self, fb) -> CanonicalExtend | None:
        """Page-canonical prefill (OSCAR_PREFILL_READS=cache; the default `exact` skips this):
        what an extend reads must not depend on how its prefix reached the cache. A cold prefill
        computes its whole prompt, a radix / host hit of P tokens (always
        whole pages) reads [0, P) from the INT2 pages, so both read every position in a complete
        page as the cache holds it (quantised; the sink in BF16) and only the positions of the last,
        incomplete page in BF16: for a request of length L, own_start = C = L // page * page (its
        ring copies are trusted from C on, by this extend's prefix reader, which then reads no ring
        entry, and by the decode steps after it), and its new tokens of [P, C) are stored before
        attention and read back dequantised. The answer is then the same whichever way [0, P)
        arrived, up to rounding (bench/path_invariance.py measures it); the scheduler gives a
        cold prompt's tail its own forward (runtime/prefill_split.py), so a hit of the prompt's
        complete pages repeats that forward and does not even round differently.

        Only requests whose extend starts on a page boundary (radix hits and prefill chunks are
        page-aligned in SGLang; a decode-like request of a mixed-chunk batch is not): the others
        read their own previous chunk's incomplete page from the ring, which a store before
        attention could overwrite, so they store after attention and keep BF16 among their new
        tokens. Layouts that cannot dequantise a request's pages (the per-token recipe) are not
        canonical. Host-known lengths only (no device synchronisation)."""
        pre_cpu, ext_cpu = fb.extend_prefix_lens_cpu, getattr(fb, "extend_seq_lens_cpu", None)
        if not self.pool.layout.dequantises_prefix or pre_cpu is None or ext_cpu is None:
            return None
        page = int(self.pool.page_size)
        pre_cpu, ext_cpu = [int(x) for x in pre_cpu], [int(x) for x in ext_cpu]
        flags = [p % page == 0 for p in pre_cpu]
        if not any(flags):
            return None
        dev = fb.seq_lens.device
        canon = to_device(flags, torch.bool, dev)
        seq = fb.seq_lens.to(torch.int64)
        pre = fb.extend_prefix_lens.to(torch.int64)
        complete = seq // page * page
        rows = fb.req_pool_indices.to(torch.int64)
        own = self.pool.own_start
        own.index_copy_(0, rows, torch.where(canon, complete, own.index_select(0, rows).to(torch.int64)).to(own.dtype))
        n_cpu = [((p + e) // page * page - p) if f else 0 for p, e, f in zip(pre_cpu, ext_cpu, flags)]
        total = sum(n_cpu)
        B = len(flags)
        kv_indptr = kv_indices = out_indptr = None
        new_rows = torch.zeros(0, dtype=torch.int64, device=dev)
        if total:  # some new tokens complete a page: where to read them back from
            n_b = torch.where(canon, (complete - pre).clamp_min(0), 0)
            kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
            lens = torch.where(canon, seq, 0)
            kv_indptr[1:] = torch.cumsum(lens, 0)
            kv_indices = torch.empty(sum(p + e for p, e, f in zip(pre_cpu, ext_cpu, flags) if f),
                                     dtype=torch.int32, device=dev)
            ops.fill_kv_indices(self.req_to_token, fb.req_pool_indices, lens, kv_indptr, kv_indices)
            out_indptr = torch.zeros(B + 1, dtype=torch.int64, device=dev)
            out_indptr[1:] = torch.cumsum(n_b, 0)
            qo = self.forward_metadata.qo_indptr[:B].to(torch.int64)
            j = torch.arange(total, device=dev)
            new_rows = (torch.repeat_interleave(qo, n_b, output_size=total)
                        + j - torch.repeat_interleave(out_indptr[:B], n_b, output_size=total))
        first_tokens = after_tokens = None
        if not all(flags):  # a mixed batch: which new tokens are stored before attention, which after
            starts = [0]
            for e in ext_cpu:
                starts.append(starts[-1] + e)
            pick = lambda want: to_device(torch.cat([torch.arange(starts[b], starts[b + 1])  # noqa: E731
                                                     for b in range(B) if flags[b] == want]
                                                    + [torch.zeros(0, dtype=torch.int64)]), torch.int64, dev)
            first_tokens, after_tokens = pick(True), pick(False)
        return CanonicalExtend(first_tokens=first_tokens, after_tokens=after_tokens, kv_indptr=kv_indptr,
                               kv_indices=kv_indices, first=pre.to(torch.int32), out_indptr=out_indptr,
                               rows=new_rows, max_len=max(n_cpu))

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, model, dtype: torch.dtype) -> None:
        """Compile the prefill kernels at start: the cached-prefix path (the INT2 prefix kernel,
        the new tokens' kernel returning LSE, the merge) and the path without a prefix. SGLang's
        own start-up request has no cached prefix, so the former used to compile on the first
        prompt longer than one prefill chunk: its TTFT on the H100 was 6.99 s fresh vs 1.90 s warm
        at 32K. Decode needs nothing here: CUDA-graph capture compiles it. Runs forward_extend
        twice, reading padding slot 0 / row 0 and storing nothing, then the kv_indices fill for a
        prefill's prefix lengths (_warm_up_kv_indices_fill); a failure stops the start (better
        than failing a user's request)."""
        from .absorb import attention_modules

        layer = next((m.attn for m in attention_modules(model)
                      if m.attn.layer_id == self.pool.start_layer), None)
        if layer is None:
            logger.warning("OSCAR INT2: no attention layer found to warm the prefill kernels up; "
                           "they compile on the first long prompt")
            return
        t0 = time.perf_counter()
        dev = self.pool.device
        T = P = 16
        Hq, H, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        md = SimpleNamespace(
            qo_indptr=torch.tensor([0, T], dtype=torch.int64, device=dev),
            kv_indptr=torch.tensor([0, P], dtype=torch.int32, device=dev),
            kv_indices=torch.zeros(P, dtype=torch.int64, device=dev),  # slot 0: padding
            max_extend_len=T,
        )
        fb = SimpleNamespace(batch_size=1, req_pool_indices=torch.zeros(1, dtype=torch.int64, device=dev))
        saved = (getattr(self, "forward_metadata", None), getattr(self, "int2_md", None))
        self.forward_metadata = md
        try:
            q = torch.zeros(T, Hq * D, dtype=dtype, device=dev)
            k = torch.zeros(T, H * D, dtype=dtype, device=dev)
            v = torch.zeros(T, H * Dv, dtype=dtype, device=dev)
            self._new_tokens.plan(md.qo_indptr, [T], T)
            if getattr(self, "_prefix_fi", None) is not None:
                self._prefix_fi.plan([T], [P], dev)
            # the outputs are not checked: they read whatever padding slot 0 / row 0 hold. With
            # FlashInfer for the prefix, the INT2 prefix kernel still serves the forwards that
            # prefix_worth_flashinfer turns down: compile both.
            paths = [(True, False), (False, False)]
            if getattr(self, "_prefix_fi", None) is not None:
                paths.insert(0, (True, True))
            for has_prefix, use_fi in paths:
                self.int2_md = Int2ForwardMetadata(has_prefix=has_prefix, use_prefix_fi=use_fi)
                self.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
            self._warm_up_kv_indices_fill(dev)
            if torch.device(dev).type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:
            hint = ("FlashInfer's JIT (OSCAR_NEW_TOKEN_ATTENTION=flashinfer, the default) needs nvcc "
                    "and the CUDA headers (nvidia-cuda-cccl); OSCAR_NEW_TOKEN_ATTENTION=triton avoids it"
                    if self._new_tokens.name == "flashinfer" else "the Triton kernels did not compile")
            raise RuntimeError(
                f"OSCAR INT2: compiling the prefill kernels at start failed ({type(e).__name__}: {e}); {hint}"
            ) from e
        finally:
            self.forward_metadata, self.int2_md = saved
        logger.info("OSCAR INT2: prefill kernels compiled at start (%.1f s)", time.perf_counter() - t0)

    def _warm_up_kv_indices_fill(self, dev) -> None:
        """Compile the kv_indices fill for both length dtypes SGLang hands it: int64 seq_lens
        (decode steps; also compiled by CUDA-graph capture) and int32 extend_prefix_lens (a prefill
        over cached tokens), else the first long prompt compiled it (134.9 ms on a bare H200,
        compile_watch, bench/results/serving_vs_fp8_h200_2026-11-27_1543_kv-indices-fill.json).
        Reads request row 0 into a scratch table."""
        req_to_token = getattr(self, "req_to_token", None)
        if req_to_token is None:
            return
        n = min(16, req_to_token.shape[1])
        indptr = torch.tensor([0, n], dtype=torch.int32, device=dev)
        rows = torch.zeros(1, dtype=torch.int64, device=dev)
        for len_dtype in (torch.int64, torch.int32):
            ops.fill_kv_indices(req_to_token, rows, torch.full((1,), n, dtype=len_dtype, device=dev),
                                indptr, torch.empty(n, dtype=torch.int64, device=dev))

    # ------------------------------------------------------------------ rotations
    def _prepare_rotations(self, dtype: torch.dtype) -> None:
        """Per local layer, the rotations in the form the hot path uses: K and V in the model's
        dtype (one GEMM with fp32 accumulation, no fp32 copies of q / k / v), as a single [D, D]
        matrix where every KV head shares it (the pool's broadcast view has stride 0 over heads);
        V^T in float32 for the float32 attention output. V is None where the weights absorbed it."""

        def lowp(R):
            if R is None:
                return None
            return (R[0] if R.stride(0) == 0 else R).to(dtype).contiguous()

        def transposed(R):
            if R is None:
                return None
            return (R[0] if R.stride(0) == 0 else R).transpose(-1, -2).float().contiguous()

        self._k_rot = [lowp(R) for R in self.pool.k_rot]
        self._v_rot = [lowp(R) for R in self.pool.v_rot]
        self._v_unrot = [transposed(R) for R in self.pool.v_rot]

    @staticmethod
    def _apply(x3: torch.Tensor, R: torch.Tensor | None) -> torch.Tensor:
        """x [T, Hx, D] -> x @ R[kv head of each of the Hx heads] (R [D, D] shared or [H, D, D])."""
        if R is None:
            return x3
        T, Hx, D = x3.shape
        if R.dim() == 2:
            return (x3.reshape(T * Hx, D) @ R).view(T, Hx, R.shape[-1])
        H = R.shape[0]
        return torch.einsum("thgd,hde->thge", x3.reshape(T, H, Hx // H, D), R).reshape(T, Hx, R.shape[-1])

    def _rot_q(self, q3: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q [T, Hq, D] -> q @ R_k[kv head of each q head] (same dtype)."""
        R = self._k_rot[self.pool.local(layer_id)]
        return self._apply(q3, None if R is None else R.to(q3.dtype))

    def _rot_qk_joint(self, q3: torch.Tensor, k3: torch.Tensor, layer_id: int):
        """(q @ R_k, k @ R_k) by one GEMM, or None where it does not apply. It applies to one
        token (a decode step of one request) whose k heads follow its q heads in one buffer, as
        SGLang's fused qkv_proj leaves them, with one R_k for every KV head (the data-free
        rotation): the [Hq + H, D] rows are then a plain matrix. At batch 1 each rotation GEMM is
        a ~2-2.5 us launch (H200 profile, 2026-11-27): one of the two a layer goes."""
        R = self._k_rot[self.pool.local(layer_id)]
        if R is None or R.dim() != 2 or q3.shape[0] != 1 or k3.shape[0] != 1:
            return None
        _, Hq, D = q3.shape
        H = k3.shape[1]
        adjacent = (k3.dtype == q3.dtype and k3.shape[2] == D and q3.stride()[1:] == (D, 1)
                    and k3.stride()[1:] == (D, 1) and k3.data_ptr() == q3.data_ptr() + Hq * D * q3.element_size())
        if not self._joint_logged:  # once: which form a one-request decode step takes
            self._joint_logged = True
            logger.info("OSCAR INT2: a one-request decode step rotates q and k %s",
                        "with one GEMM (k's heads follow q's in the model's qkv buffer)" if adjacent
                        else "with two GEMMs (q and k are not adjacent in one buffer)")
        if not adjacent:
            return None
        y = q3.as_strided((Hq + H, D), (D, 1)) @ R.to(q3.dtype)  # q's heads then k's, one matrix
        return y[:Hq].view(1, Hq, D), y[Hq:].view(1, H, D)

    def _rot_v(self, v3: torch.Tensor, layer_id: int) -> torch.Tensor:
        """v [T, H, Dv] -> v @ R_v (same dtype; v itself where the weights absorbed R_v)."""
        Rv = self._v_rot[self.pool.local(layer_id)]
        return self._apply(v3, None if Rv is None else Rv.to(v3.dtype))

    def _rot_kv(self, k3: torch.Tensor, v3: torch.Tensor, layer_id: int):
        Rk = self._k_rot[self.pool.local(layer_id)]
        return self._apply(k3, None if Rk is None else Rk.to(k3.dtype)), self._rot_v(v3, layer_id)

    def _unrot_o(self, o3: torch.Tensor, layer_id: int) -> torch.Tensor:
        """o [T, Hq, Dv] float32 in the rotated V space -> o @ R_v^T, float32 (unchanged where
        the model's o_proj absorbed R_v)."""
        return self._apply(o3.float(), self._v_unrot[self.pool.local(layer_id)])

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check(layer, k, v, sinks, score_mod) -> None:
        if k is None or v is None:
            raise NotImplementedError("oscar_triton: layers that reuse another layer's KV are not supported")
        # FP8 weights give every layer unit KV scales (refusals.kv_scale_problems refuses others at
        # start-up); k / v arrive unscaled either way, so unit scales need nothing here
        if (layer.k_scale is not None or layer.v_scale is not None) and (
                getattr(layer, "k_scale_float", None) != 1.0 or getattr(layer, "v_scale_float", None) != 1.0):
            raise NotImplementedError("oscar_triton: FP8 KV scales other than 1.0 (k_scale/v_scale) are "
                                      "not supported; serve with --kv-cache-dtype fp8_e4m3")
        if sinks is not None or score_mod is not None:
            raise NotImplementedError("oscar_triton: attention sinks / score_mod are not supported")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError("oscar_triton: sliding-window layers are not supported")

    def _store(self, layer, fb, k3, v3, rows, seq_lens, q3=None, joint_q3=None):
        """Rotate and store the new tokens. q3 (a decode step with OSCAR_DECODE_STORE=fused): one
        store launch rotates k and q itself (no GEMM launches) and quantises the completed blocks
        (one token a request); returns q @ R_k then (q3 itself without a K rotation). joint_q3 (a
        decode step with the split store): rotated with k by one GEMM where _rot_qk_joint applies,
        and returned; otherwise None is returned (the caller rotates q)."""
        Rk = self._k_rot[self.pool.local(layer.layer_id)]
        if q3 is not None:
            v_r = self._rot_v(v3, layer.layer_id)
            rot = {}
            if Rk is not None:
                rot = dict(rot_k=Rk.to(k3.dtype), q=q3, q_out=torch.empty(q3.shape, dtype=q3.dtype, device=q3.device))
            self.pool.store(layer.layer_id, fb.out_cache_loc, k3, v_r, fb.positions, rows, seq_lens,
                            one_token_per_request=True, **rot)
            return rot.get("q_out", q3)
        joint = None if joint_q3 is None else self._rot_qk_joint(joint_q3, k3, layer.layer_id)
        if joint is not None:
            q_r, k_r = joint
            v_r = self._rot_v(v3, layer.layer_id)
        else:
            q_r = None
            k_r, v_r = self._rot_kv(k3, v3, layer.layer_id)
        self.pool.store(layer.layer_id, fb.out_cache_loc, k_r, v_r, fb.positions, rows, seq_lens)
        return q_r

    def _cached_kv_args(self, layer, fb) -> dict:
        """Arguments the INT2-aware decode and prefix kernels share: this layer's pool buffers,
        the position-ordered slots of each request, its row and own_start, formats, scale."""
        md = self.forward_metadata
        return dict(
            **self.pool.layer_buffers(layer.layer_id),
            kv_indptr=md.kv_indptr,
            kv_indices=md.kv_indices,
            req_rows=fb.req_pool_indices,
            own_start=self.pool.own_start,
            sink_start=self.pool.sink_start,
            **self.pool.kernel_format_args(layer.layer_id),
            sm_scale=layer.scaling,
        )

    # ------------------------------------------------------------------ forward
    def _wait_for_layer(self, layer) -> None:
        """HiCache loads pages host -> device layer by layer on its own stream; the forward waits
        for this layer's before reading it (what SGLang's MHA pool does in get_key_buffer). No
        counter (no HiCache) or no load in flight: nothing."""
        counter = self.pool.layer_transfer_counter
        if counter is not None:
            counter.wait_until(layer.layer_id - self.pool.start_layer)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None,
                       score_mod=None, aux_tensors=None):
        self._check(layer, k, v, sinks, score_mod)
        self._wait_for_layer(layer)
        fb = forward_batch
        Hq, H = layer.tp_q_head_num, layer.tp_k_head_num
        D, Dv = layer.qk_head_dim, layer.v_head_dim
        q3 = q.reshape(-1, Hq, D)
        B = q3.shape[0]
        q_rot = None
        if save_kv_cache:  # write first: the new token is read back from the BF16 ring
            q_rot = self._store(layer, fb, k.reshape(-1, H, D), v.reshape(-1, H, Dv), fb.req_pool_indices,
                                fb.seq_lens, q3=q3 if self._fused_store else None,
                                joint_q3=None if self._fused_store else q3)
        md = self.forward_metadata
        # where o_proj absorbed R_v the per-channel merge writes the model's dtype itself (no
        # float32 output and no cast kernel per layer)
        layout = self.pool.layout
        direct = layout.decode_writes_model_dtype and self._v_unrot[self.pool.local(layer.layer_id)] is None
        o = torch.empty((B, Hq, Dv), dtype=q.dtype if direct else torch.float32, device=q.device)
        layout.decode(
            q_rot if q_rot is not None else self._rot_q(q3, layer.layer_id),
            o,
            **self._cached_kv_args(layer, fb),
            **self._decode_splits(B, Hq, Dv, md),
            logit_cap=logit_capping_mod(layer.logit_capping_method, layer.logit_cap),
        )
        if direct:
            return o.reshape(B, Hq * Dv)
        return self._unrot_o(o, layer.layer_id).to(q.dtype).reshape(B, Hq * Dv)

    def _decode_splits(self, B: int, Hq: int, Dv: int, md) -> dict:
        """Split plan and scratch of a decode batch of B requests: the layout's (SGLang's split
        counts for per-token groups, the kernel's own plan for per-channel keys; layouts.py)."""
        return self.pool.layout.decode_splits(self, B, md)

    def _wide_split_scratch(self, Hq: int, Dv: int, device):
        """Split scratch of the backend's own for the batches whose plan exceeds SGLang's scratch
        (--triton-attention-num-kv-splits, which the plugin raises to 64): with 8 KV heads on an
        H100, batch 1 plans 128 splits and batch 2 68. SGLang sizes its scratch for every row of
        a graph ([rows, Hq, splits, Dv] fp32: 0.5 GB at 512 rows and 64 splits), so these batches
        get [2, Hq, 128, Dv] (4 MB) here instead, allocated at start (the same tensors in every
        CUDA graph). None where the user set --triton-attention-num-kv-splits to another value
        (it caps the plan) or no batch needs more."""
        from .hooks import INT2_DEFAULT_KV_SPLITS

        pool = self.pool
        if not pool.layout.plans_decode_splits or self.max_kv_splits != INT2_DEFAULT_KV_SPLITS:
            return None
        plan = lambda b: ops.decode_splits_channel(b, pool.head_num, pool.sink, pool.recent, device)  # noqa: E731
        rows = 0
        while plan(rows + 1) > self.max_kv_splits:
            rows += 1
        if not rows:
            return None
        wide = (torch.empty(rows, Hq, plan(1), Dv, dtype=torch.float32, device=device),
                torch.empty(rows, Hq, plan(1), dtype=torch.float32, device=device))
        logger.info("OSCAR INT2: decode batches of up to %d request(s) use up to %d KV splits (a split "
                    "scratch of %.1f MB beside SGLang's %d-split one)", rows, plan(1),
                    wide[0].numel() * 4 / 2**20, self.max_kv_splits)
        return wide

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None,
                       score_mod=None, aux_tensors=None):
        self._check(layer, k, v, sinks, score_mod)
        self._wait_for_layer(layer)
        fb = forward_batch
        Hq, H = layer.tp_q_head_num, layer.tp_k_head_num
        D, Dv = layer.qk_head_dim, layer.v_head_dim
        q3 = q.reshape(-1, Hq, D)
        k3 = k.reshape(-1, H, D).contiguous()
        v3 = v.reshape(-1, H, Dv).contiguous()
        T = q3.shape[0]
        cap = logit_capping_mod(layer.logit_capping_method, layer.logit_cap)

        imd = self.int2_md
        canonical = imd.canonical if save_kv_cache and not imd.verify else None
        k_r = v_r = None
        if imd.verify:
            if layer.layer_id == self.pool.start_layer:  # once a forward, for every layer, in order
                # on the forward stream (inside the CUDA graph): after the previous step's rollback
                self.pool.drafts.save(fb.req_pool_indices, fb.seq_lens, imd.verify)
            # drafts over the INT2 prefix (sink, body, ring as of L) + causal among themselves
            o = self._extend_prefix_int2(q3, k3, v3, layer, fb, imd, cap, self._verify_new_tokens)
        elif canonical is not None:
            o, k_r, v_r = self._extend_canonical(q3, k3, v3, layer, fb, imd, cap, canonical)
        elif not imd.has_prefix:
            # nothing cached yet: the new tokens' attention is the whole answer
            o, _ = self._new_tokens.run(q3, k3, v3, layer, layer.logit_cap, want_lse=False)
        elif imd.use_prefix_fi:
            o = self._extend_prefix_flashinfer(q3, k3, v3, layer, fb)
        else:
            o = self._extend_prefix_int2(q3, k3, v3, layer, fb, imd, cap)

        if not imd.verify and debug_tap.enabled(layer.layer_id):  # off unless OSCAR_DEBUG_TAP_DIR is set
            debug_tap.record_extend(self, layer, fb, q3, k3, v3, o)
        if canonical is not None:  # the requests that are not page-canonical store after attention
            if canonical.after_tokens is not None:
                self._store_rotated(layer, fb, k_r, v_r, imd, canonical.after_tokens)
        elif save_kv_cache:  # after attention: the prefix reader saw the previous chunk's ring
            self._store(layer, fb, k3, v3, imd.token_rows, imd.token_seq_lens)
        return o.reshape(T, Hq * Dv)

    def _store_rotated(self, layer, fb, k_r, v_r, imd, sel: torch.Tensor | None) -> None:
        """Store rotated k / v of the new tokens `sel` (None: all) of an extend."""
        loc, pos, rows, lens = fb.out_cache_loc, fb.positions, imd.token_rows, imd.token_seq_lens
        if sel is not None:
            k_r, v_r, loc, pos, rows, lens = (x.index_select(0, sel) for x in (k_r, v_r, loc, pos, rows, lens))
        self.pool.store(layer.layer_id, loc, k_r, v_r, pos, rows, lens)

    def _extend_canonical(self, q3, k3, v3, layer, fb, imd, cap, canon: CanonicalExtend):
        """A page-canonical extend (_prepare_canonical): the canonical requests' new tokens stored
        first, their positions in complete pages read back dequantised (ops.dequant_prefix_channel,
        what the prefix readers see of a page), attention among the new tokens over those values
        in the rotated space, merged with the prefix as usual. -> (o, k_r, v_r)."""
        lid = layer.layer_id
        k_r, v_r = self._rot_kv(k3, v3, lid)
        self._store_rotated(layer, fb, k_r, v_r, imd, canon.first_tokens)
        k_m, v_m = k_r, v_r
        n = canon.rows.shape[0]
        if n:
            # the read-back overwrites rows: in place where the rotation made new tensors, on a
            # copy where k_r / v_r are the model's k / v (no rotation, or R_v in the weights)
            k_m = k_r.clone() if k_r.data_ptr() == k3.data_ptr() else k_r
            v_m = v_r.clone() if v_r.data_ptr() == v3.data_ptr() else v_r
            bufs = self.pool.layer_buffers(lid)
            fmt = self.pool.kernel_format_args(lid)
            out_k = k_r.new_empty((n, *k_r.shape[1:]))
            out_v = v_r.new_empty((n, *v_r.shape[1:]))
            ops.dequant_prefix_channel(
                bufs["k_codes"], bufs["k_params"], bufs["v_codes"], bufs["v_params"], bufs["sink_k"],
                bufs["sink_v"], bufs["ring_k"], bufs["ring_v"], canon.kv_indptr, canon.kv_indices,
                fb.req_pool_indices, self.pool.own_start, canon.first, canon.out_indptr, out_k, out_v,
                k_bits=fmt["k_bits"], k_block=fmt["k_block"], v_group=fmt["v_group"],
                max_piece_len=canon.max_len, sink_start=self.pool.sink_start)
            k_m.index_copy_(0, canon.rows, out_k)
            v_m.index_copy_(0, canon.rows, out_v)
        q_r = self._rot_q(q3, lid)
        rotated_v = self._v_unrot[self.pool.local(lid)] is not None
        if not imd.has_prefix:
            o, _ = self._new_tokens.run(q_r, k_m, v_m, layer, layer.logit_cap, want_lse=False)
            return (self._unrot_o(o, lid).to(q3.dtype) if rotated_v else o), k_r, v_r
        o_new, lse_new = self._new_tokens.run(q_r, k_m, v_m, layer, layer.logit_cap, want_lse=True)
        new = (self._unrot_o(o_new, lid), lse_new, self._new_tokens.lse_base2)
        if imd.use_prefix_fi:
            return self._extend_prefix_flashinfer(q3, k3, v3, layer, fb, new, q_rot=q_r), k_r, v_r
        return self._extend_prefix_int2(q3, k3, v3, layer, fb, imd, cap, new=new, q_rot=q_r), k_r, v_r

    def _extend_prefix_int2(self, q3, k3, v3, layer, fb, imd, cap, new_tokens=None, new=None, q_rot=None):
        """New tokens (LSE out; `new` = (o, lse, lse in base 2) where already computed) + the
        prefix read in place by the INT2-aware prefix kernel (q_rot: q @ R_k where already
        computed), merged by LSE into the model's dtype."""
        md = self.forward_metadata
        new_tokens = new_tokens or self._new_tokens
        if new is None:
            o_new, lse_new = new_tokens.run(q3, k3, v3, layer, layer.logit_cap, want_lse=True)
            new = (o_new, lse_new, new_tokens.lse_base2)
        o_new, lse_new, lse_new_base2 = new
        o_pre, lse_pre = self.pool.layout.extend_prefix(
            self._rot_q(q3, layer.layer_id) if q_rot is None else q_rot,
            md.qo_indptr,
            **self._cached_kv_args(layer, fb),
            max_len_extend=md.max_extend_len,
            logit_cap=cap,
            max_len_prefix=imd.max_prefix,
            extend_lens=None if imd.verify else getattr(fb, "extend_seq_lens_cpu", None),
        )
        o_pre = self._unrot_o(o_pre, layer.layer_id)
        return ops.merge_attention_states(o_pre, lse_pre, o_new, lse_new,
                                          lse_b_base2=lse_new_base2, out_dtype=q3.dtype)

    def _extend_prefix_flashinfer(self, q3, k3, v3, layer, fb, new=None, q_rot=None):
        """New tokens (`new` and q_rot as in _extend_prefix_int2) + the prefix as BF16 pieces
        through FlashInfer (OSCAR_PREFIX_ATTENTION), merged piece by piece; the last merge writes
        the model's dtype."""
        if new is None:
            o, lse = self._new_tokens.run(q3, k3, v3, layer, layer.logit_cap, want_lse=True)
            new = (o, lse, self._new_tokens.lse_base2)
        o, lse, base2 = new
        local = self.pool.local(layer.layer_id)
        soft_cap = layer.logit_cap if layer.logit_cap and layer.logit_cap > 0 else None
        pieces = self._prefix_fi.pieces
        q_rot = self._rot_q(q3, layer.layer_id) if q_rot is None else q_rot
        parts = self._prefix_fi.run(q_rot, layer, self._cached_kv_args(layer, fb),
                                    soft_cap)
        for i, (o_p, lse_p) in enumerate(parts):
            if self._v_unrot[local] is not None:
                o_p = self._unrot_o(o_p, layer.layer_id)
            last = i == len(pieces) - 1
            lse_m = None if last else torch.empty_like(lse, dtype=torch.float32)
            o = ops.merge_attention_states(o, lse, o_p, lse_p, lse_a_base2=base2, lse_b_base2=True,
                                           out_dtype=q3.dtype if last else torch.float32, lse_out=lse_m)
            lse, base2 = lse_m, False
        return o

