"""The training run: build every stage from a :class:`RunConfig`, warm up, resume, loop over steps, checkpoint,
log. ``dynamo train`` calls :func:`train` in every rank."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_dynamo.algorithms.allocation import PromptHistory
from megatron_dynamo.data.dataset import PromptSampler
from megatron_dynamo.eval.runner import EvalError, build_prompts, load_benchmarks
from megatron_dynamo.trainer.provenance import write_run_provenance, write_saved_warmup
from megatron_dynamo.models.checkpoint_dirs import latest_checkpoint
from megatron_dynamo.models.export import export_to_hf
from megatron_dynamo.models.qwen import load_hf_config, recompute_kwargs
from megatron_dynamo.parallel import runtime
from megatron_dynamo.parallel.stop_signals import agreed_stop_signal, signal_name
from megatron_dynamo.rollout.weight_sync import sync_weights
from megatron_dynamo.trainer.actor import MegatronActor
from megatron_dynamo.trainer.checkpoint import (CheckpointSaveError, NoIntactCheckpoint, list_checkpoints,
                                                load_checkpoint, load_in_flight, load_start_checkpoint,
                                                resume_checkpoint, rng_state, save_checkpoint, set_rng_state,
                                                step_dir_name)
from megatron_dynamo.trainer.config import RunConfig, eval_config
# The run's errors and the rollout side's builders live beside it; importable from here too.
from megatron_dynamo.trainer.errors import ResumeError, TrainingError, TrainingStopped  # noqa: F401
from megatron_dynamo.trainer.metrics import (MetricsLogger, MetricsLoggerError, StartupClock, format_duration,
                                             plot_reward_curve)
from megatron_dynamo.trainer.overlap import RemoteRollout, check_in_flight
from megatron_dynamo.trainer.preflight import resolve_run_models
from megatron_dynamo.trainer.rollout_producer import RolloutProducer
from megatron_dynamo.trainer.rollout_setup import (build_tokenizer, create_engine, create_scorer,  # noqa: F401
                                                   evaluate_on_engines, hf_weight_source, rollout_dtype,
                                                   sampling_config, training_examples)
from megatron_dynamo.trainer.sft import set_learning_rate, sft_warmup
from megatron_dynamo.trainer.step import StepRunner

log = logging.getLogger(__name__)


class Trainer:
    """One training rank's run. ``groups``: this rank's place in a job whose engines run on ranks of their own
    (``parallel.placement.join_job``; None: colocated engines, one in every rank)."""

    def __init__(self, run: RunConfig, resume: bool = False, groups=None):
        self.startup = StartupClock()
        try:  # hub ids: their snapshots in the cache, never the network (the launcher's preflight resolved them)
            run = resolve_run_models(run, local_only=True)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
        self.run = run
        self.resume = resume
        self.groups = groups
        self.source = None  # where the steps' rollouts come from (set by train())
        self.output_dir = Path(run.trainer.output_dir)
        self.checkpoint_root = Path(run.checkpoint.dir or self.output_dir / "checkpoints")
        if not resume and list_checkpoints(self.checkpoint_root):
            raise TrainingError(f"{self.checkpoint_root} already holds checkpoints of an earlier run: pass --resume "
                                "to continue it, or choose another trainer.output_dir (nothing was overwritten)")
        with self.startup.phase("distributed"):  # torch.distributed, Megatron's parallel state (and its import)
            self.info = runtime.init_distributed(run.parallel, seed=run.trainer.seed)
        self.rank = dist.get_rank()
        self.resume_from = self._verified_resume_checkpoint() if resume else None
        if self.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(asdict(run), indent=2, default=str))
            # where the numbers come from, recorded by the run itself as it starts (results are bit-identical on
            # one machine only): the machine and the hash of the warm-up it starts from
            write_run_provenance(self.output_dir, run.model.checkpoint, resumed=resume)
            self.tokenizer = build_tokenizer(run, self.output_dir)
        dist.barrier()
        if self.rank != 0:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.output_dir / "tokenizer"))
        self.hf_config = load_hf_config(run.model.config_source())  # model.config, else the checkpoint's
        self.engine_max_len = min(self.hf_config.get("max_position_embeddings", 4096),
                                  run.data.max_prompt_tokens + run.rollout.max_response_tokens)
        self._check_evaluation()
        self._build()

    def _verified_resume_checkpoint(self) -> Path | None:
        """``--resume``: the newest intact checkpoint (every rank checks its own files against the manifest), before
        anything is built or written; each damaged one skipped is named in one line."""
        try:
            path, lines = resume_checkpoint(self.checkpoint_root)
        except NoIntactCheckpoint as exc:
            raise ResumeError(str(exc)) from None
        if self.rank == 0:
            for line in lines:
                log.warning("%s", line)
        return path

    def _check_evaluation(self) -> None:
        """Read the periodic evaluation's benchmarks and measure their prompts now (every rank, so all fail
        alike), not after hours of training."""
        if not (self.run.evaluation.every or self.run.evaluation.at_start):
            return
        config = eval_config(self.run)
        try:
            build_prompts(load_benchmarks(config), config.template, self.tokenizer, self.engine_max_len - 1)
        except (EvalError, OSError, ValueError) as exc:
            raise TrainingError(f"evaluation: {exc}") from None

    # ------------------------------------------------------------------ setup
    def _build(self) -> None:
        run = self.run
        if self.hf_config["vocab_size"] < len(self.tokenizer):
            raise TrainingError(f"model vocab_size {self.hf_config['vocab_size']} is smaller than the tokenizer "
                                f"({len(self.tokenizer)} tokens)")
        self.examples = training_examples(run, self.tokenizer)  # before the model: too few prompts fail first
        self.sampler = PromptSampler(self.examples, seed=run.data.seed)
        hf_weights = hf_weight_source(run.model.checkpoint)
        with self.startup.phase("model"):
            self.actor = MegatronActor(self.hf_config, dtype=run.model.dtype, optim=run.optim, hf_weights=hf_weights,
                                       sequence_parallel=run.parallel.sequence_parallel, moe=run.moe,
                                       **recompute_kwargs(run.trainer.recompute))
        if run.model.checkpoint and hf_weights is None:  # a Megatron checkpoint: verified, then loaded
            try:
                load_start_checkpoint(run.model.checkpoint, self.actor.chunks)
            except NoIntactCheckpoint as exc:
                raise ResumeError(str(exc)) from None
            self.actor.optimizer.reload_model_params()
        self.history = PromptHistory(decay=run.dynamo.allocation.history_decay)
        eos = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        self.rollout_dtype = rollout_dtype(run)
        self.sampling = sampling_config(run, self.tokenizer,
                                        self.output_dir / "tokenizer" if self.rank == 0 else None)
        self.engine = self.scorer = producer = None
        if self.groups is None:  # colocated: this rank hosts its part of an engine
            with self.startup.phase("engine"):
                self.engine = create_engine(run, self.output_dir / "rollout_model", self.hf_config, self.tokenizer,
                                            self.engine_max_len, sleep_mode=True)
            self.scorer = create_scorer(run.reward, self.engine)
            producer = RolloutProducer(run, self.examples, self.engine, self.scorer, self.sampler, self.history,
                                       self.tokenizer, self.sampling)
        self.runner = StepRunner(run, self.actor, self.pad_token_id, self.rollout_dtype, examples=self.examples,
                                 tokenizer=self.tokenizer, engine=self.engine, producer=producer)

    # ------------------------------------------------------------------ phases
    def sft_warmup(self) -> list[float]:
        """Supervised steps before RL (``trainer/sft.py``); returns the losses."""
        return sft_warmup(self.run, self.examples, self.tokenizer, self.actor, self.runner.updater, self.rank)

    def train(self) -> list[dict[str, Any]]:
        """Run the steps. A stop signal (``parallel.stop_signals``) ends the run at the next step boundary that
        all ranks agree on, with that step's checkpoint saved: :class:`TrainingStopped`."""
        run = self.run
        started = time.perf_counter()
        with self.startup.phase("warmup"):  # the supervised warm-up, or the checkpoint of --resume
            start_step, in_flight = self._resume_or_warm_up()
        resumed = self.resume_from is not None
        self.source = self._rollout_source()
        logger = self._metrics_logger(start_step if resumed else None) if self.rank == 0 else None
        try:
            history = self._run_steps(start_step, in_flight, logger)
        finally:
            if logger is not None:
                logger.close()
        if self.rank == 0 and run.logging.plot:
            plot_reward_curve(str(self.output_dir / "metrics.jsonl"))
        if self.rank == 0 and run.checkpoint.export_hf:
            self.export_hf()
        if self.rank == 0:
            log.info("done: %d steps in %s -> %s", run.trainer.steps - start_step,
                     format_duration(time.perf_counter() - started), self.output_dir)
        return history

    def _resume_or_warm_up(self) -> tuple[int, list]:
        """The step to start after and the batches in flight then: those of ``--resume``'s checkpoint, else step 0
        after the supervised warm-up."""
        latest = self.resume_from
        if self.resume and latest is None and self.rank == 0:
            log.warning("--resume: no checkpoint under %s; starting from scratch", self.checkpoint_root)
        if latest is None:
            self.sft_warmup()
            return 0, []
        state = load_checkpoint(latest, self.actor.chunks, self.actor.optimizer)
        self._load_trainer_state(state)
        start_step = state["step"]
        in_flight = load_in_flight(latest)
        check_in_flight(in_flight, start_step, self.run)
        if self.rank == 0:
            log.info("--resume: loaded step %d from %s", start_step, latest)
        return start_step, in_flight

    def _metrics_logger(self, resume_from: int | None) -> MetricsLogger:
        run = self.run
        try:
            return MetricsLogger(str(self.output_dir), run.logging.tensorboard, run.logging.progress,
                                 run.trainer.steps, resume_from=resume_from, wandb=run.logging.wandb,
                                 verbose=run.logging.verbose,
                                 run_config=json.loads((self.output_dir / "config.json").read_text()))
        except MetricsLoggerError as exc:
            raise TrainingError(str(exc)) from None

    def _run_steps(self, start_step: int, in_flight: list, logger: MetricsLogger | None) -> list[dict[str, Any]]:
        """The steps after ``start_step``, each logged and checkpointed on schedule; the rollout source closed at
        the end, or at the step boundary where the run stops."""
        run = self.run
        saved_step = start_step if self.resume_from is not None else None
        history = []
        try:
            # Every rank: the problems of an evaluation are split over all engines.
            with self.startup.phase("first_sync"):
                eval_metrics = self.source.start(start_step, in_flight, run.evaluation.at_start and start_step == 0)
            startup = self.startup.metrics()
            if eval_metrics and logger is not None:
                logger.log(0, eval_metrics)
            if run.trainer.steps == 0 and self.resume_from is None:  # the warm-up alone: its model is the result
                saved = self.save(0)
                if self.rank == 0:
                    write_saved_warmup(self.output_dir, saved)
            for step in range(start_step + 1, run.trainer.steps + 1):
                signum = self.source.stop_signal()  # every rank, so all stop after the same step
                if signum:
                    self._stop_after(step - 1, signum, start_step, saved_step)
                warmup = run.trainer.warmup_steps
                set_learning_rate(self.actor, run.optim.lr * min(1.0, step / warmup) if warmup else run.optim.lr)
                every = run.evaluation.every
                metrics = self.source.step(step, bool(every) and (step % every == 0 or step == run.trainer.steps))
                if step == start_step + 1:
                    metrics.update(startup)
                history.append(metrics)
                if logger is not None:
                    logger.log(step, metrics)
                if step % run.checkpoint.every == 0 or step == run.trainer.steps:
                    self._save_or_stop(step)
                    saved_step = step
            self.source.close()
        except TrainingStopped:
            self.source.close()  # at a step boundary: the engines wait for a command, so they can be told
            raise
        return history

    def _save_or_stop(self, step: int) -> None:
        """A scheduled checkpoint; a failed save stops the run: the steps after it could not be saved either."""
        try:
            self.save(step)
        except CheckpointSaveError as exc:
            self.source.close()  # at a step boundary: the engines wait for a command
            raise TrainingError(f"{exc}; the run stops (--resume continues from there)") from None

    def _rollout_source(self):
        """Where the step's rollout comes from: this job's colocated engines, or the engine ranks (``groups``)."""
        if self.groups is None:
            return ColocatedRollout(self)
        return RemoteRollout(self.groups, self.run, self.runner, self.actor, self.history, self.sampler,
                             self.rollout_dtype)

    def _stop_after(self, step: int, signum: int, start_step: int, saved_step: int | None):
        """End the run at the boundary after ``step`` (all ranks): save its checkpoint unless it is saved already,
        then raise :class:`TrainingStopped` with a one-line message."""
        name = signal_name(signum)
        resume = "run the same command with --resume to continue"
        if step == start_step:
            if saved_step is None:
                raise TrainingStopped(f"stopped by {name} before step {step + 1}: no step was finished, nothing was "
                                      "saved", signum, step)
            raise TrainingStopped(f"stopped by {name} before step {step + 1}: the latest checkpoint is still step "
                                  f"{step} ({self.checkpoint_root / step_dir_name(step)}); {resume}", signum, step)
        if saved_step != step:
            try:
                self.save(step)
            except CheckpointSaveError as exc:
                kept = (f"the latest checkpoint is step {saved_step}" if saved_step is not None
                        else "no checkpoint was saved")
                raise TrainingError(f"stopped by {name} after step {step}, but its checkpoint could not be saved "
                                    f"({exc}); {kept}") from None
        raise TrainingStopped(f"stopped by {name} after step {step}: its checkpoint is saved "
                              f"({self.checkpoint_root / step_dir_name(step)}); {resume}", signum, step)

    def evaluate(self, step: int) -> dict[str, float]:
        """Every rank of a colocated job: the periodic benchmark evaluation on all rollout engines, which hold the
        weights of ``step`` (rank 0 writes ``<output_dir>/eval/step_<N>`` and gets the metrics)."""
        from functools import partial

        # The weights of `step` stay in the engine for the next rollout (a level-2 sleep would discard them).
        return evaluate_on_engines(self.run, self.engine, self.tokenizer, self.scorer, self.sampling, step,
                                   self.output_dir, self.engine_max_len,
                                   awake=partial(self.runner.engine_awake, keep_weights=True))

    def export_hf(self) -> Path:
        """Convert the latest checkpoint to an HF model directory (``<output_dir>/hf``) with the converter."""
        source = latest_checkpoint(self.checkpoint_root)
        target = self.output_dir / "hf"
        try:
            export_to_hf(source, target, tokenizer_dir=self.output_dir / "tokenizer")
        except RuntimeError as exc:
            raise TrainingError(str(exc)) from None
        log.info("exported %s -> %s", source.name, target)
        return target

    # ------------------------------------------------------------------ state
    def trainer_state(self) -> dict[str, Any]:
        return {"history": self.history.state_dict(), "sampler": self.sampler.state_dict(), "rng": rng_state(),
                "config": asdict(self.run)}

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        self.history.load_state_dict(state["history"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])

    def save(self, step: int) -> Path:
        info = self.info
        in_flight = self.source.in_flight(step) if self.source is not None else []
        return save_checkpoint(self.checkpoint_root, step, self.actor.chunks, self.actor.optimizer,
                               self.trainer_state(), self.hf_config, self.run.model.dtype,
                               self.run.checkpoint.keep_last,
                               saved_with={"tp": info.tp_size, "pp": info.pp_size, "dp": info.dp_size},
                               hf_files_from=[self.output_dir / "tokenizer"], in_flight=in_flight)

    def close(self) -> None:
        """Stop the reward workers, then the engine: last, since vLLM's shutdown ends the default process group."""
        if getattr(self, "scorer", None) is not None:
            self.scorer.close()
        if getattr(self, "engine", None) is not None:
            self.engine.close()


class ColocatedRollout:
    """The rollout of a colocated job: every rank generates its engine's share of each step with the weights just
    synced, so the steps run stage after stage (``StepRunner.run_step``)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def start(self, start_step: int, in_flight: list, evaluate: bool) -> dict[str, Any]:
        """The trainer's weights into the engines; ``evaluate``: evaluate them (metrics on rank 0)."""
        trainer = self.trainer
        sync_weights(trainer.engine, trainer.actor, dtype=trainer.rollout_dtype)
        return trainer.evaluate(0) if evaluate else {}

    def stop_signal(self) -> int:
        return agreed_stop_signal()

    def step(self, step: int, evaluate: bool) -> dict[str, Any]:
        metrics = self.trainer.runner.run_step(step)
        if evaluate:
            metrics.update(self.trainer.evaluate(step))
        return metrics

    def in_flight(self, step: int) -> list:
        return []

    def close(self) -> None:
        pass
