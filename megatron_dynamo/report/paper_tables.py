"""The paper's numbers that ``dynamo ablate`` prints beside its own: Table 1 and Table 2 of the DynaMO paper,
transcribed by hand from the paper (``docs/algorithm.md``, "The paper's tables"; pass@k in %, AIME24, AIME25, AMC23,
MATH500, Minerva, Olympiad, then the paper's Avg.). Keyed by the variant names of ``dynamo ablate``.

A reference for the direction and size of the effects only: the paper trains Qwen2.5-Math-1.5B / 7B on DAPO-Math-17k
for hundreds of steps; the CPU testbed shares nothing with it but the algorithms.
"""

from __future__ import annotations

PAPER_BENCHMARKS = ("AIME24", "AIME25", "AMC23", "MATH500", "Minerva", "Olympiad")
PAPER_K = 32  # Table 1's pass@k column is pass@32

# Table 1 ("Comparison of benchmark results across Qwen2.5-Math-1.5B and Qwen2.5-Math-7B"): per model and row,
# (P@1, P@32) of each benchmark in PAPER_BENCHMARKS order, then (P@1, P@32) of the Avg. column.
# Rows in the paper's order: GRPO, Clip-Higher, Entropy Loss, Fork Tokens, Entropy Advantages, Clip-COV, KL-COV,
# W-REINFORCE, DynaMO (Ours).
TABLE1: dict[str, dict[str, tuple[float, ...]]] = {
    "Qwen2.5-Math-1.5B": {
        "grpo":         (13.2, 32.3, 7.6, 31.5, 56.0, 90.0, 54.4, 79.2, 17.2, 42.8, 25.6, 47.0, 29.0, 53.8),
        "clip_higher":  (12.4, 34.7, 6.4, 30.6, 50.6, 89.9, 56.8, 80.2, 16.8, 41.3, 26.4, 46.8, 28.2, 53.9),
        "entropy_loss": (12.6, 33.7, 5.8, 28.4, 55.6, 86.9, 56.3, 78.5, 17.6, 43.6, 25.4, 46.4, 28.9, 52.9),
        "fork_tokens":  (9.4, 32.0, 5.9, 31.4, 52.5, 85.6, 54.3, 74.2, 16.6, 36.8, 25.5, 45.2, 27.4, 50.9),
        "entropy_adv":  (15.7, 35.8, 8.9, 33.4, 62.0, 86.4, 59.7, 76.2, 18.2, 43.0, 25.9, 44.9, 31.7, 53.3),
        "clip_cov":     (13.5, 36.4, 6.6, 34.4, 59.5, 89.7, 57.6, 75.6, 15.8, 44.3, 25.8, 47.6, 29.8, 54.7),
        "kl_cov":       (12.6, 33.9, 9.0, 33.4, 55.8, 91.3, 54.2, 78.1, 14.8, 40.3, 25.4, 48.1, 28.6, 54.2),
        "w_reinforce":  (15.3, 35.3, 8.5, 31.7, 63.0, 85.7, 56.7, 77.7, 18.2, 40.3, 24.4, 46.2, 31.0, 52.8),
        "dynamo":       (17.2, 37.2, 9.8, 32.5, 63.6, 91.9, 58.8, 81.0, 19.4, 44.0, 27.2, 47.1, 32.7, 55.6),
    },
    "Qwen2.5-Math-7B": {
        "grpo":         (28.8, 52.5, 11.7, 34.8, 68.3, 90.8, 63.3, 75.0, 22.6, 45.4, 28.6, 44.7, 37.2, 57.2),
        "clip_higher":  (27.0, 51.9, 12.1, 39.5, 67.8, 89.9, 64.2, 83.6, 24.0, 46.1, 28.1, 46.3, 37.2, 59.6),
        "entropy_loss": (30.6, 54.6, 13.2, 40.6, 66.0, 87.0, 60.6, 79.6, 23.3, 45.9, 30.2, 41.1, 37.3, 58.1),
        "fork_tokens":  (27.1, 52.5, 13.4, 43.5, 71.0, 87.3, 65.8, 79.3, 26.1, 42.4, 30.9, 47.3, 39.1, 58.7),
        "entropy_adv":  (27.5, 49.7, 9.4, 39.2, 67.9, 85.2, 65.3, 83.3, 23.7, 43.7, 30.4, 47.3, 37.4, 58.1),
        "clip_cov":     (32.2, 52.7, 13.2, 40.4, 72.7, 89.3, 64.3, 76.8, 25.4, 45.9, 29.5, 44.6, 39.5, 58.3),
        "kl_cov":       (32.8, 53.3, 11.7, 36.1, 70.6, 88.5, 64.6, 75.3, 24.5, 39.9, 30.2, 44.2, 39.1, 56.2),
        "w_reinforce":  (31.8, 55.4, 14.3, 41.0, 72.5, 89.8, 64.9, 84.0, 26.4, 49.5, 30.9, 46.7, 40.1, 61.1),
        "dynamo":       (34.4, 59.0, 15.4, 46.8, 74.4, 92.9, 66.4, 84.0, 27.3, 47.2, 31.6, 50.1, 41.6, 63.3),
    },
}

# Table 2 ("Complete ablation study on Qwen2.5-Math-7B with Pass@1 (%)"): P@1 of each benchmark in
# PAPER_BENCHMARKS order, then the Avg. column; rows in the paper's order.
TABLE2: dict[str, tuple[float, ...]] = {
    "dynamo":  (34.4, 15.4, 74.4, 66.4, 27.3, 31.6, 41.6),   # DynaMO
    "dra+ums": (33.8, 15.0, 71.9, 65.0, 26.7, 29.3, 40.3),   # w/o GC
    "dra+gc":  (33.2, 14.7, 71.9, 64.9, 25.9, 30.2, 40.1),   # w/o UMS
    "gc+ums":  (31.9, 15.2, 73.4, 65.7, 23.0, 30.4, 39.9),   # w/o DRA
    "ums":     (31.9, 14.5, 69.0, 64.4, 23.7, 29.7, 38.9),   # w/o GC & DRA
    "dra":     (30.5, 14.3, 70.2, 63.5, 22.2, 29.4, 38.4),   # w/o GC & UMS
    "gc":      (30.0, 13.8, 70.1, 61.6, 19.9, 30.2, 37.6),   # w/o UMS & DRA
    "grpo":    (28.8, 11.7, 68.3, 63.3, 22.6, 28.6, 37.2),   # GRPO (w/o ALL)
}

# The Avg. column of Table 2 (pass@1 %, 7B), by variant.
PAPER_AVG: dict[str, float] = {name: row[-1] for name, row in TABLE2.items()}


def table1_avg(model: str, name: str) -> tuple[float, float] | None:
    """(Avg. P@1, Avg. P@32) of ``name``'s Table 1 row for ``model``; None when the paper has no such row."""
    row = TABLE1.get(model, {}).get(name)
    return (row[-2], row[-1]) if row is not None else None
