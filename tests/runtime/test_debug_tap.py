"""The debug tap (runtime/debug_tap.py) and bench/server_e2e.py's analysis of it, on CPU.

A two-rank "server" is emulated: each rank records a chunked prefill of one request through
record_extend (its own KV heads, rotations and folder), with an attention output computed here
independently of check_request: in the rotated space (q R_k against the stored keys, new tokens
rotated too, then o R_v^T), where check_request reasons in model space for the new tokens. The
check must find that output equal to its INT2 emulation (up to BF16 rounding), the INT2 error
against exact attention well above that, and an output that forgot R_v^T wrong.
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


def _server_output(q, k, v, P, E, rk, rv, fmt, v_clip, unrotate=True):
    """What an INT2 server computes for the new tokens P:P+E, worked in the rotated space."""
    kr = torch.einsum("thd,hde->the", k.float(), rk).bfloat16().float()
    vr = torch.einsum("thd,hde->the", v.float(), rv).bfloat16().float()
    kp = ref.format_request_kv(kr, fmt, "k", P, layer=LAYER, clip_ratio=1.0).double()
    vp = ref.format_request_kv(vr, fmt, "v", P, layer=LAYER, clip_ratio=v_clip).double()
    keys = torch.cat([kp, kr[P:P + E].double()])
    vals = torch.cat([vp, vr[P:P + E].double()])
    qr = torch.einsum("thgd,hde->thge", q[P:P + E].float().reshape(E, H_LOCAL, G, D), rk)
    o_rot, _ = ref.attention(qr.reshape(E, H_LOCAL * G, D).bfloat16().double(), keys, vals,
                             sm_scale=D ** -0.5, causal_offset=P)
    if not unrotate:  # the bug the check must catch: R_v^T not applied
        return o_rot
    rv_q = rv.double().repeat_interleave(G, 0)  # query head j reads KV head j // G
    return torch.einsum("thd,hed->the", o_rot, rv_q)  # o R_v^T per head


def _record_rank(monkeypatch, tmp_path, rank, gen, forget_v_unrotation=False):
    fmt = KVFormat.parse(NAME, D)
    rk, rv = _orthogonal(H_LOCAL, D, gen), _orthogonal(H_LOCAL, D, gen)
    v_clip = 0.95
    pool = SimpleNamespace(
        local=lambda layer_id: 0, k_rot=[rk], v_rot=[rv], k_clip=[1.0], v_clip=[v_clip],
        sink=fmt.sink, recent=fmt.window, channel=True, own_start=torch.zeros(8, dtype=torch.long),
        kv_format=SimpleNamespace(name=NAME, k_bits=[4] * 8, k_group=fmt.k_group, v_group=fmt.v_group),
        info={"attn_tp": [rank, 2], "recipe": "test", "rotation_sha256": None, "group_size": fmt.v_group})
    # a process per rank: the module's per-process state starts afresh
    monkeypatch.setattr(debug_tap, "TAP_DIR", str(tmp_path / "tap"))
    monkeypatch.setattr(debug_tap, "_meta_saved", False)
    monkeypatch.setattr(debug_tap, "_counter", itertools.count())
    q, k, v = _request(gen, CHUNKS[-1][1])
    layer = SimpleNamespace(layer_id=LAYER, scaling=D ** -0.5)
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
        assert a["ok"]


def test_an_output_left_in_the_rotated_space_fails_the_check(monkeypatch, tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    _record_rank(monkeypatch, tmp_path, 0, gen)
    _record_rank(monkeypatch, tmp_path, 1, gen, forget_v_unrotation=True)
    good, bad = e2e.analyse_ranks(tmp_path / "tap", set())
    assert good["ok"] and not bad["ok"]
    assert all(c["rel_err_server_vs_int2_emulation"] > 0.5 for c in bad["chunks"])


def test_tap_is_off_without_its_folder(monkeypatch):
    monkeypatch.setattr(debug_tap, "TAP_DIR", None)
    monkeypatch.setattr(debug_tap, "TAP_LAYER", LAYER)
    assert not debug_tap.enabled(LAYER)
    monkeypatch.setattr(debug_tap, "TAP_DIR", "/tmp/x")
    assert debug_tap.enabled(LAYER) and not debug_tap.enabled(LAYER + 1)
