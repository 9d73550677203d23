"""Train a policy with DynaMO (or plain GRPO) from a YAML recipe, with key=value overrides.

    dynamo train configs/cpu_default.yaml
    dynamo train configs/cpu_default.yaml trainer.steps=40 dynamo.allocation.power=0.5
    dynamo train configs/cpu_default.yaml --algo grpo
    dynamo train configs/cpu_default.yaml --resume          # continue from the latest checkpoint

Every key of the recipe can be overridden as section.key=value (values are YAML: numbers, true/false, null);
an unknown key or a bad value is an error before anything is built. Ablations switch single parts off:
dynamo.allocation.enabled=false (DRA), dynamo.modulation.gc=false (GC), dynamo.modulation.ums=false (UMS).
The controls of docs/ablation.md: dynamo.modulation.pos_weight=true with gc=false (every positive advantage x
(1 + alpha)), dynamo.loss.prompt_weight=equal (every prompt weighs the same in the loss, whatever its rollouts),
dynamo.sampling.dynamic=true (DAPO's dynamic sampling: rounds of prompts until the step has prompts_per_step groups
whose rewards differ, at most dynamo.sampling.max_refills refills; dynamo.sampling.oversample sizes a round).

Launch: a single process runs all ranks itself when --nproc > 1 (gloo on CPU, one GPU per rank on GPUs);
under torchrun or srun (RANK/WORLD_SIZE or SLURM_PROCID set) each process is one rank. Every rank hosts a vLLM
worker inside its own process: rollout.tensor_parallel consecutive ranks form one engine, each engine generates its
share of a step's prompts (docs/rollout.md). With rollout.placement=separate rollout.engine_ranks=N the last N ranks
only generate and score while the others train, and rollout.max_staleness=K lets them generate up to K steps ahead
(generation overlapped with the update; docs/rollout.md, "Separate engine ranks"). On a GPU, a layout whose memory
plan exceeds the GPU's memory is refused before anything is built: exit 2, one line naming the largest term and a key
that makes it fit (docs/cluster.md, "The memory plan").
Output: <trainer.output_dir>/metrics.jsonl, prompts.jsonl, tensorboard/, reward_curve.png, checkpoints/,
config.json, provenance.json (the machine, code and start checkpoint's hash, recorded at every start) and
rollouts.jsonl with logging.rollouts=true.

Stopping: SIGINT (Ctrl-C), SIGTERM or SIGUSR1 (Slurm's time-limit notice, --signal=USR1@300) stops the run after
the current step: every rank stops after the same step, that step's checkpoint is saved (if it was not already), the
rollout engine and reward workers are shut down, and the command exits with a line naming the saved step (exit status
130 for SIGINT, 143 for SIGTERM); --resume continues from it. A second SIGINT or SIGTERM stops at once, without a
checkpoint; a repeated SIGUSR1 is ignored. With --nproc > 1 the signal goes to this
process, which passes it on to the ranks; under torchrun/srun every rank must receive it. However the run ends
(kill -9 included), a watchdog process stops whatever it started (ranks, reward workers), within a few seconds.
The reward workers run in sessions of their own, so Ctrl-C at a terminal reaches the trainer only; a signal sent
to every process of the run (scancel, Slurm's preemption) stops them too, and the step in progress then fails
instead of finishing. Under torchrun the agent kills its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by
default) after passing SIGTERM on: scripts/slurm/train.sbatch sets it to STOP_GRACE (270 s) and, at the time limit,
signals torchrun alone (docs/cluster.md).
"""

from __future__ import annotations

import os
import sys

from megatron_dynamo import heap, library_logs
from megatron_dynamo.algorithms.baselines import ALGO_HELP, BASELINES, algorithm_note
from megatron_dynamo.config import ConfigError
from megatron_dynamo.launch.memory_check import check_job_memory
from megatron_dynamo.launch.ranks import device_memory, launch_training, resolve_topology
from megatron_dynamo.models.checkpoint_io.signing import signing_key, trust_line
from megatron_dynamo.parallel import stop_signals
from megatron_dynamo.parallel.runtime import detect_launch, launcher
from megatron_dynamo.parallel.spawn import RankError
from megatron_dynamo.parallel.topology import JobTopology, plural
from megatron_dynamo.trainer.checkpoint import BAD_CHECKPOINT
from megatron_dynamo.trainer.config import ALGORITHMS, load_run_config
from megatron_dynamo.trainer.preflight import check_run_inputs, check_training_prompts
from megatron_dynamo.trainer.errors import RolloutError
from megatron_dynamo.trainer.trainer import TrainingError


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML recipe (see configs/); sections: model, parallel, data, rollout, "
                                       "dynamo, optim, trainer, checkpoint, logging")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of recipe keys")
    parser.add_argument("--algo", choices=ALGORITHMS, default="dynamo",
                        help=ALGO_HELP)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint under the run's checkpoint directory")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to spawn on this machine (default: tensor x pipeline parallel size, plus "
                             "rollout.engine_ranks with rollout.placement=separate); colocated, each hosts a vLLM "
                             "worker, so it runs N / rollout.tensor_parallel engines (N must be a multiple of it); "
                             "ignored under torchrun/srun")


def layout_line(cfg, topology: JobTopology, kind: str) -> str:
    """The header's second line: ranks, who started them, the training layout and the rollout engines."""
    world = topology.world_size
    started = {"torchrun": "torchrun", "slurm": "srun", "single": "this process" if world == 1 else "--nproc"}
    line = f"{plural(world, 'rank')} ({started[kind]}): {topology.describe()}"
    if topology.separate:
        steps = cfg.rollout.max_staleness
        line += ", on-policy" if steps == 0 else f", up to {plural(steps, 'step')} off-policy"
    return line


def equals_grpo_note(cfg, algo: str) -> str | None:
    """A note when ``algo`` cannot differ from GRPO: with one PPO mini-batch a step and one epoch every update runs
    at the policy that generated the responses, the ratio is 1, and a ratio-only baseline gives GRPO's metrics."""
    mini_batches = cfg.data.prompts_per_step // cfg.trainer.mini_batch_prompts * cfg.trainer.ppo_epochs
    if algo not in BASELINES or not BASELINES[algo].ratio_only or mini_batches > 1:
        return None
    return (f"note: --algo {algo} acts only where pi / pi_old moves away from 1; with one mini-batch a step "
            f"(data.prompts_per_step = trainer.mini_batch_prompts = {cfg.trainer.mini_batch_prompts}, ppo_epochs 1) "
            f"it never does, and this run equals --algo grpo; to see it act, give a step several, e.g. "
            f"trainer.mini_batch_prompts={max(1, cfg.trainer.mini_batch_prompts // 4)}")


def main(args) -> int:
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    try:
        with heap.start_up():  # the prompts' check imports the tokenizer's libraries
            cfg = load_run_config(args.config, args.overrides, algo=args.algo)
            # The layout, missing files, an output directory holding another run, a layout whose memory plan exceeds
            # the GPU's memory, too few or too long prompts: one
            # line now (exit 2, nothing written), not a traceback after the ranks start. Hub ids are resolved here,
            # once: the ranks get the local snapshot directories.
            topology = resolve_topology(cfg, args.nproc)
            cfg = check_run_inputs(cfg, resume=args.resume)
            # A GPU's memory plan over the device's memory (launch/memory_check.py; none on CPU).
            check_job_memory(cfg, topology, device_memory())
            prompt_note = check_training_prompts(cfg)
    except (ConfigError, OSError) as exc:
        print(f"dynamo train: {exc}", file=sys.stderr)
        return 2
    # The console: one line per step, not the libraries' start-up chatter (logging.verbose brings it back).
    library_logs.apply(cfg.logging.verbose)
    if not cfg.logging.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if detect_launch().rank == 0:
        _print_header(args, cfg, topology, prompt_note)
    try:
        launch_training(cfg, topology, args.resume)
    except (TrainingError, RolloutError, RankError) as exc:
        print(f"dynamo train: {exc}", file=sys.stderr)
        # Stopped by a signal (or failed while stopping): the status a shell gives a process the signal ended.
        signum = getattr(exc, "signum", None) or stop_signals.received()
        if signum:
            return stop_signals.exit_code(signum)
        return 2 if _no_intact_checkpoint(exc) else 1
    return 0


def _print_header(args, cfg, topology: JobTopology, prompt_note: str | None) -> None:
    """Rank 0's lines before the run: what runs, on which layout, and the notes about the settings."""
    print(f"dynamo train: {args.config} ({args.algo}{', resumed' if args.resume else ''}), "
          f"{cfg.trainer.steps} steps -> {cfg.trainer.output_dir}", flush=True)
    print(f"dynamo train: {layout_line(cfg, topology, launcher())}", flush=True)
    if prompt_note:
        print(f"dynamo train: {prompt_note}", flush=True)
    for note in (equals_grpo_note(cfg, args.algo), algorithm_note(args.algo, cfg.dynamo.loss.name)):
        if note:
            print(f"dynamo train: {note}", flush=True)
    if cfg.rollout.max_staleness and cfg.dynamo.loss.engine_is == "off":
        print(f"dynamo train: rollout.max_staleness={cfg.rollout.max_staleness} with dynamo.loss.engine_is=off: "
              "the gradient ignores that the samples come from older weights (engine_is=truncate weighs each "
              "token by the proximal/behaviour ratio: docs/rollout.md)", flush=True)
    print(f"dynamo train: {trust_line(signing_key())}", flush=True)


def _no_intact_checkpoint(exc: BaseException) -> bool:
    """--resume found only damaged checkpoints, or model.checkpoint does not verify (on one rank or, through
    RankError, on all): bad input, exit 2."""
    texts = [text for _, text in exc.errors] if hasattr(exc, "errors") else [str(exc)]
    return all(text.startswith(BAD_CHECKPOINT) for text in texts)
