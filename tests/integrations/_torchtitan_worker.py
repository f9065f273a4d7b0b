"""One rank of a torchtitan job (``torchrun --nproc_per_node=N _torchtitan_worker.py PHASE OUT
ROPE``, ROPE one of benchmarks/titan.py's ``ROPES``):

* ``zerostate`` (4 ranks): torchtitan's Llama3 debugmodel with torchtitan's own TP plan on a
  (dp_shard 2 x tp 2) gloo mesh, ``zerostate.Engine(model, mesh=mesh, stage=3, lr=...)`` at
  default settings, the RoPE caches where torchtitan puts them; trains STEPS steps, saving to
  ``OUT/ckpt`` after step SAVE_AFTER;
* ``fsdp2`` (4 ranks): the same model and plan, FSDP2 applied by torchtitan's own
  ``apply_fsdp_to_decoder``, ``torch.optim.AdamW``; trains STEPS steps;
* ``resume`` (2 ranks): the plain model (no tp), ``zerostate.Engine(model, stage=3, lr=...)``
  loads ``OUT/ckpt`` and trains the steps after SAVE_AFTER on the same global batches.

Rank 0 writes ``OUT/PHASE.json`` as it goes (the zerostate phase: its stage-3 units first,
then the losses), and the error a phase raised, so that a failure names its cause. The model,
plan, data and loss are benchmarks/titan.py's (its docstring says what runs on CPU and how).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

STEPS, SAVE_AFTER = 5, 2


def main(phase: str, out: str, rope: str) -> int:
    from benchmarks import titan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    record: dict = {"phase": phase}
    path = os.path.join(out, f"{phase}.json")

    def report(key: str, value) -> None:
        record[key] = value
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                json.dump(record, f, indent=2)

    try:
        if phase == "zerostate":
            result = titan.train_zerostate(
                range(STEPS), save_to=os.path.join(out, "ckpt"), save_after=SAVE_AFTER,
                report=report, rope=rope,
            )  # fmt: skip
        elif phase == "fsdp2":
            result = titan.train_fsdp2(range(STEPS), rope=rope)
        elif phase == "resume":
            ckpt, steps = os.path.join(out, "ckpt"), range(SAVE_AFTER + 1, STEPS)
            result = titan.resume_zerostate(ckpt, steps, rope=rope)
        else:
            raise SystemExit(f"unknown phase {phase!r}")
    except Exception as exc:
        trace = traceback.format_exc()
        report("error", f"{type(exc).__name__}: {exc}")
        report("trace", trace[-4000:])
        print(trace, file=sys.stderr, flush=True)
        return 1
    report("losses", result["losses"])
    for key in ("model_state_bytes", "gathered", "block_bytes", "root_bytes"):
        if key in result:
            report(key, result[key])
    report("done", True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
