"""The preregistered analysis of issue 32 (docs/ablation.md, "Preregistration"): from ``runs.csv`` to the tables of
docs/results/testbed.md, by one command (``dynamo confirm DIR``).

Everything the preregistration fixes before the runs is a constant here: the seeds (:data:`SEEDS`, 6..15; the
high-learning-rate grid :data:`HIGH_LR_SEEDS`, 6..13), the hypotheses (:data:`HYPOTHESES`: each a contrast, i.e.
per seed the mean over its pairs of variant a - variant b of held-out pass@1, a seed counting only when every pair
has it), the test (two-sided paired Student t, :mod:`~megatron_dynamo.experiments.paired_stats`), the family (all of
:data:`HYPOTHESES`, Holm-adjusted at :data:`ALPHA`) and the decision rules (:func:`verdict`, :func:`answers`).
Nothing is estimated from the data but the numbers in the tables. Pure numpy/mpmath: no run is read, only the CSV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from megatron_dynamo.experiments.variants import GROUPS, HIGH_LR
from megatron_dynamo.experiments.paired_stats import holm, paired_t

SEEDS = tuple(range(6, 16))
HIGH_LR_SEEDS = tuple(range(6, 14))
ALPHA = 0.05
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
    seeds: tuple[int, ...] = SEEDS
    prediction: float | None = None  # points: the paper's effect scaled to this testbed (0.13x), where stated


def _marginal(on: Sequence[str], off: Sequence[str]) -> tuple[tuple[str, str], ...]:
    return tuple(zip(on, off))


HYPOTHESES: tuple[Hypothesis, ...] = (
    Hypothesis("H1", "DynaMO - GRPO (primary)", (("dynamo", "grpo"),)),
    Hypothesis("H2", "DRA, marginal", _marginal(("dra", "dra+gc", "dra+ums", "dynamo"), ("grpo", "gc", "ums", "gc+ums")),
               prediction=0.22),
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
DESCRIPTIVE: tuple[Hypothesis, ...] = (
    Hypothesis("D1", f"GRPO at lr {HIGH_LR} - GRPO (C4's precondition)", (("grpo-hlr", "grpo"),), seeds=HIGH_LR_SEEDS),
    Hypothesis("D2", f"GC at lr {HIGH_LR}, marginal over UMS", _marginal(("gc-hlr", "gc+ums-hlr"), ("grpo-hlr", "ums-hlr")),
               seeds=HIGH_LR_SEEDS),
)


def preregistered_runs() -> list[tuple[str, int]]:
    """(variant, seed) of every preregistered run, seed-major: the confirmatory group on :data:`SEEDS`, the
    high-learning-rate grid on :data:`HIGH_LR_SEEDS` (152 runs)."""
    return [(v, seed) for seed in SEEDS for v in (*GROUPS["confirmatory"],
                                                   *(GROUPS["high_lr"] if seed in HIGH_LR_SEEDS else ()))]


def missing_runs(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, int]]:
    """The preregistered runs that ``rows`` lack (a row without its pass@1 counts as missing)."""
    present = {(r["variant"], int(r["seed"])) for r in rows if r.get("pass1") is not None}
    return [run for run in preregistered_runs() if run not in present]


def per_seed_contrast(pass1: Mapping[tuple[str, int], float], hypothesis: Hypothesis) -> dict[int, float]:
    """Per seed of the hypothesis, the mean over its pairs of pass@1(a) - pass@1(b), in points; a seed counts only
    when every variant of every pair has a value for it."""
    out = {}
    for seed in hypothesis.seeds:
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


def analyse_runs(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every hypothesis's per-seed values, paired t (95%), Holm-adjusted p and verdict; C1's 90% interval; the
    descriptive contrasts."""
    pass1 = {(r["variant"], int(r["seed"])): float(r["pass1"]) for r in rows if r.get("pass1") is not None}
    tests = {}
    for h in HYPOTHESES:
        values = per_seed_contrast(pass1, h)
        tests[h.key] = {"per_seed": values, **paired_t(values)}
    adjusted = holm({key: t["p"] for key, t in tests.items()})
    for h in HYPOTHESES:
        tests[h.key]["p_holm"] = adjusted[h.key]
        tests[h.key]["verdict"] = verdict(tests[h.key], h)
    tests["C1"]["ci90"] = paired_t(tests["C1"]["per_seed"], confidence=0.90)
    descriptive = {h.key: {"per_seed": (v := per_seed_contrast(pass1, h)), **paired_t(v)} for h in DESCRIPTIVE}
    return {"tests": tests, "descriptive": descriptive, "answers": answers(tests, descriptive)}


def _decided(test: Mapping[str, Any], sign: int) -> bool:
    return test["p_holm"] is not None and test["p_holm"] < ALPHA and sign * test["mean"] > 0


def answers(tests: Mapping[str, Mapping[str, Any]], descriptive: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The controls' questions, answered by the preregistered rules (docs/ablation.md)."""
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


__all__ = ["ALPHA", "DEGRADATION", "DESCRIPTIVE", "EQUIVALENCE_MARGIN", "HIGH_LR_SEEDS", "HYPOTHESES", "Hypothesis",
           "SEEDS", "analyse_runs", "answers", "missing_runs", "per_seed_contrast", "preregistered_runs", "verdict"]
