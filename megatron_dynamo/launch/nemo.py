"""nemo-run recipes: tasks (``run.Partial`` of :mod:`megatron_dynamo.launch.entry`), executors, dry-run rendering and
submission. nemo-run is imported inside the functions only (the ``launch`` extra), never at module import.

    task, cfg = train_task(get_recipe("qwen3-14b"), overrides=[], roots=SiteRoots.from_env())
    executor = slurm_executor(SlurmOptions(account="acct", partition="batch"), nodes=2, gpus_per_node=8,
                              time="24:00:00", env=TRAIN_ENV)
    print(render(task, executor, "qwen3-14b", base_dir).script)

The RunConfig is turned into nested ``run.Config`` objects by walking the dataclass fields, so a section added to
RunConfig needs no change here; fiddle serializes that tree into the job and builds the same RunConfig in every rank.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_dynamo.launch.entry import convert, train
from megatron_dynamo.launch.recipes import PROJECT_ROOT, Recipe, SiteRoots, load_recipe, recipe_overrides
from megatron_dynamo.launch.requeue import requeue_policy

# Seconds before the time limit at which Slurm sends SIGUSR1 to every process of the job step (nemo-run renders
# `--signal=USR1@300`, no `B:`). The ranks take it as a stop request (parallel.stop_signals: finish the step, save
# it, exit 138); torchrun's agent is told to handle it too (--signals-to-handle): it passes it on and
# waits STOP_GRACE_S for the ranks before it kills them (its default, 30 s, is no time for a step and a save), then
# exits non-zero, srun returns non-zero and nemo-run's batch script runs `scontrol requeue` (retries left): the
# next allocation resumes from the saved step. Preemption requeues through `sbatch --requeue`. A failure a new
# start would repeat (bad input: exit 2) is not requeued (launch/requeue.py).
SIGNAL_BEFORE_LIMIT_S = 300
STOP_GRACE_S = 270
# The environment torchrun's agent needs for that (added to a Slurm training job's environment).
TORCHRUN_STOP_ENV = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",  # torchrun --signals-to-handle
                     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(STOP_GRACE_S)}


def _nemo_run():
    """``import nemo_run`` without the deprecation warning its leptonai/fastapi imports print on every call."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*starlette.middleware.wsgi is deprecated.*")
        import nemo_run

    return nemo_run


def to_config(value: Any) -> Any:
    """A dataclass instance -> ``run.Config`` of its class with every init field converted the same way
    (lists, tuples and dicts element-wise); anything else unchanged."""
    run = _nemo_run()

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return run.Config(type(value), **{f.name: to_config(getattr(value, f.name))
                                          for f in dataclasses.fields(value) if f.init})
    if isinstance(value, (list, tuple)):
        return type(value)(to_config(v) for v in value)
    if isinstance(value, dict):
        return {k: to_config(v) for k, v in value.items()}
    return value


def train_task(recipe: Recipe, overrides: list[str], roots: SiteRoots, algo: str = "dynamo",
               resume: bool = True):
    """(``run.Partial(entry.train, config=run.Config(RunConfig, ...), algo=..., resume=...)``, the RunConfig)."""
    run = _nemo_run()

    cfg = load_recipe(recipe, recipe_overrides(recipe, roots, overrides), algo)
    return run.Partial(train, config=to_config(cfg), algo=algo, resume=resume), cfg


def convert_task(direction: str, **params: Any):
    """``run.Partial(entry.convert, direction=..., src=..., out=..., tp=..., ...)``; checks the arguments now."""
    import inspect

    run = _nemo_run()

    try:  # a missing or unknown parameter fails here, before anything is submitted
        inspect.signature(convert).bind(direction, **params)
    except TypeError as exc:
        raise ValueError(f"{direction}: {exc}") from None
    return run.Partial(convert, direction=direction, **params)


def local_executor(gpus: int, env: dict[str, str] | None = None, use_torchrun: bool = True):
    """This machine: torchrun with one process per GPU (``use_torchrun=False``: one plain process)."""
    run = _nemo_run()

    return run.LocalExecutor(ntasks_per_node=gpus if use_torchrun else 1,
                             launcher="torchrun" if use_torchrun else None, env_vars=dict(env or {}))


@dataclass(frozen=True)
class SlurmOptions:
    """Where and how to submit. ``job_dir``: nemo-run's experiment directory on the cluster (shared file system;
    default ``~/.nemo_run/experiments`` of the submitting user). ``ssh_host``: submit from a workstation through
    SSH (else ``sbatch`` runs on this machine, a login node). ``code_dir``: a checkout already on the cluster to
    run from; without it the committed HEAD of the checkout you launch from is packaged with ``git archive``.
    Without ``ssh_host`` (sbatch on this machine) the experiments go to ``<job_dir>/experiments/``."""

    account: str | None = None
    partition: str | None = None
    time: str | None = None
    container_image: str | None = None
    container_mounts: tuple[str, ...] = ()
    job_dir: str = ""
    ssh_host: str | None = None
    ssh_user: str | None = None
    code_dir: str | None = None
    retries: int = 20
    exclusive: bool = True
    rdzv_port: int = 29500


# What a value may hold where nemo-run writes it unquoted and it cannot be quoted: an `#SBATCH` line (sbatch reads
# it, not a shell), the paths nemo-run builds from the job directory (srun --output, the sbatch command it runs
# through a shell, `ln -s` of the code directory).
PLAIN = re.compile(r"[A-Za-z0-9_./@%+=:,-]+")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def plain(option: str, value: str) -> str:
    """``value`` if it is :data:`PLAIN`, else ValueError (``dynamo launch`` exits 2 with the line)."""
    if not PLAIN.fullmatch(value):
        raise ValueError(f"{option} {value!r}: only letters, digits and _ . / @ % + = : , - are allowed here (it "
                         "goes into an #SBATCH line or a path nemo-run does not quote)")
    return value


def shell_word(option: str, value: str, forbidden: str = "") -> str:
    """``value`` as one shell word where nemo-run writes it unquoted (its srun line, ``export``, ``ln -s``):
    shell-quoted. A control character (a newline) or one of ``forbidden`` (a separator of the option's own list)
    cannot be quoted for the program that reads it: ValueError."""
    bad = sorted({c for c in value if ord(c) < 32 or ord(c) == 127 or c in forbidden})
    if bad or not value:
        what = ", ".join(repr(c) for c in bad) or "an empty value"
        raise ValueError(f"{option} {value!r}: {what} cannot be passed on (refused)")
    return shlex.quote(value) if _nemo_leaves_srun_unquoted() else value


def _nemo_leaves_srun_unquoted() -> bool:
    """nemo-run 0.11 quotes an srun argument unless it is a ``noquote``, which it defines as ``str`` itself: so it
    quotes nothing. Quote here while that is so (a later nemo-run that quotes would otherwise quote twice)."""
    from nemo_run.core.execution import slurm

    return isinstance("", slurm.noquote)


def slurm_executor(options: SlurmOptions, nodes: int, gpus_per_node: int | None, time: str,
                   env: dict[str, str] | None = None, use_torchrun: bool = True):
    """One sbatch job of ``nodes`` nodes: one srun task per node running torchrun with ``gpus_per_node`` processes
    (rendezvous on the first node, port ``options.rdzv_port``), requeued on preemption and ``SIGNAL_BEFORE_LIMIT_S``
    before the time limit (the ranks save first, see ``TORCHRUN_STOP_ENV``). ``gpus_per_node`` 0 or None: no GPU
    request, one rank per node.
    ``use_torchrun=False``: one plain task (the conversions), no time-limit signal."""
    run = _nemo_run()

    from nemo_run.config import get_nemorun_home

    for option, value in (("--account", options.account), ("--partition", options.partition),
                          ("--time", options.time or time), ("--job-dir", options.job_dir or get_nemorun_home()),
                          ("--ssh-host", options.ssh_host), ("--ssh-user", options.ssh_user)):
        if value:
            plain(option, value)
    env = {**(env or {}), **(TORCHRUN_STOP_ENV if use_torchrun else {})}
    for name in env:
        if not ENV_NAME.fullmatch(name):
            raise ValueError(f"environment variable name {name!r}: refused")
    if options.ssh_host:
        if not options.job_dir:
            raise ValueError("--ssh-host needs --job-dir (nemo-run's job directory on the cluster)")
        tunnel = run.SSHTunnel(host=options.ssh_host, user=options.ssh_user or os.environ.get("USER", ""),
                               job_dir=options.job_dir)
    else:
        # nemo-run writes the experiment under <base_dir>/experiments/ and sbatch reads it from the tunnel's job
        # directory: on this machine they must be the same directory (submit(base_dir=options.job_dir)).
        tunnel = run.LocalTunnel(job_dir=os.path.join(options.job_dir, "experiments") if options.job_dir else "")
    # Values nemo-run writes unquoted on the srun line: each quoted (a pyxis mount list is one word, its commas
    # between the quoted mounts), or refused where a character cannot be passed on (a comma inside a mount).
    mounts = [shell_word("--mounts", m, forbidden=",") for m in options.container_mounts]
    image = shell_word("--container-image", options.container_image) if options.container_image else None
    if options.code_dir:
        # nemo-run links <job dir>/code to this directory (`ln -s CODE_DIR ...` run by a shell); the container must
        # see it under the same path. (A subclass of Packager: nemo-run links the code directory only for those.)
        code_dir = shell_word("--code-dir", options.code_dir, forbidden=",:")
        packager = run.PatternPackager(include_pattern=[], relative_path=[], symlink_from_remote_dir=code_dir)
        mounts.append(shell_word("--code-dir", f"{options.code_dir}:{options.code_dir}", forbidden=","))
    else:
        packager = run.GitArchivePackager(basepath=str(PROJECT_ROOT))
    return run.SlurmExecutor(
        account=options.account, partition=options.partition, nodes=nodes,
        ntasks_per_node=(gpus_per_node or 1) if use_torchrun else 1, gpus_per_node=gpus_per_node or None,
        time=options.time or time, exclusive=options.exclusive or None,
        container_image=image, container_mounts=mounts,
        env_vars={name: shlex.quote(value) for name, value in env.items()},  # (`export NAME=VALUE` lines)
        signal=f"USR1@{SIGNAL_BEFORE_LIMIT_S}" if use_torchrun else None, retries=options.retries,
        setup_lines=requeue_policy(),  # no requeue after a failure a new start would repeat
        job_name_prefix="dynamo-", tunnel=tunnel, packager=packager,
        launcher=run.Torchrun(rdzv_port=options.rdzv_port) if use_torchrun else None)


@dataclass(frozen=True)
class Rendered:
    """What a dry run produced. ``command``: the launched argv (torchrun ...; Slurm macros such as
    ``$head_node_ip`` left as the batch script has them); ``script``: the sbatch script (Slurm only);
    ``task_file``: the serialized task that ``nemo_run.core.runners.fdl_runner`` loads in every process."""

    executor: str
    command: list[str]
    env: dict[str, str]
    script: str | None
    script_path: Path | None
    task_file: Path
    job_dir: Path


def render(task, executor, name: str, base_dir: str | os.PathLike) -> Rendered:
    """Dry run: write everything nemo-run would submit under ``base_dir`` (kept) and return it; submits nothing."""
    run = _nemo_run()
    from nemo_run.core.frontend.console.api import CONSOLE

    plain("the job name", name)

    # nemo-run notes "Detected Torchrun launcher, setting ntasks_per_node=1 ..." while it lays out the job: its own
    # bookkeeping, printed in the middle of the dry run's script.
    quiet, CONSOLE.quiet = CONSOLE.quiet, True
    try:
        with run.Experiment(name, executor=executor, base_dir=str(base_dir), log_level="WARNING",
                            clean_mode=True) as exp:
            exp.add(task, name=name)
            exp.dryrun(log=False, delete_exp_dir=False)
            job = exp.jobs[0]
    finally:
        CONSOLE.quiet = quiet
    role = job._executable.roles[0]
    macros = job.executor.macro_values()
    if macros is not None:
        role = macros.apply(role)
    script = script_path = None
    if isinstance(job.executor, run.SlurmExecutor):
        script_path = Path(job.executor.experiment_dir) / f"{job.executor.job_name}_sbatch.sh"
        script = script_path.read_text()
    command = [role.entrypoint, *(a for arg in role.args for a in shlex.split(arg))]
    job_dir = Path(job.executor.job_dir)
    return Rendered(executor=type(job.executor).__name__, command=command, env=dict(role.env), script=script,
                    script_path=script_path, task_file=job_dir / "configs" / f"{job.id}_fn_or_script",
                    job_dir=job_dir)


def submit(task, executor, name: str, detach: bool, base_dir: str | os.PathLike | None = None) -> str:
    """Submit (Slurm: sbatch, returns once queued when ``detach``) or run (local: waits, streams the logs).
    ``base_dir``: where nemo-run keeps the experiment (default ``~/.nemo_run``). Returns the task's state
    (torchx ``AppState`` name: SUCCEEDED, FAILED, SUBMITTED, ...)."""
    run = _nemo_run()

    plain("the job name", name)

    with run.Experiment(name, executor=executor, base_dir=str(base_dir) if base_dir else None,
                        log_level="WARNING") as exp:
        exp.add(task, name=name, tail_logs=not detach)
        exp.run(detach=detach)
    state = exp.jobs[0].state  # the experiment's exit waits for a local job (not for a detached Slurm job)
    return getattr(state, "name", str(state))


def load_task(path: str | os.PathLike):
    """The built task of a serialized task file: a ``functools.partial`` of the entry point (for checks)."""
    import fiddle as fdl
    from nemo_run.core.serialization.zlib_json import ZlibJSONSerializer

    return fdl.build(ZlibJSONSerializer().deserialize(Path(path).read_text()))


__all__ = ["Rendered", "SlurmOptions", "convert_task", "load_task", "local_executor", "render", "slurm_executor",
           "submit", "to_config", "train_task"]
