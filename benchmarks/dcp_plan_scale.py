"""What a ``dcp.save`` through zerostate's ``StorageWriter`` costs in planning, committing
and opening as the number of ranks grows, with no data to speak of: the part of a save
that is not bytes to disk.

    python -m benchmarks.dcp_plan_scale --ranks 16 64 256 --tensors 300

N ranks are driven in one process, as DCP's ``_save_state_dict`` drives a storage writer
on each (torch's ``DefaultSavePlanner``, our writer's hooks, the plans pickled as DCP's
scatter pickles them), each rank holding ``--tensors`` tensors of 4 elements under keys of
its own (one piece each, as FSDP gives every rank a chunk of every parameter). Per N, in
seconds: torch's ``create_global_plan`` on the coordinator (DCP's own cost, the yardstick),
our ``prepare_global_plan``, pickling every rank's plan, the bytes sent (total and the
largest non-coordinator's), a non-coordinator's ``write_data`` (median), the commit
(``finish``: the record built, validated, written), the commit record's size, and one
rank's ``read_metadata`` when loading the step.
Prints one JSON object per N.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import tempfile
import time

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from zerostate.dcp import StorageReader, StorageWriter
from zerostate.store import format as fmt


def drive_save(states: list[dict], root: str) -> dict:
    """One ``dcp.save`` of ``len(states)`` ranks (rank r saving ``states[r]``) through our
    writers, in this process, as DCP's ``_save_state_dict`` drives a storage writer on each
    rank: torch's planner, the plans pickled as DCP's scatter pickles them, each rank's
    ``write_data`` on what it was sent, the coordinator's ``finish``. Returns what each
    rank was sent (pickled, by rank; the coordinator's own part included) and the times."""
    world_size = len(states)
    planners = [DefaultSavePlanner() for _ in range(world_size)]
    writers = [StorageWriter(root) for _ in range(world_size)]
    local = []
    for r in range(world_size):
        planners[r].set_up_planner(states[r], StorageMeta(checkpoint_id=root), r == 0)
        writers[r].set_up_storage_writer(r == 0, rank=r)
        local.append(writers[r].prepare_local_plan(planners[r].create_local_plan()))
    t0 = time.perf_counter()
    plans, metadata = planners[0].create_global_plan(local)
    t1 = time.perf_counter()
    plans = writers[0].prepare_global_plan(plans)
    t2 = time.perf_counter()
    sent = [pickle.dumps(plan) for plan in plans]
    t3 = time.perf_counter()
    results: list = [None] * world_size
    others: list[float] = []  # each non-coordinator's write_data (its specs, row, manifest)
    for r in [*range(1, world_size), 0]:
        start = time.perf_counter()
        plan = pickle.loads(sent[r]) if r else plans[0]
        results[r] = writers[r].write_data(planners[r].finish_plan(plan), planners[r]).wait()
        others.append(time.perf_counter() - start)
    others.pop()  # the coordinator's
    t4 = time.perf_counter()
    writers[0].finish(metadata, results)
    t5 = time.perf_counter()
    return {
        "sent": sent,
        "dcp_create_global_plan_s": t1 - t0,
        "ours_prepare_global_plan_s": t2 - t1,
        "pickle_plans_s": t3 - t2,
        "rank_write_data_median_s": sorted(others)[len(others) // 2] if others else 0.0,
        "commit_s": t5 - t4,
    }


def measure(world_size: int, tensors: int, root: str) -> dict:
    states = [
        {f"layers.{i}.w.r{r}": torch.full((4,), float(r)) for i in range(tensors)}
        for r in range(world_size)
    ]
    run = drive_save(states, root)
    sent = run["sent"]
    t5 = time.perf_counter()
    reader = StorageReader(root)
    reader.read_metadata()
    t6 = time.perf_counter()
    reader.close()
    record = f"{root}/{fmt.step_dir(0)}/{fmt.COMMIT_PATH}"
    with open(record, "rb") as f:
        record_nbytes = len(f.read())
    return {
        "ranks": world_size,
        "pieces": world_size * tensors,
        "dcp_create_global_plan_s": round(run["dcp_create_global_plan_s"], 3),
        "ours_prepare_global_plan_s": round(run["ours_prepare_global_plan_s"], 3),
        "pickle_plans_s": round(run["pickle_plans_s"], 3),
        "plans_MB": round(sum(map(len, sent)) / 1e6, 2),
        "largest_rank_plan_kB": round(max(map(len, sent[1:])) / 1e3, 1),
        "rank_write_data_median_s": round(run["rank_write_data_median_s"], 4),
        "commit_s": round(run["commit_s"], 3),
        "commit_record_MB": round(record_nbytes / 1e6, 2),
        "read_metadata_s": round(t6 - t5, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--tensors", type=int, default=300)
    args = parser.parse_args()
    for world_size in args.ranks:
        if world_size < 2:
            parser.error("--ranks: each at least 2")
        root = tempfile.mkdtemp(prefix="zs-plan-scale-")
        try:
            print(json.dumps(measure(world_size, args.tensors, root)), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
