"""``zerostate reshard``: rewrite one step offline for a different number of ranks."""

from __future__ import annotations

import argparse

from zerostate_cli.common import (
    CliError,
    add_checkpoint_args,
    add_output_args,
    arg_type,
    human_bytes,
    open_source,
    positive_int,
    print_json,
    progress_bar,
    storage_options,
)
from zerostate_cli.layouts import mesh_of, mesh_text, step_mesh

from zerostate.layout.partition import DEFAULT_MIN_SHARD_NUMEL


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "reshard",
        help="rewrite a step for a different world size or mesh",
        description="Rewrite one committed step into OUT with the chunk grid of "
        "--world-size ranks (and --tp, --dp-replicate); a step written through zerostate.dcp "
        "is written as a DCP step again, with the chunks FSDP2 saves at --world-size ranks. "
        "Loading already reshards on the fly; "
        "this makes the stored layout match the job that reads it, and prints the source "
        "and target layouts, e.g. (dp_shard 2 x tp 2) -> (dp 2). Memory stays near one "
        "tensor range. Without tensor-parallel layouts, a tensor of at most "
        "--min-shard-numel elements is stored whole on one rank (the least loaded), a larger "
        "one in pieces of at least that many.",
    )
    add_checkpoint_args(parser)
    parser.add_argument("out", metavar="OUT", help="destination checkpoint root (path or URL)")
    parser.add_argument(
        "--world-size",
        "--dp",
        dest="world_size",
        required=True,
        type=arg_type(positive_int),
        help="number of data-parallel ranks to lay the step out for (with --dp-replicate, "
        "every replica's ranks together)",
    )
    parser.add_argument(
        "--tp",
        type=arg_type(positive_int),
        default=1,
        help="tensor-parallel degree (default 1): the step is laid out for TP x DP ranks, "
        "each tensor the source stores in tensor-parallel pieces split along the same dim",
    )
    parser.add_argument(
        "--dp-replicate",
        type=arg_type(positive_int),
        default=1,
        help="replicas of a hybrid-sharded job (default 1): --dp then counts every replica's "
        "ranks together (as in `estimate`), and the step is laid out for one replica's "
        "dp / dp_replicate ranks, the step such a job saves and every replica reads",
    )
    parser.add_argument(
        "--min-shard-numel",
        type=arg_type(positive_int),
        default=None,
        help=f"smallest piece a tensor is cut into (default {DEFAULT_MIN_SHARD_NUMEL}; a step "
        "with tensor-parallel layouts is split evenly, as a tensor-parallel job saves it)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace the step if OUT already holds it (never allowed when OUT is CKPT, "
        "or inside it or around it, under any spelling)",
    )
    for side, what in (("src", "CKPT"), ("dst", "OUT")):
        parser.add_argument(
            f"--{side}-storage-option",
            action="append",
            metavar="KEY=VALUE",
            dest=f"{side}_storage_option",
            help=f"fsspec/s3fs option for {what} only, repeatable; on top of "
            "--storage-option, which applies to both ends (URL ends only)",
        )
    add_output_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerostate.store.reshard import reshard

    if args.world_size % args.dp_replicate:
        raise CliError(
            f"--dp {args.world_size} does not split into --dp-replicate {args.dp_replicate} "
            "replicas; --dp counts every data-parallel rank (dp_replicate x dp_shard)",
            exit_code=2,
        )
    dp_shard = args.world_size // args.dp_replicate
    src_options = storage_options(args, args.ckpt, "src")
    dst_options = storage_options(args, args.out, "dst")
    source = open_source(args, "src")
    src_step = source.step(args.step)
    try:
        if src_step.dcp_pieces and (
            args.tp > 1 or args.dp_replicate > 1 or args.min_shard_numel is not None
        ):
            raise CliError(
                f"step {src_step.step} of {args.ckpt} was written through zerostate.dcp: it "
                "reshards to the chunks FSDP2 saves at --world-size ranks; leave out --tp, "
                "--dp-replicate and --min-shard-numel",
                exit_code=2,
            )
        dcp_step = src_step.dcp_pieces
        src_mesh = step_mesh(src_step)
        # As the store decides: a source recording a tensor-parallel dim keeps its layouts.
        src_tp = any(
            getattr(mesh_of(src_step, name), "tp_dim", None) is not None
            for name in src_step.tensors
        )
        small = [int(i.numel) for i in src_step.tensors.values()]
    finally:
        src_step.close()
    dst_mesh = {"dp_replicate": args.dp_replicate, "dp_shard": dp_shard, "tp": args.tp}
    # Only a format-2 target uses the smallest piece by default ([Note: partition rule]);
    # a step with tensor-parallel layouts is split evenly, as a tensor-parallel job saves it.
    min_shard = args.min_shard_numel
    if min_shard is None and not src_tp and args.tp == 1:
        min_shard = DEFAULT_MIN_SHARD_NUMEL
    # A tensor of at most min_shard elements is one piece, on one rank.
    whole = sum(1 for n in small if 0 < n <= min_shard) if min_shard and dp_shard > 1 else 0
    if dcp_step:  # rows split as FSDP2 splits them ([Note: DCP reshard layout])
        whole = 0
    with progress_bar(args, "reshard") as progress:
        result = reshard(
            source,
            args.out,
            dp_shard,
            step=args.step,
            min_shard_numel=args.min_shard_numel,
            default_min_shard_numel=DEFAULT_MIN_SHARD_NUMEL,
            storage_options=src_options,
            dst_storage_options=dst_options or {},  # {}: not the source's options
            force=args.force,
            progress=progress,
            tp=args.tp,
        )
    if args.json:
        print_json(
            {
                "step": result.step,
                "src_world_size": result.src_world_size,
                "world_size": result.world_size,
                "src_mesh": src_mesh,
                "mesh": dst_mesh,
                "whole_on_one_rank": whole,
                "num_tensors": result.num_tensors,
                "total_bytes": result.total_bytes,
                "out": args.out,
                "tp": args.tp,
                "dp_replicate": args.dp_replicate,
            }
        )
        return 0
    print(
        f"resharded step {result.step}: {mesh_text(src_mesh)} -> {mesh_text(dst_mesh)}, "
        f"world size {result.src_world_size} -> {result.world_size}, {result.num_tensors} "
        f"tensors, {human_bytes(result.total_bytes)} -> {args.out}"
    )
    if args.dp_replicate > 1:
        print(f"laid out for {mesh_text(dst_mesh)}: one replica's step, which every replica reads")
    if whole:
        print(
            f"{whole} tensor(s) of at most {min_shard:,} elements stored whole on one rank "
            "each (--min-shard-numel); larger ones cut into pieces of at least that many"
        )
    return 0
