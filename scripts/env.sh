#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install zerostate into it.
# Sourced by the other scripts; safe to run again (it only installs what is missing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# ZEROSTATE_NO_INSTALL=1 means "use the environment as it is": with a virtual environment
# active, that one (a fresh checkout has no .venv, and a bare new one lacks zerostate).
VENV="${ZEROSTATE_VENV:-${ZEROSTATE_NO_INSTALL:+${VIRTUAL_ENV:-}}}"
VENV="${VENV:-$ROOT/.venv}"
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
    # torch pinned: a bare `torch` requirement in a fresh environment can pull a multi-GB
    # CUDA build. Set ZEROSTATE_TORCH to choose another build (e.g. "torch==2.13.0").
    torch_req="${ZEROSTATE_TORCH:-torch==2.13.0}"
    target="$ROOT"
    [ -n "$EXTRAS" ] && target="$ROOT[$EXTRAS]"
    # DS_BUILD_OPS=0: DeepSpeed installs without compiling its C++/CUDA ops (the benchmarks
    # use torch's AdamW through it), which keeps the install to pure-Python wheels.
    export DS_BUILD_OPS=0
    # uv installs the same resolution as pip (same indexes, read from pip's configuration
    # by scripts/pip_to_uv.py) in seconds instead of a minute and a half; pip is the
    # fallback when uv cannot be installed or fails. ZEROSTATE_INSTALLER=pip forces pip.
    installed=""
    if [ "${ZEROSTATE_INSTALLER:-uv}" = uv ] \
        && "$VENV/bin/python" -m pip install -q --disable-pip-version-check uv 2>/dev/null; then
        read -r -a uv_flags <<< "$("$VENV/bin/python" "$ROOT/scripts/pip_to_uv.py")"
        # The cache lives in the environment (a fresh clone starts without one) and on the
        # same disk, so uv hard-links from it instead of copying. --compile-bytecode, as pip
        # does: where PYTHONDONTWRITEBYTECODE is set (this machine sets it), Python writes no
        # .pyc files, and without compiled files every interpreter (each fork server, each
        # spawned rank) compiles torch's and transformers' sources again.
        if UV_CACHE_DIR="$VENV/.uv-cache" "$VENV/bin/python" -m uv pip install -q \
            --compile-bytecode --python "$VENV/bin/python" "${uv_flags[@]}" "$torch_req" \
            -e "$target"; then
            installed=uv
        else
            echo "zerostate: uv could not install the environment; using pip" >&2
        fi
    fi
    if [ -z "$installed" ]; then
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$torch_req"
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$target"
    fi
    # torchtitan's own model code for tests/integrations/test_torchtitan.py (the test extra
    # only). torchtitan 0.3.0 requires datasets<4.8, whose fsspec pin the s3fs zerostate
    # needs cannot meet, so it goes in without its dependencies, plus the few its model
    # package imports: spmd_types, tyro (its config manager), docstring_parser (tyro's) and
    # triton (imported at module level by its expert-parallel kernels; never run on a CPU),
    # torchdata (its dataloader, whose state the checkpoint manager's tests save).
    if [[ ",$EXTRAS," == *",test,"* ]] && [ "${ZEROSTATE_TORCHTITAN:-1}" != 0 ]; then
        titan=(torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0
               triton==3.9.0 torchdata==0.11.0)
        if [ "$installed" = uv ]; then
            UV_CACHE_DIR="$VENV/.uv-cache" "$VENV/bin/python" -m uv pip install -q \
                --compile-bytecode --python "$VENV/bin/python" "${uv_flags[@]}" --no-deps \
                "${titan[@]}"
        else
            "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
                "${titan[@]}"
        fi
    fi
    touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
