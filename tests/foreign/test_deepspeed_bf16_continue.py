"""A bf16 DeepSpeed ZeRO run continued by ``zerostate.Engine(precision="bf16")`` at another
world size: the fp32 masters and losses of the next steps against DeepSpeed's own
continuation from the same checkpoint.

Both engines keep fp32 masters and AdamW moments and run the model in bf16. After the load
the working weights are DeepSpeed's bit for bit, so the first continued loss agrees to fp32
summation order; the gradients then differ by bf16 rounding inside the backward (a global
batch of 6 split 3 + 3 by DeepSpeed's 2 ranks, or of 12 split 3 + 3 + 3 + 3 by its 4 ranks, split
other ways by zerostate: other matmul shapes, other orders of the cross-rank sum), a few
2**-9 relative, and AdamW turns that into a change of the update ``lr * m / sqrt(v)`` of a
similar relative size. Measured here (stages 1-3 from 2 ranks into worlds 1 and 3, stages 2
and 3 from 4 ranks into worlds 2 and 3): masters within 7e-5 after the first step and
2.0e-4 after the second (0.7 % and 2 % of lr), losses within 2e-7 and 4.2e-4; the first
step computed in fp64 from the same checkpoint state lands 7e-5 from DeepSpeed's masters
and 5e-5 from zerostate's, so both are that far from exact, not one of them wrong. Clearing
the restored moments moves the masters by 1.4e-2 and 2.5e-2 (more than one update), which
the negative controls below (from 2 and from 4 ranks) show the tolerance catches.

The checkpoints come from ``peers.write_deepspeed_bf16`` through the session's
``peer_checkpoints``, which test_peers.py also inspects, verifies and consolidates.
"""

from __future__ import annotations

import pytest
import torch

from tests.foreign import peers
from tests.helpers_dist import run_distributed

#: Master tolerance: 5 % of one AdamW update (about lr per element at these steps).
MASTER_TOL = 0.05 * peers.LR
#: The first continued step runs the loaded weights, bit for bit DeepSpeed's, so its loss
#: differs only by fp32 summation order; the second runs masters already a bf16 rounding
#: apart, and its logits round at 2**-9 relative (a loss near 3.4: well under 1e-3).
FIRST_LOSS_TOL, LOSS_TOL = 1e-4, 1e-3


def zerostate_bf16(
    rank: int, world_size: int, ckpt: str, stage: int, size: int, zero_moments: bool = False
) -> dict:
    """``Engine(precision="bf16")`` loads ``ckpt`` (hyperparameters deliberately wrong, to be
    restored) and takes the same next steps; ``zero_moments`` clears the restored AdamW
    moments first (the negative control)."""
    import zerostate

    model = peers.build_model()
    with torch.no_grad():  # the load must replace every value
        for p in model.parameters():
            p.add_(1.0)
    engine = zerostate.Engine(
        model,
        stage=stage,
        precision="bf16",
        lr=0.5,
        betas=(0.5, 0.5),
        eps=peers.EPS,
        weight_decay=0.0,
    )
    engine.load(ckpt)
    if zero_moments:
        for state in engine.optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].zero_()
    losses, masters = [], []
    for step in range(peers.TRAIN_STEPS, peers.TRAIN_STEPS + peers.NEXT_STEPS):
        loss = engine(*peers.bf16_share(rank, world_size, step, size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        masters.append({k: v.detach().float().clone() for k, v in engine.full_state_dict().items()})
    assert engine.module.body.weight.dtype == torch.bfloat16 or stage == 3
    return {
        "losses": losses,
        "masters": masters if rank == 0 else None,
        "steps": engine.optimizer_steps,
    }


def _differences(theirs: list[dict], ours: list[dict]) -> list[float]:
    """Max abs master difference after each next step (the tied head is ``emb.weight``)."""
    out = []
    for step_theirs, step_ours in zip(theirs, ours, strict=True):
        worst = 0.0
        for key, value in step_theirs.items():
            mine = step_ours[key if key in step_ours else "emb.weight"]
            worst = max(worst, (mine - value).abs().max().item())
        out.append(worst)
    return out


def _continue(ckpt: str, peer_world: int, world: int, stage: int, zero_moments: bool = False):
    size = peers.BF16_MICRO * peer_world  # DeepSpeed's global batch, split over ``world``
    ranks = run_distributed(
        zerostate_bf16, world, ckpt, stage, size, zero_moments=zero_moments, timeout=300
    )
    losses = [sum(r["losses"][k] for r in ranks) / world for k in range(peers.NEXT_STEPS)]
    return ranks[0], losses


#: (DeepSpeed checkpoint, zerostate world size, zerostate stage): always another world size.
CASES = [
    ("ds1-bf16-2", 3, 1),
    ("ds1-bf16-2", 1, 2),
    ("ds2-bf16-2", 3, 3),
    ("ds3-bf16-2", 1, 3),
    ("ds3-bf16-2", 3, 3),
    ("ds1-bf16-4", 3, 2),
    ("ds2-bf16-4", 2, 3),
    ("ds3-bf16-4", 3, 2),
]


@pytest.mark.parametrize(("name", "world", "stage"), CASES)
def test_bf16_engine_load_continues_deepspeed(peer_checkpoints, name, world, stage):
    ckpt, ds, peer_world = peer_checkpoints.get(name)
    mine, losses = _continue(str(ckpt), peer_world, world, stage)
    assert mine["steps"] == peers.TRAIN_STEPS + peers.NEXT_STEPS
    master_diff = _differences(ds["after"], mine["masters"])
    loss_diff = [abs(a - b) for a, b in zip(losses, ds["losses"], strict=True)]
    print(f"{name} -> world {world} stage {stage}: masters {master_diff} loss {loss_diff}")
    assert max(master_diff) <= MASTER_TOL, master_diff
    assert loss_diff[0] <= FIRST_LOSS_TOL and max(loss_diff) <= LOSS_TOL, loss_diff


@pytest.mark.parametrize(("name", "world", "stage"), [("ds1-bf16-2", 1, 2), ("ds3-bf16-4", 2, 3)])
def test_bf16_tolerance_catches_unrestored_moments(peer_checkpoints, name, world, stage):
    """The same continuation with the restored moments cleared fails the master tolerance:
    the comparison above would catch a load that dropped them."""
    ckpt, ds, peer_world = peer_checkpoints.get(name)
    mine, _ = _continue(str(ckpt), peer_world, world, stage, zero_moments=True)
    master_diff = _differences(ds["after"], mine["masters"])
    print(f"{name}, moments cleared: masters {master_diff}")
    assert max(master_diff) > 10 * MASTER_TOL, master_diff
