"""Reading training runs for ``dynamo report``: run directories, ``dynamo compare`` directories, metric series.

Only files are read (``metrics.jsonl``, ``prompts.jsonl``, ``comparison.json``); nothing of the trainer is
imported. Metric keys are looked up by name with fallbacks (:data:`KEYS`), so runs logged before or after a key
rename both read: the first candidate any row has wins, else a key whose last ``/`` component is a candidate's.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

METRICS_FILE = "metrics.jsonl"
PROMPTS_FILE = "prompts.jsonl"
COMPARISON_FILE = "comparison.json"

# What a panel needs -> metric keys, preferred first (the trainer's names, then plausible renamed ones).
KEYS: dict[str, tuple[str, ...]] = {
    "reward": ("reward_mean", "reward/mean", "reward/reward_mean", "reward/accuracy", "reward/reward/accuracy"),
    "entropy": ("entropy_mean", "entropy/mean", "actor/entropy_mean", "actor/entropy"),
    "response_length": ("response_length_mean", "response_length/mean", "response/length_mean",
                        "rollout/response_length_mean"),
    "variance_ratio": ("variance_ratio", "allocation/variance_ratio", "alloc/variance_ratio"),
    "alloc_counts": ("alloc_counts", "allocation/counts", "alloc/counts", "allocation/alloc_counts"),
    "rollouts": ("rollouts", "allocation/rollouts", "alloc/rollouts"),
    "scale_mean": ("modulation/scale_mean",),
    "scale_p10": ("modulation/scale_p10",),
    "scale_p90": ("modulation/scale_p90",),
    "beta_stab_mean": ("modulation/beta_stab_mean",),
    "beta_stab_min": ("modulation/beta_stab_min",),
    "beta_comp_mean_pos": ("modulation/beta_comp_mean_pos",),
}
_EVAL_KEY = re.compile(r"^(?:.*/)?eval/(?P<bench>[^/]+)/pass@(?P<k>\d+)$")


class ReportInputError(ValueError):
    """A RUN_DIR argument that is neither a run nor a ``dynamo compare`` directory (one-line message)."""


@dataclass
class Run:
    label: str
    path: str
    records: list[dict[str, Any]]
    prompts: list[dict[str, Any]] | None = None  # None: the run has no prompts.jsonl
    source: str = "run"  # "run", or "compare:<dir>" for a run expanded from a dynamo compare directory
    warnings: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return sorted({r["step"] for r in self.records if _has_training(r)})


def _has_training(record: dict[str, Any]) -> bool:
    """A training step's row (a step-0 row of a start-of-run evaluation holds only eval keys)."""
    return any(not k.startswith(("eval/", "time/eval")) for k in record if k != "step")


def read_jsonl(path: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of ``path`` with an integer ``step``, and the number of lines skipped (torn or foreign)."""
    rows, skipped = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
                rows.append(row)
            else:
                skipped += 1
    return rows, skipped


def load_run(path: str, label: str | None = None, source: str = "run") -> Run:
    metrics_path = os.path.join(path, METRICS_FILE)
    records, skipped = read_jsonl(metrics_path)
    warnings = [f"{metrics_path}: {skipped} unreadable line(s) skipped"] if skipped else []
    # A resumed run's file holds each step once; keep the last row of a step should one appear twice.
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        by_step[r["step"]] = {**by_step.get(r["step"], {}), **r}
    prompts = None
    prompts_path = os.path.join(path, PROMPTS_FILE)
    if os.path.isfile(prompts_path):
        prompts, skipped = read_jsonl(prompts_path)
        prompts = [p for p in prompts if _number(p.get("count")) is not None and _number(p.get("correct")) is not None]
        if skipped:
            warnings.append(f"{prompts_path}: {skipped} unreadable line(s) skipped")
    return Run(label=label or _default_label(path), path=path, records=[by_step[s] for s in sorted(by_step)],
               prompts=prompts, source=source, warnings=warnings)


def _default_label(path: str) -> str:
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if len(parts) >= 2 and re.fullmatch(r"seed\d+", parts[-1]):  # <compare dir>/<variant>/seed<S>
        return f"{parts[-2]} {parts[-1]}"
    return parts[-1] or path


def _compare_runs(path: str) -> list[tuple[str, str]]:
    """(run dir, label) of a ``dynamo compare`` output directory: the runs of its comparison.json (found by the
    recorded path, else at ``<dir>/<variant>/seed<S>``), else every ``<dir>/<variant>/seed<S>`` with metrics."""
    found: list[tuple[str, str]] = []
    comparison = os.path.join(path, COMPARISON_FILE)
    if os.path.isfile(comparison):
        try:
            with open(comparison, encoding="utf-8") as f:
                result = json.load(f)
            entries = result.get("runs", []) if isinstance(result, dict) else []
        except (OSError, json.JSONDecodeError) as exc:
            raise ReportInputError(f"{comparison}: not readable JSON ({exc})") from None
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            variant, seed = entry.get("variant"), entry.get("seed")
            candidates = [entry.get("output_dir")] if isinstance(entry.get("output_dir"), str) else []
            if variant is not None and seed is not None:
                candidates.append(os.path.join(path, str(variant), f"seed{seed}"))
            for candidate in candidates:
                if candidate and os.path.isfile(os.path.join(candidate, METRICS_FILE)):
                    label = f"{variant} seed {seed}" if variant is not None else _default_label(candidate)
                    found.append((candidate, label))
                    break
    if not found:  # no comparison.json (an interrupted compare) or its runs moved: the directory layout
        for variant in sorted(os.listdir(path)):
            variant_dir = os.path.join(path, variant)
            if not os.path.isdir(variant_dir):
                continue
            seeds = [d for d in os.listdir(variant_dir) if re.fullmatch(r"seed\d+", d)
                     and os.path.isfile(os.path.join(variant_dir, d, METRICS_FILE))]
            for seed_dir in sorted(seeds, key=lambda d: int(d[4:])):
                found.append((os.path.join(variant_dir, seed_dir), f"{variant} seed {seed_dir[4:]}"))
    return found


def expand_inputs(paths: Sequence[str], labels: Sequence[str] | None = None) -> list[Run]:
    """The runs of the RUN_DIR arguments, in order: a directory with ``metrics.jsonl`` is one run; a
    ``dynamo compare`` output directory expands into its runs. ``labels`` name the expanded runs, in order."""
    if not paths:
        raise ReportInputError("give at least one RUN_DIR")
    targets: list[tuple[str, str, str]] = []
    for path in paths:
        if not os.path.isdir(path):
            raise ReportInputError(f"{path}: no such directory")
        if os.path.isfile(os.path.join(path, METRICS_FILE)):
            targets.append((path, _default_label(path), "run"))
            continue
        runs = _compare_runs(path)
        if not runs:
            raise ReportInputError(f"{path}: not a run directory (no {METRICS_FILE}) nor a dynamo compare "
                                   f"directory (no {COMPARISON_FILE} or <variant>/seed<S>/{METRICS_FILE})")
        targets.extend((run_dir, label, f"compare:{path}") for run_dir, label in runs)
    if labels:
        if len(labels) != len(targets):
            raise ReportInputError(f"--labels gives {len(labels)} label(s) for {len(targets)} run(s): "
                                   + ", ".join(label for _, label, _ in targets))
        targets = [(path, label, source) for (path, _, source), label in zip(targets, labels)]
    seen: dict[str, int] = {}
    runs = []
    for path, label, source in targets:
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:  # two runs called "run" (e.g. a/run and b/run): keep the legend unambiguous
            label = f"{label} ({seen[label]})"
        try:
            runs.append(load_run(path, label, source))
        except OSError as exc:
            raise ReportInputError(f"{path}: cannot read {METRICS_FILE} ({exc.strerror or exc})") from None
    return runs


# ---------------------------------------------------------------------------------------------- series
def _number(value: Any) -> float | None:
    """A finite float from a logged value (the logger writes non-finite floats as strings), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        value = float(value)
    elif isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    else:
        return None
    return value if math.isfinite(value) else None


def find_key(records: Iterable[dict[str, Any]], candidates: Sequence[str]) -> str | None:
    """The first of ``candidates`` that some record has; else a key whose last ``/`` component equals a
    candidate's last component (a renamed prefix); else None."""
    keys: list[str] = []
    for r in records:
        keys.extend(k for k in r if k not in keys)
    for candidate in candidates:
        if candidate in keys:
            return candidate
    for candidate in candidates:
        tail = candidate.rsplit("/", 1)[-1]
        matches = [k for k in keys if k.rsplit("/", 1)[-1] == tail and not k.startswith("eval/")]
        if matches:
            return matches[0]
    return None


def series(run: Run, what: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a scalar metric (``what`` names a :data:`KEYS` entry); steps without a finite value
    are left out."""
    key = find_key(run.records, KEYS[what])
    steps, values = [], []
    if key is None:
        return steps, values
    for r in run.records:
        value = _number(r.get(key))
        if value is not None:
            steps.append(r["step"])
            values.append(value)
    return steps, values


def alloc_counts(run: Run) -> dict[int, list[int]]:
    """Per step, the rollout count of every prompt (``alloc_counts``)."""
    key = find_key(run.records, KEYS["alloc_counts"])
    out: dict[int, list[int]] = {}
    if key is None:
        return out
    for r in run.records:
        counts = r.get(key)
        if isinstance(counts, list) and counts:
            values = [_number(c) for c in counts]
            out[r["step"]] = [int(v) for v in values if v is not None]
    return {s: c for s, c in out.items() if c}


def eval_series(run: Run) -> dict[tuple[str, int], tuple[list[int], list[float]]]:
    """``eval/<benchmark>/pass@<k>`` -> (steps, values), for every benchmark (``avg`` included) and k."""
    out: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
    for r in run.records:
        for key, raw in r.items():
            match = _EVAL_KEY.match(key)
            value = _number(raw)
            if match and value is not None:
                steps, values = out.setdefault((match["bench"], int(match["k"])), ([], []))
                steps.append(r["step"])
                values.append(value)
    return out


def prompt_points(run: Run) -> tuple[list[float], list[int]]:
    """Per prompt and step of ``prompts.jsonl``: (success rate of its rollouts, rollouts allocated)."""
    rates, counts = [], []
    for row in run.prompts or []:
        count, correct = _number(row.get("count")), _number(row.get("correct"))
        if count and count > 0 and correct is not None:
            rates.append(min(1.0, max(0.0, correct / count)))
            counts.append(int(count))
    return rates, counts


def moving_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start, so the curve starts at the first step)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


