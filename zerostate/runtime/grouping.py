"""Which parameters form a group: size buckets (replicated parameters) or module units
(partitioned parameters).

[Note: module units]
With partitioned parameters a group is a module whose parameters are gathered when it is
entered and released when autograd is done with it. The default units are the children of
the outermost containers (``nn.ModuleList`` or ``nn.ModuleDict``, whatever their names):
a transformer's blocks, whether kept in a list (Hugging Face) or a dict keyed by layer
(torchtitan). Parameters of no unit, or shared by several modules (tied weights), join the
root group, gathered for the whole forward and backward. A unit is gathered whole, subtree
included: containers nested inside a unit never split it further, so a mixture-of-experts
block keeping one module per expert is gathered once when the block is entered, on every
rank, whichever experts its tokens are routed to.

Units that run on some ranks only (heads picked per sample, a top-level list of experts,
a block skipped on some ranks) need no setting: the runtime finds them at run time and
gathers on demand ([Note: conditional units] in zerostate.runtime.runtime).
``leaf_modules`` (module names or classes) still makes a module one whole group: a
container named there is gathered with its owner (or, at the top, with the root), which
trades memory for the per-unit exchanges of conditional units. ``unit_policy`` replaces
the default choice of units.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from zerostate.runtime.sharded import ShardedParam
from zerostate.runtime.tp import model_param

UnitPolicy = Callable[[str, nn.Module], bool]


def split_into_buckets(params: list[ShardedParam], bucket_numel: int) -> list[list[ShardedParam]]:
    """Consecutive runs of ``params`` of at most ``bucket_numel`` elements (at least one
    parameter per bucket, so a parameter larger than a bucket gets its own)."""
    buckets: list[list[ShardedParam]] = []
    current: list[ShardedParam] = []
    size = 0
    for p in params:
        if current and size + p.numel > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel
    if current:
        buckets.append(current)
    return buckets


def _owns_params(name: str, module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def leaf_matcher(leaf_modules: Sequence[Any] | None) -> Callable[[str, nn.Module], bool]:
    """``leaf_modules`` entries are module names (``"heads"``, ``"model.layers.3"``),
    class names (``"MixtralSparseMoeBlock"``) or classes."""
    names = {e for e in leaf_modules or () if isinstance(e, str)}
    classes = tuple(e for e in leaf_modules or () if isinstance(e, type))

    def match(name: str, module: nn.Module) -> bool:
        return name in names or type(module).__name__ in names or isinstance(module, classes)

    return match


def select_units(
    model: nn.Module, policy: UnitPolicy | None, leaf_modules: Sequence[Any] | None
) -> dict[str, nn.Module]:
    """Module name -> module of every unit ([Note: module units]); no unit contains
    another."""
    is_leaf = leaf_matcher(leaf_modules)
    modules = list(model.named_modules())
    if policy is None:
        blocks = set()
        for name, module in modules:
            if _is_container(module):
                # A container inside a container runs no forward of its own: its own
                # children are the blocks (a dict of lists, a list of lists).
                blocks.update(
                    f"{name}.{c}" if name else c
                    for c, child in module.named_children()
                    if not _is_container(child)
                )
        policy = (lambda name, m: name in blocks) if blocks else _owns_params
    selected: dict[str, nn.Module] = {}
    whole: list[str] = []  # selected modules: nothing below them is split
    for name, module in modules:
        if not name or any(name.startswith(w + ".") for w in whole):
            continue
        if _is_container(module) and is_leaf(name, module):
            # A container never runs a forward of its own: its owner is entered instead
            # (the experts' block: router and experts), or, at the top, the root.
            if "." in name:
                parent = name.rsplit(".", 1)[0]
                _select(selected, whole, parent, dict(modules)[parent])
            else:
                for inner in [s for s in selected if s.startswith(name + ".")]:
                    del selected[inner]
                whole.append(name)
        elif is_leaf(name, module) or (not _is_container(module) and policy(name, module)):
            _select(selected, whole, name, module)
    return selected


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _select(selected: dict[str, nn.Module], whole: list[str], name: str, module: nn.Module):
    # A unit replaces any unit selected inside it.
    for inner in [s for s in selected if s.startswith(name + ".")]:
        del selected[inner]
    whole[:] = [w for w in whole if not w.startswith(name + ".")]
    selected[name] = module
    whole.append(name)


def assign_units(
    model: nn.Module, sparams: list[ShardedParam], units: dict[str, nn.Module]
) -> tuple[list[ShardedParam], list[tuple[str, nn.Module, list[ShardedParam]]]]:
    """Root members, and ``(name, module, members)`` per unit that owns parameters, in
    the model's module order. A parameter owned by several modules joins the root."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(name)
    members: dict[str, list[ShardedParam]] = {}
    for sp in sparams:
        names = owners[id(model_param(sp.param))]
        target = ""
        if len(names) == 1:
            (owner,) = names
            for unit in units:
                if (owner == unit or owner.startswith(unit + ".")) and len(unit) > len(target):
                    target = unit
        members.setdefault(target, []).append(sp)
    root = members.pop("", [])
    return root, [(n, units[n], members[n]) for n in units if n in members]
