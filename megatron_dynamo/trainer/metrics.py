"""Per-step metrics: one JSON object per line in ``<output dir>/metrics.jsonl``, TensorBoard scalars, Weights &
Biases (optional), a one-line summary per step on the console (with the ETA, above a progress bar on a terminal),
and a reward curve PNG at the end. Only the process that owns the logger (rank 0) writes. Every metric name, its
meaning and unit: ``docs/metrics.md``. Also which ranks measure the model's metrics and their mean over those ranks
(:func:`collect_metric_sums`), and the step's per-prompt and per-response rows (``prompts.jsonl``,
``rollouts.jsonl``)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import Any

import numpy as np
import psutil
import torch
import torch.distributed as dist

from megatron_dynamo.parallel.runtime import collective_device


class MetricsLoggerError(RuntimeError):
    """A metrics sink cannot start (W&B: login, network); the message is one line."""


class MetricsLogger:
    """``resume_from``: the step of the checkpoint a resumed run continues from. Rows of later steps (logged
    before the crash, and about to be logged again) are dropped from ``metrics.jsonl`` and from TensorBoard, so
    every step appears once. None: a new run (the file is started afresh). ``wandb``: a
    :class:`~megatron_dynamo.trainer.outputs.WandbConfig` (mode other than disabled: a W&B run logs the same names
    and steps, with ``run_config`` as its config); ``verbose``: W&B's own console lines too."""

    def __init__(self, output_dir: str, tensorboard: bool = True, progress: bool = True, total_steps: int = 0,
                 resume_from: int | None = None, wandb=None, run_config: dict[str, Any] | None = None,
                 verbose: bool = False):
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.total_steps = total_steps
        self.progress = progress
        self._wandb = None
        if wandb is not None and wandb.mode != "disabled":
            self._wandb = start_wandb(wandb, output_dir, run_config, resumed=resume_from is not None, verbose=verbose)
        self._console = StepProgress(total_steps, resume_from or 0) if progress else None
        if resume_from is not None:
            truncate_metrics(self.path, resume_from)
        self._file = open(self.path, "a" if resume_from is not None else "w", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops the events of this step and later that are already on disk.
            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                     purge_step=None if resume_from is None else resume_from + 1)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: _wandb_value(v) for k, v in metrics.items()}, step=step)
        if self._console is not None:
            self._console.update(record)

    def close(self) -> None:
        """Close every sink; the W&B run is marked failed when this is called while an exception propagates."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._console is not None:
            self._console.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=0 if sys.exc_info()[0] is None else 1)
            self._wandb = None


class StartupClock:
    """Where this rank's start-up went, logged with the first step it runs (``startup/`` metrics,
    ``docs/metrics.md``): the seconds from this process's start to the trainer's construction (``launch``: the
    interpreter, imports, the recipe, the launcher's checks), each phase timed by :meth:`phase`, and the ``total``
    to the start of the first step."""

    def __init__(self):
        self.seconds = {"launch": time.time() - psutil.Process().create_time()}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """The ``startup/`` metrics, the total up to now (call it as the first step begins)."""
        total = time.time() - psutil.Process().create_time()
        return {**{f"startup/{name}": seconds for name, seconds in self.seconds.items()}, "startup/total": total}


def start_wandb(cfg, output_dir: str, run_config: dict[str, Any] | None, resumed: bool, verbose: bool = False):
    """A W&B run for ``cfg`` (a WandbConfig): named after the output directory unless ``cfg.name``, files under
    ``<cfg.dir or output_dir>/wandb``. Its id is kept in ``<output_dir>/wandb_run_id``: a resumed run continues
    the same W&B run (W&B ignores the steps it already has)."""
    import wandb

    directory = os.path.abspath(cfg.dir or output_dir)
    os.makedirs(directory, exist_ok=True)
    id_file = os.path.join(output_dir, "wandb_run_id")
    run_id = None
    if resumed and os.path.isfile(id_file):
        with open(id_file, encoding="utf-8") as f:
            run_id = f.read().strip() or None
    try:
        run = wandb.init(project=cfg.project, name=cfg.name or os.path.basename(os.path.abspath(output_dir)),
                         mode=cfg.mode, dir=directory, config=run_config, id=run_id,
                         resume="allow" if run_id else None, settings=wandb.Settings(silent=not verbose))
    except Exception as exc:  # noqa: BLE001 - login, network, bad settings: one line for the user
        raise MetricsLoggerError(f"logging.wandb: wandb.init failed ({type(exc).__name__}: {exc})") from None
    with open(id_file, "w", encoding="utf-8") as f:
        f.write(run.id + "\n")
    return run


def _wandb_value(value: Any) -> Any:
    """W&B takes numbers (NaN included) and strings as they are; a list of numbers (``alloc_counts``) becomes a
    histogram."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if isinstance(value, (list, tuple)):
        import wandb

        return wandb.Histogram([float(v) for v in value])
    return value


def format_duration(seconds: float) -> str:
    """``01:05`` (mm:ss) or ``2:03:04`` (h:mm:ss), as tqdm writes its ETA."""
    from tqdm import tqdm

    return tqdm.format_interval(max(0.0, seconds))


class StepProgress:
    """The training console: one summary line per step (:func:`progress_line`) ending in the ETA (the mean time of
    the steps this process ran after its first, times the steps left; ``--:--`` after the first step, whose time
    holds one-time start-up: the first generation's set-up, 1.3 s of the CPU default's first step against 0.35 s
    for the next ones, and 14 s while vLLM compiled a sampler helper there, when an ETA from it said 14 minutes for
    a 50-s run), on stdout; on a terminal, also a tqdm bar of steps (with its
    own rate and ETA) on stderr under the lines, gone when the run ends. Log records go through tqdm
    (``library_logs.progress_and_errors``), so they do not tear it. ``bar``: force the bar on or off (default: when stderr is a
    terminal)."""

    def __init__(self, total_steps: int, done_steps: int = 0, bar: bool | None = None):
        from tqdm import tqdm

        self.total_steps = total_steps
        self._last_step = done_steps
        self._timed_steps = 0
        self._start = time.perf_counter()
        self._first_done = None  # when the first step this process ran ended
        show = sys.stderr.isatty() if bar is None else bar
        self._bar = tqdm(total=total_steps, initial=done_steps, unit="step", desc="train", leave=False,
                         dynamic_ncols=True, file=sys.stderr, disable=not show)

    def update(self, record: dict[str, Any]) -> str:
        step, eta = record["step"], None
        if step > self._last_step:  # a training step (not the evaluation row of step 0)
            self._timed_steps += step - self._last_step
            self._bar.update(step - self._last_step)
            self._last_step = step
            now = time.perf_counter()
            if self._first_done is None:
                self._first_done, self._first_steps = now, self._timed_steps
                eta = "--:--" if step < self.total_steps else format_duration(0)
            else:
                per_step = (now - self._first_done) / (self._timed_steps - self._first_steps)
                eta = format_duration(per_step * (self.total_steps - step))
        line = progress_line(record, self.total_steps, eta)
        self._bar.write(line, file=sys.stdout)
        sys.stdout.flush()
        return line

    def close(self) -> None:
        self._bar.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def progress_line(record: dict[str, Any], total_steps: int, eta: str | None = None) -> str:
    """``step 12/100 | reward 0.412 | rollouts 256 [4-12] | var-ratio 0.81 | H 1.23 | gnorm 0.41 | 3.2s | ETA 02:31``
    (``| ETA`` when ``eta`` is given; ``| SKIPPED: <why>`` last when an update was skipped)."""
    def get(key, fmt):
        value = record.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    return (f"step {record['step']}/{total_steps} | reward {get('reward_mean', '.3f')} | rollouts "
            f"{get('rollouts', 'd')} [{get('alloc_min', 'd')}-{get('alloc_max', 'd')}] | var-ratio "
            f"{get('variance_ratio', '.2f')} | H {get('entropy_mean', '.3f')} | gnorm {get('grad_norm', '.3f')} | "
            f"{get('step_seconds', '.1f')}s" + (f" | ETA {eta}" if eta is not None else "")
            + (" | SKIPPED: " + record["skipped"] if record.get("skipped") else ""))


def truncate_metrics(path: str, last_step: int) -> None:
    """Keep the rows of ``path`` up to ``last_step`` (and drop a torn last line), rewriting it atomically."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by the crash
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_step_rows(path: str, rows: list[dict[str, Any]], drop_from_step: int | None = None) -> None:
    """Append JSON rows (each with a ``step``) to ``path``; with ``drop_from_step``, the rows of that step and
    later already in the file are dropped first (as a resumed run's ``metrics.jsonl`` is truncated)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if drop_from_step is not None:
        truncate_metrics(path, drop_from_step - 1)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_reward_curve(metrics_path: str, out_path: str | None = None, label: str | None = None) -> str:
    """Write the reward curve (per step and a moving average) as a PNG next to the metrics; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(metrics_path) if isinstance(r.get("reward_mean"), (int, float))]
    out_path = out_path or os.path.join(os.path.dirname(metrics_path), "reward_curve.png")
    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    window = max(1, len(rewards) // 10)
    smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
              for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, alpha=0.35, label="reward (per step)")
    ax.plot(steps, smooth, label=f"moving mean ({window} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(label or os.path.basename(os.path.dirname(os.path.abspath(metrics_path))))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def collect_metric_sums(local: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Average metrics measured on the last pipeline stage's TP-rank-0 processes: ``local`` maps a name to
    (sum, count) on those ranks and is empty elsewhere; rank 0 gets the means."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    totals: dict[str, list[float]] = {}
    for part in gathered:
        for key, (s, c) in (part or {}).items():
            acc = totals.setdefault(key, [0.0, 0.0])
            acc[0] += s
            acc[1] += c
    return {k: s / c for k, (s, c) in totals.items() if c > 0}


def moe_metrics(stats, aux: dict[str, torch.Tensor], micro_batches: int, layers: list[int],
                sequence_parallel: bool) -> dict[str, float]:
    """Collective over the training ranks: the ``moe/*`` metrics of a step's training forwards from every rank's
    router statistics (``models.moe_routing.RoutingStats`` over the model's MoE layers ``layers``) and Megatron's
    tracked aux losses (``aux``: key -> per MoE layer, summed over this rank's ``micro_batches``).

    A batch's counts are global: summed over the ranks that saw different tokens (data-parallel ranks, and the
    sequence slices of sequence parallelism; each pipeline stage adds its own layers). Without sequence
    parallelism a tensor-parallel group's ranks saw the same tokens: only its rank 0 counts. The aux losses are
    per micro-batch: their mean over micro-batches, data-parallel ranks and layers (the load-balancing loss of a
    sequence-parallel rank is its part of the micro-batch's, the z-loss its slice's mean)."""
    from megatron.core import parallel_state as ps

    shards = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    local = torch.cat([stats.tensor().flatten(), *aux.values()]).double().cpu()
    if not (sequence_parallel or ps.get_tensor_model_parallel_rank() == 0):
        local.zero_()
    total = local.to(collective_device())
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    total = total.cpu()
    num_layers, width = stats.counts.shape[0], stats.counts.shape[1] + 4
    table = total[:num_layers * width].view(num_layers, width)
    counts, (entropy, tokens, agreement, slots) = table[:, :-4], table[:, -4:].T
    metrics: dict[str, float] = {}
    loads = counts.max(1).values / counts.mean(1).clamp_min(1e-300)
    for layer, load, n in zip(layers, loads.tolist(), tokens.tolist()):
        if n > 0:
            metrics[f"moe/expert_load_layer_{layer}"] = load
    if tokens.sum() > 0:
        metrics["moe/expert_load_max_over_mean"] = float(loads[tokens > 0].max())
        metrics["moe/router_entropy"] = float(entropy.sum() / tokens.sum())
    if slots.sum() > 0:
        metrics["moe/routing_agreement"] = float(agreement.sum() / slots.sum())
    per_layer = total[num_layers * width:].view(-1, num_layers) if aux else total.new_zeros(0, num_layers)
    for key, values in zip(aux, per_layer):
        runs = ps.get_data_parallel_world_size() * max(micro_batches, 1) * num_layers
        metrics[key] = float(values.sum()) / runs / (shards if key == "moe/z_loss" else 1)
    return metrics


def is_metric_rank() -> bool:
    """Whether this rank measures the model's metrics: the last pipeline stage's tensor-parallel rank 0."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0


def solved_fraction(prompt_ids: list[str], rewards: list[float]) -> float:
    by_prompt: dict[str, list[float]] = {}
    for pid, r in zip(prompt_ids, rewards):
        by_prompt.setdefault(pid, []).append(r)
    if not by_prompt:
        return 0.0
    return float(np.mean([min(v) > 0.5 for v in by_prompt.values()]))


def prompt_rows(step: int, prompt_ids, counts, response_ids, rewards) -> list[dict[str, Any]]:
    """``prompts.jsonl``: one row per prompt of the step, ``{"step", "prompt_id", "count" (rollouts allocated),
    "correct" (responses with reward 1)}`` (``dynamo report`` plots success rate against allocation from it)."""
    correct: dict[Any, int] = {}
    for pid, reward in zip(response_ids, rewards):
        correct[pid] = correct.get(pid, 0) + int(reward > 0.5)
    return [{"step": step, "prompt_id": pid if isinstance(pid, (str, int)) else str(pid), "count": int(n),
             "correct": correct.get(pid, 0)} for pid, n in zip(prompt_ids, counts)]


def rollout_rows(step: int, responses, rewards, decode) -> list[dict[str, Any]]:
    """``rollouts.jsonl`` (``logging.rollouts``): every response of the step in canonical order (prompt order, then
    sample index), ``{"step", "prompt_id", "sample_index", "response_ids", "response", "reward"}``."""
    rows, sample = [], {}
    for (pid, _, ids), reward in zip(responses, rewards):
        sample[pid] = sample.get(pid, -1) + 1
        rows.append({"step": step, "prompt_id": pid, "sample_index": sample[pid], "response_ids": list(ids),
                     "response": decode(list(ids)), "reward": float(reward)})
    return rows
