#!/usr/bin/env bash
# The second preregistered study (docs/ablation.md, "Preregistration: the second study"): the eight factorial
# variants x seeds 16..34, 152 runs, resumable, in parts, on any machine. One call, seed-major (each seed's eight runs
# together, on one machine). Ctrl-C pauses it: the running runs stop after their step, the raw data of every finished
# run is written to benchmarks/results/confirmatory2; commit it. Run this script again, here or elsewhere, to go on.
# The runs' directories go outside the work tree: $DYNAMO_CONFIRMATORY2_DIR, default
# ~/dynamo-experiments/confirmatory2. Keep the cores for it: every run is pinned to one of two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${DYNAMO_CONFIRMATORY2_DIR:-$HOME/dynamo-experiments/confirmatory2}
dynamo ablate configs/cpu_testbed.yaml evaluation.limit=1500 --variants factorial \
  --seeds "$(seq -s, 16 34)" --jobs 2 --threshold 0.2 --output-dir "$out" \
  --raw-data benchmarks/results/confirmatory2
dynamo confirm benchmarks/results/confirmatory2 --write docs/results/testbed.md
