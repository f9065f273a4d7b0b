"""Conformance suites: a new checkpoint format subclasses :class:`StepReaderTests`, a new
storage backend :class:`StorageTests`, and gets every test at once, as zarr ships
``zarr.testing.store.StoreTests``. Needs pytest."""

from zerostate.testing.step_reader import StepCase, StepReaderTests
from zerostate.testing.storage import StorageTests

__all__ = ["StepCase", "StepReaderTests", "StorageTests"]
