"""Reward stage: verifiable math rewards.

``extract_answer`` pulls the final answer out of a response (last ``\\boxed{}``, else the last math segment or
number); ``MathRewardScorer`` checks it against the reference answer (a string or a list of accepted forms) with
math-verify in worker processes with hard per-item time limits, and never raises for a bad response: reward 0
and a counted reason (see ``REWARD_REASONS``).
"""

from megatron_dynamo.reward.answers import Reference, answer_to_latex, extract_answer, reference_to_latex
from megatron_dynamo.reward.math_reward import REWARD_REASONS, MathRewardScorer, RewardStats, ScoredBatch

__all__ = [
    "REWARD_REASONS",
    "MathRewardScorer",
    "Reference",
    "RewardStats",
    "ScoredBatch",
    "answer_to_latex",
    "extract_answer",
    "reference_to_latex",
]
