"""A load mentions only RNG states the checkpoint holds: a DCP checkpoint has none, a
zerostate one saved at another world size has one per rank. Those cannot be restored on a
world-size change and nothing the user passes changes that, so the load says so at info
level, never as a warning."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from tests.foreign import peers
from tests.helpers_dist import run_distributed


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.getMessage(), record.levelno))


def _load_both(rank: int, world_size: int, dcp: str, root: str) -> dict:
    import zerostate

    ours = os.path.join(root, "zerostate")
    zerostate.Engine(peers.build_model(), stage=2).save(ours)  # RNG states of 2 ranks
    sub = dist.new_group([0])
    out = {}
    if rank == 0:  # loads at world size 1: neither checkpoint's RNG states can be restored
        records = _Records()
        logger = logging.getLogger("zerostate")
        level = logger.level
        logger.addHandler(records)
        logger.setLevel(logging.INFO)
        try:
            for name, path in (("dcp", dcp), ("zerostate", ours)):
                del records.records[:]
                zerostate.Engine(peers.build_model(), stage=2, group=sub).load(path)
                out[name] = [r for r in records.records if "RNG states" in r[0]]
        finally:
            logger.removeHandler(records)
            logger.setLevel(level)
    dist.barrier()
    return out


def test_rng_warning_only_for_saved_rng_states(peer_checkpoints, tmp_path) -> None:
    path, _, peer_world = peer_checkpoints.get("dcp-2")
    assert peer_world == 2
    out = run_distributed(_load_both, 2, str(path), str(tmp_path), timeout=300)[0]
    assert out["dcp"] == [], out["dcp"]  # DCP saves no RNG state
    [(message, level)] = out["zerostate"]
    assert "RNG states of 2 ranks" in message and level == logging.INFO, out
    assert "stateful=" not in message, message  # no advice that cannot apply to RNG states
