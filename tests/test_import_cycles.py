"""The library's modules import each other without cycles: a cycle hidden behind a
function-level import still ties two modules' order of initialisation together and makes
every refactor of either a puzzle. Imports under ``if TYPE_CHECKING:`` do not count (they
never run); ``from package import submodule`` depends on the submodule, not on the
package's ``__init__``. The benchmarks are held to the same rule."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zerostate", "cli")


def _modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name.replace("cli", "zerostate_cli", 1) if package == "cli" else name] = path
    return out


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The library modules ``name`` imports anywhere in its code (at any depth)."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = name.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{alias.name}" for alias in node.names]
            found.update(subs)
            if not all(s in modules for s in subs):
                found.add(module)  # a name from the module (or package) itself

    Visitor().visit(ast.parse(path.read_text(), str(path)))
    out = set()
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_finder_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_library():
    modules = _modules()
    assert "zerostate.engine" in modules and "zerostate_cli.main" in modules
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert graph["zerostate.engine"], "the finder must see the engine's imports"
    cycles = _cycles(graph)
    detail = [" / ".join(f"{m} -> {sorted(set(graph[m]) & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_no_import_cycle_in_the_benchmarks():
    modules = _modules(("benchmarks",))
    assert "benchmarks.common" in modules and "benchmarks.forked" in modules
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert graph["benchmarks.step"], "the finder must see the benchmarks' imports"
    cycles = _cycles(graph)
    detail = [" / ".join(f"{m} -> {sorted(set(graph[m]) & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(detail)
