"""What ``verify`` found, one record per problem, for tools that summarise it.

``StepReader.verify()`` raises one :class:`VerifyError` listing every problem. Its message
stays one readable string (the first problems, then ``...``); ``problems`` keeps each one
with where it lies (tensors, rank, group, inner chunk), so the command line can summarise a
truncated row of hundreds of damaged chunks per tensor and rank instead of printing them
on one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerostate.errors import CorruptCheckpointError


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem ``verify`` found. Fields other than ``message`` are ``None`` / empty where
    they do not apply (a metadata document belongs to no rank's row)."""

    message: str
    """The whole sentence, as the error message shows it."""
    tensors: tuple[str, ...] = ()
    """Every tensor whose stored bytes the damage touches (not only the first few)."""
    rank: int | None = None
    """The rank whose row holds the damage."""
    group: str | None = None
    """The row group (``model``, ``optim``, ...) of that row."""
    chunk: int | None = None
    """The inner chunk of the row, for damage of one chunk."""
    damage: str = ""
    """What is wrong, in a few words: ``is missing``, ``is cut short``, ``fails its checksum``,
    ``shard index``; empty for problems of no row."""
    url: str = ""
    """Where the damaged object lies."""


class VerifyError(CorruptCheckpointError):
    """A step failed verification; ``problems`` lists what was found, sorted by message."""

    def __init__(self, message: str, problems: list[Problem]) -> None:
        super().__init__(message)
        self.problems = problems


def as_problem(problem: str | Problem) -> Problem:
    return problem if isinstance(problem, Problem) else Problem(problem)


def raise_if_any(where: str, problems: list[str | Problem], limit: int = 20) -> None:
    """Raise :class:`VerifyError` for ``problems`` (if any): the message names the first
    ``limit``, the exception keeps them all."""
    if not problems:
        return
    found = sorted((as_problem(p) for p in problems), key=lambda p: p.message)
    raise VerifyError(
        f"{where}: {len(found)} problem(s): "
        + "; ".join(p.message for p in found[:limit])
        + (" ..." if len(found) > limit else ""),
        found,
    )
