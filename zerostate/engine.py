"""The training engine: sequences forward, backward, the partitioned step and state access.

State lives elsewhere (``ShardedParam`` per parameter; the parameter groups of
:mod:`zerostate.runtime`, which own buckets or stage-3 units and do all communication
through :mod:`zerostate.comm`); this module only orchestrates and never looks at the
stage beyond handing it to the runtime.

One optimizer step (``K = grad_accum_steps``):

1. ``engine(*args)`` runs the module between the strategy's forward hooks.
2. ``engine.backward(loss)``, K times: the (fp16: scaled) loss is back-propagated; gradient
   hooks hand each gradient to the strategy, which accumulates it and launches bucket /
   unit collectives while backward runs; what is left is flushed. After the last one each
   ``.grad`` is a stand-in that raises on use, naming ``grad_clip=`` ([Note: gradient
   stand-ins] in zerostate.runtime.grad_stand_in).
3. ``engine.step()``: on the K-th call, each rank's gradient (shard) is taken in fp32 and
   divided by ``world_size * K * loss_scale`` (the mean over the global batch); one
   all-reduce of the squared norm and per-parameter gradient flags gives the global norm,
   the overflow verdict and which parameters to step on every rank; the optimizer
   (zerostate.optim) updates the fp32 master shards; the strategy refreshes the working
   parameters; gradients are zeroed. With ``offload`` the gradient shards went to the host
   during the last backward, as each group's reduce completed; scaling, the norm, clipping
   and the optimizer then run on the host masters ([Note: offload] in
   zerostate.runtime.offload).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import types
import warnings
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from zerostate import activation, adapt, collectives
from zerostate.checkpoint import (  # imported here, not on the first save or load
    Checkpointer,
    SaveHandle,
)
from zerostate.collectives import CommStats
from zerostate.comm import BufferPool, CommContext
from zerostate.config import EngineConfig, check_setting_names
from zerostate.coordinator import Coordinator
from zerostate.engine_state import AppliedLoad, LoadPlan, check_tensors, check_tying
from zerostate.errors import ConfigError, CorruptCheckpointError, ZerostateError
from zerostate.optim import (
    OptimizerLoad,
    ShardedOptimizer,
    describe,
    link_user_optimizers,
    resolve_user_optimizers,
    sum_of_squares,
    whole_matrix_names,
)
from zerostate.partition import TensorLayout, even_layout
from zerostate.precision import LossScaler
from zerostate.pretrained import PretrainedReport, load_pretrained
from zerostate.progress import ProgressLog
from zerostate.runtime import hollow, tp, tp_checkpoint, tp_plan
from zerostate.runtime import mesh as meshes
from zerostate.runtime.offload import HostTier, wait_copies
from zerostate.runtime.runtime import GroupRuntime, StageUsageError, holds_no_values
from zerostate.sharded import ShardedParam, ShardView
from zerostate.store.state_doc import ENGINE_STATE_VERSION, check_document

__all__ = ["Engine", "EngineConfig", "EngineUsageError", "ShardView"]

log = logging.getLogger(__name__)

#: EngineConfig fields that configure the built-in AdamW; with optimizer= they are the
#: user optimizer's business.
_ADAMW_FIELDS = ("lr", "betas", "eps", "weight_decay", "no_decay")


def _first_names(names: list[str], limit: int = 8) -> str:
    """``names`` for an error message: the first ``limit``, then how many more."""
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class EngineUsageError(ZerostateError, RuntimeError):
    """The engine's methods were called in an order it cannot honour."""


def _build_config(config: EngineConfig | None, kwargs: dict) -> EngineConfig:
    check_setting_names(kwargs)  # a typo or another trainer's name gets a did-you-mean
    if config is None:
        return EngineConfig(**kwargs)
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
    return dataclasses.replace(config, **kwargs) if kwargs else config


def _validate_model(model: Any, config: EngineConfig, tensor_parallel: Any = None) -> None:
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
_WRAPPED_BY = "_zerostate_wrapped_by"


def _check_not_wrapped(model: Any) -> None:
    """Refuse a model another Engine already wraps (a re-run notebook cell, say): that
    engine's hooks and, at stage 3, its partitioning of the parameters stay on the model."""
    mark = getattr(model, "__dict__", {}).get(_WRAPPED_BY)
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


def _mark_wrapped(model: nn.Module, engine: Engine) -> None:
    object.__setattr__(model, _WRAPPED_BY, (weakref.ref(engine), engine.stage))


def _model_aspects(model: nn.Module, config: EngineConfig | None) -> dict[str, Any]:
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


class _GradReadyHook:
    """Post-accumulate-grad hook of one trainable parameter; reaches its engine weakly.

    torch's garbage collector does not look inside post-accumulate-grad hooks (they live
    in the tensor's C++ autograd metadata), so a hook holding the engine would close the
    cycle engine -> model -> parameter -> hook -> engine where no collector can see it.
    Every engine would then live until interpreter shutdown, and with it its process
    group, which ``destroy_process_group()`` could then not free: gloo's worker threads
    would run on into interpreter shutdown.
    """

    __slots__ = ("_engine", "_index")

    def __init__(self, engine: Engine, index: int) -> None:
        self._engine = weakref.ref(engine)
        self._index = index

    def __call__(self, param: torch.Tensor) -> None:
        engine = self._engine()
        if engine is not None:
            engine._on_grad_ready(self._index)


class _ModuleLoadHook:
    """``load_state_dict`` pre-hook of one module with engine parameters in its subtree;
    reaches its engine weakly (the module outlives a closed engine) and hands the load to
    :meth:`Engine._on_module_load` ([Note: model.load_state_dict after wrapping])."""

    __slots__ = ("_engine", "_owned", "_tree")

    def __init__(
        self,
        engine: Engine,
        owned: dict[str, ShardedParam],
        tree: list[tuple[str, nn.Parameter]],
    ) -> None:
        self._engine = weakref.ref(engine)
        self._owned = owned  # the module's own parameter name -> its ShardedParam
        self._tree = tree  # every engine parameter under the module, by relative name

    def __call__(
        self, module: nn.Module, state_dict: Mapping, prefix: str, metadata: Any, *_: Any
    ) -> None:
        engine = self._engine()
        if engine is not None:
            engine._on_module_load(module, self._owned, self._tree, state_dict, prefix, metadata)

    def __deepcopy__(self, memo: dict) -> _ModuleLoadHook:
        # A deep copy of the module drops this hook ([Note: deep copies of a wrapped
        # model]); copying it first would copy the engine's shards and masters for nothing.
        return self


class _ModuleCopyGuard:
    """``__deepcopy__`` of every module with engine parameters under it, put in the
    module's ``__dict__`` bound to it (``copy.deepcopy`` looks the method up on the
    instance); reaches its engine weakly and hands the copy to :meth:`Engine._copy_module`
    ([Note: deep copies of a wrapped model])."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)

    def __call__(self, module: nn.Module, memo: dict) -> nn.Module:
        engine = self._engine()
        if engine is None:  # the module outlived its engine
            return _plain_deepcopy(module, memo)
        return engine._copy_module(module, memo)


class _ModuleConvertGuard:
    """``_apply`` of every module with partitioned engine parameters under it (the method
    behind ``.to()``, ``.half()``, ``.double()``, ``.cuda()``, ``to_empty()`` and
    ``share_memory()``), put in the module's ``__dict__`` bound to it; reaches its engine
    weakly ([Note: converting a partitioned model])."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine = weakref.ref(engine)

    def __call__(self, module: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
        engine = self._engine()
        if engine is None:  # the module outlived its engine
            return type(module)._apply(module, fn, recurse)
        return engine._convert_module(module, fn, recurse)


def _plain_deepcopy(module: nn.Module, memo: dict) -> nn.Module:
    """``copy.deepcopy(module, memo)`` past the module's own :class:`_ModuleCopyGuard`
    (taken out of its ``__dict__`` for the copy, then put back)."""
    own = module.__dict__.pop("__deepcopy__", None)
    try:
        return copy.deepcopy(module, memo)
    finally:
        if own is not None:
            module.__dict__["__deepcopy__"] = own


def _reduced_hook(ref: weakref.ref) -> Any:
    """The runtime's ``on_reduced`` for an offloading engine, holding it weakly (as
    :class:`_GradReadyHook` does)."""

    def hook(group: Any) -> None:
        engine = ref()
        if engine is not None:
            engine._on_reduced(group)

    return hook


def _weak_call(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` (bound), holding its object weakly: a hook that outlives it does nothing."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


class Engine:
    """ZeRO stage 0-3 data-parallel training of ``model`` with a partitioned optimizer.

    ``Engine(model, config=None, *, optimizer=None, **settings)``: settings are
    :class:`EngineConfig` fields. ``optimizer`` is a torch optimizer built over the model's
    parameters (any param groups), or a list of them (``[Muon(matrices), AdamW(rest)]``);
    the engine runs that class with those hyperparameters on its fp32 master shards
    (see zerostate.optim). Without it, AdamW from ``lr``, ``betas``, ``eps``,
    ``weight_decay`` and ``no_decay``. ``torch.distributed`` must be initialised (one
    process is fine); construction is collective over ``group``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
        **kwargs: Any,
    ):
        error: ZerostateError | None = None
        self._resolved: Any = None
        try:
            config = _build_config(config, kwargs)
        except ConfigError as exc:
            error, config = exc, None
        if error is None and optimizer is not None and isinstance(model, nn.Module):
            try:
                self._resolved = self._check_optimizer(model, config, optimizer, kwargs)
            except ZerostateError as exc:
                error = exc
        mesh_given = (config.mesh if config is not None else kwargs.get("mesh")) is not None
        group = config.group if config is not None else kwargs.get("group")
        #: The device mesh's groups (None without ``mesh=``): ZeRO runs over its dp_shard
        #: group, which is ``group`` from here on ([Note: hybrid sharding]).
        self._mesh: meshes.MeshPlan | None = None
        if mesh_given:
            group = None  # until the mesh is checked; a refused mesh fails on the world
        if error is None and mesh_given:
            try:
                self._mesh = meshes.plan_mesh(config.mesh, self._pick_device(model, config))
                group = self._mesh.shard_group
            except ZerostateError as exc:
                error = exc
        if config is not None and config.tp_plan is not None:
            self._apply_tp_plan(model, config, error)
        self.rank, self.world_size = collectives.group_info(group)
        # A mesh spans the default group: every rank of it agrees (and fails) together.
        agree_group = None if mesh_given else group
        agree_size = collectives.group_info(None)[1] if mesh_given else self.world_size
        if error is None:
            try:
                _check_not_wrapped(model)
                _validate_model(model, config, self._mesh.tp if self._mesh else None)
                if config.activation_checkpointing is not None:
                    activation.check_blocks(model, config.checkpoint_modules)
                if self._mesh is not None:
                    tp.check_optimizer(whole_matrix_names(optimizer), self._mesh.tp)
            except ZerostateError as exc:
                error = exc
        device = self._pick_device(model, config)
        collectives.check_agreement(
            {
                **_model_aspects(model, config),
                "optimizer": describe(optimizer),
                "mesh": self._mesh.describe() if self._mesh is not None else None,
            },
            error,
            group=agree_group,
            world_size=agree_size,
            device=device,
        )
        self.config: EngineConfig = config
        self._checkpointer: Any = None  # created by the first save() or load()
        self.module = model
        self.group = group
        self.device = device
        self.stage = config.stage
        self.dtype = config.working_dtype
        self._stats = CommStats()
        #: The control collectives of the engine's group, bound once and shared by the
        #: runtime, the checkpointer and load_pretrained ([Note: one coordinator]).
        self.coordinator = Coordinator(
            group=group,
            rank=self.rank,
            world_size=self.world_size,
            device=device,
            arrival_timeout_s=config.collective_timeout_s,
            stats=self._stats,
        )
        #: The same over dp_replicate, for [Note: one replica writes]; None without it.
        self._replica_coordinator = meshes.replica_coordinator(self._mesh, self.coordinator)
        self._pool = BufferPool(device)
        self._ctx = CommContext(
            group=group,
            rank=self.rank,
            world_size=self.world_size,
            param_dtype=self.dtype,
            reduce_dtype=config.reduce_torch_dtype,
            stats=self._stats,
            pool=self._pool,
            replicas=self._mesh.replicas if self._mesh is not None else None,
        )
        self._scaler = LossScaler(
            enabled=config.precision == "fp16",
            initial_scale=config.initial_loss_scale,
            window=config.loss_scale_window,
            min_scale=config.min_loss_scale,
        )
        self._micro_step = 0
        self.last_grad_norm: float | None = None
        self._bucket_numel = max(1, int(config.bucket_mb * 2**20) // self.dtype.itemsize)

        # Names without torch.compile's "_orig_mod." (see [Note: canonical names]).
        named, self.tied = adapt.named_parameters(model)
        no_decay = config.no_decay or (lambda name, p: p.ndim < 2)
        # [Note: partition rule]: every parameter is split evenly over the ranks.
        #: The mesh's tp dimension ([Note: tensor parallelism] in zerostate.runtime.tp).
        self._tp = self._mesh.tp if self._mesh is not None else None
        # A DTensor parameter is partitioned as its local shard (tp.LocalParam).
        local = [(n, tp.local_view(p)) for n, p in named]
        self._params = [
            ShardedParam(
                n, p, even_layout(p.numel(), self.world_size), self.rank, bool(no_decay(n, p))
            )
            for n, p in local
        ]
        self._init_buffers()
        if config.sync_module_states and not any(p.is_meta for _, p in named):
            with torch.no_grad():
                # A DTensor buffer goes as its local tensor ([Note: buffers as torch
                # treats them] in zerostate.adapt).
                tp_mesh = self._tp.mesh if self._tp is not None else None
                buffers = [
                    adapt.buffer_to_sync(b, tp_mesh) for _, b in adapt.replicated_state(model)
                ]
                states = [p.data for _, p in local] + [b for b in buffers if b is not None]
                states = [t for t in states if t.numel()]
                if self._mesh is not None:
                    meshes.broadcast_from_first(states, self._mesh)
                else:
                    collectives.broadcast_from_first(states, group=group)

        self._runtime = GroupRuntime(
            self._ctx,
            self._params,
            stage=self.stage,
            bucket_numel=self._bucket_numel,
            coordinator=self.coordinator,
        )
        self._runtime.setup(model, config)
        self._trainable = self._runtime.trainable
        # Parameters frozen when the engine was built, watched for a gradient at each step
        # ([Note: parameters unfrozen later]).
        self._frozen = [
            (sp.name, tp.model_param(sp.param)) for sp in self._params if not sp.trainable
        ]
        self._told_unfrozen: set[str] = set()
        # True while backward() runs ([Note: gradients from another backward]).
        self._backward_open = False
        #: The host tier of offloaded state ([Note: offload] in zerostate.runtime.offload).
        self._host: HostTier | None = None
        if config.offload is not None:
            self._host = HostTier(
                self._params,
                self._trainable,
                device=self.device,
                params_too=config.offload == "params",
                threads=config.offload_threads,
            )
            self._runtime.on_reduced = _reduced_hook(weakref.ref(self))
        # Names whose values no initialiser wrote ([Note: unset state], runtime/init.py).
        self._unset: set[str] = set(self._runtime.unset)
        # Names a load_pretrained that failed while reading may have partly written, and
        # its source ([Note: torn weights]).
        self._torn: set[str] = set()
        self._torn_source = ""
        self._optimizer = self._build_optimizer()
        link_user_optimizers(optimizer, self._optimizer, self)  # [Note: live user optimizer]
        self._optimizer.fence_loads(_weak_call(self._before_update))  # [Note: one fence]
        # [Note: whose optimizer state dict]: None where every rank holds the same state.
        replicated = not self._runtime.policy.shard_optimizer and self._tp is None
        owner = collectives.group_info(None) if collectives.is_initialized() else (0, 1)
        self._optimizer.guard_state_dicts(None if replicated else owner)
        _mark_wrapped(model, self)
        #: Checkpointed blocks ([Note: activation checkpoints] in zerostate.activation).
        self._activation = None
        if config.activation_checkpointing is not None:
            self._activation = activation.apply(
                model, config.activation_checkpointing, config.checkpoint_modules,
                tp=self._tp, device=device,
            )  # fmt: skip
        #: Who saves a checkpoint together under tensor parallelism ([Note: tensor-parallel
        #: checkpoints] in zerostate.runtime.tp_checkpoint); None without a tp dimension.
        self.checkpoint_world = None
        if self._tp is not None:
            self.checkpoint_world = tp_checkpoint.checkpoint_world(
                config.mesh, self._tp.rank, self._tp.size, self.rank, self.world_size
            )
        self._progress = ProgressLog(config.log_every)
        # Building a torch optimizer has just imported a module that can pin the default
        # process group for the life of the process ([Note: pinned default group]).
        collectives.release_import_time_group_pins()
        self._closed = False
        self._grad_hooks = [
            sp.param.register_post_accumulate_grad_hook(_GradReadyHook(self, i))
            for i, sp in enumerate(self._trainable)
        ]
        # [Note: model.load_state_dict after wrapping], [Note: deep copies of a wrapped
        # model], [Note: converting a partitioned model]
        self._copying = self._converting = False
        self._load_hooks, self._guarded = self._watch_modules()

    # -- construction helpers -------------------------------------------------------------
    def _apply_tp_plan(self, model: Any, config: EngineConfig, error: Any) -> None:
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
            device=self._pick_device(model, config),
        )
        tp_plan.apply(model, plan, self._mesh.tp.mesh)

    @staticmethod
    def _pick_device(model: Any, config: EngineConfig | None) -> torch.device:
        params = list(model.parameters()) if isinstance(model, nn.Module) else []
        if params and not params[0].is_meta:
            return params[0].device
        if config is not None and config.device is not None:
            return torch.device(config.device)
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @staticmethod
    def _check_optimizer(
        model: nn.Module, config: EngineConfig, optimizer: Any, kwargs: dict
    ) -> Any:
        defaults = EngineConfig()
        given = [
            f for f in _ADAMW_FIELDS if f in kwargs or getattr(config, f) != getattr(defaults, f)
        ]
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

    def _init_buffers(self) -> None:
        # Buffers are replicated; rank 0 checkpoints each persistent one whole.
        for module in self.module.modules():
            for n, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                if not b.is_meta and not collectives.is_dtensor(b) and not b.is_contiguous():
                    setattr(module, n, b.contiguous())  # stays a buffer, same persistence
        state = adapt.replicated_state(self.module)  # buffers + frozen integer parameters
        self._buffer_names = [n for n, _ in state]
        self._non_persistent = adapt.non_persistent_buffers(self.module)
        # What checkpoints hold: non-persistent buffers are neither saved nor loaded
        # ([Note: buffers as torch treats them] in zerostate.adapt).
        skip = set(self._non_persistent)
        self._saved_buffer_names = [
            n for n in self._buffer_names if adapt.canonical_name(n) not in skip
        ]

    def _build_optimizer(self) -> ShardedOptimizer:
        c = self.config

        # Which parameters received a gradient in this accumulation window, on this rank;
        # step() ORs it across ranks (see [Note: uniform stepping] in zerostate.optim).
        self._got_grad = [False] * len(self._trainable)
        optimizer = ShardedOptimizer(
            self._trainable,
            self._resolved,
            adamw=dict(lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay),
            gather=self._runtime.gather_full,
            host_step=self._host is not None,
        )
        self._resolved = None  # holds the user's optimizer; not needed any more
        return optimizer

    def _on_grad_ready(self, index: int) -> None:
        param = self._trainable[index].param
        if not self._backward_open:
            self._refuse_stray_grad(index)
        if isinstance(param, tp.LocalParam):
            # A Partial gradient is summed over tp before it is used.
            param.settle_grad(self._tp.stats)
        self._got_grad[index] = True
        self._runtime.on_grad_ready(index)

    # -- training ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open("engine(...)")
        if self._unset:
            self._refuse_unset()
        if self._torn:
            self._refuse_torn("engine(...)")
        self._runtime.pre_forward()
        cast = self.dtype if self.config.cast_forward_inputs else None
        args, kwargs = adapt.cast_inputs(args, kwargs, cast)
        self._progress.note_batch(args, kwargs)
        out = self.module(*args, **kwargs)
        self._runtime.post_forward()
        return out

    forward = __call__

    def _arrive(self, what: str) -> None:
        """See [Note: arrival deadline] in zerostate.collectives."""
        self.coordinator.arrive(what)

    def _refuse_unset(self) -> None:
        names = sorted(self._unset)
        shown = _first_names(names)
        raise EngineUsageError(
            f"{len(names)} tensor(s) of this meta-device model have no initialiser and were "
            f"never loaded: {shown}. Call engine.load_pretrained(...) or engine.load(...) "
            "first, or pass init_fn=callable(module) to initialise them"
        )

    def _mark_set(self, names: Any) -> None:
        self._unset.difference_update(names)
        self._torn.difference_update(names)

    def _mark_torn(self, names: Any, source: str) -> None:
        """[Note: torn weights]
        ``load_pretrained`` reads straight into the masters, a piece at a time, so that its
        extra memory stays one read piece whatever the model's size. A read that fails
        after others went through (an I/O error, an object store that stops answering
        after the retries, a file changed under the load) leaves those tensors part file,
        part what they were, on every rank that had read some of its part. Staging the
        whole model to undo that would cost the memory the call promises not to use, so
        the engine remembers the names instead: training on them, saving them and handing
        them back from ``close()`` are refused, naming the call that failed, until a
        ``load_pretrained`` or a ``load`` writes them. Every rank records the same names
        (its plan lists every matched tensor, whatever share it holds), so every rank
        refuses the same calls. Inspection (``full_state_dict()``, ``gathered()``) still
        works."""
        self._torn.update(names)
        self._torn_source = source

    def _refuse_torn(self, what: str) -> None:
        names = sorted(self._torn)
        shown = _first_names(names)
        raise EngineUsageError(
            f"{what} refused: load_pretrained({self._torn_source!r}) failed while reading "
            f"and left {len(names)} tensor(s) partly written, neither the model's values "
            f"nor the file's: {shown}. Call engine.load_pretrained(...) again, or "
            "engine.load(...), to set them"
        )

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss (its mean over the local batch)."""
        self._check_open("backward()")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise EngineUsageError(
                "backward() needs the scalar loss returned by a forward through the engine "
                "(a 1-element tensor that requires grad)"
            )
        accum = self.config.grad_accum_steps
        if self._micro_step >= accum:
            raise EngineUsageError(
                f"backward() called {self._micro_step + 1} times without step(); call "
                f"step() after every backward() (it steps every grad_accum_steps={accum})"
            )
        self._runtime.prepare(boundary=self._micro_step + 1 == accum)
        self._progress.note_loss(loss)
        if self._scaler.enabled:
            loss = loss.float() * self._scaler.scale
        self._backward_open = True
        try:
            loss.backward()
        finally:
            self._backward_open = False
        self._runtime.finish_backward()
        self._micro_step += 1

    def step(self) -> bool:
        """Apply the optimizer on accumulation boundaries; True if parameters changed."""
        self._check_open("step()")
        if self._micro_step == 0:
            raise EngineUsageError(
                "step() called without backward(); call engine.backward(loss) first"
            )
        if self._micro_step < self.config.grad_accum_steps:
            return False
        if self._frozen:
            self._tell_unfrozen()
        self._runtime.uncover_grads()  # [Note: gradient stand-ins] in zerostate.runtime
        if self._host is not None:
            grads = self._host_grads()
        else:
            grads = [
                g if g.dtype == torch.float32 else g.float() for g in self._runtime.step_grads()
            ]
        divisor = self.data_parallel_size * self.config.grad_accum_steps * self._scaler.scale
        torch._foreach_mul_(grads, 1.0 / divisor)
        # One all-reduce gives the global squared norm and, per parameter, how many ranks
        # saw a gradient (a parameter no rank saw is not stepped, as torch skips it).
        if self._tp is not None:  # tp-sharded squares over tp, tp-replicated ones once
            squares = tp.sum_of_squares(grads, self._trainable, self._tp, sum_of_squares)
        else:
            squares = sum_of_squares(grads)
        flags = torch.tensor(self._got_grad, dtype=torch.float32, device=squares.device)
        folded = torch.cat([squares, flags]).to(self.device)
        self._runtime.reduce_norm_and_flags(folded)
        if self._tp is not None:
            tp.all_reduce(folded, self._tp)
        folded = folded.to(squares.device)  # offload: the grads to clip are on the host
        norm = folded[:1].sqrt()
        stepped = (folded[1:] > 0).tolist()
        self._got_grad = [False] * len(self._trainable)
        self.last_grad_norm = float(norm)
        overflow = self._scaler.enabled and not math.isfinite(self.last_grad_norm)
        if self.config.grad_clip is not None and not overflow:
            coef = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0).reshape(())
            torch._foreach_mul_(grads, coef)
        if not overflow:
            self._before_update()
            if self._host is not None:
                with self._host.step_threads():
                    self._optimizer.step(grads, stepped)
            else:
                self._optimizer.step(grads, stepped)
            self._runtime.refresh()
        self._scaler.update(overflow)
        self._runtime.zero()
        self._micro_step = 0
        self._stats.end_step()
        if self._ctx.replicas is not None:
            self._ctx.replicas.stats.end_step()
        if self._tp is not None:
            self._tp.stats.end_step()
        self._progress.after_step(self)
        return not overflow

    def _refuse_stray_grad(self, index: int) -> None:
        """A gradient reached a parameter outside :meth:`backward`: drop it and raise.

        [Note: gradients from another backward]
        The engine takes each gradient as autograd accumulates it (its post-accumulate
        hook) and reduces it with its bucket, so it only knows what to do with one inside
        ``engine.backward(loss)``, which prepares the buckets and finishes them. Two habits
        reach the parameters from another backward. A DDP script's ``loss.backward()``
        (``step()`` then refused it, but the hooks had already run). And a GAN's
        generator step, ``engine_g.backward(loss_g)`` with ``loss_g`` computed through the
        discriminator's engine, the recipe of PyTorch's DCGAN example, which lets the
        generator's loss fill the discriminator's ``.grad`` and discards it with
        ``netD.zero_grad()`` before the discriminator's next step. Here that gradient
        reached buckets already reduced in the discriminator's last step and raised "arrived
        after its group was reduced ... report it with the model" (2 ranks, stages 0-3),
        which named neither the cause nor the fix; with gradient accumulation it could
        land in the discriminator's next update instead. The engine cannot set such a
        gradient aside for a later ``zero_grad()`` (at stages 2-3 it would have to hold a
        whole unreduced gradient), so the gradient is dropped from ``.grad`` (a later
        backward must not add to it) and the backward raises, naming the two fixes:
        ``engine.backward(loss)``, or freezing the parameters around a backward that must
        not train them, which equals torch's DCGAN recipe step for step."""
        sp = self._trainable[index]
        tp.model_param(sp.param).grad = None
        raise EngineUsageError(
            f"the gradient of {sp.name} arrived outside this engine's backward(): a backward "
            "the engine did not start reached its parameters (loss.backward() instead of "
            "engine.backward(loss), or another model's loss through this one, as a GAN's "
            "generator loss through the discriminator). The engine reduces gradients as "
            "they arrive and cannot keep one for a later zero_grad(); it was dropped. Call "
            "engine.backward(loss) for this engine's losses, and around a backward that must "
            "not train these parameters freeze them (model.requires_grad_(False), then "
            "requires_grad_(True)) or detach what flows into them"
        )

    @hollow.unguarded
    def _tell_unfrozen(self) -> None:
        """Warn (rank 0, once per parameter) about parameters frozen at construction that
        now hold a gradient.

        [Note: parameters unfrozen later]
        The engine partitions, and keeps masters and optimizer state for, the parameters
        that require grad when it is built; a frozen one is stored once and never stepped.
        Setting ``requires_grad_(True)`` on it later (gradual unfreezing, a callback that
        unfreezes the backbone) made autograd fill its ``.grad`` while the engine went on
        ignoring it: the parameter stayed at its initial values, with no word (2 ranks,
        stages 0-3), where torch's AdamW built over ``model.parameters()`` trains it.
        Adding a parameter to the partitions mid-run would re-plan buckets, masters, the
        optimizer's groups and the checkpoint layout, so the engine says so instead, and
        names what works: build the engine with the parameter trainable and freeze it with
        ``requires_grad_(False)`` until it should train. A trainable parameter without a
        gradient is not stepped (torch skips it too), so that run equals torch's AdamW
        step for step. Freezing a trainable parameter mid-run needs nothing: it gets no
        gradient and is not stepped. The check reads ``.grad`` of the frozen parameters
        at each optimizer step (a few hundred attribute reads for a LoRA model); their
        ``.grad`` is left as autograd made it."""
        got = [
            name
            for name, param in self._frozen
            if param.grad is not None and name not in self._told_unfrozen
        ]
        if not got:
            return
        self._told_unfrozen.update(got)
        if self.rank == 0:
            log.warning(
                "zerostate: %d parameter(s) frozen (requires_grad=False) when the Engine was "
                "built now receive gradients, which the engine does not apply: %s. It trains "
                "only the parameters that were trainable at Engine(...); to unfreeze one "
                "later, build the engine with it trainable and freeze it with "
                "requires_grad_(False) until then (a parameter without a gradient is not "
                "stepped). Their .grad tensors hold memory until set to None",
                len(got),
                _first_names(got),
            )

    def _watch_modules(self) -> tuple[list[Any], list[nn.Module]]:
        """On every module with engine parameters under it: a :class:`_ModuleLoadHook`, a
        :class:`_ModuleCopyGuard` as its ``__deepcopy__`` and, where the engine partitions
        the parameters, a :class:`_ModuleConvertGuard` as its ``_apply``. Returns the hook
        handles and those modules (for :meth:`close`)."""
        by_param = {id(tp.model_param(sp.param)): sp for sp in self._params}
        self._param_ids = set(by_param)
        copy_guard = _ModuleCopyGuard(self)
        convert_guard = _ModuleConvertGuard(self) if self._runtime.policy.shard_params else None
        handles, guarded = [], []
        for module in self.module.modules():
            tree = [
                (name, p)
                for name, p in module.named_parameters(remove_duplicate=False)
                if id(p) in by_param
            ]
            if not tree:
                continue
            owned = {
                name: by_param[id(p)]
                for name, p in module.named_parameters(recurse=False)
                if id(p) in by_param
            }
            hook = _ModuleLoadHook(self, owned, tree)
            handles.append(module.register_load_state_dict_pre_hook(hook))
            module.__dict__["__deepcopy__"] = types.MethodType(copy_guard, module)
            if convert_guard is not None:
                module.__dict__["_apply"] = types.MethodType(convert_guard, module)
            guarded.append(module)
        return handles, guarded

    def _convert_module(self, module: nn.Module, fn: Callable, recurse: bool) -> nn.Module:
        """``module._apply(fn, recurse)`` of a module with partitioned parameters under it,
        checked first.

        [Note: converting a partitioned model]
        At stage 3 the engine owns the parameters' storage: each holds no values outside
        a gather, and a gather fills the storage the parameter has. ``model.double()`` and
        ``model.share_memory()`` on a wrapped stage-3 model killed the process with SIGSEGV
        (torch copies from a parameter with no storage), ``model.half()`` raised torch's
        "data is not allocated yet", and ``model.to_empty()`` put new full tensors under
        the engine (2 gloo ranks). A conversion that changes a parameter (a new tensor, or
        its storage moved) is now refused before any is converted, naming what works; one
        that changes nothing (``.to()`` the device and dtype the parameters have, as
        Lightning and the Trainer call it) goes through. Whether ``fn`` changes a tensor
        is asked of a one-element tensor of each dtype and device the parameters have: the
        conversions torch's methods make are elementwise in dtype and device. The
        outermost call checks its whole subtree; the submodules it converts are not asked
        again.
        """
        if self._converting:
            return type(module)._apply(module, fn, recurse)
        seen = set()
        for p in module.parameters():
            if id(p) not in self._param_ids or (p.dtype, p.device) in seen:
                continue
            seen.add((p.dtype, p.device))
            if hollow.converts(fn, p.dtype, p.device):
                raise StageUsageError(
                    "converting the parameters of a model a stage-3 engine trains (to "
                    "another dtype or device, to_empty(), share_memory()): the engine owns "
                    "their storage, partitioned across the ranks, and the conversion would "
                    "replace it (outside a gather it holds no values). Set the working dtype "
                    "with precision= and move the model before building the Engine, or call "
                    "engine.close() first (the model then holds its full weights)"
                )
        self._converting = True
        try:
            return type(module)._apply(module, fn, recurse)
        finally:
            self._converting = False

    def _copy_module(self, module: nn.Module, memo: dict) -> nn.Module:
        """``copy.deepcopy(module)`` of a module the engine trains (or of a model holding
        one).

        [Note: deep copies of a wrapped model]
        A deep copy (an EMA or SWA model through ``AveragedModel(model)``, a frozen
        reference model for DPO, a snapshot) copied the engine along with the weights: the
        engine's forward hooks, its ``load_state_dict`` and ``state_dict`` hooks, the
        checkpointed blocks' forwards and the mark that the model is wrapped. Reproduced on
        2 gloo ranks:
        * with ``activation_checkpointing``, at every stage, the copy's forward ran the
          original's blocks: its output moved with the original's training (an EMA equal
          to the live model, a reference model that is the policy), with no error;
        * at stage 3, a copy made inside ``gathered()`` gathered the original's parameters
          at each of its calls, and called on rank 0 alone it hung in that gather;
        * ``Engine(copy)`` was refused as "already wrapped";
        * at stage 3 outside a gather the parameters hold no storage, and the copy (torch
          clones each parameter) killed the process with SIGSEGV.
        Now the copy is a plain torch module: none of the engine's hooks, the blocks' own
        forwards, no mark; its parameters are clones of the values the module holds (the
        working parameters: at stage 3 inside ``gathered()``). At stage 3 outside a gather
        the copy is refused before anything is copied, naming ``gathered()``. The original
        keeps everything. The copy is the caller's: the engine does not train or save it.
        """
        if self._copying:  # a submodule of a copy in progress: the outer call checks and strips
            return _plain_deepcopy(module, memo)
        hollow = [
            name
            for name, p in module.named_parameters()
            if id(p) in self._param_ids and holds_no_values(p)
        ]
        if hollow:
            raise StageUsageError(
                f"copy.deepcopy() at stage 3: {hollow[0]} (and every parameter outside a "
                "gather) is partitioned across the ranks and holds no values here, so the "
                "copy would have none. Copy inside `with engine.gathered():` (a full copy on "
                "each rank that runs it, a plain torch module the engine does not train), or "
                "build the copy from engine.full_state_dict()"
            )
        self._copying = True
        try:
            dup = _plain_deepcopy(module, memo)
        finally:
            self._copying = False
        hook_ids = {handle.id for handle in self._load_hooks} | self._runtime.hook_ids()
        checkpointed = (
            {id(m) for m in self._activation.modules()} if self._activation is not None else set()
        )
        for original in module.modules():
            twin = memo.get(id(original))
            if not isinstance(twin, nn.Module) or twin is original:
                continue
            state = twin.__dict__
            for name, value in list(state.items()):
                if "hooks" in name and isinstance(value, dict):
                    for key in [k for k in value if k in hook_ids]:
                        del value[key]
            if id(original) in checkpointed:
                state.pop("forward", None)  # the class's own forward
            state.pop(_WRAPPED_BY, None)
            state.pop("__deepcopy__", None)
            state.pop("_apply", None)
        return dup

    def _on_module_load(
        self,
        module: nn.Module,
        owned: dict[str, ShardedParam],
        tree: list[tuple[str, nn.Parameter]],
        state_dict: Mapping,
        prefix: str,
        metadata: Any,
    ) -> None:
        """Before torch copies ``state_dict`` into ``module``'s own parameters.

        [Note: model.load_state_dict after wrapping]
        ``model.load_state_dict(sd)`` after the engine is built (restoring weights the way a DDP
        script does) writes into the module's parameters, and the engine's own copies did not
        follow. At stages 0-2 with fp32 working parameters the masters are views of them and
        took the values, but in bf16 (or with the masters offloaded) the fp32 masters kept the
        old weights, and the next step wrote those back over the load: on 2 ranks every weight
        was the initial one again after one step at lr 0, with no error. At stage 3 the
        parameters hold no storage outside a gather, and torch's copy into them crashed the
        process (SIGSEGV). So before torch copies a module's parameters this hook:
        * refuses ``assign=True``, which swaps in the dict's tensors as new parameters: the
          engine's hooks and storage stay with the old ones, and the forward output stopped
          changing from step to step (stages 0 and 2, 2 ranks);
        * at stage 3 outside a gather, refuses, naming the calls that work, before anything
          is written (the called module's hook, the first to run, checks every parameter
          the call will write, so a ``gathered(modules=...)`` of a part refuses a load of
          the whole before the gathered part is written); inside
          ``gathered(rank0_only=True)`` too: rank 0 alone would write its own shards, and
          every parameter came out part loaded, part not (2 ranks);
        * passes the fence of every writer ([Note: one fence]): an async save may be reading;
        * writes this rank's fp32 master range (where it is not a view of the parameter) and
          its working-dtype shard (stage 3) from the dict's tensor itself, in full precision,
          so the load lands whether or not a ``gathered()`` block writes back;
        * counts the names as set ([Note: unset state], [Note: torn weights]).
        Tensors of another shape are left to torch, which reports them. As with DDP, every
        rank must load: each writes its own ranges from its own copy of the dict."""
        if self._closed:
            return
        if isinstance(metadata, Mapping) and metadata.get("assign_to_params_buffers"):
            raise ConfigError(
                "load_state_dict(assign=True) would put the dict's tensors in place of the "
                "parameters the engine trains, and training would go on without them; load "
                "without assign=True (the values are copied into the engine's storage)"
            )
        # The whole subtree this call writes is checked before anything is written: the
        # first hook of a load is the called module's, and it sees every key.
        coming = [
            (prefix + name, p)
            for name, p in tree
            if isinstance(src := state_dict.get(prefix + name), torch.Tensor)
            and tuple(src.shape) == tuple(p.shape)
        ]
        if not coming:
            return
        hollow = [key for key, p in coming if holds_no_values(p)]
        if hollow:
            raise ConfigError(
                f"load_state_dict() at stage 3: {hollow[0]} (and every parameter outside a "
                "gather) is partitioned across the ranks and holds no storage here, so torch "
                "cannot copy into it. Load inside `with engine.gathered():` on every rank "
                "(the values land in this rank's shards and fp32 masters), or use "
                "engine.load_pretrained(path) for a safetensors file or Hugging Face "
                "directory, or engine.load(root) for a zerostate checkpoint"
            )
        if self._runtime.gathered_rank0_only:
            raise ConfigError(
                "load_state_dict() inside gathered(rank0_only=True): each rank writes only "
                "its own shards, so the other ranks would keep the old values and every "
                "parameter would be part loaded, part not; load inside `with "
                "engine.gathered():` on every rank"
            )
        incoming = []
        for name, sp in owned.items():
            src = state_dict.get(prefix + name)
            if isinstance(src, torch.Tensor) and tuple(src.shape) == tuple(sp.shape):
                incoming.append((name, sp, src))
        if not incoming:
            return
        self._before_update()
        with torch.no_grad():
            for _, sp, src in incoming:
                flat = src.detach().reshape(-1)
                shard = sp.shard
                if shard is not None and self._runtime.policy.shard_params:
                    shard.copy_(flat[sp.start : sp.stop].view(shard.shape))
                if sp.master is not None and not sp.master_aliased:
                    lo = sp.master_start
                    sp.master.copy_(flat[lo : lo + sp.master.numel()].view(sp.master.shape))
        self._mark_set({sp.name for _, sp, _ in incoming})

    def _before_update(self) -> None:
        """The fence every writer of masters or optimizer state passes first: an async
        save may still be reading them ([Note: async save] in zerostate.checkpoint).

        [Note: one fence]
        The writers: step(), load() and load_pretrained() (through the checkpointer's
        settle()), gathered(writeback=True) (before it copies edits back), and
        load_state_dict() of the engine's optimizer or of the user's linked one (a pre-hook
        registered by ShardedOptimizer.fence_loads). torch's load_state_dict installs new
        state tensors rather than writing into the ones a snapshot reads, but it waits all
        the same: the contract is that no writer runs beside the snapshot."""
        if self._checkpointer is not None:
            self._checkpointer.before_update()

    def _on_reduced(self, group: Any) -> None:
        # Offload, on the accumulation boundary: this group's gradients leave for the host
        # while backward goes on ([Note: offload] in zerostate.runtime.offload).
        positions = self._runtime.positions(group)
        self._host.copy_group(group.index, positions, group.reduced_grads())

    def _host_grads(self) -> list[torch.Tensor]:
        """The step's gradient shards on the host, in fp32, as the device path has them
        before scaling (fp16 sums multiplied back: [Note: reduce precision])."""
        for group, positions in self._runtime.reduced_groups():
            if not self._host.copied(group.index):  # its reduce hook did not run
                self._host.copy_group(group.index, positions, group.reduced_grads())
        grads = self._host.wait_grads()
        if self._ctx.predivide != 1.0:
            torch._foreach_mul_(grads, self._ctx.predivide)
        return grads

    @property
    def data_parallel_size(self) -> int:
        """Ranks training on different data: ``world_size`` (of ``dp_shard``) times the
        replicas of a hybrid-sharded mesh."""
        return self._ctx.num_data_parallel

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    @property
    def optimizer_steps(self) -> int:
        return self._optimizer.step_count

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer running on this rank's master shards. Its ``param_groups``
        are live (schedulers, ``param_groups[i]["lr"] = ...`` apply at the next step);
        step it through :meth:`step`, not directly."""
        return self._optimizer.optimizer

    # -- state access ----------------------------------------------------------------------
    def _named_buffers(self, saved: bool = False) -> list[tuple[str, torch.Tensor]]:
        """Every buffer (and frozen integer parameter), canonical names; ``saved``: only
        those a checkpoint holds (the persistent ones)."""
        buffers = dict(adapt.replicated_state(self.module))
        names = self._saved_buffer_names if saved else self._buffer_names
        return [(adapt.canonical_name(n), buffers[n]) for n in names]

    def state_views(self) -> list[ShardView]:
        """Every logical tensor's live local state; see the checkpoint contract."""
        views: list[ShardView] = []
        for sp in self._params:
            start = sp.master_start
            kinds = [("model", sp.master)]
            if sp.trainable:
                kinds += [(f"optim/{k}", t) for k, t in self._optimizer.state_tensors(sp)]
            for kind, tensor in kinds:
                views.append(
                    ShardView(
                        f"{kind}/{sp.name}", sp.shape, torch.float32, sp.layout, tensor, start
                    )
                )
        tp_mesh = self._tp.mesh if self._tp is not None else None
        sharded: dict[str, int] = {}  # buffers sharded over tp: view name -> tp dim
        for name, buf in self._named_buffers(saved=True):
            stored = adapt.stored_buffer(name, buf, tp_mesh)
            numel = stored.local.numel()
            layout = TensorLayout(numel, self.world_size, max(1, numel), 0)
            if stored.tp_dim is not None:
                sharded[f"buffers/{name}"] = stored.tp_dim
            views.append(
                ShardView(
                    f"buffers/{name}",
                    stored.shape,
                    stored.local.dtype,
                    layout,
                    stored.local.view(-1),
                    0,
                    attrs=stored.attrs or None,
                )
            )
        if self.checkpoint_world is not None:  # tp x dp pieces of global tensors
            return tp_checkpoint.mesh_views(views, self._params, self.checkpoint_world, sharded)
        return views

    def engine_state(self) -> dict:
        return {
            "version": ENGINE_STATE_VERSION,
            "step": self._optimizer.step_count,
            "loss_scaler": self._scaler.state_dict(),
            "stage": self.stage,
            "precision": self.config.precision,
            "world_size": self.world_size,
            "config": self.config.summary(),
            "tied": dict(self.tied),
            "frozen": [sp.name for sp in self._params if not sp.trainable],
            "non_persistent_buffers": list(self._non_persistent),
            "optimizer": self._optimizer.metadata(),
        }

    def optimizer_classes(self) -> list[type]:
        """The classes of the inner optimizers, in order (what a checkpoint records)."""
        return [type(opt) for opt in self._optimizer.inner]

    def group_names(self) -> list[list[str]]:
        """The canonical parameter names of each optimizer param group, in order."""
        return [[sp.name for sp in members] for members in self._optimizer.group_members]

    def _optimizer_meta(self, state: dict) -> dict:
        meta = state.get("optimizer")
        if meta is None and state.get("version") == 1:
            from zerostate.optim import legacy_adamw_metadata

            return legacy_adamw_metadata(
                [[sp.name for sp in m] for m in self._optimizer.group_members],
                state.get("step", 0),
                self.optimizer.param_groups,
            )
        return meta

    def plan_load(
        self,
        state: dict,
        stored: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
        where: str = "the checkpoint",
        step: int | None = None,
    ) -> LoadPlan:
        """Check an engine-state document (and, given ``stored``, the step's tensors: name
        -> info with ``.shape``) against this engine and decode it; changes nothing (see
        [Note: planned load] in zerostate.engine_state)."""
        check_document(state)
        check_tying(state, self.tied)
        scaler = copy.copy(self._scaler)
        try:
            scaler.load_state_dict(state.get("loss_scaler", {"scale": 1.0, "good_steps": 0}))
        except ConfigError as exc:
            raise CorruptCheckpointError(str(exc)) from None
        meta = self._optimizer_meta(state)
        keys, scalars = self._optimizer.plan_state(meta, strict=strict)
        if stored is not None:
            # Before the groups: "the step lacks these tensors" says more about a checkpoint
            # of another model than "other param groups" does.
            step = state["step"] if step is None else step
            # Non-persistent buffers are not needed: a load leaves them as they are, as
            # torch's load_state_dict does ([Note: buffers as torch treats them]).
            needed = self._planned_tensors(keys)
            check_tensors(needed, stored, strict=strict, where=where, step=step)
        hyper, mixed = self._optimizer.plan_groups(meta, strict=strict)
        optimizer = OptimizerLoad(keys, scalars, tuple(hyper), tuple(mixed))
        return LoadPlan(state["step"], scaler.state_dict(), optimizer)

    def _planned_tensors(
        self, planned_keys: Mapping[str, tuple[str, ...] | None]
    ) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` of the views :meth:`state_views` lists once the optimizer holds
        ``planned_keys`` (see :class:`~zerostate.optim.OptimizerLoad`), in the same order."""
        needed: dict[str, tuple[int, ...]] = {}
        for sp in self._params:
            shape = tp_checkpoint.global_shape(sp.param)  # a DTensor's global shape
            needed[f"model/{sp.name}"] = shape
            if not sp.trainable:
                continue
            keys = planned_keys[sp.name]
            if keys is None:
                keys = [k for k, _ in self._optimizer.state_tensors(sp)]
            for key in keys:
                needed[f"optim/{key}/{sp.name}"] = shape
        tp_mesh = self._tp.mesh if self._tp is not None else None
        for name, buf in self._named_buffers(saved=True):
            needed[f"buffers/{name}"] = adapt.stored_buffer(name, buf, tp_mesh).shape
        return needed

    def apply_load(self, plan: LoadPlan, read: Collection[str] = ()) -> AppliedLoad:
        """Install a checked plan (before the tensors named in ``read`` are read into
        :meth:`state_views`): the host optimizer state the step holds gets tensors the
        reader fills in place (fresh ones, or its own while known zero), and the undo puts
        the optimizer state, step count and loss scale back exactly."""
        scaler = self._scaler.state_dict()
        micro = self._micro_step
        torn = set(self._torn)
        undo_optimizer, fresh = self._optimizer.apply_load(plan.optimizer, plan.step, read)
        self._scaler.load_state_dict(plan.loss_scaler)
        self._micro_step = 0
        # The step's weights and buffers replace torn ones ([Note: torn weights]).
        self._torn.difference_update(
            n.split("/", 1)[1] for n in read if n.startswith(("model/", "buffers/"))
        )

        def undo() -> None:
            undo_optimizer()
            self._scaler.load_state_dict(scaler)
            self._micro_step = micro
            self._torn = torn

        return AppliedLoad(undo, frozenset(id(t) for t in fresh))

    def load_engine_state(self, state: dict, *, strict: bool = True) -> None:
        """Plan and apply ``state`` alone (the tensors are the caller's business)."""
        self.apply_load(self.plan_load(state, strict=strict))

    def _settle_host_copies(self) -> None:
        # Offloaded masters may still be read by the last step's non-blocking host ->
        # device copies; a load writes them from the host, outside the device's order.
        if self._host is not None:
            wait_copies(self.device)

    def whole_replicas(self) -> dict[str, torch.Tensor]:
        """``{"model/<name>": whole flat working parameter}`` for the parameters a load may
        read whole from storage on every rank instead of gathering them from the loaded
        masters ([Note: whole replicas at load] in zerostate.checkpoint.load)."""
        return {f"model/{n}": t for n, t in self._runtime.whole_replicas(self._params).items()}

    def refresh_from_masters(self, read_whole: Collection[str] = ()) -> None:
        """Rebuild working parameters from the masters (after they were overwritten),
        except those a load read whole (``read_whole``: their ``model/<name>``)."""
        skip = set(read_whole)
        self._runtime.refresh([sp for sp in self._params if f"model/{sp.name}" not in skip])

    # ------------------------------------------------------------- checkpoints
    def _ckpt(self) -> Any:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self)
        return self._checkpointer

    def save(
        self,
        path: str,
        *,
        step: int | None = None,
        blocking: bool = True,
        client_state: Any = None,
        keep_last: int | None = None,
        storage_options: dict | None = None,
        stateful: dict | None = None,
        allow_older_step: bool = False,
        tier: str = "durable",
    ) -> Any:
        """Collective: every rank writes its own partitions of master weights, Adam moments,
        buffers and RNG state under ``path/step-<step>/`` (a local path or fsspec URL).

        ``step`` defaults to the number of optimizer steps taken. Blocking saves return after
        the step is committed. ``blocking=False`` returns a :class:`~zerostate.checkpoint.
        SaveHandle` after a snapshot is taken and writes in the background (one save in
        flight; errors surface at the next save, ``handle.wait()`` or exit). ``client_state``
        is JSON-able data (a data-loader position, say) that :meth:`load` returns.
        ``keep_last`` deletes older committed steps beyond that many after the commit.
        ``stateful`` maps names to objects with ``state_dict()`` / ``load_state_dict()``
        (LR schedulers, samplers): their states are stored as JSON (tensors included, never
        pickle), per rank; :meth:`load` restores them in place (see [Note: per-rank
        stateful objects] in zerostate.checkpoint for a changed world size).
        A root whose latest committed step is newer than ``step`` is refused unless this
        engine loaded from (or saved to) it: it is another run's; ``allow_older_step=True``
        saves there anyway.
        ``tier="memory"`` writes the step into this node's memory directory with a replica
        on another node, and copies it to ``path`` every ``memory_durable_every`` such saves
        ([Note: memory tier] in zerostate.checkpoint.tiers); :meth:`load` finds it.
        """

        if self._torn:
            self._refuse_torn("save()")

        def save() -> Any:
            return self._ckpt().save(
                path,
                step=step,
                blocking=blocking,
                client_state=client_state,
                keep_last=keep_last,
                storage_options=storage_options,
                stateful=stateful,
                allow_older_step=allow_older_step,
                tier=tier,  # [Note: memory tier]
            )

        if self._mesh is None:
            return save()
        # [Note: one replica writes] (zerostate.runtime.mesh)
        number = self.optimizer_steps if step is None else int(step)

        def skipped() -> SaveHandle:
            if blocking:
                return SaveHandle(number, path, None, 0.0)  # replica 0's verdict follows
            root = self._ckpt().roots.open(path, storage_options)  # the engine's root object
            watch = meshes.watch_commit(
                lambda: root.is_committed(number), f"step {number}", self._ckpt().timeout_s
            )
            return SaveHandle(number, path, watch, 0.0)

        return meshes.save_on_first_replica(self._replica_coordinator, save, skipped)

    def load(
        self,
        path: str,
        *,
        step: int | None = None,
        storage_options: dict | None = None,
        strict: bool = True,
        stateful: dict | None = None,
        strict_state: bool = False,
    ) -> Any:
        """Collective: load step ``step`` (latest committed when None) written at ANY world
        size and stage; each rank reads only the ranges it holds. Returns ``client_state``.
        ``strict=False`` leaves state the checkpoint lacks as it is (new parameters, say).
        ``stateful`` objects are restored in place from the states saved under their names;
        optimizer state and group hyperparameters (scheduled ``lr`` included) always are.
        Saved state it does not restore (a ``stateful`` object not passed, RNG states at
        another world size) is logged once on rank 0; ``strict_state=True`` raises instead."""
        self._check_open("load()")
        self._settle_host_copies()
        state = self._ckpt().load(
            path,
            step=step,
            storage_options=storage_options,
            strict=strict,
            stateful=stateful,
            strict_state=strict_state,
        )
        self._unset.clear()  # a checkpoint holds every parameter and buffer (or strict=False)
        return state

    def load_pretrained(
        self,
        path_or_url: str | os.PathLike,
        storage_options: dict | None = None,
        strict: bool = True,
    ) -> PretrainedReport:
        """Collective: load Hugging Face safetensors weights (a ``.safetensors`` file, or a
        directory / fsspec URL holding ``model.safetensors`` or a sharded
        ``model.safetensors.index.json``) into the masters and working copies, at any stage.
        Each rank reads only the byte ranges of the elements it holds. Tied aliases count
        as their parameter. ``strict=True`` raises one error listing missing, unexpected
        and mis-shaped names; ``strict=False`` loads what matches and returns the lists
        (a :class:`~zerostate.pretrained.PretrainedReport`). Optimizer state is untouched.
        """
        self._check_open("load_pretrained()")
        if self._tp is not None:
            raise tp.refuse("load_pretrained()")
        self._settle_host_copies()
        return load_pretrained(
            self,
            path_or_url,
            storage_options=storage_options,
            strict=strict,
            settle=self._settle_saves,
            loaded=self._mark_set,
            torn=self._mark_torn,
        )

    def _settle_saves(self) -> None:
        """Wait for the async save in flight (re-raising its error) and its snapshot."""
        if self._checkpointer is not None:
            self._checkpointer.settle()

    def close(self, *, whole_model: bool = True) -> None:
        """End training: wait for an in-flight async save and re-raise its error, and hand
        the model back as a plain torch module; idempotent.

        Call it (or use ``with Engine(...) as engine:``) on every rank before the process
        ends so a background save that fails is reported as an exception, not lost. After
        it the model holds its full trained weights (in the working dtype) at every stage,
        without the engine's hooks: ``torch.save(model.state_dict(), path)`` and
        ``model.save_pretrained(dir)`` (on rank 0) write them. At stage 3 that gathers
        every parameter ([Note: no hollow state dict] in zerostate.runtime.runtime): it is
        collective and costs the full working parameters once per rank.
        ``whole_model=False`` only waits for the save and leaves the model as it is, for
        an error path where other ranks may never call ``close()``. Training, ``load``
        and ``load_pretrained`` are refused afterwards; ``full_state_dict()`` still works.
        """
        ending = whole_model and not self._closed
        if ending and self._torn:
            self._refuse_torn("close()")  # close(whole_model=False) still ends an error path
        if ending:
            if self._runtime.policy.shard_params:
                self._arrive("close")
            self._runtime.detach()
            for handle in (*self._grad_hooks, *self._load_hooks):
                handle.remove()
            self._grad_hooks, self._load_hooks = [], []
            for module in self._guarded:
                module.__dict__.pop("__deepcopy__", None)
                module.__dict__.pop("_apply", None)
            self._guarded = []
            if self._activation is not None:
                self._activation.remove()
            self.module.__dict__.pop(_WRAPPED_BY, None)  # a new Engine may wrap it now
            self._closed = True
        if self._checkpointer is not None:
            self._checkpointer.close()
        if ending and self._mesh is not None and collectives.is_initialized():
            # [Note: the last arrival spans the mesh]
            # Outside torchrun (mp.spawn, a plain init_process_group) rank 0 hosts the
            # process group's store. The arrivals above are over this engine's group, a
            # dp_shard group of the mesh: the group without rank 0 could still be counting
            # itself out of close() in the store after rank 0 had returned and its process
            # ended, and failed with "lost the process group's key-value store" (HSDP 2 x 2,
            # stage 3, that group 1 s slower). The mesh covers every rank, so one more arrival
            # over all of them makes rank 0 the last to leave the store.
            world_rank, world_size = collectives.group_info(None)
            if self.world_size < world_size:
                self.coordinator.over(None, world_rank, world_size).arrive("close")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` handed the model back (training is over)."""
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EngineUsageError(
                f"{what} after engine.close(): close() ended training and handed the model "
                "back with its full weights; build a new Engine over the model to train on"
            )

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            # Not whole_model: gathering is collective, and the other ranks may be stuck
            # where this one failed.
            self.close(whole_model=False)
        except Exception as save_error:  # the body's exception is the one to propagate
            note = f"zerostate: an async checkpoint save also failed: {save_error!r}"
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(note)
            else:
                warnings.warn(note, stacklevel=2)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters (canonical names) and buffers; collective."""
        self._arrive("full_state_dict")
        full = self._runtime.full_masters(self._params)
        out = {
            # A DTensor's gathered local shard becomes the global tensor (collective
            # over tp, in parameter order on every rank).
            sp.name: sp.param.full(t) if isinstance(sp.param, tp.LocalParam) else t.view(sp.shape)
            for sp, t in zip(self._params, full, strict=True)
        }
        for name, buf in self._named_buffers():
            out[name] = buf.detach().clone()
        return out

    def gathered(
        self,
        modules: Any = None,
        *,
        rank0_only: bool = False,
        writeback: bool = False,
    ) -> Any:
        """Context manager: full working parameters for code that runs the model outside
        the training step (``generate``, evaluation, ``save_pretrained``); collective.

        At stage 3 the parameters of ``modules`` (default: the whole model) are gathered
        on entry and released on exit; ``rank0_only`` releases them on the other ranks at
        once (rank 0 saves alone); ``writeback`` copies edits made inside the block into the
        shards and fp32 masters on exit. At stages 0-2 the parameters are already whole and
        only ``writeback`` does something. Inside the block the wrapped module is called
        directly (``engine.module(...)``); do not train inside it.
        """
        if isinstance(modules, nn.Module):
            modules = [modules]
        self._arrive("gathered")
        return self._runtime.gathered(
            modules, rank0_only=rank0_only, writeback=writeback, before_write=self._before_update
        )

    def memory_stats(self) -> dict[str, int]:
        """Bytes of model state this rank holds now, by kind.

        ``model_states`` (params + grads + master + optim_states) is the quantity of the
        ZeRO paper. Beside it, every working buffer by name: ``gathered_params`` (stage 3:
        storage of the units gathered right now, at most the one computing and the one
        prefetched), ``comm_buffers`` (the pooled pack / gather buffers of the collectives
        in flight, at most two per kind, reused every step); ``buffers_in_flight`` is their
        sum and ``total`` adds it to ``model_states``. Storage shared
        by the master and the working copy (fp32) is counted once, as params. ``grads``
        counts what the reduce precision costs (docs/engine.md, "Precision"): fp32
        gradient shards at stages 1-3, and at stages 0-1 an fp32 flat accumulation buffer
        of the full gradients when ``reduce_dtype`` is wider than the working dtype.

        Per memory tier: ``device_bytes`` and ``host_bytes`` split ``total``;
        ``device_optimizer_bytes`` / ``host_optimizer_bytes`` split the optimizer part
        (fp32 masters held apart from the working copy, plus optimizer states). Without
        offload everything is on the device tier; with ``offload`` the masters, optimizer
        states and ``host_grads`` (the host staging buffer of the step's gradient shards)
        are on the host, and with ``offload="params"`` the parameter shards too.

        ``memory_tier_bytes``: host memory (tmpfs) of this node's memory-tier steps of the
        roots this engine saved to or loaded from (``save(..., tier="memory")``).

        Under tensor parallelism every count is of this rank's local tp shards (Psi/TP of a
        tp-sharded matrix, all of a tp-replicated parameter), partitioned over ``dp_shard``.
        """

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        held = self._runtime.bytes_held()
        params, grads = held["params"], held["grads"]
        master = sum(nbytes(sp.master) for sp in self._params if not sp.master_aliased)
        optim = self._optimizer.state_bytes()
        gathered = held["gathered_params"]
        comm = self._pool.allocated_bytes
        staging = self._host.staging_bytes() if self._host is not None else 0
        model_states = params + grads + master + optim
        total = model_states + gathered + comm + staging
        # Tiers ([Note: offload]): with offload the masters, optimizer states and the
        # gradient staging buffer are host memory (and the shards with offload="params").
        host_optim = master + optim if self._host is not None else 0
        host = host_optim + staging
        if self._host is not None and self._host.params_too:
            host += params
        return {
            "params": params,
            "grads": grads,
            "master": master,
            "optim_states": optim,
            "model_states": model_states,
            "gathered_params": gathered,
            "comm_buffers": comm,
            "buffers_in_flight": gathered + comm,
            "host_grads": staging,
            "total": total,
            "device_bytes": total - host,
            "host_bytes": host,
            "device_optimizer_bytes": master + optim - host_optim,
            "host_optimizer_bytes": host_optim,
            # [Note: memory tier]: this node's files, not model state (not in total)
            "memory_tier_bytes": self._checkpointer.tiers.nbytes() if self._checkpointer else 0,
        }

    def comm_stats(self, dim: str | None = None) -> dict[str, dict[str, int]]:
        """Communication of the last completed optimizer step, per collective kind and in
        total, counted as in [Note: comm accounting] (zerostate.collectives).

        With a mesh, ``dim=`` gives one dimension's part and the default adds them up:
        ``"dp_shard"`` (ZeRO's gathers and reduce-scatters, of each rank's local tp shards
        under tensor parallelism: 2 Psi/TP at stages 0-2, 3 Psi/TP at stage 3),
        ``"dp_replicate"`` (hybrid sharding's all-reduce of the reduced gradient shard) and
        ``"tp"``. Over ``tp`` only the collectives the engine itself issues are counted: the
        norm-and-flags all-reduce and the summing of ``Partial`` gradients of replicated
        DTensor parameters. The collectives torch's DTensor runs inside the module's forward
        and backward (activations, the parallel styles' input/output redistributions) are
        not counted: they are torch's, and the engine does not see them."""
        reports = {"dp_shard": self._stats.report()}
        if self._ctx.replicas is not None:
            reports["dp_replicate"] = self._ctx.replicas.stats.report()
        if self._tp is not None:
            reports["tp"] = self._tp.stats.report()
        if dim is None:
            return meshes.sum_reports(list(reports.values()))
        if dim not in reports:
            raise ConfigError(
                f"comm_stats(dim={dim!r}): this engine communicates over {sorted(reports)}"
            )
        return reports[dim]

    def layouts(self) -> dict[str, TensorLayout]:
        return {sp.name: sp.layout for sp in self._params}
