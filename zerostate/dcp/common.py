"""What the DCP writer and reader share: piece names, the global plan, checks of what is read
([Note: DCP steps] in zerostate.dcp)."""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import re
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from zerostate.errors import (
    ConfigError,
    CorruptCheckpointError,
)
from zerostate.layout.partition import TensorLayout
from zerostate.store import format as fmt
from zerostate.store.writer import TensorSpec

#: The state group holding every piece of a DCP step.
GROUP = "dcp"
#: Key of the DCP document in the commit record's ``attrs``, and its version.
ATTR = "dcp"
DCP_VERSION = 1
#: At most this many dimensions in a tensor (as the store's shapes).
MAX_DIMS = 64
#: Bytes of pieces one read batch holds in memory at once ([Note: read batches]).
READ_BATCH_NBYTES = 32 << 20
# [Note: read batches]
# The reader reads a batch of the plan's boxes into scratch memory (every chunk checksummed)
# and copies each box into its target before the next batch: the scratch is what the load
# costs in memory beyond the targets, and it is new memory for every batch. With batches of
# 256 MiB a layout-changing load of the GPT-2 ``io`` FSDP2 state (281 MiB, 2 ranks, each
# rank reading every row: columns from rows) took 0.41-0.71 s; with 64, 32, 16 and 8 MiB
# 0.31-0.39 s, whether the rows were in the page cache or not (two runs, 4 loads each per
# size): freed scratch comes back as memory already in use rather than as fresh pages, which
# on this project's virtual machine cost more than the reads. DCP's ``FileSystemReader``
# took 0.36-0.60 s on its own files in the same runs. A row's adjacent chunks are still read
# in one request per batch (a 147 MB row: five instead of one).
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class GcHold:
    """Keeps the cyclic garbage collector off the objects that existed when a save or a load
    began, until it ends ([Note: the heap held out of collections]). One per writer or
    reader; :meth:`hold` and :meth:`release` may be called any number of times.

    [Note: the heap held out of collections]
    A save through ``dcp.save`` makes many short-lived objects (DCP's write items and plans,
    pickled for its collectives, our pieces), and they trigger collections of the oldest
    generation, which walk the whole heap of the training process: the model's modules, its
    DTensors, torch's own objects. In the DCP report (2 ranks, the GPT-2 ``io`` FSDP2 state)
    3 of 8 saves in a row had one such collection on a rank, of 0.16-0.21 s, on a save of
    0.36-0.4 s otherwise, and the other rank waited for it in the next collective; with the
    heap held, 8 saves of 8 took 0.36-0.39 s. From our first hook after DCP's local planning
    (``prepare_local_plan``, so that a state DCP refuses there holds nothing) until the last
    (``finish`` on the coordinator, ``write_data`` elsewhere; ``read_data``) the objects
    that already existed are frozen (``gc.freeze``): collections still run and free the
    save's own garbage, but do not walk the rest. ``gc.unfreeze`` puts them back when the
    last hold in the process ends. Nothing is done when the collector is off or the process
    froze objects itself (a forking server's ``gc.freeze``: its frozen objects stay so).
    Our own failures release at once. A save or load that fails between two of our hooks
    (another rank's failure, raised in DCP's collective) leaves its hold until the writer's
    or reader's next ``reset`` (DCP calls it at the start of each save or load) or
    ``close``, or until the next hold or release in the process once that writer or reader
    is gone: meanwhile cycles among the frozen objects are not collected, nothing else
    changes."""

    _lock = threading.Lock()
    _holders: weakref.WeakSet[GcHold] = weakref.WeakSet()
    _froze = False

    def hold(self) -> None:
        with GcHold._lock:
            if not GcHold._holders:
                GcHold._froze = gc.isenabled() and gc.get_freeze_count() == 0
                if GcHold._froze:
                    gc.freeze()
            GcHold._holders.add(self)

    def release(self) -> None:
        with GcHold._lock:
            GcHold._holders.discard(self)
            # Empty also once every holder that failed between hooks has been freed.
            if not GcHold._holders and GcHold._froze:
                GcHold._froze = False
                gc.unfreeze()


def piece_name(rank: int, seq: int, fqn: str) -> str:
    """A valid store name for piece ``seq`` of ``rank`` that still shows the FQN: the rank
    first, so each rank's pieces are adjacent in name (slot) order."""
    readable = _UNSAFE.sub("_", fqn)[:150]
    name = f"r{rank:05d}.{seq:07d}.{readable}"
    if name.endswith(".partial"):  # reserved for files being written
        name += "_"
    return f"{GROUP}/{name}"


@dataclasses.dataclass(frozen=True)
class Piece:
    name: str
    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    owner: int  # the store rank that writes it

    def spec(self, world_size: int) -> TensorSpec:
        """The stored tensor: the box, or a complex box's real pairs ([Note: complex
        chunks])."""
        sizes, dtype, attrs = stored_as(self.sizes, self.dtype)
        numel = math.prod(sizes)
        layout = TensorLayout(numel, world_size, max(1, numel), self.owner)
        return TensorSpec(self.name, sizes, dtype, layout, attrs=attrs)


# [Note: complex chunks]
# DCP saves complex tensors as it saves any other (a RoPE table such as torchtitan's
# persistent ``freqs_cis`` before 0.3, a model with complex parameters and the optimizer
# state that follows them). The store holds complex tensors as their real pairs ([Note:
# complex tensors] in zerostate.store.format), so a chunk of a complex tensor is stored as
# the float tensor ``torch.view_as_real(chunk)``: shape ``(*box, 2)``, float32 for complex64
# and float64 for complex128, with the attribute naming the complex dtype. The DCP document
# keeps the tensor's own dtype and boxes (DCP's metadata, unchanged); each box's piece is
# checked to be its real pairs. The bytes are the complex tensor's own (real and imaginary
# parts interleaved), so a load copies them back bit for bit, and every command that reads
# the store sees the real pairs and the attribute, as it sees the engine's complex buffers.


def document_dtype_name(dtype: torch.dtype) -> str:
    """The DCP document's name of a tensor's dtype: one the store holds, or a complex one
    ([Note: complex chunks]); any other raises ConfigError naming the store's dtypes."""
    if dtype in fmt.COMPLEX_DTYPES:
        return str(dtype).removeprefix("torch.")
    return fmt.dtype_name(dtype)


def document_dtype(name: Any) -> torch.dtype:
    """The dtype a DCP document names (read from storage: never trusted)."""
    if isinstance(name, str) and name in fmt.COMPLEX_BY_NAME:
        return fmt.COMPLEX_BY_NAME[name]
    return fmt.dtype_from_name(name)


def stored_as(
    sizes: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype, dict | None]:
    """``(sizes, dtype, attrs)`` of the stored piece of a box of ``sizes`` and ``dtype``:
    the box itself, or a complex box's real pairs and the attribute naming its dtype."""
    real = fmt.COMPLEX_DTYPES.get(dtype)
    if real is None:
        return tuple(sizes), dtype, None
    return (*sizes, 2), real, fmt.complex_attrs(dtype)


def stored_data(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a chunk as its piece stores them: the tensor, or a complex one's real
    pairs (the same memory where the tensor allows it)."""
    if tensor.dtype not in fmt.COMPLEX_DTYPES:
        return tensor
    return torch.view_as_real(tensor.resolve_conj())


@dataclasses.dataclass(frozen=True)
class _GlobalPlan:
    """What the coordinator decides for the whole save; each rank gets its part in its plan
    ([Note: row views] in zerostate.store.rows)."""

    step: int
    save_id: str
    world_size: int
    coordinator: int
    pieces: tuple[Piece, ...]
    """The receiving rank's own pieces; the coordinator keeps every piece."""
    views: dict | None = None
    """The row views that place the receiving rank's pieces (None: it has every piece)."""

    def store_rank(self, rank: int) -> int:
        """The store rank of a DCP rank: the coordinator is the store's rank 0 (it commits)."""
        return (rank - self.coordinator) % self.world_size


def _rank_of_caller(kwargs: dict) -> int:
    rank = kwargs.get("rank")
    if rank is None:
        # Imported here: the CLI reads DCP steps through this package and loads no
        # process-group code ([Note: the store is the ground floor] in zerostate.store).
        from zerostate.dist import collectives

        rank = collectives.group_info(None)[0] if collectives.is_initialized() else 0
    return int(rank)


def _root_text(root: Any) -> str:
    if isinstance(root, (str, os.PathLike)):
        text = os.fspath(root)
        if isinstance(text, str) and text:
            return text
    raise ConfigError(f"a checkpoint root must be a path or URL, got {root!r}")


def _check_step(step: Any) -> int | None:
    if step is None:
        return None
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= fmt.MAX_STEP:
        raise ConfigError(f"step must be an int in [0, {fmt.MAX_STEP}] or None, got {step!r}")
    return step


def check_has_data(tensor: torch.Tensor, fqn: str) -> None:
    """Refuse a tensor on the meta device (a model built there and never materialised) in
    one line naming it, before anything of the save is written."""
    if tensor.is_meta:
        raise ConfigError(
            f"{fqn}: a tensor on the meta device holds no data to save; materialise the "
            "model first (to_empty(), then initialise or load its weights)"
        )


def plain_data(tensor: torch.Tensor, fqn: str) -> torch.Tensor:
    """A chunk's values as a plain tensor.

    [Note: tensor subclasses]
    A tensor subclass reaches a save as a chunk's data. One over its own storage that keeps
    torch's kernels (a tag class; a Parameter subclass such as bitsandbytes' packed weights)
    is its bytes, and is stored as they are. Of the others, two kinds occur. A wrapper around its
    values: torchao's float8 training keeps each weight as a ``WeightWithDynamicFloat8CastTensor``
    (FSDP2's DTensors hold them as their local tensors under torchtitan's ``float8``
    converter), a wrapper with no storage of its own whose inner ``_tensor`` holds the values.
    And a different stored form: quantized state (torchao's 8- and 4-bit optimizer states,
    NF4 or affine-quantized weights) holds codes and scales, and its values are computed.
    DCP's ``FileSystemWriter`` pickles either; the store holds values, never pickles. So a
    subclass is stored as its values (copied through its own ``copy_``, as a load copies
    back into it) only where one of its inner tensors (``__tensor_flatten__``) is exactly
    those values, bit for bit: then storing and loading them changes nothing. Anything else
    is refused in one line naming it, before the save writes: converting quantized state to
    its values and back would not give the same codes (measured: torchao's ``AdamW8bit``
    and ``AdamW4bit`` moments came back with other codes), a change no load would report."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor
    if type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        # A subclass over its own storage, with torch's kernels (a tag class, a Parameter
        # subclass such as bitsandbytes' packed weights): its bytes are its values.
        return tensor.as_subclass(torch.Tensor)
    kind = type(tensor).__name__
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    try:
        with torch.no_grad():
            out.copy_(tensor)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(
            f"{fqn}: a {kind} cannot be copied into a plain {tensor.dtype} tensor to be stored "
            f"({reason})"
        ) from exc
    if not _holds_its_values(tensor, out):
        raise ConfigError(
            f"{fqn}: a {kind} is a tensor subclass whose stored form is not its values "
            "(quantized state, such as torchao's low-bit optimizer states or NF4 weights, "
            "would not load back the same); zerostate stores values, never pickles: save "
            "plain tensors for it (its dequantized values, or the state it is built from)"
        )
    return out


def _holds_its_values(tensor: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether one of ``tensor``'s inner tensors is ``values`` bit for bit ([Note: tensor
    subclasses])."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if not callable(flatten):
        return False
    names = flatten()[0]
    want = values.reshape(-1).view(torch.uint8)
    for name in names if isinstance(names, list | tuple) else ():
        inner = getattr(tensor, name, None) if isinstance(name, str) else None
        if (
            type(inner) in (torch.Tensor, torch.nn.Parameter)
            and inner.dtype == values.dtype
            and tuple(inner.shape) == tuple(values.shape)
            and torch.equal(inner.detach().to("cpu").reshape(-1).view(torch.uint8), want)
        ):
            return True
    return False


#: Longest state key a DCP step holds: a save refuses a longer one, a read calls it damaged.
MAX_KEY_CHARS = 4096


def check_save_key(fqn: Any) -> None:
    """Refuse at save, in one line, a key the reader would refuse (so no step is committed
    that cannot be loaded): keys are non-empty strings of at most MAX_KEY_CHARS."""
    if not isinstance(fqn, str) or not fqn or len(fqn) > MAX_KEY_CHARS:
        shown = (
            repr(fqn[:80]) + ("..." if len(fqn) > 80 else "") if isinstance(fqn, str) else repr(fqn)
        )
        raise ConfigError(
            f"state key {shown} ({len(fqn) if isinstance(fqn, str) else '-'} characters) cannot "
            f"be stored: keys are non-empty strings of at most {MAX_KEY_CHARS} characters"
        )


def _check_fqn(fqn: Any, where: str) -> None:
    if not isinstance(fqn, str) or not fqn or len(fqn) > MAX_KEY_CHARS:
        raise CorruptCheckpointError(f"{where}: key {str(fqn)[:80]!r} is not a valid state key")


def _ints(value: Any, what: str, max_len: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > max_len:
        raise CorruptCheckpointError(f"{what} is not a list of at most {max_len} integers")
    out = []
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 62:
            raise CorruptCheckpointError(f"{what}: {v!r} is not a non-negative integer")
        out.append(v)
    return tuple(out)


def _planner_data(data: Any, where: str) -> dict[str, tuple]:
    """DCP's default planners keep ``{flat key: path}`` with paths of strings and ints."""
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{where}: planner data is not a mapping")
    out = {}
    for key, path in data.items():
        ok = isinstance(key, str) and isinstance(path, (list, tuple))
        if not ok or not all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path):
            raise CorruptCheckpointError(
                f"{where}: planner data entry {str(key)[:80]!r} is malformed"
            )
        out[key] = tuple(path)
    return out


def check_boxes(
    shape: tuple[int, ...], boxes: Iterable[tuple[tuple[int, ...], tuple[int, ...]]], what: str
) -> None:
    """Boxes ``(offsets, sizes)`` lie inside ``shape`` (checked by the caller), do not
    overlap and together cover it: else CorruptCheckpointError naming ``what``.

    Disjointness by a sweep along the dimension where offsets vary most: each box is
    compared only with the boxes whose extent on that dimension it meets, which for the
    grid-like layouts DCP plans is a handful, not all of them."""
    solid = [(o, s) for o, s in boxes if all(s)]
    numel = math.prod(shape)
    covered = sum(math.prod(s) for _, s in solid)
    if not shape:
        if len(solid) != 1:
            raise CorruptCheckpointError(f"{what}: a scalar needs one chunk, found {len(solid)}")
        return
    dim = max(range(len(shape)), key=lambda d: len({o[d] for o, _ in solid}))
    solid.sort(key=lambda box: box[0][dim])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for off, size in solid:
        start = off[dim]
        active = [b for b in active if b[0][dim] + b[1][dim] > start]
        for o2, s2 in active:
            if all(
                a < b2 + n2 and b2 < a + n for a, n, b2, n2 in zip(off, size, o2, s2, strict=True)
            ):
                raise CorruptCheckpointError(
                    f"{what}: chunks at {list(o2)} (sizes {list(s2)}) and {list(off)} (sizes "
                    f"{list(size)}) overlap"
                )
        active.append((off, size))
    if covered != numel:
        raise CorruptCheckpointError(
            f"{what}: chunks cover {covered} of the tensor's {numel} elements (shape "
            f"{list(shape)}); the step is damaged or incomplete"
        )
