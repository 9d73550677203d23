"""DynaMO's per-step overhead against GRPO, excluding generation, measured in one run (issue 7; the paper: < 3%).

    python benchmarks/bench_overhead.py [--steps N] [--config configs/cpu_default.yaml] [key=value ...]
    python benchmarks/bench_overhead.py --paper [--steps N] [key=value ...]      the paper's 16 mini-batches per step

One process builds one trainer from the recipe (model, vLLM engine, reward workers, prompt history), runs the
recipe's supervised warm-up once, then runs RL steps of several configurations interleaved on that same trainer.
The default set of configurations:

    1 mini-batch   x {GRPO, DynaMO}   the recipe as given (CPU default: 32 prompts per step, one PPO mini-batch)
    2 mini-batches x {GRPO, DynaMO}   trainer.mini_batch_prompts = data.prompts_per_step / 2 (CPU default: 16 of 32)

``--paper`` (issue 15) measures the paper's shape instead: 16 PPO mini-batches (16 optimizer steps) per generation
batch, trainer.mini_batch_prompts = data.prompts_per_step / 16 (the paper: 512 prompts, mini-batches of 32), with
three configurations:

    16 mini-batches x {GRPO, DynaMO scope old_policy, DynaMO scope current_policy}

where ``dynamo.modulation.scope`` says where each mini-batch's modulation scope (H_min, H_max, max Xi) comes from:
old_policy (the default) takes every mini-batch's scope from the old-log-prob pass, which runs anyway (no extra
forward); current_policy is the exact two-pass form, one more no-grad forward over every mini-batch after the first.
``--mini-batches 1,2,16`` and ``--scopes old_policy,current_policy`` choose any other set (``--paper`` is
``--mini-batches 16 --scopes old_policy,current_policy``; without ``--scopes`` DynaMO runs the recipe's scope).
Every other trainer option is a recipe override given to all configurations alike, e.g.
trainer.fused_output_layer=true, trainer.micro_batch_tokens=4096, trainer.pack_sequences=auto.

GRPO is the recipe with ``--algo grpo`` (uniform allocation, no modulation); DynaMO the recipe as given. All share
the seed, the model, the engine and the rollout budget (prompts_per_step x n_avg rollouts per step); each round runs
one step of each configuration, in the order ABCD then DCBA, so that a change of the model (responses get shorter or
longer as it trains) or of the load on the shared machine hits every configuration alike. One untimed round first
(first-call costs), then ``--steps`` timed rounds.

What is measured, per step (the trainer's own stage timers, see megatron_dynamo/trainer/step.py):
    non-generation time = step_seconds - time/rollout - time/reward
time/rollout is generation (vLLM, wake/sleep included); time/reward is math-verify scoring of the generated
texts (same number of responses in both variants; it is the reward function's cost, not DynaMO's). Everything
else stays in: data, allocation (DynaMO's allocator vs uniform counts), advantages (history update and group
advantages), old_logprob (the no-grad forward over all responses, the same in both), modulation_scope (DynaMO
only), train (forward/backward/optimizer; DynaMO's loss carries the modulation arithmetic), weight_sync, and the
broadcasts between them. The table also gives step_seconds - time/rollout alone (reward scoring kept in).

Two clocks. WALL: the trainer's own stage timers (step_seconds, time/<stage>), i.e. what a user waits for. CPU: the
same stages timed with time.process_time() of the trainer process (the benchmark wraps the trainer's stage timer;
the reward workers are separate processes, so their work is not in it; the vLLM engine runs in the trainer process
since 2026-11-23, so its work is in the rollout stage and weight_sync, as on the wall clock). On the 2-core machine
shared with other sessions the wall clock of a step swings by tens of percent with the load of others, and with
two torch threads so does the CPU time (OpenMP threads spin-wait while the other core is taken): hence one torch
thread by default (--threads), which costs this tiny model no wall time here. Both clocks are printed, with means,
medians and the standard error of the paired (same-round) difference; the medians resist the load spikes.

With one mini-batch per step, DynaMO's modulation scope of the first (only) mini-batch is computed from the
old-log-prob pass (pi = pi_old before the first update), so DynaMO's extra work is the allocator and the
modulation arithmetic. With more mini-batches and scope current_policy, every later mini-batch's scope needs the
policy after the updates before it: one extra no-grad forward over that mini-batch, which is real extra compute
(about 15/16 of an old-log-prob pass with 16 mini-batches); scope old_policy has none. Also, with DRA the
mini-batches (split by prompts) hold unequal numbers of responses, and with trainer.micro_batch_tokens = 0 the
trainer pads every micro-batch to micro_batch_size rows, so an uneven split can cost a whole padded micro-batch in
the old-log-prob and training passes (it does on the CPU default: 5 micro-batches of 64 rows instead of 4).
On a tiny model the model passes are cheap, so fixed per-step costs of DynaMO weigh more than they would on a 7B
model: for the paper shape use a larger model, model.config=configs/models/bench-qwen2-30m.json (31M parameters,
hidden 512, 8 layers) or bench-qwen2-100m.json (102M, hidden 768, 12 layers), both with the character tokenizer's
128-entry vocabulary (the command: docs/results/main-job.md; why 31M: docs/changelog.md, issue 15). A random-init
model (--sft-steps 0) generates random characters until EOS or the limit (the character tokenizer's EOS has
probability ~1/128 per token: a geometric length mix, mean ~150 of 384); it still solves a prompt now and then, and
with the recipe's learning rate the 16 updates per step change it so fast that response lengths drift within a
few steps (observed: mean 150 -> 370 tokens in two rounds), which the ABC/CBA order cannot pair away: give such a
run optim.lr=1e-12 (the same compute, a stationary model). Note that this code's GRPO path computes the entropy and sum_j pi_j^2 Lambda_j statistics in its old-log-prob and training
passes too (one routine for both), so the baseline is "this trainer with DynaMO off", not a GRPO that only
computes log-probs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGES = ("data", "allocation", "rollout", "reward", "advantages", "old_logprob", "modulation_scope", "train",
          "weight_sync")
SCOPE_LABELS = {"old_policy": "dynamo:old", "current_policy": "dynamo:cur"}
PAPER_MINI_BATCHES = 16


def _mini_batch_label(count: int) -> str:
    return f"{count} mini-batch" + ("" if count == 1 else "es")


def configurations(prompts_per_step: int, mini_batches: list[int], scopes: list[str] | None):
    """(layout, variant, extra overrides, algo) of every configuration: per mini-batch count, GRPO first, then
    DynaMO with the recipe's scope (``scopes`` None: variant "dynamo") or once per scope ("dynamo:old" / "dynamo:cur").
    Raises ValueError when a count does not divide ``prompts_per_step``."""
    out = []
    for count in mini_batches:
        if count < 1 or prompts_per_step % count:
            raise ValueError(f"data.prompts_per_step ({prompts_per_step}) is not a multiple of {count} mini-batches")
        extra = [f"trainer.mini_batch_prompts={prompts_per_step // count}"]
        layout = _mini_batch_label(count)
        out.append((layout, "grpo", extra, "grpo"))
        if scopes is None:
            out.append((layout, "dynamo", extra, "dynamo"))
        else:
            out += [(layout, SCOPE_LABELS[s], extra + [f"dynamo.modulation.scope={s}"], "dynamo") for s in scopes]
    return out


def _short(layout: str) -> str:
    return layout.split()[0] + "mb"


def _sem(values):
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")


def non_generation(m, clock="wall", include_reward=False):
    """A step's time minus generation (rollout) and, unless ``include_reward``, reward scoring. ``clock``: "wall"
    (the trainer's step_seconds and time/<stage>) or "cpu" (this process's CPU seconds, cpu/<stage>)."""
    prefix, total = ("time/", m["step_seconds"]) if clock == "wall" else ("cpu/", m["cpu_step_seconds"])
    t = total - m.get(prefix + "rollout", 0.0)
    return t if include_reward else t - m.get(prefix + "reward", 0.0)


def install_cpu_stage_timer():
    """Make the trainer's stage timer also record this process's CPU time per stage (time.process_time: all
    threads of the trainer process, the in-process vLLM engine included; the reward workers are other processes).
    CPU time is hardly moved by other work on the machine, unlike wall time. Returns a list holding the last step's
    timer."""
    from contextlib import contextmanager

    import megatron_dynamo.trainer.step as step_module

    last = []
    wall_timer = step_module.StageTimer

    class WallAndCPUStageTimer(wall_timer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.cpu_seconds = {}
            last[:] = [self]

        @contextmanager
        def __call__(self, stage):
            wall, cpu = time.perf_counter(), time.process_time()
            yield
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - wall
            self.cpu_seconds[stage] = self.cpu_seconds.get(stage, 0.0) + time.process_time() - cpu

    step_module.StageTimer = WallAndCPUStageTimer
    return last


def _pairs(measured):
    """(layout, DynaMO variant) of every non-GRPO configuration, with its layout's GRPO as the baseline."""
    return [(layout, variant) for layout, variant in measured if variant != "grpo" and (layout, "grpo") in measured]


def _summary_lines(measured, clock):
    mean, median = statistics.mean, statistics.median
    lines = [f"{'configuration':<17}{'variant':<11}{'step':>8}{'rollout':>9}{'reward':>8}"
             f"{'non-gen mean ± sem':>21}{'median':>9}{'+reward':>9}"]
    prefix, total = ("time/", "step_seconds") if clock == "wall" else ("cpu/", "cpu_step_seconds")
    for (layout, variant), runs in measured.items():
        ng = [non_generation(m, clock) for m in runs]
        lines.append(f"{layout:<17}{variant:<11}{mean(m[total] for m in runs):>8.3f}"
                     f"{mean(m.get(prefix + 'rollout', 0.0) for m in runs):>9.3f}"
                     f"{mean(m.get(prefix + 'reward', 0.0) for m in runs):>8.3f}"
                     f"{mean(ng):>12.3f} ± {_sem(ng):.3f}{median(ng):>9.3f}"
                     f"{mean(non_generation(m, clock, True) for m in runs):>9.3f}")
    lines += ["DynaMO / GRPO (paired: each round's DynaMO step minus the same round's GRPO step):",
              f"{'configuration':<17}{'variant':<11}{'ratio of means':>15}{'ratio of medians':>18}"
              f"{'paired diff, mean ± sem':>30}{'paired diff, median':>22}{'+reward, ratio of means':>25}"]
    for layout, variant in _pairs(measured):
        grpo, dyn = measured[(layout, "grpo")], measured[(layout, variant)]
        g, d = [non_generation(m, clock) for m in grpo], [non_generation(m, clock) for m in dyn]
        diff = [b - a for a, b in zip(g, d)]
        base_mean, base_median = mean(g), median(g)
        with_reward = (mean(non_generation(m, clock, True) for m in dyn)
                       / mean(non_generation(m, clock, True) for m in grpo))
        pct, pct_sem = 100 * mean(diff) / base_mean, 100 * _sem(diff) / base_mean
        lines.append(f"{layout:<17}{variant:<11}{mean(d) / base_mean:>15.3f}{median(d) / base_median:>18.3f}"
                     f"{mean(diff):>+12.3f}s ({pct:+5.1f}% ± {pct_sem:4.1f}%)"
                     f"{median(diff):>+12.3f}s ({100 * median(diff) / base_median:+5.1f}%){with_reward:>25.3f}")
    # The configurations sample different responses (DRA's counts, the seeds): their lengths differ from step to step
    # (a geometric length mix of 64 responses: ~10% per step), and the model passes scale with them.
    lines += ["The same per generated token (non-gen / (rollouts x mean response tokens); the model passes scale with "
              "the tokens, padding aside):",
              f"{'configuration':<17}{'variant':<11}{'ms/token GRPO':>15}{'ms/token DynaMO':>17}{'ratio of means':>16}"
              f"{'ratio of medians':>18}"]
    for layout, variant in _pairs(measured):
        per = {v: [1000 * non_generation(m, clock) / max(1.0, m.get("rollouts", 0) * m.get("response_length_mean", 0))
                   for m in measured[(layout, v)]] for v in ("grpo", variant)}
        g, d = per["grpo"], per[variant]
        lines.append(f"{layout:<17}{variant:<11}{mean(g):>15.3f}{mean(d):>17.3f}{mean(d) / mean(g):>16.3f}"
                     f"{median(d) / median(g):>18.3f}")
    return lines


def _stages(measured, prefix):
    """The stage names of the steps: the known ones in step order, then any other the trainer timed."""
    found = {k[len(prefix):] for runs in measured.values() for m in runs for k in m if k.startswith(prefix)}
    return [s for s in STAGES if s in found or s in ("rollout", "reward")] + sorted(found - set(STAGES))


def _stage_lines(measured, clock):
    prefix, total = ("time/", "step_seconds") if clock == "wall" else ("cpu/", "cpu_step_seconds")
    columns = list(measured)
    pairs = _pairs(measured)
    stages = _stages(measured, prefix)
    labels = [f"{_short(layout)} {variant}" for layout, variant in columns]
    width = max(12, max(len(label) for label in labels) + 1)
    diff_labels = [f"{_short(layout)} {'diff' if variant == 'dynamo' else variant.replace('dynamo', 'd')}"
                   for layout, variant in pairs]
    lines = [f"{'stage':<18}" + "".join(f"{label:>{width}}" for label in labels)
             + "".join(f"{label:>{width}}" for label in diff_labels)]
    for stage in stages + ["other"]:
        values = {}
        for key in columns:
            if stage == "other":  # broadcasts, metric collection: the step minus all its timed stages
                per = [m[total] - sum(m.get(prefix + s, 0.0) for s in stages) for m in measured[key]]
            else:
                per = [m.get(prefix + stage, 0.0) for m in measured[key]]
            values[key] = statistics.median(per)
        lines.append(f"{stage:<18}" + "".join(f"{values[k]:>{width}.4f}" for k in columns)
                     + "".join(f"{values[(l, v)] - values[(l, 'grpo')]:>+{width}.4f}" for l, v in pairs))
    return lines


def format_report(measured, args, base) -> str:
    """Summary tables (wall clock, then CPU time), DynaMO/GRPO ratios, per-stage medians."""
    mean = statistics.mean
    columns = list(measured)
    width = max(12, max(len(f"{_short(l)} {v}") for l, v in columns) + 1)
    lines = [f"recipe {args.config} {' '.join(args.overrides)}".rstrip()
             + f"; {base.data.prompts_per_step} prompts x n_avg {base.dynamo.allocation.n_avg} rollouts per step; "
             f"{args.steps} timed steps per configuration, interleaved in one process; {os.cpu_count()} CPU cores, "
             f"torch threads: {args.threads}",
             "non-gen = step - rollout - reward (seconds per step); +reward = step - rollout (reward scoring kept)"]
    if any(v.startswith("dynamo:") for _, v in columns):
        lines.append("dynamo:old = DynaMO, dynamo.modulation.scope=old_policy (scopes from the old-log-prob pass); "
                     "dynamo:cur = scope current_policy (one more no-grad forward per later mini-batch)")
    lines += ["", "WALL CLOCK (step_seconds, time/<stage>)"]
    lines += _summary_lines(measured, "wall")
    lines += ["", "TRAINER-PROCESS CPU TIME (process_time over the step and each stage; the in-process vLLM engine "
              "included, the reward workers are other processes)"]
    lines += _summary_lines(measured, "cpu")
    lines += ["", "per-stage seconds per step, median over steps: wall clock"]
    lines += _stage_lines(measured, "wall")
    lines += ["", "per-stage seconds per step, median over steps: trainer-process CPU time"]
    lines += _stage_lines(measured, "cpu")
    rows = [("rollouts/step", "rollouts", "{:.0f}"), ("optimizer steps", "optimizer_steps", "{:.1f}"),
            ("mean resp. tokens", "response_length_mean", "{:.1f}"),
            ("max resp. tokens", "rollout/response_length_max", "{:.0f}"),
            ("truncated frac", "rollout/truncated_frac", "{:.3f}")]
    for label, key, fmt in rows:
        lines.append(f"{label:<18}" + "".join(
            f"{fmt.format(mean(m.get(key, float('nan')) for m in measured[k])):>{width}}" for k in columns))
    return "\n".join(lines)


def _write_json(path, measured):
    with open(path, "w", encoding="utf-8") as f:
        json.dump({f"{layout} / {variant}": runs for (layout, variant), runs in measured.items()}, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides (all configurations)")
    parser.add_argument("--config", default="configs/cpu_default.yaml", help="YAML recipe (default: the CPU default)")
    parser.add_argument("--steps", type=int, default=24,
                        help="timed rounds; each round runs one step of each configuration (default 24)")
    parser.add_argument("--paper", action="store_true",
                        help=f"the paper's shape: {PAPER_MINI_BATCHES} mini-batches per step (trainer.mini_batch_prompts "
                             f"= data.prompts_per_step / {PAPER_MINI_BATCHES}), GRPO vs DynaMO with scope old_policy "
                             "and with scope current_policy (= --mini-batches 16 --scopes old_policy,current_policy)")
    parser.add_argument("--mini-batches", default=None, metavar="N[,N...]",
                        help="PPO mini-batches per step, one layout each (default 1,2; --paper: 16); each must divide "
                             "data.prompts_per_step")
    parser.add_argument("--scopes", default=None, metavar="SCOPE[,SCOPE...]",
                        help="DynaMO variants by dynamo.modulation.scope: old_policy and/or current_policy (default: "
                             "one DynaMO variant with the recipe's scope; --paper: both)")
    parser.add_argument("--sft-steps", type=int, default=None,
                        help="supervised warm-up steps before RL (default: the recipe's trainer.sft_warmup_steps)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of the trainer (default 1; 0: torch's default, 2 here, as in "
                             "dynamo train). On the 2-core machine 2 threads give the same wall time for this tiny "
                             "model but OpenMP threads spin while the other core is busy, so both clocks then swing "
                             "with the load of other work")
    parser.add_argument("--fixed-length", action="store_true",
                        help="every response exactly rollout.max_response_tokens long (EOS and stop ids ignored), so "
                             "that all configurations train on the same number of tokens and only their own work "
                             "differs (a model under training samples different lengths per configuration)")
    parser.add_argument("--json", default=None,
                        help="also write every timed step's metrics to this JSON file (rewritten after every round)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the ± needs two rounds)")
    try:
        mini_batches = [int(x) for x in (args.mini_batches or ("16" if args.paper else "1,2")).split(",") if x]
    except ValueError:
        parser.error(f"--mini-batches takes comma-separated integers, got {args.mini_batches!r}")
    scopes = args.scopes or ("old_policy,current_policy" if args.paper else None)
    scopes = None if scopes is None else [x for x in scopes.split(",") if x]
    if scopes is not None and (not scopes or set(scopes) - set(SCOPE_LABELS)):
        parser.error(f"--scopes takes {' and/or '.join(SCOPE_LABELS)}, got {args.scopes!r}")

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for noisy in ("megatron", "megatron.core", "vllm"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import torch

    from megatron_dynamo.config import apply_overrides, build, load_yaml
    from megatron_dynamo.rollout.weight_sync import sync_weights
    from megatron_dynamo.trainer.config import RunConfig, load_run_config
    from megatron_dynamo.trainer.trainer import Trainer

    workdir = tempfile.mkdtemp(prefix="bench_overhead_")
    common = list(args.overrides) + [f"trainer.output_dir={workdir}"]
    if args.sft_steps is not None:
        common.append(f"trainer.sft_warmup_steps={args.sft_steps}")
    # data.prompts_per_step before validation: the recipe's mini_batch_prompts need not divide it (each layout sets it)
    prompts_per_step = build(RunConfig, apply_overrides(load_yaml(args.config), common)).data.prompts_per_step
    try:
        plan = configurations(prompts_per_step, mini_batches, scopes)
    except ValueError as exc:
        parser.error(str(exc))
    configs = {(layout, variant): load_run_config(args.config, common + extra, algo=algo)
               for layout, variant, extra, algo in plan}
    keys = list(configs)
    base = configs[keys[0]]

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    last_timer = install_cpu_stage_timer()
    trainer = Trainer(configs[next(k for k in keys if k[1] != "grpo")])
    if args.fixed_length:
        trainer.runner.sampling = dataclasses.replace(trainer.runner.sampling, ignore_eos=True, stop_token_ids=(),
                                                      min_tokens=trainer.runner.sampling.max_tokens)
    args.threads = torch.get_num_threads()
    measured = {k: [] for k in keys}
    started = time.perf_counter()  # after the trainer is built: "total" is warm-up plus steps
    try:
        t0 = time.perf_counter()
        trainer.sft_warmup()
        sync_weights(trainer.engine, trainer.actor, dtype=trainer.rollout_dtype)
        print(f"SFT warm-up ({base.trainer.sft_warmup_steps} steps) and first weight sync: "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
        step = 0
        for round_index in range(args.steps + 1):  # round 0: untimed
            order = keys if round_index % 2 == 0 else keys[::-1]
            for key in order:
                step += 1
                trainer.runner.run = configs[key]
                cpu = time.process_time()
                metrics = trainer.runner.run_step(step)
                metrics["cpu_step_seconds"] = time.process_time() - cpu
                metrics.update({f"cpu/{k}": v for k, v in last_timer[0].cpu_seconds.items()})
                if metrics.get("skipped"):
                    print(f"warning: step {step} ({key}): {metrics['skipped']}", flush=True)
                if round_index > 0:
                    measured[key].append(metrics)
            label = "warm-up round" if round_index == 0 else f"round {round_index}/{args.steps}"
            print(f"{label} done ({time.perf_counter() - started:.0f}s)", flush=True)
            if args.json and round_index > 0:  # kept round by round: a run stopped early keeps its rounds
                _write_json(args.json, measured)
    finally:
        trainer.close()
        shutil.rmtree(workdir, ignore_errors=True)

    if args.json:
        _write_json(args.json, measured)
    print()
    print(format_report(measured, args, base))
    print(f"\ntotal {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
