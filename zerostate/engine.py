"""The training engine: sequences forward, backward, the partitioned step and state access.

State lives elsewhere (``ShardedParam`` per parameter, ``GradReducer`` buckets for stages
0-2, ``Stage3Runtime`` units for stage 3); this module only orchestrates.

One optimizer step (``K = grad_accum_steps``):

1. ``engine(*args)`` runs the module (stage 3 gathers the root unit first).
2. ``engine.backward(loss)``, K times: the (fp16: scaled) loss is back-propagated; gradient
   hooks launch the bucket / unit collectives while backward runs; what is left is flushed.
3. ``engine.step()``: on the K-th call, each rank's gradient shard is cast to fp32 and
   divided by ``world_size * K * loss_scale`` (the mean over the global batch); one
   all-reduce of the squared norm and per-parameter gradient flags gives the global norm,
   the overflow verdict and which parameters to step on every rank; the optimizer
   (zerostate.optim) updates the fp32 master shards; the working
   parameters are refreshed (stage 0: cast; 1/2: all-gather; 3: cast into the local
   shard); gradients are zeroed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from zerostate import collectives
from zerostate.buckets import GradReducer, all_gather_shards
from zerostate.collectives import CommStats
from zerostate.config import EngineConfig
from zerostate.errors import ConfigError, ZerostateError
from zerostate.muon import gather_full
from zerostate.optim import ShardedOptimizer, describe, resolve_user_optimizers, sum_of_squares
from zerostate.partition import TensorLayout, plan_layouts
from zerostate.precision import LossScaler
from zerostate.sharded import BufferPool, ShardedParam, ShardView
from zerostate.stage3 import Stage3Runtime, materialise

__all__ = ["Engine", "EngineConfig", "EngineUsageError", "ShardView"]

ENGINE_STATE_VERSION = 2
#: Engine states of version 1 (built-in AdamW only, no optimizer metadata) still load.
_READABLE_ENGINE_STATES = (1, 2)
#: EngineConfig fields that configure the built-in AdamW; with optimizer= they are the
#: user optimizer's business.
_ADAMW_FIELDS = ("lr", "betas", "eps", "weight_decay", "no_decay")


class EngineUsageError(ZerostateError, RuntimeError):
    """The engine's methods were called in an order it cannot honour."""


def _build_config(config: EngineConfig | None, kwargs: dict) -> EngineConfig:
    if config is None:
        return EngineConfig(**kwargs)
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
    return dataclasses.replace(config, **kwargs) if kwargs else config


def _validate_model(model: Any, config: EngineConfig) -> None:
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
    for name, p in params:
        if not p.is_floating_point():
            raise ConfigError(
                f"parameter {name} has dtype {p.dtype}; only floating-point parameters can "
                "be trained. Register it as a buffer (module.register_buffer) instead"
            )
    if any(p.is_meta for _, p in params) and config.stage != 3:
        raise ConfigError(
            f"the model is on the meta device, which only stage 3 can materialise shard by "
            f"shard (stage={config.stage}); use stage=3 or build the model on a real device"
        )


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
    }


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
        group = config.group if config is not None else kwargs.get("group")
        self.rank, self.world_size = collectives.group_info(group)
        if error is None:
            try:
                _validate_model(model, config)
            except ZerostateError as exc:
                error = exc
        device = self._pick_device(model, config)
        collectives.check_agreement(
            {**_model_aspects(model, config), "optimizer": describe(optimizer)},
            error,
            group=group,
            world_size=self.world_size,
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
        self._pool = BufferPool(device)
        self._scaler = LossScaler(
            enabled=config.precision == "fp16",
            initial_scale=config.initial_loss_scale,
            window=config.loss_scale_window,
            min_scale=config.min_loss_scale,
        )
        self._micro_step = 0
        self.last_grad_norm: float | None = None
        self._bucket_numel = max(1, int(config.bucket_mb * 2**20) // self.dtype.itemsize)

        named = list(model.named_parameters())
        first = {id(p): n for n, p in named}
        self.tied = {
            n: first[id(p)]
            for n, p in model.named_parameters(remove_duplicate=False)
            if first[id(p)] != n
        }
        layouts = plan_layouts(
            [p.numel() for _, p in named], self.world_size, config.min_shard_numel
        )
        no_decay = config.no_decay or (lambda name, p: p.ndim < 2)
        self._params = [
            ShardedParam(n, p, layout, self.rank, bool(no_decay(n, p)))
            for (n, p), layout in zip(named, layouts, strict=True)
        ]
        self._trainable = [sp for sp in self._params if sp.trainable]
        self._init_buffers()
        if config.sync_module_states and not any(p.is_meta for _, p in named):
            with torch.no_grad():
                states = [p.data for _, p in named] + [b for _, b in model.named_buffers()]
                collectives.broadcast_from_first([t for t in states if t.numel()], group=group)

        self._s3: Stage3Runtime | None = None
        self._reducer: GradReducer | None = None
        if self.stage == 3:
            materialise(
                model,
                self._params,
                dtype=self.dtype,
                device=device,
                init_fn=config.init_fn,
                seed=config.init_seed,
            )
            self._s3 = Stage3Runtime(
                model,
                self._params,
                world_size=self.world_size,
                rank=self.rank,
                dtype=self.dtype,
                group=group,
                stats=self._stats,
                pool=self._pool,
                policy=config.unit_policy,
                prefetch=config.prefetch,
            )
        else:
            self._init_replicated_params()
            self._reducer = GradReducer(
                self._trainable,
                stage=self.stage,
                world_size=self.world_size,
                rank=self.rank,
                dtype=self.dtype,
                bucket_numel=self._bucket_numel,
                group=group,
                stats=self._stats,
                pool=self._pool,
            )
        self._optimizer = self._build_optimizer()
        for sp in self._trainable:
            sp.param.register_post_accumulate_grad_hook(self._make_grad_hook(sp))

    # -- construction helpers -------------------------------------------------------------
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
            raise ConfigError(
                f"{', '.join(given)} configure the built-in AdamW and have no effect with "
                "optimizer=; set them in the optimizer's param groups instead"
            )
        return resolve_user_optimizers(optimizer, list(model.named_parameters()))

    def _init_buffers(self) -> None:
        # Buffers are replicated; they only need a plan so the store can chunk them.
        for module in self.module.modules():
            for n, b in module._buffers.items():
                if b is not None and not b.is_meta and not b.is_contiguous():
                    module._buffers[n] = b.contiguous()
        self._buffer_names = [n for n, _ in self.module.named_buffers()]
        numels = [b.numel() for _, b in self.module.named_buffers()]
        self._buffer_layouts = plan_layouts(numels, self.world_size, self.config.min_shard_numel)

    def _init_replicated_params(self) -> None:
        for sp in self._params:
            p = sp.param
            original = p.data.contiguous()
            lo, hi = (0, sp.numel) if self.stage == 0 else (sp.start, sp.stop)
            p.data = original.to(self.dtype)
            if self.dtype == torch.float32:
                sp.master, sp.master_aliased = p.data.view(-1)[lo:hi], True
            else:
                sp.master = original.view(-1)[lo:hi].to(torch.float32).clone()

    def _build_optimizer(self) -> ShardedOptimizer:
        c = self.config

        def gather(sps: list[ShardedParam], shards: list[torch.Tensor]) -> list[torch.Tensor]:
            if self.stage == 0:  # masters are whole tensors already
                return [t.reshape(-1) for t in shards]
            return gather_full(
                sps,
                shards,
                rank=self.rank,
                world_size=self.world_size,
                group=self.group,
                stats=self._stats,
            )

        # Which parameters received a gradient in this accumulation window, on this rank;
        # step() ORs it across ranks (see [Note: uniform stepping] in zerostate.optim).
        self._got_grad = [False] * len(self._trainable)
        for i, sp in enumerate(self._trainable):
            sp.param.register_post_accumulate_grad_hook(self._make_flag_hook(i))
        optimizer = ShardedOptimizer(
            self._trainable,
            self._resolved,
            adamw=dict(lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay),
            gather=gather,
        )
        self._resolved = None  # holds the user's optimizer; not needed any more
        return optimizer

    def _make_flag_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._got_grad[index] = True

        return hook

    def _make_grad_hook(self, sp: ShardedParam):
        if self._s3 is not None:
            s3 = self._s3
            return lambda param: s3.on_grad_ready(param, sp)
        return self._reducer.on_grad_ready

    # -- training ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._s3 is not None:
            self._s3.pre_forward_root()
        out = self.module(*args, **kwargs)
        if self._s3 is not None:
            self._s3.post_forward_root()
        return out

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss (its mean over the local batch)."""
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
        boundary = self._micro_step + 1 == accum
        if self._s3 is not None:
            self._s3.prepare()
        else:
            self._reducer.prepare(sync=boundary or self.stage == 2)
        if self._scaler.enabled:
            loss = loss.float() * self._scaler.scale
        loss.backward()
        if self._s3 is not None:
            self._s3.finish()
        else:
            self._reducer.finish()
        self._micro_step += 1

    def step(self) -> bool:
        """Apply the optimizer on accumulation boundaries; True if parameters changed."""
        if self._micro_step == 0:
            raise EngineUsageError(
                "step() called without backward(); call engine.backward(loss) first"
            )
        if self._micro_step < self.config.grad_accum_steps:
            return False
        if self._s3 is not None:
            grads = self._s3.step_grads(self._trainable)
        else:
            grads = self._reducer.step_grads(self._trainable)
        grads = [g if g.dtype == torch.float32 else g.float() for g in grads]
        divisor = self.world_size * self.config.grad_accum_steps * self._scaler.scale
        torch._foreach_mul_(grads, 1.0 / divisor)
        # One all-reduce gives the global squared norm and, per parameter, how many ranks
        # saw a gradient (a parameter no rank saw is not stepped, as torch skips it).
        # Stage 0 gradients are already the full, identical sum: only rank 0 adds its norm.
        squares = sum_of_squares(grads)
        if self.stage == 0 and self.rank != 0:
            squares.zero_()
        flags = torch.tensor(self._got_grad, dtype=torch.float32, device=squares.device)
        folded = torch.cat([squares, flags])
        collectives.all_reduce(folded, group=self.group, stats=self._stats)
        norm = folded[:1].sqrt()
        stepped = (folded[1:] > 0).tolist()
        self._got_grad = [False] * len(self._trainable)
        self.last_grad_norm = float(norm)
        overflow = self._scaler.enabled and not math.isfinite(self.last_grad_norm)
        if self.config.grad_clip is not None and not overflow:
            coef = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0).reshape(())
            torch._foreach_mul_(grads, coef)
        if not overflow:
            if self._checkpointer is not None:
                self._checkpointer.before_update()  # an async save may still be reading
            self._optimizer.step(grads, stepped)
            self._refresh_trainable()
        self._scaler.update(overflow)
        self._zero_grads()
        self._micro_step = 0
        self._stats.end_step()
        return not overflow

    def _refresh_trainable(self) -> None:
        if self._s3 is not None:
            pairs = [(sp.local, sp.master) for sp in self._trainable if not sp.master_aliased]
        elif self.stage == 0:
            pairs = [
                (sp.param.data.view(-1), sp.master)
                for sp in self._trainable
                if not sp.master_aliased
            ]
        else:
            self._reducer.gather_params()
            return
        if pairs:
            torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])

    def _zero_grads(self) -> None:
        if self._s3 is not None:
            self._s3.zero()
        else:
            self._reducer.zero()

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
    def _named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        buffers = dict(self.module.named_buffers())
        return [(n, buffers[n]) for n in self._buffer_names]

    def state_views(self) -> list[ShardView]:
        """Every logical tensor's live local state; see the checkpoint contract."""
        views: list[ShardView] = []
        for sp in self._params:
            start = 0 if self.stage == 0 else sp.start
            kinds = [("model", sp.master)]
            if sp.trainable:
                kinds += [(f"optim/{k}", t) for k, t in self._optimizer.state_tensors(sp)]
            for kind, tensor in kinds:
                views.append(
                    ShardView(
                        f"{kind}/{sp.name}", sp.shape, torch.float32, sp.layout, tensor, start
                    )
                )
        for (name, buf), layout in zip(self._named_buffers(), self._buffer_layouts, strict=True):
            views.append(
                ShardView(f"buffers/{name}", tuple(buf.shape), buf.dtype, layout, buf.view(-1), 0)
            )
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
            "optimizer": self._optimizer.metadata(),
        }

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

    def prepare_engine_state(self, state: dict, *, strict: bool = True) -> None:
        """Before a checkpoint's tensors are read: give the optimizer exactly the state
        tensors the checkpoint holds, so :meth:`state_views` lists them."""
        self._check_engine_state(state)
        self._optimizer.prepare_load(self._optimizer_meta(state), strict=strict)

    @staticmethod
    def _check_engine_state(state: Any) -> None:
        if not isinstance(state, dict):
            raise ConfigError(f"engine state must be a dict, got {type(state).__name__}")
        version = state.get("version")
        if version not in _READABLE_ENGINE_STATES:
            raise ConfigError(
                f"engine state version {version!r} is not one of {_READABLE_ENGINE_STATES}; "
                "it was written by an incompatible zerostate"
            )
        step = state.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"engine state step={step!r} must be an integer >= 0")

    def load_engine_state(self, state: dict) -> None:
        self._check_engine_state(state)
        step = state["step"]
        tied = state.get("tied", {})
        if tied != self.tied:
            raise ConfigError(
                f"the checkpoint ties {tied} but this model ties {self.tied}; load it into "
                "a model with the same weight tying"
            )
        self._scaler.load_state_dict(state.get("loss_scaler", {"scale": 1.0, "good_steps": 0}))
        self._optimizer.finish_load(self._optimizer_meta(state), step)
        self._micro_step = 0

    def refresh_from_masters(self) -> None:
        """Rebuild working parameters from the masters (after they were overwritten)."""
        if self._s3 is not None:
            self._s3.release_all()
            pairs = [(sp.local, sp.master) for sp in self._params if not sp.master_aliased]
        elif self.stage == 0:
            pairs = [
                (sp.param.data.view(-1), sp.master) for sp in self._params if not sp.master_aliased
            ]
        else:
            all_gather_shards(
                self._params,
                [sp.master for sp in self._params],
                [sp.param.data.view(-1) for sp in self._params],
                world_size=self.world_size,
                rank=self.rank,
                dtype=self.dtype,
                bucket_numel=self._bucket_numel,
                group=self.group,
                stats=None,
                pool=self._pool,
            )
            return
        if pairs:
            torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])

    # ------------------------------------------------------------- checkpoints
    def _ckpt(self) -> Any:
        if self._checkpointer is None:
            from zerostate.checkpoint import Checkpointer

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
        """
        return self._ckpt().save(
            path,
            step=step,
            blocking=blocking,
            client_state=client_state,
            keep_last=keep_last,
            storage_options=storage_options,
            stateful=stateful,
        )

    def load(
        self,
        path: str,
        *,
        step: int | None = None,
        storage_options: dict | None = None,
        strict: bool = True,
        stateful: dict | None = None,
    ) -> Any:
        """Collective: load step ``step`` (latest committed when None) written at ANY world
        size and stage; each rank reads only the ranges it holds. Returns ``client_state``.
        ``strict=False`` leaves state the checkpoint lacks as it is (new parameters, say).
        ``stateful`` objects are restored in place from the states saved under their names;
        optimizer state and group hyperparameters (scheduled ``lr`` included) always are."""
        return self._ckpt().load(
            path, step=step, storage_options=storage_options, strict=strict, stateful=stateful
        )

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters (canonical names) and buffers; collective."""
        if self.stage == 0:
            out = {sp.name: sp.master.view(sp.shape).clone() for sp in self._params}
        else:
            full = [
                torch.empty(sp.numel, dtype=torch.float32, device=self.device)
                for sp in self._params
            ]
            all_gather_shards(
                self._params,
                [sp.master for sp in self._params],
                full,
                world_size=self.world_size,
                rank=self.rank,
                dtype=torch.float32,
                bucket_numel=self._bucket_numel,
                group=self.group,
                stats=None,
                pool=self._pool,
            )
            out = {sp.name: t.view(sp.shape) for sp, t in zip(self._params, full, strict=True)}
        for name, buf in self._named_buffers():
            out[name] = buf.detach().clone()
        return out

    def memory_stats(self) -> dict[str, int]:
        """Bytes of model state this rank holds now, by kind.

        ``model_states`` (params + grads + master + optim_states) is the quantity of the
        ZeRO paper; ``buffers_in_flight`` (pooled communication buffers and, at stage 3,
        gathered parameters) is reported beside it; ``total`` is their sum. Storage shared
        by the master and the working copy (fp32) is counted once, as params.
        """

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        if self._s3 is not None:
            params = sum(nbytes(sp.local) for sp in self._params)
            grads = self._s3.grad_bytes()
            in_flight = self._s3.gathered_bytes()
        else:
            params = sum(nbytes(sp.param.data) for sp in self._params)
            grads = self._reducer.buffer_bytes()
            in_flight = 0
        if self.stage != 0:
            grads += sum(nbytes(sp.param.grad) for sp in self._trainable)
        master = sum(nbytes(sp.master) for sp in self._params if not sp.master_aliased)
        optim = self._optimizer.state_bytes()
        in_flight += self._pool.allocated_bytes
        model_states = params + grads + master + optim
        return {
            "params": params,
            "grads": grads,
            "master": master,
            "optim_states": optim,
            "buffers_in_flight": in_flight,
            "model_states": model_states,
            "total": model_states + in_flight,
        }

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Communication of the last completed optimizer step, per collective kind and in
        total, counted as in [Note: comm accounting] (zerostate.collectives)."""
        return self._stats.report()

    def layouts(self) -> dict[str, TensorLayout]:
        return {sp.name: sp.layout for sp in self._params}
