"""The seven baselines of the paper's Table 1, each GRPO (no DRA, no GC/UMS) plus its own change, registered here.

``BASELINES`` maps each name (``dynamo train --algo NAME``) to what it changes in the GRPO configuration
(``trainer.config.with_algorithm`` applies it): a policy loss registered below (``losses.register_policy_loss``),
clip bounds, or an advantage estimator registered below (``advantages.register_advantage_estimator``). Defaults
live in ``config.PolicyLossConfig`` and are cited here, one paragraph per baseline.

Three baselines select tokens over a whole mini-batch (Fork Tokens: the top 20% by entropy; Clip-COV and KL-COV: by
the covariance of log-prob and advantage). The selection is made once per mini-batch, before its update, from the
old-policy pass the trainer makes anyway (no extra forward), over the tokens of every micro-batch and every
data-parallel rank in one canonical order (sample index, then position), so it is the same whatever the TP/PP/DP
layout and micro-batch plan (``mini_batch_selection``; the trainer gathers the tokens with one collective). Its
per-token result reaches the loss as ``selection``. Before the first update of a step pi = pi_old, so this is the
sources' selection exactly for the first mini-batch; later mini-batches of a step use the pre-update values.

Pure torch: nothing here imports Megatron or vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from megatron_dynamo.config import ConfigError, parse_yaml

from .advantages import register_advantage_estimator
from .config import PolicyLossConfig
from .losses import (PolicyLossOutput, loss_agg, masked_mean, policy_ratio, ppo_clip_loss, register_policy_loss,
                     to_token_shape, update_metrics)

@dataclass(frozen=True)
class Baseline:
    """One baseline of the paper's Table 1, registered once: its row label in the paper, the PolicyLossConfig fields
    it sets (``loss``; a ``name`` there is a policy loss registered below) and the DynamoConfig fields it sets
    (``dynamo``). ``dynamo train --algo NAME`` applies both over GRPO (``trainer.config.with_algorithm``);
    ``dynamo ablate``'s variant NAME (``experiments/variants.py``) takes its label from here. ``ratio_only``: it
    changes only what happens where the ratio pi / pi_old moves away from 1, so with one PPO mini-batch a step it
    equals GRPO (``dynamo train`` says so; docs/baselines.md)."""

    label: str
    loss: Mapping[str, Any]
    dynamo: Mapping[str, Any] = field(default_factory=dict)
    ratio_only: bool = False

    def keys(self) -> dict[str, Any]:
        """The config keys the baseline sets (``dynamo.loss.name`` ...) and their values."""
        return {**{f"dynamo.loss.{k}": v for k, v in self.loss.items()},
                **{f"dynamo.{k}": v for k, v in self.dynamo.items()}}


#: name -> the baseline (``dynamo train --algo NAME``), in the paper's Table 1 order.
BASELINES: dict[str, Baseline] = {
    "clip_higher": Baseline("Clip-Higher", {"clip_low": 0.2, "clip_high": 0.28}, ratio_only=True),
    "entropy_loss": Baseline("Entropy Loss", {"name": "entropy_loss"}),
    "fork_tokens": Baseline("Fork Tokens", {"name": "fork_tokens"}),
    "entropy_adv": Baseline("Entropy Advantages", {"name": "entropy_adv"}),
    "clip_cov": Baseline("Clip-COV", {"name": "clip_cov"}),
    "kl_cov": Baseline("KL-COV", {"name": "kl_cov"}, ratio_only=True),
    # W-REINFORCE without the dual clip (c = None): its source's PPO clip has none (issue 32)
    "w_reinforce": Baseline("W-REINFORCE", {"name": "w_reinforce", "clip_ratio_c": None},
                            {"advantage_estimator": "reinforce_pm1"}),
}
#: The ``--algo`` help of every command that takes it, from the registry: a new baseline is added in one place.
ALGO_HELP = ("dynamo: the recipe as given; grpo: dynamic allocation and both modulation factors off; "
             f"{', '.join(BASELINES)}: GRPO plus that baseline of the paper's Table 1 (README, "
             "algorithms/baselines.py)")
#: What ``--algo grpo`` sets, and every baseline with it: dynamic allocation and both modulation factors off.
GRPO_KEYS: dict[str, Any] = {"dynamo.allocation.enabled": False, "dynamo.modulation.gc": False,
                             "dynamo.modulation.ums": False}


def algorithm_keys(algo: str) -> dict[str, Any]:
    """The config keys ``--algo algo`` sets and their values (none for ``dynamo``: the recipe as given)."""
    if algo == "dynamo":
        return {}
    return {**GRPO_KEYS, **(BASELINES[algo].keys() if algo in BASELINES else {})}


def check_algorithm_overrides(algo: str, overrides: Sequence[str]) -> None:
    """``--algo X`` with an override of a key X sets: the same value gives the same run as ``--algo X`` alone;
    another value is a one-line ConfigError (the two would otherwise give a run neither names)."""
    wanted = algorithm_keys(algo)
    for item in overrides:
        key, _, text = item.partition("=")
        key = key.strip()
        if key in wanted and parse_yaml(text) != wanted[key]:
            raise ConfigError(f"{item} contradicts --algo {algo}, which sets {key}={json.dumps(wanted[key])}: "
                              f"give one of them")


def algorithm_note(algo: str, loss_name: str) -> str | None:
    """A note when the run's policy loss is a baseline's but ``--algo`` is not that baseline (e.g.
    ``dynamo.loss.name=clip_cov`` alone keeps DRA, GC and UMS as the recipe sets them): a run neither names."""
    owner = next((name for name, b in BASELINES.items() if b.loss.get("name") == loss_name), None)
    if owner is None or owner == algo:
        return None
    return (f"note: dynamo.loss.name={loss_name} with --algo {algo} is {BASELINES[owner].label}'s loss inside "
            f"--algo {algo}, not the paper's {BASELINES[owner].label} baseline (GRPO + that loss: --algo {owner})")


#: policy losses that need ``selection`` (a mini-batch-wide choice of tokens made before the update)
SELECTION_LOSSES = ("fork_tokens", "clip_cov", "kl_cov")


# ------------------------------------------------------------------------------------------- mini-batch selections
def fork_token_weights(entropy: torch.Tensor, top_ratio: float) -> torch.Tensor:
    """Fork Tokens' selection (Wang et al. 2025, "Beyond the 80/20 rule", their verl fork's
    ``get_global_entropy_top_mask``): the K = max(1, int(N * top_ratio + 0.9999)) tokens of highest entropy among the N
    tokens of the mini-batch (ties: the earlier token in canonical order). The source masks the other tokens out
    of the loss *and* of its token-mean denominator; here a selected token gets the weight N / K and the others 0,
    which gives the same loss under the mini-batch's token-mean denominator N. float64, shape of ``entropy``."""
    n = entropy.numel()
    weights = torch.zeros(n, dtype=torch.float64, device=entropy.device)
    if n == 0:
        return weights.reshape(entropy.shape)
    k = min(n, max(1, int(n * top_ratio + 0.9999)))  # the source's ceiling
    order = torch.sort(entropy.reshape(-1).double(), descending=True, stable=True).indices
    weights[order[:k]] = n / k
    return weights.reshape(entropy.shape)


def centred_covariance(advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Per token (A - mean A)(log pi - mean log pi), the means over the given tokens (Cui et al. 2025, "The entropy
    mechanism of RL for reasoning LMs", eq. of Cov(log pi, A); verl's ``compute_policy_loss_clip_cov``/``_kl_cov``).
    float64."""
    a, lp = advantages.double(), logp.double()
    if a.numel() == 0:
        return a
    return (a - a.mean()) * (lp - lp.mean())


def clip_cov_selection(advantages: torch.Tensor, logp: torch.Tensor, ratio: float, lb: float, ub: float,
                       generator: torch.Generator | None = None,
                       excluded: torch.Tensor | None = None) -> torch.Tensor:
    """Clip-COV's tokens (verl ``compute_policy_loss_clip_cov``, defaults clip_cov_ratio 2e-4, lb 1, ub 5): of the
    tokens whose centred covariance lies strictly in (lb, ub) and that are not ``excluded`` (verl excludes those the
    PPO clip already clipped; before the update, ratio = 1, none is), max(1, int(ratio * N)) chosen uniformly at
    random (``torch.randperm`` with ``generator``: seed it alike on every rank). Bool mask, shape of the inputs."""
    cov = centred_covariance(advantages, logp).reshape(-1)
    eligible = (cov > lb) & (cov < ub)
    if excluded is not None:
        eligible &= ~excluded.reshape(-1).bool()
    candidates = torch.nonzero(eligible).reshape(-1)
    chosen = torch.zeros_like(eligible)
    number = max(1, int(ratio * cov.numel()))
    if candidates.numel():
        perm = torch.randperm(candidates.numel(), generator=generator, device="cpu").to(candidates.device)
        chosen[candidates[perm[:number]]] = True
    return chosen.reshape(advantages.shape)


def kl_cov_selection(advantages: torch.Tensor, logp: torch.Tensor, ratio: float) -> torch.Tensor:
    """KL-COV's tokens (verl ``compute_policy_loss_kl_cov``): the max(1, int(N * ratio)) tokens of largest centred
    covariance (ties: the earlier token in canonical order). kl_cov_ratio 2e-3 is Cui et al.'s setting for
    Qwen2.5-7B (verl's default is 2e-4). Bool mask, shape of the inputs."""
    cov = centred_covariance(advantages, logp).reshape(-1)
    chosen = torch.zeros(cov.shape, dtype=torch.bool, device=cov.device)
    if cov.numel():
        k = max(1, int(cov.numel() * ratio))
        chosen[torch.sort(cov, descending=True, stable=True).indices[:k]] = True
    return chosen.reshape(advantages.shape)


def mini_batch_selection(cfg: PolicyLossConfig, advantages: torch.Tensor, logp: torch.Tensor,
                         entropy: torch.Tensor, seed: int) -> torch.Tensor | None:
    """The per-token ``selection`` of the loss ``cfg.name`` over all tokens of one mini-batch, flat and in
    canonical order (the old policy's ``logp`` and ``entropy``, token-level ``advantages``), or None when the loss
    needs none. Fork Tokens: weights (N / K or 0); Clip-COV, KL-COV: 1.0 / 0.0. ``seed`` draws Clip-COV's tokens."""
    if cfg.name == "fork_tokens":
        return fork_token_weights(entropy, cfg.fork_top_ratio)
    if cfg.name == "clip_cov":
        generator = torch.Generator().manual_seed(int(seed))
        return clip_cov_selection(advantages, logp, cfg.clip_cov_ratio, cfg.clip_cov_lb, cfg.clip_cov_ub,
                                  generator).double()
    if cfg.name == "kl_cov":
        return kl_cov_selection(advantages, logp, cfg.kl_cov_ratio).double()
    return None


def _need(value: torch.Tensor | None, what: str, name: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"policy loss {name!r} needs the per-token {what}")
    return value


# ----------------------------------------------------------------------------------------------- the policy losses
@register_policy_loss("entropy_loss")
def entropy_loss(logp, old_logp, advantages, mask, cfg: PolicyLossConfig, *, global_denominator=None, seq_ids=None,
                 entropy=None, selection=None) -> PolicyLossOutput:
    """Entropy Loss: PPO clip - c * agg(H), c = ``entropy_loss_coef`` (0.001, verl's former default
    ``actor.entropy_coeff``, the entropy-bonus baseline of Cui et al. 2025; the DynaMO paper gives no value).

    ``entropy`` carries its exact gradient (the trainer's token statistics differentiate H w.r.t. the logits:
    dH / dz_j = -pi_j (log pi_j + H) / T, parallel/token_stats.py), as verl's entropy term does.
    """
    entropy = _need(entropy, "entropy", "entropy_loss").to(logp.dtype)
    output = ppo_clip_loss(logp, old_logp, advantages, mask, cfg, global_denominator=global_denominator,
                           seq_ids=seq_ids)
    term = loss_agg(entropy, mask, cfg.loss_agg_mode, global_denominator, seq_ids)
    loss = output.loss - cfg.entropy_loss_coef * term
    metrics = {**output.metrics, "actor/entropy_bonus": term.detach()}
    return PolicyLossOutput(loss=loss, clipped_mask=output.clipped_mask, metrics=metrics)


@register_policy_loss("fork_tokens")
def fork_tokens_loss(logp, old_logp, advantages, mask, cfg: PolicyLossConfig, *, global_denominator=None,
                     seq_ids=None, entropy=None, selection=None) -> PolicyLossOutput:
    """Fork Tokens (Wang et al. 2025): PPO clip on the top ``fork_top_ratio`` = 20% highest-entropy tokens of the
    mini-batch only (their main setting), token-mean over those tokens. ``selection``: ``fork_token_weights`` (a
    weight w >= 0 scales a token's clipped loss exactly, also under the dual clip)."""
    weights = _need(selection, "selection", "fork_tokens").to(logp.dtype)
    advantages = to_token_shape(advantages, logp).detach().to(logp.dtype)
    output = ppo_clip_loss(logp, old_logp, advantages * weights, mask, cfg, global_denominator=global_denominator,
                           seq_ids=seq_ids)
    output.metrics["actor/fork_token_frac"] = masked_mean((weights > 0).to(logp.dtype), mask.bool())
    return output


@register_policy_loss("entropy_adv")
def entropy_adv_loss(logp, old_logp, advantages, mask, cfg: PolicyLossConfig, *, global_denominator=None,
                     seq_ids=None, entropy=None, selection=None) -> PolicyLossOutput:
    """Entropy Advantages (Cheng et al. 2025, "Reasoning with exploration: an entropy perspective", eq. of psi):
    A_t + min(alpha * H_t, |A_t| / kappa) with alpha = ``entropy_adv_alpha`` 0.4 and kappa = ``entropy_adv_kappa``
    2 (their settings), H_t the current policy's entropy, detached; then PPO clip."""
    entropy = _need(entropy, "entropy", "entropy_adv").detach().to(logp.dtype)
    advantages = to_token_shape(advantages, logp).detach().to(logp.dtype)
    bonus = torch.minimum(cfg.entropy_adv_alpha * entropy, advantages.abs() / cfg.entropy_adv_kappa)
    output = ppo_clip_loss(logp, old_logp, advantages + bonus, mask, cfg, global_denominator=global_denominator,
                           seq_ids=seq_ids)
    output.metrics["actor/entropy_adv_bonus"] = masked_mean(bonus, mask.bool())
    return output


@register_policy_loss("clip_cov")
def clip_cov_loss(logp, old_logp, advantages, mask, cfg: PolicyLossConfig, *, global_denominator=None,
                  seq_ids=None, entropy=None, selection=None) -> PolicyLossOutput:
    """Clip-COV (Cui et al. 2025; verl ``compute_policy_loss_clip_cov``): per token
    max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (no dual clip), times 0 on the ``selection`` tokens
    (``clip_cov_selection``), so they contribute no gradient; aggregated like every loss here. The PPO clip is the
    run's (``dynamo.loss.clip_low`` / ``clip_high``, 0.2 / 0.2 by default); the authors' recipes (verl
    ``recipe/entropy``) set both to 1, i.e. the ratio bounded to [0, 2]: ``dynamo.loss.clip_low=1
    dynamo.loss.clip_high=1`` (``dynamo ablate``'s variant ``clip_cov_authors``)."""
    chosen = _need(selection, "selection", "clip_cov").to(logp.dtype)
    advantages = to_token_shape(advantages, logp).detach().to(logp.dtype)
    ratio = policy_ratio(logp, old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = torch.maximum(unclipped, clipped) * (1.0 - chosen)
    loss = loss_agg(per_token, mask, cfg.loss_agg_mode, global_denominator, seq_ids)
    valid = mask.bool()
    with torch.no_grad():
        by_clip = (clipped > unclipped) & valid
        upper, lower = by_clip & (advantages > 0), by_clip & (advantages < 0)
        metrics = update_metrics(loss, logp, old_logp, ratio, valid, upper, lower, torch.zeros_like(valid))
        metrics["actor/cov_selected_frac"] = masked_mean(chosen, valid)
    return PolicyLossOutput(loss=loss, clipped_mask=(by_clip | (chosen > 0)) & valid, metrics=metrics)


@register_policy_loss("kl_cov")
def kl_cov_loss(logp, old_logp, advantages, mask, cfg: PolicyLossConfig, *, global_denominator=None,
                seq_ids=None, entropy=None, selection=None) -> PolicyLossOutput:
    """KL-COV (Cui et al. 2025; verl ``compute_policy_loss_kl_cov``): per token -A r (no ratio clip), plus
    ``kl_cov_coef`` (1, verl's ``ppo_kl_coef``) * |log pi - log pi_old| on the ``selection`` tokens
    (``kl_cov_selection``)."""
    chosen = _need(selection, "selection", "kl_cov").to(logp.dtype)
    advantages = to_token_shape(advantages, logp).detach().to(logp.dtype)
    ratio = policy_ratio(logp, old_logp)
    per_token = -advantages * ratio + chosen * cfg.kl_cov_coef * (logp - old_logp).abs()
    loss = loss_agg(per_token, mask, cfg.loss_agg_mode, global_denominator, seq_ids)
    valid = mask.bool()
    with torch.no_grad():
        none = torch.zeros_like(valid)  # no ratio clip
        metrics = update_metrics(loss, logp, old_logp, ratio, valid, none, none, none)
        metrics["actor/cov_selected_frac"] = masked_mean(chosen, valid)
    return PolicyLossOutput(loss=loss, clipped_mask=torch.zeros_like(valid), metrics=metrics)


@register_policy_loss("w_reinforce")
def w_reinforce_loss(logp, old_logp, advantages, mask, cfg: PolicyLossConfig, *, global_denominator=None,
                     seq_ids=None, entropy=None, selection=None) -> PolicyLossOutput:
    """W-REINFORCE (Zhu et al. 2025, "The surprising effectiveness of negative reinforcement"): lambda * L_PSR +
    L_NSR, i.e. positive advantages scaled by lambda = ``w_reinforce_lambda`` 0.1 (their setting), negative ones
    kept, with the ``reinforce_pm1`` advantages (+1 / -1); through the PPO clip of their verl setup, without the
    dual clip (``BASELINES`` sets clip_ratio_c to None; with it, A = -1 tokens at r > c lost their gradient)."""
    advantages = to_token_shape(advantages, logp).detach().to(logp.dtype)
    weighted = torch.where(advantages > 0, cfg.w_reinforce_lambda * advantages, advantages)
    return ppo_clip_loss(logp, old_logp, weighted, mask, cfg, global_denominator=global_denominator, seq_ids=seq_ids)


@register_advantage_estimator("reinforce_pm1")
def reinforce_pm1_advantages(rewards: Any, prompt_ids: Any, normalize_std: bool = True, **_: Any) -> torch.Tensor:
    """REINFORCE without baseline on +1 / -1 rewards (Zhu et al. 2025): A = +1 for a correct response (reward >
    0.5), -1 otherwise; no group mean, no std (``normalize_std`` is ignored). float32 (the rewards' float dtype)."""
    rewards_t = torch.as_tensor(rewards)
    dtype = rewards_t.dtype if rewards_t.is_floating_point() else torch.float32
    return torch.where(rewards_t > 0.5, 1.0, -1.0).to(dtype)


__all__ = ["ALGO_HELP", "BASELINES", "GRPO_KEYS", "Baseline", "algorithm_keys", "algorithm_note", "check_algorithm_overrides", "SELECTION_LOSSES", "centred_covariance", "clip_cov_selection", "fork_token_weights",
           "kl_cov_selection", "mini_batch_selection", "reinforce_pm1_advantages"]
