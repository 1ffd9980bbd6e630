"""Triton kernels compiled while serving: one warning each, and a list in /server_info.

A kernel variant (a Triton specialisation) that neither the start-up warm-up nor CUDA-graph
capture compiled is compiled by the first request that needs it, and that request waits for it
(about a second on a machine whose Triton cache is empty). On 2026-11-27 the first 32K request on
two bare machines took 1.8-2.0x a warm one's TTFT with OSCAR_DECODE_STORE=fused, and the server
log could not say why. The backend calls start() at the first forward after CUDA-graph capture;
from then on each in-process Triton cache miss (a compile, or a load from Triton's disk cache) is
logged with the kernel, its time and its signature, and listed in /server_info under
oscar_int2.compiled_while_serving. The compiles before it (the warm-up's and CUDA-graph capture's)
are summed per kernel and logged once when serving starts, slowest first, and listed under
oscar_int2.compiled_at_start: on a bare H100 the default's start spent ~230 s in the prefill
warm-up (116.6 s) and the decode graph capture (114.8 s, 86 s of it on its first batch), mostly
compiling (2026-11-28, the server log lines in bench/results/serving/
2026-11-28_0049_int2-fp16-paired_64x8k_h100.json, startup_s 322), and which kernels take it was
not known. (The per-token recipe's whole start on the same machine afterwards, caches warm: 102 s.)

Triton's runtime hooks (knobs.runtime.jit_cache_hook / jit_post_compile_hook, Triton >= 3.4) are
chained, not replaced: a hook someone else set still runs, and what it returns is returned.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger("oscar_sglang")

MAX_KEPT = 64  # entries kept for /server_info (the log has every one)
TOP_AT_START = 6  # kernels named in the start-up summary line

_state: dict = {"installed": False, "serving_since": None, "pending": {}, "compiled": [], "at_start": {}}


def _name(fn) -> str:
    """module.name of Triton's JitFunctionInfo (its module is the kernel's __module__ string)."""
    module = getattr(fn, "module", "") or ""
    module = getattr(module, "__name__", module)  # typed as a module object in Triton's dataclass
    return f"{module}.{getattr(fn, 'name', '?')}" if module else str(getattr(fn, "name", "?"))


def _on_miss(prev, kwargs):
    skip = prev(**kwargs) if prev is not None else None  # truthy: Triton compiles nothing
    if not skip and not kwargs.get("is_manual_warmup"):
        _state["pending"][(_name(kwargs.get("fn")), repr(kwargs.get("key")))] = time.perf_counter()
    return skip


def _on_compiled(prev, kwargs):
    name = _name(kwargs.get("fn"))
    t0 = _state["pending"].pop((name, repr(kwargs.get("key"))), None)
    if t0 is not None and _state["serving_since"] is None:  # start-up: summed per kernel
        n_ms = _state.setdefault("at_start", {}).setdefault(name, [0, 0.0])
        n_ms[0] += 1
        n_ms[1] += (time.perf_counter() - t0) * 1e3
    elif t0 is not None:
        now = time.perf_counter()
        entry = {"kernel": name, "ms": round((now - t0) * 1e3, 1),
                 "after_start_s": round(now - _state["serving_since"], 1)}
        if len(_state["compiled"]) < MAX_KEPT:
            _state["compiled"].append(entry)
        logger.warning("OSCAR INT2: Triton compiled (or loaded from its disk cache) %s while serving "
                       "(%.0f ms, %.1f s after the first forward): the start-up did not compile this "
                       "variant, so a request waited for it; signature %s",
                       name, entry["ms"], entry["after_start_s"], str(kwargs.get("repr", ""))[:600])
    return prev(**kwargs) if prev is not None else None


def install() -> bool:
    """Chain the watch into Triton's runtime hooks (once per process). False where this Triton
    has no such hooks (nothing is watched then; said once in the log)."""
    if _state["installed"]:
        return True
    try:
        from triton import knobs

        rt = knobs.runtime
        prev_miss, prev_done = rt.jit_cache_hook, rt.jit_post_compile_hook
    except (ImportError, AttributeError):
        logger.info("OSCAR INT2: this Triton has no runtime compile hooks; kernels compiled while "
                    "serving are not reported")
        return False
    rt.jit_cache_hook = lambda **kw: _on_miss(prev_miss, kw)
    rt.jit_post_compile_hook = lambda **kw: _on_compiled(prev_done, kw)
    _state["installed"] = True
    return True


def start() -> None:
    """The first forward after capture: compiles from here on are a request's wait. Logs what
    the start-up compiled (compiled_at_start) once."""
    if _state["serving_since"] is None:
        _state["serving_since"] = time.perf_counter()
        done = compiled_at_start()
        if done["variants"]:
            top = ", ".join(f"{k['kernel']} ({k['variants']} x, {k['s']:.1f} s)"
                            for k in done["kernels"][:TOP_AT_START])
            logger.info("OSCAR INT2: Triton compiled (or loaded from its disk cache) %d kernel variants "
                        "during start-up, %.1f s in all; slowest: %s", done["variants"], done["s"], top)


def compiled_at_start() -> dict:
    """{variants, s, kernels: [{kernel, variants, s}] slowest first} of the compiles before
    start(): the warm-up's and CUDA-graph capture's."""
    per = _state.get("at_start", {})
    kernels = sorted(({"kernel": k, "variants": n, "s": round(ms / 1e3, 2)} for k, (n, ms) in per.items()),
                     key=lambda e: -e["s"])
    return {"variants": sum(n for n, _ in per.values()), "s": round(sum(ms for _, ms in per.values()) / 1e3, 2),
            "kernels": kernels}


def compiled_while_serving() -> list:
    """[{kernel, ms, after_start_s}] of the compiles since start() (at most MAX_KEPT)."""
    return [dict(e) for e in _state["compiled"]]
