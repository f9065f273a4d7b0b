"""Single-process unit tests of the communication core and of every stage strategy.

The multi-rank cases run W simulated ranks as threads (``simgroup.run_sim``), so they take
a fraction of a second each and need no process launch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from common import batch, compare, local, make_engine, make_model, reference_run
from simgroup import SimGroup, run_sim

from zerostate.dist.collectives import CommStats
from zerostate.dist.comm import (
    BufferPool,
    CommContext,
    InFlight,
    PendingOp,
    fp16_predivide_factor,
    reduce_scatter_grads,
)
from zerostate.layout.partition import even_layout
from zerostate.runtime.group import GroupPolicy
from zerostate.runtime.sharded import FlatLayout, ShardedParam

PACKAGE = Path(__file__).resolve().parents[2] / "zerostate"


def _sparams(numels: list[int], world_size: int, rank: int) -> list[ShardedParam]:
    out = []
    for i, n in enumerate(numels):
        p = torch.nn.Parameter(torch.zeros(n))
        out.append(ShardedParam(f"p{i}", p, even_layout(n, world_size), rank, False))
    return out


@pytest.mark.parametrize("world_size", [1, 3, 4, 7])
def test_flat_layout_segments_hold_each_ranks_slices(world_size: int) -> None:
    numels = [17 * 257, 1, 0, 5, 64, 3]
    full = [torch.randn(n) for n in numels]
    segments = []
    for rank in range(world_size):
        layout = FlatLayout(_sparams(numels, world_size, rank), world_size, rank)
        buffer = torch.full((layout.numel,), float("nan"))
        layout.pack(buffer, full)
        assert not buffer.isnan().any()  # padding is zeroed, never left as garbage
        segment = layout.segment(buffer)
        for sp, view, t in zip(layout.params, layout.shard_views(segment), full, strict=True):
            assert torch.equal(view, t[sp.start : sp.stop])
        segments.append(segment.clone())
        # Padding is at most world_size - 1 elements per tensor.
        assert layout.numel - sum(numels) <= len(numels) * (world_size - 1) + world_size
    # Concatenated segments (what an all-gather produces) unpack to the full tensors.
    layout = FlatLayout(_sparams(numels, world_size, 0), world_size, 0)
    targets = [torch.empty(n) for n in numels]
    layout.unpack(torch.cat(segments), targets)
    for a, b in zip(targets, full, strict=True):
        assert torch.equal(a, b)


def test_pool_lends_handles_and_reuses_storage() -> None:
    pool = BufferPool(torch.device("cpu"))
    a = pool.acquire(10, torch.float32)
    assert a.tensor.numel() == 10
    pool.release(a)
    b = pool.acquire(7, torch.float32)
    assert b.tensor.numel() == 7 and b.storage is a.storage  # reused, no new allocation
    c = pool.acquire(7, torch.bfloat16)  # another dtype never shares storage
    assert c.storage is not a.storage
    assert pool.allocated_bytes == 10 * 4 + 7 * 2


class _Work:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(f"wait {self.name}")


def test_inflight_caps_pending_work_and_completes_in_order() -> None:
    from zerostate.dist.collectives import Handle

    log: list[str] = []
    inflight = InFlight(limit=2)
    for i in range(4):
        inflight.make_room()
        op = PendingOp(Handle(_Work(log, str(i))), lambda i=i: log.append(f"done {i}"))
        inflight.add(op)
        assert len(inflight) <= 2
    inflight.drain()
    assert log == [f"{kind} {i}" for i in range(4) for kind in ("wait", "done")]
    op.complete()  # idempotent
    assert log.count("done 3") == 1


def test_fp16_reduction_is_predivided_and_accumulated_in_fp32(monkeypatch) -> None:
    world_size = 4
    assert fp16_predivide_factor(world_size) == 2.0
    numels = [6, 3]

    def worker(rank: int, group: SimGroup) -> list[torch.Tensor]:
        ctx = CommContext(
            group=group,
            rank=rank,
            world_size=world_size,
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            stats=CommStats(),
            pool=BufferPool(torch.device("cpu")),
        )
        layout = FlatLayout(_sparams(numels, world_size, rank), world_size, rank)
        shard = torch.empty(layout.seg_numel, dtype=torch.float32)
        inflight = InFlight()
        # 4 ranks x 20000 = 80000 overflows fp16 (max 65504) unless pre-divided.
        for accumulate in (False, True):
            grads = [torch.full((n,), 20000.0, dtype=torch.float16) for n in numels]
            reduce_scatter_grads(ctx, inflight, layout, grads, shard, accumulate=accumulate)
        inflight.drain()
        return layout.shard_views(shard)

    for views in run_sim(worker, world_size, monkeypatch):
        for view in views:
            assert torch.equal(view, torch.full_like(view, 160000.0))


def _train(rank: int, group: SimGroup, model, stage: int, settings: dict, accum: int) -> tuple:
    engine = make_engine(model, stage=stage, group=group, **settings)
    losses = _steps(engine, rank, group.size(), 3, accum)
    return losses, engine.full_state_dict(), engine._runtime.policy


def _steps(engine, rank: int, world_size: int, steps: int, accum: int) -> list[float]:
    # Like common.engine_steps, without its torch.distributed loss all-reduce: each
    # simulated rank reports its local mean losses and the test averages them.
    out = []
    for step in range(steps):
        total = 0.0
        for m in range(accum):
            x, y = batch(step, m)
            loss = engine(local(x, rank, world_size), local(y, rank, world_size))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        out.append(total / accum)
    return out


POLICIES = {
    0: GroupPolicy(shard_optimizer=False, shard_grads=False, shard_params=False),
    1: GroupPolicy(shard_optimizer=True, shard_grads=False, shard_params=False),
    2: GroupPolicy(shard_optimizer=True, shard_grads=True, shard_params=False),
    3: GroupPolicy(shard_optimizer=True, shard_grads=True, shard_params=True),
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size, accum", [(1, 1), (3, 2)])
def test_each_stage_policy_matches_torch_adamw(monkeypatch, stage, world_size, accum) -> None:
    settings = dict(grad_accum_steps=accum, bucket_mb=0.01)
    # Models are built here, not on the rank threads: torch's default generator is global,
    # so threads building models at once would interleave their random draws.
    models = [make_model() for _ in range(world_size)]
    results = run_sim(
        lambda rank, group: _train(rank, group, models[rank], stage, settings, accum),
        world_size,
        monkeypatch,
    )
    ref_losses, ref_params = reference_run(make_model(), 3, accum=accum)
    # Equal local batches: the mean of the ranks' local means is the global mean.
    losses = [sum(r[0][i] for r in results) / world_size for i in range(3)]
    for _, params, policy in results:
        assert policy == POLICIES[stage]
        loss_err, param_err, worst = compare(losses, ref_losses, params, ref_params)
        assert loss_err < 1e-5 and param_err < 1e-5, (stage, worst, loss_err, param_err)


def test_engine_has_no_stage_branches() -> None:
    # The engine package, but its settings (which check each setting against the stage).
    source = "".join(
        p.read_text() for p in sorted((PACKAGE / "engine").glob("*.py")) if p.name != "config.py"
    )
    assert "_s3" not in source
    assert not re.search(r"self\.stage\s*[=!<>]=|stage\s*==\s*\d", source)


def test_every_torch_distributed_call_goes_through_collectives() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "collectives.py" and path.parent == PACKAGE / "dist":
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            # torch.distributed.checkpoint is a file format (the DCP writer of `convert`,
            # run with no process group), not a collective.
            code = line.split("#", 1)[0].replace("torch.distributed.checkpoint", "dcp_format")
            if re.search(r"import\s+torch\.distributed|from\s+torch\s+import\s+distributed", code):
                offenders.append(f"{path.name}:{number}: {line.strip()}")
            elif re.search(r"\b(dist|torch\.distributed)\.[a-z_]+\(", code):
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert not offenders, "torch.distributed used outside collectives.py:\n" + "\n".join(offenders)
