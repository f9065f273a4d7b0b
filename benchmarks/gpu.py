"""``python -m benchmarks.gpu --out gpu.json`` (what benchmarks/gpu.sh runs): the CUDA and
NCCL paths on one GPU, each part guarded so that one failure leaves the others' results.

Parts, in order: environment; parity of every stage with single-process torch AdamW on
one process and on several processes sharing the device (NCCL may refuse that; the error
is recorded); bf16 step time vs FSDP2 and DeepSpeed; blocking and async save (pinned host
buffers and a side stream inside the engine) vs DCP. Results go to one JSON file, written
again after every part so that a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common import version_of
from benchmarks.contenders import Ctx

PARITY_STEPS = 5
PARITY_TOL = 1e-5  # relative L2 error of every parameter after PARITY_STEPS steps
# The attention key bias has an analytically zero gradient, so its computed gradient is
# rounding noise whose sign depends on summation order; with eps=1e-8 Adam turns that noise
# into full-size steps that no two reduction orders agree on. eps=1e-6 keeps it out.
PARITY_EPS = 1e-6


def parity(params: dict, ctx: Ctx) -> dict:
    """Worker: zerostate at ``params['stage']`` vs torch AdamW on the global batch, in fp32;
    worst relative L2 error over parameters after a few steps."""
    import torch
    import torch.distributed as dist

    from benchmarks.contenders import adamw, batches, build_model, make_zerostate

    torch.backends.cuda.matmul.allow_tf32 = False  # parity is an fp32 question
    torch.backends.cudnn.allow_tf32 = False
    preset, mb, seq = params["model"], params["micro_batch"], params["seq_len"]
    ref = build_model(preset, ctx.device)
    opt = adamw(ref.parameters(), eps=PARITY_EPS)
    trainer = make_zerostate(build_model(preset, ctx.device), params["stage"], eps=PARITY_EPS)
    mine = batches(preset, ctx.rank, mb, seq, PARITY_STEPS, ctx.device)
    every = [batches(preset, r, mb, seq, PARITY_STEPS, ctx.device) for r in range(ctx.world)]
    for i in range(PARITY_STEPS):
        trainer.step(mine[i][:, :-1], mine[i][:, 1:])
        # The engine averages gradients over ranks: the reference averages the ranks' losses.
        opt.zero_grad(set_to_none=True)
        loss = sum(ref(b[i][:, :-1], b[i][:, 1:]) for b in every) / ctx.world
        loss.backward()
        opt.step()
    full = trainer.obj.full_state_dict()
    worst = 0.0
    for name, p in ref.named_parameters():
        err = float((full[name].float() - p.detach().float()).norm() / p.detach().norm())
        worst = max(worst, err)
    dist.barrier()
    return {"worst_rel_l2": worst, "steps": PARITY_STEPS, "ok": worst <= PARITY_TOL}


def _opts(**kw: Any) -> argparse.Namespace:
    base = dict(quick=False, nproc=1, load_nproc=1, steps=10, rounds=1, precision="fp32",
                timeout=300.0,
                verbose=False, contenders=None, dir=None, model=None, io_model=None,
                batch=None, quick_jobs=False)
    return argparse.Namespace(**{**base, **kw})


def _env() -> dict:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "deepspeed": version_of("deepspeed"),
                           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out.update(device=torch.cuda.get_device_name(0), devices=torch.cuda.device_count(),
                   cuda=torch.version.cuda, nccl=str(torch.cuda.nccl.version()))
    return out


def _part_parity(nproc: int) -> dict:
    """Stages 0-3 in one torchrun job (one start-up) at ``nproc`` processes."""
    from benchmarks.common import launch

    jobs = [(f"stage{s}", "parity", {"model": "small", "micro_batch": 4, "seq_len": 64,
                                     "stage": s}) for s in range(4)]
    done = launch(jobs, nproc=nproc, batch=True, timeout=150)
    out = {name: (job.ranks[0] if job.ok else {"ok": False, "error": job.error})
           for name, job in done.items()}
    print(f"  parity nproc={nproc}: {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu.json"))
    p.add_argument("--nproc", type=int, default=2, help="processes sharing the GPU")
    args = p.parse_args(argv)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "parts": {}}

    def part(name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        print(f"{name} ...", flush=True)
        try:
            results["parts"][name] = {"ok": True, "result": fn()}
        except Exception:
            results["parts"][name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        results["parts"][name]["seconds"] = time.perf_counter() - t0
        args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")

    part("environment", _env)
    part("parity_nproc1", lambda: _part_parity(1))
    shared = 1
    if args.nproc > 1:
        part(f"parity_nproc{args.nproc}", lambda: _part_parity(args.nproc))
        run = results["parts"][f"parity_nproc{args.nproc}"]
        if run["ok"] and all(r.get("ok") for r in run["result"].values()):
            shared = args.nproc  # NCCL accepted several ranks on one device
    results["ranks_per_device_used"] = shared

    from benchmarks import ckpt_rows, step

    # The async path (pinned host buffers, side stream) first: it exists only on a GPU.
    part("save_async_load_consolidate", lambda: ckpt_rows.run(_opts(
        nproc=shared, load_nproc=1, io_model="gpu", timeout=150)))
    part("step_bf16", lambda: step.run(_opts(
        nproc=shared, precision="bf16", model="gpu", batch=(8, 512), steps=10, quick_jobs=True,
        contenders=["ddp", "ds1", "ds2", "fsdp2_noreshard", "ds3", "fsdp2",
                    "zs0", "zs1", "zs2", "zs3"])))
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    bad = [k for k, v in results["parts"].items() if not v["ok"]]
    print(f"wrote {args.out}; parts failed: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
