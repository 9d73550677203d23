"""`dynamo report`: one page of a run's curves (PNG + self-contained HTML + report.json), several runs overlaid,
compare directories expanded, "no data" panels, one-line errors. Synthetic run directories, no training."""

import json
import os
import re

import numpy as np
import pytest

from megatron_dynamo.cli import main
from megatron_dynamo.report.page import build_figure, write_report
from megatron_dynamo.report.runs import expand_inputs, find_key, load_run

LINE_PANELS = ["reward", "entropy", "response_length", "variance_ratio", "modulation", "eval",
               "success_vs_allocation"]


def make_run(path, steps=12, prompts=8, n_avg=4, seed=0, uniform=False, eval_every=4, keys=None,
             prompt_rows=True, modulation=True):
    """A run directory as the trainer writes it: metrics.jsonl (+ prompts.jsonl). ``keys`` renames metric keys."""
    rng = np.random.default_rng(seed)
    keys = keys or {}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as metrics, \
            open(os.path.join(path, "prompts.jsonl"), "w") as per_prompt:
        metrics.write(json.dumps({"step": 0, "eval/avg/pass@1": 0.1, "eval/avg/pass@4": 0.3,
                                  "eval/toy/pass@1": 0.1, "eval/toy/pass@4": 0.3}) + "\n")
        for step in range(1, steps + 1):
            if uniform or step == 1:
                counts = [n_avg] * prompts
            else:
                counts = [int(c) for c in rng.multinomial(prompts * n_avg - prompts * 2, [1 / prompts] * prompts) + 2]
            correct = [int(rng.integers(0, c + 1)) for c in counts]
            row = {"step": step, "reward_mean": sum(correct) / sum(counts), "rollouts": sum(counts),
                   "variance_ratio": 1.0 if uniform or step == 1 else float(rng.uniform(0.6, 0.95)),
                   "alloc_counts": counts, "entropy_mean": 1.0 - step / (2 * steps),
                   "response_length_mean": 100 + 5 * step + float(rng.normal()),
                   "grad_norm": "nan" if step == 3 else 1.0}
            if modulation:
                row.update({"modulation/scale_mean": 1.02, "modulation/scale_p10": 0.9, "modulation/scale_p90": 1.15,
                            "modulation/beta_stab_mean": 0.95, "modulation/beta_stab_min": 0.7,
                            "modulation/beta_comp_mean_pos": 1.2})
            if eval_every and step % eval_every == 0:
                row.update({"eval/avg/pass@1": 0.1 + step / 100, "eval/avg/pass@4": 0.3 + step / 100,
                            "eval/toy/pass@1": 0.1 + step / 100, "eval/toy/pass@4": 0.3 + step / 100})
            metrics.write(json.dumps({keys.get(k, k): v for k, v in row.items()}) + "\n")
            if prompt_rows:
                for i, (c, k) in enumerate(zip(counts, correct)):
                    per_prompt.write(json.dumps({"step": step, "prompt_id": f"p{i}", "count": c, "correct": k}) + "\n")
    if not prompt_rows:
        os.remove(os.path.join(path, "prompts.jsonl"))
    return str(path)


def _panels(manifest):
    return {p["id"]: p for p in manifest["panels"]}


def test_one_run_renders_every_panel_and_a_self_contained_page(tmp_path):
    run_dir = make_run(tmp_path / "run")
    assert main(["report", run_dir]) == 0
    out = tmp_path / "run" / "report"
    manifest = json.loads((out / "report.json").read_text())
    panels = _panels(manifest)
    assert list(panels) == LINE_PANELS + ["alloc_counts/run", "final"]  # the free cell: final numbers
    assert not any(p["no_data"] for p in panels.values())
    assert all(p["runs"] == ["run"] for p in panels.values())
    assert panels["variance_ratio"]["title"].startswith("eq. 23 variance ratio")
    assert (panels["success_vs_allocation"]["xlabel"], panels["success_vs_allocation"]["ylabel"]) == (
        "success rate of the prompt's rollouts at that step", "rollouts allocated to the prompt")
    assert (panels["alloc_counts/run"]["xlabel"], panels["alloc_counts/run"]["ylabel"]) == (
        "rollouts allocated to a prompt", "step")
    assert panels["modulation"]["band"] and panels["eval"]["benchmarks"] == ["avg"]
    assert manifest["runs"][0]["steps"] == 12 and manifest["runs"][0]["prompts_jsonl"]
    final = manifest["final"][0]
    assert final["rollouts"] == 12 * 8 * 4 and final["last eval step"] == 12
    assert final["avg pass@4"] == pytest.approx(0.42)
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and "<table>" in page and "0.42" in page
    # Self-contained: nothing is fetched (no http(s) or other URL in src/href, no external stylesheet/script).
    links = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]*)""", page)
    assert links and all(link.startswith("data:image/png;base64,") for link in links)
    assert "<script" not in page and "<link" not in page and "http" not in page


def test_figure_axes_carry_the_titles_and_labels():
    import matplotlib.pyplot as plt

    from megatron_dynamo.report.runs import Run

    runs = [Run("a", "a", [{"step": s, "reward_mean": s / 10, "entropy_mean": 1.0} for s in range(1, 6)], None)]
    fig, panels, window = build_figure(runs, window=2)
    try:
        titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert titles == [p["title"] for p in panels]
        reward = next(ax for ax in fig.axes if ax.get_title() == "reward per step")
        assert (reward.get_xlabel(), reward.get_ylabel()) == ("step", "mean reward") and len(reward.lines) == 2
        assert window == 2 and list(reward.lines[1].get_ydata()) == pytest.approx([.1, .15, .25, .35, .45])
        unsmoothed = build_figure(runs, window=1)[0]
        assert len(unsmoothed.axes[0].lines) == 1  # no smoothing: one line per run
        plt.close(unsmoothed)
        # Panels without data say so, on the page and in the manifest.
        empty = {p["id"] for p in panels if p["no_data"]}
        assert empty == {"response_length", "variance_ratio", "modulation", "eval", "success_vs_allocation",
                         "alloc_counts/a"}
        for ax in fig.axes:
            if ax.get_title() in {p["title"] for p in panels if p["no_data"]}:
                assert "no data" in [t.get_text() for t in ax.texts]
    finally:
        plt.close(fig)


def test_several_runs_overlay_on_one_page(tmp_path):
    grpo = make_run(tmp_path / "grpo", uniform=True, modulation=False, seed=1)
    dynamo = make_run(tmp_path / "dynamo", seed=2)
    out = tmp_path / "out"
    assert main(["report", grpo, dynamo, "--labels", "GRPO", "DynaMO", "--out", str(out), "--window", "3"]) == 0
    manifest = json.loads((out / "report.json").read_text())
    panels = _panels(manifest)
    assert [r["label"] for r in manifest["runs"]] == ["GRPO", "DynaMO"] and manifest["window"] == 3
    for panel in ("reward", "entropy", "response_length", "variance_ratio", "eval", "success_vs_allocation"):
        assert panels[panel]["runs"] == ["GRPO", "DynaMO"], panel
    assert panels["modulation"]["runs"] == ["DynaMO"]  # GRPO logs no modulation
    assert panels["alloc_counts/GRPO"]["count_range"] == panels["alloc_counts/DynaMO"]["count_range"]
    assert [row["run"] for row in manifest["final"]] == ["GRPO", "DynaMO"]
    # A comma-separated --labels value works as well; the count must match the runs.
    assert main(["report", grpo, dynamo, "--labels", "a,b", "--out", str(out)]) == 0


def test_a_compare_directory_expands_into_its_runs(tmp_path):
    cmp_dir = tmp_path / "cmp"
    entries = []
    for variant, uniform in (("grpo", True), ("dynamo", False)):
        for seed in (1, 2):
            make_run(cmp_dir / variant / f"seed{seed}", uniform=uniform, seed=seed, steps=6)
            # compare records the run dir as given on its command line (relative to where it ran)
            entries.append({"variant": variant, "seed": seed, "output_dir": f"elsewhere/{variant}/seed{seed}"})
    (cmp_dir / "comparison.json").write_text(json.dumps({"runs": entries, "variants": ["grpo", "dynamo"]}))
    single = make_run(tmp_path / "extra", steps=3)
    runs = expand_inputs([str(cmp_dir), single])
    assert [r.label for r in runs] == ["grpo seed 1", "grpo seed 2", "dynamo seed 1", "dynamo seed 2", "extra"]
    assert all(r.source == f"compare:{cmp_dir}" for r in runs[:4]) and runs[4].source == "run"
    # Without comparison.json (an interrupted compare) the <variant>/seed<S> layout is enough.
    (cmp_dir / "comparison.json").unlink()
    assert [r.label for r in expand_inputs([str(cmp_dir)])] == [
        "dynamo seed 1", "dynamo seed 2", "grpo seed 1", "grpo seed 2"]
    assert main(["report", str(cmp_dir)]) == 0
    manifest = json.loads((cmp_dir / "report" / "report.json").read_text())
    assert len(manifest["runs"]) == 4 and sum(p["id"].startswith("alloc_counts/") for p in manifest["panels"]) == 4


def test_missing_data_gives_no_data_panels(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    rows = "".join(json.dumps({"step": s, "reward_mean": 0.5, "loss": 0.1}) + "\n" for s in range(1, 4))
    (bare / "metrics.jsonl").write_text(rows + '{"step": 4, "re')  # a torn last line
    manifest = write_report(expand_inputs([str(bare)]), str(tmp_path / "out"))
    panels = _panels(manifest)
    assert not panels["reward"]["no_data"]
    for name in ("entropy", "response_length", "variance_ratio", "modulation", "eval", "success_vs_allocation",
                 "alloc_counts/bare"):
        assert panels[name]["no_data"] and panels[name]["reason"], name
    assert "no prompts.jsonl" in panels["success_vs_allocation"]["reason"]
    assert manifest["runs"][0]["warnings"]  # the torn last line is reported, not fatal
    # An empty metrics.jsonl (a run that has not finished a step) renders an all-"no data" page.
    (bare / "metrics.jsonl").write_text("")
    manifest = write_report(expand_inputs([str(bare)]), str(tmp_path / "out2"))
    assert all(p["no_data"] for p in manifest["panels"] if p["id"] != "final")


def test_renamed_keys_are_found(tmp_path):
    run_dir = make_run(tmp_path / "renamed", keys={"variance_ratio": "allocation/variance_ratio",
                                                   "alloc_counts": "allocation/counts",
                                                   "entropy_mean": "actor/entropy",
                                                   "modulation/scale_mean": "dynamo/modulation/scale_mean"})
    run = load_run(run_dir)
    assert find_key(run.records, ["variance_ratio"]) == "allocation/variance_ratio"
    manifest = write_report([run], str(tmp_path / "out"))
    assert not any(p["no_data"] for p in manifest["panels"])


@pytest.mark.parametrize("args, message", [
    (["{tmp}/missing"], "no such directory"),
    (["{tmp}"], "not a run directory"),
    (["{run}", "--labels", "a", "b"], "--labels gives 2 label(s) for 1 run(s)"),
    (["{run}", "--window", "0"], "--window must be >= 1"),
])
def test_bad_input_is_a_one_line_error_with_exit_2(tmp_path, capsys, args, message):
    run_dir = make_run(tmp_path / "run", steps=2)
    (tmp_path / "empty").mkdir()
    args = [a.format(tmp=tmp_path / "empty", run=run_dir) for a in args]
    assert main(["report", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynamo report: ") and message in err and err.count("\n") == 1


def test_prompt_rows_of_a_resumed_run_are_not_doubled(tmp_path):
    from megatron_dynamo.trainer.metrics import append_step_rows

    path = str(tmp_path / "prompts.jsonl")
    for step in (1, 2, 3):
        append_step_rows(path, [{"step": step, "prompt_id": "a", "count": 4, "correct": 1}],
                         drop_from_step=step if step == 1 else None)
    with open(path, "a") as f:
        f.write('{"step": 4, "prom')  # a crash mid-write
    append_step_rows(path, [{"step": 3, "prompt_id": "a", "count": 5, "correct": 2}], drop_from_step=3)
    rows = [json.loads(line) for line in open(path)]
    assert [(r["step"], r["count"]) for r in rows] == [(1, 4), (2, 4), (3, 5)]
