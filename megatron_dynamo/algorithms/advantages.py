"""Group-normalised advantages (GRPO), keyed by prompt id, for groups of different sizes.

With dynamic rollout allocation prompt i has n_i responses, so groups differ in size and responses of one prompt
need not be adjacent: every response carries its prompt id and groups are formed by id, never by position.

Estimators are registered by name (``register_advantage_estimator`` / ``get_advantage_estimator``) so that variants
can be added without touching the trainer; "grpo" is registered here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .allocation import factorize_prompt_ids

AdvantageEstimator = Callable[..., torch.Tensor]
_ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering ``fn(rewards, prompt_ids, **options) -> advantages`` under ``name``.

    Registering a different function under a taken name raises ValueError (re-registering the same one is fine).
    """

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        existing = _ADVANTAGE_ESTIMATORS.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered ({existing.__qualname__})")
        _ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; ValueError listing the registered names otherwise."""
    try:
        return _ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered: {sorted(_ADVANTAGE_ESTIMATORS)}") from None


def registered_advantage_estimators() -> tuple[str, ...]:
    """Names of all registered advantage estimators."""
    return tuple(sorted(_ADVANTAGE_ESTIMATORS))


def group_advantages(rewards: Any, prompt_ids: Any, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages per response (docs/algorithm.md, step 6): A_j = (r_j - mean_g) / (std_g + eps), g = prompt of j.

    Groups are the responses sharing a prompt id (int or str, any order, any group sizes). ``std_g`` is the
    *sample* standard deviation (Bessel-corrected, like ``torch.std`` and verl's GRPO estimator); with
    ``normalize_std=False`` the advantage is only centred (A = r - mean, "Dr. GRPO" style). A group whose rewards
    are all equal, singletons included, gets exactly 0. Computed in float64; returned in the rewards' floating
    dtype (float32 for integer/bool rewards), on the rewards' device, shape ``[num_responses]``.
    """
    rewards_t = torch.as_tensor(rewards)
    if rewards_t.dim() != 1:
        raise ValueError(f"rewards must be one-dimensional (one per response), got shape {tuple(rewards_t.shape)}")
    out_dtype = rewards_t.dtype if rewards_t.is_floating_point() else torch.float32
    codes_np, uniques = factorize_prompt_ids(prompt_ids)
    if codes_np.size != rewards_t.shape[0]:
        raise ValueError(f"{rewards_t.shape[0]} rewards but {codes_np.size} prompt ids")
    if rewards_t.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards_t.device)
    reward = rewards_t.detach().to(torch.float64)
    if not torch.isfinite(reward).all():
        raise ValueError("rewards must be finite")
    codes = torch.from_numpy(codes_np).to(reward.device)
    num_groups = len(uniques)

    size = torch.bincount(codes, minlength=num_groups).to(torch.float64)
    mean = torch.zeros(num_groups, dtype=torch.float64, device=reward.device).index_add_(0, codes, reward) / size
    centred = reward - mean[codes]
    if normalize_std:
        squares = torch.zeros_like(mean).index_add_(0, codes, centred * centred)
        std = torch.sqrt(squares / (size - 1).clamp_min(1.0))  # Bessel's correction; singletons: 0 / 1
        advantage = centred / (std[codes] + eps)
    else:
        advantage = centred
    # Exactly zero for constant groups: the float mean of equal values need not equal them bit for bit.
    group_max = torch.full_like(mean, -torch.inf).scatter_reduce_(0, codes, reward, reduce="amax")
    group_min = torch.full_like(mean, torch.inf).scatter_reduce_(0, codes, reward, reduce="amin")
    constant = (group_max == group_min)[codes]
    advantage = torch.where(constant, torch.zeros_like(advantage), advantage)
    return advantage.to(out_dtype)


@register_advantage_estimator("grpo")
def grpo_advantages(rewards: Any, prompt_ids: Any, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Registered "grpo" estimator: ``group_advantages`` (group mean baseline, optional sample-std scaling)."""
    return group_advantages(rewards, prompt_ids, normalize_std=normalize_std, eps=eps)


__all__ = [
    "AdvantageEstimator",
    "get_advantage_estimator",
    "group_advantages",
    "grpo_advantages",
    "register_advantage_estimator",
    "registered_advantage_estimators",
]
