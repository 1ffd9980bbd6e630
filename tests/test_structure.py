"""The package's architecture, checked from the source (no import is executed):

* the modules the plugin entry point reaches (every import, including those inside functions)
  are runtime, common and oscar_kernels modules only: no calibration, evaluation, CLI or command;
* no import cycle anywhere in oscar_sglang, counting imports inside functions;
* tools -> runtime -> common, never upwards;
* every hook is listed in runtime/hooks.py's HOOKS table and nowhere else registers one.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests import ROOT, load_toml

SOURCES = {"oscar_sglang": ROOT / "oscar_sglang", "oscar_kernels": ROOT / "kernels" / "oscar_kernels"}


def _modules() -> dict[str, Path]:
    out = {}
    for top, base in SOURCES.items():
        for p in base.rglob("*.py"):
            parts = [top, *p.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _parents(name: str) -> list[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imports(name: str, path: Path) -> set[str]:
    """Our modules that `name` imports, anywhere in its body (module level or in functions)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()

    def add(mod: str) -> None:
        if mod in MODULES:
            found.add(mod)
            found.update(p for p in _parents(mod) if p in MODULES)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            add(mod)
            for a in node.names:  # `from pkg import submodule`
                add(f"{mod}.{a.name}")
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _reached(start: str) -> set[str]:
    seen, todo = set(), [start, *_parents(start)]
    while todo:
        m = todo.pop()
        if m in seen or m not in GRAPH:
            continue
        seen.add(m)
        todo.extend(GRAPH[m])
    return seen


def _entry_point() -> str:
    eps = load_toml()["project"]["entry-points"]
    return eps["sglang.srt.plugins"]["oscar_int2"].split(":")[0]


def test_the_graph_sees_the_known_edges():
    """Guard against a parser that finds nothing: known imports, including function-level ones."""
    assert "oscar_sglang.runtime.configurator" in GRAPH["oscar_sglang.runtime.hooks"]  # in a function
    assert "oscar_sglang.common.rotations" in GRAPH["oscar_sglang.runtime.configurator"]
    assert "oscar_kernels.ops" in GRAPH["oscar_sglang.runtime.layouts"]
    assert "oscar_sglang.runtime.layouts" in GRAPH["oscar_sglang.runtime.pool"]
    assert "oscar_sglang.tools.calibration.pipeline" in GRAPH["oscar_sglang.tools.calibration"]
    assert len(MODULES) > 40


def test_the_entry_point_reaches_only_the_runtime():
    start = _entry_point()
    assert start == "oscar_sglang.runtime.plugin"
    reached = _reached(start)
    assert "oscar_sglang.runtime.backend" in reached and "oscar_sglang.runtime.pool" in reached
    offline = sorted(m for m in reached if m.startswith("oscar_sglang.tools"))
    assert offline == [], f"the server plugin imports offline tools: {offline}"
    allowed = ("oscar_sglang.runtime", "oscar_sglang.common", "oscar_kernels")
    assert all(m == "oscar_sglang" or m.startswith(allowed) for m in reached), sorted(reached)


def test_layers_only_import_downwards():
    rank = {"oscar_sglang.common": 0, "oscar_sglang.runtime": 1, "oscar_sglang.tools": 2}

    def layer(m):
        return next((r for p, r in rank.items() if m == p or m.startswith(p + ".")), None)

    upward = [(a, b) for a, deps in GRAPH.items() for b in deps
              if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)]
    assert upward == []


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH.get(m, ())):
            # a package's __init__ importing its own submodule is not a cycle with that submodule
            # importing a sibling: only edges between distinct modules that are not parent/child
            if m.startswith(d + "."):
                continue
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_hooks_are_registered_in_one_place():
    """Only runtime/hooks.py talks to HookRegistry, and its HOOKS table lists each target once."""
    users = sorted(n for n, p in MODULES.items() if "HookRegistry" in p.read_text())
    assert users == ["oscar_sglang.runtime.hooks"]
    tree = ast.parse(MODULES["oscar_sglang.runtime.hooks"].read_text())
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "HOOKS" for t in n.targets))
    rows = [(e.elts[0].value, e.elts[1].value) for e in table.elts]
    assert len(rows) == len(set(rows)) >= 9
