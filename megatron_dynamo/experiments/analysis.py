"""The Analysis stage of an ablation: the collected run summaries aggregated over seeds (:func:`analyse`), for the
ablation of DynaMO's parts (paper Table 2) and the baselines of the paper's Table 1. numpy only (through
:mod:`~megatron_dynamo.experiments.stats`): testable without training. ablation.md renders it
(:mod:`~megatron_dynamo.experiments.tables`), ablation.png plots it (:mod:`~megatron_dynamo.experiments.plot`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from megatron_dynamo.experiments.paper import PAPER_AVG
from megatron_dynamo.experiments.stats import (bootstrap_ci, finite_number, finite_values, marginal_effect,
                                               paired_differences)
from megatron_dynamo.experiments.variants import COMPONENTS, SFT, SFT_LABEL, VARIANTS

#: The per-seed numbers of :func:`~megatron_dynamo.experiments.stats.run_summary` each variant gets a CI of.
SUMMARY_KEYS = ("final_reward", "variance_ratio_predicted", "variance_ratio_realised", "zero_advantage_share",
                "response_length_mean", "entropy_first", "entropy_final")
#: Paired contrasts besides the marginal effects: label -> (variant, reference).
CONTRASTS = {"dynamo - grpo": ("dynamo", "grpo"), "power 0.5 - power 1.0": ("dynamo-p0.5", "dynamo")}


@dataclass(frozen=True)
class Summaries:
    """The run summaries ({(variant or "sft", seed): summary}) over ``seeds``, with the CI settings."""

    runs: Mapping[tuple[str, int], Mapping[str, Any]]
    seeds: Sequence[int]
    resamples: int
    seed: int
    confidence: float

    def ci(self, values: Mapping[int, Any]) -> dict[str, Any]:
        """Bootstrap mean [CI] of per-seed values, the values kept under ``per_seed``."""
        ci = bootstrap_ci([values[s] for s in sorted(values)], resamples=self.resamples,
                          confidence=self.confidence, seed=self.seed)
        ci["per_seed"] = {int(s): finite_number(v) for s, v in sorted(values.items())}
        return ci

    def of(self, name: str) -> list[tuple[int, Mapping[str, Any]]]:
        return [(s, self.runs[(name, s)]) for s in self.seeds if (name, s) in self.runs]

    def per_seed(self, name: str, key: str) -> dict[int, Any]:
        return {s: r.get(key) for s, r in self.of(name) if r.get(key) is not None}

    def per_seed_eval(self, name: str, key: str) -> dict[int, Any]:
        return {s: r["eval"][key] for s, r in self.of(name) if key in (r.get("eval") or {})}

    def benchmarks(self) -> list[str]:
        """The held-out benchmarks (eval/<bench>/pass@<k> of the final rows), in order of appearance."""
        found: list[str] = []
        for summary in self.runs.values():
            for key in summary.get("eval") or {}:
                bench = key.split("/")[1]
                if bench != "avg" and bench not in found:
                    found.append(bench)
        return found


def _modulation(data: Summaries, name: str) -> dict[str, float | None]:
    """Per-step means of the modulation diagnostics, the mean over seeds."""
    keys = list(dict.fromkeys(key for _, r in data.of(name) for key in r.get("modulation", {})))
    means = {}
    for key in keys:
        values = finite_values(r.get("modulation", {}).get(key) for _, r in data.of(name))
        means[key] = float(values.mean()) if values.size else None
    return means


def _variant_entry(data: Summaries, name: str, variants: Sequence[str], metrics: Sequence[str],
                   benchmarks: Sequence[str]) -> dict[str, Any]:
    entry: dict[str, Any] = {"label": SFT_LABEL if name == SFT else VARIANTS[name].label, "runs": len(data.of(name))}
    for key in (*metrics, *SUMMARY_KEYS):
        entry[key] = data.ci(data.per_seed(name, key))
    entry["benchmarks"] = {bench: {m: data.ci(data.per_seed_eval(name, f"eval/{bench}/{m}")) for m in metrics}
                           for bench in benchmarks}
    if name != SFT:
        entry["rollouts_to_threshold"] = data.ci(data.per_seed(name, "rollouts_to_threshold_censored"))
        entry["rollouts_to_threshold"]["censored"] = sum(bool(r.get("censored")) for _, r in data.of(name))
        entry["modulation"] = _modulation(data, name)
    if "grpo" in variants and name != "grpo":
        entry["delta_vs_grpo"] = {m: data.ci(paired_differences(data.per_seed(name, m), data.per_seed("grpo", m)))
                                  for m in metrics}
    return entry


def _effects(data: Summaries, variants: Sequence[str], metrics: Sequence[str]) -> dict[str, Any]:
    """The marginal effects of DRA, GC and UMS, and the paired :data:`CONTRASTS`."""
    values = {m: {name: data.per_seed(name, m) for name in variants} for m in metrics}
    effects: dict[str, Any] = {}
    for component in COMPONENTS:
        effects[component] = {}
        for m in metrics:
            effect = marginal_effect(values[m], component)
            effects[component][m] = {**data.ci(effect["per_seed"]), "missing": effect["missing"],
                                     "simple_effects": {p: {int(s): v for s, v in d.items()}
                                                        for p, d in effect["simple_effects"].items()}}
    for label, (a, b) in CONTRASTS.items():
        present = a in variants and b in variants
        effects[label] = {m: {**data.ci(paired_differences(values[m].get(a, {}), values[m].get(b, {}))
                                        if present else {}),
                              "missing": [v for v in (a, b) if v not in variants]} for m in metrics}
    return effects


def analyse(summaries: Mapping[tuple[str, int], Mapping[str, Any]], variants: Sequence[str], seeds: Sequence[int],
            *, k: int, resamples: int = 10000, seed: int = 0, confidence: float = 0.95) -> dict[str, Any]:
    """Aggregate run summaries ({(variant or "sft", seed): :func:`~megatron_dynamo.experiments.stats.run_summary`
    of a finished run}) over seeds.

    Per variant: mean [CI] of pass@1, pass@k (the benchmarks' mean, and per benchmark), final reward, rollouts to
    threshold (censored as the budget, with the number of censored seeds), predicted / realised variance ratio,
    zero-advantage share, and per-step means of the modulation diagnostics and response length (mean over seeds),
    and the mean token entropy of the first and the last tenth of the steps. Paired by seed: each variant - GRPO
    (pass@1, pass@k), DynaMO - GRPO, power 0.5 - power 1, and the marginal effects of DRA, GC and UMS.
    """
    data = Summaries(summaries, seeds, resamples, seed, confidence)
    metrics = ("pass@1", f"pass@{k}")
    benchmarks = data.benchmarks()
    names = list(variants) + ([SFT] if any((SFT, s) in summaries for s in seeds) else [])
    per_variant = {name: _variant_entry(data, name, variants, metrics, benchmarks) for name in names}
    return {"k": k, "seeds": list(seeds), "variants": list(variants), "benchmarks": benchmarks,
            "bootstrap_resamples": resamples, "bootstrap_seed": seed, "bootstrap_confidence": confidence,
            "per_variant": per_variant, "effects": _effects(data, variants, metrics),
            "paper_marginal_avg": {c: _paper_marginal(c) for c in COMPONENTS}}


def _paper_marginal(component: str) -> float:
    """The same marginal effect computed from the paper's Table 2 "Avg." column (pass@1 points, 7B)."""
    effect = marginal_effect({name: {0: value} for name, value in PAPER_AVG.items()}, component)
    return round(effect["per_seed"][0], 3)
