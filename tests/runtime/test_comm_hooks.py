"""The collective patterns at one rank ([Note: single rank] in zerostate.dist.comm) and the
completion hooks of pending reduces ([Note: completion hooks])."""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import engine_steps, make_engine, make_model
from helpers_dist import run_distributed

from zerostate.dist.collectives import Handle
from zerostate.dist.comm import InFlight, PendingOp

# Not pooled workers (this file is not in tests/conftest.py's POOLED_FILES): its ranks wrap
# torch.distributed's collectives to measure them and keep the wrappers. Each call forks new
# processes ([Note: forked workers] in tests/fork_server.py); nothing here needs a new interpreter,
# so the ranks are not spawned.

_COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather",
    "broadcast",
)


def _single_rank_worker(rank: int, world_size: int) -> dict:
    largest: dict = {}
    current = {"key": None}
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            fn = getattr(dist, name)

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                if current["key"] is not None:
                    numel = max((a.numel() for a in args if isinstance(a, torch.Tensor)), default=0)
                    key = (*current["key"], _name)
                    largest[key] = max(largest.get(key, 0), numel)
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
    states = {}
    for stage in (0, 1, 2, 3):
        for offload in (None, "optimizer") if stage else (None,):
            engine = make_engine(make_model(), stage=stage, offload=offload, grad_accum_steps=2)
            engine_steps(engine, rank, world_size, 1, accum=2)  # the first step agrees orders
            current["key"] = (stage, offload)
            engine_steps(engine, rank, world_size, 2, accum=2, first_step=1)
            current["key"] = None
            states[(stage, offload)] = (engine.full_state_dict(), engine.comm_stats())
    numel = sum(p.numel() for p in make_model().parameters())
    return {"largest": largest, "states": states, "numel": numel}


def test_one_rank_hands_no_gradient_or_parameter_traffic_to_torch_distributed() -> None:
    out = run_distributed(_single_rank_worker, 1, timeout=300)[0]
    # Only the small exchanges remain (the global norm and flags, stage 3's order checks):
    # no collective ever sees a tensor of the model's size.
    assert out["largest"], "the counter saw no collective at all"
    assert max(out["largest"].values()) < out["numel"] / 10, out["largest"]
    for (stage, offload), (state, stats) in out["states"].items():
        assert stats["reduce_scatter"]["elements"] == 0, (stage, stats)
        assert stats["all_gather"]["elements"] < out["numel"] / 10, (stage, stats)
        ref = out["states"][(stage, None)][0]
        worst = max((state[n] - ref[n]).abs().max().item() for n in ref)
        assert worst <= 1e-6, (stage, offload, worst)
    # Every stage trains the same one-rank model alike (the collectives were identities).
    base = out["states"][(0, None)][0]
    for key, (state, _) in out["states"].items():
        assert max((state[n] - base[n]).abs().max().item() for n in base) <= 1e-6, key


class _Work:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.finished = log, name, False

    def is_completed(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def test_finished_reduces_run_their_hooks_at_the_next_launch_in_order() -> None:
    log: list[str] = []
    inflight = InFlight(limit=3)
    works = [_Work(log, str(i)) for i in range(4)]

    def launch(i: int) -> None:
        inflight.make_room()
        done = lambda: log.append(f"done {i}")  # noqa: E731
        hook = lambda: log.append(f"hook {i}")  # noqa: E731
        inflight.add(PendingOp(Handle(works[i]), done, hook))

    launch(0)
    launch(1)
    works[1].finished = True  # finished out of order: 0 still pending, so nothing runs
    launch(2)
    assert log == []
    works[0].finished = True
    launch(3)  # polls: 0 and 1 are finished, 2 is not
    assert log == ["wait 0", "done 0", "hook 0", "wait 1", "done 1", "hook 1"]
    inflight.drain()
    assert log[6:] == ["wait 2", "done 2", "hook 2", "wait 3", "done 3", "hook 3"]
    assert len(inflight) == 0
