"""``ZeroStateTrainer``: a drop-in for ``transformers.Trainer`` that trains through a
:class:`zerostate.Engine` and checkpoints into the zerostate store.

    trainer = ZeroStateTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                               stage=3)          # + any zerostate.EngineConfig field
    trainer.train()                               # or train(resume_from_checkpoint=True)
    trainer.save_model("out/")                    # consolidated: from_pretrained loads it

Same arguments as ``Trainer`` plus ``stage`` and the engine's options. What changes:

- the optimizer the Trainer builds (``optim``, ``learning_rate``, weight-decay groups) is
  handed to the engine, which rebuilds it over its master shards; the Trainer's scheduler
  (``lr_scheduler_type``, warm-up) drives the engine's param groups;
- ``gradient_accumulation_steps`` and ``max_grad_norm`` become the engine's; the engine
  reduces gradients (no DDP wrapper) and steps at the accumulation boundary. Each loss is
  back-propagated exactly as the stock Trainer would (its token-count normalisation
  included), so the numbers match ``Trainer`` with DDP;
- every ``save_steps`` the Trainer's ``checkpoint-<step>/`` directory is a store root
  (every rank writes its partitions: weights, optimizer state, scheduler, RNG) beside the
  Trainer's ``trainer_state.json``; ``resume_from_checkpoint`` loads it at any world size
  and the Trainer skips to the data position it records (keep the global batch, i.e.
  per-device batch x world size, the same); with ``load_best_model_at_end=True`` the
  engine loads the best of them before ``train()`` returns;
- ``save_model(dir)`` writes the gathered fp32 weights with ``save_pretrained`` (a peft
  model writes its adapter), which ``from_pretrained`` loads;
- ``mesh=`` (a device mesh with ``tp``: the model parallelized with torch's
  ``parallelize_module`` before the Trainer is built) passes through to the engine, and the
  dataloader is split over the data-parallel ranks only (accelerate's mesh-aware split): the
  ``tp`` ranks of one data-parallel coordinate see the same batches. The Trainer's
  checkpoints with tensor parallelism are not tested yet (``engine.save`` / ``load`` are:
  format 3); ``save_strategy="no"`` keeps clear of them;
- when ``train()`` returns, the engine is closed and the model holds its full trained
  weights at every stage, stage 3 included: ``model.save_pretrained(dir)`` or
  ``torch.save(model.state_dict(), path)`` on rank 0 writes them, and evaluation runs on
  the plain model. A ``train()`` that raises leaves the model as it is.

The number of batches per epoch must be a multiple of ``gradient_accumulation_steps``
(the engine steps every that many micro-batches; the stock Trainer also steps on a
shorter last window). Tested with transformers 5.x.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any

import torch
import transformers
from torch import nn

import zerostate
from zerostate.errors import ConfigError
from zerostate.store import open_checkpoint

log = logging.getLogger(__name__)

#: Engine settings that come from ``TrainingArguments``.
_FROM_ARGS = ("precision", "grad_accum_steps", "grad_clip", "stage", "optimizer")


class _EngineModule(nn.Module):
    """What the Trainer runs: calls go through the engine; no DDP wrapper around it."""

    def __init__(self, engine: zerostate.Engine, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.engine = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)


class _EngineOptimizer(torch.optim.Optimizer):
    """The engine's param groups under the Trainer's optimizer calls: schedulers set their
    learning rate; ``step`` and ``zero_grad`` do nothing (the engine steps in
    ``training_step``); the state lives in the engine and in its checkpoints."""

    def __init__(self, engine: zerostate.Engine) -> None:  # noqa: D107 - no super(): no params
        self.engine = engine
        self.defaults = dict(engine.optimizer.defaults)
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.engine.optimizer.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:  # type: ignore[override]
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override]
        pass


def is_store_root(path: str) -> bool:
    """Whether ``path`` holds zerostate steps (a checkpoint this trainer wrote)."""
    try:
        return bool(open_checkpoint(path).steps())
    except (OSError, ValueError):
        return False


class ZeroStateTrainer(transformers.Trainer):
    """``transformers.Trainer`` through the engine; see the module documentation."""

    def __init__(self, *args: Any, stage: int = 2, **kwargs: Any) -> None:
        names = set(zerostate.EngineConfig.__dataclass_fields__)
        engine_options = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        taken = sorted(set(engine_options) & set(_FROM_ARGS))
        if taken:
            raise ConfigError(
                f"ZeroStateTrainer: {taken} come from TrainingArguments (bf16/fp16, "
                "gradient_accumulation_steps, max_grad_norm, optim) or stage=; set them there"
            )
        super().__init__(*args, **kwargs)
        zerostate.EngineConfig(stage=stage, **engine_options)  # validated now, not at train
        if engine_options.get("mesh") is not None:
            self._shard_data_by_mesh(engine_options["mesh"])
        self.stage = stage
        self.engine_options = engine_options
        self.engine: zerostate.Engine | None = None
        self._engine_module: _EngineModule | None = None

    def _shard_data_by_mesh(self, mesh: Any) -> None:
        """Ranks at one data-parallel coordinate (the ``tp`` ranks of it) must see the same
        batches. Accelerate splits a dataloader by a device mesh whose dimensions are named
        as the engine's (``dp_replicate``, ``dp_shard``, ``tp``, tp innermost), and takes
        that mesh from ``Accelerator._prepare_device_mesh``, which here returns the
        engine's mesh instead of accelerate's own (none without a parallelism config)."""
        if not hasattr(self.accelerator, "_prepare_device_mesh"):
            raise ConfigError(
                "ZeroStateTrainer(mesh=...): this accelerate version cannot split the data "
                "by a device mesh (Accelerator._prepare_device_mesh is missing); use "
                "accelerate >= 1.10"
            )
        names = tuple(mesh.mesh_dim_names or ())
        if "tp" in names and names[-1] != "tp":
            raise ConfigError(
                f"ZeroStateTrainer(mesh=...): mesh dimensions {names} must end with 'tp' "
                "(accelerate gives ranks r // tp_size the same data)"
            )
        self.accelerator._prepare_device_mesh = lambda: mesh

    # ---------------------------------------------------------------- building
    def _precision(self) -> str:
        return "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32"

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.engine is None:
            user = super().create_optimizer(model)
            clip = self.args.max_grad_norm
            self.engine = zerostate.Engine(
                self.model,
                stage=self.stage,
                optimizer=user,
                precision=self._precision(),
                grad_accum_steps=self.args.gradient_accumulation_steps,
                grad_clip=float(clip) if clip and clip > 0 else None,
                **self.engine_options,
            )
            self._engine_module = _EngineModule(self.engine, self.model)
            self.optimizer = _EngineOptimizer(self.engine)
        return self.optimizer

    def train(self, *args: Any, **kwargs: Any) -> Any:
        output = super().train(*args, **kwargs)
        if self.engine is not None:
            # Every rank returns from train() here; after an exception the others may be
            # stuck, so only a normal end gathers ([Note: no hollow state dict] in
            # zerostate.runtime.runtime).
            self.engine.close()
        return output

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None):
        if self._engine_module is None or self.engine.closed:  # the plain model
            return super()._wrap_model(model, training, dataloader)
        return self._engine_module

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        accum = self.args.gradient_accumulation_steps
        if len(loader) % accum:
            raise ConfigError(
                f"ZeroStateTrainer: {len(loader)} batches per epoch on each rank is not a "
                f"multiple of gradient_accumulation_steps={accum}; the engine steps every "
                f"{accum} micro-batches (drop the last batches with dataloader_drop_last or "
                "change the batch size)"
            )
        return loader

    # ----------------------------------------------------------------- training
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """The stock step's loss, back-propagated through the engine. The engine divides
        the summed gradients by world size x accumulation steps; DDP divides by the world
        size only, so the loss the stock step would back-propagate is scaled by the
        accumulation steps first."""
        assert self.engine is not None
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.loss_is_scaled_for_ga is not None:
            scaled = self.loss_is_scaled_for_ga
        else:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        self.engine.backward(loss * self.args.gradient_accumulation_steps)
        self.engine.step()
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        assert self.engine is not None
        return torch.tensor(self.engine.last_grad_norm)  # the engine clipped already

    # -------------------------------------------------------------- checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        if _internal_call:  # a checkpoint at save_steps: the whole state, into the store
            self.engine.save(output_dir, stateful=self._stateful())
            return None
        state = self.engine.full_state_dict()  # collective: every rank gathers
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            unwrapped = self.accelerator.unwrap_model(self.model)
            unwrapped.save_pretrained(output_dir, state_dict=state)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        return None

    def _stateful(self) -> dict:
        return {"scheduler": self.lr_scheduler} if self.lr_scheduler is not None else {}

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pass  # in the store with the weights (save_model, internal call)

    def _save_rng_state(self, output_dir: str) -> None:
        pass  # every rank's RNG state is in its manifest

    def _save_scaler(self, output_dir: str) -> None:
        pass  # the engine's loss scale is part of its state

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not is_store_root(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        return None  # the engine loads it once it exists (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self.engine is None or not is_store_root(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.engine.load(checkpoint, stateful=self._stateful())
        return None

    def _load_best_model(self) -> None:
        """``load_best_model_at_end=True``: the best checkpoint is a store root, which the
        stock method looks into for ``model.safetensors``, finds none, and leaves the last
        weights in the model with a warning about ``--save_on_each_node`` (2 ranks,
        stages 2 and 3). The engine loads it instead (collective, as the Trainer calls this
        on every rank), before ``train()`` closes the engine and leaves the weights in the
        model."""
        best = self.state.best_model_checkpoint
        if self.engine is None or self.engine.closed or best is None or not is_store_root(best):
            return super()._load_best_model()
        log.info("Loading best model from %s (score: %s).", best, self.state.best_metric)
        self.engine.load(best, stateful=self._stateful())
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_store_root(checkpoint):
            return super()._load_rng_state(checkpoint)
        return None  # restored by engine.load (at the same world size)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_store_root(checkpoint):
            return super()._load_scaler(checkpoint)
        return None


__all__ = ["ZeroStateTrainer"]
