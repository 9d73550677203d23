"""The preregistered analyses (docs/ablation.md, "Preregistration" and "The second study"): from ``runs.csv`` to the
tables of docs/results/testbed.md, by one command (``dynamo confirm DIR``).

Everything a preregistration fixes before its runs is a constant here, one :class:`Study` each (:data:`STUDIES`):
the seeds, the runs, the hypotheses (:class:`Hypothesis`: each a contrast, i.e. per seed the mean over its pairs of
variant a - variant b of held-out pass@1, a seed counting only when every pair has it), the test (two-sided paired
Student t, :mod:`~megatron_dynamo.experiments.paired_stats`), the family (all of a study's hypotheses, Holm-adjusted
at :data:`ALPHA`), the decision rules (:func:`verdict`, and the first study's :func:`answers`) and the power plan (the
per-seed variance each test was planned with, and the effects it was powered against). Nothing is estimated from the
data but the numbers in the tables and the power lines (:func:`power_lines`: the realised standard errors against the
planned ones, and the smallest effect each test could detect). Pure numpy/mpmath: no run is read, only the CSV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from megatron_dynamo.experiments.variants import GROUPS, HIGH_LR
from megatron_dynamo.experiments.paired_stats import (detectable_effect, holm, paired_t, paired_t_power,
                                                      seeds_for_power)

ALPHA = 0.05
#: The power every plan aims at, and at which the smallest detectable effect is stated.
POWER = 0.8
#: C1's equivalence margin (points): GC "is" a constant reweighting when the 90% t interval of pos_weight - gc
#: lies inside +-0.3 points (two one-sided tests at 5%), a third of last round's DynaMO - GRPO.
EQUIVALENCE_MARGIN = 0.3
#: C4's precondition (points): the grid is informative only if GRPO at the high lr is at least this much below
#: GRPO at the recipe's lr (paired, seeds 6..13).
DEGRADATION = 1.0


@dataclass(frozen=True)
class Hypothesis:
    key: str
    question: str
    pairs: tuple[tuple[str, str], ...]  # per seed: mean over the pairs of pass@1(a) - pass@1(b)
    seeds: tuple[int, ...] | None = None  # None: the study's seeds
    prediction: float | None = None  # points: the paper's effect scaled to this testbed (0.13x), where stated


@dataclass(frozen=True)
class Study:
    """One preregistered experiment on the mechanism testbed: what its preregistration fixed."""

    key: str
    raw_data: str  # where its raw data is committed (the repository path)
    seeds: tuple[int, ...]
    runs: tuple[tuple[str, tuple[int, ...]], ...]  # (variant group of experiments/variants.py, its seeds)
    hypotheses: tuple[Hypothesis, ...]
    #: per test: the per-seed variance of its contrast the power plan assumed (points^2), and the effects (points)
    #: it was powered against
    planned_variance: Mapping[str, float]
    planned_effects: Mapping[str, tuple[float, ...]]
    descriptive: tuple[Hypothesis, ...] = ()
    answers: Callable[[Mapping, Mapping], dict[str, str]] | None = field(default=None, compare=False)

    def seeds_of(self, hypothesis: Hypothesis) -> tuple[int, ...]:
        return hypothesis.seeds if hypothesis.seeds is not None else self.seeds

    def preregistered_runs(self) -> list[tuple[str, int]]:
        """(variant, seed) of every preregistered run, seed-major (each seed's runs together)."""
        seeds = sorted({s for _, group_seeds in self.runs for s in group_seeds})
        return [(v, seed) for seed in seeds for group, group_seeds in self.runs if seed in group_seeds
                for v in GROUPS[group]]


def _marginal(on: Sequence[str], off: Sequence[str]) -> tuple[tuple[str, str], ...]:
    return tuple(zip(on, off))


H1 = Hypothesis("H1", "DynaMO - GRPO (primary)", (("dynamo", "grpo"),))
DRA_MARGINAL = _marginal(("dra", "dra+gc", "dra+ums", "dynamo"), ("grpo", "gc", "ums", "gc+ums"))
HIGH_LR_SEEDS = tuple(range(6, 14))

#: The first study (issue 32): the confirmatory replication, seeds 6..15, ten tests.
REPLICATION_HYPOTHESES: tuple[Hypothesis, ...] = (
    H1,
    Hypothesis("H2", "DRA, marginal", DRA_MARGINAL, prediction=0.22),
    Hypothesis("H3", "GC, marginal", _marginal(("gc", "dra+gc", "gc+ums", "dynamo"), ("grpo", "dra", "ums", "dra+ums")),
               prediction=0.14),
    Hypothesis("H4", "UMS, marginal", _marginal(("ums", "dra+ums", "gc+ums", "dynamo"), ("grpo", "dra", "gc", "dra+gc")),
               prediction=0.25),
    Hypothesis("C1", "constant positive weight - GC", (("pos_weight", "gc"),)),
    Hypothesis("C2a", "DRA's allocation, prompts weighted equally - GRPO", (("dra-equal", "grpo"),)),
    Hypothesis("C2b", "DRA - DRA with prompts weighted equally (its reweighting)", (("dra", "dra-equal"),)),
    Hypothesis("C3a", "GRPO + dynamic sampling - GRPO", (("grpo+ds", "grpo"),)),
    Hypothesis("C3b", "DynaMO + dynamic sampling - DynaMO", (("dynamo+ds", "dynamo"),)),
    Hypothesis("C4", f"UMS at lr {HIGH_LR}, marginal over GC", _marginal(("ums-hlr", "gc+ums-hlr"), ("grpo-hlr", "gc-hlr")),
               seeds=HIGH_LR_SEEDS),
)
#: Reported beside, not tested: C4's precondition and GC's marginal effect at the high lr.
REPLICATION_DESCRIPTIVE: tuple[Hypothesis, ...] = (
    Hypothesis("D1", f"GRPO at lr {HIGH_LR} - GRPO (C4's precondition)", (("grpo-hlr", "grpo"),), seeds=HIGH_LR_SEEDS),
    Hypothesis("D2", f"GC at lr {HIGH_LR}, marginal over UMS", _marginal(("gc-hlr", "gc+ums-hlr"), ("grpo-hlr", "ums-hlr")),
               seeds=HIGH_LR_SEEDS),
)
# The first study's power plan (docs/ablation.md, Preregistration), from the 2026-11-25 testbed run: the evaluation
# noise of one paired difference, 0.236 points^2 at 1000 problems x 8, x 1000/1500 at 1500 problems, and no training
# variance (all of that run's seed-to-seed spread was evaluation noise); a marginal effect's measured per-seed
# variance (5 seeds: DRA 0.155, GC 0.068, UMS 0.075 points^2 at 1000 problems), x 2/3; C4 two paired differences.
_PAIR = 0.236 * 1000 / 1500
REPLICATION_PLAN = {"H1": _PAIR, "H2": 0.155 * 2 / 3, "H3": 0.068 * 2 / 3, "H4": 0.075 * 2 / 3,
                    **{k: _PAIR for k in ("C1", "C2a", "C2b", "C3a", "C3b")}, "C4": _PAIR / 2}
REPLICATION_EFFECTS = {"H1": (0.3, 0.57), "H2": (0.22, 0.6), "H3": (0.14, 0.3), "H4": (0.25, 0.3),
                       **{k: (0.3, 0.5) for k in ("C1", "C2a", "C2b", "C3a", "C3b", "C4")}}

#: The second study (issue 55): H1 with the seeds its first estimate needs, DRA's marginal effect beside it.
#: Its seed count is :func:`second_study_seeds` of the first study's raw data (19), fixed here before its runs.
SECOND_STUDY_SEEDS = tuple(range(16, 35))
# Its power plan: the first study's realised per-seed variances of H1 and H2 (points^2, benchmarks/results/
# confirmatory/runs.csv; :func:`second_study_plan`), against the first study's estimates of each.
SECOND_PLAN = {"H1": 0.4943, "H2": 0.0809}
SECOND_EFFECTS = {"H1": (0.48,), "H2": (0.22,)}


def per_seed_contrast(pass1: Mapping[tuple[str, int], float], hypothesis: Hypothesis,
                      seeds: Sequence[int] | None = None) -> dict[int, float]:
    """Per seed (``seeds``, else the hypothesis's own), the mean over its pairs of pass@1(a) - pass@1(b), in points;
    a seed counts only when every variant of every pair has a value for it."""
    out = {}
    for seed in seeds if seeds is not None else (hypothesis.seeds or ()):
        if all((v, seed) in pass1 for pair in hypothesis.pairs for v in pair):
            diffs = [pass1[(a, seed)] - pass1[(b, seed)] for a, b in hypothesis.pairs]
            out[seed] = 100 * sum(diffs) / len(diffs)
    return out


def verdict(result: Mapping[str, Any], hypothesis: Hypothesis) -> str:
    """The preregistered decision of one test: "positive" / "negative" where the Holm-adjusted p is below
    :data:`ALPHA` (by the sign of the estimate), else "not resolved"; a stated prediction outside the 95% interval
    is said too."""
    if result["n"] < 2 or result["p_holm"] is None:
        return f"no test ({result['n']} seed(s))"
    if result["p_holm"] < ALPHA:
        text = "positive" if result["mean"] > 0 else "negative"
    else:
        text = "not resolved"
    if hypothesis.prediction is not None and result["lo"] is not None:
        if result["hi"] < hypothesis.prediction:
            text += f"; below the scaled paper prediction +{hypothesis.prediction:.2f}"
        elif result["lo"] > hypothesis.prediction:
            text += f"; above the scaled paper prediction +{hypothesis.prediction:.2f}"
    return text


def missing_runs(rows: Sequence[Mapping[str, Any]], study: Study) -> list[tuple[str, int]]:
    """The preregistered runs of ``study`` that ``rows`` lack (a row without its pass@1 counts as missing)."""
    present = {(r["variant"], int(r["seed"])) for r in rows if r.get("pass1") is not None}
    return [run for run in study.preregistered_runs() if run not in present]


def analyse_runs(rows: Sequence[Mapping[str, Any]], study: Study) -> dict[str, Any]:
    """Every hypothesis's per-seed values, paired t (95%), Holm-adjusted p and verdict; C1's 90% interval (where
    the study has C1); the descriptive contrasts; the controls' answers (the first study); the power lines."""
    pass1 = {(r["variant"], int(r["seed"])): float(r["pass1"]) for r in rows if r.get("pass1") is not None}
    tests = {}
    for h in study.hypotheses:
        values = per_seed_contrast(pass1, h, study.seeds_of(h))
        tests[h.key] = {"per_seed": values, **paired_t(values)}
    adjusted = holm({key: t["p"] for key, t in tests.items()})
    for h in study.hypotheses:
        tests[h.key]["p_holm"] = adjusted[h.key]
        tests[h.key]["verdict"] = verdict(tests[h.key], h)
    if "C1" in tests:
        tests["C1"]["ci90"] = paired_t(tests["C1"]["per_seed"], confidence=0.90)
    descriptive = {h.key: {"per_seed": (v := per_seed_contrast(pass1, h, study.seeds_of(h))), **paired_t(v)}
                   for h in study.descriptive}
    return {"tests": tests, "descriptive": descriptive,
            "answers": study.answers(tests, descriptive) if study.answers else {},
            "power": power_lines(tests, study)}


def power_lines(tests: Mapping[str, Mapping[str, Any]], study: Study) -> dict[str, dict[str, Any]]:
    """Per test, what its design could resolve as realised: the planned standard error (the plan's per-seed
    variance over the seeds in), the realised one, the smallest effect the test detects with :data:`POWER` at
    :data:`ALPHA` and at Holm's first threshold (ALPHA / tests), and its power against the planned effects, each
    at the realised standard error."""
    out = {}
    m = len(study.hypotheses)
    for h in study.hypotheses:
        t = tests[h.key]
        if t["n"] < 2 or not t["se"]:
            continue
        df = t["n"] - 1
        planned = math.sqrt(study.planned_variance[h.key] / t["n"])
        out[h.key] = {"n": t["n"], "planned_se": planned, "se": t["se"], "ratio": t["se"] / planned,
                      "detectable": detectable_effect(t["se"], df, POWER, ALPHA),
                      "detectable_holm": detectable_effect(t["se"], df, POWER, ALPHA / m),
                      "power": {effect: paired_t_power(effect, t["se"], df, ALPHA)
                                for effect in study.planned_effects[h.key]}}
    return out


def second_study_plan(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """The second study's design from the first study's raw data: per test (H1, H2) the realised per-seed variance
    and estimate, and the seeds for :data:`POWER` against that estimate at :data:`ALPHA` (two-sided paired t)."""
    pass1 = {(r["variant"], int(r["seed"])): float(r["pass1"]) for r in rows if r.get("pass1") is not None}
    out = {}
    for h in REPLICATION_HYPOTHESES[:2]:
        values = list(per_seed_contrast(pass1, h, REPLICATION.seeds_of(h)).values())
        result = paired_t(values)
        variance = result["se"] ** 2 * result["n"]
        out[h.key] = {"variance": variance, "estimate": result["mean"],
                      "seeds": seeds_for_power(variance, result["mean"], POWER, ALPHA)}
    return out


def _decided(test: Mapping[str, Any], sign: int) -> bool:
    return test["p_holm"] is not None and test["p_holm"] < ALPHA and sign * test["mean"] > 0


def answers(tests: Mapping[str, Mapping[str, Any]], descriptive: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The first study's controls' questions, answered by its preregistered rules (docs/ablation.md)."""
    out = {}
    c1 = tests["C1"]
    ci90 = c1.get("ci90") or {}
    if ci90.get("lo") is not None and -EQUIVALENCE_MARGIN < ci90["lo"] and ci90["hi"] < EQUIVALENCE_MARGIN:
        out["Is GC a constant positive:negative reweighting?"] = (
            f"yes: pos_weight - gc lies within +-{EQUIVALENCE_MARGIN} points (90% interval)")
    elif _decided(c1, 1) or _decided(c1, -1):
        out["Is GC a constant positive:negative reweighting?"] = "no: pos_weight and GC differ (Holm)"
    else:
        out["Is GC a constant positive:negative reweighting?"] = "not resolved (neither equivalent nor different)"
    variance, curriculum = _decided(tests["C2a"], 1), _decided(tests["C2b"], 1)
    out["Is DRA's gain variance reduction or curriculum?"] = {
        (True, False): "variance reduction: DRA's allocation helps with equal prompt weights, its reweighting adds "
                       "nothing resolved",
        (False, True): "curriculum: the reweighting carries the gain, the allocation alone does not",
        (True, True): "both: the allocation helps and its reweighting adds to it",
        (False, False): "not resolved"}[(variance, curriculum)]
    d1 = descriptive["D1"]
    if d1["mean"] is None or d1["mean"] > -DEGRADATION:
        out[f"Does UMS stabilise GRPO at lr {HIGH_LR}?"] = (
            f"uninformative: GRPO did not degrade by {DEGRADATION} point(s) at that lr (precondition D1)")
    else:
        out[f"Does UMS stabilise GRPO at lr {HIGH_LR}?"] = (
            "yes" if _decided(tests["C4"], 1) else "no: UMS makes it worse" if _decided(tests["C4"], -1)
            else "not resolved")
    return out


REPLICATION = Study("replication", "benchmarks/results/confirmatory", tuple(range(6, 16)),
                    (("confirmatory", tuple(range(6, 16))), ("high_lr", HIGH_LR_SEEDS)), REPLICATION_HYPOTHESES,
                    REPLICATION_PLAN, REPLICATION_EFFECTS, REPLICATION_DESCRIPTIVE, answers)
SECOND = Study("second", "benchmarks/results/confirmatory2", SECOND_STUDY_SEEDS,
               (("factorial", SECOND_STUDY_SEEDS),), (H1, Hypothesis("H2", "DRA, marginal", DRA_MARGINAL)),
               SECOND_PLAN, SECOND_EFFECTS)
#: Every preregistered study, by key; their seeds are disjoint, so a runs.csv's seeds name its study.
STUDIES: dict[str, Study] = {s.key: s for s in (REPLICATION, SECOND)}


def study_of(rows: Sequence[Mapping[str, Any]], directory: str | None = None) -> Study:
    """The study ``rows`` belong to: the one whose raw data lives in ``directory``, else the one whose seeds they
    use; ValueError (one line) when none or several match."""
    for study in STUDIES.values():
        if directory is not None and directory == study.raw_data:
            return study
    seeds = {int(r["seed"]) for r in rows if r.get("variant") != "sft"}
    found = [s for s in STUDIES.values() if seeds & set(s.seeds)]
    if len(found) != 1:
        raise ValueError(f"the runs' seeds ({', '.join(map(str, sorted(seeds))) or 'none'}) belong to "
                         f"{'no' if not found else 'more than one'} preregistered study "
                         f"({'; '.join(f'{s.key}: seeds {s.seeds[0]}..{s.seeds[-1]}' for s in STUDIES.values())}): "
                         "give --study")
    return found[0]


__all__ = ["ALPHA", "DEGRADATION", "EQUIVALENCE_MARGIN", "HIGH_LR_SEEDS", "Hypothesis", "POWER", "REPLICATION",
           "SECOND", "STUDIES", "Study", "analyse_runs", "answers", "missing_runs", "per_seed_contrast",
           "power_lines", "REPLICATION_EFFECTS", "REPLICATION_PLAN", "second_study_plan", "study_of", "verdict"]
