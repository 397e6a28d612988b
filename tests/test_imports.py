"""The package's import graph, read from the source with ``ast`` (every import, including those
inside functions): it has no cycle, no lazy ``"module:attr"`` string import is left, and outside
``asps_jax/controls/`` only that package itself is imported, never one of its modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "asps_jax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (``from a import b`` counts ``a.b`` when that is
    a module, else ``a``)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        edges = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    package = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}".rstrip(".")
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in files else base)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def _cycle(graph) -> list[str] | None:
    """One import cycle (a list of modules, first = last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    graph = _graph()
    assert "asps_jax.verify.registry" in graph and "asps_jax.decode" in graph
    # A package's __init__ imports its modules (re-exports): an edge from a module to its own
    # package's __init__ would then close a cycle, so such an edge counts as one too.
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_verifiers_sit_below_the_registry():
    graph = _graph()
    verifiers = ("chain", "multi", "tree", "tree_rules", "options", "verdict", "checks")
    for name in verifiers:
        module = f"asps_jax.verify.{name}"
        assert not graph[module] & {"asps_jax.verify.registry", "asps_jax.verify.api"}, module
    assert "asps_jax" not in graph["asps_jax.models.cards"]


def test_no_lazy_string_import_is_left():
    pattern = re.compile(r"""["']asps_jax(\.\w+)+:\w+["']""")
    hits = [
        f"{p.relative_to(PACKAGE.parent)}: {m.group(0)}"
        for p in PACKAGE.rglob("*.py")
        for m in pattern.finditer(p.read_text())
    ]
    assert not hits, hits
    for p in PACKAGE.rglob("*.py"):
        assert 'importlib.import_module(f"asps_jax' not in p.read_text() or p.name == "base.py", p


def _controls_reads(path: Path, modules: set[str]) -> list[str]:
    """The places where ``path`` reaches past ``asps_jax.controls`` into one of its modules:
    ``import asps_jax.controls.m``, ``from asps_jax.controls.m import ...``, ``from
    asps_jax.controls import m`` and ``controls.m`` (the package's modules are ``modules``)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            hits += [a.name for a in node.names if a.name.startswith("asps_jax.controls.")]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.startswith("asps_jax.controls."):
                hits.append(f"from {node.module}")
            elif node.module == "asps_jax.controls":
                hits += [f"from asps_jax.controls import {a.name}" for a in node.names
                         if a.name in modules]  # fmt: skip
        elif isinstance(node, ast.Attribute) and node.attr in modules:
            if isinstance(node.value, ast.Name) and node.value.id == "controls":
                hits.append(f"controls.{node.attr}")
    return [f"{path.relative_to(PACKAGE.parent)}:{h}" for h in hits]


def test_outside_the_controls_package_only_its_facade_is_imported():
    controls = PACKAGE / "controls"
    modules = {p.stem for p in controls.glob("*.py")} - {"__init__"}
    assert {"penalties", "constraints", "automaton", "facade"} <= modules
    outside = [p for p in PACKAGE.rglob("*.py") if controls not in p.parents]
    hits = [h for p in outside for h in _controls_reads(p, modules)]
    assert not hits, hits
    decode = ast.parse((PACKAGE / "decode.py").read_text())
    reads = [
        node.module
        for node in ast.walk(decode)
        if isinstance(node, ast.ImportFrom)
        and ("controls" in (node.module or "") or any(a.name == "controls" for a in node.names))
    ]
    assert reads == ["asps_jax"], reads  # decode: `from asps_jax import controls`, nothing else
