#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install zerostate into it.
# Sourced by the other scripts; safe to run again (it only installs what is missing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ZEROSTATE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
# test + bench: the benchmark smoke test runs the peers (DeepSpeed etc.) and fails without them.
EXTRAS="${ZEROSTATE_EXTRAS-test,bench}"  # set it empty for the library alone
if [ ! -x "$VENV/bin/python" ]; then
    echo "zerostate: creating virtual environment in $VENV" >&2
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.zerostate-installed-$EXTRAS"
# ZEROSTATE_NO_INSTALL=1: use the environment as it is (the test of examples/demo.sh runs it
# in the environment running the tests, which must not be re-pointed at another checkout).
if [ -z "${ZEROSTATE_NO_INSTALL:-}" ] && { [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; }; then
    # torch first and pinned: a bare `torch` requirement in a fresh environment can pull a
    # multi-GB CUDA build. Set ZEROSTATE_TORCH to choose another build (e.g. "torch==2.13.0").
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${ZEROSTATE_TORCH:-torch==2.13.0}"
    target="$ROOT"
    [ -n "$EXTRAS" ] && target="$ROOT[$EXTRAS]"
    # DS_BUILD_OPS=0: DeepSpeed installs without compiling its C++/CUDA ops (the benchmarks
    # use torch's AdamW through it), which keeps the install to pure-Python wheels.
    DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$target"
    touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
