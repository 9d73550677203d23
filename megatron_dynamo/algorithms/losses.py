"""Policy loss: PPO clip with separate lower/upper clip and dual clip, loss aggregation, KL (k3) and entropy terms.

Registered by name (``register_policy_loss`` / ``get_policy_loss``) so that variants can be added without touching
the trainer; "ppo_clip" is registered here. ``compute_actor_loss`` adds the optional KL and entropy terms to the
registered policy loss named in the config.

Aggregation over micro-batches: the trainer splits a mini-batch (one optimizer step) into micro-batches and sums
their gradients. ``loss_agg`` therefore takes a ``global_denominator`` (valid tokens, or sequences, of the whole
mini-batch) so that the micro-batch losses add up to exactly the mini-batch loss, whatever the micro-batch layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import ENGINE_IS_MODES, LOSS_AGG_MODES, PolicyLossConfig

# exp() of a log-ratio beyond +-20 only produces inf/0; clamping there (as verl does) keeps the loss finite.
LOG_RATIO_LIMIT = 20.0


@dataclass
class PolicyLossOutput:
    """A policy loss result: the scalar ``loss`` (with gradient), the bool ``clipped_mask`` of tokens where the
    clipped objective has zero gradient (the 1[clip] of eq. 12), and detached ``metrics`` (local to the batch)."""

    loss: torch.Tensor
    clipped_mask: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


PolicyLossFn = Callable[..., PolicyLossOutput]
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering ``fn(logp, old_logp, advantages, mask, cfg, *, global_denominator, seq_ids, entropy,
    selection)`` returning a ``PolicyLossOutput`` under ``name``. ``entropy`` is the per-token entropy of the
    current policy (no gradient needed), ``selection`` the per-token values a mini-batch-wide selection made before
    the update (``baselines.mini_batch_selection``); a loss that does not use them ignores them. A different
    function under a taken name raises ValueError."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = _POLICY_LOSSES.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"policy loss {name!r} is already registered ({existing.__qualname__})")
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``; ValueError listing the registered names otherwise."""
    try:
        return _POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(_POLICY_LOSSES)}") from None


def registered_policy_losses() -> tuple[str, ...]:
    """Names of all registered policy losses."""
    return tuple(sorted(_POLICY_LOSSES))


def sequence_index(values: torch.Tensor, seq_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Per-element sequence index (0..S-1) and S: rows of a [B, T] tensor, or the groups of ``seq_ids`` (same
    shape as ``values``, any integer ids) for packed layouts such as Megatron's THD [1, total_tokens]."""
    if seq_ids is not None:
        seq = torch.as_tensor(seq_ids, device=values.device)
        if seq.shape != values.shape:
            raise ValueError(f"seq_ids shape {tuple(seq.shape)} differs from the tokens' {tuple(values.shape)}")
        uniques, index = torch.unique(seq, return_inverse=True)
        return index, int(uniques.numel())
    if values.dim() != 2:
        raise ValueError(f"without seq_ids, token tensors must be [batch, tokens]; got shape {tuple(values.shape)}")
    rows = torch.arange(values.shape[0], device=values.device).unsqueeze(-1).expand_as(values)
    return rows, int(values.shape[0])


def segment_sum(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sum of ``values`` per segment ``index`` (same shape, ids 0..num_segments-1) -> [num_segments]."""
    return torch.zeros(num_segments, dtype=values.dtype, device=values.device).index_add_(
        0, index.reshape(-1), values.reshape(-1))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (0 when the mask is empty)."""
    weight = mask.to(values.dtype)
    return (values * weight).sum() / weight.sum().clamp_min(1.0)


def loss_agg(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
             global_denominator: float | int | torch.Tensor | None = None,
             seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Aggregate per-token losses ``values`` over valid tokens ``mask`` into a scalar.

    - "token-mean": sum_t m_t l_t / D, with D the number of valid tokens of the whole mini-batch.
    - "seq-mean-token-mean": sum_s (sum_t m l / sum_t m) / D, with D the number of sequences of the mini-batch.
    - "seq-mean-token-sum": sum_s (sum_t m l) / D (D sequences as above).

    ``global_denominator`` is that D. Pass the mini-batch total so that micro-batch losses sum to the mini-batch
    loss (if the data-parallel gradient reduction averages over ranks, pass the global total divided by the DP
    size). Without it, D is local: valid tokens, or sequences with at least one valid token. Sequences are the rows
    of a [B, T] tensor or the groups of ``seq_ids``.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")
    if values.shape != mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} differs from mask shape {tuple(mask.shape)}")
    weight = mask.to(values.dtype)
    masked = values * weight
    if mode == "token-mean":
        total = masked.sum()
        local_count = weight.sum()
    else:
        index, num_seqs = sequence_index(values, seq_ids)
        seq_total = segment_sum(masked, index, num_seqs)
        seq_tokens = segment_sum(weight, index, num_seqs)
        if mode == "seq-mean-token-mean":
            seq_total = seq_total / seq_tokens.clamp_min(1.0)
        total = seq_total.sum()
        local_count = (seq_tokens > 0).sum().to(values.dtype)
    if global_denominator is None:
        denominator = local_count.clamp_min(1.0)
    else:
        if not isinstance(global_denominator, torch.Tensor) and not global_denominator > 0:
            raise ValueError(f"global_denominator must be > 0, got {global_denominator!r}")
        # A tensor is not checked here: that would synchronise with the GPU on every micro-batch.
        denominator = torch.as_tensor(global_denominator, dtype=values.dtype, device=values.device)
    return total / denominator


def policy_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """r_t = pi(a_t) / pi_old(a_t) = exp(log pi - log pi_old) (the ratio in eq. 12), log-ratio clamped to +-20."""
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def ppo_clip_mask(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                  clip_ratio_c: float | None = None) -> torch.Tensor:
    """Tokens where the (dual-)clipped PPO objective has zero gradient: the complement of 1[clip] in eq. 12.

    A > 0 and r > 1 + clip_high; A < 0 and r < 1 - clip_low; with dual clip, also A < 0 and r > clip_ratio_c.
    Depends only on r and the sign of A, so it is the same for the raw and the modulated advantages (the
    modulation factors are positive); the modulation computes xi_t with it before the loss is evaluated.
    """
    advantages = to_token_shape(advantages, ratio)
    clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
    if clip_ratio_c is not None:
        clipped = clipped | ((advantages < 0) & (ratio > clip_ratio_c))
    return clipped


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1 with d = log pi_ref - log pi (>= 0, unbiased
    under samples from pi). d is clamped to +-20 like the policy ratio."""
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_ratio) - log_ratio - 1.0


def engine_importance_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, mode: str,
                              cap: float) -> torch.Tensor:
    """Per-token weights correcting for the rollout engine sampling from a slightly different distribution than
    the trainer's old policy (bf16 vLLM kernels against Megatron): with rho = pi_old(a) / pi_engine(a) =
    exp(old_logp - engine_logp) (log-ratio clamped to +-20),

    - ``"off"``: 1;
    - ``"truncate"``: min(rho, cap) (truncated importance sampling: verl's token-level ``rollout_is`` truncate mode,
      docs/advance/rollout_is.md of volcengine/verl, cap 2.0 there; slime's ``compute_tis_weights``, exp(old -
      rollout) clamped to ``tis_clip``);
    - ``"mask"``: 1 where 1/cap <= rho <= cap, else 0 (the token is dropped from the loss; verl's mask mode, which
      also takes it out of the denominator: here the denominator stays the mini-batch's token count).

    The weight multiplies each token's policy loss; since it is >= 0 this equals multiplying the token's advantage
    (min(w x, w y) = w min(x, y), and the same for the dual clip's max). Constants: no gradient flows through them.
    """
    if mode not in ENGINE_IS_MODES:
        raise ValueError(f"engine importance weights: mode must be one of {ENGINE_IS_MODES}, got {mode!r}")
    if mode == "off":
        return torch.ones_like(old_logp)
    rho = torch.exp((old_logp - engine_logp).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if mode == "truncate":
        return rho.clamp(max=cap)
    return ((rho >= 1.0 / cap) & (rho <= cap)).to(old_logp.dtype)


def engine_gap_sums(old_logp: torch.Tensor, engine_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the engine's log-probs of the sampled tokens are from the trainer's old-policy ones, as sums over
    the given tokens (the caller reduces them over micro-batches and ranks): ``abs_sum`` and ``abs_max`` of
    |engine_logp - old_logp|, ``kl_k3_sum`` of the k3 estimator of KL(pi_engine || pi_old) (exp(d) - d - 1,
    d = old_logp - engine_logp: unbiased under the engine's samples), and ``num_tokens``. float64."""
    diff = (old_logp.double() - engine_logp.double())
    return {"abs_sum": diff.abs().sum(), "abs_max": diff.abs().max() if diff.numel() else diff.new_zeros(()),
            "kl_k3_sum": k3_kl(engine_logp.double(), old_logp.double()).sum(),
            "num_tokens": diff.new_tensor(float(diff.numel()))}


def to_token_shape(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages at token level: unchanged if already of the tokens' shape, expanded if one per sequence."""
    advantages = torch.as_tensor(advantages, device=like.device)
    if advantages.shape == like.shape:
        return advantages
    if advantages.dim() == like.dim() - 1 and advantages.shape == like.shape[:-1]:
        return advantages.unsqueeze(-1).expand_as(like)  # one advantage per sequence
    raise ValueError(f"advantages shape {tuple(advantages.shape)} matches neither the tokens {tuple(like.shape)} "
                     f"nor one value per sequence {tuple(like.shape[:-1])}")


def update_metrics(loss: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor, ratio: torch.Tensor,
                   valid: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor,
                   dual: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``actor/`` keys every policy loss reports (docs/metrics.md), detached, over the ``valid`` tokens:
    ``upper``/``lower``/``dual`` are the bool masks of the tokens each clip bound clipped."""
    ratio = ratio.detach()
    return {
        "actor/pg_loss": loss.detach(),
        "actor/pg_clipfrac": masked_mean((upper | lower).to(ratio.dtype), valid),
        "actor/pg_clipfrac_upper": masked_mean(upper.to(ratio.dtype), valid),
        "actor/pg_clipfrac_lower": masked_mean(lower.to(ratio.dtype), valid),
        "actor/pg_clipfrac_dual": masked_mean(dual.to(ratio.dtype), valid),
        "actor/ppo_kl": masked_mean((old_logp - logp).detach(), valid),
        "actor/ratio_mean": masked_mean(ratio, valid),
        "actor/ratio_max": torch.where(valid, ratio, torch.zeros_like(ratio)).max() if ratio.numel()
        else ratio.new_zeros(()),
        "actor/num_tokens": valid.sum(),
    }


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  cfg: PolicyLossConfig, *, global_denominator: float | torch.Tensor | None = None,
                  seq_ids: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
                  selection: torch.Tensor | None = None) -> PolicyLossOutput:
    """PPO clip (appendix I objective, GRPO form) with separate clip bounds and dual clip, per token t:

        l_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)
        for A_t < 0 with dual clip c:  l_t = min(l_t, -c A_t)   (bounds the loss of a negative token at r > c)

    aggregated by ``loss_agg`` with ``cfg.loss_agg_mode``. ``advantages`` (token level, or one per sequence) are
    treated as constants. Metrics (detached, over this batch's valid tokens): clip fractions, approx KL to the old
    policy (mean of log pi_old - log pi), ratio mean/max. ``entropy`` and ``selection`` are not used.
    """
    advantages = to_token_shape(advantages, logp).detach().to(logp.dtype)
    valid = mask.bool()
    ratio = policy_ratio(logp, old_logp)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    if cfg.clip_ratio_c is not None:
        surrogate = torch.where(advantages < 0, torch.maximum(surrogate, cfg.clip_ratio_c * advantages), surrogate)
    per_token_loss = -surrogate
    loss = loss_agg(per_token_loss, mask, cfg.loss_agg_mode, global_denominator, seq_ids)

    with torch.no_grad():
        ratio_d = ratio.detach()
        clipped = ppo_clip_mask(ratio_d, advantages, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)
        upper = (advantages > 0) & (ratio_d > 1.0 + cfg.clip_high)
        lower = (advantages < 0) & (ratio_d < 1.0 - cfg.clip_low)
        dual = ((advantages < 0) & (ratio_d > cfg.clip_ratio_c)) if cfg.clip_ratio_c is not None \
            else torch.zeros_like(valid)
        metrics = update_metrics(loss, logp, old_logp, ratio_d, valid, upper, lower, dual)
    return PolicyLossOutput(loss=loss, clipped_mask=clipped & valid, metrics=metrics)


def compute_actor_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                       cfg: PolicyLossConfig, *, ref_logp: torch.Tensor | None = None,
                       entropy: torch.Tensor | None = None,
                       global_denominator: float | torch.Tensor | None = None,
                       seq_ids: torch.Tensor | None = None,
                       selection: torch.Tensor | None = None) -> PolicyLossOutput:
    """Total actor loss: policy loss ``cfg.name`` + kl_coef * agg(k3 KL vs ``ref_logp``) - entropy_coef * agg(H).

    All terms use the same aggregation mode and ``global_denominator``. ``ref_logp`` is required when
    kl_coef > 0, ``entropy`` (with gradient) when entropy_coef != 0; when given they are also reported.
    ``entropy`` and ``selection`` are passed on to the policy loss (the baselines use them).
    """
    output = get_policy_loss(cfg.name)(logp, old_logp, advantages, mask, cfg,
                                       global_denominator=global_denominator, seq_ids=seq_ids, entropy=entropy,
                                       selection=selection)
    loss = output.loss
    metrics = dict(output.metrics)
    valid = mask.bool()
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("PolicyLossConfig.kl_coef > 0 needs ref_logp (reference policy log-probs)")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("PolicyLossConfig.entropy_coef != 0 needs the per-token entropy")
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * loss_agg(kl, mask, cfg.loss_agg_mode, global_denominator, seq_ids)
        metrics["actor/kl_k3"] = masked_mean(kl.detach(), valid)
    if entropy is not None:
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * loss_agg(entropy, mask, cfg.loss_agg_mode, global_denominator, seq_ids)
        metrics["actor/entropy"] = masked_mean(entropy.detach(), valid)
    metrics["actor/loss"] = loss.detach()
    return PolicyLossOutput(loss=loss, clipped_mask=output.clipped_mask, metrics=metrics)


__all__ = [
    "LOG_RATIO_LIMIT",
    "PolicyLossFn",
    "PolicyLossOutput",
    "ENGINE_IS_MODES",
    "compute_actor_loss",
    "engine_gap_sums",
    "engine_importance_weights",
    "get_policy_loss",
    "k3_kl",
    "loss_agg",
    "masked_mean",
    "policy_ratio",
    "ppo_clip_loss",
    "ppo_clip_mask",
    "register_policy_loss",
    "registered_policy_losses",
    "segment_sum",
    "sequence_index",
    "to_token_shape",
    "update_metrics",
]
