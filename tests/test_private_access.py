"""The engine, the checkpoint package, ``frozen`` and ``pretrained`` meet through public
members only: none of them reads or calls another object's private member (``x._name``
where ``x`` is not ``self`` or ``cls``, or ``getattr(x, "_name")``). A private member is
free to change with its class; a module that reaches into another's makes both change
together, which is how the checkpointer came to depend on ten engine members."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = [
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "zerostate/engine").glob("*.py")),
    "zerostate/frozen.py",
    "zerostate/pretrained.py",
    "zerostate/coordinator.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "zerostate/checkpoint").glob("*.py")),
]

#: Accesses allowed anyway, per file, with why.
ALLOWED = {
    # torch's multi-tensor (foreach) kernels have no public name.
    ("zerostate/engine/facade.py", "torch._foreach_mul_"),
    # Hooks defined in the engine package itself hold the engine through a weak reference (so that
    # a dropped engine can be collected) and call back into it.
    ("zerostate/engine/facade.py", "engine._on_grad_ready"),
    ("zerostate/engine/facade.py", "engine._on_reduced"),
    ("zerostate/engine/facade.py", "engine._on_module_load"),
    ("zerostate/engine/facade.py", "engine._copy_module"),
    ("zerostate/engine/facade.py", "engine._convert_module"),
    # The conversion guard hands the call on to the class's own Module._apply, which torch
    # names nowhere else (.to(), .half(), .cuda(), to_empty() all go through it).
    ("zerostate/engine/facade.py", "type(module)._apply"),
    # torch.compile's wrapper keeps the compiled model there and names it nowhere else.
    ("zerostate/checkpoint/state.py", "getattr(module, '_orig_mod', module)"),
}

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
            if (path, expr) not in ALLOWED:
                bad.append(f"{path}:{line}: {expr}")
    assert not bad, "private members of other objects used:\n" + "\n".join(bad)
