"""The Markdown tables of ``dynamo ablate`` (``ablation.md``): the baselines in the paper's Table 1 layout, the
ablation in its Table 2 layout, the effects, and the diagnostics; the paper's numbers beside ours
(:mod:`megatron_dynamo.experiments.paper`). Input: the dict of :func:`megatron_dynamo.experiments.analysis.analyse`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from megatron_dynamo.experiments.variants import (BASELINES, COMPONENT_LABELS, COMPONENTS, CONTROLS, PAPER_ORDER,
                                                      SFT, TABLE1_ORDER, display_order)
from megatron_dynamo.experiments.paper import PAPER_AVG, PAPER_K, TABLE1, table1_avg


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


# Table 1's own labels of the rows it shares with Table 2
TABLE1_LABELS = {"grpo": "GRPO", "dynamo": "DynaMO (Ours)"}


def _delta_vs_grpo(entry: Mapping[str, Any], name: str) -> str:
    if name == "grpo":
        return "0 (reference)"
    return fmt_ci(entry["delta_vs_grpo"]["pass@1"], signed=True) if "delta_vs_grpo" in entry else "n/a"


def table1_table(analysis: Mapping[str, Any], budget: int | None = None) -> str:
    """The paper's Table 1 layout: GRPO, the seven baselines, DynaMO (paper order, those run); per held-out
    benchmark pass@1 / pass@k (when there are several), their mean (Avg.), Δ pass@1 vs GRPO paired by seed,
    rollouts to threshold and final train reward; then the paper's Avg. P@1 / P@32 of the same row for both of
    its models."""
    k = analysis["k"]
    per = analysis["per_variant"]
    benchmarks = analysis.get("benchmarks", []) if len(analysis.get("benchmarks", [])) > 1 else []
    models = list(TABLE1)
    header = ["method", "variant", "runs",
              *[f"{b} {m}" for b in benchmarks for m in ("P@1", f"P@{k}")], "Avg. P@1 (%)", f"Avg. P@{k} (%)",
              "Δ P@1 vs GRPO (points, paired)", f"rollouts to threshold (budget {budget})" if budget else
              "rollouts to threshold", "final train reward (%)",
              *[f"paper {model.split('-')[-1]} Avg. P@1 / P@{PAPER_K}" for model in models]]
    rows = []
    for name in [v for v in TABLE1_ORDER if v in analysis["variants"]]:
        e = per[name]
        paper = [table1_avg(model, name) for model in models]
        rows.append([TABLE1_LABELS.get(name, e["label"]), name, str(e["runs"]),
                     *[fmt_ci(e["benchmarks"][b][m]) for b in benchmarks for m in ("pass@1", f"pass@{k}")],
                     fmt_ci(e["pass@1"]), fmt_ci(e[f"pass@{k}"]), _delta_vs_grpo(e, name),
                     _fmt_rollouts(e["rollouts_to_threshold"]), fmt_ci(e["final_reward"]),
                     *[f"{p[0]:.1f} / {p[1]:.1f}" if p else "-" for p in paper]])
    return _markdown(header, rows)


def main_table(analysis: Mapping[str, Any], budget: int | None = None, rows: Sequence[str] | None = None) -> str:
    """The paper's Table 2 (ablation) layout: one row per variant (paper order), then the SFT start; or the given
    ``rows`` (the controls' table) in that layout."""
    k = analysis["k"]
    per = analysis["per_variant"]
    names = row_order(analysis["variants"], SFT in per) if rows is None else list(rows)
    header = ["method", "variant", "runs", "held-out pass@1 (%)", f"held-out pass@{k} (%)",
              "Δ pass@1 vs GRPO (points, paired)", f"rollouts to threshold (budget {budget})" if budget else
              "rollouts to threshold", "final train reward (%)", "paper Avg. pass@1 (%, 7B)"]
    lines = []
    for name in names:
        e = per[name]
        delta = _delta_vs_grpo(e, name)
        lines.append([e["label"], name if name != SFT else "sft", str(e["runs"]), fmt_ci(e["pass@1"]),
                      fmt_ci(e[f"pass@{k}"]), delta,
                      _fmt_rollouts(e["rollouts_to_threshold"]) if name != SFT else "-",
                      fmt_ci(e["final_reward"]) if name != SFT else "-",
                      f"{PAPER_AVG[name]:.1f}" if name in PAPER_AVG else "-"])
    return _markdown(header, lines)


def effects_table(analysis: Mapping[str, Any]) -> str:
    """Marginal effects of DRA, GC, UMS; DynaMO - GRPO; power 0.5 - power 1 (paired by seed)."""
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


def _entropy_trajectory(entry: Mapping[str, Any]) -> str:
    first, final = entry["entropy_first"]["mean"], entry["entropy_final"]["mean"]
    return "-" if first is None or final is None else f"{first:.3f} -> {final:.3f}"


def diagnostics_table(analysis: Mapping[str, Any]) -> str:
    """Eq. 23 variance ratio (predicted, realised), zero-advantage share, modulation diagnostics; every variant."""
    per = analysis["per_variant"]
    order = display_order(analysis["variants"])
    mod_keys: list[str] = []
    for name in order:
        for key in per[name].get("modulation", {}):
            if key not in mod_keys:
                mod_keys.append(key)
    header = ["variant", "predicted var. ratio (eq. 23)", "realised var. ratio", "zero-adv. groups (%)",
              *[key.removeprefix("modulation/") for key in mod_keys], "response length",
              "entropy first -> last tenth (nats)"]
    rows = []
    for name in order:
        e = per[name]
        mod = e.get("modulation", {})
        rows.append([name, fmt_ci(e["variance_ratio_predicted"], "num"), fmt_ci(e["variance_ratio_realised"], "num"),
                     fmt_ci(e["zero_advantage_share"]),
                     *[f"{mod[key]:.3f}" if mod.get(key) is not None else "-" for key in mod_keys],
                     f"{e['response_length_mean']['mean']:.2f}" if e["response_length_mean"]["mean"] is not None
                     else "-", _entropy_trajectory(e)])
    return _markdown(header, rows)


def format_markdown(analysis: Mapping[str, Any], *, title: str, settings_line: str, budget: int | None) -> str:
    """The tables with their captions (the page ``ablation.md``): the baselines in the paper's Table 1 layout (when
    any of the seven is among the variants), the ablation in its Table 2 layout, the effects, the diagnostics."""
    n = len(analysis["seeds"])
    k = analysis["k"]
    crude = (f"{n} seed(s): means over seeds with {round(100 * analysis['bootstrap_confidence'])}% "
             f"percentile-bootstrap CIs ({analysis['bootstrap_resamples']} resamples, seed "
             f"{analysis['bootstrap_seed']}) in brackets; with so few seeds the bootstrap CI is crude (it cannot "
             "be wider than the seeds' range) and understates the uncertainty (over 5 seeds a 95% percentile "
             "bootstrap covers ~83%): exploratory; for claims use `dynamo confirm` on `--raw-data` (paired Student "
             "t, Holm).")
    controls = [v for v in CONTROLS if v in analysis["variants"]]
    baselines = []
    if any(v in BASELINES for v in analysis["variants"]):
        baselines = [
            f"## Baselines (paper Table 1 layout)\n\nHeld-out pass@1 / pass@{k} of the final model per benchmark "
            "of the recipe's evaluation (when it has several) and their mean (Avg.); Δ, rollouts to threshold and "
            "final train reward as in the ablation table below. The last columns are the paper's Table 1 Avg. "
            f"pass@1 / pass@{PAPER_K} of the same method (Qwen2.5-Math-1.5B and -7B, six benchmarks), for the "
            "direction of the effects only.",
            table1_table(analysis, budget)]
    return "\n\n".join([
        f"# {title}", settings_line, crude, *baselines,
        f"## Ablation (paper Table 2 layout)\n\nHeld-out pass@1 / pass@{k}: `eval/avg/pass@<k>` of the "
        "final model on the recipe's evaluation benchmarks. Δ: paired by seed (same SFT start). Rollouts to "
        "threshold: censored at the budget when not reached (the mean is then a lower bound, \">=\"). Final "
        "train reward: mean reward_mean of the last tenth of the steps. The last column is the paper's Table 2 "
        "Avg. (Qwen2.5-Math-7B, six benchmarks), for the direction of the effects only.",
        main_table(analysis, budget),
        *([f"## Controls (issue 32)\n\nThe same columns for the controls (docs/ablation.md, Controls); the "
           "`-hlr` variants' Δ is still against GRPO at the recipe's learning rate. The preregistered analysis of "
           "them is `dynamo confirm` on `--raw-data`.", main_table(analysis, budget, controls)] if controls else []),
        "## Effects on held-out pass@k (paired by seed)\n\nMarginal effect of a component: per seed, the "
        "mean over the 4 pairs of power-1 variants that differ only in it of (with - without); n/a when a "
        "variant of a pair is missing. The paper column applies the same formula to its Table 2 Avg. column.",
        effects_table(analysis),
        "## Eq. 23 variance ratio and advantage modulation\n\nPredicted: mean over steps of the logged "
        "`variance_ratio` (from the prompt history before sampling). Realised: from prompts.jsonl, per step "
        "sum p(1-p)/n_i over sum p(1-p)/n_uniform with each group's own success rate p (1 for a uniform "
        "allocation). Zero-adv. groups: (step, prompt) groups all correct or all wrong. Modulation columns and "
        "response length: means over steps, then over seeds (\"-\": the factor is off in that variant). Entropy: "
        "`entropy_mean` (the sampling policy's mean token entropy) over the first and the last tenth of the steps, "
        "mean over seeds.",
        diagnostics_table(analysis),
    ]) + "\n"
