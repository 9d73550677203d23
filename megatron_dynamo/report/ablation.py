"""``dynamo ablate``'s analysis: run summaries aggregated over seeds (:func:`analyse`), for the ablation of DynaMO's
parts (paper Table 2) and the baselines of the paper's Table 1.

The parts, one module each (numpy only; nothing of the trainer, Megatron or vLLM: testable without training):
:mod:`~megatron_dynamo.report.ablation_variants` (what a variant is, the groups of ``--variants``),
:mod:`~megatron_dynamo.report.ablation_stats` (bootstrap CIs, paired and marginal effects, the variance ratio, one
run's numbers), :mod:`~megatron_dynamo.report.ablation_tables` (ablation.md), :mod:`~megatron_dynamo.report.
ablation_plot` (ablation.png) and :mod:`~megatron_dynamo.report.paper_tables` (the paper's numbers). The names
``dynamo ablate`` and its tests use are re-exported here.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from megatron_dynamo.report.ablation_plot import plot_ablation
from megatron_dynamo.report.ablation_stats import (bootstrap_ci, eval_at, finite_number, finite_values,
                                                   has_final_eval, marginal_effect, paired_differences,
                                                   realised_variance_ratio, run_summary, training_rows,
                                                   zero_advantage_share)
from megatron_dynamo.report.ablation_tables import (diagnostics_table, effects_table, format_markdown, main_table,
                                                    table1_table)
from megatron_dynamo.report.ablation_variants import (BASELINES, COMPONENTS, DEFAULT_GROUP, GROUPS, PAPER_ORDER, SFT,
                                                      SFT_LABEL, TABLE1_ORDER, VARIANTS, parse_variants)
from megatron_dynamo.report.paper_tables import PAPER_AVG

__all__ = ["BASELINES", "DEFAULT_GROUP", "GROUPS", "PAPER_AVG", "PAPER_ORDER", "SFT", "TABLE1_ORDER", "VARIANTS", "analyse",
           "bootstrap_ci", "diagnostics_table", "effects_table", "eval_at", "format_markdown", "has_final_eval",
           "main_table", "marginal_effect", "paired_differences", "parse_variants", "plot_ablation",
           "realised_variance_ratio", "run_summary", "table1_table", "training_rows", "zero_advantage_share"]


def _ci_of(values: Mapping[int, Any], resamples: int, seed: int, confidence: float = 0.95) -> dict[str, Any]:
    ci = bootstrap_ci([values[s] for s in sorted(values)], resamples=resamples, confidence=confidence, seed=seed)
    ci["per_seed"] = {int(s): finite_number(v) for s, v in sorted(values.items())}
    return ci


def analyse(summaries: Mapping[tuple[str, int], Mapping[str, Any]], variants: Sequence[str], seeds: Sequence[int],
            *, k: int, resamples: int = 10000, seed: int = 0, confidence: float = 0.95) -> dict[str, Any]:
    """Aggregate run summaries ({(variant or "sft", seed): :func:`run_summary` of a finished run}) over seeds.

    Per variant: mean [CI] of pass@1, pass@k (the benchmarks' mean, and per benchmark), final reward, rollouts to threshold (censored as the budget, with
    the number of censored seeds), predicted / realised variance ratio, zero-advantage share, and per-step means of
    the modulation diagnostics and response length (mean over seeds), and the mean token entropy of the first and the
    last tenth of the steps. Paired by seed: each variant - GRPO (pass@1,
    pass@k), DynaMO - GRPO, power 0.5 - power 1, and the marginal effects of DRA, GC and UMS.
    """
    metrics = ("pass@1", f"pass@{k}")

    def ci(values: Mapping[int, Any]) -> dict[str, Any]:
        return _ci_of(values, resamples, seed, confidence)

    def per_seed(name: str, key: str) -> dict[int, Any]:
        return {s: summaries[(name, s)].get(key) for s in seeds if (name, s) in summaries
                and summaries[(name, s)].get(key) is not None}

    def per_seed_eval(name: str, key: str) -> dict[int, Any]:
        return {s: summaries[(name, s)]["eval"][key] for s in seeds if (name, s) in summaries
                and key in (summaries[(name, s)].get("eval") or {})}

    # the held-out benchmarks (eval/<bench>/pass@<k> of the final rows), in order of appearance; "avg" is the mean
    benchmarks: list[str] = []
    for summary in summaries.values():
        for key in summary.get("eval") or {}:
            bench = key.split("/")[1]
            if bench != "avg" and bench not in benchmarks:
                benchmarks.append(bench)
    names = list(variants) + ([SFT] if any((SFT, s) in summaries for s in seeds) else [])
    per_variant: dict[str, Any] = {}
    for name in names:
        entry: dict[str, Any] = {"label": SFT_LABEL if name == SFT else VARIANTS[name].label,
                                 "runs": sum((name, s) in summaries for s in seeds)}
        for key in (*metrics, "final_reward", "variance_ratio_predicted", "variance_ratio_realised",
                    "zero_advantage_share", "response_length_mean", "entropy_first", "entropy_final"):
            entry[key] = ci(per_seed(name, key))
        entry["benchmarks"] = {bench: {m: ci(per_seed_eval(name, f"eval/{bench}/{m}"))
                                       for m in metrics} for bench in benchmarks}
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
                values = finite_values(summaries[(name, s)].get("modulation", {}).get(key) for s in seeds
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
    return {"k": k, "seeds": list(seeds), "variants": list(variants), "benchmarks": benchmarks,
            "bootstrap_resamples": resamples,
            "bootstrap_seed": seed, "bootstrap_confidence": confidence, "per_variant": per_variant, "effects": effects,
            "paper_marginal_avg": {c: _paper_marginal(c) for c in COMPONENTS}}


def _paper_marginal(component: str) -> float:
    """The same marginal effect computed from the paper's Table 2 "Avg." column (pass@1 points, 7B)."""
    effect = marginal_effect({name: {0: value} for name, value in PAPER_AVG.items()}, component)
    return round(effect["per_seed"][0], 3)
