"""Where a mini-batch's modulation scope (H_min, H_max, max Xi) comes from: the one-pass form (``modulation.scope:
old_policy``, from the old-log-prob pass) and the exact two-pass form (``current_policy``, a no-grad forward under
the current weights). Before the first update they must agree exactly, with the real Megatron actor; after it they
differ, and the trainer reports by how much."""

import os

import pytest
import torch

from hf_reference import REPO, TINY_QWEN2, hf_state_dict
from multiproc import run_on_ranks
from samples import random_samples, train_metrics

CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")


def _samples(vocab: int):
    return random_samples(vocab, seed=5)


def _scope_worker(rank, world_size, output):
    from megatron_dynamo.algorithms.config import ModulationConfig, PolicyLossConfig
    from megatron_dynamo.algorithms.modulation import modulation_factors, modulation_scope
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig
    from megatron_dynamo.trainer.batch import gather_token_values, make_micro_batches, token_values
    from megatron_dynamo.trainer.policy_loss import dynamo_loss_fn, scope_inputs, token_stats_fn

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    actor = MegatronActor(TINY_QWEN2, optim=OptimConfig(lr=1e-2, clip_grad=0.0),
                          hf_weights=hf_state_dict(TINY_QWEN2).__getitem__)
    micro = make_micro_batches(_samples(actor.arch.vocab_size), 4, 0)
    cfg, loss_cfg = ModulationConfig(), PolicyLossConfig()

    def forward_stats():
        per_sample = {}
        for mb, out in zip(micro, actor.forward_backward(micro, token_stats_fn(1.0), forward_only=True,
                                                         output=output)):
            for name in ("logp", "entropy", "sum_pi2_lambda"):
                for index, values in gather_token_values(mb, out[name]).items():
                    per_sample.setdefault(index, {})[name] = values
        return per_sample

    old = forward_stats()
    for mb in micro:
        mb.old_logp = token_values(mb, {i: v["logp"] for i, v in old.items()})
    old_scope = modulation_scope([scope_inputs(mb, old, loss_cfg) for mb in micro], cfg)

    # The training forward's own token stats, recorded by a loss function wrapped around the trainer's.
    seen = []

    def recording_loss(scope):
        inner = dynamo_loss_fn(cfg, loss_cfg, scope, 40.0, 1.0)

        def loss_fn(model_output, mb):
            from megatron_dynamo.trainer.policy_loss import response_token_stats

            stats, _, _ = response_token_stats(model_output, mb, 1.0, None)
            seen.append({i: {"logp": v} for i, v in gather_token_values(mb, _full(stats.logp, mb)).items()})
            for name in ("entropy", "sum_pi2_lambda"):
                for i, v in gather_token_values(mb, _full(getattr(stats, name), mb)).items():
                    seen[-1][i][name] = v
            return inner(model_output, mb)

        return loss_fn

    actor.forward_backward(micro, recording_loss(old_scope), output=output)
    during = {i: v for part in seen for i, v in part.items()}
    during_inputs = [scope_inputs(mb, during, loss_cfg) for mb in micro]
    first = {"old": old_scope, "during": modulation_scope(during_inputs, cfg),
             "factors_equal": all(
                 torch.equal(a.beta_comp, b.beta_comp) and torch.equal(a.beta_stab, b.beta_stab)
                 for inputs in during_inputs
                 for a, b in [(modulation_factors(inputs, cfg, old_scope),
                               modulation_factors(inputs, cfg, modulation_scope(during_inputs, cfg)))])}
    actor.optimizer_step()
    # After the update: the exact scope needs a new forward, and it is not the old one.
    current = forward_stats()
    after = modulation_scope([scope_inputs(mb, current, loss_cfg) for mb in micro], cfg)
    return {"first": first, "after": after}


def _full(values, mb):
    mask = mb.loss_mask.bool()
    out = torch.zeros(mask.shape, dtype=values.dtype)
    out[mask] = values.detach()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("output", ["hidden", "logits"])
def test_one_pass_scope_is_exact_before_the_first_update_and_not_after(output):
    (result,) = run_on_ranks(_scope_worker, 1, output)
    first, after = result["first"], result["after"]
    for name in ("h_min", "h_max", "xi_max"):
        assert torch.equal(getattr(first["old"], name), getattr(first["during"], name)), name
    assert first["factors_equal"]
    assert first["old"].xi_max > 0 and first["old"].h_max > first["old"].h_min
    assert not all(torch.equal(getattr(first["old"], n), getattr(after, n)) for n in ("h_min", "h_max", "xi_max"))


def _train(output_dir, *extra):
    return train_metrics(output_dir, CPU_DEFAULT, "trainer.sft_warmup_steps=30", "data.prompts_per_step=8",
                         "trainer.mini_batch_prompts=4", "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2",
                         "dynamo.allocation.n_max=6", "data.synthetic_problems=16", "trainer.steps=1",
                         "checkpoint.every=1", "logging.tensorboard=false", "logging.plot=false",
                         "logging.progress=false", *extra, timeout=600)


@pytest.mark.slow
def test_trainer_reports_the_scope_gap_per_mini_batch(tmp_path):
    metrics = _train(tmp_path, "dynamo.modulation.scope=current_policy")
    for row in metrics:
        gaps = row["modulation/scope_gap_by_mini_batch"]
        assert len(gaps) == 2  # two mini-batches, one PPO epoch
        assert gaps[0] == [0.0, 0.0, 0.0, 0.0]  # the old-log-prob pass is the current policy before any update
        assert max(gaps[1]) > 0  # after one update it is not
        assert row["modulation/scope_gap_beta_comp_max"] == max(g[0] for g in gaps)
        assert row["modulation/scope_gap_beta_stab_max"] == max(g[2] for g in gaps)
        assert row["time/modulation_scope"] > 0
        # the modulation stage, timed inside the update's loss: a part of the training time
        assert 0 < row["time/modulation"] < row["time/train"]
