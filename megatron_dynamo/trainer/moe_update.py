"""The mixture-of-experts part of a step's update (``trainer/update.py``): which experts the forwards use
(``moe.routing_replay``, docs/moe.md) and what the routers did (``moe/*`` metrics, docs/metrics.md).

- ``rollout``: every sample carries the engine's experts of its tokens (``Sample.routed_experts``, checked here
  against the model's MoE layers and top-k); the micro-batches carry them, and every forward replays them.
- ``old_policy``: the old-log-prob pass records the experts Megatron chose (megatron-core's ``RECORD``) and puts
  them into its micro-batches, so every later forward and backward of the step over them replays them. Where the
  update's own forward stands in for the pass (``trainer/old_logprobs.py``), it is the first and only forward of
  the step: it routes for itself and there is nothing to replay.
- the update's training forwards measure the routers (:class:`~megatron_dynamo.models.moe_routing.RoutingStats`),
  and Megatron's aux-loss tracker holds the load-balancing and z-losses of those forwards (when their
  coefficients are on).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_dynamo.models.moe_routing import RoutingPass, RoutingStats, moe_layer_pattern
from megatron_dynamo.trainer.batch import Sample, UpdateBatch
from megatron_dynamo.trainer.errors import RolloutError
from megatron_dynamo.trainer.metrics import moe_metrics


class MoEUpdate:
    """One run's MoE bookkeeping for its updates (``actor``: the policy; ``routing_replay``: the run's
    ``moe.routing_replay``). :meth:`start` begins a step's update, :meth:`metrics` ends it."""

    def __init__(self, actor, routing_replay: str):
        self.actor = actor
        self.routing_replay = routing_replay
        self.config = actor.config
        self.layers = [i for i, moe in enumerate(moe_layer_pattern(self.config)) if moe]
        self.stats: RoutingStats | None = None
        self.micro_batches = 0

    @property
    def records_old_policy(self) -> bool:
        """The old-log-prob pass records the experts the update replays."""
        return self.routing_replay == "old_policy"

    def check_engine_experts(self, samples: list[Sample]) -> None:
        """``rollout``: every sample's engine experts, one row per token the model reads, the model's MoE layers and
        top-k, valid expert ids; a RolloutError in one line otherwise (every rank holds the same rollout, so all
        raise alike)."""
        if self.routing_replay != "rollout":
            return
        shape = (len(self.layers), self.config.moe_router_topk)
        for s in samples:
            rows = len(s.prompt_tokens) + len(s.response_tokens) - 1
            experts = s.routed_experts
            if experts is None:
                raise RolloutError("moe.routing_replay: rollout needs the engine's routed experts of every response; "
                                   "the engine returned none")
            if tuple(experts.shape) != (rows, *shape):
                raise RolloutError(f"routed experts of sample {s.index}: shape {tuple(experts.shape)}, expected "
                                   f"{(rows, *shape)} (prompt + response - 1 tokens, MoE layers, top-k)")
            experts_count = self.config.num_moe_experts
            if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < experts_count:
                raise RolloutError(f"routed experts of sample {s.index}: ids outside 0..{experts_count - 1}")

    def start(self) -> None:
        """Before a step's update: fresh router statistics, and Megatron's aux-loss tracker emptied of the
        forwards before (the warm-up's, the last step's)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        self.stats = RoutingStats(len(self.layers), self.config.num_moe_experts, self.actor.device)
        self.micro_batches = 0

    def training_pass(self, micro: list[UpdateBatch]) -> RoutingPass:
        """What a training forward/backward over ``micro`` measures."""
        self.micro_batches += len(micro)
        return RoutingPass(stats=self.stats)

    def keep_recorded(self, micro: list[UpdateBatch], routing: RoutingPass) -> None:
        """The experts the old-log-prob pass recorded, into its micro-batches (cut back from a pipeline's common
        shape to each micro-batch's own)."""
        for index, mb in enumerate(micro):
            recorded = routing.recorded[index]
            mb.routed_experts = recorded[:, :mb.input_ids.shape[1]].to(mb.input_ids.device)

    def metrics(self) -> dict[str, Any]:
        """Collective (every training rank): the step's ``moe/*`` metrics (``metrics.moe_metrics``)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker, config = get_moe_layer_wise_logging_tracker(), self.config
        aux = {}
        for name, key, on in (("load_balancing_loss", "moe/aux_loss",
                               config.moe_router_load_balancing_type == "aux_loss"),
                              ("z_loss", "moe/z_loss", config.moe_z_loss_coeff is not None)):
            if on:  # tracked on the ranks that hold MoE layers (per layer of the model, summed over micro-batches)
                values = tracker[name]["values"] if name in tracker else torch.zeros(config.num_layers)
                aux[key] = values[self.layers].double()
        return moe_metrics(self.stats, aux, self.micro_batches, self.layers, self.config.sequence_parallel)
