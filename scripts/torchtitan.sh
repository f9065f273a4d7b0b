#!/usr/bin/env bash
# torchtitan 0.3.0 in a virtual environment of its own, and what runs in it:
#
#   bash scripts/torchtitan.sh test [pytest args]   # tests/integrations/test_torchtitan*.py
#   bash scripts/torchtitan.sh bench [--steps N]     # benchmarks/titan.py: zerostate stage 3
#                                                    # vs FSDP2, one torchrun job each
#
# Why apart: torchtitan 0.3.0 requires datasets<4.8, whose fsspec pin the s3fs zerostate needs
# cannot meet, so the two never resolve into the project's .venv. Its model code needs only a
# few of its dependencies, so torchtitan is installed without them (--no-deps) plus those its
# model package imports: spmd_types, tyro (its config manager), docstring_parser (tyro's) and
# triton (imported at module level by its expert-parallel kernels; about 1 GB, never run on
# CPU). zerostate goes in editable with its own dependencies and the test runner.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ZEROSTATE_TITAN_VENV:-$ROOT/.venv-torchtitan}"
PY="${PYTHON:-python3}"
what="${1:-test}"
shift || true

if [ ! -x "$VENV/bin/python" ]; then
    echo "zerostate: creating the torchtitan environment in $VENV" >&2
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.zerostate-torchtitan-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
    pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" "${ZEROSTATE_TORCH:-torch==2.13.0}"
    "${pip[@]}" -e "$ROOT" pytest pytest-timeout pytest-xdist psutil
    "${pip[@]}" --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
        docstring_parser==0.18.0 triton==3.9.0 torchdata==0.11.0
    touch "$stamp"
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
case "$what" in
    test)
        # A missing torchtitan fails here instead of skipping.
        ZEROSTATE_REQUIRE_TORCHTITAN=1 exec "$VENV/bin/python" -m pytest -p no:cacheprovider \
            -n 0 tests/integrations/test_torchtitan.py \
            tests/integrations/test_torchtitan_checkpoint.py "$@"
        ;;
    bench)
        out="${ZEROSTATE_TITAN_OUT:-$ROOT/bench-out/titan}"
        mkdir -p "$out"
        rc=0
        for contender in fsdp2 zerostate; do
            "$VENV/bin/python" -m torch.distributed.run --nproc-per-node 4 \
                -m benchmarks.titan --contender "$contender" --out "$out/$contender.json" "$@" \
                > "$out/$contender.log" 2>&1 || rc=1
        done
        "$VENV/bin/python" -m benchmarks.titan --table "$out/fsdp2.json" "$out/zerostate.json"
        exit "$rc"
        ;;
    *)
        echo "usage: bash scripts/torchtitan.sh {test|bench} [args]" >&2
        exit 2
        ;;
esac
