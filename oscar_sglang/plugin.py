"""SGLang plugin entry point (`sglang.srt.plugins`: oscar_int2 = oscar_sglang.plugin:register).

SGLang's load_plugins() calls register() in the launching process and again in every spawned
scheduler process (each is a fresh interpreter), then applies the registered hooks. Failures in
either step are only logged by SGLang, so register() applies and verifies the hooks itself:
if any is missing, the error is kept and raised by require_hooks(), which every int2 code path
calls (and, if "int2" is on the command line, register() exits the process at once).
"""
from __future__ import annotations

import logging
import sys

logger = logging.getLogger("oscar_sglang")

_state = {"registered": False, "error": None}


class HookInstallError(RuntimeError):
    pass


def _register_backend() -> None:
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from .hooks import BACKEND

    if BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND])
    if BACKEND not in ATTENTION_BACKENDS:

        @register_attention_backend(BACKEND)
        def _make_oscar_backend(runner):
            require_hooks()
            from .backend import OscarInt2TritonBackend

            return OscarInt2TritonBackend(runner)


def register() -> None:
    """Register the oscar_triton backend and the int2 hooks; apply and verify them."""
    if _state["registered"]:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .hooks import HOOKS, verify_hooks

    _register_backend()
    for target, kind, fn in HOOKS:
        HookRegistry.register(target, fn, HookType[kind])
    # Apply now (idempotent: load_plugins' own apply_hooks skips patched targets) so we can
    # check the result here instead of trusting a log line.
    HookRegistry.apply_hooks()
    missing = verify_hooks()
    _state["registered"] = True
    if missing:
        msg = (
            "oscar-sglang: these SGLang hooks did not apply, so --kv-cache-dtype int2 cannot "
            "work (is this sglang==0.5.17?):\n  " + "\n  ".join(missing)
        )
        _state["error"] = msg
        logger.error(msg)
        if "int2" in sys.argv:
            # SGLang would only log an exception: stop the start here, loudly.
            print(msg, file=sys.stderr)
            raise SystemExit(2)
    else:
        logger.info("oscar-sglang: %d hooks applied, oscar_triton backend registered", len(HOOKS))


def require_hooks() -> None:
    """Raise if the plugin is not fully installed in this process (called by int2 paths)."""
    if not _state["registered"]:
        raise HookInstallError(
            "oscar-sglang's SGLang plugin is not loaded in this process: install the package "
            "(pip install oscar-sglang) so its sglang.srt.plugins entry point is found, and do "
            "not exclude it with SGLANG_PLUGINS"
        )
    if _state["error"]:
        raise HookInstallError(_state["error"])


def hooks_ok() -> bool:
    return _state["registered"] and not _state["error"]
