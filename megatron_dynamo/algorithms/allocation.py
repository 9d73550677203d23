"""Sequence level of DynaMO: dynamic rollout allocation (DRA), paper section 2.1, appendices C and D.

- ``PromptHistory``: cumulative correct count k_i and attempt count G_i per stable prompt id (training state).
- ``bernoulli_variance``: the unbiased Bernoulli variance P_i of eq. 2; ``prompt_variances`` adds the rule for
  prompts with too little history (docs/algorithm.md).
- ``allocate_rollouts``: the water level n_i = clip(lambda * P_i**power, n_min, n_max) with sum n_i = B, made
  integer by largest remainder; ``water_level`` is its continuous solution.
- ``predicted_variance_ratio``: the eq. 23 diagnostic, sum sigma^2/n of the chosen allocation over uniform's.

Everything is vectorised with numpy: no Python loop runs over prompts (the only per-key Python work is dict
look-ups done through C-level ``map``, and the validation of ids seen for the first time).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from itertools import repeat
from typing import Any, Union

import numpy as np

from .config import AllocationConfig

PromptId = Union[int, str]
ArrayLike = Any  # list / tuple / numpy array / torch tensor


def _to_numpy(values: ArrayLike, dtype: Any = np.float64) -> np.ndarray:
    if hasattr(values, "detach"):  # torch tensor, without importing torch here
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=dtype)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}")


def factorize_prompt_ids(prompt_ids: ArrayLike) -> tuple[np.ndarray, list]:
    """Map a sequence of prompt ids (one per response) to group codes: ``ids == uniques[codes]``.

    Ids may be Python ints or strings (or a numpy/torch integer array). Grouping is by value, never by position.
    The work is done by numpy (integer/str arrays) or by C-level dict operations (lists), without a Python loop.
    """
    if hasattr(prompt_ids, "detach"):
        prompt_ids = prompt_ids.detach().cpu().numpy()
    if isinstance(prompt_ids, np.ndarray):
        if prompt_ids.ndim != 1:
            raise ValueError(f"prompt_ids must be one-dimensional, got shape {prompt_ids.shape}")
        if prompt_ids.dtype.kind in "iuU":
            uniques, codes = np.unique(prompt_ids, return_inverse=True)
            return codes.reshape(-1).astype(np.int64), uniques.tolist()
        prompt_ids = prompt_ids.tolist()
    ids = list(prompt_ids)
    table: dict[Hashable, int] = dict.fromkeys(ids)  # first-occurrence order, duplicates merged
    uniques = list(table)
    table.update(zip(uniques, range(len(uniques))))
    codes = np.fromiter(map(table.__getitem__, ids), dtype=np.int64, count=len(ids))
    return codes, uniques


def _normalise_key(key: Any) -> PromptId:
    # Keys are stored as plain int / str so that state_dict() survives a JSON round trip with their type intact.
    if isinstance(key, (bool, np.bool_)):
        raise TypeError(f"prompt ids must be int or str, got bool {key!r}")
    if isinstance(key, (int, np.integer)):
        return int(key)
    if isinstance(key, str):
        return str(key)
    raise TypeError(f"prompt ids must be int or str, got {type(key).__name__} {key!r}")


def bernoulli_variance(k: ArrayLike, G: ArrayLike) -> np.ndarray | float:
    """Unbiased Bernoulli variance of eq. 2: P = k (G - k) / (G (G - 1)), with E[P] = p (1 - p) (eq. 22).

    ``k`` correct answers out of ``G`` attempts (arrays broadcast; floats allowed, as produced by history decay).
    The estimator needs G >= 2: where G < 2 the result is NaN, and ``prompt_variances`` replaces it by the batch
    rule of docs/algorithm.md. Raises ValueError for non-finite values, negative counts or k > G.
    """
    k_arr = _to_numpy(k)
    g_arr = _to_numpy(G)
    if not (np.isfinite(k_arr).all() and np.isfinite(g_arr).all()):
        raise ValueError("bernoulli_variance: k and G must be finite (found NaN or inf)")
    if (g_arr < 0).any() or (k_arr < 0).any():
        raise ValueError("bernoulli_variance: k and G must be non-negative")
    if (k_arr > g_arr).any():
        raise ValueError("bernoulli_variance: k (correct) must not exceed G (attempts)")
    with np.errstate(divide="ignore", invalid="ignore"):
        variance = k_arr * (g_arr - k_arr) / (g_arr * (g_arr - 1.0))
    variance = np.where(g_arr >= 2, variance, np.nan)
    return float(variance) if variance.ndim == 0 else variance


class PromptHistory:
    """Per-prompt success history (k_i correct out of G_i attempts), keyed by a stable prompt id (int or str).

    Appendix D: after each step, G_i <- G_i + n_i and k_i <- k_i + (correct answers of this step). It is training
    state: ``state_dict()`` is JSON-serialisable and ``load_state_dict()`` restores it exactly.

    ``decay`` (default 1.0 = off) forgets old history: each time a prompt is revisited its past (k, G) is multiplied
    by ``decay`` before the new results are added. It acts per visit, not per step, because a prompt is seen
    about once per epoch, so a per-step factor would make the memory depend on the dataset size.
    """

    def __init__(self, decay: float = 1.0) -> None:
        if not (isinstance(decay, (int, float)) and 0 < decay <= 1):
            raise ValueError(f"PromptHistory: decay must lie in (0, 1], got {decay!r}")
        self.decay = float(decay)
        self._row: dict[PromptId, int] = {}
        self._ids: list[PromptId] = []
        self._k = np.zeros(0, dtype=np.float64)
        self._G = np.zeros(0, dtype=np.float64)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._row

    def _rows(self, keys: Sequence, create: bool) -> np.ndarray:
        rows = np.fromiter(map(self._row.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))
        if create:
            missing = np.flatnonzero(rows < 0)
            if missing.size:
                new_keys = [_normalise_key(keys[i]) for i in missing]  # only ids never seen before
                start = len(self._ids)
                new_rows = np.arange(start, start + len(new_keys), dtype=np.int64)
                self._row.update(zip(new_keys, new_rows.tolist()))
                self._ids.extend(new_keys)
                self._k = np.concatenate([self._k, np.zeros(len(new_keys))])
                self._G = np.concatenate([self._G, np.zeros(len(new_keys))])
                rows[missing] = new_rows
        return rows

    def update(self, prompt_ids: ArrayLike, correct: ArrayLike) -> None:
        """Add one step's results: one (prompt id, correct) pair per response (appendix D update rule).

        ``correct`` is 0/1 (bool or number in [0, 1]); responses of one prompt may appear in any order.
        """
        codes, uniques = factorize_prompt_ids(prompt_ids)
        correct_arr = _to_numpy(correct).reshape(-1)
        if correct_arr.shape[0] != codes.shape[0]:
            raise ValueError(
                f"PromptHistory.update: {codes.shape[0]} prompt ids but {correct_arr.shape[0]} results")
        if not np.isfinite(correct_arr).all() or (correct_arr < 0).any() or (correct_arr > 1).any():
            raise ValueError("PromptHistory.update: correct must be 0/1 values (numbers in [0, 1])")
        if codes.size == 0:
            return
        correct_per_prompt = np.bincount(codes, weights=correct_arr, minlength=len(uniques))
        attempts_per_prompt = np.bincount(codes, minlength=len(uniques)).astype(np.float64)
        rows = self._rows(uniques, create=True)  # distinct rows, so fancy-index updates are safe
        if self.decay != 1.0:
            self._k[rows] *= self.decay
            self._G[rows] *= self.decay
        self._k[rows] += correct_per_prompt
        self._G[rows] += attempts_per_prompt

    def counts(self, prompt_ids: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """(k, G) for each given id, in the given order; 0, 0 for ids never seen."""
        codes, uniques = factorize_prompt_ids(prompt_ids)
        rows = self._rows(uniques, create=False)[codes]
        known = rows >= 0
        k = np.zeros(codes.size, dtype=np.float64)
        g = np.zeros(codes.size, dtype=np.float64)
        k[known] = self._k[rows[known]]
        g[known] = self._G[rows[known]]
        return k, g

    def variances(self, prompt_ids: ArrayLike) -> np.ndarray:
        """Eq. 2 for each given id; NaN where G < 2 (unknown prompts included)."""
        k, g = self.counts(prompt_ids)
        return np.asarray(bernoulli_variance(k, g), dtype=np.float64).reshape(-1)

    def state_dict(self) -> dict[str, list]:
        """JSON-serialisable state: ids (int or str, type kept), k and G as float lists."""
        return {"ids": list(self._ids), "k": self._k.tolist(), "G": self._G.tolist()}

    def load_state_dict(self, state: dict[str, list]) -> None:
        """Restore the state written by ``state_dict()`` (replaces the current history)."""
        try:
            ids, k, g = list(state["ids"]), state["k"], state["G"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"PromptHistory.load_state_dict: expected keys ids, k, G ({exc})") from None
        k_arr = np.asarray(k, dtype=np.float64).reshape(-1)
        g_arr = np.asarray(g, dtype=np.float64).reshape(-1)
        if not len(ids) == k_arr.size == g_arr.size:
            raise ValueError(
                f"PromptHistory.load_state_dict: ids, k, G lengths differ ({len(ids)}, {k_arr.size}, {g_arr.size})")
        if not (np.isfinite(k_arr).all() and np.isfinite(g_arr).all()) or (k_arr < 0).any() or (k_arr > g_arr).any():
            raise ValueError("PromptHistory.load_state_dict: counts must be finite with 0 <= k <= G")
        keys = [_normalise_key(key) for key in ids]
        row = dict(zip(keys, range(len(keys))))
        if len(row) != len(keys):
            raise ValueError("PromptHistory.load_state_dict: duplicate prompt ids")
        self._ids, self._row, self._k, self._G = keys, row, k_arr.copy(), g_arr.copy()


def prompt_variances(history: PromptHistory, prompt_ids: ArrayLike, unknown_variance: float = 0.25) -> np.ndarray:
    """P_i (eq. 2) for a batch of prompts, with docs/algorithm.md's rule for prompts with too little history.

    Prompts with G_i < 2 take the mean P of the batch's prompts that have history (G >= 2), or
    ``unknown_variance`` (0.25, the largest p (1 - p)) when none has; so the first epoch is near-uniform.
    """
    variance = history.variances(prompt_ids)
    known = ~np.isnan(variance)
    fill = float(variance[known].mean()) if known.any() else float(unknown_variance)
    return np.where(known, variance, fill)


def _validate_allocation(variances: ArrayLike, budget: Any, n_min: Any, n_max: Any,
                         power: Any) -> tuple[np.ndarray, int, int, int, float]:
    variance = _to_numpy(variances)
    if variance.ndim != 1:
        raise ValueError(f"variances must be one-dimensional, got shape {variance.shape}")
    if variance.size == 0:
        raise ValueError("variances is empty: there are no prompts to allocate rollouts to")
    if np.isnan(variance).any():
        raise ValueError(f"variances contain NaN (first at index {int(np.flatnonzero(np.isnan(variance))[0])})")
    if np.isinf(variance).any():
        raise ValueError(f"variances contain inf (first at index {int(np.flatnonzero(np.isinf(variance))[0])})")
    if (variance < 0).any():
        raise ValueError(f"variances contain negative values (first at index {int(np.flatnonzero(variance < 0)[0])})")
    budget, n_min, n_max = _as_int("budget", budget), _as_int("n_min", n_min), _as_int("n_max", n_max)
    if n_min < 0:
        raise ValueError(f"n_min must be >= 0, got {n_min}")
    if n_min > n_max:
        raise ValueError(f"n_min ({n_min}) must be <= n_max ({n_max})")
    num_prompts = variance.size
    if not num_prompts * n_min <= budget <= num_prompts * n_max:
        raise ValueError(
            f"budget {budget} is impossible for {num_prompts} prompts with counts in [{n_min}, {n_max}]: "
            f"it must lie in [N*n_min, N*n_max] = [{num_prompts * n_min}, {num_prompts * n_max}]")
    if isinstance(power, bool) or not isinstance(power, (int, float, np.floating, np.integer)) \
            or not math.isfinite(power) or power <= 0:
        raise ValueError(f"power must be a finite number > 0, got {power!r}")
    return variance, budget, n_min, n_max, float(power)


def _water_level(variance: np.ndarray, budget: int, n_min: int, n_max: int, power: float) -> np.ndarray:
    num_prompts = variance.size
    if n_min == n_max or budget == num_prompts * n_min:
        return np.full(num_prompts, float(n_min))
    weight = variance ** power
    positive = weight > 0
    num_positive = int(positive.sum())
    num_zero = num_prompts - num_positive
    level = np.empty(num_prompts, dtype=np.float64)
    if num_positive == 0:  # no information at all: uniform
        level[:] = budget / num_prompts
        return level
    saturated_total = num_zero * n_min + num_positive * n_max
    if budget >= saturated_total:
        # Every informative prompt is at n_max: the rest is shared evenly among prompts with P = 0 (docs/algorithm.md).
        level[positive] = n_max
        if num_zero:
            level[~positive] = n_min + (budget - saturated_total) / num_zero
        return level

    # f(lam) = sum_i clip(lam w_i, n_min, n_max) is continuous, piecewise linear and non-decreasing; its
    # breakpoints are lam = n_min / w_i (prompt i leaves n_min) and lam = n_max / w_i (it reaches n_max).
    # Weights are scaled to (0, 1] so that no breakpoint overflows for reasonable inputs.
    scaled = weight[positive] / weight[positive].max()
    desc = np.sort(scaled)[::-1]
    prefix = np.concatenate([[0.0], np.cumsum(desc)])
    enter = n_min / desc   # ascending
    leave = n_max / desc   # ascending, leave >= enter elementwise
    fixed_zero = num_zero * n_min

    def total_at(lam: np.ndarray, side: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # Prompts [0, exited) of ``desc`` are at n_max, [exited, entered) in between, [entered, M) at n_min.
        entered = np.searchsorted(enter, lam, side=side)
        exited = np.searchsorted(leave, lam, side=side)
        constant = fixed_zero + (num_positive - entered) * n_min + exited * n_max
        return constant + lam * (prefix[entered] - prefix[exited]), entered, exited

    # Smallest breakpoint at which f reaches the budget (the last one, all at n_max, exceeds it: see above).
    candidates = []
    for points in (enter, leave):
        reached = total_at(points, "right")[0] >= budget
        if reached.any():
            candidates.append(points[int(np.argmax(reached))])
    lam_hi = min(candidates)
    below = np.concatenate([enter[enter < lam_hi], leave[leave < lam_hi], [0.0]])
    lam_lo = float(below.max())
    # On (lam_lo, lam_hi) f is linear: solve it, with the slope summed directly (no prefix-sum cancellation).
    _, entered, exited = total_at(np.asarray([lam_hi]), "left")
    entered, exited = int(entered[0]), int(exited[0])
    slope = float(desc[exited:entered].sum())
    constant = fixed_zero + (num_positive - entered) * n_min + exited * n_max
    lam = (budget - constant) / slope if slope > 0 else lam_hi
    lam = min(max(lam, lam_lo), lam_hi)
    level[positive] = np.clip(lam * scaled, n_min, n_max)
    level[~positive] = n_min
    return level


def water_level(variances: ArrayLike, budget: int, n_min: int, n_max: int, power: float = 1.0) -> np.ndarray:
    """Continuous water level of appendix D / docs/algorithm.md: n_i = clip(lambda * P_i**power, n_min, n_max), sum = B.

    power = 1 is the paper's rule (n ~ P, appendix C); power = 0.5 is n ~ sigma (eq. 1, the variance optimum,
    and with the bounds the exact minimiser of sum sigma^2/n since the box-constrained KKT point has that form).
    All P = 0 gives B / N each; if every prompt with P > 0 is at n_max, the remainder is shared evenly by the
    prompts with P = 0. lambda is found from the sorted breakpoints and prefix sums in O(N log N).
    Same validation as ``allocate_rollouts``.
    """
    return _water_level(*_validate_allocation(variances, budget, n_min, n_max, power))


def _largest_remainder(level: np.ndarray, budget: int, n_min: int, n_max: int, priority: np.ndarray) -> np.ndarray:
    counts = np.clip(np.floor(level), n_min, n_max).astype(np.int64)
    remainder = level - counts
    shortfall = budget - int(counts.sum())
    if shortfall > 0:
        # The largest fractional parts get one more; ties go to the larger variance, then to the lower index
        # (lexsort is stable), which keeps the counts monotone in the variance and deterministic.
        key = np.where(counts < n_max, remainder, -np.inf)
        order = np.lexsort((-priority, -key))[:shortfall]
        if not np.isfinite(key[order]).all():
            raise RuntimeError("allocate_rollouts: internal error, budget cannot be met by rounding up")
        counts[order] += 1
    elif shortfall < 0:  # only from floating-point noise in the water level
        key = np.where(counts > n_min, remainder, np.inf)
        order = np.lexsort((priority, key))[:-shortfall]
        if not np.isfinite(key[order]).all():
            raise RuntimeError("allocate_rollouts: internal error, budget cannot be met by rounding down")
        counts[order] -= 1
    return counts


def allocate_rollouts(variances: ArrayLike, budget: int, n_min: int, n_max: int, power: float = 1.0) -> np.ndarray:
    """Integer rollout counts by the water level of appendix D: n_i = clip(lambda * P_i**power, n_min, n_max).

    ``variances`` are the per-prompt P_i (eq. 2), any array-like of non-negative finite numbers. Returns int64
    counts with sum exactly ``budget`` and every count in [n_min, n_max], each within 1 of the continuous
    solution (``water_level``): floors plus one for the largest remainders (ties: larger P, then lower index).
    All-zero variances give the uniform allocation, as even as possible. O(N log N), no Python loop over prompts.

    Raises ValueError naming the problem for: empty input, NaN, inf or negative variances, n_min > n_max,
    n_min < 0, a budget outside [N*n_min, N*n_max], power <= 0.
    """
    variance, budget, n_min, n_max, power = _validate_allocation(variances, budget, n_min, n_max, power)
    level = _water_level(variance, budget, n_min, n_max, power)
    return _largest_remainder(level, budget, n_min, n_max, variance)


def predicted_variance_ratio(variances: ArrayLike, counts: ArrayLike) -> float:
    """Eq. 23 diagnostic: sum_i sigma_i^2 / n_i under ``counts`` over the same sum under uniform counts B / N.

    ``variances`` are sigma_i^2 (in practice the P_i of eq. 2), B = sum(counts). Below 1 means the allocation
    lowers the variance of the group-mean gradient estimate. Defined as 1.0 when all variances are 0.
    """
    variance = _to_numpy(variances).reshape(-1)
    count = _to_numpy(counts).reshape(-1)
    if variance.shape != count.shape:
        raise ValueError(f"variances and counts differ in length ({variance.size} vs {count.size})")
    if not (np.isfinite(variance).all() and np.isfinite(count).all()) or (variance < 0).any() or (count < 0).any():
        raise ValueError("variances and counts must be finite and non-negative")
    if variance.size == 0 or not (variance > 0).any():
        return 1.0
    informative = variance > 0
    if (count[informative] == 0).any():
        raise ValueError("a prompt with positive variance has 0 rollouts: its variance is infinite")
    chosen = float((variance[informative] / count[informative]).sum())
    uniform = float(variance.sum()) * variance.size / float(count.sum())
    return chosen / uniform


def plan_rollouts(history: PromptHistory, prompt_ids: ArrayLike, cfg: AllocationConfig) -> np.ndarray:
    """Counts for one step: P from the history (eq. 2 + fill-in rule), then ``allocate_rollouts`` with budget
    N * n_avg; uniform n_avg per prompt when DRA is switched off (``cfg.enabled=False``)."""
    cfg.validate()
    codes, _ = factorize_prompt_ids(prompt_ids)
    num_prompts = codes.size
    if not cfg.enabled:
        return np.full(num_prompts, cfg.n_avg, dtype=np.int64)
    variance = prompt_variances(history, prompt_ids, cfg.unknown_variance)
    return allocate_rollouts(variance, cfg.budget(num_prompts), cfg.n_min, cfg.n_max, cfg.power)
