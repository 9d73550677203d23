"""The "update" stage of one DynaMO step: the RL update of the policy on a step's scored samples
(``docs/algorithm.md``, "One training step").

    micro-batches -> old log-probs (stage ``old_logprob``) -> token selections of the baselines
    -> modulation scopes (stage ``modulation_scope``) -> per mini-batch and PPO epoch: forward/backward with the
       modulated advantages (stage ``train``; the modulation factors inside it, stage ``modulation``) and one
       optimizer step, skipped on a non-finite loss or gradient -> the step's update metrics

:class:`PolicyUpdater` owns it and the model work it needs (the micro-batch layout, the forward-only token stats);
``StepRunner`` (``trainer/step.py``) calls :meth:`PolicyUpdater.update` once a step, and
``benchmarks/bench_update.py`` times it. Every training rank runs it (SPMD) on its data-parallel share and its
pipeline/tensor shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynamo.algorithms.modulation import ModulationScope, modulation_scope
from megatron_dynamo.models.moe_routing import RoutingPass
from megatron_dynamo.trainer.batch import (Sample, UpdateBatch, build_micro_batches, gather_token_values,
                                           make_micro_batches, plan_token_micro_batches, resolve_pack_sequences,
                                           shard_for_rank, split_mini_batches)
from megatron_dynamo.trainer.metrics import collect_metric_sums, is_metric_rank
from megatron_dynamo.trainer.moe_update import MoEUpdate
from megatron_dynamo.trainer.old_logprobs import (entropies_from_update, old_entropies, old_logprob_pass,
                                                  old_policy_metrics, scatter_engine_logprobs,
                                                  update_gives_old_logprobs)
from megatron_dynamo.trainer.policy_loss import (dynamo_loss_fn, global_denominator, reduce_scope_gaps,
                                                 scope_inputs, sum_scope_gaps, token_stats_fn)
from megatron_dynamo.trainer.token_selection import scatter_selections

#: A step's stage timer (``step.StageTimer``): ``with timer("stage"):`` adds the block's seconds to ``time/stage``.
Timer = Callable[[str], ContextManager]

#: A mini-batch as the update runs it: its samples and this rank's micro-batches of them.
Plan = tuple[list[Sample], list[UpdateBatch]]


@dataclass(frozen=True)
class UpdateLayout:
    """Where this rank stands in the model-parallel layout, as the update needs it."""

    last_stage: bool  # the last pipeline stage: the only one with logits, losses and token stats
    dp_group: Any  # the data-parallel group, None with one data-parallel rank
    dp_rank: int


@dataclass
class UpdateTally:
    """What the mini-batch loop accumulates: token-weighted metric sums (name -> (sum, weight), on the metric ranks;
    the old policy's ``entropy_mean`` and gap come in too), the optimizer steps and gradient norms, the skipped
    updates, the scope gaps (``scope: current_policy``), and the loss's outputs of the last mini-batch run."""

    sums: dict[str, tuple[float, float]] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    optimizer_steps: int = 0
    skipped: list[str] = field(default_factory=list)
    scope_gaps: list[tuple[int, int, dict[str, float]]] = field(default_factory=list)  # (epoch, mini-batch, gaps)
    last_results: list[dict[str, Any]] = field(default_factory=list)

    def add(self, key: str, value: float, count: float) -> None:
        """``value`` into the sum of ``key`` and ``count`` into its count (its mean: sums over counts)."""
        s, c = self.sums.get(key, (0.0, 0.0))
        self.sums[key] = (s + value, c + count)

    def add_loss_outputs(self, results: list[dict[str, Any]], loss: float, dp_rank: int) -> None:
        """One mini-batch's loss outputs (this rank's micro-batches) into the sums: token-weighted means; the token
        counts themselves are weights, not metrics. A mean over a subset of the tokens comes with its own count,
        ``<key>/num_tokens``."""
        for r in results:
            n = float(r.get("actor/num_tokens", 0.0))
            for key, value in r.items():
                if key.startswith(("actor/", "modulation/")) and not key.endswith("/num_tokens"):
                    weight = float(r.get(f"{key}/num_tokens", n))
                    self.add(key, float(value) * weight, weight)
        # Micro-batch losses carry the global denominator: their sum over micro-batches and DP ranks is the
        # mini-batch loss; count each update once (on DP rank 0).
        self.add("loss", float(loss), 1.0 if dp_rank == 0 else 0.0)

    def metrics(self, gap_max: float | None, scope_gaps: bool) -> dict[str, Any]:
        """Collective: the step's update metrics (means over the metric ranks)."""
        metrics = collect_metric_sums(self.sums if is_metric_rank() else {})
        if scope_gaps:
            metrics.update(reduce_scope_gaps(self.scope_gaps))
        if gap_max is not None:
            metrics["rollout/logp_gap_max"] = gap_max
        metrics["grad_norm"] = float(np.mean(self.grad_norms)) if self.grad_norms else float("nan")
        metrics["optimizer_steps"] = self.optimizer_steps
        if self.skipped:
            metrics["skipped"] = "; ".join(self.skipped)
        return metrics


class PolicyUpdater:
    """The RL update of the policy ``actor`` under the run config ``run`` (module docstring); ``pad_token_id`` pads
    the micro-batches."""

    def __init__(self, run, actor, pad_token_id: int):
        self.run = run
        self.actor = actor
        self.pad_token_id = pad_token_id
        # A mixture-of-experts policy: routing replay and the routers' metrics (trainer/moe_update.py).
        self.moe = MoEUpdate(actor, run.moe.routing_replay) if getattr(actor, "moe_routing", None) else None

    # ------------------------------------------------------------------ model work
    def micro_batches_for(self, samples: list[Sample]) -> list[UpdateBatch]:
        """This data-parallel rank's share of ``samples`` (one optimizer step's worth) as micro-batches on the
        model's device. Every DP rank gets the same number of micro-batches (the largest share decides), so that
        the ranks of a data-parallel group run matching schedules; a rank with no sample gets empty ones.

        ``trainer.micro_batch_tokens`` > 0: micro-batches of at most that many tokens, the samples balanced over
        the DP ranks by tokens (``batch.plan_token_micro_batches``, the same plan on every rank); else
        ``micro_batch_size`` sequences each. ``trainer.pack_sequences``: sequences packed into one row without
        padding (``batch.packed_micro_batch``) or padded rows. The layout changes neither the loss nor the
        gradients: every micro-batch's loss is divided by the mini-batch's global denominator."""
        from megatron.core import parallel_state as ps

        trainer = self.run.trainer
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        packed = resolve_pack_sequences(trainer.pack_sequences, getattr(self.actor, "use_te", False))
        seq_multiple = self.actor.sequence_multiple
        # Only pipeline stages need every micro-batch to have the same shape; padding rows costs compute.
        fixed_shape = ps.get_pipeline_model_parallel_world_size() > 1
        if trainer.micro_batch_tokens > 0:
            groups = plan_token_micro_batches(samples, dp, trainer.micro_batch_tokens, packed=packed,
                                              seq_multiple=seq_multiple, fixed_shape=fixed_shape)[dp_rank]
            return build_micro_batches(groups, self.pad_token_id, fixed_shape=fixed_shape, device=self.actor.device,
                                       seq_multiple=seq_multiple, packed=packed)
        largest_share = -(-len(samples) // dp)
        num_micro = max(1, -(-largest_share // trainer.micro_batch_size))
        shard = shard_for_rank(samples, dp_rank, dp)
        return make_micro_batches(shard, trainer.micro_batch_size, self.pad_token_id, num_micro,
                                  fixed_shape=fixed_shape, device=self.actor.device, seq_multiple=seq_multiple,
                                  packed=packed)

    @property
    def model_output(self) -> str:
        """What the loss functions get from the model (``MegatronActor.forward_backward``): the final hidden states
        with the output weight (``trainer.fused_output_layer``: logits only chunk by chunk at response positions),
        else the logits in the model dtype."""
        return "hidden" if self.run.trainer.fused_output_layer else "logits"

    def forward_token_stats(self, micro_batches: list[UpdateBatch],
                            record_routing: bool = False) -> dict[int, dict[str, torch.Tensor]]:
        """Forward-only pass: per sample index, its response tokens' logp / entropy / sum_pi2_lambda (last stage).
        ``record_routing``: the experts it routes to go into the micro-batches (``moe.routing_replay: old_policy``)."""
        fn = token_stats_fn(self.run.rollout.temperature, self.run.dynamo.token_stats_chunk)
        routing = RoutingPass(record=True) if record_routing else None
        results = self.actor.forward_backward(micro_batches, fn, forward_only=True, output=self.model_output,
                                              routing=routing)
        if routing is not None:
            self.moe.keep_recorded(micro_batches, routing)
        per_sample: dict[int, dict[str, torch.Tensor]] = {}
        for mb, out in zip(micro_batches, results):
            for name in ("logp", "entropy", "sum_pi2_lambda"):
                for index, values in gather_token_values(mb, out[name]).items():
                    per_sample.setdefault(index, {})[name] = values
        return per_sample

    # ------------------------------------------------------------------ the update
    def update(self, samples: list[Sample], prompt_order: list[str], timer: Timer, step: int) -> dict[str, Any]:
        """The RL update of step ``step`` on scored ``samples``: old log-probs, token selections and modulation
        scopes, then one optimizer step per mini-batch of ``prompt_order`` and PPO epoch; returns its metrics.
        ``step`` seeds the baselines' random token selection (``trainer/token_selection.py``)."""
        from megatron.core import parallel_state as ps

        run = self.run
        plans: list[Plan] = [(mb, self.micro_batches_for(mb))
                             for mb in split_mini_batches(samples, prompt_order, run.trainer.mini_batch_prompts) if mb]
        layout = UpdateLayout(ps.is_pipeline_last_stage(ignore_virtual=True),
                              ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None,
                              ps.get_data_parallel_rank())
        tally = UpdateTally()
        if self.moe is not None:
            self.moe.check_engine_experts(samples)
            self.moe.start()
        # Where the update's own forward gives the old log-probs, it stands in for their pass (old_logprobs.py).
        reuse = update_gives_old_logprobs(run, len(plans))
        old = {} if reuse else old_logprob_pass(self, plans, layout.last_stage, timer)
        engine_logp = scatter_engine_logprobs(samples, plans, layout.last_stage, run.dynamo.loss.engine_is)
        gap_max = None if reuse else old_policy_metrics(plans, old_entropies(old), tally.sums, engine_logp)
        # The baselines' mini-batch-wide token selections (Fork Tokens, Clip-COV, KL-COV), from the same pass.
        scatter_selections(run.dynamo.loss, plans, old, layout.last_stage, layout.dp_group, run.trainer.seed, step)
        old_scopes = self.old_policy_scopes(plans, old, layout, timer)
        for epoch in range(run.trainer.ppo_epochs):
            for index, (mini, micro) in enumerate(plans):
                scope = old_scopes[index]
                if self.current_policy_scopes and (epoch, index) != (0, 0):
                    scope = self.current_policy_scope(micro, layout, timer)
                self.train_mini_batch(mini, micro, scope, old_scopes[index], (epoch, index), layout, tally, timer)
        if reuse and plans:  # the update ran on the old weights: the old policy's numbers come from it
            entropies = entropies_from_update(plans, tally.last_results, layout.last_stage)
            gap_max = old_policy_metrics(plans, entropies, tally.sums, engine_logp)
        metrics = tally.metrics(gap_max, scope_gaps=self.current_policy_scopes)
        return metrics if self.moe is None else {**metrics, **self.moe.metrics()}

    @property
    def records_old_policy(self) -> bool:
        """The old-log-prob pass records the experts the update replays (``moe.routing_replay: old_policy``)."""
        return self.moe is not None and self.moe.records_old_policy

    # ------------------------------------------------------------------ modulation scopes
    @property
    def current_policy_scopes(self) -> bool:
        """``modulation.scope: current_policy``: every mini-batch after the first gets the scope of the weights it
        is trained on (a no-grad forward), and the step reports its gap to the old-policy scope."""
        modulation = self.run.dynamo.modulation
        return modulation.enabled and modulation.scope == "current_policy"

    def old_policy_scopes(self, plans: list[Plan], old: dict[int, dict[str, torch.Tensor]], layout: UpdateLayout,
                          timer: Timer) -> list[ModulationScope | None]:
        """Collective over the DP group: every mini-batch's modulation scope (H_min, H_max, max Xi over its tokens
        and the DP group) under the old policy, from the old-log-prob pass: no extra forward. It is the exact scope
        of the first mini-batch (pi = pi_old before the first update) and, with ``modulation.scope: old_policy``,
        the one used for all. None for each with modulation off, or off the last pipeline stage."""
        modulation = self.run.dynamo.modulation
        scopes: list[ModulationScope | None] = [None] * len(plans)
        if modulation.enabled:
            with timer("modulation_scope"):
                if layout.last_stage:
                    scopes = [modulation_scope([scope_inputs(mb, old, self.run.dynamo.loss) for mb in micro],
                                               modulation, group=layout.dp_group) for _, micro in plans]
        return scopes

    def current_policy_scope(self, micro: list[UpdateBatch], layout: UpdateLayout,
                             timer: Timer) -> ModulationScope | None:
        """The exact two-pass form: the mini-batch's scope under the current weights, from a no-grad forward (on
        every stage; the scope itself on the last)."""
        with timer("modulation_scope"):
            stats = self.forward_token_stats(micro)
            if not layout.last_stage:
                return None
            inputs = [scope_inputs(mb, stats, self.run.dynamo.loss) for mb in micro]
            return modulation_scope(inputs, self.run.dynamo.modulation, group=layout.dp_group)

    # ------------------------------------------------------------------ one optimizer step
    def train_mini_batch(self, mini: list[Sample], micro: list[UpdateBatch], scope: ModulationScope | None,
                         old_scope: ModulationScope | None, where: tuple[int, int], layout: UpdateLayout,
                         tally: UpdateTally, timer: Timer) -> None:
        """Forward/backward of one mini-batch (``where``: its PPO epoch and index) with the modulation of ``scope``
        and one optimizer step; its outputs into ``tally``. ``old_scope``: its old-policy scope, compared with the
        trained one where they differ (``scope: current_policy``)."""
        run = self.run
        loss_fn = dynamo_loss_fn(run.dynamo.modulation, run.dynamo.loss, scope,
                                 global_denominator(mini, run.dynamo.loss.loss_agg_mode), run.rollout.temperature,
                                 run.dynamo.token_stats_chunk,
                                 compare_scope=old_scope if self.current_policy_scopes else None, timer=timer)
        with timer("train"):
            routing = self.moe.training_pass(micro) if self.moe is not None else None
            results = self.actor.forward_backward(micro, loss_fn, output=self.model_output, routing=routing)
            tally.last_results = results
            loss = sum(float(r["loss"]) for r in results)
            if not self.loss_is_finite(loss):
                self.actor.zero_grad()
                tally.skipped.append(f"non-finite loss at epoch {where[0]} mini-batch {where[1]}")
                return
            self.optimizer_step(where, tally)
        if is_metric_rank():
            if self.current_policy_scopes:
                tally.scope_gaps.append((*where, sum_scope_gaps(results)))
            tally.add_loss_outputs(results, loss, layout.dp_rank)

    def loss_is_finite(self, loss: float) -> bool:
        """Collective: the mini-batch's loss is finite on every rank."""
        finite = torch.tensor([1.0 if math.isfinite(loss) else 0.0], device=self.actor.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return finite.item() != 0

    def optimizer_step(self, where: tuple[int, int], tally: UpdateTally) -> None:
        """The optimizer step on the accumulated gradients. The actor checks them first: a non-finite one leaves the
        weights as they are, and the step counts as skipped."""
        result = self.actor.optimizer_step()
        if not result.update_successful:
            tally.skipped.append(f"non-finite gradient at epoch {where[0]} mini-batch {where[1]}")
            return
        tally.optimizer_steps += 1
        if result.grad_norm is not None:
            tally.grad_norms.append(result.grad_norm)
