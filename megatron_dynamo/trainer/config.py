"""The configuration of a training run: one dataclass per section, loaded by ``megatron_dynamo.config``.

    run = load_run_config("configs/cpu_default.yaml", ["trainer.steps=50"], algo="grpo")

Defaults are the paper's (Table 3 and section 2) where the paper gives a value; ``configs/`` holds the recipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from megatron_dynamo.algorithms.advantages import registered_advantage_estimators
from megatron_dynamo.algorithms.baselines import BASELINES, algorithm_keys, check_algorithm_overrides
from megatron_dynamo.algorithms.config import (AllocationConfig, DynamicSamplingConfig, ModulationConfig,
                                               PolicyLossConfig)
from megatron_dynamo.algorithms.losses import registered_policy_losses
from megatron_dynamo.algorithms.prompt_weights import HOMOGENEOUS_LOSSES
from megatron_dynamo.config import ConfigError, apply_overrides, build, load_yaml, validate_tree
from megatron_dynamo.data.dataset import GENERATED_TASKS
from megatron_dynamo.data.prompt_length import PROMPT_OVERFLOW
from megatron_dynamo.data.templates import list_templates
from megatron_dynamo.eval.runner import EvalConfig
from megatron_dynamo.models.checkpoint_io import CHECKPOINT_HF_DIR, is_model_checkpoint
from megatron_dynamo.models.qwen import RECOMPUTE_MODES
from megatron_dynamo.models.qwen_moe import MoEConfig
from megatron_dynamo.parallel.runtime import ParallelConfig
from megatron_dynamo.parallel.topology import check_at_least_one, check_placement
from megatron_dynamo.rollout.interface import registered_engines
from megatron_dynamo.trainer.actor import OptimConfig
from megatron_dynamo.trainer.outputs import CheckpointConfig, EvaluationConfig, LoggingConfig
from megatron_dynamo.trainer.old_logprobs import OLD_LOGPROB_PASSES

DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class ModelConfig:
    """The policy: its architecture, its weights and its tokenizer. One of ``config`` and ``checkpoint`` is needed.

    Keys:
        config: an HF config.json (file or directory) giving the architecture; null: the checkpoint's own
            (a Megatron checkpoint's ``hf/config.json``).
        checkpoint: the weights to start from: an HF model directory (safetensors), a hub id such as
            ``Qwen/Qwen2.5-Math-1.5B`` (``models/hub.py``), or a Megatron checkpoint written by ``checkpoints_convert``
            or a training run; null: random weights.
        tokenizer: a tokenizer directory, a hub id, or ``char``, the offline character tokenizer of the generated
            CPU tasks.
        dtype: the training precision.
    """

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

        checkpoint = str(Path(self.checkpoint).expanduser())
        return str(Path(checkpoint) / CHECKPOINT_HF_DIR) if is_model_checkpoint(checkpoint) else checkpoint


@dataclass(frozen=True)
class DataConfig:
    """Training prompts (paper: 512 a step from DAPO-Math-17k). Dataset names are looked up in ``data_dir``, else
    ``$MEGATRON_DYNAMO_DATA_DIR``, else ``data/``, where ``dynamo data prepare`` writes.

    Keys:
        train: a dataset name (``dynamo data list``), a JSONL or parquet file (verl's RL layout too), or a generated
            task: ``synthetic`` (the CPU default's arithmetic), ``reasoning`` (the ablation testbed's running sums;
            held-out benchmark ``reasoning_test``) or ``testbed`` (the mechanism testbed; ``testbed_test``).
        data_dir: the directory of local dataset files (``dynamo data prepare NAME --out DIR`` writes them).
        synthetic_problems {>= 1}: the number of problems of a generated task.
        sft_problems {>= 0}: the supervised warm-up's own problems, drawn from the same generated task with seed
            ``seed + 1`` (it teaches the task, not the answers of the RL prompts); 0: it trains on the RL prompts.
        prompts_per_step {>= 1}: prompts a step (the generation batch); a multiple of ``trainer.mini_batch_prompts``.
        template: the prompt template (``data/templates.py``).
        max_prompt_tokens {>= 1}: the longest prompt, in tokens, before ``prompt_overflow`` applies.
        prompt_overflow: what happens to a longer prompt: cut from the left (the paper's), dropped, or the run refused;
            checked before the run starts (``data/prompt_length.py``).
        max_overflow_share {[0, 1]}: the largest share of training prompts that may be cut or dropped; more stops
            the run.
        seed: the seed of the prompt order and of the generated tasks.
    """

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
        if self.template not in list_templates():
            raise ValueError(f"template must be one of {list_templates()}, got {self.template!r}")
        if self.prompt_overflow not in PROMPT_OVERFLOW:
            raise ValueError(f"prompt_overflow must be one of {PROMPT_OVERFLOW}, got {self.prompt_overflow!r}")
        if not 0 <= self.max_overflow_share <= 1:
            raise ValueError(f"max_overflow_share must lie in [0, 1], got {self.max_overflow_share}")
        if self.synthetic_problems < 1:
            raise ValueError(f"synthetic_problems must be >= 1, got {self.synthetic_problems}")
        if self.sft_problems < 0:
            raise ValueError(f"sft_problems must be >= 0 (0: the training prompts), got {self.sft_problems}")
        if self.sft_problems and self.train not in GENERATED_TASKS:
            raise ValueError(f"sft_problems draws problems from a generated task ({', '.join(GENERATED_TASKS)}); "
                             f"train is {self.train!r}: set sft_problems to 0")


@dataclass(frozen=True)
class RolloutConfig:
    """Generation (paper: vLLM, TP=2, temperature 1.0, top-p 1.0, responses of up to 8192 tokens). Every rank hosts a
    vLLM worker; ``tensor_parallel`` consecutive ranks form one engine, so a job runs world / tensor_parallel engines.

    Keys:
        engine: the rollout engine (``rollout/interface.py`` registers them).
        tensor_parallel {>= 1}: ranks per vLLM engine; must divide the number of ranks.
        gpu_memory_utilization {(0, 1]}: the share of each GPU that vLLM may take while it generates (weights and
            KV cache); Megatron's state lives in the rest, or on the host with ``offload_training_state``.
        temperature {> 0}: the sampling temperature (log-probabilities and entropies use the same one).
        top_p {(0, 1]}: nucleus sampling's probability mass.
        max_response_tokens {>= 1}: the longest response, in tokens.
        min_response_tokens {>= 0}: no end of turn (EOS or a stop token) before that many tokens (vLLM's
            ``min_tokens``); at most ``max_response_tokens`` (benchmarks set both: every response that long).
        sleep_during_training: free vLLM's GPU memory between rollouts (vLLM's sleep mode).
        sleep_level: 2: the weights are dropped while asleep (every step reloads them); 1: offloaded to the host.
        offload_training_state: move Megatron's parameters, gradients and optimizer state to host memory while vLLM
            generates (GPU; for the large recipes).
        emulate_sleep: tests, CPU only: the CPU engine sleeps as CUDA vLLM does (level 1 keeps the weights and drops
            the KV cache, level 2 poisons the weights until the next weight update).
        placement: colocated: every rank trains and hosts a vLLM worker, the stages of a step
            run in turn; separate: the last ``engine_ranks`` ranks only generate and score, the others only train
            (on a cluster, whole nodes), generation overlapping the update (docs/rollout.md).
        engine_ranks {>= 0}: with ``placement: separate``, the ranks that only generate (>= 1, a multiple of
            ``tensor_parallel``); 0 when colocated.
        max_staleness {>= 0}: with ``placement: separate``, K: batch b is generated by the weights of step
            max(0, b - 1 - K), so the engines generate while the trainer updates; 0 is on-policy.
        cpu_kvcache_gb {> 0}: the CPU engine's KV cache in GiB; null (the default): what a step needs, from the model's
            layers and KV heads, the engine's max_model_len and the step's rollout budget, at least 16 MiB.
    """

    engine: str = "vllm"
    tensor_parallel: int = 2
    gpu_memory_utilization: float = 0.5
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_tokens: int = 8192
    min_response_tokens: int = 0
    sleep_during_training: bool = True
    sleep_level: int = 2
    offload_training_state: bool = False
    emulate_sleep: bool = False
    placement: str = "colocated"
    engine_ranks: int = 0
    max_staleness: int = 0
    cpu_kvcache_gb: float | None = None

    def validate(self) -> None:
        check_at_least_one("rollout.tensor_parallel", self.tensor_parallel)
        check_placement(self.placement, self.engine_ranks, self.max_staleness, self.tensor_parallel)
        if self.engine not in registered_engines():
            raise ValueError(f"engine must be one of {registered_engines()}, got {self.engine!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1, got {self.max_response_tokens}")
        if not 0 <= self.min_response_tokens <= self.max_response_tokens:
            raise ValueError(f"min_response_tokens must lie in [0, max_response_tokens ({self.max_response_tokens})], "
                             f"got {self.min_response_tokens}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.cpu_kvcache_gb is not None and not self.cpu_kvcache_gb > 0:
            raise ValueError(f"cpu_kvcache_gb must be > 0 (null: sized to the run), got {self.cpu_kvcache_gb}")


@dataclass(frozen=True)
class DynamoConfig:
    """DynaMO's parts (``docs/algorithm.md``): rollout allocation, advantage modulation, the policy loss and the group
    advantage estimator; beside them DAPO's dynamic sampling (``sampling``, off by default; with DRA or without).
    ``--algo grpo`` switches allocation and modulation off.

    Keys:
        advantage_estimator: how rewards become advantages (``algorithms/advantages.py`` registers them).
        normalize_advantage_std: divide by the group's standard deviation (GRPO); false: centre only.
        token_stats_chunk {>= 1}: tokens per chunk of the vocab-parallel log-prob / entropy routine; null: automatic.
    """

    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    modulation: ModulationConfig = field(default_factory=ModulationConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    advantage_estimator: str = "grpo"
    normalize_advantage_std: bool = True
    token_stats_chunk: int | None = None

    def validate(self) -> None:
        if self.advantage_estimator not in registered_advantage_estimators():
            raise ValueError(f"advantage_estimator {self.advantage_estimator!r} is not registered "
                             f"(registered: {list(registered_advantage_estimators())})")
        if self.loss.name not in registered_policy_losses():
            raise ValueError(f"loss.name {self.loss.name!r} is not a registered policy loss "
                             f"(registered: {list(registered_policy_losses())})")
        if self.loss.prompt_weight != "rollouts" and (self.loss.name not in HOMOGENEOUS_LOSSES
                                                      or self.loss.entropy_coef != 0):
            # The weight multiplies each token's advantage, which weights its loss only where the loss is
            # homogeneous in the advantage.
            raise ValueError(f"loss.prompt_weight must be rollouts unless loss.name is one of "
                             f"{', '.join(HOMOGENEOUS_LOSSES)} with loss.entropy_coef 0, got {self.loss.prompt_weight} "
                             f"with loss.name {self.loss.name}, entropy_coef {self.loss.entropy_coef}")
        if self.loss.name == "fork_tokens" and self.loss.loss_agg_mode != "token-mean":
            raise ValueError("loss.name fork_tokens needs loss.loss_agg_mode token-mean (its source's token mean "
                             "over the selected tokens)")
        # The paper trains with kl_coef 0; the trainer has no reference model for the KL term yet. (entropy_coef
        # works: the vocab-parallel routine differentiates the entropy.)
        if self.loss.kl_coef != 0:
            raise ValueError("loss.kl_coef must be 0 in this trainer (no reference model); the paper uses 0")
        if self.token_stats_chunk is not None and self.token_stats_chunk < 1:
            raise ValueError(f"token_stats_chunk must be None or >= 1, got {self.token_stats_chunk}")


PACK_SEQUENCES = ("auto", True, False)  # TrainerConfig's docstring says what each means


@dataclass(frozen=True)
class TrainerConfig:
    """The training loop (paper: PPO mini-batches of 32 prompts out of 512 a step, 10 warm-up steps).

    Keys:
        steps {>= 0}: RL steps; 0 runs only the supervised warm-up and saves it as checkpoint step 0 (``dynamo ablate``
            starts every variant of a seed from it).
        mini_batch_prompts {>= 1}: prompts (with all their responses) a PPO mini-batch, i.e. an optimizer step.
        micro_batch_size {>= 1}: sequences that go through the model at once (when ``micro_batch_tokens`` is 0).
        ppo_epochs {>= 1}: passes over a step's responses.
        warmup_steps {>= 0}: the learning rate's linear warm-up, in optimizer steps.
        micro_batch_tokens {>= 0}: 0: ``micro_batch_size`` sequences a micro-batch; > 0: micro-batches of at most
            that many tokens, the samples balanced over the data-parallel ranks by tokens.
        pack_sequences: ``auto``: packed without padding on the Transformer Engine spec, padded on the local spec
            (where packing means full attention under a block-diagonal mask, slower on CPU); true: packed on both;
            false: padded. The layout changes neither the loss nor the gradients.
        fused_output_layer: compute log-probs, entropy and Delta H inside the output layer, chunk by chunk, without
            the full logits (``docs/update.md``); false: the unfused layer, for comparison.
        sft_warmup_steps {>= 0}: supervised steps on worked solutions or reference answers before RL (the generated CPU
            tasks use it so that rewards are not all 0).
        sft_batch_size {>= 1}: sequences a supervised warm-up step.
        sft_lr: the supervised warm-up's learning rate.
        seed: the seed of sampling, initialisation and the baselines' token selection.
        old_logprob_pass: auto leaves the old-log-prob forward out where the update's own forward
            gives the same numbers (one mini-batch, one epoch, no modulation or mini-batch token selection:
            ``trainer/old_logprobs.py``); always runs it every step.
        recompute: activations rerun in the backward instead of kept: off; selective: the attention's scores and
            softmax; full: each layer from its input (least memory, about one more forward; ``docs/update.md``).
        output_dir: where metrics, checkpoints and plots go; a new run needs a new one (give each ``--algo`` its
            own: ``trainer.output_dir=outputs/cpu_default-grpo``).
    """

    steps: int = 100
    mini_batch_prompts: int = 32
    micro_batch_size: int = 8
    ppo_epochs: int = 1
    warmup_steps: int = 10
    micro_batch_tokens: int = 0
    pack_sequences: bool | str = "auto"
    fused_output_layer: bool = True
    old_logprob_pass: str = "auto"
    recompute: str = "off"
    sft_warmup_steps: int = 0
    sft_batch_size: int = 64
    sft_lr: float = 1e-3
    seed: int = 1234
    output_dir: str = "outputs/run"

    def validate(self) -> None:
        for names, least in ((("mini_batch_prompts", "micro_batch_size", "ppo_epochs", "sft_batch_size"), 1),
                             (("steps", "warmup_steps", "sft_warmup_steps", "micro_batch_tokens"), 0)):
            for name in (name for name in names if getattr(self, name) < least):
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        for name, allowed in (("pack_sequences", PACK_SEQUENCES), ("old_logprob_pass", OLD_LOGPROB_PASSES),
                              ("recompute", RECOMPUTE_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RewardConfig:
    """math-verify scoring of the responses (``reward/math_reward.py``), in worker processes of each engine leader.

    Keys:
        timeout_seconds {>= 1}: math-verify's own limit per answer (a worker past twice that + 2 s is killed and
            replaced).
        batch_seconds {>= 0}: the time budget for scoring one step's responses on one leader: the answers not scored
            when it runs out get reward 0 (reason ``timeout``) and are counted in ``reward/over_budget``; 0: no budget.
        worker_memory_mb {>= 0}: how much each worker may grow beyond its start-up size before an allocation fails
            (the answer is an ``error``, the worker goes on); 0: no limit.
    """

    timeout_seconds: int = 5
    batch_seconds: float = 600.0
    worker_memory_mb: int = 2048

    def validate(self) -> None:
        if self.timeout_seconds < 1:
            raise ValueError(f"timeout_seconds must be >= 1, got {self.timeout_seconds}")
        if self.batch_seconds < 0:
            raise ValueError(f"batch_seconds must be >= 0 (0: no budget), got {self.batch_seconds}")
        if self.worker_memory_mb < 0:
            raise ValueError(f"worker_memory_mb must be >= 0 (0: no limit), got {self.worker_memory_mb}")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    dynamo: DynamoConfig = field(default_factory=DynamoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
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
    """``run`` with the keys ``--algo algo`` sets (``algorithms.baselines.algorithm_keys``: none for ``dynamo``;
    allocation and both modulation factors off for ``grpo`` and every baseline, plus the baseline's own)."""
    if algo not in ALGORITHMS:
        raise ConfigError(f"--algo must be one of {ALGORITHMS}, got {algo!r}")
    for key, value in algorithm_keys(algo).items():
        run = _with_key(run, key.split("."), value)
    return run


def _with_key(section, path: list[str], value):
    """A copy of the frozen dataclass ``section`` with the dotted key ``path`` set to ``value``."""
    head, *rest = path
    return replace(section, **{head: _with_key(getattr(section, head), rest, value) if rest else value})


def load_run_config(path: str | None, overrides: list[str] | None = None, algo: str = "dynamo") -> RunConfig:
    """Read a YAML recipe (or the defaults when ``path`` is None), apply overrides and --algo, validate all."""
    values = load_yaml(path) if path else {}
    run = with_algorithm(build(RunConfig, apply_overrides(values, overrides or [])), algo)
    check_algorithm_overrides(algo, overrides or [])  # --algo X and a key X sets: one value, or an error
    validate_tree(run)
    return run
