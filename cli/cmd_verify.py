"""``zerostate verify``: re-read every chunk of a step and check its checksum."""

from __future__ import annotations

import argparse

from zerostate_cli.common import (
    CliError,
    add_checkpoint_args,
    add_output_args,
    human_bytes,
    open_step,
    print_json,
    progress_bar,
)

from zerostate.errors import CorruptCheckpointError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="re-read every chunk and check checksums (exit 1 on damage)",
        description="Re-read every chunk of one committed step and check its checksum. "
        "Exit 0 when clean; exit 1 with the damaged tensor and chunk otherwise.",
    )
    add_checkpoint_args(parser)
    add_output_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    _, st = open_step(args)
    total = sum(int(info.nbytes) for info in st.tensors.values())
    try:
        with progress_bar(args, f"verify step {st.step}") as progress:
            st.verify(progress=_adapt(progress, total))
    except CorruptCheckpointError as exc:
        if args.json:
            print_json({"step": st.step, "ok": False, "error": str(exc)})
        raise CliError(f"verify failed: {exc}") from exc
    if args.json:
        print_json(
            {"step": st.step, "ok": True, "num_tensors": len(st.tensors), "total_bytes": total}
        )
    else:
        print(
            f"step {st.step}: {len(st.tensors)} tensors, {human_bytes(total)} verified, "
            "every checksum matches"
        )
    return 0


def _adapt(progress, total: int):
    # The store reports increments of bytes read; the bar wants cumulative counts.
    done = 0

    def update(num_bytes: int) -> None:
        nonlocal done
        done += int(num_bytes)
        progress(done, total)

    return update
