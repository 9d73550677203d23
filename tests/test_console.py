"""What a user watches: the console of `dynamo train` (one line per step, no library chatter), the progress line
and its ETA, the filters that keep the libraries' pointless warnings out (and only those), the wandb preflight."""

import logging
import os
import subprocess
import sys

import pytest

from hf_reference import REPO
from megatron_dynamo import library_logs
from megatron_dynamo.config import ConfigError
from megatron_dynamo.trainer.config import load_run_config

CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")


@pytest.mark.slow
def test_cpu_default_console_is_one_line_per_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (library_logs.ENV, "TORCH_CPP_LOG_LEVEL",
                                                             "VLLM_LOGGING_LEVEL")}
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT,
                           f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=3", "trainer.sft_warmup_steps=10"],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    lines = proc.stdout.splitlines()
    # A fixed header (the command, the layout, the checkpoints' trust, the SFT warm-up), one line per step, a footer, all on stdout (`> log` keeps
    # them all: the warm-up and the footer went to stderr before); nothing from the libraries, nothing on stderr.
    assert proc.stderr == "", proc.stderr
    assert len(lines) == 4 + 3 + 1, proc.stdout
    assert lines[0] == f"dynamo train: {CPU_DEFAULT} (dynamo), 3 steps -> {tmp_path / 'run'}"
    assert lines[1] == "dynamo train: 1 rank (this process): DP 1 x TP 1 x PP 1; 1 rollout engine of 1 rank"
    assert lines[2].startswith("dynamo train: checkpoints are checked for integrity only")  # no key set here
    assert lines[3].startswith("SFT warm-up: 10 steps, loss ")
    for step, line in enumerate(lines[4:7], start=1):
        assert line.startswith(f"step {step}/3 | reward ") and " | ETA " in line, line
    assert lines[7].startswith("done: 3 steps in ") and lines[7].endswith(str(tmp_path / "run"))
    assert not any(word in proc.stdout for word in ("WARNING", "Warning", "vllm", "vLLM", "Triton")), proc.stdout


def test_progress_line_has_the_eta_of_the_steps_left(monkeypatch, capsys):
    from megatron_dynamo.trainer import metrics

    clock = iter([100.0, 110.0, 130.0, 140.0])  # start, after step 5 (10 s), step 6 (20 s), step 7 (10 s)
    monkeypatch.setattr(metrics, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))
    progress = metrics.StepProgress(total_steps=10, done_steps=4, bar=False)
    record = {"reward_mean": 0.5, "rollouts": 64, "alloc_min": 2, "alloc_max": 12, "variance_ratio": 0.8,
              "entropy_mean": 1.2, "grad_norm": 0.3, "step_seconds": 10.0}
    first = progress.update({"step": 5, **record})
    second = progress.update({"step": 6, **record})
    third = progress.update({"step": 7, **record})
    progress.close()
    # The first step a process runs carries vLLM's one-time start-up (the CPU default: 14 s against 0.8 s): no ETA
    # from it (that said 14 minutes for a 50-s run).
    assert first == ("step 5/10 | reward 0.500 | rollouts 64 [2-12] | var-ratio 0.80 | H 1.200 | gnorm 0.300 | "
                     "10.0s | ETA --:--")
    assert second.endswith("| ETA 01:20")  # 20 s per step after the first, 4 left
    assert third.endswith("| ETA 00:45")  # 15 s per step (2 steps in 30 s), 3 left
    assert capsys.readouterr().out.splitlines() == [first, second, third]
    assert metrics.progress_line({"step": 7, "skipped": "non-finite loss"}, 10, "00:30").endswith(
        "| -s | ETA 00:30 | SKIPPED: non-finite loss")


def test_library_filters_drop_exactly_the_listed_records():
    drop = library_logs.DropRecords(["%s: Failed to load weights"], first_args={"RotaryEmbedding"})

    def record(msg, *args):
        return logging.LogRecord("vllm.x", logging.WARNING, "f.py", 1, msg, args, None)

    assert not drop.filter(record("%s: Failed to load weights", "RotaryEmbedding"))
    assert drop.filter(record("%s: Failed to load weights", "QKVParallelLinear"))  # a real missing weight shows
    assert drop.filter(record("something else %s", "RotaryEmbedding"))
    every = library_logs.DropRecords(["Enforce eager set, disabling torch.compile"])
    assert not every.filter(record("Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup."))
    assert every.filter(record("Enforce eager is not supported"))
    # Every entry names a logger of the library and gives the reason it says nothing to the user.
    assert all(name.startswith("vllm.") and prefix and why for name, prefix, why in library_logs.NOISE)


def test_library_policy_reaches_started_processes_through_the_environment(monkeypatch):
    monkeypatch.delenv(library_logs.ENV, raising=False)
    assert not library_logs.quiet()
    monkeypatch.setattr(library_logs, "install", lambda: installed.append(True))
    installed = []
    library_logs.apply(verbose=True)
    assert os.environ[library_logs.ENV] == "verbose" and not installed and not library_logs.quiet()
    library_logs.apply(verbose=False)
    assert os.environ[library_logs.ENV] == "quiet" and installed == [True] and library_logs.quiet()
    library_logs.apply_from_environment()  # what `megatron_dynamo.cli` does on import in a started process
    assert installed == [True, True]
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    library_logs.apply(verbose=False)
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"  # the ranks it starts load torch with it


def test_wandb_mode_needs_wandb_before_any_rank_starts(monkeypatch):
    import importlib.util

    from megatron_dynamo.trainer import preflight

    with pytest.raises(ConfigError, match=r"^logging.wandb.mode: must be one of"):
        load_run_config(CPU_DEFAULT, ["logging.wandb.mode=onlne"])
    run = load_run_config(CPU_DEFAULT, ["logging.wandb.mode=offline"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else
                        real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb.mode=offline needs wandb.*pip install -e '\.\[wandb\]'"):
        preflight.check_run_inputs(run)
    preflight.check_run_inputs(load_run_config(CPU_DEFAULT))  # disabled (the default): wandb is not needed
