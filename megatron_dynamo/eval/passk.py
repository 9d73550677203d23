"""The unbiased pass@k estimator (Chen et al., 2021), as the paper's table uses it.

With ``n`` samples of a problem of which ``c`` are correct, the probability that a set of ``k`` samples drawn
without replacement holds at least one correct one is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

The product form never builds the binomials (C(32, 16) is fine, C(1024, 512) overflows a float), so it is exact
to rounding for any n. A benchmark's pass@k is the mean over its problems.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one problem with ``c`` correct out of ``n`` samples (``1 <= k <= n``, ``0 <= c <= n``)."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if int(value) != value:
            raise ValueError(f"pass@k: {name} must be an integer, got {value!r}")
    n, c, k = int(n), int(c), int(k)
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Mean pass@k over problems given as ``(n, c)`` pairs (each problem may have its own n >= k)."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("mean_pass_at_k: no problems")
    return float(np.mean(values))
