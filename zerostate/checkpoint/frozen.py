"""Frozen parameters are written once per checkpoint root; later steps refer to them.

A save decides, before any byte is written, which frozen parameters (``requires_grad``
False: a LoRA run's base model) it can take from the root's latest committed step instead
of writing them again ([Note: tensor references] in ``store/refs.py``). Each rank hashes
its owned range of every frozen parameter and compares it with the hash that step's
manifest recorded for the same rank; one all-gather of the verdicts makes every rank
agree, and a tensor is referenced only where every rank matched. Anything that cannot be
checked (no earlier step, another world size or layout, an unreadable step, a changed
tensor) is written in full: the fallback is always the plain save.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from zerostate.store.refs import TensorRef, shard_digest

log = logging.getLogger(__name__)

#: Key of the per-rank hashes in a step's ``rank_state``.
RANK_STATE_KEY = "frozen"


@dataclass(slots=True)
class FrozenReferences:
    """What one save writes of the frozen parameters."""

    #: Tensors the step refers to (not written).
    refs: list[TensorRef] = field(default_factory=list)
    #: This rank's ``{name: {"digest": hex, "step": holder}}`` for the step's rank_state.
    digests: dict[str, dict] = field(default_factory=dict)

    @property
    def skipped(self) -> set[str]:
        return {r.spec.name for r in self.refs}


class SaveSource(Protocol):
    """What :func:`reference_frozen` needs of the save it decides for (a save session)."""

    @property
    def document(self) -> dict:
        """The engine-state document the save records (its ``frozen`` names)."""

    @property
    def pieces(self) -> list[Any]:
        """This rank's pieces (``.spec``, ``.source``: the owned slice) of every view."""

    @property
    def coordinator(self) -> Any:
        """The save's :class:`~zerostate.dist.coordinator.Coordinator`."""


def reference_frozen(
    save: SaveSource, root: Any, step: int, latest: int | None
) -> FrozenReferences:
    """Collective: every rank calls it with the same arguments; it never raises for a
    problem of one rank (that rank votes "write everything" instead). ``save`` is the save
    session, ``root`` its :class:`~zerostate.store.root.CheckpointRoot`, ``latest`` its
    latest committed step as rank 0 listed it before the save (None: the root holds none)."""
    coordinator = save.coordinator
    names = sorted(f"model/{n}" for n in save.document.get("frozen", []))
    if not names:
        return FrozenReferences()
    base, holders, digests, specs = -1, {}, {}, {}
    try:
        pieces = {p.spec.name: p for p in save.pieces if p.spec.name in names}
        specs = {n: pieces[n].spec for n in names}
        digests = {n: shard_digest(pieces[n].source) for n in names}
        base, holders = _matching(coordinator, root, latest, specs, digests)
    except Exception as exc:  # noqa: BLE001 - the plain save is always correct
        log.warning("zerostate: frozen tensors of step %d are written in full: %s", step, exc)
        base, holders = -1, {}
    votes = [base, *(1 if n in holders else 0 for n in names)]
    rows = coordinator.exchange(votes)
    agreed = len({r[0] for r in rows}) == 1 and rows[0][0] >= 0 and bool(specs)
    refs, recorded = [], {}
    for i, name in enumerate(names, start=1):
        if agreed and all(r[i] for r in rows):
            refs.append(TensorRef(specs[name], holders[name]))
            recorded[name] = {"digest": digests[name], "step": holders[name]}
        elif name in digests:
            recorded[name] = {"digest": digests[name], "step": step}
    return FrozenReferences(refs, recorded)


def _matching(
    coordinator: Any,
    root: Any,
    latest: int | None,
    specs: dict[str, Any],
    digests: dict[str, str],
) -> tuple[int, dict[str, int]]:
    """``(latest committed step, {name: holder step})`` of the tensors whose owned range
    on this rank equals what that step holds for this rank."""
    if latest is None:
        return -1, {}
    with root.step(latest) as st:
        if not st.supports_references or st.world_size != coordinator.world_size:
            return -1, {}
        prior = (st.rank_state(coordinator.rank) or {}).get(RANK_STATE_KEY)
        if not isinstance(prior, dict):
            return st.step, {}
        refs = st.refs
        holders = {}
        for name, spec in specs.items():
            entry, info = prior.get(name), st.tensors.get(name)
            if not isinstance(entry, dict) or info is None:
                continue
            holder = refs.get(name, st.step)
            same_spec = (
                tuple(info.shape) == spec.shape
                and info.dtype == spec.dtype
                and info.layout.to_json() == spec.layout.to_json()
            )
            if same_spec and entry.get("digest") == digests[name] and entry.get("step") == holder:
                holders[name] = holder
        return st.step, holders


def adapter_attrs(module: Any) -> dict:
    """``{"peft": {"adapter_name", "config"}}`` for a peft model (its active adapter's
    configuration as ``adapter_config.json`` holds it), else ``{}``: recorded at save so
    that ``zerostate consolidate --trainable-only`` can write a directory peft loads."""
    configs = getattr(module, "peft_config", None)
    name = getattr(module, "active_adapter", None)
    if not isinstance(configs, dict) or not isinstance(name, str) or name not in configs:
        return {}
    try:
        config = _json_value(configs[name].to_dict())
    except Exception as exc:  # noqa: BLE001 - the save itself does not need it
        log.warning("zerostate: the peft config of adapter %r is not recorded: %s", name, exc)
        return {}
    return {"peft": {"adapter_name": name, "config": config}}


def _json_value(value: Any) -> Any:
    """peft's ``to_dict()`` as plain JSON, as ``save_pretrained`` writes it (sets as lists,
    enums as their values)."""
    import enum

    if isinstance(value, enum.Enum):
        return _json_value(value.value)
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_json_value(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"{type(value).__name__} is not JSON")
