#!/usr/bin/env bash
# The preregistered replication (docs/ablation.md, "Preregistration"): its 152 runs, resumable, in parts, on any
# machine. The runs are the preregistered commands' own (the same recipe, overrides, seeds, variants, threshold and
# raw data); they are started seed-major over both commands' variants, so that each seed's runs finish together on
# one machine (see the preregistration's "Deviations"):
#   1. --variants confirmatory,high_lr --seeds 6..13   (16 runs a seed)
#   2. --variants confirmatory --seeds 14,15           (12 runs a seed; the high-lr grid stops at seed 13)
# Ctrl-C pauses it: the running runs stop after their step, the raw data of every finished run is written to
# benchmarks/results/confirmatory; commit it. Run this script again, here or on another machine, to go on: a run in
# the raw data is not run again, a seed left unfinished on another machine is rerun here whole.
# The runs' directories go outside the work tree (a checkout may be laid anew; the machine may be kept):
# $DYNAMO_CONFIRMATORY_DIR, default ~/dynamo-experiments/confirmatory. Keep the cores for it: every run is pinned
# to one of two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${DYNAMO_CONFIRMATORY_DIR:-$HOME/dynamo-experiments/confirmatory}
common=(configs/cpu_testbed.yaml evaluation.limit=1500 --jobs 2 --threshold 0.2 --output-dir "$out"
        --raw-data benchmarks/results/confirmatory)
dynamo ablate "${common[@]}" --variants confirmatory,high_lr --seeds 6,7,8,9,10,11,12,13
dynamo ablate "${common[@]}" --variants confirmatory --seeds 14,15
dynamo confirm benchmarks/results/confirmatory --write docs/results/testbed.md
