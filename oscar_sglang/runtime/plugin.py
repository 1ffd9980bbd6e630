"""SGLang plugin entry point (`sglang.srt.plugins`: oscar_int2 = oscar_sglang.runtime.plugin:register).

SGLang's load_plugins() calls register() in the launching process and again in every spawned
scheduler process (each is a fresh interpreter), then applies the registered hooks. register()
adds the oscar_triton attention backend to SGLang's registry and hands the hooks to
hooks.install(), which applies and verifies them (SGLang would only log a failure).
"""
from __future__ import annotations

from .config import BACKEND
from .state import is_installed, require_hooks


def _register_backend() -> None:
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

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
    if is_installed():
        return
    from .hooks import install

    _register_backend()
    install()
