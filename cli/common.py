"""Pieces shared by the subcommands: argument types, storage options, progress, output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from zerostate.errors import ConfigError


class CliError(Exception):
    """An expected failure the command reports as one line, with an exit code."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a parser raising ConfigError so argparse reports its message as a usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def parse_storage_options(
    pairs: list[str] | None, flag: str = "--storage-option"
) -> dict[str, Any] | None:
    """``KEY=VALUE`` pairs to fsspec/s3fs keyword arguments.

    Values that read as JSON (``true``, ``3``, ``{"a": 1}``) are decoded, anything else
    stays a string. A dotted key nests: ``client_kwargs.region_name=eu-west-1`` gives
    ``{"client_kwargs": {"region_name": "eu-west-1"}}``. A malformed pair is a usage error
    (exit 2) naming ``flag``; :func:`check_storage_options` checks the keys once the URL
    (and so the filesystem) is known.
    """
    if not pairs:
        return None
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise CliError(
                f"{flag} {pair!r} is not KEY=VALUE; e.g. {flag} endpoint_url=http://localhost:8333",
                exit_code=2,
            )
        try:
            value: Any = json.loads(raw)
        except ValueError:
            if raw.lstrip()[:1] in ("{", "["):
                example = f'{key}=\'{{"ACL": "private"}}\''
                raise CliError(
                    f"{flag} {key}: the value {raw!r} starts like JSON but is not valid "
                    f"JSON; quote it for the shell, e.g. {flag} {example}",
                    exit_code=2,
                ) from None
            value = raw
        *parents, leaf = key.split(".")
        target = options
        for part in parents:
            child = target.setdefault(part, {})
            if not isinstance(child, dict):
                raise CliError(f"{flag} {key!r} conflicts with an earlier {flag}", 2)
            target = child
        if isinstance(target.get(leaf), dict) and not isinstance(value, dict):
            raise CliError(f"{flag} {key!r} conflicts with an earlier {flag}", 2)
        target[leaf] = value
    return options


def check_storage_options(url: str, options: dict[str, Any] | None, flag: str) -> None:
    """Refuse (exit 2) options the filesystem of ``url`` would reject only once it
    connects: an unknown key (``endpoint-url``, ``client_kwargs.endpoint-url``), a
    non-dict ``*_kwargs``, a non-boolean switch (``anon=yes``), options for a local path."""
    from zerostate.store.options import validate_storage_options

    try:
        validate_storage_options(url, options)
    except ConfigError as exc:
        raise CliError(f"{flag} {exc}", exit_code=2) from None


def storage_options(
    args: argparse.Namespace, url: str, side: str | None = None
) -> dict[str, Any] | None:
    """The checked options for ``url``: ``--storage-option``, then (for ``side`` ``src``
    or ``dst``) ``--src-storage-option`` / ``--dst-storage-option`` on top, key by key.
    The shared ones apply to URL ends only, so ``reshard s3://... ./local`` works."""
    shared = parse_storage_options(getattr(args, "storage_option", None))
    own_flag = f"--{side}-storage-option" if side else "--storage-option"
    own = parse_storage_options(getattr(args, f"{side}_storage_option", None), own_flag)
    is_url = "://" in url and not url.lower().startswith(("file://", "local://"))
    if side and not is_url:
        check_storage_options(url, own, own_flag)  # refuses side options for a local path
        return None
    merged = _merge(shared or {}, own or {}) or None
    check_storage_options(url, merged, own_flag if own else "--storage-option")
    return merged


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def add_checkpoint_args(parser: argparse.ArgumentParser, *, step: bool = True) -> None:
    parser.add_argument("ckpt", metavar="CKPT", help="checkpoint root: a path or URL (s3://...)")
    if step:
        parser.add_argument(
            "--step",
            type=arg_type(non_negative_int),
            default=None,
            help="step to use (default: the latest committed step)",
        )
    parser.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        dest="storage_option",
        help="fsspec/s3fs option, repeatable (e.g. endpoint_url=http://host:8333, anon=true)",
    )


def add_output_args(parser: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


@contextmanager
def progress_bar(args: argparse.Namespace, desc: str, unit: str = "B") -> Iterator[Any]:
    """A tqdm bar on stderr, off with --quiet or when stderr is not a terminal.

    Yields a ``progress(done, total)`` callback: library code reports cumulative counts
    and does not depend on tqdm.
    """
    from tqdm import tqdm

    quiet = getattr(args, "quiet", False) or not sys.stderr.isatty()
    bar = tqdm(
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024,
        file=sys.stderr,
        disable=quiet,
        leave=False,
        dynamic_ncols=True,
    )

    def update(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        bar.close()


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def human_bytes(num_bytes: float) -> str:
    from zerostate.estimate import format_bytes

    return format_bytes(num_bytes)


def open_source(args: argparse.Namespace, side: str | None = None) -> Any:
    """Open ``args.ckpt`` in whatever format it holds (zerostate, DeepSpeed ZeRO, DCP):
    every command reads checkpoints through this."""
    from zerostate.store.sources import open_source as open_any

    return open_any(args.ckpt, storage_options=storage_options(args, args.ckpt, side))


def open_step(args: argparse.Namespace) -> tuple[Any, Any]:
    """Open ``args.ckpt`` and its ``args.step`` (latest committed when None)."""
    ckpt = open_source(args)
    return ckpt, ckpt.step(getattr(args, "step", None))
