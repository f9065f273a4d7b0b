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
    """The damage per rank's row and tensor: a line naming each damaged row (rank, group,
    object), under it one line per kind of damage (how many inner chunks, or what is wrong
    with the whole row) and one per tensor those chunks hold, in row order. Problems of no
    row (metadata, manifests, a format-1 chunk object) follow, one line each."""
    rows: dict[tuple[str, int, str, str], list[Problem]] = defaultdict(list)
    others: list[str] = []
    for p in problems:
        if p.rank is not None and p.group is not None:
            rows[(_held_by(p), p.rank, p.group, p.url)].append(p)
        else:
            others.append(p.message)
    lines: list[str] = []
    for (held, rank, group, url), found in sorted(rows.items(), key=_row_order):
        lines.append(f"{held}rank {rank}'s row of group {group!r}" + (f" ({url}):" if url else ":"))
        chunked = [p for p in found if p.chunk is not None]
        if chunked:
            lines += _chunk_lines(chunked)
        lines += ["  " + _row_problem(p) for p in found if p.chunk is None]
    return lines + others


def _chunk_lines(found: list[Problem]) -> list[str]:
    """Damaged inner chunks of one row: per kind of damage, the count and chunk ranges, then
    each tensor they hold with its count (the first tensor named is where damage begins)."""
    kinds: dict[str, list[Problem]] = defaultdict(list)
    for p in found:
        kinds[p.damage].append(p)
    lines = []
    for damage, items in sorted(kinds.items()):
        chunks = sorted({p.chunk for p in items if p.chunk is not None})
        per_tensor: dict[str, int] = defaultdict(int)
        first: dict[str, int] = {}
        for p in items:
            for name in p.tensors:
                per_tensor[name] += 1
                first.setdefault(name, p.chunk or 0)
                first[name] = min(first[name], p.chunk or 0)
        lines.append(
            f"  {len(chunks)} inner chunk(s) {_PLURAL.get(damage, damage or 'damaged')} "
            f"(chunk(s) {_ints(chunks)}), in {len(per_tensor)} tensor(s):"
        )
        lines += [
            f"    {name}: {per_tensor[name]} chunk(s)"
            for name in sorted(per_tensor, key=lambda n: (first[n], n))
        ]
    return lines


def _held_by(p: Problem) -> str:
    # A step that refers to an older step's tensors verifies that step's rows too.
    return p.message.split(": ", 1)[0] + ": " if p.message.startswith("held by step ") else ""


def _row_problem(p: Problem) -> str:
    """A problem of a whole row, without the row's name (its heading line says it)."""
    if p.damage == "is missing":
        shown = ", ".join(p.tensors[:3]) + (
            f" and {len(p.tensors) - 3} more" if len(p.tensors) > 3 else ""
        )
        return f"the row object is missing; it holds {len(p.tensors)} tensor(s): {shown}"
    head = f"({p.url}): "
    return p.message.split(head, 1)[1] if head in p.message else p.message


def bounded(lines: list[str], limit: int = MAX_LINES, width: int = MAX_WIDTH) -> list[str]:
    """At most ``limit`` of ``lines``, then how many were left out. Rows and what is wrong
    with them come first; the per-tensor lines (indented 4) fill what is left, in order.
    Those are cut to ``width`` characters; a row's heading keeps its whole URL, which is
    what a user needs to find the object."""
    detail = [line.startswith("    ") for line in lines]
    keep = [i for i, d in enumerate(detail) if not d][:limit]
    room = limit - len(keep)
    keep += [i for i, d in enumerate(detail) if d][: max(0, room)]
    shown = [
        lines[i] if not detail[i] or len(lines[i]) <= width else lines[i][: width - 3] + "..."
        for i in sorted(keep)
    ]
    if len(lines) > len(keep):
        shown.append(f"... and {len(lines) - len(keep)} more line(s); --all lists every problem")
    return shown


def _row_order(item: tuple) -> tuple:
    (held, rank, group, _), _ = item
    return (rank, group, held)


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
