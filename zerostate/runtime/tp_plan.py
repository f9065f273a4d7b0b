"""``Engine(model, mesh=mesh, tp_plan=...)``: the engine applies torch's tensor parallelism.

[Note: tp plans]
``tp_plan={pattern: style}`` is what the user would pass to torch's
``parallelize_module(model, mesh["tp"], plan)``; the engine makes that call itself, once
the plan is checked, and then trains the DTensor parameters it produced as in [Note: tensor
parallelism] (zerostate.runtime.tp). A style is a torch ``ParallelStyle``
(``ColwiseParallel()``, ...) or one of the names of :data:`STYLES`, the vocabulary
transformers models use in their plans. ``tp_plan="auto"`` takes a transformers model's
own plan, ``config.base_model_tp_plan``, whose patterns are relative to the base model
(``model.model`` of a ``LlamaForCausalLM``), so they are prefixed with its path. Only
that plan: the heads' extra entries (``lm_head``) stay replicated.

Patterns follow ``parallelize_module``: split at dots, each part matched against child
module names with ``fnmatch`` (``layers.*.mlp.up_proj``). A pattern that matches no
module, a style name not in :data:`STYLES`, a plan on a model already parallelized or on a
mesh without ``tp`` is a :class:`ConfigError` raised on every rank before the first
collective ``parallelize_module`` runs (the verdict is agreed first, so no rank enters
the collectives alone).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatch
from typing import Any

from torch import nn

from zerostate.dist import collectives
from zerostate.errors import ConfigError


def _styles() -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    def colwise_replicated() -> Any:
        return ColwiseParallel(output_layouts=Replicate())

    def rowwise_replicated() -> Any:
        return RowwiseParallel(input_layouts=Replicate())

    return {
        # Input replicated, output sharded on the last dimension (torch's default).
        "colwise": ColwiseParallel,
        # Input sharded on the last dimension, output replicated (torch's default).
        "rowwise": RowwiseParallel,
        "colwise_rep": colwise_replicated,
        "colwise_gather_output": colwise_replicated,
        "rowwise_rep": rowwise_replicated,
        "rowwise_split_input": rowwise_replicated,
        # An nn.Embedding split by rows (vocabulary), token ids replicated.
        "embedding_rowwise": rowwise_replicated,
        "sequence_parallel": SequenceParallel,
    }


#: Style names a plan may use, as transformers' plans spell them.
STYLES = (
    "colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep",
    "rowwise_split_input", "embedding_rowwise", "sequence_parallel",
)  # fmt: skip


def _is_style(value: Any) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle

    return isinstance(value, ParallelStyle)


def check_spec(tp_plan: Any, mesh_names: tuple[str, ...] | None) -> None:
    """What can be checked of ``tp_plan`` without the model (config validation)."""
    if mesh_names is None or "tp" not in mesh_names:
        raise ConfigError(
            f"tp_plan= needs a mesh with a 'tp' dimension (mesh has {mesh_names}); pass "
            "mesh=init_device_mesh(..., mesh_dim_names=('dp_shard', 'tp'))"
        )
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise ConfigError(
                f"tp_plan={tp_plan!r}: the only plan given by name is 'auto' (a transformers "
                "model's config.base_model_tp_plan); otherwise pass {pattern: style}"
            )
        return
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        raise ConfigError(
            f"tp_plan must be 'auto' or a non-empty {{module pattern: style}} dict, got "
            f"{type(tp_plan).__name__}"
        )
    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"tp_plan pattern {pattern!r} is not a module name pattern")
        if isinstance(style, str):
            if style not in STYLES:
                raise ConfigError(
                    f"tp_plan[{pattern!r}] = {style!r} is not a known style; use one of "
                    f"{', '.join(STYLES)}, or a torch ParallelStyle such as ColwiseParallel()"
                )
        elif not _is_style(style):
            raise ConfigError(
                f"tp_plan[{pattern!r}] is a {type(style).__name__}; give a style name "
                f"({', '.join(STYLES)}) or a torch ParallelStyle such as ColwiseParallel()"
            )


def _auto_plan(model: nn.Module) -> dict[str, Any]:
    """The plan of the outermost transformers model in ``model`` (the model itself, or the
    one a LightningModule or another wrapper holds), under its base model's path."""
    owner = next(
        (
            m
            for m in model.modules()
            if getattr(getattr(m, "config", None), "base_model_tp_plan", None)
        ),
        None,
    )
    if owner is None:
        raise ConfigError(
            f"tp_plan='auto' takes a transformers model's config.base_model_tp_plan, and "
            f"{type(model).__name__} holds none; pass tp_plan={{pattern: style}}"
        )
    base_plan = owner.config.base_model_tp_plan
    base = getattr(owner, "base_model", owner)
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    return {f"{prefix}.{k}" if prefix else k: v for k, v in base_plan.items()}


def _matches(model: nn.Module, pattern: str) -> bool:
    """Whether ``pattern`` names a module, the way ``parallelize_module`` walks it."""
    frontier = [model]
    for atom in pattern.split("."):
        frontier = [c for m in frontier for n, c in m.named_children() if fnmatch(n, atom)]
    return bool(frontier)


def resolve(model: Any, tp_plan: Any) -> dict[str, Any]:
    """The ``{pattern: ParallelStyle}`` plan to apply to ``model``; local, no collective."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    parallel = [n for n, p in model.named_parameters() if collectives.is_dtensor(p)]
    if parallel:
        raise ConfigError(
            f"tp_plan= given, but the model is parallelized already ({parallel[0]} is a "
            "DTensor); drop tp_plan= (the engine takes the DTensors as they are) or pass "
            "the model before parallelize_module"
        )
    check_spec(tp_plan, ("tp",))
    plan = _auto_plan(model) if tp_plan == "auto" else dict(tp_plan)
    check_spec(plan, ("tp",))  # the model's own plan may name styles not in STYLES
    missing = [p for p in plan if not _matches(model, p)]
    if missing:
        raise ConfigError(
            f"tp_plan pattern(s) {missing} match no module of {type(model).__name__}; "
            "patterns name modules as model.named_modules() does, with '*' for any part "
            "(e.g. 'model.layers.*.self_attn.q_proj')"
        )
    styles = _styles()
    return {k: styles[v]() if isinstance(v, str) else v for k, v in plan.items()}


def describe(tp_plan: Any) -> Any:
    """What must agree across ranks about a plan."""
    if tp_plan is None or isinstance(tp_plan, str):
        return tp_plan
    return sorted((k, v if isinstance(v, str) else type(v).__name__) for k, v in tp_plan.items())


def apply(model: nn.Module, plan: dict[str, Any], tp_mesh: Any) -> None:
    """torch's ``parallelize_module`` over ``mesh["tp"]`` (collective over ``tp``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, plan)
