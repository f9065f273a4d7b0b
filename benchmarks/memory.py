"""Model-state memory per rank against the ZeRO paper, measured from the live tensors.

``python -m benchmarks.memory [--world-size N ...]`` trains two small transformers models of
different shapes (built from configs) in bf16 on N gloo ranks and, after the first backward
of a 2-micro-step accumulation (when each stage holds what the paper counts), sums the bytes
of every live tensor storage of the process (found through the garbage collector, so
nothing the engine forgets to report escapes). It prints, per stage, that sum less the
working buffers ``memory_stats()`` names (``gathered_params``, ``comm_buffers``, and
``peer_segments``: other ranks' shared-memory segments mapped into this process) and the
model's own buffers, divided by the paper's per-rank model states with gradients counted at
the reduce dtype's bytes: (2 + g + 12) Psi at stage 0, (2 + g) Psi + 12 Psi / N at stage 1,
2 Psi + (g + 12) Psi / N at stage 2, (2 + g + 12) Psi / N at stage 3.
"""

from __future__ import annotations

import argparse
import gc

import torch

MODELS = ("llama", "gpt2")


def build(name: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "llama":
        cfg = LlamaConfig(vocab_size=1000, hidden_size=192, intermediate_size=520,
                          num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                          max_position_embeddings=64)  # fmt: skip
        return LlamaForCausalLM(cfg)
    cfg = GPT2Config(vocab_size=777, n_positions=64, n_embd=136, n_layer=5, n_head=4)
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def paper_bytes(stage: int, psi: int, n: int, grad_bytes: int) -> float:
    g = grad_bytes
    return {
        0: (2 + g + 12) * psi,
        1: (2 + g) * psi + 12 * psi / n,
        2: 2 * psi + (g + 12) * psi / n,
        3: (2 + g + 12) * psi / n,
    }[stage]


def live_storage_bytes() -> int:
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                storage = obj.untyped_storage()
                seen[storage.data_ptr() or id(storage)] = storage.nbytes()
                grad = obj.grad if obj.is_leaf and obj.requires_grad else None
                if grad is not None:
                    seen[grad.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
        except (RuntimeError, ReferenceError, AttributeError):
            continue
    return sum(seen.values())


def measure(rank: int, world_size: int, name: str, stage: int, reduce_dtype: str) -> dict:
    import zerostate

    model = build(name)
    psi = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    engine = zerostate.Engine(
        model, stage=stage, precision="bf16", reduce_dtype=reduce_dtype, grad_accum_steps=2
    )
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, model.config.vocab_size, (2, 32), generator=g)
    engine.backward(engine(input_ids=x, labels=x).loss)
    del x
    gc.collect()
    live = live_storage_bytes()
    stats = engine.memory_stats()
    named = stats["gathered_params"] + stats["comm_buffers"] + stats["peer_segments"]
    grad_bytes = 4 if reduce_dtype == "fp32" else 2
    return {
        "psi": psi,
        "live": live,
        "named": named,
        "buffers": buffers,
        "reported": stats["model_states"],
        "paper": paper_bytes(stage, psi, world_size, grad_bytes),
    }


def _worker(rank: int, world_size: int) -> dict:
    """Every model, reduce dtype and stage on this rank.

    [Note: frozen import state]
    What the process holds before the first model (torch's, transformers' and zerostate's
    import state: some 350,000 objects and no tensor storage, measured) is moved to the
    collector's permanent generation first. Each of the 16 measurements runs two full
    collections and a scan of every tracked object; over the import state they cost about
    0.5 CPU s per measurement and rank, nearly all of this worker's time. Frozen objects
    are neither collected nor listed by ``gc.get_objects()``, so the scan sees exactly the
    objects created since: the models, engines and everything they allocate."""
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    try:
        out = {}
        for name in MODELS:
            for reduce_dtype in ("fp32", "bf16"):
                for stage in range(4):
                    out[(name, reduce_dtype, stage)] = measure(
                        rank, world_size, name, stage, reduce_dtype
                    )
                    gc.collect()
        return out
    finally:
        gc.unfreeze()


def rows(world_sizes: list[int]) -> list[dict]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers_dist import run_distributed

    table = []
    for n in world_sizes:
        results = run_distributed(_worker, n, timeout=600)
        for key, r in sorted(results[0].items()):
            name, reduce_dtype, stage = key
            unnamed = r["live"] - r["named"] - r["buffers"]
            table.append({
                "model": name, "world_size": n, "reduce_dtype": reduce_dtype, "stage": stage,
                "psi": r["psi"], "measured_over_paper": unnamed / r["paper"],
                "reported_over_paper": r["reported"] / r["paper"],
                "named_buffers_mib": r["named"] / 2**20,
            })  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    print("| model | N | reduce | stage | Psi | live / paper | memory_stats / paper | named MiB |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in rows(args.world_size):
        print(f"| {r['model']} | {r['world_size']} | {r['reduce_dtype']} | {r['stage']} | "
              f"{r['psi']:,} | {r['measured_over_paper']:.3f} | {r['reported_over_paper']:.3f} | "
              f"{r['named_buffers_mib']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
