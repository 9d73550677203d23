#!/usr/bin/env bash
# Download, on a machine with a package index, the wheels that scripts/gpu_check.sh installs on a bare GPU machine
# that has no network (the lent device machine): megatron-core and math-verify with the dependencies its image
# lacks, for that machine's Python (3.12, x86-64 manylinux). They go to .whl/ (ignored by git; about 3 MB); carry
# .whl with the device command and scripts/gpu_check.sh installs those of them that Python lacks.
#
#   scripts/gpu_wheels.sh [--python-version 3.12] [--dest .whl] [NAME==VERSION ...]
#
# Extra NAME==VERSION arguments are downloaded too (no dependencies are resolved: name each one). Transformer
# Engine and vLLM cannot go this way: TE's torch extension only exists as source (it is built against the local
# torch), and vLLM's CUDA wheels pin their own torch and are hundreds of MB, over the device tool's 64 MiB limit.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python_version=3.12
dest=.whl
extra=()
while (($#)); do
  case $1 in
    --python-version) python_version=$2; shift ;;
    --dest) dest=$2; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_wheels: unknown option $1" >&2; exit 2 ;;
    *) extra+=("$1") ;;
  esac
  shift
done

# Keep in step with SMALL_WHEELS in benchmarks/gpu_check_parts/registry.py.
wheels=(megatron-core==0.16.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2)
if ((${#extra[@]})); then
  wheels+=("${extra[@]}")
fi
mkdir -p "$dest"
platforms=()
for n in 28 27 24 17; do
  platforms+=(--platform "manylinux_2_${n}_x86_64")
done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$python_version" --implementation cp "${platforms[@]}" -d "$dest" "${wheels[@]}"
echo "gpu_wheels: in $dest ($(du -sh "$dest" | cut -f1)):"
ls -1 "$dest"
if ! git check-ignore -q "$dest/x.whl" 2>/dev/null; then
  echo "gpu_wheels: warning: $dest is not ignored by git; add it to .gitignore or .git/info/exclude" >&2
fi
echo "gpu_wheels: device command: carry [\"$dest\"]; scripts/gpu_check.sh finds $dest/ itself" \
  "(or set GPU_CHECK_WHEELS=$dest)"
