"""[Note: test groups] in tests/conftest.py: the files whose tests use the peers'
session-wide checkpoints are collected first (their setup is the longest)."""

from __future__ import annotations


def test_files_using_the_peers_checkpoints_are_collected_first(request, peer_checkpoints):
    assert peer_checkpoints.root.exists()
    files = [item.nodeid.split("::")[0] for item in request.session.items]
    uses = [
        "peer_checkpoints" in getattr(item, "fixturenames", ()) for item in request.session.items
    ]
    peer_files = {f for f, u in zip(files, uses, strict=True) if u}
    first = [f in peer_files for f in files]
    assert first == sorted(first, reverse=True), "a peers file was collected after another file"


def test_files_with_slow_tests_come_before_the_rest(request):
    """After the peers' files, files with slow tests, so that xdist (run with
    ``--no-loadscope-reorder``) hands out the long files first and the short ones fill the
    end of the run."""
    items = request.session.items
    files = [item.nodeid.split("::")[0] for item in items]
    peer = {f for f, i in zip(files, items, strict=True)
            if "peer_checkpoints" in getattr(i, "fixturenames", ())}
    slow = {f for f, i in zip(files, items, strict=True) if i.get_closest_marker("slow")}
    rank = [0 if f in peer else 1 if f in slow else 2 for f in files]
    assert rank == sorted(rank), "a file with slow tests was collected after one without"
