"""``python -m benchmarks.foreign_consolidate``: consolidating the peers' own checkpoints.

DeepSpeed (ZeRO-3) and FSDP2 + DCP each save the same model on 2 gloo ranks; then, one
process each with the page cache dropped first, ``zerostate consolidate`` reads each
checkpoint in place and writes safetensors, against the peers' own tools: DeepSpeed's
``zero_to_fp32.py`` and DCP's ``dcp_to_torch_save``. Rows: wall time and peak RSS of the
tool's process tree, and zerostate's peak RSS against the largest tensor. The report goes
to ``docs/benchmarks/foreign_consolidate.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

from benchmarks.common import drop_caches, measure_child

MIB = 1 << 20
REPORT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "foreign_consolidate.md"


def build(dim: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])


def _write(rank: int, world: int, port: int, kind: str, out: str, dim: int, layers: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        LOCAL_RANK=str(rank),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    model = build(dim, layers)
    x = torch.randn(2, dim)
    if kind == "ds":
        from benchmarks.deepspeed_import import import_deepspeed

        deepspeed = import_deepspeed()

        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "train_batch_size": 2 * world,
            "optimizer": {"type": "AdamW", "params": {"torch_adam": True, "lr": 1e-3}},
            "zero_optimization": {"stage": 3},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.save_checkpoint(out)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(x).square().mean().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def write(kind: str, out: Path, dim: int, layers: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_write, args=(2, _port(), kind, str(out), dim, layers), nprocs=2)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(dim: int, layers: int, base: Path) -> dict:
    ds, dcp = base / "ds", base / "dcp"
    for kind, path in (("ds", ds), ("dcp", dcp)):
        print(f"writing the {kind} checkpoint ...", flush=True)
        write(kind, path, dim, layers)
    zs = shutil.which("zerostate") or str(Path(sys.executable).with_name("zerostate"))
    out = base / "out"
    out.mkdir()
    to_torch = (
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
        f"dcp_to_torch_save({str(dcp)!r}, {str(out / 'dcp.pt')!r})"
    )
    ref = [sys.executable, str(ds / "zero_to_fp32.py"), str(ds), str(out / "ds-ref")]
    tools = [
        ("DeepSpeed ZeRO-3", "zerostate consolidate",
         [zs, "consolidate", "-q", str(ds), str(out / "ds.safetensors")]),
        ("DeepSpeed ZeRO-3", "zero_to_fp32.py", ref),
        ("FSDP2 + DCP", "zerostate consolidate",
         [zs, "consolidate", "-q", str(dcp), str(out / "dcp.safetensors")]),
        ("FSDP2 + DCP", "dcp_to_torch_save", [sys.executable, "-c", to_torch]),
    ]  # fmt: skip
    rows = []
    for source, tool, cmd in tools:
        print(f"  {source}: {tool} ...", flush=True)
        drop_caches()
        m = measure_child(cmd, timeout=1800)
        rows.append(
            {
                "checkpoint": source,
                "tool": tool,
                "seconds": m["wall_s"],
                "peak_rss_mb": m["peak_rss_bytes"] / MIB,
            }
        )
    largest_mb = dim * dim * 4 / MIB
    model_mb = layers * (dim * dim + dim) * 4 / MIB
    return {
        "dim": dim,
        "layers": layers,
        "largest_tensor_mb": largest_mb,
        "model_mb": model_mb,
        "rows": rows,
    }


def report(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "# Consolidating the peers' checkpoints",
        "",
        f"`python -m benchmarks.foreign_consolidate --dim {result['dim']} --layers "
        f"{result['layers']}`: {result['layers']} Linear layers of {result['dim']}x"
        f"{result['dim']} (model {result['model_mb']:.0f} MiB fp32, largest tensor "
        f"{result['largest_tensor_mb']:.0f} MiB), saved on 2 gloo ranks by DeepSpeed ZeRO-3 "
        "and by FSDP2 + DCP; each tool runs alone, page cache dropped first; peak RSS of "
        "its process tree. One run, this machine (2 cores).",
        "",
        "| checkpoint | tool | seconds | peak RSS MiB |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {r['checkpoint']} | {r['tool']} | {r['seconds']:.2f} | {r['peak_rss_mb']:.0f} |"
              for r in rows]  # fmt: skip
    lines += ["", "| ratio | value |", "|---|---:|"]
    for i, peer in ((0, "zero_to_fp32"), (2, "dcp_to_torch_save")):
        zs, ref = rows[i], rows[i + 1]
        lines.append(f"| time, zerostate / {peer} | {zs['seconds'] / ref['seconds']:.2f} |")
        lines.append(
            f"| peak RSS, zerostate / {peer} | {zs['peak_rss_mb'] / ref['peak_rss_mb']:.2f} |"
        )
        lines.append(
            f"| zerostate peak RSS over the largest tensor ({rows[i]['checkpoint']}) | "
            f"{(zs['peak_rss_mb'] - result['base_rss_mb']) / result['largest_tensor_mb']:.2f} |"
        )
    lines += [
        "",
        "The last rows subtract the RSS of an interpreter that imported zerostate "
        f"({result['base_rss_mb']:.0f} MiB).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="zs-foreign-") as tmp:
        result = run(args.dim, args.layers, Path(tmp))
    base = measure_child([sys.executable, "-c", "import zerostate.store.sources, torch"])
    result["base_rss_mb"] = base["peak_rss_bytes"] / MIB
    text = report(result)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
