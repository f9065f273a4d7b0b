"""Pieces the benchmark scripts share (they run as plain scripts, so this sits beside them)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_worker(worker: Callable[[Any, int], None], args: Any) -> None:
    """Run a torchrun worker; on failure leave its traceback in ``<result_file>.rank<r>.err``
    for the launcher. Never returns: with gloo, interpreter teardown after the work is done
    sometimes aborts ("terminate called without an active exception", SIGABRT), which would
    report a finished run as failed, so the process exits without it."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        worker(args, rank)
    except BaseException:
        Path(f"{args.result_file}.rank{rank}.err").write_text(traceback.format_exc())
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def deepspeed_config(*, stage: int, micro_batch: int, world: int, lr: float,
                     weight_decay: float) -> dict:
    """DeepSpeed ZeRO ``stage`` in fp32 (no fp16/bf16 section) with plain torch AdamW:
    ``torch_adam`` needs no compiled FusedAdam/CPUAdam op, so it runs on CPU."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world,
        "optimizer": {
            "type": "AdamW",
            "params": {"torch_adam": True, "lr": lr, "weight_decay": weight_decay},
        },
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def drop_caches() -> bool:
    """Write back and drop the page cache; False when not permitted (not root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
