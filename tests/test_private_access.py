"""The engine, the checkpoint package (``frozen`` and ``pretrained`` included), the
integrations and the CLI meet through public members only: none of them reads or calls
another object's private member (``x._name`` where ``x`` is not ``self`` or ``cls``, or
``getattr(x, "_name")``). A private member is free to change with its class; a module that
reaches into another's makes both change together, which is how the checkpointer came to
depend on ten engine members.

Two checks beside it: no module outside ``zerostate/engine/`` touches a private member of
the engine, and the checkpoint code takes the engine's parts, never the engine ([Note:
engine parts] in zerostate.checkpoint.parts)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = [
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "zerostate/engine").glob("*.py")),
    "zerostate/dist/coordinator.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "zerostate/checkpoint").glob("*.py")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "zerostate/integrations").glob("*.py")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cli").glob("*.py")),
]

#: Accesses allowed anyway, per file, with why.
ALLOWED = {
    # torch's multi-tensor (foreach) kernels have no public name.
    ("zerostate/engine/facade.py", "torch._foreach_mul_"),
    ("zerostate/engine/pipeline.py", "torch._foreach_mul_"),
    # Hooks defined beside the engine hold it through a weak reference (so that a dropped
    # engine can be collected) and call back into it.
    ("zerostate/engine/hooks.py", "engine._on_grad_ready"),
    ("zerostate/engine/hooks.py", "engine._on_reduced"),
    # The conversion guard hands the call on to the class's own Module._apply, which torch
    # names nowhere else (.to(), .half(), .cuda(), to_empty() all go through it).
    ("zerostate/engine/guards.py", "type(module)._apply"),
    # torch.compile's wrapper keeps the compiled model there and names it nowhere else.
    ("zerostate/checkpoint/state.py", "getattr(module, '_orig_mod', module)"),
    # Lightning runs the callbacks' and the module's hooks through these, and a strategy
    # that steps the optimizer itself must run on_before_optimizer_step as Lightning does.
    ("zerostate/integrations/lightning.py", "call._call_callback_hooks"),
    ("zerostate/integrations/lightning.py", "call._call_lightning_module_hook"),
    # The Trainer's extension points are private methods (wrapping the model, resuming).
    ("zerostate/integrations/transformers.py", "super()._wrap_model"),
    ("zerostate/integrations/transformers.py", "super()._load_from_checkpoint"),
    ("zerostate/integrations/transformers.py", "super()._load_optimizer_and_scheduler"),
    ("zerostate/integrations/transformers.py", "super()._load_best_model"),
    ("zerostate/integrations/transformers.py", "super()._load_rng_state"),
    ("zerostate/integrations/transformers.py", "super()._load_scaler"),
    # accelerate takes the mesh it splits the data by from there and nowhere else.
    ("zerostate/integrations/transformers.py", "self.accelerator._prepare_device_mesh"),
    ("zerostate/integrations/transformers.py", "hasattr(self.accelerator, '_prepare_device_mesh')"),
    # argparse lists a parser's options only there.
    ("cli/main.py", "target._actions"),
}

#: Accesses allowed in any checked file: argparse names its subcommands action nowhere else.
ALLOWED_ANYWHERE = {"argparse._SubParsersAction"}

_BY_NAME = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_accesses(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """``(line, expression)`` for every access to another object's private member."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _BY_NAME
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            owner = node.args[0]
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_check_finds_private_access() -> None:
    source = (
        "class A:\n"
        "    def f(self, engine, ckpt):\n"
        "        self._ok = cls._ok = self.__dict__\n"
        "        engine._params\n"
        "        ckpt._exchange([1])\n"
        "        self.engine._mark_set([])\n"
        "        getattr(engine, '_checkpointer', None)\n"
        "        getattr(engine, 'public', None)\n"
        "        type(engine).__name__\n"
    )
    assert sorted(private_accesses(source)) == [
        (4, "engine._params"),
        (5, "ckpt._exchange"),
        (6, "self.engine._mark_set"),
        (7, "getattr(engine, '_checkpointer', None)"),
    ]


def test_no_private_access_across_engine_checkpoint_frozen_pretrained() -> None:
    assert (ROOT / "zerostate/checkpoint/__init__.py").exists()
    bad = []
    for path in CHECKED:
        for line, expr in private_accesses((ROOT / path).read_text(), path):
            if (path, expr) not in ALLOWED and expr not in ALLOWED_ANYWHERE:
                bad.append(f"{path}:{line}: {expr}")
    assert not bad, "private members of other objects used:\n" + "\n".join(bad)


ENGINE = ROOT / "zerostate/engine"


def engine_private_names() -> set[str]:
    """The private members of :class:`~zerostate.engine.Engine`: its private methods and
    properties and the private attributes it sets on ``self``."""
    names = set()
    for path in ENGINE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ClassDef) and node.name == "Engine"):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(inner.name)
                elif (
                    isinstance(inner, ast.Attribute)
                    and isinstance(inner.value, ast.Name)
                    and inner.value.id == "self"
                    and isinstance(inner.ctx, ast.Store)
                ):
                    names.add(inner.attr)
    return {n for n in names if _private(n)}


def test_no_module_outside_the_engine_touches_its_private_members() -> None:
    private = engine_private_names()
    assert {"_runtime", "_params", "_ckpt", "_check_open"} <= private, sorted(private)
    outside = [
        p
        for p in [*(ROOT / "zerostate").rglob("*.py"), *(ROOT / "cli").glob("*.py")]
        if ENGINE not in p.parents
    ]
    bad = []
    for path in outside:
        rel = str(path.relative_to(ROOT))
        for line, expr in private_accesses(path.read_text(), rel):
            name = expr.rsplit(".", 1)[-1] if not expr.endswith(")") else expr.split("'")[1]
            owner = expr.rsplit(".", 1)[0] if not expr.endswith(")") else expr.split(",")[0]
            if name in private or "engine" in owner.lower():
                bad.append(f"{rel}:{line}: {expr}")
    assert not bad, "private members of the engine used outside zerostate/engine/:\n" + "\n".join(
        bad
    )


def engine_parameters(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """``(line, function)`` for every function taking the engine: a parameter named
    ``engine`` or annotated with ``Engine``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is None:
                continue
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if arg.arg == "engine" or re.search(r"\bEngine\b", annotation):
                found.append((node.lineno, getattr(node, "name", "<lambda>")))
    return found


def test_the_check_finds_functions_taking_the_engine() -> None:
    source = (
        "def a(engine: Any) -> None: ...\n"
        "def b(parts: EngineParts, roots: EngineRoots) -> None: ...\n"
        "def c(x: Engine | None = None) -> None: ...\n"
        "class S:\n"
        "    def __init__(self, *, engine) -> None: ...\n"
    )
    assert engine_parameters(source) == [(1, "a"), (3, "c"), (5, "__init__")]


def test_the_checkpoint_code_takes_parts_not_the_engine() -> None:
    # [Note: engine parts] in zerostate.checkpoint.parts
    bad = []
    for path in (ROOT / "zerostate/checkpoint").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        bad += [f"{rel}:{line}: {name}" for line, name in engine_parameters(path.read_text(), rel)]
    assert not bad, "checkpoint functions that take the engine:\n" + "\n".join(bad)
