#!/usr/bin/env bash
# Install the CPU test environment from the lock file (exact versions of every package, torch's CPU build
# included) plus this project, and run the test suite. This is the README's test command; .ci/run calls it.
# Extra arguments go to pytest. CI's suite leaves out the tests marked `extended` (larger variants of properties
# other tests check; docs/testing.md); `--all` as the first argument runs them too. Refresh the lock with
# scripts/lock_cpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
pip="python -m pip --quiet --disable-pip-version-check"
$pip install --no-deps -r requirements-cpu.lock
$pip install --no-deps -e .
# The tests marked `slurm` run real jobs on a two-node Slurm on this host: bring it up where we can (root; it
# installs Debian's slurm and munge when missing, about 30 s). Elsewhere those tests skip and say why.
if [[ $(id -u) -eq 0 ]] && { command -v slurmctld >/dev/null || command -v apt-get >/dev/null; }; then
  bash scripts/local_slurm.sh up || echo "run_tests: the local Slurm cluster did not come up; the slurm tests skip" >&2
fi
# The documentation site's browser check (tests/test_docs.py) drives Debian's headless Chromium through
# chromedriver: install both where we can (root, apt-get; about a minute). Elsewhere that test skips and says why.
if [[ $(id -u) -eq 0 ]] && ! { [[ -x /usr/bin/chromium ]] && [[ -x /usr/bin/chromedriver ]]; } \
    && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
    || echo "run_tests: chromium did not install; the browser check of the documentation skips" >&2
fi
tier=(-m "not extended")  # a -m of the caller's, given later, replaces it
# Two test processes (pytest-xdist), each test file whole in one of them (a module's shared fixture runs once, the
# Slurm tests never share the cluster): much of the suite waits on process start-ups, Slurm and subprocesses, so
# two files at once take about 0.7x the time of one after the other on 2 cores. The files go heaviest first, in
# the order of tests/durations.json (tests/conftest.py), not by their number of tests: then no file of minutes
# starts last while the other process has nothing left. DYNAMO_TEST_WORKERS=0: one process.
workers=(-n "${DYNAMO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
if [[ "${1:-}" == "--all" ]]; then
  tier=()
  shift
fi
set +e
python -m pytest "${workers[@]}" "${tier[@]}" "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$status"
