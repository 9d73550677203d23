#!/usr/bin/env bash
# The GPU check: one command that exercises every GPU path of the project on ONE GPU and writes a dated report
# (date, commit, GPU, versions, the command, each part's pass/fail and numbers). Run it from anywhere; it works in
# the repository root. The driver is benchmarks/gpu_check.py, the parts live in benchmarks/gpu_check_parts/ (one
# process per part, each with its own time limit, every part runs whatever happened to the ones before).
#
#   scripts/gpu_check.sh                      all parts (budget: the sum of their limits, about an hour)
#   scripts/gpu_check.sh --list               the parts, their time limits and what they need
#   scripts/gpu_check.sh --part vllm          one part (repeat --part, or give a comma-separated list)
#   scripts/gpu_check.sh --append-report F..  append reports written elsewhere (a device machine) to docs/changelog.md
#
# Options:
#   --out DIR            where gpu_check_report.md, gpu_check.json and gpu_check.log go
#                        (default: $OUT when set, e.g. on the lent device machine, else outputs/gpu_check/<stamp>)
#   --total-seconds N    time budget of the whole command (default: the sum of the chosen parts' limits plus 15 s
#                        each and 120 s for installs; all parts: 4155 s); a part gets min(its limit, what is left),
#                        and a part with under 60 s left is NOT RUN (on the device tool, whose commands stop at
#                        600 s: --total-seconds 580 and few parts)
#   --commit HASH        the commit to report where the checkout has no git metadata (the device machine's copy)
#   --no-append          do not append the report to docs/changelog.md (default: append when CUDA ran)
#   --install            also try pip (network) for megatron-core / math-verify / psutil when they are missing
#   --strict             a part skipped for a missing package counts as failed (exit non-zero)
#   --cpu                developers: run the parts that have a CPU variant with tiny shapes (never appended)
#
# Packages: wheels in .whl/ (or $GPU_CHECK_WHEELS) of packages this Python lacks are installed into
# /tmp/gpu_check_site first: scripts/gpu_wheels.sh downloads megatron-core and math-verify for the device
# machine's Python. A part whose packages are missing (Transformer Engine, vLLM on the lent machine) says what is
# missing and is skipped. Without CUDA every part says "skipped: no CUDA" and the command exits 0.
# Exit status: 0 when every part passed or was skipped (no CUDA, missing package), 1 when one failed, 3 when none
# failed but one was NOT RUN (the budget was spent before it), 2 for a usage error.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 2
PY=${GPU_CHECK_PYTHON:-python3}
check=benchmarks/gpu_check.py
results_md=${GPU_CHECK_RESULTS_MD:-docs/changelog.md}  # tests point this elsewhere

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

append_reports() {
  local file status=0
  if (($# == 0)); then
    echo "gpu_check: --append-report needs at least one report file" >&2
    return 2
  fi
  for file in "$@"; do
    if [[ ! -f $file ]] || ! head -n 1 "$file" | grep -q '^## GPU check'; then
      echo "gpu_check: $file is not a gpu_check report (it must start with '## GPU check')" >&2
      status=2
      continue
    fi
    { printf '\n'; cat "$file"; } >>"$results_md"
    echo "gpu_check: appended $file to $results_md"
  done
  return "$status"
}

parts=()
out_dir=""
total=""
commit=""
append=1
install_pip=0
strict=0
cpu=0
list=0
args_given=("$@")
while (($#)); do
  case $1 in
    --list) list=1 ;;
    --part | --parts)
      [[ $# -ge 2 ]] || { echo "gpu_check: $1 needs a value" >&2; exit 2; }
      IFS=, read -r -a more <<<"$2"
      parts+=("${more[@]}")
      shift ;;
    --part=* | --parts=*)
      IFS=, read -r -a more <<<"${1#*=}"
      parts+=("${more[@]}") ;;
    --out)
      [[ $# -ge 2 ]] || { echo "gpu_check: --out needs a directory" >&2; exit 2; }
      out_dir=$2
      shift ;;
    --total-seconds)
      [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || { echo "gpu_check: --total-seconds needs a number" >&2; exit 2; }
      total=$2
      shift ;;
    --commit)
      [[ $# -ge 2 ]] || { echo "gpu_check: --commit needs a value" >&2; exit 2; }
      commit=$2
      shift ;;
    --no-append) append=0 ;;
    --install) install_pip=1 ;;
    --strict) strict=1 ;;
    --cpu) cpu=1 ;;
    --append-report)
      shift
      append_reports "$@"
      exit $? ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (--help lists the options)" >&2; exit 2 ;;
  esac
  shift
done
if [[ ${GPU_CHECK_CPU:-0} == 1 ]]; then
  cpu=1
fi

if ((list)); then
  exec "$PY" "$check" list
fi

# Part names and time limits, in the check's order.
declare -A limit_of=()
all_parts=()
while IFS=$'\t' read -r name seconds; do
  all_parts+=("$name")
  limit_of[$name]=$seconds
done < <("$PY" "$check" list --tsv)
if ((${#all_parts[@]} == 0)); then
  echo "gpu_check: '$PY $check list' printed no part (is $PY a working Python?)" >&2
  exit 2
fi
if ((${#parts[@]} == 0)); then
  parts=("${all_parts[@]}")
fi
"$PY" "$check" list --validate "${parts[@]}" || exit 2
if [[ -z $total ]]; then  # the budget covers every chosen part at its full limit
  total=120
  for part in "${parts[@]}"; do
    total=$((total + ${limit_of[$part]} + 15))
  done
fi

if [[ -z $out_dir ]]; then
  if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then
    out_dir=$OUT
  else
    out_dir=outputs/gpu_check/$(date -u +%Y%m%d-%H%M%S)
  fi
fi
mkdir -p "$out_dir" || exit 2
log=$out_dir/gpu_check.log
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
# shellcheck disable=SC2329  # invoked by the EXIT trap
cleanup() {
  if [[ ${GPU_CHECK_KEEP_WORK:-0} == 1 ]]; then
    echo "gpu_check: scratch kept in $work"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

command_line="scripts/gpu_check.sh"
if ((${#args_given[@]})); then
  command_line+=$(printf ' %q' "${args_given[@]}")
fi
say() {
  echo "[gpu_check] $*" | tee -a "$log"
}
start=$SECONDS  # the budget covers everything: installs, environment, parts
say "$(date -u '+%Y-%m-%d %H:%M:%S UTC'): $command_line"
say "parts: ${parts[*]}; total budget ${total} s; report and log in $out_dir"

# Packages: carried wheels first, then (with --install) the network, then the repo itself on the path.
site=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
install_args=(install --target "$site" --wheels "${GPU_CHECK_WHEELS:-$repo/.whl}")
if ((install_pip)); then
  install_args+=(--pip)
fi
"$PY" "$check" "${install_args[@]}" 2>&1 | tee -a "$log"
pythonpath=$repo
if [[ -d $site ]]; then
  pythonpath+=:$site
fi
export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

env_args=(env --json "$work/env.json")
if [[ -n $commit ]]; then
  env_args+=(--commit "$commit")
fi
"$PY" "$check" "${env_args[@]}" 2>&1 | tee -a "$log"
if [[ ! -s $work/env.json ]]; then
  say "could not read the environment (does '$PY -c \"import torch\"' work?); nothing was run"
  exit 1
fi

run_args=()
if ((cpu)); then
  run_args+=(--cpu)
fi

# Interrupting the check stops the part in flight (timeout forwards the signal to the part's process group).
part_pid=""
interrupted=0
# shellcheck disable=SC2329  # invoked by the INT/TERM trap
on_signal() {
  interrupted=1
  if [[ -n $part_pid ]]; then
    kill -TERM "$part_pid" 2>/dev/null
  fi
}
trap on_signal INT TERM

for part in "${parts[@]}"; do
  if ((interrupted)); then
    echo "rc=interrupted seconds=0 limit=0" >"$work/$part.status"
    continue
  fi
  left=$((total - (SECONDS - start)))
  limit=${limit_of[$part]}
  if ((left - 15 < limit)); then
    limit=$((left - 15))
  fi
  if ((limit < 60)); then
    say "=== $part: skipped, the total budget is spent (${left} s left)"
    echo "rc=budget seconds=0 limit=$left" >"$work/$part.status"
    continue
  fi
  say "=== $part (time limit ${limit} s) ==="
  part_start=$SECONDS
  timeout -k 20 "$limit" "$PY" "$check" run "$part" --env "$work/env.json" --result "$work/$part.json" \
    --work "$work/$part" --timeout "$limit" "${run_args[@]}" > >(tee -a "$log") 2>&1 &
  part_pid=$!
  wait "$part_pid"
  rc=$?
  if ((interrupted)); then
    wait "$part_pid" 2>/dev/null
    rc=130
  fi
  part_pid=""
  status_line="rc=$rc seconds=$((SECONDS - part_start)) limit=$limit"
  if command -v nvidia-smi >/dev/null 2>&1; then
    leftover=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null |
      tr -d ' ' | paste -sd ';' -)
    if [[ -n $leftover ]]; then
      say "GPU processes still running after $part: $leftover"
      status_line+=" leftover=$leftover"
    fi
  fi
  echo "$status_line" >"$work/$part.status"
  # Anything the part left in the scratch directory (models, checkpoints) goes now: the disk is shared.
  rm -rf "${work:?}/$part"
done
trap - INT TERM

report_args=(report --work "$work" --parts "${parts[*]}" --command "$command_line" --out-dir "$out_dir")
if ((append)); then
  report_args+=(--append "$results_md")
fi
if ((cpu)); then
  report_args+=(--cpu)
fi
if ((strict)); then
  report_args+=(--strict)
fi
"$PY" "$check" "${report_args[@]}" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
if ((interrupted)); then
  status=130
fi
exit "$status"
