"""The old-log-prob pass left out where the update's own forward gives the same numbers (trainer/old_logprobs.py).

With one mini-batch and one PPO epoch (GRPO, no modulation, no mini-batch token selection) ``trainer.old_logprob_pass:
auto`` runs no forward-only pass; the real Megatron actor on CPU then gives, bit for bit, the metrics (losses,
ratios, clip fractions, entropy_mean, the engine/trainer gap) and the weights after the optimizer step of the same
update with the pass (``always``). Where the old policy is needed before the update (modulation, several
mini-batches or epochs, a baseline's token selection) the pass still runs under ``auto``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_reference import REPO, TINY_QWEN2, hf_state_dict
from multiproc import run_on_ranks
from samples import random_samples

CPU_DEFAULT = f"{REPO}/configs/cpu_default.yaml"
GRPO_ONE_MINI_BATCH = ["trainer.micro_batch_size=4", "trainer.micro_batch_tokens=0", "optim.lr=0.01"]


def _samples(vocab: int):
    """Six responses over three prompts, with engine log-probs a little off (so the gap metrics are not 0)."""
    samples = random_samples(vocab, seed=11)
    return [dataclasses.replace(s, engine_logp=tuple(-0.5 - 0.1 * t for t in range(s.num_response_tokens)))
            for s in samples]


def _update(run, samples):
    """One ``StepRunner.update`` on a fresh actor (the same initial weights every time): its metrics without the
    timings, the weights after it, and how many forward-only passes it made."""
    from megatron_dynamo.trainer.actor import MegatronActor
    from megatron_dynamo.trainer.step import StageTimer, StepRunner

    actor = MegatronActor(TINY_QWEN2, optim=run.optim, hf_weights=hf_state_dict(TINY_QWEN2).__getitem__)
    runner = StepRunner(run, actor, pad_token_id=0, rollout_dtype=torch.float32)
    passes = []
    forward_token_stats = runner.updater.forward_token_stats
    runner.updater.forward_token_stats = lambda micro, **kwargs: (passes.append(len(micro))
                                                                  or forward_token_stats(micro, **kwargs))
    timer = StageTimer()
    before = {name: p.detach().clone() for name, p in actor.named_parameters()}
    metrics = runner.update(samples, [f"p{i}" for i in range(3)], timer, step=1)
    weights = {name: p.detach().clone() for name, p in actor.named_parameters()}
    moved = sum(not torch.equal(before[name], w) for name, w in weights.items())
    return {"metrics": metrics, "weights": weights, "moved": moved, "passes": len(passes),
            "stages": sorted(timer.seconds)}


def _worker(rank, world_size, cases):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.config import load_run_config

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    out = {}
    for name, algo, overrides in cases:
        run = load_run_config(CPU_DEFAULT, overrides, algo=algo)
        out[name] = _update(run, _samples(128))
    return out


CASES = [
    ("grpo_auto", "grpo", GRPO_ONE_MINI_BATCH),
    ("grpo_always", "grpo", GRPO_ONE_MINI_BATCH + ["trainer.old_logprob_pass=always"]),
    ("engine_is_auto", "grpo", GRPO_ONE_MINI_BATCH + ["dynamo.loss.engine_is=truncate"]),
    ("engine_is_always", "grpo", GRPO_ONE_MINI_BATCH + ["dynamo.loss.engine_is=truncate",
                                                         "trainer.old_logprob_pass=always"]),
    # Where the old policy is needed before the update, auto keeps the pass.
    ("modulation", "dynamo", GRPO_ONE_MINI_BATCH),
    ("two_mini_batches", "grpo", GRPO_ONE_MINI_BATCH + ["trainer.mini_batch_prompts=2", "data.prompts_per_step=4"]),
    ("two_epochs", "grpo", GRPO_ONE_MINI_BATCH + ["trainer.ppo_epochs=2"]),
    ("fork_tokens", "fork_tokens", GRPO_ONE_MINI_BATCH),
]


@pytest.fixture(scope="module")
def updates():
    (out,) = run_on_ranks(_worker, 1, CASES)
    return out


def _without_timings(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["grpo", "engine_is"])
def test_leaving_the_pass_out_changes_no_metric_and_no_weight(updates, name):
    auto, always = updates[f"{name}_auto"], updates[f"{name}_always"]
    assert auto["passes"] == 0 and "old_logprob" not in auto["stages"]
    assert always["passes"] == 1 and "old_logprob" in always["stages"]
    got, want = _without_timings(auto["metrics"]), _without_timings(always["metrics"])
    # The old policy's numbers are reported without the pass too, and the update moved the weights.
    for key in ("entropy_mean", "rollout/logp_gap_mean", "rollout/engine_kl_k3", "rollout/logp_gap_max", "loss",
                "actor/ratio_mean", "grad_norm"):
        assert key in got, key
    assert got["optimizer_steps"] == 1 and got["actor/ratio_mean"] == 1.0
    # Bit for bit: the forward-only pass and the update's forward compute the same log-probs.
    assert got == want
    assert auto["moved"] == always["moved"] == len(always["weights"])  # every tensor changed
    for param, weight in always["weights"].items():
        assert torch.equal(auto["weights"][param], weight), param


@pytest.mark.distributed
@pytest.mark.parametrize("name,passes", [("modulation", 1), ("two_mini_batches", 2), ("two_epochs", 1),
                                         ("fork_tokens", 1)])
def test_the_pass_stays_where_the_old_policy_is_needed_first(updates, name, passes):
    assert updates[name]["passes"] == passes and "old_logprob" in updates[name]["stages"], name


def test_which_runs_leave_the_pass_out():
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.old_logprobs import update_gives_old_logprobs

    def gives(overrides, algo="grpo", mini_batches=1):
        return update_gives_old_logprobs(load_run_config(CPU_DEFAULT, overrides, algo=algo), mini_batches)

    assert gives([])
    assert gives(["dynamo.loss.engine_is=mask"]) and gives([], algo="clip_higher") and gives([], algo="w_reinforce")
    assert not gives(["trainer.old_logprob_pass=always"])
    assert not gives([], mini_batches=2) and not gives(["trainer.ppo_epochs=2"])
    assert not gives([], algo="dynamo") and not gives(["dynamo.modulation.ums=false"], algo="dynamo")
    assert not any(gives([], algo=a) for a in ("fork_tokens", "clip_cov", "kl_cov"))
