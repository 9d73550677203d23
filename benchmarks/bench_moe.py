"""The mixture-of-experts step, phase by phase, at expert parallel 1 and 2, and DynaMO's overhead on it against GRPO
(issue 41).

    python benchmarks/bench_moe.py                          configs/cpu_moe.yaml, rounds 1,2,3, 8 RL steps a run
    python benchmarks/bench_moe.py --rounds 1 --steps 4     a quick look
    python benchmarks/bench_moe.py [--config YAML] [key=value ...]   overrides for every run

Every run is ``dynamo train CONFIG --nproc 2`` (two ranks, data parallel 2 for the dense layers) from one shared
supervised warm-up (saved at the recipe's layout, then loaded at each layout: a checkpoint reshards across expert
layouts). Four configurations, on the same two ranks, batch and seed:

    EP 1 x {GRPO, DynaMO}   every rank holds all the experts; each computes its own tokens' experts
    EP 2 x {GRPO, DynaMO}   each rank holds half the experts; tokens cross to their expert's rank (all-to-all)

A round runs each configuration once, in the order ABCD, the next round DCBA, so a drift of the machine's load hits
every configuration alike; each round has its own ``trainer.seed``.

What is measured (the runs' own metrics.jsonl, rank 0's stage timers; median over the steps from step 2, the first
carries first-call costs): the step (``step_seconds``), generation (``time/rollout``), scoring (``time/reward``),
the old-log-prob forward (``time/old_logprob``), the update (``time/train``: forward, backward, optimizer), the
weight sync (``time/weight_sync``) and the rest. DynaMO's overhead is its non-generation time (step - rollout -
reward) over GRPO's, at the same layout. The reward per step is shown too: the layouts train the same model.

Output: a markdown table on stdout, and ``--out``/bench_moe.json (``--json`` another copy) with every number and
the machine (CPU model, cores, torch), which decides the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import child_process  # noqa: E402  (benchmarks/child_process.py)

from megatron_dynamo.trainer.provenance import machine_id  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
#: (name, expert parallel, algorithm)
CONFIGURATIONS = (("EP1 GRPO", 1, "grpo"), ("EP1 DynaMO", 1, "dynamo"), ("EP2 GRPO", 2, "grpo"),
                  ("EP2 DynaMO", 2, "dynamo"))
PHASES = (("step", "step_seconds"), ("generation", "time/rollout"), ("scoring", "time/reward"),
          ("old log-prob", "time/old_logprob"), ("update", "time/train"), ("weight sync", "time/weight_sync"))


def _train(config: str, out: Path, overrides: list[str], algo: str = "dynamo") -> float:
    """``dynamo train --nproc 2`` into ``out``; its wall seconds. Fails loudly with the run's last output."""
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", config, f"trainer.output_dir={out}",
           "logging.progress=false", "logging.plot=false", *overrides, "--algo", algo, "--nproc", "2"]
    start = time.perf_counter()
    proc = child_process.run(cmd, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"bench_moe: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def summarise(out: Path, first_step: int = 2) -> dict:
    """Median seconds of each phase over the steps from ``first_step``, the rest, and the reward per step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("step", 0) >= first_step and "step_seconds" in r]
    if not steps:
        raise SystemExit(f"bench_moe: {out}/metrics.jsonl has no RL step from step {first_step}")
    medians = {name: statistics.median(r.get(key, 0.0) for r in steps) for name, key in PHASES}
    medians["non-generation"] = statistics.median(
        r["step_seconds"] - r.get("time/rollout", 0.0) - r.get("time/reward", 0.0) for r in steps)
    medians["rest"] = statistics.median(
        r["step_seconds"] - sum(r.get(key, 0.0) for _, key in PHASES[1:]) for r in steps)
    return {"seconds": medians, "steps": len(steps),
            "reward": [r.get("reward_mean") for r in rows if "reward_mean" in r]}


def _ratio(a: float, b: float) -> str:
    """``a / b`` as ``1.23x``; ``-`` where the phase did not run (the old-log-prob pass is skipped when the update's
    own forward stands in for it: one mini-batch, one epoch)."""
    return f"{a / b:.2f}x" if b else "-"


def render(results: dict[str, list[dict]]) -> str:
    """Per configuration: the median over rounds of each phase's median, and the two ratios."""
    names = [name for name, _ in PHASES] + ["rest", "non-generation"]
    median = {config: {n: statistics.median(run["seconds"][n] for run in runs) for n in names}
              for config, runs in results.items()}
    lines = ["| configuration | " + " | ".join(f"{n} s" for n in names) + " | last reward |",
             "|---|" + "---|" * (len(names) + 1)]
    for config, runs in results.items():
        last = statistics.mean(run["reward"][-1] for run in runs if run["reward"])
        lines.append(f"| {config} | " + " | ".join(f"{median[config][n]:.3f}" for n in names) + f" | {last:.3f} |")
    lines += ["", "| ratio | step | update | old log-prob | non-generation |", "|---|---|---|---|---|"]
    for label, a, b in (("EP2 / EP1, GRPO", "EP2 GRPO", "EP1 GRPO"), ("EP2 / EP1, DynaMO", "EP2 DynaMO", "EP1 DynaMO"),
                        ("DynaMO / GRPO, EP1", "EP1 DynaMO", "EP1 GRPO"),
                        ("DynaMO / GRPO, EP2", "EP2 DynaMO", "EP2 GRPO")):
        if a in median and b in median:
            lines.append(f"| {label} | " + " | ".join(_ratio(median[a][n], median[b][n]) for n in
                                                       ("step", "update", "old log-prob", "non-generation")) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every run")
    parser.add_argument("--config", default="configs/cpu_moe.yaml", help="the recipe (default: %(default)s)")
    parser.add_argument("--rounds", default="1,2,3", help="comma-separated trainer.seed values, one round each "
                                                          "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run (default: %(default)s)")
    child_process.add_output_options(parser, "bench_moe")
    args = parser.parse_args(argv)
    child_process.exit_on_sigterm()
    out = Path(args.out).resolve()
    rounds = [int(s) for s in args.rounds.split(",")]
    warm = out / "warmup"
    if not (warm / "checkpoints" / "step_000000").is_dir():
        print(f"warm-up: {_train(args.config, warm, [*args.overrides, 'trainer.steps=0']):.0f} s", flush=True)
    start = [f"model.checkpoint={warm / 'checkpoints' / 'step_000000'}", "trainer.sft_warmup_steps=0",
             f"trainer.steps={args.steps}", "checkpoint.every=1000", *args.overrides]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in CONFIGURATIONS}
    for i, seed in enumerate(rounds):
        for name, ep, algo in (CONFIGURATIONS if i % 2 == 0 else CONFIGURATIONS[::-1]):
            run_dir = out / name.replace(" ", "-").lower() / f"seed{seed}"
            if not (run_dir / "metrics.jsonl").exists():
                seconds = _train(args.config, run_dir, [*start, f"trainer.seed={seed}",
                                                        f"parallel.expert_parallel={ep}"], algo)
                print(f"{name} seed {seed}: {seconds:.0f} s", flush=True)
            results[name].append(summarise(run_dir))
    report = render(results)
    print(report)
    payload = {"date": date.today().isoformat(), "machine": machine_id(), "config": args.config,
               "overrides": start, "rounds": rounds, "runs": results, "report": report}
    for path in filter(None, [out / "bench_moe.json", args.json and Path(args.json)]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
