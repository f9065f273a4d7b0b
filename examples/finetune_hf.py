"""Fine-tune a Hugging Face Llama from pretrained safetensors with zerostate (ZeRO stage 3).

    torchrun --nproc_per_node=2 examples/finetune_hf.py --workdir runs/ft --steps 12 --stop-at 6
    torchrun --nproc_per_node=1 examples/finetune_hf.py --workdir runs/ft --steps 12 --resume

As two "nodes" (one process each; run both commands, in two shells):

    torchrun --nnodes=2 --nproc_per_node=1 --node-rank=0 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=ft examples/finetune_hf.py --workdir runs/ft ...
    torchrun --nnodes=2 --nproc_per_node=1 --node-rank=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=ft examples/finetune_hf.py --workdir runs/ft ...

What happens, under ``--workdir``:

1. ``pretrained/``: without ``--pretrained``, rank 0 creates a small Llama (random weights,
   ``LlamaConfig``) and writes it as sharded safetensors with its ``config.json``, so the
   example runs offline. Point ``--pretrained`` at a downloaded model directory instead.
2. Every rank builds the model on the ``meta`` device (no memory), wraps it in a stage-3
   engine and ``load_pretrained`` reads only the byte ranges of the elements it owns.
3. Two parameter groups (weight matrices with weight decay; norms at a lower learning rate
   without it), linear warm-up then cosine decay, on the bytes of ``--data`` (vocabulary
   256). The global batch of step ``s`` depends only on ``s``, so a run resumed at another
   world size sees the batches the uninterrupted run would have seen.
4. ``ckpt/``: asynchronous saves every ``--save-every`` steps; ``--stop-at`` ends the run
   early (a preemption); ``--resume`` continues from the latest committed step at any world
   size, scheduler included.
5. ``hf/``: after the last step, the final checkpoint is consolidated into
   ``model.safetensors`` beside the model's ``config.json``, which ``from_pretrained``
   opens; rank 0 checks its logits against the engine's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import zerostate
from zerostate.store.consolidate import consolidate

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "fixtures" / "text" / "corpus.txt"
#: Whether this zerostate takes a torch optimizer (``Engine(optimizer=...)``) with live
#: ``engine.optimizer`` param groups and ``stateful=`` save/load.
TORCH_OPTIMIZER_API = "optimizer" in inspect.signature(zerostate.Engine.__init__).parameters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("runs/finetune"), help="output directory")
    p.add_argument("--pretrained", help="HF safetensors file/dir/URL (default: create one)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="text file to train on")
    p.add_argument("--steps", type=int, default=12, help="length of the whole schedule")
    p.add_argument("--stop-at", type=int, help="stop after this step (simulates preemption)")
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--resume", action="store_true", help="continue from WORKDIR/ckpt")
    p.add_argument("--global-batch", type=int, default=4, help="sequences per step, all ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--norm-lr-scale", type=float, default=0.5, help="norms' lr / lr")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=3, help="linear warm-up steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor / lr")
    p.add_argument("--hidden", type=int, default=64, help="size of the created model")
    p.add_argument("--layers", type=int, default=2, help="size of the created model")
    p.add_argument("--log-json", type=Path, help="append one JSON line per step (rank 0)")
    return p.parse_args(argv)


def init_distributed() -> torch.device:
    if "RANK" not in os.environ:  # plain `python finetune_hf.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", RANK="0", WORLD_SIZE="1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    return torch.device("cpu")


def create_pretrained(path: Path, args: argparse.Namespace) -> None:
    """Stand-in for a downloaded checkpoint: a random small Llama in HF's own layout."""
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max(64, args.seq_len), tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(1234)
    model = LlamaForCausalLM(cfg)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    # Small shards so the sharded index path is what gets exercised, as with real models.
    model.save_pretrained(tmp, max_shard_size="200KB")
    tmp.rename(path)


def warmup_cosine(step: int, args: argparse.Namespace) -> float:
    """Learning-rate factor for optimizer step ``step`` (0-based)."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def is_no_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.ndim < 2  # norms (and biases, if any)


def build_engine(model: LlamaForCausalLM, args: argparse.Namespace, device: torch.device):
    """The engine and a scheduler-like object with ``step()`` (called after each step)."""
    if TORCH_OPTIMIZER_API:
        named = list(model.named_parameters())
        groups = [
            {"params": [p for n, p in named if not is_no_decay(n, p)],
             "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if is_no_decay(n, p)], "weight_decay": 0.0,
             "lr": args.lr * args.norm_lr_scale},
        ]  # fmt: skip
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
        engine = zerostate.Engine(model, stage=3, optimizer=optimizer, device=str(device))
        sched = torch.optim.lr_scheduler.LambdaLR(
            engine.optimizer, lambda s: warmup_cosine(s, args)
        )
        return engine, sched
    # Engines without Engine(optimizer=...): the built-in AdamW's two groups (decay /
    # no_decay) share one learning rate, which the schedule sets before every step.
    engine = zerostate.Engine(
        model, stage=3, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
        no_decay=is_no_decay, device=str(device),
    )  # fmt: skip
    return engine, _StepSchedule(engine, args)


class _StepSchedule:
    """Sets the built-in optimizer's lr from the step count (restored with the engine)."""

    def __init__(self, engine, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        self.step()

    def step(self) -> None:
        factor = warmup_cosine(self.engine.optimizer_steps, self.args)
        self.engine._optimizer.lr = self.args.lr * factor

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.step()


def batch_for_step(data: torch.Tensor, step: int, args: argparse.Namespace, rank: int,
                   world_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if args.global_batch % world_size:
        raise SystemExit(f"--global-batch {args.global_batch} must divide by {world_size} ranks")
    gen = torch.Generator().manual_seed(1_000_003 + step)
    starts = torch.randint(0, data.numel() - args.seq_len - 1, (args.global_batch,), generator=gen)
    per_rank = args.global_batch // world_size
    mine = starts[rank * per_rank : (rank + 1) * per_rank].tolist()
    idx = torch.stack([data[s : s + args.seq_len] for s in mine]).long()
    tgt = torch.stack([data[s + 1 : s + 1 + args.seq_len] for s in mine]).long()
    return idx, tgt


def save(engine, sched, ckpt: Path, step: int):
    kwargs = {"stateful": {"scheduler": sched}} if TORCH_OPTIMIZER_API else {}
    return engine.save(str(ckpt), step=step, blocking=False, keep_last=2,
                       client_state={"next_step": step}, **kwargs)  # fmt: skip


def load(engine, sched, ckpt: Path) -> int:
    if TORCH_OPTIMIZER_API:
        state = engine.load(str(ckpt), stateful={"scheduler": sched})
    else:
        state = engine.load(str(ckpt))
        sched.load_state_dict({})
    return int((state or {}).get("next_step", 0))


def export(engine, args: argparse.Namespace, rank: int, cfg: LlamaConfig) -> None:
    """Consolidate the last step beside the config and compare ``from_pretrained``'s logits."""
    out = args.workdir / "hf"
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        result = consolidate(str(args.workdir / "ckpt"), out / "model.safetensors")
        cfg.save_pretrained(out)  # config.json beside the weights
        print(f"consolidated step {result.step} into {out}", flush=True)
    idx = torch.arange(2 * args.seq_len).remainder(256).view(2, args.seq_len)
    engine.module.eval()
    with torch.no_grad():
        expected = engine(input_ids=idx.to(engine.device)).logits.float().cpu()
    dist.barrier()
    if rank == 0:
        hf = LlamaForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
        with torch.no_grad():
            got = hf(input_ids=idx).logits.float()
        diff = (got - expected).abs().max().item()
        print(f"from_pretrained({out}) logits vs engine: max abs diff {diff:.3e}", flush=True)
        if diff > 1e-4:
            raise SystemExit(f"exported model disagrees with the engine ({diff:.3e})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    pretrained = args.pretrained or str(args.workdir / "pretrained")
    if args.pretrained is None and rank == 0 and not Path(pretrained).exists():
        create_pretrained(Path(pretrained), args)
    dist.barrier()
    data = torch.frombuffer(bytearray(args.data.read_bytes()), dtype=torch.uint8)

    cfg = LlamaConfig.from_pretrained(pretrained, local_files_only=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine, sched = build_engine(model, args, device)
    ckpt = args.workdir / "ckpt"
    step = 0
    if args.resume:
        step = load(engine, sched, ckpt)
        if rank == 0:
            print(f"resumed at step {step} on {world_size} rank(s)", flush=True)
    else:
        report = engine.load_pretrained(pretrained)
        if rank == 0:
            print(f"loaded {pretrained} on {world_size} rank(s): {report}", flush=True)

    handle = None
    last = min(args.steps, args.stop_at or args.steps)
    engine.module.train()
    while step < last:
        idx, tgt = batch_for_step(data, step, args, rank, world_size)
        logits = engine(input_ids=idx.to(device)).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.to(device).view(-1))
        engine.backward(loss)
        engine.step()
        sched.step()
        step += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world_size
        if rank == 0:
            print(f"step {step:4d}  loss {mean:.5f}", flush=True)
            if args.log_json:
                with args.log_json.open("a") as f:
                    f.write(json.dumps({"step": step, "loss": mean, "world_size": world_size}))
                    f.write("\n")
        if step % args.save_every == 0 or step == last:
            if handle is not None:
                handle.wait()
            handle = save(engine, sched, ckpt, step)
    if handle is not None:
        handle.wait()
    dist.barrier()
    if step == args.steps:
        export(engine, args, rank, cfg)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
