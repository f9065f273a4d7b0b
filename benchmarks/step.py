"""Row 1: training-step time and peak memory per ZeRO stage, zerostate vs DDP,
ZeroRedundancyOptimizer, DeepSpeed ZeRO 1-3 and FSDP2, one torchrun job per contender, on
GPT-2 (section ``step``) and on a model where communication dominates (``step_mlp``)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.common import MIB, MLP, MODELS, launch
from benchmarks.contenders import CONTENDERS, PEERS, ZEROSTATE, Ctx

DATA_POOL = 2


def train(params: dict, ctx: Ctx) -> dict:
    """Worker: train ``params['contender']`` for warmup + steps; per-step times and losses."""
    import torch

    from benchmarks.common import peak_rss_bytes
    from benchmarks.contenders import batches, build_model, make

    name, preset = params["contender"], params["model"]
    model = build_model(preset, ctx.device, params.get("mlp"))
    n_params = sum(p.numel() for p in model.parameters())
    trainer = make(name, model, ctx, micro_batch=params["micro_batch"],
                   precision=params.get("precision", "fp32"))
    tokens = batches(preset, ctx.rank, params["micro_batch"], params["seq_len"], DATA_POOL,
                     ctx.device, params.get("mlp"))
    times, losses = [], []
    for i in range(params["warmup"] + params["steps"]):
        batch = tokens[i % DATA_POOL]
        if ctx.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = trainer.step(batch[:, :-1], batch[:, 1:])
        if ctx.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))  # outside the timed region
        if i >= params["warmup"]:
            times.append(dt)
    out: dict[str, Any] = {"times": times, "losses": losses, "n_params": n_params,
                           "peak_rss": peak_rss_bytes()}
    if ctx.cuda:
        out["peak_cuda"] = torch.cuda.max_memory_allocated(ctx.device)
    if name.startswith("zs"):
        out["model_states"] = trainer.obj.memory_stats()["model_states"]
    return out


def _median_ms(job: Any, steps: int) -> float:
    """Median over steps of the slowest rank's step time (a step waits for every rank)."""
    return statistics.median(max(r["times"][i] for r in job.ranks) for i in range(steps)) * 1e3


#: The communication-heavy model of ``--quick`` (a smoke run: the same code, tiny sizes).
MLP_QUICK = dict(width=64, layers=2)


def run_mlp(opts: Any) -> dict:
    """The step row on the communication-heavy model ([``MLP``] in benchmarks.common)."""
    mlp = MLP_QUICK if opts.quick else MLP
    return run(opts, model="mlp", batch=(4 if opts.quick else 16, 1), mlp=mlp)


def run(opts: Any, *, model: str | None = None, batch: tuple[int, int] | None = None,
        mlp: dict | None = None) -> dict:
    """Launcher: every selected contender, then per stage zerostate / fastest peer."""
    preset = model or getattr(opts, "model", None) or ("tiny" if opts.quick else "small")
    micro_batch, seq_len = (batch or getattr(opts, "batch", None)
                            or ((4, 32) if opts.quick else (8, 64)))
    steps, warmup = (2, 1) if opts.quick else (opts.steps, 3)
    # By stage, zerostate right after its peers: a change in outside load between jobs
    # then hits contenders that are compared with each other alike.
    names = sorted((n for n in CONTENDERS if not opts.contenders or n in opts.contenders),
                   key=lambda n: (CONTENDERS[n][0], n in ZEROSTATE))
    precision = getattr(opts, "precision", "fp32")
    params = {"model": preset, "micro_batch": micro_batch, "seq_len": seq_len,
              "steps": steps, "warmup": warmup, "precision": precision, "mlp": mlp}
    rounds = max(1, getattr(opts, "rounds", 1))
    runs: dict[str, list] = {n: [] for n in names}
    for k in range(rounds):
        order = names if k % 2 == 0 else names[::-1]  # alternate, so no one always goes last
        done = launch([(n, "train", {**params, "contender": n}) for n in order],
                      nproc=opts.nproc, batch=opts.quick or getattr(opts, "quick_jobs", False),
                      timeout=opts.timeout, verbose=opts.verbose)
        for n in names:
            runs[n].append(done[n])
    rows = []
    for name in names:
        failed = next((j for j in runs[name] if not j.ok), None)
        # Best round: outside load only ever slows a run down.
        job = failed or min(runs[name], key=lambda j: _median_ms(j, steps))
        stage, desc = CONTENDERS[name]
        row: dict[str, Any] = {"contender": name, "stage": stage, "description": desc,
                               "kind": "peer" if name in PEERS else "zerostate",
                               "ok": job.ok, "error": job.error, "values": {}}
        if job.ok:
            ranks = job.ranks
            first = sum(r["losses"][0] for r in ranks) / len(ranks)
            last = sum(r["losses"][-1] for r in ranks) / len(ranks)
            row["values"] = {
                "step_ms": _median_ms(job, steps),
                "peak_rss_mb": max(r["peak_rss"] for r in ranks) / MIB,
                "loss_first": first,
                "loss_last": last,
            }
            if "peak_cuda" in ranks[0]:
                row["values"]["peak_cuda_mb"] = max(r["peak_cuda"] for r in ranks) / MIB
            if "model_states" in ranks[0]:
                row["values"]["model_states_mb"] = max(r["model_states"] for r in ranks) / MIB
            row["n_params"] = ranks[0]["n_params"]
            row["step_ms_per_round"] = [_median_ms(j, steps) for j in runs[name]]
            if not last < first:
                row["ok"], row["error"] = False, f"loss did not fall ({first:.4f} -> {last:.4f})"
        print(f"  step ({preset}): {name}: " + (f"{row['values']['step_ms']:.1f} ms" if row["ok"]
                                     else f"FAILED {row['error']}"), flush=True)
        rows.append(row)
    ratios = []
    for stage in range(4):
        peers = [r for r in rows if r["stage"] == stage and r["kind"] == "peer" and r["ok"]]
        zs = next((r for r in rows if r["stage"] == stage and r["kind"] == "zerostate"), None)
        if not peers or zs is None or not zs["ok"]:
            continue
        fastest = min(peers, key=lambda r: r["values"]["step_ms"])
        mem_peer = min(peers, key=lambda r: r["values"]["peak_rss_mb"])
        ratios.append({"label": f"stage {stage} step time, {zs['contender']} / fastest peer "
                                f"({fastest['contender']})",
                       "value": zs["values"]["step_ms"] / fastest["values"]["step_ms"],
                       "target": 1.0, "better": "lower"})
        ratios.append({"label": f"stage {stage} peak RSS per rank, {zs['contender']} / "
                                f"leanest peer ({mem_peer['contender']})",
                       "value": zs["values"]["peak_rss_mb"] / mem_peer["values"]["peak_rss_mb"],
                       "target": None, "better": "lower"})
    n = next((r["n_params"] for r in rows if r.get("n_params")), None)
    if preset == "mlp":
        what = (f"Communication-heavy MLP ({mlp['layers']} x Linear({mlp['width']}, "
                f"{mlp['width']}) + GELU, MSE loss, {n if n else '?'} parameters), {precision}, "
                f"micro-batch {micro_batch} rows per rank")
    else:
        cfg = MODELS[preset]
        what = (f"GPT-2 '{preset}' ({cfg['n_layer']} layers, width {cfg['n_embd']}, vocab "
                f"{cfg['vocab_size']}, {n if n else '?'} parameters), {precision}, micro-batch "
                f"{micro_batch} x {seq_len} tokens per rank")
    setup = (f"{what}, {opts.nproc} ranks, AdamW lr 1e-3 "
             f"weight decay 0.01 on every parameter; median of {steps} steps after {warmup} "
             f"warm-up, slowest rank per step, best of {rounds} round(s) in alternating "
             "order"
             + ("; all contenders in one process group (--quick), so peak RSS accumulates"
                if opts.quick or getattr(opts, "quick_jobs", False)
                else "; one torchrun job per contender"))
    key, title = "step", "Training step time and peak memory per stage"
    if preset == "mlp":
        key, title = "step_mlp", title + ", communication-heavy model"
    return {"key": key, "title": title,
            "setup": setup, "columns": {"step_ms": "step ms", "peak_rss_mb": "peak RSS MB/rank",
                                        "model_states_mb": "model states MB/rank",
                                        "loss_first": "loss first", "loss_last": "loss last"},
            "rows": rows, "ratios": ratios}
