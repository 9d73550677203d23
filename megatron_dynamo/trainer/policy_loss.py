"""The two loss functions the actor runs through Megatron's pipeline schedule during an RL step.

- :func:`token_stats_fn` (forward only): per response token, log pi(a), entropy H and sum_j pi_j^2 Lambda_j from
  the vocab-parallel logits, across TP shards in one pass. Used for the old log-probs (and the modulation scopes
  taken from them) and, with ``modulation.scope: current_policy``, for the scope pass of later mini-batches.
- :func:`dynamo_loss_fn`: the PPO-clip loss on DynaMO-modulated advantages, normalised by the mini-batch's global
  denominator (see ``trainer/actor.py``); or the registered policy loss ``dynamo.loss.name`` (a baseline of the
  paper's Table 1, ``algorithms/baselines.py``), with the micro-batch's ``selection`` when it has one. A
  micro-batch without ``old_logp`` takes its own detached log-probs as the old ones and returns its per-token
  ``token/logp`` and ``token/entropy`` (the update stands in for the old-log-prob pass: ``trainer/old_logprobs.py``).

Both see only the response positions (``loss_mask``) of a micro-batch. The model output they get is either the
vocab-parallel logits (then only the response positions' rows are taken, in the model dtype: the routine
accumulates in fp32 itself) or, with the fused output layer, the final hidden states and the output weight: then
logits exist only chunk by chunk inside the routine (``parallel/token_stats.py``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from megatron_dynamo.algorithms.config import ModulationConfig, PolicyLossConfig
from megatron_dynamo.algorithms.losses import (LOG_RATIO_LIMIT, compute_actor_loss, engine_importance_weights,
                                               policy_ratio, ppo_clip_mask)
from megatron_dynamo.algorithms.modulation import (ModulationInputs, ModulationScope, modulate_advantages,
                                                   modulation_factors)
from megatron_dynamo.algorithms.prompt_weights import weighted_denominator
from megatron_dynamo.parallel.token_stats import (TokenStats, fused_vocab_parallel_token_stats,
                                                  vocab_parallel_token_stats)
from megatron_dynamo.trainer.actor import OutputLayerInput
from megatron_dynamo.trainer.batch import Sample, UpdateBatch
from megatron_dynamo.trainer.metrics import is_metric_rank
from megatron_dynamo.trainer.old_logprobs import TOKEN_OUTPUTS, full_token_values


def _tp_group():
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def response_positions(micro_batch: UpdateBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The bool mask of response positions ([B, S], or [1, T] packed) and, per flattened response token, its
    sequence id: its row, or in a packed micro-batch its ``token_row`` (the index of its sequence), so that
    ``advantages[seq_ids]`` and per-sequence aggregation work alike for both layouts."""
    mask = micro_batch.loss_mask.bool()
    token_row = micro_batch.token_row
    if token_row is not None:
        return mask, token_row[mask]
    seq_ids = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1).expand_as(mask)[mask]
    return mask, seq_ids


def response_token_stats(model_output: torch.Tensor | OutputLayerInput, micro_batch: UpdateBatch,
                         temperature: float, chunk_size: int | None) -> tuple[TokenStats, torch.Tensor, torch.Tensor]:
    """Token stats at the response positions, flattened; also the sequence id and the mask of each token.
    ``model_output``: the logits [B, S, V/tp] or the fused output layer's input (``trainer.actor.OutputLayerInput``)."""
    mask, seq_ids = response_positions(micro_batch)
    targets = micro_batch.labels[mask]
    if isinstance(model_output, OutputLayerInput):
        stats = fused_vocab_parallel_token_stats(
            model_output.hidden[mask], model_output.weight, targets, temperature, _tp_group(), chunk_size,
            allreduce_grad_hidden=not model_output.grad_reduced_by_gather)
    else:
        stats = vocab_parallel_token_stats(model_output[mask], targets, temperature, _tp_group(), chunk_size)
    return stats, seq_ids, mask


def token_stats_fn(temperature: float, chunk_size: int | None = None) -> Callable:
    """Forward-only loss function returning {"logp", "entropy", "sum_pi2_lambda"} as [B, S] tensors (0 off the
    response positions) and the micro-batch's sample indices."""

    def loss_fn(model_output, micro_batch):
        stats, _, mask = response_token_stats(model_output, micro_batch, temperature, chunk_size)
        out = {"sample_index": micro_batch.sample_index}
        for name in ("logp", "entropy", "sum_pi2_lambda"):
            out[name] = full_token_values(getattr(stats, name), mask)
        return stats.logp.new_zeros(()), out

    return loss_fn


def scope_inputs(micro_batch: UpdateBatch, per_sample: dict[int, dict[str, torch.Tensor]],
                 loss_cfg: PolicyLossConfig) -> ModulationInputs:
    """Flattened modulation inputs of one micro-batch under the current policy, from per-sample token stats
    (``{sample index: {"logp", "entropy", "sum_pi2_lambda"}}``, as the forward-only pass returns them)."""
    mask, seq_ids = response_positions(micro_batch)
    rows = [i for i in micro_batch.sample_index.tolist() if i >= 0]
    logp, entropy, sum_pi2_lambda = (
        torch.cat([per_sample[i][name] for i in rows]) if rows else mask.new_zeros(0, dtype=torch.float32)
        for name in ("logp", "entropy", "sum_pi2_lambda"))
    advantages = micro_batch.advantages[seq_ids]
    ratio = policy_ratio(logp, micro_batch.old_logp[mask])
    clipped = ppo_clip_mask(ratio, advantages, loss_cfg.clip_low, loss_cfg.clip_high, loss_cfg.clip_ratio_c)
    return ModulationInputs(advantages=advantages, entropy=entropy, mask=torch.ones_like(logp, dtype=torch.bool),
                            logp=logp, sum_pi2_lambda=sum_pi2_lambda, ratio=ratio, clipped_mask=clipped,
                            seq_ids=seq_ids)


def scope_gap(trained, other) -> dict[str, torch.Tensor]:
    """Per-token absolute differences of beta_comp and beta_stab between two ``ModulationFactors`` of the same
    tokens: their sums and maxima, and the token count (``scope_gap/*``, reduced by the trainer)."""
    out = {"scope_gap/num_tokens": torch.tensor(float(trained.beta_comp.numel()))}
    for name in ("beta_comp", "beta_stab"):
        gap = (getattr(trained, name) - getattr(other, name)).abs().double()
        out[f"scope_gap/{name}_sum"] = gap.sum()
        out[f"scope_gap/{name}_max"] = gap.max() if gap.numel() else gap.new_zeros(())
    return out


def modulate(inputs: ModulationInputs, modulation: ModulationConfig, scope: ModulationScope | None,
             compare_scope: ModulationScope | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The modulation stage of one micro-batch: its advantages modulated under the mini-batch-wide ``scope``
    (``algorithms/modulation.py``: GC and UMS factors), with their statistics (``modulation/*``); with
    ``compare_scope`` also the gap of the factors to those under that scope (:func:`scope_gap`)."""
    final_advantages, modulation_stats = modulate_advantages(
        inputs.advantages, inputs.entropy, inputs.logp, inputs.sum_pi2_lambda, inputs.ratio, inputs.clipped_mask,
        inputs.mask, seq_ids=inputs.seq_ids, cfg=modulation, scope=scope)
    if compare_scope is not None and modulation.enabled:
        modulation_stats.update(scope_gap(modulation_factors(inputs, modulation, scope),
                                          modulation_factors(inputs, modulation, compare_scope)))
    return final_advantages, modulation_stats


def engine_is_weights(micro_batch: UpdateBatch, mask: torch.Tensor, old_logp: torch.Tensor,
                      loss_cfg: PolicyLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each token's loss weight w(pi_old / pi_engine) (``dynamo.loss.engine_is``) and its metrics: w >= 0, so
    weighting the advantage weights the clipped loss term alike (``losses.engine_importance_weights``)."""
    if micro_batch.engine_logp is None:
        raise RuntimeError("dynamo.loss.engine_is needs the engine's log-probs in the micro-batch")
    engine_logp = micro_batch.engine_logp[mask]
    weights = engine_importance_weights(old_logp, engine_logp, loss_cfg.engine_is, loss_cfg.engine_is_cap)
    rho = torch.exp((old_logp - engine_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    changed = weights == 0 if loss_cfg.engine_is == "mask" else rho > loss_cfg.engine_is_cap
    return weights, {
        "actor/engine_is_weight_mean": weights.mean() if weights.numel() else weights.new_zeros(()),
        "actor/engine_is_capped_frac": changed.float().mean() if changed.numel() else weights.new_zeros(())}


def dynamo_loss_fn(modulation: ModulationConfig, loss_cfg: PolicyLossConfig, scope: ModulationScope | None,
                   global_denominator: float, temperature: float, chunk_size: int | None = None,
                   compare_scope: ModulationScope | None = None,
                   timer: Callable[[str], ContextManager] | None = None) -> Callable:
    """The actor loss of one micro-batch: token stats -> ratio and clip mask -> modulated advantages (with the
    mini-batch-wide ``scope``) -> PPO clip aggregated over ``global_denominator``.

    ``compare_scope`` (a diagnostic, nothing is trained with it): another scope of the same mini-batch (the
    old-policy one, while training with the current-policy one); the metrics then carry the absolute differences
    of beta_comp and beta_stab between the two, per token: ``scope_gap/{beta_comp,beta_stab}_{sum,max}`` over the
    valid tokens, and ``scope_gap/num_tokens``.

    ``timer`` (the step's stage timer): with modulation on, :func:`modulate` is timed as the stage
    ``modulation`` (inside ``train``, whose forward runs this loss)."""
    modulation_stage = timer if timer is not None and modulation.enabled else (lambda _: nullcontext())

    def loss_fn(model_output, micro_batch):
        stats, seq_ids, mask = response_token_stats(model_output, micro_batch, temperature, chunk_size)
        # No old_logp: this forward runs on the old policy's weights and stands in for the old-log-prob pass
        # (trainer/old_logprobs.py).
        update_is_old_pass = micro_batch.old_logp is None
        old_logp = stats.logp.detach() if update_is_old_pass else micro_batch.old_logp[mask]
        advantages = micro_batch.advantages[seq_ids]
        valid = torch.ones_like(old_logp, dtype=torch.bool)
        logp = stats.logp
        entropy = stats.entropy.detach()  # a weight everywhere but in an entropy bonus (stats.entropy, below)
        ratio = policy_ratio(logp.detach(), old_logp)
        clipped = ppo_clip_mask(ratio, advantages, loss_cfg.clip_low, loss_cfg.clip_high, loss_cfg.clip_ratio_c)
        inputs = ModulationInputs(advantages=advantages, entropy=entropy, mask=valid, logp=logp.detach(),
                                  sum_pi2_lambda=stats.sum_pi2_lambda, ratio=ratio, clipped_mask=clipped,
                                  seq_ids=seq_ids)
        with modulation_stage("modulation"):
            final_advantages, modulation_stats = modulate(inputs, modulation, scope, compare_scope)
        if loss_cfg.engine_is != "off":
            weights, is_metrics = engine_is_weights(micro_batch, mask, old_logp, loss_cfg)
            final_advantages = final_advantages * weights
            modulation_stats.update(is_metrics)
        # Each prompt's weight (dynamo.loss.prompt_weight; exactly 1 by default): on the advantage after the
        # modulation, which weights the token's loss (the losses allowed with it are homogeneous in A); the
        # denominator is weighted alike (global_denominator).
        final_advantages = final_advantages * micro_batch.loss_weight[seq_ids].to(final_advantages.dtype)
        # The baselines' mini-batch-wide token selection (token_selection.py, algorithms/baselines.py), if any.
        selection = micro_batch.selection[mask] if micro_batch.selection is not None else None
        output = compute_actor_loss(logp, old_logp, final_advantages, valid, loss_cfg,
                                    global_denominator=global_denominator, seq_ids=seq_ids,
                                    entropy=stats.entropy, selection=selection)
        metrics = {k: v.detach().float() for k, v in {**output.metrics, **modulation_stats}.items()}
        metrics["actor/entropy"] = entropy.mean() if entropy.numel() else entropy.new_zeros(())
        metrics["loss"] = output.loss.detach()
        if update_is_old_pass:
            metrics.update({f"token/{name}": full_token_values(getattr(stats, name), mask) for name in TOKEN_OUTPUTS})
        return output.loss, metrics

    return loss_fn


def global_denominator(mini_batch: list[Sample], mode: str) -> float:
    """The loss denominator of a mini-batch (every DP rank's share): its response tokens (``token-mean``) or
    sequences, each weighted by its prompt weight (``algorithms/prompt_weights.py``; 1 by default)."""
    return weighted_denominator([s.num_response_tokens for s in mini_batch], [s.loss_weight for s in mini_batch],
                                mode)


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
