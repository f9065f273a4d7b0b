"""The ``zerostate`` command: consolidate, inspect, verify, reshard, estimate.

Every failure ends as one line on stderr, ``zerostate: error: ...``, and one rule sets
the exit status: 2 when the command line itself is wrong (an unknown flag, a malformed
value, a malformed or unknown ``--storage-option``), 1 when a well-formed command fails
(a missing checkpoint or step, an existing output, a damaged chunk, an unreachable
server, a refused destination). Set ``ZEROSTATE_DEBUG=1`` to get the traceback instead.

Subcommand modules import the heavy parts (torch, fsspec) inside ``run``, so ``--help``
and usage errors stay fast.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import NoReturn

from zerostate_cli import (
    cmd_consolidate,
    cmd_convert,
    cmd_estimate,
    cmd_inspect,
    cmd_reshard,
    cmd_verify,
)
from zerostate_cli.common import CliError

from zerostate import __version__
from zerostate.errors import ZerostateError

COMMANDS = (cmd_consolidate, cmd_inspect, cmd_verify, cmd_reshard, cmd_estimate, cmd_convert)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the help is one ``--help`` away), and an
    unknown flag gets the closest one the command takes (``--dtpye``: ``--dtype``)."""

    _seen: list[str] = []

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        # Kept for error(): argparse reports a missing required flag before the unknown
        # ones, so a typo in a required flag (--world-sise) is only found here.
        self._seen = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._unknown(parsed, extras)
        return parsed

    def _unknown(self, parsed: argparse.Namespace, extras: list[str]) -> NoReturn:
        sub = self._subparser(getattr(parsed, "command", None))
        target = sub if sub is not None else self
        flags = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
        for extra in extras:
            flag = extra.split("=", 1)[0]
            if flag.startswith("-"):
                close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.6)
                if close:
                    target.error(f"unrecognized argument {flag}; did you mean {close[0]}?")
        target.error(f"unrecognized arguments: {' '.join(extras)}")

    def _subparser(self, command: str | None) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                return action.choices[command]
        return None

    def _typo_of_required(self, message: str) -> str | None:
        if not message.startswith("the following arguments are required"):
            return None
        known = {o for a in self._actions for o in a.option_strings}
        required = [o for a in self._actions if a.required for o in a.option_strings]
        for token in self._seen:
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and flag not in known:
                close = difflib.get_close_matches(flag, required, n=1, cutoff=0.6)
                if close:
                    return f"unrecognized argument {flag}; did you mean {close[0]}?"
        return None

    def error(self, message: str) -> NoReturn:
        message = self._typo_of_required(message) or message
        command = self.prog.split(" ", 1)[1] + ": " if " " in self.prog else ""
        self.exit(2, f"zerostate: error: {command}{message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="zerostate",
        description="Inspect, verify, reshard and export zerostate checkpoints; "
        "estimate ZeRO memory per rank.",
    )
    parser.add_argument("--version", action="version", version=f"zerostate {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _refuse_step_directory(getattr(args, "ckpt", None), args.command)
        return int(args.run(args) or 0)
    except BrokenPipeError:
        # The reader went away (`zerostate inspect CKPT | head`): stop quietly, as Unix tools
        # do, and keep Python from complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CliError as exc:
        return _fail(str(exc), exc.exit_code)
    except (ZerostateError, OSError) as exc:
        if os.environ.get("ZEROSTATE_DEBUG"):
            raise
        return _fail(_describe(exc), 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - still one line; the traceback is one env var away
        if os.environ.get("ZEROSTATE_DEBUG"):
            raise
        return _fail(
            f"{type(exc).__name__}: {exc} (unexpected; ZEROSTATE_DEBUG=1 shows the traceback)",
            1,
        )


def _refuse_step_directory(ckpt: str | None, command: str) -> None:
    """CKPT is a root holding step-* directories; name the root when given one of them."""
    if not ckpt:
        return
    from zerostate.store.format import parse_step_dir

    head, _, name = ckpt.rstrip("/").rpartition("/")
    step = parse_step_dir(name)
    if step is not None:
        root = head or "."
        raise CliError(
            f"CKPT {ckpt!r} is one step's directory; CKPT is the checkpoint root that holds "
            f"the step-* directories: zerostate {command} {root} --step {step}"
        )


def _describe(exc: BaseException) -> str:
    message = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and not isinstance(exc, ZerostateError):
        # Backends raise bare OSErrors (no such bucket, access denied); keep the class
        # name, it is often the most informative part.
        if exc.strerror and exc.filename:
            message = f"{exc.strerror}: {exc.filename}"
        message = f"{type(exc).__name__}: {message}"
    return " ".join(message.split())


def _fail(message: str, code: int) -> int:
    # One line, whatever the exception text looked like.
    print(f"zerostate: error: {' '.join(message.split())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
