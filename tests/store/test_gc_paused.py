"""[Note: GC paused while parsing] in zerostate/store/format.py: the collector is off while
a commit record is encoded or parsed, and in the state it was in afterwards."""

from __future__ import annotations

import gc

import pytest

from zerostate.store import format as fmt


def test_the_collector_is_paused_inside_and_resumed_after_even_on_error():
    seen = []

    @fmt.gc_paused
    def inner():
        seen.append(gc.isenabled())

    @fmt.gc_paused
    def outer(fail: bool):
        inner()  # nested: the outermost resumes it
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("boom")

    assert gc.isenabled()
    outer(False)
    assert gc.isenabled() and seen == [False, False]
    with pytest.raises(ValueError, match="boom"):
        outer(True)
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        fmt.dumps({"a": [1, 2]})
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_commit_record_paths_run_paused(monkeypatch):
    # parse_document is what every commit record, manifest and document is read through.
    states = []
    real = fmt.json.loads

    def spy(*args, **kwargs):
        states.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(fmt.json, "loads", spy)
    doc = fmt.group_document({"zerostate_commit": {"x": 1}})
    fmt.parse_document(doc, "zerostate_commit", "test")
    assert states and not any(states)
