"""Print the ``uv pip install`` flags that give the package sources pip is configured with
(``pip config list``: index-url, extra-index-url, find-links, constraint), so that
scripts/env.sh installs the same resolution with uv as with pip. Prints nothing when pip
has no such settings (plain PyPI)."""

from __future__ import annotations

import shlex
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint"}


def main() -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                         capture_output=True, text=True, check=False).stdout
    seen: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if option not in FLAGS or not value:
            continue
        # Environment settings (":env:.") come before files in pip's precedence; a value
        # (quoted by pip) may list several entries separated by whitespace.
        for item in " ".join(shlex.split(value)).split():
            if item not in seen.setdefault(option, []):
                seen[option].append(item)
    flags = []
    for option, items in seen.items():
        for item in items:
            flags += [FLAGS[option], item]
    if seen.get("index-url") or seen.get("extra-index-url") or seen.get("find-links"):
        # pip takes the best version from any source; uv's default stops at the first
        # index that has the package.
        flags += ["--index-strategy", "unsafe-best-match"]
    print(" ".join(flags))


if __name__ == "__main__":
    main()
