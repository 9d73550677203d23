"""The collectives and metrics of one DynaMO step (``trainer/step.py``): a failure on any rank raised on every rank,
the reward counts of every engine leader summed, metrics averaged over the ranks that measure them, the scope gaps
of the modulation, the engine's log-probs scattered into the micro-batches with their gap to the trainer's, and
the loss denominators. Every function marked collective must be called by every rank."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynamo.algorithms.losses import engine_gap_sums
from megatron_dynamo.algorithms.prompt_weights import weighted_denominator
from megatron_dynamo.parallel.placement import job_rank
from megatron_dynamo.parallel.runtime import collective_device
from megatron_dynamo.reward.math_reward import REWARD_REASONS, RewardStats
from megatron_dynamo.trainer.batch import Sample, token_values


class RolloutError(RuntimeError):
    """Generation, scoring or a weight load failed on some rank; raised on every rank."""


def parallel_state():
    from megatron.core import parallel_state as ps

    return ps


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


def is_metric_rank() -> bool:
    ps = parallel_state()
    return ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0


def scatter_engine_logprobs(samples: list[Sample], plans, last_stage: bool, engine_is: str) -> bool:
    """The engine's log-probs of the sampled tokens into every micro-batch (``engine_logp``, beside ``old_logp``:
    ``dynamo.loss.engine_is`` weighs the loss with them). False when the engine gave no log-probs (every rank holds
    the same rollout, so all agree); then ``engine_is`` other than off is an error."""
    engine = {}
    for s in samples:
        values = torch.tensor(s.engine_logp if s.engine_logp is not None else [math.nan] * s.num_response_tokens,
                              dtype=torch.float32)
        if values.numel() != s.num_response_tokens or not bool(torch.isfinite(values).all()):
            engine = None
            break
        engine[s.index] = values
    if engine is None or not samples:
        if engine_is != "off":
            raise RolloutError("dynamo.loss.engine_is needs the engine's log-prob of every sampled token; "
                               "the engine returned none")
        return False
    scatter_into_plans(plans, engine, "engine_logp", last_stage)
    return True


def scatter_into_plans(plans, values: dict[int, torch.Tensor], name: Literal["old_logp", "engine_logp"],
                       last_stage: bool) -> None:
    """Per-sample token ``values`` into every micro-batch (``UpdateBatch``) of ``plans`` as its field ``name``
    (zeros off the last pipeline stage, which computes no loss)."""
    for _, micro in plans:
        for mb in micro:
            setattr(mb, name, token_values(mb, values if last_stage else None))


def engine_gap_metrics(plans, local: dict[str, tuple[float, float]]) -> float:
    """Collective (every rank calls it): the gap between the engine's and the trainer's old-policy log-probs of the
    micro-batches' tokens (``engine_logp``, ``old_logp``), from the pass already made (no extra forward):
    ``rollout/logp_gap_mean`` and ``rollout/engine_kl_k3`` (the k3 estimator of KL(engine || trainer) on the
    sampled tokens) as token-weighted sums in ``local``; returns ``rollout/logp_gap_max``."""
    largest = 0.0
    if is_metric_rank():
        for _, micro in plans:
            for mb in micro:
                mask = mb.loss_mask.bool()
                gap = engine_gap_sums(mb.old_logp[mask], mb.engine_logp[mask])
                n = float(gap["num_tokens"])
                for key, name in (("rollout/logp_gap_mean", "abs_sum"), ("rollout/engine_kl_k3", "kl_k3_sum")):
                    s, c = local.get(key, (0.0, 0.0))
                    local[key] = (s + float(gap[name]), c + n)
                largest = max(largest, float(gap["abs_max"]))
    peak = torch.tensor([largest], dtype=torch.float64, device=collective_device())
    if dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def raise_on_any_rank(failure: str | None, what: str) -> None:
    """Collective: raise :class:`RolloutError` on every rank if any rank has a ``failure`` (its text, else None),
    naming the first failed rank's reason."""
    if dist.get_world_size() == 1:
        failed = [] if failure is None else [failure] if job_rank(0) == 0 else [f"rank {job_rank(0)}: {failure}"]
    else:
        flag = torch.tensor([0.0 if failure is None else 1.0], device=collective_device())
        dist.all_reduce(flag)
        if flag.item() == 0:
            return
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, failure)  # a few lines of text, only on failure
        failed = [f"rank {job_rank(r)}: {text}" for r, text in enumerate(reasons) if text is not None]
    if failed:
        raise RolloutError(f"{what} ({failed[0]}). The checkpoints written so far are intact: fix the cause and "
                           "rerun with --resume.")


def sum_reward_stats(stats) -> dict[str, float]:
    """Collective: the reward counts of every engine leader's scoring summed (seconds: the slowest leader), as
    ``reward/*`` metrics (docs/metrics.md). ``stats``: this rank's RewardStats, None on ranks that did not score."""
    summed = ["num_responses", "num_verified", "cache_hits", "workers_replaced", "over_budget"]
    local = stats or RewardStats()
    values = torch.tensor([float(local.counts[r]) for r in REWARD_REASONS] + [float(getattr(local, k)) for k in summed],
                          dtype=torch.float64, device=collective_device())
    slowest = torch.tensor([local.seconds], dtype=torch.float64, device=collective_device())
    if dist.get_world_size() > 1:
        dist.all_reduce(values)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = values.tolist()
    total = RewardStats(counts={r: int(v) for r, v in zip(REWARD_REASONS, values)},
                        seconds=float(slowest.item()))
    for key, value in zip(summed, values[len(REWARD_REASONS):]):
        setattr(total, key, int(value))
    return total.as_metrics()


def _add_scope_gap(total: dict[str, float], part: dict[str, float]) -> None:
    """Scope-gap sums and maxima of ``part`` into ``total``: keys ending in ``_max`` by max, the others summed."""
    for key, value in part.items():
        total[key] = max(total[key], value) if key.endswith("_max") else total[key] + value


def sum_scope_gaps(results: list[dict[str, Any]]) -> dict[str, float]:
    """This rank's scope-gap sums and maxima over a mini-batch's micro-batches (``policy_loss.scope_gap``)."""
    keys = ("num_tokens", "beta_comp_sum", "beta_stab_sum", "beta_comp_max", "beta_stab_max")
    out = dict.fromkeys(keys, 0.0)
    for r in results:
        _add_scope_gap(out, {key: float(r.get(f"scope_gap/{key}", 0.0)) for key in keys})
    return out


def reduce_scope_gaps(local: list[tuple[int, int, dict[str, float]]]) -> dict[str, Any]:
    """Collective: how far beta_comp and beta_stab under the old-policy scope are from those under the exact
    (current-policy) scope, over the metric ranks (summed over DP, max of maxima): per step
    ``modulation/scope_gap_{beta_comp,beta_stab}_{max,mean}`` (per token, over all mini-batches) and
    ``modulation/scope_gap_by_mini_batch``, one [beta_comp max, beta_comp mean, beta_stab max, beta_stab mean]
    per (epoch, mini-batch) in training order."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local if is_metric_rank() else [])
    merged: dict[tuple[int, int], dict[str, float]] = {}
    for part in gathered:
        for epoch, index, gap in part or []:
            _add_scope_gap(merged.setdefault((epoch, index), dict.fromkeys(gap, 0.0)), gap)
    rows = [merged[k] for k in sorted(merged)]
    tokens = sum(r["num_tokens"] for r in rows)
    out: dict[str, Any] = {"modulation/scope_gap_by_mini_batch": [
        [r["beta_comp_max"], r["beta_comp_sum"] / max(r["num_tokens"], 1.0), r["beta_stab_max"],
         r["beta_stab_sum"] / max(r["num_tokens"], 1.0)] for r in rows]}
    for name in ("beta_comp", "beta_stab"):
        out[f"modulation/scope_gap_{name}_max"] = max((r[f"{name}_max"] for r in rows), default=0.0)
        out[f"modulation/scope_gap_{name}_mean"] = sum(r[f"{name}_sum"] for r in rows) / max(tokens, 1.0)
    return out


def global_denominator(mini_batch: list[Sample], mode: str) -> float:
    """The loss denominator of a mini-batch (every DP rank's share): its response tokens (``token-mean``) or
    sequences, each weighted by its prompt weight (``algorithms/prompt_weights.py``; 1 by default)."""
    return weighted_denominator([s.num_response_tokens for s in mini_batch], [s.loss_weight for s in mini_batch],
                                mode)


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
