"""The reward workers, A/B: pebble's ``ProcessPool`` (the scorer now) against the hand-written pool it replaced.

    python benchmarks/bench_reward.py [--problems 256] [--rounds 3] [--workers 2] [--baseline-rev 4fb5b7a]

Workload: the training set's answers (``dapo_math_17k.jsonl``, the GPU recipes' ``data.train``, from ``--data-dir``;
the first ``--problems`` rows), four model-style responses per problem (the answer boxed, a wrong boxed answer,
``\\boxed{<answer> + 0}``, the answer at the end of unboxed prose: the same pair as the first, answered from the
call's cache as repeated answers of a prompt's rollouts are), plus ``--timeouts`` responses on which
math-verify's own alarm fires (a power tower, the scorer's default 5 s limit each). The scorer as the trainer builds
it (defaults: ``timeout_seconds=5``, hard limit 12 s) with ``--workers`` workers. A second, small call measures a
hung worker being killed and replaced: one power tower with a 1 s hard limit below math-verify's 5 s, then 16 plain
items.

Each variant runs in a fresh process (alternating, ``--rounds`` times each, so both see the same machine load):
start-up (construction to the first scored item), the batch's wall time, the hung-worker call's wall time, and the
memory of the scorer (its process's RSS and the workers' summed PSS, read with psutil after the batch). The
hand-written pool is read from git (``megatron_dynamo/reward/math_reward.py`` at ``--baseline-rev``, the last
commit with it) into a temporary folder; both variants must give identical reasons for every response.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

POWER_TOWER = "\\boxed{9^{9^{9^{9^{9^{9}}}}}}"


def build_workload(data_dir: str, problems: int, timeouts: int) -> tuple[list[str], list[list[str]]]:
    from megatron_dynamo.data import load_math_jsonl

    responses, references = [], []
    for example in list(load_math_jsonl(os.path.join(data_dir, "dapo_math_17k.jsonl")))[:problems]:
        answer, refs = example.answer, example.references()
        wrong = str(int(answer) + 1) if answer.lstrip("-").isdigit() else answer + "+1"
        for text in (f"So the answer is \\boxed{{{answer}}}.", f"Thus \\boxed{{{wrong}}}.",
                     f"We get \\boxed{{{answer} + 0}}.", f"Adding everything up, the final answer is {answer}"):
            responses.append(text)
            references.append(refs)
    for i in range(timeouts):
        responses.insert((i + 1) * len(responses) // (timeouts + 1), POWER_TOWER)
        references.insert((i + 1) * len(references) // (timeouts + 1), ["1"])
    return responses, references


def measure(variant: str, module_dir: str, args) -> dict:
    """One variant in this (fresh) process."""
    import psutil

    if variant == "handwritten":
        sys.path.insert(0, module_dir)
        import handwritten_math_reward as module
    else:
        from megatron_dynamo.reward import math_reward as module
    responses, references = build_workload(args.data_dir, args.problems, args.timeouts)
    me = psutil.Process()
    t0 = time.perf_counter()
    with module.MathRewardScorer(num_workers=args.workers) as scorer:
        scorer.score(["\\boxed{1}"], ["1"])
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        scored = scorer.score(responses, references)
        batch = time.perf_counter() - t0
        workers = [p for p in me.children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
        workers_pss = sum(p.memory_full_info().pss for p in workers)
        own_rss = me.memory_info().rss
    with module.MathRewardScorer(num_workers=1, hard_timeout_seconds=1.0) as scorer:
        scorer.score(["\\boxed{1}"], ["1"])
        t0 = time.perf_counter()
        hung = scorer.score([POWER_TOWER] + [f"\\boxed{{{i}}}" for i in range(16)], ["1"] + [str(i) for i in range(16)])
        hung_seconds = time.perf_counter() - t0
    return {"startup_s": startup, "batch_s": batch, "items": len(responses), "verified": scored.stats.num_verified,
            "counts": scored.stats.counts, "reasons": scored.reasons, "hung_s": hung_seconds,
            "hung_reasons": hung.reasons[:2], "replaced": hung.stats.workers_replaced,
            "workers_pss_mb": workers_pss / 2**20, "own_rss_mb": own_rss / 2**20, "num_workers": len(workers)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=256, help="training-set rows (4 responses each)")
    parser.add_argument("--timeouts", type=int, default=2, help="responses on which math-verify times out")
    parser.add_argument("--workers", type=int, default=2, help="reward worker processes")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant (alternating)")
    parser.add_argument("--baseline-rev", default="4fb5b7a", help="git revision with the hand-written pool")
    parser.add_argument("--data-dir", default=os.environ.get("MEGATRON_DYNAMO_DATA_DIR", "data"),
                        help="where dapo_math_17k.jsonl is (`dynamo data prepare dapo_math_17k` writes it to data/)")
    parser.add_argument("--measure", choices=("pebble", "handwritten"), help=argparse.SUPPRESS)
    parser.add_argument("--module-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.data_dir, "dapo_math_17k.jsonl")):
        print(f"bench_reward: --data-dir: no dapo_math_17k.jsonl in {args.data_dir}; write it there with "
              f"`dynamo data prepare dapo_math_17k --out {args.data_dir}`", file=sys.stderr)
        return 2
    if args.measure:
        print(json.dumps(measure(args.measure, args.module_dir, args)))
        return 0

    with tempfile.TemporaryDirectory() as module_dir:
        old = f"{args.baseline_rev}:megatron_dynamo/reward/math_reward.py"
        source = subprocess.run(["git", "-C", REPO, "show", old], check=True, capture_output=True, text=True).stdout
        with open(os.path.join(module_dir, "handwritten_math_reward.py"), "w") as f:
            f.write(source)
        runs: dict[str, list[dict]] = {"handwritten": [], "pebble": []}
        for _ in range(args.rounds):
            for variant in runs:
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", variant, "--module-dir",
                                      module_dir, "--problems", str(args.problems), "--timeouts", str(args.timeouts),
                                      "--workers", str(args.workers), "--data-dir", args.data_dir],
                                     check=True, capture_output=True, text=True).stdout
                runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    first = runs["handwritten"][0]
    same = all(r["reasons"] == first["reasons"] and r["hung_reasons"] == first["hung_reasons"]
               for v in runs.values() for r in v)
    print(f"{first['items']} responses ({first['verified']} distinct pairs verified) from {args.problems} rows of "
          f"dapo_math_17k, {args.timeouts} math-verify timeouts; {args.workers} workers; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; counts {first['counts']}; identical reasons: {same}")
    print(f"{'variant':<13}{'start-up s':>12}{'batch s':>10}{'items/s':>10}{'hung-worker call s':>20}"
          f"{'scorer RSS MB':>15}{'workers PSS MB':>16}   (median of {args.rounds}; all runs: batch s)")
    for variant, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("startup_s", "batch_s", "hung_s", "own_rss_mb",
                                                                 "workers_pss_mb")}
        print(f"{variant:<13}{med['startup_s']:>12.2f}{med['batch_s']:>10.2f}{first['items'] / med['batch_s']:>10.1f}"
              f"{med['hung_s']:>20.2f}{med['own_rss_mb']:>15.0f}{med['workers_pss_mb']:>16.0f}   "
              f"{', '.join(format(r['batch_s'], '.2f') for r in rs)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
