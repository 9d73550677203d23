"""The paper's numbers that ``dynamo ablate`` prints beside its own: Table 1 and Table 2 of the DynaMO paper, kept as
data in ``paper_tables.json`` beside this module (transcribed by hand from the paper, ``docs/algorithm.md``, "The
paper's tables"; pass@k in %, AIME24, AIME25, AMC23, MATH500, Minerva, Olympiad, then the paper's Avg.). Keyed by the
variant names of ``dynamo ablate`` (``experiments/variants.py``).

``table1``: per model ("Comparison of benchmark results across Qwen2.5-Math-1.5B and Qwen2.5-Math-7B") and row,
(P@1, P@32) of each benchmark in :data:`PAPER_BENCHMARKS` order, then (P@1, P@32) of the Avg. column; rows in the
paper's order (GRPO, Clip-Higher, Entropy Loss, Fork Tokens, Entropy Advantages, Clip-COV, KL-COV, W-REINFORCE,
DynaMO). ``table2`` ("Complete ablation study on Qwen2.5-Math-7B with Pass@1 (%)"): P@1 of each benchmark, then the
Avg. column; rows in the paper's order (DynaMO, w/o GC, w/o UMS, w/o DRA, w/o GC & DRA, w/o GC & UMS, w/o UMS & DRA,
GRPO).

A reference for the direction and size of the effects only: the paper trains Qwen2.5-Math-1.5B / 7B on DAPO-Math-17k
for hundreds of steps; the CPU testbed shares nothing with it but the algorithms.
"""

from __future__ import annotations

import json
import os

with open(os.path.join(os.path.dirname(__file__), "paper_tables.json"), encoding="utf-8") as _file:
    _PAPER = json.load(_file)

PAPER_BENCHMARKS: tuple[str, ...] = tuple(_PAPER["benchmarks"])
PAPER_K: int = _PAPER["table1_k"]  # Table 1's pass@k column is pass@32
TABLE1: dict[str, dict[str, tuple[float, ...]]] = {model: {name: tuple(row) for name, row in rows.items()}
                                                   for model, rows in _PAPER["table1"].items()}
TABLE2: dict[str, tuple[float, ...]] = {name: tuple(row) for name, row in _PAPER["table2"].items()}
# The Avg. column of Table 2 (pass@1 %, 7B), by variant.
PAPER_AVG: dict[str, float] = {name: row[-1] for name, row in TABLE2.items()}


def table1_avg(model: str, name: str) -> tuple[float, float] | None:
    """(Avg. P@1, Avg. P@32) of ``name``'s Table 1 row for ``model``; None when the paper has no such row."""
    row = TABLE1.get(model, {}).get(name)
    return (row[-2], row[-1]) if row is not None else None
