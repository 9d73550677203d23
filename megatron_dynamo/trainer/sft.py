"""The supervised warm-up before RL: steps on (prompt, reference answer + EOS), so that a model from scratch solves
some prompts before RL has any signal (the synthetic CPU default). Same micro-batching and the same Megatron actor
as the RL update (``PolicyUpdater.micro_batches_for``), a token-mean loss over the data-parallel ranks."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_dynamo.data.dataset import GENERATED_TASKS
from megatron_dynamo.data.synthetic import sft_pairs
from megatron_dynamo.parallel.stop_signals import agreed_stop_signal, signal_name
from megatron_dynamo.trainer.batch import Sample
from megatron_dynamo.trainer.errors import TrainingStopped
from megatron_dynamo.trainer.policy_loss import response_token_stats

log = logging.getLogger(__name__)


def set_learning_rate(actor, lr: float) -> None:
    for group in actor.optimizer.param_groups:
        group["lr"] = lr


def sft_warmup(run, examples, tokenizer, actor, updater, rank: int) -> list[float]:
    """Supervised steps on (prompt, reference answer + EOS): a model from scratch must solve some prompts
    before RL has any signal (the synthetic CPU default). ``updater``: the RL update's ``PolicyUpdater``, whose
    micro-batch layout and model output the warm-up shares. Returns the losses."""
    if run.trainer.sft_warmup_steps == 0:
        return []
    if run.data.sft_problems:  # the warm-up's own problems of the same task (config: generated tasks only)
        task = GENERATED_TASKS[run.data.train]
        examples = (task.sft or task.make)(run.data.sft_problems, run.data.seed + 1)
    pairs = sft_pairs(examples, template=run.data.template, answer_format="plain")
    samples = []
    for i, (prompt, answer) in enumerate(pairs):
        p = tuple(tokenizer.encode(prompt, add_special_tokens=False))
        a = tuple(tokenizer.encode(answer, add_special_tokens=False)) + (tokenizer.eos_token_id,)
        samples.append(Sample(i, examples[i].id, p, a, reward=1.0, advantage=1.0))
    set_learning_rate(actor, run.trainer.sft_lr)
    generator = torch.Generator().manual_seed(run.trainer.seed)
    batch = run.trainer.sft_batch_size
    # A long warm-up (minutes) shows its progress every tenth; a short one only its final line.
    steps = run.trainer.sft_warmup_steps
    report_every = steps // 10 if steps >= 200 else 0
    if rank == 0 and report_every:
        log.info("SFT warm-up: %d steps (a stop signal ends it after its step: it is saved only whole)", steps)
    losses = []
    for step in range(steps):
        order = torch.randperm(len(samples), generator=generator)[:batch].tolist()
        chosen = [samples[i] for i in order]
        denominator = float(sum(s.num_response_tokens for s in chosen))
        micro = updater.micro_batches_for(chosen)
        results = actor.forward_backward(micro, sft_loss_fn(denominator), output=updater.model_output)
        actor.optimizer_step()
        from megatron.core import parallel_state

        own = results and parallel_state.get_tensor_model_parallel_rank() == 0
        loss = torch.tensor([sum(float(r["loss"]) for r in results) if own else 0.0], device=actor.device)
        dist.all_reduce(loss)  # the last stage's DP ranks hold the parts of the token mean
        losses.append(loss.item())
        signum = agreed_stop_signal()  # every rank stops after the same step, not after a warm-up of minutes
        if signum:
            raise TrainingStopped(f"stopped by {signal_name(signum)} during the SFT warm-up, after its step {step + 1} "
                                  f"of {steps}: nothing was saved (a warm-up is saved only whole); the same command "
                                  "starts it again", signum, 0)
        if rank == 0 and report_every and (step + 1) % report_every == 0 and step + 1 < steps:
            log.info("SFT warm-up: step %d/%d, loss %.3f", step + 1, steps, losses[-1])
    set_learning_rate(actor, run.optim.lr)
    if rank == 0:
        log.info("SFT warm-up: %d steps, loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
    return losses


def sft_loss_fn(denominator: float):
    def loss_fn(model_output, micro_batch):
        stats, _, _ = response_token_stats(model_output, micro_batch, 1.0, None)
        loss = -stats.logp.sum() / denominator
        return loss, {"loss": loss.detach()}

    return loss_fn
