"""No import cycle among the modules of ``zerostate.store`` (module-level imports), the
step readers are siblings of one base rather than subclasses of each other, and the store
and the CLI load no training code."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
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


#: Training code: the engine and its configuration, the runtime and what only it uses,
#: the optimizers and loss scaling, the checkpoint sessions and what only they use, the
#: integrations. A name stands for the module or, for a package, everything under it.
TRAINING = (
    "zerostate.engine",
    "zerostate.config",
    "zerostate.runtime",
    "zerostate.dist",
    "zerostate.optim",
    "zerostate.checkpoint",
    "zerostate.integrations",
    "zerostate.models",
)

CLI = Path(__file__).resolve().parents[2] / "cli"

#: Run in a fresh interpreter: import every module of the store, the CLI's modules and
#: every library module the CLI imports (at any depth), and report what got loaded.
_PROBE = """
import importlib, json, pkgutil, sys
import zerostate.store, zerostate_cli
names = [m.name for m in pkgutil.walk_packages(zerostate.store.__path__, "zerostate.store.")]
names += sorted(
    f"zerostate_cli.{m.name}"
    for m in pkgutil.iter_modules(zerostate_cli.__path__)
    if m.name == "main" or m.name.startswith("cmd_")
)
names += sys.argv[1:]
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "loaded": sorted(sys.modules)}))
"""


def _training(loaded: list[str]) -> list[str]:
    return [m for m in loaded if any(m == t or m.startswith(t + ".") for t in TRAINING)]


def _cli_imports() -> set[str]:
    """The ``zerostate`` modules the CLI's sources import anywhere (inside commands too)."""
    out = set()
    for path in CLI.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
    return {m for m in out if m == "zerostate" or m.startswith("zerostate.")}


def test_the_training_list_names_modules_that_exist():
    # A module renamed or moved must be renamed here too, or the check below would pass
    # without looking at it.
    package = STORE.parent
    for name in TRAINING:
        path = package.parent.joinpath(*name.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), name
    assert _training(["zerostate.engine_state", "zerostate.runtime.group", "zerostate.store"]) == [
        "zerostate.runtime.group",
    ]


def test_the_store_and_the_cli_load_no_training_code():
    # [Note: the store is the ground floor] in zerostate.store
    cli_imports = sorted(_cli_imports())
    assert "zerostate.store.consolidate" in cli_imports, cli_imports
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *cli_imports],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    for name in (
        "zerostate.store.reader",
        "zerostate.store.reader_v2",
        "zerostate.store.foreign.deepspeed",
        "zerostate.store.foreign.dcp",
        "zerostate.store.consolidate",
        "zerostate.store.reshard",
        "zerostate_cli.main",
        "zerostate_cli.cmd_inspect",
    ):
        assert name in report["imported"], name
    training = _training(report["loaded"])
    assert not training, f"the store or the CLI loads training code: {training}"
