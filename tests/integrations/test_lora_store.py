"""Fine-tuning checkpoints store the frozen base once per root (issue: LoRA saves).

A peft LoRA model trains on 2 gloo ranks and saves every step twice: into one root, where
later steps refer to the frozen base, and into a fresh root per step, which rewrites the
base each time. Both must hold the same tensors, resume to the same training and
consolidate to the same file, while each referring step holds at most 1.5x the trainable
state (fp32 weights + two AdamW moments) in row bytes.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers_dist import run_distributed
from lora_common import make_engine, make_lora_model, train, trainable_state_nbytes
from safetensors.torch import load_file

from zerostate.errors import CheckpointError
from zerostate.store import delete_step, open_checkpoint, prune_steps
from zerostate.store.consolidate import consolidate

sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = 4
CHANGED = "model/base_model.model.model.embed_tokens.weight"


def _save_run(rank, world_size, root, fresh, stage):
    model = make_lora_model()
    engine = make_engine(model, stage=stage)
    losses = []
    for step in range(STEPS):
        if step == 2:  # a "frozen" tensor that changes anyway must be written again
            # gathered(writeback=True): at stage 3 the parameter's storage is empty outside it.
            with torch.no_grad(), engine.gathered(writeback=True):
                model.base_model.model.model.embed_tokens.weight.add_(0.5)
        losses += train(engine, rank, world_size, [step])
        engine.save(root)
        engine.save(f"{fresh}-{step + 1}")
    state = engine.full_state_dict()
    engine.close()
    return losses, state


def _resume_run(rank, world_size, root, steps):
    model = make_lora_model(seed=123)  # different init: everything must come from the load
    engine = make_engine(model)
    engine.load(root)
    start = engine.optimizer_steps
    losses = train(engine, rank, world_size, range(start, start + steps), root=root)
    state = engine.full_state_dict()
    engine.close()
    return losses, state


def _row_nbytes(st) -> int:
    return sum(n for _, _, n in st.row_objects())


def _run_and_check(tmp_path, stage):
    root, fresh = str(tmp_path / "refs"), str(tmp_path / "full")
    results = run_distributed(_save_run, 2, root, fresh, stage, timeout=400)
    trainable = trainable_state_nbytes(make_lora_model())
    frozen = [n for n, p in make_lora_model().named_parameters() if not p.requires_grad]
    ckpt = open_checkpoint(root)
    assert ckpt.steps() == list(range(1, STEPS + 1))
    first = ckpt.step(1)
    assert first.refs == {}
    sizes = {}
    for step in range(1, STEPS + 1):
        st, full = ckpt.step(step), open_checkpoint(f"{fresh}-{step}").step(step)
        st.verify()
        assert set(st.tensors) == set(full.tensors)
        for name in full.tensors:
            assert torch.equal(st.read(name), full.read(name)), (step, name)
        sizes[step] = _row_nbytes(st)
        if step > 1:
            expected = {f"model/{n}" for n in frozen}
            if step == 3:
                expected.discard(CHANGED)  # changed before step 3's save: written again
            assert set(st.refs) == expected, step
            if step != 3:
                assert sizes[step] <= 1.5 * trainable, (step, sizes[step], trainable)
    assert ckpt.step(3).refs.get(CHANGED) is None
    assert ckpt.step(4).refs[CHANGED] == 3
    assert {h for h in ckpt.step(4).refs.values()} == {1, 3}
    print(
        f"\nLoRA stage {stage}: first step {sizes[1]} B of rows, later steps "
        f"{[sizes[s] for s in range(2, STEPS + 1)]} B (step 3 rewrites the changed embedding) "
        f"for {trainable} B of trainable state ({sizes[STEPS] / trainable:.3f}x); a full step "
        f"{_row_nbytes(open_checkpoint(f'{fresh}-{STEPS}').step(STEPS))} B"
    )
    # Consolidation follows the references: byte-identical to the rewriting run's export.
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    consolidate(root, a)
    consolidate(f"{fresh}-{STEPS}", b)
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    return root, fresh, results


@pytest.mark.slow
def test_lora_saves_refer_to_the_base_and_resume_identically(tmp_path):
    root, fresh, results = _run_and_check(tmp_path, stage=2)
    (losses, state), _ = results
    for name, value in state.items():
        assert torch.equal(value, results[1][1][name])
    # Resume at another world size, from the referring root and from the rewriting one.
    copy = str(tmp_path / "copy")
    shutil.copytree(f"{fresh}-{STEPS}", copy)
    got = run_distributed(_resume_run, 1, root, 2, timeout=300)[0]
    want = run_distributed(_resume_run, 1, copy, 2, timeout=300)[0]
    assert got[0] == want[0]
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name
    ckpt = open_checkpoint(root)
    # The first save at world size 1 writes the base again; the one after refers to it.
    assert ckpt.step(STEPS + 1).refs == {}
    assert set(ckpt.step(STEPS + 2).refs.values()) == {STEPS + 1}
    # Retention keeps what the kept steps refer to, and nothing else.
    deleted, _ = prune_steps(root, keep_last=1, partial_below=None)
    assert open_checkpoint(root).steps() == [STEPS + 1, STEPS + 2]
    assert deleted == [1, 2, 3, 4]
    open_checkpoint(root).step().verify()
    with pytest.raises(CheckpointError, match="refer"):
        delete_step(root, STEPS + 1)


@pytest.mark.slow
def test_lora_references_at_stage_0_and_1(tmp_path):
    for stage in (0, 1):
        _run_and_check(tmp_path / f"s{stage}", stage=stage)


@pytest.mark.slow
def test_lora_references_at_stage_3(tmp_path):
    _run_and_check(tmp_path, stage=3)


@pytest.mark.slow
def test_verify_names_a_damaged_holder(tmp_path):
    root, _, _ = _run_and_check(tmp_path, stage=2)
    st = open_checkpoint(root).step(STEPS)
    path, offset = st.locate(sorted(st.refs)[0], 0)
    target = Path(root) / path
    data = bytearray(target.read_bytes())
    data[offset] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(Exception, match="held by step 1"):
        open_checkpoint(root).step(STEPS).verify()
