"""The DynaMO ablation (paper Table 2) and the baselines of the paper's Table 1 on one recipe, over seeds.

    dynamo ablate configs/cpu_default.yaml --seeds 1,2,3
    dynamo ablate RECIPE trainer.steps=40 --variants grpo,dynamo,dynamo-p0.5 --jobs 2 --output-dir outputs/abl
    dynamo ablate RECIPE --variants table1,ablation --seeds 1,2,3 --jobs 2      # Table 1 and Table 2: 16 variants

A variant is (--algo, overrides). Variants (``--variants``, comma-separated names or groups; default the group
``ablation``, the nine below). Each sets the same seven keys explicitly:
dynamo.allocation.enabled (DRA, dynamic rollout allocation), dynamo.modulation.gc (GC, gradient compensation),
dynamo.modulation.ums (UMS, update-magnitude stabilisation), dynamo.allocation.power, and the controls' switches
dynamo.modulation.pos_weight, dynamo.loss.prompt_weight, dynamo.sampling.dynamic (off but where named below):
    grpo           DRA off, GC off, UMS off                  paper row "GRPO (w/o ALL)"
    dra, gc, ums   one component on                          "w/o GC & UMS", "w/o UMS & DRA", "w/o GC & DRA"
    dra+gc, dra+ums, gc+ums   two on                         "w/o UMS", "w/o GC", "w/o DRA"
    dynamo         all three on, power 1.0 (the paper's rule) "DynaMO"
    dynamo-p0.5    all three on, power 0.5 (n ~ sigma)       ours
(power 1.0 everywhere else; with DRA off the power is unused.) These run ``--algo dynamo``. The seven baselines of
the paper's Table 1 run ``--algo NAME`` with DRA, GC and UMS off (GRPO plus the method's own change):
    clip_higher "Clip-Higher", entropy_loss "Entropy Loss", fork_tokens "Fork Tokens", entropy_adv "Entropy
    Advantages", clip_cov "Clip-COV", kl_cov "KL-COV", w_reinforce "W-REINFORCE"
The controls of the preregistered replication (docs/ablation.md, Preregistration; GRPO or a DRA/GC/UMS variant with
one change): pos_weight (every positive advantage x (1 + alpha)), dra-equal (DRA, every prompt weighted equally in
the loss), grpo+ds and dynamo+ds (DAPO's dynamic sampling), grpo-hlr, ums-hlr, gc-hlr, gc+ums-hlr (at the high
learning rate where GRPO degrades), clip_cov_authors (Clip-COV with its authors' clip 1 / 1).
Groups: ablation (the nine above), table1 (grpo, the seven baselines, dynamo: the paper's Table 1 rows), all (both,
16 variants), factorial (the eight power-1 DRA x GC x UMS variants), controls (pos_weight, dra-equal, grpo+ds,
dynamo+ds), high_lr (the four -hlr variants), confirmatory (factorial and controls); a group's members already
listed are not repeated.

Runs, per seed S (trainer.seed=S; data.seed stays the recipe's, so every seed trains and evaluates on the same
problems), each a subprocess ``python -m megatron_dynamo.cli train RECIPE [key=value ...] <run keys> --algo
<the variant's>`` writing to its own directory (its console output in train.log):
 1. SFT warm-up, when the recipe has trainer.sft_warmup_steps > 0: trainer.steps=0 and evaluation.at_start=true
    (the warm-up alone, evaluated, saved as checkpoint step 0). By default one warm-up, with the recipe's own
    trainer.seed, is the base model of every run (as the paper starts every run from one base model) ->
    <out>/sft/seed<recipe seed>/; with --sft-per-seed each seed warms up its own -> <out>/sft/seed<S>/. Every
    variant starts from its warm-up's checkpoint (model.checkpoint=<it>, trainer.sft_warmup_steps=0,
    evaluation.at_start=false): the same policy for all variants of a seed, the warm-up paid once. Its held-out
    pass@1 is the "SFT start" row.
 2. every variant: evaluation.every=trainer.steps, so the trainer evaluates the final model on the recipe's
    evaluation.benchmarks (the held-out split) with the run's own engine (the code path of ``dynamo eval``) and
    logs eval/<bench>/pass@<k> and eval/avg/pass@<k> on the last step's row -> <out>/runs/<variant>/seed<S>/.
Checked before any run: every variant's config loads (a typo fails at once), all budgets (prompts_per_step x
n_avg rollouts per step, steps) are equal, the recipe names evaluation.benchmarks, checkpoint.dir is unset.
The command sets trainer.seed, trainer.output_dir, evaluation.every and the four variant keys itself (passing
them is an error).

--jobs N runs up to N runs at once (a shared SFT run first and alone, on every core; a per-seed SFT run before the
variants of its seed; seed-major order). With N > 1
each run gets its own share of the cores (cores // N, pinned with CPU affinity; OMP_NUM_THREADS and
MKL_NUM_THREADS set to it); N = 1 leaves the environment as it is. N > 1 is refused for recipes with
rollout.tensor_parallel > 1 (vLLM's CPU shared-memory names would collide between runs). Progress: a line per run start and end with
[done/total], its wall time, final train reward and held-out pass@1.

Resume: run the same command again. A run whose metrics.jsonl has every step and the final evaluation (the SFT
run: its checkpoint step 0) is reused; one with a checkpoint continues with --resume; one without any is deleted
and rerun. <out>/ablation_plan.json records the recipe (resolved), overrides and budget: a different one is
refused (exit 2); more seeds or variants may be added. Ctrl-C stops the running runs after their current step
(their checkpoint saved; a second Ctrl-C kills them) and exits 130; nothing is left running.

Outputs in <out>: ablation.md (the baselines in the paper's Table 1 layout when any was run: per benchmark and Avg.
pass@1 / pass@k beside the paper's Avg.; the ablation in its Table 2 layout with held-out pass@1 / pass@k mean
[95% CI], Δ pass@1 vs GRPO paired by seed, rollouts to threshold, final train reward; marginal effects of DRA, GC, UMS;
eq. 23 variance ratio predicted and realised, zero-advantage groups and the modulation diagnostics), ablation.json
(every run's numbers and the aggregates), ablation.png (pass@1 per variant with CIs; the effects) and report/
(``dynamo report``'s page of every variant run's curves). With --raw-data DIR also DIR/runs.csv (one row per
finished run of the plan: variant, seed, held-out pass@1 and pass@k, train rollouts, steps, wall seconds) and
DIR/problems.csv.gz (correct samples per held-out problem), which ``dynamo confirm DIR`` turns into the
preregistered tables. Statistics and formulas: docs/ablation.md.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Mapping, Sequence

from megatron_dynamo.commands.ablate_plan import (PLAN_FILE, RunSpec, merge_plan, plan_record, plan_runs,  # noqa: F401
                                                  read_run, run_dir, run_overrides, sft_checkpoint,
                                                  train_command, variant_algo)
from megatron_dynamo.commands.ablate_runs import (CPUS_ENV, AblationInterrupted, Launch, RunResult,  # noqa: F401
                                                  SubprocessLauncher, cpu_slots, execute)
from megatron_dynamo.commands.ablate_statistics import collect, write_outputs, write_raw
from megatron_dynamo.parallel.runtime import single_process_environment
from megatron_dynamo.report.ablation import DEFAULT_GROUP, GROUPS, SFT, VARIANTS, parse_variants
from megatron_dynamo.report.ablation_variants import VARIANT_KEYS
from megatron_dynamo.report.thresholds import parse_seeds

DEFAULT_VARIANTS = DEFAULT_GROUP
RESERVED_KEYS = ("trainer.seed", "trainer.output_dir", "evaluation.every", *VARIANT_KEYS)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML recipe shared by every run (it must set evaluation.benchmarks: the "
                                       "held-out problems the final models are evaluated on)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="recipe overrides applied to every run (not " + ", ".join(RESERVED_KEYS) +
                             ": the command sets those per run)")
    parser.add_argument("--seeds", default="1,2,3",
                        help="comma-separated seeds; each sets trainer.seed of the SFT run and the variants of "
                             "that seed (default 1,2,3)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="comma-separated variants and groups, in the order to run: the DynaMO ablation's "
                             f"{', '.join(GROUPS['ablation'])}; the paper's Table 1 baselines "
                             f"{', '.join(v for v in GROUPS['table1'] if v not in GROUPS['ablation'])} (each "
                             "--algo NAME, DRA/GC/UMS off); the controls "
                             f"{', '.join(v for v in VARIANTS if VARIANTS[v].kind == 'control')}; groups ablation "
                             "(those nine), table1 (grpo, the seven baselines, dynamo), all (both, 16 variants), "
                             "factorial (the eight DRA x GC x UMS), controls (pos_weight, dra-equal, grpo+ds, "
                             "dynamo+ds), high_lr (the four -hlr), confirmatory (factorial + controls), e.g. "
                             f"--variants table1,ablation (default: {DEFAULT_VARIANTS})")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once (default 1); each gets cores // N threads on its own cores")
    parser.add_argument("--threshold", type=float, default=0.6,
                        help="reward threshold on the moving mean of reward_mean for rollouts-to-threshold "
                             "(default 0.6)")
    parser.add_argument("--window", type=int, default=5,
                        help="steps in the trailing moving mean compared with the threshold (default 5)")
    parser.add_argument("--bootstrap", type=int, default=10000,
                        help="bootstrap resamples of the 95%% CIs (default 10000; the RNG is seeded)")
    parser.add_argument("--sft-per-seed", action="store_true",
                        help="one SFT warm-up per seed (trainer.seed = the seed) instead of one shared by all seeds "
                             "(the recipe's trainer.seed): seed-to-seed spread then includes the warm-up's")
    parser.add_argument("--raw-data", default=None, metavar="DIR",
                        help="also write DIR/runs.csv (variant, seed, held-out pass@1 and pass@k, train rollouts, "
                             "steps, wall seconds) and DIR/problems.csv.gz (correct samples per held-out problem) "
                             "of every finished run of the output directory's plan, all calls' seeds and variants "
                             "(docs/ablation.md, Raw data); e.g. --raw-data benchmarks/results/confirmatory")
    parser.add_argument("--output-dir", default="outputs/ablate",
                        help="where runs, ablation.md/.json/.png, report/ and ablation_plan.json go "
                             "(default outputs/ablate)")


def child_environment(base: Mapping[str, str], jobs: int, cpus: Sequence[int] | None) -> dict[str, str]:
    """A run's environment: ``base`` without launcher variables, unbuffered output; with jobs > 1 also its thread
    count (the number of its CPUs) and the CPUs to pin it to (:data:`CPUS_ENV`)."""
    # a run is a single-process job of its own: launcher variables of the ablation's environment must not reach it
    # (it would take itself for a rank of a torchrun/Slurm job, with a job-wide MASTER_PORT shared by all runs)
    env = single_process_environment(base)
    env.pop(CPUS_ENV, None)
    env.setdefault("PYTHONUNBUFFERED", "1")  # train.log follows the run (the step lines as they happen)
    if jobs > 1 and cpus:
        for name in THREAD_VARIABLES:
            env[name] = str(len(cpus))
        env[CPUS_ENV] = ",".join(map(str, cpus))
    return env



# ---------------------------------------------------------------------------------------------- the command
def _fail(message: str) -> int:
    print(f"dynamo ablate: {message}", file=sys.stderr)
    return 2


def run(args, launch: Launch | None = None) -> int:
    from megatron_dynamo.config import ConfigError, apply_overrides, load_yaml, to_dict
    from megatron_dynamo.report.ablation import analyse
    from megatron_dynamo.trainer.config import load_run_config

    try:
        seeds = parse_seeds(args.seeds)
        variants = parse_variants(args.variants)
        if args.window < 1:
            raise ValueError(f"--window must be >= 1, got {args.window}")
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        if args.bootstrap < 100:
            raise ValueError(f"--bootstrap must be >= 100, got {args.bootstrap}")
        overrides = list(args.overrides)
        for item in overrides:
            if item.split("=", 1)[0].strip() in RESERVED_KEYS:
                raise ValueError(f"override {item!r}: dynamo ablate sets {', '.join(RESERVED_KEYS)} per run")
        raw = apply_overrides(load_yaml(args.config), overrides)
        benchmarks = (raw.get("evaluation") or {}).get("benchmarks") if isinstance(raw.get("evaluation"), dict) \
            else None
        if not benchmarks:
            raise ValueError("the recipe has no evaluation.benchmarks: the final models are evaluated on them (the "
                             "held-out split); set evaluation.benchmarks in the recipe or as an override, e.g. "
                             "evaluation.benchmarks=[<name or JSONL path>]")
        base = load_run_config(args.config, overrides)
        # The recipe's files and dataset names (found in data.data_dir, else the default data directory) and its
        # prompts, before any run starts: one line, not 27 failed runs.
        from megatron_dynamo.trainer.preflight import check_run_inputs, check_training_prompts

        check_run_inputs(base)
        check_training_prompts(base)
        if base.checkpoint.dir is not None:
            raise ValueError("checkpoint.dir is set: every run keeps its checkpoints in its own output directory "
                             "(remove checkpoint.dir)")
        steps = base.trainer.steps
        if steps < 1:
            raise ValueError(f"trainer.steps must be >= 1 for the variant runs, got {steps}")
        with_sft = base.trainer.sft_warmup_steps > 0
        if args.jobs > 1 and base.rollout.tensor_parallel > 1:
            raise ValueError(f"--jobs {args.jobs} with rollout.tensor_parallel={base.rollout.tensor_parallel}: "
                             "concurrent runs would share vLLM's CPU shared-memory names; use --jobs 1")
        # Every run's config, before any compute (as the runs will load it, paths included).
        probe_seed = seeds[0]
        shared_sft_seed = None if args.sft_per_seed else base.trainer.seed
        probe_sft_seed = probe_seed if shared_sft_seed is None else shared_sft_seed
        configs = {}
        sft_dir = run_dir(args.output_dir, SFT, probe_sft_seed)
        if with_sft:
            configs[SFT] = load_run_config(args.config, run_overrides(RunSpec(SFT, probe_sft_seed, sft_dir),
                                                                      overrides, steps))
        placeholder = os.path.join(sft_dir, "checkpoints", "step_000000") if with_sft else None
        for v in variants:
            spec = RunSpec(v, probe_seed, run_dir(args.output_dir, v, probe_seed))
            try:
                configs[v] = load_run_config(args.config, run_overrides(spec, overrides, steps, placeholder),
                                             algo=variant_algo(v))
            except (ValueError, ConfigError) as exc:
                raise ValueError(f"variant {v} (--algo {variant_algo(v)}): {exc}") from None
    except (ValueError, ConfigError, OSError) as exc:
        return _fail(str(exc))
    budgets = {name: (c.data.prompts_per_step * c.dynamo.allocation.n_avg, c.trainer.steps)
               for name, c in configs.items() if name != SFT}
    if len(set(budgets.values())) != 1:  # cannot happen with the built-in variants; guards future ones
        return _fail(f"the variants' rollout budgets differ: {budgets}")
    per_step, _ = next(iter(budgets.values()))
    budget = per_step * steps
    k = max(configs[variants[0]].evaluation.k)
    plan = plan_record(args.config, overrides, to_dict(base), {"rollouts_per_step": per_step, "steps": steps,
                                                               "sft_warmup_steps": base.trainer.sft_warmup_steps,
                                                               "sft": "per seed" if args.sft_per_seed else "shared"},
                       seeds, variants)
    plan_path = os.path.join(args.output_dir, PLAN_FILE)
    try:
        existing = None
        if os.path.isfile(plan_path):
            with open(plan_path, encoding="utf-8") as f:
                existing = json.load(f)
        merged = merge_plan(existing, plan)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        return _fail(f"{plan_path}: {exc}")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(plan_path, "w", encoding="utf-8") as f:
        json.dump(merged, f, indent=1)

    specs = plan_runs(args.output_dir, seeds, variants, with_sft, shared_sft_seed)

    def command_for(spec: RunSpec, resume: bool) -> list[str]:
        checkpoint = None
        if spec.sft_seed is not None:
            checkpoint = sft_checkpoint(run_dir(args.output_dir, SFT, spec.sft_seed))
            if checkpoint is None:
                raise RuntimeError(f"the SFT run of seed {spec.sft_seed} left no checkpoint")
        return train_command(args.config, run_overrides(spec, overrides, steps, checkpoint), resume=resume,
                             algo=variant_algo(spec.variant))

    slots = cpu_slots(args.jobs)
    env_for = lambda slot: child_environment(os.environ, args.jobs, slots[slot])  # noqa: E731
    launcher = launch or SubprocessLauncher()
    print(f"dynamo ablate: {args.config}: {len(variants)} variant(s) x {len(seeds)} seed(s)"
          f"{(' + 1 SFT warm-up per seed' if args.sft_per_seed else ' + 1 shared SFT warm-up') if with_sft else ''}"
          f" = {len(specs)} runs of {steps} steps, "
          f"{per_step} rollouts/step; {args.jobs} at once"
          + (f" ({len(slots[0])} core(s) each)" if args.jobs > 1 else "") + f" -> {args.output_dir}", flush=True)

    def announce(spec: RunSpec, resume: bool, done: int, total: int) -> None:
        print(f"[{done}/{total}] start {spec.describe()}{' (--resume)' if resume else ''}: "
              f"log {os.path.join(spec.output_dir, 'train.log')}", flush=True)

    def report(result: RunResult, done: int, total: int) -> None:
        spec = result.spec
        line = f"[{done}/{total}] {spec.describe()}: "
        if result.status == "reused":
            line += "finished before, reused"
        elif result.status == "skipped":
            line += f"skipped ({result.message})"
        elif result.status == "failed":
            line += f"FAILED ({result.message})"
        else:
            line += f"ok in {result.seconds:.0f}s"
        if result.ok:
            from megatron_dynamo.report.ablation import eval_at, training_rows
            from megatron_dynamo.report.thresholds import tail_mean

            records, _ = read_run(spec.output_dir)
            numbers = []
            if not spec.is_sft:
                final = tail_mean([float(r["reward_mean"]) for r in training_rows(records)])
                if final is not None:
                    numbers.append(f"final reward {final:.3f}")
            pass1 = eval_at(records, 0 if spec.is_sft else steps).get("eval/avg/pass@1")
            if pass1 is not None:
                numbers.append(f"held-out pass@1 {pass1:.3f}")
            if numbers:
                line += ": " + ", ".join(numbers)
        print(line, flush=True)

    # SIGTERM stops like Ctrl-C; so does SIGINT where it arrived ignored (a shell starts a background command, e.g.
    # `nohup dynamo ablate ... &`, with SIGINT ignored, and `kill -INT` did nothing).
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_stop(signum, frame):
        raise KeyboardInterrupt

    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        for sig in previous:
            signal.signal(sig, on_stop)
    try:
        # A shared warm-up runs first and alone, on every core (no other run can start before it ends).
        shared = [s for s in specs if s.is_sft] if shared_sft_seed is not None else []
        results = execute(shared, steps, command_for, launcher, jobs=1, report=report, announce=announce,
                          env_for=lambda slot: child_environment(os.environ, 1, None)) if shared else {}
        rest = [s for s in specs if s not in shared]
        if shared and not results[shared[0].key].ok:
            results.update({s.key: RunResult(s, "skipped", message="the shared SFT run failed") for s in rest})
        else:
            results.update(execute(rest, steps, command_for, launcher, jobs=args.jobs, env_for=env_for,
                                   report=report, announce=announce))
    except AblationInterrupted as exc:
        print(f"dynamo ablate: {exc}", file=sys.stderr)
        return 130
    finally:
        if in_main:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    summaries = collect(specs, results, steps=steps, k=k, threshold=args.threshold, window=args.window,
                        budget=budget)
    analysis = analyse(summaries, variants, seeds, k=k, resamples=args.bootstrap)
    evaluation = configs[variants[0]].evaluation
    settings = {"config": args.config, "overrides": overrides, "seeds": seeds, "variants": variants,
                "budget_per_step": per_step, "steps": steps, "budget": budget,
                "sft_warmup_steps": base.trainer.sft_warmup_steps, "benchmarks": list(evaluation.benchmarks),
                "sft": "one per seed" if args.sft_per_seed else f"one shared by all seeds, seed {base.trainer.seed}",
                "eval_n": evaluation.n, "k": k, "threshold": args.threshold, "window": args.window,
                "bootstrap": args.bootstrap, "jobs": args.jobs,
                "variant_overrides": {v: list(VARIANTS[v].overrides()) for v in variants},
                "variant_algos": {v: variant_algo(v) for v in variants}}
    paths = write_outputs(args.output_dir, specs=specs, results=results, summaries=summaries, analysis=analysis,
                          settings=settings, budget=budget)
    if args.raw_data:
        paths.update(write_raw(args.raw_data, args.output_dir, merged, steps=steps, k=k, with_sft=with_sft,
                               shared_sft_seed=shared_sft_seed))
    with open(paths["md"], encoding="utf-8") as f:
        print("\n" + f.read())
    print("wrote " + ", ".join(paths.values()))
    failed = [r for r in results.values() if not r.ok]
    if failed:
        print(f"dynamo ablate: {len(failed)} run(s) failed or were skipped: "
              + ", ".join(r.spec.describe() for r in failed), file=sys.stderr)
    return 0 if not failed else 1
