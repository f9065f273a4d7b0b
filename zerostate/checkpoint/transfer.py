"""Moving a memory tier's files between ranks: the nodes, the replica ring, byte bundles and
their transfer over torch.distributed ([Note: memory tier] in zerostate.checkpoint.tiers).

Files travel as one byte string per destination (:func:`pack`); a receiver trusts nothing
in it (:func:`unpack` checks sizes and paths; the caller checks contents against what it
expects).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace

import torch

from zerostate.dist import collectives
from zerostate.dist.coordinator import Coordinator
from zerostate.errors import CheckpointError, ConfigError
from zerostate.store import format as fmt

_MAX_FILES = 1_000_000


# --------------------------------------------------------------------------- nodes
@dataclass(frozen=True, slots=True)
class Nodes:
    """Which node each rank is on, and who keeps whose replica."""

    node_of: list[int]
    #: rank -> the rank keeping its replica (None: one node, no replica)
    partner: list[int | None]

    def ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def leader(self, node: int) -> int:
        return self.ranks(node)[0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.node_of[rank]) == rank

    def source_of(self, rank: int) -> list[int]:
        """The ranks whose replica ``rank`` keeps."""
        return [r for r, p in enumerate(self.partner) if p == rank]


def node_index() -> int:
    """This process's node: torchrun's ``GROUP_RANK`` (0 without torchrun)."""
    text = os.environ.get("GROUP_RANK", "0")
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"GROUP_RANK={text!r} is not an integer") from None
    if value < 0:
        raise ConfigError(f"GROUP_RANK={value} is negative")
    return value


def find_nodes(coordinator: Coordinator) -> Nodes:
    """Collective: the nodes of the coordinator's ranks and the replica ring between them
    (rank of local index i on node k -> local index i mod size on the next node)."""
    node_of = [row[0] for row in coordinator.exchange([node_index()])]
    order = sorted(set(node_of))
    partner: list[int | None] = []
    for rank, node in enumerate(node_of):
        if len(order) == 1:
            partner.append(None)
            continue
        mine = [r for r, n in enumerate(node_of) if n == node]
        nxt = order[(order.index(node) + 1) % len(order)]
        theirs = [r for r, n in enumerate(node_of) if n == nxt]
        partner.append(theirs[mine.index(rank) % len(theirs)])
    return Nodes(node_of, partner)


# ------------------------------------------------------------------------ bundles
def pack(files: list[tuple[str, bytes]]) -> bytearray:
    """Files as one byte string: a JSON header ``[[path, nbytes], ...]`` then the bytes
    (one copy: a bytearray the transfer sends without copying again)."""
    header = json.dumps([[p, len(d)] for p, d in files]).encode()
    out = bytearray(8 + len(header) + sum(len(d) for _, d in files))
    view = memoryview(out)
    view[:8] = struct.pack("<Q", len(header))
    pos = 8 + len(header)
    view[8:pos] = header
    for _, data in files:
        view[pos : pos + len(data)] = data
        pos += len(data)
    return out


def unpack(data: bytes | memoryview, where: str) -> list[tuple[str, memoryview]]:
    """The files of :func:`pack`; sizes and paths checked (nothing else is trusted)."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise CheckpointError(f"{where}: a bundle of {len(view)} bytes")
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > min(len(view) - 8, 256 * 1024 * 1024):
        raise CheckpointError(f"{where}: header length {hlen} out of range")
    try:
        header = json.loads(bytes(view[8 : 8 + hlen]))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: header is not JSON: {exc}") from exc
    if not isinstance(header, list) or len(header) > _MAX_FILES:
        raise CheckpointError(f"{where}: header is not a list of files")
    out, pos = [], 8 + hlen
    for entry in header:
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], int)
        if not ok or entry[1] < 0 or pos + entry[1] > len(view):
            raise CheckpointError(f"{where}: bad file entry {str(entry)[:200]}")
        path = fmt.validate_name(entry[0], what=f"{where}: path", allow_meta=True)
        out.append((path, view[pos : pos + entry[1]]))
        pos += entry[1]
    if pos != len(view):
        raise CheckpointError(f"{where}: {len(view) - pos} bytes after the last file")
    return out


def side_group(coordinator: Coordinator) -> Coordinator | None:
    """Collective over the whole world: a coordinator of a new gloo group of the same ranks,
    for the control traffic and transfers of a save running on a background thread (a
    thread must not share a process group with the training thread's collectives). None
    where that cannot be made alike on every process: a subgroup (tensor parallelism),
    or no process group at all (then nothing needs one)."""
    if not collectives.is_initialized() or coordinator.group is not None:
        return None
    group = collectives.new_gloo_group()
    return replace(
        coordinator.over(group, coordinator.rank, coordinator.world_size),
        device=torch.device("cpu"),
    )


def _tensor(data: bytes | bytearray, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    buffer = data if isinstance(data, bytearray) else bytearray(data)  # frombuffer: writable
    return torch.frombuffer(buffer, dtype=torch.uint8).to(device)


def exchange_pairs(
    coordinator: Coordinator, sends: dict[int, bytes | bytearray], recvs: list[int]
) -> dict[int, memoryview]:
    """Collective: send ``sends[dst]`` to each ``dst`` and receive from each rank in
    ``recvs``, all at once (sizes travel first in one all-gather of every rank's send
    sizes to every rank)."""
    world, group, device = coordinator.world_size, coordinator.group, coordinator.device
    sizes_row = [len(sends.get(r, b"")) for r in range(world)]
    table = coordinator.exchange(sizes_row)  # table[src][dst]
    inbox, receives, outgoing = {}, [], []
    for src in recvs:
        buf = torch.empty(table[src][coordinator.rank], dtype=torch.uint8, device=device)
        inbox[src] = buf
        if buf.numel():
            receives.append((buf, src))
    for dst, data in sends.items():
        if data:
            outgoing.append((_tensor(data, device), dst))
    collectives.send_and_receive(outgoing, receives, group=group)
    # Views of the received tensors: no copy (they live as long as the views).
    return {src: memoryview(buf.cpu().numpy()).cast("B") for src, buf in inbox.items()}


def broadcast_bytes(coordinator: Coordinator, data: bytes | None, src: int) -> bytes:
    """Collective: rank ``src``'s bytes on every rank."""
    if coordinator.world_size == 1:
        return data or b""
    size = coordinator.exchange([len(data) if data is not None else 0])[src][0]
    group, device = coordinator.group, coordinator.device
    buf = _tensor(data, device) if coordinator.rank == src and data else None
    if buf is None:
        buf = torch.empty(size, dtype=torch.uint8, device=device)
    if size:
        collectives.broadcast_from(buf, src, group=group)
    return bytes(buf.cpu().numpy().tobytes())
