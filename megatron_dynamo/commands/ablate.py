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
finished run of the plan: variant, seed, held-out pass@1 and pass@k, train rollouts, steps, wall seconds, the
machine it ran on and its warm-up's hash), DIR/problems.csv.gz (correct samples per held-out problem) and
DIR/plan.json, which ``dynamo confirm DIR`` turns into the preregistered tables; written at Ctrl-C too. A run
already in DIR (same plan) does not run again when its seed is complete there or it ran on this machine from this
warm-up; a seed left unfinished on another machine runs here whole (a seed's runs are paired: one machine each).
Statistics and formulas: docs/ablation.md.
"""

from __future__ import annotations

from megatron_dynamo.experiments.variants import DEFAULT_GROUP, GROUPS, RESERVED_KEYS, VARIANTS

DEFAULT_VARIANTS = DEFAULT_GROUP


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
                             "steps, wall seconds, machine, warm-up hash), DIR/problems.csv.gz (correct samples per "
                             "held-out problem) and DIR/plan.json of every finished run of the plan, all calls' "
                             "seeds and variants, at the end and at Ctrl-C; runs already in DIR are not run again "
                             "(on another machine: the seeds complete there), so an experiment can move between "
                             "machines (docs/ablation.md, Raw data); e.g. --raw-data benchmarks/results/confirmatory")
    parser.add_argument("--output-dir", default="outputs/ablate",
                        help="where runs, ablation.md/.json/.png, report/ and ablation_plan.json go "
                             "(default outputs/ablate)")


def main(args, launch=None) -> int:
    """Plan, run, collect, analyse, write (``experiments/ablation.py``); ``launch(command, env, log_path)`` runs one
    train command (a fake in tests)."""
    # lazy: the experiments layer (checkpoint readers, the statistics) adds ~100 ms to every `dynamo --help`
    from megatron_dynamo.experiments.ablation import run_ablation

    return run_ablation(args, launch)
