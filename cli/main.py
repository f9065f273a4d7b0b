"""The ``zerostate`` command (placeholder until the subcommands land)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("zerostate: commands are being built", file=sys.stderr)
    return 2
