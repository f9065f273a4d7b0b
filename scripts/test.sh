#!/usr/bin/env bash
# Install what the tests need (into .venv) and run the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k store -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh" 2> >(grep -v "is ignored: it is neither" >&2)
cd "$ROOT"
# torchtitan is installed by env.sh (ZEROSTATE_TORCHTITAN=0 leaves it out): its tests fail
# instead of skipping when it is missing.
if [ "${ZEROSTATE_TORCHTITAN:-1}" != 0 ]; then
    export ZEROSTATE_REQUIRE_TORCHTITAN=1
fi
set +e
# Two pytest-xdist workers (ZEROSTATE_TEST_WORKERS; 0 runs in this process): a test file runs
# on one worker, files handed out in the order tests/conftest.py sets ([Note: test groups]).
python -m pytest -p no:cacheprovider --durations=30 \
    -n "${ZEROSTATE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "zerostate: pytest collected no tests; failing on purpose" >&2
    exit 1
fi
exit "$rc"
