"""One DynaMO step's update, stage by stage, each timed (``docs/algorithm.md``, "One training step"):

    [rollout stages: data -> allocation -> rollout -> reward -> exchange -> history, in rounds with dynamic
     sampling]   (trainer/rollout_producer.py, trainer/step_sampling.py)
    -> advantages and prompt weights -> old log-probs -> PPO mini-batch updates with modulation -> weight sync

Every training rank runs this (SPMD). The scored rollout reaches it whole, in one canonical order, from the engines
of this job's ranks (colocated: :meth:`StepRunner.run_step` produces it here first) or from engine ranks of their
own (``rollout.placement: separate``, ``trainer/overlap.py``). Everything after is computed identically on every
rank from the same data, except the model work, which each rank does on its data-parallel share and its
pipeline/tensor shard.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynamo.algorithms.advantages import get_advantage_estimator
from megatron_dynamo.algorithms.prompt_weights import prompt_weights
from megatron_dynamo.rollout.weight_sync import sync_weights
from megatron_dynamo.trainer.batch import Sample
from megatron_dynamo.trainer.errors import raise_on_any_rank
from megatron_dynamo.trainer.metrics import append_step_rows, prompt_rows, rollout_rows, solved_fraction
from megatron_dynamo.trainer.offload import HostOffload, training_state_tensors
from megatron_dynamo.trainer.update import PolicyUpdater


@dataclass
class StageTimer:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


class StepRunner:
    """Trains on a step's scored rollout (:meth:`train_on_batch`) and, where the engines share the training ranks,
    runs whole steps (:meth:`run_step`). Built by :class:`megatron_dynamo.trainer.trainer.Trainer`.

    ``examples``: the run's example list (a batch names its prompts by index into it); ``engine``: this rank's
    part of its colocated engine (None where the engines run on ranks of their own); ``producer``: the rollout
    stages of a colocated run (``trainer/rollout_producer.py``)."""

    def __init__(self, run, actor, pad_token_id: int, rollout_dtype: torch.dtype, *, examples=(), tokenizer=None,
                 engine=None, producer=None):
        self.run = run
        self.actor = actor
        self.pad_token_id = pad_token_id
        self.rollout_dtype = rollout_dtype
        self.examples = examples
        self.tokenizer = tokenizer
        self.engine = engine
        self.producer = producer
        if producer is not None:
            producer.awake = self.engine_awake
        self.updater = PolicyUpdater(run, actor, pad_token_id)
        self._logs_started: set[str] = set()  # the first step logged to a file drops that file's later rows

    @contextmanager
    def engine_awake(self, keep_weights: bool = False):
        """The engine awake for a generation phase (rollout, evaluation), asleep again after it when
        ``rollout.sleep_during_training`` and the engine has a sleep mode (vLLM's CPU backend has none: nothing to
        free, so nothing is called). With ``rollout.offload_training_state`` Megatron's state sits in host memory
        meanwhile (collected anew each time: Adam's moments appear at the first step), and comes back even after a
        failure (a checkpoint may still be written). No sleep after a failure: a dead engine cannot sleep.

        ``keep_weights``: the next generation uses the engine's weights as they are, no weight update comes first
        (an evaluation: the next phase is a rollout or the end of the run). A level-2 sleep would discard them and
        the next ``wake_up`` restores nothing (CUDA vLLM; ``rollout.emulate_sleep`` on CPU), so the engine stays
        awake: no training runs before the next rollout, only a checkpoint save, and it moves no weight bytes
        (a level-1 sleep would copy the weights to host memory and back, a re-sync would gather them from
        Megatron again). With ``offload_training_state`` the training state comes back to the GPU and may not fit
        beside the awake engine: there it sleeps at level 1 (weights kept in host memory)."""
        sleeping = self.run.rollout.sleep_during_training and getattr(self.engine, "sleep_mode", True)
        offload = None
        if self.run.rollout.offload_training_state:
            offload = HostOffload(training_state_tensors(self.actor.chunks, self.actor.optimizer))
            offload.offload()
        try:
            if sleeping:
                self.engine.wake_up()
            yield
            if sleeping and not keep_weights:
                self.engine.sleep()
            elif sleeping and self.run.rollout.offload_training_state:
                self.engine.sleep(level=1)
        finally:
            if offload is not None:
                offload.reload()

    def run_step(self, step: int) -> dict[str, Any]:
        """A colocated step: the rollout on this job's engines (with the weights of step ``step - 1``), the update
        on it, and the new weights into the engines."""
        timer = StageTimer()
        start = time.perf_counter()
        batch = self.producer.produce(step, step - 1, timer)
        metrics = self.train_on_batch(batch, timer)
        with timer("weight_sync"):
            metrics.update(self._sync_weights(step))
        metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
        metrics["step_seconds"] = time.perf_counter() - start
        return metrics

    def train_on_batch(self, batch, timer: StageTimer) -> dict[str, Any]:
        """Advantages, the per-prompt logs and the update of one scored rollout (a
        :class:`~megatron_dynamo.rollout.rollout_batch.RolloutBatch`); returns the step's metrics (the caller adds
        the stage times)."""
        run = self.run
        rank = dist.get_rank()
        examples = [self.examples[i] for i in batch.example_indices]
        prompt_ids = [ex.id for ex in examples]
        rollout = batch.responses
        responses = [(prompt_ids[p], batch.prompt_tokens[p], toks) for p, toks in zip(rollout.prompt_index,
                                                                                     rollout.token_ids)]
        rewards = rollout.rewards
        with timer("advantages"):
            response_ids = [pid for pid, _, _ in responses]
            estimator = get_advantage_estimator(run.dynamo.advantage_estimator)
            advantages = estimator(torch.tensor(rewards, dtype=torch.float64), response_ids,
                                   normalize_std=run.dynamo.normalize_advantage_std)
            weights = prompt_weights(response_ids, run.dynamo.loss.prompt_weight)
            routed = rollout.routed_experts or [None] * len(responses)  # the engine's (moe.routing_replay: rollout)
            # one conversion each, not one per sample (an estimator may return any sequence of numbers)
            advantages, weights = torch.as_tensor(advantages, dtype=torch.float64).tolist(), weights.tolist()
            samples = [Sample(i, pid, tuple(ptoks), tuple(rtoks), rewards[i], advantages[i],
                              engine_logp=rollout.logprobs[i], loss_weight=weights[i], routed_experts=routed[i])
                       for i, (pid, ptoks, rtoks) in enumerate(responses) if len(rtoks) > 0]
        if rank == 0:
            self._append_rows("prompts.jsonl", batch.step,
                              prompt_rows(batch.step, prompt_ids, batch.counts, response_ids, rewards))
            if run.logging.rollouts:
                rows = rollout_rows(batch.step, responses, rewards, self.tokenizer.decode)
                self._append_rows("rollouts.jsonl", batch.step, rows)
        update_metrics = self.update(samples, prompt_ids, timer, batch.step)
        counts = np.asarray(batch.counts, dtype=np.int64)
        reward_metrics = dict(batch.metrics)
        prompts_truncated = reward_metrics.pop("data/prompts_truncated", 0)
        return {
            "reward_mean": float(batch.reward_mean),  # every generated response (dynamic sampling: every round's)
            "rollouts": int(batch.rollouts),
            "rollouts_trained": int(counts.sum()),
            "alloc_min": int(counts.min()) if counts.size else 0,
            "alloc_max": int(counts.max()) if counts.size else 0,
            "variance_ratio": float(batch.variance_ratio),
            "alloc_counts": [int(c) for c in counts],
            "reward/prompts_solved_frac": solved_fraction(response_ids, rewards),
            "data/prompts_truncated": prompts_truncated,
            **update_metrics,
            **reward_metrics,
        }

    def _append_rows(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        """Rank 0: ``rows`` of ``step`` appended to ``<output_dir>/<name>``. The first step this runner writes there
        first drops the file's rows of that step and later (a resumed run's steps after its checkpoint, or an
        earlier run's rows in the same directory)."""
        append_step_rows(os.path.join(self.run.trainer.output_dir, name), rows,
                         drop_from_step=None if name in self._logs_started else step)
        self._logs_started.add(name)

    def update(self, samples: list[Sample], prompt_order: list[str], timer: StageTimer, step: int) -> dict[str, Any]:
        """The RL update of step ``step`` (``trainer/update.py``, :meth:`PolicyUpdater.update`)."""
        return self.updater.update(samples, prompt_order, timer, step)

    def _sync_weights(self, step: int) -> dict[str, float]:
        """Collective: the new weights into every rank's engine. A failure on any rank (which keeps relaying its
        part of the gather, so no rank hangs) becomes a :class:`RolloutError` on every rank."""
        stats, failure = None, None
        try:
            stats = sync_weights(self.engine, self.actor, dtype=self.rollout_dtype)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            failure = f"{type(exc).__name__}: {exc}"
        raise_on_any_rank(failure, f"step {step}: loading the new weights into the rollout engines failed")
        return stats.as_metrics()
