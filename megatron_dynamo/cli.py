"""The `dynamo` command. Each subcommand lives in its own module and registers itself in ``SUBCOMMANDS``.

    dynamo info            what this machine can run (CUDA, Transformer Engine, vLLM, versions)
    dynamo smoke           a few Megatron training steps on random tokens, any TP/PP/DP layout
    dynamo train           DynaMO / GRPO training from a YAML recipe (the main job)
    dynamo compare         GRPO vs DynaMO variants over seeds: rollouts to reach a reward threshold
    dynamo ablate          the DynaMO ablation (DRA x GC x UMS, power 0.5) over seeds: held-out pass@k with CIs
    dynamo confirm         the preregistered analysis of an ablation's runs.csv: t intervals, Holm, verdicts
    dynamo eval            pass@1 / pass@k on AIME24/25, AMC23, MATH500, Minerva, OlympiadBench (vLLM + math-verify)
    dynamo data            bring your own data: `data prepare NAME|HUB_ID` fetches and converts a hub math dataset
    dynamo report          one page (PNG + self-contained HTML) of runs' curves: reward, entropy, length, variance
                           ratio, allocation heat map, success vs allocation, modulation, pass@k
    dynamo <cmd> --help    every option of a subcommand
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_dynamo import heap, library_logs

# The processes `dynamo train` / `dynamo eval` start (ranks, vLLM's engine core and workers) are spawned, and spawn
# imports this main module first: the console policy of the command reaches them before any library logs a line.
library_logs.apply_from_environment()

# name -> (module, one-line help). The module provides add_arguments(parser) and main(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("megatron_dynamo.commands.info", "show versions and what this machine can run (CUDA, TE, vLLM)"),
    "smoke": ("megatron_dynamo.commands.smoke", "train a model a few steps on random tokens (stack check)"),
    "train": ("megatron_dynamo.commands.train", "train a policy with DynaMO or GRPO from a YAML recipe"),
    "compare": ("megatron_dynamo.commands.compare", "GRPO vs DynaMO over seeds: rollouts to reach a reward threshold"),
    "ablate": ("megatron_dynamo.commands.ablate", "the DynaMO ablation over seeds: held-out pass@k, effects, CIs"),
    "confirm": ("megatron_dynamo.commands.confirm", "the preregistered tables of an ablation's runs.csv (docs/results/testbed.md)"),
    "launch": ("megatron_dynamo.commands.launch", "cluster recipes (1.5B/7B/14B, conversion) via nemo-run"),
    "eval": ("megatron_dynamo.commands.eval", "pass@1 / pass@k of a checkpoint on the paper's six benchmarks"),
    "data": ("megatron_dynamo.commands.data", "fetch / convert hub math datasets to <out>/<name>.jsonl (data prepare)"),
    "report": ("megatron_dynamo.commands.report", "one page (PNG + HTML) of a run's curves; several runs overlaid"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's parser, or with ``command`` only that one's options: the other subcommands are listed by
    name and help line without importing their modules, so ``dynamo --help`` and ``dynamo info`` start fast."""
    parser = argparse.ArgumentParser(
        prog="dynamo", description="DynaMO RLVR training on Megatron-Core. `dynamo <command> --help` for details.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if command is not None and name != command:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The top-level parser has no option but --help: the first word that is no option names the command.
    command = next((word for word in argv if not word.startswith("-")), "")
    with heap.start_up():  # the command's module and its libraries (torch for most) are imported here
        parser = build_parser(command)
    args, extra = parser.parse_known_args(argv)
    # argparse ends a positional list at the first option: `train cfg --resume a=b` leaves `a=b` over. Overrides
    # may come anywhere on the line, so key=value leftovers join the command's overrides.
    if extra and hasattr(args, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides = [*(args.overrides or []), *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
