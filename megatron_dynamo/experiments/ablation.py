"""``dynamo ablate`` as a plan over the one executor: the checks made before any run (:func:`make_plan`), the runs
(:func:`run_plan`, on :func:`~megatron_dynamo.experiments.executor.execute`), then Collector -> Analysis -> the
files (:func:`finish`). ``commands/ablate.py`` parses the command line and calls :func:`run_ablation`; what the
command does is documented there."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from megatron_dynamo.config import ConfigError, apply_overrides, load_yaml, to_dict
from megatron_dynamo.experiments.analysis import analyse
from megatron_dynamo.experiments.collector import collect, read_run, run_state
from megatron_dynamo.experiments.executor import (Launch, RunResult, StateOf, SubprocessLauncher, child_environment,
                                                  cpu_slots, execute, run_then_finish)
from megatron_dynamo.experiments.outputs import write_outputs, write_raw
from megatron_dynamo.experiments.plan import (PLAN_FILE, RunSpec, merge_plan, plan_record, plan_runs, run_dir,
                                              run_overrides, sft_checkpoint, train_command, variant_algo, warmup_hash)
from megatron_dynamo.experiments.raw_data import PLAN_FILE as RAW_PLAN_FILE
from megatron_dynamo.experiments.raw_data import RawData, RecordedRuns, read_raw_data
from megatron_dynamo.experiments.stats import eval_at, training_rows
from megatron_dynamo.experiments.variants import RESERVED_KEYS, SFT, VARIANTS, display_order, parse_variants
from megatron_dynamo.report.thresholds import parse_seeds, tail_mean
from megatron_dynamo.trainer.config import RunConfig, load_run_config
from megatron_dynamo.trainer.preflight import check_run_inputs, check_training_prompts
from megatron_dynamo.trainer.provenance import machine_id

@dataclass
class AblationPlan:
    """Everything checked before the first run: the arguments, the recipe, every run's config and the runs."""

    args: Any  # the parsed command line (commands/ablate.py)
    seeds: list[int]
    variants: list[str]
    overrides: list[str]
    base: RunConfig
    configs: dict[str, RunConfig]  # every variant's (and the SFT run's) config, as its runs will load it
    per_step: int  # rollouts per step, the same for every variant
    shared_sft_seed: int | None  # the seed of the one shared SFT warm-up; None: one per seed (or none)
    specs: list[RunSpec]
    record: dict[str, Any] | None = None  # ablation_plan.json, merged with an earlier call's
    raw: RawData | None = None  # --raw-data DIR's files before this call (runs finished here or on other machines)
    recorded: RecordedRuns | None = None  # what of it counts as done for this call

    @property
    def steps(self) -> int:
        return self.base.trainer.steps

    @property
    def with_sft(self) -> bool:
        return self.base.trainer.sft_warmup_steps > 0

    @property
    def budget(self) -> int:
        return self.per_step * self.steps

    @property
    def k(self) -> int:
        return max(self.configs[self.variants[0]].evaluation.k)


def _check_arguments(args) -> tuple[list[int], list[str], list[str]]:
    seeds = parse_seeds(args.seeds)
    variants = parse_variants(args.variants)
    for name, value, least in (("--window", args.window, 1), ("--jobs", args.jobs, 1),
                               ("--bootstrap", args.bootstrap, 100)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    overrides = list(args.overrides)
    for item in overrides:
        if item.split("=", 1)[0].strip() in RESERVED_KEYS:
            raise ValueError(f"override {item!r}: dynamo ablate sets {', '.join(RESERVED_KEYS)} per run")
    return seeds, variants, overrides


def _check_recipe(args, overrides: list[str]) -> RunConfig:
    raw = apply_overrides(load_yaml(args.config), overrides)
    evaluation = raw.get("evaluation")
    if not (evaluation.get("benchmarks") if isinstance(evaluation, dict) else None):
        raise ValueError("the recipe has no evaluation.benchmarks: the final models are evaluated on them (the "
                         "held-out split); set evaluation.benchmarks in the recipe or as an override, e.g. "
                         "evaluation.benchmarks=[<name or JSONL path>]")
    base = load_run_config(args.config, overrides)
    # The recipe's files and dataset names (found in data.data_dir, else the default data directory) and its
    # prompts, before any run starts: one line, not 27 failed runs.
    check_run_inputs(base)
    check_training_prompts(base)
    if base.checkpoint.dir is not None:
        raise ValueError("checkpoint.dir is set: every run keeps its checkpoints in its own output directory "
                         "(remove checkpoint.dir)")
    if base.trainer.steps < 1:
        raise ValueError(f"trainer.steps must be >= 1 for the variant runs, got {base.trainer.steps}")
    if args.jobs > 1 and base.rollout.tensor_parallel > 1:
        raise ValueError(f"--jobs {args.jobs} with rollout.tensor_parallel={base.rollout.tensor_parallel}: "
                         "concurrent runs would share vLLM's CPU shared-memory names; use --jobs 1")
    return base


def _run_configs(args, base: RunConfig, seed: int, sft_seed: int, variants: list[str],
                 overrides: list[str]) -> dict[str, RunConfig]:
    """Every run's config for one seed, as the runs will load it (paths included): a typo fails here, at once."""
    steps, with_sft = base.trainer.steps, base.trainer.sft_warmup_steps > 0
    configs = {}
    sft_dir = run_dir(args.output_dir, SFT, sft_seed)
    if with_sft:
        configs[SFT] = load_run_config(args.config, run_overrides(RunSpec(SFT, sft_seed, sft_dir), overrides, steps))
    placeholder = os.path.join(sft_dir, "checkpoints", "step_000000") if with_sft else None
    for v in variants:
        spec = RunSpec(v, seed, run_dir(args.output_dir, v, seed))
        try:
            configs[v] = load_run_config(args.config, run_overrides(spec, overrides, steps, placeholder),
                                         algo=variant_algo(v))
        except (ValueError, ConfigError) as exc:
            raise ValueError(f"variant {v} (--algo {variant_algo(v)}): {exc}") from None
    return configs


def make_plan(args) -> AblationPlan:
    """Check everything before any compute; ValueError / ConfigError / OSError with a one-line message."""
    seeds, variants, overrides = _check_arguments(args)
    base = _check_recipe(args, overrides)
    shared_sft_seed = None if args.sft_per_seed else base.trainer.seed
    configs = _run_configs(args, base, seeds[0], seeds[0] if shared_sft_seed is None else shared_sft_seed,
                           variants, overrides)
    budgets = {name: (c.data.prompts_per_step * c.dynamo.allocation.n_avg, c.trainer.steps)
               for name, c in configs.items() if name != SFT}
    if len(set(budgets.values())) != 1:  # cannot happen with the built-in variants; guards future ones
        raise ValueError(f"the variants' rollout budgets differ: {budgets}")
    per_step = next(iter(budgets.values()))[0]
    specs = plan_runs(args.output_dir, seeds, variants, base.trainer.sft_warmup_steps > 0, shared_sft_seed)
    raw = read_raw_data(args.raw_data) if args.raw_data else None
    recorded = None
    if raw is not None:
        recorded = RecordedRuns.of(raw.rows, seeds, variants)
        specs = _with_seed_reruns(specs, recorded, args.output_dir)
    return AblationPlan(args, seeds, variants, overrides, base, configs, per_step, shared_sft_seed, specs, raw=raw,
                        recorded=recorded)


def _with_seed_reruns(specs: list[RunSpec], recorded: RecordedRuns, output_dir: str) -> list[RunSpec]:
    """``specs`` plus, for every seed this call runs here, the runs the raw data holds of it that this call's
    variants do not name: a seed's runs are paired, so a seed that goes on here has all its runs here (each is
    reused when it finished here, with this warm-up, before)."""
    out = list(specs)
    for seed in sorted({s.seed for s in specs if not s.is_sft} - recorded.complete_seeds):
        sft_seed = next(s.sft_seed for s in specs if s.seed == seed and not s.is_sft)
        planned = {s.variant for s in specs if s.seed == seed}
        last = max(i for i, s in enumerate(out) if s.seed == seed and not s.is_sft)
        extra = [RunSpec(v, seed, run_dir(output_dir, v, seed), sft_seed)
                 for v in display_order(recorded.variants_of(seed)) if v not in planned]
        out[last + 1:last + 1] = extra  # seed-major order kept
    return out


def write_plan_record(plan: AblationPlan) -> None:
    """ablation_plan.json: this call's plan merged with an earlier one's (a different recipe: ValueError)."""
    args = plan.args
    record = plan_record(args.config, plan.overrides, to_dict(plan.base),
                         {"rollouts_per_step": plan.per_step, "steps": plan.steps,
                          "sft_warmup_steps": plan.base.trainer.sft_warmup_steps,
                          "sft": "per seed" if args.sft_per_seed else "shared"}, plan.seeds, plan.variants)
    path = os.path.join(args.output_dir, PLAN_FILE)
    try:
        existing = None
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                existing = json.load(f)
        plan.record = merge_plan(existing, record)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}; use another --output-dir (or delete that directory)") from None
    if plan.raw is not None:  # the runs recorded there must be runs of this plan
        raw_plan = os.path.join(args.raw_data, RAW_PLAN_FILE)
        try:
            merge_plan(plan.raw.plan, record, raw_plan)
        except ValueError as exc:
            raise ValueError(f"--raw-data {args.raw_data}: {exc}: its runs are another plan's; use another "
                             "--raw-data DIR") from None
    os.makedirs(args.output_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(plan.record, f, indent=1)


def _command_for(plan: AblationPlan):
    def command_for(spec: RunSpec, resume: bool) -> list[str]:
        checkpoint = None
        if spec.sft_seed is not None:
            checkpoint = sft_checkpoint(run_dir(plan.args.output_dir, SFT, spec.sft_seed))
            if checkpoint is None:
                raise RuntimeError(f"the SFT run of seed {spec.sft_seed} left no checkpoint")
        return train_command(plan.args.config, run_overrides(spec, plan.overrides, plan.steps, checkpoint),
                             resume=resume, algo=variant_algo(spec.variant))
    return command_for


def announce(spec: RunSpec, resume: bool, done: int, total: int) -> None:
    print(f"[{done}/{total}] start {spec.describe()}{' (--resume)' if resume else ''}: "
          f"log {os.path.join(spec.output_dir, 'train.log')}", flush=True)


def result_line(result: RunResult, steps: int, done: int, total: int) -> str:
    """The progress line of a run that ended: its status, final train reward and held-out pass@1."""
    spec = result.spec
    status = {"reused": "finished before, reused", "skipped": f"skipped ({result.message})",
              "recorded": "in the raw data (finished elsewhere), not run here",
              "failed": f"FAILED ({result.message})"}.get(result.status, f"ok in {result.seconds or 0:.0f}s")
    line = f"[{done}/{total}] {spec.describe()}: {status}"
    if not result.local:
        return line
    records, _ = read_run(spec.output_dir)
    numbers = []
    if not spec.is_sft:
        final = tail_mean([float(r["reward_mean"]) for r in training_rows(records)])
        if final is not None:
            numbers.append(f"final reward {final:.3f}")
    pass1 = eval_at(records, 0 if spec.is_sft else steps).get("eval/avg/pass@1")
    if pass1 is not None:
        numbers.append(f"held-out pass@1 {pass1:.3f}")
    return line + (": " + ", ".join(numbers) if numbers else "")


def _state_of(plan: AblationPlan) -> StateOf:
    """A run's state: its directory's (done, resume, fresh), or "recorded" when the raw data holds it and it need not
    run here: its seed is complete there, or it ran on this machine from this warm-up."""
    here = machine_id()

    def state_of(spec: RunSpec) -> str:
        state = run_state(spec, plan.steps)
        recorded = plan.recorded
        if state == "done" or recorded is None:
            return state
        if spec.is_sft:  # a seed's own warm-up (--sft-per-seed) is not needed when the seed is complete there
            return "recorded" if plan.shared_sft_seed is None and spec.seed in recorded.complete_seeds else state
        if spec.key not in recorded.rows:
            return state
        if spec.seed in recorded.complete_seeds or recorded.counts_here(
                spec.key, (here, warmup_hash(plan.args.output_dir, spec.sft_seed))):
            return "recorded"
        return state
    return state_of


def run_plan(plan: AblationPlan, launch: Launch) -> dict[tuple[str, int], RunResult]:
    """A shared warm-up first and alone, on every core (no other run can start before it ends; not run when every
    other run is recorded in the raw data); then the rest, up to --jobs at once, each on its own cores.
    ExperimentInterrupted on Ctrl-C / SIGTERM (under :func:`~megatron_dynamo.experiments.executor.run_then_finish`'s
    stop_signals)."""
    jobs, steps = plan.args.jobs, plan.steps
    slots = cpu_slots(jobs)
    report = lambda result, done, total: print(result_line(result, steps, done, total), flush=True)  # noqa: E731
    state_of = _state_of(plan)
    command_for = _command_for(plan)
    shared = [s for s in plan.specs if s.is_sft] if plan.shared_sft_seed is not None else []
    rest = [s for s in plan.specs if s not in shared]
    complete = plan.recorded.complete_seeds if plan.recorded is not None else frozenset()
    if all(s.seed in complete for s in rest):
        shared = []  # nothing will start from it here
    results = execute(shared, state_of, command_for, launch, jobs=1, report=report, announce=announce,
                      env_for=lambda slot: child_environment(os.environ, 1, None)) if shared else {}
    if shared and not results[shared[0].key].ok:
        results.update({s.key: RunResult(s, "skipped", message="the shared SFT run failed") for s in rest})
    else:
        results.update(execute(rest, state_of, command_for, launch, jobs=jobs, report=report, announce=announce,
                               env_for=lambda slot: child_environment(os.environ, jobs, slots[slot])))
    return results


def _settings(plan: AblationPlan) -> dict[str, Any]:
    args, base, evaluation = plan.args, plan.base, plan.configs[plan.variants[0]].evaluation
    return {"config": args.config, "overrides": plan.overrides, "seeds": plan.seeds, "variants": plan.variants,
            "budget_per_step": plan.per_step, "steps": plan.steps, "budget": plan.budget,
            "sft_warmup_steps": base.trainer.sft_warmup_steps, "benchmarks": list(evaluation.benchmarks),
            "sft": "one per seed" if args.sft_per_seed else f"one shared by all seeds, seed {base.trainer.seed}",
            "eval_n": evaluation.n, "k": plan.k, "threshold": args.threshold, "window": args.window,
            "bootstrap": args.bootstrap, "jobs": args.jobs,
            "variant_overrides": {v: list(VARIANTS[v].overrides()) for v in plan.variants},
            "variant_algos": {v: variant_algo(v) for v in plan.variants}}


def finish(plan: AblationPlan, results: dict[tuple[str, int], RunResult]) -> int:
    """Collector -> Analysis -> ablation.json/.md/.png, the report page and (--raw-data) the raw data."""
    args = plan.args
    finished = {key for key, result in results.items() if result.local}
    summaries = collect(plan.specs, finished, steps=plan.steps, k=plan.k, threshold=args.threshold,
                        window=args.window, budget=plan.budget)
    analysis = analyse(summaries, plan.variants, plan.seeds, k=plan.k, resamples=args.bootstrap)
    paths = write_outputs(args.output_dir, specs=plan.specs, results=results, summaries=summaries,
                          analysis=analysis, settings=_settings(plan), budget=plan.budget)
    if args.raw_data:
        paths.update(write_raw_data_of(plan))
    with open(paths["md"], encoding="utf-8") as f:
        print("\n" + f.read())
    print("wrote " + ", ".join(paths.values()))
    failed = [r for r in results.values() if not r.ok]
    if failed:
        print(f"dynamo ablate: {len(failed)} run(s) failed or were skipped: "
              + ", ".join(r.spec.describe() for r in failed), file=sys.stderr)
    return 0 if not failed else 1


def _fail(message: str) -> int:
    print(f"dynamo ablate: {message}", file=sys.stderr)
    return 2


def run_ablation(args, launch: Launch | None = None) -> int:
    """``dynamo ablate``: plan (exit 2 on bad input, nothing run), run, collect, analyse, write."""
    try:
        plan = make_plan(args)
        write_plan_record(plan)
    except (ValueError, ConfigError, OSError) as exc:
        return _fail(str(exc))
    slots = cpu_slots(args.jobs)
    sft = (' + 1 SFT warm-up per seed' if args.sft_per_seed else ' + 1 shared SFT warm-up') if plan.with_sft else ''
    print(f"dynamo ablate: {args.config}: {len(plan.variants)} variant(s) x {len(plan.seeds)} seed(s){sft} = "
          f"{len(plan.specs)} runs of {plan.steps} steps, {plan.per_step} rollouts/step; {args.jobs} at once"
          + (f" ({len(slots[0])} core(s) each)" if args.jobs > 1 else "") + f" -> {args.output_dir}", flush=True)
    return run_then_finish("ablate", lambda: run_plan(plan, launch or SubprocessLauncher()),
                           lambda results: finish(plan, results),
                           interrupted=(lambda: _keep_raw_data(plan)) if args.raw_data else None)


def write_raw_data_of(plan: AblationPlan) -> dict[str, str]:
    """--raw-data DIR: runs.csv, problems.csv.gz and plan.json of every finished run (``outputs.write_raw``)."""
    return write_raw(plan.args.raw_data, plan.args.output_dir, plan.record or {}, steps=plan.steps, k=plan.k,
                     with_sft=plan.with_sft, shared_sft_seed=plan.shared_sft_seed)


def _keep_raw_data(plan: AblationPlan) -> None:
    """Interrupted: the raw data of every run that finished, so that a pause loses none of them (no tables)."""
    paths = write_raw_data_of(plan)
    print(f"dynamo ablate: kept the raw data of the finished runs in {paths['runs']}", file=sys.stderr)
