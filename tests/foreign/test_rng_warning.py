"""A load warns only about RNG states the checkpoint holds: a DCP checkpoint has none, a
zerostate one saved at another world size has one per rank."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from tests.foreign import peers
from tests.helpers_dist import run_distributed


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load_both(rank: int, world_size: int, dcp: str, root: str) -> dict:
    import zerostate

    ours = os.path.join(root, "zerostate")
    zerostate.Engine(peers.build_model(), stage=2).save(ours)  # RNG states of 2 ranks
    sub = dist.new_group([0])
    out = {}
    if rank == 0:  # loads at world size 1: neither checkpoint's RNG states can be restored
        records = _Records()
        logging.getLogger("zerostate").addHandler(records)
        try:
            for name, path in (("dcp", dcp), ("zerostate", ours)):
                del records.messages[:]
                zerostate.Engine(peers.build_model(), stage=2, group=sub).load(path)
                out[name] = [m for m in records.messages if "RNG states" in m]
        finally:
            logging.getLogger("zerostate").removeHandler(records)
    dist.barrier()
    return out


def test_rng_warning_only_for_saved_rng_states(peer_checkpoints, tmp_path) -> None:
    path, _, peer_world = peer_checkpoints.get("dcp-2")
    assert peer_world == 2
    out = run_distributed(_load_both, 2, str(path), str(tmp_path), timeout=300)[0]
    assert out["dcp"] == [], out["dcp"]  # DCP saves no RNG state
    assert len(out["zerostate"]) == 1 and "RNG states of 2 ranks" in out["zerostate"][0], out
