"""``zerostate convert CKPT OUT --to dcp``: FSDP2 loads the result and its next steps
equal zerostate's own."""

from __future__ import annotations

import pytest

from tests.foreign import peers
from tests.foreign.conftest import run_cli
from tests.helpers_dist import run_distributed


@pytest.mark.parametrize(("stage", "fsdp_world"), [(2, 2), (3, 1)])
def test_fsdp2_continues_a_converted_checkpoint(tmp_path, stage, fsdp_world):
    root, out = tmp_path / "zs", tmp_path / "dcp"
    mine = run_distributed(peers.zerostate_train_save, 2, str(root), stage, timeout=300)[0]
    result = run_cli("convert", str(root), str(out), "--to", "dcp")
    assert result.returncode == 0, result.stderr
    assert (out / ".metadata").exists()
    theirs = run_distributed(peers.fsdp2_from_dcp, fsdp_world, str(out), timeout=300)[0]
    for k, (a, b) in enumerate(zip(mine["after"], theirs["after"], strict=True)):
        for name, value in b.items():
            ours = a[name] if name in a else a["emb.weight"]
            diff = (ours - value).abs().max().item()
            assert diff <= 1e-5, f"step {k}: {name} differs by {diff}"
    # The converted directory reads back through zerostate's own DCP reader.
    shown = run_cli("inspect", str(out))
    assert shown.returncode == 0 and "optim/exp_avg/body.weight" in shown.stdout


def test_convert_refuses_a_non_empty_output(tmp_path):
    root = tmp_path / "zs"
    run_distributed(peers.zerostate_train_save, 1, str(root), 1, timeout=300)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    result = run_cli("convert", str(root), str(tmp_path / "busy"), "--to", "dcp")
    assert result.returncode == 1 and "--force" in result.stderr
