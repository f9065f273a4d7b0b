"""``CheckpointManager``: torchtitan's checkpoint manager, saving into the zerostate store.

torchtitan (0.3.0) picks its checkpoint manager by the class of ``job.checkpoint``'s config
(``BaseCheckpointManager.Config``; the trainer calls ``config.checkpoint.build(...)``). This
one is torchtitan's DCP manager with the storage changed: every save is ``dcp.save`` /
``dcp.async_save`` through :class:`zerostate.dcp.StorageWriter`, every load ``dcp.load``
through :class:`zerostate.dcp.StorageReader`. A job selects it with one config change::

    from zerostate.integrations.torchtitan import CheckpointManager

    checkpoint=CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=500, async_mode="async",
        keep_latest_k=2,
    )

``folder`` (joined to the job's dump folder, as torchtitan does) is a checkpoint root of the
store: a local path or an fsspec URL (``s3://...``, ``storage_options`` for its filesystem).
What torchtitan's own DCP manager honours, this one does: ``enable``, ``interval``,
``async_mode`` (``disabled``, ``async``, ``async_with_pinned_mem``), ``keep_latest_k`` (the
store's retention), ``load_step`` (-1: the newest committed step), ``initial_load_path``
(another root of the store; ``initial_load_model_only``) and ``initial_load_in_hf`` (a
Hugging Face directory, through the model's state-dict adapter, as torchtitan reads it),
``exclude_from_loading``, ``load_only``, ``enable_first_step_checkpoint``, and the last
step's ``last_save_model_only`` / ``export_dtype`` / ``last_save_in_hf``.

The states are torchtitan's: the model flattened to the top level (torchtitan's
``ModelWrapper``), ``optimizer`` (its ``OptimizersContainer``, FQN-keyed), ``lr_scheduler``,
``dataloader`` and ``train_state`` (the trainer), under the same keys as torchtitan's DCP
manager writes them. The store holds no pickle: torchtitan's ``ParallelAwareDataloader``
pickles its state into bytes, so this manager saves the state it pickles instead, as a
plain value, and loads it back without unpickling anything ([Note: dataloader state]).

Importing this module imports torchtitan; ``zerostate`` itself never does.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

try:
    from torchtitan.components.checkpointer.base import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
except ModuleNotFoundError as _exc:
    if (_exc.name or "").partition(".")[0] != "torchtitan":  # torchtitan's own imports
        raise
    raise ImportError(
        "zerostate.integrations.torchtitan needs torchtitan 0.3.0: pip install --no-deps "
        "torchtitan==0.3.0 (docs/torchtitan.md lists the few packages it imports)"
    ) from None

from zerostate.dcp import StorageReader, StorageWriter
from zerostate.dist import collectives
from zerostate.store.root import CheckpointRoot

log = logging.getLogger(__name__)

__all__ = ["ASYNC_MODES", "CheckpointManager", "export_hf"]

#: ``Config.async_mode``'s values, as torchtitan names them.
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


class _DataloaderState:
    """[Note: dataloader state]
    torchtitan's ``ParallelAwareDataloader.state_dict()`` is ``{"dp_rank_<r>":
    pickle.dumps(StatefulDataLoader.state_dict()), "world_size": W}``, and its
    ``load_state_dict`` unpickles those bytes. The store keeps no pickle and this module never
    unpickles what it reads, so the dataloader joins a checkpoint through this wrapper: the
    same keys, with the state torchtitan would pickle as the value (plain data that
    ``zerostate.jsonstate`` stores), handed back to ``StatefulDataLoader.load_state_dict``
    on load after the same world-size check torchtitan makes. Any other dataloader (any
    ``Stateful``) is saved as it is."""

    def __init__(self, dataloader: Any, inner: Callable[[], Any]) -> None:
        self.dataloader = dataloader
        self.inner = inner  # the StatefulDataLoader view of ``dataloader``

    def _rank_key(self) -> str:
        keys = [k for k in self.dataloader.state_dict() if k != "world_size"]
        if len(keys) != 1:
            raise ValueError(f"dataloader state has keys {keys}, expected one dp_rank key")
        return keys[0]

    def state_dict(self) -> dict[str, Any]:
        return {
            self._rank_key(): self.inner().state_dict(),
            "world_size": self.dataloader.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self._rank_key()
        if not state_dict or key not in state_dict:
            log.warning("dataloader state is empty for this dp rank (expected key %s)", key)
            return
        if state_dict.get("world_size") != self.dataloader.dp_world_size:
            raise ValueError(
                f"the checkpoint's dataloader state is for dp world size "
                f"{state_dict.get('world_size')}, this job has {self.dataloader.dp_world_size}"
                ": dataloader resharding is not supported (exclude_from_loading=['dataloader'])"
            )
        self.inner().load_state_dict(state_dict[key])


def _dataloader_state(dataloader: Any) -> Any:
    """``dataloader`` as it joins a checkpoint ([Note: dataloader state])."""
    try:
        from torchtitan.components.dataloader import ParallelAwareDataloader
    except ImportError:  # torchdata missing: no ParallelAwareDataloader can exist
        return dataloader
    if isinstance(dataloader, ParallelAwareDataloader):
        return _DataloaderState(dataloader, lambda: super(ParallelAwareDataloader, dataloader))
    return dataloader


class CheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager saving into zerostate's store (module docstring).

    Built by torchtitan's trainer as ``config.checkpoint.build(dataloader=...,
    model_parts=..., optimizers=..., lr_schedulers=..., states={"train_state": trainer},
    sd_adapter=..., base_folder=dump_folder)`` and driven as it drives its DCP manager:
    ``load(step)`` before the first step, ``maybe_wait_for_staging()`` before each optimizer
    step, ``save(step, last_step=...)`` after each step, ``close()`` at the end.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint policies (``BaseCheckpointManager.Config``) and the
        store's own settings."""

        async_mode: str = "disabled"
        """``disabled`` (``dcp.save``), ``async`` (``dcp.async_save`` on a thread: training
        goes on while the step is written) or ``async_with_pinned_mem`` (staged into pinned
        shared memory and written by a process of its own, as torchtitan does)."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """Options of the fsspec filesystem when ``folder`` is a URL (``s3://...``)."""

        hf_folder: str = ""
        """Where ``last_save_in_hf`` writes the Hugging Face directory (``step-<N>/`` in
        it), relative to the dump folder; empty: ``<folder>-hf``."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.strip().lower() if isinstance(self.async_mode, str) else None
            if mode not in ASYNC_MODES:
                raise ValueError(
                    f"checkpoint.async_mode must be one of {', '.join(ASYNC_MODES)}, got "
                    f"{self.async_mode!r}"
                )
            self.async_mode = mode

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future: Future | None = None
        if not self.enable:
            return
        self.folder = filesystem.join(base_folder, config.folder)
        hf_folder = config.hf_folder or f"{config.folder.rstrip('/')}-hf"
        self.hf_folder = filesystem.join(base_folder, hf_folder)
        self.storage_options = dict(config.storage_options)
        self.interval = config.interval
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: _dataloader_state(dataloader),
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.load_only = config.load_only
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.initial_load_in_hf = config.initial_load_in_hf
        if config.initial_load_in_hf_quantized:
            raise ValueError(
                "checkpoint.initial_load_in_hf_quantized is not supported by zerostate's "
                "manager; use torchtitan's CheckpointManager for quantized HF loads"
            )
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = config.last_save_in_hf
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.sd_adapter = sd_adapter
        if self.last_save_in_hf and sd_adapter is None:
            log.warning(
                "checkpoint.last_save_in_hf without a state-dict adapter: the Hugging Face "
                "directory holds the model under torchtitan's own names"
            )
        self.keep_latest_k = config.keep_latest_k
        self.async_mode = config.async_mode
        # [Note: async saves] A background save's collectives run on a gloo group of their
        # own, as torchtitan's manager does: the training thread's groups stay free.
        self.pg = collectives.new_gloo_group() if self.async_mode != "disabled" else None
        self.stager: Any = None
        self.staging_future: Future | None = None
        log.info("Checkpointing into zerostate's store at %s", self.folder)

    def __del__(self) -> None:
        self.close()

    # ------------------------------------------------------------------ states
    def _model_states(self) -> dict[str, Any]:
        return self.states[MODEL].state_dict()

    def _flattened_states(self, states: dict[str, Any] | None = None) -> dict[str, Any]:
        """The model's tensors at the top level, the other states under their keys (the
        layout torchtitan's DCP manager writes)."""
        states = self.states if states is None else states
        flat = {k: v for k, v in states.items() if k != MODEL}
        if MODEL in states:
            flat.update(states[MODEL].state_dict())
        return flat

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return self._model_states()
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ValueError(
                    f"checkpoint.exclude_from_loading names {key!r}, which is not a state of "
                    f"this job ({', '.join(sorted(self.states))})"
                )
        kept = {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}
        return self._flattened_states(kept)

    # ------------------------------------------------------------------ saving
    def _writer(self, step: int, keep: bool = True) -> StorageWriter:
        keep_last = self.keep_latest_k if keep and self.keep_latest_k > 0 else None
        return StorageWriter(
            self.folder, step=step, keep_last=keep_last, storage_options=self.storage_options
        )

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step:
            self._save_last_step(curr_step)
            return True
        states = self._flattened_states()
        # [Note: retention] keep_latest_k is the writer's keep_last: the coordinator
        # deletes the older committed steps right after it commits this one (in the
        # background with the rest of an async save), never a step still being written.
        writer = self._writer(curr_step)
        if self.async_mode == "async":
            self.save_future = dcp.async_save(states, storage_writer=writer, process_group=self.pg)
        elif self.async_mode == "async_with_pinned_mem":
            self._save_pinned(states, writer)
        else:
            dcp.save(states, storage_writer=writer)
        return True

    def _save_pinned(self, states: dict[str, Any], writer: StorageWriter) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.stager is None:
            pinned = torch.cuda.is_available()  # pinning needs an accelerator's runtime
            if not pinned:
                log.warning("async_with_pinned_mem without CUDA: staging without pinning")
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=pinned,
                    use_shared_memory=True,
                    use_async_staging=True,
                    use_non_blocking_copy=pinned,
                )
            )
        result = dcp.async_save(
            states,
            storage_writer=writer,
            process_group=self.pg,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self.stager,
        )
        self.staging_future = result.staging_completion
        self.save_future = result.upload_completion

    def _save_last_step(self, curr_step: int) -> None:
        """The final save, synchronous: the whole state, or (``last_save_model_only``) the
        model in ``export_dtype``; with ``last_save_in_hf`` that model also as a Hugging
        Face directory consolidated from the committed step."""
        if not self.last_save_model_only:
            dcp.save(self._flattened_states(), storage_writer=self._writer(curr_step, False))
            return
        states = {
            k: v.to(self.export_dtype)
            if isinstance(v, torch.Tensor)
            and v.is_floating_point()
            and v.dtype != self.export_dtype
            else v
            for k, v in self._model_states().items()
        }
        if self.last_save_in_hf and self.sd_adapter is not None:
            states = self.sd_adapter.to_hf(states)
        dcp.save(states, storage_writer=self._writer(curr_step, False))
        if self.last_save_in_hf:
            out = filesystem.join(self.hf_folder, f"step-{curr_step}")
            export_hf(self.folder, curr_step, out, storage_options=self.storage_options)
            log.info("Exported step %d as a Hugging Face directory at %s", curr_step, out)

    # ------------------------------------------------------------------ loading
    def _committed_steps(self, root: str) -> list[int]:
        return CheckpointRoot.open(root, self.storage_options or None).steps()

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        steps = self._committed_steps(self.folder)
        if step != -1 and step not in steps:
            raise FileNotFoundError(
                f"checkpoint.load_step={step} is not a committed step of {self.folder} "
                f"(committed: {steps or 'none'})"
            )
        if steps:
            # Resuming: the folder's own steps win over every initial_* setting, as in
            # torchtitan, so a restarted job keeps its arguments.
            load_step = steps[-1] if step == -1 else step
            self._load_from(self.folder, load_step, model_only=load_step == 0)
            return True
        if self.initial_load_in_hf:
            path = self.initial_load_path or getattr(self.sd_adapter, "hf_assets_path", None)
            if self.sd_adapter is None or not path:
                raise ValueError(
                    "checkpoint.initial_load_in_hf needs the model's state-dict adapter and "
                    "checkpoint.initial_load_path (or model.hf_assets_path)"
                )
            self._load_hf(path)
            return True
        if not self.initial_load_path:
            log.info("No checkpoint was provided, this is a fresh start.")
            return False
        initial = self._committed_steps(self.initial_load_path)
        if not initial:
            raise FileNotFoundError(
                f"checkpoint.initial_load_path {self.initial_load_path} holds no committed "
                "step of zerostate's store"
            )
        self._load_from(self.initial_load_path, initial[-1], self.initial_load_model_only)
        return True

    def _load_from(self, root: str, step: int, model_only: bool) -> None:
        log.info("Loading step %d of %s%s", step, root, " (model only)" if model_only else "")
        states = self._states_to_load(model_only)
        reader = StorageReader(root, step=step, storage_options=self.storage_options)
        dcp.load(states, storage_reader=reader)
        # DCP loads the flattened model tensors in place; the wrapper then hands them to
        # the modules (what torchtitan's DCP manager does after its load).
        self.states[MODEL].load_state_dict(states)

    def _load_hf(self, path: str) -> None:
        log.info("Loading the model from the Hugging Face directory %s", path)
        hf_states = self.sd_adapter.to_hf(self._model_states())
        dcp.load(hf_states, storage_reader=self.sd_adapter.get_hf_storage_reader(path))
        self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_states))

    # ------------------------------------------------------------------ waiting
    def _maybe_wait_for_staging(self) -> None:
        if self.staging_future is not None:
            self.staging_future.result()
            self.staging_future = None

    def _wait_for_saving(self) -> None:
        assert self.save_future is not None
        future, self.save_future = self.save_future, None
        future.result()

    def _close(self) -> None:
        # A save still in flight is finished, not dropped: its step commits (or its
        # error is raised) before the job ends.
        if self.save_future is not None:
            self._wait_for_saving()
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def export_hf(
    root: str,
    step: int,
    out: str | os.PathLike,
    *,
    storage_options: dict | None = None,
) -> Path:
    """Write the tensors of committed step ``step`` of ``root`` (a step saved through
    :class:`zerostate.dcp.StorageWriter`) as a Hugging Face safetensors directory ``out``.

    Collective when a process group is up: the tensors are split by bytes over the ranks,
    each rank reads its whole tensors through :class:`~zerostate.dcp.StorageReader` (every
    byte checked) and writes ``model-<i>-of-<n>.safetensors``; rank 0 writes
    ``model.safetensors.index.json`` last, so a directory with an index is complete.
    """
    from safetensors.torch import save_file

    rank, world_size = collectives.group_info(None) if collectives.is_initialized() else (0, 1)
    reader = StorageReader(root, step=step, storage_options=storage_options)
    meta = reader.read_metadata()
    reader.close()
    tensors = {k: v for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")}
    # Largest first, each to the least loaded rank: the same split on every rank.
    loads = [0] * world_size
    owner: dict[str, int] = {}
    for key in sorted(tensors, key=lambda k: (-_nbytes(tensors[k]), k)):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        owner[key] = target
        loads[target] += _nbytes(tensors[key])
    writers = sorted({r for r in owner.values()})
    files = {r: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, r in
             enumerate(writers)}  # fmt: skip
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    mine = {
        k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype)
        for k, r in owner.items()
        if r == rank
    }
    if mine:
        dcp.load(mine, storage_reader=StorageReader(root, step, storage_options=storage_options),
                 no_dist=True)  # fmt: skip
        target = directory / files[rank]
        partial = target.with_name(target.name + ".partial")
        save_file({k: v.contiguous() for k, v in mine.items()}, str(partial),
                  metadata={"format": "pt"})  # fmt: skip
        os.replace(partial, target)
    collectives.barrier(group=None)
    if rank == 0:
        index = {
            "metadata": {"total_size": sum(loads)},
            "weight_map": {k: files[r] for k, r in sorted(owner.items())},
        }
        partial = directory / "model.safetensors.index.json.partial"
        partial.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(partial, directory / "model.safetensors.index.json")
    collectives.barrier(group=None)
    return directory


def _nbytes(meta: Any) -> int:
    numel = 1
    for d in meta.size:
        numel *= int(d)
    return numel * meta.properties.dtype.itemsize
