"""The synthetic reasoning task of the CPU ablation testbed: running sums written out step by step.

A problem is a chain of one-digit terms added or subtracted left to right, e.g. ``7+5+9-3``; each line of the
worked solution is the previous expression with its first operation done, and the last line boxes the total::

    7+5+9-3=  ->  12+9-3
                  21-3
                  \\boxed{18}

One line per operation, so a chain of ``k`` terms needs ``k - 1`` correct lines: 19 to 70 generated characters
(tokens, with the character tokenizer), 20 to 71 with the end token, for ``k`` = 4..8. Each line is easy (copy the
rest, add or subtract one digit), but an error anywhere changes the final total, so the per-prompt success rate
falls with the chain length, and many prompts lie between always and never solved (the regime where the
allocation of rollouts matters); the token-level modulation has long responses to act on. Running totals stay in
0..99.

Splits: a problem belongs to the held-out split when the first byte of the SHA-256 of its text is below
:data:`TEST_BUCKET` (about a tenth of all problems), else to the training split, so the two are disjoint for
every seed and size. ``data.train: reasoning`` trains on ``data.synthetic_problems`` training problems (seed
``data.seed``); the benchmark name ``reasoning_test`` is the fixed held-out split (:data:`TEST_SIZE` problems,
seed 0, the same levels), for ``evaluation.benchmarks`` and ``dynamo eval --benchmarks``.

Every example's ``extras``: ``level`` (the number of terms), ``level_name`` (``chain<k>``) and ``solution`` (the
worked solution above, what the supervised warm-up trains on). Ids are ``"reasoning:<problem>"``. The answer is
the final integer; math-verify accepts ``\\boxed{<answer>}`` (tested).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from megatron_dynamo.data.dataset import GeneratedTask, MathExample, register_generated_task
from megatron_dynamo.data.leveled import draw_leveled_problems

DATA_SOURCE = "reasoning"
#: Chain lengths (number of terms) of the task, one level each, sampled equally often.
CHAIN_LENGTHS: tuple[int, ...] = (4, 5, 6, 7, 8)
MAX_TOTAL = 99
#: A problem is held out when the first byte of sha256(problem) is below this: 26/256, about a tenth.
TEST_BUCKET = 26
TEST_SIZE = 200
TEST_SEED = 0


def is_held_out(problem: str) -> bool:
    """Whether ``problem`` belongs to the held-out split (a property of the text alone)."""
    return hashlib.sha256(problem.encode("utf-8")).digest()[0] < TEST_BUCKET


def solve(problem: str) -> tuple[int, str]:
    """The answer and worked solution of a chain ``a op b op c ...`` (one-digit terms, ``+`` / ``-``): each line is
    the previous one with its first operation done, the last line the boxed answer."""
    terms, ops = [int(problem[0])], []
    for i in range(1, len(problem), 2):
        ops.append(problem[i])
        terms.append(int(problem[i + 1]))
    total, lines = terms[0], []
    for j, (op, term) in enumerate(zip(ops, terms[1:])):
        total = total + term if op == "+" else total - term
        rest = "".join(f"{o}{t}" for o, t in zip(ops[j + 1:], terms[j + 2:]))
        lines.append(f"{total}{rest}" if rest else f"\\boxed{{{total}}}")
    return total, "\n".join(lines)


def _random_chain(rng: np.random.Generator, length: int) -> str:
    """A chain of ``length`` one-digit terms whose running totals stay in 0..MAX_TOTAL; subtraction where the
    total allows it, half the time."""
    total = int(rng.integers(1, 10))
    text = str(total)
    for _ in range(length - 1):
        term = int(rng.integers(1, 10))
        subtract = total - term >= 0 and (total + term > MAX_TOTAL or rng.random() < 0.5)
        total = total - term if subtract else total + term
        text += ("-" if subtract else "+") + str(term)
    return text


def make_reasoning_task(num_problems: int, seed: int = 0, split: str = "train",
                        lengths: Sequence[int] = CHAIN_LENGTHS) -> list[MathExample]:
    """``num_problems`` distinct chains of ``split`` ("train" or "test"), equally many of each length in
    ``lengths`` (the first levels get one more when it does not divide), in a seeded random order."""
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    bad = [k for k in lengths if not 2 <= int(k) <= 40]
    if not lengths or bad:
        raise ValueError(f"chain lengths must lie in 2..40, got {list(lengths)}")
    rng = np.random.default_rng([seed, 1 if split == "test" else 0])
    return draw_leveled_problems(rng, num_problems, lengths, split, draw=_random_chain, is_held_out=is_held_out,
                                 solve=lambda problem, _rng: solve(problem), data_source=DATA_SOURCE,
                                 level_prefix="chain")


register_generated_task(GeneratedTask(
    name=DATA_SOURCE,
    make=lambda num_problems, seed: make_reasoning_task(num_problems, seed, "train"),
    test=lambda: make_reasoning_task(TEST_SIZE, TEST_SEED, "test"),
))
