"""What a run writes, and when: the checkpoint, evaluation and logging sections of its configuration
(``trainer/config.py`` assembles the whole configuration; ``docs/reference/config.md`` lists every key)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints, each proving itself with a manifest of sizes and SHA-256 sums (``docs/checkpoints.md``).

    Keys:
        every {>= 1}: save every that many steps, and at the end.
        keep_last {>= 1}: how many checkpoints to keep.
        dir: where; null: ``<output_dir>/checkpoints``.
        export_hf: also write the final model in HF format to ``<output_dir>/hf`` through the converter.
    """

    every: int = 50
    keep_last: int = 2
    dir: str | None = None
    export_hf: bool = False

    def validate(self) -> None:
        for name in ("every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EvaluationConfig:
    """Benchmark evaluation during training: after every ``every``-th step and the last one, rank 0 samples ``n``
    responses per problem with the rollout engine and logs ``eval/<benchmark>/pass@k`` and ``eval/avg/pass@k``;
    the samples go to ``<output_dir>/eval/step_<N>/``. Keep it small: the other ranks wait for it, within the
    process-group timeout (30 minutes).

    Keys:
        every {>= 0}: evaluate after every that many steps; 0: off.
        at_start: also before the first step.
        benchmarks: benchmark names (``aime24``, ``aime25``, ``amc23``, ``math500``, ``minerva``, ``olympiadbench``,
            ``reasoning_test``, ``testbed_test``) or JSONL / parquet paths.
        n: samples per problem.
        k: the k of pass@k; each in [1, n].
        limit: the first that many problems of each benchmark; null: all.
        data_dir: where the benchmark files are; null: ``data.data_dir``.
        max_tokens: the longest response; null: ``rollout.max_response_tokens``.
        temperature: null: ``rollout.temperature``.
        top_p: null: ``rollout.top_p``.
        answer_candidates: accept a benchmark's other forms of the answer (Minerva's ``answer_candidates``).
    """

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
    """Weights & Biases, beside TensorBoard and ``metrics.jsonl`` (the same names and steps). A resumed run continues
    the same W&B run; ``online`` and ``offline`` need ``pip install -e ".[wandb]"``.

    Keys:
        project: the W&B project.
        name: the W&B run name; null: the output directory's name.
        mode: ``offline`` writes files under ``<dir>/wandb`` for ``wandb sync``.
        dir: null: the output directory.
    """

    project: str = "megatron_dynamo"
    name: str | None = None
    mode: str = "disabled"
    dir: str | None = None

    def validate(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"mode must be one of {WANDB_MODES}, got {self.mode!r}")


@dataclass(frozen=True)
class LoggingConfig:
    """Where the metrics go: ``<output_dir>/metrics.jsonl`` always (every key in ``docs/metrics.md``), and:

    Keys:
        tensorboard: TensorBoard event files under ``<output_dir>/tensorboard``.
        progress: one line a step on the console (reward, rollouts, ETA), a progress bar too on a terminal.
        plot: ``reward_curve.png`` beside the metrics at the end.
        verbose: the libraries' own logs and warnings too (Megatron, vLLM); false: the run's lines only
            (``library_logs.py`` says what is left out and why).
        rollouts: every response of every step to ``<output_dir>/rollouts.jsonl`` (prompt id, tokens, text, reward).
    """

    tensorboard: bool = True
    progress: bool = True
    plot: bool = True
    verbose: bool = False
    rollouts: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
