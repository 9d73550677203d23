"""Importable entry points of the nemo-run recipes (``run.Partial`` targets). No nemo-run import here.

Under torchrun / srun every process calls :func:`train` with the same config and is one rank: it runs the code path
of ``dynamo train`` (``launch.ranks.train_on_rank``). Failures exit non-zero; nemo-run's batch script requeues the
job then (retries left), except after a failure a new start would repeat: those print
``launch.requeue.NOT_REQUEUED`` with the reason, which the script looks for (``launch/requeue.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_dynamo.config import ConfigError, validate_tree
from megatron_dynamo.launch.ranks import launch_training, resolve_topology
from megatron_dynamo.launch.requeue import not_requeued
from megatron_dynamo.models.checkpoint_dirs import latest_checkpoint
from megatron_dynamo.parallel.spawn import RankError
from megatron_dynamo.trainer.config import RunConfig, with_algorithm
from megatron_dynamo.trainer.preflight import check_run_inputs
from megatron_dynamo.trainer.errors import RolloutError
from megatron_dynamo.trainer.trainer import ResumeError, TrainingError, TrainingStopped


def train(config: RunConfig, algo: str = "dynamo", resume: bool = True) -> None:
    """Train ``config`` (a recipe's RunConfig) with ``algo``. ``resume=True`` continues from the latest complete
    checkpoint under the run's checkpoint directory and starts from scratch when there is none (the trainer logs
    a warning), so the same task serves the first submission and every requeue."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    try:
        run = with_algorithm(config, algo)
        validate_tree(run)
        topology = resolve_topology(run)
        run = check_run_inputs(run)  # hub ids -> local snapshots (one of several ranks: from the cache only)
    except ConfigError as exc:
        print(f"dynamo launch: {exc}\n{not_requeued('bad input (exit 2)')}", file=sys.stderr)
        raise SystemExit(2) from None
    try:  # under torchrun/srun this process is one rank; a single process spawns the model-parallel ranks
        launch_training(run, topology, resume)
    except (TrainingError, RolloutError, RankError) as exc:
        print(f"dynamo launch: rank {os.environ.get('RANK', os.environ.get('SLURM_PROCID', '0'))}: {exc}",
              file=sys.stderr)
        # A stop signal (its step saved), a failed rollout (an engine or a device) or a lost rank: a new start may
        # succeed, the job requeues. What a new start would repeat ends it (launch/requeue.py).
        if isinstance(exc, TrainingError) and not isinstance(exc, TrainingStopped):
            code = 2 if isinstance(exc, ResumeError) else 1
            print(not_requeued(f"the run cannot go on (exit {code})"), file=sys.stderr)
            raise SystemExit(code) from None
        raise SystemExit(1) from None


def resolve_checkpoint(path: str) -> str:
    """A training checkpoint directory (``<output_dir>/checkpoints``, holding ``latest``) -> its latest step
    directory; any other path unchanged. Resolved when the job runs, not when it is submitted."""
    latest = latest_checkpoint(path)
    return str(latest) if latest is not None else path


def convert_args(direction: str, src: str, out: str, tp: int = 1, pp: int = 1, tokenizer: str | None = None,
                 dtype: str | None = None, force: bool = False, ep: int = 1) -> list[str]:
    """``python -m checkpoints_convert`` arguments. hf-to-megatron: ``src`` is the HF directory; megatron-to-hf:
    a Megatron checkpoint, a training ``step_N`` directory, or a ``checkpoints`` directory (its latest step).
    ``ep``: the experts' split while converting a mixture-of-experts model (``--ep``; 1 is left out)."""
    if direction == "hf-to-megatron":
        args = [direction, "--hf", src, "--out", out]
    elif direction == "megatron-to-hf":
        args = [direction, "--megatron", resolve_checkpoint(src), "--out", out]
        if tokenizer:
            args += ["--tokenizer", tokenizer]
    else:
        raise ValueError(f"direction must be hf-to-megatron or megatron-to-hf, got {direction!r}")
    args += ["--tp", str(tp), "--pp", str(pp)] + (["--ep", str(ep)] if ep != 1 else [])
    if dtype:
        args += ["--dtype", dtype]
    if force:
        args.append("--force")
    return args


def convert(direction: str, src: str, out: str, tp: int = 1, pp: int = 1, tokenizer: str | None = None,
            dtype: str | None = None, force: bool = False, ep: int = 1) -> None:
    """Run the checkpoint converter as its own process: ``python -m checkpoints_convert`` hides the GPUs before
    torch is imported and spawns its tp x pp CPU workers itself."""
    args = convert_args(direction, src, out, tp, pp, tokenizer, dtype, force, ep)
    print("dynamo launch: python -m checkpoints_convert " + " ".join(args), flush=True)
    code = subprocess.run([sys.executable, "-m", "checkpoints_convert", *args], check=False).returncode
    if code > 0:  # the converter's own error (its line is above): the same input fails again
        print(not_requeued(f"the conversion failed (exit {code})"), file=sys.stderr, flush=True)
    if code:
        raise SystemExit(code if code > 0 else 1)
