"""What a peer's run did to its update that the loading engine sets on its own.

[Note: a peer's update settings]
A DeepSpeed checkpoint restores masters, moments and group hyperparameters (lr, betas, eps,
weight decay), but some of what shaped the run's update lives in its engine config, not in
its optimizer state: DeepSpeed clips gradients at 1.0 when its config says nothing
(``gradient_clipping`` defaults to 1.0; 0 turns it off). A zerostate engine takes its
clipping from its own ``grad_clip``, so a run continued without ``grad_clip=1.0`` drifts
away from the peer's own continuation (4e-2 relative after two steps in one measurement,
1e-7 with the setting) while every loaded tensor is exact. The reader records the saved
run's effective value (``attrs["deepspeed"]["update"]`` in
zerostate.store.foreign.deepspeed); :func:`differences` compares it with the engine's and
the load warns on rank 0, naming the argument to pass. Nothing is changed silently:
continuing with other settings on purpose is legitimate.
"""

from __future__ import annotations

from typing import Any


def differences(attrs: dict, config: Any, url: str) -> list[str]:
    """One warning per update setting of the saved run (a step's ``attrs``) that differs
    from the engine's ``config`` (an EngineConfig); empty for zerostate's own steps."""
    update = attrs.get("deepspeed", {}).get("update") if isinstance(attrs, dict) else None
    if not isinstance(update, dict):
        return []
    out = []
    clip = update.get("gradient_clipping")
    mine = config.grad_clip
    if isinstance(clip, float) and (mine or None) != (clip or None):
        ran = f"clipped gradients at norm {clip:g}" if clip > 0 else "did not clip gradients"
        fix = f"grad_clip={clip:g}" if clip > 0 else "grad_clip=None"
        out.append(
            f"the DeepSpeed run at {url} {ran} (gradient_clipping; DeepSpeed clips at 1.0 "
            f"when its config leaves it out) but this engine has grad_clip={mine!r}: the run "
            f"continues differently. Pass {fix} to continue it as it ran"
        )
    return out
