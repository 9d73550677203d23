#!/usr/bin/env bash
# Refresh requirements-gpu.lock: resolve setup.py's core + gpu requirements for the GPU platform (CPython 3.11 and
# 3.12, manylinux_2_28 x86_64) with uv, which reads wheel metadata only: no CUDA wheel is downloaded, nothing is
# installed. Where the two Pythons resolve a package differently the lock carries both lines with a
# python_version marker. The resolution only sees releases uploaded before RESOLVED_AT (uv's --exclude-newer), so a
# refresh does not pick up whatever was released this morning. That date alone does not make the resolution
# repeatable: the registry served different files on different days for the same date (cuda-pathfinder 1.9.1,
# uploaded before 2026-11-21, was not offered when the lock was made on 2026-11-25 and was on 2026-11-25 evening).
# CHECK=LOCK resolves with that lock as constraints instead: the output
# equals the lock exactly when the locked set satisfies setup.py's requirements and every dependency for both
# Pythons on the GPU platform, whatever else the registry offers (tests/test_gpu_lock.py).
#   Usage: [RESOLVED_AT=2026-11-25T00:00:00Z] [CHECK=requirements-gpu.lock] bash scripts/lock_gpu.sh [OUTPUT]
#   (default: the date in the current lock's header; default OUTPUT requirements-gpu.lock; needs uv: pip install uv)
# Install (docker/Dockerfile does this): pip install --no-deps -r requirements-gpu.lock && pip install --no-deps -e .
# then Transformer Engine's torch extension: pip install --no-build-isolation --no-deps "transformer-engine-torch==2.11.0"
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-requirements-gpu.lock}
uv=${UV:-uv}
resolved_at=${RESOLVED_AT:-$(sed -n 's/^# Resolved at: \([^ ]*\).*/\1/p' requirements-gpu.lock 2>/dev/null | head -n 1)}
if [ -z "$resolved_at" ]; then
  echo "lock_gpu: set RESOLVED_AT (e.g. RESOLVED_AT=$(date -u +%Y-%m-%dT00:00:00Z)): requirements-gpu.lock names none" >&2
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# setup.py's install_requires + extras_require["gpu"], read without building the package.
python3 - >"$work/gpu.in" <<'PY'
import ast
tree = ast.parse(open("setup.py", encoding="utf-8").read())
names = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
         if isinstance(t, ast.Name)}
print("\n".join(ast.literal_eval(names["CORE"]) + ast.literal_eval(names["EXTRAS"])["gpu"]))
PY
constraints=()
if [ -n "${CHECK:-}" ]; then
  constraints=(--constraint "$CHECK")
fi
for v in 3.11 3.12; do
  "$uv" pip compile "$work/gpu.in" --quiet --no-header --no-annotate --python-platform x86_64-manylinux_2_28 \
    --python-version "$v" --exclude-newer "$resolved_at" "${constraints[@]}" -o "$work/$v.txt"
done
python3 - "$work/3.11.txt" "$work/3.12.txt" "$resolved_at" >"$work/lock" <<'PY'
import sys
def pins(path):
    return dict(line.split("==", 1) for line in open(path).read().split() if "==" in line)
a, b = pins(sys.argv[1]), pins(sys.argv[2])
print("# The GPU environment, exactly (CPython 3.11/3.12, manylinux_2_28 x86_64, torch 2.13.0 = CUDA 13, NVIDIA driver")
print("# >= 580). Made by scripts/lock_gpu.sh from setup.py's core + gpu requirements (uv, wheel metadata only).")
print("# Install: pip install --no-deps -r requirements-gpu.lock && pip install --no-deps -e .")
print("# then: pip install --no-build-isolation --no-deps transformer-engine-torch==2.11.0 (docker/Dockerfile)")
print(f"# Resolved at: {sys.argv[3]} (releases uploaded later are not seen; RESOLVED_AT=... moves it)")
for name in sorted(set(a) | set(b), key=str.lower):
    if a.get(name) == b.get(name):
        print(f"{name}=={a[name]}")
        continue
    for version, pins_ in (("3.11", a), ("3.12", b)):
        if name in pins_:
            print(f'{name}=={pins_[name]} ; python_version == "{version}"')
PY
mv "$work/lock" "$out"
echo "lock_gpu: wrote $out ($(grep -c '==' "$out") lines)"
