"""Generation overlapped with the update: one step off-policy (rollout.max_staleness=1) against on-policy (0), with
the engine on a rank of its own (issue 35).

    python benchmarks/bench_overlap.py                       configs/cpu_overlap.yaml, seeds 1,2,3
    python benchmarks/bench_overlap.py --seeds 1 --steps 8   a quick look
    python benchmarks/bench_overlap.py [--config YAML] [key=value ...]   overrides for every run

One supervised warm-up of the recipe is shared by every run (``trainer.steps=0``, saved as checkpoint step 0). Then,
per seed, the same recipe runs twice from it with ``--nproc 2`` (rank 0 trains, rank 1 generates and scores):
K = 0 (the engine waits while the trainer updates) and K = 1 (the engine generates the next batch meanwhile), in
the order K0 K1 for odd seeds and K1 K0 for even ones, so a drift of the machine's load hits both alike. Every run
has its own seed (``trainer.seed``: sampling and initialisation; the warm-up is the same).

What is measured (the runs' own metrics.jsonl): the step time ``step_seconds`` (the trainer's wall clock from the
start of one step to the next, waiting for the batch included), median from step 3 (the first steps carry the
engine's start); the trainer's waits (``time/wait_rollout``), its update (``time/old_logprob + time/train``) and
the weight hand-over (``time/weight_sync``); the engine's generation and scoring (``time/rollout``,
``time/reward``); the reward per step; and the timeline of consecutive steps from the wall-clock phase marks
(``phase/generate`` on the engine rank, ``phase/update`` and ``phase/weight_sync`` on the trainer rank).

Output: a markdown table and timeline on stdout, ``--out``/bench_overlap.json with every number, and
``--out``/bench_overlap_timeline.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import child_process  # noqa: E402  (benchmarks/child_process.py)

REPO = Path(__file__).resolve().parents[1]


def _run(config: str, out: Path, overrides: list[str], nproc: int) -> float:
    """``dynamo train`` into ``out``; its wall seconds. Fails loudly with the run's last output."""
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", config, f"trainer.output_dir={out}",
           "logging.progress=false", "logging.plot=false", *overrides]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    start = time.perf_counter()
    proc = child_process.run(cmd, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"bench_overlap: {' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _median_from(rows: list[dict], key: str, first: int = 3) -> float:
    values = [r.get(key, 0.0) for r in rows if r["step"] >= first]
    return statistics.median(values) if values else float("nan")


def summarise(rows: list[dict]) -> dict:
    steps = [r for r in rows if r["step"] > 0]
    return {
        "step_s": _median_from(steps, "step_seconds"),
        "wait_rollout_s": _median_from(steps, "time/wait_rollout"),
        "update_s": statistics.median([r.get("time/old_logprob", 0.0) + r.get("time/train", 0.0)
                                       for r in steps if r["step"] >= 3] or [float("nan")]),
        "weight_sync_s": _median_from(steps, "time/weight_sync"),
        "generate_s": _median_from(steps, "time/rollout"),
        "reward_s": _median_from(steps, "time/reward"),
        "reward": [r["reward_mean"] for r in steps],
        "staleness": [r.get("rollout/staleness_max") for r in steps],
        "phases": {r["step"]: {k: r[k] for k in ("phase/generate", "phase/update", "phase/weight_sync") if k in r}
                   for r in steps},
    }


def timeline(phases: dict[int, dict], steps: range, width: int = 100) -> list[str]:
    """ASCII lanes of the phases of ``steps``: the engine's generations (G), the trainer's updates (U) and weight
    hand-overs (S), on one time axis."""
    marks = [(lane, name, span) for step in steps for name, span in phases.get(step, {}).items()
             for lane in ["engine" if name == "phase/generate" else "trainer"]]
    if not marks:
        return []
    t0 = min(span[0] for _, _, span in marks)
    t1 = max(span[1] for _, _, span in marks)
    scale = (width - 1) / max(t1 - t0, 1e-9)
    lanes = {"engine": [" "] * width, "trainer": [" "] * width}
    symbol = {"phase/generate": "G", "phase/update": "U", "phase/weight_sync": "S"}
    for lane, name, (a, b) in marks:
        for i in range(int((a - t0) * scale), max(int((a - t0) * scale) + 1, int((b - t0) * scale))):
            lanes[lane][min(i, width - 1)] = symbol[name]
    return [f"{lane:>8} |{''.join(cells)}|" for lane, cells in lanes.items()] + \
        [f"{'':>8}  0 s{'':>{width - 12}}{t1 - t0:6.1f} s"]


def plot_timeline(runs: dict[int, dict], steps: range, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.6 * len(runs) + 0.6), squeeze=False)
    colours = {"phase/generate": "tab:orange", "phase/update": "tab:blue", "phase/weight_sync": "tab:green"}
    for ax, (k, phases) in zip(axes[:, 0], sorted(runs.items())):
        spans = [(name, span) for step in steps for name, span in phases.get(step, {}).items()]
        t0 = min(span[0] for _, span in spans)
        for name, (a, b) in spans:
            y = 1 if name == "phase/generate" else 0
            ax.broken_barh([(a - t0, b - a)], (y - 0.35, 0.7), color=colours[name])
        ax.set_yticks([0, 1], ["trainer", "engine"])
        ax.set_title(f"rollout.max_staleness={k}: steps {steps.start}-{steps.stop - 1}", fontsize=9)
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, ["generate + score", "update", "weight sync"], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every run")
    parser.add_argument("--config", default="configs/cpu_overlap.yaml", help="the recipe (default: %(default)s)")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated trainer.seed values (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the recipe's)")
    child_process.add_output_options(parser, "bench_overlap")
    args = parser.parse_args(argv)
    child_process.exit_on_sigterm()
    out = Path(args.out).resolve()
    seeds = [int(s) for s in args.seeds.split(",")]
    common = list(args.overrides) + ([f"trainer.steps={args.steps}"] if args.steps else [])
    warm = out / "warmup"
    if not (warm / "checkpoints" / "step_000000").is_dir():
        seconds = _run(args.config, warm, [*common, "trainer.steps=0", "rollout.placement=colocated",
                                           "rollout.engine_ranks=0", "rollout.max_staleness=0",
                                           "dynamo.loss.engine_is=off"], nproc=1)
        print(f"warm-up: {seconds:.0f} s", flush=True)
    start = [f"model.checkpoint={warm / 'checkpoints' / 'step_000000'}", "trainer.sft_warmup_steps=0"]
    results: dict[str, dict] = {}
    for i, seed in enumerate(seeds):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            run_dir = out / f"k{k}" / f"seed{seed}"
            if not (run_dir / "metrics.jsonl").exists():
                seconds = _run(args.config, run_dir, [*start, *common, f"trainer.seed={seed}",
                                                      f"rollout.max_staleness={k}"], nproc=2)
                print(f"K={k} seed {seed}: {seconds:.0f} s", flush=True)
            results[f"k{k}/seed{seed}"] = summarise(_rows(run_dir))
    report = render(results, seeds)
    print(report)
    first = results[f"k0/seed{seeds[0]}"]
    steps = range(3, min(7, len(first["reward"]) + 1))
    plot_timeline({k: results[f"k{k}/seed{seeds[0]}"]["phases"] for k in (0, 1)}, steps,
                  out / "bench_overlap_timeline.png")
    payload = {"config": args.config, "overrides": common, "seeds": seeds, "runs": results, "report": report,
               "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()}}
    for path in filter(None, [out / "bench_overlap.json", args.json and Path(args.json)]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return 0


def render(results: dict[str, dict], seeds: list[int]) -> str:
    lines = ["| seed | K | step s (median from step 3) | trainer waits s | update s | weight sync s | engine generates "
             "s | engine scores s | mean reward | staleness |", "|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for seed in seeds:
        for k in (0, 1):
            r = results[f"k{k}/seed{seed}"]
            lines.append(f"| {seed} | {k} | {r['step_s']:.2f} | {r['wait_rollout_s']:.2f} | {r['update_s']:.2f} | "
                         f"{r['weight_sync_s']:.2f} | {r['generate_s']:.2f} | {r['reward_s']:.2f} | "
                         f"{statistics.mean(r['reward']):.3f} | {max(s or 0 for s in r['staleness'])} |")
        ratios.append(results[f"k1/seed{seed}"]["step_s"] / results[f"k0/seed{seed}"]["step_s"])
    lines.append("")
    lines.append(f"K=1 / K=0 step time, per seed: {', '.join(f'{r:.2f}' for r in ratios)}; median "
                 f"{statistics.median(ratios):.2f}")
    diffs = [statistics.mean(results[f"k1/seed{s}"]["reward"]) - statistics.mean(results[f"k0/seed{s}"]["reward"])
             for s in seeds]
    lines.append(f"mean reward K=1 - K=0, per seed: {', '.join(f'{d:+.3f}' for d in diffs)}")
    first = results[f"k0/seed{seeds[0]}"]
    steps = range(3, min(7, len(first["reward"]) + 1))
    for k in (0, 1):
        lines.append("")
        lines.append(f"timeline, seed {seeds[0]}, K={k}, steps {steps.start}-{steps.stop - 1} "
                     "(G generate + score, U update, S weight sync):")
        lines += ["    " + row for row in timeline(results[f"k{k}/seed{seeds[0]}"]["phases"], steps)]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
