"""``dynamo ablate``'s results: each finished run's numbers (:func:`collect`), the files of the ablation
(:func:`write_outputs`: ablation.json, ablation.md, ablation.png, the report page of every run) and its raw data
(:func:`write_raw`: runs.csv and problems.csv.gz of every finished run of the plan, ``--raw-data``). The statistics
themselves are :mod:`megatron_dynamo.report.ablation`'s."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from megatron_dynamo.commands.ablate_plan import RunSpec, plan_runs, read_run, run_state
from megatron_dynamo.commands.ablate_runs import RunResult, recorded_seconds
from megatron_dynamo.report.ablation import SFT


def collect(specs: Sequence[RunSpec], results: Mapping[tuple[str, int], RunResult], *, steps: int, k: int,
            threshold: float, window: int, budget: int) -> dict[tuple[str, int], dict[str, Any]]:
    """:func:`~megatron_dynamo.report.ablation.run_summary` of every finished run."""
    from megatron_dynamo.report.ablation import run_summary

    summaries = {}
    for spec in specs:
        result = results.get(spec.key)
        if result is None or not result.ok:
            continue
        records, prompts = read_run(spec.output_dir)
        summaries[spec.key] = run_summary(records, None if spec.is_sft else prompts, eval_step=0 if spec.is_sft
                                          else steps, k=k, threshold=threshold, window=window, budget=budget)
    for spec in specs:  # a shared warm-up is every seed's start: its row holds the one model for each seed
        if spec.sft_seed is not None and (SFT, spec.sft_seed) in summaries:
            summaries.setdefault((SFT, spec.seed), summaries[(SFT, spec.sft_seed)])
    return summaries


def write_outputs(output_dir: str, *, specs: Sequence[RunSpec], results: Mapping[tuple[str, int], RunResult],
                  summaries: Mapping[tuple[str, int], Mapping[str, Any]], analysis: Mapping[str, Any],
                  settings: Mapping[str, Any], budget: int, curves: bool = True) -> dict[str, str]:
    """ablation.json, ablation.md, ablation.png and (``curves``) the report page of every variant run."""
    from megatron_dynamo.report.ablation import format_markdown, plot_ablation

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
        from megatron_dynamo.report.page import write_report
        from megatron_dynamo.report.runs import load_run

        loaded = [load_run(spec.output_dir, f"{spec.variant} seed {spec.seed}") for spec in specs
                  if not spec.is_sft and spec.key in summaries]
        if loaded:
            manifest = write_report(loaded, os.path.join(output_dir, "report"),
                                    title=f"DynaMO ablation runs: {os.path.basename(settings['config'])}")
            paths["report"] = manifest["files"]["html"]
    return paths


def write_raw(raw_dir: str, output_dir: str, plan: Mapping[str, Any], *, steps: int, k: int, with_sft: bool,
              shared_sft_seed: int | None) -> dict[str, str]:
    """runs.csv and problems.csv.gz (``report/raw_data.py``) in ``raw_dir`` of every finished run that the plan of
    ``output_dir`` holds (every seed and variant any call added, not only this call's): the SFT warm-up(s) first,
    then the variants in display order, each over its seeds."""
    from megatron_dynamo.report.ablation_variants import display_order
    from megatron_dynamo.report.raw_data import FinishedRun, write_raw_data

    seeds = sorted(int(s) for s in plan.get("seeds", []))
    specs = plan_runs(output_dir, seeds, display_order(plan.get("variants", [])), with_sft, shared_sft_seed)
    specs = sorted(specs, key=lambda s: (not s.is_sft, 0 if s.is_sft else display_order(plan["variants"])
                                         .index(s.variant), s.seed))
    finished = [FinishedRun(s.variant, s.seed, s.output_dir, recorded_seconds(s)) for s in specs
                if run_state(s, steps) == "done"]
    return write_raw_data(raw_dir, finished, k)
