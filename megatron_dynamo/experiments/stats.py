"""Statistics of ``dynamo ablate`` over seeds and the numbers of one run (numpy only; nothing of the trainer,
Megatron or vLLM: testable without training). The formulas are in docs/ablation.md ("Statistics").

- mean and percentile-bootstrap CI (:func:`bootstrap_ci`): resample the n per-seed values with replacement
  ``resamples`` times (seeded RNG), take each resample's mean; the CI is the (1-c)/2 and (1+c)/2 percentiles of
  those means. With 3 seeds the bootstrap CI is crude (it can never be wider than the sample's range, and a
  3-point resample has only 10 distinct means).
- paired differences (:func:`paired_differences`): per seed, a - b, over the seeds both have; then mean and CI.
- marginal effect of a component X (:func:`marginal_effect`): per seed, the mean over the 4 pairs of power-1
  variants that differ only in X of (with X) - (without X); then mean and CI over seeds. A seed counts only when
  all 8 power-1 variants have a value for it; "n/a" when no seed does (a variant missing or failed).
- rollouts to threshold: as ``dynamo compare`` (trailing ``window``-step mean of reward_mean >= threshold,
  cumulative rollouts); a run that never reaches it counts as the whole budget B = prompts/step x n_avg x steps
  and is censored: the mean is then a lower bound, shown as ">= ...".
- eq. 23 variance ratio, predicted (the allocator's logged ``variance_ratio``, from the prompt history before
  sampling) and realised (:func:`realised_variance_ratio`, from ``prompts.jsonl`` after sampling).
- zero-advantage share (:func:`zero_advantage_share`): the (step, prompt) groups whose responses are all correct
  or all wrong (GRPO's advantage is 0 for all of them: no gradient).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from megatron_dynamo.experiments.variants import COMPONENTS, variant_with
from megatron_dynamo.report.thresholds import head_mean, summarize_run, tail_mean

# Per-step diagnostics averaged per run, then over seeds (docs/metrics.md).
MODULATION_KEYS = ("modulation/scale_mean", "modulation/scale_p10", "modulation/scale_p90",
                   "modulation/beta_stab_mean", "modulation/beta_stab_min", "modulation/beta_comp_mean_pos")
_SHARE_KEY = re.compile(r"^modulation/.*(_frac|_share|share_).*$")


def finite_values(values: Iterable[Any]) -> np.ndarray:
    out = [float(v) for v in values if finite_number(v) is not None]
    return np.asarray(out, dtype=np.float64)


def finite_number(value: Any) -> float | None:
    """A finite float from a logged value (non-finite floats are logged as strings), else None."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def bootstrap_ci(values: Sequence[float], resamples: int = 10000, confidence: float = 0.95,
                 seed: int = 0) -> dict[str, Any]:
    """Mean of ``values`` (non-finite and None left out) and its percentile-bootstrap CI.

    ``resamples`` resamples of n values drawn with replacement (``numpy.random.default_rng(seed)``: the same
    inputs give the same CI); lo / hi = the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` percentiles of
    the resample means. n = 0: every number None; n = 1: a zero-width CI at the value.
    """
    x = finite_values(values)
    n = int(x.size)
    if n == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    mean = float(x.mean())
    if n == 1 or np.all(x == x[0]):
        return {"mean": mean, "lo": mean, "hi": mean, "n": n}
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, dtype=np.float64)
    chunk = max(1, 2_000_000 // n)  # bounded memory for large n
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = x[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    lo, hi = np.percentile(means, [50 * (1 - confidence), 50 * (1 + confidence)])
    return {"mean": mean, "lo": float(lo), "hi": float(hi), "n": n}


def paired_differences(a: Mapping[int, Any], b: Mapping[int, Any]) -> dict[int, float]:
    """Per seed, ``a[seed] - b[seed]`` over the seeds where both are finite numbers (sorted by seed)."""
    out = {}
    for seed in sorted(set(a) & set(b)):
        x, y = finite_number(a[seed]), finite_number(b[seed])
        if x is not None and y is not None:
            out[seed] = x - y
    return out


def marginal_effect(values: Mapping[str, Mapping[int, Any]], component: str) -> dict[str, Any]:
    """The marginal effect of ``component`` (``dra``, ``gc`` or ``ums``) from per-variant, per-seed values.

    For each of the 4 settings of the two other components, the pair (with, without) of power-1 variants; per
    seed, effect = mean over the 4 pairs of value(with) - value(without). A seed counts only when all 8 power-1
    variants have a finite value for it. Returns ``per_seed`` {seed: effect} (empty: n/a), the ``pairs``
    [(with, without)], their per-seed ``simple_effects`` (each pair's own difference, over the seeds it has) and
    ``missing`` (variants absent from ``values``).
    """
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {COMPONENTS}, got {component!r}")
    others = [c for c in COMPONENTS if c != component]
    pairs = []
    for a in (False, True):
        for b in (False, True):
            setting = {others[0]: a, others[1]: b}
            on = variant_with(**{**setting, component: True})
            off = variant_with(**{**setting, component: False})
            pairs.append((on, off))
    simple = {f"{on} - {off}": paired_differences(values.get(on, {}), values.get(off, {})) for on, off in pairs}
    missing = sorted({v for pair in pairs for v in pair if v not in values})
    seeds = set.intersection(*(set(d) for d in simple.values())) if simple else set()
    per_seed = {s: float(np.mean([simple[f"{on} - {off}"][s] for on, off in pairs])) for s in sorted(seeds)}
    return {"per_seed": per_seed, "pairs": pairs, "simple_effects": simple, "missing": missing}


def realised_variance_ratio(prompt_rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The eq. 23 variance ratio measured after sampling, from ``prompts.jsonl`` rows {step, prompt_id, count,
    correct}.

    Per step t with prompts i = 1..N, counts n_i and success rates p_i = correct_i / n_i::

        ratio_t = sum_i p_i (1 - p_i) / n_i  /  sum_i p_i (1 - p_i) / n_u,   n_u = (sum_i n_i) / N

    i.e. the variance of the group-mean estimates under the allocation used over that under a uniform split of the
    same budget, with the plug-in Bernoulli variance p_i (1 - p_i) of the step's own samples (what the allocator
    predicted from the history beforehand is the logged ``variance_ratio``). Uniform counts give exactly 1; below 1
    the allocation put its rollouts where the variance was. Steps whose denominator is 0 (every group all correct
    or all wrong) are left out. Returns ``mean`` over the steps used (None if none), ``per_step`` and
    ``steps_used``.
    """
    by_step: dict[int, list[tuple[float, float]]] = {}
    for row in prompt_rows:
        count, correct = finite_number(row.get("count")), finite_number(row.get("correct"))
        if count is None or correct is None or count <= 0 or not isinstance(row.get("step"), int):
            continue
        by_step.setdefault(row["step"], []).append((count, min(max(correct, 0.0), count)))
    per_step = {}
    for step in sorted(by_step):
        n = np.array([c for c, _ in by_step[step]])
        p = np.array([k for _, k in by_step[step]]) / n
        var = p * (1 - p)
        n_uniform = n.sum() / n.size
        denominator = float(var.sum() / n_uniform)
        if denominator > 0:
            per_step[step] = float((var / n).sum()) / denominator
    mean = float(np.mean(list(per_step.values()))) if per_step else None
    return {"mean": mean, "per_step": per_step, "steps_used": len(per_step)}


def zero_advantage_share(prompt_rows: Iterable[Mapping[str, Any]]) -> float | None:
    """Fraction of (step, prompt) groups of ``prompts.jsonl`` with all responses correct or all wrong."""
    total = zero = 0
    for row in prompt_rows:
        count, correct = finite_number(row.get("count")), finite_number(row.get("correct"))
        if count is None or correct is None or count <= 0:
            continue
        total += 1
        zero += correct <= 0 or correct >= count
    return zero / total if total else None


# ---------------------------------------------------------------------------------------------- one run
def training_rows(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows of training steps (step >= 1 with a reward), in step order."""
    return sorted((r for r in records if isinstance(r.get("step"), int) and r["step"] >= 1
                   and finite_number(r.get("reward_mean")) is not None), key=lambda r: r["step"])


def step_mean(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean over the training rows of a numeric key (rows without a finite value left out)."""
    values = finite_values(r.get(key) for r in training_rows(records))
    return float(values.mean()) if values.size else None


def eval_at(records: Sequence[Mapping[str, Any]], step: int) -> dict[str, float]:
    """The ``eval/<bench>/pass@<k>`` values of the row of ``step`` (empty if it has none)."""
    for r in records:
        if r.get("step") == step:
            return {k: float(v) for k, v in r.items()
                    if k.startswith("eval/") and "/pass@" in k and finite_number(v) is not None}
    return {}


def has_final_eval(records: Sequence[Mapping[str, Any]], step: int) -> bool:
    """The row of ``step`` holds a held-out pass@1 (``eval/<bench>/pass@1``)."""
    return any(k.endswith("/pass@1") for k in eval_at(records, step))


def run_summary(records: Sequence[Mapping[str, Any]], prompts: Sequence[Mapping[str, Any]] | None, *,
                eval_step: int, k: int, threshold: float, window: int, budget: int | None) -> dict[str, Any]:
    """One run's numbers: held-out pass@1 / pass@k (``eval/avg/...`` of the row ``eval_step``), the threshold
    numbers (``rollouts_to_threshold`` None when not reached; ``rollouts_to_threshold_censored`` = that or
    ``budget``), final train reward, the per-step means of the variance ratio / modulation diagnostics / response
    length, the mean token entropy of the first and the last tenth of the steps, the realised variance ratio and
    the zero-advantage share."""
    evals = eval_at(records, eval_step)
    out: dict[str, Any] = {"pass@1": evals.get("eval/avg/pass@1"), f"pass@{k}": evals.get(f"eval/avg/pass@{k}"),
                           "eval": evals}
    train = [dict(r) for r in training_rows(records)]
    if train or eval_step > 0:
        threshold_numbers = summarize_run(train, threshold, window)
        reached = threshold_numbers["rollouts_to_threshold"]
        out.update({key: threshold_numbers[key] for key in ("steps", "total_rollouts", "rollouts_to_threshold",
                                                            "step_reached", "first_reward", "final_reward")})
        out["censored"] = reached is None
        out["rollouts_to_threshold_censored"] = reached if reached is not None else budget
        out["variance_ratio_predicted"] = step_mean(records, "variance_ratio")
        out["response_length_mean"] = step_mean(records, "response_length_mean")
        # the entropy trajectory (GC / UMS act on it): mean token entropy of the first and the last tenth of the steps
        entropy = [float(v) for v in (finite_number(r.get("entropy_mean")) for r in train) if v is not None]
        out["entropy_first"], out["entropy_final"] = head_mean(entropy), tail_mean(entropy)
        keys = list(MODULATION_KEYS)
        for r in train:
            keys.extend(key for key in r if _SHARE_KEY.match(key) and key not in keys)
        out["modulation"] = {key: step_mean(records, key) for key in keys}
    rows = list(prompts or [])
    out["variance_ratio_realised"] = realised_variance_ratio(rows)["mean"] if rows else None
    out["zero_advantage_share"] = zero_advantage_share(rows) if rows else None
    return out
