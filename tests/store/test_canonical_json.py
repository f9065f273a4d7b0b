"""[Note: canonical JSON, fast] in zerostate.store.format: ``format.dumps`` writes exactly
the bytes of ``json.dumps(obj, sort_keys=True, indent=1, allow_nan=False)`` plus a newline,
for any JSON value, and fails as ``json.dumps`` fails on anything else."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerostate.store import format as fmt

FIXTURES = Path(__file__).resolve().parent.parent.parent / "fixtures"


def _reference(obj) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(_values)
def test_equals_json_dumps_on_any_json_value(value):
    assert fmt.dumps(value) == _reference(value)


def test_every_stored_document_of_the_golden_checkpoints_is_written_back_byte_for_byte():
    docs = [p for p in FIXTURES.rglob("*.json") if p.name == "zarr.json"]
    assert len(docs) >= 10, "the golden checkpoints hold the format's documents"
    for path in docs:
        raw = path.read_bytes()
        assert fmt.dumps(json.loads(raw)) == raw, path


@pytest.mark.parametrize(
    "value",
    [
        {1: "int key"},
        {"a": {None: 1}, "b": {2.5: 2, True: 3}},
        {"x": [1, 2, {3: 4}]},
        {"bool": True, "int": 1, "float": 1.5, "big": 10**30, "neg0": -0.0, "tiny": 5e-324},
        ["\u2028", "é", '"quoted"', "\\", "\x00", "\ud800"],
    ],
)
def test_keys_and_scalars_json_treats_specially(value):
    assert fmt.dumps(value) == _reference(value)


@pytest.mark.parametrize(
    "value",
    [
        math.nan,
        {"a": [math.inf]},
        {"a": -math.inf},
        {"a": object()},
        {"a": {1, 2}},
        b"bytes",
        {"a": {None: 1, "b": 2}},  # keys that do not sort together
    ],
)
def test_what_json_refuses_is_refused_with_its_error(value):
    with pytest.raises((TypeError, ValueError)) as ours:
        fmt.dumps(value)
    with pytest.raises(type(ours.value)) as theirs:
        _reference(value)
    assert str(ours.value) == str(theirs.value)


def test_a_cycle_is_refused_as_json_refuses_it():
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="Circular reference"):
        fmt.dumps(cycle)


def _wrap_some(value, draw_bits):
    """``value`` with some of its nested values replaced by their encoded form."""
    if isinstance(value, dict):
        value = {k: _wrap_some(v, draw_bits) for k, v in value.items()}
    elif isinstance(value, (list, tuple)):
        value = [_wrap_some(v, draw_bits) for v in value]
    return fmt.encoded(value) if draw_bits() else value


@settings(max_examples=300, deadline=None)
@given(_values, st.randoms(use_true_random=False))
def test_an_encoded_value_is_written_as_its_value_at_any_depth(value, rng):
    """[Note: a value encoded once] in zerostate.store.format."""
    wrapped = _wrap_some(value, lambda: rng.random() < 0.4)
    assert fmt.dumps(wrapped) == _reference(value)
    assert fmt.dumps({"a": {"b": [wrapped]}}) == _reference({"a": {"b": [value]}})


def test_an_encoded_value_survives_the_json_dumps_fallback():
    inner = {"x": [1, 2.5, "a\nb"], "y": {"z": None}}
    # A non-str key sends the whole document to json.dumps.
    doc = {1: "int key", 2: {"deeper": fmt.encoded(inner)}}
    assert fmt.dumps(doc) == _reference({1: "int key", 2: {"deeper": inner}})
    with pytest.raises(TypeError, match="set"):
        fmt.dumps({1: fmt.encoded(inner), 2: {1, 2}})


def test_the_writer_digest_is_the_same_with_the_text_kept():
    from zerostate.store import format2

    tensors = {"m/w": {"shape": [3, 5], "dtype": "float32", "note": "line\nbreak"}, "m/b": {}}
    digest, doc = format2.tensors_digest(tensors)
    assert digest == format2.writer_digest(tensors, {}, None)
    assert doc.value is tensors and fmt.dumps(doc) == _reference(tensors)
