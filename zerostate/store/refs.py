"""Tensor references between steps of one checkpoint root (format 2). Pure, no I/O
except :func:`kept_steps`, which reads commit records for retention.

[Note: tensor references]
A fine-tuning run saves the same frozen base at every step. A step may instead *refer*
to a tensor of an older committed step of the same root, its *holder*: the commit record's
optional ``refs`` object maps the tensor's name to its spec (shape, dtype, layout, attrs)
and ``"step": K``. The step's own rows do not hold it; a reader reads it from step K's
rows, where step K's ``tensors`` entry gives its group and offset. Rules:
- The holder stores the tensor itself (a reference never points at a reference), is an
  older step (``K < step``), and its entry has the same spec as the reference.
- The writer refers only to tensors whose content it checked: each rank hashes its owned
  range and compares it with the hash the holder's step recorded for that rank, and the
  tensor is referenced only if every rank's range matches (same world size and layout).
  A changed "frozen" tensor, or a save at another world size, writes the tensor again.
- Retention (``prune_steps``, ``delete_step``) never deletes a step a kept step refers
  to, directly or through the steps it keeps; ``remove_partial_steps`` never deletes a
  step that a committed step refers to (the writer refers only to committed steps, so it
  could only meet one after damage).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from zerostate.errors import CorruptCheckpointError
from zerostate.store import format as fmt

log = logging.getLogger(__name__)

#: Bytes hashed per update: bounds the copy a hash of a GPU tensor makes on the host.
HASH_BLOCK_NBYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor a step refers to instead of storing: its spec and the step that holds it."""

    spec: Any  # writer.TensorSpec (not imported: the writer imports this module)
    step: int

    def to_json(self) -> dict:
        s = self.spec
        entry = fmt.spec_json(s.name, s.shape, s.dtype, s.layout, s.attrs or {})
        entry["step"] = self.step
        return entry


def parse_refs(
    refs_json: Any, step: int, world_size: int, where: str, max_dim: int
) -> dict[str, tuple[fmt.TensorInfo, int]]:
    """``{name: (info as the reference states it, holder step)}`` of a commit record's
    ``refs`` (absent: none). Group and offset come from the holder when it is opened."""
    if refs_json is None:
        return {}
    if not isinstance(refs_json, dict):
        raise CorruptCheckpointError(f"{where}: refs must be an object")
    out = {}
    for name, entry in refs_json.items():
        fmt.validate_name(name)
        what = f"{where}: reference {name!r}"
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{what}: expected an object")
        shape, dtype, layout = fmt.parse_shape_dtype_layout(entry, world_size, what, max_dim)
        attrs = entry.get("attrs", {})
        if not isinstance(attrs, dict):
            raise CorruptCheckpointError(f"{what}: attrs must be an object")
        holder = fmt._int(entry.get("step"), f"{what}: step", 0, fmt.MAX_STEP)
        if holder >= step:
            raise CorruptCheckpointError(
                f"{what}: refers to step {holder}, which is not older than step {step}"
            )
        out[name] = (fmt.TensorInfo(name, shape, dtype, layout, attrs), holder)
    return out


def check_holder_entry(ref: fmt.TensorInfo, held: fmt.TensorInfo | None, where: str) -> None:
    """The holder must store the tensor with exactly the spec the reference states."""
    if held is None:
        raise CorruptCheckpointError(f"{where}: the holder step does not store {ref.name!r}")
    same = (
        tuple(held.shape) == tuple(ref.shape)
        and held.dtype == ref.dtype
        and held.layout.to_json() == ref.layout.to_json()
    )
    if not same:
        raise CorruptCheckpointError(
            f"{where}: {ref.name!r} is {tuple(held.shape)} {held.dtype} in the holder step, "
            f"the reference says {tuple(ref.shape)} {ref.dtype} (or another layout)"
        )


def shard_digest(source: torch.Tensor) -> str:
    """Hex sha256 of a tensor's bytes (its dtype and element count included), read in
    blocks so a GPU tensor is copied to the host a block at a time."""
    flat = source.detach().reshape(-1)
    h = hashlib.sha256(f"{fmt.dtype_name(flat.dtype)}:{flat.numel()}:".encode())
    if flat.numel():
        step = max(1, HASH_BLOCK_NBYTES // flat.element_size())
        for lo in range(0, flat.numel(), step):
            block = flat[lo : lo + step].contiguous().cpu()
            h.update(memoryview(block.view(torch.uint8).numpy()))
    return h.hexdigest()


def referenced_by(record: Any) -> set[int]:
    """Holder steps a raw (parsed JSON) commit record refers to; empty if it has none."""
    refs = record.get("refs") if isinstance(record, dict) else None
    if not isinstance(refs, dict):
        return set()
    steps = (e.get("step") for e in refs.values() if isinstance(e, dict))
    return {k for k in steps if isinstance(k, int) and not isinstance(k, bool)}


def kept_steps(storage: Any, keep: set[int]) -> set[int] | None:
    """``keep`` plus every step they refer to, transitively; None if a commit record on
    the way cannot be read (then the caller must not delete committed steps: it cannot
    prove that nothing refers to them)."""
    out, todo = set(), list(keep)
    while todo:
        step = todo.pop()
        if step in out:
            continue
        out.add(step)
        where = f"commit record of step {step} in {storage.url}"
        try:
            raw = storage.read(f"{fmt.step_dir(step)}/{fmt.COMMIT_PATH}")
            record = fmt.parse_document(raw, "zerostate_commit", where)
        except FileNotFoundError:
            continue  # not committed: it refers to nothing
        except Exception as exc:  # noqa: BLE001 - reported; deleting nothing is safe
            log.warning("zerostate: cannot read %s (%s); keeping every step", where, exc)
            return None
        todo += sorted(referenced_by(record) - out)
    return out
