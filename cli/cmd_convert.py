"""``zerostate convert``: write a step in another trainer's format (a way back out)."""

from __future__ import annotations

import argparse

from zerostate_cli.common import (
    add_checkpoint_args,
    add_output_args,
    human_bytes,
    open_source,
    print_json,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="write a step as a DCP checkpoint that FSDP2 loads",
        description="Write one step (model, optimizer moments and step counts, param "
        "groups) as a torch.distributed.checkpoint directory in get_state_dict's layout, "
        "which FSDP2 + set_state_dict loads at any world size.",
    )
    add_checkpoint_args(parser)
    parser.add_argument("out", metavar="OUT", help="output directory (local)")
    parser.add_argument("--to", required=True, choices=["dcp"], help="output format")
    parser.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    add_output_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerostate.store.foreign.dcp_write import convert_to_dcp

    result = convert_to_dcp(open_source(args), args.out, step=args.step, force=args.force)
    if args.json:
        print_json({"step": result.step, "out": str(result.out), "num_tensors": result.num_tensors,
                    "total_bytes": result.total_bytes})  # fmt: skip
        return 0
    print(
        f"wrote step {result.step} as DCP: {result.num_tensors} tensors, "
        f"{human_bytes(result.total_bytes)} -> {result.out}"
    )
    return 0
