"""Fitting a peer's step (DeepSpeed ZeRO, DCP) to the engine that loads it.

A peer records less than a zerostate save: DCP says nothing of weight tying, a DeepSpeed
config may not name its optimizer class, and a peer may group parameters differently.
What a peer's step does not record is supplied here by the loading engine, on a copy of
the step's engine-state document, and what cannot fit is refused before the engine
changes ([Note: planned load] in zerostate.checkpoint.load_plan).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from zerostate.errors import CheckpointError
from zerostate.store.sources import open_source

if TYPE_CHECKING:
    from zerostate.checkpoint.parts import EngineParts


def open_any_step(
    parts: EngineParts, path: Any, step: int | None, storage_options: dict | None = None
) -> tuple[Any, dict]:
    """Open step ``step`` of the checkpoint at ``path`` (a path, URL or the engine's open
    :class:`~zerostate.store.root.CheckpointRoot`) in any readable format (zerostate,
    DeepSpeed ZeRO, DCP): ``(the step, its engine-state document)``; a peer's document is a
    copy fitted to the engine's ``parts`` (see :func:`fit_foreign_step`)."""
    st = open_source(path, storage_options=storage_options).step(step)
    try:
        state = st.attrs.get("engine", {})
        if isinstance(state, dict) and state.get("source") in ("deepspeed", "dcp"):
            state = fit_foreign_step(parts, st, copy.deepcopy(state))
        return st, state
    except BaseException:
        st.close()  # the caller never sees it: its threads go back now, not at GC
        raise


def fit_foreign_step(parts: EngineParts, st: Any, state: dict) -> dict:
    """``state`` (a peer step's engine-state document, the caller's copy) with what the
    peer does not record supplied by the loading engine's ``parts``: its weight tying (DCP
    stores tied aliases as separate tensors and says nothing of the tie; the aliases must
    hold the same values), its optimizer classes (when the peer's config does not name one), and its
    buffer names (DCP does not tell buffers from parameters: a buffer is read from
    ``model/<name>``). Refuses what cannot fit before the engine changes ([Note: planned
    load] in zerostate.checkpoint.load_plan)."""
    if state.get("tied") is None:
        for alias, canonical in parts.tied.items():
            if f"model/{alias}" in st.tensors and f"model/{canonical}" in st.tensors:
                if not torch.equal(st.read(f"model/{alias}"), st.read(f"model/{canonical}")):
                    raise CheckpointError(
                        f"this model ties {alias} to {canonical}, but the checkpoint at "
                        f"{st.url} holds different values for them"
                    )
        state["tied"] = dict(parts.tied)
    optimizer = state.get("optimizer")
    if isinstance(optimizer, dict) and optimizer.get("classes") is None:
        optimizer["classes"] = [cls.__name__ for cls in parts.optimizer_classes()]
    if isinstance(optimizer, dict):
        regroup(parts, optimizer, st.url)
    for view in parts.state_views():
        model_name = "model/" + view.name.removeprefix("buffers/")
        if view.name.startswith("buffers/") and view.name not in st.tensors:
            if model_name in st.tensors and st.supports_aliases:
                st.alias(view.name, model_name)
    return state


def regroup(parts: EngineParts, optimizer: dict, url: str) -> None:
    """Give the peer's group hyperparameters to the engine's own param groups (in
    ``optimizer``, the caller's copy): each engine group takes the settings of the peer
    group its parameters were in (the engine's built-in AdamW splits decay / no-decay
    parameters, a peer may keep them in one group, decaying all; the run continues as the
    peer ran it)."""
    mine = parts.group_names()
    theirs = optimizer.get("group_params")
    hyper = optimizer.get("param_groups")
    if theirs == mine or not isinstance(theirs, list) or not isinstance(hyper, list):
        return
    if not theirs and not optimizer.get("state"):  # a model state dict alone: fresh optimizer
        optimizer["group_params"], optimizer["param_groups"] = mine, [{} for _ in mine]
        return
    where = {n: i for i, members in enumerate(theirs) for n in members}
    regrouped = []
    for members in mine:
        groups = {where.get(n) for n in members}
        if None in groups or len(groups) > 1:
            raise CheckpointError(
                f"the checkpoint at {url} groups the parameters {members} differently "
                f"(its groups: {theirs}); build the engine with an optimizer whose param "
                "groups match the run that saved it"
            )
        regrouped.append(hyper[groups.pop()] if groups else (hyper[0] if hyper else {}))
    optimizer["group_params"], optimizer["param_groups"] = mine, regrouped
