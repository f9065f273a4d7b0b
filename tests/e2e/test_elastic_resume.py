"""Save at 4 ranks, resume at 2 and 3 ranks (and from stage 2 into stage 3): training must
continue exactly as an uninterrupted single-process torch.optim.AdamW run."""

from __future__ import annotations

import json

import pytest
from e2e_common import assert_matches_reference, torchrun
from safetensors.torch import load_file

import zerostate
from zerostate.store import open_checkpoint

STAGES = [1, 2, 3]


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    jobs = [
        {"name": f"s{s}-n4", "stage": s, "start": 0, "stop": 10,
         "saves": [{"path": str(root / f"ckpt-s{s}")}]}
        for s in STAGES
    ]
    torchrun(4, jobs, root / "out")
    return root


def _resume_jobs(root, world):
    jobs = [
        {"name": f"s{s}-n{world}", "stage": s, "start": 10, "stop": 20,
         "load": str(root / f"ckpt-s{s}")}
        for s in STAGES
    ]
    jobs.append({"name": f"s2to3-n{world}", "stage": 3, "start": 10, "stop": 20,
                 "load": str(root / "ckpt-s2")})
    return jobs


@pytest.mark.parametrize("world", [2, 3])
def test_resume_at_other_world_size_matches_reference(saved_at_4, world, reference20):
    root = saved_at_4
    torchrun(world, _resume_jobs(root, world), root / "out")
    ref_losses, ref_params = reference20
    for s in STAGES + ["2to3"]:
        first = json.loads((root / "out" / f"s{2 if s == '2to3' else s}-n4.json").read_text())
        second = json.loads((root / "out" / f"s{s}-n{world}.json").read_text())
        assert second["world_size"] == world
        params = load_file(str(root / "out" / f"s{s}-n{world}.safetensors"))
        assert_matches_reference(first["losses"] + second["losses"], params, ref_losses, ref_params)


def test_checkpoint_records_engine_state(saved_at_4):
    st = open_checkpoint(str(saved_at_4 / "ckpt-s2")).step()
    assert st.step == 10 and st.world_size == 4
    assert st.attrs["client_state"] == {"next_step": 10}
    assert st.attrs["engine"]["stage"] == 2
    names = set(st.tensors)
    assert "model/transformer.wte.weight" in names
    assert "optim/exp_avg/transformer.h.0.attn.c_attn.weight" in names
    assert "optim/exp_avg_sq/transformer.ln_f.bias" in names
    assert not any(n.startswith("model/lm_head") for n in names)  # tied alias stored once


def test_loading_missing_checkpoint_is_a_clear_error(tmp_path):
    import ckpt_worker as w
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0,
                                world_size=1)
    try:
        engine = w.make_engine(2)
        with pytest.raises(zerostate.CheckpointNotFoundError):
            engine.load(str(tmp_path / "nothing-here"))
    finally:
        dist.destroy_process_group()


def _port():
    from helpers_dist import free_port

    return free_port()
