"""Compare GRPO and DynaMO variants on one recipe: rollouts needed to reach a reward threshold, over seeds.

    dynamo compare configs/cpu_default.yaml --seeds 1,2,3 --threshold 0.6
    dynamo compare configs/cpu_default.yaml trainer.steps=40 --variants grpo,dynamo --output-dir outputs/cmp

Variants (``--variants``, comma-separated):
    grpo           ``dynamo train --algo grpo``: uniform n_avg rollouts per prompt, no advantage modulation
    dynamo         DynaMO as in the paper: dynamic allocation with dynamo.allocation.power=1 (the paper's rule),
                   gradient-conflict and update-magnitude modulation on
    dynamo-p<P>    DynaMO with dynamo.allocation.power=P, e.g. dynamo-p0.5

Every variant runs once per seed (trainer.seed and data.seed both set to the seed, so the synthetic task, the
prompt order, the model initialisation and the sampling all follow it), one run at a time, each as a subprocess
``python -m megatron_dynamo.cli train CONFIG [key=value ...] [--algo grpo]`` writing to
``<output-dir>/<variant>/seed<S>/`` (its log in train.log). All variants share the recipe, hence the same rollout
budget: data.prompts_per_step prompts x dynamo.allocation.n_avg rollouts per step (DynaMO redistributes that total
among the prompts, GRPO spreads it evenly) for trainer.steps steps. The supervised warm-up
(trainer.sft_warmup_steps) reads only the model, data and trainer sections and the seed, none of which differ
between variants: it is identical for all variants of one seed (its final loss, taken from each run's log, is
checked and a mismatch is reported), so RL starts from the same policy.

Result: for each run, the rollouts needed to first reach the threshold = the cumulative ``rollouts`` up to and
including the first step at which the trailing moving mean of ``reward_mean`` over ``--window`` steps (full
windows only) is >= ``--threshold``; "not reached" if it never is. Per variant, the median over seeds counts
"not reached" as infinitely many rollouts (so the median is "not reached" when at least half the seeds are). The
final reward is the mean ``reward_mean`` of the last tenth of the steps. Printed as a table and written to
``<output-dir>/comparison.json`` and ``<output-dir>/reward_curves.png`` (reward curves of every run against
cumulative rollouts).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

# The threshold arithmetic is shared with `dynamo ablate`; imported here so these names stay importable from compare.
from megatron_dynamo.report.thresholds import (head_mean, median_rollouts, moving_mean, parse_seeds,  # noqa: F401
                                               rollouts_to_threshold, summarize_run, tail_mean)

DEFAULT_VARIANTS = "grpo,dynamo,dynamo-p0.5"
RESERVED_KEYS = ("trainer.seed", "data.seed", "trainer.output_dir")
_SFT_LINE = re.compile(r"SFT warm-up: (\d+) steps, loss ([-\d.einfa]+) -> ([-\d.einfa]+)")


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML recipe shared by every variant (e.g. configs/cpu_default.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="recipe overrides applied to every variant (not trainer.seed, data.seed or "
                             "trainer.output_dir: the command sets those per run)")
    parser.add_argument("--seeds", default="1,2,3",
                        help="comma-separated seeds; each run sets trainer.seed and data.seed to one (default 1,2,3)")
    parser.add_argument("--threshold", type=float, default=0.6,
                        help="reward threshold on the moving mean of reward_mean (default 0.6)")
    parser.add_argument("--window", type=int, default=5,
                        help="steps in the trailing moving mean compared with the threshold (default 5)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated: grpo, dynamo (power 1), dynamo-p<P> (power P) "
                             f"(default {DEFAULT_VARIANTS})")
    parser.add_argument("--output-dir", default="outputs/compare",
                        help="where runs, comparison.json and reward_curves.png go (default outputs/compare)")
    parser.add_argument("--reuse", action="store_true",
                        help="do not rerun a run whose metrics.jsonl already has all trainer.steps steps "
                             "(to finish an interrupted comparison, or to re-tabulate with another threshold)")


# ---------------------------------------------------------------------------------------------- pure functions
@dataclass(frozen=True)
class Variant:
    name: str
    algo: str
    overrides: tuple[str, ...]


def parse_variant(name: str) -> Variant:
    """``grpo`` | ``dynamo`` | ``dynamo-p<power>`` -> the train command's --algo and overrides."""
    name = name.strip()
    if name == "grpo":
        return Variant(name, "grpo", ())
    if name == "dynamo":
        return Variant(name, "dynamo", ("dynamo.allocation.power=1.0",))
    match = re.fullmatch(r"dynamo-p(\d+(?:\.\d*)?|\.\d+)", name)
    if match:
        power = float(match.group(1))
        if power <= 0:
            raise ValueError(f"variant {name!r}: the power must be > 0")
        return Variant(name, "dynamo", (f"dynamo.allocation.power={power}",))
    raise ValueError(f"unknown variant {name!r}: use grpo, dynamo or dynamo-p<power> (e.g. dynamo-p0.5)")


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


# ---------------------------------------------------------------------------------------------- running
def _run_dir(output_dir: str, variant: str, seed: int) -> str:
    return os.path.join(output_dir, variant, f"seed{seed}")


def _read_records(path: str) -> list[dict[str, Any]]:
    from megatron_dynamo.trainer.metrics import read_metrics

    return read_metrics(path) if os.path.isfile(path) else []


def _sft_loss(log_path: str) -> str | None:
    if not os.path.isfile(log_path):
        return None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        match = _SFT_LINE.search(f.read())
    return match.group(3) if match else None


def _train_command(config: str, overrides: list[str], variant: Variant, seed: int, run_dir: str) -> list[str]:
    return [sys.executable, "-m", "megatron_dynamo.cli", "train", config, *overrides, *variant.overrides,
            f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.output_dir={run_dir}", "--algo", variant.algo]


def plot_curves(result: dict[str, Any], path: str) -> str:
    import matplotlib

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


def run(args) -> int:
    from megatron_dynamo.config import ConfigError
    from megatron_dynamo.trainer.config import load_run_config

    try:
        seeds = parse_seeds(args.seeds)
        variants = [parse_variant(v) for v in args.variants.split(",") if v.strip()]
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
    except (ValueError, ConfigError, OSError) as exc:
        print(f"dynamo compare: {exc}", file=sys.stderr)
        return 2
    budgets = {name: (c.data.prompts_per_step * c.dynamo.allocation.n_avg, c.trainer.steps)
               for name, c in configs.items()}
    if len(set(budgets.values())) != 1:  # cannot happen with the built-in variants; guards future ones
        print(f"dynamo compare: the variants' rollout budgets differ: {budgets}", file=sys.stderr)
        return 2
    per_step, steps = next(iter(budgets.values()))
    os.makedirs(args.output_dir, exist_ok=True)
    result: dict[str, Any] = {
        "config": args.config, "overrides": list(args.overrides), "seeds": seeds, "threshold": args.threshold,
        "window": args.window, "variants": [v.name for v in variants], "budget_per_step": per_step, "steps": steps,
        "variant_commands": {v.name: {"algo": v.algo, "overrides": list(v.overrides)} for v in variants},
        "runs": [],
    }
    total_runs, done = len(seeds) * len(variants), 0
    for seed in seeds:  # seed-major: a load change on the machine hits every variant of a seed alike
        for variant in variants:
            done += 1
            run_dir = _run_dir(args.output_dir, variant.name, seed)
            metrics_path = os.path.join(run_dir, "metrics.jsonl")
            log_path = os.path.join(run_dir, "train.log")
            command = _train_command(args.config, list(args.overrides), variant, seed, run_dir)
            existing = _read_records(metrics_path) if args.reuse else []
            entry: dict[str, Any] = {"variant": variant.name, "seed": seed, "output_dir": run_dir,
                                     "command": command}
            if args.reuse and len(existing) >= steps:
                print(f"[{done}/{total_runs}] {variant.name} seed {seed}: reusing {metrics_path}", flush=True)
                entry.update(returncode=0, seconds=None, reused=True)
            else:
                os.makedirs(run_dir, exist_ok=True)
                print(f"[{done}/{total_runs}] {variant.name} seed {seed}: running (log {log_path})", flush=True)
                start = time.perf_counter()
                with open(log_path, "w", encoding="utf-8") as log:
                    log.write(" ".join(command) + "\n")
                    log.flush()
                    proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
                entry.update(returncode=proc.returncode, seconds=round(time.perf_counter() - start, 1), reused=False)
            records = _read_records(metrics_path)
            entry.update(summarize_run(records, args.threshold, args.window))
            entry["ok"] = entry["returncode"] == 0 and entry["steps"] >= steps
            entry["sft_final_loss"] = _sft_loss(log_path)
            status = ("ok" if entry["ok"] else
                      f"FAILED (exit {entry['returncode']}, {entry['steps']} steps; see {log_path})")
            message = f"    {status}"
            if entry["final_reward"] is not None:
                message += (f": final reward {entry['final_reward']:.3f}, threshold at "
                            f"{_fmt_rollouts(entry['rollouts_to_threshold'], entry['step_reached'])}")
            if entry.get("seconds"):
                message += f", {entry['seconds']:.0f}s"
            print(message, flush=True)
            result["runs"].append(entry)
    result["summary"] = {v.name: summarize_variant([r for r in result["runs"] if r["variant"] == v.name])
                         for v in variants}
    warnings = []
    for seed in seeds:
        losses = {r["variant"]: r["sft_final_loss"] for r in result["runs"] if r["seed"] == seed}
        if len({l for l in losses.values() if l is not None}) > 1:
            warnings.append(f"seed {seed}: the SFT warm-up ended at different losses across variants: {losses}")
    result["warnings"] = warnings
    table = format_table(result)
    result["table"] = table
    json_path = os.path.join(args.output_dir, "comparison.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    png_path = plot_curves(result, os.path.join(args.output_dir, "reward_curves.png"))
    print()
    print(table)
    for w in warnings:
        print(f"warning: {w}")
    print(f"\nwrote {json_path} and {png_path}")
    return 0 if all(r["ok"] for r in result["runs"]) else 1
