"""The DynaMO algorithm as plain torch/numpy functions. Nothing here imports Megatron or vLLM.

- allocation: per-prompt history, Bernoulli variance (eq. 2), water-level rollout allocation (appendix D),
  predicted variance ratio (eq. 23).
- advantages: group-normalised GRPO advantages keyed by prompt id (registry of estimators).
- modulation: beta_comp (eq. 3), beta_stab (eq. 4), Delta H (Theorem 1), mini-batch/DP normalisation scope.
- losses: PPO clip (separate bounds, dual clip), aggregation modes, KL (k3) and entropy terms (registry).
- config: AllocationConfig, ModulationConfig, PolicyLossConfig with the paper's defaults.
- baselines: the seven baselines of the paper's Table 1 (policy losses, an advantage estimator, mini-batch-wide
  token selections), registered on import.
"""

from .advantages import (
    get_advantage_estimator,
    group_advantages,
    register_advantage_estimator,
    registered_advantage_estimators,
)
from .allocation import (
    PromptHistory,
    allocate_rollouts,
    bernoulli_variance,
    factorize_prompt_ids,
    plan_rollouts,
    predicted_variance_ratio,
    prompt_variances,
    water_level,
)
from .config import AllocationConfig, ModulationConfig, PolicyLossConfig
from .baselines import BASELINES, SELECTION_LOSSES, mini_batch_selection
from .losses import (
    PolicyLossOutput,
    compute_actor_loss,
    get_policy_loss,
    k3_kl,
    loss_agg,
    policy_ratio,
    ppo_clip_loss,
    ppo_clip_mask,
    register_policy_loss,
    registered_policy_losses,
)
from .modulation import (
    ModulationInputs,
    ModulationScope,
    beta_comp,
    beta_stab,
    delta_h_exact,
    delta_h_sequence_mean,
    entropy_change,
    modulate_advantages,
    modulation_scope,
)

__all__ = [
    "AllocationConfig",
    "BASELINES",
    "SELECTION_LOSSES",
    "ModulationConfig",
    "ModulationInputs",
    "ModulationScope",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "PromptHistory",
    "allocate_rollouts",
    "bernoulli_variance",
    "beta_comp",
    "beta_stab",
    "compute_actor_loss",
    "delta_h_exact",
    "delta_h_sequence_mean",
    "entropy_change",
    "factorize_prompt_ids",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_advantages",
    "k3_kl",
    "loss_agg",
    "mini_batch_selection",
    "modulate_advantages",
    "modulation_scope",
    "plan_rollouts",
    "policy_ratio",
    "ppo_clip_loss",
    "ppo_clip_mask",
    "predicted_variance_ratio",
    "prompt_variances",
    "register_advantage_estimator",
    "register_policy_loss",
    "registered_advantage_estimators",
    "registered_policy_losses",
    "water_level",
]
