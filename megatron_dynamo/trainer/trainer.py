"""The training run: build every stage from a :class:`RunConfig`, warm up, resume, loop over steps, checkpoint,
log. ``dynamo train`` calls :func:`train` in every rank."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dynamo.algorithms.allocation import PromptHistory
from megatron_dynamo.trainer.config import RunConfig
from megatron_dynamo.trainer.sft import set_learning_rate

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """A run cannot go on; the message says why and what was kept."""


class ResumeError(TrainingError):
    """``--resume`` found checkpoints but none intact (``dynamo train`` exits 2: bad input)."""


class TrainingStopped(TrainingError):
    """The run stopped at a step boundary on SIGINT / SIGTERM (``signum``) after ``step``; the message says which
    checkpoint holds it."""

    def __init__(self, message: str, signum: int, step: int):
        super().__init__(message)
        self.signum = signum
        self.step = step


def build_tokenizer(run: RunConfig, output_dir: Path):
    """The run's tokenizer, saved under ``<output_dir>/tokenizer`` (the rollout engine loads it from there)."""
    target = output_dir / "tokenizer"
    if run.model.tokenizer == "char":
        from megatron_dynamo.data.tokenizer import build_char_tokenizer

        return build_char_tokenizer(str(target))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.model.tokenizer)
    tokenizer.save_pretrained(str(target))
    return tokenizer


def _hf_weight_source(path: str | None):
    """A tensor getter for an HF model directory, or None (random init / Megatron checkpoint)."""
    if path is None:
        return None
    from megatron_dynamo.models.checkpoint_io import HFCheckpointReader, is_model_checkpoint

    if is_model_checkpoint(path):
        return None
    return HFCheckpointReader(path).get


class Trainer:
    def __init__(self, run: RunConfig, resume: bool = False):
        from megatron_dynamo.models.qwen import load_hf_config
        from megatron_dynamo.parallel import runtime
        from megatron_dynamo.trainer.checkpoint import list_checkpoints
        from megatron_dynamo.trainer.preflight import resolve_run_models

        try:  # hub ids: their snapshots in the cache, never the network (the launcher's preflight resolved them)
            run = resolve_run_models(run, local_only=True)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
        self.run = run
        self.resume = resume
        self.output_dir = Path(run.trainer.output_dir)
        self.checkpoint_root = Path(run.checkpoint.dir or self.output_dir / "checkpoints")
        if not resume and list_checkpoints(self.checkpoint_root):
            raise TrainingError(f"{self.checkpoint_root} already holds checkpoints of an earlier run: pass --resume "
                                "to continue it, or choose another trainer.output_dir (nothing was overwritten)")
        self.info = runtime.init_distributed(run.parallel, seed=run.trainer.seed)
        self.rank = dist.get_rank()
        self.resume_from = self._verified_resume_checkpoint() if resume else None
        if self.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(asdict(run), indent=2, default=str))
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
        from megatron_dynamo.trainer.checkpoint import NoIntactCheckpoint, resume_checkpoint

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
        from megatron_dynamo.eval.runner import EvalError, build_prompts, load_benchmarks
        from megatron_dynamo.trainer.config import eval_config

        if not (self.run.evaluation.every or self.run.evaluation.at_start):
            return
        config = eval_config(self.run)
        try:
            build_prompts(load_benchmarks(config), config.template, self.tokenizer, self.engine_max_len - 1)
        except (EvalError, OSError, ValueError) as exc:
            raise TrainingError(f"evaluation: {exc}") from None

    # ------------------------------------------------------------------ setup
    def _build(self) -> None:
        from megatron_dynamo.data.dataset import PromptSampler
        from megatron_dynamo.rollout.interface import SamplingConfig
        from megatron_dynamo.trainer.actor import MegatronActor
        from megatron_dynamo.trainer.preflight import load_examples
        from megatron_dynamo.trainer.step import StepRunner

        run = self.run
        if self.hf_config["vocab_size"] < len(self.tokenizer):
            raise TrainingError(f"model vocab_size {self.hf_config['vocab_size']} is smaller than the tokenizer "
                                f"({len(self.tokenizer)} tokens)")
        self.examples = load_examples(run)  # before the model: a data set too small for a step fails first
        if run.data.prompt_overflow == "drop":  # long prompts left out (the launcher's preflight accepted the share)
            from megatron_dynamo.data.prompt_length import fitting_examples, prompt_token_lengths

            self.examples = fitting_examples(self.examples, prompt_token_lengths(self.examples, self.tokenizer,
                                                                                 run.data.template),
                                             run.data.max_prompt_tokens)
        per_round = run.dynamo.sampling.round_prompts(run.data.prompts_per_step)  # prompts_per_step, or a round's
        if len(self.examples) < per_round:
            raise TrainingError(f"data.train has {len(self.examples)} usable prompts, fewer than the {per_round} a "
                                "step draws at once (data.prompts_per_step, x dynamo.sampling.oversample): a step "
                                "never holds a prompt twice")
        self.sampler = PromptSampler(self.examples, seed=run.data.seed)
        hf_weights = _hf_weight_source(run.model.checkpoint)
        self.actor = MegatronActor(self.hf_config, dtype=run.model.dtype, optim=run.optim, hf_weights=hf_weights,
                                   sequence_parallel=run.parallel.sequence_parallel)
        if run.model.checkpoint and hf_weights is None:
            from megatron_dynamo.models.checkpoint_io import load_model_checkpoint

            load_model_checkpoint(self.actor.chunks, run.model.checkpoint)
            self.actor.optimizer.reload_model_params()
        self.history = PromptHistory(decay=run.dynamo.allocation.history_decay)
        eos = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        self.rollout_dtype = torch.bfloat16 if (torch.cuda.is_available() and run.model.dtype == "bf16") else torch.float32
        # Stop where the model's turn ends: the tokenizer's EOS, the model's generation_config.json end tokens (its
        # HF directory, a Megatron checkpoint's hf/, the tokenizer directory) and the template's end of turn.
        from megatron_dynamo.data.stopping import GenerationConfigError, copy_generation_config, stop_token_ids

        model_dirs = [run.model.tokenizer]
        if run.model.checkpoint:
            model_dirs.insert(0, run.model.checkpoint if hf_weights is not None else Path(run.model.checkpoint) / "hf")
        try:
            stop_ids = stop_token_ids(self.tokenizer, run.data.template, model_dirs)
            if self.rank == 0:  # saved checkpoints (hf/) and the exported model carry it from the tokenizer dir
                copy_generation_config(model_dirs, self.output_dir / "tokenizer")
        except (GenerationConfigError, OSError) as exc:
            raise TrainingError(str(exc)) from None
        self.sampling = SamplingConfig(temperature=run.rollout.temperature, top_p=run.rollout.top_p,
                                       max_tokens=run.rollout.max_response_tokens, seed=run.trainer.seed,
                                       stop_token_ids=stop_ids)
        self.engine = self._build_engine()
        self.scorer = None
        if self.engine.layout.is_leader:
            from megatron_dynamo.reward.math_reward import MathRewardScorer, reward_workers_per_scorer

            self.scorer = MathRewardScorer(num_workers=reward_workers_per_scorer(self.engine.layout.tensor_parallel))
        self.runner = StepRunner(run, self.actor, self.engine, self.scorer, self.sampler, self.history,
                                 self.tokenizer, run.data.template, self.sampling, self.pad_token_id,
                                 self.rollout_dtype)

    def _build_engine(self):
        """This rank's part of its rollout engine (every rank hosts a vLLM worker; ``rollout.tensor_parallel``
        consecutive ranks form an engine), started from the run's tokenizer and model config with random weights:
        Megatron's are loaded before the first rollout (no model file is written). Rank 0 writes the directory."""
        from megatron_dynamo.rollout.interface import create_engine

        model_dir = self.output_dir / "rollout_model"
        if self.rank == 0:
            model_dir.mkdir(parents=True, exist_ok=True)
            (model_dir / "config.json").write_text(json.dumps(self.hf_config, indent=2))
            self.tokenizer.save_pretrained(str(model_dir))
        dist.barrier()
        run = self.run
        gpu = torch.cuda.is_available()
        return create_engine(run.rollout.engine, model=str(model_dir),
                             tensor_parallel_size=run.rollout.tensor_parallel,
                             dtype="bfloat16" if self.rollout_dtype == torch.bfloat16 else "float32",
                             max_model_len=self.engine_max_len, seed=run.trainer.seed,
                             gpu_memory_utilization=run.rollout.gpu_memory_utilization,
                             enable_sleep_mode=run.rollout.sleep_during_training and gpu,
                             sleep_level=run.rollout.sleep_level,
                             emulate_sleep=run.rollout.emulate_sleep and not gpu,
                             # Random weights at start: the trainer loads its own before the first rollout.
                             engine_kwargs={"load_format": "dummy"})

    # ------------------------------------------------------------------ phases
    def sft_warmup(self) -> list[float]:
        """Supervised steps before RL (``trainer/sft.py``); returns the losses."""
        from megatron_dynamo.trainer.sft import sft_warmup

        return sft_warmup(self.run, self.examples, self.tokenizer, self.actor, self.runner, self.rank)

    def train(self) -> list[dict[str, Any]]:
        """Run the steps. A stop signal (``parallel.stop_signals``) ends the run at the next step boundary that
        all ranks agree on, with that step's checkpoint saved: :class:`TrainingStopped`."""
        from megatron_dynamo.parallel.stop_signals import agreed_stop_signal
        from megatron_dynamo.rollout.weight_sync import sync_weights
        from megatron_dynamo.trainer.checkpoint import CheckpointSaveError, load_checkpoint
        from megatron_dynamo.trainer.metrics import (MetricsLogger, MetricsLoggerError, format_duration,
                                                     plot_reward_curve)

        run = self.run
        started = time.perf_counter()
        start_step = 0
        latest = self.resume_from
        if self.resume and latest is None and self.rank == 0:
            log.warning("--resume: no checkpoint under %s; starting from scratch", self.checkpoint_root)
        if latest is not None:
            state = load_checkpoint(latest, self.actor.chunks, self.actor.optimizer)
            self._load_trainer_state(state)
            start_step = state["step"]
            if self.rank == 0:
                log.info("--resume: loaded step %d from %s", start_step, latest)
        else:
            self.sft_warmup()
        saved_step = start_step if latest is not None else None
        sync_weights(self.engine, self.actor, dtype=self.rollout_dtype)
        logger = None
        if self.rank == 0:
            try:
                logger = MetricsLogger(str(self.output_dir), run.logging.tensorboard, run.logging.progress,
                                       run.trainer.steps, resume_from=start_step if latest is not None else None,
                                       wandb=run.logging.wandb, verbose=run.logging.verbose,
                                       run_config=json.loads((self.output_dir / "config.json").read_text()))
            except MetricsLoggerError as exc:
                raise TrainingError(str(exc)) from None
        history = []
        try:
            if run.evaluation.at_start and start_step == 0:
                eval_metrics = self.evaluate(0)  # every rank: the problems are split over all engines
                if logger is not None:
                    logger.log(0, eval_metrics)
            if run.trainer.steps == 0 and latest is None:  # the warm-up alone: its model is the run's result
                self.save(0)
            for step in range(start_step + 1, run.trainer.steps + 1):
                signum = agreed_stop_signal()  # every rank, so all stop after the same step
                if signum:
                    self._stop_after(step - 1, signum, start_step, saved_step)
                warmup = run.trainer.warmup_steps
                set_learning_rate(self.actor, run.optim.lr * min(1.0, step / warmup) if warmup else run.optim.lr)
                metrics = self.runner.run_step(step)
                every = run.evaluation.every
                if every and (step % every == 0 or step == run.trainer.steps):
                    metrics.update(self.evaluate(step))
                history.append(metrics)
                if logger is not None:
                    logger.log(step, metrics)
                if step % run.checkpoint.every == 0 or step == run.trainer.steps:
                    try:
                        self.save(step)
                        saved_step = step
                    except CheckpointSaveError as exc:
                        if self.rank == 0:
                            log.error("%s", exc)
                        if step == run.trainer.steps:
                            raise TrainingError(str(exc)) from None
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

    def _stop_after(self, step: int, signum: int, start_step: int, saved_step: int | None):
        """End the run at the boundary after ``step`` (all ranks): save its checkpoint unless it is saved already,
        then raise :class:`TrainingStopped` with a one-line message."""
        from megatron_dynamo.parallel.stop_signals import signal_name
        from megatron_dynamo.trainer.checkpoint import CheckpointSaveError, step_dir_name

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
        """Every rank: the periodic benchmark evaluation on all rollout engines, which hold the weights of ``step``
        (rank 0 writes ``<output_dir>/eval/step_<N>``; a resumed run finishes an interrupted one there)."""
        import time

        from megatron_dynamo.eval.runner import EvalError, evaluate, summary_metrics
        from megatron_dynamo.trainer.checkpoint import step_dir_name
        from megatron_dynamo.trainer.config import eval_config

        start = time.perf_counter()
        config = eval_config(self.run, stop_token_ids=self.sampling.stop_token_ids)
        try:
            # The weights of `step` stay in the engine for the next rollout (a level-2 sleep would discard them).
            with self.runner.engine_awake(keep_weights=True):
                summary = evaluate(self.engine, self.tokenizer, self.scorer, config,
                                   self.output_dir / "eval" / step_dir_name(step), model=f"training step {step}",
                                   max_prompt_tokens=self.engine_max_len - 1, progress="bar")
        except (EvalError, OSError) as exc:
            raise TrainingError(f"evaluation after step {step} failed: {exc}") from None
        metrics = {**summary_metrics(summary), "time/eval": time.perf_counter() - start}
        if self.rank != 0:
            return {}
        log.info("eval after step %d: %s", step, ", ".join(f"{k.removeprefix('eval/avg/')} {v:.3f}"
                                                             for k, v in metrics.items() if k.startswith("eval/avg/")))
        return metrics

    def export_hf(self) -> Path:
        """Convert the latest checkpoint to an HF model directory (``<output_dir>/hf``) with the converter."""
        from megatron_dynamo.models.checkpoint_dirs import latest_checkpoint
        from megatron_dynamo.models.export import export_to_hf

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
        from megatron_dynamo.trainer.checkpoint import rng_state

        return {"history": self.history.state_dict(), "sampler": self.sampler.state_dict(), "rng": rng_state(),
                "config": asdict(self.run)}

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        from megatron_dynamo.trainer.checkpoint import set_rng_state

        self.history.load_state_dict(state["history"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])

    def save(self, step: int) -> Path:
        from megatron_dynamo.trainer.checkpoint import save_checkpoint

        info = self.info
        return save_checkpoint(self.checkpoint_root, step, self.actor.chunks, self.actor.optimizer,
                               self.trainer_state(), self.hf_config, self.run.model.dtype,
                               self.run.checkpoint.keep_last,
                               saved_with={"tp": info.tp_size, "pp": info.pp_size, "dp": info.dp_size},
                               hf_files_from=[self.output_dir / "tokenizer"])

    def close(self) -> None:
        """Stop the reward workers, then the engine: last, since vLLM's shutdown ends the default process group."""
        if getattr(self, "scorer", None) is not None:
            self.scorer.close()
        if getattr(self, "engine", None) is not None:
            self.engine.close()
