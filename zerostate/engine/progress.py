"""The opt-in progress line (``EngineConfig.log_every``), as DeepSpeed's ``steps_per_print``.

Rank 0 logs through :mod:`logging` (logger ``zerostate.engine``, level INFO) every
``log_every`` optimizer steps: the step, the mean step time over the window, samples/s and
tokens/s over all ranks (counted from the forward inputs: the first tensor argument's
first dimension is the batch, and an integer tensor of two or more dimensions is token
ids), the last loss given to ``engine.backward``, the learning rate, the gradient norm and
memory. Nothing here synchronises a GPU except on the steps that log.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

log = logging.getLogger("zerostate.engine")


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, dict):
            found = _first_tensor((), value)
            if found is not None:
                return found
    return None


class ProgressLog:
    """Counts what passes through the engine and logs one line every ``every`` steps."""

    def __init__(self, every: int | None) -> None:
        self.every = every
        self._start = time.perf_counter()
        self._steps = 0
        self._samples = 0
        self._tokens = 0
        self._loss: torch.Tensor | None = None

    def note_batch(self, args: tuple, kwargs: dict) -> None:
        if self.every is None:
            return
        batch = _first_tensor(args, kwargs)
        if batch is None or batch.ndim == 0:
            return
        self._samples += int(batch.shape[0])
        if batch.ndim >= 2 and not batch.is_floating_point():
            self._tokens += batch.numel()

    def note_loss(self, loss: torch.Tensor) -> None:
        if self.every is not None:
            self._loss = loss.detach()

    def after_step(self, engine: Any) -> None:
        if self.every is None:
            return
        self._steps += 1
        if engine.optimizer_steps % self.every:
            return
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        if engine.rank == 0:
            log.info("%s", self.line(engine, elapsed))
        self._start, self._steps, self._samples, self._tokens = now, 0, 0, 0

    def line(self, engine: Any, elapsed: float) -> str:
        parts = [f"step {engine.optimizer_steps}"]
        if self._loss is not None:
            parts.append(f"loss {float(self._loss):.4g}")
        parts.append(f"step time {elapsed / max(self._steps, 1):.3f} s")
        if self._samples:
            parts.append(f"{self._samples * engine.data_parallel_size / elapsed:.1f} samples/s")
        if self._tokens:
            parts.append(f"{self._tokens * engine.data_parallel_size / elapsed:.0f} tokens/s")
        groups = engine.optimizer.param_groups
        if groups and "lr" in groups[0]:
            parts.append(f"lr {float(groups[0]['lr']):.3g}")
        if engine.last_grad_norm is not None:
            parts.append(f"grad norm {engine.last_grad_norm:.3g}")
        parts.append(f"model states {engine.memory_stats()['total'] / 2**20:.1f} MiB/rank")
        if engine.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(engine.device) / 2**30
            parts.append(f"peak {peak:.2f} GiB")
        return ", ".join(parts)
