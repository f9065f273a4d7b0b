"""One rank of a Trainer run on a (dp_shard 2 x tp 2) mesh under torchrun (4 gloo ranks):
``python -m torch.distributed.run --nproc_per_node=4 _mesh_worker.py {hf|lightning} OUT``.

The user's flow: initialise the process group, build the mesh, hand it to the integration
with ``tp_plan="auto"``: the engine applies torch's ``parallelize_module`` from the Llama's
own ``base_model_tp_plan`` (q/k/v/gate/up colwise, o/down rowwise). Rank 0 then trains the
same Llama on one process with plain SGD on the global batches the data-parallel ranks
trained on and writes the largest weight difference to ``OUT`` (``result.json``), with
whether the tp peers saw the same batches."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

VOCAB, SEQ, ROWS, PER_DEVICE, STEPS, LR = 256, 8, 12, 2, 3, 0.05


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg)


TP_APPLIED: list[bool] = []


def _is_tp(module) -> bool:
    """Whether the plan was applied: every q_proj weight is a DTensor split over tp."""
    from torch.distributed.tensor import DTensor

    q = [p for n, p in module.named_parameters() if n.endswith("self_attn.q_proj.weight")]
    return bool(q) and all(isinstance(p, DTensor) for p in q)


def row(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": row(i), "labels": row(i)}


#: The batches this rank trained on, in order.
SEEN: list[torch.Tensor] = []


def reference(seen: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One process, SGD on the global batch of each step: the batches the data-parallel
    ranks (tp coordinate 0 of each: ranks 0 and 2) trained on at that step."""
    model = llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x = torch.cat([seen[0][step], seen[2][step]])
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def train_hf(mesh, out: str) -> dict[str, torch.Tensor]:
    from transformers import TrainingArguments

    from zerostate.integrations.transformers import ZeroStateTrainer

    class Recording(ZeroStateTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            SEEN.append(inputs["input_ids"].clone())
            return super().training_step(model, inputs, *args, **kwargs)

    args = TrainingArguments(
        output_dir=f"{out}/run", per_device_train_batch_size=PER_DEVICE, max_steps=STEPS,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    model = llama()  # the engine parallelizes it from the model's own plan
    trainer = Recording(
        model=model, args=args, train_dataset=Rows(), mesh=mesh, stage=2, tp_plan="auto"
    )
    trainer.train()
    TP_APPLIED.append(_is_tp(trainer.engine.module))
    return trainer.engine.full_state_dict()


def train_lightning(mesh, out: str) -> dict[str, torch.Tensor]:
    import lightning.pytorch as pl

    from zerostate.integrations.lightning import ZeroStateStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()  # tp_plan="auto" finds it inside the LightningModule

        def training_step(self, batch, batch_idx):
            SEEN.append(batch["input_ids"].clone())
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    loader = torch.utils.data.DataLoader(Rows(), batch_size=PER_DEVICE, shuffle=False)
    strategy = ZeroStateStrategy(stage=2, mesh=mesh, tp_plan="auto")
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=f"{out}/run",
    )  # fmt: skip
    trainer.fit(Module(), loader)
    TP_APPLIED.append(_is_tp(strategy.engine.module))
    state = strategy.engine.full_state_dict()
    return {n.removeprefix("model."): t for n, t in state.items()}


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    which, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    state = (train_hf if which == "hf" else train_lightning)(mesh, out)
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, SEEN)
    if dist.get_rank() == 0:
        ref = reference(seen)
        missing = sorted(set(ref) - set(state))
        worst = max(
            float((state[n] - p).abs().max() / p.abs().max()) for n, p in ref.items() if n in state
        )
        moved = max(float((p - llama().state_dict()[n]).abs().max()) for n, p in ref.items())
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(
                {
                    "worst": worst,
                    "missing": missing,
                    "moved": moved,
                    "steps": [len(s) for s in seen],
                    "tp_applied": TP_APPLIED == [True],
                    # tp peers (ranks 0-1, 2-3) trained on the same batches; dp ranks not.
                    "tp_peers_same": all(
                        torch.equal(a, b)
                        for r in (0, 2)
                        for a, b in zip(seen[r], seen[r + 1], strict=True)
                    ),
                    "dp_ranks_differ": all(
                        not torch.equal(a, b) for a, b in zip(seen[0], seen[2], strict=True)
                    ),
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
