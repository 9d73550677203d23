"""Paired Student t intervals, Holm's step-down adjustment and the power of a paired t test: the statistics of the
preregistered analysis (docs/ablation.md, "Preregistration"; issue 32).

A comparison is paired by seed: both runs of a seed start from the same SFT model and are evaluated on the same
held-out problems, so the per-seed differences d_1..d_n are the replicates. With mean d, standard deviation s and
SE = s / sqrt(n), the two-sided 100c% interval is mean +- t_{n-1, (1+c)/2} SE and the p-value of "mean 0" is
2 P(T_{n-1} > |mean| / SE). (A percentile bootstrap over 5 seeds covers ~83% where it claims 95%; issue 32.)

Holm (1979): with m p-values sorted p_(1) <= ... <= p_(m), the adjusted p_(i) = max_{j <= i} min(1, (m - j + 1)
p_(j)); rejecting where the adjusted value is below alpha controls the family-wise error at alpha.

Power of the two-sided paired t test at level alpha against a true mean effect delta with standard error SE on
n - 1 = df degrees of freedom: T = (Z + delta/SE) / sqrt(V / df), V ~ chi^2_df, so
power = E_V[Phi(delta/SE - c sqrt(V/df)) + Phi(-delta/SE - c sqrt(V/df))], c = t_{df, 1 - alpha/2} (the
noncentral t), integrated numerically. Inverted: the smallest effect detectable with a given power
(:func:`detectable_effect`) and the fewest seeds that give it (:func:`seeds_for_power`).

The t distribution comes from mpmath (the regularized incomplete beta function), a dependency of torch's sympy and
in both lock files; numpy does the rest.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import mpmath
import numpy as np


def _upper_tail(x, df):
    """P(T_df > x) for x >= 0, in mpmath's working precision."""
    return mpmath.betainc(mpmath.mpf(df) / 2, mpmath.mpf(1) / 2, 0, df / (df + x * x), regularized=True) / 2


def t_cdf(x: float, df: float) -> float:
    """P(T_df <= x) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    with mpmath.workdps(30):
        tail = _upper_tail(mpmath.mpf(abs(x)), df)
        return float(1 - tail) if x >= 0 else float(tail)


def t_quantile(q: float, df: float) -> float:
    """The x with P(T_df <= x) = q, 0 < q < 1: the root of the upper tail, bracketed and refined (Illinois) at 30
    digits."""
    if not 0 < q < 1:
        raise ValueError(f"q must lie in (0, 1), got {q}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_quantile(1 - q, df)
    with mpmath.workdps(30):
        target = 1 - mpmath.mpf(q)
        hi = mpmath.mpf(1)
        while _upper_tail(hi, df) > target:
            hi *= 2
        root = mpmath.findroot(lambda x: _upper_tail(x, df) - target, (hi / 2 if hi > 1 else 0, hi),
                               solver="illinois", tol=mpmath.mpf(10) ** -25)
        return float(root)


def paired_t(values: Sequence[float] | Mapping[int, float], confidence: float = 0.95) -> dict[str, float | int | None]:
    """Mean of the per-seed ``values`` (differences), its two-sided ``confidence`` Student t interval and the
    two-sided p-value of "mean 0". n < 2: no interval (lo, hi, p None); s = 0: a zero-width interval, p 0 unless
    the mean is 0 too."""
    x = np.asarray(list(values.values()) if isinstance(values, Mapping) else list(values), dtype=np.float64)
    n = int(x.size)
    if n == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0, "se": None, "t": None, "p": None, "df": 0}
    mean = float(x.mean())
    if n == 1:
        return {"mean": mean, "lo": None, "hi": None, "n": 1, "se": None, "t": None, "p": None, "df": 0}
    se = float(x.std(ddof=1)) / math.sqrt(n)
    df = n - 1
    if se == 0:
        return {"mean": mean, "lo": mean, "hi": mean, "n": n, "se": 0.0, "t": None, "p": 1.0 if mean == 0 else 0.0,
                "df": df}
    half = t_quantile((1 + confidence) / 2, df) * se
    t = mean / se
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n, "se": se, "t": t,
            "p": min(1.0, 2 * (1 - t_cdf(abs(t), df))), "df": df}


def holm(pvalues: Mapping[str, float | None]) -> dict[str, float | None]:
    """Holm's adjusted p-values of a family (None stays None and is not counted in m)."""
    present = sorted(((p, name) for name, p in pvalues.items() if p is not None), key=lambda item: item[0])
    m = len(present)
    adjusted: dict[str, float | None] = {name: None for name in pvalues}
    running = 0.0
    for i, (p, name) in enumerate(present):
        running = max(running, min(1.0, (m - i) * p))
        adjusted[name] = running
    return adjusted


def paired_t_power(effect: float, se: float, df: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t test at ``alpha`` against a true mean ``effect`` with standard error ``se``
    on ``df`` degrees of freedom (module docstring). The expectation over V ~ chi^2_df is an integral over
    u = log V of a smooth integrand that decays exponentially on the left and double-exponentially on the right,
    where the trapezoid rule converges geometrically: 2001 points give 1e-13 against scipy's noncentral t (tests)."""
    if se <= 0 or df < 1 or not 0 < alpha < 1:
        raise ValueError(f"need se > 0, df >= 1, 0 < alpha < 1; got {se}, {df}, {alpha}")
    shift = effect / se
    critical = t_quantile(1 - alpha / 2, df)
    half = df / 2
    u = np.linspace(-80.0 / df - 2.0, math.log(df + 20 * math.sqrt(df) + 60), 2001)
    v = np.exp(u)
    weight = np.exp(half * u - v / 2 - half * math.log(2) - math.lgamma(half))  # chi^2 density x dV/du
    scale = critical * np.sqrt(v / df)
    inside = _normal_cdf(shift - scale) + _normal_cdf(-shift - scale)
    return float((u[1] - u[0]) * np.dot(weight, inside))  # the ends contribute nothing at this precision


_erfc = np.frompyfunc(math.erfc, 1, 1)


def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * _erfc(-x / math.sqrt(2)).astype(np.float64)


def detectable_effect(se: float, df: int, power: float = 0.8, alpha: float = 0.05) -> float:
    """The smallest true effect (> 0, same units as ``se``) that the two-sided paired t test at ``alpha`` with
    standard error ``se`` on ``df`` degrees of freedom detects with probability ``power``: the root of
    :func:`paired_t_power` (increasing in the effect), in units of ``se``: bracketed, then refined (Illinois) to
    1e-9 of the power, about ten evaluations of the power's integral."""
    if not 0 < power < 1:
        raise ValueError(f"power must lie in (0, 1), got {power}")
    return se * _detectable_shift(df, power, alpha)


@functools.lru_cache(maxsize=256)
def _detectable_shift(df: int, power: float, alpha: float) -> float:
    # the power depends on the effect only through effect / se: one root per (df, power, alpha)
    lo, hi = 0.0, 4.0
    while paired_t_power(hi, 1.0, df, alpha) < power:
        lo, hi = hi, 2 * hi
    return float(mpmath.findroot(lambda x: paired_t_power(float(x), 1.0, df, alpha) - power, (lo, hi),
                                 solver="illinois", tol=1e-18))


def seeds_for_power(variance: float, effect: float, power: float = 0.8, alpha: float = 0.05,
                    max_seeds: int = 1000) -> int:
    """The fewest seeds S >= 2 at which the two-sided paired t test at ``alpha`` has at least ``power`` against a
    true mean ``effect``, when one seed's paired difference has ``variance`` (SE = sqrt(variance / S), S - 1 df)."""
    if variance <= 0 or effect == 0:
        raise ValueError(f"need variance > 0 and effect != 0; got {variance}, {effect}")
    for seeds in range(2, max_seeds + 1):
        if paired_t_power(abs(effect), math.sqrt(variance / seeds), seeds - 1, alpha) >= power:
            return seeds
    raise ValueError(f"more than {max_seeds} seeds needed for power {power} against {effect}")


__all__ = ["detectable_effect", "holm", "paired_t", "paired_t_power", "seeds_for_power", "t_cdf", "t_quantile"]
