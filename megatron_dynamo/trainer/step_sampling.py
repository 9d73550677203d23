"""The sampling stages of one step (``trainer/step.py``): draw the step's prompts, allocate their rollouts (uniform,
or DRA from the prompt history), generate and score them, update the history; with ``dynamo.sampling.dynamic``
in rounds, keeping only the groups whose rewards differ (DAPO's dynamic sampling,
``algorithms/dynamic_sampling.py``).

Every rank runs this (SPMD): the prompts and allocations are the same on every rank (the sampler and the history
are, and the allocation is broadcast from rank 0), the scored responses reach every rank through the rollout's
exchange, so every rank keeps the same groups without another collective.

What the update trains on is :class:`StepRollout`: the kept prompts in training order with their counts, responses,
rewards and the engine's log-probs. What the step *generated* (every round) is in its ``rollouts``, ``reward_mean``
and ``metrics``: the cost and the sampled accuracy are those of all responses, not of the kept ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_dynamo.algorithms.dynamic_sampling import RoundOutcome, fill_step, mixed_groups

# How the per-round rollout metrics combine into the step's: means weighted by the round's responses, maxima, or
# (everything else: the reward counts and seconds) sums; reward/accuracy is recomputed from the counts.
_WEIGHTED_MEANS = ("response_length_mean", "rollout/truncated_frac")
_MAXIMA = ("rollout/response_length_max", "rollout/engine_tokens_max_over_mean", "rollout/engines")


@dataclass
class StepRollout:
    """The responses of one step that the update trains on, and what generating them cost."""

    prompt_ids: list[str]
    counts: list[int]
    responses: list[tuple[str, tuple[int, ...], tuple[int, ...]]]  # (prompt id, prompt tokens, response tokens)
    rewards: list[float]
    engine_logprobs: list[Any]
    variance_ratio: float
    rollouts: int  # generated in the step, every round
    reward_mean: float  # over every generated response
    metrics: dict[str, Any] = field(default_factory=dict)


def merge_round_metrics(rounds: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The step's rollout / reward metrics from those of its rounds ``[(responses, metrics)]``."""
    if len(rounds) == 1:
        return dict(rounds[0][1])
    total = sum(n for n, _ in rounds)
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for _, m in rounds for k in m):
        values = [(n, m[key]) for n, m in rounds if key in m]
        if key in _WEIGHTED_MEANS:
            out[key] = sum(n * v for n, v in values) / total if total else 0.0
        elif key in _MAXIMA:
            out[key] = max(v for _, v in values)
        else:
            out[key] = sum(v for _, v in values)
    if "reward/correct" in out:
        out["reward/accuracy"] = out["reward/correct"] / total if total else 0.0
    return out


def sample_step(runner, step: int, timer) -> StepRollout:
    """Every rank: the step's prompts, rollouts and rewards (module docstring). ``runner``: the
    :class:`~megatron_dynamo.trainer.step.StepRunner` (its sampler, history, config and rollout stage)."""
    from megatron_dynamo.rollout.allocation import allocate_counts

    run = runner.run
    sampling = run.dynamo.sampling
    rounds: list[dict[str, Any]] = []

    def run_round(index: int, size: int) -> RoundOutcome:
        with timer("data"):
            examples = runner.sampler.next_batch(size)
            prompt_ids = [ex.id for ex in examples]
        with timer("allocation"):
            allocation = allocate_counts(runner.history, prompt_ids, run.dynamo.allocation)
        responses, rewards, metrics, logprobs = runner.rollout_and_reward(step, examples, allocation.counts, timer,
                                                                          round_index=index)
        response_ids = [pid for pid, _, _ in responses]
        with timer("advantages"):  # the prompt history sees every generated group, dropped ones too
            runner.history.update(response_ids, np.asarray(rewards) > 0.5)
        rounds.append({"prompt_ids": prompt_ids, "counts": [int(c) for c in allocation.counts],
                       "responses": responses, "rewards": list(rewards), "logprobs": list(logprobs),
                       "metrics": metrics, "variance_ratio": float(allocation.predicted_variance_ratio)})
        mixed = mixed_groups(response_ids, rewards) if sampling.dynamic else prompt_ids
        return RoundOutcome(prompt_ids, mixed, int(sum(allocation.counts)))

    target = run.data.prompts_per_step
    filled = fill_step(target, sampling.round_prompts(target), sampling.max_refills if sampling.dynamic else 0,
                       run_round)
    if sampling.dynamic:
        kept_prompts, counts, responses, rewards, logprobs = [], [], [], [], []
        for index, pid in filled.kept:
            part = rounds[index]
            kept_prompts.append(pid)
            counts.append(part["counts"][part["prompt_ids"].index(pid)])
            chosen = [j for j, response in enumerate(part["responses"]) if response[0] == pid]
            responses += [part["responses"][j] for j in chosen]
            rewards += [part["rewards"][j] for j in chosen]
            logprobs += [part["logprobs"][j] for j in chosen]
    else:  # one round, every group, in the exchange's order
        (part,) = rounds
        kept_prompts, counts, responses = part["prompt_ids"], part["counts"], part["responses"]
        rewards, logprobs = part["rewards"], part["logprobs"]
    every_reward = [r for part in rounds for r in part["rewards"]]
    metrics = merge_round_metrics([(len(part["rewards"]), part["metrics"]) for part in rounds])
    if sampling.dynamic:
        metrics.update(filled.metrics())
    return StepRollout(prompt_ids=kept_prompts, counts=counts, responses=responses, rewards=rewards,
                       engine_logprobs=logprobs,
                       variance_ratio=float(np.mean([part["variance_ratio"] for part in rounds])),
                       rollouts=filled.rollouts, reward_mean=float(np.mean(every_reward)) if every_reward else 0.0,
                       metrics=metrics)
