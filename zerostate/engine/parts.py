"""The engine's state as parts: what a checkpoint saves and loads, and how a load is
planned and applied ([Note: engine parts] in zerostate.checkpoint.parts).

:class:`StateParts` holds references to the pieces the engine built (the sharded
parameters, the sharded optimizer, the loss scaler, the group runtime, the host tier) and
the few counters a load resets; the engine hands it, never itself, to the checkpoint
sessions and to ``load_pretrained``.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerostate.checkpoint import tensor_parallel as tp_checkpoint
from zerostate.checkpoint.load_plan import AppliedLoad, LoadPlan, check_tensors, check_tying
from zerostate.dist.coordinator import Coordinator
from zerostate.engine.build import first_names
from zerostate.errors import ConfigError, CorruptCheckpointError, EngineUsageError
from zerostate.layout.partition import TensorLayout
from zerostate.optim import OptimizerLoad, ShardedOptimizer
from zerostate.optim.precision import LossScaler
from zerostate.runtime import adapt
from zerostate.runtime.offload import HostTier, wait_copies
from zerostate.runtime.runtime import GroupRuntime
from zerostate.runtime.sharded import ShardedParam, ShardView
from zerostate.store.state_doc import ENGINE_STATE_VERSION, check_document

if TYPE_CHECKING:
    from zerostate.checkpoint.tensor_parallel import CheckpointWorld
    from zerostate.engine.config import EngineConfig
    from zerostate.runtime.tp import TensorParallel

__all__ = ["StateParts"]


class StateParts:
    """One engine's state, as :class:`~zerostate.checkpoint.parts.EngineParts`."""

    def __init__(
        self,
        *,
        module: nn.Module,
        config: EngineConfig,
        params: list[ShardedParam],
        tied: Mapping[str, str],
        optimizer: ShardedOptimizer,
        scaler: LossScaler,
        runtime: GroupRuntime,
        host: HostTier | None,
        tensor_parallel: TensorParallel | None,
        coordinator: Coordinator,
        checkpoint_world: CheckpointWorld | None,
        device: torch.device,
        unset: Collection[str] = (),
    ) -> None:
        self.module, self.config, self.tied = module, config, tied
        self.coordinator, self.checkpoint_world = coordinator, checkpoint_world
        self.rank, self.world_size = coordinator.rank, coordinator.world_size
        self._params, self._optimizer, self._scaler = params, optimizer, scaler
        self._runtime, self._host, self._tp, self._device = runtime, host, tensor_parallel, device
        state = adapt.replicated_state(module)  # buffers + frozen integer parameters
        self._buffer_names = [n for n, _ in state]
        #: Non-persistent buffers: neither saved nor loaded ([Note: buffers as torch
        #: treats them] in zerostate.runtime.adapt).
        self.non_persistent = adapt.non_persistent_buffers(module)
        skip = set(self.non_persistent)
        self._saved_buffer_names = [
            n for n in self._buffer_names if adapt.canonical_name(n) not in skip
        ]
        #: Micro-batches accumulated since the last optimizer step (a load resets it).
        self.micro_step = 0
        #: Names whose values no initialiser wrote ([Note: unset state], runtime/init.py).
        self.unset: set[str] = set(unset)
        #: Names a load_pretrained that failed while reading may have partly written, and
        #: its source ([Note: torn weights]).
        self.torn: set[str] = set()
        self.torn_source = ""

    @property
    def optimizer_steps(self) -> int:
        return self._optimizer.step_count

    # -- what a load wrote -----------------------------------------------------------------
    def mark_set(self, names: Collection[str]) -> None:
        self.unset.difference_update(names)
        self.torn.difference_update(names)

    def mark_torn(self, names: Collection[str], source: str) -> None:
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
        self.torn.update(names)
        self.torn_source = source

    def check_trainable(self, what: str) -> None:
        """Refuse ``what`` while tensors are unset or torn (training on them would train
        values nobody wrote)."""
        if self.unset:
            names = sorted(self.unset)
            raise EngineUsageError(
                f"{len(names)} tensor(s) of this meta-device model have no initialiser and "
                f"were never loaded: {first_names(names)}. Call engine.load_pretrained(...) "
                "or engine.load(...) first, or pass init_fn=callable(module) to initialise them"
            )
        self.check_not_torn(what)

    def check_not_torn(self, what: str) -> None:
        """Refuse ``what`` while a failed ``load_pretrained`` left tensors torn."""
        if not self.torn:
            return
        names = sorted(self.torn)
        raise EngineUsageError(
            f"{what} refused: load_pretrained({self.torn_source!r}) failed while reading "
            f"and left {len(names)} tensor(s) partly written, neither the model's values "
            f"nor the file's: {first_names(names)}. Call engine.load_pretrained(...) again, "
            "or engine.load(...), to set them"
        )

    # -- state views -----------------------------------------------------------------------
    def named_buffers(self, saved: bool = False) -> list[tuple[str, torch.Tensor]]:
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
        for name, buf in self.named_buffers(saved=True):
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
            "stage": self.config.stage,
            "precision": self.config.precision,
            "world_size": self.world_size,
            "config": self.config.summary(),
            "tied": dict(self.tied),
            "frozen": [sp.name for sp in self._params if not sp.trainable],
            "non_persistent_buffers": list(self.non_persistent),
            "optimizer": self._optimizer.metadata(),
        }

    def optimizer_classes(self) -> list[type]:
        """The classes of the inner optimizers, in order (what a checkpoint records)."""
        return [type(opt) for opt in self._optimizer.inner]

    def group_names(self) -> list[list[str]]:
        """The canonical parameter names of each optimizer param group, in order."""
        return [[sp.name for sp in members] for members in self._optimizer.group_members]

    # -- planned load ----------------------------------------------------------------------
    def _optimizer_meta(self, state: dict) -> dict:
        meta = state.get("optimizer")
        if meta is None and state.get("version") == 1:
            from zerostate.optim import legacy_adamw_metadata

            return legacy_adamw_metadata(
                self.group_names(), state.get("step", 0), self._optimizer.optimizer.param_groups
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
        [Note: planned load] in zerostate.checkpoint.load_plan)."""
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
        for name, buf in self.named_buffers(saved=True):
            needed[f"buffers/{name}"] = adapt.stored_buffer(name, buf, tp_mesh).shape
        return needed

    def apply_load(self, plan: LoadPlan, read: Collection[str] = ()) -> AppliedLoad:
        """Install a checked plan (before the tensors named in ``read`` are read into
        :meth:`state_views`): the host optimizer state the step holds gets tensors the
        reader fills in place (fresh ones, or its own while known zero), and the undo puts
        the optimizer state, step count and loss scale back exactly."""
        scaler = self._scaler.state_dict()
        micro = self.micro_step
        torn = set(self.torn)
        undo_optimizer, fresh = self._optimizer.apply_load(plan.optimizer, plan.step, read)
        self._scaler.load_state_dict(plan.loss_scaler)
        self.micro_step = 0
        # The step's weights and buffers replace torn ones ([Note: torn weights]).
        self.torn.difference_update(
            n.split("/", 1)[1] for n in read if n.startswith(("model/", "buffers/"))
        )

        def undo() -> None:
            undo_optimizer()
            self._scaler.load_state_dict(scaler)
            self.micro_step = micro
            self.torn.clear()
            self.torn.update(torn)

        return AppliedLoad(undo, frozenset(id(t) for t in fresh))

    def load_engine_state(self, state: dict, *, strict: bool = True) -> None:
        """Plan and apply ``state`` alone (the tensors are the caller's business)."""
        self.apply_load(self.plan_load(state, strict=strict))

    def settle_host_copies(self) -> None:
        # Offloaded masters may still be read by the last step's non-blocking host ->
        # device copies; a load writes them from the host, outside the device's order.
        if self._host is not None:
            wait_copies(self._device)

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
