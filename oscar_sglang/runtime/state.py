"""Per-process state of the plugin, in a module that imports nothing of ours.

* whether the hooks were installed and verified (set by hooks.install(), read by every int2
  code path through require_hooks() and by /server_info through hooks_ok());
* RUNTIME_INFO: what this scheduler process loaded (filled by configurator.build_pool, read by
  the server-info and metrics hooks).

Kept apart so that the modules reading it need not import the modules writing it (that is what
made plugin -> hooks -> configurator -> server_info -> plugin a cycle).
"""
from __future__ import annotations

_install = {"registered": False, "error": None}

# What this process loaded (filled by configurator.build_pool); read by server_info / metrics.
RUNTIME_INFO: dict = {}


class HookInstallError(RuntimeError):
    pass


def mark_installed(error: str | None) -> None:
    _install["registered"] = True
    _install["error"] = error


def is_installed() -> bool:
    return _install["registered"]


def require_hooks() -> None:
    """Raise if the plugin is not fully installed in this process (called by int2 paths)."""
    if not _install["registered"]:
        raise HookInstallError(
            "oscar-sglang's SGLang plugin is not loaded in this process: install the package "
            "(pip install oscar-sglang) so its sglang.srt.plugins entry point is found, and do "
            "not exclude it with SGLANG_PLUGINS"
        )
    if _install["error"]:
        raise HookInstallError(_install["error"])


def hooks_ok() -> bool:
    return _install["registered"] and not _install["error"]
