"""torch.distributed.checkpoint (DCP) storage plug-ins that write and read zerostate's store.

``dcp.save(state, storage_writer=StorageWriter(root))`` and
``dcp.load(state, storage_reader=StorageReader(root))`` keep torch's planners (what is
saved, deduplication of replicated tensors, resharding on load) and replace only the
storage: a step of the store (``docs/format.md``, version 2) instead of ``.distcp`` files
and a pickled ``.metadata``. ``docs/dcp.md`` describes the mapping.

[Note: DCP steps]
Every chunk DCP plans (an N-D box of a global tensor, written by one rank) is one *piece*:
a tensor of the step, in the group ``dcp``, of the box's shape, owned whole by the rank that
writes it (layout ``chunk_numel = numel``, ``first_owner = rank``). Piece names start with
the writing rank (``dcp/r<rank>.<seq>.<fqn>``), so each rank's pieces lie back to back in
its row and each rank writes one checksummed row object. The coordinator sends each rank
only its own pieces and the row views that place them ([Note: row views] in
zerostate.store.rows), so planning a save is linear in ranks, not quadratic. The commit record's
``attrs["dcp"]`` holds DCP's metadata as JSON: for each tensor its global shape, dtype and
chunk boxes with the piece holding each; each non-tensor value (DCP's ``BYTE_IO`` items:
an optimizer's ``param_groups``, a scheduler's state) in ``zerostate.jsonstate``'s lossless
encoding; the planner's key mapping. Nothing is pickled: a value JSON cannot hold is
refused at save time, naming its key.

Commit: every rank writes its row and manifest in ``write_data``; DCP then gathers the
results on the coordinator, whose ``finish`` writes the commit record (with the metadata)
last, so the step is invisible until every rank's writes are durable.

On load, the metadata is validated before use (names, dtypes, shapes; the boxes of each
tensor lie inside it, do not overlap and tile it; each box's piece exists with the box's
shape and dtype), every byte read is checked against its crc32c, and non-tensor values
are decoded from the validated JSON and placed where DCP's default planner puts them, with
no unpickling (a planner with its own ``load_bytes`` gets bytes this module serialised from
that value, never bytes read from storage).
"""

from zerostate.dcp.common import GROUP, check_boxes
from zerostate.dcp.reader import StorageReader, describe_step
from zerostate.dcp.writer import StorageWriter

__all__ = ["GROUP", "StorageReader", "StorageWriter", "check_boxes", "describe_step"]
