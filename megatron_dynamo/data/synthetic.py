"""The synthetic verifiable math task of the embedded CPU run: short integer arithmetic, generated with a seed.

Problems are at most 7 characters over ``0-9 + - * ( )`` with non-negative integer answers, in difficulty
levels chosen so that a tiny model has per-prompt success rates spread over (0, 1) -- the situation in which
the allocation of rollouts matters:

=========  ===============  ========  ===================================================
level      example          problems  why it is harder
=========  ===============  ========  ===================================================
add1       ``3+4``          100       one-digit facts (easy)
add2       ``23+45``        8,100     two digits, with or without a carry
sub2       ``91-37``        4,095     borrows; first operand >= second
mul1       ``7*8``          64        multiplication facts 2..9
mul2       ``23*7``         720       two digits times one digit, three-digit answers
two_ops    ``(3+4)*5``      ~2,700    precedence and parentheses, one-digit operands
=========  ===============  ========  ===================================================

Every answer is the exact integer value, and math-verify accepts ``\\boxed{<answer>}`` (tested). Ids are
``"synthetic:<problem>"``: problems are distinct within a task, so ids are unique and say what they are.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from megatron_dynamo.data.dataset import GeneratedTask, MathExample, register_generated_task
from megatron_dynamo.data.templates import render

DATA_SOURCE = "synthetic"


def _add1() -> list[tuple[str, int]]:
    return [(f"{a}+{b}", a + b) for a in range(10) for b in range(10)]


def _add2() -> list[tuple[str, int]]:
    return [(f"{a}+{b}", a + b) for a in range(10, 100) for b in range(10, 100)]


def _sub2() -> list[tuple[str, int]]:
    return [(f"{a}-{b}", a - b) for a in range(10, 100) for b in range(10, a + 1)]


def _mul1() -> list[tuple[str, int]]:
    return [(f"{a}*{b}", a * b) for a in range(2, 10) for b in range(2, 10)]


def _mul2() -> list[tuple[str, int]]:
    return [(f"{a}*{b}", a * b) for a in range(10, 100) for b in range(2, 10)]


def _two_ops() -> list[tuple[str, int]]:
    digits = range(1, 10)
    problems = []
    for a in digits:
        for b in digits:
            for c in digits:
                problems.append((f"({a}+{b})*{c}", (a + b) * c))
                problems.append((f"{a}+{b}*{c}", a + b * c))
                problems.append((f"{a}*{b}+{c}", a * b + c))
                if a * b >= c:
                    problems.append((f"{a}*{b}-{c}", a * b - c))
    return problems


#: Level name -> generator of every (problem, answer) of that level, from easiest to hardest.
SYNTHETIC_LEVELS: dict[str, Callable[[], list[tuple[str, int]]]] = {
    "add1": _add1, "add2": _add2, "sub2": _sub2, "mul1": _mul1, "mul2": _mul2, "two_ops": _two_ops,
}


def _level_counts(num_problems: int, weights: Mapping[str, float], capacity: Mapping[str, int]) -> dict[str, int]:
    """Split ``num_problems`` over levels by weight (largest remainder); a level that runs out of distinct
    problems hands its surplus to the levels that still have some."""
    counts = dict.fromkeys(weights, 0)
    remaining = num_problems
    open_levels = [name for name in weights if weights[name] > 0]
    while remaining > 0 and open_levels:
        total = sum(weights[name] for name in open_levels)
        shares = {name: remaining * weights[name] / total for name in open_levels}
        step = {name: int(np.floor(shares[name])) for name in open_levels}
        leftover = remaining - sum(step.values())
        for name in sorted(open_levels, key=lambda n: shares[n] - step[n], reverse=True)[:leftover]:
            step[name] += 1
        for name in open_levels:
            counts[name] += step[name]
        remaining = 0
        for name in list(open_levels):
            if counts[name] >= capacity[name]:
                remaining += counts[name] - capacity[name]
                counts[name] = capacity[name]
                open_levels.remove(name)
    if remaining > 0:
        raise ValueError(f"asked for {num_problems} distinct problems; these levels hold only {sum(counts.values())}")
    return counts


def make_synthetic_task(num_problems: int, seed: int = 0,
                        levels: Sequence[str] | Mapping[str, float] | None = None) -> list[MathExample]:
    """``num_problems`` distinct arithmetic problems, spread over difficulty levels, shuffled with ``seed``.

    ``levels``: level names (equal weights) or ``{name: weight}``; default every level, equal weights. A level
    with fewer distinct problems than its share (``add1`` has 100, ``mul1`` 64) gives the rest to the others.
    Each example's ``extras`` holds ``level`` (index in :data:`SYNTHETIC_LEVELS`) and ``level_name``.
    """
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    if levels is None:
        weights = dict.fromkeys(SYNTHETIC_LEVELS, 1.0)
    elif isinstance(levels, Mapping):
        weights = {name: float(w) for name, w in levels.items()}
    else:
        weights = dict.fromkeys(levels, 1.0)
    unknown = sorted(set(weights) - set(SYNTHETIC_LEVELS))
    if unknown:
        raise ValueError(f"unknown synthetic levels {unknown}; known: {list(SYNTHETIC_LEVELS)}")
    if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
        raise ValueError(f"level weights must be >= 0 with at least one > 0, got {weights}")

    pools = {name: SYNTHETIC_LEVELS[name]() for name in weights}
    counts = _level_counts(num_problems, weights, {name: len(pool) for name, pool in pools.items()})
    rng = np.random.default_rng(seed)
    level_index = {name: i for i, name in enumerate(SYNTHETIC_LEVELS)}
    examples: list[MathExample] = []
    for name, pool in pools.items():
        for i in rng.choice(len(pool), size=counts[name], replace=False):
            problem, answer = pool[int(i)]
            examples.append(MathExample(
                id=f"{DATA_SOURCE}:{problem}", problem=problem, answer=str(answer), data_source=DATA_SOURCE,
                extras={"level": level_index[name], "level_name": name},
            ))
    order = rng.permutation(len(examples))  # mix the levels
    return [examples[int(i)] for i in order]


def sft_pairs(examples: Sequence[MathExample], template: str = "synthetic",
              answer_format: str = "boxed") -> list[tuple[str, str]]:
    """Supervised warm-start pairs ``(prompt, completion)``, e.g. ``("23+45=", "\\boxed{68}")``.

    The completion is the example's worked solution (``extras["solution"]``, e.g. the reasoning task's) where it
    has one, else its answer in ``answer_format``: ``"boxed"`` (``\\boxed{68}``) or ``"plain"`` (``68``). It
    carries no end token: the trainer appends the tokenizer's EOS.
    """
    if answer_format not in ("boxed", "plain"):
        raise ValueError(f"answer_format must be 'boxed' or 'plain', got {answer_format!r}")
    pairs = []
    for example in examples:
        completion = example.extras.get("solution") or (
            f"\\boxed{{{example.answer}}}" if answer_format == "boxed" else example.answer)
        pairs.append((render(template, example.problem), completion))
    return pairs


#: The benchmark ``synthetic_eval``: the CPU default's own 128 problems (data.synthetic_problems 128, data.seed 0),
#: what README's CPU `dynamo eval` example scores: how well the run learnt its task (not a held-out split).
SYNTHETIC_EVAL = "synthetic_eval"

register_generated_task(GeneratedTask(
    name=DATA_SOURCE, make=lambda num_problems, seed: make_synthetic_task(num_problems, seed=seed),
    test=lambda: make_synthetic_task(128, seed=0), test_name=SYNTHETIC_EVAL))
