"""The routers of a mixture-of-experts model on this rank, micro-batch by micro-batch: replaying given experts,
recording the experts Megatron chose, and measuring what the routers did (expert load, routing entropy, agreement
with given experts).

Layout. A micro-batch's experts travel with it as one per-token tensor ``routed_experts`` [B, S, L, k] in its token
layout ([B, S] padded rows, or [1, T] packed), L the model's MoE layers in model order (dense layers skipped), k the
router's top-k, -1 where none is given (padding). Megatron's router sees its layer's hidden states [s, b, h] (with
sequence parallelism only this tensor-parallel rank's slice of s) as tokens in [s, b] order, and megatron-core
0.16.1's ``RouterReplay`` (transformer/moe/router_replay.py) takes one [tokens, k] tensor a layer in that order.
Each rank reads, and records into, only its own layers (pipeline stages hold some) and its sequence slice.

Replay (config ``moe_enable_routing_replay``, the run's ``moe.routing_replay``): the router gathers its own scores
at the given experts (``REPLAY_FORWARD``), so the routing weights and their gradient stay the trainer's; only the
choice is replayed. Under activation recompute the backward's recomputed forward takes the same experts again
(``REPLAY_BACKWARD``: a queue with one entry per micro-batch forward, in schedule order; a hook on the
micro-batch's output switches to it when its backward starts).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from megatron_dynamo.models.mappings import unwrap_model


def moe_layer_pattern(config) -> list[int]:
    """1 for a MoE layer, 0 for a dense one, over the whole model (``TransformerConfig.moe_layer_freq``)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(config.num_layers)]
    return [int(bool(p)) for p in freq]


def moe_routers(module) -> list[tuple[int, Any]]:
    """(MoE layer index in model order, ``TopKRouter``) of the MoE layers of one model chunk (a GPTModel)."""
    pattern = moe_layer_pattern(module.config)
    decoder = getattr(module, "decoder", None)
    out = []
    for layer in decoder.layers if decoder is not None else []:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            out.append((sum(pattern[:layer.layer_number - 1]), router))
    return out


def router_order(per_token: torch.Tensor, sequence: slice) -> torch.Tensor:
    """[B, S, ...] per-token values as the router sees its tokens: this rank's ``sequence`` slice, [s, b] flattened."""
    x = per_token[:, sequence].transpose(0, 1)
    return x.reshape(-1, *x.shape[2:])


def from_router_order(values: torch.Tensor, batch: int) -> torch.Tensor:
    """Inverse of :func:`router_order`: [s * b, ...] -> [b, s, ...]."""
    return values.reshape(-1, batch, *values.shape[1:]).transpose(0, 1)


def replay_targets(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A layer's given experts [tokens, k] as ``RouterReplay`` takes them (int64). A token without any (-1: padding
    rows, a packed tail) gets k distinct experts that walk round all ``num_experts``: token i the ids i k .. i k + k - 1
    modulo E. Padding comes after every real token of its sequence (or in a segment of its own), so under the causal
    mask it changes no log-prob the update uses; spread this way, the padding of a micro-batch (a whole one that only
    evens out ranks) loads every expert, and so every expert-parallel rank, alike instead of the first k."""
    experts = experts.long()
    tokens, k = experts.shape
    filler = (torch.arange(tokens, device=experts.device)[:, None] * k
              + torch.arange(k, device=experts.device)) % num_experts
    return torch.where((experts < 0).any(-1, keepdim=True), filler, experts)


def real_tokens(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bool [B, S]: the micro-batch's real tokens, not padding. Packed: ``token_row`` >= 0. Padded rows: every
    position up to the row's last trained one (``loss_mask``; a sequence ends with its response); all without a
    loss mask."""
    if "token_row" in micro_batch:
        return micro_batch["token_row"] >= 0
    mask = micro_batch.get("loss_mask")
    if mask is None:
        return torch.ones_like(micro_batch["input_ids"], dtype=torch.bool)
    return mask.flip(-1).cumsum(-1).flip(-1) > 0


class RoutingStats:
    """What the routers did over the forwards they were given to, per MoE layer of the whole model (zeros for the
    layers of other pipeline stages), over real tokens only: tokens routed to each expert (``counts`` [L, E]),
    the routing distribution's entropy summed over tokens, the tokens, and, where experts were given, how many of
    the router's own top-k experts are among them (``agreement``, out of ``agreement_slots`` = tokens x k)."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu"):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.entropy, self.tokens, self.agreement, self.agreement_slots = torch.zeros(
            4, num_layers, dtype=torch.float64, device=device)

    def add(self, layer: int, logits: torch.Tensor, routing_map: torch.Tensor, real: torch.Tensor,
            given: torch.Tensor | None) -> None:
        """One router call: its ``logits`` [tokens, E], the experts it used (``routing_map`` bool [tokens, E]), which
        tokens are real, and the given experts [tokens, k] (or None)."""
        logits = logits[real].double()
        log_probs = torch.log_softmax(logits, dim=-1)
        self.entropy[layer] -= (log_probs.exp() * log_probs).sum()
        self.tokens[layer] += logits.shape[0]
        self.counts[layer] += routing_map[real].sum(0)
        if given is not None:
            given = given[real].long()
            own = logits.topk(given.shape[-1], dim=-1).indices
            self.agreement[layer] += (own.unsqueeze(-1) == given.unsqueeze(-2)).any(-1).sum()
            self.agreement_slots[layer] += given.numel()

    def tensor(self) -> torch.Tensor:
        """Everything as one float64 [L, E + 4] tensor (one collective sums it)."""
        return torch.cat([self.counts, torch.stack([self.entropy, self.tokens, self.agreement,
                                                    self.agreement_slots], dim=1)], dim=1)


@dataclass
class RoutingPass:
    """What one ``forward_backward`` call does with the MoE routers besides routing: ``record`` the experts Megatron
    chose (``recorded``: micro-batch index -> [B, S, L, k], -1 outside this rank's layers and sequence slice;
    megatron-core's ``RECORD``), and add the routers' statistics to ``stats``."""

    record: bool = False
    stats: RoutingStats | None = None
    recorded: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Current:
    """The micro-batch a chunk is running forward: its real tokens and given experts in router order."""

    routing: RoutingPass | None
    real: torch.Tensor
    given: torch.Tensor | None  # [tokens, L, k]


class MoERouting:
    """This rank's MoE routers, chunk by chunk (``chunks``: the model chunks, wrapped or not), driven from the
    pipeline schedule's forward step (:meth:`micro_batch`)."""

    def __init__(self, chunks):
        modules = [unwrap_model(chunk) for chunk in chunks]
        self.config = modules[0].config
        self.routers = [moe_routers(module) for module in modules]
        self.num_layers = sum(moe_layer_pattern(self.config))
        self.top_k = self.config.moe_router_topk
        self.num_experts = self.config.num_moe_experts
        self.recompute = self.config.recompute_granularity is not None
        self._current: _Current | None = None
        for routers in self.routers:
            for layer, router in routers:
                router.register_forward_hook(self._stats_hook(layer))

    def _sequence(self, seq_len: int) -> slice:
        """This rank's slice of a micro-batch's sequence as its routers see it (sequence parallelism splits it
        over the tensor-parallel ranks)."""
        if not self.config.sequence_parallel:
            return slice(None)
        from megatron.core import parallel_state as ps

        size = seq_len // ps.get_tensor_model_parallel_world_size()
        rank = ps.get_tensor_model_parallel_rank()
        return slice(rank * size, (rank + 1) * size)

    @contextlib.contextmanager
    def micro_batch(self, chunk: int, index: int, count: int, micro_batch: dict[str, torch.Tensor],
                    routing: RoutingPass | None) -> Iterator[list[torch.Tensor]]:
        """Around the forward of micro-batch ``index`` of ``count`` (its tensors ``micro_batch``) through chunk
        ``chunk``: replay its ``routed_experts`` where the model replays, else record them when ``routing.record``;
        measure into ``routing.stats``. Put the forward's output in the yielded list: its backward then weighs the
        aux losses (:meth:`_backward_starts`) and, under activation recompute, replays the same experts."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers, outputs = self.routers[chunk], []
        if not routers:
            yield outputs
            return
        given = micro_batch.get("routed_experts")
        sequence = self._sequence(micro_batch["input_ids"].shape[1])
        given_here = router_order(given, sequence) if given is not None else None
        replays = [router.router_replay for _, router in routers if router.router_replay is not None]
        for layer, router in routers:
            if router.router_replay is None:
                continue
            if given_here is not None:
                router.router_replay.set_target_indices(replay_targets(given_here[:, layer], self.num_experts))
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            elif routing is not None and routing.record:
                router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                router.router_replay.clear_router_replay_action()
        real_here = router_order(real_tokens(micro_batch), sequence)
        self._current = _Current(routing, real_here, given_here)
        try:
            yield outputs
        finally:
            self._current = None
        if given_here is None and routing is not None and routing.record:
            self._keep_recorded(chunk, index, micro_batch["input_ids"].shape, sequence, routing)
        if outputs and outputs[0].requires_grad:
            replaying = replays if given_here is not None and self.recompute else []
            outputs[0].register_hook(self._backward_starts(replaying, real_here.numel(), count))

    @staticmethod
    def _backward_starts(replays, tokens: int, count: int):
        """A hook for the gradient of a micro-batch's output, which arrives before any of its layers' backward:
        ``replays`` switch to the experts queued for the backward's recompute (``REPLAY_BACKWARD``), and the aux
        losses get their weight. megatron-core (0.16, ``calculate_per_token_loss``) attaches each micro-batch's
        aux losses times its ``tokens`` (the router's tokens on this rank) and leaves their gradient unscaled, for a
        ``finalize_model_grads`` that divides all gradients by the batch's tokens; this trainer's losses carry
        their own normalisation and nothing is divided, so that scale is set here instead: 1 / (tokens x
        micro-batches x data-parallel ranks), making ``moe.aux_loss_coef`` (and ``z_loss_coef``) the weight of
        the losses' mean over the update's micro-batches. The schedule sets the scale at every forward step, so it
        is set again as each backward starts."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        scale = 1.0 / (max(tokens, 1) * count * ps.get_data_parallel_world_size())

        def hook(grad):
            for replay in replays:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, device=grad.device))

        return hook

    def _keep_recorded(self, chunk: int, index: int, shape: torch.Size, sequence: slice,
                       routing: RoutingPass) -> None:
        """The experts this chunk's routers recorded for micro-batch ``index`` into ``routing.recorded``."""
        batch, seq_len = shape
        out = routing.recorded.get(index)
        if out is None:
            out = torch.full((batch, seq_len, self.num_layers, self.top_k), -1, dtype=torch.int16)
            routing.recorded[index] = out
        for layer, router in self.routers[chunk]:
            recorded = router.router_replay.get_recorded_indices()
            out[:, sequence, layer] = from_router_order(recorded, batch).to(device="cpu", dtype=torch.int16)

    def _stats_hook(self, layer: int):
        def hook(router, inputs, output):
            current = self._current
            if current is None or current.routing is None or current.routing.stats is None:
                return  # not a forward step measured (or the backward's recompute)
            with torch.no_grad():
                logits = router.gating(inputs[0]).reshape(-1, router.config.num_moe_experts)
                given = current.given[:, layer] if current.given is not None else None
                current.routing.stats.add(layer, logits, output[1], current.real, given)

        return hook

    def finish(self) -> None:
        """After a ``forward_backward`` call: no replay state outlives it (the backward queue of a run without
        recompute would grow by a micro-batch each forward)."""
        for routers in self.routers:
            for _, router in routers:
                if router.router_replay is not None:
                    router.router_replay.clear_indices()
                    router.router_replay.clear_router_replay_action()
