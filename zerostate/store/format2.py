"""Format v2 documents: tensor entries, manifests and the commit record, and their checks.

Pure functions, no I/O; ``docs/format.md`` is the specification and ``rows.py`` the row
plan ([Note: rows]) both sides derive from the tensors' layouts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from zerostate.errors import ConfigError, CorruptCheckpointError, UnsafeNameError
from zerostate.layout import mesh_layout as layout_mod
from zerostate.layout.mesh_layout import MeshLayout
from zerostate.store import format as fmt
from zerostate.store import geometry as mesh_mod
from zerostate.store import refs as refs_mod
from zerostate.store.rows import GroupPlan, RowView, group_of, plan_groups, row_path

VERSION = 2
#: A rank's JSON state (RNG states, stateful objects) is kept small: it rides in the manifest.
MAX_RANK_STATE_NBYTES = 4 << 20
#: Manifests are read whole; anything larger than this is not one this writer made.
MAX_MANIFEST_NBYTES = MAX_RANK_STATE_NBYTES + (4 << 20)
MAX_INNER_NBYTES = 64 << 20
MAX_ROW_NBYTES = 1 << 48


@dataclass(frozen=True, slots=True)
class RowTensorInfo(fmt.TensorInfo):
    """A format-2 tensor: its bytes lie in the rows of ``group``, at byte ``offset`` of
    every row ([Note: rows] in ``rows.py``)."""

    group: str = ""
    offset: int = 0


@dataclass(frozen=True, slots=True)
class RowRecord:
    """One written row object: its size, the crc32c of its shard index and the crc32c of
    the concatenated 4-byte checksums of its inner chunks (binds every chunk to the record)."""

    nbytes: int
    index_crc32c: int
    chunks_crc32c: int

    def to_json(self) -> dict:
        return {
            "nbytes": self.nbytes,
            "index_crc32c": self.index_crc32c,
            "chunks_crc32c": self.chunks_crc32c,
        }


def tensor_entries(
    specs: list[Any], world_size: int, views: dict[str, RowView] | None = None
) -> tuple[dict[str, dict], dict[str, GroupPlan]]:
    """Commit-record tensor entries and group plans of writer specs (placed by ``views``
    where given: [Note: row views] in ``rows.py``)."""
    plans = plan_groups(
        ((s.name, s.layout, s.dtype.itemsize) for s in specs), world_size, views=views
    )
    offsets = {slot.name: slot.offset for plan in plans.values() for slot in plan.slots}
    entries = {}
    for s in specs:
        mesh = getattr(s, "mesh", None)
        shape = (s.layout.numel,) if mesh is not None else s.shape
        entry = fmt.spec_json(s.name, shape, s.dtype, s.layout, s.attrs or {})
        entry.update(group=group_of(s.name), offset=offsets[s.name])
        if mesh is not None:
            entry["mesh"] = layout_mod.to_json(mesh)
        entries[s.name] = entry
    return entries, plans


def writer_digest(
    tensors: dict[str, dict], refs: dict[str, dict], views: dict[str, RowView] | None
) -> str:
    """The specs digest a writer puts in its manifest: rank 0 commits only manifests whose
    digest is the one it expects of that rank."""
    digested: dict = tensors
    if refs:  # steps without references or views keep the digest they always had
        digested = {"tensors": tensors, "refs": refs}
    if views:
        # Rank 0 computes one for every other rank: the compact form, which CPython's C
        # encoder writes (the indented canonical form takes 13 ms per 300 tensors).
        doc = {"tensors": tensors, "views": {g: v.to_json() for g, v in views.items()}}
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()
    return fmt.specs_digest(digested)


def tensors_digest(tensors: dict[str, dict]) -> tuple[str, fmt.Encoded]:
    """:func:`writer_digest` of a writer without refs or views, with the tensor entries'
    canonical text kept for the commit record ([Note: a value encoded once] in format.py)."""
    doc = fmt.encoded(tensors)
    return fmt.specs_digest(doc), doc


def group_entries(plans: dict[str, GroupPlan], rows: dict[str, list[dict | None]]) -> dict:
    return {
        g: {"inner_chunk_nbytes": p.inner, "row_nbytes": p.row_nbytes, "rows": rows[g]}
        for g, p in plans.items()
    }


def check_rank_state(rank_state: Any) -> dict | None:
    """Validate a rank's JSON state before it is written (writer side)."""
    if rank_state is None:
        return None
    if not isinstance(rank_state, dict):
        raise ConfigError(
            f"rank_state must be a JSON object (dict) or None, got {type(rank_state).__name__}"
        )
    fmt.check_json(rank_state, "rank_state")
    size = len(fmt.dumps(rank_state))
    if size > MAX_RANK_STATE_NBYTES:
        raise ConfigError(
            f"rank_state is {size} bytes as JSON, over the {MAX_RANK_STATE_NBYTES}-byte limit; "
            "store large per-rank data as tensors instead"
        )
    return rank_state


def parse_row(entry: Any, what: str) -> RowRecord | None:
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{what}: expected an object or null, got {entry!r}")
    return RowRecord(
        fmt._int(entry.get("nbytes"), f"{what}: nbytes", 1, MAX_ROW_NBYTES),
        fmt._int(entry.get("index_crc32c"), f"{what}: index_crc32c", 0, 0xFFFFFFFF),
        fmt._int(entry.get("chunks_crc32c"), f"{what}: chunks_crc32c", 0, 0xFFFFFFFF),
    )


@dataclass(frozen=True, slots=True)
class StepRecord:
    """A validated format-2 commit record."""

    world_size: int
    attrs: dict
    tensors: dict[str, RowTensorInfo]
    plans: dict[str, GroupPlan]
    rows: dict[str, list[RowRecord | None]]
    manifests: list[fmt.ChunkRecord]
    files: dict[str, fmt.ChunkRecord]
    #: Tensors held by older steps: ``{name: (info as referenced, holder step)}``
    #: ([Note: tensor references] in ``refs.py``).
    refs: dict[str, tuple[fmt.TensorInfo, int]] = field(default_factory=dict)
    #: Tensors stored as tp x dp pieces: their logical layouts ([Note: mesh tensors]).
    meshes: dict[str, MeshLayout] = field(default_factory=dict)
    format_version: int = VERSION


@fmt.gc_paused
def parse_commit_record(record: dict, expected_step: int, where: str) -> StepRecord:
    """Validate a format-2 commit record read from storage; every name, number and offset
    is checked before use (rows against the plan lazily, see ``check_row``)."""
    version = fmt.check_format_version(record, where, (VERSION, mesh_mod.VERSION))
    step = fmt._int(record.get("step"), f"{where}: step", 0, fmt.MAX_STEP)
    if step != expected_step:
        raise CorruptCheckpointError(
            f"{where} says step {step}, but it lives in step {expected_step}'s directory"
        )
    world_size = fmt._int(record.get("world_size"), f"{where}: world_size", 1, fmt.MAX_RANKS + 1)
    attrs, tensors_json = record.get("attrs"), record.get("tensors")
    groups_json, files_json = record.get("groups"), record.get("files")
    manifests_json = record.get("manifests")
    if not all(isinstance(x, dict) for x in (attrs, tensors_json, groups_json, files_json)):
        raise CorruptCheckpointError(f"{where}: attrs, tensors, groups and files must be objects")
    if not isinstance(manifests_json, list) or len(manifests_json) != world_size:
        raise CorruptCheckpointError(f"{where}: manifests must be a list of {world_size} entries")
    tensors: dict[str, RowTensorInfo] = {}
    meshes: dict[str, MeshLayout] = {}
    for name, entry in tensors_json.items():
        fmt.validate_name(name)
        what = f"{where}: tensor {name!r}"
        tensors[name] = _parse_tensor(name, entry, world_size, what)
        if isinstance(entry, dict) and "mesh" in entry:
            if version < mesh_mod.VERSION:
                raise CorruptCheckpointError(
                    f"{what}: a mesh entry in a format-{version} step (mesh tensors need "
                    f"format {mesh_mod.VERSION})"
                )
            meshes[name] = layout_mod.from_json(entry["mesh"], name)
            mesh_mod.check_stored(meshes[name], tensors[name].layout, name)
            if tuple(tensors[name].shape) != (tensors[name].layout.numel,):
                raise CorruptCheckpointError(f"{what}: a mesh tensor's stored array is 1-D")
    refs = refs_mod.parse_refs(record.get("refs"), step, world_size, where, MAX_ROW_NBYTES)
    try:
        fmt.check_name_tree([*tensors, *refs])
        inner = {}
        for g, entry in groups_json.items():
            if not isinstance(entry, dict):
                raise CorruptCheckpointError(f"{where}: group {g!r} must be an object")
            inner[g] = fmt._int(
                entry.get("inner_chunk_nbytes"),
                f"{where}: group {g!r} inner_chunk_nbytes",
                1,
                MAX_INNER_NBYTES,
            )
        plans = plan_groups(
            ((i.name, i.layout, i.dtype.itemsize) for i in tensors.values()), world_size, inner
        )
    except ConfigError as exc:
        raise UnsafeNameError(f"{where}: {exc}") from exc
    if set(plans) != set(groups_json):
        raise CorruptCheckpointError(
            f"{where}: groups {sorted(groups_json)[:10]} do not match the tensors' groups "
            f"{sorted(plans)[:10]}"
        )
    rows: dict[str, list[RowRecord | None]] = {}
    for g, plan in plans.items():
        entry = groups_json[g]
        if entry.get("row_nbytes") != plan.row_nbytes or plan.row_nbytes > MAX_ROW_NBYTES:
            raise CorruptCheckpointError(
                f"{where}: group {g!r} row_nbytes {entry.get('row_nbytes')!r} does not match "
                f"its tensors ({plan.row_nbytes})"
            )
        rows_json = entry.get("rows")
        if not isinstance(rows_json, list) or len(rows_json) != world_size:
            raise CorruptCheckpointError(f"{where}: group {g!r} needs {world_size} rows")
        rows[g] = [parse_row(r, f"{where}: group {g!r} row {i}") for i, r in enumerate(rows_json)]
        for slot in plan.slots:
            if tensors[slot.name].offset != slot.offset:
                raise CorruptCheckpointError(
                    f"{where}: tensor {slot.name!r} offset {tensors[slot.name].offset} does not "
                    f"match the row plan ({slot.offset})"
                )
    manifests = [
        fmt._parse_chunk(m, f"{where}: manifest {r}") for r, m in enumerate(manifests_json)
    ]
    for r, m in enumerate(manifests):
        if m.nbytes > MAX_MANIFEST_NBYTES:
            raise CorruptCheckpointError(f"{where}: manifest {r} is recorded as {m.nbytes} bytes")
    files: dict[str, fmt.ChunkRecord] = {}
    for path, entry in files_json.items():
        fmt.validate_name(path, what="metadata path", allow_meta=True)
        files[path] = fmt._parse_chunk(entry, f"{where}: file {path!r}")
    if meshes and refs:
        raise CorruptCheckpointError(f"{where}: a step with mesh tensors refers to no other step")
    return StepRecord(
        world_size, attrs, tensors, plans, rows, manifests, files, refs, meshes, version
    )


def check_row(plan: GroupPlan, rank: int, row: RowRecord | None, where: str) -> None:
    """A row record must be exactly what the plan says ``rank`` stores."""
    # One rank's size from its stored chunks (which a reader of the row needs anyway), not
    # every rank's: at small world sizes the vectorised form costs more than it saves.
    expected = plan.object_nbytes(rank)
    got = row.nbytes if row is not None else 0
    if got != expected:
        raise CorruptCheckpointError(
            f"{where}: group {plan.name!r} row {rank} is recorded as {got} bytes, the plan "
            f"says {expected} ({row_path(plan.name, rank)})"
        )


def _parse_tensor(name: str, entry: Any, world_size: int, what: str) -> RowTensorInfo:
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{what}: expected an object")
    shape, dtype, layout = fmt.parse_shape_dtype_layout(entry, world_size, what, MAX_ROW_NBYTES)
    attrs = entry.get("attrs", {})
    if not isinstance(attrs, dict):
        raise CorruptCheckpointError(f"{what}: attrs must be an object")
    if entry.get("group") != group_of(name):
        raise CorruptCheckpointError(
            f"{what}: group {entry.get('group')!r}, expected {group_of(name)!r}"
        )
    offset = fmt._int(entry.get("offset"), f"{what}: offset", 0, MAX_ROW_NBYTES)
    return RowTensorInfo(name, shape, dtype, layout, attrs, group_of(name), offset)
