"""Equal prompt weights (``dynamo.loss.prompt_weight: equal``, issue 32's "DRA without reweighting"): the weights
against their definition, the loss against an independent weighted token mean, bit-identity with the plain loss
when every prompt has the same count, and the same loss and gradients at every micro-batch layout, two DP ranks,
TP2 and PP2 with the real Megatron actor on CPU (as tests/test_micro_batching.py and test_baselines_layout.py do for
the plain loss)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_reference import REPO, TINY_QWEN2
from multiproc import run_on_ranks
from megatron_dynamo.algorithms.prompt_weights import prompt_weights, weighted_denominator
from megatron_dynamo.config import ConfigError
from megatron_dynamo.trainer.config import load_run_config

CPU_DEFAULT = f"{REPO}/configs/cpu_default.yaml"


def test_weights_make_every_prompt_weigh_the_mean_count():
    ids = ["a", "a", "a", "a", "b", "b", "c", "a"]  # counts a 5, b 2, c 1; mean 8 / 3
    w = prompt_weights(ids, "equal")
    assert w.tolist() == pytest.approx([8 / 15] * 4 + [4 / 3] * 2 + [8 / 3, 8 / 15])
    per_prompt = {pid: sum(x for p, x in zip(ids, w) if p == pid) for pid in "abc"}
    assert per_prompt == pytest.approx({"a": 8 / 3, "b": 8 / 3, "c": 8 / 3})  # each weighs the mean count
    assert w.sum() == pytest.approx(len(ids))  # the total weight is the number of responses
    assert prompt_weights(ids, "rollouts").tolist() == [1.0] * 8
    uniform = prompt_weights([p for p in "abcd" for _ in range(8)], "equal")
    assert uniform.dtype == np.float64 and (uniform == 1.0).all()  # exactly 1: the plain loss, bit for bit
    assert prompt_weights([], "equal").size == 0
    with pytest.raises(ValueError, match="prompt weight mode"):
        prompt_weights(ids, "tokens")
    assert weighted_denominator([3, 5], [0.5, 2.0], "token-mean") == 11.5
    assert weighted_denominator([3, 5], [0.5, 2.0], "seq-mean-token-mean") == 2.5
    assert weighted_denominator([], [], "token-mean") == 1.0


def test_equal_weights_are_refused_where_they_would_not_weight_the_loss():
    assert load_run_config(CPU_DEFAULT, ["dynamo.loss.prompt_weight=equal"]).dynamo.loss.prompt_weight == "equal"
    for algo in ("entropy_adv", "kl_cov", "entropy_loss", "fork_tokens"):
        with pytest.raises(ConfigError, match="dynamo.loss.prompt_weight: must be rollouts unless loss.name is one of"):
            load_run_config(CPU_DEFAULT, ["dynamo.loss.prompt_weight=equal"], algo=algo)
    with pytest.raises(ConfigError, match="entropy_coef"):
        load_run_config(CPU_DEFAULT, ["dynamo.loss.prompt_weight=equal", "dynamo.loss.entropy_coef=0.01"])
    with pytest.raises(ConfigError, match="dynamo.loss.prompt_weight: must be one of"):
        load_run_config(CPU_DEFAULT, ["dynamo.loss.prompt_weight=tokens"])


def _samples(vocab: int, equal_counts: bool = False):
    """Seven responses: prompt p0 four, p1 two, p2 one (or 7 prompts of one each with ``equal_counts``)."""
    from megatron_dynamo.trainer.batch import Sample

    prompts = [f"p{i}" for i in range(7)] if equal_counts else ["p0", "p0", "p1", "p0", "p2", "p1", "p0"]
    g = torch.Generator().manual_seed(4)
    return [Sample(i, prompts[i], tuple(torch.randint(1, vocab, (3 + i % 3,), generator=g).tolist()),
                   tuple(torch.randint(1, vocab, (2 + i,), generator=g).tolist()), reward=float(i % 2),
                   advantage=[1.2, -0.4, 0.7, -1.1, 0.3, 0.9, -0.6][i]) for i in range(7)]


PLANS = {
    "rows64": ["trainer.micro_batch_size=64", "trainer.micro_batch_tokens=0", "trainer.pack_sequences=false"],
    "rows1": ["trainer.micro_batch_size=1", "trainer.micro_batch_tokens=0", "trainer.pack_sequences=false"],
    "tokens12": ["trainer.micro_batch_tokens=12", "trainer.pack_sequences=false"],
    "packed_tokens40": ["trainer.micro_batch_tokens=40", "trainer.pack_sequences=true"],
}


def _worker(rank, world_size, parallel, cases):
    """Per (plan, prompt weight, equal counts?): one update's summed micro-batch loss and gradients, as the trainer
    makes it (the samples' weights from prompt_weights, the weighted global denominator), and per sample the token
    log-probs and the perturbed old ones (for the independent reference)."""
    from dataclasses import replace

    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig
    from megatron_dynamo.trainer.policy_loss import dynamo_loss_fn
    from megatron_dynamo.trainer.policy_loss import global_denominator

    from hf_reference import hf_state_dict
    from samples import micro_batches_with_old_logp

    runtime.init_distributed(runtime.ParallelConfig(**parallel), seed=0)
    from megatron.core import parallel_state as ps

    actor = MegatronActor(TINY_QWEN2, optim=OptimConfig(lr=1e-3, clip_grad=0.0),
                          hf_weights=hf_state_dict(TINY_QWEN2).__getitem__)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    out = {}
    for plan, mode, equal_counts in cases:
        run = load_run_config(CPU_DEFAULT, PLANS[plan] + [f"dynamo.loss.prompt_weight={mode}"], algo="grpo")
        samples = _samples(actor.arch.vocab_size, equal_counts)
        weights = prompt_weights([s.prompt_id for s in samples], mode)
        samples = [replace(s, loss_weight=float(w)) for s, w in zip(samples, weights)]
        updater, micro, stats, old = micro_batches_with_old_logp(run, actor, samples, last_stage=last)
        loss_fn = dynamo_loss_fn(run.dynamo.modulation, run.dynamo.loss, None,
                                 global_denominator(samples, run.dynamo.loss.loss_agg_mode), run.rollout.temperature)
        results = actor.forward_backward(micro, loss_fn, output=updater.model_output)
        out[plan, mode, equal_counts] = {
            "loss": sum(float(r["loss"]) for r in results) if last else None,
            "logp": {i: v["logp"].double() for i, v in stats.items()}, "old": {i: v.double() for i, v in old.items()},
            "grads": {n: p.main_grad.detach().clone() for n, p in actor.named_parameters()}}
        actor.zero_grad()
    return out


def _reference_loss(samples, weights, logp, old, clip=0.2, dual=3.0):
    """The weighted token mean of the dual-clipped PPO loss, in float64 from the definitions: every token of
    response i has weight w_i; sum_t w l_t / sum_t w."""
    total = norm = 0.0
    for s, w in zip(samples, weights):
        ratio = torch.exp(logp[s.index] - old[s.index])
        a = s.advantage
        loss = -torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
        if a < 0:
            loss = torch.minimum(loss, torch.full_like(loss, -dual * a))
        total += w * float(loss.sum())
        norm += w * s.num_response_tokens
    return total / norm


def _same(ref, got, name, grads=True):
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-8), name
    if grads:
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(got["grads"][param], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()),
                                       msg=f"{name} grad {param}")


CASES = [(plan, "equal", False) for plan in PLANS] + [("rows64", "rollouts", False), ("rows64", "equal", True),
                                                       ("rows64", "rollouts", True)]


@pytest.fixture(scope="module")
def one_rank():
    (out,) = run_on_ranks(_worker, 1, {}, CASES)
    return out


@pytest.mark.distributed
def test_equal_weights_loss_is_the_weighted_token_mean_at_every_layout(one_rank):
    ref = one_rank["rows64", "equal", False]
    samples = _samples(10)  # only the ids, lengths and advantages matter here (the tokens are the worker's)
    weights = prompt_weights([s.prompt_id for s in samples], "equal")
    expected = _reference_loss(samples, weights, ref["logp"], ref["old"])
    assert ref["loss"] == pytest.approx(expected, rel=1e-5)
    plain = one_rank["rows64", "rollouts", False]
    assert plain["loss"] == pytest.approx(_reference_loss(samples, np.ones(7), plain["logp"], plain["old"]), rel=1e-5)
    assert abs(plain["loss"] - ref["loss"]) > 1e-3 * abs(ref["loss"])  # the weights change the loss here
    for plan in PLANS:
        _same(ref, one_rank[plan, "equal", False], f"equal {plan}")
    # one response per prompt: every weight is exactly 1, the loss and gradients bit-identical to the plain ones
    a, b = one_rank["rows64", "equal", True], one_rank["rows64", "rollouts", True]
    assert a["loss"] == b["loss"] and all(torch.equal(a["grads"][n], g) for n, g in b["grads"].items())


@pytest.mark.distributed
def test_equal_weights_two_dp_ranks_match_one(one_rank):
    cases = [("packed_tokens40", "equal", False), ("tokens12", "equal", False)]
    first, second = run_on_ranks(_worker, 2, {}, cases)
    for case in cases:
        merged = {"loss": first[case]["loss"] + second[case]["loss"], "grads": first[case]["grads"]}
        _same(one_rank["rows64", "equal", False], merged, f"dp2 {case}")


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}], ids=["tp2", "pp2"])
def test_equal_weights_tensor_and_pipeline_parallel_give_the_same_loss(one_rank, parallel):
    ranks = run_on_ranks(_worker, 2, parallel, [("rows64", "equal", False)])
    _same(one_rank["rows64", "equal", False], ranks[-1]["rows64", "equal", False], f"{parallel}", grads=False)
