"""The engine-state document's schema versions: what a save writes and what a load reads.

The engine, the checkpointer and the readers of peers' checkpoints (which build an engine
state for a DeepSpeed or DCP step) all need these numbers; they live here, apart from the
engine, so the store's readers do not import the engine.
"""

from __future__ import annotations

#: Version of the engine-state document a save writes.
ENGINE_STATE_VERSION = 2
#: Engine states of version 1 (built-in AdamW only, no optimizer metadata) still load.
READABLE_ENGINE_STATES = (1, 2)
