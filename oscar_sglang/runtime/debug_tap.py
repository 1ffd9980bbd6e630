"""Debug tap: record one layer's attention inputs/outputs inside a running server, and the
float64 references they are checked against (used by bench/server_e2e.py).

Enabled only by OSCAR_DEBUG_TAP_DIR (a directory) and OSCAR_DEBUG_TAP_LAYER (a global layer id).
It runs in eager forwards only (prefill / extend); CUDA-graph replays never execute Python, and a
capture is skipped. Each call of the tapped layer with batch size 1 saves q, k, v (model space,
as the backend received them), the backend's output, the positions / own_start it used and, for
per-channel key formats, the cached prefix as its reader sees it (read back from the pool with the
dequant op of the FlashInfer prefix path, rotated space), under OSCAR_DEBUG_TAP_DIR/rank<r> (r =
the attention TP rank: each rank taps its own KV heads). The read-back checks the stored keys
directly: on dummy weights the scores are too small for the keys to move the output.
"""
from __future__ import annotations

import itertools
import math
import os
from types import SimpleNamespace

import torch

from ..common import settings

# read once per process (the settings registry validates both at start, runtime/config.load_config)
TAP_DIR = settings.DEBUG_TAP_DIR.get()
TAP_LAYER = settings.DEBUG_TAP_LAYER.get()
_counter = itertools.count()
_meta_saved = False


def enabled(layer_id: int) -> bool:
    return (
        TAP_DIR is not None
        and layer_id == TAP_LAYER
        and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    )


def rank_dir(pool) -> str:
    """This rank's folder: ranks of a TP server are separate processes with the same TAP_DIR."""
    return os.path.join(TAP_DIR, f"rank{int(pool.info.get('attn_tp', (0, 1))[0])}")


def stored_prefix(backend, layer, fb, prefix_len: int):
    """(K, V) [prefix_len, H, D] of request 0's cached prefix as the reader sees it (sink / ring
    copies, the body dequantised), in the pool's rotated space; None for the per-token layout."""
    pool = backend.pool
    if not pool.layout.dequantises_prefix or prefix_len == 0:
        return None
    from oscar_kernels import ops

    kw = {k: v for k, v in backend._cached_kv_args(layer, fb).items() if k != "sm_scale"}
    k_out = torch.empty((prefix_len, *kw["sink_k"].shape[-2:]), dtype=kw["sink_k"].dtype, device=kw["sink_k"].device)
    v_out = torch.empty((prefix_len, *kw["sink_v"].shape[-2:]), dtype=kw["sink_v"].dtype, device=kw["sink_v"].device)
    dev = k_out.device
    ops.dequant_prefix_channel(piece_lo=torch.zeros(1, dtype=torch.int32, device=dev),
                               out_indptr=torch.tensor([0, prefix_len], dtype=torch.int32, device=dev),
                               out_k=k_out, out_v=v_out, max_piece_len=prefix_len, **kw)
    return k_out, v_out


def record_extend(backend, layer, fb, q3, k3, v3, o) -> None:
    global _meta_saved
    if fb.batch_size != 1:
        return
    pool = backend.pool
    out_dir = rank_dir(pool)
    os.makedirs(out_dir, exist_ok=True)
    i = pool.local(layer.layer_id)
    if not _meta_saved:
        torch.save(
            {
                "k_rot": None if pool.k_rot[i] is None else pool.k_rot[i].cpu(),
                "v_rot": None if pool.v_rot[i] is None else pool.v_rot[i].cpu(),
                "k_clip": pool.k_clip[i], "v_clip": pool.v_clip[i], "sink": pool.sink,
                "recent": pool.recent, "kv_format": pool.kv_format.name, "channel": pool.layout.name == "channel",
                "k_bits": pool.kv_format.k_bits[layer.layer_id], "group": pool.kv_format.k_group,
                "v_group": pool.kv_format.v_group, "sm_scale": layer.scaling,
                "info": {k: v for k, v in pool.info.items() if k != "env"},
            },
            os.path.join(out_dir, "meta.pt"),
        )
        _meta_saved = True
    prefix = int(fb.extend_prefix_lens[0])
    seen = stored_prefix(backend, layer, fb, prefix)  # before this chunk is stored (the caller stores after)
    torch.save(
        {
            "prefix_k": None if seen is None else seen[0].cpu(), "prefix_v": None if seen is None else seen[1].cpu(),
            "q": q3.detach().cpu(), "k": k3.detach().cpu(), "v": v3.detach().cpu(),
            "o": o.detach().reshape(q3.shape[0], q3.shape[1], -1).cpu(),
            "prefix": prefix, "seq_len": int(fb.seq_lens[0]),
            "row": int(fb.req_pool_indices[0]), "own_start": int(backend.pool.own_start[fb.req_pool_indices[0]]),
            "sink_start": int(backend.pool.sink_start[fb.req_pool_indices[0]]),
            "canonical": bool(getattr(backend, "_canonical_prefill", False)),  # OSCAR_PREFILL_READS=cache
        },
        os.path.join(out_dir, f"extend_{next(_counter):05d}.pt"),
    )


# ------------------------------------------------------------------------------ references


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_request(meta: dict, chunks: list[dict]) -> dict:
    """Chunks of one request (in order, contiguous positions from 0). For every chunk with a
    cached prefix: the server output vs (a) exact attention over the BF16 K/V and (b) the INT2
    design emulated in float64 (oscar_kernels.reference) on the same K/V and rotations."""
    from oscar_kernels import reference as ref
    from oscar_kernels.format import Int2Format

    K = torch.cat([c["k"] for c in chunks]).float()
    V = torch.cat([c["v"] for c in chunks]).float()
    H, D = K.shape[1], K.shape[2]
    Dv = V.shape[2]
    eye_k = torch.eye(D).expand(H, D, D)
    eye_v = torch.eye(Dv).expand(H, Dv, Dv)
    Rk = meta["k_rot"].float() if meta["k_rot"] is not None else eye_k
    Rv = meta["v_rot"].float() if meta["v_rot"] is not None else eye_v
    dt = chunks[0]["k"].dtype
    # what the backend stores / reads: rotated in fp32, rounded to the model dtype
    Kr = torch.einsum("thd,hde->the", K, Rk).to(dt).float()
    Vr = torch.einsum("thd,hde->the", V, Rv).to(dt).float()
    fk, fv = Int2Format(D, min(meta["group"], D)), Int2Format(Dv, min(meta.get("v_group", meta["group"]), Dv))
    sm = meta["sm_scale"]

    def cached(x, which, clip, P, own, sink_start):
        """What the prefix reader sees of K or V (rotated), in the tapped layer's format."""
        if not meta.get("channel"):
            fmt = fk if which == "k" else fv
            return ref.mixed_kv(x[:P], fmt, P, meta["sink"], meta["recent"], own, clip,
                                sink_start=sink_start).double()
        # per-channel keys: the reference of any KVFormat (duck-typed: sink / ring sizes outside
        # the study's grid are fine here)
        kvf = SimpleNamespace(
            k_layout="channel", k_group=meta["group"], v_group=meta["v_group"], token_norm=False,
            sink=meta["sink"], window=meta["recent"], name=meta["kv_format"],
            layer_bits=lambda layer, n=None: (meta["k_bits"], 2))
        return ref.format_request_kv(x[:P], kvf, which, P, own_start=own, sink_start=sink_start,
                                     clip_ratio=1.0 if which == "k" else clip).double()

    out = []
    for c in chunks:
        P, E = c["prefix"], c["q"].shape[0]
        if P == 0:
            continue
        q = c["q"].float()
        Hq = q.shape[1]
        g = Hq // H
        o_bf16, _ = ref.attention(q, K[: P + E], V[: P + E], sm_scale=sm, causal_offset=P)
        own = min(c["own_start"], 2**31 - 1)
        sink_start = min(c.get("sink_start", own), 2**31 - 1)  # (taps before it was recorded)
        qr = torch.einsum("thgd,hde->thge", q.reshape(E, H, g, D), Rk).reshape(E, Hq, D).to(dt).double()
        causal = torch.arange(E).view(-1, 1) < torch.arange(E).view(1, -1)
        if meta.get("channel") and P % meta["group"] == 0 and c.get("canonical"):
            # a page-canonical chunk (OSCAR_PREFILL_READS=cache, backend._prepare_canonical): its
            # new tokens in complete pages are read as the cache holds them too, own_start = the
            # start of its last page
            Kp = cached(Kr, "k", meta["k_clip"], P + E, own, sink_start)
            Vp = cached(Vr, "v", meta["v_clip"], P + E, own, sink_start)
            s_all = torch.einsum("thd,lhd->htl", qr, Kp.repeat_interleave(g, 1)) * sm
            s_all[:, :, P:] = s_all[:, :, P:].masked_fill(causal.unsqueeze(0), float("-inf"))
            p = torch.softmax(s_all, -1)
            vv = torch.einsum("lhd,hed->lhe", Vp, Rv.double()).repeat_interleave(g, 1)
            Kp, Vp = Kp[:P], Vp[:P]
        else:
            Kp = cached(Kr, "k", meta["k_clip"], P, own, sink_start)
            Vp = cached(Vr, "v", meta["v_clip"], P, own, sink_start)
            sp = torch.einsum("thd,lhd->htl", qr, Kp.repeat_interleave(g, 1)) * sm
            sn = torch.einsum("thd,lhd->htl", q.double(), K[P : P + E].double().repeat_interleave(g, 1)) * sm
            sn = sn.masked_fill(causal.unsqueeze(0), float("-inf"))
            p = torch.softmax(torch.cat([sp, sn], -1), -1)
            Vp_model = torch.einsum("lhd,hed->lhe", Vp, Rv.double())  # un-rotate: v @ R_v^T
            vv = torch.cat([Vp_model, V[P : P + E].double()]).repeat_interleave(g, 1)
        o_emul = torch.einsum("htl,lhd->thd", p, vv)
        o = c["o"].float()
        out.append({
            "prefix": P, "new_tokens": E, "own_start": own,
            "rel_err_server_vs_bf16": _rel(o, o_bf16),
            "rel_err_int2_emulation_vs_bf16": _rel(o_emul, o_bf16),
            "rel_err_server_vs_int2_emulation": _rel(o, o_emul),
        })
        if c.get("prefix_k") is not None:  # the stored prefix itself, keys included
            out[-1]["rel_err_stored_k_vs_emulation"] = _rel(c["prefix_k"], Kp)
            out[-1]["rel_err_stored_v_vs_emulation"] = _rel(c["prefix_v"], Vp)
    return {"chunks": out, "head_dim": D, "kv_heads": H, "q_heads": chunks[0]["q"].shape[1],
            "sm_scale_check": math.isclose(sm, 1 / math.sqrt(D), rel_tol=1e-3)}
