"""The catalog of cluster recipes: which YAML, how many 8-GPU nodes, which environment, which site paths.

Nothing here imports nemo-run: ``dynamo launch list/show`` and the plain sbatch scripts work without it.

A training recipe is a YAML file under ``configs/`` (the single source of truth for the run) plus the cluster shape
(nodes x GPUs per node), which a RunConfig has no section for. Site paths are never in the YAML: it names
``checkpoints/<HF name>``, ``data`` and ``outputs/<recipe>`` relative to the code checkout, and the launcher
rebases them onto the site's roots (``--ckpt-root``/``--data-dir``/``--output-root`` or the ``DYNAMO_*``
environment variables) as ordinary ``key=value`` overrides, so the rendered command says exactly what runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from megatron_dynamo.algorithms.baselines import check_algorithm_overrides
from megatron_dynamo.config import ConfigError, apply_overrides, build, load_yaml
from megatron_dynamo.launch.memory_plan import DEFAULT_DEVICE_MEMORY
from megatron_dynamo.parallel.topology import JobTopology, check_at_least_one, check_divides
from megatron_dynamo.trainer.config import ALGORITHMS, RunConfig, load_run_config
from megatron_dynamo.trainer.preflight import check_model_on_layout


# The project checkout (configs/ is not part of the installed package; the launcher needs an editable install or
# to be run from the checkout).
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Recipe:
    name: str
    config: str  # YAML path relative to the project root (and to the job's working directory)
    nodes: int
    gpus_per_node: int = 8
    time: str = "24:00:00"  # one Slurm allocation; the job requeues itself and resumes when it runs out
    description: str = ""
    overrides: tuple[str, ...] = ()  # a variant of the YAML: applied first, before the site's and the user's
    # Bytes of one GPU, for the memory plan (launch/memory_check.py): the cluster's 80 GB GPUs unless a recipe says
    # otherwise; a YAML path gets the same.
    device_memory: int = DEFAULT_DEVICE_MEMORY


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("qwen2.5-math-1.5b", "configs/qwen2.5-math-1.5b.yaml", nodes=1,
           description="Qwen2.5-Math-1.5B, 1 node: TP=1 PP=1 DP=8"),
    Recipe("qwen2.5-math-7b", "configs/qwen2.5-math-7b.yaml", nodes=1,
           description="Qwen2.5-Math-7B, 1 node: TP=4 (SP) PP=1 DP=2"),
    # Generation on a node of its own, one step ahead of the update (docs/rollout.md, "Separate engine ranks"):
    # node 0 trains (TP=4 DP=2, its state alone on each GPU), node 1 runs 4 vLLM engines of TP=2 that keep their
    # GPUs (no sleep: 0.85 of each). The behaviour policy's staleness is corrected token by token (engine_is).
    Recipe("qwen2.5-math-7b-separate", "configs/qwen2.5-math-7b.yaml", nodes=2,
           description="Qwen2.5-Math-7B, 2 nodes: node 0 trains (TP=4 (SP) DP=2), node 1 generates one step ahead",
           overrides=("rollout.placement=separate", "rollout.engine_ranks=8", "rollout.max_staleness=1",
                      "rollout.gpu_memory_utilization=0.85", "dynamo.loss.engine_is=truncate",
                      "trainer.output_dir=outputs/qwen2.5-math-7b-separate")),
    Recipe("qwen3-14b", "configs/qwen3-14b.yaml", nodes=2,
           description="Qwen3-14B, 2 nodes: TP=4 (SP) PP=2 DP=2"),
    Recipe("qwen3-30b-a3b", "configs/qwen3-30b-a3b.yaml", nodes=2,
           description="Qwen3-30B-A3B (MoE, 128 experts), 2 nodes: TP=1 PP=2 EP=8 DP=8"),
)}

# Conversion recipes: name -> `python -m checkpoints_convert` direction. They run on the CPU (the converter hides
# GPUs), one task on one node.
CONVERSIONS: dict[str, str] = {
    "convert-hf-to-megatron": "hf-to-megatron",
    "convert-megatron-to-hf": "megatron-to-hf",
}

# The environment of every training process. scripts/slurm/train.sbatch exports the same (a test checks both).
TRAIN_ENV: dict[str, str] = {
    # Megatron's tensor/sequence-parallel communication overlap relies on kernels running in issue order.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    # Compute nodes are often offline; the trainer reads only local files, so never wait on the hub.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # The reward workers and vLLM fork/spawn after tokenizers are used.
    "TOKENIZERS_PARALLELISM": "false",
    # Megatron's recommendation with NCCL: free communication buffers without recordStream bookkeeping.
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "PYTHONUNBUFFERED": "1",
}

ROOT_ENV = {"ckpt_root": "DYNAMO_CKPT_ROOT", "data_dir": "DYNAMO_DATA_DIR", "output_root": "DYNAMO_OUTPUT_ROOT"}


@dataclass(frozen=True)
class SiteRoots:
    """Where the site keeps HF checkpoints (``<ckpt_root>/<HF name>``), the JSONL data, and run outputs
    (``<output_root>/<recipe>``). None keeps the YAML's relative path."""

    ckpt_root: str | None = None
    data_dir: str | None = None
    output_root: str | None = None

    @classmethod
    def from_env(cls, **given: str | None) -> "SiteRoots":
        """Explicit values win over ``DYNAMO_CKPT_ROOT`` / ``DYNAMO_DATA_DIR`` / ``DYNAMO_OUTPUT_ROOT``."""
        return cls(**{key: given.get(key) or os.environ.get(env) or None for key, env in ROOT_ENV.items()})


def get_recipe(name: str) -> Recipe:
    """A catalog recipe by name, or a YAML file (``configs/cpu_default.yaml``; relative to the current directory
    or the project root) as a recipe of 1 node x 1 GPU named after the file (``--nodes``/``--gpus-per-node``
    change the shape; ``--gpus-per-node 0``: one CPU rank per node)."""
    if name in RECIPES:
        return RECIPES[name]
    if name.endswith((".yaml", ".yml")):
        for path in (Path(name), PROJECT_ROOT / name):
            if path.is_file():
                path = path.resolve()
                config = str(path.relative_to(PROJECT_ROOT)) if path.is_relative_to(PROJECT_ROOT) else str(path)
                return Recipe(Path(name).stem, config, nodes=1, gpus_per_node=1, time="04:00:00",
                              description=f"the YAML {config}")
        raise ConfigError(f"recipe file {name} does not exist")
    raise ConfigError(f"unknown recipe {name!r}; recipes: {', '.join([*RECIPES, *CONVERSIONS])} or a YAML path")


def config_path(recipe: Recipe) -> Path:
    return PROJECT_ROOT / recipe.config


def layout_reasons(recipe: Recipe) -> list[str]:
    """The "Layout:" paragraph of the recipe YAML's header comment and what follows it in that comment (why each
    of nodes, TP, PP, EP and the vLLM engines is what it is), as comment lines; [] when the header has none."""
    header = []
    for line in config_path(recipe).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    start = next((i for i, line in enumerate(header) if line.startswith("# Layout")), len(header))
    return header[start:]


def _rebase(value: str, root: str) -> str:
    """``checkpoints/Qwen3-14B`` on root ``/lustre/models`` -> ``/lustre/models/Qwen3-14B``."""
    return str(PurePosixPath(root) / PurePosixPath(value).name)


def site_overrides(recipe: Recipe, roots: SiteRoots) -> list[str]:
    """The overrides that put the recipe's relative checkpoint / data / output paths under the site's roots."""
    yaml_run = build(RunConfig, apply_overrides(load_yaml(str(config_path(recipe))), list(recipe.overrides)))
    out = []
    if roots.ckpt_root:
        if yaml_run.model.checkpoint:
            out.append(f"model.checkpoint={_rebase(yaml_run.model.checkpoint, roots.ckpt_root)}")
        if yaml_run.model.tokenizer != "char":
            out.append(f"model.tokenizer={_rebase(yaml_run.model.tokenizer, roots.ckpt_root)}")
    if roots.data_dir:
        out.append(f"data.data_dir={roots.data_dir}")
    if roots.output_root:
        out.append(f"trainer.output_dir={_rebase(yaml_run.trainer.output_dir, roots.output_root)}")
    return out


def recipe_overrides(recipe: Recipe, roots: SiteRoots, overrides: list[str] | None = None) -> list[str]:
    """The recipe's own overrides (a variant of its YAML), then the site's, then the user's (a later override of
    the same key wins)."""
    return [*recipe.overrides, *site_overrides(recipe, roots), *(overrides or [])]


def load_recipe(recipe: Recipe, overrides: list[str], algo: str = "dynamo") -> RunConfig:
    """The recipe's RunConfig with overrides, validated as ``dynamo train`` validates it. It stays the recipe's
    config: the entry point applies ``algo`` (the task carries both, so the rendered task shows the recipe)."""
    if algo not in ALGORITHMS:
        raise ConfigError(f"--algo must be one of {ALGORITHMS}, got {algo!r}")
    check_algorithm_overrides(algo, overrides)  # as dynamo train: --algo X and a key X sets, one value or an error
    return load_run_config(str(config_path(recipe)), overrides)


@dataclass(frozen=True)
class Layout:
    """A recipe's job on ``nodes`` x ``gpus_per_node`` GPUs: its topology, and whether TP splits the activations too."""

    nodes: int
    gpus_per_node: int
    topology: JobTopology
    sequence_parallel: bool = False

    @property
    def tensor_parallel(self) -> int:
        return self.topology.parallel.tensor_parallel

    @property
    def pipeline_parallel(self) -> int:
        return self.topology.parallel.pipeline_parallel

    @property
    def data_parallel(self) -> int:
        return self.topology.parallel.data_parallel

    @property
    def expert_groups_within_nodes(self) -> bool:
        """Megatron gives an expert group (expert_parallel x expert_tensor_parallel ranks) consecutive ranks, from 0
        (its rank order tp-cp-ep-dp-pp), so a node holds whole groups when its GPUs are a multiple of the group."""
        p = self.topology.parallel
        return self.gpus_per_node % (p.expert_parallel * p.expert_tensor_parallel) == 0

    def describe(self) -> str:
        sp = " (SP)" if self.sequence_parallel else ""
        top, p, engines = self.topology, self.topology.parallel, self.topology.rollout
        head = (f"{self.nodes} node(s) x {self.gpus_per_node} GPUs = {top.world_size} ranks: TP={p.tensor_parallel}{sp} "
                f"PP={p.pipeline_parallel} CP={p.context_parallel} DP={p.data_parallel}{p.describe_experts()}")
        if p.expert_parallel > 1:
            head += (", each expert group on one node" if self.expert_groups_within_nodes
                     else ", expert groups span nodes (their all-to-all crosses the network)")
        if top.separate:
            return (f"{head} on ranks 0-{p.ranks - 1}; {engines.num_engines} vLLM engine(s) of "
                    f"TP={engines.tensor_parallel} on ranks {top.first_engine_rank}-{top.world_size - 1}")
        return f"{head}; {engines.num_engines} vLLM engine(s) of TP={engines.tensor_parallel}, one worker on every GPU"


def check_layout(run: RunConfig, nodes: int, gpus_per_node: int) -> Layout:
    """The parallel layout on ``nodes`` x ``gpus_per_node`` GPUs, or ConfigError if it does not divide (checked
    before anything is submitted, instead of in every rank after the queue wait)."""
    check_at_least_one("nodes", nodes)
    check_at_least_one("GPUs per node", gpus_per_node)
    topology = JobTopology.resolve(nodes * gpus_per_node, run.parallel, run.rollout)
    if run.model.config is not None and (PROJECT_ROOT / run.model.config).is_file():
        check_model_on_layout(replace(run, model=replace(run.model, config=str(PROJECT_ROOT / run.model.config))))
    tensor_parallel = topology.rollout.tensor_parallel
    check_divides(f"rollout.tensor_parallel={tensor_parallel}", tensor_parallel, f"the {gpus_per_node} GPUs of a node",
                  gpus_per_node, "every GPU hosts a vLLM worker; an engine's ranks share a node")
    if topology.separate:
        check_divides(f"the node size {gpus_per_node}", gpus_per_node, f"rollout.engine_ranks={topology.engine_ranks}",
                      topology.engine_ranks, "a node either trains or generates")
    return Layout(nodes, gpus_per_node, topology, run.parallel.sequence_parallel)


def train_args(recipe: Recipe, overrides: list[str], algo: str = "dynamo") -> list[str]:
    """``python -m megatron_dynamo.cli`` arguments of the same run (what scripts/slurm/train.sbatch launches)."""
    return ["train", recipe.config, *overrides, "--algo", algo, "--resume"]
