"""The layout strategies (runtime/layouts.py): chosen once from the KV format, they shape the key
buffers and say what each layout supports; the kernels they call are tested through the backend
(test_backend.py: per-token, test_backend_channel.py: per-channel)."""
from types import SimpleNamespace

import pytest

from oscar_sglang.runtime import layouts as LY
from oscar_sglang.runtime.kv_format import resolve


def _fmt(name, D=64, layers=2):
    return resolve(name, head_dim=D, v_head_dim=D, num_layers=layers, group_size=64)


def test_the_format_picks_the_layout():
    ch = LY.layout_for(_fmt("k3c64-v2t64@0=k4"))
    tok = LY.layout_for(_fmt("token"))
    assert isinstance(ch, LY.PerChannelLayout) and ch.name == "channel"
    assert isinstance(tok, LY.PerTokenLayout) and tok.name == "token"
    with pytest.raises(ValueError, match="unknown layout 'bogus'"):
        LY.layout_for(SimpleNamespace(layout="bogus", name="x"))


def test_capabilities():
    ch, tok = LY.layout_for(_fmt("k4c64-v2h-s4-w128")), LY.layout_for(_fmt("token"))
    for flag in ("fused_decode_store", "dequantises_prefix", "plans_decode_splits", "decode_writes_model_dtype"):
        assert getattr(ch, flag) is True and getattr(tok, flag) is False, flag


def test_key_buffers_and_format_arguments():
    ch = LY.layout_for(_fmt("k3c64-v2t64@0=k4"))
    assert ch.k_format(64) is None
    assert ch.k_param_shape(256, 64, 2, 64) == (4, 2, 64, 2)  # one (scale, min) per page and channel
    assert ch.format_args(0) == dict(k_bits=4, k_block=64, v_group=64)
    assert ch.format_args(1) == dict(k_bits=3, k_block=64, v_group=64)
    ch.check_page_size(64)
    with pytest.raises(ValueError, match="needs --page-size 64, the pool has 32"):
        ch.check_page_size(32)

    tok = LY.layout_for(_fmt("token"))
    assert (tok.k_format(64).head_dim, tok.k_format(64).group_size) == (64, 64)
    assert tok.k_param_shape(256, 1, 2, 64) == (256, 2, 1, 2)  # one (scale, min) per slot and group
    assert tok.format_args(1) == dict(k_group=64, v_group=64)
    tok.check_page_size(16)  # any page size
    with pytest.raises(ValueError, match="per-channel format store options"):
        tok.store(None, 0, 0, None, None, None, {}, one_token_per_request=True)


def test_per_token_decode_splits_are_sglangs():
    tok = LY.layout_for(_fmt("token"))
    md = SimpleNamespace(num_kv_splits="n", attn_logits="l", attn_lse="s")
    assert tok.decode_splits(SimpleNamespace(max_kv_splits=8), 3, md) == dict(
        num_kv_splits="n", max_kv_splits=8, attn_logits="l", attn_lse="s")
