"""The Collector stage: what a run left in its directory. Its metrics and prompts (:func:`read_run`), its
checkpoints, its state for a resume (:func:`run_state`: done / resume / fresh), its wall time
(``ablate_run.json``: :func:`record_seconds`, :func:`run_record`) and the numbers of every finished run of an
ablation (:func:`collect`, one :func:`~megatron_dynamo.experiments.stats.run_summary` each)."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Sequence

from megatron_dynamo.experiments.plan import RunSpec
from megatron_dynamo.experiments.stats import has_final_eval, run_summary, training_rows
from megatron_dynamo.experiments.variants import SFT
from megatron_dynamo.report.runs import METRICS_FILE, load_run
from megatron_dynamo.trainer.checkpoint import list_checkpoints

# In a finished run's directory: its wall time, so that a later call that reuses the run (another --threshold, more
# seeds) still reports it (ablation.json; scripts/power_calc.py reads run times from there).
RUN_RECORD = "ablate_run.json"


def read_run(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(metrics records, prompts rows or None) of a run directory; empty when it has no metrics yet."""
    if not os.path.isfile(os.path.join(path, METRICS_FILE)):
        return [], None
    run = load_run(path)
    return run.records, run.prompts


def checkpoints_of(path: str) -> list[int]:
    """Steps of the complete checkpoints under ``<path>/checkpoints``."""
    return [step for step, _ in list_checkpoints(os.path.join(path, "checkpoints"))]


def run_state(spec: RunSpec, steps: int) -> str:
    """An ablation run's state: ``done`` (every step and the final evaluation: reuse), ``resume`` (a checkpoint to
    continue from) or ``fresh`` (start over); the SFT warm-up is done once its checkpoint step 0 exists."""
    saved = checkpoints_of(spec.output_dir)
    if spec.is_sft:
        return "done" if 0 in saved else "fresh"
    records, _ = read_run(spec.output_dir)
    finished = {r["step"] for r in training_rows(records)} >= set(range(1, steps + 1))
    if finished and has_final_eval(records, steps):
        return "done"
    return "resume" if saved else "fresh"


def record_seconds(spec: RunSpec, seconds: float, resumed: bool) -> None:
    """Keep a finished run's wall time in its directory (``resumed``: the time of the call that finished it; the
    machine is the run's own record, ``trainer/provenance.py``)."""
    with contextlib.suppress(OSError):  # a lost record costs a time in a table, not the run
        with open(os.path.join(spec.output_dir, RUN_RECORD), "w", encoding="utf-8") as f:
            json.dump({"seconds": seconds, "resumed": resumed}, f)


def run_record(spec: RunSpec) -> dict[str, Any]:
    """What :func:`record_seconds` kept of a finished run (``ablate_run.json``), or {}."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(spec.output_dir, RUN_RECORD), encoding="utf-8") as f:
            record = json.load(f)
            return record if isinstance(record, dict) else {}
    return {}


def recorded_seconds(spec: RunSpec) -> float | None:
    """A finished run's wall time kept in its directory (``ablate_run.json``), or None."""
    with contextlib.suppress(TypeError, ValueError, KeyError):
        return float(run_record(spec)["seconds"])
    return None


def collect(specs: Sequence[RunSpec], finished: set[tuple[str, int]], *, steps: int, k: int, threshold: float,
            window: int, budget: int) -> dict[tuple[str, int], dict[str, Any]]:
    """:func:`~megatron_dynamo.experiments.stats.run_summary` of every finished run (its key in ``finished``)."""
    summaries = {}
    for spec in specs:
        if spec.key not in finished:
            continue
        records, prompts = read_run(spec.output_dir)
        summaries[spec.key] = run_summary(records, None if spec.is_sft else prompts, eval_step=0 if spec.is_sft
                                          else steps, k=k, threshold=threshold, window=window, budget=budget)
    for spec in specs:  # a shared warm-up is every seed's start: its row holds the one model for each seed
        if spec.sft_seed is not None and (SFT, spec.sft_seed) in summaries:
            summaries.setdefault((SFT, spec.seed), summaries[(SFT, spec.sft_seed)])
    return summaries
