"""The engine: ZeRO stage 0-3 training of one model, as a facade over the runtime, the
optimizer and the checkpoint sessions.

``facade`` holds :class:`Engine` itself (wiring, forward, backward, the step as a
sequence, save and load, properties); ``build`` the settings and the checks every rank
agrees on before anything changes; ``parts`` the engine's state as the checkpoint code sees
it ([Note: engine parts] in zerostate.checkpoint.parts); ``guards`` the guards on torch's
module API over the wrapped model; ``hooks`` the weak autograd and runtime hooks;
``pipeline`` the gradient side of a step (norm, flags, clipping); ``stats`` memory and
communication statistics; ``config`` the settings (:class:`EngineConfig`); ``progress``
the progress log.
"""

from zerostate.engine.config import EngineConfig
from zerostate.engine.facade import Engine
from zerostate.errors import EngineUsageError
from zerostate.runtime.sharded import ShardView

__all__ = ["Engine", "EngineConfig", "EngineUsageError", "ShardView"]
