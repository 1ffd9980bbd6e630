"""OSCAR_KV_FORMAT: what a server stores (runtime/kv_format.py), resolved per model."""
from types import SimpleNamespace

import pytest

from oscar_sglang.runtime import config as C
from oscar_sglang.runtime import kv_format as KF


def resolve(name, D=128, layers=32, G=128, sink=None, recent=None):
    return KF.resolve(name, head_dim=D, v_head_dim=D, num_layers=layers, group_size=G, sink=sink, recent=recent)


def test_default_is_4bit_channel_keys_over_pages_of_64_one_value_group_a_head():
    assert KF.DEFAULT_KV_FORMAT == C.load_config({}).kv_format == "k4c64-v2h-s4-w128"
    f = resolve(None)  # a 128-dim head: one value group of 128, spelled out in the served name
    assert f.name == "k4c64-v2t128-s4-w128" and resolve(f.name) == f
    assert (f.layout, f.k_bits[0], f.k_group, f.v_group, f.sink, f.recent) == ("channel", 4, 64, 128, 4, 128)
    assert f.page_size == 64 and not f.k_clip and not f.v_clip
    # K: 64 code bytes + 128 channels x 4 B / 64 tokens; V: 32 + one group's 4 B
    assert (f.k_row_bytes(0), f.v_row_bytes()) == (72, 36)
    assert f.body_bits_per_element() == 3.375
    # a 64-dim head (SmolLM2): exactly the k4c64-v2t64-s4-w128 of the H100 NIAH table
    g = resolve(None, D=64)
    assert (g.name, g.v_group, g.body_bits_per_element()) == ("k4c64-v2t64-s4-w128", 64, 3.5)


def test_token_recipe_keeps_the_old_behaviour():
    f = resolve("token", D=64, layers=3, G=128)
    assert f.name == "k2t64-v2t64-kclip-vclip" and f.layout == "token" and f.page_size is None
    assert f.k_clip and f.v_clip and f.k_group == f.v_group == 64  # the group capped at head_dim
    g = resolve("token", G=32, sink=4, recent=8)
    assert g.name == "k2t32-v2t32-kclip-vclip-s4-w8" and (g.sink, g.recent) == (4, 8)
    # the same recipe by explicit name, and one without clips
    assert resolve("k2t64-v2t64-kclip-vclip") == resolve("token", G=64)
    assert not resolve("k2t64-v2t64").k_clip


def test_sink_window_and_per_layer_bits():
    f = resolve("k2c32-v2t128-s4-w128@0,-1=k4", layers=4)
    assert (f.sink, f.recent, f.k_group, f.k_bits) == (4, 128, 32, (4, 2, 2, 4))
    assert f.name == "k2c32-v2t128-s4-w128@0,-1=k4" and resolve(f.name, layers=4) == f
    # env sizes apply where the name says nothing; sizes outside the study grid are served
    g = resolve("k3c64-v2t64", sink=8, recent=100)
    assert (g.sink, g.recent) == (8, 100) and g.name == "k3c64-v2t64-s8-w100"
    with pytest.raises(KF.KVFormatError, match="set it in one place"):
        resolve("k3c64-v2t64-s4", sink=8)


def test_value_group_per_head_is_served_under_its_group():
    """OSCAR_KV_FORMAT with v2h: one value scale per token and head; the served name (logs,
    /server_info) spells the group the model got, and resolves back to the same format."""
    for D, v_bytes in ((64, 16 + 4), (128, 32 + 4)):
        f = resolve("k4c64-v2h-s4-w128", D=D)
        assert (f.v_group, f.v_row_bytes(), f.name) == (D, v_bytes, f"k4c64-v2t{D}-s4-w128")
        assert resolve(f.name, D=D) == f
    assert resolve("k3c64-v2h", D=128, sink=8).name == "k3c64-v2t128-s8"  # w256: the grammar's default


def test_default_sizes_give_way_to_the_environment():
    # no OSCAR_KV_FORMAT: OSCAR_SINK_TOKENS / OSCAR_RECENT_TOKENS override the default's 4 / 128
    f = resolve(None, sink=64, recent=256)
    assert (f.sink, f.recent, f.name) == (64, 256, "k4c64-v2t128")
    assert resolve(None, recent=192).name == "k4c64-v2t128-s4-w192"
    # through the config: an explicit name keeps its own segments (and conflicts are errors)
    shape = SimpleNamespace(head_dim=128, v_head_dim=128, num_hidden_layers=32)
    assert KF.for_model(C.load_config({"OSCAR_SINK_TOKENS": "16"}), shape).name == "k4c64-v2t128-s16-w128"
    assert KF.for_model(C.load_config({}), shape).name == "k4c64-v2t128-s4-w128"
    assert KF.for_model(C.load_config({"OSCAR_KV_FORMAT": "k3c64-v2t64"}), shape).sink == 64
    with pytest.raises(KF.KVFormatError, match="set it in one place"):
        KF.for_model(C.load_config({"OSCAR_KV_FORMAT": "k3c64-v2t64-s4-w128", "OSCAR_SINK_TOKENS": "16"}), shape)


@pytest.mark.parametrize("name, D, words", [
    ("k3c64-v2t64-tn", 128, ["token-norm"]),
    ("k3c64-v4t64", 128, ["2-bit"]),
    ("k3c64-v2t64-id", 128, ["OSCAR_ROTATION"]),
    ("k3c64-v2t64-kclip", 128, ["kclip"]),
    ("k3c64-v2t64-w32", 128, ["shorter than a key block"]),
    ("k3c64-v2t64", 256, ["head_dim 256", "OSCAR_KV_FORMAT=token"]),
    ("k4c64-v2h-s4-w128", 256, ["head_dim 256", "OSCAR_KV_FORMAT=token"]),  # v2h on 256-dim heads
    (None, 256, ["head_dim 256", "OSCAR_KV_FORMAT=token"]),  # the default (v2h) there
    ("k3t64-v2t64", 128, ["per-token keys"]),
    ("k3c48-v2t64", 128, ["page size"]),
    ("nonsense", 128, ["a key and a value segment", "(default)"]),
])
def test_unservable_formats_say_why_and_what_instead(name, D, words):
    with pytest.raises(KF.KVFormatError) as e:
        resolve(name, D=D)
    msg = str(e.value)
    assert "OSCAR_KV_FORMAT" in msg and all(w in msg for w in words), msg


def test_config_checks_the_name_early_and_page_size_from_name():
    assert C.load_config({"OSCAR_KV_FORMAT": " k2c32-v2t64 "}).kv_format == "k2c32-v2t64"
    assert C.load_config({"OSCAR_KV_FORMAT": "token"}).sources["kv_format"] == "OSCAR_KV_FORMAT"
    with pytest.raises(C.OscarConfigError, match="OSCAR_KV_FORMAT"):
        C.load_config({"OSCAR_KV_FORMAT": "k9c64-v2t64"})
    assert KF.page_size_for("k2c32-v2t64-s4-w64") == 32 and KF.page_size_for("token") is None
    assert KF.page_size_for("k2t64-v2t64") is None and KF.page_size_for("") == 64


def test_for_model_uses_env_sizes_only_when_given():
    mc = SimpleNamespace(head_dim=64, v_head_dim=64, num_hidden_layers=30)
    assert KF.for_model(C.load_config({}), mc).sink == 4
    f = KF.for_model(C.load_config({"OSCAR_SINK_TOKENS": "8", "OSCAR_RECENT_TOKENS": "192"}), mc)
    assert (f.sink, f.recent, len(f.k_bits)) == (8, 192, 30)
