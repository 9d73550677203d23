"""The raw data of an ablation, small enough to commit: ``runs.csv`` (one row per run), ``problems.csv.gz`` (per
run, per held-out problem, the number of correct samples) and ``plan.json`` (the plan the runs belong to), written
from the run directories of ``dynamo ablate`` (``--raw-data DIR``) and read back by the preregistered analysis
(``experiments/confirmatory.py``) and by a later ``dynamo ablate --raw-data DIR`` on another machine, which then
runs only what is missing.

``runs.csv`` columns: ``variant`` (the ``dynamo ablate`` variant, or ``sft`` for the warm-up every variant starts
from), ``seed``, ``pass1`` and ``passk`` (held-out ``eval/avg/pass@1`` and ``pass@<k>`` of the final evaluation, as
fractions), ``k``, ``train_rollouts`` (responses generated over the whole run: every step's ``rollouts``, refills
of dynamic sampling included), ``steps`` (training steps logged), ``wall_seconds`` (the run's wall time as
``dynamo ablate`` measured it; empty when unknown), ``machine`` (CPU model, cores, torch version:
``experiments/provenance.py``) and ``warmup`` (the hash of the warm-up checkpoint the run started from; the warm-up's
own for an ``sft`` row). Rows: the warm-ups, then the display order of the variants, then seed.

``problems.csv.gz`` (gzip, no timestamp: the same runs give the same bytes): ``variant``, ``seed``, ``warmup``,
``benchmark``, ``problem_id``, ``samples`` (n), ``correct`` (of n), the final evaluation's
``eval/step_*/samples.jsonl`` per problem in its order. Held-out pass@1 of a run is the mean over its problems of
correct / samples.

Which rows a write keeps (:func:`merge_rows`): a seed's runs are paired, so all of them come from one machine and
one warm-up. Per seed the group (machine, warm-up) with the most runs is kept, this call's own on a tie; the runs of
another group are left out (their seed is rerun where it resumes).
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from megatron_dynamo.experiments.provenance import check_one_group_per_seed, group_of
from megatron_dynamo.experiments.variants import SFT
from megatron_dynamo.report.runs import load_run

RUNS_FILE = "runs.csv"
PROBLEMS_FILE = "problems.csv.gz"
PLAN_FILE = "plan.json"
RUNS_COLUMNS = ("variant", "seed", "pass1", "passk", "k", "train_rollouts", "steps", "wall_seconds", "machine",
                "warmup")
PROBLEM_COLUMNS = ("variant", "seed", "warmup", "benchmark", "problem_id", "samples", "correct")
#: Columns an older file may lack (read as empty): it recorded no machine and no warm-up.
PROVENANCE_COLUMNS = ("machine", "warmup")


@dataclass(frozen=True)
class FinishedRun:
    """A finished run of an ablation: its variant (``sft`` for the warm-up), seed, directory, wall seconds, the
    machine it ran on and the hash of the warm-up checkpoint it started from."""

    variant: str
    seed: int
    path: str
    seconds: float | None = None
    machine: str = ""
    warmup: str = ""


@dataclass
class RawData:
    """What a raw-data directory holds: the runs.csv rows, the problems.csv.gz rows and the plan (None: none yet)."""

    rows: list[dict[str, Any]]
    problems: list[dict[str, Any]]
    plan: dict[str, Any] | None = None

    def problems_of(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The problems.csv.gz rows of one runs.csv row, in their order."""
        return self._problems_by_run.get((row["variant"], int(row["seed"]), str(row.get("warmup") or "")), [])

    @functools.cached_property
    def _problems_by_run(self) -> dict[tuple[str, int, str], list[dict[str, Any]]]:
        # grouped once: a write keeps up to every recorded run, each with 1500 problems
        grouped: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        for p in self.problems:
            grouped.setdefault((p["variant"], p["seed"], p["warmup"]), []).append(p)
        return grouped


@dataclass(frozen=True)
class RecordedRuns:
    """The runs a raw-data directory holds, as one call of ``dynamo ablate`` sees them: ``rows`` (the variant runs
    by (variant, seed)) and ``complete_seeds``, the seeds of the call whose every run is recorded, all from one
    machine and one warm-up: nothing of them runs here."""

    rows: Mapping[tuple[str, int], Mapping[str, Any]]
    complete_seeds: frozenset[int]

    @classmethod
    def of(cls, rows: Iterable[Mapping[str, Any]], seeds: Iterable[int], variants: Sequence[str]) -> "RecordedRuns":
        by_key = {(r["variant"], int(r["seed"])): r for r in rows if r["variant"] != SFT}
        complete = frozenset(seed for seed in seeds
                             if all((v, seed) in by_key for v in variants)
                             and len({group_of(r) for (_, s), r in by_key.items() if s == seed}) == 1)
        return cls(by_key, complete)

    def variants_of(self, seed: int) -> list[str]:
        return [variant for variant, s in self.rows if s == seed]

    def counts_here(self, key: tuple[str, int], group: tuple[str, str]) -> bool:
        """Whether run ``key`` is recorded from ``group`` (this machine and this warm-up): then it need not run."""
        row = self.rows.get(key)
        return row is not None and group_of(row) == group


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
            "wall_seconds": None if run.seconds is None else round(float(run.seconds), 1),
            "machine": run.machine, "warmup": run.warmup}


def run_problems(run: FinishedRun) -> list[dict[str, Any]]:
    """The ``problems.csv.gz`` rows of a finished run (none when it left no final evaluation samples)."""
    samples = final_eval_samples(run.path)
    return [{"variant": run.variant, "seed": int(run.seed), "warmup": run.warmup, "benchmark": bench,
             "problem_id": pid, "samples": n, "correct": correct}
            for bench, pid, n, correct in (problem_counts(samples) if samples else [])]


def merge_rows(local: Sequence[Mapping[str, Any]], recorded: Sequence[Mapping[str, Any]],
               variant_order: Sequence[str]) -> list[Mapping[str, Any]]:
    """The rows to keep of this call's finished runs (``local``) and of the file's (``recorded``): per seed the runs
    of one (machine, warm-up), the group with the most runs (``local``'s on a tie), a local row over a recorded row
    of the same run; the warm-up rows of the groups kept (and the local one). Ordered: warm-ups, then
    ``variant_order`` (variants not in it after, by name), then seed."""
    by_seed: dict[int, dict[tuple[str, str], dict[str, Mapping[str, Any]]]] = {}
    for rows, is_local in ((recorded, False), (local, True)):
        for row in rows:
            if row["variant"] != SFT:
                group = by_seed.setdefault(int(row["seed"]), {}).setdefault(group_of(row), {})
                group[row["variant"]] = row  # local rows come second: they replace a recorded one
    local_groups = {group_of(r) for r in local}
    kept: list[Mapping[str, Any]] = []
    for seed, groups in by_seed.items():
        best = max(groups, key=lambda g: (len(groups[g]), g in local_groups))
        kept.extend(groups[best].values())
    used = {group_of(r) for r in kept} | {group_of(r) for r in local if r["variant"] == SFT}
    warmups: dict[tuple[str, str], Mapping[str, Any]] = {}
    for row in [*recorded, *local]:
        if row["variant"] == SFT and group_of(row) in used:
            warmups[group_of(row)] = row
    order = {name: i for i, name in enumerate(variant_order)}
    kept.sort(key=lambda r: (order.get(r["variant"], len(order)), r["variant"], int(r["seed"])))
    return [warmups[g] for g in sorted(warmups)] + kept


def _csv_text(columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        values = [row.get(c) for c in columns]
        writer.writerow([v if isinstance(v, str) else _number(v) for v in values])
    return out.getvalue()


def write_raw_data(output_dir: str, rows: Sequence[Mapping[str, Any]], problems: Sequence[Mapping[str, Any]],
                   plan: Mapping[str, Any] | None = None) -> dict[str, str]:
    """``runs.csv`` (``rows`` in the given order), ``problems.csv.gz`` and (``plan``) ``plan.json`` into
    ``output_dir``; their paths. Each file is written to a temporary name and renamed: a stop halfway leaves the
    previous files whole."""
    os.makedirs(output_dir, exist_ok=True)
    paths = {"runs": os.path.join(output_dir, RUNS_FILE), "problems": os.path.join(output_dir, PROBLEMS_FILE)}
    contents = {"runs": _csv_text(RUNS_COLUMNS, rows).encode("utf-8")}
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
        f.write(_csv_text(PROBLEM_COLUMNS, problems).encode("utf-8"))
    contents["problems"] = raw.getvalue()
    if plan is not None:
        paths["plan"] = os.path.join(output_dir, PLAN_FILE)
        contents["plan"] = (json.dumps(plan, indent=1, sort_keys=True) + "\n").encode("utf-8")
    for name, path in paths.items():
        with open(path + ".tmp", "wb") as f:
            f.write(contents[name])
        os.replace(path + ".tmp", path)
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


_TEXT_COLUMNS = ("variant", "machine", "warmup")


def read_runs(path: str) -> list[dict[str, Any]]:
    """The rows of a ``runs.csv`` (numbers parsed; ``variant``, ``machine`` and ``warmup`` stay strings, empty
    where an older file lacks them; other empty cells None)."""
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in RUNS_COLUMNS if c not in (reader.fieldnames or []) and c not in PROVENANCE_COLUMNS]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}")
        rows = [{key: (value if key in _TEXT_COLUMNS else _cell(value)) for key, value in row.items()}
                for row in reader]
    for row in rows:
        for column in PROVENANCE_COLUMNS:
            row[column] = row.get(column) or ""
    return rows


def read_paired_runs(path: str) -> list[dict[str, Any]]:
    """:func:`read_runs`, and ValueError (one line) when a seed's runs span two machines or two warm-ups: the runs
    of a seed are paired, so they must be comparable bit for bit (:func:`~.provenance.check_one_group_per_seed`)."""
    rows = read_runs(path)
    check_one_group_per_seed(rows)
    return rows


def read_problem_counts(path: str) -> list[dict[str, Any]]:
    """The rows of a ``problems.csv.gz`` (``samples`` and ``correct`` as integers; ``warmup`` empty where an older
    file lacks it)."""
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        return [{**row, "seed": int(row["seed"]), "warmup": row.get("warmup") or "", "samples": int(row["samples"]),
                 "correct": int(row["correct"])} for row in csv.DictReader(f)]


def read_raw_data(directory: str) -> RawData | None:
    """The raw data in ``directory``, or None when it has no runs.csv. ValueError (one line) for a runs.csv without
    its problems.csv.gz or plan.json, or any file that does not parse."""
    runs = os.path.join(directory, RUNS_FILE)
    if not os.path.isfile(runs):
        return None
    rows = read_runs(runs)
    problems_path, plan_path = os.path.join(directory, PROBLEMS_FILE), os.path.join(directory, PLAN_FILE)
    for path in (problems_path, plan_path):
        if not os.path.isfile(path):
            raise ValueError(f"{directory} has {RUNS_FILE} but no {os.path.basename(path)}: its runs cannot be "
                             "reused; use another --raw-data DIR")
    try:
        problems = read_problem_counts(problems_path)
        with open(plan_path, encoding="utf-8") as f:
            plan = json.load(f)
    except (OSError, ValueError, KeyError, EOFError) as exc:
        raise ValueError(f"{directory}: {exc}") from None
    return RawData(rows, problems, plan)


__all__ = ["FinishedRun", "PLAN_FILE", "PROBLEMS_FILE", "PROBLEM_COLUMNS", "PROVENANCE_COLUMNS", "RUNS_COLUMNS",
           "RUNS_FILE", "RawData", "RecordedRuns", "final_eval_samples", "merge_rows", "problem_counts",
           "read_paired_runs", "read_problem_counts", "read_raw_data", "read_runs", "run_problems", "run_row",
           "write_raw_data"]
