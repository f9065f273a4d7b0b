"""Dynamic loss scaling for fp16 training.

bf16 and fp32 have fp32's exponent range and need no scaling; they get a disabled scaler
whose scale is 1, so the engine's step has one code path.
"""

from __future__ import annotations

from zerostate.errors import ConfigError


class LossScaler:
    """Scale the loss up so small fp16 gradients do not flush to zero.

    On a step whose gradients overflowed (on any rank) the step is skipped and the scale
    halves (not below ``min_scale``); after ``window`` consecutive good steps it doubles.
    """

    def __init__(
        self, *, enabled: bool, initial_scale: float, window: int, min_scale: float
    ) -> None:
        self.enabled = enabled
        self.scale = float(initial_scale) if enabled else 1.0
        self.window = window
        self.min_scale = float(min_scale)
        self.good_steps = 0
        self.num_skipped = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            self.num_skipped += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {
            "enabled": self.enabled,
            "scale": self.scale,
            "good_steps": self.good_steps,
            "num_skipped": self.num_skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        try:
            scale = float(state["scale"])
            good_steps = int(state["good_steps"])
            num_skipped = int(state.get("num_skipped", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed loss-scaler state {state!r}: {exc}") from None
        if not self.enabled:
            # Resuming an fp16 run in bf16/fp32 (or the reverse) is legitimate: the
            # scale is a property of the precision, not of the model.
            return
        if not state.get("enabled", False):
            return  # keep this run's initial scale
        if scale <= 0:
            raise ConfigError(f"loss-scaler state has scale {scale}; it must be > 0")
        self.scale, self.good_steps, self.num_skipped = scale, good_steps, num_skipped
