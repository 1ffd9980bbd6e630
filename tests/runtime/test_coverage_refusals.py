"""The coverage matrix's refusals, from SGLang's own ModelConfig of each config in launch/models
(built on CPU from config.json alone), and the refusals that stand-ins pin: attention sinks,
chunked attention, FP8 KV-cache scales (FP8 weights with unit scales are served)."""
import contextlib
import json
from types import SimpleNamespace

import pytest
import torch

from oscar_sglang.runtime import refusals as F
from tests import ROOT

MODELS = ROOT / "launch" / "models"
MATRIX = json.loads((MODELS / "matrix.json").read_text())["rows"]
# what each refused row's message must name (why), and what to use instead
WHY = {"sliding-window": "sliding_window=4096", "hybrid-linear": "linear-attention",
       "hd256-mha": "head_dim 256"}
INSTEAD = {"hd256-mha": "OSCAR_KV_FORMAT=token"}


@pytest.mark.parametrize("name", [r["name"] for r in MATRIX])
def test_matrix_rows_are_refused_exactly_when_expected(name):
    """The model's refusals and its KV format's (the row's plugin env, e.g. OSCAR_KV_FORMAT)."""
    from sglang.srt.configs.model_config import ModelConfig

    from oscar_sglang.runtime.config import load_config

    r = next(r for r in MATRIX if r["name"] == name)
    mc = ModelConfig(str(MODELS / r["config"]))
    problems = F.model_problems(mc, hybrid_linear=F.is_hybrid_linear(mc))
    problems += F.format_problems(load_config(r.get("env", {})), mc)
    if r["expect"] == "served":
        assert problems == [], (r["name"], problems)
    else:
        assert problems, r["name"]
        assert any(WHY[r["kind"]] in p for p in problems), problems
        # every message says what to do instead: another KV cache, or another KV format
        assert all(F.INSTEAD in p or "use OSCAR_KV_FORMAT=" in p for p in problems), problems
        if r["kind"] in INSTEAD:
            assert any(INSTEAD[r["kind"]] in p for p in problems), problems
    with pytest.raises(F.Int2Unsupported) if problems else contextlib.nullcontext():
        F.raise_if_any(problems)


def _model(**kw):
    base = dict(attention_arch=SimpleNamespace(name="MHA"), hf_config=SimpleNamespace(architectures=["X"]),
                is_hybrid_swa=False, sliding_window_size=None, is_encoder_decoder=False, head_dim=128,
                v_head_dim=128, attention_chunk_size=None, has_attention_sinks=False)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("kw, words", [
    (dict(has_attention_sinks=True), ["attention sinks", "gpt-oss"]),
    (dict(attention_chunk_size=8192), ["chunked local attention", "Llama 4"]),
    (dict(is_hybrid_swa=True), ["hybrid sliding-window"]),
    (dict(sliding_window_size=512), ["sliding_window=512"]),
])
def test_new_model_refusals_say_why_and_what_instead(kw, words):
    assert F.model_problems(_model()) == []
    problems = F.model_problems(_model(**kw))
    assert problems
    for w in words:
        assert any(w in p for p in problems), (w, problems)
    assert all(F.INSTEAD in p for p in problems)


class _Attn(torch.nn.Module):
    """RadixAttention's KV-scale attributes as SGLang sets them (kv_cache.BaseKVCacheMethod)."""

    def __init__(self, layer_id, scale):
        super().__init__()
        self.layer_id = layer_id
        if scale is None:
            self.k_scale = self.v_scale = self.k_scale_float = self.v_scale_float = None
        else:
            self.k_scale = torch.nn.Parameter(torch.tensor(scale), requires_grad=False)
            self.v_scale = torch.nn.Parameter(torch.tensor(scale), requires_grad=False)
            self.k_scale_float = self.v_scale_float = float(scale)


def _net(*scales):
    return torch.nn.ModuleList([_Attn(i, s) for i, s in enumerate(scales)])


def test_fp8_weights_with_unit_kv_scales_are_served_other_scales_refused():
    assert F.kv_scale_problems(_net(None, None)) == []  # BF16 weights: no scales
    assert F.kv_scale_problems(_net(1.0, 1.0)) == []    # --quantization fp8 / FP8 weights, no KV scales
    p = F.kv_scale_problems(_net(1.0, 0.05, 0.07))
    assert len(p) == 1 and "2 attention layers" in p[0] and "layer 1" in p[0]
    assert "--kv-cache-dtype fp8_e4m3" in p[0]
    with pytest.raises(F.Int2Unsupported):
        F.raise_if_any(p)


def test_dummy_weights_get_neutral_kv_scales():
    """--load-format dummy: SGLang keeps random positive 'scales' (uniform(-1e-3, 1e-3)); they are
    reset to 1.0 instead of refusing the FP8 dummy model; real checkpoints' scales stay refused."""
    net = _net(0.0004, 1.0, None)
    assert F.kv_scale_problems(net)
    assert F.unit_kv_scales_for_dummy_weights(net) == 1
    assert F.kv_scale_problems(net) == []
    assert float(net[0].k_scale) == 1.0 == net[0].v_scale_float and net[2].k_scale is None


def test_backend_accepts_unit_kv_scales_at_forward():
    from oscar_sglang.runtime.backend import OscarInt2TritonBackend as B

    k = v = torch.zeros(1)
    unit = SimpleNamespace(k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0), k_scale_float=1.0,
                           v_scale_float=1.0, sliding_window_size=-1)
    B._check(unit, k, v, None, None)  # no exception
    B._check(SimpleNamespace(k_scale=None, v_scale=None, sliding_window_size=-1), k, v, None, None)
    scaled = SimpleNamespace(**{**vars(unit), "k_scale_float": 0.5})
    with pytest.raises(NotImplementedError, match="fp8_e4m3"):
        B._check(scaled, k, v, None, None)
    no_float = SimpleNamespace(k_scale=torch.tensor(1.0), v_scale=None, sliding_window_size=-1)
    with pytest.raises(NotImplementedError):  # a scale whose value is unknown is not assumed to be 1
        B._check(no_float, k, v, None, None)
