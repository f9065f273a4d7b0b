"""Checkpoint format at scale: format 1 (one object per chunk) vs format 2 (one row object
per state group and rank), from the planner alone and measured on storage.

    python benchmarks/bench_scale.py plan                   # Llama-7B/70B, 8..4096 ranks
    python benchmarks/bench_scale.py s3 [--model M] [--fraction F]  # one rank's share, S3
    python benchmarks/bench_scale.py disk --dir /tmp/x      # save throughput vs dd, local
    python benchmarks/bench_scale.py all --dir /tmp/x --out results.md

``plan`` prints, for AdamW state (fp32 master weights and both moments) of Llama shapes:
objects per committed step, bytes of metadata per rank (manifest) and in the commit
record, and the time one rank spends planning (layouts, row plan, its own row's chunk
index; and rank 0's check of every manifest against the plan at commit). Format 1
counts what the format-1 planner (``plan_layouts``, min_shard_numel 65536; its greedy
placement computed with numpy, same result) and writer produce: one object per chunk and
per array document, plus one RNG tensor per rank; format 2 counts rows, manifests (with
the RNG state as ``rank_state``) and documents. Format-2 metadata sizes are those of the
canonical JSON of the real documents (checksums filled in with placeholders of the same
width); format-1 sizes are estimated from the number of entries times their size.

``s3`` starts SeaweedFS (benchmarks/s3.py) and times writing one rank's share of Llama-7B
(or ``--model``) state at 1,024 ranks, as format-1 objects (one PUT per chunk and per array
document the rank owns, on 8 threads like the format-1 writer, plus its manifest) and as
format 2 (``StepWriter.write``: its three rows and its manifest), alternating, after an
untimed warm-up round; median and range of ``--repeat`` rounds, and the CPU time this
process (the client) and the server process used per write: on a shared 2-core machine
wall times swing with outside load, CPU time much less. ``--latency-ms`` adds rows where a
proxy process (tests/faults/_proxy.py) holds every request that long before passing it on,
as the round trip to a network object store does. ``--fraction`` keeps that share of the
tensors (object sizes and their mix unchanged).

``disk`` times a sync save of one rank's share (fsync, rename, directory fsync) in format
2, the format-1 object set written through the same storage layer, and ``dd bs=4M
conv=fsync`` copying the same bytes from the page cache, alternating, best of
``--repeat`` after a warm-up round.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import numpy as np
import torch

from zerostate.layout.partition import (
    DEFAULT_MIN_SHARD_NUMEL,
    TensorLayout,
    chunk_numel_for,
    even_layout,
    plan_layouts,
)
from zerostate.store import StepWriter, TensorSpec, format2
from zerostate.store import format as fmt
from zerostate.store.storage import open_storage

MIB = 1 << 20
RANKS = (8, 64, 256, 1024, 4096)
STATES = ("model", "optim/exp_avg", "optim/exp_avg_sq")
RNG_NBYTES = 5056  # torch.get_rng_state().numel() on CPU
SHAPES = {
    "Llama-7B": dict(vocab=32000, d=4096, layers=32, ffn=11008, kv=4096),
    "Llama-70B": dict(vocab=32000, d=8192, layers=80, ffn=28672, kv=1024),
}


def llama_params(vocab: int, d: int, layers: int, ffn: int, kv: int) -> dict[str, int]:
    """Parameter name -> numel of a Llama model (untied embeddings, GQA via ``kv``)."""
    out = {"embed_tokens.weight": vocab * d}
    for i in range(layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": d * d,
                p + "self_attn.k_proj.weight": kv * d,
                p + "self_attn.v_proj.weight": kv * d,
                p + "self_attn.o_proj.weight": d * d,
                p + "mlp.gate_proj.weight": ffn * d,
                p + "mlp.up_proj.weight": ffn * d,
                p + "mlp.down_proj.weight": d * ffn,
                p + "input_layernorm.weight": d,
                p + "post_attention_layernorm.weight": d,
            }
        )
    out.update({"norm.weight": d, "lm_head.weight": vocab * d})
    return out


def v2_specs(params: dict[str, int], world: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{state}/{name}", (n,), torch.float32, even_layout(n, world))
        for state in STATES
        for name, n in params.items()
    ]


# ------------------------------------------------------------------------------ plan
def plan_v2(params: dict[str, int], world: int) -> dict:
    t0 = time.perf_counter()
    specs = v2_specs(params, world)
    tensors_json, plans = format2.tensor_entries(specs, world)
    mine = {g: p.index_bytes(world // 2) for g, p in plans.items()}  # one rank's own rows
    planning_s = time.perf_counter() - t0
    assert mine
    # Rank 0's commit derives every rank's row size from the plan to check the manifests.
    t0 = time.perf_counter()
    written = sum(int((p.object_sizes() > 0).sum()) for p in plans.values())
    commit_check_s = time.perf_counter() - t0
    row = {"nbytes": 2**40, "index_crc32c": 2**31, "chunks_crc32c": 2**31}
    crc_file = {"nbytes": 100_000, "crc32c": 2**31}
    files = {"zarr.json": crc_file, **{f"{g}/zarr.json": crc_file for g in plans}}
    files.update({f"{g}/zarr.json": crc_file for g in fmt.group_paths(list(plans))})
    files.update({f"{fmt.META_DIR}/zarr.json": crc_file, f"{fmt.MANIFEST_DIR}/zarr.json": crc_file})
    rank_state = {"rng": {"cpu": "x" * (RNG_NBYTES * 4 // 3)}}  # base64 of the RNG state
    manifest = {
        "format_version": 2,
        "kind": "manifest",
        "step": 10**7,
        "rank": world - 1,
        "world_size": world,
        "save_id": "f" * 16,
        "specs_digest": "f" * 64,
        "rows": {g: row for g in plans},
        "files": {},
        "rank_state": rank_state,
    }
    record = {
        "format_version": 2,
        "kind": "commit",
        "step": 10**7,
        "world_size": world,
        "save_id": "f" * 16,
        "attrs": {},
        "tensors": tensors_json,
        "groups": format2.group_entries(plans, {g: [row] * world for g in plans}),
        "manifests": [crc_file] * world,
        "files": files,
    }
    objects = written + world + len(files) + 1
    return {
        "commit_check_s": commit_check_s,
        "objects": objects,
        "manifest_bytes": len(fmt.group_document({"zerostate_manifest": manifest})),
        "commit_bytes": len(fmt.group_document({"zerostate_commit": record})),
        "planning_s": planning_s,
    }


def plan_v1(params: dict[str, int], world: int) -> dict:
    t0 = time.perf_counter()
    numels = [n for _ in STATES for n in params.values()]
    layouts = v1_layouts(numels, world)
    planning_s = time.perf_counter() - t0
    chunks = sum(lay.num_chunks for lay in layouts) + world  # + one RNG tensor per rank
    tensors = len(layouts) + world
    groups = 5  # model, optim, optim/exp_avg, optim/exp_avg_sq, rng (+ rng/rank-<r> below)
    objects = chunks + tensors + groups + world + world + 4
    chunk_entry = len(json.dumps({"index": 99, "nbytes": 2**30, "crc32c": 2**31}, indent=1)) + 40
    doc_entry = len(json.dumps({"nbytes": 2**10, "crc32c": 2**31}, indent=1)) + 60
    mean_name = sum(len(f"{s}/{n}") for s in STATES for n in params) / len(numels)
    per_rank_chunks = chunks / world
    manifest = 600 + per_rank_chunks * (chunk_entry + mean_name) + tensors / world * doc_entry
    tensor_entry = 260 + mean_name
    commit = 600 + tensors * tensor_entry + chunks * 40 + (tensors + groups) * doc_entry
    return {
        "objects": objects,
        "manifest_bytes": int(manifest),
        "commit_bytes": int(commit),
        "planning_s": planning_s,
    }


def v1_layouts(numels: list[int], world: int) -> list[TensorLayout]:
    """``plan_layouts(numels, world)`` (the format-1 placement), with the greedy choice of
    each small tensor's first owner done by numpy window sums: the same plan (checked
    against ``plan_layouts`` in ``run_plan``), in O(tensors * world) instead of
    O(tensors * world * chunks), which takes hours at 4,096 ranks."""
    load = np.zeros(world, dtype=np.int64)
    out = []
    for numel in numels:
        chunk = chunk_numel_for(numel, world, DEFAULT_MIN_SHARD_NUMEL)
        num_chunks = -(-numel // chunk) if numel else 0
        first = 0
        if 0 < num_chunks < world:
            ext = np.concatenate([[0], np.cumsum(np.concatenate([load, load[: num_chunks - 1]]))])
            sums = ext[num_chunks : num_chunks + world] - ext[:world]  # circular window sums
            first = int(np.argmin(sums))  # ties to the lowest start, as the loop
        layout = TensorLayout(numel, world, chunk, first)
        if num_chunks:
            owners = (first + np.arange(num_chunks)) % world
            sizes = np.full(num_chunks, chunk, dtype=np.int64)
            sizes[-1] = numel - chunk * (num_chunks - 1)
            np.add.at(load, owners, sizes)
        out.append(layout)
    return out


def run_plan() -> str:
    sample = [70000, 5, 100000, 200000, 9, 65536 * 3 + 1] * 5
    for world in (3, 8):
        assert v1_layouts(sample, world) == plan_layouts(sample, world)
    plan_v2(llama_params(**SHAPES["Llama-7B"]), 8)  # one-time import and first-use costs
    lines = [
        "| model | ranks | objects v1 | objects v2 | manifest v1 | manifest v2 | "
        "commit record v1 | commit record v2 | planning v1 | planning v2 | "
        "rank 0 commit check v2 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, shape in SHAPES.items():
        params = llama_params(**shape)
        for world in RANKS:
            a, b = plan_v1(params, world), plan_v2(params, world)
            lines.append(
                f"| {model} ({len(params)} tensors x 3) | {world} | {a['objects']:,} | "
                f"{b['objects']:,} | {_kib(a['manifest_bytes'])} | {_kib(b['manifest_bytes'])} | "
                f"{_kib(a['commit_bytes'])} | {_kib(b['commit_bytes'])} | "
                f"{a['planning_s'] * 1e3:.0f} ms | {b['planning_s'] * 1e3:.0f} ms | "
                f"{b['commit_check_s'] * 1e3:.0f} ms |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines)


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 10 * MIB else f"{n / MIB:,.1f} MiB"


# ----------------------------------------------------------------- one rank's share
def share(params: dict[str, int], world: int, rank: int, fraction: float) -> tuple:
    """Format-1 chunk objects and format-2 specs of ``rank``'s share, keeping ``fraction``
    of the tensors (every k-th, so the mix of sizes stays)."""
    names = list(params)
    keep = names[:: max(1, round(1 / fraction))] if fraction < 1 else names
    sub = {n: params[n] for n in keep}
    layouts = v1_layouts([sub[n] for _ in STATES for n in sub], world)
    v1_objects = []  # (path, nbytes)
    k = 0
    for state in STATES:
        for name in sub:
            lay: TensorLayout = layouts[k]
            k += 1
            full = f"{state}/{name}"
            index = lay.owned_chunk(rank)
            if index is not None:
                v1_objects.append((f"{full}/c/{index}", lay.chunk_numel * 4 + 4))
            if (
                lay.num_chunks
                and lay.chunk_owner(crc32c.crc32c(full.encode()) % lay.num_chunks) == rank
            ):
                v1_objects.append((f"{full}/zarr.json", 520 + len(full)))
    v1_objects.append(("_zerostate/manifests/rank-x/zarr.json", 300 + 120 * len(v1_objects)))
    specs = v2_specs(sub, world)
    return v1_objects, specs


def write_v1(root: str, options: dict | None, objects: list, buf: memoryview) -> None:
    storage = open_storage(root, options)
    if storage.has_directories:
        storage.makedirs(sorted({p.rsplit("/", 1)[0] for p, _ in objects}))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda o: storage.write(o[0], [buf[: o[1]]]), objects))
    storage.sync_dirs()


def write_v2(root: str, options: dict | None, specs: list, rank: int, world: int, buf) -> None:
    writer = StepWriter(root, 1, rank=rank, world_size=world, specs=specs, storage_options=options)
    shards = {}
    for spec in specs:
        lo, hi = spec.layout.owned_range(rank)
        if hi > lo:
            shards[spec.name] = buf[: hi - lo]
    writer.write(shards)


class _LatencyProxy:
    """The fault proxy of tests/faults in a process of its own, holding every request
    ``latency_ms`` before passing it on: the round trip a network object store adds to
    each request, which a server on the same machine does not have."""

    def __init__(self, upstream_port: int, latency_ms: float) -> None:
        faults = Path(__file__).resolve().parents[1] / "tests" / "faults"
        code = (
            f"import sys, time; sys.path.insert(0, {str(faults)!r}); "
            "from _proxy import FaultyProxy; "
            f"p = FaultyProxy({upstream_port}, seed=0, delay_rate=1.0, "
            f"delay_s={latency_ms / 1000!r}); p.__enter__(); "
            "print(p.port, flush=True); time.sleep(1e9)"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline().strip()
        if not line.isdigit():
            self.close()
            raise RuntimeError(f"latency proxy did not start (printed {line!r})")
        self.endpoint = f"http://127.0.0.1:{line}"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _cell(times: list[float], cpu: list[tuple[float, float]], objects: int) -> str:
    client = statistics.median(x[0] for x in cpu)
    weed = statistics.median(x[1] for x in cpu)
    return (
        f"{objects} objects: {statistics.median(times):.2f} s ({min(times):.2f}-"
        f"{max(times):.2f}); CPU {client:.2f} s client + {weed:.2f} s server"
    )


def run_s3(model: str, fraction: float, repeat: int, latencies_ms: list[float]) -> str:
    """Rows of the s3 table: for each added per-request latency, format 1 vs format 2,
    alternating. Each format writes into a bucket of its own, every round under a new
    prefix that is deleted afterwards (not timed); an untimed first round lets SeaweedFS
    grow the bucket's volumes, which is the server's start-up cost, not the format's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import s3fs

    from benchmarks.s3 import SeaweedFS, storage_options

    server = SeaweedFS(volume_size_mb=1024)
    rows = []
    try:
        world, rank = 1024, 1
        params = llama_params(**SHAPES[model])
        v1_objects, specs = share(params, world, rank, fraction)
        nbytes = sum(n for _, n in v1_objects)
        largest = max(n for _, n in v1_objects)
        buf = torch.ones(max(largest // 4 + 1, 1), dtype=torch.float32)
        view = memoryview(buf.view(torch.uint8).numpy())
        buckets = {"v1": server.new_bucket(), "v2": server.new_bucket()}
        port = int(server.endpoint.rsplit(":", 1)[1])
        for latency in latencies_ms:
            proxy = _LatencyProxy(port, latency) if latency else None
            options = storage_options(proxy.endpoint if proxy else server.endpoint)
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
            times: dict[str, list[float]] = {"v1": [], "v2": []}
            cpu: dict[str, list[tuple[float, float]]] = {"v1": [], "v2": []}
            try:
                for i in range(repeat + 1):
                    for kind in ("v1", "v2") if i % 2 == 0 else ("v2", "v1"):
                        prefix = f"{buckets[kind]}/round-{latency:g}-{i}"
                        s0, c0, t0 = server.cpu_s(), time.process_time(), time.perf_counter()
                        if kind == "v1":
                            write_v1(f"s3://{prefix}/step-00000001", options, v1_objects, view)
                        else:
                            write_v2(f"s3://{prefix}", options, specs, rank, world, buf)
                        elapsed = time.perf_counter() - t0
                        used = (time.process_time() - c0, server.cpu_s() - s0)
                        fs.rm(prefix, recursive=True)
                        if i:  # round 0 warms up
                            times[kind].append(elapsed)
                            cpu[kind].append(used)
                        print(f"s3 +{latency:g} ms round {i} {kind}: {elapsed:.2f} s", flush=True)
            finally:
                if proxy:
                    proxy.close()
            v1, v2 = statistics.median(times["v1"]), statistics.median(times["v2"])
            total = {k: sum(statistics.median(x[j] for x in cpu[k]) for j in (0, 1)) for k in cpu}
            rows.append(
                f"| SeaweedFS{f' + {latency:g} ms per request' if latency else ''}, "
                f"{model} share of rank {rank} of {world} ({fraction:g} of the tensors, "
                f"{nbytes / MIB:.1f} MiB) | {_cell(times['v1'], cpu['v1'], len(v1_objects))} | "
                f"{_cell(times['v2'], cpu['v2'], len(STATES) + 1)} | {v1 / v2:.2f}x | "
                f"{total['v1'] / total['v2']:.2f}x |"
            )
    finally:
        server.close()
    return "\n".join(rows)


def _dd_source(directory: str, nbytes: int) -> str:
    """A file of ``nbytes`` holding the same float32 ones the checkpoint holds, read once so
    dd copies it from the page cache. (Not /dev/zero: on some virtual disks zero pages are
    written at a different speed than data.)"""
    path = os.path.join(directory, "zs-bench-dd-source.bin")
    if not os.path.exists(path) or os.path.getsize(path) != nbytes:
        block = torch.ones(MIB // 4, dtype=torch.float32).view(torch.uint8).numpy().tobytes()
        with open(path, "wb") as f:
            for offset in range(0, nbytes, MIB):
                f.write(block[: min(MIB, nbytes - offset)])
    with open(path, "rb") as f:
        while f.read(64 * MIB):
            pass
    return path


def run_disk(directory: str, world: int, fraction: float, repeat: int) -> str:
    params = llama_params(**SHAPES["Llama-7B"])
    rank = 1
    v1_objects, specs = share(params, world, rank, fraction)
    largest = max(n for _, n in v1_objects)
    buf = torch.ones(largest // 4 + 1, dtype=torch.float32)
    view = memoryview(buf.view(torch.uint8).numpy())
    best = {"dd": math.inf, "v1": math.inf, "v2": math.inf}
    size = {}
    for i in range(repeat + 1):  # round 0 warms up
        for kind in ("v2", "v1", "dd"):
            root = os.path.join(directory, f"zs-bench-{kind}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            t0 = time.perf_counter()
            if kind == "v1":
                write_v1(os.path.join(root, "step-00000001"), None, v1_objects, view)
            elif kind == "v2":
                write_v2(root, None, specs, rank, world, buf)
            else:
                source = _dd_source(directory, size["v2"])
                subprocess.run(
                    ["dd", f"if={source}", f"of={root}/dd.bin", "bs=4M", "conv=fsync"],
                    check=True, capture_output=True,
                )  # fmt: skip
            seconds = time.perf_counter() - t0
            if kind != "dd":
                size[kind] = sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
            shutil.rmtree(root)
            if i:
                best[kind] = min(best[kind], seconds)
            print(f"disk round {i} {kind}: {seconds:.2f} s", flush=True)

    os.remove(os.path.join(directory, "zs-bench-dd-source.bin"))

    def rate(kind: str) -> float:
        return size["v2" if kind == "dd" else kind] / best[kind] / MIB

    return (
        f"| local disk, Llama-7B share of rank {rank} of {world} ({fraction:g} of the "
        f"tensors): v1 {len(v1_objects)} objects {size['v1'] / MIB:.0f} MiB, v2 "
        f"{size['v2'] / MIB:.0f} MiB | v1 {rate('v1'):.0f} MiB/s | v2 {rate('v2'):.0f} MiB/s "
        f"| dd conv=fsync {rate('dd'):.0f} MiB/s | v2/dd {rate('v2') / rate('dd'):.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["plan", "s3", "disk", "all"])
    parser.add_argument("--dir", default="/tmp/zs-bench-scale", help="disk: where to write")
    parser.add_argument("--model", choices=list(SHAPES), default="Llama-7B", help="s3: shapes")
    parser.add_argument("--fraction", type=float, default=1.0, help="share of the tensors")
    parser.add_argument("--disk-ranks", type=int, default=8, help="disk: world size")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--latency-ms",
        type=float,
        nargs="+",
        default=[0, 10, 30],
        help="s3: per-request latencies to add with a proxy (0: the server directly)",
    )
    parser.add_argument("--out", help="also write the markdown tables here")
    args = parser.parse_args()
    sections = []
    if args.what in ("plan", "all"):
        sections.append(
            "### Objects, metadata and planning per step (AdamW state)\n\n" + run_plan()
        )
    if args.what in ("s3", "all"):
        row = run_s3(args.model, args.fraction, args.repeat, args.latency_ms)
        sections.append(
            f"### Writing one rank's share at 1,024 ranks (median of {args.repeat}, range)"
            "\n\n| case | format 1 | format 2 | wall time, 1 / 2 | CPU time, 1 / 2 |"
            "\n|---|---:|---:|---:|---:|\n" + row
        )
    if args.what in ("disk", "all"):
        os.makedirs(args.dir, exist_ok=True)
        row = run_disk(args.dir, args.disk_ranks, args.fraction, args.repeat)
        sections.append(
            "### Sync save on local disk (best of runs)\n\n| case | format 1 | format 2 | dd | "
            "ratio |\n|---|---:|---:|---:|---:|\n" + row
        )
    text = "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
