"""FSDP2 state through torch's checkpoint API: zerostate's storage plug-in
(``zerostate.dcp.StorageWriter`` / ``StorageReader``) against DCP's ``FileSystemWriter`` /
``FileSystemReader`` and against torch-checkpointing's ``CheckpointManager`` (when installed:
the ``bench`` extra), same state, same disk, interleaved in one run.

    torchrun --nproc-per-node 2 -m benchmarks.dcp_plugin --dir /tmp/bench --rounds 3

Per round, in alternating order:
- a blocking save with each (seconds from a common start until the slowest rank returns),
  each started after an ``os.sync()``: no contender's dirty pages (torch-checkpointing does
  not fsync) are left for the next one's fsyncs to wait on.
  Ours and DCP's fsync every file; torch-checkpointing's buffered writes are not fsynced
  (its O_DIRECT mode fails here on a file's unaligned tail), so its time excludes the disk;
  ``torch_checkpointing_fsynced`` is the same save followed by an fsync of every file and
  directory it wrote: the time until its bytes are as durable as ours;
- an ``async_save`` with each (seconds the call blocks the training loop). Each contender
  keeps one saver across rounds, as a training loop does: ours is its own stager (buffers
  reused once the previous save is done with them), DCP's default stager copies into new
  memory each time, and, where an accelerator is present (it pins memory), DCP's
  ``cache_staged_state_dict=True`` writer (reused buffers, no check that the previous save
  finished) is measured too. torch-checkpointing's async
  manager stages in the background; its blocked time is its ``save`` call;
- a layout-changing load: the state the FSDP2 ranks saved (rows split over ranks) read into
  targets split by columns (``Shard(1)``; 1-D tensors replicated), so every rank needs a part
  of every saved chunk: our reader on our step vs ``FileSystemReader`` on DCP's. Twice: as
  the save left the files (``layout_changing_load_s``: DCP's were written through the page
  cache and are read from memory, ours past it by default and are read from the disk), and
  cold (``cold_layout_changing_load_s``: every contender's files dropped from the page cache
  first, as for a job restarted on another node), with the MiB each cold load had read from
  the disk, all ranks together (``cold_load_read_MiB``, from ``/proc/self/io``).
Bounds are timed in the same rounds, as references, not contenders ([Note: the benchmark's
bounds]): ``disk_bound``, each rank's bytes written to one file through the page cache and
fsynced; ``direct_bound``, the same with ``O_DIRECT`` from one aligned buffer (no plan, no
metadata, no checksum: the least time a writer that makes the same bytes durable on this
disk needs, by either road); ``no_read_floor``, ``dcp.load`` through a
``FileSystemReader`` whose ``read_data`` reads nothing (DCP's metadata read, planning and
collectives: what every reader pays through ``dcp.load`` before its first byte); and
``read_bound``, each rank's ``direct_bound`` file read back cold in 8 MiB pieces (every byte
of the state read from the disk once: what any layout-changing reader needs at least, since
each rank needs a part of every saved row).
Rank 0 prints one JSON object: every round's times, the medians, the ratios (save throughput
ours over each peer's, blocked time and load time ours over DCP's) and the objects per step.
The GPT-2 ``io`` preset (~26M parameters: fp32 weights and both AdamW moments); ``--device
cuda`` keeps the state on the GPU (``benchmarks/gpu.sh``'s row: staging copies it to host).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _state(preset: str, device: torch.device) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from benchmarks.common import MODELS
    from benchmarks.contenders import batches, build_model, fully_shard_model

    model = build_model(preset, device)
    fully_shard_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seq = min(64, MODELS[preset]["n_positions"])
    batch = batches(preset, dist.get_rank(), 2, seq, 1, device)[0]
    model(batch[:, :-1], batch[:, 1:]).backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _nbytes(state: dict) -> int:
    total = 0
    for value in _tensors(state):
        local = value.to_local() if hasattr(value, "to_local") else value
        total += local.numel() * local.element_size()
    return total


def _by_columns(value):
    """A target of ``value``'s structure whose DTensors are split by columns (``Shard(1)``,
    1-D ones replicated), zero-filled."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor import zeros as dzeros

    if isinstance(value, dict):
        return {k: _by_columns(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_by_columns(v) for v in value]
    if isinstance(value, DTensor):
        placement = Shard(1) if value.dim() >= 2 else Replicate()
        return dzeros(value.shape, dtype=value.dtype, device_mesh=value.device_mesh,
                      placements=[placement])  # fmt: skip
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    return value


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _count_files(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and every directory (what this rank can see; ranks
    share the disk, so each syncs all, and the slowest rank's time counts)."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(dirpath, name))
        _fsync(dirpath)


def _disk_bound(state: dict, path: Path) -> None:
    """Each rank's local tensor bytes, back to back, in one file of its own, then fsynced
    with their directory ([Note: the benchmark's bounds]).

    [Note: the benchmark's bounds]
    A ratio against a peer says nothing of how far either is from what the machine allows,
    so the report times bounds in the same rounds. ``disk_bound`` is the durable write
    through the page cache with nothing else, ``direct_bound`` the same with ``O_DIRECT``
    from one aligned buffer. On this project's 2-core virtual machine (ext4 on virtio) a
    write through the page cache first takes pages from free memory, which costs more than
    the disk when the guest has not used that memory before, and which it is varies from
    round to round and run to run: ``disk_bound`` took 0.2-0.97 s for the GPT-2 ``io`` state
    at 2 ranks in one 5-round run, ``direct_bound`` 0.18-0.24 s. Our writer writes large
    rows past the page cache by default ([Note: direct writes] in zerostate/store/local.py),
    so it pays the direct road's cost plus its plan, checksums and commit; DCP's
    ``FileSystemWriter`` and torch-checkpointing pay the page cache's. The same holds for
    reads: a load right after the save reads DCP's files from memory and ours from the
    disk, so the report also times a cold load, every contender's files dropped from the
    page cache first. A cold layout-changing load needs every byte of the state from the
    disk at least once (each rank needs a part of every saved row; ranks reading the same
    file share its pages, so each byte comes from the disk once): ``read_bound`` times that
    read alone, and ``cold_load_read_MiB`` says how much each cold load did read.
    ``cold_load_ratio_floor_over_dcp`` adds the medians of ``no_read_floor`` and
    ``read_bound`` over DCP's cold load: the least share of it such a reader could take
    here (an estimate: the two are timed apart). In two runs on 2026-12-07 (``io``, 2 ranks,
    3 rounds) it was 0.275 and 0.332, with our cold load at 0.337 and 0.457 of DCP's: each
    load, ours and DCP's, read the 282 MiB from the disk once. It is a guide, not a proof:
    in a third run (5 rounds) the bare reads were slower (0.28-0.49 s) and the figure 0.68,
    while our reader took 0.646 of DCP's cold load. Starting each rank's reads at a
    different place in its boxes, so that the ranks fetch different stretches at once, made
    our cold load slower in another run (0.46-0.51 s against 0.37-0.44 s), and is not done.
    ``no_read_floor`` is ``dcp.load`` with nothing read: DCP's own metadata read, planning
    and collectives, which any ``StorageReader`` pays as well. Its median was 0.28-0.61 of
    ``FileSystemReader``'s whole layout-changing load in three runs on 2026-12-06 and 0.12
    in a run on 2026-12-07 (single rounds 0.06-0.08 s against 0.07-0.26 s): the floor
    moves with the state of the machine as much as the loads do."""
    path.mkdir(parents=True, exist_ok=True)
    views = _byte_views(state)
    fd = os.open(path / f"rank{dist.get_rank()}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for view in views:
            while view.nbytes:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync(path)


def _direct_bound(state: dict, path: Path) -> None:
    """Each rank's local tensor bytes copied block by block into one aligned buffer and
    written with ``O_DIRECT`` (the tail padded, the file cut back), then fsynced with their
    directory ([Note: the benchmark's bounds]). Falls back to the page cache where the
    filesystem refuses direct I/O."""
    import mmap

    block, size = mmap.mmap(-1, 4 << 20), 4 << 20
    view = memoryview(block)
    path.mkdir(parents=True, exist_ok=True)
    name = path / f"rank{dist.get_rank()}.bin"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    except OSError:
        return _disk_bound(state, path)
    try:
        fill = offset = 0
        for src in _byte_views(state):
            while src.nbytes:
                take = min(src.nbytes, size - fill)
                view[fill : fill + take] = src[:take]
                fill, src = fill + take, src[take:]
                if fill == size:
                    os.pwrite(fd, view, offset)
                    offset, fill = offset + size, 0
        if fill:
            padded = -(-fill // 4096) * 4096
            view[fill:padded] = bytes(padded - fill)
            os.pwrite(fd, view[:padded], offset)
            os.ftruncate(fd, offset + fill)
        os.fsync(fd)
    finally:
        os.close(fd)
        view.release()
        block.close()
    _fsync(path)


def _evict(path: Path) -> None:
    """Drop every file under ``path`` from the page cache (they are fsynced: clean pages go),
    so that a load reads them from the disk."""
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _read_bound(path: Path) -> None:
    """This rank's file of the round's ``direct_bound`` save read back in 8 MiB pieces, four
    at a time (one at a time took about twice as long on this disk: 0.46-0.55 s for the
    ``io`` state at 2 ranks, against 0.19-0.28 s), into reused buffers: with every rank
    doing the same, every byte of the state is read once ([Note: the benchmark's bounds]);
    the caller drops the files from the page cache first."""
    from concurrent.futures import ThreadPoolExecutor

    piece, lanes = 8 << 20, 4
    fd = os.open(path / f"rank{dist.get_rank()}.bin", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        offsets = list(range(0, size, piece))
        bufs = [memoryview(bytearray(piece)) for _ in range(lanes)]

        def lane(k: int) -> None:
            for offset in offsets[k::lanes]:
                want = min(piece, size - offset)
                got = os.preadv(fd, [bufs[k][:want]], offset)
                if got != want:
                    raise OSError(f"{path}: read {got} of {want} bytes at {offset}")

        with ThreadPoolExecutor(lanes) as pool:
            list(pool.map(lane, range(lanes)))
    finally:
        os.close(fd)


def _storage_read_bytes() -> int | None:
    """Bytes this process has had read from storage (``/proc/self/io``'s ``read_bytes``:
    what the page cache did not hold), None where the kernel does not say."""
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _byte_views(state: dict) -> list[memoryview]:
    """Each of this rank's non-empty local tensors of ``state`` as a byte view (the bounds'
    bytes, in the state's order)."""
    views = []
    for value in _tensors(state):
        local = value.to_local() if hasattr(value, "to_local") else value
        if local.numel():
            data = local.detach().contiguous().cpu().view(-1).view(torch.uint8)
            views.append(memoryview(data.numpy()))
    return views


def _tensors(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, torch.Tensor):
        yield value


def _no_read_reader(path: str):
    """``FileSystemReader`` whose ``read_data`` reads nothing ([Note: the benchmark's
    bounds]): the targets stay as they were."""
    import torch.distributed.checkpoint as dcp
    from torch.futures import Future

    class NoRead(dcp.FileSystemReader):
        def read_data(self, plan, planner):
            done: Future = Future()
            done.set_result(None)
            return done

    return NoRead(path)


def _torch_checkpointing(sync: bool):
    try:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    except ImportError:
        return None
    config = CheckpointManager.Config.with_sync_save() if sync else CheckpointManager.Config()
    # Its O_DIRECT writes fail on a file's unaligned tail on this disk (EINVAL at close):
    # buffered writes, which it does not fsync.
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(config)


def main() -> None:
    import torch.distributed.checkpoint as dcp

    from zerostate.dcp import StorageReader, StorageWriter

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--preset", default="io")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cuda":  # the state on the GPU; DCP's collectives and ours on gloo
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Path(args.dir)
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
    dist.barrier()
    state = _state(args.preset, device)
    local = torch.tensor([_nbytes(state)], dtype=torch.int64)
    dist.all_reduce(local)
    total = int(local.item())
    # async_save's collectives run on a thread: their own group, so that they never
    # interleave with this thread's barriers on the default one (a hang).
    async_group = dist.new_group(backend="gloo")

    tc_sync, tc_async = _torch_checkpointing(True), _torch_checkpointing(False)
    ours_sync = StorageWriter(str(base / "ours"))  # one root, the step advances
    ours_async = StorageWriter(str(base / "ours-async"))
    dcp_cached = dcp.FileSystemWriter(str(base / "unused"), cache_staged_state_dict=True)

    def save(who: str, tag: str) -> None:
        if who == "ours":
            dcp.save(state, storage_writer=ours_sync)
        elif who == "dcp":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(base / f"dcp-{tag}")))
        elif who == "torch_checkpointing":
            tc_sync.save(str(base / f"tc-{tag}"), state)  # type: ignore[union-attr]
        elif who == "torch_checkpointing_fsynced":  # its files forced to disk as ours are
            tc_sync.save(str(base / f"tcd-{tag}"), state)  # type: ignore[union-attr]
            _fsync_tree(base / f"tcd-{tag}")
        elif who == "direct_bound":
            _direct_bound(state, base / f"direct-{tag}")
        else:
            _disk_bound(state, base / f"disk-{tag}")

    def start_async(who: str, tag: str):
        if who == "ours":
            return dcp.async_save(state, storage_writer=ours_async, process_group=async_group)
        if who == "dcp":
            writer = dcp.FileSystemWriter(str(base / f"dcpa-{tag}"))
            return dcp.async_save(state, storage_writer=writer, process_group=async_group)
        if who == "dcp_cached":
            return dcp.async_save(
                state, storage_writer=dcp_cached, checkpoint_id=str(base / f"dcpc-{tag}"),
                process_group=async_group,
            )  # fmt: skip
        return tc_async.save(str(base / f"tca-{tag}"), state)  # type: ignore[union-attr]

    savers = ["ours", "dcp"]
    savers += ["torch_checkpointing", "torch_checkpointing_fsynced"] if tc_sync else []
    savers += ["disk_bound", "direct_bound"]
    # DCP's caching stager pins its buffers: it needs an accelerator.
    async_savers = ["ours", "dcp"] + (["dcp_cached"] if torch.cuda.is_available() else [])
    async_savers += ["torch_checkpointing"] if tc_async is not None else []
    save_s: dict[str, list[float]] = {k: [] for k in savers}
    blocked: dict[str, list[float]] = {k: [] for k in async_savers}
    loaders = ["ours", "dcp", "no_read_floor"]
    load_s: dict[str, list[float]] = {k: [] for k in loaders}
    cold_loaders = ["ours", "dcp", "read_bound"]
    cold_s: dict[str, list[float]] = {k: [] for k in cold_loaders}
    # MiB the kernel read from storage during each cold load, all ranks together (None
    # where /proc/self/io is missing)
    cold_read: dict[str, list[float | None]] = {k: [] for k in cold_loaders}
    for r in range(args.rounds):
        flip = r % 2 == 1
        for who in reversed(savers) if flip else savers:
            os.sync()  # no contender's dirty pages left for the next one's fsyncs to wait on
            save_s[who].append(_timed(lambda w=who, t=str(r): save(w, t)))
        for who in reversed(async_savers) if flip else async_savers:
            future = None

            def start(w=who, t=str(r)) -> None:
                nonlocal future
                future = start_async(w, t)

            blocked[who].append(_timed(start))
            if future is not None:
                future.result()
            dist.barrier()
        for who in reversed(loaders) if flip else loaders:
            target = _by_columns(state)
            if who == "ours":
                reader = StorageReader(str(base / "ours"), step=r)
            elif who == "dcp":
                reader = dcp.FileSystemReader(str(base / f"dcp-{r}"))
            else:
                reader = _no_read_reader(str(base / f"dcp-{r}"))
            load_s[who].append(_timed(lambda t=target, rd=reader: dcp.load(t, storage_reader=rd)))
        for who in reversed(cold_loaders) if flip else cold_loaders:
            target = _by_columns(state)
            where = {"ours": base / "ours", "dcp": base / f"dcp-{r}"}.get(who, base / f"direct-{r}")
            _evict(where)
            before = _storage_read_bytes()
            if who == "read_bound":
                cold_s[who].append(_timed(lambda w=where: _read_bound(w)))
            else:
                reader = (
                    StorageReader(str(where), step=r)
                    if who == "ours"
                    else dcp.FileSystemReader(str(where))
                )
                cold_s[who].append(
                    _timed(lambda t=target, rd=reader: dcp.load(t, storage_reader=rd))
                )
            after = _storage_read_bytes()
            known = before is not None and after is not None
            # [bytes read, ranks that cannot say]: summed over ranks in one collective
            read = torch.tensor([after - before if known else 0, 0 if known else 1])  # type: ignore[operator]
            dist.all_reduce(read)
            cold_read[who].append(None if read[1] else round(int(read[0]) / 2**20, 1))
        if rank == 0:  # as it goes: a run cut short still shows its rounds
            last = {
                name: {k: round(v[-1], 3) for k, v in times.items()}
                for name, times in (
                    ("save", save_s),
                    ("blocked", blocked),
                    ("load", load_s),
                    ("cold", cold_s),
                )
            }
            print(f"round {r}: {last}", flush=True)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in save_s.items()}
        med_blocked = {k: statistics.median(v) for k, v in blocked.items()}
        med_load = {k: statistics.median(v) for k, v in load_s.items()}
        med_cold = {k: statistics.median(v) for k, v in cold_s.items()}
        mib = total / 2**20
        step0 = base / "ours" / "steps"
        print(
            json.dumps(
                {
                    "world_size": world,
                    "device": str(device),
                    "state_MiB": round(mib, 1),
                    "save_s": save_s,
                    "async_blocked_s": blocked,
                    "layout_changing_load_s": load_s,
                    "cold_layout_changing_load_s": cold_s,
                    "cold_load_read_MiB": cold_read,
                    "save_MiB_per_s": {k: round(mib / v, 1) for k, v in med.items()},
                    "throughput_ratio_ours_over": {
                        k: round(v / med["ours"], 3)
                        for k, v in med.items()
                        if k not in ("ours", "disk_bound", "direct_bound")
                    },
                    "blocked_ratio_ours_over": {
                        k: round(med_blocked["ours"] / v, 3)
                        for k, v in med_blocked.items()
                        if k != "ours" and v > 0
                    },
                    "load_ratio_ours_over_dcp": round(med_load["ours"] / med_load["dcp"], 3),
                    "cold_load_ratio_ours_over_dcp": round(med_cold["ours"] / med_cold["dcp"], 3),
                    # [Note: the benchmark's bounds]: the most a durable writer could gain
                    # over DCP's here, and the least share of DCP's load any reader could take
                    "bounds": {
                        "throughput_ratio_disk_bound_over_dcp": round(
                            med["dcp"] / med["disk_bound"], 3
                        ),
                        "throughput_ratio_disk_bound_over_ours": round(
                            med["ours"] / med["disk_bound"], 3
                        ),
                        "throughput_ratio_direct_bound_over_dcp": round(
                            med["dcp"] / med["direct_bound"], 3
                        ),
                        "throughput_ratio_direct_bound_over_ours": round(
                            med["ours"] / med["direct_bound"], 3
                        ),
                        "load_ratio_no_read_floor_over_dcp": round(
                            med_load["no_read_floor"] / med_load["dcp"], 3
                        ),
                        # DCP's planning and every byte read once, cold: the least share
                        # of DCP's cold load a reader that needs every byte could take
                        "cold_load_ratio_floor_over_dcp": round(
                            (med_load["no_read_floor"] + med_cold["read_bound"]) / med_cold["dcp"],
                            3,
                        ),
                    },
                    "objects_per_step": {
                        "ours": _count_files(base / "ours") // max(1, args.rounds),
                        "dcp": _count_files(base / "dcp-0"),
                        "limit": 4 * world + 64,
                    },
                    "ours_steps_dir": str(step0),
                },
                indent=1,
            )
        )
    dist.barrier()
    for manager in (tc_sync, tc_async):
        if manager is not None:
            manager.close()
    ours_async.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
