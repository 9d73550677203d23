"""Power calculation for the ablation testbed (issue 26): how many seeds, problems and samples resolve an effect.

    python scripts/power_calc.py PILOT_DIR [--variants dynamo,grpo] [--effect 1.5] [--power 0.8]
        [--minutes 90] [--jobs 2] [--table-variants 9] [--json FILE]

PILOT_DIR is a ``dynamo ablate`` output directory (``runs/<variant>/seed<S>/`` with metrics.jsonl, train.log and
the final evaluation's ``eval/step_*/samples.jsonl``) of two variants over a few seeds. Plain numpy.

Model of one run's held-out pass@1 (variant v, seed s, on the fixed held-out problems i = 1..P, n samples each):
x_vs = mean_i c_vsi / n, with c_vsi ~ Binomial(n, p_vsi). A comparison is the paired difference
d_s = x_As - x_Bs over seeds (both variants start from the same SFT model and see the same problems).

1. **Evaluation noise, problem-clustered.** For one pair of runs the per-problem differences
   d_si = c_Asi / n - c_Bsi / n are the clusters; Var(d_s | training) = Var_i(d_si) / P (the cluster-robust variance
   of a mean of P problem-level values). It splits into a sampling part, (w_A + w_B) / n with
   w = mean_i p_i (1 - p_i) (estimated without bias by c (n - c) / (n (n - 1))), and a between-problem part
   tau_d^2 = Var_i(p_Ai - p_Bi) (what remains: Var_i(d_si) - (w_A + w_B) / n, at least 0). So
   V_eval(P, n) = (tau_d^2 + (w_A + w_B) / n) / P: more samples shrink only the sampling part, more problems both.
2. **Seed-to-seed variance.** Var_s(d_s) over the pilot's seeds estimates sigma_train^2 + V_eval(P0, n0) at the pilot's
   P0, n0; sigma_train^2 = Var_s(d_s) - mean_s V_eval,s (at least 0) is the part that more evaluation cannot remove.
3. **Design.** With S seeds, Var(mean d) = (sigma_train^2 + V_eval(P, n)) / S; a two-sided test at 5% has power
   1 - beta against an effect delta when delta / sqrt(Var) >= t_{S-1, 0.975} + t_{S-1, power} (Student t:
   megatron_dynamo/experiments/paired_stats.py). Cost: one run takes t_train + P n t_gen seconds (t_train and the
   per-sample generation time t_gen from the pilot's logs), runs go ``--jobs`` at a time, so a design of
   V variants x S seeds takes about ceil(V S / jobs) run times plus the shared SFT warm-up. The script lists, for
   each S, the smallest evaluation that reaches the power and the wall time it needs, and picks the cheapest design
   within ``--minutes``, for ``--table-variants`` variants and for the 2-variant comparison.

With a pilot of 3 seeds sigma_train^2 has 2 degrees of freedom: its upper 80% bound (chi-square) is printed beside
the point estimate, and the choice is made at the point estimate (say so when quoting it).

    python scripts/power_calc.py --preregistration

prints the power table of the preregistered confirmatory replication (issue 32; docs/ablation.md, Preregistration):
for each preregistered test its expected standard error at 10 seeds (8 for the high-lr grid) and 1500 held-out
problems x 8 samples, derived from the 2026-11-25 testbed run (:data:`PREREGISTRATION_INPUTS`), and the power of
the two-sided paired t test (the noncentral t, ``paired_t_power``) against the stated effects, at alpha 0.05 and at
0.005 (Holm's first step over the 10 tests).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

from megatron_dynamo.experiments.confirmatory import REPLICATION_EFFECTS, REPLICATION_PLAN
from megatron_dynamo.experiments.paired_stats import paired_t_power, t_quantile


def _chi2_quantile(q: float, df: int, draws: int = 400_000) -> float:
    return float(np.quantile(np.random.default_rng(0).chisquare(df, draws), q))


# The first study's power plan is its Study's (experiments/confirmatory.py: REPLICATION_PLAN, from the 2026-11-25
# testbed run), so that dynamo confirm's planned standard errors are this table's.
PREREGISTRATION_INPUTS = (  # (test, per-seed variance in points^2 at 1500 x 8, seeds, effects to power against)
    ("H1 DynaMO - GRPO", REPLICATION_PLAN["H1"], 10, REPLICATION_EFFECTS["H1"]),
    ("H2 DRA marginal", REPLICATION_PLAN["H2"], 10, REPLICATION_EFFECTS["H2"]),
    ("H3 GC marginal", REPLICATION_PLAN["H3"], 10, REPLICATION_EFFECTS["H3"]),
    ("H4 UMS marginal", REPLICATION_PLAN["H4"], 10, REPLICATION_EFFECTS["H4"]),
    ("C1-C3 one paired difference", REPLICATION_PLAN["C1"], 10, REPLICATION_EFFECTS["C1"]),
    ("C4 UMS marginal at the high lr (2 pairs)", REPLICATION_PLAN["C4"], 8, REPLICATION_EFFECTS["C4"]),
)


def preregistration_table() -> str:
    """The Markdown power table of the preregistration (module docstring)."""
    lines = ["| test | seeds | expected SE (points) | effect (points) | power, alpha 0.05 | power, alpha 0.005 |",
             "|---|---|---|---|---|---|"]
    for name, variance, seeds, effects in PREREGISTRATION_INPUTS:
        se = math.sqrt(variance / seeds)
        for effect in effects:
            lines.append(f"| {name} | {seeds} | {se:.3f} | {effect:+.2f} | "
                         f"{paired_t_power(effect, se, seeds - 1, 0.05):.2f} | "
                         f"{paired_t_power(effect, se, seeds - 1, 0.005):.2f} |")
    return "\n".join(lines)


def read_samples(run_dir: Path) -> dict[str, np.ndarray]:
    """problem id -> correct flags of the final evaluation (the last eval/step_* directory)."""
    steps = sorted((run_dir / "eval").glob("step_*/samples.jsonl"))
    if not steps:
        raise SystemExit(f"power_calc: no eval/step_*/samples.jsonl in {run_dir}")
    by_problem: dict[str, list[bool]] = {}
    for line in steps[-1].read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_problem.setdefault(row["problem_id"], []).append(bool(row["correct"]))
    return {k: np.array(v, dtype=float) for k, v in by_problem.items()}


def run_seconds(run_dir: Path) -> tuple[float | None, float | None]:
    """(training seconds, evaluation seconds) of a run from metrics.jsonl (step_seconds, time/eval)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = sum(r.get("step_seconds", 0.0) for r in rows) or None
    evals = [v for r in rows for k, v in r.items() if re.fullmatch(r"time/eval", k)]
    return train, (evals[-1] if evals else None)


def eval_components(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    """The per-problem pieces of V_eval for one pair of runs on the same problems."""
    ids = sorted(set(a) & set(b))
    n = min(min(len(a[i]) for i in ids), min(len(b[i]) for i in ids))
    ca = np.array([a[i][:n].sum() for i in ids])
    cb = np.array([b[i][:n].sum() for i in ids])
    d = ca / n - cb / n
    w_a = float((ca * (n - ca) / (n * (n - 1))).mean())
    w_b = float((cb * (n - cb) / (n * (n - 1))).mean())
    # per-sample mismatch of the paired samples (sample j of A vs sample j of B: the evaluation draws the same random
    # numbers per (seed, problem), so close models give correlated samples): the within-problem variance of
    # x_Aj - x_Bj, unbiased per problem, averaged
    pair = np.array([a[i][:n] - b[i][:n] for i in ids])
    s2 = float(pair.var(axis=1, ddof=1).mean())
    var_d = float(d.var(ddof=1))
    return {"P": len(ids), "n": n, "d": float(d.mean()), "var_problem_diff": var_d, "w_a": w_a, "w_b": w_b,
            "s2_pair": s2, "tau_d2": max(0.0, var_d - s2 / n), "v_eval": var_d / len(ids),
            "v_eval_independent": (w_a + w_b) / n / len(ids),
            "tau_single2": float(max(0.0, (ca / n).var(ddof=1) - w_a / n)), "pass1_a": float(ca.mean() / n),
            "pass1_b": float(cb.mean() / n)}


def required_seeds(sigma2_train: float, v_eval: float, effect: float, power: float, max_seeds: int = 200) -> int | None:
    for seeds in range(2, max_seeds + 1):
        se = math.sqrt((sigma2_train + v_eval) / seeds)
        if effect / se >= t_quantile(0.975, seeds - 1) + t_quantile(power, seeds - 1):
            return seeds
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pilot", nargs="?", help="a dynamo ablate output directory with runs/<variant>/seed<S>/")
    parser.add_argument("--preregistration", action="store_true",
                        help="print the power table of the preregistered replication (issue 32) and exit")
    parser.add_argument("--variants", default="dynamo,grpo", help="the two pilot variants A,B (default dynamo,grpo)")
    parser.add_argument("--effect", type=float, default=1.5, help="effect to resolve, points of pass@1 (default 1.5)")
    parser.add_argument("--power", type=float, default=0.8, help="power at 5%% two-sided (default 0.8)")
    parser.add_argument("--minutes", type=float, default=90.0, help="wall-time budget of the whole ablation")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (dynamo ablate --jobs)")
    parser.add_argument("--table-variants", type=int, default=9, help="variants of the full design (default 9)")
    parser.add_argument("--sft-minutes", type=float, default=None, help="shared warm-up time (default: pilot's)")
    parser.add_argument("--max-problems", type=int, default=1500, help="size of the held-out split")
    parser.add_argument("--train-minutes", type=float, default=None,
                        help="one run's training time without evaluation (default: the pilot's)")
    parser.add_argument("--eval-ms", type=float, default=None, help="ms per evaluation sample (default: pilot's)")
    parser.add_argument("--independent", action="store_true",
                        help="extrapolate the evaluation noise as if the paired runs' samples were independent "
                             "(w_A + w_B; conservative) instead of the measured paired mismatch")
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args(argv)
    if args.preregistration:
        print(preregistration_table())
        return 0
    if args.pilot is None:
        parser.error("give a pilot directory, or --preregistration")
    if not 0 < args.power < 1 or args.effect <= 0 or args.jobs < 1 or args.minutes <= 0:
        parser.error("need 0 < --power < 1, --effect > 0, --jobs >= 1, --minutes > 0")
    pilot = Path(args.pilot)
    var_a, var_b = args.variants.split(",")
    seeds_a = {p.name for p in (pilot / "runs" / var_a).glob("seed*")}
    seeds = sorted(seeds_a & {p.name for p in (pilot / "runs" / var_b).glob("seed*")},
                   key=lambda s: int(s[4:]))
    seeds = [s for s in seeds if list((pilot / "runs" / var_a / s / "eval").glob("step_*/samples.jsonl"))
             and list((pilot / "runs" / var_b / s / "eval").glob("step_*/samples.jsonl"))]
    if len(seeds) < 2:
        print(f"power_calc: need >= 2 seeds with both {var_a} and {var_b} evaluated in {pilot}", file=sys.stderr)
        return 2
    pairs = [eval_components(read_samples(pilot / "runs" / var_a / s), read_samples(pilot / "runs" / var_b / s))
             for s in seeds]
    d = np.array([100 * p["d"] for p in pairs])                      # points
    v_eval0 = float(np.mean([p["v_eval"] for p in pairs])) * 1e4      # points^2
    var_d = float(d.var(ddof=1))
    sigma2_train = max(0.0, var_d - v_eval0)
    df = len(seeds) - 1
    sigma2_train_hi = max(0.0, var_d * df / _chi2_quantile(0.2, df) - v_eval0)
    tau_d2 = float(np.mean([p["tau_d2"] for p in pairs])) * 1e4
    w_sum = float(np.mean([p["w_a"] + p["w_b"] for p in pairs])) * 1e4
    s2_pair = float(np.mean([p["s2_pair"] for p in pairs])) * 1e4
    v_indep0 = float(np.mean([p["v_eval_independent"] for p in pairs])) * 1e4
    singles = np.array([100 * p[k] for p in pairs for k in ("pass1_a", "pass1_b")])

    def v_eval(P: int, n: int) -> float:  # paired samples as measured (s2_pair); w_sum if they were independent
        return (tau_d2 + (w_sum if args.independent else s2_pair) / n) / P

    times = [run_seconds(pilot / "runs" / v / s) for v in (var_a, var_b) for s in seeds]
    walls = []
    plan = json.loads((pilot / "ablation.json").read_text()) if (pilot / "ablation.json").is_file() else {}
    for run in plan.get("runs", []):
        if run.get("variant") in (var_a, var_b) and run.get("seconds"):
            walls.append(float(run["seconds"]))
    P0, n0 = pairs[0]["P"], pairs[0]["n"]
    run_wall = float(np.mean(walls)) if walls else None
    eval_s = [e for _, e in times if e]
    t_gen = (float(np.mean(eval_s)) / (P0 * n0)) if eval_s else None
    t_train = (run_wall - (float(np.mean(eval_s)) if eval_s else 0.0)) if run_wall else None
    if args.train_minutes is not None:  # timings of a quiet machine instead of the pilot's
        t_train, run_wall = args.train_minutes * 60, args.train_minutes * 60
    if args.eval_ms is not None:
        t_gen = args.eval_ms / 1000
    sft_min = args.sft_minutes
    if sft_min is None:
        sft_min = next((float(r["seconds"]) / 60 for r in plan.get("runs", [])
                        if r.get("variant") == "sft" and r.get("seconds")), 0.0)

    print(f"pilot: {pilot} ({var_a} vs {var_b}, seeds {', '.join(seeds)}; final evaluation P={P0} problems x n={n0})")
    print(f"  per-seed difference {var_a} - {var_b} (points): {' '.join(f'{x:+.2f}' for x in d)}; "
          f"mean {d.mean():+.2f}, variance {var_d:.2f}")
    print(f"  single-run pass@1 (%): {' '.join(f'{x:.1f}' for x in singles)}")
    print(f"  evaluation noise of one paired difference at P={P0}, n={n0}: {v_eval0:.3f} points^2 "
          f"(SE {math.sqrt(v_eval0):.2f}); between-problem part tau_d^2 = {tau_d2:.1f}, per-sample mismatch of the "
          f"paired samples s^2 = {s2_pair:.1f} points^2 (independent samples would give w_A + w_B = {w_sum:.1f}: "
          f"V_eval {v_indep0:.3f})")
    print(f"  training (seed-to-seed) variance of the difference: sigma_train^2 = {sigma2_train:.2f} points^2 "
          f"(upper 80% bound {sigma2_train_hi:.2f}, {df} df)")
    if run_wall:
        print(f"  run wall time {run_wall / 60:.1f} min (training ~{(t_train or 0) / 60:.1f} min, "
              f"{(t_gen or 0) * 1000:.1f} ms per evaluation sample), shared SFT {sft_min:.1f} min")
    rows = []
    for n in (4, 8, 16):
        for P in sorted({300, 600, 1000, args.max_problems}):
            if P > args.max_problems:
                continue
            for label, sigma2 in (("point", sigma2_train), ("upper80", sigma2_train_hi)):
                S = required_seeds(sigma2, v_eval(P, n), args.effect, args.power)
                minutes = {}
                if S and run_wall is not None:
                    per_run = (t_train or run_wall) + (t_gen or 0.0) * P * n
                    for V in (2, args.table_variants):
                        minutes[V] = sft_min + math.ceil(V * S / args.jobs) * per_run / 60
                rows.append({"n": n, "P": P, "sigma2": label, "seeds": S, "v_eval": round(v_eval(P, n), 4),
                             "minutes": {k: round(v, 1) for k, v in minutes.items()}})
    print(f"\nseeds for {args.effect} points at {args.power:.0%} power (two-sided 5%), and wall time with "
          f"--jobs {args.jobs} for 2 / {args.table_variants} variants:")
    print("| n | P | sigma_train^2 | V_eval (pts^2) | seeds | minutes (2 var.) | minutes "
          f"({args.table_variants} var.) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["minutes"]
        print(f"| {r['n']} | {r['P']} | {r['sigma2']} | {r['v_eval']} | {r['seeds'] or '>200'} | "
              f"{m.get(2, '-')} | {m.get(args.table_variants, '-')} |")
    best = {}
    for V in (2, args.table_variants):
        fit = [r for r in rows if r["sigma2"] == "point" and r["seeds"] and r["minutes"].get(V) is not None]
        inside = [r for r in fit if r["minutes"][V] <= args.minutes]
        pick = min(inside or fit, key=lambda r: r["minutes"][V], default=None)
        best[V] = pick
        if pick:
            verdict = "fits" if pick in inside else "does NOT fit"
            print(f"cheapest for {V} variants: {pick['seeds']} seeds, P={pick['P']}, n={pick['n']}: "
                  f"{pick['minutes'][V]} min ({verdict} in {args.minutes:.0f} min)")
    out = {"pilot": str(pilot), "variants": [var_a, var_b], "seeds": seeds, "d_points": d.tolist(),
           "var_d": var_d, "v_eval0": v_eval0, "tau_d2": tau_d2, "w_sum": w_sum, "s2_pair": s2_pair,
           "v_eval_independent0": v_indep0, "sigma2_train": sigma2_train,
           "sigma2_train_upper80": sigma2_train_hi, "run_wall_s": run_wall, "t_train_s": t_train, "t_gen_s": t_gen,
           "sft_minutes": sft_min, "rows": rows, "best": {str(k): v for k, v in best.items()},
           "pairs": pairs}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
