"""[Note: whole replicas at load]: at stages 1-2 a load from local files reads each fp32
working parameter whole on every rank instead of gathering it from the loaded masters.
Both ways must leave exactly the same state; the gather must still run wherever the
shortcut does not apply (stage 3, bf16 working copies, storage that does not read locally),
and every rank must leave the same parameters out of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from common import batch, local, make_model
from helpers_dist import run_distributed

import zerostate
from zerostate.runtime import runtime as runtime_mod
from zerostate.store import reader_v2

VOCAB = 67  # odd shapes: 67 x 36 embeddings, 3 heads of 12


def _engine(stage: int, precision: str) -> zerostate.Engine:
    model = make_model(3, vocab_size=VOCAB, n_embd=36, n_head=3, n_layer=3)
    return zerostate.Engine(model, stage=stage, precision=precision, lr=1e-2)


def _train(engine: zerostate.Engine, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, 0, vocab=VOCAB)
        loss = engine(local(x, rank, world), local(y, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save(rank: int, world: int, root: str, stage: int, precision: str) -> dict:
    torch.set_num_threads(1)
    engine = _engine(stage, precision)
    _train(engine, range(3), rank, world)
    engine.save(root)
    full = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    return full


def _load(rank: int, world: int, root: str, stage: int, precision: str, locally: bool) -> dict:
    # The patches are undone before returning: the ranks may be pooled workers that run
    # other tests next.
    reads_locally = reader_v2.StepReaderV2.__dict__["reads_locally"]
    try:
        if not locally:  # as on storage that is not this host's files
            reader_v2.StepReaderV2.reads_locally = property(lambda self: False)
        return _load_counting(rank, world, root, stage, precision)
    finally:
        reader_v2.StepReaderV2.reads_locally = reads_locally


def _load_counting(rank: int, world: int, root: str, stage: int, precision: str) -> dict:
    torch.set_num_threads(1)
    gathers: list[int] = []
    real = runtime_mod.all_gather_groups

    def counting(ctx, layouts, *args, **kwargs):
        gathers.append(len(layouts))  # buckets gathered
        return real(ctx, layouts, *args, **kwargs)

    engine = _engine(stage, precision)
    whole = sorted(engine.whole_replicas())
    runtime_mod.all_gather_groups = counting
    try:
        engine.load(root)
    finally:
        runtime_mod.all_gather_groups = real
    loaded = {k: v.clone() for k, v in engine.full_state_dict().items()}
    losses = _train(engine, range(3, 5), rank, world)
    after = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    return {"whole": whole, "gathers": gathers, "loaded": loaded, "losses": losses, "after": after}


def _exactly_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    ("stage", "precision"), [(1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "fp32")]
)
def test_whole_reads_leave_the_state_a_gather_leaves(tmp_path: Path, stage, precision) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 2, root, stage, precision, timeout=180)[0]
    direct = run_distributed(_load, 3, root, stage, precision, True, timeout=180)
    gathered = run_distributed(_load, 3, root, stage, precision, False, timeout=180)
    shortcut = stage in (1, 2) and precision == "fp32"
    model_names = {f"model/{n}" for n in saved}
    for rank in range(3):
        d, g = direct[rank], gathered[rank]
        # The same parameters on every rank: the gather's groups match across ranks.
        assert d["whole"] == direct[0]["whole"]
        assert set(d["whole"]) == (model_names if shortcut else set())
        # The load's own gather is gone exactly where the shortcut applies (stage 3 copies
        # the loaded partitions and gathers nothing either way).
        assert bool(sum(d["gathers"])) == (stage in (1, 2) and not shortcut), d["gathers"]
        assert bool(sum(g["gathers"])) == (stage in (1, 2)), g["gathers"]
        _exactly_equal(d["loaded"], saved)
        _exactly_equal(g["loaded"], saved)
        # Masters and moments too: the next steps agree to the bit.
        assert d["losses"] == g["losses"]
        _exactly_equal(d["after"], g["after"])
        _exactly_equal(d["after"], direct[0]["after"])


def _named(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        engine = _engine(stage, "fp32")
        out[stage] = sorted(engine.whole_replicas())
        engine.close()
    model = make_model(3, vocab_size=VOCAB, n_embd=36, n_head=3, n_layer=3)
    out["params"] = sorted(f"model/{n}" for n, _ in model.named_parameters())  # tied once
    return out


def test_only_stages_1_and_2_read_whole() -> None:
    # Stage 0 keeps whole masters (nothing to gather); stage 3 keeps only partitions.
    (named,) = run_distributed(_named, 1, timeout=120)
    assert named[0] == [] and named[3] == []
    assert named[1] == named[2] == named["params"]  # every parameter, at 1 rank too
