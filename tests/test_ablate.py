"""`dynamo ablate`: the statistics (bootstrap CI, paired and marginal effects, realised variance ratio), the table
layout, and the scheduler / resume logic with a fake trainer (no training)."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from hf_reference import REPO
from megatron_dynamo.cli import build_parser
from megatron_dynamo.commands import ablate
from megatron_dynamo.experiments import ablation as ablation_module
from megatron_dynamo.experiments import executor
from megatron_dynamo.experiments.analysis import analyse
from megatron_dynamo.experiments.collector import run_state
from megatron_dynamo.experiments.paper import PAPER_AVG, PAPER_BENCHMARKS, TABLE1, TABLE2
from megatron_dynamo.experiments.plan import PLAN_FILE, RunSpec
from megatron_dynamo.trainer import provenance as provenance_module
from megatron_dynamo.trainer.provenance import checkpoint_hash, machine_id, write_run_provenance, write_saved_warmup
from megatron_dynamo.experiments.stats import (bootstrap_ci, marginal_effect, paired_differences,
                                               realised_variance_ratio, zero_advantage_share)
from megatron_dynamo.experiments.tables import format_markdown, main_table, table1_table
from megatron_dynamo.experiments.variants import (BASELINES, CONTROLS, GROUPS, HIGH_LR, PAPER_ORDER, TABLE1_ORDER,
                                                  VARIANT_KEYS, VARIANTS, parse_variants)


# ---------------------------------------------------------------------------------------------- statistics
def test_bootstrap_ci_of_constant_samples_has_zero_width():
    ci = bootstrap_ci([0.3, 0.3, 0.3], resamples=1000)
    assert ci["mean"] == pytest.approx(0.3) and ci["lo"] == pytest.approx(0.3) and ci["hi"] == pytest.approx(0.3)
    assert ci["n"] == 3
    assert bootstrap_ci([0.7])["lo"] == bootstrap_ci([0.7])["hi"] == 0.7
    empty = bootstrap_ci([None, float("nan"), "nan"])
    assert empty["n"] == 0 and empty["mean"] is None


def test_bootstrap_ci_of_a_large_normal_sample_matches_the_normal_interval():
    x = np.random.default_rng(123).normal(2.0, 3.0, size=500)
    ci = bootstrap_ci(x, resamples=4000, seed=7)
    half = 1.96 * x.std(ddof=1) / np.sqrt(x.size)  # reference computed here, not by the code under test
    assert ci["mean"] == pytest.approx(x.mean())
    assert ci["lo"] == pytest.approx(x.mean() - half, abs=0.1 * half)
    assert ci["hi"] == pytest.approx(x.mean() + half, abs=0.1 * half)


def test_bootstrap_ci_is_reproducible_with_its_seed():
    x = [0.1, 0.5, 0.35, 0.8]
    assert bootstrap_ci(x, resamples=500, seed=3) == bootstrap_ci(x, resamples=500, seed=3)
    assert bootstrap_ci(x, resamples=500, seed=3) != bootstrap_ci(x, resamples=500, seed=4)
    ci = bootstrap_ci(x, resamples=500)
    assert min(x) <= ci["lo"] < ci["mean"] < ci["hi"] <= max(x)


def test_paired_differences_use_the_common_seeds_only():
    a = {1: 0.5, 2: 0.6, 3: 0.9, 4: "nan"}
    b = {1: 0.4, 3: 0.7, 4: 0.1, 5: 0.2}
    assert paired_differences(a, b) == pytest.approx({1: 0.1, 3: 0.2})
    assert paired_differences({}, b) == {}


def _additive(base=0.3, effects=(0.05, 0.02, -0.01), seeds=(1, 2, 3), offsets=(0.0, 0.1, -0.04)):
    values = {}
    for name, v in VARIANTS.items():
        if v.power != 1.0:
            continue
        values[name] = {s: base + o + effects[0] * v.dra + effects[1] * v.gc + effects[2] * v.ums
                        for s, o in zip(seeds, offsets)}
    return values


def test_marginal_effects_recover_an_additive_model_exactly():
    values = _additive()
    for component, expected in zip(("dra", "gc", "ums"), (0.05, 0.02, -0.01)):
        effect = marginal_effect(values, component)
        assert effect["per_seed"] == pytest.approx({1: expected, 2: expected, 3: expected})
        assert effect["missing"] == [] and len(effect["pairs"]) == 4
        assert all(on != off and VARIANTS[on].__getattribute__(component) and
                   not VARIANTS[off].__getattribute__(component) for on, off in effect["pairs"])
    # an interaction term moves the simple effects but the marginal effect is their mean
    values["dynamo"] = {s: v + 0.04 for s, v in values["dynamo"].items()}
    assert marginal_effect(values, "dra")["per_seed"][1] == pytest.approx(0.05 + 0.01)


def test_a_missing_variant_makes_the_marginal_effect_na():
    values = _additive()
    del values["gc+ums"]
    effect = marginal_effect(values, "dra")
    assert effect["per_seed"] == {} and effect["missing"] == ["gc+ums"]
    values = _additive()
    del values["dra"][2]  # one failed run: that seed drops out
    assert sorted(marginal_effect(values, "dra")["per_seed"]) == [1, 3]
    # the analysis says n/a
    summaries = {(name, s): {"pass@1": v, "pass@4": v} for name, per in _additive().items() for s, v in per.items()
                 if name != "gc+ums"}
    analysis = analyse(summaries, [n for n in VARIANTS if n not in ("gc+ums", "dynamo-p0.5")], [1, 2, 3], k=4,
                       resamples=200)
    assert analysis["effects"]["dra"]["pass@1"]["mean"] is None
    assert analysis["effects"]["power 0.5 - power 1.0"]["pass@1"]["missing"] == ["dynamo-p0.5"]
    assert analysis["effects"]["dynamo - grpo"]["pass@1"]["mean"] == pytest.approx(0.06)


def test_paper_marginal_effects_from_its_table():
    analysis = analyse({}, list(VARIANTS), [1], k=4, resamples=100)
    # DRA: mean of (41.6-39.9), (40.3-38.9), (40.1-37.6), (38.4-37.2) = 1.7
    assert analysis["paper_marginal_avg"]["dra"] == pytest.approx(1.7)
    assert PAPER_AVG["dynamo"] == 41.6


def test_realised_variance_ratio_by_hand():
    # uniform counts: exactly 1 whatever the success rates
    uniform = [{"step": 1, "prompt_id": i, "count": 8, "correct": c} for i, c in enumerate([1, 4, 8, 0, 6])]
    assert realised_variance_ratio(uniform)["mean"] == 1.0
    # step 2: counts 4 and 12 (n_uniform 8), successes 2/4 and 3/12: p(1-p) = 0.25 and 0.1875
    #   allocated: 0.25/4 + 0.1875/12 = 0.078125; uniform: (0.25 + 0.1875)/8 = 0.0546875 -> ratio 1.428571...
    # step 3: counts 2 and 6 (n_uniform 4), successes 0/2 and 3/6: only the second has variance 0.25
    #   allocated: 0.25/6; uniform: 0.25/4 -> ratio 2/3
    # step 4: every group all correct or all wrong: left out
    rows = [{"step": 2, "prompt_id": "a", "count": 4, "correct": 2}, {"step": 2, "prompt_id": "b", "count": 12,
                                                                       "correct": 3},
            {"step": 3, "prompt_id": "a", "count": 2, "correct": 0}, {"step": 3, "prompt_id": "b", "count": 6,
                                                                       "correct": 3},
            {"step": 4, "prompt_id": "a", "count": 4, "correct": 4}, {"step": 4, "prompt_id": "b", "count": 4,
                                                                       "correct": 0}]
    out = realised_variance_ratio(rows)
    assert out["per_step"] == pytest.approx({2: 0.078125 / 0.0546875, 3: 2 / 3})
    assert out["steps_used"] == 2 and out["mean"] == pytest.approx((0.078125 / 0.0546875 + 2 / 3) / 2)
    assert realised_variance_ratio([])["mean"] is None
    assert zero_advantage_share(rows) == pytest.approx(3 / 6)


def test_table_rows_follow_the_paper_order_with_its_labels():
    summaries = {(name, s): {"pass@1": 0.1 * i, "pass@4": 0.2, "final_reward": 0.5,
                             "rollouts_to_threshold_censored": 100, "censored": False}
                 for i, name in enumerate(VARIANTS) for s in (1, 2)}
    summaries.update({("sft", s): {"pass@1": 0.05, "pass@4": 0.1} for s in (1, 2)})
    analysis = analyse(summaries, list(VARIANTS), [1, 2], k=4, resamples=100)
    lines = main_table(analysis, budget=1000).splitlines()
    labels = [line.split("|")[1].strip() for line in lines[2:]]
    assert labels == ["DynaMO", "w/o GC", "w/o UMS", "w/o DRA", "w/o GC & DRA", "w/o GC & UMS", "w/o UMS & DRA",
                      "GRPO (w/o ALL)", "DynaMO, power 0.5", "SFT start"]
    assert [line.split("|")[2].strip() for line in lines[2:]] == [*PAPER_ORDER, "sft"]
    assert "held-out pass@1" in lines[0] and "Δ pass@1 vs GRPO" in lines[0] and "rollouts to threshold" in lines[0]
    # GRPO is the reference; DynaMO's Δ is paired: (0.7 - 0.0) = +70 points, zero width (same in both seeds)
    assert "0 (reference)" in lines[9] and "+70.0 [+70.0, +70.0]" in lines[2]
    assert parse_variants("dynamo, grpo") == ["dynamo", "grpo"]
    for bad in ("ppo", "grpo,grpo", ""):
        with pytest.raises(ValueError):
            parse_variants(bad)


def test_variant_groups_and_the_baselines_registry():
    from megatron_dynamo.trainer.config import ALGORITHMS, load_run_config

    assert parse_variants("ablation") == list(GROUPS["ablation"]) == [n for n in VARIANTS
                                                                       if VARIANTS[n].kind == "ablation"]
    assert parse_variants("table1") == ["grpo", "clip_higher", "entropy_loss", "fork_tokens", "entropy_adv",
                                        "clip_cov", "kl_cov", "w_reinforce", "dynamo"] == list(TABLE1_ORDER)
    both = parse_variants("table1,ablation")
    assert len(both) == 16 == len(set(both)) and both[:9] == list(TABLE1_ORDER)  # grpo, dynamo once each
    assert sorted(parse_variants("all")) == sorted(both) == sorted(n for n in VARIANTS if n not in CONTROLS)
    assert parse_variants("kl_cov,table1")[:2] == ["kl_cov", "grpo"]
    for bad in ("table1,table1", "kl_cov,kl_cov", "table2"):
        with pytest.raises(ValueError):
            parse_variants(bad)
    # the seven are the trainer's --algo names besides dynamo and grpo; each is GRPO's four keys + its --algo
    assert set(BASELINES) == set(ALGORITHMS) - {"dynamo", "grpo"} and len(BASELINES) == 7
    for name in BASELINES:
        assert VARIANTS[name].algo == name and VARIANTS[name].overrides() == VARIANTS["grpo"].overrides()
        run = load_run_config(os.path.join(REPO, "configs", "cpu_default.yaml"), list(VARIANTS[name].overrides()),
                              algo=name)
        assert not run.dynamo.allocation.enabled and not run.dynamo.modulation.gc and not run.dynamo.modulation.ums
    assert all(VARIANTS[n].algo == "dynamo" for n in GROUPS["ablation"])


def test_the_controls_are_variants_that_change_only_their_own_keys():
    from megatron_dynamo.trainer.config import load_run_config

    recipe = os.path.join(REPO, "configs", "cpu_testbed.yaml")
    assert parse_variants("confirmatory") == [*GROUPS["factorial"], "pos_weight", "dra-equal", "grpo+ds", "dynamo+ds"]
    assert len(GROUPS["factorial"]) == 8 and "dynamo-p0.5" not in GROUPS["factorial"]
    assert parse_variants("high_lr") == ["grpo-hlr", "ums-hlr", "gc-hlr", "gc+ums-hlr"]
    base = {name: load_run_config(recipe, list(VARIANTS[name].overrides()), algo=VARIANTS[name].algo)
            for name in ("grpo", "gc", "dra", "dynamo", "ums", "gc+ums", "clip_cov")}
    expected = {  # control: (its reference, the config as the reference's with these changes)
        "pos_weight": ("grpo", lambda r: (r.dynamo.modulation.pos_weight, r.dynamo.modulation.gc), (True, False)),
        "dra-equal": ("dra", lambda r: r.dynamo.loss.prompt_weight, "equal"),
        "grpo+ds": ("grpo", lambda r: r.dynamo.sampling.dynamic, True),
        "dynamo+ds": ("dynamo", lambda r: r.dynamo.sampling.dynamic, True),
        "grpo-hlr": ("grpo", lambda r: r.optim.lr, float(HIGH_LR)),
        "ums-hlr": ("ums", lambda r: r.optim.lr, float(HIGH_LR)),
        "gc-hlr": ("gc", lambda r: r.optim.lr, float(HIGH_LR)),
        "gc+ums-hlr": ("gc+ums", lambda r: r.optim.lr, float(HIGH_LR)),
        "clip_cov_authors": ("clip_cov", lambda r: (r.dynamo.loss.clip_low, r.dynamo.loss.clip_high), (1.0, 1.0)),
    }
    assert set(expected) == set(CONTROLS)
    for name, (reference, read, value) in expected.items():
        run = load_run_config(recipe, list(VARIANTS[name].overrides()), algo=VARIANTS[name].algo)
        assert read(run) == value and read(base[reference]) != value, name
        # nothing else differs from the reference (the budget included)
        undo = {"pos_weight": ["dynamo.modulation.pos_weight=false"], "dra-equal": ["dynamo.loss.prompt_weight=rollouts"],
                "clip_cov_authors": ["dynamo.loss.clip_low=0.2", "dynamo.loss.clip_high=0.2"]}.get(
            name, ["dynamo.sampling.dynamic=false"] if name.endswith("+ds") else ["optim.lr=5e-5"])
        again = load_run_config(recipe, list(VARIANTS[name].overrides()) + undo, algo=VARIANTS[name].algo)
        assert again == base[reference], name
    # every variant sets the same explicit keys, so a recipe cannot leak a control's switch into another variant
    keys = {tuple(item.split("=")[0] for item in v.overrides()[:7]) for v in VARIANTS.values()}
    assert keys == {VARIANT_KEYS}


def test_paper_tables_are_transcribed_consistently():
    # every Avg. is its row's mean (to the paper's rounding), and Table 2 repeats Table 1's 7B P@1 of its rows
    assert len(PAPER_BENCHMARKS) == 6 and set(TABLE1["Qwen2.5-Math-7B"]) == set(TABLE1_ORDER)
    for model, rows in TABLE1.items():
        for name, row in rows.items():
            assert len(row) == 14
            assert np.mean(row[0:12:2]) == pytest.approx(row[12], abs=0.051), (model, name)
            assert np.mean(row[1:12:2]) == pytest.approx(row[13], abs=0.051), (model, name)
    for name, row in TABLE2.items():
        assert np.mean(row[:6]) == pytest.approx(row[6], abs=0.051), name
        if name in TABLE1["Qwen2.5-Math-7B"]:
            assert TABLE1["Qwen2.5-Math-7B"][name][0:12:2] == row[:6]
    assert list(TABLE2) == [v for v in PAPER_ORDER if v != "dynamo-p0.5"]


def test_table1_layout_per_benchmark_beside_the_paper():
    # two benchmarks a and b; variant i of TABLE1_ORDER: pass@1 a = 0.1 + 0.01 i + 0.02 s (seed s), b = a + 0.1
    summaries = {}
    for i, name in enumerate(TABLE1_ORDER):
        for s in (1, 2):
            a = 0.1 + 0.01 * i + 0.02 * s
            summaries[(name, s)] = {
                "pass@1": a + 0.05, "pass@8": 0.5, "final_reward": 0.5, "rollouts_to_threshold_censored": 64,
                "censored": False, "eval": {"eval/a/pass@1": a, "eval/b/pass@1": a + 0.1, "eval/a/pass@8": 0.4,
                                            "eval/b/pass@8": 0.6, "eval/avg/pass@1": a + 0.05, "eval/avg/pass@8": 0.5}}
    analysis = analyse(summaries, list(TABLE1_ORDER), [1, 2], k=8, resamples=200)
    assert analysis["benchmarks"] == ["a", "b"]
    lines = table1_table(analysis, budget=64).splitlines()
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert header[3:7] == ["a P@1", "a P@8", "b P@1", "b P@8"] and header[-2:] == [
        "paper 1.5B Avg. P@1 / P@32", "paper 7B Avg. P@1 / P@32"]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]
    assert [c[0] for c in cells] == ["GRPO", "Clip-Higher", "Entropy Loss", "Fork Tokens", "Entropy Advantages",
                                     "Clip-COV", "KL-COV", "W-REINFORCE", "DynaMO (Ours)"]
    # W-REINFORCE (i = 7): a = 0.17 + 0.02 s -> 19 and 21 % (mean 20.0); b = a + 10 points; Δ vs GRPO +7.0 flat
    w = cells[7]
    assert w[3] == "20.0 [19.0, 21.0]" and w[5] == "30.0 [29.0, 31.0]" and w[4] == "40.0 [40.0, 40.0]"
    assert w[7] == "25.0 [24.0, 26.0]" and w[9] == "+7.0 [+7.0, +7.0]" and cells[0][9] == "0 (reference)"
    assert w[-2:] == ["31.0 / 52.8", "40.1 / 61.1"] and cells[8][-2:] == ["32.7 / 55.6", "41.6 / 63.3"]
    assert cells[0][-1] == "37.2 / 57.2"
    md = format_markdown(analysis, title="t", settings_line="s", budget=64)
    assert md.index("## Baselines (paper Table 1 layout)") < md.index("## Ablation (paper Table 2 layout)")
    # the diagnostics cover the baselines too
    assert "| w_reinforce |" in md.split("## Eq. 23")[1]


# ---------------------------------------------------------------------------------------------- fake trainer
STEPS = 6


RECIPE_SEED = 77  # the recipe's trainer.seed: the seed of a shared SFT warm-up


class FakeTrainer:
    """Stands in for `dynamo train`: writes metrics.jsonl / prompts.jsonl / checkpoints like a run, with values
    that depend only on (variant, seed, step); refuses to overwrite checkpoints without --resume, continues from
    the latest one with it. ``interrupt``: (call number, step): raise KeyboardInterrupt after that step's
    checkpoint, as Ctrl-C would stop the real trainer; with ``by_signal`` send this process SIGINT instead."""

    def __init__(self, interrupt=None, sft_per_seed=True, by_signal=False):
        self.calls = []
        self.interrupt = interrupt
        self.sft_per_seed = sft_per_seed
        self.by_signal = by_signal

    def __call__(self, command, env, log_path):
        self.calls.append(list(command))
        assert command[1:5] == ["-m", "megatron_dynamo.cli", "train", command[4]]
        kv = dict(item.split("=", 1) for item in command if "=" in item and not item.startswith("-"))
        out = Path(kv["trainer.output_dir"])
        assert Path(log_path).parent == out and out.is_dir()
        ckpt = out / "checkpoints"
        resume = "--resume" in command
        saved = sorted(int(p.name[5:]) for p in ckpt.glob("step_*")) if ckpt.is_dir() else []
        if saved and not resume:
            raise AssertionError("the trainer refuses to overwrite checkpoints")
        seed = int(kv["trainer.seed"])
        steps = int(kv.get("trainer.steps", STEPS))

        def save(step):
            (ckpt / f"step_{step:06d}").mkdir(parents=True, exist_ok=True)
            (ckpt / f"step_{step:06d}" / "trainer_state.json").write_text("{}")
            (ckpt / "latest").write_text(f"step_{step:06d}")

        write_run_provenance(out, kv.get("model.checkpoint"), resumed=resume)  # as the trainer does, at its start
        if steps == 0:  # the SFT warm-up
            assert "evaluation.at_start=true" in command
            with open(out / "metrics.jsonl", "w") as f:
                f.write(json.dumps({"step": 0, "eval/held/pass@1": 0.1 + 0.01 * seed,
                                    "eval/avg/pass@1": 0.1 + 0.01 * seed, "eval/avg/pass@4": 0.2}) + "\n")
            save(0)
            write_saved_warmup(out, ckpt / "step_000000")
            return 0
        assert kv["evaluation.every"] == str(STEPS) and kv["trainer.sft_warmup_steps"] == "0"
        sft_seed = seed if self.sft_per_seed else RECIPE_SEED
        assert kv["model.checkpoint"].endswith(os.path.join(f"sft/seed{sft_seed}/checkpoints", "step_000000"))
        assert os.path.isdir(kv["model.checkpoint"])  # its SFT run came first
        dra, gc, ums = (kv[k] == "true" for k in VARIANT_KEYS[:3])
        power = float(kv["dynamo.allocation.power"])
        algo = command[command.index("--algo") + 1]
        bump = 0.01 * (1 + BASELINES.index(algo)) if algo in BASELINES else 0.0  # a baseline's own effect
        start = saved[-1] if resume and saved else 0
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")] if resume and start else []
        rows = [r for r in rows if r["step"] <= start]
        prompts = [json.loads(line) for line in open(out / "prompts.jsonl")] if resume and start else []
        prompts = [r for r in prompts if r["step"] <= start]
        for step in range(start + 1, steps + 1):
            reward = 0.3 + 0.05 * step + 0.02 * dra + 0.01 * gc + 0.005 * ums + 0.001 * seed + 0.003 * (power < 1)
            row = {"step": step, "reward_mean": reward, "rollouts": 32, "variance_ratio": 0.8 if dra else 1.0,
                   "response_length_mean": 5.0, "entropy_mean": 1.0 - 0.1 * step + 0.05 * gc}
            if gc or ums:
                row["modulation/scale_mean"] = 1.0 + 0.1 * gc - 0.05 * ums
            if step == steps:
                final = 0.4 + 0.05 * dra + 0.02 * gc + 0.01 * ums + 0.01 * seed + 0.004 * (power < 1) + bump
                row.update({"eval/held/pass@1": final, "eval/avg/pass@1": final, "eval/avg/pass@4": final + 0.1})
                samples = out / "eval" / f"step_{steps:06d}"  # two held-out problems x 4 samples
                samples.mkdir(parents=True, exist_ok=True)
                (samples / "samples.jsonl").write_text("".join(
                    json.dumps({"benchmark": "held", "problem_id": f"q{p}", "sample_index": j,
                                "correct": j < p + dra + seed % 2}) + "\n" for p in range(2) for j in range(4)))
            rows.append(row)
            counts = [4, 12] if dra else [8, 8]
            prompts += [{"step": step, "prompt_id": i, "count": c, "correct": c // (i + 2)}
                        for i, c in enumerate(counts)]
            with open(out / "metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            with open(out / "prompts.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in prompts)
            if step % 2 == 0 or step == steps:
                save(step)
            if self.interrupt == (len(self.calls), step):
                if not self.by_signal:
                    raise KeyboardInterrupt
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)  # the handler runs here; an ignored SIGINT lets the run go on
        return 0


@pytest.fixture
def recipe(tmp_path):
    values = yaml.safe_load(open(os.path.join(REPO, "configs", "cpu_default.yaml")))
    values["trainer"].update(steps=STEPS, sft_warmup_steps=5, output_dir=str(tmp_path / "ignored"), seed=RECIPE_SEED)
    values["evaluation"] = {"benchmarks": ["held"], "n": 4, "k": [4]}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def _args(recipe, out, *extra):
    # as `dynamo` parses a command line: key=value words after an option join the overrides
    per_seed = [] if "--shared-sft" in extra else ["--sft-per-seed"]
    extra = [e for e in extra if e != "--shared-sft"]
    args, rest = build_parser().parse_known_args(["ablate", recipe, "--output-dir", str(out), "--bootstrap", "200",
                                                  *per_seed, *extra])
    assert all("=" in item for item in rest)
    args.overrides = [*args.overrides, *rest]
    return args


def _kind(command):
    kv = dict(item.split("=", 1) for item in command if "=" in item)
    algo = command[command.index("--algo") + 1]
    matches = [name for name, v in VARIANTS.items() if v.algo == algo and all(item in command for item in v.overrides())]
    variant = max(matches, key=lambda name: len(VARIANTS[name].overrides()), default=None)  # a control's extra too
    return ("sft" if kv.get("trainer.steps") == "0" else variant, int(kv["trainer.seed"]), "--resume" in command)


def _analysis(out):
    return json.loads((Path(out) / "ablation.json").read_text())["analysis"]


@pytest.mark.slow
def test_ablation_with_a_fake_trainer_resumes_after_an_interrupt(recipe, tmp_path, capsys):
    variants = "grpo,dra,gc,ums,dra+gc,dra+ums,gc+ums,dynamo,dynamo-p0.5"
    whole = FakeTrainer()
    assert ablate.main(_args(recipe, tmp_path / "a", "--seeds", "1,2", "--variants", variants), launch=whole) == 0
    assert len(whole.calls) == 2 * (1 + 9)
    kinds = [_kind(c) for c in whole.calls]
    assert kinds[0] == ("sft", 1, False) and kinds[10] == ("sft", 2, False)  # seed-major, SFT first
    printed = capsys.readouterr().out
    assert "[20/20]" in printed and "held-out pass@1" in printed and "final reward" in printed

    # interrupted during the 4th run (gc, seed 1) after step 3 (checkpoint at step 2)
    out = tmp_path / "b"
    first = FakeTrainer(interrupt=(4, 3))
    assert ablate.main(_args(recipe, out, "--seeds", "1,2", "--variants", variants), launch=first) == 130
    assert len(first.calls) == 4
    assert "run the same command again to resume" in capsys.readouterr().err
    (out / "runs" / "ums" / "seed1").mkdir(parents=True)  # a run that started but saved nothing: redone
    (out / "runs" / "ums" / "seed1" / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.9}\n')
    second = FakeTrainer()
    assert ablate.main(_args(recipe, out, "--seeds", "1,2", "--variants", variants), launch=second) == 0
    kinds = [_kind(c) for c in second.calls]
    assert kinds[0] == ("gc", 1, True)  # the unfinished run with a checkpoint continues
    assert ("sft", 1, False) not in kinds and ("grpo", 1, False) not in kinds and ("dra", 1, False) not in kinds
    assert len(kinds) == 20 - 3 and all(not r for _, _, r in kinds[1:])
    assert "reused" in capsys.readouterr().out
    assert _analysis(out)["per_variant"] == _analysis(tmp_path / "a")["per_variant"]
    assert _analysis(out)["effects"] == _analysis(tmp_path / "a")["effects"]

    # everything done: a third call runs nothing and re-tabulates (another threshold is fine)
    third = FakeTrainer()
    assert ablate.main(_args(recipe, out, "--seeds", "1,2", "--variants", variants, "--threshold", "0.5"),
                      launch=third) == 0
    assert third.calls == []
    result = json.loads((out / "ablation.json").read_text())
    # a reused run keeps the wall time of the call that ran it (power_calc reads run times from here)
    assert {r["status"] for r in result["runs"]} == {"reused"}
    assert all(isinstance(r["seconds"], float) for r in result["runs"])
    a = result["analysis"]
    assert a["effects"]["dra"]["pass@1"]["mean"] == pytest.approx(0.05)
    assert a["effects"]["gc"]["pass@4"]["mean"] == pytest.approx(0.02)
    assert a["effects"]["power 0.5 - power 1.0"]["pass@1"]["mean"] == pytest.approx(0.004)
    assert a["per_variant"]["sft"]["pass@1"]["mean"] == pytest.approx(0.115)
    assert a["per_variant"]["dynamo"]["variance_ratio_predicted"]["mean"] == pytest.approx(0.8)
    assert a["per_variant"]["grpo"]["variance_ratio_realised"]["mean"] == pytest.approx(1.0)
    # the fake's DRA steps: counts 4 and 12 with 2/4 and 4/12 correct: (1/4 / 4 + 2/9 / 12) / ((1/4 + 2/9) / 8)
    assert a["per_variant"]["dra"]["variance_ratio_realised"]["mean"] == pytest.approx(
        (0.25 / 4 + 2 / 9 / 12) / ((0.25 + 2 / 9) / 8))
    assert a["per_variant"]["grpo"]["modulation"]["modulation/scale_mean"] is None
    assert a["per_variant"]["gc"]["modulation"]["modulation/scale_mean"] == pytest.approx(1.1)
    # the entropy trajectory: the first and the last tenth of the steps (one step each at this length)
    assert a["per_variant"]["gc"]["entropy_first"]["mean"] == pytest.approx(1.0 - 0.1 + 0.05)
    assert a["per_variant"]["grpo"]["entropy_final"]["mean"] == pytest.approx(1.0 - 0.1 * STEPS)
    md = (out / "ablation.md").read_text()
    assert "0.950 -> " in md
    assert "2 seed(s)" in md and "crude" in md and "| DynaMO | dynamo |" in md
    assert "Baselines (paper Table 1 layout)" not in md  # none of the seven was run
    assert (out / "ablation.png").stat().st_size > 0 and (out / "report" / "report.html").is_file()
    plan = json.loads((out / PLAN_FILE).read_text())
    assert plan["seeds"] == [1, 2] and plan["budget"]["rollouts_per_step"] == 32 * 8


def test_raw_data_holds_every_finished_run_of_the_plan(recipe, tmp_path, capsys):
    import gzip

    out, raw = tmp_path / "r", tmp_path / "raw"
    fake = FakeTrainer(sft_per_seed=False)
    assert ablate.main(_args(recipe, out, "--seeds", "1", "--variants", "grpo,pos_weight,grpo-hlr", "--shared-sft",
                            "--raw-data", str(raw)), launch=fake) == 0
    assert sorted(_kind(c)[0] for c in fake.calls) == ["grpo", "grpo-hlr", "pos_weight", "sft"]
    # a second call adds a seed and a variant; the raw data then covers both calls' runs (the plan's union)
    assert ablate.main(_args(recipe, out, "--seeds", "2", "--variants", "dra", "--shared-sft", "--raw-data", str(raw)),
                      launch=FakeTrainer(sft_per_seed=False)) == 0
    lines = (raw / "runs.csv").read_text().splitlines()
    assert lines[0] == "variant,seed,pass1,passk,k,train_rollouts,steps,wall_seconds,machine,warmup"
    rows = [line.split(",") for line in lines[1:]]
    assert [(r[0], r[1]) for r in rows] == [("sft", str(RECIPE_SEED)), ("dra", "2"), ("grpo", "1"),
                                            ("pos_weight", "1"), ("grpo-hlr", "1")]  # the tables' order
    grpo = dict(zip(lines[0].split(","), rows[2]))
    assert float(grpo["pass1"]) == pytest.approx(0.41) and float(grpo["passk"]) == pytest.approx(0.51)
    assert grpo["k"] == "4" and grpo["train_rollouts"] == str(32 * STEPS) and grpo["steps"] == str(STEPS)
    assert float(grpo["wall_seconds"]) >= 0
    sft = dict(zip(lines[0].split(","), rows[0]))
    assert (sft["train_rollouts"], sft["steps"]) == ("0", "0")
    # every row names this machine and the warm-up every run started from: the SFT run's checkpoint
    warmup = checkpoint_hash(out / "sft" / f"seed{RECIPE_SEED}" / "checkpoints" / "step_000000")
    parsed = list(csv.DictReader(lines))
    assert [(r["machine"], r["warmup"]) for r in parsed] == [(machine_id(), warmup)] * 5
    with gzip.open(raw / "problems.csv.gz", "rt") as f:
        problems = f.read().splitlines()
    assert problems[0] == "variant,seed,warmup,benchmark,problem_id,samples,correct"
    # the fake's samples: problem p has min(4, p + dra + seed % 2) correct of 4
    assert problems[1:] == [line.replace(",held", f",{warmup},held") for line in [
        "dra,2,held,q0,4,1", "dra,2,held,q1,4,2", "grpo,1,held,q0,4,1", "grpo,1,held,q1,4,2",
        "pos_weight,1,held,q0,4,1", "pos_weight,1,held,q1,4,2", "grpo-hlr,1,held,q0,4,1", "grpo-hlr,1,held,q1,4,2"]]
    first = (raw / "problems.csv.gz").read_bytes()
    assert ablate.main(_args(recipe, out, "--seeds", "2", "--variants", "dra", "--shared-sft", "--raw-data", str(raw)),
                      launch=FakeTrainer(sft_per_seed=False)) == 0
    assert (raw / "problems.csv.gz").read_bytes() == first  # no timestamp: the same runs give the same bytes


def _on_machine(monkeypatch, name):
    """This process takes itself for machine ``name``: what ``provenance.machine_id`` would say on another CPU."""
    for module in (ablation_module, provenance_module):  # what ablate asks, and what the (fake) run records
        monkeypatch.setattr(module, "machine_id", lambda: name)


def _raw_rows(raw):
    with open(raw / "runs.csv", newline="") as f:
        return [(r["variant"], int(r["seed"]), r["machine"]) for r in csv.DictReader(f)]


def test_a_new_machine_runs_only_what_the_raw_data_lacks_and_never_splits_a_seed(recipe, tmp_path, monkeypatch,
                                                                                  capsys):
    raw = tmp_path / "raw"
    _on_machine(monkeypatch, "CPU A")
    # machine A: seeds 1 and 2 whole; seed 3 stopped by Ctrl-C in its second run: the first is kept on the way out
    assert ablate.main(_args(recipe, tmp_path / "a", "--seeds", "1,2", "--variants", "grpo,dra", "--shared-sft",
                             "--raw-data", str(raw)), launch=FakeTrainer(sft_per_seed=False)) == 0
    assert ablate.main(_args(recipe, tmp_path / "a", "--seeds", "3", "--variants", "grpo,dra", "--shared-sft",
                             "--raw-data", str(raw)), launch=FakeTrainer(sft_per_seed=False, interrupt=(2, 1))) == 130
    assert "kept the raw data" in capsys.readouterr().err
    assert _raw_rows(raw) == [("sft", RECIPE_SEED, "CPU A"), ("dra", 1, "CPU A"), ("dra", 2, "CPU A"),
                              ("grpo", 1, "CPU A"), ("grpo", 2, "CPU A"), ("grpo", 3, "CPU A")]
    # machine B, a fresh checkout and output directory: seeds 1 and 2 are done; seed 3 runs here whole, its run
    # from machine A included (its pairs must share a machine), after this machine's own warm-up
    _on_machine(monkeypatch, "CPU B")
    fake = FakeTrainer(sft_per_seed=False)
    assert ablate.main(_args(recipe, tmp_path / "b", "--seeds", "1,2,3", "--variants", "grpo,dra", "--shared-sft",
                             "--raw-data", str(raw)), launch=fake) == 0
    assert [_kind(c) for c in fake.calls] == [("sft", RECIPE_SEED, False), ("grpo", 3, False), ("dra", 3, False)]
    assert "grpo seed 1: in the raw data (finished elsewhere), not run here" in capsys.readouterr().out
    assert _raw_rows(raw) == [("sft", RECIPE_SEED, "CPU A"), ("sft", RECIPE_SEED, "CPU B"), ("dra", 1, "CPU A"),
                              ("dra", 2, "CPU A"), ("dra", 3, "CPU B"), ("grpo", 1, "CPU A"), ("grpo", 2, "CPU A"),
                              ("grpo", 3, "CPU B")]
    # machine C: a seed complete elsewhere costs nothing, not even a warm-up; a new variant of seed 3 brings the
    # seed's other runs along (dra, which this call does not name), so that seed 3 stays on one machine
    _on_machine(monkeypatch, "CPU C")
    fake = FakeTrainer(sft_per_seed=False)
    assert ablate.main(_args(recipe, tmp_path / "c", "--seeds", "3", "--variants", "grpo", "--shared-sft",
                             "--raw-data", str(raw)), launch=fake) == 0
    assert fake.calls == []
    assert ablate.main(_args(recipe, tmp_path / "c", "--seeds", "3", "--variants", "grpo,gc", "--shared-sft",
                             "--raw-data", str(raw)), launch=fake) == 0
    assert [_kind(c) for c in fake.calls] == [("sft", RECIPE_SEED, False), ("grpo", 3, False), ("gc", 3, False),
                                              ("dra", 3, False)]
    assert sorted(r for r in _raw_rows(raw) if r[1] == 3) == [("dra", 3, "CPU C"), ("gc", 3, "CPU C"),
                                                               ("grpo", 3, "CPU C")]
    assert [r for r in _raw_rows(raw) if r[0] == "sft"] == [("sft", RECIPE_SEED, "CPU A"),
                                                            ("sft", RECIPE_SEED, "CPU C")]
    # with a warm-up per seed, a seed complete in the raw data needs no warm-up here either
    per_seed = tmp_path / "raw_per_seed"
    assert ablate.main(_args(recipe, tmp_path / "e", "--seeds", "1", "--variants", "grpo", "--raw-data",
                             str(per_seed)), launch=FakeTrainer()) == 0
    _on_machine(monkeypatch, "CPU D")
    fake = FakeTrainer()
    assert ablate.main(_args(recipe, tmp_path / "f", "--seeds", "1", "--variants", "grpo", "--raw-data",
                             str(per_seed)), launch=fake) == 0
    assert fake.calls == []
    # the runs recorded there belong to one plan: another one is refused before anything runs
    capsys.readouterr()
    fake = FakeTrainer(sft_per_seed=False)
    assert ablate.main(_args(recipe, tmp_path / "d", "--seeds", "4", "--variants", "grpo", "--shared-sft",
                             "--raw-data", str(raw), "optim.lr=1e-4"), launch=fake) == 2
    err = capsys.readouterr().err
    assert fake.calls == [] and err.count("\n") == 1 and "optim.lr" in err and "--raw-data" in err, err


def test_sigint_stops_an_ablation_started_with_sigint_ignored(recipe, tmp_path, capsys):
    """A shell starts a background command (`nohup dynamo ablate ... &`) with SIGINT ignored: `kill -INT` must
    still stop it as Ctrl-C does (it did nothing: the runs went on to the end)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        trainer = FakeTrainer(interrupt=(2, 3), by_signal=True)
        code = ablate.main(_args(recipe, tmp_path / "a", "--seeds", "1", "--variants", "grpo,dynamo"), launch=trainer)
    finally:
        restored = signal.signal(signal.SIGINT, previous)
    assert code == 130 and len(trainer.calls) == 2
    assert "run the same command again to resume" in capsys.readouterr().err
    assert restored is signal.SIG_IGN  # the command puts back what it found


def test_one_shared_warm_up_starts_every_seed(recipe, tmp_path, capsys):
    fake = FakeTrainer(sft_per_seed=False)
    out = tmp_path / "s"
    assert ablate.main(_args(recipe, out, "--seeds", "1,2", "--variants", "grpo,dynamo", "--shared-sft"),
                      launch=fake) == 0
    kinds = [_kind(c) for c in fake.calls]
    assert kinds[0] == ("sft", RECIPE_SEED, False) and len(kinds) == 1 + 2 * 2
    assert sorted(kinds[1:]) == [("dynamo", 1, False), ("dynamo", 2, False), ("grpo", 1, False), ("grpo", 2, False)]
    assert "1 shared SFT warm-up" in capsys.readouterr().out
    sft = _analysis(out)["per_variant"]["sft"]
    assert sft["runs"] == 2 and sft["pass@1"]["mean"] == pytest.approx(0.1 + 0.01 * RECIPE_SEED)
    assert sft["pass@1"]["lo"] == sft["pass@1"]["hi"] == pytest.approx(sft["pass@1"]["mean"])  # one model
    assert json.loads((out / PLAN_FILE).read_text())["budget"]["sft"] == "shared"


def test_the_table1_baselines_run_with_their_algo_and_the_same_statistics(recipe, tmp_path, capsys):
    fake = FakeTrainer(sft_per_seed=False)
    out = tmp_path / "t1"
    assert ablate.main(_args(recipe, out, "--seeds", "1,2", "--variants", "table1,gc", "--shared-sft"),
                      launch=fake) == 0
    kinds = [_kind(c) for c in fake.calls]
    assert kinds[0] == ("sft", RECIPE_SEED, False) and len(kinds) == 1 + 2 * 10
    assert sorted({k[0] for k in kinds[1:]}) == sorted([*TABLE1_ORDER, "gc"])
    algos = {_kind(c)[0]: c[c.index("--algo") + 1] for c in fake.calls[1:]}
    assert algos == {**{b: b for b in BASELINES}, "grpo": "dynamo", "dynamo": "dynamo", "gc": "dynamo"}
    assert fake.calls[0][fake.calls[0].index("--algo") + 1] == "dynamo"  # the warm-up
    a = _analysis(out)
    # the fake's baseline j (0-based) adds 0.01 (j + 1) to GRPO's held-out pass@1, the same in each seed
    for j, name in enumerate(BASELINES):
        assert a["per_variant"][name]["delta_vs_grpo"]["pass@1"]["mean"] == pytest.approx(0.01 * (j + 1))
        assert a["per_variant"][name]["delta_vs_grpo"]["pass@1"]["n"] == 2
    assert a["per_variant"]["dynamo"]["delta_vs_grpo"]["pass@1"]["mean"] == pytest.approx(0.08)
    assert a["benchmarks"] == ["held"]
    md = (out / "ablation.md").read_text()
    assert "## Baselines (paper Table 1 layout)" in md and "| W-REINFORCE | w_reinforce | 2 |" in md
    assert "| 31.0 / 52.8 | 40.1 / 61.1 |" in md  # the paper's W-REINFORCE Avg. (1.5B, 7B) beside ours
    settings = json.loads((out / "ablation.json").read_text())["settings"]
    assert settings["variant_algos"]["kl_cov"] == "kl_cov" and settings["variant_algos"]["gc"] == "dynamo"
    assert "[20/20]" in capsys.readouterr().out  # after the shared warm-up's [1/1]


def test_jobs_run_concurrently_with_their_own_cores(recipe, tmp_path):
    launched = []

    class Recording(FakeTrainer):
        def __call__(self, command, env, log_path):
            launched.append(dict(env))
            return super().__call__(command, env, log_path)

    fake = Recording()
    assert ablate.main(_args(recipe, tmp_path / "j", "--seeds", "1,2", "--variants", "grpo,dynamo", "--jobs", "2"),
                      launch=fake) == 0
    assert len(fake.calls) == 6
    slots = executor.cpu_slots(2)
    assert {e[executor.CPUS_ENV] for e in launched} <= {",".join(map(str, s)) for s in slots}
    assert all(e["OMP_NUM_THREADS"] == str(len(slots[0])) for e in launched)
    # each variant started after its seed's SFT run (the fake asserts the SFT checkpoint path exists in its args)
    order = [_kind(c)[:2] for c in fake.calls]
    for seed in (1, 2):
        assert order.index(("sft", seed)) < order.index(("grpo", seed))
    assert executor.cpu_slots(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert executor.cpu_slots(3, [0, 1]) == [[0], [1], [0]]
    env = executor.child_environment({"RANK": "0", "MASTER_PORT": "1", "PATH": "/bin"}, 1, [0])
    assert env == {"PATH": "/bin", "PYTHONUNBUFFERED": "1"}


def test_a_changed_plan_is_refused(recipe, tmp_path, capsys):
    out = tmp_path / "p"
    assert ablate.main(_args(recipe, out, "--seeds", "1", "--variants", "grpo"), launch=FakeTrainer()) == 0
    # more seeds and variants: fine, only the new runs execute
    more = FakeTrainer()
    assert ablate.main(_args(recipe, out, "--seeds", "1,2", "--variants", "grpo,dynamo"), launch=more) == 0
    assert sorted(_kind(c)[:2] for c in more.calls) == [("dynamo", 1), ("dynamo", 2), ("grpo", 2), ("sft", 2)]
    assert json.loads((out / PLAN_FILE).read_text())["variants"] == ["grpo", "dynamo"]
    capsys.readouterr()
    changed = FakeTrainer()
    assert ablate.main(_args(recipe, out, "--seeds", "1", "--variants", "grpo", "trainer.steps=8"),
                      launch=changed) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynamo ablate:") and "differs" in err and len(err.strip().splitlines()) == 1
    assert changed.calls == []


def test_bad_arguments_fail_before_any_run(recipe, tmp_path, capsys):
    no_eval = tmp_path / "no_eval.yaml"
    values = yaml.safe_load(open(recipe))
    del values["evaluation"]
    no_eval.write_text(yaml.safe_dump(values))
    cases = [(recipe, ["trainer.seed=3"]), (recipe, ["dynamo.modulation.gc=false"]), (recipe, ["trainer.stpes=3"]),
             (recipe, ["--variants", "grpo,ppo"]), (recipe, ["--variants", "table1,table1"]),
             (recipe, ["--seeds", "1,1"]), (str(no_eval), [])]
    for config, extra in cases:
        fake = FakeTrainer()
        assert ablate.main(_args(config, tmp_path / "bad", *extra), launch=fake) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("dynamo ablate:") and len(err.strip().splitlines()) == 1, err
        assert fake.calls == [] and not (tmp_path / "bad").exists()
        if config == str(no_eval):
            assert "no evaluation.benchmarks" in err


def test_ablate_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "ablate", "--help"], capture_output=True,
                         text=True, check=True, cwd=REPO).stdout
    for option in ("--seeds", "--variants", "--jobs", "--threshold", "--window", "--bootstrap", "--output-dir",
                   "--raw-data", "runs.csv", "controls", "high_lr", "confirmatory",
                   "key=value", "dynamo-p0.5", "Resume", "--resume", "table1", "w_reinforce", "--algo NAME"):
        assert option in out, option


def test_ctrl_c_stops_the_running_runs_and_leaves_none_behind(tmp_path):
    import threading

    specs = [RunSpec(v, 1, str(tmp_path / v)) for v in ("grpo", "dynamo", "gc")]
    script = ("import json, os, sys, time; json.dump({'pid': os.getpid(), 'sid': os.getsid(0), "
              "'cpus': sorted(os.sched_getaffinity(0)), 'threads': os.environ['OMP_NUM_THREADS']}, "
              "open(sys.argv[1] + '.tmp', 'w')); os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(60)")
    command_for = lambda spec, resume: [sys.executable, "-c", script, os.path.join(spec.output_dir, "pid")]  # noqa
    slots = executor.cpu_slots(2)
    env_for = lambda slot: executor.child_environment(os.environ, 2, slots[slot])  # noqa: E731
    written = [os.path.join(s.output_dir, "pid") for s in specs[:2]]

    def interrupt():
        for _ in range(200):  # both running runs started (the third waits for a free slot)
            if all(os.path.exists(p) for p in written):
                break
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C as a terminal delivers it, whatever SIGINT handling this process started with: Python's
    # KeyboardInterrupt (a CI run launched in the background on 2026-11-26 saw the runs finish unstopped).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Thread(target=interrupt)
    timer.start()
    launcher = executor.SubprocessLauncher()
    try:
        with pytest.raises(executor.ExperimentInterrupted, match="0 of 3 runs finished"):
            executor.execute(specs, lambda spec: run_state(spec, STEPS), command_for, launcher, jobs=2,
                             env_for=env_for)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert not os.path.exists(os.path.join(specs[2].output_dir, "pid"))  # never started
    seen = set()
    for path in written:
        child = json.load(open(path))
        assert child["sid"] == child["pid"] != os.getpid()  # a session of its own: Ctrl-C reaches us only
        assert child["threads"] == str(len(slots[0])) and child["cpus"] in slots
        seen.add(tuple(child["cpus"]))
        with pytest.raises(ProcessLookupError):
            os.kill(child["pid"], 0)  # stopped and reaped
    assert seen == {tuple(slot) for slot in slots}  # each running run had a slot of its own (one CPU: the same one)
    assert launcher.running() == 0
    assert "# " in open(os.path.join(specs[0].output_dir, "train.log")).read()
