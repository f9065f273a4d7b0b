"""``python -m benchmarks.rss CMD...``: run CMD, then print its wall time and the peak RSS
of its process tree as one ``ZS_BENCH_RSS {json}`` line (exit status: CMD's)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time


def main() -> int:
    cmd = sys.argv[1:]
    if not cmd:
        print("usage: python -m benchmarks.rss CMD [ARGS...]", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    # This process has no other children, so the mark is the command tree's largest process.
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print("ZS_BENCH_RSS " + json.dumps({"wall_s": wall, "peak_rss_bytes": peak}), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
