"""Reward-curve arithmetic shared by ``dynamo compare`` and ``dynamo ablate``: seeds, trailing moving mean,
rollouts to reach a reward threshold, head/tail means, one run's summary.

Pure Python on lists of numbers: nothing of the trainer, Megatron or vLLM is imported (the commands import these;
commands do not import each other).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence


def parse_seeds(text: str) -> list[int]:
    """``"1,2, 3"`` -> [1, 2, 3]; ValueError for non-integers, an empty list or repeats."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must list distinct integers, got {text!r}")
    return seeds


def moving_mean(values: Sequence[float], window: int) -> list[float | None]:
    """Trailing mean over ``window`` values; None where fewer than ``window`` values exist yet."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out: list[float | None] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / window if i >= window - 1 else None)
    return out


def rollouts_to_threshold(rewards: Sequence[float], rollouts: Sequence[int], threshold: float,
                          window: int) -> tuple[int | None, int | None]:
    """(cumulative rollouts, 1-based step) at the first step whose trailing ``window``-step mean reward is
    >= ``threshold``; (None, None) if none is."""
    if len(rewards) != len(rollouts):
        raise ValueError("rewards and rollouts must have one entry per step")
    cumulative = 0
    for step, (mean, n) in enumerate(zip(moving_mean(rewards, window), rollouts), start=1):
        cumulative += int(n)
        if mean is not None and mean >= threshold:
            return cumulative, step
    return None, None


def median_rollouts(values: Sequence[int | None]) -> float | None:
    """Median over seeds with "not reached" (None) as +infinity; None when the median is not reached."""
    if not values:
        return None
    median = statistics.median([math.inf if v is None else float(v) for v in values])
    return None if math.isinf(median) else median


def tail_mean(values: Sequence[float], fraction: float = 0.1) -> float | None:
    """Mean of the last ``fraction`` of ``values`` (at least one value)."""
    if not values:
        return None
    k = max(1, int(round(len(values) * fraction)))
    return sum(values[-k:]) / k


def head_mean(values: Sequence[float], fraction: float = 0.1) -> float | None:
    """Mean of the first ``fraction`` of ``values`` (at least one value)."""
    if not values:
        return None
    k = max(1, int(round(len(values) * fraction)))
    return sum(values[:k]) / k


def summarize_run(records: list[dict[str, Any]], threshold: float, window: int) -> dict[str, Any]:
    """The threshold numbers of one run's metrics records (steps with a numeric reward_mean only): steps, total
    rollouts, rollouts to threshold and the step reached, first and final (last tenth) reward, the series."""
    records = [r for r in records if isinstance(r.get("reward_mean"), (int, float))
               and not isinstance(r.get("reward_mean"), bool)]
    rewards = [float(r["reward_mean"]) for r in records]
    rollouts = [int(r.get("rollouts", 0)) for r in records]
    reached, step = rollouts_to_threshold(rewards, rollouts, threshold, window)
    return {"steps": len(records), "total_rollouts": sum(rollouts), "rollouts_to_threshold": reached,
            "step_reached": step, "first_reward": head_mean(rewards), "final_reward": tail_mean(rewards),
            "rewards": rewards, "rollouts": rollouts}
