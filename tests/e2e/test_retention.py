"""Retention keeps the newest committed steps, crashed partial steps are cleaned up, and
bad save arguments are refused before anything is written."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from e2e_common import free_port

import zerostate
from zerostate.store import StepExistsError, open_checkpoint
from zerostate.store.format import COMMIT_PATH


@pytest.fixture()
def engine():
    import ckpt_worker as w

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield w.make_engine(2)
    finally:
        dist.destroy_process_group()


def _train_step(engine, step):
    import ckpt_worker as w

    idx, tgt = w.local_batch(step, 0, 1)
    engine.backward(engine(idx, tgt))
    engine.step()


def test_keep_last_and_partial_cleanup(engine, tmp_path):
    root = tmp_path / "ckpt"
    for step in range(1, 4):
        _train_step(engine, step)
        engine.save(str(root), keep_last=2)
    assert open_checkpoint(str(root)).steps() == [2, 3]
    # Step 1 stopped being committed before save() returned; its data is removed on a thread
    # ([Note: retention off the save's path]) that the next save's guard waits for.
    assert not (root / "step-00000001" / COMMIT_PATH).exists()
    # A crashed save leaves a directory without a commit record: invisible, then removed.
    (root / "step-00000000").mkdir()
    (root / "step-00000000" / "zarr.json").write_text("{}")
    assert open_checkpoint(str(root)).steps() == [2, 3]
    _train_step(engine, 4)
    handle = engine.save(str(root), keep_last=2, blocking=False)
    handle.wait()
    assert open_checkpoint(str(root)).steps() == [3, 4]
    assert not (root / "step-00000001").exists()  # removed before step 4 was written
    engine.close()  # waits for the removal the last save started
    assert not (root / "step-00000000").exists()
    assert not (root / "step-00000002").exists()
    assert open_checkpoint(str(root)).step().attrs["engine"]["stage"] == 2


def test_bad_save_arguments(engine, tmp_path):
    root = str(tmp_path / "ckpt")
    _train_step(engine, 0)
    engine.save(root)
    with pytest.raises(StepExistsError, match="already committed"):
        engine.save(root)  # same step number again
    with pytest.raises(zerostate.ConfigError, match="client_state.*without pickle"):
        engine.save(root, step=7, client_state={"t": object()})
    with pytest.raises(zerostate.ConfigError, match="keep_last"):
        engine.save(root, step=8, keep_last=0)
    assert open_checkpoint(root).steps() == [1]


def test_loading_another_models_checkpoint_names_the_problem(engine, tmp_path):
    from zerostate.errors import CheckpointError
    from zerostate.models import GPT2, GPT2Config

    root = str(tmp_path / "ckpt")
    _train_step(engine, 0)
    engine.save(root)
    wider = zerostate.Engine(
        GPT2(GPT2Config(vocab_size=64, n_positions=16, n_embd=48, n_layer=2, n_head=4)), stage=2
    )
    with pytest.raises(CheckpointError, match=r"shape .*48"):
        wider.load(root)
    deeper = zerostate.Engine(
        GPT2(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=4)), stage=2
    )
    with pytest.raises(CheckpointError, match=r"lacks 36 tensor.*transformer\.h\.2\."):
        deeper.load(root)
