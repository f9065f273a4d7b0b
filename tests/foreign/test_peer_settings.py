"""[Note: a peer's update settings]: continuing a DeepSpeed run whose config left
``gradient_clipping`` out (DeepSpeed then clips at 1.0) says so on rank 0 and names the
argument that continues the run as it ran."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.foreign import peers
from tests.helpers_dist import run_distributed
from zerostate.checkpoint.peer_settings import differences


def _attrs(clip: float | None) -> dict:
    return {"deepspeed": {"update": {} if clip is None else {"gradient_clipping": clip}}}


@pytest.mark.parametrize(
    ("saved", "engine", "warns"),
    [
        (1.0, None, "grad_clip=1"),
        (1.0, 1.0, None),
        (1.0, 0.5, "grad_clip=1"),
        (0.0, None, None),
        (0.0, 2.0, "grad_clip=None"),
        (None, None, None),  # the value could not be read: nothing claimed
    ],
)
def test_differences(saved, engine, warns):
    found = differences(_attrs(saved), SimpleNamespace(grad_clip=engine), "ckpt/")
    if warns is None:
        assert found == []
    else:
        (line,) = found
        assert f"Pass {warns} " in line and "ckpt/" in line


def test_zerostate_steps_have_no_peer_settings():
    config = SimpleNamespace(grad_clip=None)
    assert differences({"engine": {}}, config, "x") == []
    assert differences({"deepspeed": {"ds_version": "1"}}, config, "x") == []


def test_default_clipping_is_named_and_continues_within_1e_6(peer_checkpoints):
    path, peer, peer_world = peer_checkpoints.get("ds2-fp32-2-clipdefault")
    plain = run_distributed(peers.zerostate_continue, 2, str(path), 2, peer_world, timeout=300)
    (line,) = plain[0]["warnings"]
    assert "clipped gradients at norm 1" in line and "Pass grad_clip=1 " in line, line
    assert plain[1]["warnings"] == []  # rank 0 alone says it
    # the warning is about something real: without clipping the run drifts away
    drift = max(
        (plain[0]["after"][-1][k] - v).abs().max().item() for k, v in peer["after"][-1].items()
        if k != "head.weight"
    )  # fmt: skip
    assert drift > 1e-4, drift
    clipped = run_distributed(
        peers.zerostate_continue, 2, str(path), 2, peer_world, grad_clip=1.0, timeout=300
    )
    assert clipped[0]["warnings"] == []
    peers.assert_continues(peer["after"], clipped[0]["after"], tol=1e-6)


def test_an_explicit_setting_that_matches_says_nothing(peer_checkpoints):
    path, _, peer_world = peer_checkpoints.get("ds2-fp32-2")  # gradient_clipping: 0.0
    (mine,) = run_distributed(peers.zerostate_continue, 1, str(path), 2, peer_world, timeout=300)
    assert not [w for w in mine["warnings"] if "DeepSpeed run" in w], mine["warnings"]
