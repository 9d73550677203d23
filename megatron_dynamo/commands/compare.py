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

Ctrl-C or SIGTERM stops the running run after its current step (a second one kills it) and exits 130; nothing is
left running. The runs go through the executor of ``dynamo ablate`` (megatron_dynamo/experiments/).
"""

from __future__ import annotations

DEFAULT_VARIANTS = "grpo,dynamo,dynamo-p0.5"


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
                             "(to finish an interrupted comparison, or to re-tabulate with another threshold); "
                             "without it every run starts over in an emptied directory")


def main(args, launch=None) -> int:
    """Plan, run, tabulate, write (``experiments/comparison.py``); ``launch(command, env, log_path)`` runs one
    train command (a fake in tests)."""
    # lazy: the experiments layer (checkpoint readers, the statistics) adds ~100 ms to every `dynamo --help`
    from megatron_dynamo.experiments.comparison import run_comparison

    return run_comparison(args, launch)
