"""Property-based fuzzing of the partition / reshard math and of everything that parses
metadata read from storage. Parsers may only ever raise zerostate's own errors."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerostate.errors import CheckpointError, ZerostateError
from zerostate.layout.partition import TensorLayout, chunk_reads, even_layout, intersect
from zerostate.store import format as fmt
from zerostate.store import open_checkpoint

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

numels = st.integers(min_value=0, max_value=10**7)
world_sizes = st.integers(min_value=1, max_value=4096)


@FAST
@given(numels, world_sizes)
def test_even_layout_covers_every_element_once_with_little_padding(numel, world_size):
    layout = even_layout(numel, world_size)
    ranges = [layout.owned_range(r) for r in range(world_size)]
    covered = sorted((lo, hi) for lo, hi in ranges if hi > lo)
    position = 0
    for lo, hi in covered:
        assert lo == position  # contiguous, disjoint, in order
        position = hi
    assert position == numel
    padded = layout.chunk_numel * world_size
    assert padded - numel <= world_size - 1 or numel == 0
    # Ownership is by rank order: rank r's range starts at r * chunk (or is empty).
    for r, (lo, hi) in enumerate(ranges):
        assert hi == lo or lo == r * layout.chunk_numel


@st.composite
def layouts(draw):
    numel = draw(st.integers(min_value=1, max_value=10**6))
    world_size = draw(st.integers(min_value=1, max_value=256))
    low = math.ceil(numel / world_size)
    chunk = draw(st.integers(min_value=low, max_value=max(low, numel)))
    first = draw(st.integers(min_value=0, max_value=world_size - 1))
    return TensorLayout(numel, world_size, chunk, first)


@FAST
@given(layouts(), st.data())
def test_chunk_reads_rebuild_any_range_exactly(layout, data):
    start = data.draw(st.integers(min_value=0, max_value=layout.numel))
    stop = data.draw(st.integers(min_value=start, max_value=layout.numel))
    reads = chunk_reads(layout, start, stop)
    out_pos = 0
    for read in reads:
        lo, hi = layout.chunk_range(read.chunk_index)
        base = read.chunk_index * layout.chunk_numel
        assert read.out_start == out_pos
        assert lo <= base + read.chunk_start < base + read.chunk_stop <= hi
        assert base + read.chunk_start == start + out_pos
        out_pos += read.numel
    assert out_pos == stop - start


@FAST
@given(numels, world_sizes, world_sizes)
def test_resharding_n_to_m_reads_exactly_the_target_ranges(numel, n, m):
    """Every element a new rank owns comes from exactly one old rank's range, and the
    total read over all new ranks is the tensor once: shards need not align."""
    old, new = even_layout(numel, n), even_layout(numel, m)
    total = 0
    for r in range(min(m, 64)):  # a sample of target ranks keeps big m fast
        lo, hi = new.owned_range(r)
        got = 0
        for read in chunk_reads(old, lo, hi):
            owner_lo, owner_hi = old.chunk_range(read.chunk_index)
            piece = intersect((lo, hi), (owner_lo, owner_hi))
            assert piece is not None and piece[1] - piece[0] == read.numel
            got += read.numel
        assert got == hi - lo
        total += got
    if m <= 64:
        assert total == numel


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)  # fmt: skip


@FAST
@given(json_values)
def test_layout_from_json_only_raises_value_errors(value):
    try:
        TensorLayout.from_json(value)
    except (ValueError, AttributeError, OverflowError):
        pass


VALID_V1 = {
    "format_version": 1,
    "kind": "commit",
    "step": 3,
    "world_size": 2,
    "save_id": None,
    "attrs": {},
    "tensors": {
        "model/w": {
            "shape": [3, 5],
            "dtype": "float32",
            "layout": {"numel": 15, "world_size": 2, "chunk_numel": 8, "first_owner": 0},
            "attrs": {},
            "chunks": [{"nbytes": 36, "crc32c": 1}, {"nbytes": 36, "crc32c": 2}],
        }
    },
    "files": {"zarr.json": {"nbytes": 10, "crc32c": 5}},
}


def _apply(record: dict, field: str, value) -> dict:
    record = json.loads(json.dumps(record))
    tensor = record["tensors"]["model/w"]
    if field == "tensor.name":
        record["tensors"] = {str(value): tensor}
    elif field == "file.name":
        record["files"] = {str(value): {"nbytes": 1, "crc32c": 1}}
    elif field.startswith("tensor."):
        tensor[field.split(".", 1)[1]] = value
    else:
        record[field] = value
    return record


@FAST
@given(st.sampled_from(["format_version", "step", "world_size", "attrs", "tensors", "files",
                        "tensor.shape", "tensor.dtype", "tensor.layout", "tensor.chunks",
                        "tensor.name", "file.name"]),
       json_values)  # fmt: skip
def test_commit_record_parser_raises_only_checkpoint_errors(field, value):
    record = _apply(VALID_V1, field, value)
    try:
        fmt.parse_commit_record(record, 3, "fuzzed record")
    except CheckpointError:
        pass


@FAST
@given(st.binary(max_size=2000) | st.text(max_size=2000).map(str.encode))
def test_document_parser_raises_only_checkpoint_errors(raw):
    try:
        fmt.parse_document(raw, "zerostate_commit", "fuzzed document")
    except CheckpointError:
        pass


@FAST
@given(st.text(max_size=300))
def test_name_validation_never_lets_a_path_escape(name):
    try:
        fmt.validate_name(name)
    except ZerostateError:
        return
    parts = name.split("/")
    assert ".." not in parts and "." not in parts and "" not in parts
    assert not name.startswith("/") and "\\" not in name and "\x00" not in name


# -- format 2: every field of a real commit record, replaced by fuzzed JSON ----------------
GOLDEN_V2 = Path(__file__).resolve().parents[2] / "fixtures" / "golden-v2" / "ckpt"
COMMIT_V2 = GOLDEN_V2 / "step-00000042" / "_zerostate" / "commit" / "zarr.json"


def _paths(value, prefix=()):
    """Every path into a JSON value (dict keys and list indices), containers included."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, (*prefix, index))


_V2_DOC = json.loads(COMMIT_V2.read_text())
_V2_PATHS = [p for p in _paths(_V2_DOC) if p]


def _replaced(doc, path, value):
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_V2_PATHS), json_values)
def test_format2_reader_raises_only_checkpoint_errors(tmp_path_factory, path, value):
    """The whole read path (commit record parsing, the row plan, ranged verified reads)
    on a golden step whose commit record has one field replaced."""
    root = tmp_path_factory.mktemp("fuzz2") / "ckpt"
    shutil.copytree(GOLDEN_V2, root)
    target = root / "step-00000042" / "_zerostate" / "commit" / "zarr.json"
    target.write_text(json.dumps(_replaced(_V2_DOC, path, value)))
    try:
        step = open_checkpoint(str(root)).step()
        for name in list(step.tensors)[:8]:
            step.read(name)
        step.verify()
    except CheckpointError:
        pass
