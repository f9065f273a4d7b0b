"""``zerostate estimate``: per-rank model-state memory for ZeRO stages 0-3."""

from __future__ import annotations

import argparse

from zerostate_cli.common import arg_type, positive_int, print_json

from zerostate.estimate import (
    DEFAULT_K,
    OFFLOAD_STAGES,
    STAGES,
    estimate,
    format_bytes,
    mesh_shape,
    parse_count,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate",
        help="per-rank model-state memory for ZeRO stages 0-3",
        description="Model-state bytes per data-parallel rank (the ZeRO paper's formulas: "
        "2 bytes weights + 2 bytes gradients + K bytes optimizer state per parameter). "
        "Activations and temporary buffers are not included.",
    )
    parser.add_argument(
        "--params",
        required=True,
        type=arg_type(parse_count),
        help="number of parameters: 7.5e9, 7.5B, 350M, 125K",
    )
    parser.add_argument(
        "--dp",
        required=True,
        type=arg_type(positive_int),
        help="data-parallel ranks (N; with --dp-replicate, every replica's ranks together)",
    )
    parser.add_argument(
        "--tp",
        type=arg_type(positive_int),
        default=1,
        help="tensor-parallel ranks: each holds 1/TP of the parameters tensor parallelism "
        "splits (the world is dp x tp)",
    )
    parser.add_argument(
        "--dp-replicate",
        type=arg_type(positive_int),
        default=1,
        help="replicas of hybrid sharding: ZeRO partitions over dp / dp_replicate ranks",
    )
    parser.add_argument(
        "--tp-replicated",
        type=arg_type(parse_count),
        default=None,
        help="parameters the tensor-parallel plan leaves whole on every tp rank "
        "(embeddings, norms outside the plan); default 0",
    )
    parser.add_argument("--stage", type=int, choices=STAGES, default=None, help="only this stage")
    parser.add_argument(
        "--k",
        type=float,
        default=DEFAULT_K,
        help=f"optimizer bytes per parameter (default {DEFAULT_K}: mixed-precision Adam)",
    )
    parser.add_argument(
        "--offload",
        choices=tuple(OFFLOAD_STAGES),
        default=None,
        help="ZeRO-Offload: also split each rank's bytes into device and host (optimizer: "
        "stages 1-3, optimizer states and the fp32 gradient staging buffer on the host; "
        "params: stage 3, the parameter shards too)",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    stages = None if args.stage is None else (args.stage,)
    mesh = dict(tp=args.tp, dp_replicate=args.dp_replicate, tp_replicated=args.tp_replicated or 0)
    rows = estimate(args.params, args.dp, stages=stages, k=args.k, offload=args.offload, **mesh)
    shape = mesh_shape(args.params, args.dp, **mesh)
    if args.json:
        print_json(
            {
                "params": args.params,
                "dp": args.dp,
                "tp": args.tp,
                "dp_replicate": args.dp_replicate,
                "dp_shard": shape.dp_shard,
                "params_per_tp_rank": shape.params_per_tp_rank,
                "k": args.k,
                "offload": args.offload,
                "stages": [row.to_json() for row in rows],
            }
        )
        return 0
    offload = f", offload={args.offload}" if args.offload else ""
    print(
        f"model-state memory per rank: {args.params:,} parameters, "
        f"{args.dp} data-parallel ranks, K={args.k:g}{offload}"
    )
    if args.tp > 1 or args.dp_replicate > 1:
        print(
            f"mesh: dp_replicate {args.dp_replicate} x dp_shard {shape.dp_shard} x tp "
            f"{args.tp}; ZeRO partitions {shape.params_per_tp_rank:,} parameters per tp rank "
            f"over {shape.dp_shard} dp_shard ranks"
        )
    tiers = f" {'device':>12} {'host':>12}" if args.offload else ""
    print(
        f"{'stage':<6} {'partitioned':<42} {'per rank':>12} {'GB (1e9)':>10} {'bytes':>17}" + tiers
    )
    for row in rows:
        total = row.total_bytes
        split = ""
        if args.offload:
            split = f" {format_bytes(row.device_bytes):>12} {format_bytes(row.host_bytes):>12}"
        print(
            f"{row.stage:<6} {row.partitioned:<42} {format_bytes(total):>12} "
            f"{total / 1e9:>10.1f} {round(total):>17,}" + split
        )
    return 0
