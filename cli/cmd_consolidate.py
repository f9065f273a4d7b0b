"""``zerostate consolidate``: one step's model weights and buffers to safetensors."""

from __future__ import annotations

import argparse

from zerostate_cli.common import (
    add_checkpoint_args,
    add_output_args,
    arg_type,
    human_bytes,
    open_source,
    print_json,
    progress_bar,
    storage_options,
)

#: Smallest --max-shard-size written without a unit. ``--max-shard-size 10`` is ten bytes,
#: one file per tensor, and never what was meant; with a unit (``10KB``) any size is taken
#: as written.
MIN_BARE_SHARD_SIZE = 1 << 20


def parse_dtype(text: str):
    from zerostate.store.consolidate import parse_dtype

    return parse_dtype(text)


def parse_shard_size(text: str) -> int:
    from zerostate.errors import ConfigError
    from zerostate.store.consolidate import parse_size

    size = parse_size(text)
    if size < MIN_BARE_SHARD_SIZE and not text.strip()[-1:].isalpha():
        raise ConfigError(
            f"{text!r} has no unit, so it counts bytes (one shard per tensor); write the "
            "unit, e.g. --max-shard-size 10GB (a bare number must be at least 1048576)"
        )
    return size


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "consolidate",
        help="export model weights and buffers to safetensors (streaming)",
        description="Write one step's model weights (fp32 masters) and buffers as "
        "safetensors, streaming tensor by tensor: host memory stays near one read piece, "
        "whatever the model size. Optimizer state is not exported. The output appears "
        "only when complete (written as OUT.partial, then renamed).",
    )
    add_checkpoint_args(parser)
    parser.add_argument(
        "out",
        metavar="OUT",
        help="output file (OUT.safetensors); with --max-shard-size, OUT.safetensors names "
        "the index (OUT-00001-of-0000N.safetensors beside it) and any other OUT is a "
        "directory that gets model-*.safetensors + model.safetensors.index.json",
    )
    parser.add_argument(
        "--dtype",
        type=arg_type(parse_dtype),
        default=None,
        metavar="{fp32,bf16,fp16}",
        help="cast floating-point tensors (default: as stored, fp32)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=arg_type(parse_shard_size),
        default=None,
        metavar="SIZE",
        help="split into Hugging Face style shards of at most SIZE: 5GB, 500MB, 2GiB; a "
        "number without a unit counts bytes and must be at least 1048576 (1MiB)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")
    parser.add_argument(
        "--trainable-only",
        action="store_true",
        help="export only the tensors that were trainable (not frozen) when saved: for a "
        "peft model OUT becomes a directory PeftModel.from_pretrained loads "
        "(adapter_model.safetensors + adapter_config.json)",
    )
    add_output_args(parser)
    parser.set_defaults(run=run)


def run_trainable(args: argparse.Namespace) -> int:
    from zerostate.errors import ConfigError
    from zerostate.store.adapter import export_trainable

    if args.max_shard_size is not None:
        raise ConfigError("--trainable-only writes one file; leave out --max-shard-size")
    result = export_trainable(
        args.ckpt,
        args.out,
        step=args.step,
        dtype=args.dtype,
        force=args.force,
        storage_options=storage_options(args, args.ckpt),
    )
    summary = {
        "step": result.step,
        "files": [str(p) for p in (result.weights, result.config) if p is not None],
        "num_tensors": result.num_tensors,
        "total_bytes": result.total_bytes,
    }
    if args.json:
        print_json(summary)
    else:
        print(
            f"wrote step {result.step}: {result.num_tensors} trainable tensors, "
            f"{human_bytes(result.total_bytes)} -> {', '.join(summary['files'])}"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    from zerostate.store.consolidate import consolidate

    if getattr(args, "trainable_only", False):
        return run_trainable(args)

    options = storage_options(args, args.ckpt)
    with progress_bar(args, "consolidate") as progress:
        result = consolidate(
            open_source(args),
            args.out,
            step=args.step,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            progress=progress,
            force=args.force,
            storage_options=options,
        )
    if args.json:
        print_json(
            {
                "step": result.step,
                "files": [str(f) for f in result.files],
                "index": str(result.index) if result.index else None,
                "num_tensors": result.num_tensors,
                "total_bytes": result.total_bytes,
                "tied": result.tied,
            }
        )
        return 0
    where = str(result.index) if result.index else str(result.files[0])
    shards = f" in {len(result.files)} shards" if result.index else ""
    print(
        f"wrote step {result.step}: {result.num_tensors} tensors, "
        f"{human_bytes(result.total_bytes)}{shards} -> {where}"
    )
    for alias, canonical in sorted(result.tied.items()):
        print(f"tied: {alias} is stored once, as {canonical}")
    return 0
