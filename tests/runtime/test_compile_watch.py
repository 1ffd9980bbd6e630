"""compile_watch: a Triton compile after the first forward is logged and listed in /server_info;
compiles before it are summed per kernel, logged once when serving starts and listed too; hooks
set by others keep running and keep their say.

Triton's own JIT runs the hooks only on a GPU (the interpreter has none), so these tests call the
hooks installed in triton.knobs.runtime with the keyword arguments JITFunction._call_hook passes
(Triton 3.6): key, repr, fn (module and name), compile, is_manual_warmup, already_compiled."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def watch(monkeypatch):
    from oscar_sglang.runtime import compile_watch as cw

    monkeypatch.setattr(cw, "_state", {"installed": False, "serving_since": None, "pending": {}, "compiled": [],
                                       "at_start": {}})
    rt = knobs.runtime
    saved = rt.jit_cache_hook, rt.jit_post_compile_hook
    yield cw
    rt.jit_cache_hook, rt.jit_post_compile_hook = saved


def _compile(key, manual=False, name="_tokens_kernel", module="oscar_kernels.triton.channel_store", pause=0.0):
    """One in-process cache miss as Triton reports it: the cache hook, then (compiled, after
    `pause` seconds) the post hook."""
    import time

    fn = SimpleNamespace(module=module, name=name, jit_function=None)
    kw = dict(key=key, repr=f"_tokens_kernel[num_warps=4](XK: *bf16, T: i32) {key}", fn=fn,
              compile={"key": key}, is_manual_warmup=manual, already_compiled=False)
    skip = knobs.runtime.jit_cache_hook(**kw)
    if not skip:
        time.sleep(pause)
        knobs.runtime.jit_post_compile_hook(**kw)
    return skip


def test_only_compiles_after_the_first_forward_are_reported(watch, caplog):
    assert watch.install() and watch.install()  # once per process
    with caplog.at_level(logging.WARNING, logger="oscar_sglang"):
        _compile(("capture", 1))  # start-up and CUDA-graph capture: expected, no warning
        assert watch.compiled_while_serving() == [] and not caplog.records
        watch.start()
        watch.start()  # later forwards do not move the start
        _compile(("serving", 8192))
        _compile(("warmup", 16), manual=True)  # a kernel's own .warmup(): not a request's wait
    got = watch.compiled_while_serving()
    assert [e["kernel"] for e in got] == ["oscar_kernels.triton.channel_store._tokens_kernel"]
    assert got[0]["ms"] >= 0 and got[0]["after_start_s"] >= 0
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "oscar_kernels.triton.channel_store._tokens_kernel while serving" in msgs[0]
    assert "('serving', 8192)" in msgs[0]  # the signature says which specialisation it was


def test_hooks_set_by_others_still_run_and_decide(watch):
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("miss", kw["key"])) or kw["key"] == "skip"
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("done", kw["key"]))
    watch.install()
    watch.start()
    assert _compile("skip") is True  # the other hook asked Triton not to compile: nothing compiled
    assert _compile("real") is False
    assert seen == [("miss", "skip"), ("miss", "real"), ("done", "real")]
    assert [e["kernel"].rsplit(".", 1)[1] for e in watch.compiled_while_serving()] == ["_tokens_kernel"]


def test_the_list_is_bounded(watch):
    watch.install()
    watch.start()
    for i in range(watch.MAX_KEPT + 5):
        _compile(("k", i))
    assert len(watch.compiled_while_serving()) == watch.MAX_KEPT


def test_server_info_lists_them(watch):
    from oscar_sglang.runtime.server_info import describe

    watch.install()
    assert describe({})["compiled_while_serving"] == []
    watch.start()
    _compile(("serving", 1))
    assert [e["kernel"] for e in describe({})["compiled_while_serving"]] == [
        "oscar_kernels.triton.channel_store._tokens_kernel"]


def test_the_backend_starts_the_watch_at_its_first_forward_after_capture(watch, monkeypatch):
    """Capture's metadata calls (in_capture=True) do not start it; a replay's or an eager forward's do."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from oscar_sglang.runtime.backend import OscarInt2TritonBackend

    monkeypatch.setattr(TritonAttnBackend, "init_forward_metadata_out_graph", lambda self, fb, in_capture=False: None)
    b = OscarInt2TritonBackend.__new__(OscarInt2TritonBackend)
    monkeypatch.setattr(b, "_prepare_forward", lambda fb, graph=False: None)
    b.init_forward_metadata_out_graph(SimpleNamespace(), in_capture=True)
    assert watch._state["serving_since"] is None
    b.init_forward_metadata_out_graph(SimpleNamespace())
    assert watch._state["serving_since"] is not None


def test_start_up_compiles_are_summed_per_kernel_and_logged_once(watch, caplog):
    watch.install()
    dec = dict(name="channel_kernel", module="oscar_kernels.triton.channel_attend")
    _compile(("bs", 639), pause=0.03, **dec)
    _compile(("bs", 8), pause=0.03, **dec)
    _compile(("chunk", 16))
    _compile(("warmup", 1), manual=True)  # a kernel's own .warmup(): not counted
    with caplog.at_level(logging.INFO, logger="oscar_sglang"):
        watch.start()
        watch.start()  # once
        _compile(("serving", 8192))  # after the start: a warning of its own, not in the summary
    got = watch.compiled_at_start()
    assert got["variants"] == 3
    names = [k["kernel"] for k in got["kernels"]]
    assert names == ["oscar_kernels.triton.channel_attend.channel_kernel",
                     "oscar_kernels.triton.channel_store._tokens_kernel"]  # slowest first
    assert got["kernels"][0]["variants"] == 2 and got["kernels"][0]["s"] >= 0.05
    assert got["s"] >= got["kernels"][0]["s"]
    summary = [r.getMessage() for r in caplog.records if "during start-up" in r.getMessage()]
    assert len(summary) == 1 and "3 kernel variants" in summary[0]
    assert summary[0].index("channel_kernel (2 x") < summary[0].index("_tokens_kernel (1 x")
    from oscar_sglang.runtime.server_info import describe

    assert describe({})["compiled_at_start"] == got
