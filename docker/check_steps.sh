#!/usr/bin/env bash
# docker build cannot run where there is no container engine (this CI machine). This script runs the steps of
# docker/Dockerfile after its base image in a plain venv, as far as a machine without CUDA can go, and says what it
# did not run:
#   1. python3 -m venv + pip upgrade                                        real
#   2. pip install --no-deps -r requirements-gpu.lock                       every line checked against the index for
#      this Python and platform (uv --dry-run: metadata only); installed for real except the CUDA-sized packages
#      (torch, nvidia-*, vllm, triton, flashinfer, cupy, TE, xformers, ...), for which the CPU build of the same torch
#      (2.13.0+cpu) stands in so that the imports after it can run
#   3. transformer-engine-torch --no-build-isolation                        NOT RUN (needs nvcc and a CUDA torch)
#   4. pip install --no-deps -e .                                           real
#   5. python docker/smoke_test.py --allow-missing-cuda                     real; the CUDA-only imports say NOT RUN
# Usage: bash docker/check_steps.sh [VENV_DIR]   (default: a temporary directory, removed after; needs uv and PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
keep=${1:-}
venv=${keep:-$(mktemp -d)/venv}
if [[ -z $keep ]]; then
  trap 'rm -rf "$(dirname "$venv")"' EXIT
fi
uv=${UV:-uv}
big='^(torch|torchvision|torchaudio|torchcodec|vllm|triton|xformers|flashinfer[-a-z]*|cupy[-a-z0-9]*|nvidia-[-a-z0-9]*|transformer-engine[-a-z0-9]*|cuda-[-a-z]*|tilelang|quack-kernels|tokenspeed-mla|apache-tvm-ffi|torch-c-dlpack-ext|z3-solver)=='
t0=$SECONDS
echo "== 1. venv ($(python3 --version))"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
echo "== 2. the lock: $(grep -c '==' requirements-gpu.lock) lines"
"$uv" pip install --dry-run --no-deps --python "$venv/bin/python" -r requirements-gpu.lock 2>&1 | grep -E '^(Would|Resolved|error)' || true
small=$(mktemp)
grep -vE "$big" requirements-gpu.lock | grep '==' >"$small"
echo "   installed for real: $(wc -l <"$small") packages; not installed (CUDA builds, vLLM's GPU kernel stack):" \
  "$(grep -E "$big" requirements-gpu.lock | cut -d= -f1 | sort -u | paste -sd' ' -)"
"$uv" pip install --quiet --no-deps --python "$venv/bin/python" -r "$small"
# The stand-in: pip's own configuration (on the CI machine a local wheel directory; elsewhere
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
"$venv/bin/python" -m pip install --quiet --no-deps "torch==2.13.0+cpu" ||
  echo "   torch 2.13.0+cpu (the stand-in) could not be installed"
rm -f "$small"
echo "== 3. transformer-engine-torch==2.11.0 --no-build-isolation: NOT RUN (needs nvcc and a CUDA build of torch)"
echo "== 4. the package"
"$venv/bin/python" -m pip install --quiet --no-deps -e .
echo "== 5. smoke test"
status=0
"$venv/bin/python" docker/smoke_test.py --allow-missing-cuda || status=$?
echo "check_steps: done in $((SECONDS - t0)) s (exit $status)"
exit "$status"
