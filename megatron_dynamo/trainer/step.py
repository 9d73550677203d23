"""One DynaMO step, stage by stage, each timed (``../shared/notes/DYNAMO.md``):

    data -> allocation (rank 0, broadcast) -> rollout (every engine its share) -> reward (each engine leader)
    -> exchange -> history [-> the same again for a refill of dynamic sampling: trainer/step_sampling.py]
    -> advantages and prompt weights -> old log-probs -> PPO mini-batch updates with modulation -> weight sync

Every rank runs this function (SPMD). Every rank hosts a vLLM worker; consecutive ranks form engines of
``rollout.tensor_parallel`` (``rollout.sharding``). The step's prompts are split over the engines by a rule every rank
computes alike; each engine generates its share and its leader scores it; the scored responses reach every rank as
packed tensors (``rollout.exchange``). Everything after is computed identically on every rank from the same data,
except the model work, which each rank does on its data-parallel share and its pipeline/tensor shard.
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
from megatron_dynamo.algorithms.allocation import PromptHistory
from megatron_dynamo.algorithms.modulation import modulation_scope
from megatron_dynamo.algorithms.prompt_weights import prompt_weights
from megatron_dynamo.trainer.batch import (Sample, build_micro_batches, gather_token_values, make_micro_batches,
                                           plan_token_micro_batches, resolve_pack_sequences, scatter_token_values,
                                           shard_for_rank, split_mini_batches)
from megatron_dynamo.trainer.policy_loss import dynamo_loss_fn, scope_inputs, token_stats_fn
from megatron_dynamo.trainer.step_metrics import (RolloutError, collect_metric_sums,  # noqa: F401 (step.RolloutError)
                                                  global_denominator, is_metric_rank, parallel_state, prompt_rows,
                                                  raise_on_any_rank, reduce_scope_gaps, rollout_rows,
                                                  scatter_engine_logprobs, solved_fraction, sum_reward_stats,
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
    """Holds the stage objects of a run and executes steps. Built by :class:`megatron_dynamo.trainer.trainer.Trainer`."""

    def __init__(self, run, actor, engine, scorer, sampler, history: PromptHistory, tokenizer, template: str,
                 sampling, pad_token_id: int, rollout_dtype: torch.dtype):
        self.run = run
        self.actor = actor
        self.engine = engine  # this rank's part of its engine (every rank)
        self.scorer = scorer  # engine leaders only (None elsewhere)
        self.sampler = sampler
        self.history = history
        self.tokenizer = tokenizer
        self.template = template
        self.sampling = sampling
        self.pad_token_id = pad_token_id
        self.rollout_dtype = rollout_dtype
        self._logs_started: set[str] = set()  # the first step logged to a file drops that file's later rows
        # The split of a step's prompts over engines weighs responses by the last step's mean length (the same
        # number on every rank: it comes from the exchanged rollout). It only balances load: results do not
        # depend on it.
        self.expected_response_tokens = run.rollout.max_response_tokens / 2

    # ------------------------------------------------------------------ stages
    def _prompts(self, examples) -> list[tuple[int, ...]]:
        from megatron_dynamo.data.prompt_length import fit_prompt
        from megatron_dynamo.data.templates import render

        out = []
        for example in examples:
            ids = self.tokenizer.encode(render(self.template, example.problem), add_special_tokens=False)
            # Left-truncate long prompts (paper: prompts left-truncated to the max prompt length); data.prompt_overflow
            # decided before the run whether any may be cut (data/prompt_length.py).
            ids, cut = fit_prompt(ids, self.run.data.max_prompt_tokens)
            self.prompts_truncated += cut
            out.append(ids)
        return out

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

    def rollout_and_reward(self, step, examples, counts, timer, round_index: int = 0):
        """Every rank: generate this engine's share of the prompts, score it on the engine leader, exchange.
        Returns (responses as (prompt id, prompt tokens, response tokens), rewards, metrics, the engine's
        per-token log-probs of each response: NaN where it gave none). ``round_index`` > 0 (a refill of dynamic
        sampling, ``trainer/step_sampling.py``): a prompt drawn again in the same step gets other samples."""
        from megatron_dynamo.rollout.exchange import ScoredResponses, gather_rollout
        from megatron_dynamo.rollout.interface import GenerationRequest, request_seed
        from megatron_dynamo.rollout.sharding import assign_to_engines, engine_loads, request_loads

        layout = self.engine.layout
        with timer("data"):
            prompt_tokens = self._prompts(examples)
        loads = request_loads([len(t) for t in prompt_tokens], counts, self.expected_response_tokens)
        assignment = assign_to_engines(loads, layout.num_engines)
        mine = [i for i, engine in enumerate(assignment) if engine == layout.engine_index]
        index_of = {examples[i].id: i for i in mine}
        refill_seed = None if round_index == 0 or self.sampling.seed is None else (
            lambda pid: request_seed(self.sampling.seed, step, f"{pid}\x1fround {round_index}"))
        requests = [GenerationRequest(prompt_id=examples[i].id, prompt_token_ids=prompt_tokens[i], count=int(counts[i]),
                                      seed=refill_seed(examples[i].id) if refill_seed else None)
                    for i in mine]
        local, stats, failure = None, None, None
        try:
            with timer("rollout"), self.engine_awake():
                responses = self.engine.generate(requests, self.sampling, step=step)
            if layout.is_leader:
                with timer("reward"):
                    references = {examples[i].id: examples[i].references() for i in mine}
                    scored = self.scorer.score([r.text or "" for r in responses],
                                               [references[r.prompt_id] for r in responses],
                                               finish_reasons=[r.finish_reason for r in responses])
                local = ScoredResponses([index_of[r.prompt_id] for r in responses],
                                        [r.sample_index for r in responses], [r.token_ids for r in responses],
                                        [r.truncated for r in responses], [float(x) for x in scored.rewards],
                                        [r.logprobs for r in responses])
                stats = scored.stats
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
            failure = f"{type(exc).__name__}: {exc}"
        raise_on_any_rank(failure, f"step {step}: the rollout failed")
        with timer("exchange"):
            rollout = gather_rollout(local)
            reward_metrics = sum_reward_stats(stats)
        responses = [(examples[p].id, prompt_tokens[p], toks) for p, toks in zip(rollout.prompt_index,
                                                                                 rollout.token_ids)]
        lengths = [len(t) for t in rollout.token_ids]
        per_engine = engine_loads(lengths, [assignment[p] for p in rollout.prompt_index], layout.num_engines)
        if lengths:
            self.expected_response_tokens = float(np.mean(lengths))
        reward_metrics["response_length_mean"] = float(np.mean(lengths)) if lengths else 0.0
        reward_metrics["rollout/response_length_max"] = float(max(lengths)) if lengths else 0.0
        reward_metrics["rollout/truncated_frac"] = float(np.mean(rollout.truncated)) if lengths else 0.0
        reward_metrics["rollout/engines"] = layout.num_engines
        mean_tokens = float(np.mean(per_engine))
        reward_metrics["rollout/engine_tokens_max_over_mean"] = max(per_engine) / mean_tokens if mean_tokens else 1.0
        return responses, rollout.rewards, reward_metrics, rollout.logprobs

    def run_step(self, step: int) -> dict[str, Any]:
        from megatron_dynamo.trainer.step_sampling import sample_step

        run = self.run
        timer = StageTimer()
        start = time.perf_counter()
        rank = dist.get_rank()
        self.prompts_truncated = 0  # summed over the step's rounds (_prompts)
        batch = sample_step(self, step, timer)  # prompts, allocation, rollout, reward, history (every round)
        responses, rewards = batch.responses, batch.rewards
        with timer("advantages"):
            response_ids = [pid for pid, _, _ in responses]
            estimator = get_advantage_estimator(run.dynamo.advantage_estimator)
            advantages = estimator(torch.tensor(rewards, dtype=torch.float64), response_ids,
                                   normalize_std=run.dynamo.normalize_advantage_std)
            weights = prompt_weights(response_ids, run.dynamo.loss.prompt_weight)
            samples = [Sample(i, pid, tuple(ptoks), tuple(rtoks), rewards[i], float(advantages[i]),
                              engine_logp=batch.engine_logprobs[i], loss_weight=float(weights[i]))
                       for i, (pid, ptoks, rtoks) in enumerate(responses) if len(rtoks) > 0]
        if rank == 0:
            self._append_rows("prompts.jsonl", step, prompt_rows(step, batch.prompt_ids, batch.counts, response_ids,
                                                                 rewards))
            if run.logging.rollouts:
                rows = rollout_rows(step, responses, rewards, self.tokenizer.decode)
                self._append_rows("rollouts.jsonl", step, rows)
        self.current_step = step  # seeds the baselines' random token selection (trainer/token_selection.py)
        update_metrics = self.update(samples, batch.prompt_ids, timer)
        with timer("weight_sync"):
            sync_stats = self._sync_weights(step)
        counts = np.asarray(batch.counts, dtype=np.int64)
        metrics = {
            "reward_mean": batch.reward_mean,
            "rollouts": int(batch.rollouts),
            "rollouts_trained": int(counts.sum()),
            "alloc_min": int(counts.min()) if counts.size else 0,
            "alloc_max": int(counts.max()) if counts.size else 0,
            "variance_ratio": batch.variance_ratio,
            "alloc_counts": [int(c) for c in counts],
            "reward/prompts_solved_frac": solved_fraction(response_ids, rewards),
            "data/prompts_truncated": self.prompts_truncated,
            **update_metrics,
            **batch.metrics,
            **sync_stats,
            **{f"time/{k}": v for k, v in timer.seconds.items()},
        }
        metrics["step_seconds"] = time.perf_counter() - start
        return metrics

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
        with timer("old_logprob"):
            old = {}
            for _, micro in plans:
                old.update(self.forward_token_stats(micro))
            old_logp = {i: v["logp"] for i, v in old.items()}
            for _, micro in plans:
                for mb in micro:
                    if last_stage:
                        scatter_token_values(mb, old_logp, "old_logp")
                    else:
                        mb["old_logp"] = torch.zeros_like(mb["loss_mask"])
        local: dict[str, tuple[float, float]] = {}
        if last_stage and old:
            entropies = torch.cat([v["entropy"] for v in old.values()])
            local["entropy_mean"] = (float(entropies.sum()), float(entropies.numel()))
        gap_max = scatter_engine_logprobs(samples, plans, last_stage, local, run.dynamo.loss.engine_is)
        modulation = run.dynamo.modulation
        dp_group = ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None
        # The baselines' mini-batch-wide token selections (Fork Tokens, Clip-COV, KL-COV), from the same pass.
        scatter_selections(run.dynamo.loss, plans, old, last_stage, dp_group, run.trainer.seed,
                           getattr(self, "current_step", 0))
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
