"""The trainer-vs-engine gap (issue 24): the engine's per-token log-probs travel through the exchange, the gap
metrics, and the importance weights of ``dynamo.loss.engine_is`` (truncate / mask) against hand-computed tensors;
with the real Megatron actor on CPU, weights of exactly 1 change neither the loss nor any gradient, and an injected
gap weights each token's loss as the formula says."""

from __future__ import annotations

import math

import pytest
import torch

from hf_reference import TINY_QWEN2, hf_state_dict
from multiproc import run_on_ranks
from samples import random_samples

from megatron_dynamo.algorithms.config import PolicyLossConfig
from megatron_dynamo.algorithms.losses import engine_gap_sums, engine_importance_weights, k3_kl


def test_importance_weights_follow_the_formula():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.1])
    engine = torch.tensor([-1.0, -1.0, -2.0, -3.5, -0.1])
    # rho = exp(old - engine): 1, e^-1, e^1.5, e^0.5, 1
    rho = [1.0, math.exp(-1.0), math.exp(1.5), math.exp(0.5), 1.0]
    truncated = engine_importance_weights(old, engine, "truncate", 2.0)
    assert truncated.tolist() == pytest.approx([1.0, rho[1], 2.0, 2.0 if rho[3] > 2 else rho[3], 1.0], rel=1e-6)
    assert engine_importance_weights(old, engine, "mask", 2.0).tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert engine_importance_weights(old, engine, "off", 2.0).tolist() == [1.0] * 5
    # identity: the engine agrees with the trainer -> weights exactly 1, gap 0
    assert torch.equal(engine_importance_weights(old, old.clone(), "truncate", 2.0), torch.ones(5))
    assert torch.equal(engine_importance_weights(old, old.clone(), "mask", 2.0), torch.ones(5))
    gap = engine_gap_sums(old, engine)
    diffs = [0.0, 1.0, 1.5, 0.5, 0.0]
    assert float(gap["abs_sum"]) == pytest.approx(sum(diffs)) and float(gap["abs_max"]) == 1.5
    assert float(gap["num_tokens"]) == 5
    # k3 of KL(engine || old) under the engine's samples: exp(d) - d - 1 with d = old - engine
    d = [0.0, -1.0, 1.5, 0.5, 0.0]
    assert float(gap["kl_k3_sum"]) == pytest.approx(sum(math.exp(x) - x - 1 for x in d), rel=1e-12)
    assert float(gap["kl_k3_sum"]) == pytest.approx(float(k3_kl(engine.double(), old.double()).sum()))
    assert float(engine_gap_sums(old, old)["kl_k3_sum"]) == 0.0


@pytest.mark.parametrize("override,message", [
    ({"engine_is": "clip"}, "engine_is must be one of"),
    ({"engine_is_cap": 1.0}, "engine_is_cap must be a finite number > 1"),
])
def test_bad_engine_is_settings_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**override).validate()


def test_the_exchange_carries_the_engine_logprobs():
    from megatron_dynamo.rollout.exchange import ScoredResponses, gather_rollout

    local = ScoredResponses([1, 0], [0, 0], [(5, 6, 7), (8,)], [False, True], [0.0, 1.0],
                            [(-0.5, -1.25, -2.0), (-0.125,)])
    merged = gather_rollout(local)
    assert merged.token_ids == [(8,), (5, 6, 7)]
    assert merged.logprobs == [(-0.125,), (-0.5, -1.25, -2.0)]
    # without log-probs the slots are NaN (the trainer then logs no gap)
    bare = gather_rollout(ScoredResponses([0], [0], [(1, 2)], [False], [1.0]))
    assert len(bare.logprobs[0]) == 2 and all(math.isnan(x) for x in bare.logprobs[0])


def _samples(vocab: int):
    return random_samples(vocab, seed=7)


def _gap_worker(rank, world_size):
    from megatron_dynamo.algorithms.config import ModulationConfig
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig
    from megatron_dynamo.trainer.batch import gather_token_values, make_micro_batches, token_values
    from megatron_dynamo.trainer.policy_loss import dynamo_loss_fn, token_stats_fn

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    actor = MegatronActor(TINY_QWEN2, optim=OptimConfig(lr=1e-2, clip_grad=0.0),
                          hf_weights=hf_state_dict(TINY_QWEN2).__getitem__)
    samples = _samples(actor.arch.vocab_size)
    micro = make_micro_batches(samples, 4, 0)
    old = {}
    for mb, out in zip(micro, actor.forward_backward(micro, token_stats_fn(1.0), forward_only=True)):
        old.update(gather_token_values(mb, out["logp"]))
    g = torch.Generator().manual_seed(3)
    perturbed = {i: v + 0.6 * torch.randn(v.shape, generator=g) for i, v in old.items()}
    denominator = float(sum(s.num_response_tokens for s in samples))
    modulation = ModulationConfig(gc=False, ums=False)  # plain PPO-clip: loss = -sum_t w_t A_t / D at r = 1

    def run(engine_is: str, engine_logp: dict):
        for mb in micro:
            mb.old_logp = token_values(mb, old)
            mb.engine_logp = token_values(mb, engine_logp)
        actor.zero_grad()
        cfg = PolicyLossConfig(engine_is=engine_is, engine_is_cap=2.0)
        results = actor.forward_backward(micro, dynamo_loss_fn(modulation, cfg, None, denominator, 1.0))
        grads = [p.main_grad.clone() if getattr(p, "main_grad", None) is not None else p.grad.clone()
                 for _, p in actor.named_parameters()]
        return results, grads

    off, off_grads = run("off", old)
    out = {"off_loss": sum(float(r["loss"]) for r in off)}
    for mode in ("truncate", "mask"):
        same, same_grads = run(mode, {i: v.clone() for i, v in old.items()})
        out[f"{mode}_identity_loss"] = sum(float(r["loss"]) for r in same)
        out[f"{mode}_identity_grads_equal"] = all(torch.equal(a, b) for a, b in zip(off_grads, same_grads))
        out[f"{mode}_identity_weight_mean"] = [float(r["actor/engine_is_weight_mean"]) for r in same]
        gapped, _ = run(mode, perturbed)
        out[f"{mode}_gap_loss"] = sum(float(r["loss"]) for r in gapped)
        out[f"{mode}_gap_weight_sum"] = sum(float(r["actor/engine_is_weight_mean"]) * float(r["actor/num_tokens"])
                                            for r in gapped)
    # hand reference: at r = 1 every token's PPO-clip loss is -A (dual clip inactive), weighted by w
    expected = {}
    for mode in ("truncate", "mask"):
        total, weights = 0.0, 0.0
        for s in samples:
            rho = torch.exp(old[s.index].double() - perturbed[s.index].double())
            w = rho.clamp(max=2.0) if mode == "truncate" else ((rho >= 0.5) & (rho <= 2.0)).double()
            total += float(-(w * s.advantage).sum())
            weights += float(w.sum())
        expected[f"{mode}_gap_loss"] = total / denominator
        expected[f"{mode}_gap_weight_sum"] = weights
    out["expected"] = expected
    out["unweighted"] = -sum(s.advantage * s.num_response_tokens for s in samples) / denominator
    return out


@pytest.mark.slow
def test_engine_importance_weights_in_the_real_loss():
    (out,) = run_on_ranks(_gap_worker, 1)
    assert out["off_loss"] == pytest.approx(out["unweighted"], rel=1e-5)
    for mode in ("truncate", "mask"):
        # identity: weights exactly 1, loss and every gradient bit for bit those of engine_is: off
        assert out[f"{mode}_identity_loss"] == out["off_loss"], mode
        assert out[f"{mode}_identity_grads_equal"], mode
        assert out[f"{mode}_identity_weight_mean"] == [1.0] * len(out[f"{mode}_identity_weight_mean"])
        # injected gap: each token's loss weighted by the hand-computed w
        assert out[f"{mode}_gap_loss"] == pytest.approx(out["expected"][f"{mode}_gap_loss"], rel=1e-5), mode
        assert out[f"{mode}_gap_weight_sum"] == pytest.approx(out["expected"][f"{mode}_gap_weight_sum"], rel=1e-5)
        assert out[f"{mode}_gap_loss"] != pytest.approx(out["off_loss"], rel=1e-3), mode
