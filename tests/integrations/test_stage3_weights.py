"""After Lightning's ``fit`` and Hugging Face's ``train`` at stage 3 (2 gloo ranks, a tiny
GPT-2), the model holds its full trained weights: ``torch.save(model.state_dict(), f)`` /
``model.save_pretrained(dir)`` on rank 0 give files that ``torch.load(weights_only=True)``
and ``from_pretrained`` read, equal to ``engine.full_state_dict()``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers_dist import free_port, run_distributed


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=80, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 80, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _launcher_env(rank: int, world_size: int, port: int) -> None:
    # The process group exists already; these tell Lightning / accelerate that the
    # processes were started outside them.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip


def _export(model, out: str, rank: int) -> None:
    """The documented line, on rank 0."""
    if rank == 0:
        torch.save(model.state_dict(), f"{out}/model.pt")
        model.save_pretrained(f"{out}/hf")
    dist.barrier()


def _lightning_worker(rank: int, world_size: int, out: str, port: int) -> dict:
    import lightning.pytorch as pl

    from zerostate.integrations.lightning import ZeroStateStrategy

    _launcher_env(rank, world_size, port)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = _gpt2()

        def training_step(self, batch, batch_idx):
            return self.gpt(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    strategy = ZeroStateStrategy(stage=3)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, num_nodes=1, strategy=strategy, max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=2)
    trainer.fit(module, loader)
    full = strategy.engine.full_state_dict()  # names of the LightningModule: "gpt.<name>"
    _export(module.gpt, out, rank)
    return {k.removeprefix("gpt."): v for k, v in full.items()}


def _hf_worker(rank: int, world_size: int, out: str, port: int) -> dict:
    from transformers import TrainingArguments

    from zerostate.integrations.transformers import ZeroStateTrainer

    _launcher_env(rank, world_size, port)
    model = _gpt2()
    args = TrainingArguments(output_dir=f"{out}/run", per_device_train_batch_size=2,
                             max_steps=2, learning_rate=1e-2, report_to=[], use_cpu=True,
                             disable_tqdm=True, save_strategy="no")  # fmt: skip
    trainer = ZeroStateTrainer(model=model, args=args, train_dataset=_Tokens(), stage=3)
    trainer.train()
    full = trainer.engine.full_state_dict()
    _export(model, out, rank)
    return full


def _check(out: Path, full: dict) -> None:
    from transformers import GPT2LMHeadModel

    loaded = torch.load(out / "model.pt", weights_only=True)
    pretrained = GPT2LMHeadModel.from_pretrained(out / "hf").state_dict()
    for name, value in full.items():
        assert torch.equal(pretrained[name], value), name
        assert torch.equal(loaded[name], value), name


@pytest.mark.slow
def test_lightning_fit_at_stage3_leaves_the_trained_weights(tmp_path: Path) -> None:
    results = run_distributed(_lightning_worker, 2, str(tmp_path), free_port(), timeout=300)
    assert all(torch.equal(results[1][k], v) for k, v in results[0].items())
    _check(tmp_path, results[0])


@pytest.mark.slow
def test_hf_train_at_stage3_leaves_the_trained_weights(tmp_path: Path) -> None:
    results = run_distributed(_hf_worker, 2, str(tmp_path), free_port(), timeout=300)
    assert all(torch.equal(results[1][k], v) for k, v in results[0].items())
    _check(tmp_path, results[0])
