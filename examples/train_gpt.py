"""Train a small GPT-2 on a text file with zerostate, saving and resuming checkpoints.

    torchrun --nproc_per_node=2 examples/train_gpt.py --steps 40 --save-every 20 --ckpt runs/demo
    torchrun --nproc_per_node=1 examples/train_gpt.py --steps 60 --ckpt runs/demo --resume
    zerostate consolidate runs/demo runs/demo.safetensors

S3 or another object store: pass the URL and the options the CLI takes, or set the
standard AWS variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_DEFAULT_REGION), which s3fs reads itself:

    torchrun --nproc_per_node=2 examples/train_gpt.py --ckpt s3://bucket/run \
        --storage-option client_kwargs.endpoint_url=http://127.0.0.1:8333 \
        --storage-option key=KEY --storage-option secret=SECRET

Data: the bytes of ``fixtures/text/corpus.txt`` (vocabulary of 256). The global batch for
step ``s`` is drawn from a generator seeded with ``(seed, s)`` and split evenly across the
ranks, so a run resumed on a different number of ranks sees exactly the batches the
uninterrupted run would have seen; the data position travels in ``client_state``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zerostate
from zerostate.models import GPT2, GPT2Config

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "fixtures" / "text" / "corpus.txt"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="text file to train on")
    p.add_argument("--ckpt", default="runs/gpt", help="checkpoint root (path or s3:// URL)")
    p.add_argument("--steps", type=int, default=40, help="train until this global step")
    p.add_argument("--save-every", type=int, default=20, help="save every N steps (0: never)")
    p.add_argument("--keep-last", type=int, default=3, help="committed steps to keep")
    p.add_argument("--resume", action="store_true", help="load the latest committed step first")
    p.add_argument("--async-save", action="store_true", help="save in the background")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--global-batch", type=int, default=12, help="sequences per step, all ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-json", type=Path, help="append one JSON line per step here (rank 0)")
    p.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec/s3fs option for an s3:// --ckpt, repeatable, as in the zerostate "
        "CLI (endpoint_url=..., client_kwargs.region_name=..., anon=true)",
    )
    args = p.parse_args(argv)
    # The CLI's KEY=VALUE parser, then zerostate.check_storage: a typo in an option
    # (endpoint-url, client_kwargs.endpoint-url) is a usage error here, and a missing
    # bucket is found now, not after the first --save-every steps of training.
    from zerostate_cli.common import CliError, parse_storage_options

    try:
        args.storage_options = parse_storage_options(args.storage_option)
        if args.save_every or args.resume or args.storage_options:
            zerostate.check_storage(args.ckpt, args.storage_options)
    except (CliError, zerostate.ConfigError) as exc:
        p.error(f"--storage-option: {exc}" if isinstance(exc, zerostate.ConfigError) else str(exc))
    except zerostate.ZerostateError as exc:
        raise SystemExit(f"zerostate: cannot use --ckpt {args.ckpt}: {exc}") from None
    return args


def init_distributed() -> None:
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python train_gpt.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", RANK="0", WORLD_SIZE="1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # After `torchrun --max-restarts` restarts the workers they meet in the same agent
        # store, where the dead group's addresses are still registered (gloo then dials
        # them and times out). A per-attempt key prefix gives each attempt a clean slate.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
        )
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"attempt-{attempt}/", store),
            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
        )  # fmt: skip
    else:
        dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def batch_for_step(
    data: torch.Tensor, step: int, args: argparse.Namespace, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if args.global_batch % world_size:
        raise SystemExit(
            f"--global-batch {args.global_batch} must be divisible by the world size {world_size}"
        )
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - args.seq_len - 1, (args.global_batch,), generator=gen)
    per_rank = args.global_batch // world_size
    mine = starts[rank * per_rank : (rank + 1) * per_rank]
    idx = torch.stack([data[s : s + args.seq_len] for s in mine.tolist()])
    tgt = torch.stack([data[s + 1 : s + 1 + args.seq_len] for s in mine.tolist()])
    return idx.long(), tgt.long()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    raw = args.data.read_bytes()
    if len(raw) < args.seq_len + 2:
        raise SystemExit(f"{args.data} is too short for --seq-len {args.seq_len}")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    torch.manual_seed(args.seed)
    cfg = GPT2Config(
        vocab_size=256,
        n_positions=args.seq_len,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
    )
    model = GPT2(cfg).to(device)
    engine = zerostate.Engine(
        model,
        stage=args.stage,
        lr=args.lr,
        precision=args.precision,
        weight_decay=args.weight_decay,
    )

    step = 0
    if args.resume:
        try:
            state = engine.load(args.ckpt, storage_options=args.storage_options) or {}
        except zerostate.CheckpointNotFoundError:
            state = {}
            if rank == 0:
                print(f"no committed checkpoint in {args.ckpt}; starting fresh", flush=True)
        step = int(state.get("next_step", 0))
        if rank == 0 and state:
            print(f"resumed from {args.ckpt} at step {step} on {world_size} rank(s)", flush=True)
    if rank == 0 and "://" not in args.ckpt:
        # A Hugging Face config beside the steps, so a consolidated file is loadable there.
        Path(args.ckpt).mkdir(parents=True, exist_ok=True)
        (Path(args.ckpt) / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))

    progress = None
    if rank == 0 and sys.stderr.isatty():
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=step, unit="step", dynamic_ncols=True)
    tokens_per_step = args.global_batch * args.seq_len
    handle = None
    t_last = time.perf_counter()
    while step < args.steps:
        idx, tgt = batch_for_step(data, step, args, rank, world_size)
        loss = engine(idx.to(device), tgt.to(device))
        engine.backward(loss)
        engine.step()
        step += 1
        reduced = loss.detach().float().clone()
        dist.all_reduce(reduced)
        reduced = reduced.item() / world_size
        now = time.perf_counter()
        tok_s = tokens_per_step / max(now - t_last, 1e-9)
        t_last = now
        if rank == 0:
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{reduced:.4f}", tok_s=f"{tok_s:,.0f}")
            else:
                print(f"step {step:5d}  loss {reduced:.4f}  {tok_s:,.0f} tok/s", flush=True)
            if args.log_json:
                record = {"step": step, "loss": reduced, "world_size": world_size}
                with args.log_json.open("a") as f:
                    f.write(json.dumps(record) + "\n")
        if args.save_every and (step % args.save_every == 0 or step == args.steps):
            handle = engine.save(
                args.ckpt,
                step=step,
                blocking=not args.async_save,
                client_state={"next_step": step},
                keep_last=args.keep_last,
                storage_options=args.storage_options,
            )
            if rank == 0 and not args.async_save:
                print(f"saved step {step} to {args.ckpt} ({handle.blocked_s:.2f} s)", flush=True)
    if handle is not None:
        handle.wait()
    if progress is not None:
        progress.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
