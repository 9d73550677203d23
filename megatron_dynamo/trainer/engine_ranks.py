"""The engine ranks of a job whose engines run apart (``rollout.placement: separate``): they only generate and
score. Their default process group holds just them (``parallel/placement.py``): ``rollout.tensor_parallel``
consecutive engine ranks form one vLLM engine, every engine generates its share of each batch, and the first engine
rank hands the scored batch to the trainer ranks. They follow the schedule of ``trainer/overlap.py``: with the
weights of version v they generate every batch up to ``v + rollout.max_staleness + 1``, then wait for the trainer
ranks' next command (new weights, with or without an evaluation, or the end).

Failures: anything that fails on an engine rank becomes one ``ERROR`` message to every trainer rank, naming the
rank, and the same error on every engine rank. No sleep mode: the engines have their devices to themselves.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_dynamo.algorithms.allocation import PromptHistory
from megatron_dynamo.data.dataset import PromptSampler
from megatron_dynamo.models.qwen import load_hf_config
from megatron_dynamo.parallel.stop_signals import agreed_stop_signal
from megatron_dynamo.rollout import channel
from megatron_dynamo.rollout.weight_sync import load_weights_from_trainer_ranks
from megatron_dynamo.trainer.errors import TrainingError
from megatron_dynamo.trainer.overlap import OverlapSchedule
from megatron_dynamo.trainer.preflight import resolve_run_models
from megatron_dynamo.trainer.rollout_producer import RolloutProducer
from megatron_dynamo.trainer.rollout_setup import (build_tokenizer, create_engine, create_scorer, evaluate_on_engines,
                                                   sampling_config, training_examples)
from megatron_dynamo.trainer.step import StageTimer
from megatron_dynamo.trainer.errors import RolloutError, raise_on_any_rank


log = logging.getLogger(__name__)


class EngineRanks:
    """This engine rank's part of the job: its engine, the reward scorer (engine leaders), the data and the prompt
    history (the copy the allocation reads). Built on every engine rank together (collective over them)."""

    def __init__(self, run, groups):
        self.run = resolve_run_models(run, local_only=True)
        self.groups = groups
        self.engine = self.scorer = None
        run = self.run
        self.output_dir = Path(run.trainer.output_dir)
        self.model_dir = self.output_dir / "rollout_model"
        if dist.get_rank() == 0:
            self.model_dir.mkdir(parents=True, exist_ok=True)
            build_tokenizer(run, self.model_dir)
        dist.barrier()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir / "tokenizer"))
        hf_config = load_hf_config(run.model.config_source())
        self.max_model_len = min(hf_config.get("max_position_embeddings", 4096),
                                 run.data.max_prompt_tokens + run.rollout.max_response_tokens)
        self.examples = training_examples(run, self.tokenizer)
        self.sampler = PromptSampler(self.examples, seed=run.data.seed)
        self.history = PromptHistory(decay=run.dynamo.allocation.history_decay)
        self.sampling = sampling_config(run, self.tokenizer)
        self.engine = create_engine(run, self.model_dir, hf_config, self.tokenizer, self.max_model_len,
                                    sleep_mode=False)
        self.scorer = create_scorer(run.reward, self.engine)
        self.producer = RolloutProducer(run, self.examples, self.engine, self.scorer, self.sampler, self.history,
                                        self.tokenizer, self.sampling)

    # ------------------------------------------------------------------ messages to the trainer ranks
    def _send(self, kind: int, *args) -> None:
        """The first engine rank sends; the others have no part in the ``batches`` group."""
        if self.groups.batches is None:
            return
        if kind == channel.BATCH:
            channel.send_batch(self.groups.batches, *args)
        elif kind == channel.EVAL:
            channel.send_eval(self.groups.batches, *args)
        else:
            channel.send_signal(self.groups.batches, kind)

    # ------------------------------------------------------------------ the loop
    def serve(self) -> None:
        """Generate and hand over batches as the trainer ranks' commands say, until ``STOP``."""
        self._send(channel.READY)
        command = channel.receive_control(self.groups.control)
        if command.kind == channel.STOP:
            self._send(channel.DONE)
            return
        self.sampler.load_state_dict(command.state["sampler"])
        self.history.load_state_dict(command.state["history"])
        next_batch = int(command.state["next_batch"])
        while True:
            version = command.version
            schedule = OverlapSchedule(self.run.rollout.max_staleness, command.generate_until)
            self._load_weights(version)
            if command.evaluate:
                self._evaluate(version)
            while next_batch <= schedule.sends_until(version):
                self._produce(next_batch, version)
                next_batch += 1
            command = channel.receive_control(self.groups.control)
            if command.kind == channel.STOP:
                self._send(channel.DONE)
                return

    def _load_weights(self, version: int) -> None:
        failure = None
        try:
            load_weights_from_trainer_ranks(self.engine, self.groups.control)
        except Exception as exc:  # noqa: BLE001 - every engine rank must learn of it
            failure = f"{type(exc).__name__}: {exc}"
        raise_on_any_rank(failure, f"loading the weights of step {version} into the rollout engines failed")

    def _evaluate(self, version: int) -> None:
        failure, metrics = None, {}
        try:
            metrics = evaluate_on_engines(self.run, self.engine, self.tokenizer, self.scorer, self.sampling, version,
                                          self.output_dir, self.max_model_len)
        except (TrainingError, OSError) as exc:
            failure = str(exc)
        raise_on_any_rank(failure, f"the evaluation after step {version} failed")
        self._send(channel.EVAL, version, metrics)

    def _produce(self, step: int, version: int) -> None:
        timer = StageTimer()
        started = time.time()
        batch = self.producer.produce(step, version, timer)
        batch.stop_signal = agreed_stop_signal()
        timer.seconds.pop("advantages", None)  # the history update: the trainer times its own advantages
        metrics: dict[str, Any] = batch.metrics
        metrics.update({f"time/{name}": seconds for name, seconds in timer.seconds.items()})
        metrics["phase/generate"] = [started, time.time()]
        self._send(channel.BATCH, batch)

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        if self.engine is not None:
            self.engine.close()


def serve_engine_ranks(run, groups) -> None:
    """An engine rank's whole life in a separate job: build, serve, and on failure tell the trainer ranks (one
    ``ERROR`` naming this rank, sent by the first engine rank), then raise the error here too."""
    worker = None
    try:
        worker = EngineRanks(run, groups)
        worker.serve()
    except Exception as exc:  # noqa: BLE001 - the trainer ranks wait for a message: they must get this one
        if isinstance(exc, RolloutError):  # raise_on_any_rank named the rank that failed
            text = str(exc)
        elif isinstance(exc, TrainingError):
            text = f"rank {groups.rank}: {exc}"
        else:
            text = f"rank {groups.rank}: {type(exc).__name__}: {exc}"
        if groups.batches is not None:
            try:
                channel.send_error(groups.batches, groups.rank, text)
            except Exception:  # noqa: BLE001 - the trainer ranks are gone: the launcher reports them
                log.debug("could not report the failure to the trainer ranks", exc_info=True)
        raise RolloutError(text) from exc
    finally:
        if worker is not None:
            worker.close()
