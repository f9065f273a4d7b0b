"""``zerostate.jsonstate``: bytes and ``io.BytesIO`` values (a Stateful's blob, DCP's own
tests keep a ``torch.save``-d list in one) survive JSON exactly and are validated on decode."""

from __future__ import annotations

import io
import json

import pytest
import torch

from zerostate import jsonstate
from zerostate.errors import ConfigError, CorruptCheckpointError


def _round_trip(value):
    return jsonstate.decode(json.loads(json.dumps(jsonstate.encode(value))))


def test_bytes_and_bytesio_round_trip_with_contents_and_position() -> None:
    blob = bytes(range(256)) + b"\x80\x04 not a pickle to us"
    buffer = io.BytesIO()
    torch.save([0.25, 1.5], buffer)  # left at its end, as torch.save leaves it
    value = {"blob": blob, "empty": b"", "buf": buffer, 7: (b"k", io.BytesIO(b"xyz"))}
    back = _round_trip(value)
    assert type(back["blob"]) is bytes and back["blob"] == blob
    assert back["empty"] == b""
    assert type(back["buf"]) is io.BytesIO
    assert back["buf"].getvalue() == buffer.getvalue()
    assert back["buf"].tell() == buffer.tell() == len(buffer.getvalue())
    back["buf"].seek(0)
    assert torch.load(back["buf"]) == [0.25, 1.5]
    key, inner = back[7]
    assert key == b"k" and inner.getvalue() == b"xyz" and inner.tell() == 0
    # A user's key that spells a marker stays a key.
    assert _round_trip({"__zs_bytes__": "plain text"}) == {"__zs_bytes__": "plain text"}


def test_bytes_like_values_that_would_not_round_trip_are_refused() -> None:
    closed = io.BytesIO(b"gone")
    closed.close()
    with pytest.raises(ConfigError, match=r"state\['c'\] is a closed io.BytesIO"):
        jsonstate.encode({"c": closed})
    with pytest.raises(ConfigError, match="bytearray"):
        jsonstate.encode({"b": bytearray(b"ab")})


def test_values_whose_type_would_be_lost_unseen_are_refused_naming_their_path() -> None:
    import collections
    import enum

    class Mode(enum.IntEnum):
        TRAIN = 1

    class Tag(str, enum.Enum):
        A = "a"

    point = collections.namedtuple("Point", "x y")
    with pytest.raises(ConfigError, match=r"state\['m'\] is the enum member Mode.TRAIN"):
        jsonstate.encode({"m": Mode.TRAIN})
    with pytest.raises(ConfigError, match=r"state\['t'\]\[1\] is the enum member Tag.A"):
        jsonstate.encode({"t": [0, Tag.A]})
    with pytest.raises(ConfigError, match=r"state\[0\] is a named tuple \(Point\)"):
        jsonstate.encode((point(1, 2),))
    # Mappings and lists that are subclasses keep their items and order, as a dict / list.
    od = collections.OrderedDict([("b", 1), ("a", (2.5, None))])
    back = _round_trip({"od": od, "t": (1, "x")})
    assert list(back["od"].items()) == [("b", 1), ("a", (2.5, None))]
    assert type(back["t"]) is tuple and back["t"] == (1, "x")


@pytest.mark.parametrize(
    "stored",
    [
        {"__zs_bytes__": "not base64!"},
        {"__zs_bytes__": 3},
        {"__zs_bytesio__": {"data": "AAAA"}},
        {"__zs_bytesio__": {"data": "AAAA", "pos": -1}},
        {"__zs_bytesio__": {"data": "AAAA", "pos": True}},
        {"__zs_bytesio__": {"data": "AAAA", "pos": 1 << 62}},
        {"__zs_bytesio__": {"data": "@@", "pos": 0}},
        {"__zs_bytesio__": ["AAAA", 0]},
    ],
)
def test_malformed_bytes_markers_are_refused(stored) -> None:
    with pytest.raises(CorruptCheckpointError):
        jsonstate.decode(stored)


def _bits(x: float) -> bytes:
    import struct

    return struct.pack(">d", x)


def test_infinities_and_nans_round_trip_bit_for_bit_through_strict_json() -> None:
    """Floats JSON has no number for come back as the same eight bytes (a NaN keeps its sign
    and payload), anywhere in a value, through the strict JSON the store writes."""
    import struct

    odd_nan = struct.unpack(">d", bytes.fromhex("fff8000000000123"))[0]
    value = {
        "best": float("inf"),
        "worst": float("-inf"),
        "nan": float("nan"),
        "odd_nan": odd_nan,
        "finite": [0.5, -0.0, 1e308],
        "nested": ({"x": float("-inf")}, [float("inf")]),
        "__zs_float__": "a user's key that looks like the marker",
    }
    stored = json.loads(json.dumps(jsonstate.encode(value), allow_nan=False))
    back = jsonstate.decode(stored)
    assert back.keys() == value.keys()
    for key in ("best", "worst", "nan", "odd_nan"):
        assert isinstance(back[key], float) and _bits(back[key]) == _bits(value[key]), key
    assert back["finite"] == [0.5, -0.0, 1e308] and _bits(back["finite"][1]) == _bits(-0.0)
    assert back["nested"][0]["x"] == float("-inf") and back["nested"][1] == [float("inf")]
    assert back["__zs_float__"] == value["__zs_float__"]
    assert jsonstate.encode(0.25) == 0.25  # finite floats stay JSON numbers


@pytest.mark.parametrize(
    "body", ["7FF0000000000000", "7ff000000000000", "xyz", 7, None, "3ff0000000000000"]
)
def test_malformed_float_markers_are_refused(body) -> None:
    """Upper case, a wrong length, not hex, not text, or a finite float (stored as a number,
    never as a marker): a damaged or hostile step."""
    with pytest.raises(CorruptCheckpointError, match="float"):
        jsonstate.decode({"v": {"__zs_float__": body}})
