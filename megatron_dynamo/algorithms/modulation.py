"""Token level of DynaMO: gradient-aware advantage modulation (paper section 2.2, eqs. 3-4, Theorem 1 / eq. 14).

    A_final = A * beta_comp * beta_stab          (both factors detached: weights, not gradients)

- ``beta_comp`` (eq. 3) raises the advantage of confident (low-entropy) tokens with A > 0.
- ``beta_stab`` (eq. 4) damps tokens whose update would change the entropy most, Xi_t = |Delta H_t|.
- ``delta_h_exact`` / ``delta_h_sequence_mean`` give Delta H_t (per unit learning rate, first order).

Normalisation scope (docs/algorithm.md): H_min, H_max and max Xi are taken over all valid tokens of the whole mini-batch
(one optimizer step) and reduced over the data-parallel group, so the result does not depend on micro-batch size,
dynamic batching or DP size. Hence two phases:

1. ``modulation_scope(batches, cfg, group)``: (h_min, h_max, xi_max) over a list of micro-batches, then one MAX
   all-reduce of (-h_min, h_max, xi_max) over ``group`` (a plain torch.distributed group).
2. ``modulate_advantages(..., scope=scope)`` per micro-batch.

The per-token inputs of phase 2 (entropy, log pi_a, the vocabulary sum, the ratio) are those of the current
parameters, from the forward that computes the token's loss (as in the paper). Where the scope of phase 1 comes
from is the trainer's choice (``ModulationConfig.scope``): "current_policy" takes it from a no-grad forward over
the mini-batch under the current parameters (exact: the same values the gradient pass sees; for the first
mini-batch of an on-policy step the old-log-prob pass is that forward, since pi = pi_old there); "old_policy"
takes every mini-batch's scope from the old-log-prob pass (no extra forward; exact for the first mini-batch, an
approximation after the first update). So a token's H_t or Xi_t may fall outside its scope in "old_policy" mode:
the normalised positions (H_max - H_t) / (H_max - H_min) and Xi_t / max Xi are clamped to [0, 1], which keeps
beta_comp in [1, 1 + alpha] and beta_stab in [f(1), f(0)], the ranges of the paper's formulas, and changes
nothing when the scope is exact. Min and max are exact in floating point, so the scope, and therefore A_final,
are bit-identical for any micro-batch split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import ModulationConfig
from .losses import masked_mean, segment_sum, sequence_index, to_token_shape


@dataclass(frozen=True)
class ModulationInputs:
    """Per-token quantities of one micro-batch (all tensors of the token shape, [B, T] or packed [1, T]/[T]).

    advantages: A_t, token level or one per sequence ([B]). entropy: H_t of pi (after temperature).
    mask: valid response tokens. logp: log pi(a_t) of the sampled token. sum_pi2_lambda: sum_j pi_j^2 Lambda_j with
    Lambda_j = log pi_j + H (vocabulary sum, "exact" mode only). ratio: r_t = pi(a_t)/pi_old(a_t).
    clipped_mask: tokens where PPO clipping zeroes the gradient (``losses.ppo_clip_mask``). seq_ids: sequence id
    per token for packed layouts ("sequence_mean" mode; rows are sequences otherwise).
    Only ``advantages``, ``entropy`` and ``mask`` are needed when UMS is off.
    """

    advantages: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    logp: torch.Tensor | None = None
    sum_pi2_lambda: torch.Tensor | None = None
    ratio: torch.Tensor | None = None
    clipped_mask: torch.Tensor | None = None
    seq_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class ModulationScope:
    """Mini-batch-wide normalisers of eqs. 3-4 (0-d float64 tensors): min/max entropy and max Xi over all valid
    tokens. With no valid token: h_min = +inf, h_max = -inf, xi_max = 0 (then both factors are neutral)."""

    h_min: torch.Tensor
    h_max: torch.Tensor
    xi_max: torch.Tensor


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        if tensor is not None and tensor.is_floating_point():
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def beta_comp(entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None = None,
              alpha: float = 0.3, h_min: Any = None, h_max: Any = None) -> torch.Tensor:
    """Gradient compensation, eq. 3:

        beta_comp = 1 + alpha (H_max - H_t) / (H_max - H_min)   where A_t > 0,      1 where A_t <= 0.

    ``h_min``/``h_max`` default to the range of ``entropy`` over ``mask`` (pass the mini-batch scope instead).
    H_max == H_min (or an empty scope) gives 1 everywhere; tokens outside ``mask`` get 1. An H_t outside the given
    scope is clamped to it (module docstring). Detached.
    """
    with torch.no_grad():
        dtype = _compute_dtype(entropy)
        entropy = entropy.detach().to(dtype)
        advantages = to_token_shape(advantages, entropy).detach()
        valid = torch.ones_like(entropy, dtype=torch.bool) if mask is None else mask.bool()
        if h_min is None or h_max is None:
            scope_min, scope_max = _entropy_range(entropy, valid)
            h_min = scope_min if h_min is None else h_min
            h_max = scope_max if h_max is None else h_max
        h_min = torch.as_tensor(h_min, dtype=torch.float64, device=entropy.device)
        h_max = torch.as_tensor(h_max, dtype=torch.float64, device=entropy.device)
        spread = h_max - h_min
        has_spread = spread > 0  # also False for the empty scope (-inf - inf)
        safe_spread = torch.where(has_spread, spread, torch.ones_like(spread)).to(dtype)
        compensated = 1.0 + alpha * ((h_max.to(dtype) - entropy) / safe_spread).clamp(0.0, 1.0)
        apply = (advantages > 0) & valid & has_spread
        return torch.where(apply, compensated, torch.ones_like(entropy))


def beta_stab(xi: torch.Tensor, xi_max: Any = None, gamma: float = 5.0, tau: float = 0.5,
              lambda_min: float = 0.6) -> torch.Tensor:
    """Update-magnitude stabilisation, eq. 4:

        beta_stab = f(Xi_t / max_j Xi_j),   f(x) = lambda_min + (1 - lambda_min) * sigmoid(-gamma (x - tau)).

    ``xi_max`` defaults to ``xi.max()`` (pass the mini-batch scope instead); xi_max == 0 gives x = 0; x is clamped
    to [0, 1] (a Xi above the scope's max, module docstring). Detached.
    """
    with torch.no_grad():
        dtype = _compute_dtype(xi)
        xi = xi.detach().to(dtype)
        if xi_max is None:
            xi_max = xi.max() if xi.numel() else xi.new_zeros(())
        xi_max = torch.as_tensor(xi_max, device=xi.device).to(dtype)
        positive = xi_max > 0
        x = torch.where(positive, xi / torch.where(positive, xi_max, torch.ones_like(xi_max)), torch.zeros_like(xi))
        x = x.clamp(0.0, 1.0)
        return lambda_min + (1.0 - lambda_min) * torch.sigmoid(-gamma * (x - tau))


def _update_coefficient(ratio: torch.Tensor, advantages: torch.Tensor, clipped_mask: torch.Tensor | None,
                        dtype: torch.dtype) -> torch.Tensor:
    # xi_t = 1[not clipped] r_t A_t (eq. 12): the coefficient of the token's logit update (Lemma 1, eq. 13).
    coefficient = ratio.detach().to(dtype) * to_token_shape(advantages, ratio).detach().to(dtype)
    if clipped_mask is not None:
        coefficient = torch.where(clipped_mask.bool(), torch.zeros_like(coefficient), coefficient)
    return coefficient


def delta_h_exact(logp: torch.Tensor, entropy: torch.Tensor, sum_pi2_lambda: torch.Tensor, ratio: torch.Tensor,
                  advantages: torch.Tensor, clipped_mask: torch.Tensor | None = None) -> torch.Tensor:
    """First-order entropy change per unit learning rate caused by token t's update (Theorem 1, eqs. 12-15):

        Delta H_t / eta = -xi_t (pi_a Lambda_a - sum_j pi_j^2 Lambda_j),   Lambda_j = log pi_j + H_t,
        xi_t = 1[not clipped] r_t A_t.

    The update moves the logits by eta xi_t (e_a - pi) (eq. 13) and dH/dz_j = -pi_j Lambda_j. Inputs per token:
    log pi_a, H, the vocabulary sum ``sum_pi2_lambda`` (computed over the TP-sharded logits elsewhere), r, A,
    clipped mask. Returns the signed value; Xi_t = |Delta H_t| (eta cancels in Xi / max Xi). Detached.
    """
    with torch.no_grad():
        dtype = _compute_dtype(logp, entropy, sum_pi2_lambda)
        logp = logp.detach().to(dtype)
        own_term = torch.exp(logp) * (logp + entropy.detach().to(dtype))  # pi_a Lambda_a
        coefficient = _update_coefficient(ratio, advantages, clipped_mask, dtype)
        return -coefficient * (own_term - sum_pi2_lambda.detach().to(dtype))


def delta_h_sequence_mean(logp: torch.Tensor, entropy: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                          clipped_mask: torch.Tensor | None, mask: torch.Tensor,
                          seq_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The public reference code's approximation of ``delta_h_exact`` (it cannot see the whole vocabulary):

        Delta H_t / eta ~= -xi_t (pi_a Lambda_a - mean_{s in seq(t), valid} pi_{a_s} Lambda_{a_s}),

    i.e. the vocabulary sum sum_j pi_j^2 Lambda_j is replaced by the mean over the sequence's valid tokens of the
    sampled tokens' pi_a Lambda_a. Sequences: rows of [B, T], or ``seq_ids`` groups. Kept for comparison
    (``delta_h: sequence_mean``); the exact form is the default. Detached.
    """
    with torch.no_grad():
        dtype = _compute_dtype(logp, entropy)
        logp = logp.detach().to(dtype)
        own_term = torch.exp(logp) * (logp + entropy.detach().to(dtype))
        weight = mask.to(dtype)
        index, num_seqs = sequence_index(own_term, seq_ids)
        seq_mean = segment_sum(own_term * weight, index, num_seqs) / segment_sum(weight, index, num_seqs).clamp_min(1)
        coefficient = _update_coefficient(ratio, advantages, clipped_mask, dtype)
        return -coefficient * (own_term - seq_mean[index])


def entropy_change(inputs: ModulationInputs, cfg: ModulationConfig) -> torch.Tensor:
    """Delta H_t / eta of a micro-batch by the configured method (``cfg.delta_h``)."""
    missing = [name for name in ("logp", "ratio") if getattr(inputs, name) is None]
    if cfg.delta_h == "exact" and inputs.sum_pi2_lambda is None:
        missing.append("sum_pi2_lambda")
    if missing:
        raise ValueError(f"update-magnitude stabilisation (delta_h={cfg.delta_h!r}) needs {', '.join(missing)}")
    if cfg.delta_h == "exact":
        return delta_h_exact(inputs.logp, inputs.entropy, inputs.sum_pi2_lambda, inputs.ratio, inputs.advantages,
                             inputs.clipped_mask)
    return delta_h_sequence_mean(inputs.logp, inputs.entropy, inputs.ratio, inputs.advantages, inputs.clipped_mask,
                                 inputs.mask, inputs.seq_ids)


def _entropy_range(entropy: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = entropy.detach().to(torch.float64)
    if values.numel() == 0:
        return values.new_full((), torch.inf), values.new_full((), -torch.inf)
    low = torch.where(valid, values, torch.full_like(values, torch.inf)).min()
    high = torch.where(valid, values, torch.full_like(values, -torch.inf)).max()
    return low, high


def _quantiles(values: torch.Tensor, qs: Sequence[float]) -> list[torch.Tensor]:
    """Quantiles of a 1-d tensor with linear interpolation (torch.quantile's default, without its input-size
    limit); 1.0 each for an empty tensor (the neutral factor, as ``beta_stab_min``)."""
    if values.numel() == 0:
        return [torch.ones((), dtype=torch.float64, device=values.device) for _ in qs]
    ordered = values.detach().to(torch.float64).flatten().sort().values
    out = []
    for q in qs:
        position = q * (ordered.numel() - 1)
        low = int(position)
        high = min(low + 1, ordered.numel() - 1)
        out.append(ordered[low] + (position - low) * (ordered[high] - ordered[low]))
    return out


def _reduce_scope(packed: torch.Tensor, group: Any) -> torch.Tensor:
    """MAX all-reduce over ``group``, on the entropies' device: the group's (NCCL: the GPU, gloo: the CPU)."""
    import torch.distributed as dist  # only when a group is given

    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return packed


def modulation_scope(batches: ModulationInputs | Sequence[ModulationInputs], cfg: ModulationConfig | None = None,
                     group: Any = None) -> ModulationScope:
    """Phase 1: H_min, H_max (eq. 3) and max_j Xi_j (eq. 4) over all valid tokens of a mini-batch.

    ``batches`` is one ``ModulationInputs`` (a flat batch) or the list of a mini-batch's micro-batches (this
    rank's share). With ``group`` (a torch.distributed process group, e.g. the data-parallel group) the three
    values are reduced over its ranks by a single MAX all-reduce of (-H_min, H_max, max Xi). Xi is computed only
    when UMS is on (xi_max = 0 otherwise).
    """
    cfg = ModulationConfig() if cfg is None else cfg
    batch_list = [batches] if isinstance(batches, ModulationInputs) else list(batches)
    if not batch_list:
        raise ValueError("modulation_scope needs at least one micro-batch (it may have no valid tokens)")
    device = batch_list[0].entropy.device
    neg_h_min = torch.full((), -torch.inf, dtype=torch.float64, device=device)
    h_max = torch.full((), -torch.inf, dtype=torch.float64, device=device)
    xi_max = torch.zeros((), dtype=torch.float64, device=device)
    for batch in batch_list:  # loop over micro-batches; everything inside is vectorised
        valid = batch.mask.bool()
        low, high = _entropy_range(batch.entropy, valid)
        neg_h_min = torch.maximum(neg_h_min, -low)
        h_max = torch.maximum(h_max, high)
        if cfg.ums and valid.numel():
            xi = entropy_change(batch, cfg).abs().to(torch.float64)
            xi_max = torch.maximum(xi_max, torch.where(valid, xi, torch.zeros_like(xi)).max())
    packed = torch.stack([neg_h_min, h_max, xi_max])
    if group is not None:
        packed = _reduce_scope(packed, group)
    return ModulationScope(h_min=-packed[0], h_max=packed[1], xi_max=packed[2])


@dataclass(frozen=True)
class ModulationFactors:
    """The two per-token factors of one batch (token shape, detached; 1 where a factor is off or a token is not
    valid) and Delta H_t / eta (None when UMS is off)."""

    beta_comp: torch.Tensor
    beta_stab: torch.Tensor
    delta_h: torch.Tensor | None


def modulation_factors(inputs: ModulationInputs, cfg: ModulationConfig, scope: ModulationScope) -> ModulationFactors:
    """beta_comp (eq. 3, if ``cfg.gc``; 1 + alpha on every A > 0 token with ``cfg.pos_weight``) and beta_stab (eq. 4,
    if ``cfg.ums``) of every token of ``inputs`` under ``scope``. ``inputs.advantages`` must be token-shaped."""
    with torch.no_grad():
        valid = inputs.mask.bool()
        dtype = _compute_dtype(inputs.advantages, inputs.entropy, inputs.logp, inputs.sum_pi2_lambda)
        ones = torch.ones_like(inputs.entropy, dtype=dtype)
        compensation, stabilisation, delta_h = ones, ones, None
        if cfg.gc:
            compensation = beta_comp(inputs.entropy.to(dtype), inputs.advantages, valid, cfg.alpha, scope.h_min,
                                     scope.h_max)
        elif cfg.pos_weight:  # the control for GC: its cap on every positive token, whatever the entropy
            positive = valid & (to_token_shape(inputs.advantages, inputs.entropy) > 0)
            compensation = torch.where(positive, torch.full_like(ones, 1.0 + cfg.alpha), ones)
        if cfg.ums:
            delta_h = entropy_change(inputs, cfg).to(dtype)
            stabilisation = beta_stab(delta_h.abs(), scope.xi_max, cfg.gamma, cfg.tau, cfg.lambda_min)
            stabilisation = torch.where(valid, stabilisation, ones)
        return ModulationFactors(compensation, stabilisation, delta_h)


def modulate_advantages(advantages: torch.Tensor, entropy: torch.Tensor, logp: torch.Tensor | None,
                        sum_pi2_lambda: torch.Tensor | None, ratio: torch.Tensor | None,
                        clipped_mask: torch.Tensor | None, mask: torch.Tensor,
                        seq_ids: torch.Tensor | None = None, cfg: ModulationConfig | None = None,
                        group: Any = None, scope: ModulationScope | None = None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Phase 2: A_final = A * beta_comp (eq. 3, if ``cfg.gc``; the constant 1 + alpha on A > 0 with
    ``cfg.pos_weight``) * beta_stab (eq. 4, if ``cfg.ums``), per token.

    ``scope`` should come from ``modulation_scope`` over the whole mini-batch; without it the scope of this batch
    alone is used (reduced over ``group`` if given), which is right only when this batch is the whole mini-batch.
    Returns the detached token-level A_final (advantages' dtype, token shape) and detached stats local to this
    batch (means over its valid tokens, the minimum of beta_stab, the 10th/90th percentiles of the factor
    beta_comp * beta_stab) plus the global scope values. With GC and UMS off, A is returned
    unchanged (broadcast to tokens): plain GRPO.
    """
    cfg = ModulationConfig() if cfg is None else cfg
    cfg.validate()
    with torch.no_grad():
        token_advantages = to_token_shape(advantages, entropy).detach()
        out_dtype = token_advantages.dtype if token_advantages.is_floating_point() else torch.float32
        if not cfg.enabled:
            return token_advantages.to(out_dtype), {}
        inputs = ModulationInputs(advantages=token_advantages, entropy=entropy, mask=mask, logp=logp,
                                  sum_pi2_lambda=sum_pi2_lambda, ratio=ratio, clipped_mask=clipped_mask,
                                  seq_ids=seq_ids)
        if scope is None:
            scope = modulation_scope(inputs, cfg, group)
        valid = mask.bool()
        dtype = _compute_dtype(token_advantages, entropy, logp, sum_pi2_lambda)
        stats: dict[str, torch.Tensor] = {
            "modulation/h_min": scope.h_min, "modulation/h_max": scope.h_max, "modulation/xi_max": scope.xi_max,
            "modulation/num_tokens": valid.sum(),
        }
        factors = modulation_factors(inputs, cfg, scope)
        compensation, stabilisation = factors.beta_comp, factors.beta_stab
        if cfg.gc or cfg.pos_weight:
            positive = valid & (token_advantages > 0)
            stats["modulation/beta_comp_mean_pos"] = masked_mean(compensation, positive)
            # its weight when averaged over micro-batches: a micro-batch without positive tokens holds no mean
            stats["modulation/beta_comp_mean_pos/num_tokens"] = positive.sum()
        if cfg.ums:
            stats["modulation/beta_stab_mean"] = masked_mean(stabilisation, valid)
            stats["modulation/beta_stab_min"] = stabilisation.min() if stabilisation.numel() \
                else torch.ones((), dtype=dtype, device=entropy.device)
            stats["modulation/delta_h_mean"] = masked_mean(factors.delta_h, valid)
        scale = compensation * stabilisation
        stats["modulation/scale_mean"] = masked_mean(scale, valid)
        # The spread of the per-token factor beta_comp * beta_stab over this batch's valid tokens.
        stats["modulation/scale_p10"], stats["modulation/scale_p90"] = _quantiles(scale[valid], (0.1, 0.9))
        final = (token_advantages.to(dtype) * scale).to(out_dtype)
    return final, stats


__all__ = [
    "ModulationFactors",
    "ModulationInputs",
    "ModulationScope",
    "beta_comp",
    "beta_stab",
    "delta_h_exact",
    "delta_h_sequence_mean",
    "entropy_change",
    "modulate_advantages",
    "modulation_factors",
    "modulation_scope",
]
