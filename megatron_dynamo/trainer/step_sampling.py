"""DAPO's dynamic sampling on the rollout side of a step (``dynamo.sampling.dynamic``,
``algorithms/dynamic_sampling.py``): rounds of prompts, each drawn, allocated (uniform, or DRA from the prompt
history), generated, scored and entered into the history like a step without it
(:meth:`~megatron_dynamo.trainer.rollout_producer.RolloutProducer.produce_round`); the groups whose rewards differ
are kept until the step's ``data.prompts_per_step`` are full, and the step's
:class:`~megatron_dynamo.rollout.rollout_batch.RolloutBatch` holds only them.

The ranks that produce rollouts run this together (colocated: every rank; ``rollout.placement: separate``: the
engine ranks): every round's scored responses reach each of them through the rollout's exchange, so they all keep
the same groups without another collective. The batch then travels as any other (``RolloutBatch.to_tensors``).

What the update trains on is the kept groups, in the order they were kept; what the step *generated* (every
round) is in the batch's ``rollouts``, ``reward_mean``, history results and ``metrics``: the cost and the sampled
accuracy are those of all responses, not of the kept ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_dynamo.algorithms.dynamic_sampling import FilledStep, RoundOutcome, fill_step, mixed_groups
from megatron_dynamo.rollout.exchange import ScoredResponses
from megatron_dynamo.rollout.rollout_batch import RolloutBatch

# How the per-round rollout metrics combine into the step's: means weighted by the round's responses, maxima, or
# (everything else: the reward counts, seconds and truncated prompts) sums; reward/accuracy is recomputed from the
# counts.
_WEIGHTED_MEANS = ("response_length_mean", "rollout/truncated_frac")
_MAXIMA = ("rollout/response_length_max", "rollout/engine_tokens_max_over_mean", "rollout/engines")


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


def dynamic_sampling_batch(producer, step: int, version: int, timer) -> RolloutBatch:
    """Collective over the producing ranks: the rounds of one step and the batch of its kept groups (module
    docstring). ``producer``: the :class:`~megatron_dynamo.trainer.rollout_producer.RolloutProducer`."""
    run = producer.run
    sampling = run.dynamo.sampling
    rounds: list[RolloutBatch] = []

    def run_round(index: int, size: int) -> RoundOutcome:
        batch = producer.produce_round(step, version, size, timer, round_index=index)
        rounds.append(batch)
        prompt_ids = [producer.examples[i].id for i in batch.example_indices]
        response_ids = [prompt_ids[p] for p in batch.responses.prompt_index]
        return RoundOutcome(prompt_ids, mixed_groups(response_ids, batch.responses.rewards), sum(batch.counts))

    target = run.data.prompts_per_step
    filled = fill_step(target, sampling.round_prompts(target), sampling.max_refills, run_round)
    return kept_groups(rounds, filled, [[producer.examples[i].id for i in b.example_indices] for b in rounds])


def kept_groups(rounds: list[RolloutBatch], filled: FilledStep, round_prompt_ids: list[list[str]]) -> RolloutBatch:
    """One batch of the groups ``filled`` kept from ``rounds`` (their prompt ids ``round_prompt_ids``), in the order
    kept, each group's responses in its round's canonical order; the history results, rollouts, mean reward and
    metrics of every round."""
    example_indices, prompt_tokens, counts = [], [], []
    kept = ScoredResponses()
    for round_index, pid in filled.kept:
        part = rounds[round_index]
        p = round_prompt_ids[round_index].index(pid)
        example_indices.append(part.example_indices[p])
        prompt_tokens.append(part.prompt_tokens[p])
        counts.append(part.counts[p])
        chosen = [j for j, q in enumerate(part.responses.prompt_index) if q == p]
        kept.prompt_index += [len(counts) - 1] * len(chosen)
        for name in ("sample_index", "token_ids", "truncated", "rewards"):
            getattr(kept, name).extend(getattr(part.responses, name)[j] for j in chosen)
        # an engine that gave no log-probs at all leaves the list empty: NaN per token after the exchange
        kept.logprobs += [part.responses.logprobs[j] if part.responses.logprobs else None for j in chosen]
        kept.routed_experts += [part.responses.routed_experts[j] if part.responses.routed_experts else None
                                for j in chosen]
    every_reward = [r for part in rounds for r in part.responses.rewards]
    metrics = merge_round_metrics([(len(part.responses), part.metrics) for part in rounds])
    metrics.update(filled.metrics())
    last = rounds[-1]
    return RolloutBatch(step=last.step, version=last.version, example_indices=example_indices,
                        prompt_tokens=prompt_tokens, counts=counts,
                        variance_ratio=float(np.mean([part.variance_ratio for part in rounds])), responses=kept,
                        history_index=[i for part in rounds for i in part.history_index],
                        history_correct=[c for part in rounds for c in part.history_correct],
                        history_updates=[len(part.history_index) for part in rounds],
                        sampler_state=last.sampler_state, rollouts=filled.rollouts,
                        reward_mean=float(np.mean(every_reward)) if every_reward else 0.0, metrics=metrics)
