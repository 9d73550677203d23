"""Cluster recipes for Qwen2.5-Math-1.5B / 7B and Qwen3-14B (paper, Table 3), launched through nemo-run.

    dynamo launch list
    dynamo launch show qwen3-14b [key=value ...]
    dynamo launch run qwen3-14b --executor slurm --account A --partition P \\
        --container-image IMG --mounts /lustre:/lustre --ckpt-root /lustre/models --data-dir /lustre/data \\
        --output-root /lustre/runs --dryrun
    dynamo launch run qwen2.5-math-1.5b --executor local trainer.steps=10
    dynamo launch run convert-hf-to-megatron --executor slurm --account A --partition P \\
        src=/lustre/models/Qwen3-14B out=/lustre/models/Qwen3-14B-megatron tp=4 pp=2

A training recipe is configs/<name>.yaml (see `show`) plus its cluster shape. The task is a run.Partial of
megatron_dynamo.launch.entry.train (the code path of `dynamo train`, one process per GPU under torchrun) with
resume on: every (re)start continues from the latest checkpoint, the first one starts from scratch. Slurm jobs
requeue on preemption, and 5 minutes before the time limit (SIGUSR1 -> the ranks save the step they are on ->
non-zero exit -> scontrol requeue, up to --retries times). RECIPE may also be a YAML path (configs/cpu_default.yaml;
--gpus-per-node 0 runs CPU ranks). Site paths come from --ckpt-root / --data-dir / --output-root or DYNAMO_CKPT_ROOT /
DYNAMO_DATA_DIR / DYNAMO_OUTPUT_ROOT; Slurm defaults from DYNAMO_SLURM_ACCOUNT, DYNAMO_SLURM_PARTITION,
DYNAMO_CONTAINER_IMAGE, DYNAMO_CONTAINER_MOUNTS, DYNAMO_JOB_DIR. Conversion recipes take key=value parameters:
src, out, tp, pp, tokenizer, dtype, force. `run` needs nemo-run (pip install -e ".[launch]"); list and show do
not. Without nemo-run: scripts/slurm/train.sbatch and scripts/slurm/convert.sbatch (docs/cluster.md).

Memory: `show` prints the plan of the fullest GPU (weights, gradients, optimizer state, activations, routes, the
vLLM engine's share, the weight sync's transient; launch/memory_plan.py) at the recipe's device memory
(Recipe.device_memory, the cluster's 80 GB GPUs); `show` and `run` refuse a GPU job whose plan exceeds it, before
anything is submitted: exit 2, one line naming the largest term and a key that makes it fit (docs/cluster.md).

Values that reach the batch script are shell-quoted (--container-image, --mounts, --code-dir and their DYNAMO_*
defaults: nemo-run writes them unquoted) or refused with exit 2 where they cannot be: --account, --partition,
--time, --job-dir, --ssh-host and --ssh-user go into #SBATCH lines or paths nemo-run does not quote, so they take
letters, digits and _ . / @ % + = : , - only; a newline is refused everywhere.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile

import yaml

from megatron_dynamo.algorithms.baselines import ALGO_HELP
from megatron_dynamo.config import ConfigError, parse_yaml, to_dict
from megatron_dynamo.launch import nemo
from megatron_dynamo.launch.entry import convert_args
from megatron_dynamo.launch.memory_check import architecture, check_job_memory, check_memory, plan_run, plan_table
from megatron_dynamo.launch.memory_plan import GiB
from megatron_dynamo.launch.recipes import (CONVERSIONS, PROJECT_ROOT, RECIPES, Recipe, SiteRoots, TRAIN_ENV,
                                            check_layout, get_recipe, layout_reasons, load_recipe, recipe_overrides,
                                            train_args)
from megatron_dynamo.trainer.config import ALGORITHMS


def _site_arguments(parser) -> None:
    parser.add_argument("name", help="recipe name (see `dynamo launch list`) or a YAML config path "
                        "(configs/cpu_default.yaml: 1 node x 1 GPU unless --nodes/--gpus-per-node say otherwise)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="training recipes: config overrides (trainer.steps=50); conversion recipes: "
                             "src=, out=, tp=, pp=, tokenizer=, dtype=, force=")

    parser.add_argument("--algo", choices=ALGORITHMS, default="dynamo",
                        help=ALGO_HELP)
    parser.add_argument("--ckpt-root", default=None,
                        help="directory of HF checkpoints: model.checkpoint/tokenizer become <root>/<HF name> "
                             "(default $DYNAMO_CKPT_ROOT, else the YAML's relative path)")
    parser.add_argument("--data-dir", default=None,
                        help="directory of the JSONL datasets, becomes data.data_dir (default $DYNAMO_DATA_DIR)")
    parser.add_argument("--output-root", default=None,
                        help="runs go to <root>/<recipe> (trainer.output_dir; default $DYNAMO_OUTPUT_ROOT)")


def add_arguments(parser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True,
                                    help="list | show NAME | run NAME")
    actions.add_parser("list", help="the recipes: name, nodes x GPUs, parallel layout")
    _site_arguments(actions.add_parser("show", help="a recipe's layout, memory plan, full config and plain launch "
                                                    "commands"))
    run = actions.add_parser("run", help="submit a recipe (or print it with --dryrun)")
    _site_arguments(run)
    env = os.environ.get
    run.add_argument("--executor", choices=["local", "slurm"], required=True,
                     help="local: torchrun on this machine; slurm: an sbatch job")
    run.add_argument("--nodes", type=int, default=None, help="nodes (default: the recipe's; local: 1)")
    run.add_argument("--gpus-per-node", type=int, default=None,
                     help="GPUs per node (default: the recipe's, 8; a YAML path: 1); 0: a CPU job, one rank per "
                          "node and no GPU requested")
    run.add_argument("--account", default=env("DYNAMO_SLURM_ACCOUNT"),
                     help="Slurm account (default $DYNAMO_SLURM_ACCOUNT; none: no --account line)")
    run.add_argument("--partition", default=env("DYNAMO_SLURM_PARTITION"),
                     help="Slurm partition (default $DYNAMO_SLURM_PARTITION)")
    run.add_argument("--time", default=None, help="Slurm time limit per allocation (default: the recipe's)")
    run.add_argument("--container-image", default=env("DYNAMO_CONTAINER_IMAGE"),
                     help="pyxis/enroot image with the project's dependencies (default $DYNAMO_CONTAINER_IMAGE; "
                          "none: run on the host)")
    run.add_argument("--mounts", default=env("DYNAMO_CONTAINER_MOUNTS", ""),
                     help="comma-separated container mounts SRC:DST (default $DYNAMO_CONTAINER_MOUNTS); each is "
                          "shell-quoted in the batch script, a newline in one is refused")
    run.add_argument("--job-dir", default=env("DYNAMO_JOB_DIR", ""),
                     help="nemo-run's job directory on the cluster's shared file system (default $DYNAMO_JOB_DIR, "
                          "else ~/.nemo_run/experiments)")
    run.add_argument("--ssh-host", default=None, help="submit through SSH to this login node (needs --job-dir)")
    run.add_argument("--ssh-user", default=None, help="SSH user for --ssh-host (default $USER)")
    run.add_argument("--code-dir", default=None,
                     help="run from this checkout on the cluster instead of packaging the committed HEAD of "
                          "this checkout with git archive")
    run.add_argument("--rdzv-port", type=int, default=29500,
                     help="Slurm: torchrun's rendezvous port on the job's first node (default 29500)")
    run.add_argument("--retries", type=int, default=None,
                     help="Slurm requeues after a non-zero exit, time-limit requeues included (default 20 for "
                          "training, 0 for conversions)")
    run.add_argument("--dryrun", action="store_true",
                     help="print the batch script / command that would run; submit nothing")


def _roots(args):
    return SiteRoots.from_env(ckpt_root=args.ckpt_root, data_dir=args.data_dir, output_root=args.output_root)


def _convert_params(overrides: list[str]) -> dict:
    params = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"parameter '{item}' is not of the form key=value")
        value = parse_yaml(raw) if raw.strip() else ""
        params[key.strip()] = str(value) if key.strip() in ("src", "out", "tokenizer", "dtype") else value
    return params


def _list() -> int:
    for recipe in RECIPES.values():
        print(f"{recipe.name:24s} {recipe.nodes} x {recipe.gpus_per_node} GPUs  {recipe.description}  "
              f"[{recipe.config}]")
    for name, direction in CONVERSIONS.items():
        print(f"{name:24s} 1 node, CPU       python -m checkpoints_convert {direction} (src= out= tp= pp= ep=)")
    return 0


def _show(args) -> int:
    if args.name in CONVERSIONS:
        try:
            command = convert_args(CONVERSIONS[args.name], **_convert_params(args.overrides))
        except TypeError as exc:  # a missing or unknown parameter
            raise ValueError(f"{args.name}: {exc}") from None
        print("python -m checkpoints_convert " + shlex.join(command))
        return 0
    recipe = get_recipe(args.name)
    overrides = recipe_overrides(recipe, _roots(args), args.overrides)
    cfg = load_recipe(recipe, overrides, args.algo)
    layout = check_layout(cfg, recipe.nodes, recipe.gpus_per_node)
    print(f"# {recipe.name}: {recipe.config}\n# layout: {layout.describe()}")
    print("\n".join(layout_reasons(recipe)))
    arch = architecture(cfg, PROJECT_ROOT)
    if arch is not None:  # the table first: a layout that does not fit is refused below, with the plan shown
        print("\n".join(plan_table(plan_run(cfg, arch, layout.topology, recipe.device_memory),
                                   _capacity_note(recipe))), flush=True)
        check_memory(cfg, arch, layout.topology, recipe.device_memory)
    else:
        print(f"# memory plan: none, the architecture ({cfg.model.config or cfg.model.checkpoint}) is not readable "
              "here")
    print(f"# algo: {args.algo}; resume on: the latest checkpoint under the output directory, if any")
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    print("\n# the same run without nemo-run, on every node of the job (scripts/slurm/train.sbatch does this):")
    print(f"torchrun --nnodes {recipe.nodes} --nproc-per-node {recipe.gpus_per_node} --rdzv-backend c10d "
          f"--rdzv-endpoint HEAD_NODE:29500 --rdzv-id JOB_ID -m megatron_dynamo.cli "
          + shlex.join(train_args(recipe, overrides, args.algo)))
    return 0


def _capacity_note(recipe: Recipe) -> str:
    return f"{recipe.device_memory / GiB:.1f} GiB a GPU (Recipe.device_memory; the cluster recipes' 80 GB GPUs)"


def _dryrun_notes(args, script: str, each_task: str, per_node: int | None) -> list[str]:
    """What the sbatch script leaves unsaid: the command every task runs, where the logs go, what is not set."""
    import re

    batch_log = re.search(r"^#SBATCH --output=(\S+)", script, re.M)
    task_log = re.search(r"^srun --output (\S+)", script, re.M)
    ranks = f"torchrun in it starts {per_node} processes, each one rank running" if per_node else "it runs"
    lines = [f"# every task (one srun task per node; {ranks}):", f"#   {each_task}",
             "#   (the script hands it to nemo-run's runner through its task file, written when the job is submitted)",
             f"# logs: the batch script's {batch_log.group(1) if batch_log else '(sbatch default)'}",
             f"#       each task's {task_log.group(1) if task_log else '(with the batch log)'}",
             "#   (nemo-run's job directory: --job-dir DIR or $DYNAMO_JOB_DIR puts it on the cluster's shared file "
             "system)"]
    unset = [f"--{key} (${env})" for key, env in (("account", "DYNAMO_SLURM_ACCOUNT"),
                                                   ("partition", "DYNAMO_SLURM_PARTITION")) if not getattr(args, key)]
    if unset:
        lines.append(f"# not set: {', '.join(unset)}: sbatch takes the cluster's defaults")
    return lines


def _run(args) -> int:
    if args.name in CONVERSIONS:
        task = nemo.convert_task(CONVERSIONS[args.name], **_convert_params(args.overrides))
        nodes, gpus, env, torchrun, time_limit, retries = 1, None, {}, False, "04:00:00", 0
        summary = f"python -m checkpoints_convert {CONVERSIONS[args.name]} on 1 node (CPU)"
        name = args.name
        each_task = "python -m checkpoints_convert " + shlex.join(
            convert_args(CONVERSIONS[args.name], **_convert_params(args.overrides)))
    else:
        recipe = get_recipe(args.name)
        name = recipe.name  # a YAML path: its file name without .yaml (nemo-run's experiment and job name)
        task, cfg = nemo.train_task(recipe, args.overrides, _roots(args), args.algo)
        each_task = "dynamo " + shlex.join(train_args(recipe, recipe_overrides(recipe, _roots(args), args.overrides),
                                                      args.algo))
        nodes = args.nodes or (1 if args.executor == "local" else recipe.nodes)
        if args.executor == "local" and recipe.nodes > 1 and args.nodes is None:
            raise ValueError(f"{recipe.name} is laid out for {recipe.nodes} nodes; the local executor runs one node: "
                             "pass --nodes 1 to run it here anyway (fewer data-parallel ranks, more memory per GPU)")
        if args.executor == "local" and nodes != 1:
            raise ValueError("the local executor runs on one node: --nodes 1")
        gpus = recipe.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
        if gpus < 0:
            raise ValueError(f"--gpus-per-node must be >= 0, got {gpus}")
        layout = check_layout(cfg, nodes, gpus or 1)  # 0 GPUs: one CPU rank per node
        summary = layout.describe()
        if gpus:  # refused before it is submitted when a GPU's memory plan exceeds the recipe's device memory
            check_job_memory(cfg, layout.topology, recipe.device_memory, PROJECT_ROOT)
        else:
            summary = summary.replace("GPUs", "CPU ranks", 1)
        env, torchrun, time_limit, retries = TRAIN_ENV, True, recipe.time, 20
    if args.executor == "local":
        executor = nemo.local_executor(gpus or 1, env, use_torchrun=torchrun)
    else:
        options = nemo.SlurmOptions(
            account=args.account, partition=args.partition, time=args.time, container_image=args.container_image,
            container_mounts=tuple(m for m in args.mounts.split(",") if m), job_dir=args.job_dir,
            ssh_host=args.ssh_host, ssh_user=args.ssh_user, code_dir=args.code_dir,
            retries=retries if args.retries is None else args.retries, rdzv_port=args.rdzv_port)
        executor = nemo.slurm_executor(options, nodes, gpus, time_limit, env, use_torchrun=torchrun)
    print(f"# {name}: {summary}", flush=True)
    if args.name not in CONVERSIONS and args.dryrun:
        print("\n".join(layout_reasons(recipe)))
    if not args.dryrun:
        local_job_dir = args.executor == "slurm" and not args.ssh_host and args.job_dir
        state = nemo.submit(task, executor, name, detach=args.executor == "slurm",
                            base_dir=args.job_dir if local_job_dir else None)
        print(f"# {name}: {state}")
        return 1 if state == "FAILED" else 0
    with tempfile.TemporaryDirectory(prefix="dynamo-launch-") as base:
        rendered = nemo.render(task, executor, name, base)
        if rendered.script is not None:
            print(f"# sbatch --requeue --parsable {rendered.script_path.name}\n{rendered.script}")
            print("\n".join(_dryrun_notes(args, rendered.script, each_task, gpus if torchrun else None)))
        else:
            print("\n".join(f"{k}={shlex.quote(v)}" for k, v in rendered.env.items() if k != "PATH"))
            print(shlex.join(rendered.command))
    return 0


def main(args) -> int:
    try:
        if args.action == "list":
            return _list()
        if args.action == "show":
            return _show(args)
        return _run(args)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"dynamo launch: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"dynamo launch: {exc}; `dynamo launch run` needs nemo-run: pip install -e \".[launch]\"",
              file=sys.stderr)
        return 2
