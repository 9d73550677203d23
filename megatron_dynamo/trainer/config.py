"""The configuration of a training run: one dataclass per section, loaded by ``megatron_dynamo.config``.

    run = load_run_config("configs/cpu_default.yaml", ["trainer.steps=50"], algo="grpo")

Defaults are the paper's (Table 3 and section 2) where the paper gives a value; ``configs/`` holds the recipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from megatron_dynamo.algorithms.baselines import BASELINES
from megatron_dynamo.algorithms.config import (AllocationConfig, DynamicSamplingConfig, ModulationConfig,
                                               PolicyLossConfig)
from megatron_dynamo.config import ConfigError, apply_overrides, build, load_yaml, validate_tree
from megatron_dynamo.parallel.runtime import ParallelConfig
from megatron_dynamo.trainer.actor import OptimConfig

DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class ModelConfig:
    """The policy. ``checkpoint`` an HF model directory (safetensors), a hub id (``Qwen/Qwen2.5-Math-1.5B``, see
    ``models/hub.py``) or a Megatron checkpoint written by ``checkpoints_convert`` or a training run to start from
    (random initialisation when None); ``config`` an HF config.json (file or directory) giving the architecture,
    taken from the checkpoint when None (its config.json, a Megatron checkpoint's hf/config.json): one of the two is
    needed; ``tokenizer`` a tokenizer directory, a hub id, or "char" for the offline character tokenizer of the
    synthetic task."""

    config: str | None = None
    checkpoint: str | None = None
    tokenizer: str = "char"
    dtype: str = "fp32"

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.config is None and self.checkpoint is None:
            raise ValueError("neither config nor checkpoint is given: set model.checkpoint (an HF model directory, "
                             "hub id or Megatron checkpoint, whose config.json gives the architecture) or model.config "
                             "(an HF config.json, for a model from random weights)")

    def config_source(self) -> str:
        """Where the architecture is read from: ``config``, else the checkpoint's config.json (a Megatron
        checkpoint's ``hf/config.json``). The checkpoint must be a local path here (hub ids resolved first)."""
        if self.config is not None:
            return self.config
        if self.checkpoint is None:
            raise ValueError("model: neither config nor checkpoint is given")
        from megatron_dynamo.models.checkpoint_io import CHECKPOINT_HF_DIR, is_model_checkpoint

        checkpoint = str(Path(self.checkpoint).expanduser())
        return str(Path(checkpoint) / CHECKPOINT_HF_DIR) if is_model_checkpoint(checkpoint) else checkpoint


@dataclass(frozen=True)
class DataConfig:
    """Training prompts: ``train`` is a dataset name (e.g. dapo_math_17k), a JSONL or parquet path (verl's RL
    parquet layout too), or a generated task of ``synthetic_problems`` problems: "synthetic" (the seeded
    arithmetic of the CPU default) or "reasoning" (running sums written out, the ablation testbed's task; its
    held-out split is the benchmark ``reasoning_test``). ``data_dir`` holds local files (``dynamo data prepare
    NAME --out DIR`` writes them). ``sft_problems``: the supervised warm-up's own problems, drawn from the same
    generated task with seed ``seed + 1`` (so the warm-up teaches the task, not the answers of the RL prompts);
    0: the warm-up trains on the RL prompts.
    ``prompts_per_step`` is the generation batch (paper: 512). ``template`` is the prompt template.
    ``prompt_overflow``: what happens to prompts longer than ``max_prompt_tokens`` (``truncate_left``, the paper's;
    ``drop``; ``refuse``), checked before the run starts: more than ``max_overflow_share`` of the training prompts
    cut or dropped stops it (see ``data/prompt_length.py``)."""

    train: str = "dapo_math_17k"
    data_dir: str | None = None
    synthetic_problems: int = 256
    sft_problems: int = 0
    prompts_per_step: int = 512
    template: str = "qwen_math_boxed"
    max_prompt_tokens: int = 2048
    prompt_overflow: str = "truncate_left"
    max_overflow_share: float = 0.05
    seed: int = 0

    def validate(self) -> None:
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        from megatron_dynamo.data.prompt_length import PROMPT_OVERFLOW

        if self.prompt_overflow not in PROMPT_OVERFLOW:
            raise ValueError(f"prompt_overflow must be one of {PROMPT_OVERFLOW}, got {self.prompt_overflow!r}")
        if not 0 <= self.max_overflow_share <= 1:
            raise ValueError(f"max_overflow_share must lie in [0, 1], got {self.max_overflow_share}")
        if self.synthetic_problems < 1:
            raise ValueError(f"synthetic_problems must be >= 1, got {self.synthetic_problems}")
        if self.sft_problems < 0:
            raise ValueError(f"sft_problems must be >= 0 (0: the training prompts), got {self.sft_problems}")
        from megatron_dynamo.data.dataset import GENERATED_TASKS

        if self.sft_problems and self.train not in GENERATED_TASKS:
            raise ValueError(f"sft_problems draws problems from a generated task ({', '.join(GENERATED_TASKS)}); "
                             f"train is {self.train!r}: set sft_problems to 0")


@dataclass(frozen=True)
class RolloutConfig:
    """Generation (paper: vLLM, TP=2, temperature 1.0, top-p 1.0, max response 8192).

    Every rank hosts a vLLM worker; ``tensor_parallel`` consecutive ranks form one engine (it must divide the world
    size), so a job runs world / tensor_parallel engines. ``gpu_memory_utilization``: the fraction of each GPU vLLM
    may take while it generates (weights + KV cache; Megatron's state lives in the rest, or on the host with
    ``offload_training_state``). ``sleep_during_training``: free vLLM's GPU memory between rollouts (vLLM sleep mode
    ``sleep_level`` 2: weights discarded, since every step reloads them; 1: offloaded to host).
    ``offload_training_state``: move Megatron's parameters, gradients and optimizer state to host memory while vLLM
    generates (GPU; for the large recipes). ``emulate_sleep`` (tests; CPU only): the CPU engine behaves as CUDA vLLM
    does in sleep mode: ``sleep_level`` 1 keeps the weights and drops the KV cache, 2 poisons the weights (NaN) until
    the next weight update, so a wake-up alone restores nothing (``rollout/vllm_engine.py``)."""

    engine: str = "vllm"
    tensor_parallel: int = 2
    gpu_memory_utilization: float = 0.5
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_tokens: int = 8192
    sleep_during_training: bool = True
    sleep_level: int = 2
    offload_training_state: bool = False
    emulate_sleep: bool = False

    def validate(self) -> None:
        from megatron_dynamo.rollout.interface import registered_engines

        if self.engine not in registered_engines():
            raise ValueError(f"engine must be one of {registered_engines()}, got {self.engine!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1, got {self.max_response_tokens}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level}")


@dataclass(frozen=True)
class DynamoConfig:
    """DynaMO's parts: dynamic rollout allocation (sequence level), advantage modulation (token level), the
    policy loss, and the group advantage estimator. ``algo: grpo`` switches allocation and modulation off.
    ``sampling``: DAPO's dynamic sampling (off by default; with DRA or without)."""

    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    modulation: ModulationConfig = field(default_factory=ModulationConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    advantage_estimator: str = "grpo"
    normalize_advantage_std: bool = True
    token_stats_chunk: int | None = None

    def validate(self) -> None:
        from megatron_dynamo.algorithms.advantages import registered_advantage_estimators
        from megatron_dynamo.algorithms.losses import registered_policy_losses

        if self.advantage_estimator not in registered_advantage_estimators():
            raise ValueError(f"advantage_estimator {self.advantage_estimator!r} is not registered "
                             f"(registered: {list(registered_advantage_estimators())})")
        if self.loss.name not in registered_policy_losses():
            raise ValueError(f"loss.name {self.loss.name!r} is not a registered policy loss "
                             f"(registered: {list(registered_policy_losses())})")
        from megatron_dynamo.algorithms.prompt_weights import HOMOGENEOUS_LOSSES

        if self.loss.prompt_weight != "rollouts" and (self.loss.name not in HOMOGENEOUS_LOSSES
                                                      or self.loss.entropy_coef != 0):
            raise ValueError(f"loss.prompt_weight {self.loss.prompt_weight} weights each token's advantage, which "
                             f"weights the loss only for {', '.join(HOMOGENEOUS_LOSSES)} with entropy_coef 0; got "
                             f"loss.name {self.loss.name}, entropy_coef {self.loss.entropy_coef}")
        if self.loss.name == "fork_tokens" and self.loss.loss_agg_mode != "token-mean":
            raise ValueError("loss.name fork_tokens needs loss.loss_agg_mode token-mean (its source's token mean "
                             "over the selected tokens)")
        # The paper trains with kl_coef 0; the trainer has no reference model for the KL term yet. (entropy_coef
        # works: the vocab-parallel routine differentiates the entropy.)
        if self.loss.kl_coef != 0:
            raise ValueError("loss.kl_coef must be 0 in this trainer (no reference model); the paper uses 0")
        if self.token_stats_chunk is not None and self.token_stats_chunk < 1:
            raise ValueError(f"token_stats_chunk must be None or >= 1, got {self.token_stats_chunk}")


# "auto": packed (no padding) where the layer spec has variable-length attention (Transformer Engine, THD);
# true: also on the local spec (one row per micro-batch, block-diagonal causal mask); false: padded rows.
PACK_SEQUENCES = ("auto", True, False)


@dataclass(frozen=True)
class TrainerConfig:
    """The loop. ``mini_batch_prompts`` prompts (with all their responses) make one optimizer step (paper: PPO
    mini-batch 32 of a generation batch of 512); ``micro_batch_size`` sequences go through the model at once;
    ``ppo_epochs`` passes over the rollout. ``sft_warmup_steps`` supervised steps on the reference answers (a
    task's worked solution where it has one) come first, ``sft_batch_size`` sequences each (used by the synthetic
    CPU tasks so that rewards are not all 0); ``steps: 0`` runs only that warm-up and saves it as checkpoint step 0
    (``dynamo ablate`` starts every variant of a seed from it). ``warmup_steps`` is the learning-rate warm-up
    (paper: 10)."""

    steps: int = 100
    mini_batch_prompts: int = 32
    micro_batch_size: int = 8
    ppo_epochs: int = 1
    warmup_steps: int = 10
    micro_batch_tokens: int = 0
    pack_sequences: bool | str = "auto"
    fused_output_layer: bool = True
    sft_warmup_steps: int = 0
    sft_batch_size: int = 64
    sft_lr: float = 1e-3
    seed: int = 1234
    output_dir: str = "outputs/run"

    def validate(self) -> None:
        for name in ("mini_batch_prompts", "micro_batch_size", "ppo_epochs", "sft_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "warmup_steps", "sft_warmup_steps", "micro_batch_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.pack_sequences not in PACK_SEQUENCES:
            raise ValueError(f"pack_sequences must be one of {PACK_SEQUENCES}, got {self.pack_sequences!r}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints every ``every`` steps and at the end, keeping the last ``keep_last``, under
    ``<output_dir>/checkpoints`` (or ``dir``); ``export_hf`` also writes the final model in HF format to
    ``<output_dir>/hf`` with the checkpoint converter."""

    every: int = 50
    keep_last: int = 2
    dir: str | None = None
    export_hf: bool = False

    def validate(self) -> None:
        if self.every < 1 or self.keep_last < 1:
            raise ValueError("every and keep_last must be >= 1")


@dataclass(frozen=True)
class EvaluationConfig:
    """Benchmark evaluation during training (off while ``every`` is 0): after every ``every``-th step and the
    last one (and before the first with ``at_start``), rank 0 samples ``n`` responses per problem of
    ``benchmarks`` with the rollout engine, which holds the weights just trained, and logs
    ``eval/<benchmark>/pass@k`` and ``eval/avg/pass@k`` with that step's metrics; the samples go to
    ``<output_dir>/eval/step_<N>/``. Sampling defaults to the rollout's (``null``); prompts use
    ``data.template``. Keep it small (a subset, ``limit``): the other ranks wait for it in the next step's first
    collective, within the process-group timeout (30 minutes)."""

    every: int = 0
    at_start: bool = False
    benchmarks: tuple[str, ...] = ("aime24", "amc23", "math500")
    n: int = 4
    k: tuple[int, ...] = (4,)
    limit: int | None = None
    data_dir: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    answer_candidates: bool = True

    def validate(self) -> None:
        if self.every < 0:
            raise ValueError(f"every must be >= 0 (0: off), got {self.every}")


WANDB_MODES = ("disabled", "online", "offline")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases, next to TensorBoard and ``metrics.jsonl`` (rank 0; the same metric names and steps; the
    run's ``config.json`` as the W&B config). ``mode``: ``disabled`` (default), ``online`` or ``offline`` (files
    under ``<dir>/wandb``, ``wandb sync`` uploads them later); anything else needs ``pip install -e ".[wandb]"``.
    ``name``: the W&B run name (default: the output directory's name); ``dir`` default: the output directory. A
    resumed run (``--resume``) continues the same W&B run."""

    project: str = "megatron_dynamo"
    name: str | None = None
    mode: str = "disabled"
    dir: str | None = None

    def validate(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"mode must be one of {WANDB_MODES}, got {self.mode!r}")


@dataclass(frozen=True)
class LoggingConfig:
    """Metrics go to ``<output_dir>/metrics.jsonl`` (every key: ``docs/metrics.md``), TensorBoard
    (``tensorboard``), W&B (``wandb``) and, with ``progress``, the console: one summary line per step with the ETA
    (and a progress bar on a terminal); ``plot`` writes ``reward_curve.png`` next to the metrics at the end.
    ``verbose``: the libraries' own logs and warnings too (Megatron, vLLM); off, the console shows the run's lines
    only (see ``megatron_dynamo/library_logs.py`` for what is left out and why). ``rollouts``: also write every
    response of every step to ``<output_dir>/rollouts.jsonl`` (prompt id, sample index, token ids, text, reward)."""

    tensorboard: bool = True
    progress: bool = True
    plot: bool = True
    verbose: bool = False
    rollouts: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    dynamo: DynamoConfig = field(default_factory=DynamoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        if self.data.prompts_per_step % self.trainer.mini_batch_prompts:
            raise ValueError(f"data.prompts_per_step ({self.data.prompts_per_step}) must be a multiple of "
                             f"trainer.mini_batch_prompts ({self.trainer.mini_batch_prompts})")
        if self.evaluation.every or self.evaluation.at_start:
            try:
                eval_config(self).validate()
            except (ValueError, KeyError) as exc:
                raise ValueError(f"evaluation: {exc}") from None


def eval_config(run: RunConfig, stop_token_ids: tuple[int, ...] = ()):
    """The :class:`~megatron_dynamo.eval.runner.EvalConfig` of the run's periodic evaluation: its own settings,
    the rollout's sampling where it leaves them open, the training prompt template and data directory."""
    from megatron_dynamo.eval.runner import EvalConfig

    ev = run.evaluation
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return EvalConfig(benchmarks=ev.benchmarks, n=ev.n, k=ev.k, limit=ev.limit,
                      data_dir=pick(ev.data_dir, run.data.data_dir),
                      max_tokens=pick(ev.max_tokens, run.rollout.max_response_tokens),
                      temperature=pick(ev.temperature, run.rollout.temperature),
                      top_p=pick(ev.top_p, run.rollout.top_p), template=run.data.template,
                      seed=run.trainer.seed, answer_candidates=ev.answer_candidates, stop_token_ids=stop_token_ids)


#: --algo names: DynaMO, GRPO and the seven baselines of the paper's Table 1 (algorithms/baselines.py).
ALGORITHMS = ("dynamo", "grpo", *BASELINES)


def with_algorithm(run: RunConfig, algo: str) -> RunConfig:
    """``dynamo``: the config as given. ``grpo``: allocation and both modulation factors off (plain GRPO). A
    baseline name: GRPO plus that baseline's changes (``algorithms.baselines.BASELINES``), over the recipe's
    values."""
    if algo not in ALGORITHMS:
        raise ConfigError(f"--algo must be one of {ALGORITHMS}, got {algo!r}")
    if algo == "dynamo":
        return run
    dynamo = replace(run.dynamo, allocation=replace(run.dynamo.allocation, enabled=False),
                     modulation=replace(run.dynamo.modulation, gc=False, ums=False))
    if algo in BASELINES:
        changes = dict(BASELINES[algo])
        dynamo = replace(dynamo, loss=replace(dynamo.loss, **changes.pop("loss", {})), **changes)
    return replace(run, dynamo=dynamo)


def load_run_config(path: str | None, overrides: list[str] | None = None, algo: str = "dynamo") -> RunConfig:
    """Read a YAML recipe (or the defaults when ``path`` is None), apply overrides and --algo, validate all."""
    values = load_yaml(path) if path else {}
    run = with_algorithm(build(RunConfig, apply_overrides(values, overrides or [])), algo)
    validate_tree(run)
    return run
