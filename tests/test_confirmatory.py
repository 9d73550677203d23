"""The preregistered analysis (issue 32): paired Student t intervals, Holm's adjustment and the power of the paired
t test against independent references, the hypotheses' contrasts and verdicts on a made-up runs.csv whose effects
are known exactly, ``dynamo confirm`` (print, write, check), and the committed tables of docs/results/testbed.md
against what the command prints for the committed runs.csv."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from hf_reference import REPO
from megatron_dynamo.experiments.variants import HIGH_LR
from megatron_dynamo.experiments.confirmatory import (REPLICATION, SECOND, STUDIES, analyse_runs, missing_runs,
                                                      per_seed_contrast, second_study_plan, study_of)
from megatron_dynamo.experiments.confirmatory_tables import committed_blocks, format_tables, replace_block
from megatron_dynamo.experiments.paired_stats import (detectable_effect, holm, paired_t, paired_t_power, seeds_for_power,
                                                      t_cdf, t_quantile)
from megatron_dynamo.experiments.raw_data import RUNS_COLUMNS, RUNS_FILE, read_runs

RESULTS = os.path.join(REPO, "docs", "results", "testbed.md")  # the testbed's results page
CONFIRMATORY = os.path.join("benchmarks", "results", "confirmatory")
HYPOTHESES, SEEDS = REPLICATION.hypotheses, REPLICATION.seeds


# ---------------------------------------------------------------------------------------------- statistics
def test_t_quantiles_match_the_tables():
    # scipy.stats.t.ppf's values (2.776, 2.262, ... of every printed table)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764451051977934, abs=1e-10)
    assert t_quantile(0.975, 9) == pytest.approx(2.262157162798205, abs=1e-10)
    assert t_quantile(0.95, 9) == pytest.approx(1.833112932656237, abs=1e-10)
    assert t_quantile(0.025, 7) == pytest.approx(-2.3646242515927844, abs=1e-10)
    assert t_quantile(0.975, 1) == pytest.approx(12.706204736174694, abs=1e-8)
    assert t_cdf(0.0, 3) == 0.5 and t_cdf(2.262157162798205, 9) == pytest.approx(0.975, abs=1e-12)
    # scipy 1.17.1's stats.t.ppf(q, df) (scipy is not a dependency: the values are written here)
    for q, df, expected in (
        (0.6, 1, 0.32491969623290634),
        (0.9, 1, 3.0776835371752544),
        (0.975, 1, 12.706204736174694),
        (0.999, 1, 318.30883898555015),
        (0.6, 2, 0.2886751345948128),
        (0.9, 2, 1.8856180831641272),
        (0.975, 2, 4.302652729749462),
        (0.999, 2, 22.327124770119866),
        (0.6, 5, 0.2671808657041451),
        (0.9, 5, 1.4758840488244815),
        (0.975, 5, 2.5705818356363146),
        (0.999, 5, 5.893429531356009),
        (0.6, 9, 0.260955336473911),
        (0.9, 9, 1.3830287383966329),
        (0.975, 9, 2.262157162798205),
        (0.999, 9, 4.296805662729918),
        (0.6, 29, 0.25568363457125604),
        (0.9, 29, 1.311433647301551),
        (0.975, 29, 2.045229642132703),
        (0.999, 29, 3.3962402883568026),
        (0.6, 200, 0.25368437919014747),
        (0.9, 200, 1.2857987939948012),
        (0.975, 200, 1.9718962236339088),
        (0.999, 200, 3.131479814221121),
    ):
        assert t_quantile(q, df) == pytest.approx(expected, abs=1e-9)


def test_paired_t_of_last_rounds_dynamo_minus_grpo():
    # issue 32: the 5 per-seed differences of 2026-11-25 give [+0.05, +1.09], not the bootstrap's [+0.2, +0.9]
    d = [0.18, 0.92, 0.46, 1.09, 0.19]
    result = paired_t(d)
    mean, se = np.mean(d), np.std(d, ddof=1) / math.sqrt(5)
    assert result["mean"] == pytest.approx(mean) and result["se"] == pytest.approx(se)
    assert result["lo"] == pytest.approx(mean - 2.7764451051977934 * se)
    assert result["hi"] == pytest.approx(mean + 2.7764451051977934 * se)
    assert (round(result["lo"], 2), round(result["hi"], 2)) == (0.05, 1.09)
    assert result["t"] == pytest.approx(mean / se) and result["df"] == 4
    assert result["p"] == pytest.approx(0.03867102652334977, rel=1e-9)  # scipy.stats.ttest_1samp
    assert paired_t([1.0])["lo"] is None and paired_t([])["n"] == 0
    flat = paired_t([0.5, 0.5, 0.5])
    assert flat["lo"] == flat["hi"] == 0.5 and flat["p"] == 0.0


def test_holm_adjusts_step_down_and_monotone():
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": None, "e": 0.5})
    # sorted 0.01, 0.03, 0.04, 0.5 (m = 4): 0.04, max(0.04, 0.09), max(0.09, 0.08), max(0.09, 0.5)
    assert adjusted.pop("d") is None
    assert adjusted == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "e": 0.5})
    assert holm({"x": 0.6, "y": 0.7}) == {"x": 1.0, "y": 1.0}


def test_power_of_the_paired_t_test():
    # the normal limit: power -> Phi(delta/SE - z) + Phi(-delta/SE - z) for many degrees of freedom
    z = 1.959963984540054
    normal = 0.5 * (1 + math.erf((3.0 - z) / math.sqrt(2))) + 0.5 * (1 + math.erf((-3.0 - z) / math.sqrt(2)))
    assert paired_t_power(0.3, 0.1, 5000) == pytest.approx(normal, abs=2e-4)
    assert paired_t_power(0.0, 0.1, 9) == pytest.approx(0.05, abs=1e-9)  # no effect: the test's size
    assert paired_t_power(0.6, 0.125, 9) == pytest.approx(0.9888063497733043, abs=1e-9)  # scipy's nct
    # scipy 1.17.1: nct.sf(c, df, effect / se) + nct.cdf(-c, df, effect / se), c = t.ppf(1 - alpha / 2, df)
    for effect, se, df, alpha, expected in (
        (0.14, 0.07, 9, 0.05, 0.4313263147198325),
        (0.25, 0.07, 9, 0.005, 0.4994059450286418),
        (0.3, 0.1, 7, 0.05, 0.7306301093780355),
    ):
        assert paired_t_power(effect, se, df, alpha) == pytest.approx(expected, abs=1e-9)


# ---------------------------------------------------------------------------------------------- the analysis
def _made_up_rows():
    """runs.csv rows whose contrasts are known: an additive DRA/GC/UMS model (DRA +0.5, GC +0.1, UMS +0.2 points)
    with a seed-dependent wobble on DynaMO, a constant positive weight equal to GC within 0.01 points, DRA's
    allocation with equal weights +0.4, dynamic sampling +0.05, and GRPO 3 points worse at the high lr, where UMS
    gains 1 point."""
    def wobble(seed, scale):  # mean 0 over seeds 6..15
        return scale * ((seed % 3) - 1 + (seed == 15))

    rows = []
    for seed in range(6, 16):
        base = 0.15 + 0.002 * (seed % 4)
        values = {}
        for dra in (0, 1):
            for gc in (0, 1):
                for ums in (0, 1):
                    name = {(0, 0, 0): "grpo", (1, 0, 0): "dra", (0, 1, 0): "gc", (0, 0, 1): "ums", (1, 1, 0): "dra+gc",
                            (1, 0, 1): "dra+ums", (0, 1, 1): "gc+ums", (1, 1, 1): "dynamo"}[dra, gc, ums]
                    values[name] = base + 0.005 * dra + 0.001 * gc + 0.002 * ums
        values["dynamo"] += wobble(seed, 0.001)
        values["pos_weight"] = values["gc"] + wobble(seed, 0.0001)
        values["dra-equal"] = values["grpo"] + 0.004 + wobble(seed, 0.0005)
        values["grpo+ds"] = values["grpo"] + 0.0005 + wobble(seed, 0.002)
        values["dynamo+ds"] = values["dynamo"] + 0.0005 + wobble(seed, 0.002)
        if seed <= 13:
            values["grpo-hlr"] = values["grpo"] - 0.03
            values["gc-hlr"] = values["grpo-hlr"] + 0.001
            values["ums-hlr"] = values["grpo-hlr"] + 0.01 + wobble(seed, 0.001)
            values["gc+ums-hlr"] = values["gc-hlr"] + 0.01 + wobble(seed, 0.001)
        for name, value in values.items():
            rows.append({"variant": name, "seed": seed, "pass1": value, "passk": value + 0.4, "k": 8,
                         "train_rollouts": 3840 * (2 if name.endswith("+ds") else 1), "steps": 30,
                         "wall_seconds": 120.0})
    rows.append({"variant": "sft", "seed": 1234, "pass1": 0.146, "passk": 0.534, "k": 8, "train_rollouts": 0,
                 "steps": 0, "wall_seconds": 170.0})
    return rows


def test_contrasts_tests_and_verdicts_on_known_effects():
    rows = _made_up_rows()
    pass1 = {(r["variant"], r["seed"]): r["pass1"] for r in rows}
    h = {h.key: h for h in HYPOTHESES}
    assert per_seed_contrast(pass1, h["H2"], SEEDS) == pytest.approx({s: 0.5 + 0.025 * ((s % 3) - 1 + (s == 15))
                                                                      for s in SEEDS})  # dynamo's wobble, a quarter
    assert per_seed_contrast(pass1, h["H3"], SEEDS) == pytest.approx({s: 0.1 + 0.025 * ((s % 3) - 1 + (s == 15))
                                                                      for s in SEEDS})
    assert sorted(per_seed_contrast(pass1, h["C4"])) == list(range(6, 14))  # the grid's 8 seeds
    analysis = analyse_runs(rows, REPLICATION)
    tests = analysis["tests"]
    assert tests["H1"]["mean"] == pytest.approx(0.8) and tests["H1"]["n"] == 10
    assert tests["H4"]["mean"] == pytest.approx(0.2) and tests["C2b"]["mean"] == pytest.approx(0.1)
    adjusted = holm({k: t["p"] for k, t in tests.items()})
    assert all(tests[k]["p_holm"] == adjusted[k] for k in tests)
    assert tests["H2"]["verdict"].startswith("positive") and "above the scaled paper prediction +0.22" in \
        tests["H2"]["verdict"]
    assert tests["C3a"]["verdict"] == "not resolved"  # +0.05 in a wobble of +-0.2
    assert analysis["descriptive"]["D1"]["mean"] == pytest.approx(-3.0)
    answers = analysis["answers"]
    assert answers["Is GC a constant positive:negative reweighting?"].startswith("yes")
    assert answers["Is DRA's gain variance reduction or curriculum?"].startswith("both")
    assert answers[f"Does UMS stabilise GRPO at lr {HIGH_LR}?"] == "yes"
    # no degradation at the high lr: the grid is uninformative, whatever UMS does there
    flat = [{**r, "pass1": r["pass1"] + 0.03} if r["variant"].endswith("-hlr") else r for r in rows]
    assert analyse_runs(flat, REPLICATION)["answers"][f"Does UMS stabilise GRPO at lr {HIGH_LR}?"].startswith("uninformative")


def _write_runs(directory, rows):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, RUNS_FILE), "w", newline="") as f:
        writer = csv.DictWriter(f, RUNS_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def _confirm(*args, cwd):
    return subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "confirm", *args], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ, "PYTHONPATH": REPO})


def test_dynamo_confirm_prints_writes_and_checks_the_tables(tmp_path):
    _write_runs(tmp_path / "data", _made_up_rows())
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nsome text\n")
    printed = _confirm("data", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.rstrip("\n") == format_tables(read_runs(str(tmp_path / "data" / RUNS_FILE)), "data",
                                                              REPLICATION)
    text = printed.stdout
    assert "| H1 | DynaMO - GRPO (primary) | 10 | +0.80 [" in text and "| sft | SFT start | 1 | 14.60 (1 seed)" in text
    assert "| grpo+ds | GRPO + dynamic sampling | 10 |" in text and "| 7680 |" in text
    assert _confirm("data", "--check", "RESULTS.md", cwd=tmp_path).returncode == 1  # no block yet
    assert _confirm("data", "--write", "RESULTS.md", cwd=tmp_path).returncode == 0
    written = results.read_text()
    assert written.startswith("# Results\n\nsome text\n\n<!-- confirm:data -->\n")
    assert _confirm("data", "--check", "RESULTS.md", cwd=tmp_path).returncode == 0
    results.write_text(written.replace("+0.80 [", "+0.81 ["))  # a hand edit of a committed table
    check = _confirm("data", "--check", "RESULTS.md", cwd=tmp_path)
    assert check.returncode == 1 and "differ" in check.stderr
    assert _confirm("data", "--write", "RESULTS.md", cwd=tmp_path).returncode == 0
    assert results.read_text() == written  # replaced in place, not appended again
    missing = _confirm("nowhere", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1


def test_a_partial_file_gives_how_many_runs_are_in_and_no_table(tmp_path):
    """The preregistration analyses the whole experiment: while runs are missing, dynamo confirm counts them per
    seed and machine and computes nothing else."""
    rows = [{**r, "machine": "CPU A" if r["seed"] < 9 else "CPU B", "warmup": "w"} for r in _made_up_rows()]
    partial = [r for r in rows if not (r["seed"] == 12 and r["variant"] == "dra")]
    assert len(REPLICATION.preregistered_runs()) == 152 and missing_runs(rows, REPLICATION) == []
    assert missing_runs(partial, REPLICATION) == [("dra", 12)]
    _write_runs(tmp_path / "data", partial)
    printed = _confirm("data", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    text = printed.stdout
    assert "151 of the 152 preregistered runs are in" in text
    assert "| 6 | 16 | 16 | CPU A, warm-up w |" in text and "| 12 | 15 | 16 | CPU B, warm-up w |" in text
    assert "| 14 | 12 | 12 | CPU B, warm-up w |" in text
    assert "H1" not in text and "pass@1" not in text and "%" not in text  # no result of a part
    _write_runs(tmp_path / "data", rows)
    assert "| H1 | DynaMO - GRPO (primary) | 10 | +0.80 [" in _confirm("data", cwd=tmp_path).stdout


def test_confirm_refuses_a_seed_whose_runs_span_two_machines(tmp_path):
    rows = [{**r, "machine": "CPU B" if (r["seed"], r["variant"]) == (7, "gc") else "CPU A", "warmup": "w"}
            for r in _made_up_rows()]
    _write_runs(tmp_path / "data", rows)
    refused = _confirm("data", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1
    assert "seed 7's runs span two machines (15 run(s) on CPU A from warm-up w; 1 run(s) on CPU B" in refused.stderr


def test_replace_block_keeps_the_text_around_it():
    text = "a\n<!-- confirm:x -->\nold\n<!-- /confirm -->\nb\n"
    assert replace_block(text, "x", "new") == "a\n<!-- confirm:x -->\nnew\n<!-- /confirm -->\nb\n"
    assert committed_blocks(text) == {"x": "old"}


def test_the_committed_tables_are_what_the_command_prints():
    """Every confirm block of docs/results/testbed.md equals ``dynamo confirm DIR`` for the committed DIR/runs.csv,
    and committed confirmatory data has its block."""
    blocks = committed_blocks(open(RESULTS, encoding="utf-8").read())
    if os.path.isfile(os.path.join(REPO, CONFIRMATORY, RUNS_FILE)):
        assert CONFIRMATORY in blocks, f"{CONFIRMATORY}/runs.csv is committed but docs/results/testbed.md has no tables of it"
    for source, block in blocks.items():
        path = os.path.join(REPO, source, RUNS_FILE)
        rows = read_runs(path) if os.path.exists(path) else []  # a preregistered study before its first run
        if not rows:
            assert source in {s.raw_data for s in STUDIES.values()} and "0 of the 152 preregistered runs" in block
        assert block == format_tables(rows, source, study_of(rows, source)), \
            f"the tables of {source} are stale: dynamo confirm {source} --write docs/results/testbed.md"


def test_the_preregistrations_power_table_is_what_the_script_prints():
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("power_calc", os.path.join(REPO, "scripts", "power_calc.py"))
    power_calc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(power_calc)
    doc = open(os.path.join(REPO, "docs", "ablation.md"), encoding="utf-8").read()
    (block,) = re.findall(r"<!-- power:preregistration -->\n(.*?)\n<!-- /power -->", doc, re.S)
    assert block == power_calc.preregistration_table()


# ---------------------------------------------------------------------------------------------- power, as realised
def test_the_detectable_effect_and_the_seed_count_invert_the_power():
    for se, df, alpha in ((0.1, 9, 0.05), (0.222, 9, 0.005), (0.07, 18, 0.025)):
        effect = detectable_effect(se, df, 0.8, alpha)
        assert paired_t_power(effect, se, df, alpha) == pytest.approx(0.8, abs=1e-5)
        assert paired_t_power(0.98 * effect, se, df, alpha) < 0.8 < paired_t_power(1.02 * effect, se, df, alpha)
    # many seeds: the normal approximation (z_0.975 + z_0.8) SE
    assert detectable_effect(0.1, 5000) == pytest.approx((1.959964 + 0.841621) * 0.1, rel=1e-3)
    seeds = seeds_for_power(0.494, 0.48)
    assert paired_t_power(0.48, math.sqrt(0.494 / seeds), seeds - 1) >= 0.8
    assert paired_t_power(0.48, math.sqrt(0.494 / (seeds - 1)), seeds - 2) < 0.8
    # the normal approximation undercounts by the t's heavier tails: n = var (z + z)^2 / d^2 = 16.8
    assert 0.494 * (1.959964 + 0.841621) ** 2 / 0.48 ** 2 < seeds


def test_the_power_lines_set_the_realised_error_against_the_plan():
    rows = _made_up_rows()
    analysis = analyse_runs(rows, REPLICATION)
    line = analysis["power"]["H1"]
    tests = analysis["tests"]
    assert line["se"] == tests["H1"]["se"] and line["n"] == 10
    assert line["planned_se"] == pytest.approx(math.sqrt(0.236 / 1.5 / 10))
    assert line["ratio"] == pytest.approx(tests["H1"]["se"] / line["planned_se"])
    assert line["detectable"] == pytest.approx(detectable_effect(tests["H1"]["se"], 9, 0.8, 0.05))
    assert line["detectable_holm"] == pytest.approx(detectable_effect(tests["H1"]["se"], 9, 0.8, 0.005))
    assert line["power"] == pytest.approx({e: paired_t_power(e, tests["H1"]["se"], 9) for e in (0.3, 0.57)})
    assert analysis["power"]["C4"]["n"] == 8 and set(analysis["power"]) <= {h.key for h in HYPOTHESES}
    text = format_tables(rows, "data", REPLICATION)
    assert "| H1 | 10 | 0.125 |" in text and "detectable at power 0.8: alpha 0.05 / 0.005" in text


def test_the_second_studys_seed_count_is_computed_from_the_first_studys_data():
    """The preregistration's numbers (docs/ablation.md, power:second-study) come from the committed runs.csv of the
    first study, and its design constants are those numbers."""
    import re

    rows = read_runs(os.path.join(REPO, CONFIRMATORY, RUNS_FILE))
    plan = second_study_plan(rows)
    assert plan["H1"]["seeds"] == len(SECOND.seeds) == 19 and set(SECOND.seeds).isdisjoint(range(1, 16))
    assert SECOND.planned_variance == pytest.approx({k: v["variance"] for k, v in plan.items()}, abs=1e-4)
    doc = open(os.path.join(REPO, "docs", "ablation.md"), encoding="utf-8").read()
    (block,) = re.findall(r"<!-- power:second-study -->\n(.*?)\n<!-- /power -->", doc, re.S)
    labels = {"H1": "H1 DynaMO - GRPO", "H2": "H2 DRA, marginal"}
    for key, row in plan.items():
        assert (f"| {labels[key]} | {row['estimate']:+.2f} | {row['variance']:.3f} | {row['seeds']} |") in block


def test_a_runs_file_names_its_study_by_directory_or_seeds():
    rows = _made_up_rows()
    assert study_of(rows) is REPLICATION and study_of([], "benchmarks/results/confirmatory2") is SECOND
    second = [{**r, "seed": r["seed"] + 10} for r in rows if r["variant"] in ("grpo", "dynamo")]
    assert study_of(second) is SECOND
    with pytest.raises(ValueError, match="no preregistered study"):
        study_of([{**r, "seed": 99} for r in rows])
    assert len(SECOND.preregistered_runs()) == 152 and set(STUDIES) == {"replication", "second"}
    assert SECOND.preregistered_runs()[:8] == [(v, 16) for v in ("grpo", "dra", "gc", "ums", "dra+gc", "dra+ums",
                                                                  "gc+ums", "dynamo")]


def test_the_pages_quote_the_first_studys_power_lines_as_computed():
    """The README and the testbed page say in words what the replication could resolve; those numbers are the power
    lines dynamo confirm computes from the committed runs.csv, not figures typed once and left to drift."""
    rows = read_runs(os.path.join(REPO, CONFIRMATORY, RUNS_FILE))
    power = analyse_runs(rows, REPLICATION)["power"]
    readme = " ".join(open(os.path.join(REPO, "README.md"), encoding="utf-8").read().split())
    page = " ".join(open(RESULTS, encoding="utf-8").read().split())
    detectable = {key: f"{power[key]['detectable']:+.2f}" for key in ("H1", "H2", "H3", "H4", "C4")}
    for text in (readme, page):
        assert f"at least {detectable['H1']} points for H1" in text
        assert f"{detectable['H2']} for DRA, {detectable['H3']} for GC" in text
        assert f"{detectable['H4']} for UMS" in text
    assert f"(+{power['H1']['detectable_holm']:.2f} at Holm's first threshold)" in page
    assert f"{detectable['C4']} for UMS at the high learning rate" in page
    scaled = [power[key]["power"][effect] for key, effect in (("H2", 0.22), ("H3", 0.14), ("H4", 0.25))]
    assert "power {:.2f} (DRA), {:.2f} (GC) and {:.2f} (UMS)".format(*scaled) in page
    assert f"power {min(scaled):.2f}-{max(scaled):.2f} against the paper's scaled effects" in readme
    own = paired_t_power(analyse_runs(rows, REPLICATION)["tests"]["H1"]["mean"], power["H1"]["se"], 9)
    assert f"H1 {own:.2f} at its own estimate" in page
    ratios = [line["ratio"] for line in power.values()]
    assert f"{min(r for r in ratios if r > 1.2):.1f}-{max(ratios):.1f}x" in readme and "1.5-3.3x" in page


def test_the_pages_quote_the_second_studys_verdicts_as_computed():
    """The README and the testbed page state the second study's verdicts, estimates, intervals, Holm p and what it
    could detect in words; each is what dynamo confirm computes from the committed runs.csv."""
    rows = read_runs(os.path.join(REPO, SECOND.raw_data, RUNS_FILE))
    if missing_runs(rows, SECOND):
        pytest.skip("the second study is not complete in the committed raw data")
    result = analyse_runs(rows, SECOND)
    readme = " ".join(open(os.path.join(REPO, "README.md"), encoding="utf-8").read().split())
    page = " ".join(open(RESULTS, encoding="utf-8").read().split())
    h1, h2 = result["tests"]["H1"], result["tests"]["H2"]
    for text in (readme, page):
        assert f"**H1, DynaMO - GRPO: {h1['verdict']}**, {h1['mean']:+.2f} [{h1['lo']:+.2f}, {h1['hi']:+.2f}]" in text
        assert f"{h2['mean']:+.2f} [{h2['lo']:+.2f}, {h2['hi']:+.2f}]" in text and h2["verdict"] in text
        assert f"detect {result['power']['H1']['detectable']:+.2f} and {result['power']['H2']['detectable']:+.2f}" \
            in text
    assert f"(Holm p {h1['p_holm']:.3f})" in readme and f"(Holm p {h2['p_holm']:.4f})" in readme
    assert f"(p {h1['p']:.3f}, Holm {h1['p_holm']:.3f})" in page and f"(Holm {h2['p_holm']:.4f})" in page
