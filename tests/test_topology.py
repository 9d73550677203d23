"""The job's topology (``parallel/topology.py``): the layouts users run, every layout check with its exact message,
and the same topology wherever it is read (``dynamo train``'s header, ``dynamo launch``'s layout, the ranks).

The engine arithmetic is checked against a reference written out rank by rank (engines as lists of consecutive
ranks), not against the formulas it uses.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_dynamo.cli import main
from megatron_dynamo.config import ConfigError
from megatron_dynamo.launch.ranks import resolve_topology
from megatron_dynamo.launch.recipes import RECIPES, check_layout, load_recipe
from megatron_dynamo.parallel.runtime import LAUNCH_VARIABLES, ParallelConfig
from megatron_dynamo.parallel.topology import EngineLayout, JobTopology, TrainingLayout
from megatron_dynamo.trainer.config import load_run_config

ROOT = Path(__file__).resolve().parent.parent
CPU_DEFAULT = str(ROOT / "configs" / "cpu_default.yaml")


def _sections(tp=1, pp=1, cp=1, rollout_tp=1, engine_ranks=0):
    parallel = SimpleNamespace(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp, expert_parallel=1,
                               expert_tensor_parallel=1)
    rollout = SimpleNamespace(tensor_parallel=rollout_tp, placement="separate" if engine_ranks else "colocated",
                              engine_ranks=engine_ranks)
    return parallel, rollout


def _reference_engines(first: int, ranks: int, tensor_parallel: int) -> list[list[int]]:
    """The engines as lists of job ranks: consecutive runs of tensor_parallel ranks from ``first``."""
    engines, current = [], []
    for rank in range(first, first + ranks):
        current.append(rank)
        if len(current) == tensor_parallel:
            engines.append(current)
            current = []
    assert not current
    return engines


# ---------------------------------------------------------------------------------------------- layouts users run
@pytest.mark.parametrize("name,world,dp,tp,pp,engines,first_engine_rank", [
    ("qwen2.5-math-1.5b", 8, 8, 1, 1, 4, 0),
    ("qwen2.5-math-7b", 8, 2, 4, 1, 4, 0),
    ("qwen2.5-math-7b-separate", 16, 2, 4, 1, 4, 8),
    ("qwen3-14b", 16, 2, 4, 2, 8, 0),
    ("qwen3-30b-a3b", 16, 8, 1, 2, 4, 0),
])
def test_the_recipes_layouts(name, world, dp, tp, pp, engines, first_engine_rank):
    recipe = RECIPES[name]
    run = load_recipe(recipe, list(recipe.overrides))
    topology = check_layout(run, recipe.nodes, recipe.gpus_per_node).topology
    assert topology == JobTopology.resolve(recipe.nodes * recipe.gpus_per_node, run.parallel, run.rollout)
    assert topology.world_size == world
    assert (topology.parallel.data_parallel, topology.parallel.tensor_parallel,
            topology.parallel.pipeline_parallel) == (dp, tp, pp)
    assert (topology.rollout.num_engines, topology.first_engine_rank) == (engines, first_engine_rank)
    reference = _reference_engines(first_engine_rank, world - first_engine_rank, run.rollout.tensor_parallel)
    assert topology.engine_leaders == tuple(engine[0] for engine in reference)
    for index, engine in enumerate(reference):
        for rank in engine:
            layout = topology.engine_layout(rank)
            assert (layout.engine_index, layout.is_leader) == (index, rank == engine[0])


@pytest.mark.parametrize("world,tp,pp", itertools.product(range(1, 13), (1, 2, 4), (1, 2, 3)))
def test_every_tp_pp_combination_gives_dp_or_the_one_message(world, tp, pp):
    parallel, rollout = _sections(tp=tp, pp=pp)
    if world % (tp * pp):
        with pytest.raises(ConfigError) as error:
            JobTopology.resolve(world, parallel, rollout)
        assert str(error.value) == (f"parallel.tensor_parallel x pipeline_parallel x context_parallel = {tp * pp} "
                                    f"does not divide world size {world} (the training ranks form whole "
                                    "model-parallel groups; the rest is data parallel)")
        return
    topology = JobTopology.resolve(world, parallel, rollout)
    assert topology.parallel.data_parallel * tp * pp == world and not topology.separate
    assert topology.rollout.num_engines == world  # rollout.tensor_parallel 1: an engine on every rank


@pytest.mark.parametrize("world,rollout_tp,engine_ranks", [
    (1, 1, 0), (4, 2, 0), (8, 4, 0), (6, 3, 0), (3, 1, 1), (4, 1, 2), (6, 2, 4), (16, 2, 8), (5, 4, 4),
])
def test_engine_counts_leaders_and_roles_against_the_reference(world, rollout_tp, engine_ranks):
    topology = JobTopology.resolve(world, *_sections(rollout_tp=rollout_tp, engine_ranks=engine_ranks))
    first = world - engine_ranks if engine_ranks else 0
    reference = _reference_engines(first, engine_ranks or world, rollout_tp)
    assert topology.rollout.num_engines == len(reference)
    assert topology.engine_leaders == tuple(engine[0] for engine in reference)
    assert topology.placement == ("separate" if engine_ranks else "colocated")
    for rank in range(world):
        layout = topology.engine_layout(rank)
        hosting = [i for i, engine in enumerate(reference) if rank in engine]
        if not hosting:  # a training rank of a separate job: no engine worker at all
            assert layout is None
            assert (topology.role(rank), topology.role_rank(rank)) == ("trainer", rank)
            continue
        assert (layout.engine_index, layout.num_engines, layout.world_size) == (hosting[0], len(reference),
                                                                                engine_ranks or world)
        assert layout.rank == rank - first and layout.is_leader == (rank in topology.engine_leaders)
        assert topology.role(rank) == ("engine" if engine_ranks else "trainer")
        assert topology.role_rank(rank) == rank - first


def test_a_rank_with_nothing_to_generate_and_the_trainer_world():
    topology = JobTopology.resolve(3, *_sections(engine_ranks=1))
    assert [topology.engine_layout(rank) for rank in range(3)][:2] == [None, None]
    assert (topology.parallel.ranks, topology.engine_ranks, topology.first_engine_rank) == (2, 1, 2)
    assert topology.parallel.data_parallel == 2
    assert topology.describe() == "DP 2 x TP 1 x PP 1; 1 rollout engine of 1 rank on rank 2 of its own"
    two = JobTopology.resolve(4, *_sections(engine_ranks=2))
    assert two.describe() == "DP 2 x TP 1 x PP 1; 2 rollout engines of 1 rank on ranks 2-3 of their own"


# ---------------------------------------------------------------------------------------------- the messages
@pytest.mark.parametrize("world,sections,message", [
    (6, dict(rollout_tp=4), "rollout.tensor_parallel=4 does not divide the 6 ranks (every rank hosts one vLLM worker, "
                            "in engines of rollout.tensor_parallel ranks)"),
    (5, dict(rollout_tp=2, engine_ranks=3), "rollout.tensor_parallel=2 does not divide rollout.engine_ranks=3 "
                                            "(every rank hosts one vLLM worker, in engines of rollout.tensor_parallel "
                                            "ranks)"),
    (2, dict(engine_ranks=2), "rollout.engine_ranks=2 must leave at least one of the job's 2 ranks to train"),
    (3, dict(tp=2, pp=2, engine_ranks=1), "parallel.tensor_parallel x pipeline_parallel x context_parallel = 4 does "
                                          "not divide the 2 training ranks (3 ranks minus rollout.engine_ranks=1) "
                                          "(the training ranks form whole model-parallel groups; the rest is data "
                                          "parallel)"),
    (0, dict(), "the job's ranks: must be >= 1, got 0"),
    (2, dict(rollout_tp=0), "rollout.tensor_parallel: must be >= 1, got 0"),
    (2, dict(pp=0), "parallel.pipeline_parallel: must be >= 1, got 0"),
])
def test_layout_errors_are_one_exact_line(world, sections, message):
    with pytest.raises(ConfigError) as error:
        JobTopology.resolve(world, *_sections(**sections))
    assert str(error.value) == message


@pytest.mark.parametrize("override,message", [
    ("rollout.tensor_parallel=0", "rollout.tensor_parallel: must be >= 1, got 0"),
    ("parallel.tensor_parallel=0", "parallel.tensor_parallel: must be >= 1, got 0"),
    ("parallel.context_parallel=-1", "parallel.context_parallel: must be >= 1, got -1"),
])
def test_the_config_loader_gives_the_same_at_least_one_message(override, message):
    with pytest.raises(ConfigError) as error:
        load_run_config(CPU_DEFAULT, [override])
    assert str(error.value) == message


def test_the_rank_time_guard_and_the_engine_layout_share_the_messages():
    with pytest.raises(ConfigError, match=r"^parallel.tensor_parallel x pipeline_parallel x context_parallel = 4 "
                                          r"does not divide world size 6 "):
        ParallelConfig(tensor_parallel=2, pipeline_parallel=2).validate(6)
    with pytest.raises(ConfigError, match=r"^rollout.tensor_parallel=4 does not divide the 6 ranks "):
        EngineLayout(0, 6, 4)
    with pytest.raises(ConfigError, match=r"^rank 2 is not one of the 2 ranks$"):
        EngineLayout(2, 2, 1)
    with pytest.raises(ConfigError, match=r"^2 training ranks and 1 engine ranks do not make a job of 4$"):
        JobTopology(4, TrainingLayout(2), EngineLayout(0, 1, 1))


def test_engines_only_names_the_commands_flags():
    topology = JobTopology.engines_only(4, 2, "--nproc 4", "--tensor-parallel")
    assert (topology.rollout.num_engines, topology.engine_leaders, topology.separate) == (2, (0, 2), False)
    with pytest.raises(ConfigError) as error:
        JobTopology.engines_only(3, 2, "--nproc 3", "--tensor-parallel")
    assert str(error.value) == ("--tensor-parallel=2 does not divide --nproc 3 (every rank hosts one vLLM worker, in "
                                "engines of --tensor-parallel ranks)")


def test_launch_resolves_nproc_or_the_default_world(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    run = load_run_config(CPU_DEFAULT, ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"])
    assert resolve_topology(run).world_size == 4  # default: tensor x pipeline parallel
    assert resolve_topology(run, 8).parallel.data_parallel == 2
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "12")
    assert resolve_topology(run, 8).world_size == 12  # the launcher's world wins over --nproc
    separate = load_run_config(CPU_DEFAULT, ["rollout.placement=separate", "rollout.engine_ranks=1"])
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert resolve_topology(separate).world_size == 2  # the engine ranks come on top of the training ranks


def test_dynamo_train_refuses_a_layout_before_anything_is_built(tmp_path, capsys, monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    code = main(["train", CPU_DEFAULT, f"trainer.output_dir={out}", "rollout.tensor_parallel=2", "--nproc", "3"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dynamo train: rollout.tensor_parallel=2 does not divide the 3 ranks (every rank hosts one vLLM worker, in "
        "engines of rollout.tensor_parallel ranks)"]
    assert not out.exists()
