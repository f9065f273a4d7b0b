"""Entry point of every torchrun job: ``python -m benchmarks.worker TASK PARAMS_JSON OUT_DIR``.

Each rank runs ``TASK`` (a function ``(params, ctx) -> dict``) and writes its dict to
``OUT_DIR/rank<r>.json``; on failure the traceback goes to ``OUT_DIR/rank<r>.err`` for the
launcher to report."""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

TASKS = {
    "train": "benchmarks.step:train",
    "save": "benchmarks.ckpt:save",
    "load": "benchmarks.ckpt:load",
    "s3": "benchmarks.s3:transfer",
    "parity": "benchmarks.gpu:parity",
    "layout_save": "benchmarks.layout:save",
    "layout_load": "benchmarks.layout:load",
}


def _batch(params: dict, ctx: object) -> dict:
    """Several jobs one after the other in this process group (``--quick``: one start-up
    instead of one per contender). A failing job is recorded and the next one runs."""
    import torch.distributed as dist

    out = {}
    for name, task, sub in params["jobs"]:
        try:
            out[name] = {"ok": True, "result": _call(task, sub, ctx)}
        except Exception:
            out[name] = {"ok": False, "error": traceback.format_exc()}
        dist.barrier()
    return out


def _call(task: str, params: dict, ctx: object) -> dict:
    import torch

    torch.set_num_threads(params.get("threads", 1))
    if task == "batch":
        return _batch(params, ctx)
    module, func = TASKS[task].split(":")
    return getattr(importlib.import_module(module), func)(params, ctx)


def _run(task: str, params: dict) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks.contenders import Ctx

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and not os.environ.get("ZS_BENCH_CPU")
    # Several ranks may share one GPU (benchmarks/gpu.sh on a one-GPU machine).
    device = (torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda
              else torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=params.get("pg_timeout", 600))
    if task != "batch" and str(params.get("contender", "")).startswith("ds"):
        from benchmarks.deepspeed_import import import_deepspeed

        import_deepspeed().init_distributed(dist_backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout,
                                **({"device_id": device} if cuda else {}))
    ctx = Ctx(dist.get_rank(), dist.get_world_size(), device, cuda)
    result = _call(task, params, ctx)
    dist.barrier()
    dist.destroy_process_group()
    return result


def main() -> None:
    task, params, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = _run(task, params)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    # With gloo, interpreter teardown after finished work sometimes aborts ("terminate
    # called without an active exception"), which would report a finished run as failed.
    os._exit(0)


if __name__ == "__main__":
    main()
