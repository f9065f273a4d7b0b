"""The engine's settings, :class:`EngineConfig`; they live in :mod:`zerostate.engine.config`,
and this module keeps the name code written against it imports."""

from zerostate.engine.config import (
    OFFLOAD_STAGES,
    STAGES,
    EngineConfig,
    check_setting_names,
    field_docs,
    field_names,
    unknown_setting,
)

__all__ = [
    "OFFLOAD_STAGES",
    "STAGES",
    "EngineConfig",
    "check_setting_names",
    "field_docs",
    "field_names",
    "unknown_setting",
]
