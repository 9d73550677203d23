"""Side by side with a peer (issue 35, item 6; issue 43): our ``dynamo train --algo grpo`` against TRL's GRPOTrainer.

    python benchmarks/bench_peer.py [--shape cpu_default|large|both] [--placement colocated|overlapped|both]
                                    [--pairs 2] [--steps N] [--work DIR]
    python benchmarks/bench_peer.py --sweep [--sweep-lengths 16,64,256,1024] [--sweep-models tiny,30m,100m,0.5b]
                                    [--sweep-budget-s S] [--work DIR]          (benchmarks/peer_sweep.py)
    python benchmarks/bench_peer.py --plot-only benchmarks/results/bench_peer_sweep.json   (the sweep's plot again)

Both sides get the same exported warm-up model (our supervised warm-up, ``trainer.steps=0
checkpoint.export_hf=true``, written once per shape under ``--work`` and reused), the same prompts in the same order
(our prompt sampler's, step by step; TRL reads them in order and each step checks that it got the step's prompts),
the same reward (megatron_dynamo.reward's math-verify scorer, wrapped as TRL's reward function, truncated responses
0 as ours), the same group size, Adam (lr, betas, eps, weight decay, gradient clip 1.0, constant lr), temperature,
top-p, maximum response tokens, micro-batch size, clip range, token-mean loss and step count, one mini-batch and one
epoch per step. TRL generates with transformers ``generate`` (no vLLM), the peer side is ``benchmarks/peer_trl.py``;
running either side is ``benchmarks/peer_runs.py``.

Runs are alternated and paired (A B A B ...: ours, then TRL, per pair), one process tree at a time. Each run's whole
process tree (trainer, in-process vLLM, reward workers, watchdog) is sampled: summed CPU time (user + system of every
process) every ``--interval`` seconds, PSS (psutil's ``memory_full_info().pss``: shared pages split among the
processes that map them, so a tree's sum counts each page once) every ``--pss-interval`` seconds (a PSS read slows
the measured process: ``peer_tree.py``; until 2026-11-29 it was read every 0.1 s too). Reported per run
(``peer_report.py``):

    step        median of the trainer's own step seconds from step 3 (ours: step_seconds; TRL: on_step_begin to
                on_step_end), where the first steps' one-time costs are over
    wall/step   wall time from the end of step 2 to the end of the last step over the steps between (logging,
                checkpointing between steps included)
    CPU/step    the tree's CPU seconds over the same window, per step
    start-up    launch of the command to the start of step 1 (imports, model, engine, reward workers, first sync);
                under the table, each side's phases as its first step's record gives them (``startup/``: ours,
                docs/metrics.md, of the training rank; TRL's, peer_trl.py)
    peak PSS    the largest sampled PSS of the tree over the run
    parts       medians from step 3: generation, reward, old_logprob, update, weight_sync, other (ours: time/rollout,
                time/reward, time/old_logprob, time/train, time/weight_sync, the rest of step_seconds; TRL: see
                peer_trl.py, other = its scoring's padding/advantages/metrics)

Placements of ours (``--placement``; default both at the CPU default, colocated at the large shape): ``colocated``
is the recipe's one rank, the stages of a step in turn; ``overlapped`` is ``--nproc 2 rollout.placement=separate
rollout.engine_ranks=1 rollout.max_staleness=1`` (rank 0 trains, rank 1 generates and scores one step ahead, the
staleness corrected by ``dynamo.loss.engine_is=truncate``; docs/rollout.md). With both, each pair runs ours
colocated, ours overlapped, then TRL (A B C A B C ...), and the table has a row set per placement, each against the
same TRL runs (TRL has the same two cores). An overlapped step is one step of the trainer rank: the wait for its
batch (part wait_rollout: the generation and scoring the previous update did not hide), the update and the weight
hand-over. Its generation and reward parts are the engine rank's time for the batch the step trained on, spent
while the trainer updated on the batch before: off-policy, they overlap the update and do not add up to the step.

Ratios are ours / TRL per pair, then the median over pairs. The table, headed by the machine (CPU model, cores,
memory, the torch / vLLM / transformers / TRL versions), goes to stdout and, with the raw per-step records and
samples, to ``benchmarks/results/bench_peer_<shape>.json`` (``pairs``: per pair ``ours``, ``ours_overlapped``,
``trl``, as measured). Shapes:

    cpu_default  configs/cpu_default.yaml: tiny Qwen2, 32 prompts x 8, 6-token responses, 20 steps
    large        the 101M-parameter configs/models/bench-qwen2-100m.json from random weights (no warm-up: its
                 responses run to EOS or 256 tokens), 4 prompts x 8, 256-token responses, lr 1e-6 (the paper's:
                 response lengths stay put over the steps), 5 steps. Micro-batches: TRL's of 8 sequences; ours as
                 our GPU recipes run them, token budgets (``trainer.micro_batch_tokens``) of 8 longest sequences
                 (8 x (16 + 256)), the sequences binned longest first, so a micro-batch is padded to its own
                 longest and not the step's (the responses' lengths range from a few tokens to 256). Both sides
                 rerun every layer in the backward (ours ``trainer.recompute=full``; TRL's gradient checkpointing,
                 its default). Elsewhere neither does: TRL's ``gradient_checkpointing`` follows our recompute

``--sweep``: step time against response length x model size, every response exactly the point's length on both
sides (benchmarks/peer_sweep.py; its plot, benchmarks/peer_plot.py, goes to docs/results/peer_sweep.png).

The machine should be quiet: the load average before and after each run is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_plot  # noqa: E402  (benchmarks/peer_plot.py)
import peer_sweep  # noqa: E402
from peer_report import PLACEMENTS, machine_info, table  # noqa: E402
from peer_runs import ROOT, export_model, peer_spec, run_config, run_ours, run_trl  # noqa: E402

SHAPES = {
    "cpu_default": {"recipe": "configs/cpu_default.yaml", "overrides": [], "rl": [], "steps": 20},
    "large": {"recipe": "configs/cpu_default.yaml",
              "overrides": ["model.config=configs/models/bench-qwen2-100m.json", "trainer.sft_warmup_steps=0",
                            "rollout.max_response_tokens=256"],
              "rl": ["data.prompts_per_step=4", "trainer.mini_batch_prompts=4", "trainer.micro_batch_size=8",
                     "trainer.micro_batch_tokens=2176", "optim.lr=1e-6", "trainer.recompute=full"],
              "steps": 5},
}


def placements_of(shape: str, choice: str | None) -> list[str]:
    """Our placements measured at ``shape``: ``--placement``, by default both at the CPU default, else colocated."""
    choice = choice or ("both" if shape == "cpu_default" else "colocated")
    return list(PLACEMENTS) if choice == "both" else [choice]


def fresh(directory: Path) -> Path:
    """This benchmark's own run directory: a new run each time."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def bench_shape(name: str, args, work: Path) -> str:
    shape = SHAPES[name]
    steps = args.steps or shape["steps"]
    if steps < 4:
        raise SystemExit("bench_peer: --steps must be >= 4 (medians from step 3, windows from step 2)")
    placements = placements_of(name, args.placement)
    shape_dir = work / name
    shape_dir.mkdir(parents=True, exist_ok=True)
    hf = export_model(shape, shape_dir)
    _, run = run_config(shape, hf, steps)
    pairs, traces = [], []
    for index in range(args.pairs):  # per pair: ours in each placement, then TRL (A B C A B C ...)
        pair, trace = {}, {}
        for placement in placements:
            key = PLACEMENTS[placement][0]
            pair[key], trace[key] = run_ours(shape, hf, steps, fresh(shape_dir / f"pair{index}_{key}"),
                                             args.interval, placement, args.pss_interval)
            pair[key]["rollouts"] = run.data.prompts_per_step * run.dynamo.allocation.n_avg
            print(f"bench_peer: {name} pair {index} {key}: step {pair[key]['step_s']:.3f} s, "
                  f"peak {pair[key]['peak_pss_gib']:.2f} GiB", flush=True)
        trl_dir = fresh(shape_dir / f"pair{index}_trl")
        pair["trl"], trace["trl"] = run_trl(peer_spec(run, hf, steps, trl_dir), trl_dir, args.interval,
                                            args.pss_interval)
        print(f"bench_peer: {name} pair {index} TRL: step {pair['trl']['step_s']:.3f} s, "
              f"peak {pair['trl']['peak_pss_gib']:.2f} GiB", flush=True)
        pairs.append(pair)
        traces.append(trace)
    machine = machine_info()
    row_sets = {p: [(pair[PLACEMENTS[p][0]], pair["trl"]) for pair in pairs] for p in placements}
    text = table(f"{name} ({run.data.prompts_per_step} prompts x {run.dynamo.allocation.n_avg}, "
                 f"{run.rollout.max_response_tokens}-token responses, {steps} steps)", row_sets, machine)
    result = {"shape": name, "steps": steps, "placements": placements, "pairs": pairs, "traces": traces,
              "machine": machine, "table": text, "date": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.json_dir) / f"bench_peer_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return text + f"\n\n(JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out})"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=(*SHAPES, "both"), default="both", help="which shape (default both)")
    parser.add_argument("--placement", choices=(*PLACEMENTS, "both"), default=None,
                        help="our placements (default: both at cpu_default, colocated at large)")
    parser.add_argument("--pairs", type=int, default=2, help="ours/TRL pairs per shape, alternated (default 2)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per run (default: the shape's, 20 and 5; the sweep's 3)")
    parser.add_argument("--work", default=None, help="directory for the start models and the runs (default: a new "
                                                     "temporary one); an exported model found there is reused")
    parser.add_argument("--interval", type=float, default=0.1,
                        help="process-tree sampling period of CPU time and step ends, s (default 0.1)")
    parser.add_argument("--pss-interval", type=float, default=1.0,
                        help="period of the tree's PSS reads, s (default 1.0; each read walks the page tables of "
                             "the measured processes and slows them: peer_tree.py)")
    parser.add_argument("--json-dir", default=str(ROOT / "benchmarks" / "results"),
                        help="where the JSON goes (default benchmarks/results)")
    peer_sweep.add_options(parser)
    parser.add_argument("--plot-only", metavar="JSON", default=None,
                        help="only draw the sweep's plot from its JSON (--plot, default docs/results/peer_sweep.png)")
    parser.add_argument("--plot", default=str(peer_plot.DEFAULT_PLOT), help="where the sweep's plot goes")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    try:
        peer_sweep.check_options(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        print(f"bench_peer: plot {peer_plot.plot_sweep(json.loads(Path(args.plot_only).read_text()), args.plot)}")
        return 0
    import trl  # noqa: F401 -- the peer: a missing install fails here, before any run

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the run in progress too (peer_tree.trace_run)

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_peer_")).resolve()
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    if args.sweep:
        print(peer_sweep.run_sweep(args, work), flush=True)
        return 0
    for name in (SHAPES if args.shape == "both" else [args.shape]):
        print(bench_shape(name, args, work), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
