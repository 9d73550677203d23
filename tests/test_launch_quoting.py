"""Launch values never reach a shell (issue 33): `dynamo launch run ... --executor slurm` put --container-image,
--mounts and --code-dir (also DYNAMO_CONTAINER_IMAGE / DYNAMO_CONTAINER_MOUNTS) unquoted on the sbatch script's srun
line, so `--mounts '/a:/b$(touch X)'` ran `touch X` on the cluster and a path with a space broke the job.

Here the script is rendered with values holding $(...), backticks, quotes and spaces and run under bash with srun
and scontrol stubbed (they record their arguments): srun must receive each value exactly, and nothing may run.
Values that cannot be quoted where they land (a newline anywhere, a space in an #SBATCH value, a comma inside one
mount) are refused with exit 2 and one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUBS = {
    "srun": '#!/bin/bash\nn=$(ls "$STUB_LOG" | grep -c "^srun")\nprintf "%s\\0" "$@" > "$STUB_LOG/srun.$n"\n'
            'echo 127.0.0.1\n',
    "scontrol": '#!/bin/bash\nprintf "%s\\0" "$@" >> "$STUB_LOG/scontrol"\n'
                'if [[ $1 == show && $2 == hostnames ]]; then echo node1; fi\n',
}


def _hostile(marker: Path) -> dict:
    """Values that run `touch` in MARKER if any shell evaluates them, with spaces and both kinds of quote."""
    return {"container_image": f"nvcr.io/org/img:1$(touch {marker}/image)`touch {marker}/tick` it's \"q\"",
            "container_mounts": (f"/lustre/a b:/data$(touch {marker}/mount)", f"/c:/d`touch {marker}/tick2`'"),
            "code_dir": f"/lustre/code dir/$(touch {marker}/code)`touch {marker}/tick3`'q\""}


def _run_script(script: str, tmp_path: Path) -> list[list[str]]:
    """Run the sbatch script as Slurm starts it (SLURM_* set), srun/scontrol stubbed; srun's argv per call."""
    stubs, log = tmp_path / "bin", tmp_path / "log"
    stubs.mkdir(parents=True)
    log.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(log), "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node1",
           "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(log / name).read_text().split("\0")[:-1] for name in sorted(os.listdir(log)) if name.startswith("srun")]


def test_hostile_values_reach_srun_exactly_and_run_nothing(tmp_path):
    from megatron_dynamo.launch import nemo
    from megatron_dynamo.launch.recipes import TRAIN_ENV, SiteRoots, get_recipe

    marker = tmp_path / "ran"
    marker.mkdir()
    values = _hostile(marker)
    recipe = get_recipe(str(ROOT / "configs" / "cpu_default.yaml"))
    task, _ = nemo.train_task(recipe, [], SiteRoots())
    options = nemo.SlurmOptions(account="acct", partition="batch", job_dir=str(tmp_path / "jobs"), **values)
    executor = nemo.slurm_executor(options, 1, 0, recipe.time, TRAIN_ENV)
    rendered = nemo.render(task, executor, recipe.name, tmp_path / "exp")
    calls = _run_script(rendered.script, tmp_path / "run")
    main = next(argv for argv in calls if "--container-image" in argv)
    assert main[main.index("--container-image") + 1] == values["container_image"]
    mounts = main[main.index("--container-mounts") + 1]
    code = values["code_dir"]
    assert mounts.startswith(",".join([*values["container_mounts"], f"{code}:{code}"]) + ","), mounts
    assert sorted(os.listdir(marker)) == [], "a value was run by the shell"
    # The packager links the job's code directory with `ln -s CODE_DIR DST`, a command nemo-run runs in a shell.
    from nemo_run.core.tunnel.client import PackagingJob

    link = tmp_path / "link"
    command = PackagingJob(symlink=True, src_path=executor.packager.symlink_from_remote_dir,
                           dst_path=str(link)).symlink_cmd()
    subprocess.run(["bash", "-c", command], check=True, cwd=tmp_path)
    assert os.readlink(link) == code and sorted(os.listdir(marker)) == []
    for key, value in TRAIN_ENV.items():  # exported values: quoted only where they need it (none of these)
        assert f"export {key}={value}\n" in rendered.script


def _launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DYNAMO_")}
    return subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "launch", "run", "configs/cpu_default.yaml",
                           "--executor", "slurm", "--gpus-per-node", "0", "--dryrun", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, env={**base, **(env or {})})


def test_the_cli_and_its_environment_defaults_are_quoted_too(tmp_path):
    """`dynamo launch run --dryrun` with DYNAMO_CONTAINER_IMAGE / DYNAMO_CONTAINER_MOUNTS holding $(...): the printed
    script, run with srun stubbed, passes them on as they are and runs nothing."""
    marker = tmp_path / "ran"
    marker.mkdir()
    values = _hostile(marker)
    proc = _launch("--job-dir", str(tmp_path / "jobs"), env={
        "DYNAMO_CONTAINER_IMAGE": values["container_image"],
        "DYNAMO_CONTAINER_MOUNTS": ",".join(values["container_mounts"])})
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout[proc.stdout.index("#!/bin/bash"):]
    main = next(argv for argv in _run_script(script, tmp_path / "run") if "--container-image" in argv)
    assert main[main.index("--container-image") + 1] == values["container_image"]
    assert main[main.index("--container-mounts") + 1].startswith(",".join(values["container_mounts"]) + ",")
    assert sorted(os.listdir(marker)) == []


@pytest.mark.parametrize("args,phrase", [
    (["--mounts", "/a:/b\ntouch /tmp/x"], "--mounts '/a:/b\\ntouch /tmp/x': '\\n' cannot be passed on (refused)"),
    (["--container-image", "img\n"], "--container-image 'img\\n': '\\n' cannot be passed on (refused)"),
    (["--code-dir", "/code\rdir"], "--code-dir '/code\\rdir': '\\r' cannot be passed on (refused)"),
    (["--code-dir", "/code:dir"], "--code-dir '/code:dir': ':' cannot be passed on (refused)"),
    (["--account", "acct --wrap=x"], "--account 'acct --wrap=x': only letters, digits and"),
    (["--partition", "p\n#SBATCH --x"], "--partition 'p\\n#SBATCH --x': only letters, digits and"),
    (["--time", "1:00:00 $(id)"], "--time '1:00:00 $(id)': only letters, digits and"),
    (["--job-dir", "/jobs dir"], "--job-dir '/jobs dir': only letters, digits and"),
])
def test_values_that_cannot_be_quoted_there_are_refused_in_one_line(args, phrase):
    proc = _launch(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dynamo launch: {phrase}"), proc.stderr
    assert "#!/bin/bash" not in proc.stdout
