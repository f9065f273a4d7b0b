"""The layout-changing load: a checkpoint written at (dp_shard 2 x tp 2) on 4 ranks, read at
dp_shard 4 (plain data parallel, no tensor parallelism) on 4 fresh ranks.

* zerostate: ``Engine(model, mesh=mesh, stage=3)`` saves at the mesh; a mesh-less
  ``Engine(model, stage=3)`` on 4 ranks ``load``s it.
* DCP: FSDP2 + TP built the torchtitan way (``parallelize_module`` over ``mesh["tp"]``,
  ``fully_shard`` per layer over ``mesh["dp_shard"]``) saves ``get_state_dict(model, opt)``
  with ``dcp.save``; a 4-rank FSDP2 model (``fully_shard`` over all 4 ranks) loads it with
  ``dcp.load`` and ``set_state_dict``: DCP's own resharding load.
* ``cat`` of zerostate's files by 4 processes, the page cache dropped first: the disk's
  speed for the same bytes.

Both contenders train one AdamW step from the same weights on the same data, so each
checkpoint holds weights and both moments; after the load, the loss of a fixed batch must
equal the one before the save. Worker tasks ``layout_save`` / ``layout_load`` run in
``benchmarks.worker``; :func:`run` is the launcher side (``python -m benchmarks --only
layout``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.ckpt_rows import _checked, _cold_cat, _load_s, _ratio, _row
from benchmarks.common import MIB, drop_caches_in_job, launch, tree_bytes

NPROC, TP = 4, 2
LR = 1e-4
# A Llama of about the checkpoint rows' GPT-2 'io' size (26M parameters, ~300 MB of fp32
# weights and Adam moments), so the load reads enough bytes for the disk to matter.
PRESETS = {
    "io": dict(hidden=512, inter=1376, layers=6, heads=8, kv=4, vocab=8192, mb=2, seq=64),
}
WHO = {
    "zs": "zerostate engine.load",
    "dcp": "DCP load with resharding (dcp.load + set_state_dict into a dp 4 FSDP2 model)",
}


def _preset(params: dict) -> dict:
    from benchmarks.mesh import PRESETS as MESH_PRESETS

    return {**MESH_PRESETS, **PRESETS}[params["preset"]]


def _eval_loss(forward: Any, preset: dict) -> float:
    """Loss of one fixed batch, the same on every rank: equal before a save and after a load."""
    import torch

    g = torch.Generator().manual_seed(10_000)
    x = torch.randint(0, preset["vocab"], (preset["mb"], preset["seq"]), generator=g)
    with torch.no_grad():
        return float(forward(input_ids=x, labels=x).loss)


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _fsdp2(model: Any, mesh: Any) -> Any:
    import torch
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.optim.AdamW(model.parameters(), lr=LR)


def _dcp_state(model: Any, opt: Any) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def save(params: dict, ctx: Any) -> dict:
    """Worker: one training step at (dp_shard 2 x tp 2), then a save into ``<dir>/<who>``."""
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.mesh import batches, build

    preset, who, root = _preset(params), params["contender"], Path(params["dir"])
    mesh = init_device_mesh("cpu", (NPROC // TP, TP), mesh_dim_names=("dp_shard", "tp"))
    model = build(preset, ctx.device, mesh["tp"])
    x = batches(preset, int(mesh.get_local_rank("dp_shard")), 1, ctx.device)[0]
    if who == "zs":
        import zerostate

        engine = zerostate.Engine(model, mesh=mesh, stage=3, lr=LR)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        out = {"eval_loss": _eval_loss(engine, preset)}
        out["save_s"] = _timed(lambda: engine.save(str(root / who), step=1))
        engine.close()
        return out
    import torch.distributed.checkpoint as dcp

    opt = _fsdp2(model, mesh["dp_shard"])
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    out = {"eval_loss": _eval_loss(model, preset)}
    out["save_s"] = _timed(lambda: dcp.save(_dcp_state(model, opt), checkpoint_id=str(root / who)))
    return out


def load(params: dict, ctx: Any) -> dict:
    """Worker: a fresh dp_shard 4 contender (no tensor parallelism) loads ``<dir>/<who>``."""
    from benchmarks.mesh import build

    preset, who, root = _preset(params), params["contender"], Path(params["dir"])
    model = build(preset, ctx.device, None)
    if who == "zs":
        import zerostate

        engine = zerostate.Engine(model, stage=3, lr=LR)
        drop_caches_in_job()  # [Note: cold reads] in benchmarks.common
        seconds = _timed(lambda: engine.load(str(root / who)))
        out = {"load_s": seconds, "eval_loss": _eval_loss(engine, preset)}
        engine.close()
        return out
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    opt = _fsdp2(model, init_device_mesh("cpu", (NPROC,)))

    def fn() -> None:
        state = _dcp_state(model, opt)  # allocates this rank's shards of every entry
        dcp.load(state, checkpoint_id=str(root / who))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    drop_caches_in_job()
    seconds = _timed(fn)
    return {"load_s": seconds, "eval_loss": _eval_loss(model, preset)}


def run(opts: Any) -> dict:
    """Launcher: both saves, then ``--rounds`` rounds of the two loads and ``cat`` in
    alternating order, page cache dropped right before each ([Note: cold reads] in
    benchmarks.common); each keeps its best round."""
    base = Path(tempfile.mkdtemp(prefix="zs-bench-layout-", dir=opts.dir))
    try:
        return _run(opts, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run(opts: Any, base: Path) -> dict:
    name = "tiny" if opts.quick else "io"
    common = {"preset": name, "dir": str(base), "threads": 1}
    print("  layout: saves at (dp_shard 2 x tp 2) ...", flush=True)
    saves = launch(
        [(w, "layout_save", {**common, "contender": w}) for w in WHO],
        nproc=NPROC,
        batch=opts.quick,
        timeout=opts.timeout,
        verbose=opts.verbose,
    )
    rounds = 1 if opts.quick else opts.rounds
    jobs: dict[str, Any] = {}
    cat_times: list[float] = []
    for r in range(rounds):
        print(f"  layout load round {r + 1}/{rounds} ...", flush=True)
        if r % 2 and saves["zs"].ok:
            cat_times.append(_cold_cat(base / "zs", NPROC))
        order = [
            w
            for w in (list(WHO) if r % 2 == 0 else list(WHO)[::-1])
            if saves[w].ok and (w not in jobs or jobs[w].ok)
        ]
        got = launch(
            [(w, "layout_load", {**common, "contender": w}) for w in order],
            nproc=NPROC,
            batch=opts.quick,
            timeout=opts.timeout,
            verbose=opts.verbose,
        )
        for w, job in got.items():
            job = _checked(job, saves[w].ranks[0]["eval_loss"])
            print(
                f"    {w}: {_load_s(job):.3f} s" if job.ok else f"    {w}: {job.error}", flush=True
            )
            if w not in jobs or not job.ok or _load_s(job) < _load_s(jobs[w]):
                jobs[w] = job
        if r % 2 == 0 and saves["zs"].ok:
            cat_times.append(_cold_cat(base / "zs", NPROC))
    rows = []
    for w, label in WHO.items():
        job = jobs.get(w)
        if not saves[w].ok:
            rows.append(_row(label, False, f"the save failed ({saves[w].error})"))
        elif not job.ok:
            rows.append(_row(label, False, job.error))
        else:
            want = saves[w].ranks[0]["eval_loss"]
            rows.append(
                _row(
                    label,
                    True,
                    MiB=tree_bytes(base / w) / MIB,
                    seconds=_load_s(job),
                    save_s=max(r["save_s"] for r in saves[w].ranks),
                    eval_loss_error=abs(job.ranks[0]["eval_loss"] - want),
                )
            )
    if cat_times:
        rows.append(
            _row(
                f"cat of zerostate's files, {NPROC} processes (disk speed)",
                True,
                MiB=tree_bytes(base / "zs") / MIB,
                seconds=min(cat_times),
            )
        )
    zs, dcp_row = rows[0], rows[1]
    ratios = [
        x
        for x in (
            _ratio(
                "layout-changing load time, zerostate / cat of the same files",
                zs,
                rows[-1],
                "seconds",
                None,
            )
            if cat_times
            else None,
            _ratio(
                "layout-changing load time, zerostate / DCP resharding load",
                zs,
                dcp_row,
                "seconds",
                1.0,
            ),
        )
        if x
    ]
    p = _preset(common)
    setup = (
        f"transformers Llama from a config (hidden {p['hidden']}, intermediate "
        f"{p['inter']}, {p['layers']} layers, vocab {p['vocab']}), fp32 weights + AdamW "
        f"moments after one step, saved by {NPROC} gloo ranks at (dp_shard {NPROC // TP} x "
        f"tp {TP}) (zerostate stage 3; FSDP2 + TP with DCP), loaded by {NPROC} fresh ranks "
        f"at dp_shard {NPROC} without tensor parallelism (zerostate stage 3; FSDP2), page "
        "cache dropped right before each timed load (inside the job, once the ranks are "
        "up) and before each cat; loaded state checked by the "
        f"loss of a fixed batch; best of {rounds} round(s) in alternating order, the cat "
        "included"
    )
    return {
        "key": "layout",
        "title": f"Layout-changing load: (dp_shard {NPROC // TP} x tp {TP}) -> dp_shard {NPROC}",
        "setup": setup,
        "rows": rows,
        "ratios": ratios,
    }
