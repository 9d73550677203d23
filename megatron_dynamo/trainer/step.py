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

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynamo.algorithms.advantages import get_advantage_estimator
from megatron_dynamo.algorithms.modulation import modulation_scope
from megatron_dynamo.algorithms.prompt_weights import prompt_weights
from megatron_dynamo.trainer.batch import (Sample, build_micro_batches, gather_token_values, make_micro_batches,
                                           plan_token_micro_batches, resolve_pack_sequences, shard_for_rank,
                                           split_mini_batches)
from megatron_dynamo.trainer.old_logprobs import (entropies_from_update, old_entropies, old_logprob_pass,
                                                  old_policy_metrics, update_gives_old_logprobs)
from megatron_dynamo.trainer.policy_loss import dynamo_loss_fn, scope_inputs, token_stats_fn
from megatron_dynamo.trainer.step_metrics import (RolloutError, collect_metric_sums,  # noqa: F401 (step.RolloutError)
                                                  global_denominator, is_metric_rank, parallel_state, prompt_rows,
                                                  raise_on_any_rank, reduce_scope_gaps, rollout_rows,
                                                  scatter_engine_logprobs, solved_fraction,
                                                  sum_scope_gaps)
from megatron_dynamo.trainer.token_selection import scatter_selections


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
        self.current_step = 0  # seeds the baselines' random token selection (trainer/token_selection.py)
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
        from megatron_dynamo.trainer.offload import HostOffload, training_state_tensors

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
            samples = [Sample(i, pid, tuple(ptoks), tuple(rtoks), rewards[i], float(advantages[i]),
                              engine_logp=rollout.logprobs[i], loss_weight=float(weights[i]))
                       for i, (pid, ptoks, rtoks) in enumerate(responses) if len(rtoks) > 0]
        if rank == 0:
            self._append_rows("prompts.jsonl", batch.step,
                              prompt_rows(batch.step, prompt_ids, batch.counts, response_ids, rewards))
            if run.logging.rollouts:
                rows = rollout_rows(batch.step, responses, rewards, self.tokenizer.decode)
                self._append_rows("rollouts.jsonl", batch.step, rows)
        self.current_step = batch.step
        update_metrics = self.update(samples, prompt_ids, timer)
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
        from megatron_dynamo.trainer.metrics import append_step_rows

        append_step_rows(os.path.join(self.run.trainer.output_dir, name), rows,
                         drop_from_step=None if name in self._logs_started else step)
        self._logs_started.add(name)

    # ------------------------------------------------------------------ model work
    def micro_batches_for(self, samples: list[Sample]):
        """This data-parallel rank's share of ``samples`` (one optimizer step's worth) as micro-batches on the
        model's device. Every DP rank gets the same number of micro-batches (the largest share decides), so that
        the ranks of a data-parallel group run matching schedules; a rank with no sample gets empty ones.

        ``trainer.micro_batch_tokens`` > 0: micro-batches of at most that many tokens, the samples balanced over
        the DP ranks by tokens (``batch.plan_token_micro_batches``, the same plan on every rank); else
        ``micro_batch_size`` sequences each. ``trainer.pack_sequences``: sequences packed into one row without
        padding (``batch.packed_micro_batch``) or padded rows. The layout changes neither the loss nor the
        gradients: every micro-batch's loss is divided by the mini-batch's global denominator."""
        ps = parallel_state()
        trainer = self.run.trainer
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        packed = resolve_pack_sequences(trainer.pack_sequences, getattr(self.actor, "use_te", False))
        seq_multiple = self.actor.sequence_multiple
        # Only pipeline stages need every micro-batch to have the same shape; padding rows costs compute.
        fixed_shape = ps.get_pipeline_model_parallel_world_size() > 1
        if trainer.micro_batch_tokens > 0:
            groups = plan_token_micro_batches(samples, dp, trainer.micro_batch_tokens, packed=packed,
                                              seq_multiple=seq_multiple, fixed_shape=fixed_shape)[dp_rank]
            return build_micro_batches(groups, self.pad_token_id, fixed_shape=fixed_shape, device=self.actor.device,
                                       seq_multiple=seq_multiple, packed=packed)
        largest_share = -(-len(samples) // dp)
        num_micro = max(1, -(-largest_share // trainer.micro_batch_size))
        shard = shard_for_rank(samples, dp_rank, dp)
        return make_micro_batches(shard, trainer.micro_batch_size, self.pad_token_id, num_micro,
                                  fixed_shape=fixed_shape, device=self.actor.device, seq_multiple=seq_multiple,
                                  packed=packed)

    @property
    def model_output(self) -> str:
        """What the loss functions get from the model (``MegatronActor.forward_backward``): the final hidden states
        with the output weight (``trainer.fused_output_layer``: logits only chunk by chunk at response positions),
        else the logits in the model dtype."""
        return "hidden" if self.run.trainer.fused_output_layer else "logits"

    def forward_token_stats(self, micro_batches) -> dict[int, dict[str, torch.Tensor]]:
        """Forward-only pass: per sample index, its response tokens' logp / entropy / sum_pi2_lambda (last stage)."""
        fn = token_stats_fn(self.run.rollout.temperature, self.run.dynamo.token_stats_chunk)
        results = self.actor.forward_backward(micro_batches, fn, forward_only=True, output=self.model_output)
        per_sample: dict[int, dict[str, torch.Tensor]] = {}
        for mb, out in zip(micro_batches, results):
            for name in ("logp", "entropy", "sum_pi2_lambda"):
                for index, values in gather_token_values(mb, out[name]).items():
                    per_sample.setdefault(index, {})[name] = values
        return per_sample

    def update(self, samples: list[Sample], prompt_order: list[str], timer: StageTimer) -> dict[str, float]:
        """The RL update of one step on scored ``samples``: old log-probs, advantages and modulation, then one
        optimizer step per mini-batch of ``prompt_order``; returns its metrics (``benchmarks/bench_update.py``
        times it)."""
        run, ps = self.run, parallel_state()
        mini_batches = split_mini_batches(samples, prompt_order, run.trainer.mini_batch_prompts)
        plans = [(mb, self.micro_batches_for(mb)) for mb in mini_batches if mb]
        last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        # Where the update's own forward gives the old log-probs, it stands in for their pass (old_logprobs.py).
        reuse = update_gives_old_logprobs(run, len(plans))
        old = {} if reuse else old_logprob_pass(self, plans, last_stage, timer)
        local: dict[str, tuple[float, float]] = {}
        engine_logp = scatter_engine_logprobs(samples, plans, last_stage, run.dynamo.loss.engine_is)
        gap_max = None if reuse else old_policy_metrics(plans, old_entropies(old), local, engine_logp)
        modulation = run.dynamo.modulation
        dp_group = ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None
        # The baselines' mini-batch-wide token selections (Fork Tokens, Clip-COV, KL-COV), from the same pass.
        scatter_selections(run.dynamo.loss, plans, old, last_stage, dp_group, run.trainer.seed,
                           self.current_step)
        # Every mini-batch's modulation scope (H_min, H_max, max Xi over its tokens and the DP group) under the old
        # policy, from the old-log-prob pass: no extra forward. It is the exact scope of the first mini-batch
        # (pi = pi_old before the first update) and, with modulation.scope: old_policy, the one used for all.
        old_scopes = [None] * len(plans)
        if modulation.enabled:
            with timer("modulation_scope"):
                if last_stage:
                    old_scopes = [modulation_scope([scope_inputs(mb, old, run.dynamo.loss) for mb in micro],
                                                   modulation, group=dp_group) for _, micro in plans]
        current_policy = modulation.enabled and modulation.scope == "current_policy"
        scope_gaps: list[tuple[int, int, dict[str, float]]] = []  # (epoch, mini-batch, sums/maxima), diagnostics
        grad_norms, skipped, optimizer_steps = [], [], 0
        for epoch in range(run.trainer.ppo_epochs):
            for index, (mini, micro) in enumerate(plans):
                scope = old_scopes[index]
                if current_policy and (epoch, index) != (0, 0):
                    with timer("modulation_scope"):
                        # The exact two-pass form: a no-grad forward under the current weights (on every stage).
                        stats = self.forward_token_stats(micro)
                        if last_stage:
                            inputs = [scope_inputs(mb, stats, run.dynamo.loss) for mb in micro]
                            scope = modulation_scope(inputs, modulation, group=dp_group)
                denominator = global_denominator(mini, run.dynamo.loss.loss_agg_mode)
                loss_fn = dynamo_loss_fn(modulation, run.dynamo.loss, scope, denominator, run.rollout.temperature,
                                         run.dynamo.token_stats_chunk,
                                         compare_scope=old_scopes[index] if current_policy else None)
                with timer("train"):
                    results = self.actor.forward_backward(micro, loss_fn, output=self.model_output)
                    loss = sum(float(r["loss"]) for r in results)
                    finite = torch.tensor([1.0 if math.isfinite(loss) else 0.0], device=self.actor.device)
                    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
                    if finite.item() == 0:
                        self.actor.zero_grad()
                        skipped.append(f"non-finite loss at epoch {epoch} mini-batch {index}")
                        continue
                    # The actor checks the gradients before stepping: a non-finite one leaves the weights as they are.
                    result = self.actor.optimizer_step()
                    if not result.update_successful:
                        skipped.append(f"non-finite gradient at epoch {epoch} mini-batch {index}")
                    else:
                        optimizer_steps += 1
                        if result.grad_norm is not None:
                            grad_norms.append(result.grad_norm)
                if current_policy and is_metric_rank():
                    scope_gaps.append((epoch, index, sum_scope_gaps(results)))
                if is_metric_rank():
                    for r in results:
                        n = float(r.get("actor/num_tokens", 0.0))
                        for key, value in r.items():
                            # Token-weighted means; the token counts themselves are weights, not metrics. A mean
                            # over a subset of the tokens comes with its own count, "<key>/num_tokens".
                            if key.startswith(("actor/", "modulation/")) and not key.endswith("/num_tokens"):
                                w = float(r.get(f"{key}/num_tokens", n))
                                s, c = local.get(key, (0.0, 0.0))
                                local[key] = (s + float(value) * w, c + w)
                    # Micro-batch losses carry the global denominator: their sum over micro-batches and DP ranks
                    # is the mini-batch loss; count each update once (on DP rank 0).
                    s, c = local.get("loss", (0.0, 0.0))
                    local["loss"] = (s + float(loss), c + (1.0 if ps.get_data_parallel_rank() == 0 else 0.0))
        if reuse and plans:  # the update ran on the old weights: the old policy's numbers come from it
            gap_max = old_policy_metrics(plans, entropies_from_update(plans, results, last_stage), local, engine_logp)
        if not is_metric_rank():
            local = {}
        metrics = collect_metric_sums(local)
        if current_policy:
            metrics.update(reduce_scope_gaps(scope_gaps))
        if gap_max is not None:
            metrics["rollout/logp_gap_max"] = gap_max
        metrics["grad_norm"] = float(np.mean(grad_norms)) if grad_norms else float("nan")
        metrics["optimizer_steps"] = optimizer_steps
        if skipped:
            metrics["skipped"] = "; ".join(skipped)
        return metrics

    def _sync_weights(self, step: int) -> dict[str, float]:
        """Collective: the new weights into every rank's engine. A failure on any rank (which keeps relaying its
        part of the gather, so no rank hangs) becomes a :class:`RolloutError` on every rank."""
        from megatron_dynamo.rollout.weight_sync import sync_weights

        stats, failure = None, None
        try:
            stats = sync_weights(self.engine, self.actor, dtype=self.rollout_dtype)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            failure = f"{type(exc).__name__}: {exc}"
        raise_on_any_rank(failure, f"step {step}: loading the new weights into the rollout engines failed")
        return stats.as_metrics()
