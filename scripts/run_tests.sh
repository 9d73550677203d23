#!/usr/bin/env bash
# Install the CPU test environment from the lock file (exact versions of every package, torch's CPU build
# included) plus this project, and run the test suite. This is the README's test command; .ci/run calls it.
# Extra arguments go to pytest. Refresh the lock with scripts/lock_cpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
pip="python -m pip --quiet --disable-pip-version-check"
$pip install --no-deps -r requirements-cpu.lock
$pip install --no-deps -e .
set +e
python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$status"
