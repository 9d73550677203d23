"""`dynamo compare`: the threshold / median / final-reward arithmetic on metric lists (no training), its --help, and
its plan run on the experiments executor with a fake trainer."""

import json
import os
import subprocess
import sys

import pytest

from hf_reference import REPO
from megatron_dynamo.experiments.comparison import format_table, summarize_variant
from megatron_dynamo.experiments.variants import compare_variant as parse_variant
from megatron_dynamo.report.thresholds import (median_rollouts, moving_mean, parse_seeds, rollouts_to_threshold,
                                               summarize_run, tail_mean)


def test_moving_mean_uses_full_windows_only():
    assert moving_mean([1.0, 0.0, 1.0, 1.0], 2) == [None, 0.5, 0.5, 1.0]
    assert moving_mean([0.3, 0.7], 1) == [0.3, 0.7]
    assert moving_mean([1.0, 1.0], 3) == [None, None]
    with pytest.raises(ValueError):
        moving_mean([1.0], 0)


def test_rollouts_to_threshold_counts_every_rollout_up_to_the_first_window_that_reaches_it():
    rewards = [0.9, 0.1, 0.5, 0.7, 0.8, 0.2]
    rollouts = [256, 256, 250, 262, 256, 256]
    # A single lucky first step does not count: windows of 3 end at steps 3, 4, 5 with means 0.5, 0.433, 0.667
    assert rollouts_to_threshold(rewards, rollouts, 0.6, 3) == (256 + 256 + 250 + 262 + 256, 5)
    assert rollouts_to_threshold(rewards, rollouts, 0.9, 1) == (256, 1)
    assert rollouts_to_threshold(rewards, rollouts, 0.95, 2) == (None, None)
    # exactly at the threshold counts as reached
    assert rollouts_to_threshold([0.5, 0.5], [10, 10], 0.5, 2) == (20, 2)
    with pytest.raises(ValueError):
        rollouts_to_threshold([0.1], [1, 2], 0.5, 1)


def test_median_treats_not_reached_as_infinite():
    assert median_rollouts([300, 100, 200]) == 200
    assert median_rollouts([300, None, 100]) == 300
    assert median_rollouts([None, None, 100]) is None
    assert median_rollouts([100, 200]) == 150
    assert median_rollouts([100, None]) is None
    assert median_rollouts([]) is None


def test_tail_mean_is_the_last_tenth_with_at_least_one_step():
    assert tail_mean([0.0] * 18 + [1.0, 0.5]) == pytest.approx(0.75)
    assert tail_mean([0.2, 0.4]) == pytest.approx(0.4)
    assert tail_mean([]) is None


def test_summaries_and_table():
    records = [{"step": i + 1, "reward_mean": r, "rollouts": 256} for i, r in enumerate([0.2, 0.4, 0.8, 0.9])]
    records.append({"step": 5, "reward_mean": "nan", "rollouts": 256})  # a non-numeric reward is not a step
    run = summarize_run(records, threshold=0.6, window=2)
    assert run["rollouts_to_threshold"] == 768 and run["step_reached"] == 3 and run["steps"] == 4
    assert run["final_reward"] == pytest.approx(0.9) and run["total_rollouts"] == 1024
    never = summarize_run(records, threshold=0.95, window=2)
    runs = {"grpo": [dict(never, ok=True, variant="grpo", seed=s) for s in (1, 2)],
            "dynamo": [dict(run, ok=True, variant="dynamo", seed=1), dict(never, ok=True, variant="dynamo", seed=2)]}
    summary = {v: summarize_variant(r) for v, r in runs.items()}
    assert summary["grpo"]["median_rollouts_to_threshold"] is None and summary["grpo"]["seeds_reached"] == 0
    assert summary["dynamo"]["seeds_reached"] == 1 and summary["dynamo"]["final_reward_mean"] == pytest.approx(0.9)
    failed = summarize_variant([dict(run, ok=True), {"ok": False, "rollouts_to_threshold": None}])
    assert failed["failed_runs"] == 1 and failed["median_rollouts_to_threshold"] is None
    table = format_table({"seeds": [1, 2], "variants": ["grpo", "dynamo"], "threshold": 0.6, "window": 2,
                          "budget_per_step": 256, "steps": 4, "summary": summary,
                          "runs": runs["grpo"] + runs["dynamo"]})
    lines = table.splitlines()
    assert "median" in lines[1] and lines[2].startswith("grpo") and "not reached" in lines[2]
    assert "768 (s3)" in lines[3]


def test_variant_and_seed_parsing():
    assert parse_variant("grpo").algo == "grpo"
    assert parse_variant("dynamo").overrides == ("dynamo.allocation.power=1.0",)
    assert parse_variant("dynamo-p0.5").overrides == ("dynamo.allocation.power=0.5",)
    for bad in ("ppo", "dynamo-p", "dynamo-p0", "dynamo-px"):
        with pytest.raises(ValueError):
            parse_variant(bad)
    assert parse_seeds("1,2, 3") == [1, 2, 3]
    for bad in ("", "1,1", "a"):
        with pytest.raises(ValueError):
            parse_seeds(bad)


def test_compare_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "compare", "--help"], capture_output=True,
                         text=True, check=True, cwd=REPO).stdout
    for option in ("--seeds", "--threshold", "--window", "--variants", "--output-dir", "--reuse", "key=value"):
        assert option in out
    assert "identical for all variants of one seed" in out.replace("\n", " ")


@pytest.mark.slow
def test_compare_rejects_bad_arguments_before_any_run(tmp_path):
    for extra in (["trainer.seed=3"], ["trainer.stpes=3"], ["--variants", "grpo,ppo"], ["--seeds", "1,1"]):
        proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "compare", "configs/cpu_default.yaml",
                               *extra, "--output-dir", str(tmp_path / "out")], capture_output=True, text=True,
                              timeout=120, cwd=REPO)
        assert proc.returncode == 2 and "dynamo compare:" in proc.stderr, (extra, proc.stderr)
        assert not (tmp_path / "out").exists()


def _compare_args(out, *extra):
    from megatron_dynamo.cli import build_parser

    args, rest = build_parser().parse_known_args(["compare", os.path.join(REPO, "configs", "cpu_default.yaml"), "trainer.steps=4",
                                                  "--output-dir", str(out), "--window", "2", *extra])
    args.overrides = [*args.overrides, *rest]
    return args


class FakeCompareTrainer:
    """Stands in for `dynamo train` under `dynamo compare`: a metrics.jsonl whose rewards depend on the variant's
    power and the seed, and the SFT line of a real run's log."""

    def __init__(self):
        self.calls = []

    def __call__(self, command, env, log_path):
        self.calls.append(list(command))
        kv = dict(item.split("=", 1) for item in command if "=" in item and not item.startswith("-"))
        algo = command[command.index("--algo") + 1]
        lift = 0.0 if algo == "grpo" else 0.1 * float(kv["dynamo.allocation.power"])
        rows = [{"step": s, "reward_mean": 0.3 + 0.1 * s + lift + 0.01 * int(kv["trainer.seed"]), "rollouts": 32}
                for s in range(1, int(kv["trainer.steps"]) + 1)]
        with open(f"{kv['trainer.output_dir']}/metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with open(log_path, "a") as f:
            f.write("SFT warm-up: 5 steps, loss 2.0 -> 1.5\n")
        return 0


def test_compare_runs_its_plan_on_the_experiments_executor(tmp_path, capsys):
    from megatron_dynamo.commands import compare

    out = tmp_path / "cmp"
    fake = FakeCompareTrainer()
    assert compare.main(_compare_args(out, "--seeds", "1,2", "--variants", "grpo,dynamo-p0.5"), launch=fake) == 0
    # seed-major, each run with its variant's --algo and overrides, its seed and its own directory
    assert [(c[c.index("--algo") + 1], c[-3]) for c in fake.calls] == [
        ("grpo", f"trainer.output_dir={out}/grpo/seed1"), ("dynamo", f"trainer.output_dir={out}/dynamo-p0.5/seed1"),
        ("grpo", f"trainer.output_dir={out}/grpo/seed2"), ("dynamo", f"trainer.output_dir={out}/dynamo-p0.5/seed2")]
    assert "dynamo.allocation.power=0.5" in fake.calls[1] and "data.seed=2" in fake.calls[2]
    result = json.loads((out / "comparison.json").read_text())
    assert result["variants"] == ["grpo", "dynamo-p0.5"] and all(r["ok"] for r in result["runs"])
    # dynamo-p0.5, seed 1: rewards 0.46, 0.56, 0.66, ...: the 2-step mean first reaches 0.6 at step 3 (96 rollouts)
    run = next(r for r in result["runs"] if (r["variant"], r["seed"]) == ("dynamo-p0.5", 1))
    assert (run["rollouts_to_threshold"], run["step_reached"]) == (96, 3) and run["sft_final_loss"] == "1.5"
    assert result["warnings"] == [] and (out / "reward_curves.png").stat().st_size > 0
    # --reuse: every run has its steps, none runs again; without it every run starts over
    again = FakeCompareTrainer()
    assert compare.main(_compare_args(out, "--seeds", "1,2", "--variants", "grpo,dynamo-p0.5", "--reuse"),
                       launch=again) == 0
    assert again.calls == [] and "reusing" in capsys.readouterr().out
    rerun = FakeCompareTrainer()
    assert compare.main(_compare_args(out, "--seeds", "1", "--variants", "grpo"), launch=rerun) == 0
    assert len(rerun.calls) == 1
