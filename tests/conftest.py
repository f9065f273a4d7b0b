"""Shared fixtures. ``s3_server``: a real SeaweedFS S3 server on 127.0.0.1 for the session.

Tests marked ``s3`` use it. When the server cannot start those tests FAIL (never skip):
a silently skipped S3 suite would hide exactly the bugs it exists to catch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# No test reaches the Hugging Face hub (models come from configs). Set before any fork
# server starts: huggingface_hub reads it when imported there.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fork_server  # noqa: E402
import helpers_dist  # noqa: E402
from seaweed import S3Server, start_seaweedfs, stop_seaweedfs  # noqa: E402

# tests/foreign imports the launcher as ``tests.helpers_dist``: one module under both names,
# so every test shares one set of worker pools.
sys.modules.setdefault("tests.helpers_dist", helpers_dist)

__all__ = ["S3Server", "s3_server"]


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "fresh_processes: run_distributed spawns new interpreters for this test instead of "
        "using pooled or forked workers (interpreter exit, teardown, crashes, environment, "
        "forking)",
    )


# Files whose multi-rank tests run on the persistent worker pool (tests/dist_pool.py): only
# the pool's own tests. Every other multi-rank call forks new workers from the fork
# servers ([Note: forked workers] in tests/fork_server.py), which is cheaper and isolated
# by construction: a 4-rank call of a trivial function costs 0.2 CPU s forked and 1.06
# CPU s pooled (5 calls each on this 2-core machine; the pool's isolation checks after
# each call, a full garbage collection and scans of every module's attributes, cost more
# than a fork). The thirteen files that used the pool took 157 CPU s forked against 207
# CPU s pooled.
POOLED_FILES = {
    "tests/test_dist_pool.py",
}


@pytest.fixture(autouse=True)
def _pool_context(request):
    """Names the running test to the worker pools (leak and timeout errors name it) and
    says whether it may use them."""
    fresh = request.node.get_closest_marker("fresh_processes") is not None
    checked = request.node.nodeid.split("::")[0] in POOLED_FILES
    with fork_server.test_context(request.node.nodeid, pooled=checked and not fresh, spawn=fresh):
        yield


def pytest_sessionfinish(session, exitstatus) -> None:
    pool = sys.modules.get("dist_pool")  # imported by the pool's own tests only
    if pool is not None:
        pool.shutdown()
    fork_server.stop_fork_servers()


def pytest_collection_modifyitems(config, items) -> None:
    """End-to-end tests (torchrun jobs) and S3 tests (a SeaweedFS server) are slow: the fast
    set, ``pytest -m "not slow"``, leaves them out; scripts/test.sh and CI run them.

    [Note: test groups]: scripts/test.sh runs the suite on two pytest-xdist workers with
    ``--dist loadfile``: a test file runs on one worker, in order, so its module- and
    class-scoped fixtures are built once. Session fixtures (the S3 server, the peers'
    checkpoints) are built once per worker that needs them. Files are handed out in the
    order set here (scripts/test.sh passes ``--no-loadscope-reorder``; xdist's own order,
    most tests first, put the files of one or two long tests, the end-to-end jobs and the
    benchmark smoke run, last, where one worker ran them while the other sat idle): files
    whose tests use the peers' checkpoints first, so that their long setup does not start
    last, then files with slow tests, then the rest, whose many short tests fill the end."""
    e2e = Path(__file__).resolve().parent / "e2e"
    for item in items:
        if item.get_closest_marker("s3") or e2e in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)
    peer_files = {_file(i) for i in items if "peer_checkpoints" in getattr(i, "fixturenames", ())}
    slow_files = {_file(i) for i in items if i.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (_file(item) not in peer_files,
                                 _file(item) not in slow_files))  # stable


def _file(item) -> str:
    return item.nodeid.split("::")[0]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Session-wide SeaweedFS (``weed server -s3``) bound to 127.0.0.1 only."""
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        stop_seaweedfs(server)
