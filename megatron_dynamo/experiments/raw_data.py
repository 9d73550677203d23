"""The raw data of an ablation, small enough to commit: ``runs.csv`` (one row per run) and ``problems.csv.gz`` (per
run, per held-out problem, the number of correct samples), written from the run directories of ``dynamo ablate``
(``--raw-data DIR``) and read back by the preregistered analysis (``experiments/confirmatory.py``).

``runs.csv`` columns: ``variant`` (the ``dynamo ablate`` variant, or ``sft`` for the warm-up every variant starts
from), ``seed``, ``pass1`` and ``passk`` (held-out ``eval/avg/pass@1`` and ``pass@<k>`` of the final evaluation, as
fractions), ``k``, ``train_rollouts`` (responses generated over the whole run: every step's ``rollouts``, refills
of dynamic sampling included), ``steps`` (training steps logged), ``wall_seconds`` (the run's wall time as
``dynamo ablate`` measured it; empty when unknown). Rows: the display order of the variants, then seed.

``problems.csv.gz`` (gzip, no timestamp: the same runs give the same bytes): ``variant``, ``seed``, ``benchmark``,
``problem_id``, ``samples`` (n), ``correct`` (of n), the final evaluation's ``eval/step_*/samples.jsonl`` per
problem in its order. Held-out pass@1 of a run is the mean over its problems of correct / samples.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from megatron_dynamo.report.runs import load_run

RUNS_FILE = "runs.csv"
PROBLEMS_FILE = "problems.csv.gz"
RUNS_COLUMNS = ("variant", "seed", "pass1", "passk", "k", "train_rollouts", "steps", "wall_seconds")
PROBLEM_COLUMNS = ("variant", "seed", "benchmark", "problem_id", "samples", "correct")


@dataclass(frozen=True)
class FinishedRun:
    """A finished run of an ablation: its variant (``sft`` for the warm-up), seed, directory, wall seconds."""

    variant: str
    seed: int
    path: str
    seconds: float | None = None


def _number(value: Any) -> str:
    """A CSV cell: integers as such, floats with 10 significant digits, None empty."""
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{float(value):.10g}"


def final_eval_samples(path: str) -> str | None:
    """The ``samples.jsonl`` of a run's last evaluation (``eval/step_*``, the highest step), or None."""
    root = os.path.join(path, "eval")
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_")) if os.path.isdir(root) else []
    for step in reversed(steps):
        candidate = os.path.join(root, step, "samples.jsonl")
        if os.path.isfile(candidate):
            return candidate
    return None


def problem_counts(samples_path: str) -> list[tuple[str, str, int, int]]:
    """(benchmark, problem id, samples, correct) per problem of a ``samples.jsonl``, in order of first appearance."""
    counts: dict[tuple[str, str], list[int]] = {}
    with open(samples_path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            entry = counts.setdefault((str(record["benchmark"]), str(record["problem_id"])), [0, 0])
            entry[0] += 1
            entry[1] += int(bool(record["correct"]))
    return [(bench, pid, n, c) for (bench, pid), (n, c) in counts.items()]


def run_row(run: FinishedRun, k: int) -> dict[str, Any]:
    """The ``runs.csv`` row of a finished run, from its metrics.jsonl (the last row holding an evaluation)."""
    records = load_run(run.path).records
    evaluated = [r for r in records if "eval/avg/pass@1" in r]
    final = evaluated[-1] if evaluated else {}
    training = [r for r in records if r.get("step", 0) >= 1 and "reward_mean" in r]
    return {"variant": run.variant, "seed": int(run.seed), "pass1": final.get("eval/avg/pass@1"),
            "passk": final.get(f"eval/avg/pass@{k}"), "k": int(k),
            "train_rollouts": int(sum(int(r.get("rollouts", 0)) for r in training)), "steps": len(training),
            "wall_seconds": None if run.seconds is None else round(float(run.seconds), 1)}


def _csv_text(columns: Sequence[str], rows: Iterable[dict[str, Any] | Sequence[Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        values = [row[c] for c in columns] if isinstance(row, dict) else list(row)
        writer.writerow([v if isinstance(v, str) else _number(v) for v in values])
    return out.getvalue()


def write_raw_data(output_dir: str, runs: Sequence[FinishedRun], k: int) -> dict[str, str]:
    """``runs.csv`` and ``problems.csv.gz`` of ``runs`` (in the given order) into ``output_dir``; their paths."""
    os.makedirs(output_dir, exist_ok=True)
    rows, problems = [], []
    for run in runs:
        rows.append(run_row(run, k))
        samples = final_eval_samples(run.path)
        for bench, pid, n, correct in problem_counts(samples) if samples else []:
            problems.append((run.variant, int(run.seed), bench, pid, n, correct))
    paths = {"runs": os.path.join(output_dir, RUNS_FILE), "problems": os.path.join(output_dir, PROBLEMS_FILE)}
    with open(paths["runs"], "w", encoding="utf-8") as f:
        f.write(_csv_text(RUNS_COLUMNS, rows))
    with open(paths["problems"], "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(_csv_text(PROBLEM_COLUMNS, problems).encode("utf-8"))
    return paths


def _cell(value: str) -> Any:
    if value == "":
        return None
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            return value


def read_runs(path: str) -> list[dict[str, Any]]:
    """The rows of a ``runs.csv`` (numbers parsed; ``variant`` stays a string; empty cells None)."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in RUNS_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        return [{key: (value if key == "variant" else _cell(value)) for key, value in row.items()} for row in reader]


def read_problem_counts(path: str) -> list[dict[str, Any]]:
    """The rows of a ``problems.csv.gz`` (``samples`` and ``correct`` as integers)."""
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        return [{**row, "seed": int(row["seed"]), "samples": int(row["samples"]), "correct": int(row["correct"])}
                for row in csv.DictReader(f)]


__all__ = ["FinishedRun", "PROBLEMS_FILE", "PROBLEM_COLUMNS", "RUNS_COLUMNS", "RUNS_FILE", "final_eval_samples",
           "problem_counts", "read_problem_counts", "read_runs", "run_row", "write_raw_data"]
