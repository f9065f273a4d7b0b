"""A rank process for the store tests: ``python _store_worker.py MODE ROOT RANK WORLD PORT``.

save:  join a gloo group, write this rank's shards of step 1, commit, barrier.
crash: write this rank's shards of step 2 and die (os._exit) after the first chunk lands.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _store_helpers import make_specs, make_tensors, owned_shards  # noqa: E402

from zerostate.store import StepWriter  # noqa: E402


def main() -> None:
    mode, root, rank, world_size, port = sys.argv[1:6]
    rank, world_size = int(rank), int(world_size)
    torch.set_num_threads(1)
    tensors = make_tensors(seed=1)
    specs = make_specs(tensors, world_size)
    if mode == "save":
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        writer = StepWriter(
            root,
            1,
            rank=rank,
            world_size=world_size,
            specs=specs,
            attrs={"written_by": world_size},
            timeout_s=60,
        )
        writer.write(owned_shards(tensors, specs, rank))
        writer.commit(wait=True)  # coordination through storage only
        dist.barrier()
        dist.destroy_process_group()
    elif mode == "crash":

        def die(_num_bytes: int) -> None:
            os._exit(17)  # no cleanup, no manifest: as if the host lost power

        writer = StepWriter(
            root, 2, rank=rank, world_size=world_size, specs=specs, num_threads=1, progress=die
        )
        writer.write(owned_shards(tensors, specs, rank))
        raise SystemExit("unreachable: the progress hook exits")
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
