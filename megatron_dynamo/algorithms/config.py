"""Configuration of the DynaMO algorithm core, with the paper's values as defaults.

The small frozen dataclasses that the trainer's config system embeds. Each has ``validate()``, which raises a
``ValueError`` naming the offending field, so a bad configuration is reported before any work starts.
Defaults: paper section 2 / appendix I (table 3), and ``docs/algorithm.md`` where the paper gives no value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DELTA_H_MODES = ("exact", "sequence_mean")
# Where H_min, H_max and max Xi of a mini-batch come from: "old_policy", the old-log-prob pass (no extra forward;
# exact for the first mini-batch, where pi = pi_old), or "current_policy", a no-grad forward under the current
# weights before each later mini-batch (exact for every mini-batch, one more forward over it).
SCOPE_SOURCES = ("old_policy", "current_policy")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
#: dynamo.loss.prompt_weight: how much a prompt's responses weigh in the loss (algorithms/prompt_weights.py).
PROMPT_WEIGHTS = ("rollouts", "equal")
#: dynamo.loss.engine_is: how the trainer corrects for the engine/trainer log-prob gap (losses.engine_importance_weights).
ENGINE_IS_MODES = ("off", "truncate", "mask")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class AllocationConfig:
    """Dynamic rollout allocation (DRA, section 2.1, eqs. 1-2, appendix D; ``docs/algorithm.md``).

    Keys:
        enabled: false: every prompt gets ``n_avg`` responses (the "w/o DRA" ablation).
        n_avg {>= 1}: responses a prompt on average: a step with N prompts has a budget of N * n_avg.
        n_min {>= 1}: the fewest responses a prompt gets (the paper's G_min); at most ``n_avg``.
        n_max {>= 1}: the most responses a prompt gets (the paper's G_max); at least ``n_avg``.
        power {> 0}: the exponent of the Bernoulli variance P: 1.0, the paper's rule (n ~ P); 0.5: n ~ sigma (eq. 1).
        unknown_variance {>= 0}: the P of a prompt without enough history when no prompt of the batch has any.
        history_decay {(0, 1]}: multiplies a prompt's past (k, G) each time it comes back; 1.0: off.
    """

    enabled: bool = True
    n_avg: int = 16
    n_min: int = 8
    n_max: int = 24
    power: float = 1.0
    unknown_variance: float = 0.25
    history_decay: float = 1.0

    def validate(self) -> "AllocationConfig":
        if not isinstance(self.enabled, bool):
            raise ValueError(f"AllocationConfig.enabled must be a bool, got {self.enabled!r}")
        for name in ("n_avg", "n_min", "n_max"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"AllocationConfig.{name} must be an integer >= 1, got {value!r}")
        if self.n_min > self.n_max:
            raise ValueError(f"AllocationConfig.n_min ({self.n_min}) must be <= n_max ({self.n_max})")
        if not self.n_min <= self.n_avg <= self.n_max:
            raise ValueError(
                f"AllocationConfig.n_avg ({self.n_avg}) must lie in [n_min, n_max] = [{self.n_min}, {self.n_max}]")
        if not _is_real(self.power) or self.power <= 0:
            raise ValueError(f"AllocationConfig.power must be a finite number > 0, got {self.power!r}")
        if not _is_real(self.unknown_variance) or self.unknown_variance < 0:
            raise ValueError(
                f"AllocationConfig.unknown_variance must be a finite number >= 0, got {self.unknown_variance!r}")
        if not _is_real(self.history_decay) or not 0 < self.history_decay <= 1:
            raise ValueError(f"AllocationConfig.history_decay must lie in (0, 1], got {self.history_decay!r}")
        return self

    def budget(self, num_prompts: int) -> int:
        """Total rollouts of a step with ``num_prompts`` prompts: B = N * n_avg (section 2.1)."""
        return int(num_prompts) * self.n_avg


@dataclass(frozen=True)
class ModulationConfig:
    """Token-level advantage modulation (section 2.2, eqs. 3-4; ``docs/algorithm.md``).

    Keys:
        gc: gradient compensation (beta_comp, eq. 3).
        ums: update-magnitude stabilisation (beta_stab, eq. 4).
        alpha {>= 0}: the strength of gradient compensation (paper: 0.3).
        gamma {> 0}: the steepness of the stabilisation's sigmoid (paper: 5; flat between 3 and 7).
        tau: the sigmoid's midpoint in Xi / max Xi (paper: 0.5; flat between 0.4 and 0.6).
        lambda_min {[0, 1]}: the smallest stabilisation factor (not in the paper: 0.6).
        delta_h: how Xi = abs(Delta H) is computed: ``exact`` (Theorem 1, the whole vocabulary) or ``sequence_mean``
            (the public reference code's approximation).
        scope: where a mini-batch's H_min, H_max and max Xi come from: ``old_policy`` (the old-log-prob pass, no
            extra forward) or ``current_policy`` (one no-grad forward before each later mini-batch; exact).
        pos_weight: a control for GC, not part of DynaMO: every token with A > 0 gets GC's cap 1 + ``alpha`` as its
            factor whatever its entropy (a constant positive:negative reweighting; GC's beta_comp lies in
            [1, 1 + alpha] and sits at the cap where H_t is near the mini-batch's H_min); needs ``gc`` false.
    """

    gc: bool = True
    ums: bool = True
    alpha: float = 0.3
    gamma: float = 5.0
    tau: float = 0.5
    lambda_min: float = 0.6
    delta_h: str = "exact"
    scope: str = "old_policy"
    pos_weight: bool = False

    def validate(self) -> "ModulationConfig":
        for name in ("gc", "ums", "pos_weight"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModulationConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_real(self.alpha) or self.alpha < 0:
            raise ValueError(f"ModulationConfig.alpha must be a finite number >= 0, got {self.alpha!r}")
        if not _is_real(self.gamma) or self.gamma <= 0:
            raise ValueError(f"ModulationConfig.gamma must be a finite number > 0, got {self.gamma!r}")
        if not _is_real(self.tau):
            raise ValueError(f"ModulationConfig.tau must be a finite number, got {self.tau!r}")
        if not _is_real(self.lambda_min) or not 0 <= self.lambda_min <= 1:
            raise ValueError(f"ModulationConfig.lambda_min must lie in [0, 1], got {self.lambda_min!r}")
        if self.delta_h not in DELTA_H_MODES:
            raise ValueError(f"ModulationConfig.delta_h must be one of {DELTA_H_MODES}, got {self.delta_h!r}")
        if self.scope not in SCOPE_SOURCES:
            raise ValueError(f"ModulationConfig.scope must be one of {SCOPE_SOURCES}, got {self.scope!r}")
        if self.gc and self.pos_weight:
            raise ValueError("ModulationConfig.pos_weight must be false with gc true (pos_weight replaces GC's "
                             "beta_comp by its cap 1 + alpha: set gc false)")
        return self

    @property
    def enabled(self) -> bool:
        """True when at least one factor (beta_comp, beta_stab or the constant positive weight) is applied."""
        return self.gc or self.ums or self.pos_weight


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss (appendix I: PPO-clip, clip 0.2, KL 0, entropy 0) and the parameters of the baselines of the
    paper's Table 1, each read only by the loss of its name (``algorithms/baselines.py`` cites their sources).

    Keys:
        name: the registered policy loss; ``--algo`` sets it for the baselines.
        clip_low {[0, 1]}: the ratio's lower bound is 1 - clip_low (1: no lower clip; Clip-COV's authors run
            clip_low = clip_high = 1).
        clip_high {>= 0}: the ratio's upper bound is 1 + clip_high, exactly as given (the reference code used 0.28).
        clip_ratio_c {> 1}: the dual-clip constant for A < 0; null: no dual clip.
        kl_coef {0}: the weight of the k3 KL estimator against a reference policy (this trainer has none: 0).
        entropy_coef: the weight of an entropy bonus.
        loss_agg_mode: how token losses are averaged: over all tokens, or per sequence first.
        engine_is: correct each token for the gap between the engine's and the trainer's log-prob of the sampled
            token: ``off``; ``truncate`` (weight min(pi_old / pi_engine, cap)); ``mask`` (drop tokens whose ratio
            lies outside [1 / cap, cap]) (``docs/rollout.md``).
        engine_is_cap {> 1}: the cap of ``engine_is``; > 1.
        prompt_weight: how much a prompt's responses weigh in the loss: ``rollouts`` (each response counts once, so
            a prompt with n responses weighs n times one response, as in every GRPO trainer) or ``equal`` (a
            prompt's responses weighted by mean n / n_i, so every prompt weighs what it would under a uniform
            allocation whatever its n_i; ``algorithms/prompt_weights.py``); ``equal`` needs a loss homogeneous in
            the advantage (``ppo_clip``, ``w_reinforce`` or ``clip_cov``) and ``entropy_coef`` 0.
        entropy_loss_coef {>= 0}: ``entropy_loss``: the weight of the entropy term.
        fork_top_ratio {(0, 1]}: ``fork_tokens``: the share of highest-entropy tokens that get a gradient.
        entropy_adv_alpha {>= 0}: ``entropy_adv``: the entropy's weight in the advantage.
        entropy_adv_kappa {> 0}: ``entropy_adv``: the entropy term is at most abs(A) / kappa.
        clip_cov_ratio {(0, 1]}: ``clip_cov``: the share of tokens whose gradient is cut.
        clip_cov_lb: ``clip_cov``: the covariance window's lower bound; below ``clip_cov_ub``.
        clip_cov_ub: ``clip_cov``: the covariance window's upper bound.
        kl_cov_ratio {(0, 1]}: ``kl_cov``: the share of tokens that get the KL penalty.
        kl_cov_coef {>= 0}: ``kl_cov``: the penalty's weight.
        w_reinforce_lambda {>= 0}: ``w_reinforce``: the weight of positive samples.
    """

    name: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    engine_is: str = "off"
    engine_is_cap: float = 2.0
    prompt_weight: str = "rollouts"
    # The baselines of the paper's Table 1 (``algorithms/baselines.py``, sources and defaults cited there); each is
    # read only by the policy loss of its name.
    entropy_loss_coef: float = 0.001
    fork_top_ratio: float = 0.2
    entropy_adv_alpha: float = 0.4
    entropy_adv_kappa: float = 2.0
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    w_reinforce_lambda: float = 0.1

    def validate(self) -> "PolicyLossConfig":
        if not _is_real(self.clip_low) or not 0 <= self.clip_low <= 1:
            raise ValueError(f"PolicyLossConfig.clip_low must lie in [0, 1], got {self.clip_low!r}")
        if not _is_real(self.clip_high) or self.clip_high < 0:
            raise ValueError(f"PolicyLossConfig.clip_high must be a finite number >= 0, got {self.clip_high!r}")
        if self.clip_ratio_c is not None and (not _is_real(self.clip_ratio_c) or self.clip_ratio_c <= 1):
            raise ValueError(f"PolicyLossConfig.clip_ratio_c must be > 1 or None, got {self.clip_ratio_c!r}")
        if not _is_real(self.kl_coef) or self.kl_coef < 0:
            raise ValueError(f"PolicyLossConfig.kl_coef must be a finite number >= 0, got {self.kl_coef!r}")
        if not _is_real(self.entropy_coef):
            raise ValueError(f"PolicyLossConfig.entropy_coef must be a finite number, got {self.entropy_coef!r}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"PolicyLossConfig.loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.engine_is not in ENGINE_IS_MODES:
            raise ValueError(f"PolicyLossConfig.engine_is must be one of {ENGINE_IS_MODES}, got {self.engine_is!r}")
        if self.prompt_weight not in PROMPT_WEIGHTS:
            raise ValueError(f"PolicyLossConfig.prompt_weight must be one of {PROMPT_WEIGHTS}, "
                             f"got {self.prompt_weight!r}")
        if not _is_real(self.engine_is_cap) or self.engine_is_cap <= 1:
            raise ValueError(f"PolicyLossConfig.engine_is_cap must be a finite number > 1, got {self.engine_is_cap!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"PolicyLossConfig.name must be a non-empty string, got {self.name!r}")
        # Whether ``name`` is registered is checked where the registry is consulted (losses.get_policy_loss, and the
        # trainer's config validation), so that this module imports no implementation (issue 27).
        for field_name in ("entropy_loss_coef", "entropy_adv_alpha", "kl_cov_coef", "w_reinforce_lambda"):
            value = getattr(self, field_name)
            if not _is_real(value) or value < 0:
                raise ValueError(f"PolicyLossConfig.{field_name} must be a finite number >= 0, got {value!r}")
        for field_name in ("fork_top_ratio", "clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, field_name)
            if not _is_real(value) or not 0 < value <= 1:
                raise ValueError(f"PolicyLossConfig.{field_name} must lie in (0, 1], got {value!r}")
        if not _is_real(self.entropy_adv_kappa) or self.entropy_adv_kappa <= 0:
            raise ValueError(f"PolicyLossConfig.entropy_adv_kappa must be a finite number > 0, "
                             f"got {self.entropy_adv_kappa!r}")
        if not (_is_real(self.clip_cov_lb) and _is_real(self.clip_cov_ub)) or self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"PolicyLossConfig.clip_cov_lb ({self.clip_cov_lb!r}) must be a finite number below "
                             f"clip_cov_ub ({self.clip_cov_ub!r})")
        return self


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (Yu et al. 2025, section 3.2; verl ``recipe/dapo``: ``filter_groups``), the field's
    answer to groups whose rewards are all equal (zero advantage, no gradient): each step samples rounds of prompts
    (each round allocated as without it: uniform, or by DRA), keeps the groups whose rewards differ and refills
    until the step's ``data.prompts_per_step`` are full; the surplus is dropped (``algorithms/dynamic_sampling.py``).
    verl's ``max_num_gen_batches`` counts rounds (``max_refills + 1``) and stops the run when they run out; here the
    step trains on the groups it has (``sampling/prompts_short`` says how many were missing).

    Keys:
        dynamic: dynamic sampling on (off: one round of ``data.prompts_per_step`` prompts, every group trained).
        oversample {>= 1}: a round draws ceil(``data.prompts_per_step`` x oversample) prompts.
        max_refills {>= 0}: the most rounds after the first in one step.
    """

    dynamic: bool = False
    oversample: float = 1.0
    max_refills: int = 4

    def validate(self) -> "DynamicSamplingConfig":
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"DynamicSamplingConfig.dynamic must be a bool, got {self.dynamic!r}")
        if not _is_real(self.oversample) or self.oversample < 1:
            raise ValueError(f"DynamicSamplingConfig.oversample must be a number >= 1, got {self.oversample!r}")
        if not _is_int(self.max_refills) or self.max_refills < 0:
            raise ValueError(f"DynamicSamplingConfig.max_refills must be an integer >= 0, got {self.max_refills!r}")
        return self

    def round_prompts(self, prompts_per_step: int) -> int:
        """Prompts drawn per round: ceil(prompts_per_step x oversample) (prompts_per_step without ``dynamic``)."""
        return math.ceil(prompts_per_step * self.oversample) if self.dynamic else int(prompts_per_step)
