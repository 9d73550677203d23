"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO", section 3.2; verl ``recipe/dapo``, ``filter_groups``): keep only
the groups whose rewards differ, refill until the step's prompts are full (``dynamo.sampling``,
``config.DynamicSamplingConfig``).

A group whose rewards are all equal has advantage 0 for every response under GRPO: it adds tokens to the loss's
denominator and nothing to its gradient. DRA answers that by giving such prompts fewer rollouts; dynamic sampling by
generating more prompts and dropping them. :func:`fill_step` is the loop, with the generation behind a callback so
that it is the same for the trainer and the tests:

- round r draws ``round_prompts`` prompts and generates their groups (``run_round(r, round_prompts)``, which
  allocates the round's rollouts as the step would without dynamic sampling: uniform, or by DRA);
- its groups whose rewards differ are kept in the round's prompt order, until ``target`` are kept; the rest of the
  round's mixed groups is the surplus, dropped as DAPO drops it; a prompt already kept in this step is not kept
  again (the sampler may repeat a prompt across an epoch boundary, and the trainer groups responses by prompt id);
- rounds stop when ``target`` groups are kept or after ``max_refills`` refills (``1 + max_refills`` rounds), then
  the step trains on what it has (``short`` groups missing).

Every generated rollout counts in ``rollouts`` (the step's generation cost). Pure Python: nothing of Megatron or
vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence


def mixed_groups(prompt_ids: Sequence[Hashable], rewards: Sequence[float]) -> list[Hashable]:
    """The prompt ids, in order of first appearance, whose responses' rewards are not all equal."""
    if len(prompt_ids) != len(rewards):
        raise ValueError(f"{len(prompt_ids)} prompt ids but {len(rewards)} rewards")
    seen: dict[Hashable, set[float]] = {}
    for pid, reward in zip(prompt_ids, rewards):
        seen.setdefault(pid, set()).add(float(reward))
    return [pid for pid, values in seen.items() if len(values) > 1]


@dataclass(frozen=True)
class RoundOutcome:
    """One generation round: its prompts (in order), those whose rewards differ, and its rollouts."""

    prompt_ids: Sequence[Hashable]
    mixed: Sequence[Hashable]
    rollouts: int


@dataclass
class FilledStep:
    """What :func:`fill_step` kept: ``kept`` (round, prompt id) in training order, and its counts."""

    target: int
    kept: list[tuple[int, Hashable]] = field(default_factory=list)
    rounds: int = 0
    rollouts: int = 0
    groups: int = 0
    zero_variance: int = 0  # groups dropped because their rewards were all equal
    surplus: int = 0  # mixed groups beyond the target, or of a prompt already kept, dropped

    @property
    def refills(self) -> int:
        return max(0, self.rounds - 1)

    @property
    def short(self) -> int:
        """Groups missing from the target when the refills ran out."""
        return self.target - len(self.kept)

    def metrics(self) -> dict[str, Any]:
        """The step's ``sampling/*`` metrics (docs/metrics.md)."""
        return {"sampling/rounds": self.rounds, "sampling/refills": self.refills,
                "sampling/groups_generated": self.groups, "sampling/groups_zero_variance": self.zero_variance,
                "sampling/groups_surplus": self.surplus, "sampling/groups_kept": len(self.kept),
                "sampling/prompts_short": self.short, "sampling/rollouts_generated": self.rollouts}


def fill_step(target: int, round_prompts: int, max_refills: int,
              run_round: Callable[[int, int], RoundOutcome]) -> FilledStep:
    """Run rounds ``run_round(round index, round_prompts)`` until ``target`` groups with differing rewards are kept
    or ``max_refills`` refills are spent (module docstring)."""
    if target < 1 or round_prompts < 1 or max_refills < 0:
        raise ValueError(f"need target >= 1, round_prompts >= 1, max_refills >= 0; got {target}, {round_prompts}, "
                         f"{max_refills}")
    result = FilledStep(target=target)
    kept_ids: set[Hashable] = set()
    for index in range(max_refills + 1):
        outcome = run_round(index, round_prompts)
        result.rounds += 1
        result.rollouts += int(outcome.rollouts)
        mixed = set(outcome.mixed)
        for pid in outcome.prompt_ids:
            result.groups += 1
            if pid not in mixed:
                result.zero_variance += 1
            elif len(result.kept) < target and pid not in kept_ids:
                result.kept.append((index, pid))
                kept_ids.add(pid)
            else:
                result.surplus += 1
        if len(result.kept) >= target:
            break
    return result


__all__ = ["FilledStep", "RoundOutcome", "fill_step", "mixed_groups"]
