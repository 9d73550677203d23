"""A bad input is not retried on the cluster (issue 33): nemo-run's batch script requeued a job on any non-zero
exit while retries were left (TORCHX_MAX_RETRIES=20), so a config error (exit 2) ran 20 times. Now a failure a new
start would repeat ends the job at once, with its line in the log; a signal or a killed process still requeues.

Here the rendered batch script runs under bash with srun and scontrol stubbed, for every case (no cluster);
tests/test_slurm.py runs the same on the local Slurm: a config error ends the job FAILED with no restart, a rank
killed by SIGKILL (what a node failure or the OOM killer does) requeues it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUBS = {
    # The job step: what the ranks print goes to srun's --output (nemo-run's log-<job>_%j_<restart>.out).
    "srun": '#!/bin/bash\nif [[ $* == *hostname* ]]; then echo 127.0.0.1; exit 0; fi\n'
            'while [[ $1 != --output ]]; do shift; done\nout=${2//%j/$SLURM_JOB_ID}\n'
            'printf "%s\\n" "$STUB_STEP_OUTPUT" >> "$out"\nexit "$STUB_STEP_EXIT"\n',
    "scontrol": '#!/bin/bash\necho "$*" >> "$STUB_LOG"\nif [[ $1 == show ]]; then echo node1; fi\n',
}


def _render(tmp_path: Path) -> tuple[str, Path]:
    from megatron_dynamo.launch import nemo
    from megatron_dynamo.launch.recipes import TRAIN_ENV, SiteRoots, get_recipe

    recipe = get_recipe(str(ROOT / "configs" / "cpu_default.yaml"))
    task, _ = nemo.train_task(recipe, [], SiteRoots())
    executor = nemo.slurm_executor(nemo.SlurmOptions(job_dir=str(tmp_path / "jobs"), code_dir="/code"), 1, 0,
                                   recipe.time, TRAIN_ENV)
    rendered = nemo.render(task, executor, recipe.name, tmp_path / "exp")
    output = re.search(r"^#SBATCH --output=(\S+)$", rendered.script, re.M).group(1)
    return rendered.script, Path(output.replace("%j", "77"))


@pytest.mark.parametrize("step_output,exit_code,requeued", [
    ("dynamo launch: data.train: no such file: /nope.jsonl\ndynamo launch: not requeued: bad input (exit 2)", 2,
     False),
    ("[default0]:dynamo launch: rank 0: --resume: no intact checkpoint under /r\n"
     "[default0]:dynamo launch: not requeued: the run cannot go on (exit 2)", 1, False),
    ("dynamo launch: rank 0: stopped by SIGUSR1 after step 2: its checkpoint is saved", 1, True),
    ("srun: error: node1: task 0: Killed", 137, True),
    ("Traceback (most recent call last):\nRuntimeError: gloo connection closed by peer", 1, True),
])
def test_the_batch_script_requeues_only_after_a_signal_or_a_lost_process(tmp_path, step_output, exit_code, requeued):
    script, batch_log = _render(tmp_path)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    batch_log.parent.mkdir(parents=True, exist_ok=True)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(tmp_path / "scontrol.log"), "SLURM_JOB_ID": "77",
           "SLURM_JOB_NODELIST": "node1", "STUB_STEP_OUTPUT": step_output, "STUB_STEP_EXIT": str(exit_code),
           "HOME": str(tmp_path)}
    with open(batch_log, "w") as out:  # the batch shell's stdout is the job's batch log, as under Slurm
        proc = subprocess.run(["bash", "-c", script], env=env, stdout=out, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    assert proc.returncode == exit_code, proc.stderr[-2000:]
    calls = (tmp_path / "scontrol.log").read_text().splitlines()
    assert ("requeue 77" in calls) == requeued, calls
    said = [line for line in batch_log.read_text().splitlines() if line.startswith("dynamo: job 77")]
    if requeued:
        assert said == []
    else:
        assert said == [f"dynamo: job 77 is not requeued: {step_output.splitlines()[-1].split('requeued: ')[1]}"]
