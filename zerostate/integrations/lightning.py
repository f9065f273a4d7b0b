"""``ZeroStateStrategy``: a ``lightning.pytorch.Trainer`` strategy training through a
:class:`zerostate.Engine` (ZeRO stages 0-3) and checkpointing into the zerostate store.

    trainer = lightning.pytorch.Trainer(
        accelerator="cpu", devices=2, strategy=ZeroStateStrategy(stage=3)
    )

It follows Lightning's custom-strategy extension point the way Lightning's own
``DeepSpeedStrategy`` does: a ``DDPStrategy`` subclass (launching, process group,
collectives and the distributed sampler are DDP's) whose ``setup`` builds the engine
instead of a ``DistributedDataParallel`` wrapper:

- the engine owns the optimizer that ``configure_optimizers`` returns (one torch optimizer;
  its param groups are rebuilt over the engine's master shards) and the schedulers are
  pointed at ``engine.optimizer``, so they keep working (interval and frequency as usual);
- precision comes from ``Trainer(precision=...)`` (``32-true``, ``bf16-mixed``/``bf16-true``,
  ``16-mixed``/``16-true``): the engine's working dtype, no autocast;
- ``accumulate_grad_batches`` becomes the engine's ``grad_accum_steps`` (the strategy
  handles accumulation, as DeepSpeed's does) and ``gradient_clip_val`` its ``grad_clip``
  (norm clipping only);
- ``trainer.save_checkpoint(path)`` (and so ``ModelCheckpoint``) saves into the store: the
  path becomes a checkpoint root (a directory or fsspec URL); Lightning's own state
  (loops, callbacks, schedulers) rides in the step's attrs as JSON, never a pickle.
  ``async_save=True`` returns while the step is written;
- ``trainer.fit(model, ckpt_path=path)`` resumes from that root at any number of devices;
- when ``fit`` (``validate``, ``test``, ``predict``) returns, the engine is closed and the
  LightningModule holds its full trained weights at every stage, stage 3 included:
  ``torch.save(model.state_dict(), path)`` on rank 0 writes them. A run that ends with an
  exception leaves the model as it is (gathering is collective; other ranks may be stuck).

``mesh=`` (a device mesh with ``tp``, the LightningModule's layers parallelized with torch's
``parallelize_module`` before ``fit``; the process group initialised first, which Lightning
then keeps) passes through to the engine, and the distributed sampler splits the data over
the data-parallel ranks only, so the ``tp`` ranks of one coordinate see the same batches.
Lightning checkpoints with tensor parallelism are not tested yet (``engine.save`` /
``load`` are: format 3); ``enable_checkpointing=False`` keeps clear of them.

Gradient accumulation across the end of an epoch differs from DDP: the engine steps every
``accumulate_grad_batches`` micro-batches, so keep the batches per epoch a multiple of it.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

import zerostate
from zerostate import jsonstate
from zerostate.errors import ConfigError

log = logging.getLogger(__name__)

#: Lightning precision settings and the engine's working dtype for each.
PRECISIONS = {
    "32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16",
    "16-mixed": "fp16", "16-true": "fp16",
}  # fmt: skip
#: Keys of Lightning's checkpoint dict the engine itself stores (as sharded tensors).
_ENGINE_KEYS = ("state_dict", "optimizer_states")


class _EngineModule(nn.Module):
    """What the strategy hands Lightning as its model: calls go through the engine (its
    stage-3 gathers and input casts), the LightningModule stays the engine's module."""

    def __init__(self, engine: zerostate.Engine, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.engine = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


class _EnginePrecision(Precision):
    """Backward and the optimizer step go through the engine; the engine clips."""

    def __init__(self, strategy: ZeroStateStrategy, precision: str) -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self._strategy = strategy

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args, **kwargs):
        self._strategy.engine.backward(tensor)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        result = closure()
        self._after_closure_hooks(model, optimizer)
        self._strategy.engine.step()
        return result

    def _after_closure_hooks(self, model: Any, optimizer: Any) -> None:
        from lightning.pytorch.trainer import call

        trainer = model.trainer
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)

    def forward_context(self) -> Any:
        return nullcontext()


class ZeroStateStrategy(DDPStrategy):
    """Train with ``zerostate.Engine(stage=stage, **engine_options)``; see the module doc.

    ``engine_options`` are :class:`zerostate.EngineConfig` fields other than those the
    Trainer sets (``precision``, ``grad_accum_steps``, ``grad_clip``, ``lr`` and the AdamW
    settings, which come from ``configure_optimizers``). ``async_save`` makes checkpoint
    saves return once the state is snapshotted; ``keep_last`` applies the store's
    retention to each root."""

    strategy_name = "zerostate"

    def __init__(
        self,
        stage: int = 2,
        *,
        async_save: bool = False,
        storage_options: dict | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        start_method: str = "popen",
        **engine_options: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        trainer_set = {"precision", "grad_accum_steps", "grad_clip", "stage"}
        taken = sorted(trainer_set & set(engine_options))
        if taken:
            raise ConfigError(
                f"ZeroStateStrategy: {taken} come from the Trainer (precision=, "
                "accumulate_grad_batches=, gradient_clip_val=) or stage=; set them there"
            )
        zerostate.EngineConfig(stage=stage, **engine_options)  # validated now, not at fit
        self.stage = stage
        self.async_save = async_save
        self.storage_options = storage_options
        self.engine_options = engine_options
        self.engine: zerostate.Engine | None = None
        self._interrupted = False

    # ------------------------------------------------------------------- setup
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self._interrupted = False
        self.accelerator.setup(trainer)
        self.model_to_device()
        precision = self._engine_precision()
        module = self.lightning_module
        optimizer, configs = None, []
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers, configs = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1:
                raise ConfigError(
                    f"ZeroStateStrategy takes one optimizer from configure_optimizers, got "
                    f"{len(optimizers)}; combine their param groups into one optimizer"
                )
            optimizer = optimizers[0]
        clip = trainer.gradient_clip_val
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", "norm"))
        if clip is not None and algorithm != "norm":
            raise ConfigError(
                "ZeroStateStrategy clips by norm only: use gradient_clip_algorithm='norm'"
            )
        self.engine = zerostate.Engine(
            module,
            stage=self.stage,
            precision=precision,
            grad_accum_steps=trainer.accumulate_grad_batches,
            grad_clip=float(clip) if clip else None,
            optimizer=optimizer,
            **self.engine_options,
        )
        for config in configs:
            # Built over the user's optimizer; the engine's carries the same groups.
            config.scheduler.optimizer = self.engine.optimizer
        self.model = _EngineModule(self.engine, module)
        self.optimizers = [self.engine.optimizer] if optimizer is not None else []
        self.lr_scheduler_configs = configs
        self.barrier()

    def _engine_precision(self) -> str:
        setting = str(getattr(self.precision_plugin, "precision", "32-true"))
        if setting not in PRECISIONS:
            raise ConfigError(
                f"Trainer(precision={setting!r}) is not supported by ZeroStateStrategy; use "
                f"one of {sorted(PRECISIONS)}"
            )
        self.precision_plugin = _EnginePrecision(self, setting)
        return PRECISIONS[setting]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """With ``mesh=``, the sampler splits the data over the data-parallel ranks only:
        the ``tp`` ranks of one ``(dp_replicate, dp_shard)`` coordinate see the same
        batches (they compute one model replica together)."""
        mesh = self.engine_options.get("mesh")
        if mesh is None:
            return super().distributed_sampler_kwargs
        rank, size = data_parallel_coordinate(mesh)
        return {"num_replicas": size, "rank": rank}

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist to load into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine loads its own optimizer state

    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)

    # ------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine saves the weights, sharded

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Collective: every rank writes its partitions into the root ``filepath``."""
        filepath = self.broadcast(str(filepath))
        options = storage_options if storage_options is not None else self.storage_options
        state = _encode_lightning_state(checkpoint)
        assert self.engine is not None
        self.engine.save(
            filepath, client_state=state, blocking=not self.async_save, storage_options=options
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        assert self.engine is not None
        path = self.broadcast(str(checkpoint_path))
        state = self.engine.load(path, storage_options=self.storage_options)
        if not isinstance(state, dict):
            raise ConfigError(
                f"{path} was not saved by ZeroStateStrategy (it holds no Lightning state); "
                "load it with zerostate.Engine.load or engine.load_pretrained instead"
            )
        # The engine decodes its client_state (jsonstate), steps saved before it did included:
        # their values were encoded here, and one decoding gives the objects either way.
        checkpoint = dict(state)
        checkpoint.setdefault("state_dict", {})
        checkpoint.setdefault("optimizer_states", [])
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded by the engine in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded by the engine in load_checkpoint

    def on_exception(self, exception: BaseException) -> None:
        self._interrupted = True  # teardown must not start a collective gather
        super().on_exception(exception)

    def teardown(self) -> None:
        if self.engine is not None:
            # Waits for an async save (raises its error) and, after a run that ended
            # normally, leaves the full weights in the module ([Note: no hollow state
            # dict] in zerostate.runtime.runtime).
            self.engine.close(whole_model=not self._interrupted)
        if isinstance(self.model, _EngineModule):
            self.model = self.model.module
        super().teardown()


def data_parallel_coordinate(mesh: Any) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks of ``mesh`` (``dp_replicate`` outer,
    ``dp_shard`` inner) and their number; ``tp`` ranks share one index."""
    names = tuple(mesh.mesh_dim_names or ())
    rank, size = 0, 1
    for dim in ("dp_replicate", "dp_shard"):
        if dim in names:
            n = int(mesh.size(names.index(dim)))
            rank, size = rank * n + int(mesh.get_local_rank(dim)), size * n
    return rank, size


def _encode_lightning_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint dict without what the engine stores itself, for the engine's
    ``client_state`` (which it encodes with ``zerostate.jsonstate``); a key that cannot be
    stored that way (a hyperparameter holding an arbitrary object) is left out with a
    warning rather than pickled."""
    out = {}
    for key, value in checkpoint.items():
        if key in _ENGINE_KEYS:
            continue
        try:
            jsonstate.encode(value, f"checkpoint[{key!r}]")
        except ConfigError as exc:
            log.warning("zerostate: Lightning checkpoint key %r is not saved: %s", key, exc)
            continue
        out[key] = value
    return out
