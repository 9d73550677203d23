"""What the rollout side of a run is built from, for the ranks that generate: every rank of a colocated job, or the
engine ranks of a job whose engines run apart (``trainer/engine_ranks.py``). The training prompts, the sampling
parameters with the model's stop tokens, the vLLM engine, the reward scorer, and the periodic evaluation on the
engines."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from megatron_dynamo.data.prompt_length import fitting_examples, prompt_token_lengths
from megatron_dynamo.data.stopping import GenerationConfigError, copy_generation_config, stop_token_ids
from megatron_dynamo.eval.runner import EvalError, evaluate, summary_metrics
from megatron_dynamo.models.checkpoint_dirs import step_dir_name
from megatron_dynamo.models.checkpoint_io import HFCheckpointReader, is_model_checkpoint
from megatron_dynamo.reward.math_reward import MathRewardScorer, reward_workers_per_scorer
from megatron_dynamo.rollout.interface import SamplingConfig, create_engine as create
from megatron_dynamo.rollout.kv_cache import kv_cache_size
from megatron_dynamo.trainer.config import eval_config
from megatron_dynamo.trainer.errors import TrainingError
from megatron_dynamo.trainer.preflight import load_examples


log = logging.getLogger(__name__)


def build_tokenizer(run, output_dir: Path):
    """The run's tokenizer, saved under ``<output_dir>/tokenizer`` (the rollout engine loads it from there)."""
    target = output_dir / "tokenizer"
    # Here, not at the top: data.tokenizer imports transformers (~0.9 s), and `dynamo --help` imports this module.
    from megatron_dynamo.data.tokenizer import build_char_tokenizer
    from transformers import AutoTokenizer

    if run.model.tokenizer == "char":
        return build_char_tokenizer(str(target))

    tokenizer = AutoTokenizer.from_pretrained(run.model.tokenizer)
    tokenizer.save_pretrained(str(target))
    return tokenizer


def hf_weight_source(path: str | None):
    """A tensor getter for an HF model directory, or None (random init / Megatron checkpoint)."""
    if path is None:
        return None

    if is_model_checkpoint(path):
        return None
    return HFCheckpointReader(path).get


def training_examples(run, tokenizer) -> list:
    """The run's training prompts (long ones left out under ``data.prompt_overflow: drop``); refuses a data set
    smaller than one step (one round of dynamic sampling)."""
    examples = load_examples(run)
    if run.data.prompt_overflow == "drop":  # long prompts left out (the launcher's preflight accepted the share)

        examples = fitting_examples(examples, prompt_token_lengths(examples, tokenizer, run.data.template),
                                    run.data.max_prompt_tokens)
    per_round = run.dynamo.sampling.round_prompts(run.data.prompts_per_step)  # prompts_per_step, or a round's
    if len(examples) < per_round:
        raise TrainingError(f"data.train has {len(examples)} usable prompts, fewer than the {per_round} a step draws "
                            "at once (data.prompts_per_step, x dynamo.sampling.oversample): a step never holds a "
                            "prompt twice")
    return examples


def sampling_config(run, tokenizer, generation_config_to: Path | None = None):
    """The rollout's sampling parameters. Responses stop where the model's turn ends: the tokenizer's EOS, the
    model's generation_config.json end tokens (its HF directory, a Megatron checkpoint's hf/, the tokenizer
    directory) and the template's end of turn. ``generation_config_to``: copy the generation config there (saved
    checkpoints and the exported model carry it from the tokenizer directory). ``moe.routing_replay: rollout``
    asks the engine for the experts it routed each token to."""
    model_dirs = [run.model.tokenizer]
    if run.model.checkpoint:  # an HF directory, or a Megatron checkpoint with its hf/
        checkpoint = run.model.checkpoint
        model_dirs.insert(0, Path(checkpoint) / "hf" if is_model_checkpoint(checkpoint) else checkpoint)
    try:
        stop_ids = stop_token_ids(tokenizer, run.data.template, model_dirs)
        if generation_config_to is not None:
            copy_generation_config(model_dirs, generation_config_to)
    except (GenerationConfigError, OSError) as exc:
        raise TrainingError(str(exc)) from None
    return SamplingConfig(temperature=run.rollout.temperature, top_p=run.rollout.top_p,
                          max_tokens=run.rollout.max_response_tokens, min_tokens=run.rollout.min_response_tokens,
                          seed=run.trainer.seed, stop_token_ids=stop_ids,
                          routed_experts=run.moe.routing_replay == "rollout")


def rollout_dtype(run) -> torch.dtype:
    return torch.bfloat16 if (torch.cuda.is_available() and run.model.dtype == "bf16") else torch.float32


def create_engine(run, model_dir: Path, hf_config: dict[str, Any], tokenizer, max_model_len: int,
                  sleep_mode: bool):
    """This rank's part of its rollout engine (``rollout.tensor_parallel`` consecutive ranks of the default process
    group form one), started from the run's tokenizer and model config with random weights: the trainer's are
    loaded before the first rollout (no model file is written). The default group's rank 0 writes ``model_dir``.
    ``sleep_mode``: the engine sleeps while the trainer updates (colocated engines)."""
    if dist.get_rank() == 0:
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
        tokenizer.save_pretrained(str(model_dir))
    dist.barrier()
    gpu = torch.cuda.is_available()
    dtype = rollout_dtype(run)
    return create(run.rollout.engine, model=str(model_dir), tensor_parallel=run.rollout.tensor_parallel,
                  dtype="bfloat16" if dtype == torch.bfloat16 else "float32", max_model_len=max_model_len,
                  seed=run.trainer.seed, gpu_memory_utilization=run.rollout.gpu_memory_utilization,
                  enable_sleep_mode=sleep_mode and run.rollout.sleep_during_training and gpu,
                  sleep_level=run.rollout.sleep_level,
                  emulate_sleep=sleep_mode and run.rollout.emulate_sleep and not gpu,
                  **kv_cache_size(run, hf_config, max_model_len, gpu),
                  # routing replay from the rollout: on a GPU, vLLM's own routed-experts output (built in)
                  routed_experts=run.moe.routing_replay == "rollout" and gpu,
                  # Random weights at start: the trainer loads its own before the first rollout.
                  engine_kwargs={"load_format": "dummy"})


def create_scorer(reward, engine):
    """The reward scorer of an engine leader (None on the engine's other ranks), with the ``reward`` section's
    limits."""
    if not engine.layout.is_leader:
        return None
    return MathRewardScorer(reward_workers_per_scorer(engine.layout.tensor_parallel), reward.timeout_seconds,
                            max_batch_seconds=reward.batch_seconds or None, worker_memory_mb=reward.worker_memory_mb)


def evaluate_on_engines(run, engine, tokenizer, scorer, sampling, step: int, output_dir: Path, max_model_len: int,
                        awake: Callable[[], ContextManager] = contextlib.nullcontext) -> dict[str, float]:
    """Collective over the engines' ranks: the periodic benchmark evaluation of the engines' current weights (those
    of ``step``); rank 0 of the group writes ``<output_dir>/eval/step_<N>`` (a resumed run finishes an interrupted
    one there) and gets the metrics, the others ``{}``."""
    start = time.perf_counter()
    config = eval_config(run, stop_token_ids=sampling.stop_token_ids)
    try:
        with awake():
            summary = evaluate(engine, tokenizer, scorer, config, output_dir / "eval" / step_dir_name(step),
                               model=f"training step {step}", max_prompt_tokens=max_model_len - 1, progress="bar")
    except (EvalError, OSError) as exc:
        raise TrainingError(f"evaluation after step {step} failed: {exc}") from None
    metrics = {**summary_metrics(summary), "time/eval": time.perf_counter() - start}
    if dist.get_rank() != 0:
        return {}
    log.info("eval after step %d: %s", step, ", ".join(f"{k.removeprefix('eval/avg/')} {v:.3f}"
                                                         for k, v in metrics.items() if k.startswith("eval/avg/")))
    return metrics
