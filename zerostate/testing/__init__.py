"""Conformance suites: a new checkpoint format subclasses :class:`StepReaderTests` and gets
every test at once, as zarr ships ``zarr.testing.store.StoreTests``. Needs pytest."""

from zerostate.testing.step_reader import StepCase, StepReaderTests

__all__ = ["StepCase", "StepReaderTests"]
