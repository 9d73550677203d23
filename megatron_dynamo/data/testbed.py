"""The task of the mechanism testbed (issue 26): sum a multiset of one-digit numbers, in any order.

A problem is a sum of ``k`` one-digit terms, e.g. ``3+8+5+2``. Each line of a solution adds the running total
(the first term) to **any one** of the remaining terms, and writes the new total followed by the terms not yet
used, in their original order; the last line boxes the total::

    3+8+5+2=  ->  8+8+2        (3+5: the policy chose the third term; 11+5+2 and 5+8+5 were as valid)
                  10+8         (8+2)
                  \\boxed{18}

So every line opens with a **decision point** (``k - 1 - j`` valid partners at line ``j``, usually as many
distinct first digits), followed by tokens that are determined by that choice (the sum, the copied rest): the
per-token entropy of the warmed-up policy varies widely within a response, which is what GC/UMS need to act on
(on the running-sum task of ``data/reasoning.py`` nearly every token was certain). The worked solutions of the
supervised warm-up pick every partner uniformly at random, so the warm-up teaches that all orders are valid and
leaves the choice open; RL may then prefer some orders (the entropy trajectory shows it).

Difficulty is the number of terms (:data:`LENGTHS`, 4..8; 3 to 7 lines). The warm-up sees only
:data:`WARMUP_LENGTHS` (4..6 terms), so the longest unseen sums are (nearly) never solved: prompts with pass rate
0 at n samples give the dynamic allocation rollouts to move. Measured after the recipe's 250-step warm-up
(``benchmarks/bench_mechanisms.py``, docs/results/testbed.md): 31.5% never solved in 16 samples, none always solved
(a longer warm-up is meant to add the always-solved side).

Splits: a problem is held out when the first byte of the SHA-256 of its **sorted** terms is below
:data:`TEST_BUCKET` (about a tenth), so a reordering of a held-out multiset is held out too and the splits are
disjoint as multisets. ``data.train: testbed`` trains on ``data.synthetic_problems`` training problems, equally
many of every length (seed ``data.seed``); ``data.sft_problems`` warm-up problems come from
:data:`WARMUP_LENGTHS` only (:func:`make_warmup_problems`). The benchmark ``testbed_test`` is the fixed held-out
split (:data:`TEST_SIZE` problems, every length equally, seed 0).

``extras``: ``level`` (``k``), ``level_name`` (``sum<k>``), ``solution`` (one worked solution, partners drawn
with the example's seed). Ids ``"testbed:<problem>"``. The answer is the total; math-verify accepts
``\\boxed{<total>}``. :func:`check_solution` checks every line of a response (the decision taken and the partial
sum), for diagnostics beside the reward.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from megatron_dynamo.data.dataset import GeneratedTask, MathExample, register_generated_task
from megatron_dynamo.data.leveled import draw_leveled_problems

DATA_SOURCE = "testbed"
#: Number of terms of the task's levels, equally often in training prompts and the held-out split.
LENGTHS: tuple[int, ...] = (4, 5, 6, 7, 8)
#: The levels the supervised warm-up covers (the rest is never seen before RL).
WARMUP_LENGTHS: tuple[int, ...] = (4, 5, 6)
#: A multiset is held out when the first byte of sha256(sorted terms) is below this: 26/256, about a tenth.
TEST_BUCKET = 26
TEST_SIZE = 1500
TEST_SEED = 0


def terms_of(problem: str) -> list[int]:
    """The terms of ``a+b+c...`` (one-digit each); ValueError for anything else."""
    parts = problem.split("+")
    if len(parts) < 2 or not all(len(p) == 1 and p.isdigit() for p in parts):
        raise ValueError(f"not a sum of one-digit terms: {problem!r}")
    return [int(p) for p in parts]


def is_held_out(problem: str) -> bool:
    """Whether the multiset of ``problem``'s terms belongs to the held-out split (any order of it does too)."""
    key = "+".join(str(t) for t in sorted(terms_of(problem)))
    return hashlib.sha256(key.encode("utf-8")).digest()[0] < TEST_BUCKET


def solve(problem: str, rng: np.random.Generator | None = None) -> tuple[int, str]:
    """The total and one worked solution: each line adds the running total to a partner drawn uniformly from the
    remaining terms (with ``rng``; the next term in order without), then the boxed total."""
    terms = terms_of(problem)
    total, rest, lines = terms[0], terms[1:], []
    while rest:
        j = int(rng.integers(len(rest))) if rng is not None else 0
        total += rest.pop(j)
        lines.append("+".join([str(total)] + [str(t) for t in rest]) if rest else f"\\boxed{{{total}}}")
    return total, "\n".join(lines)


def check_solution(problem: str, response: str) -> tuple[int, int]:
    """(valid lines, lines needed) of ``response``: a line is valid when it is the previous state with the
    running total added to one of the remaining terms (the decision and the partial sum both right); counting
    stops at the first invalid line. ``lines needed`` is ``k - 1``."""
    terms = terms_of(problem)
    total, rest, valid = terms[0], terms[1:], 0
    for line in response.strip().split("\n"):
        if not rest:
            break
        if len(rest) == 1:
            ok = line.strip() == f"\\boxed{{{total + rest[0]}}}"
            if ok:
                valid, rest = valid + 1, []
            break
        parts = line.strip().split("+")
        if not all(p.isdigit() for p in parts) or len(parts) != len(rest):
            break
        new_total, new_rest = int(parts[0]), [int(p) for p in parts[1:]]
        partner = next((j for j in range(len(rest)) if rest[:j] + rest[j + 1:] == new_rest
                        and total + rest[j] == new_total), None)
        if partner is None:
            break
        total, rest, valid = new_total, new_rest, valid + 1
    return valid, len(terms) - 1


def _draw(rng: np.random.Generator, length: int) -> str:
    return "+".join(str(int(t)) for t in rng.integers(1, 10, size=length))


def make_testbed_task(num_problems: int, seed: int = 0, split: str = "train",
                      lengths: Sequence[int] = LENGTHS) -> list[MathExample]:
    """``num_problems`` distinct sums of ``split`` ("train" or "test"), equally many of each length in
    ``lengths`` (the first levels get one more when it does not divide), in a seeded random order; each with one
    worked solution whose partners are drawn with the same seed."""
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    bad = [k for k in lengths if not 2 <= int(k) <= 12]
    if not lengths or bad:
        raise ValueError(f"lengths must lie in 2..12, got {list(lengths)}")
    rng = np.random.default_rng([seed, 1 if split == "test" else 0, 26])
    return draw_leveled_problems(rng, num_problems, lengths, split, draw=_draw, is_held_out=is_held_out,
                                 solve=solve, data_source=DATA_SOURCE, level_prefix="sum")


def make_warmup_problems(num_problems: int, seed: int) -> list[MathExample]:
    """The supervised warm-up's problems: training-split sums of :data:`WARMUP_LENGTHS` terms only."""
    return make_testbed_task(num_problems, seed, "train", WARMUP_LENGTHS)


register_generated_task(GeneratedTask(
    name=DATA_SOURCE,
    make=lambda num_problems, seed: make_testbed_task(num_problems, seed, "train"),
    test=lambda: make_testbed_task(TEST_SIZE, TEST_SEED, "test"),
    sft=make_warmup_problems,
))
