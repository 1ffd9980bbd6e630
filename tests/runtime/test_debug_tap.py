"""The debug tap (runtime/debug_tap.py) and bench/server_e2e.py's analysis of it, on CPU.

A two-rank "server" is emulated: each rank records a chunked prefill of one request through
record_extend (its own KV heads, rotations and folder), with an attention output computed here
independently of check_request: in the rotated space (q R_k against the stored keys, new tokens
rotated too, then o R_v^T), where check_request reasons in model space for the new tokens. The
check must find that output equal to its INT2 emulation (up to BF16 rounding), the INT2 error
against exact attention well above that, and an output that forgot R_v^T wrong; likewise a stored
prefix read back as the design says, and one whose keys were stored unrotated. Then the real
backend (TRITON_INTERPRET, one layer, per-channel keys) prefills a request in two chunks with the
tap on: its read-back prefix must be what the format says the reader sees.
"""
import importlib.util
import itertools
import sys
from types import SimpleNamespace

import pytest
import torch

from oscar_kernels import reference as ref
from oscar_kernels.format import KVFormat
from oscar_sglang.runtime import debug_tap
from tests import ROOT

from .test_backend import backend_cls  # noqa: F401  (fixture)

sys.path.insert(0, str(ROOT / "bench"))
_spec = importlib.util.spec_from_file_location("server_e2e", ROOT / "bench" / "server_e2e.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)

D, H_LOCAL, G, LAYER, NAME = 64, 2, 2, 3, "k4c64-v2t64-s4-w128"
CHUNKS = [(0, 200), (200, 330), (330, 400)]  # prefill chunks: the second and third end mid-block


def _orthogonal(h, d, gen):
    return torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].float()


def _request(gen, n):
    """q, k, v of one request in the model dtype, keys with a few large persistent channels."""
    k = torch.randn(n, H_LOCAL, D, generator=gen)
    k[..., torch.randperm(D, generator=gen)[:3]] *= 12.0
    v = torch.randn(n, H_LOCAL, D, generator=gen)
    q = torch.randn(n, H_LOCAL * G, D, generator=gen)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _rotated(x, r):
    """x R per head, rounded to the model dtype as the backend stores it."""
    return torch.einsum("thd,hde->the", x.float(), r).bfloat16().float()


def _reader_sees(kr, vr, P, fmt, v_clip):
    """What a reader of P cached positions sees of rotated K and V (float64)."""
    return (ref.format_request_kv(kr, fmt, "k", P, layer=LAYER, clip_ratio=1.0).double(),
            ref.format_request_kv(vr, fmt, "v", P, layer=LAYER, clip_ratio=v_clip).double())


def _server_output(q, k, v, P, E, rk, rv, fmt, v_clip, unrotate=True):
    """What an INT2 server computes for the new tokens P:P+E, worked in the rotated space."""
    kr, vr = _rotated(k, rk), _rotated(v, rv)
    kp, vp = _reader_sees(kr, vr, P, fmt, v_clip)
    keys = torch.cat([kp, kr[P:P + E].double()])
    vals = torch.cat([vp, vr[P:P + E].double()])
    qr = torch.einsum("thgd,hde->thge", q[P:P + E].float().reshape(E, H_LOCAL, G, D), rk)
    o_rot, _ = ref.attention(qr.reshape(E, H_LOCAL * G, D).bfloat16().double(), keys, vals,
                             sm_scale=D ** -0.5, causal_offset=P)
    if not unrotate:  # the bug the check must catch: R_v^T not applied
        return o_rot
    rv_q = rv.double().repeat_interleave(G, 0)  # query head j reads KV head j // G
    return torch.einsum("thd,hed->the", o_rot, rv_q)  # o R_v^T per head


def _record_rank(monkeypatch, tmp_path, rank, gen, forget_v_unrotation=False, unrotated_keys=False):
    fmt = KVFormat.parse(NAME, D)
    rk, rv = _orthogonal(H_LOCAL, D, gen), _orthogonal(H_LOCAL, D, gen)
    v_clip = 0.95
    pool = SimpleNamespace(
        local=lambda layer_id: 0, k_rot=[rk], v_rot=[rv], k_clip=[1.0], v_clip=[v_clip],
        sink=fmt.sink, recent=fmt.window, own_start=torch.zeros(8, dtype=torch.long),
        sink_start=torch.zeros(8, dtype=torch.long),
        layout=SimpleNamespace(name="channel", dequantises_prefix=True),
        kv_format=SimpleNamespace(name=NAME, k_bits=[4] * 8, k_group=fmt.k_group, v_group=fmt.v_group),
        info={"attn_tp": [rank, 2], "recipe": "test", "rotation_sha256": None, "group_size": fmt.v_group})
    # a process per rank: the module's per-process state starts afresh
    monkeypatch.setattr(debug_tap, "TAP_DIR", str(tmp_path / "tap"))
    monkeypatch.setattr(debug_tap, "_meta_saved", False)
    monkeypatch.setattr(debug_tap, "_counter", itertools.count())
    q, k, v = _request(gen, CHUNKS[-1][1])
    layer = SimpleNamespace(layer_id=LAYER, scaling=D ** -0.5)

    def stored(backend, layer_, fb, P):  # the pool read back, as the design stores it (or not)
        k_rot = torch.eye(D).expand(H_LOCAL, D, D) if unrotated_keys else rk
        return tuple(x.bfloat16() for x in _reader_sees(_rotated(k, k_rot), _rotated(v, rv), P, fmt, v_clip))

    monkeypatch.setattr(debug_tap, "stored_prefix", stored)
    for P, end in CHUNKS:
        E = end - P
        o = _server_output(q, k, v, P, E, rk, rv, fmt, v_clip, unrotate=not forget_v_unrotation)
        fb = SimpleNamespace(batch_size=1, extend_prefix_lens=torch.tensor([P]), seq_lens=torch.tensor([end]),
                             req_pool_indices=torch.tensor([1]))
        debug_tap.record_extend(SimpleNamespace(pool=pool), layer, fb, q[P:end], k[P:end], v[P:end],
                                o.bfloat16().reshape(E, -1))
    return tmp_path / "tap" / f"rank{rank}"


def test_each_rank_taps_into_its_own_folder_and_checks_out(monkeypatch, tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    for rank in (0, 1):
        d = _record_rank(monkeypatch, tmp_path, rank, gen)
        assert sorted(p.name for p in d.iterdir()) == ["extend_00000.pt", "extend_00001.pt",
                                                       "extend_00002.pt", "meta.pt"]
    accs = e2e.analyse_ranks(tmp_path / "tap", set())
    assert [a["rank"] for a in accs] == [0, 1]
    for a in accs:
        assert a["tap_files"] == 3 and a["chunk_sizes"] == [200, 130, 70]
        assert [c["prefix"] for c in a["chunks"]] == [200, 330]  # the first chunk has no prefix
        assert a["kv_heads"] == H_LOCAL and a["q_heads"] == H_LOCAL * G and a["sm_scale_check"]
        for c in a["chunks"]:
            # the same computation up to BF16 rounding of the output and of model-space new tokens
            assert c["rel_err_server_vs_int2_emulation"] < 0.01, c
            # the INT2 body's own error is far above that: the check can tell the two apart
            assert c["rel_err_int2_emulation_vs_bf16"] > 3 * c["rel_err_server_vs_int2_emulation"], c
            assert c["rel_err_server_vs_bf16"] == pytest.approx(c["rel_err_int2_emulation_vs_bf16"], rel=0.2)
            assert c["rel_err_stored_k_vs_emulation"] < 0.01 and c["rel_err_stored_v_vs_emulation"] < 0.01, c
        assert a["ok"]


# a rank whose output was left in the rotated space (R_v^T not applied), or whose keys were stored
# without their rotation: the check must fail that rank alone, on the error that shows the fault
@pytest.mark.parametrize("fault,wrong,right", [
    ({"forget_v_unrotation": True}, "rel_err_server_vs_int2_emulation", "rel_err_stored_k_vs_emulation"),
    ({"unrotated_keys": True}, "rel_err_stored_k_vs_emulation", "rel_err_stored_v_vs_emulation")])
def test_a_faulty_rank_fails_the_check(monkeypatch, tmp_path, seed, fault, wrong, right):
    gen = torch.Generator().manual_seed(seed)
    _record_rank(monkeypatch, tmp_path, 0, gen)
    _record_rank(monkeypatch, tmp_path, 1, gen, **fault)
    good, bad = e2e.analyse_ranks(tmp_path / "tap", set())
    assert good["ok"] and not bad["ok"]
    for c in bad["chunks"]:
        assert c[wrong] > 0.5 and c[right] < 0.01, c


# cut 70: chunk 2 starts off a page boundary (BF16 among its new tokens); 64: a page-canonical
# chunk 2 (its new tokens in complete pages read quantised), which the analysis emulates too
# reads: OSCAR_PREFILL_READS (cache: chunk 1 page-canonical, own_start 64; exact: own_start 0)
@pytest.mark.parametrize("cut,reads", [(70, "cache"), (64, "cache"), (64, "exact")])
def test_the_backend_taps_the_prefix_its_reader_sees(backend_cls, monkeypatch, tmp_path, seed, cut, reads):
    """A real pool and backend (tests/runtime/test_backend_channel.py's one-layer setup: blocks of
    32, sink 4, ring 32): a request of 110 tokens prefilled as `cut` + the rest with the tap on;
    the second chunk's reader sees the sink, then (page-canonical chunk 1: own_start 64) positions
    4-63 from the quantised blocks 0-1 and the ring after, or (exact: own_start 0) the ring's
    copies of the last 32 positions and the quantised blocks before."""
    from oscar_sglang.runtime.pool import note_new_rows

    from .test_backend import H as H1, Hq as Hq1, _heavy, _rot
    from .test_backend_channel import B, D as D1, _make, _seen

    monkeypatch.setattr(debug_tap, "TAP_DIR", str(tmp_path / "tap"))
    monkeypatch.setattr(debug_tap, "TAP_LAYER", 0)
    monkeypatch.setattr(debug_tap, "_meta_saved", False)
    monkeypatch.setattr(debug_tap, "_counter", itertools.count())
    b, pool, layer, Rk, Rv = _make(backend_cls, reads=reads)
    pool.info["attn_tp"] = [0, 1]
    row, n = 1, 110
    k, v = _heavy(n, D1), _heavy(n, D1)
    q = torch.randn(n, Hq1, D1).bfloat16().float()
    b.req_to_token = torch.zeros(4, 128, dtype=torch.int64)
    b.req_to_token[row, :n] = torch.arange(B, B + n)  # page-aligned slots, as SGLang's allocator gives
    for s, e in ((0, cut), (cut, n)):
        pre, ext = torch.tensor([s]), torch.tensor([e - s])
        fb = SimpleNamespace(
            batch_size=1, req_pool_indices=torch.tensor([row]), seq_lens=pre + ext, extend_seq_lens=ext,
            extend_prefix_lens=pre, extend_prefix_lens_cpu=pre.tolist(), extend_seq_lens_cpu=ext.tolist(),
            positions=torch.arange(s, e), out_cache_loc=b.req_to_token[row, s:e],
            forward_mode=SimpleNamespace(is_extend=lambda: True))
        if s == 0:
            note_new_rows([row], [0])
        b.forward_metadata = SimpleNamespace(
            qo_indptr=torch.tensor([0, e - s]), kv_indptr=torch.tensor([0, s], dtype=torch.int32),
            kv_indices=b.req_to_token[row, :s], max_extend_len=e - s)
        b._prepare_forward(fb)
        b.forward_extend(q[s:e].reshape(-1, Hq1 * D1), k[s:e].reshape(-1, H1 * D1), v[s:e].reshape(-1, H1 * D1),
                         layer, fb)
    d = tmp_path / "tap" / "rank0"
    first, second = (torch.load(d / f"extend_0000{i}.pt", weights_only=False) for i in (0, 1))
    assert first["prefix_k"] is None and second["prefix"] == cut
    # what the format says a reader of `cut` keys sees
    own = cut // B * B if reads == "cache" else 0
    want_k = _seen(_rot(k, Rk)[:cut], "k", cut, own, 0)
    want_v = _seen(_rot(v, Rv)[:cut], "v", cut, own, 0)
    assert second["prefix_k"].shape == (cut, H1, D1)
    # the body differs from the BF16 copies (so the comparison sees the quantisation), the sink does not
    assert not torch.allclose(want_k[4:38], _rot(k, Rk)[4:38].double(), atol=1e-3)
    assert torch.equal(second["prefix_k"][:4].double(), _rot(k, Rk)[:4].double())
    assert (second["prefix_k"].double() - want_k).abs().max() <= 0.02 * want_k.abs().max()
    assert (second["prefix_v"].double() - want_v).abs().max() <= 0.02 * want_v.abs().max()
    acc = e2e.analyse_tap(d / "meta.pt", [d / "extend_00000.pt", d / "extend_00001.pt"])
    (c,) = acc["chunks"]
    assert c["rel_err_stored_k_vs_emulation"] < 0.01 and c["rel_err_stored_v_vs_emulation"] < 0.01, c
    assert c["rel_err_server_vs_int2_emulation"] < 0.02 and acc["ok"], c


def test_tap_is_off_without_its_folder(monkeypatch):
    monkeypatch.setattr(debug_tap, "TAP_DIR", None)
    monkeypatch.setattr(debug_tap, "TAP_LAYER", LAYER)
    assert not debug_tap.enabled(LAYER)
    monkeypatch.setattr(debug_tap, "TAP_DIR", "/tmp/x")
    assert debug_tap.enabled(LAYER) and not debug_tap.enabled(LAYER + 1)
