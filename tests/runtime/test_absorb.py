"""Folding R_v into the V and output projections (runtime/absorb.py) changes nothing a layer
computes: attention through the absorbed weights, with V stored rotated and no un-rotation, gives
the original layer's output (float64 reference, fresh random weights with outlier channels)."""
import math
from types import SimpleNamespace

import pytest
import torch

from oscar_sglang.runtime.absorb import absorb_v_rotations, attention_modules


class Attn(torch.nn.Module):
    """The attribute layout of SGLang's Llama/Qwen attention: attn (RadixAttention), a fused
    qkv_proj with [q | k | v] rows and an o_proj over the q heads' outputs."""

    def __init__(self, layer_id, hidden, Hq, Hkv, D, bias, dtype):
        super().__init__()
        self.attn = SimpleNamespace(layer_id=layer_id, tp_q_head_num=Hq, tp_k_head_num=Hkv,
                                    qk_head_dim=D, v_head_dim=D)
        self.qkv_proj = torch.nn.Linear(hidden, (Hq + 2 * Hkv) * D, bias=bias, dtype=dtype)
        self.o_proj = torch.nn.Linear(Hq * D, hidden, bias=False, dtype=dtype)
        with torch.no_grad():  # a few large channels, as real V projections have
            self.qkv_proj.weight[torch.randperm(self.qkv_proj.weight.shape[0])[:4]] *= 20

    def forward(self, x, v_rotation=None):
        """Causal attention in float64; v_rotation: rotate V and un-rotate o (the backend's job)."""
        a = self.attn
        Hq, Hkv, D = a.tp_q_head_num, a.tp_k_head_num, a.qk_head_dim
        qkv = torch.nn.functional.linear(x.double(), self.qkv_proj.weight.double(),
                                         None if self.qkv_proj.bias is None else self.qkv_proj.bias.double())
        T = x.shape[0]
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], -1)
        q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        if v_rotation is not None:
            v = torch.einsum("thd,hde->the", v, v_rotation.double().expand(Hkv, D, D))
        G = Hq // Hkv
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), v)
        if v_rotation is not None:
            R = v_rotation.double().expand(Hkv, D, D).repeat_interleave(G, 0)
            o = torch.einsum("thd,hed->the", o, R)
        return torch.nn.functional.linear(o.reshape(T, Hq * D), self.o_proj.weight.double())


def _model(layers, **kw):
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([Attn(i, **kw) for i in layers])
    return m


def _orthogonal(*shape):
    return torch.linalg.qr(torch.randn(*shape, dtype=torch.float64))[0].float()


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_head"])
@pytest.mark.parametrize("bias", [False, True])
def test_absorbed_weights_compute_the_same_layer(seed, shared, bias):
    L, Hq, Hkv, D, hidden, T = 2, 6, 2, 16, 48, 9
    model = _model(range(L), hidden=hidden, Hq=Hq, Hkv=Hkv, D=D, bias=bias, dtype=torch.float32)
    R = _orthogonal(L, 1 if shared else Hkv, D, D)
    x = torch.randn(T, hidden)
    before = [m(x) for m in model.layers]
    # the backend's runtime rotation gives the original output too (the reference is right)
    for m, want in zip(model.layers, before):
        torch.testing.assert_close(m(x, R[m.attn.layer_id]), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    layers, why = absorb_v_rotations(model, R, start_layer=0)
    assert why is None and layers == [0, 1]
    for m, want in zip(model.layers, before):
        # V comes out rotated and o_proj takes rotated outputs: no rotation anywhere at run time
        torch.testing.assert_close(m(x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_bf16_weights_stay_within_their_rounding(seed):
    model = _model([4, 5], hidden=64, Hq=4, Hkv=4, D=16, bias=False, dtype=torch.bfloat16)
    R = _orthogonal(2, 4, 16, 16)
    x = torch.randn(7, 64).bfloat16()
    before = [m(x) for m in model.layers]
    assert absorb_v_rotations(model, R, start_layer=4) == ([4, 5], None)
    for m, want in zip(model.layers, before):
        err = (m(x) - want).norm() / want.norm()
        assert err < 2e-2, err  # one more bf16 rounding of the V / o weights


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("problem", ["quantised", "layers", "heads", "layout"])
def test_all_or_nothing(seed, problem):
    model = _model([0, 1], hidden=32, Hq=4, Hkv=2, D=8, bias=False, dtype=torch.float32)
    R = _orthogonal(2, 2, 8, 8)
    start = 0
    if problem == "quantised":
        model.layers[1].o_proj.quant_method = type("Fp8LinearMethod", (), {})()
        want = "o_proj is quantised (Fp8LinearMethod)"
    elif problem == "layers":
        start = 3  # this rank holds layers 3..4, the model 0..1
        want = "do not match this rank's layers"
    elif problem == "heads":
        R = _orthogonal(2, 3, 8, 8)
        want = "3 V rotations for 2 KV heads"
    else:
        model.layers[0].qkv_proj = torch.nn.Linear(32, 3 * 4 * 8)  # q, k, v all with 4 heads
        want = "qkv_proj rows are not [q | k | v]"
    before = _weights(model)
    layers, why = absorb_v_rotations(model, R, start_layer=start)
    assert layers == [] and want in why
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))  # nothing touched


def test_finds_attention_modules_in_layer_order():
    model = _model([2, 0, 1], hidden=16, Hq=2, Hkv=1, D=8, bias=False, dtype=torch.float32)
    assert [m.attn.layer_id for m in attention_modules(model)] == [0, 1, 2]
    assert absorb_v_rotations(torch.nn.Linear(2, 2), torch.zeros(1, 1, 8, 8), 0)[1].startswith("no attention module")
