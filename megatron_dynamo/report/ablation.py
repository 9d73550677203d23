"""Statistics and tables of ``dynamo ablate``: the DynaMO ablation (paper Table 2) over seeds.

Pure functions on numbers, metric records and prompt rows (numpy; matplotlib only inside :func:`plot_ablation`):
nothing of the trainer, Megatron or vLLM is imported, so the analysis is testable without training.

Statistics (all over seeds; a seed is one replicate: every variant of a seed starts from the same SFT policy):

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
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from megatron_dynamo.report.thresholds import summarize_run


# ---------------------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class AblationVariant:
    name: str
    dra: bool
    gc: bool
    ums: bool
    power: float
    label: str  # the paper's row label (Table 2)

    def overrides(self) -> tuple[str, ...]:
        """The four explicit train overrides of the variant."""
        b = lambda v: "true" if v else "false"  # noqa: E731
        return (f"dynamo.allocation.enabled={b(self.dra)}", f"dynamo.modulation.gc={b(self.gc)}",
                f"dynamo.modulation.ums={b(self.ums)}", f"dynamo.allocation.power={self.power:.1f}")


# CLI order (and --variants default): GRPO, singles, pairs, DynaMO, DynaMO with power 0.5.
VARIANTS: dict[str, AblationVariant] = {v.name: v for v in (
    AblationVariant("grpo", False, False, False, 1.0, "GRPO (w/o ALL)"),
    AblationVariant("dra", True, False, False, 1.0, "w/o GC & UMS"),
    AblationVariant("gc", False, True, False, 1.0, "w/o UMS & DRA"),
    AblationVariant("ums", False, False, True, 1.0, "w/o GC & DRA"),
    AblationVariant("dra+gc", True, True, False, 1.0, "w/o UMS"),
    AblationVariant("dra+ums", True, False, True, 1.0, "w/o GC"),
    AblationVariant("gc+ums", False, True, True, 1.0, "w/o DRA"),
    AblationVariant("dynamo", True, True, True, 1.0, "DynaMO"),
    AblationVariant("dynamo-p0.5", True, True, True, 0.5, "DynaMO, power 0.5"),
)}
SFT = "sft"
SFT_LABEL = "SFT start"
# Rows of the paper's Table 2, in its order, then ours.
PAPER_ORDER = ("dynamo", "dra+ums", "dra+gc", "gc+ums", "ums", "dra", "gc", "grpo", "dynamo-p0.5")
# The paper's Table 2 "Avg." column (pass@1 %, Qwen2.5-Math-7B, six benchmarks): a reference, not our numbers.
PAPER_AVG = {"dynamo": 41.6, "dra+ums": 40.3, "dra+gc": 40.1, "gc+ums": 39.9, "ums": 38.9, "dra": 38.4,
             "gc": 37.6, "grpo": 37.2}
COMPONENTS = ("dra", "gc", "ums")
COMPONENT_LABELS = {"dra": "DRA", "gc": "GC", "ums": "UMS"}
# Per-step diagnostics averaged per run, then over seeds (docs/metrics.md).
MODULATION_KEYS = ("modulation/scale_mean", "modulation/scale_p10", "modulation/scale_p90",
                   "modulation/beta_stab_mean", "modulation/beta_stab_min", "modulation/beta_comp_mean_pos")
_SHARE_KEY = re.compile(r"^modulation/.*(_frac|_share|share_).*$")


def parse_variants(text: str) -> list[str]:
    """``--variants``: comma-separated names of :data:`VARIANTS` (in the given order), distinct."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(map(repr, unknown))}: choose from {', '.join(VARIANTS)}")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--variants must list distinct variants, got {text!r}")
    return names


def variant_with(dra: bool, gc: bool, ums: bool) -> str:
    """The power-1 variant with these components on."""
    for v in VARIANTS.values():
        if (v.dra, v.gc, v.ums, v.power) == (dra, gc, ums, 1.0):
            return v.name
    raise KeyError((dra, gc, ums))


# ---------------------------------------------------------------------------------------------- statistics
def _finite(values: Iterable[Any]) -> np.ndarray:
    out = [float(v) for v in values if _num(v) is not None]
    return np.asarray(out, dtype=np.float64)


def _num(value: Any) -> float | None:
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
    x = _finite(values)
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
        x, y = _num(a[seed]), _num(b[seed])
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
        count, correct = _num(row.get("count")), _num(row.get("correct"))
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
        count, correct = _num(row.get("count")), _num(row.get("correct"))
        if count is None or correct is None or count <= 0:
            continue
        total += 1
        zero += correct <= 0 or correct >= count
    return zero / total if total else None


# ---------------------------------------------------------------------------------------------- one run
def training_rows(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows of training steps (step >= 1 with a reward), in step order."""
    return sorted((r for r in records if isinstance(r.get("step"), int) and r["step"] >= 1
                   and _num(r.get("reward_mean")) is not None), key=lambda r: r["step"])


def step_mean(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean over the training rows of a numeric key (rows without a finite value left out)."""
    values = _finite(r.get(key) for r in training_rows(records))
    return float(values.mean()) if values.size else None


def eval_at(records: Sequence[Mapping[str, Any]], step: int) -> dict[str, float]:
    """The ``eval/<bench>/pass@<k>`` values of the row of ``step`` (empty if it has none)."""
    for r in records:
        if r.get("step") == step:
            return {k: float(v) for k, v in r.items()
                    if k.startswith("eval/") and "/pass@" in k and _num(v) is not None}
    return {}


def has_final_eval(records: Sequence[Mapping[str, Any]], step: int) -> bool:
    """The row of ``step`` holds a held-out pass@1 (``eval/<bench>/pass@1``)."""
    return any(k.endswith("/pass@1") for k in eval_at(records, step))


def run_summary(records: Sequence[Mapping[str, Any]], prompts: Sequence[Mapping[str, Any]] | None, *,
                eval_step: int, k: int, threshold: float, window: int, budget: int | None) -> dict[str, Any]:
    """One run's numbers: held-out pass@1 / pass@k (``eval/avg/...`` of the row ``eval_step``), the threshold
    numbers (``rollouts_to_threshold`` None when not reached; ``rollouts_to_threshold_censored`` = that or
    ``budget``), final train reward, the per-step means of the variance ratio / modulation diagnostics / response
    length, the realised variance ratio and the zero-advantage share."""
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
        keys = list(MODULATION_KEYS)
        for r in train:
            keys.extend(key for key in r if _SHARE_KEY.match(key) and key not in keys)
        out["modulation"] = {key: step_mean(records, key) for key in keys}
    rows = list(prompts or [])
    out["variance_ratio_realised"] = realised_variance_ratio(rows)["mean"] if rows else None
    out["zero_advantage_share"] = zero_advantage_share(rows) if rows else None
    return out


# ---------------------------------------------------------------------------------------------- aggregation
def _ci_of(values: Mapping[int, Any], resamples: int, seed: int, confidence: float = 0.95) -> dict[str, Any]:
    ci = bootstrap_ci([values[s] for s in sorted(values)], resamples=resamples, confidence=confidence, seed=seed)
    ci["per_seed"] = {int(s): _num(v) for s, v in sorted(values.items())}
    return ci


def analyse(summaries: Mapping[tuple[str, int], Mapping[str, Any]], variants: Sequence[str], seeds: Sequence[int],
            *, k: int, resamples: int = 10000, seed: int = 0, confidence: float = 0.95) -> dict[str, Any]:
    """Aggregate run summaries ({(variant or "sft", seed): :func:`run_summary` of a finished run}) over seeds.

    Per variant: mean [CI] of pass@1, pass@k, final reward, rollouts to threshold (censored as the budget, with
    the number of censored seeds), predicted / realised variance ratio, zero-advantage share, and per-step means of
    the modulation diagnostics and response length (mean over seeds). Paired by seed: each variant - GRPO (pass@1,
    pass@k), DynaMO - GRPO, power 0.5 - power 1, and the marginal effects of DRA, GC and UMS.
    """
    metrics = ("pass@1", f"pass@{k}")

    def ci(values: Mapping[int, Any]) -> dict[str, Any]:
        return _ci_of(values, resamples, seed, confidence)

    def per_seed(name: str, key: str) -> dict[int, Any]:
        return {s: summaries[(name, s)].get(key) for s in seeds if (name, s) in summaries
                and summaries[(name, s)].get(key) is not None}

    names = list(variants) + ([SFT] if any((SFT, s) in summaries for s in seeds) else [])
    per_variant: dict[str, Any] = {}
    for name in names:
        entry: dict[str, Any] = {"label": SFT_LABEL if name == SFT else VARIANTS[name].label,
                                 "runs": sum((name, s) in summaries for s in seeds)}
        for key in (*metrics, "final_reward", "variance_ratio_predicted", "variance_ratio_realised",
                    "zero_advantage_share", "response_length_mean"):
            entry[key] = ci(per_seed(name, key))
        if name != SFT:
            entry["rollouts_to_threshold"] = ci(per_seed(name, "rollouts_to_threshold_censored"))
            entry["rollouts_to_threshold"]["censored"] = sum(
                bool(summaries[(name, s)].get("censored")) for s in seeds if (name, s) in summaries)
            modulation_keys: list[str] = []
            for s in seeds:
                for key in (summaries.get((name, s)) or {}).get("modulation", {}):
                    if key not in modulation_keys:
                        modulation_keys.append(key)
            entry["modulation"] = {}
            for key in modulation_keys:
                values = _finite(summaries[(name, s)].get("modulation", {}).get(key) for s in seeds
                                 if (name, s) in summaries)
                entry["modulation"][key] = float(values.mean()) if values.size else None
        if "grpo" in variants and name != "grpo":
            entry["delta_vs_grpo"] = {m: ci(paired_differences(per_seed(name, m), per_seed("grpo", m)))
                                      for m in metrics}
        per_variant[name] = entry

    values = {m: {name: per_seed(name, m) for name in variants} for m in metrics}
    effects: dict[str, Any] = {}
    for component in COMPONENTS:
        effects[component] = {}
        for m in metrics:
            effect = marginal_effect(values[m], component)
            effects[component][m] = {**ci(effect["per_seed"]), "missing": effect["missing"],
                                     "simple_effects": {p: {int(s): v for s, v in d.items()}
                                                        for p, d in effect["simple_effects"].items()}}
    for label, (a, b) in (("dynamo - grpo", ("dynamo", "grpo")), ("power 0.5 - power 1.0", ("dynamo-p0.5", "dynamo"))):
        effects[label] = {}
        for m in metrics:
            present = a in variants and b in variants
            diff = paired_differences(values[m].get(a, {}), values[m].get(b, {})) if present else {}
            effects[label][m] = {**ci(diff),
                                 "missing": [v for v in (a, b) if v not in variants]}
    return {"k": k, "seeds": list(seeds), "variants": list(variants), "bootstrap_resamples": resamples,
            "bootstrap_seed": seed, "bootstrap_confidence": confidence, "per_variant": per_variant, "effects": effects,
            "paper_marginal_avg": {c: _paper_marginal(c) for c in COMPONENTS}}


def _paper_marginal(component: str) -> float:
    """The same marginal effect computed from the paper's Table 2 "Avg." column (pass@1 points, 7B)."""
    effect = marginal_effect({name: {0: value} for name, value in PAPER_AVG.items()}, component)
    return round(effect["per_seed"][0], 3)


# ---------------------------------------------------------------------------------------------- tables
def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:+.1f}" if signed else f"{100 * value:.1f}"


def fmt_ci(ci: Mapping[str, Any] | None, scale: str = "pct", signed: bool = False) -> str:
    """``mean [lo, hi]``: percentages (``pct``), plain numbers with 3 decimals (``num``) or integers (``int``)."""
    if not ci or ci.get("mean") is None:
        return "n/a"
    if scale == "pct":
        f = lambda v: _pct(v, signed)  # noqa: E731
    elif scale == "int":
        f = lambda v: f"{v:.0f}"  # noqa: E731
    else:
        f = lambda v: f"{v:+.3f}" if signed else f"{v:.3f}"  # noqa: E731
    if ci.get("n", 0) <= 1:
        return f"{f(ci['mean'])} (1 seed)" if ci.get("n") == 1 else "n/a"
    return f"{f(ci['mean'])} [{f(ci['lo'])}, {f(ci['hi'])}]"


def _fmt_rollouts(ci: Mapping[str, Any]) -> str:
    if not ci or ci.get("mean") is None:
        return "n/a"
    text = fmt_ci(ci, "int")
    censored = ci.get("censored", 0)
    if censored:
        text = f">= {text} ({censored}/{ci['n']} not reached)"
    return text


def row_order(variants: Sequence[str], with_sft: bool) -> list[str]:
    """The table rows: the paper's order restricted to ``variants``, then the SFT start."""
    return [v for v in PAPER_ORDER if v in variants] + ([SFT] if with_sft else [])


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main_table(analysis: Mapping[str, Any], budget: int | None = None) -> str:
    """Table 1, in the paper's ablation layout: one row per variant (paper order), then the SFT start."""
    k = analysis["k"]
    per = analysis["per_variant"]
    header = ["method", "variant", "runs", "held-out pass@1 (%)", f"held-out pass@{k} (%)",
              "Δ pass@1 vs GRPO (points, paired)", f"rollouts to threshold (budget {budget})" if budget else
              "rollouts to threshold", "final train reward (%)", "paper Avg. pass@1 (%, 7B)"]
    rows = []
    for name in row_order(analysis["variants"], SFT in per):
        e = per[name]
        delta = "0 (reference)" if name == "grpo" else (fmt_ci(e["delta_vs_grpo"]["pass@1"], signed=True)
                                                        if "delta_vs_grpo" in e else "n/a")
        rows.append([e["label"], name if name != SFT else "sft", str(e["runs"]), fmt_ci(e["pass@1"]),
                     fmt_ci(e[f"pass@{k}"]), delta,
                     _fmt_rollouts(e["rollouts_to_threshold"]) if name != SFT else "-",
                     fmt_ci(e["final_reward"]) if name != SFT else "-",
                     f"{PAPER_AVG[name]:.1f}" if name in PAPER_AVG else "-"])
    return _markdown(header, rows)


def effects_table(analysis: Mapping[str, Any]) -> str:
    """Table 2: marginal effects of DRA, GC, UMS; DynaMO - GRPO; power 0.5 - power 1 (paired by seed)."""
    k = analysis["k"]
    header = ["effect", "Δ held-out pass@1 (points)", f"Δ held-out pass@{k} (points)", "seeds",
              "per seed (pass@1)", "paper (Avg., 7B)"]
    rows = []
    labels = {**{c: f"{COMPONENT_LABELS[c]} (mean of 4 pairs)" for c in COMPONENTS},
              "dynamo - grpo": "DynaMO - GRPO", "power 0.5 - power 1.0": "DynaMO power 0.5 - power 1.0"}
    for key, label in labels.items():
        e = analysis["effects"][key]
        p1 = e["pass@1"]
        if p1["missing"] and p1["n"] == 0:
            rows.append([label, "n/a (missing: " + ", ".join(p1["missing"]) + ")", "n/a", "0", "-", "-"])
            continue
        per_seed = " ".join(f"{_pct(v, True)}" for v in p1["per_seed"].values()) or "-"
        paper = analysis["paper_marginal_avg"].get(key)
        if key == "dynamo - grpo":
            paper = PAPER_AVG["dynamo"] - PAPER_AVG["grpo"]
        rows.append([label, fmt_ci(p1, signed=True), fmt_ci(e[f"pass@{k}"], signed=True), str(p1["n"]),
                     per_seed, f"{paper:+.1f}" if paper is not None else "-"])
    return _markdown(header, rows)


def diagnostics_table(analysis: Mapping[str, Any]) -> str:
    """Table 3: eq. 23 variance ratio (predicted, realised), zero-advantage share, modulation diagnostics."""
    per = analysis["per_variant"]
    order = row_order(analysis["variants"], False)
    mod_keys: list[str] = []
    for name in order:
        for key in per[name].get("modulation", {}):
            if key not in mod_keys:
                mod_keys.append(key)
    header = ["variant", "predicted var. ratio (eq. 23)", "realised var. ratio", "zero-adv. groups (%)",
              *[key.removeprefix("modulation/") for key in mod_keys], "response length"]
    rows = []
    for name in order:
        e = per[name]
        mod = e.get("modulation", {})
        rows.append([name, fmt_ci(e["variance_ratio_predicted"], "num"), fmt_ci(e["variance_ratio_realised"], "num"),
                     fmt_ci(e["zero_advantage_share"]),
                     *[f"{mod[key]:.3f}" if mod.get(key) is not None else "-" for key in mod_keys],
                     f"{e['response_length_mean']['mean']:.2f}" if e["response_length_mean"]["mean"] is not None
                     else "-"])
    return _markdown(header, rows)


def format_markdown(analysis: Mapping[str, Any], *, title: str, settings_line: str, budget: int | None) -> str:
    """The three tables with their captions (the page ``ablation.md``)."""
    n = len(analysis["seeds"])
    k = analysis["k"]
    crude = (f"{n} seed(s): means over seeds with {round(100 * analysis['bootstrap_confidence'])}% "
             f"percentile-bootstrap CIs ({analysis['bootstrap_resamples']} resamples, seed "
             f"{analysis['bootstrap_seed']}) in brackets; with so few seeds the bootstrap CI is crude (it cannot "
             "be wider than the seeds' range) and understates the uncertainty.")
    return "\n\n".join([
        f"# {title}", settings_line, crude,
        f"## Table 1: ablation (paper Table 2 layout)\n\nHeld-out pass@1 / pass@{k}: `eval/avg/pass@<k>` of the "
        "final model on the recipe's evaluation benchmarks. Δ: paired by seed (same SFT start). Rollouts to "
        "threshold: censored at the budget when not reached (the mean is then a lower bound, \">=\"). Final "
        "train reward: mean reward_mean of the last tenth of the steps. The last column is the paper's Table 2 "
        "Avg. (Qwen2.5-Math-7B, six benchmarks), for the direction of the effects only.",
        main_table(analysis, budget),
        "## Table 2: effects on held-out pass@k (paired by seed)\n\nMarginal effect of a component: per seed, the "
        "mean over the 4 pairs of power-1 variants that differ only in it of (with - without); n/a when a "
        "variant of a pair is missing. The paper column applies the same formula to its Table 2 Avg. column.",
        effects_table(analysis),
        "## Table 3: eq. 23 variance ratio and advantage modulation\n\nPredicted: mean over steps of the logged "
        "`variance_ratio` (from the prompt history before sampling). Realised: from prompts.jsonl, per step "
        "sum p(1-p)/n_i over sum p(1-p)/n_uniform with each group's own success rate p (1 for a uniform "
        "allocation). Zero-adv. groups: (step, prompt) groups all correct or all wrong. Modulation columns and "
        "response length: means over steps, then over seeds (\"-\": the factor is off in that variant).",
        diagnostics_table(analysis),
    ]) + "\n"


# ---------------------------------------------------------------------------------------------- plot
def plot_ablation(analysis: Mapping[str, Any], path: str, title: str = "DynaMO ablation") -> str:
    """``path`` (PNG): held-out pass@1 per variant with CI error bars (GRPO and SFT start as lines), and the
    paired effects with CIs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = analysis["per_variant"]
    order = row_order(analysis["variants"], False)
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [3, 2]})

    def bar(ax, x, ci, color):
        if ci.get("mean") is None:
            return
        mean = 100 * ci["mean"]
        err = [[mean - 100 * ci["lo"]], [100 * ci["hi"] - mean]]
        ax.errorbar([x], [mean], yerr=err, fmt="o", color=color, capsize=5, markersize=7)

    for i, name in enumerate(order):
        bar(left, i, per[name]["pass@1"], "tab:red" if name.startswith("dynamo") else
            "tab:gray" if name == "grpo" else "tab:blue")
        seeds = [v for v in per[name]["pass@1"].get("per_seed", {}).values() if v is not None]
        left.scatter([i + 0.12] * len(seeds), [100 * v for v in seeds], s=10, color="black", alpha=0.5, zorder=3)
    for name, style, color in (("grpo", "--", "tab:gray"), (SFT, ":", "tab:green")):
        mean = per.get(name, {}).get("pass@1", {}).get("mean")
        if mean is not None:
            left.axhline(100 * mean, linestyle=style, color=color, linewidth=1,
                         label=f"{'GRPO' if name == 'grpo' else SFT_LABEL} mean")
    left.set_xlim(-0.6, len(order) - 0.4)
    left.set_xticks(range(len(order)))
    left.set_xticklabels([f"{per[n]['label']}\n({n})" for n in order], rotation=30, ha="right", fontsize=8)
    left.set_ylabel("held-out pass@1 (%)")
    left.set_title("held-out pass@1: mean, 95% bootstrap CI, seeds (dots)")
    left.grid(alpha=0.3, axis="y")
    if left.get_legend_handles_labels()[0]:
        left.legend(fontsize=8)

    labels, keys = [], []
    for key, label in (("dra", "DRA"), ("gc", "GC"), ("ums", "UMS"), ("dynamo - grpo", "DynaMO - GRPO"),
                       ("power 0.5 - power 1.0", "power 0.5 - 1.0")):
        labels.append(label)
        keys.append(key)
    for i, key in enumerate(keys):
        ci = analysis["effects"][key]["pass@1"]
        if ci.get("mean") is None:
            right.text(i, 0, "n/a", ha="center", va="center", fontsize=8, color="gray")
            continue
        bar(right, i, ci, "tab:purple")
    right.axhline(0, color="black", linewidth=0.8)
    right.set_xlim(-0.6, len(keys) - 0.4)
    right.set_xticks(range(len(keys)))
    right.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    right.set_ylabel("Δ held-out pass@1 (points)")
    right.set_title("paired effects (marginal: mean of 4 pairs)")
    right.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
