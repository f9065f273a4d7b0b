"""Shared fixtures. ``s3_server``: a real SeaweedFS S3 server on 127.0.0.1 for the session.

Tests marked ``s3`` use it. When the server cannot start those tests FAIL (never skip):
a silently skipped S3 suite would hide exactly the bugs it exists to catch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from seaweed import S3Server, start_seaweedfs, stop_seaweedfs  # noqa: E402

__all__ = ["S3Server", "s3_server"]


def pytest_collection_modifyitems(config, items) -> None:
    """End-to-end tests (torchrun jobs) and S3 tests (a SeaweedFS server) are slow: the fast
    set, ``pytest -m "not slow"``, leaves them out; scripts/test.sh and CI run them."""
    e2e = Path(__file__).resolve().parent / "e2e"
    for item in items:
        if item.get_closest_marker("s3") or e2e in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Session-wide SeaweedFS (``weed server -s3``) bound to 127.0.0.1 only."""
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        stop_seaweedfs(server)
