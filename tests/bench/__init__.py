import importlib.util

from tests import ROOT


def load_render_docs(name: str):
    """bench/render_docs.py as the script runs it (loaded from its file, a module of its own per
    caller, so a test's monkeypatching of ROOT stays in that test's copy)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "render_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
