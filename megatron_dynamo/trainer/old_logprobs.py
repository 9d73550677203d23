"""When the RL update's own forward gives the old log-probs, so that the old-log-prob pass can be left out.

PPO's ratio pi / pi_old needs pi_old: the log-probs of the sampled tokens under the weights the step starts with.
The trainer gets them from a forward-only pass over the whole rollout before the first optimizer step
(``PolicyUpdater.update``, ``trainer/update.py``). With one mini-batch and one PPO epoch, the update's only forward
runs on those very weights, so its log-probs, detached, are the old log-probs: the forward-only pass computes the
same numbers a second time (TRL's GRPOTrainer skips it in the same case). The update then takes ``old_logp`` = its
own ``logp.detach()`` (``policy_loss.dynamo_loss_fn`` does so when a micro-batch carries no ``old_logp``), and what
the step reports from the old-policy pass (``entropy_mean``, the engine/trainer log-prob gap) is taken from the
update's forward instead, after it: the same values (``tests/test_old_logprobs.py``: metrics and weights identical,
bit for bit, to a run with the pass).

The pass stays where something needs the old policy's numbers before the update's first loss:

- more than one mini-batch, or more than one PPO epoch: later updates run on changed weights;
- modulation on: the mini-batch-wide scope (H_min, H_max, max Xi over all the mini-batch's tokens) enters the loss
  of every micro-batch, so it must be known before the first (and ``scope: current_policy`` needs the pass too);
- a baseline with a mini-batch-wide token selection (Fork Tokens, Clip-COV, KL-COV) chosen before its update;
- ``trainer.old_logprob_pass: always`` (the check above is ``auto``, the default).

The module also puts the old log-probs and the engine's own log-probs of the sampled tokens into the micro-batches
and measures the gap between the two.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from megatron_dynamo.algorithms.baselines import SELECTION_LOSSES
from megatron_dynamo.algorithms.losses import engine_gap_sums
from megatron_dynamo.parallel.runtime import collective_device
from megatron_dynamo.trainer.batch import Sample, token_values
from megatron_dynamo.trainer.errors import RolloutError
from megatron_dynamo.trainer.metrics import is_metric_rank

#: trainer.old_logprob_pass: ``auto`` leaves the pass out where the update's forward gives the same numbers;
#: ``always`` runs it every step.
OLD_LOGPROB_PASSES = ("auto", "always")

#: The per-token outputs the update's loss returns when it stands in for the old-log-prob pass (``token/<name>``).
TOKEN_OUTPUTS = ("logp", "entropy")


def update_gives_old_logprobs(run, num_mini_batches: int) -> bool:
    """True where the old-log-prob pass may be left out (module docstring): ``trainer.old_logprob_pass`` is
    ``auto``, one mini-batch, one PPO epoch, modulation off, and a loss without a mini-batch token selection."""
    trainer, dynamo = run.trainer, run.dynamo
    return (trainer.old_logprob_pass == "auto" and num_mini_batches <= 1 and trainer.ppo_epochs == 1
            and not dynamo.modulation.enabled and dynamo.loss.name not in SELECTION_LOSSES)


def full_token_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flattened per-token ``values`` at the response positions back in the micro-batch's layout ([B, S] or [1, T]
    packed), 0 elsewhere, detached, in fp32: what ``batch.gather_token_values`` reads per sample."""
    full = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    full[mask] = values.detach().float()
    return full


def entropies_from_update(plans, results, last_stage: bool) -> torch.Tensor:
    """After the update of the single mini-batch of ``plans``: its log-probs (``token/logp``, computed on the weights
    before the optimizer step: the old policy) into its micro-batches as ``old_logp``, in the layout the pass's
    scatter gives (``full_token_values``: the values at the response positions, 0 elsewhere; zeros off the last
    pipeline stage); returns the response tokens' entropies in the order the pass's per-sample stats give them
    (micro-batch, sample, position): :func:`old_entropies` of the pass, without a per-sample gather and scatter."""
    micro = plans[0][1]
    if not last_stage:
        scatter_into_plans(plans, {}, "old_logp", last_stage)
        return torch.zeros(0)
    entropies = []
    for mb, out in zip(micro, results):
        mb.old_logp = out["token/logp"]
        entropies.append(out["token/entropy"][mb.loss_mask.bool()])
    return torch.cat(entropies) if entropies else torch.zeros(0)


def old_entropies(old: dict[int, dict[str, torch.Tensor]]) -> torch.Tensor:
    """The response tokens' entropies of the old-log-prob pass's per-sample stats, in their order."""
    return torch.cat([v["entropy"] for v in old.values()]) if old else torch.zeros(0)


def old_logprob_pass(updater, plans, last_stage: bool, timer) -> dict[int, dict[str, torch.Tensor]]:
    """The forward-only pass over every mini-batch of ``plans`` under the step's starting weights (timed as
    ``old_logprob``), its log-probs put into the micro-batches as ``old_logp`` (and, with ``moe.routing_replay:
    old_policy``, the experts it routed to as ``routed_experts``); returns the per-sample token stats.
    ``updater``: the ``PolicyUpdater``."""
    with timer("old_logprob"):
        old: dict[int, dict[str, torch.Tensor]] = {}
        for _, micro in plans:
            old.update(updater.forward_token_stats(micro, record_routing=updater.records_old_policy))
        put_old_logp(plans, old, last_stage)
    return old


def put_old_logp(plans, old: dict[int, dict[str, torch.Tensor]], last_stage: bool) -> None:
    """``old``'s log-probs into every micro-batch of ``plans`` as ``old_logp``."""
    scatter_into_plans(plans, {i: v["logp"] for i, v in old.items()}, "old_logp", last_stage)


def old_policy_metrics(plans, entropies: torch.Tensor, local: dict[str, tuple[float, float]],
                       engine_logp: bool) -> float | None:
    """Collective: what a step reports of the old policy, as token-weighted sums in ``local``: ``entropy_mean`` (of
    ``entropies``, empty off the last pipeline stage) and, when the micro-batches carry the engine's log-probs
    (``engine_logp``), the engine/trainer gap (``engine_gap_metrics``, whose maximum it returns; None
    without them)."""
    if entropies.numel():
        local["entropy_mean"] = (float(entropies.sum()), float(entropies.numel()))
    return engine_gap_metrics(plans, local) if engine_logp else None


def scatter_engine_logprobs(samples: list[Sample], plans, last_stage: bool, engine_is: str) -> bool:
    """The engine's log-probs of the sampled tokens into every micro-batch (``engine_logp``, beside ``old_logp``:
    ``dynamo.loss.engine_is`` weighs the loss with them). False when the engine gave no log-probs (every rank holds
    the same rollout, so all agree); then ``engine_is`` other than off is an error."""
    lengths = [s.num_response_tokens for s in samples]
    complete = bool(samples) and all(s.engine_logp is not None and len(s.engine_logp) == n
                                     for s, n in zip(samples, lengths))
    # One tensor and one finiteness check for the whole rollout, split into per-sample views
    flat = torch.tensor([v for s in samples for v in s.engine_logp], dtype=torch.float32) if complete else None
    if flat is None or not bool(torch.isfinite(flat).all()):
        if engine_is != "off":
            raise RolloutError("dynamo.loss.engine_is needs the engine's log-prob of every sampled token; "
                               "the engine returned none")
        return False
    engine = dict(zip((s.index for s in samples), flat.split(lengths)))
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
