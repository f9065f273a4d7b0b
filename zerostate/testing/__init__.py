"""Conformance suites a new checkpoint format (or storage backend) runs to get every test
at once, as zarr ships ``zarr.testing.store.StoreTests``."""
