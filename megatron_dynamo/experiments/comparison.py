"""``dynamo compare`` as a plan over the one executor: every variant (:func:`~megatron_dynamo.experiments.variants.
compare_variant`) once per seed, seed-major, one run at a time, each in ``<output-dir>/<variant>/seed<S>/``; then
the rollouts to a reward threshold, the final reward, comparison.json and reward_curves.png. ``commands/compare.py``
parses the command line and calls :func:`run_comparison`; what the command does is documented there."""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from megatron_dynamo.config import ConfigError
from megatron_dynamo.experiments.executor import (Launch, RunResult, SubprocessLauncher, child_environment, execute,
                                                  run_then_finish)
from megatron_dynamo.experiments.plan import RunSpec, train_command
from megatron_dynamo.experiments.variants import Variant, compare_variant
from megatron_dynamo.report.thresholds import median_rollouts, moving_mean, parse_seeds, summarize_run
from megatron_dynamo.trainer.config import load_run_config
from megatron_dynamo.trainer.metrics import read_metrics

RESERVED_KEYS = ("trainer.seed", "data.seed", "trainer.output_dir")
_SFT_LINE = re.compile(r"SFT warm-up: (\d+) steps, loss ([-\d.einfa]+) -> ([-\d.einfa]+)")


def summarize_variant(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("ok")]
    finals = [r["final_reward"] for r in ok if r.get("final_reward") is not None]
    reached = [r["rollouts_to_threshold"] for r in ok]
    return {"median_rollouts_to_threshold": median_rollouts(reached) if len(ok) == len(runs) else None,
            "seeds_reached": sum(v is not None for v in reached), "seeds": len(runs),
            "failed_runs": len(runs) - len(ok),
            "final_reward_mean": sum(finals) / len(finals) if finals else None}


def _fmt_rollouts(value, step=None) -> str:
    if value is None:
        return "not reached"
    text = f"{int(value)}" if float(value).is_integer() else f"{value:.1f}"
    return f"{text} (s{step})" if step is not None else text


def format_table(result: dict[str, Any]) -> str:
    seeds = result["seeds"]
    variants = result["variants"]
    by_key = {(r["variant"], r["seed"]): r for r in result["runs"]}
    head = (f"rollouts to reach a {result['window']}-step moving mean reward >= {result['threshold']:g} "
            f"(s<step> = step reached); budget {result.get('budget_per_step', '?')} rollouts/step x "
            f"{result.get('steps', '?')} steps")
    cols = ["variant"] + [f"seed {s}" for s in seeds] + ["median", "final reward (last 10%) per seed", "mean"]
    rows = []
    for v in variants:
        runs = [by_key[(v, s)] for s in seeds]
        cells = [v]
        for r in runs:
            cells.append(_fmt_rollouts(r["rollouts_to_threshold"], r["step_reached"]) if r.get("ok") else "failed")
        summary = result["summary"][v]
        cells.append("failed" if summary["failed_runs"] else _fmt_rollouts(summary["median_rollouts_to_threshold"]))
        cells.append(" ".join(f"{r['final_reward']:.3f}" if r.get("ok") and r.get("final_reward") is not None
                              else "-" for r in runs))
        mean = summary["final_reward_mean"]
        cells.append(f"{mean:.3f}" if mean is not None else "-")
        rows.append(cells)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([head, line(cols)] + [line(r) for r in rows])


def _sft_loss(log_path: str) -> str | None:
    if not os.path.isfile(log_path):
        return None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        match = _SFT_LINE.search(f.read())
    return match.group(3) if match else None


def plot_curves(result: dict[str, Any], path: str) -> str:
    import matplotlib  # an optional heavy library: only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    fig, (raw_ax, smooth_ax) = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for vi, variant in enumerate(result["variants"]):
        for si, seed in enumerate(result["seeds"]):
            run = next(r for r in result["runs"] if r["variant"] == variant and r["seed"] == seed)
            if not run.get("rewards"):
                continue
            x, total = [], 0
            for n in run["rollouts"]:
                total += n
                x.append(total)
            color, style = colors[vi % len(colors)], styles[si % len(styles)]
            raw_ax.plot(x, run["rewards"], color=color, linestyle=style, alpha=0.6, linewidth=1,
                        label=f"{variant} seed {seed}")
            smooth = moving_mean(run["rewards"], result["window"])
            xs = [a for a, m in zip(x, smooth) if m is not None]
            ys = [m for m in smooth if m is not None]
            smooth_ax.plot(xs, ys, color=color, linestyle=style, linewidth=1.5, label=f"{variant} seed {seed}")
    for ax, title in ((raw_ax, "reward_mean per step"),
                      (smooth_ax, f"{result['window']}-step moving mean")):
        ax.axhline(result["threshold"], color="gray", linewidth=1, linestyle="--")
        ax.set_xlabel("cumulative rollouts")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    raw_ax.set_ylabel("mean reward")
    smooth_ax.legend(fontsize=7, ncol=len(result["variants"]))
    fig.suptitle(f"{os.path.basename(result['config'])}: threshold {result['threshold']:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@dataclass
class ComparisonPlan:
    """Everything checked before the first run."""

    args: Any  # the parsed command line (commands/compare.py)
    seeds: list[int]
    variants: list[Variant]
    per_step: int  # rollouts per step, the same for every variant
    steps: int
    specs: list[RunSpec]

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def command(self, spec: RunSpec) -> list[str]:
        """``python -m megatron_dynamo.cli train CONFIG [overrides] <variant's> <seed, output> --algo ALGO``."""
        variant = self.variant(spec.variant)
        return train_command(self.args.config, [*self.args.overrides, *variant.overrides,
                                                f"trainer.seed={spec.seed}", f"data.seed={spec.seed}",
                                                f"trainer.output_dir={spec.output_dir}"], algo=variant.algo)


def make_plan(args) -> ComparisonPlan:
    """Check everything before any compute; ValueError / ConfigError / OSError with a one-line message."""
    seeds = parse_seeds(args.seeds)
    variants = [compare_variant(v) for v in args.variants.split(",") if v.strip()]
    if not variants or len({v.name for v in variants}) != len(variants):
        raise ValueError(f"--variants must list distinct variants, got {args.variants!r}")
    if args.window < 1:
        raise ValueError(f"--window must be >= 1, got {args.window}")
    for item in args.overrides:
        if item.split("=", 1)[0].strip() in RESERVED_KEYS:
            raise ValueError(f"override {item!r}: dynamo compare sets {', '.join(RESERVED_KEYS)} per run")
    # Check every variant's config before any compute (a typo fails here, not after the first runs).
    configs = {v.name: load_run_config(args.config, list(args.overrides) + list(v.overrides), algo=v.algo)
               for v in variants}
    budgets = {name: (c.data.prompts_per_step * c.dynamo.allocation.n_avg, c.trainer.steps)
               for name, c in configs.items()}
    if len(set(budgets.values())) != 1:  # cannot happen with the built-in variants; guards future ones
        raise ValueError(f"the variants' rollout budgets differ: {budgets}")
    per_step, steps = next(iter(budgets.values()))
    # seed-major: a load change on the machine hits every variant of a seed alike
    specs = [RunSpec(v.name, seed, os.path.join(args.output_dir, v.name, f"seed{seed}")) for seed in seeds
             for v in variants]
    return ComparisonPlan(args, seeds, variants, per_step, steps, specs)


def _records(spec: RunSpec) -> list[dict[str, Any]]:
    path = os.path.join(spec.output_dir, "metrics.jsonl")
    return read_metrics(path) if os.path.isfile(path) else []


def run_entry(plan: ComparisonPlan, spec: RunSpec, result: RunResult) -> dict[str, Any]:
    """A run's entry of comparison.json: its command, exit, time, threshold numbers and SFT loss."""
    reused = result.status == "reused"
    entry: dict[str, Any] = {"variant": spec.variant, "seed": spec.seed, "output_dir": spec.output_dir,
                             "command": plan.command(spec), "returncode": 0 if reused else result.returncode,
                             "seconds": None if reused else result.seconds, "reused": reused}
    entry.update(summarize_run(_records(spec), plan.args.threshold, plan.args.window))
    entry["ok"] = entry["returncode"] == 0 and entry["steps"] >= plan.steps
    entry["sft_final_loss"] = _sft_loss(os.path.join(spec.output_dir, "train.log"))
    return entry


def _progress(plan: ComparisonPlan, result: RunResult, done: int, total: int) -> None:
    spec = result.spec
    if result.status == "reused":
        print(f"[{done}/{total}] {spec.variant} seed {spec.seed}: reusing "
              f"{os.path.join(spec.output_dir, 'metrics.jsonl')}", flush=True)
        return
    entry = run_entry(plan, spec, result)
    log_path = os.path.join(spec.output_dir, "train.log")
    message = "    " + ("ok" if entry["ok"] else
                        f"FAILED (exit {entry['returncode']}, {entry['steps']} steps; see {log_path})")
    if entry["final_reward"] is not None:
        message += (f": final reward {entry['final_reward']:.3f}, threshold at "
                    f"{_fmt_rollouts(entry['rollouts_to_threshold'], entry['step_reached'])}")
    if entry.get("seconds"):
        message += f", {entry['seconds']:.0f}s"
    print(message, flush=True)


def run_plan(plan: ComparisonPlan, launch: Launch) -> dict[tuple[str, int], RunResult]:
    """The runs one at a time; with --reuse a run whose metrics.jsonl has every step is not rerun, without it
    every run starts over in an emptied directory. ExperimentInterrupted on Ctrl-C / SIGTERM."""
    def state_of(spec: RunSpec) -> str:
        return "done" if len(_records(spec)) >= plan.steps else "fresh"

    def announce(spec: RunSpec, resume: bool, done: int, total: int) -> None:
        print(f"[{done + 1}/{total}] {spec.variant} seed {spec.seed}: running "
              f"(log {os.path.join(spec.output_dir, 'train.log')})", flush=True)

    return execute(plan.specs, state_of, lambda spec, resume: plan.command(spec), launch, jobs=1,
                   env_for=lambda slot: child_environment(os.environ, 1, None), announce=announce,
                   report=lambda result, done, total: _progress(plan, result, done, total), reuse=plan.args.reuse)


def sft_warnings(runs: list[dict[str, Any]], seeds: list[int]) -> list[str]:
    """The seeds whose SFT warm-up ended at different losses across variants (it must not)."""
    warnings = []
    for seed in seeds:
        losses = {r["variant"]: r["sft_final_loss"] for r in runs if r["seed"] == seed}
        if len({loss for loss in losses.values() if loss is not None}) > 1:
            warnings.append(f"seed {seed}: the SFT warm-up ended at different losses across variants: {losses}")
    return warnings


def finish(plan: ComparisonPlan, results: dict[tuple[str, int], RunResult]) -> int:
    """comparison.json, reward_curves.png and the table."""
    args = plan.args
    result: dict[str, Any] = {
        "config": args.config, "overrides": list(args.overrides), "seeds": plan.seeds, "threshold": args.threshold,
        "window": args.window, "variants": [v.name for v in plan.variants], "budget_per_step": plan.per_step,
        "steps": plan.steps,
        "variant_commands": {v.name: {"algo": v.algo, "overrides": list(v.overrides)} for v in plan.variants},
        "runs": [run_entry(plan, spec, results[spec.key]) for spec in plan.specs],
    }
    result["summary"] = {v.name: summarize_variant([r for r in result["runs"] if r["variant"] == v.name])
                         for v in plan.variants}
    result["warnings"] = sft_warnings(result["runs"], plan.seeds)
    result["table"] = format_table(result)
    json_path = os.path.join(args.output_dir, "comparison.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    png_path = plot_curves(result, os.path.join(args.output_dir, "reward_curves.png"))
    print()
    print(result["table"])
    for w in result["warnings"]:
        print(f"warning: {w}")
    print(f"\nwrote {json_path} and {png_path}")
    return 0 if all(r["ok"] for r in result["runs"]) else 1


def run_comparison(args, launch: Launch | None = None) -> int:
    """``dynamo compare``: plan (exit 2 on bad input, nothing run), run, tabulate, write."""
    try:
        plan = make_plan(args)
    except (ValueError, ConfigError, OSError) as exc:
        print(f"dynamo compare: {exc}", file=sys.stderr)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    return run_then_finish("compare", lambda: run_plan(plan, launch or SubprocessLauncher()),
                           lambda results: finish(plan, results))
