"""The package's layering, as the README's layout section draws it, kept true by reading the imports.

Every import in testbed/ counts, the ones inside functions too: a lazy import still ties two modules,
it only hides the tie from the reader. Each module belongs to the layer of its longest prefix in
LAYERS and may import only from its own layer or lower ones; the import graph has no circles. A test
beside the real check plants an upward import and a circle in a small package of its own, so the
check is known to catch both.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from testbed import _moved

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module may import its own layer and the ones above it in this list.
LAYERS = [
    ("base", ["testbed", "testbed._moved", "testbed.errors", "testbed.inputs", "testbed.stop", "testbed.children",
              "testbed.verdicts", "testbed.netguard", "testbed.report.tables", "testbed.report.implementations"]),
    ("configuration and store", ["testbed.config", "testbed.results"]),
    ("numbers: measuring, comparing, model inputs", ["testbed.measure", "testbed.oracles.numerical",
                                                     "testbed.models"]),
    ("devices", ["testbed.devices", "testbed.peers"]),
    ("backends", ["testbed.backends"]),
    ("oracles", ["testbed.oracles"]),
    ("experiments", ["testbed.experiments", "testbed.runner"]),
    ("report", ["testbed.report"]),
    ("lab", ["testbed.lab"]),
    ("commands", ["testbed.cli", "testbed.pytest_plugin", "testbed.__main__"]),
]


def modules(package_dir: Path) -> dict[str, Path]:
    found = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's own modules `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = name.split(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            wanted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in wanted:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target.split(".")[0] == top and target != name:
                targets.add(target)
    return targets


def layer_of(name: str, layers) -> int:
    best = max((prefix for _, prefixes in layers for prefix in prefixes
                if name == prefix or name.startswith(prefix + ".")), key=len)
    return next(i for i, (_, prefixes) in enumerate(layers) if best in prefixes)


def upward(graph: dict[str, set[str]], layers) -> list[str]:
    return sorted(f"{a} ({layers[layer_of(a, layers)][0]}) imports {b} ({layers[layer_of(b, layers)][0]})"
                  for a, targets in graph.items() for b in targets if layer_of(b, layers) > layer_of(a, layers))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    known = modules(package_dir)
    return {name: imports(name, path, known) for name, path in known.items()}


def test_testbed_has_no_import_circles():
    assert circles(import_graph(ROOT / "testbed")) == []


def test_no_module_imports_a_layer_above_its_own():
    assert upward(import_graph(ROOT / "testbed"), LAYERS) == []


def test_every_module_has_a_layer():
    """A new top-level module or package must be placed in LAYERS (and in the README's layout)."""
    for name in import_graph(ROOT / "testbed"):
        layer_of(name, LAYERS)  # raises ValueError when no prefix matches


def test_refimpl_uses_nothing_of_testbed():
    """The references are plain functions on numpy arrays: nothing they compute may depend on the
    framework that judges with them."""
    for path in (ROOT / "refimpl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "testbed" or n.startswith("testbed.") for n in names), path


def test_the_check_catches_an_upward_import_and_a_circle(tmp_path):
    pkg = tmp_path / "mini"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "high" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from mini.high import b  # lazy, still a tie\n")
    (pkg / "high" / "b.py").write_text("from mini.low import a\n")
    (pkg / "high" / "c.py").write_text("from . import b\n")
    layers = [("base", ["mini"]), ("low", ["mini.low"]), ("high", ["mini.high"])]
    graph = import_graph(pkg)
    assert graph["mini.high.c"] == {"mini.high.b"}  # a relative import is resolved
    assert upward(graph, layers) == ["mini.low.a (low) imports mini.high.b (high)"]
    assert circles(graph) == [["mini.high.b", "mini.low.a"]]
    (pkg / "low" / "a.py").write_text("def f():\n    return 1\n")
    graph = import_graph(pkg)
    assert upward(graph, layers) == [] and circles(graph) == []


@pytest.mark.parametrize("old", sorted(_moved.MODULES))
def test_an_old_module_path_is_the_moved_module_and_warns(old):
    """A lab's experiment written against testbed 0.1's flat paths still runs for one release."""
    new = _moved.MODULES[old]
    sys.modules.pop(old, None)  # an earlier import of the old name would not warn again
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


@pytest.mark.parametrize("package, name", [("testbed.oracles", "check_nmse"), ("testbed.measure", "time_alternating"),
                                           ("testbed.report", "night_log")])
def test_what_an_old_module_held_is_reached_through_its_package_with_a_warning(package, name):
    held = importlib.import_module(_moved.PACKAGES[package])
    with pytest.warns(DeprecationWarning, match=f"{package}.{name} moved to {_moved.PACKAGES[package]}"):
        value = getattr(importlib.import_module(package), name)
    assert value is getattr(held, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        getattr(importlib.import_module(package), "no_such_name")
