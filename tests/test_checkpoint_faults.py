"""Faults are one line and lose nothing (issue 33): a full disk mid-save, unwritable directories, too little room for a
checkpoint, a converter --force aimed at the wrong directory. The disks are real: a small tmpfs mounted for the test
(root only: skipped otherwise, with the reason) and a read-only one. Real CLI, real Megatron on gloo."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_reference import REPO

CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")
SHORT = ["trainer.sft_warmup_steps=5", "data.prompts_per_step=8", "trainer.mini_batch_prompts=4",
         "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2", "dynamo.allocation.n_max=6",
         "data.synthetic_problems=16", "logging.plot=false", "logging.tensorboard=false"]


def _train(*args, env=None):
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT, *SHORT, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)


@contextlib.contextmanager
def _mounted_tmpfs(path: Path, options: str):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs the suite as root)")
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.slow
def test_a_full_disk_mid_save_is_one_line_and_keeps_latest(tmp_path):
    """25 MB hold two checkpoints of the CPU default (10.1 MB each) but not a third: the step-3 save fails. Before:
    `CheckpointException ... unexpected pos` traceback, a step_000003.tmp left, and (periodic saves) the run went
    on without saving. Now: one line naming the directory and the space, no traceback, no .tmp, latest still
    step 2, the run stops (exit 1) after step 3; the next --resume is refused by the preflight (no room for one
    checkpoint), in one line, exit 2, before any step."""
    with _mounted_tmpfs(tmp_path / "disk", "size=25m") as disk:
        root = disk / "checkpoints"
        run = tmp_path / "run"
        proc = _train(f"trainer.output_dir={run}", f"checkpoint.dir={root}", "trainer.steps=5", "checkpoint.every=1",
                      "checkpoint.keep_last=3")
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if "not saved" in line]
        assert len(errors) == 1, proc.stderr[-3000:]
        assert errors[0].startswith(f"dynamo train: checkpoint of step 3 not saved in {root}: no space left on "
                                    "device: "), errors[0]
        assert "free of 26.2 MB; step_000003.tmp removed, latest is still step_000002; the run stops" in errors[0]
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
        assert (root / "latest").read_text() == "step_000002\n"
        steps = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(steps) == 3  # step 3 trained, not saved; no step after it

        resumed = _train(f"trainer.output_dir={run}", f"checkpoint.dir={root}", "trainer.steps=5", "--resume")
        assert resumed.returncode == 2, resumed.stderr[-3000:]
        line = resumed.stderr.strip().splitlines()[-1]
        assert re.fullmatch(rf"dynamo train: {re.escape(str(root))}: \d+\.\d MB free of 26\.2 MB, but one checkpoint "
                            r"of this run takes about 1\d\.\d MB \(fp32 weights, Adam state\): free space or set "
                            r"checkpoint\.dir elsewhere", line), resumed.stderr[-3000:]
        print(f"\nfull disk: {errors[0]}\nresume: {line}")


def test_unwritable_directories_are_refused_before_anything_runs(tmp_path):
    """trainer.output_dir or checkpoint.dir on a read-only file system: before, a raw OSError traceback (output) or
    every step trained and none saved, "the previous checkpoint is intact" with none there (checkpoint.dir). Now one
    line naming the key, exit 2, nothing started."""
    with _mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as readonly:
        for args, key in (([f"trainer.output_dir={readonly / 'run'}"], "trainer.output_dir"),
                          ([f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.dir={readonly / 'ck'}"],
                           "checkpoint.dir")):
            proc = _train(*args, "trainer.steps=1")
            assert proc.returncode == 2, proc.stderr[-3000:]
            lines = proc.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"dynamo train: {key}: ") and \
                "is not writable" in lines[0] and "Read-only file system" in lines[0], proc.stderr
            assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_checkpoint_size_estimate_against_a_saved_checkpoint(tmp_path):
    """The preflight's estimate of one checkpoint (weights, Adam moments, fp32 master weights of bf16) is at least
    the size of a real one and at most 15 % + 1 MiB above it, for fp32 and bf16 (measured: a step of each)."""
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.preflight import check_model_on_layout, checkpoint_bytes

    for dtype in ("fp32", "bf16"):
        run = tmp_path / dtype
        proc = _train(f"trainer.output_dir={run}", "trainer.steps=1", f"model.dtype={dtype}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        step = run / "checkpoints" / "step_000001"
        actual = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
        config = load_run_config(CPU_DEFAULT, [f"model.dtype={dtype}"])
        estimate = checkpoint_bytes(config, check_model_on_layout(config))
        assert actual <= estimate <= 1.15 * actual + 2**20, (dtype, actual, estimate)


def test_converter_force_replaces_only_a_checkpoint_of_its_own_kind(tmp_path):
    """--force was `rm -rf` of any --out. Now: a directory holding something else is refused in one line and left
    as it was; an empty one, or one holding a checkpoint of the kind being written, is replaced."""
    from checkpoints_convert.convert import check_replaceable
    from megatron_dynamo.models.checkpoint_io import CheckpointError

    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    for kind in ("megatron", "hf"):
        with pytest.raises(CheckpointError, match="--force replaces only an empty directory or one holding") as e:
            check_replaceable(precious, True, kind)
        assert "\n" not in str(e.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError):
        check_replaceable(tmp_path / "file", True, "hf")
    (tmp_path / "empty").mkdir()
    check_replaceable(tmp_path / "empty", True, "hf")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    check_replaceable(hf, True, "hf")
    with pytest.raises(CheckpointError):
        check_replaceable(hf, True, "megatron")  # an HF model is not what hf-to-megatron writes
    (tmp_path / "link").symlink_to(hf)
    with pytest.raises(CheckpointError):
        check_replaceable(tmp_path / "link", True, "hf")

    proc = subprocess.run([sys.executable, "-m", "checkpoints_convert", "megatron-to-hf", "--megatron",
                           str(tmp_path / "nothing"), "--out", str(precious), "--force"], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1 and "--force replaces only" in proc.stderr, proc.stderr
    assert (precious / "thesis.tex").read_text() == "years of work"
