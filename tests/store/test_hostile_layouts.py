"""Hostile layouts in a format-3 step (issue 33, must-show 5): overlapping pieces, a piece
outside the tensor, a shard index beyond its count, a fused split that does not add up.

Each is one edit of a tensor's ``mesh`` entry in the commit record of a real step written at
(tp 2 x dp 2): the rows, their checksums and every other document stay as written, so the
layout is the only thing wrong. ``inspect``, ``verify``, ``consolidate`` and ``reshard`` must
each exit non-zero with one line naming the tensor, and ``engine.load`` must raise a
:class:`LayoutError` before it changes anything in the engine."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from torch import nn
from world_of_one import world_of_one  # noqa: F401 - fixture

import zerostate
from tests.foreign.conftest import one_line_refusals, run_cli
from tests.store.test_mesh_store import _rewrite_mesh, write_mesh_step
from zerostate.errors import LayoutError
from zerostate.store.root import CheckpointRoot

TENSOR = "model/attn.qkv.weight"  # (13, 10) fused q/k/v 7/3/3, Shard(0): pieces of <= 40

#: problem -> (edit of the mesh entry, what the one-line error must say)
HOSTILE = {
    # dp_shard 1 makes each tp shard one piece of up to 80 elements, where the stored array
    # holds chunks of 40: every piece would run into the next one's chunk.
    "overlapping pieces": (dict(dp_shard=1), "would overlap in chunks of 40"),
    # tp 4 x dp 2 pieces, but the step has 4 rows: pieces (2, *) and (3, *) lie nowhere.
    "a piece outside the tensor": (
        dict(tp_degree=4, first_owners=[0, 0, 0, 0]),
        "piece \\(3, 1\\) lies outside the step's 4 rows",
    ),
    # The stored array holds more than the pieces of a (13, 8) tensor fill.
    "stored elements outside the tensor": (dict(shape=[13, 8]), "lie outside the tensor"),
    "a shard index beyond its count": (
        dict(first_owners=[0, 2]),
        "dp shard index 2 beyond its count 2",
    ),
    "a fused split that does not add up": (
        dict(fused_sizes=[7, 3, 4]),
        "fused sizes \\[7, 3, 4\\] sum to 14, not dim 0's 13",
    ),
}


@pytest.fixture(scope="module")
def good_step(tmp_path_factory):
    root = tmp_path_factory.mktemp("good") / "ckpt"
    write_mesh_step(root, 2, 2, 2, plain=False)
    return root


def _hostile(good_step, tmp_path, problem):
    root = tmp_path / "ckpt"
    shutil.copytree(good_step, root)
    change, _ = HOSTILE[problem]
    _rewrite_mesh(root, 2, TENSOR, lambda entry: entry["mesh"].update(change))
    return root


def test_the_unedited_step_reads_and_verifies(good_step):
    """The edits below are the only damage: the step as written passes every command."""
    assert run_cli("verify", str(good_step), "-q").returncode == 0
    st = CheckpointRoot.open(str(good_step)).step(2)
    assert st.mesh_layout(TENSOR).tp_degree == 2
    st.close()


@pytest.mark.parametrize("problem", sorted(HOSTILE))
def test_every_command_refuses_it_in_one_line(good_step, tmp_path, problem):
    root = _hostile(good_step, tmp_path, problem)
    want = HOSTILE[problem][1]
    with pytest.raises(LayoutError, match=want):
        CheckpointRoot.open(str(root)).step(2)
    extra = ["reshard", str(root), str(tmp_path / "out-tp"), "--tp", "2", "--dp", "1"]
    for args, line in one_line_refusals(root, tmp_path, extra):
        assert repr(TENSOR) in line, (problem, args, line)
        assert re.search(want, line), (problem, args, line)
    assert not (tmp_path / "out.safetensors").exists()
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("step-*"))


def _engine() -> zerostate.Engine:
    torch.manual_seed(0)
    engine = zerostate.Engine(nn.Sequential(nn.Linear(10, 13), nn.Linear(13, 10)), stage=2, lr=0.1)
    loss = engine(torch.randn(4, 10)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine


def _snapshot(engine: zerostate.Engine) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in engine.module.parameters()]
    for state in engine.optimizer.state.values():
        tensors += [v.clone() for _, v in sorted(state.items()) if torch.is_tensor(v)]
    return tensors


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("problem", sorted(HOSTILE))
def test_engine_load_refuses_it_before_changing_the_engine(good_step, tmp_path, problem):
    root = _hostile(good_step, tmp_path, problem)
    with _engine() as engine:
        before = _snapshot(engine)
        steps = engine.optimizer_steps
        with pytest.raises(LayoutError, match=HOSTILE[problem][1]):
            engine.load(str(root))
        after = _snapshot(engine)
        assert len(after) == len(before) > 2
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert engine.optimizer_steps == steps
