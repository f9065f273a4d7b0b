"""[Note: test groups] in tests/conftest.py: tests that share the peers' session-wide
checkpoints run on one xdist worker (the DeepSpeed and DCP runs are written once, not once
per worker), and every other test is grouped with its own file."""

from __future__ import annotations


def test_a_test_using_the_peers_checkpoints_is_in_the_peers_group(request, peer_checkpoints):
    assert peer_checkpoints.root.exists()
    assert request.node.get_closest_marker("xdist_group").args == ("peers",)


def test_any_other_test_is_grouped_with_its_file(request):
    group = request.node.get_closest_marker("xdist_group").args[0]
    assert group == "tests/foreign/test_test_groups.py"


def test_the_peers_group_is_collected_first(request):
    items = request.session.items
    groups = [item.get_closest_marker("xdist_group").args[0] for item in items]
    peers = [i for i, g in enumerate(groups) if g == "peers"]
    assert peers == list(range(len(peers))), "the longest group should start first"
