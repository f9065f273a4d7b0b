"""Collectives between the ranks of one host through shared memory.

[Note: shared-memory transport]
gloo moves a collective between processes of one host over loopback TCP: every byte is
copied into a socket, through the kernel and out again, on the CPUs that also compute the
step. When every rank of a gloo group runs on the same host, the large collectives of
training (the gradient all-reduce of stage 0, the reduce-scatter and all-gather of stages
1-3, see :mod:`zerostate.dist.comm`) go through shared memory instead: each rank maps one
segment of its own in ``/dev/shm`` and maps every other rank's, so a collective is a few
memory copies and one or two barriers. Measured on 2 shared cores, a 3.3M-element fp32
all-reduce (GPT-2 small's gradients): 2 ranks 14.0 ms with gloo, 7.2 ms here; 4 ranks
31-36 ms, 14-16 ms (medians of 15). Whole training steps, interleaved with the same
engine on gloo (``benchmarks/shm_ab.py``): docs/benchmarks/profile.md.

- *Who uses it.* :mod:`zerostate.dist.collectives` decides per call, from what every rank
  of the call has in common (the group, the tensor's device, dtype and size), so all ranks
  take the same path: CPU tensors of at least :data:`MIN_ELEMENTS` elements on a gloo group
  whose ranks proved, at the group's first such call, that they see each other's segments
  (each writes a random token into its own and reads every other's back). Anything else,
  and every group once ``ZEROSTATE_SHM=0`` is set, goes to gloo as before.
- *The algorithms.* All-reduce: each rank copies its tensor into its segment; barrier;
  rank ``r`` sums slice ``r`` of every segment into its own segment's slice ``r``;
  barrier; every rank copies every rank's summed slice out. Each element of the result is
  summed by exactly one rank, in one order, so every rank gets the same bits (replicated
  parameters stay identical). Reduce-scatter: copy in, barrier, rank ``r`` sums segment
  ``r`` of every rank's input straight into its output. All-gather: copy in, barrier,
  copy every rank's piece out.
- *Why two buffers.* Each segment holds two buffers used in turn. Collective ``k`` reads
  the others' buffer ``k % 2`` after its barrier; a rank writes that buffer again only in
  collective ``k + 2``, after collective ``k + 1``'s barrier, which no rank passes before
  it finished reading collective ``k``. So one barrier per collective suffices (two for an
  all-reduce), and none at the end.
- *Barriers* are the group's own ``barrier``: ordered with the
  group's other collectives, bounded by its timeout, and a rank that died fails the others
  as a gloo collective would. The copies and sums run on the calling thread, so a
  collective is finished when the call returns.
- *Memory.* Segments grow to the largest collective seen (twice that, for the two
  buffers), rounded up to a whole MiB; growing is collective and all-or-nothing: each
  rank reserves its new segment with ``posix_fallocate`` (a full ``/dev/shm`` is an error
  here, never a SIGBUS mid-copy), every rank learns whether all succeeded, and on any
  failure the group goes back to gloo for good. Files are unlinked as soon as every rank
  has mapped them, so nothing outlives the processes, even killed ones.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable

import torch

#: Smaller collectives stay on gloo: two barriers cost more than they would save.
MIN_ELEMENTS = 1 << 16

#: Environment switch: ``0`` keeps every collective on gloo.
ENV = "ZEROSTATE_SHM"

DIRECTORY = "/dev/shm"

#: Element types summed here (what training communicates); others stay on gloo.
DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32}
)

_MAGIC = 0x7A73_686D  # "zshm"
_HEADER = 64  # bytes before the buffers: the magic and token, one cache line
_ALIGN = 64  # slice boundaries fall on cache lines (and on every element size)


def enabled() -> bool:
    """Whether the environment allows the transport (``ZEROSTATE_SHM`` unset or not 0)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def eligible(tensor: torch.Tensor) -> bool:
    """Whether a collective of ``tensor`` (its full size) may go through shared memory.
    Decided from what every rank of the call shares, never from one rank's state."""
    return (
        tensor.device.type == "cpu"
        and tensor.dtype in DTYPES
        and tensor.numel() >= MIN_ELEMENTS
        and not tensor.is_sparse
    )


def _bounds(n: int, world: int, itemsize: int) -> list[int]:
    """Slice boundaries of ``n`` elements over ``world`` ranks, on cache lines."""
    step = max(1, _ALIGN // itemsize)
    cuts = [min(n, (n * q // world) // step * step) for q in range(world)]
    return cuts + [n]


class Transport:
    """One gloo group's shared segments; see [Note: shared-memory transport].

    ``barrier()`` and ``all_ok(flag)`` are collectives on the group (the caller's, so
    they are ordered with its other collectives); ``token`` is the same on every rank.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        token: int,
        barrier: Callable[[], None],
        all_ok: Callable[[bool], bool],
    ) -> None:
        self.rank = rank
        self.world = world
        self.token = token
        self._barrier = barrier
        self._all_ok = all_ok
        self.capacity = 0  # bytes per buffer
        self.generation = 0
        self.segments: list[torch.Tensor] = []  # uint8, every rank's, this rank's included
        self.turn = 0
        self.broken = False

    # -- segments ------------------------------------------------------------------------
    def _path(self, rank: int) -> str:
        return os.path.join(DIRECTORY, f"zerostate-{self.token:016x}-{self.generation}-{rank}.shm")

    def reserve(self, nbytes: int) -> bool:
        """Make each buffer hold ``nbytes`` (collective when it must grow); False once the
        group cannot use shared memory (the caller then uses gloo)."""
        if self.broken:
            return False
        if nbytes <= self.capacity:
            return True
        capacity = -(-nbytes // (1 << 20)) << 20  # whole MiB: growth is rare (bucket sizes)
        self.generation += 1
        size = _HEADER + 2 * capacity
        mine = self._path(self.rank)
        ok = _create(mine, size, self.token, self.rank)
        if not self._all_ok(ok):  # nobody opened any file yet
            self._give_up(mine if ok else None)
            return False
        segments, ok = [], True
        try:
            for q in range(self.world):
                seg = torch.from_file(self._path(q), shared=True, size=size, dtype=torch.uint8)
                head = seg[:16].view(torch.int64).tolist()
                ok = ok and head == [_MAGIC + q, self.token]
                segments.append(seg)
        except (OSError, RuntimeError):
            ok = False
        agreed = self._all_ok(ok)  # every rank mapped every segment: files may go
        _unlink(mine)
        if not agreed:
            self._give_up(None)
            return False
        self.segments = segments
        self.capacity = capacity
        return True

    def nbytes(self) -> tuple[int, int]:
        """Bytes of this rank's segment and of the other ranks' segments mapped here."""
        sizes = [seg.numel() for seg in self.segments]
        own = sizes[self.rank] if sizes else 0
        return own, sum(sizes) - own

    def _give_up(self, path: str | None) -> None:
        if path is not None:
            _unlink(path)
        self.broken = True
        self.segments = []

    def _buffers(self, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Every rank's current buffer as ``numel`` elements of ``dtype``; flips the turn."""
        start = _HEADER + self.turn * self.capacity
        self.turn ^= 1
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return [seg[start : start + nbytes].view(dtype) for seg in self.segments]

    # -- collectives ---------------------------------------------------------------------
    @torch.no_grad()  # a buffer or a parameter's data, as gloo takes it
    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """``tensor`` summed (or maxed) over the group, in place."""
        n = tensor.numel()
        buffers = self._buffers(tensor.dtype, n)
        mine = buffers[self.rank]
        mine.view(tensor.shape).copy_(tensor)
        self._barrier()
        cuts = _bounds(n, self.world, tensor.element_size())
        a, b = cuts[self.rank], cuts[self.rank + 1]
        acc = mine[a:b]
        for q in range(self.world):
            if q != self.rank:
                if op == "sum":
                    acc.add_(buffers[q][a:b])
                else:
                    torch.maximum(acc, buffers[q][a:b], out=acc)
        self._barrier()
        flat = tensor.view(-1) if tensor.is_contiguous() else None
        for q in range(self.world):
            lo, hi = cuts[q], cuts[q + 1]
            if flat is not None:
                flat[lo:hi].copy_(buffers[q][lo:hi])
            elif q != self.rank:
                mine[lo:hi].copy_(buffers[q][lo:hi])  # nobody reads these slices now
        if flat is None:
            tensor.copy_(mine.view(tensor.shape))

    @torch.no_grad()  # a buffer or a parameter's data, as gloo takes it
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Sum ``input`` (``world`` equal segments) over the group into ``output``, this
        rank's segment."""
        n = input.numel()
        m = n // self.world
        buffers = self._buffers(input.dtype, n)
        buffers[self.rank].view(input.shape).copy_(input)
        self._barrier()
        lo, hi = self.rank * m, (self.rank + 1) * m
        out = output.view(-1) if output.is_contiguous() else torch.empty(m, dtype=output.dtype)
        torch.add(buffers[0][lo:hi], buffers[1][lo:hi], out=out)
        for q in range(2, self.world):
            out.add_(buffers[q][lo:hi])
        if out.data_ptr() != output.data_ptr() or not output.is_contiguous():
            output.copy_(out.view(output.shape))

    @torch.no_grad()  # a buffer or a parameter's data, as gloo takes it
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Every rank's ``input`` into ``output`` (``world`` segments), in rank order."""
        m = input.numel()
        buffers = self._buffers(input.dtype, m)
        buffers[self.rank].view(input.shape).copy_(input)
        self._barrier()
        flat = (
            output.view(-1)
            if output.is_contiguous()
            else torch.empty(output.numel(), dtype=output.dtype)
        )
        for q in range(self.world):
            piece = flat[q * m : (q + 1) * m]
            if q != self.rank or piece.data_ptr() != input.data_ptr():
                piece.copy_(buffers[q])
        if not output.is_contiguous():
            output.copy_(flat.view(output.shape))


def new_token() -> int:
    """A random segment-name token (rank 0's is everyone's)."""
    return secrets.randbits(62)


def _create(path: str, size: int, token: int, rank: int) -> bool:
    """This rank's segment, reserved in full and stamped; False when it cannot be."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, (_MAGIC + rank).to_bytes(8, "little") + token.to_bytes(8, "little"), 0)
    except OSError:
        os.close(fd)
        _unlink(path)
        return False
    os.close(fd)
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
