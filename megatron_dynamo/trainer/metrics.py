"""Per-step metrics: one JSON object per line in ``<output dir>/metrics.jsonl``, TensorBoard scalars, a one-line
progress display, and a reward curve PNG at the end. Only the process that owns the logger (rank 0) writes."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any


class MetricsLogger:
    """``resume_from``: the step of the checkpoint a resumed run continues from. Rows of later steps (logged
    before the crash, and about to be logged again) are dropped from ``metrics.jsonl`` and from TensorBoard, so
    every step appears once. None: a new run (the file is started afresh)."""

    def __init__(self, output_dir: str, tensorboard: bool = True, progress: bool = True, total_steps: int = 0,
                 resume_from: int | None = None):
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.total_steps = total_steps
        self.progress = progress
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
        if self.progress:
            print(progress_line(record, self.total_steps), file=sys.stdout, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def progress_line(record: dict[str, Any], total_steps: int) -> str:
    """``step 12/100 | reward 0.412 | rollouts 256 [4-12] | var-ratio 0.81 | H 1.23 | gnorm 0.41 | 3.2s``"""
    def get(key, fmt):
        value = record.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    return (f"step {record['step']}/{total_steps} | reward {get('reward_mean', '.3f')} | rollouts "
            f"{get('rollouts', 'd')} [{get('alloc_min', 'd')}-{get('alloc_max', 'd')}] | var-ratio "
            f"{get('variance_ratio', '.2f')} | H {get('entropy_mean', '.3f')} | gnorm {get('grad_norm', '.3f')} | "
            f"{get('step_seconds', '.1f')}s" + (" | SKIPPED: " + record["skipped"] if record.get("skipped") else ""))


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
