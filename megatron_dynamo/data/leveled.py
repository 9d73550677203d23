"""Generated tasks with difficulty levels and a held-out split: the draw loop shared by ``reasoning`` and
``testbed`` (distinct problems, each on the side of the split its own rule puts it, levels mixed at the end)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from megatron_dynamo.data.dataset import MathExample


def draw_leveled_problems(rng: np.random.Generator, num_problems: int, lengths: Sequence[int], split: str, *,
                          draw: Callable[[np.random.Generator, int], str], is_held_out: Callable[[str], bool],
                          solve: Callable[[str, np.random.Generator], tuple[int, str]], data_source: str,
                          level_prefix: str) -> list[MathExample]:
    """``num_problems`` distinct problems, level ``lengths[i % len(lengths)]`` for the i-th, each drawn until it is
    new and ``is_held_out(problem) == (split == "test")``; ``solve`` gives (answer, worked solution). The examples
    come back in a random order (levels mixed). ValueError when a level runs out of problems of its split."""
    want_held_out = split == "test"
    examples: list[MathExample] = []
    seen: set[str] = set()
    for index in range(num_problems):
        length = int(lengths[index % len(lengths)])
        for _ in range(100_000):
            problem = draw(rng, length)
            if problem not in seen and is_held_out(problem) == want_held_out:
                break
        else:  # only the shortest levels run out
            raise ValueError(f"cannot draw {num_problems} distinct {split} problems of {length} terms")
        seen.add(problem)
        answer, solution = solve(problem, rng)
        examples.append(MathExample(
            id=f"{data_source}:{problem}", problem=problem, answer=str(answer), data_source=data_source,
            extras={"level": length, "level_name": f"{level_prefix}{length}", "solution": solution}))
    order = rng.permutation(len(examples))  # mix the levels
    return [examples[int(i)] for i in order]
