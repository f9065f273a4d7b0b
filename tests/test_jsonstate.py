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


# ------------------------------------------------ numpy values, torch dtypes and devices
def test_numpy_rng_state_round_trips_and_resumes_the_same_stream() -> None:
    import numpy as np

    rng = np.random.RandomState(1234)
    rng.standard_normal(7)  # leaves a cached gaussian: every field of the state in use
    state = rng.get_state()
    back = _round_trip({"np": state})["np"]
    assert type(back) is tuple and back[0] == "MT19937"
    assert type(back[1]) is np.ndarray and back[1].dtype == np.uint32
    assert np.array_equal(back[1], state[1]) and back[2:] == state[2:]
    again = np.random.RandomState()
    again.set_state(back)
    assert np.array_equal(again.standard_normal(5), rng.standard_normal(5))
    generator = np.random.default_rng(7)  # the new API's state: a dict of Python ints
    assert _round_trip(generator.bit_generator.state) == generator.bit_generator.state


@pytest.mark.parametrize("name", sorted(jsonstate.NUMPY_DTYPES))
def test_numpy_arrays_and_scalars_keep_their_type_and_bytes(name) -> None:
    import numpy as np

    dtype = np.dtype(name)
    raw = np.random.default_rng(3).integers(0, 256, size=6 * dtype.itemsize, dtype=np.uint8)
    array = raw.view(dtype).reshape(2, 3) if name != "bool" else raw.reshape(2, 3) % 2 == 1
    value = {"a": array, "t": array.T, "s": array.reshape(-1)[4], "e": array[:0]}
    back = _round_trip(value)
    for key in value:
        assert type(back[key]) is type(value[key]), (key, type(back[key]))
        assert back[key].dtype == dtype and back[key].shape == value[key].shape, key
        assert back[key].tobytes() == np.ascontiguousarray(value[key]).tobytes(), key  # NaNs too
    assert back["a"].flags.writeable


def test_other_numpy_values_are_refused_naming_their_path() -> None:
    import numpy as np

    with pytest.raises(ConfigError, match=r"state\['o'\] is a numpy array of dtype object"):
        jsonstate.encode({"o": np.array([{}], dtype=object)})
    with pytest.raises(ConfigError, match=r"state\['c'\] is a numpy scalar of dtype complex128"):
        jsonstate.encode({"c": np.complex128(1j)})
    with pytest.raises(ConfigError, match=r"state\['m'\] is a matrix"):
        jsonstate.encode({"m": np.matrix([[1, 2]])})
    big = np.arange(4, dtype=">u4")  # big-endian: the same values come back
    back = _round_trip(big)
    assert np.array_equal(back, big) and back.dtype == np.uint32


def test_torch_dtypes_devices_and_sizes_round_trip() -> None:
    value = {"dtype": torch.bfloat16, "devices": [torch.device("cpu"), torch.device("cuda:1")]}
    value["sizes"] = (torch.Size([2, 3]), torch.Size([]))
    back = _round_trip(value)
    assert back == value and back["dtype"] is torch.bfloat16
    assert [type(s) for s in back["sizes"]] == [torch.Size, torch.Size]


@pytest.mark.parametrize(
    "stored",
    [
        {"__zs_ndarray__": {"dtype": "object", "shape": [1], "data": ""}},
        {"__zs_ndarray__": {"dtype": "int32", "shape": [2], "data": "AAAAAA=="}},
        {"__zs_ndarray__": {"dtype": "int32", "shape": [-1], "data": ""}},
        {"__zs_ndarray__": {"dtype": "int32", "shape": [1]}},
        {"__zs_npscalar__": {"dtype": "float64", "data": "AAAA"}},
        {"__zs_dtype__": "float"},  # an alias: only the canonical name is written
        {"__zs_dtype__": "Tensor"},
        {"__zs_dtype__": "__import__"},
        {"__zs_device__": "cuda:0; rm -rf /"},
        {"__zs_device__": "nonsense"},
        {"__zs_size__": [2, -1]},
        {"__zs_size__": "2x3"},
        {"__zs_future__": 1},  # a newer version's marker is never taken for a dict
    ],
)
def test_malformed_numpy_dtype_and_device_markers_are_refused(stored) -> None:
    with pytest.raises(CorruptCheckpointError):
        jsonstate.decode(stored)


def test_user_keys_in_the_reserved_prefix_stay_keys() -> None:
    value = {"__zs_note__": 1, "__zs_ndarray__": "text"}
    assert _round_trip(value) == value
    assert _round_trip({"__zs_future__": {"a": 1}}) == {"__zs_future__": {"a": 1}}


def test_dcp_save_through_our_writer_keeps_a_numpy_rng_state(tmp_path) -> None:
    import numpy as np
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageReader, StorageWriter

    rng = np.random.RandomState(5)
    state = {"w": torch.ones(3), "rng": {"np": rng.get_state(), "amp": torch.bfloat16}}
    dcp.save(state, storage_writer=StorageWriter(str(tmp_path / "c")), no_dist=True)
    target = {"w": torch.zeros(3), "rng": {"np": None, "amp": None}}
    dcp.load(target, storage_reader=StorageReader(str(tmp_path / "c")), no_dist=True)
    again = np.random.RandomState()
    again.set_state(target["rng"]["np"])
    assert np.array_equal(again.random_sample(4), rng.random_sample(4))
    assert target["rng"]["amp"] is torch.bfloat16 and torch.equal(target["w"], torch.ones(3))


def _nested(depth: int, kind: str):
    value = 1
    for _ in range(depth):
        value = {"k": value} if kind == "dict" else (value,) if kind == "tuple" else [value]
    return value


@pytest.mark.parametrize("kind", ["list", "dict", "tuple"])
def test_nesting_is_bounded_the_same_way_on_save_and_on_load(kind) -> None:
    """A state nested 600 deep used to fail its save with a bare RecursionError, and a stored
    one about 900 deep made every read of the step raise one: a hostile record escaped the
    one-line refusal. Both sides now stop at MAX_DEPTH, so what saves always loads."""
    deepest = _nested(jsonstate.MAX_DEPTH, kind)
    assert _round_trip(deepest) == deepest
    with pytest.raises(ConfigError, match=f"nested more than {jsonstate.MAX_DEPTH} containers"):
        jsonstate.encode(_nested(jsonstate.MAX_DEPTH + 1, kind))
    with pytest.raises(ConfigError, match="nested more than"):
        jsonstate.encode(_nested(5000, kind))
    stored = json.loads("[" * 900 + "1" + "]" * 900)
    with pytest.raises(CorruptCheckpointError, match="nested more than"):
        jsonstate.decode(stored)
