"""The mesh section (launcher side): zerostate inside a (dp_shard x tp) device mesh against
FSDP2 + TP built the torchtitan way, step time and peak memory in one run.

Each contender of ``benchmarks/mesh.py`` runs in its own ``torchrun`` job (a process's peak
RSS is a high-water mark, so contenders sharing a process would inherit each other's), for
``--rounds`` rounds in alternating order; each keeps its best round by step time, as the
step row does. ``--quick`` runs every contender in one job at the tiny preset.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import MIB, _env, cuda_available, run_ranks

NPROC, TP = 4, 2
# zerostate contender -> (the FSDP2 + TP contender it is compared with, target of the ratio)
# Targets only where the partitioning is the same: stage 3 is FSDP2's (parameters,
# gradients and optimizer states sharded over dp_shard); stage 2 keeps whole (tp-local)
# parameters, so its peak memory is meant to be above FSDP2's.
PAIRS = {
    "zerostate_stage3": ("fsdp2_tp", 1.0),
    "zerostate": ("fsdp2_tp", None),
    "zerostate_pa": ("fsdp2_tp_ac", None),
}
LABELS = {
    "fsdp2_tp": "FSDP2 + TP (fully_shard per layer over dp_shard)",
    "fsdp2_tp_ac": "FSDP2 + TP, every layer in checkpoint_wrapper",
    "zerostate": "zerostate.Engine(mesh=mesh, stage=2)",
    "zerostate_pa": "zerostate stage 2, activation_checkpointing='partitioned' (Pa)",
    "zerostate_stage3": "zerostate.Engine(mesh=mesh, stage=3)",
}


def _job(
    contenders: list[str], common: list[str], timeout: float, verbose: bool
) -> dict[str, dict]:
    """One job (torchrun, or forked ranks under ``--quick``) of ``benchmarks.mesh`` with
    ``contenders``; their rows, or errors."""
    with tempfile.TemporaryDirectory(prefix="zs-bench-mesh-") as tmp:
        out = Path(tmp) / "mesh.json"
        argv = [*common, "--contenders", ",".join(contenders), "--out", str(out)]
        rc, output = run_ranks("benchmarks.mesh", argv, nproc=NPROC, env=_env(1),
                               timeout=timeout)
        if verbose:
            print(output, file=sys.stderr)
        rows = json.loads(out.read_text())["rows"] if out.exists() else {}
    why = "timed out" if rc is None else f"exit status {rc}"
    tail = [ln for ln in (output or "").strip().splitlines() if ln.strip()][-1:]
    return {
        c: rows.get(c) or {"error": f"{why}: {tail[0][:300] if tail else '(no output)'}"}
        for c in contenders
    }


def run(opts: Any) -> dict:
    """Launcher: every contender at (dp_shard 2 x tp 2) on 4 ranks; the section."""
    from benchmarks.mesh import CONTENDERS, PRESETS

    cuda = cuda_available()
    preset = "tiny" if opts.quick else ("1b" if cuda else "cpu")
    steps, warmup = (2, 1) if opts.quick else (opts.steps, 3)
    precision = "bf16" if cuda else "fp32"
    common = [
        "--device",
        "cuda" if cuda else "cpu",
        "--tp",
        str(TP),
        "--stage",
        "2",
        "--preset",
        preset,
        "--precision",
        precision,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
    ]
    rounds = 1 if opts.quick else max(1, opts.rounds)
    runs: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    for k in range(rounds):
        order = list(CONTENDERS) if k % 2 == 0 else list(CONTENDERS)[::-1]
        if opts.quick:
            got = _job(order, common, opts.timeout, opts.verbose)
        else:
            got = {}
            for c in order:
                print(f"  mesh round {k + 1}/{rounds}: {c} ...", flush=True)
                got.update(_job([c], common, opts.timeout, opts.verbose))
        for c in order:
            runs[c].append(got[c])
    rows = [_row(c, runs[c], cuda) for c in CONTENDERS]
    by_name = dict(zip(CONTENDERS, rows, strict=True))
    ratios = []
    memory_key = "peak_device_mb" if cuda else "peak_rss_mb"
    for zs, (peer, target) in PAIRS.items():
        a, b = by_name[zs], by_name[peer]
        if not (a["ok"] and b["ok"]):
            continue
        for key, what in (
            ("step_ms", "step time"),
            (memory_key, "peak memory per rank"),
            ("model_states_mb", "model-state bytes per rank"),
        ):
            ratios.append(
                {
                    "label": f"{what}, {zs} / {peer}",
                    "value": a["values"][key] / b["values"][key],
                    "target": target if key != "model_states_mb" else None,
                    "better": "lower",
                }
            )
    p = PRESETS[preset]
    memory = (
        "peak torch.cuda.max_memory_allocated"
        if cuda
        else "peak RSS (ru_maxrss of the rank's process, interpreter and imports included)"
    )
    setup = (
        f"transformers Llama from a config (hidden {p['hidden']}, intermediate "
        f"{p['inter']}, {p['layers']} layers, {p['heads']} heads, {p['kv']} KV heads, vocab "
        f"{p['vocab']}), {precision}, micro-batch {p['mb']} x {p['seq']} tokens per "
        f"dp_shard rank, {NPROC} {'NCCL' if cuda else 'gloo'} ranks as (dp_shard "
        f"{NPROC // TP} x tp {TP}), torch's parallelize_module over mesh['tp'] "
        "(q/k/v/gate/up colwise, o/down rowwise), AdamW lr 1e-4; median of "
        f"{steps} steps after {warmup} warm-up, the slowest rank's; {memory} and "
        "model-state bytes (local shards of parameters, gradients, masters and optimizer "
        "states) of the fullest rank; "
        + (
            "all contenders in one job (--quick), so peak RSS accumulates"
            if opts.quick
            else f"one torchrun job per contender, best of {rounds} round(s) in alternating order"
        )
    )
    return {
        "key": "mesh",
        "title": f"Tensor parallelism x ZeRO: (dp_shard {NPROC // TP} x tp {TP}) on {NPROC} ranks",
        "setup": setup,
        "rows": rows,
        "ratios": ratios,
    }


def _row(name: str, rounds: list[dict], cuda: bool) -> dict:
    failed = next((r for r in rounds if "error" in r), None)
    row: dict[str, Any] = {
        "contender": LABELS[name],
        "name": name,
        "ok": failed is None,
        "error": failed["error"] if failed else None,
        "values": {},
    }
    if failed:
        print(f"  mesh: {name}: FAILED {failed['error'][:200]}", flush=True)
        return row
    best = min(rounds, key=lambda r: r["step_s"])  # outside load only slows a run down
    row["values"] = {"step_ms": best["step_s"] * 1e3}
    if cuda:
        row["values"]["peak_device_mb"] = best["peak_device_bytes"] / MIB
    else:
        row["values"]["peak_rss_mb"] = best["peak_rss_bytes"] / MIB
    row["values"]["model_states_mb"] = best["model_state_bytes"] / MIB
    row["values"]["last_loss"] = best["last_loss"]
    row["step_ms_per_round"] = [r["step_s"] * 1e3 for r in rounds]
    row["per_rank"] = {k: best[k] for k in best if k.endswith("_per_rank")}
    print(f"  mesh: {name}: {row['values']['step_ms']:.1f} ms", flush=True)
    return row
