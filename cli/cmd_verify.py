"""``zerostate verify``: re-read every chunk of a step and check its checksum."""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # the store imports torch: `--help` must not
    from zerostate.store.problems import Problem

#: Lines of problems shown without --all: a row cut short early damages every chunk after
#: the cut, hundreds of problems that say one thing.
MAX_LINES = 20
#: Longest line shown without --all (names and URLs can be long).
MAX_WIDTH = 160
#: A chunk's damage (as the store words it) said of many chunks.
_PLURAL = {"is cut short": "cut short", "fails its checksum": "failing their checksums"}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="re-read every chunk and check checksums (exit 1 on damage)",
        description="Re-read every chunk of one committed step and check its checksum. "
        "Exit 0 when clean; exit 1 otherwise, after a summary of the damage per rank's row "
        f"and tensor in at most {MAX_LINES} lines (--all lists every problem).",
    )
    add_checkpoint_args(parser)
    add_output_args(parser)
    parser.add_argument(
        "--all",
        action="store_true",
        dest="all_problems",
        help="list every problem found, one per line, instead of the summary",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zerostate.store.problems import as_problem

    _, st = open_step(args)
    total = sum(int(info.nbytes) for info in st.tensors.values())
    try:
        with progress_bar(args, f"verify step {st.step}") as progress:
            st.verify(progress=_adapt(progress, total))
    except CorruptCheckpointError as exc:
        problems = [as_problem(p) for p in getattr(exc, "problems", None) or [str(exc)]]
        if args.json:
            print_json(
                {
                    "step": st.step,
                    "ok": False,
                    "error": str(exc),
                    "problems": [dataclasses.asdict(p) for p in problems],
                }
            )
            raise CliError(f"verify failed: {exc}") from exc
        if len(problems) == 1:  # the one error line says it all, as it always did
            raise CliError(f"verify failed: {exc}") from exc
        # The listing goes to stdout (it is the command's report); stderr keeps its one line.
        print(f"step {st.step}: {headline(problems)}")
        if args.all_problems:
            print("\n".join(p.message for p in problems))
        else:
            print("\n".join(bounded(problems_lines(problems))))
        raise CliError(
            f"verify failed: step {st.step} at {st.url}: {headline(problems)}, listed above"
        ) from exc
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


def headline(problems: list[Problem]) -> str:
    """``N problem(s) in T tensor(s) on rank(s) ...``: the damage in one short clause."""
    tensors = {t for p in problems for t in p.tensors}
    ranks = sorted({p.rank for p in problems if p.rank is not None})
    text = f"{len(problems)} problem(s)"
    if tensors:
        text += f" in {len(tensors)} tensor(s)"
    if ranks:
        text += f" on rank(s) {_ints(ranks)}"
    return text


def problems_lines(problems: list[Problem]) -> list[str]:
    """The damage per rank's row and tensor: for each row (rank, group) and kind of damage,
    one line saying how many inner chunks, then one indented line per tensor they hold.
    Problems of no row (metadata, manifests) are one line each."""
    rows: dict[tuple, list[Problem]] = defaultdict(list)
    lines: list[str] = []
    for p in problems:
        if p.tensors or p.rank is not None:
            rows[(p.rank, p.group, p.damage, p.url)].append(p)
        else:
            lines.append(p.message)
    for (rank, group, damage, url), found in sorted(rows.items(), key=_row_order):
        chunks = sorted({p.chunk for p in found if p.chunk is not None})
        where = f"rank {rank}'s row of group {group!r}" if rank is not None else "chunks"
        if not chunks:  # a whole row missing, or its shard index: one problem of the row
            lines += [p.message for p in found]
            per_chunk: dict[str, int] = {}
        else:
            what = _PLURAL.get(damage, damage or "damaged")
            lines.append(
                f"{where}: {len(chunks)} inner chunk(s) {what} (chunk(s) {_ints(chunks)})"
                + (f" {url}" if url else "")
            )
            per_chunk = defaultdict(int)
            first: dict[str, int] = {}
            for p in found:
                for name in p.tensors:
                    per_chunk[name] += 1
                    first[name] = min(first.get(name, p.chunk or 0), p.chunk or 0)
        # In row order: the first tensor named is where the damage begins.
        for name in sorted(per_chunk, key=lambda n: (first[n], n)):
            lines.append(f"  {name}: {per_chunk[name]} chunk(s)")
    return lines


def bounded(lines: list[str], limit: int = MAX_LINES, width: int = MAX_WIDTH) -> list[str]:
    """At most ``limit`` lines of at most ``width`` characters, then how many were left."""
    shown = [line if len(line) <= width else line[: width - 3] + "..." for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"... and {len(lines) - limit} more line(s); --all lists every problem")
    return shown


def _row_order(item: tuple) -> tuple:
    (rank, group, damage, url), found = item
    whole_row = all(p.chunk is None for p in found)  # after the row's chunk damage
    return (rank if rank is not None else -1, group or "", whole_row, damage, url)


def _ints(values: Iterable[int], limit: int = 6) -> str:
    """``1-3, 7, 9-12``: sorted ints as ranges, the first ``limit`` ranges."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return text + (", ..." if len(runs) > limit else "")
