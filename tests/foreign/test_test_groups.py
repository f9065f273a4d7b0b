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
