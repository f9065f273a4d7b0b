"""Seeded crash sweep: a save (and the retention that follows it) is SIGKILLed at random
storage operations, on local disk and on a real S3 server. After every kill:

* every committed step verifies and holds exactly the values it was saved with;
* the step being saved is either invisible (not listed, not loadable) or complete;
* retention never leaves a committed step with missing pieces;
* after ``remove_partial_steps`` the interrupted save can simply be run again.

The sweep is the store's commit protocol under test: ranks are played in turn by one process
(as ``save_tensors`` does), so a kill lands in any rank's writes, a manifest, the commit
record, or the deletion of an old step.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import uuid
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _crash import KillPoint, run_in_child  # noqa: E402

from zerostate.errors import CheckpointNotFoundError  # noqa: E402
from zerostate.store import (  # noqa: E402
    open_checkpoint,
    prune_steps,
    remove_partial_steps,
    save_tensors,
)

SEED = 20261130
LOCAL_POINTS = int(os.environ.get("ZEROSTATE_CRASH_POINTS_LOCAL", "170"))
S3_POINTS = int(os.environ.get("ZEROSTATE_CRASH_POINTS_S3", "30"))


def _tensors(step: int, seed: int) -> dict[str, torch.Tensor]:
    """A model-like state with odd shapes, tiny and large-ish tensors, several states."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (37, 19), "h.0.w": (19, 57), "h.0.b": (57,), "h.1.w": (57, 19),
              "h.1.b": (19,), "ln.w": (19,), "scalar": (), "head": (19, 37)}  # fmt: skip
    out = {}
    for state in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
        for name, shape in shapes.items():
            out[f"{state}/{name}"] = torch.randn(shape, generator=g) + step
    out["buffers/mask"] = torch.arange(23, dtype=torch.int64) * step
    return out


def _check(
    root: str, opts: dict | None, expected: dict[int, dict[str, torch.Tensor]], old: int
) -> list[int]:
    reader = open_checkpoint(root, storage_options=opts)
    committed = reader.steps()
    assert committed, "a kill must never lose every committed step"
    assert set(committed) <= set(expected), committed
    # The old step may only disappear through retention, i.e. after the new one committed.
    assert old in committed or max(expected) in committed
    for step in committed:
        st = reader.step(step)
        st.verify()
        assert set(st.tensors) == set(expected[step])
        for name, value in expected[step].items():
            got = st.read(name)
            assert got.dtype == value.dtype and torch.equal(got, value), (step, name)
    for step in set(expected) - set(committed):
        with pytest.raises(CheckpointNotFoundError):
            reader.step(step)
    assert reader.step().step == max(committed)
    return committed


def _sweep(make_root, opts, num_points: int, world_sizes=(2, 3, 4)) -> dict[str, int]:
    """Kill point i saves step s+1 over a root holding committed step s (one root per world
    size, steps chained so no point pays for a fresh first save)."""
    rng = random.Random(SEED)
    counts = {"kill points": 0, "killed": 0, "new step committed at kill": 0,
              "damaged committed steps": 0, "partial steps loaded": 0}  # fmt: skip
    roots, current, ops = {}, {}, {}
    for world_size in world_sizes:
        roots[world_size] = make_root(f"w{world_size}")
        current[world_size] = (1, _tensors(1, seed=world_size))
        save_tensors(roots[world_size], 1, current[world_size][1], world_size=world_size,
                     storage_options=opts)  # fmt: skip
    for i in range(num_points):
        world_size = world_sizes[i % len(world_sizes)]
        root, (step, before) = roots[world_size], current[world_size]
        new_step, after = step + 1, _tensors(step + 1, seed=1000 + i)

        def scenario(root=root, step=new_step, tensors=after, world_size=world_size) -> None:
            save_tensors(root, step, tensors, world_size=world_size, storage_options=opts)
            prune_steps(root, keep_last=1, partial_below=step, storage_options=opts)

        if world_size not in ops:  # dry run on a scratch root: count the operations
            scratch = make_root(f"dry{world_size}")
            save_tensors(scratch, step, before, world_size=world_size, storage_options=opts)
            status, counted = run_in_child(
                lambda r=scratch, s=new_step, t=after, w=world_size: (
                    save_tensors(r, s, t, world_size=w, storage_options=opts),
                    prune_steps(r, keep_last=1, partial_below=s, storage_options=opts),
                ),
                None,
                s3=opts is not None,
            )
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and counted > 0
            ops[world_size] = counted
        point = KillPoint(rng.randint(1, ops[world_size]), torn=rng.random() < 0.5)
        status, _ = run_in_child(scenario, point, s3=opts is not None)
        counts["kill points"] += 1
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            counts["killed"] += 1
        else:  # a path with fewer operations than the dry run (no retention to do, say)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        expected = {step: before, new_step: after}
        try:
            committed = _check(root, opts, expected, old=step)
        except AssertionError:
            counts["damaged committed steps"] += 1
            raise
        except CheckpointNotFoundError:
            counts["partial steps loaded"] += 1
            raise
        if new_step in committed:
            counts["new step committed at kill"] += 1
        else:
            # Recovery: clean the partial step up and run the same save again.
            remove_partial_steps(root, storage_options=opts)
            save_tensors(root, new_step, after, world_size=world_size, storage_options=opts)
        prune_steps(root, keep_last=1, partial_below=new_step, storage_options=opts)
        assert open_checkpoint(root, storage_options=opts).scan() == ([new_step], [])
        current[world_size] = (new_step, after)
    return counts


def _report(capsys, where: str, counts: dict[str, int]) -> None:
    with capsys.disabled():
        print(f"\ncrash sweep ({where}): " + ", ".join(f"{k}: {v}" for k, v in counts.items()))


@pytest.mark.slow
def test_crash_sweep_local(tmp_path, capsys):
    def make_root(i):
        path = tmp_path / f"ckpt-{i}"
        shutil.rmtree(path, ignore_errors=True)
        return str(path)

    counts = _sweep(make_root, None, LOCAL_POINTS)
    _report(capsys, "local disk", counts)
    assert counts["kill points"] == LOCAL_POINTS
    assert counts["damaged committed steps"] == 0 and counts["partial steps loaded"] == 0
    # The sweep must really kill: almost every point lies inside the save.
    assert counts["killed"] >= 0.9 * LOCAL_POINTS


@pytest.mark.slow
@pytest.mark.s3
def test_crash_sweep_s3(s3_server, capsys):
    bucket, opts = s3_server.new_bucket("crash")

    def make_root(i):
        return f"s3://{bucket}/{i}-{uuid.uuid4().hex[:6]}"

    counts = _sweep(make_root, opts, S3_POINTS)
    _report(capsys, "S3 (SeaweedFS)", counts)
    assert counts["kill points"] == S3_POINTS
    assert counts["damaged committed steps"] == 0 and counts["partial steps loaded"] == 0
    assert counts["killed"] >= 0.9 * S3_POINTS
