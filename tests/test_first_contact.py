"""Issue 25, first contact: what a new user does after the main job (their own data, the README's commands, typos)
works or stops before anything runs with one line and exit status 2."""

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megatron_dynamo.config import ConfigError
from megatron_dynamo.trainer.config import load_run_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")


def _dynamo(*args, cwd=REPO, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


def _one_line_exit_2(proc, prefix: str, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == "", proc.stdout  # no header: nothing started
    return lines[0]


def _gsm8k_hub_file(path, rows: int, words: int = 1):
    """GSM8K's hub schema: question, answer with a '#### N' final line."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            question = " ".join(["Tom has"] * words) + f" {i} apples and buys 2 more. How many?"
            f.write(json.dumps({"question": question, "answer": f"{i}+2={i + 2}\n#### {i + 2}"}) + "\n")


def _flat_file(path, rows: int, problem=lambda i: f"{i}+1"):
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps({"id": i, "problem": problem(i), "answer": str(i + 1)}) + "\n")


# 1 ----------------------------------------------------------------------------------------------------------------
def test_prepared_data_is_found_by_name_with_no_flag(tmp_path, monkeypatch):
    from megatron_dynamo.data.dataset import DATA_DIR_ENV, load_math_jsonl, resolve_dataset_path
    from megatron_dynamo.trainer.preflight import check_run_inputs

    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    _gsm8k_hub_file(tmp_path / "hub.jsonl", 40)
    proc = _dynamo("data", "prepare", "gsm8k_train", "--from", str(tmp_path / "hub.jsonl"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = _dynamo("data", "list", cwd=tmp_path).stdout
    assert any(line.startswith("gsm8k_train") and line.endswith("[present]") for line in listed.splitlines())
    monkeypatch.chdir(tmp_path)
    assert resolve_dataset_path("gsm8k_train") == tmp_path.joinpath("data", "gsm8k_train.jsonl").relative_to(tmp_path)
    assert len(load_math_jsonl("gsm8k_train")) == 40  # what dynamo eval --benchmarks and evaluation.benchmarks read
    run = load_run_config(CPU_DEFAULT, ["data.train=gsm8k_train", f"trainer.output_dir={tmp_path / 'run'}",
                                        f"model.config={REPO}/configs/models/tiny-qwen2.json"])
    check_run_inputs(run)  # before: "no data directory was given"
    # the environment variable and an explicit directory still win
    (tmp_path / "other").mkdir()
    _flat_file(tmp_path / "other" / "gsm8k_train.jsonl", 3)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "other"))
    assert len(load_math_jsonl("gsm8k_train")) == 3
    assert len(load_math_jsonl("gsm8k_train", data_dir=tmp_path / "data")) == 40


# 2 ----------------------------------------------------------------------------------------------------------------
def test_long_prompts_are_counted_and_a_run_that_would_cut_most_is_refused(tmp_path):
    from megatron_dynamo.data.prompt_length import PromptLengthReport, check_prompt_overflow
    from megatron_dynamo.trainer.preflight import check_training_prompts

    _gsm8k_hub_file(tmp_path / "hub.jsonl", 64)
    assert _dynamo("data", "prepare", "gsm8k_train", "--from", str(tmp_path / "hub.jsonl"), "--out",
                   str(tmp_path / "data")).returncode == 0
    proc = _dynamo("train", CPU_DEFAULT, f"trainer.output_dir={tmp_path / 'run'}", "data.train=gsm8k_train",
                   f"data.data_dir={tmp_path / 'data'}")
    _one_line_exit_2(proc, "dynamo train: ", "64 of 64 training prompts", "data.max_prompt_tokens=16",
                     "data.max_overflow_share")
    assert not (tmp_path / "run").exists()
    # the policy itself: a small share is cut and reported, drop, refuse
    report = PromptLengthReport.of([5, 20, 8, 9] + [10] * 16, max_tokens=16)  # 1 of 20 over: 5 %
    assert check_prompt_overflow(report, "truncate_left", 0.05).startswith("1 of 20 training prompts (5.0%)")
    assert "dropped" in check_prompt_overflow(report, "drop", 0.05)
    with pytest.raises(ValueError, match="data.prompt_overflow=refuse"):
        check_prompt_overflow(report, "refuse", 1.0)
    with pytest.raises(ValueError, match="raise data.max_prompt_tokens to 20"):
        check_prompt_overflow(report, "truncate_left", 0.04)
    assert check_prompt_overflow(PromptLengthReport.of([16, 3], 16), "refuse", 0.0) is None
    # the recipes fit the data they ship with
    for recipe in ("cpu_default.yaml", "cpu_reasoning.yaml"):
        assert check_training_prompts(load_run_config(os.path.join(REPO, "configs", recipe))) is None
    # drop keeps the fitting prompts: then the step size is checked against what is left
    _flat_file(tmp_path / "mixed.jsonl", 40, problem=lambda i: f"{i}+1" if i < 30 else "1+" * 20 + "1")
    run = load_run_config(CPU_DEFAULT, [f"data.train={tmp_path / 'mixed.jsonl'}", "data.prompt_overflow=drop",
                                        "data.max_overflow_share=0.3"])
    with pytest.raises(ConfigError, match="data.train has 30 usable prompts"):
        check_training_prompts(run)


# 4 ----------------------------------------------------------------------------------------------------------------
def test_the_readme_cpu_eval_benchmark_exists_on_a_fresh_clone():
    from megatron_dynamo.data.dataset import load_math_jsonl
    from megatron_dynamo.trainer.preflight import load_examples

    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert "--benchmarks synthetic_eval " in readme and "synthetic_eval.jsonl" not in readme
    examples = load_math_jsonl("synthetic_eval").examples  # no file anywhere: a generated benchmark
    assert examples == load_examples(load_run_config(CPU_DEFAULT))  # the CPU default's 128 problems


# 5 ----------------------------------------------------------------------------------------------------------------
def test_yaml_syntax_errors_are_one_line_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  config: configs/models/tiny-qwen2.json\ndata:\n  train: [synthetic\noptim: {}\n")
    _one_line_exit_2(_dynamo("train", str(bad)), "dynamo train: ", f"{bad}:5:", "YAML syntax error")
    _one_line_exit_2(_dynamo("train", CPU_DEFAULT, "optim.lr=[1"), "dynamo train: ", "override 'optim.lr=[1'",
                     "not valid YAML")


# 6 ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("env", [{"HF_ENDPOINT": "http://127.0.0.1:9"},
                                 {"HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}])
@pytest.mark.slow
def test_data_prepare_without_network_says_so_in_one_line_at_once(tmp_path, env):
    start = time.monotonic()
    proc = _dynamo("data", "prepare", "gsm8k_train", "--out", str(tmp_path / "data"),
                   env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": "", **env})
    seconds = time.monotonic() - start
    _one_line_exit_2(proc, "dynamo data prepare: cannot fetch the hub dataset openai/gsm8k", "cannot be reached",
                     "hf download openai/gsm8k")
    assert seconds < 15, seconds  # before: 25 s of 5 retries
    assert not (tmp_path / "data").exists()


# 7 ----------------------------------------------------------------------------------------------------------------
def test_an_output_directory_with_checkpoints_is_refused_before_the_header(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_000020"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    _one_line_exit_2(_dynamo("train", CPU_DEFAULT, f"trainer.output_dir={tmp_path / 'run'}"), "dynamo train: ",
                     "already holds checkpoints", "--resume", f"trainer.output_dir={tmp_path / 'run'}-grpo")
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written
    (tmp_path / "file").write_text("")
    _one_line_exit_2(_dynamo("train", CPU_DEFAULT, f"trainer.output_dir={tmp_path / 'file'}"), "dynamo train: ",
                     "trainer.output_dir", "not a directory")


# 9 ----------------------------------------------------------------------------------------------------------------
def test_a_small_data_set_names_every_key_to_change_at_once(tmp_path):
    from megatron_dynamo.trainer.preflight import check_run_inputs, check_training_prompts, small_data_fix

    _flat_file(tmp_path / "mine.jsonl", 30)
    line = _one_line_exit_2(_dynamo("train", CPU_DEFAULT, f"trainer.output_dir={tmp_path / 'run'}",
                                    f"data.train={tmp_path / 'mine.jsonl'}"), "dynamo train: ",
                            "30 usable prompts", "data.prompts_per_step=30 trainer.mini_batch_prompts=30")
    assert not (tmp_path / "run").exists()
    fix = line.split("run with ")[1].split(" (")[0].split()
    run = load_run_config(CPU_DEFAULT, [f"data.train={tmp_path / 'mine.jsonl'}", *fix])  # consistent: it loads
    check_run_inputs(run)
    assert check_training_prompts(run) is None
    assert small_data_fix(100, 512, 32) == {"data.prompts_per_step": 96}
    assert small_data_fix(512, 512, 32) == {}


# 8 ----------------------------------------------------------------------------------------------------------------
def test_eval_outputs_are_keyed_by_the_checkpoint_and_a_finished_one_is_reused(tmp_path):
    from megatron_dynamo.commands.eval_output import (checkpoint_key, default_output, finished_evaluation,
                                                      other_model, record_finished)
    from megatron_dynamo.eval.model_source import checkpoint_identity

    a, b = tmp_path / "a" / "checkpoints" / "step_000060", tmp_path / "b" / "checkpoints" / "step_000060"
    for step in (a, b):
        step.mkdir(parents=True)
        (step / "model.pt").write_bytes(b"x" * 10)
    assert default_output(a, a.name) != default_output(b, b.name)
    assert default_output(a, a.name).name.startswith("step_000060-")
    identity = checkpoint_identity(a)
    assert identity == checkpoint_identity(a)
    time.sleep(0.01)
    (a / "model.pt").write_bytes(b"y" * 11)  # a new run wrote its step 60 at the same path
    assert checkpoint_identity(a) != identity
    out = tmp_path / "out"
    out.mkdir()
    args = SimpleNamespace(benchmarks="synthetic_eval", data_dir=None, n=8, k="8", temperature=1.0, top_p=1.0,
                           max_tokens=6, template=None, seed=0, answer_only=False, limit=None, tokenizer=None,
                           max_model_len=None, dtype=None)
    (out / "summary.json").write_text(json.dumps({"benchmarks": {}, "avg": {"pass@1": 0.5}}))
    assert finished_evaluation(out, checkpoint_key(a), args) is None  # not marked finished
    record_finished(out, checkpoint_key(a), args)
    assert finished_evaluation(out, checkpoint_key(a), args)["avg"] == {"pass@1": 0.5}
    assert finished_evaluation(out, checkpoint_key(a), SimpleNamespace(**{**vars(args), "n": 4})) is None
    assert finished_evaluation(out, checkpoint_key(b), args) is None
    (out / "settings.json").write_text(json.dumps({"model": str(a)}))
    assert other_model(out, a) is None and other_model(out, b) == str(a)


def test_ablate_checks_the_recipes_data_names_before_any_run(tmp_path):
    recipe = os.path.join(REPO, "configs", "cpu_reasoning.yaml")
    model = f"model.config={REPO}/configs/models/tiny-qwen2.json"
    proc = _dynamo("ablate", recipe, "--seeds", "1", "--output-dir", str(tmp_path / "abl"), model,
                   "data.train=gsm8k_train", "data.sft_problems=0", cwd=tmp_path,
                   env={"MEGATRON_DYNAMO_DATA_DIR": ""})
    _one_line_exit_2(proc, "dynamo ablate: data.train: ", "'gsm8k_train.jsonl' is not in 'data'",
                     "dynamo data prepare gsm8k_train")
    assert not (tmp_path / "abl").exists()


# 10 ---------------------------------------------------------------------------------------------------------------
def test_a_baseline_that_equals_grpo_says_so_at_start_up():
    """With one mini-batch a step the ratio is 1: clip_higher and kl_cov give GRPO's metrics, bit for bit."""
    from megatron_dynamo.commands.train import equals_grpo_note

    for algo in ("clip_higher", "kl_cov"):
        note = equals_grpo_note(load_run_config(CPU_DEFAULT, algo=algo), algo)
        assert note.startswith(f"note: --algo {algo} acts only where pi / pi_old moves away from 1")
        assert "\n" not in note
        assert "equals --algo grpo" in note and "trainer.mini_batch_prompts=8" in note
    several = load_run_config(CPU_DEFAULT, ["trainer.mini_batch_prompts=8"], algo="clip_higher")
    assert equals_grpo_note(several, "clip_higher") is None
    assert equals_grpo_note(load_run_config(CPU_DEFAULT, ["trainer.ppo_epochs=2"], algo="kl_cov"), "kl_cov") is None
    for algo in ("grpo", "dynamo", "entropy_loss", "clip_cov", "w_reinforce"):
        assert equals_grpo_note(load_run_config(CPU_DEFAULT, algo=algo), algo) is None


def test_the_baselines_are_named_once_in_their_registry(monkeypatch):
    """--algo's help in both commands and the ratio-only note read the registry: a baseline is added in one place."""
    import dataclasses

    from megatron_dynamo.algorithms.baselines import BASELINES
    from megatron_dynamo.cli import build_parser
    from megatron_dynamo.commands.train import equals_grpo_note

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for command in (commands["train"], commands["launch"]._subparsers._group_actions[0].choices["run"]):
        (algo,) = [a for a in command._actions if a.dest == "algo"]
        assert tuple(algo.choices) == ("dynamo", "grpo", *BASELINES)
        assert ", ".join(BASELINES) + ": GRPO plus that baseline" in algo.help
    assert {name for name, b in BASELINES.items() if b.ratio_only} == {"clip_higher", "kl_cov"}
    monkeypatch.setitem(BASELINES, "kl_cov", dataclasses.replace(BASELINES["kl_cov"], ratio_only=False))
    assert equals_grpo_note(load_run_config(CPU_DEFAULT, algo="kl_cov"), "kl_cov") is None


# issue 41 ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,nproc,needles", [
    (["parallel.expert_parallel=2"], 2, ["parallel.expert_parallel: must be 1 for a dense model"]),
    (["model.config=configs/models/tiny-qwen3-moe.json", "parallel.expert_parallel=3", "rollout.tensor_parallel=1"],
     3, ["parallel.expert_parallel=3", "the model's 8 experts"]),
    (["model.config=configs/models/tiny-qwen3-moe.json", "parallel.tensor_parallel=3"], 3,
     ["tiny-qwen3-moe.json: num_attention_heads=4 is not divisible by tensor_parallel=3"]),
    (["model.config=configs/models/tiny-qwen3-moe.json", "parallel.expert_tensor_parallel=2",
      "parallel.tensor_parallel=2"], 2, ["parallel.expert_tensor_parallel: must be 1 without CUDA"]),
])
def test_a_model_that_does_not_fit_the_layout_is_refused_before_any_rank(tmp_path, overrides, nproc, needles):
    """The model over the layout (heads, layers, experts) is checked by the launching process: one line, exit 2,
    no rank started (every rank would otherwise find it while building the model)."""
    proc = _dynamo("train", CPU_DEFAULT, f"trainer.output_dir={tmp_path / 'run'}", *overrides, "--nproc", str(nproc))
    _one_line_exit_2(proc, "dynamo train: ", *needles)
    assert not (tmp_path / "run").exists()
