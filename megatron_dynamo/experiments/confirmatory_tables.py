"""The Markdown tables of the preregistered analysis (``dynamo confirm DIR``), generated from ``DIR/runs.csv`` only,
and the block of docs/results/testbed.md that holds them.

The block is delimited by ``<!-- confirm:DIR -->`` and ``<!-- /confirm -->`` (DIR relative to the repository
root); :func:`replace_block` writes it, and the test suite fails when a committed block differs from what the
command prints for the committed ``runs.csv`` (tests/test_confirmatory.py).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from megatron_dynamo.experiments.variants import SFT, VARIANTS, display_order
from megatron_dynamo.experiments.confirmatory import ALPHA, POWER, Study, analyse_runs, missing_runs
from megatron_dynamo.experiments.provenance import seed_groups
from megatron_dynamo.experiments.paired_stats import paired_t

BEGIN = "<!-- confirm:{} -->"
END = "<!-- /confirm -->"


def _fmt(result: Mapping[str, Any], scale: float = 1.0, signed: bool = True, digits: int = 2) -> str:
    if result.get("mean") is None:
        return "n/a"
    f = (lambda v: f"{scale * v:+.{digits}f}") if signed else (lambda v: f"{scale * v:.{digits}f}")  # noqa: E731
    if result.get("lo") is None:
        return f"{f(result['mean'])} ({result['n']} seed)"
    return f"{f(result['mean'])} [{f(result['lo'])}, {f(result['hi'])}]"


def _p(value: float | None) -> str:
    if value is None:
        return "-"
    return "<0.0001" if value < 1e-4 else f"{value:.4f}"


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def variants_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per variant: seeds, held-out pass@1 and pass@k (%, mean [95% t interval over seeds]), Δ pass@1 against its
    reference (GRPO; GRPO at the high lr for the grid), train rollouts and wall minutes (means)."""
    by_variant: dict[str, dict[int, Mapping[str, Any]]] = {}
    warmups = [r for r in rows if r["variant"] == SFT]  # one per machine the experiment ran on
    for r in rows:
        if r["variant"] != SFT:
            by_variant.setdefault(r["variant"], {})[int(r["seed"])] = r
    k = next((int(r["k"]) for r in rows if r.get("k") is not None), None)
    header = ["variant", "label", "seeds", "pass@1 (%)", f"pass@{k} (%)", "Δ pass@1 vs reference (points)",
              "train rollouts", "wall (min)"]
    out = []
    named = [(SFT, {int(r["seed"]): r}, _warmup_label(r, len(warmups))) for r in warmups]
    named += [(name, by_variant[name], VARIANTS[name].label if name in VARIANTS else name)
              for name in display_order(list(by_variant))]
    for name, runs, label in named:
        seeds = sorted(runs)
        reference = "grpo-hlr" if name.endswith("-hlr") else "grpo"
        delta = "-"
        if name not in (reference, SFT) and reference in by_variant:
            diffs = {s: 100 * (runs[s]["pass1"] - by_variant[reference][s]["pass1"]) for s in seeds
                     if s in by_variant[reference] and runs[s]["pass1"] is not None
                     and by_variant[reference][s]["pass1"] is not None}
            delta = f"{_fmt(paired_t(diffs))} vs {reference}"
        rollouts = [runs[s]["train_rollouts"] for s in seeds if runs[s].get("train_rollouts") is not None]
        walls = [runs[s]["wall_seconds"] for s in seeds if runs[s].get("wall_seconds") is not None]
        out.append([name, label, str(len(seeds)),
                    _fmt(paired_t([runs[s]["pass1"] for s in seeds if runs[s]["pass1"] is not None]), 100, False),
                    _fmt(paired_t([runs[s]["passk"] for s in seeds if runs[s]["passk"] is not None]), 100, False),
                    delta, f"{sum(rollouts) / len(rollouts):.0f}" if rollouts else "-",
                    f"{sum(walls) / len(walls) / 60:.1f}" if walls else "-"])
    return _markdown(header, out)


def _warmup_label(row: Mapping[str, Any], warmups: int) -> str:
    if warmups < 2:
        return "SFT start"
    return f"SFT start on {row.get('machine') or 'an unrecorded machine'} (warm-up {row.get('warmup') or '?'})"


def hypotheses_table(analysis: Mapping[str, Any], study: Study) -> str:
    """Every preregistered test: estimate [95% t interval], t, p, Holm-adjusted p, verdict; then the descriptive
    contrasts (not tested)."""
    header = ["", "contrast (held-out pass@1, points, paired by seed)", "seeds", "estimate [95% CI]", "t", "p",
              "p (Holm)", "verdict"]
    out = []
    for h in study.hypotheses:
        t = analysis["tests"][h.key]
        out.append([h.key, h.question, str(t["n"]), _fmt(t), f"{t['t']:.2f}" if t["t"] is not None else "-",
                    _p(t["p"]), _p(t["p_holm"]), t["verdict"]])
    for h in study.descriptive:
        t = analysis["descriptive"][h.key]
        out.append([h.key, h.question, str(t["n"]), _fmt(t), f"{t['t']:.2f}" if t["t"] is not None else "-",
                    _p(t["p"]), "(not tested)", "-"])
    return _markdown(header, out)


def power_table(analysis: Mapping[str, Any], study: Study) -> str:
    """Per test, what the design resolved as realised: planned and realised standard errors, the smallest effect
    detectable with power 0.8 (at alpha and at Holm's first threshold), the power against the planned effects, and
    what its verdict therefore says."""
    m = len(study.hypotheses)
    header = ["", "seeds", "planned SE", "realised SE", "realised / planned",
              f"detectable at power {POWER:g}: alpha {ALPHA:g} / {ALPHA / m:.3g} (Holm's first step)",
              f"power against the planned effects (alpha {ALPHA:g})", "what the verdict says"]
    out = []
    for h in study.hypotheses:
        line = analysis["power"].get(h.key)
        if line is None:
            continue
        verdict = analysis["tests"][h.key]["verdict"]
        if verdict.startswith("not resolved"):
            says = (f"not resolved: says little of effects below {line['detectable']:+.2f} (missed more than 1 "
                    "time in 5)")
        else:
            says = verdict.split(";")[0]
        powers = ", ".join(f"{p:.2f} at {effect:+.2f}" for effect, p in line["power"].items())
        out.append([h.key, str(line["n"]), f"{line['planned_se']:.3f}", f"{line['se']:.3f}", f"{line['ratio']:.1f}x",
                    f"{line['detectable']:+.2f} / {line['detectable_holm']:+.2f}", powers, says])
    return _markdown(header, out)


def progress_table(rows: Sequence[Mapping[str, Any]], study: Study) -> str:
    """Per preregistered seed: its runs in, of how many, and the machine and warm-up they ran on. No result."""
    expected: dict[int, int] = {}
    for _, seed in study.preregistered_runs():
        expected[seed] = expected.get(seed, 0) + 1
    missing = set(missing_runs(rows, study))
    groups = seed_groups(r for r in rows if (r["variant"], int(r["seed"])) not in missing)
    out = []
    for seed, total in expected.items():
        found = groups.get(seed, {})
        where = "; ".join(f"{machine or '?'}, warm-up {warmup or '?'}" for machine, warmup in sorted(found)) or "-"
        out.append([str(seed), str(sum(found.values())), str(total), where])
    return _markdown(["seed", "runs in", "of", "machine, warm-up"], out)


def format_tables(rows: Sequence[Mapping[str, Any]], source: str, study: Study) -> str:
    """The block of the results page: the variants, the tests, the power lines, the controls' answers (Markdown, no
    trailing newline). While preregistered runs are missing: only how many are in, per seed and machine (the
    preregistration analyses the whole experiment: no table of a part)."""
    missing = missing_runs(rows, study)
    if missing:
        total = len(study.preregistered_runs())
        return "\n\n".join([
            f"Generated by `dynamo confirm {source}` from `{source}/runs.csv`; do not edit by hand. "
            f"{total - len(missing)} of the {total} preregistered runs are in. The tables come when all are: the "
            "preregistration analyses the whole experiment, and no table of a part is computed "
            "(docs/ablation.md, Preregistration).",
            progress_table(rows, study)])
    analysis = analyse_runs(rows, study)
    keys = [h.key for h in study.hypotheses]
    parts = [
        f"Generated by `dynamo confirm {source}` from `{source}/runs.csv` ({len(rows)} runs); do not edit by hand. "
        f"Intervals: two-sided 95% Student t over seeds (paired by seed for differences); p: two-sided paired t; "
        f"Holm over the {len(keys)} tests {keys[0]}-{keys[-1]} at {ALPHA}. Preregistered seeds "
        f"{study.seeds[0]}..{study.seeds[-1]} (docs/ablation.md, Preregistration).",
        variants_table(rows),
        hypotheses_table(analysis, study),
        "What the design could resolve, as realised (power of the two-sided paired t test, the noncentral t, at the "
        "realised standard error; planned SE: the preregistered per-seed variance over the seeds in):",
        power_table(analysis, study)]
    if "C1" in analysis["tests"]:
        parts.append(f"C1's 90% interval (equivalence at +-0.3 points): {_fmt(analysis['tests']['C1'].get('ci90') or {})}.")
    if analysis["answers"]:
        parts.append(_markdown(["question", "answer (preregistered rule)"],
                               [[q, a] for q, a in analysis["answers"].items()]))
    return "\n\n".join(parts)


def block_pattern(source: str) -> re.Pattern:
    return re.compile(re.escape(BEGIN.format(source)) + r"\n(.*?)\n" + re.escape(END), re.S)


def committed_blocks(text: str) -> dict[str, str]:
    """{source directory: the block's text} of every confirm block in ``text``."""
    return {m.group(1): m.group(2) for m in re.finditer(r"<!-- confirm:(\S+) -->\n(.*?)\n" + re.escape(END), text,
                                                        re.S)}


def replace_block(text: str, source: str, tables: str) -> str:
    """``text`` with the block of ``source`` replaced by ``tables`` (appended as a new block when it has none)."""
    block = f"{BEGIN.format(source)}\n{tables}\n{END}"
    pattern = block_pattern(source)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    return text.rstrip("\n") + "\n\n" + block + "\n"


__all__ = ["BEGIN", "END", "block_pattern", "committed_blocks", "format_tables", "hypotheses_table", "power_table",
           "progress_table", "replace_block", "variants_table"]
