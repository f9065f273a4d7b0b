"""No import cycle among the modules of ``zerostate.store`` (module-level imports), and the
step readers are siblings of one base rather than subclasses of each other."""

from __future__ import annotations

import ast
from pathlib import Path

import zerostate.store
from zerostate.store.foreign.base import ForeignStep
from zerostate.store.reader import StepReader
from zerostate.store.reader_v2 import StepReaderV2
from zerostate.store.step_base import StepBase

STORE = Path(zerostate.store.__file__).resolve().parent


def _module(path: Path) -> str:
    parts = path.relative_to(STORE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """``zerostate.store`` modules imported at module level (not inside functions)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n.startswith("zerostate.store")}
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the store modules it imports. ``from zerostate.store import format``
    depends on the submodule; a package's ``__init__`` runs before any of its modules
    anyway, so an edge to a package counts only when nothing more specific was named."""
    modules = {_module(p): p for p in STORE.rglob("*.py")}
    packages = {_module(p) for p in STORE.rglob("__init__.py")}
    graph = {}
    for m, p in modules.items():
        found = {n for n in _imports(p) if n in modules and n != m}
        graph[m] = {
            n for n in found if n not in packages or not any(o.startswith(n + ".") for o in found)
        }
    return graph


def test_no_import_cycle_in_store():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert "zerostate.store.step_base" in graph and graph["zerostate.store.reader_v2"]


def test_the_readers_are_siblings():
    for reader in (StepReader, StepReaderV2, ForeignStep):
        assert StepBase in reader.__mro__
    assert not issubclass(StepReaderV2, StepReader) and not issubclass(StepReader, StepReaderV2)
    assert not issubclass(ForeignStep, (StepReader, StepReaderV2))
    assert StepReaderV2.supports_references and not StepReader.supports_references
    assert ForeignStep.supports_aliases and not StepReaderV2.supports_aliases
