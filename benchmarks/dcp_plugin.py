"""FSDP2 state through torch's checkpoint API: zerostate's storage plug-in
(``zerostate.dcp.StorageWriter``) against DCP's ``FileSystemWriter``, same state, same disk,
interleaved in one run.

    torchrun --nproc-per-node 2 -m benchmarks.dcp_plugin --dir /tmp/bench --rounds 3

Per round, in alternating order: a blocking ``dcp.save`` with each writer (seconds from a
common start until the slowest rank returns: every byte durable, both writers fsync), and
an ``async_save`` with each (seconds the call blocks). Rank 0 prints one JSON object: every
round's times, the medians, and the ratios (throughput ours / DCP's, blocked time ours /
DCP's). The GPT-2 ``io`` preset (~26M parameters, fp32 weights and both AdamW moments).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _state(preset: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from benchmarks.contenders import batches, build_model, fully_shard_model

    model = build_model(preset, torch.device("cpu"))
    fully_shard_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = batches(preset, dist.get_rank(), 2, 64, 1, torch.device("cpu"))[0]
    model(batch[:, :-1], batch[:, 1:]).backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _nbytes(state: dict) -> int:
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += _nbytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def _writer(who: str, base: Path, tag: str):
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageWriter

    if who == "ours":
        return StorageWriter(str(base / "ours"))  # one root, the step advances
    return dcp.FileSystemWriter(str(base / f"dcp-{tag}"))


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    import torch.distributed.checkpoint as dcp

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--preset", default="io")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    base = Path(args.dir)
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
    dist.barrier()
    state = _state(args.preset)
    local = torch.tensor([_nbytes(state)], dtype=torch.int64)
    dist.all_reduce(local)
    total = int(local.item())
    # async_save's collectives run on a thread: their own group, so that they never
    # interleave with this thread's barriers on the default one (a hang).
    async_group = dist.new_group(backend="gloo")
    save = {"ours": [], "dcp": []}
    blocked = {"ours": [], "dcp": []}
    for r in range(args.rounds):
        order = ("ours", "dcp") if r % 2 == 0 else ("dcp", "ours")
        for who in order:
            writer = _writer(who, base, f"{r}-sync")
            save[who].append(_timed(lambda w=writer: dcp.save(state, storage_writer=w)))
        for who in order:
            writer = _writer(who, base, f"{r}-async")
            future = None

            def start(w=writer) -> None:
                nonlocal future
                future = dcp.async_save(state, storage_writer=w, process_group=async_group)

            blocked[who].append(_timed(start))
            future.result()  # type: ignore[union-attr]
            dist.barrier()
        if rank == 0:  # as it goes: a run cut short still shows its rounds
            done = {k: (save[k][-1], blocked[k][-1]) for k in save}
            print(f"round {r}: (save s, async blocked s) {done}", flush=True)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in save.items()}
        med_blocked = {k: statistics.median(v) for k, v in blocked.items()}
        mib = total / 2**20
        print(
            json.dumps(
                {
                    "world_size": dist.get_world_size(),
                    "state_MiB": round(mib, 1),
                    "save_s": save,
                    "async_blocked_s": blocked,
                    "save_MiB_per_s": {k: round(mib / v, 1) for k, v in med.items()},
                    "throughput_ratio_ours_over_dcp": round(med["dcp"] / med["ours"], 3),
                    "blocked_ratio_ours_over_dcp": round(
                        med_blocked["ours"] / med_blocked["dcp"], 3
                    ),
                },
                indent=1,
            )
        )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
