"""The engine: ZeRO stage 0-3 training of one model, as a facade over the runtime, the
optimizer and the checkpoint sessions.

``facade`` holds :class:`Engine` itself (wiring, forward, backward, the step as a
sequence, save and load, properties).
"""

from zerostate.config import EngineConfig
from zerostate.engine.facade import Engine, EngineUsageError
from zerostate.sharded import ShardView

__all__ = ["Engine", "EngineConfig", "EngineUsageError", "ShardView"]
