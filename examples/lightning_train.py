"""Train a LightningModule with zerostate's ZeRO strategy (or Lightning's DDP, to compare).

    torchrun --nproc_per_node=2 examples/lightning_train.py --stage 3 --workdir runs/pl
    torchrun --nproc_per_node=3 examples/lightning_train.py --stage 3 --workdir runs/pl \\
        --resume runs/pl/ckpt/epoch=0.ckpt          # continue on 3 devices

The only zerostate line is the strategy:
``Trainer(strategy=ZeroStateStrategy(stage=3))``. ``configure_optimizers`` returns a torch
AdamW and a warm-up schedule; the Trainer's ``accumulate_grad_batches`` and
``gradient_clip_val`` apply; ``ModelCheckpoint`` saves into the zerostate store at the end
of every epoch (``ckpt/epoch=<e>.ckpt`` is a checkpoint root), and ``--resume`` continues
from one at any number of devices. Every micro-batch's loss (the mean over all ranks) goes
to ``--log-json``. The global batch is fixed (``--global-batch``), so runs on 1, 2 or 3
devices see the same batches.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerostate.integrations.lightning import ZeroStateStrategy


class Classifier(pl.LightningModule):
    def __init__(self, lr: float = 3e-3, warmup: int = 3) -> None:
        super().__init__()
        self.lr, self.warmup = lr, warmup
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
        )
        self.losses: list[tuple[int, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        self.losses.append((self.trainer.global_step, mean.item()))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warm, "interval": "step"}}


def dataset(n: int = 96) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4
    return TensorDataset(x, y)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategy", choices=["zerostate", "ddp"], default="zerostate")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("runs/lightning"))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--resume", default=None, help="a checkpoint (root) to continue from")
    p.add_argument("--async-save", action="store_true", help="save in the background")
    p.add_argument("--log-json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % devices:
        raise SystemExit(f"--global-batch {args.global_batch} must divide over {devices} devices")
    pl.seed_everything(0, workers=True)
    model = Classifier()
    loader = DataLoader(dataset(), batch_size=args.global_batch // devices, shuffle=False)
    strategy = (
        ZeroStateStrategy(stage=args.stage, async_save=args.async_save)
        if args.strategy == "zerostate"
        else "ddp"
    )
    checkpoints = ModelCheckpoint(
        dirpath=args.workdir / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip,
        callbacks=[checkpoints], logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )  # fmt: skip
    trainer.fit(model, loader, ckpt_path=args.resume)
    if trainer.is_global_zero and args.log_json is not None:
        with open(args.log_json, "w") as f:
            for step, loss in model.losses:
                f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    if dist.is_initialized():  # a clean exit: no process-group threads left at shutdown
        # Lightning leaves the group to interpreter exit, where gloo's threads can abort
        # the process ("terminate called without an active exception"; rank 0 did once
        # under torchrun, after fit had finished).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
