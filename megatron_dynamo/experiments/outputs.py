"""The files of an ablation: ablation.json (every run's numbers, the analysis, the settings), ablation.md (the tables
of :mod:`~megatron_dynamo.experiments.tables`), ablation.png (:mod:`~megatron_dynamo.experiments.plot`), the report
page of every run's curves (``report/``, :mod:`megatron_dynamo.report.page`), and the raw data (:func:`write_raw`:
runs.csv and problems.csv.gz of every finished run of the plan, ``--raw-data``; ``dynamo confirm`` reads them)."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from megatron_dynamo.experiments.collector import recorded_seconds, run_state
from megatron_dynamo.experiments.executor import RunResult
from megatron_dynamo.experiments.plan import RunSpec, merge_plan, plan_runs
from megatron_dynamo.experiments.plot import plot_ablation
from megatron_dynamo.experiments.raw_data import (PLAN_FILE, FinishedRun, RawData, merge_rows, read_raw_data,
                                                  run_problems, run_row, write_raw_data)
from megatron_dynamo.experiments.tables import format_markdown
from megatron_dynamo.experiments.variants import display_order
from megatron_dynamo.trainer.provenance import recorded_provenance
from megatron_dynamo.report.page import write_report
from megatron_dynamo.report.runs import load_run


def write_outputs(output_dir: str, *, specs: Sequence[RunSpec], results: Mapping[tuple[str, int], RunResult],
                  summaries: Mapping[tuple[str, int], Mapping[str, Any]], analysis: Mapping[str, Any],
                  settings: Mapping[str, Any], budget: int, curves: bool = True) -> dict[str, str]:
    """ablation.json, ablation.md, ablation.png and (``curves``) the report page of every variant run."""
    seeds = analysis["seeds"]
    settings_line = (f"Recipe `{settings['config']}` {' '.join(settings['overrides']) or '(no overrides)'}; "
                     f"{len(seeds)} seed(s) {', '.join(map(str, seeds))}; budget {settings['budget_per_step']} "
                     f"rollouts/step x {settings['steps']} steps = {budget} rollouts per run; SFT warm-up "
                     f"{settings['sft_warmup_steps']} steps ({settings['sft']}); held-out evaluation on "
                     f"{', '.join(settings['benchmarks'])} (n={settings['eval_n']}); threshold "
                     f"{settings['threshold']:g} on the {settings['window']}-step moving mean of reward_mean.")
    failed = [r for r in results.values() if not r.ok]
    if failed:
        settings_line += " Missing from the statistics (failed or skipped): " + ", ".join(
            r.spec.describe() for r in failed) + "."
    markdown = format_markdown(analysis, title="DynaMO ablation", settings_line=settings_line, budget=budget)
    paths = {"json": os.path.join(output_dir, "ablation.json"), "md": os.path.join(output_dir, "ablation.md"),
             "png": os.path.join(output_dir, "ablation.png")}
    runs = []
    for spec in specs:
        result = results.get(spec.key)
        entry: dict[str, Any] = {"variant": spec.variant, "seed": spec.seed, "output_dir": spec.output_dir}
        if result is not None:
            entry.update(status=result.status, returncode=result.returncode, seconds=result.seconds,
                         resumed=result.resumed, command=result.command, message=result.message)
        else:
            entry["status"] = "not run"
        summary = summaries.get(spec.key)
        if summary is not None:
            entry["summary"] = summary
        runs.append(entry)
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump({"settings": dict(settings), "runs": runs, "analysis": analysis, "markdown": markdown}, f,
                  indent=1, default=str)
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(markdown)
    plot_ablation(analysis, paths["png"], title=f"DynaMO ablation: {os.path.basename(settings['config'])}, "
                                                f"{len(seeds)} seed(s)")
    if curves:

        loaded = [load_run(spec.output_dir, f"{spec.variant} seed {spec.seed}") for spec in specs
                  if not spec.is_sft and spec.key in summaries]
        if loaded:
            manifest = write_report(loaded, os.path.join(output_dir, "report"),
                                    title=f"DynaMO ablation runs: {os.path.basename(settings['config'])}")
            paths["report"] = manifest["files"]["html"]
    return paths


def write_raw(raw_dir: str, output_dir: str, plan: Mapping[str, Any], *, steps: int, k: int, with_sft: bool,
              shared_sft_seed: int | None) -> dict[str, str]:
    """runs.csv, problems.csv.gz and plan.json (``experiments/raw_data.py``) in ``raw_dir``: every finished run of
    ``output_dir`` that the plan holds (every seed and variant any call added, here or in the raw data), each with
    the machine it ran on and the hash of its warm-up, merged with the runs the files held before (other
    machines'), one (machine, warm-up) per seed (:func:`~megatron_dynamo.experiments.raw_data.merge_rows`)."""
    recorded = read_raw_data(raw_dir) or RawData([], [])
    merged = merge_plan(recorded.plan, plan, os.path.join(raw_dir, PLAN_FILE))
    variants = display_order(merged.get("variants", []))
    specs = plan_runs(output_dir, sorted(int(s) for s in merged.get("seeds", [])), variants, with_sft,
                      shared_sft_seed)
    local = {}
    for s in specs:
        if run_state(s, steps) == "done":  # machine and warm-up as the run recorded them, never inferred here
            run = FinishedRun(s.variant, s.seed, s.output_dir, recorded_seconds(s),
                              *recorded_provenance(s.output_dir, warmup_run=s.is_sft))
            row = run_row(run, k)
            local[id(row)] = (row, run)  # merge_rows keeps the row objects: their runs' problems are read below
    rows = merge_rows([row for row, _ in local.values()], recorded.rows, variants)
    problems = [p for row in rows for p in (run_problems(local[id(row)][1]) if id(row) in local
                                            else recorded.problems_of(row))]
    return write_raw_data(raw_dir, rows, problems, merged)
