"""Building an engine: the settings, the checks every rank runs before anything changes,
and the verdict they agree on.

:func:`check_setup` builds the :class:`~zerostate.engine.config.EngineConfig`, checks the
model, the optimizer, the device mesh and the tp plan, and agrees over the ranks on the
verdict and on the model's aspects ([Note: arrival deadline] in zerostate.dist.arrival), so
that every rank raises the same error, or none does, before the engine touches the model.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, NamedTuple

import torch
from torch import nn

from zerostate.checkpoint import tensor_parallel as tp_checkpoint
from zerostate.dist import collectives
from zerostate.engine.config import EngineConfig, check_setting_names
from zerostate.errors import ConfigError, ZerostateError
from zerostate.optim import describe, resolve_user_optimizers, whole_matrix_names
from zerostate.runtime import activation, adapt, process_groups, tp, tp_plan

#: EngineConfig fields that configure the built-in AdamW; with optimizer= they are the
#: user optimizer's business.
ADAMW_FIELDS = ("lr", "betas", "eps", "weight_decay", "no_decay")


def first_names(names: list[str], limit: int = 8) -> str:
    """``names`` for an error message: the first ``limit``, then how many more."""
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def build_config(config: EngineConfig | None, kwargs: dict) -> EngineConfig:
    check_setting_names(kwargs)  # a typo or another trainer's name gets a did-you-mean
    if config is None:
        return EngineConfig(**kwargs)
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
    return dataclasses.replace(config, **kwargs) if kwargs else config


def validate_model(model: Any, config: EngineConfig, tensor_parallel: Any = None) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.named_parameters())
    if not params:
        raise ConfigError("the model has no parameters; there is nothing to train")
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        raise ConfigError(
            f"parameters live on several devices {sorted(map(str, devices))}; move the "
            "model to one device (each rank trains a full replica's worth of shards)"
        )
    tp.check_model(params, tensor_parallel)
    for name, p in params:
        # A frozen integer parameter is kept as replicated state (adapt.replicated_state).
        if not p.is_floating_point() and (p.requires_grad or p.is_meta):
            raise ConfigError(
                f"parameter {name} has dtype {p.dtype}; only floating-point parameters can "
                "be trained, and a frozen one must live on a real device. Register it as a "
                "buffer (module.register_buffer) or set requires_grad=False"
            )
    adapt.check_compile(model, config.stage)
    if any(p.is_meta for _, p in params) and config.stage != 3:
        raise ConfigError(
            f"the model is on the meta device, which only stage 3 can materialise shard by "
            f"shard (stage={config.stage}); use stage=3 or build the model on a real device"
        )


#: Attribute an Engine leaves on its model: ``(weakref to the engine, stage)``.
WRAPPED_BY = "_zerostate_wrapped_by"


def check_not_wrapped(model: Any) -> None:
    """Refuse a model another Engine already wraps (a re-run notebook cell, say): that
    engine's hooks and, at stage 3, its partitioning of the parameters stay on the model."""
    mark = getattr(model, "__dict__", {}).get(WRAPPED_BY)
    if mark is None:
        return
    ref, stage = mark
    if ref() is not None:
        raise ConfigError(
            f"this model is already wrapped by a zerostate Engine (stage {stage}), which owns "
            "its parameters and gradient hooks; keep using that engine, or build a fresh "
            "model for a new one (in a notebook, rebuild the model in the cell that builds "
            "the Engine)"
        )
    if any(p.numel() and not p.untyped_storage().nbytes() for p in model.parameters()):
        raise ConfigError(
            f"this model was wrapped by a stage-{stage} Engine, which partitioned its "
            "parameters (each rank kept only its shard); build a fresh model for a new Engine"
        )


def mark_wrapped(model: nn.Module, engine: Any, stage: int) -> None:
    object.__setattr__(model, WRAPPED_BY, (weakref.ref(engine), stage))


def model_aspects(model: nn.Module, config: EngineConfig | None) -> dict[str, Any]:
    if not isinstance(model, nn.Module):
        return {}
    params = list(model.named_parameters(remove_duplicate=False))
    return {
        "parameter names": [n for n, _ in params],
        "parameter shapes": [tuple(p.shape) for _, p in params],
        "parameter dtypes / requires_grad": [(str(p.dtype), p.requires_grad) for _, p in params],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        "engine settings": config.summary() if config is not None else None,
        # Not in summary(): a checkpoint's content does not depend on offload.
        "offload": (config.offload, config.offload_threads) if config is not None else None,
    }


class Setup(NamedTuple):
    """What :func:`check_setup` found, agreed by every rank."""

    config: EngineConfig
    resolved: Any
    """The user's optimizer(s) resolved against the model's parameters (None: AdamW)."""
    mesh: process_groups.MeshPlan | None
    """The device mesh's groups (None without ``mesh=``): ZeRO runs over its dp_shard
    group ([Note: hybrid sharding])."""
    group: Any
    """The group ZeRO partitions over (``group=``, or the mesh's dp_shard group)."""
    rank: int
    world_size: int
    device: torch.device


def check_setup(model: Any, config: EngineConfig | None, optimizer: Any, kwargs: dict) -> Setup:
    """Build the config and check the model, the optimizer, the mesh and the tp plan on
    every rank; collective: the verdict is agreed, so every rank raises or none does."""
    error: ZerostateError | None = None
    resolved: Any = None
    try:
        config = build_config(config, kwargs)
    except ConfigError as exc:
        error, config = exc, None
    if error is None and optimizer is not None and isinstance(model, nn.Module):
        try:
            resolved = check_optimizer(model, config, optimizer, kwargs)
        except ZerostateError as exc:
            error = exc
    mesh_given = (config.mesh if config is not None else kwargs.get("mesh")) is not None
    group = config.group if config is not None else kwargs.get("group")
    mesh: process_groups.MeshPlan | None = None
    if mesh_given:
        group = None  # until the mesh is checked; a refused mesh fails on the world
    if error is None and mesh_given:
        try:
            mesh = process_groups.plan_mesh(config.mesh, pick_device(model, config))
            group = mesh.shard_group
        except ZerostateError as exc:
            error = exc
    if config is not None and config.tp_plan is not None:
        apply_tp_plan(model, config, error, mesh)
    rank, world_size = collectives.group_info(group)
    # A mesh spans the default group: every rank of it agrees (and fails) together.
    agree_group = None if mesh_given else group
    agree_size = collectives.group_info(None)[1] if mesh_given else world_size
    if error is None:
        try:
            check_not_wrapped(model)
            validate_model(model, config, mesh.tp if mesh else None)
            if config.activation_checkpointing is not None:
                activation.check_blocks(model, config.checkpoint_modules)
            if mesh is not None:
                tp.check_optimizer(whole_matrix_names(optimizer), mesh.tp)
        except ZerostateError as exc:
            error = exc
    device = pick_device(model, config)
    collectives.check_agreement(
        {
            **model_aspects(model, config),
            "optimizer": describe(optimizer),
            "mesh": mesh.describe() if mesh is not None else None,
        },
        error,
        group=agree_group,
        world_size=agree_size,
        device=device,
    )
    return Setup(config, resolved, mesh, group, rank, world_size, device)


def apply_tp_plan(model: Any, config: EngineConfig, error: Any, mesh: Any) -> None:
    """``tp_plan=``: checked on every rank, the verdict agreed over the whole mesh (so
    no rank enters torch's collectives alone), then ``parallelize_module`` over
    ``mesh["tp"]`` ([Note: tp plans] in zerostate.runtime.tp_plan)."""
    plan = None
    if error is None:
        try:
            plan = tp_plan.resolve(model, config.tp_plan)
        except ZerostateError as exc:
            error = exc
    collectives.check_agreement(
        {"tp_plan": tp_plan.describe(config.tp_plan)},
        error,
        group=None,
        world_size=collectives.group_info(None)[1],
        device=pick_device(model, config),
    )
    tp_plan.apply(model, plan, mesh.tp.mesh)


def pick_device(model: Any, config: EngineConfig | None) -> torch.device:
    params = list(model.parameters()) if isinstance(model, nn.Module) else []
    if params and not params[0].is_meta:
        return params[0].device
    if config is not None and config.device is not None:
        return torch.device(config.device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_optimizer(model: nn.Module, config: EngineConfig, optimizer: Any, kwargs: dict) -> Any:
    defaults = EngineConfig()
    given = [f for f in ADAMW_FIELDS if f in kwargs or getattr(config, f) != getattr(defaults, f)]
    if given:
        values = ", ".join(f"{f}={getattr(config, f)!r}" for f in given)
        name = type(optimizer).__name__ if not isinstance(optimizer, list) else "optimizer"
        verb = "has" if len(given) == 1 else "have"
        raise ConfigError(
            f"Engine got {values} and optimizer={name}(...): {', '.join(given)} {verb} "
            "no effect with optimizer= (they configure the built-in AdamW); set them "
            f"where you build the optimizer ({name}(params, lr=...)) and drop them from "
            "Engine(...)"
        )
    return resolve_user_optimizers(optimizer, list(model.named_parameters()))


def contiguous_buffers(model: nn.Module) -> None:
    """Make every buffer contiguous (it stays a buffer, of the same persistence): buffers
    are replicated, broadcast by ``sync_module_states`` and checkpointed whole."""
    for module in model.modules():
        for n, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if not b.is_meta and not collectives.is_dtensor(b) and not b.is_contiguous():
                setattr(module, n, b.contiguous())  # stays a buffer, same persistence


def sync_module_states(model: nn.Module, local: list[torch.Tensor], mesh: Any, group: Any) -> None:
    """``sync_module_states``: rank 0's parameters (``local``: each one's local tensor) and
    buffers to every rank, over the mesh when there is one."""
    with torch.no_grad():
        # A DTensor buffer goes as its local tensor ([Note: buffers as torch treats them]
        # in zerostate.runtime.adapt).
        tp_mesh = mesh.tp.mesh if mesh is not None and mesh.tp is not None else None
        buffers = [adapt.buffer_to_sync(b, tp_mesh) for _, b in adapt.replicated_state(model)]
        states = [p.data for p in local] + [b for b in buffers if b is not None]
        states = [t for t in states if t.numel()]
        if mesh is not None:
            process_groups.broadcast_from_first(states, mesh)
        else:
            collectives.broadcast_from_first(states, group=group)


def checkpointed_blocks(
    model: nn.Module, config: EngineConfig, tensor_parallel: Any, device: torch.device
) -> activation.ActivationCheckpointing | None:
    """Checkpointed blocks ([Note: activation checkpoints] in zerostate.runtime.activation); None
    without ``activation_checkpointing``."""
    if config.activation_checkpointing is None:
        return None
    return activation.apply(
        model,
        config.activation_checkpointing,
        config.checkpoint_modules,
        tp=tensor_parallel,
        device=device,
    )


def checkpoint_world(
    config: EngineConfig, tensor_parallel: Any, rank: int, world_size: int
) -> tp_checkpoint.CheckpointWorld | None:
    """Who saves a checkpoint together under tensor parallelism ([Note: tensor-parallel
    checkpoints] in zerostate.checkpoint.tensor_parallel); None without a tp dimension."""
    if tensor_parallel is None:
        return None
    return tp_checkpoint.checkpoint_world(
        config.mesh, tensor_parallel.rank, tensor_parallel.size, rank, world_size
    )
