"""Seeded crash sweep over saves that refer to a frozen base, and the retention after
them: a fine-tuning root where step 1 (or a later step, after the base changed) holds the
base and every other step refers to it. A save of step s+1 plus ``prune_steps(keep_last=1)``
is SIGKILLed at random storage operations (see test_crash_sweep.py). After every kill:

* every committed step verifies, follows its references and holds exactly its values;
* the step that holds the base of a kept step is never deleted, by the killed retention,
  by the recovery's ``remove_partial_steps`` or by the retention after it;
* a holder no kept step refers to any more is deleted by the next retention.
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

from zerostate.store import (  # noqa: E402
    StepWriter,
    open_checkpoint,
    owned_shards,
    plan_specs,
    prune_steps,
    remove_partial_steps,
)
from zerostate.store.refs import TensorRef  # noqa: E402

SEED = 20261201
POINTS = int(os.environ.get("ZEROSTATE_CRASH_POINTS_REFS", "80"))
S3_POINTS = int(os.environ.get("ZEROSTATE_CRASH_POINTS_REFS_S3", "16"))
BASE_SHAPES = {"emb": (41, 17), "h.0.w": (17, 53), "h.0.b": (53,), "head": (17, 41)}
ADAPTER_SHAPES = {"h.0.lora_A": (4, 17), "h.0.lora_B": (53, 4)}


def _base(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model/{n}": torch.randn(s, generator=g) for n, s in BASE_SHAPES.items()}


def _trainable(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    out = {}
    for state in ("model", "optim/exp_avg", "optim/exp_avg_sq"):
        for n, s in ADAPTER_SHAPES.items():
            out[f"{state}/{n}"] = torch.randn(s, generator=g) + step
    return out


def _save(
    root: str, step: int, tensors: dict, holder: int | None, world_size: int, opts=None
) -> None:
    """Every rank in turn, rank 0 last; the base tensors refer to ``holder`` if given."""
    specs = plan_specs(tensors, world_size)
    base = {n for n in tensors if n.split("/", 1)[1] in BASE_SHAPES and n.startswith("model/")}
    refs = [TensorRef(s, holder) for s in specs if holder is not None and s.name in base]
    stored = [s for s in specs if holder is None or s.name not in base]
    for rank in [*range(1, world_size), 0]:
        writer = StepWriter(root, step, rank=rank, world_size=world_size, specs=stored, refs=refs,
                            storage_options=opts)  # fmt: skip
        writer.write(owned_shards(tensors, stored, rank))
        writer.commit(wait=False)


def _check(root: str, opts, expected: dict[int, dict], holders: dict[int, int]) -> list[int]:
    reader = open_checkpoint(root, storage_options=opts)
    committed = reader.steps()
    assert committed
    for step in committed:
        st = reader.step(step)
        st.verify()
        assert set(st.tensors) == set(expected[step]), step
        for name, value in expected[step].items():
            assert torch.equal(st.read(name), value), (step, name)
        assert set(st.refs.values()) <= {holders[step]}, (step, st.refs)
    return committed


def _sweep(make_root, opts, num_points: int) -> dict[str, int]:
    rng = random.Random(SEED)
    counts = {"kill points": 0, "killed": 0, "base rewritten": 0, "holders kept": 0,
              "holders freed": 0}  # fmt: skip
    world_sizes = (2, 3)
    roots, state, ops = {}, {}, {}
    for ws in world_sizes:
        roots[ws] = make_root(f"w{ws}")
        base = _base(ws)
        tensors = {**base, **_trainable(1)}
        _save(roots[ws], 1, tensors, None, ws, opts)
        # per root: current step, its base and its holder, expected values and holders
        state[ws] = {"step": 1, "base": base, "holder": 1, "expected": {1: tensors},
                     "holders": {1: 1}}  # fmt: skip
    for i in range(num_points):
        ws = world_sizes[i % len(world_sizes)]
        root, s = roots[ws], state[ws]
        new = s["step"] + 1
        rewrite = rng.random() < 0.2  # the "frozen" base changed: written again in full
        base = _base(1000 + i) if rewrite else s["base"]
        holder = new if rewrite else s["holder"]
        tensors = {**base, **_trainable(new)}
        ref = None if rewrite else s["holder"]

        def scenario(root=root, new=new, tensors=tensors, ref=ref, ws=ws) -> None:
            _save(root, new, tensors, ref, ws, opts)
            prune_steps(root, keep_last=1, partial_below=new, storage_options=opts)

        if ws not in ops:  # count the operations of one referring save on a scratch root
            scratch = make_root(f"dry{ws}")
            _save(scratch, 1, {**s["base"], **_trainable(1)}, None, ws, opts)
            dry = {**s["base"], **_trainable(2)}
            status, counted = run_in_child(
                lambda r=scratch, t=dry, w=ws: (
                    _save(r, 2, t, 1, w, opts),
                    prune_steps(r, keep_last=1, partial_below=2, storage_options=opts),
                ),
                None,
                s3=opts is not None,
            )
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and counted > 0
            ops[ws] = counted
        point = KillPoint(rng.randint(1, ops[ws]), torn=rng.random() < 0.5)
        status, _ = run_in_child(scenario, point, s3=opts is not None)
        counts["kill points"] += 1
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            counts["killed"] += 1
        else:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        expected = {**s["expected"], new: tensors}
        holders = {**s["holders"], new: holder}
        committed = _check(root, opts, expected, holders)
        assert s["step"] in committed or new in committed
        if new not in committed:  # recovery: clean up, save again
            remove_partial_steps(root, storage_options=opts)
            _check(root, opts, expected, holders)
            _save(root, new, tensors, ref, ws, opts)
        prune_steps(root, keep_last=1, partial_below=new, storage_options=opts)
        committed = _check(root, opts, expected, holders)
        want = sorted({new, holder})
        assert committed == want, (committed, want)
        assert open_checkpoint(root, storage_options=opts).scan()[1] == []
        counts["base rewritten"] += rewrite
        counts["holders kept"] += holder != new
        counts["holders freed"] += rewrite and s["holder"] not in committed
        s.update(step=new, base=base, holder=holder,
                 expected={k: expected[k] for k in committed},
                 holders={k: holders[k] for k in committed})  # fmt: skip
    return counts


def _report(capsys, where: str, counts: dict[str, int]) -> None:
    with capsys.disabled():
        print(f"\ncrash sweep with references ({where}): "
              + ", ".join(f"{k}: {v}" for k, v in counts.items()))  # fmt: skip


@pytest.mark.slow
def test_crash_sweep_with_references(tmp_path, capsys):
    def make_root(i):
        path = tmp_path / f"ckpt-{i}"
        shutil.rmtree(path, ignore_errors=True)
        return str(path)

    counts = _sweep(make_root, None, POINTS)
    _report(capsys, "local disk", counts)
    assert counts["killed"] >= 0.9 * POINTS
    assert counts["holders kept"] > 0 and counts["holders freed"] > 0


@pytest.mark.slow
@pytest.mark.s3
def test_crash_sweep_with_references_s3(s3_server, capsys):
    bucket, opts = s3_server.new_bucket("crashrefs")

    def make_root(i):
        return f"s3://{bucket}/{i}-{uuid.uuid4().hex[:6]}"

    counts = _sweep(make_root, opts, S3_POINTS)
    _report(capsys, "S3 (SeaweedFS)", counts)
    assert counts["killed"] >= 0.9 * S3_POINTS
    assert counts["holders kept"] > 0
