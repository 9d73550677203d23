"""The baselines give the same update at every layout: micro-batch plans (rows, token budgets, packing), DP2,
TP2 and PP2, with the real Megatron actor on CPU. Fork Tokens', Clip-COV's and KL-COV's selections are made over the
whole mini-batch (trainer/token_selection.py), so they must come out identical token for token, and the loss (and,
where the parameters are not sharded, every gradient) must match the one-rank, one-micro-batch reference."""

from __future__ import annotations

import pytest
import torch

from hf_reference import REPO, TINY_QWEN2
from multiproc import run_on_ranks
from samples import micro_batches_with_old_logp, random_samples

CPU_DEFAULT = f"{REPO}/configs/cpu_default.yaml"
# Parameters that make the selections non-trivial on ~60 tokens (the defaults select one token of a few hundred).
SMALL_BATCH = ["dynamo.loss.clip_cov_ratio=0.2", "dynamo.loss.clip_cov_lb=0.05", "dynamo.loss.kl_cov_ratio=0.2"]
SELECTING = ("fork_tokens", "clip_cov", "kl_cov")
ALL = ("clip_higher", "entropy_loss", "fork_tokens", "entropy_adv", "clip_cov", "kl_cov", "w_reinforce")
PLANS = {
    "rows64": ["trainer.micro_batch_size=64", "trainer.micro_batch_tokens=0", "trainer.pack_sequences=false"],
    "rows1": ["trainer.micro_batch_size=1", "trainer.micro_batch_tokens=0", "trainer.pack_sequences=false"],
    "packed_tokens40": ["trainer.micro_batch_tokens=40", "trainer.pack_sequences=true"],
}


def _worker(rank, world_size, parallel, cases):
    """For each (algorithm, plan): one update from the same weights, as the trainer makes it: old-policy token
    stats, the mini-batch selection, the loss and the gradients. Returns per case the selection per sample (last
    stage), the summed micro-batch losses and the gradients."""
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig
    from megatron_dynamo.trainer.batch import gather_token_values
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.policy_loss import dynamo_loss_fn
    from megatron_dynamo.trainer.token_selection import scatter_selections

    from hf_reference import hf_state_dict

    runtime.init_distributed(runtime.ParallelConfig(**parallel), seed=0)
    from megatron.core import parallel_state as ps

    actor = MegatronActor(TINY_QWEN2, optim=OptimConfig(lr=1e-3, clip_grad=0.0),
                          hf_weights=hf_state_dict(TINY_QWEN2).__getitem__)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    dp_group = ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None
    samples = random_samples(actor.arch.vocab_size, seed=11, count=7)
    out = {}
    for algo, plan in cases:
        run = load_run_config(CPU_DEFAULT, PLANS[plan] + SMALL_BATCH, algo=algo)
        updater, micro, stats, old = micro_batches_with_old_logp(run, actor, samples, last_stage=last)
        pre_update = {i: {"logp": old[i], "entropy": v["entropy"]} for i, v in stats.items()}
        scatter_selections(run.dynamo.loss, [(samples, micro)], pre_update, last, dp_group, seed=5, step=2)
        tokens = float(sum(s.num_response_tokens for s in samples))  # token-mean: the mini-batch's tokens
        loss_fn = dynamo_loss_fn(run.dynamo.modulation, run.dynamo.loss, None, tokens, run.rollout.temperature)
        results = actor.forward_backward(micro, loss_fn, output=updater.model_output)
        selection = {}
        if last and micro[0].selection is not None:
            for mb in micro:
                selection.update(gather_token_values(mb, mb.selection))
        out[algo, plan] = {"selection": selection, "loss": sum(float(r["loss"]) for r in results) if last else None,
                           "grads": {n: p.main_grad.detach().clone() for n, p in actor.named_parameters()}}
        actor.zero_grad()
    return out


def _same(ref, got, name, grads=True):
    assert got["selection"].keys() == ref["selection"].keys(), name
    for index, chosen in ref["selection"].items():
        assert torch.equal(got["selection"][index], chosen), f"{name}: selection of sample {index}"
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-7), name
    if grads:
        for param, grad in ref["grads"].items():
            torch.testing.assert_close(got["grads"][param], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()),
                                       msg=f"{name} grad {param}")


@pytest.fixture(scope="module")
def reference():
    (out,) = run_on_ranks(_worker, 1, {}, [(algo, plan) for algo in ALL for plan in PLANS])
    return out


@pytest.mark.distributed
def test_every_micro_batch_plan_gives_the_same_selection_loss_and_gradients(reference):
    for algo in ALL:
        ref = reference[algo, "rows64"]
        assert ref["loss"] != 0, algo
        if algo in SELECTING:
            chosen = torch.cat(list(ref["selection"].values()))
            assert 0 < int((chosen > 0).sum()) < chosen.numel(), algo  # a real choice, not all or nothing
        else:
            assert ref["selection"] == {}, algo
        for plan in PLANS:
            _same(ref, reference[algo, plan], f"{algo} {plan}")


@pytest.mark.distributed
@pytest.mark.timeout(1800)  # with the reference fixture: 16 min on the 2-core machine under a load of ~70
def test_two_data_parallel_ranks_match_one(reference):
    cases = [(algo, "packed_tokens40") for algo in ALL]
    first, second = run_on_ranks(_worker, 2, {}, cases)
    for case in cases:
        a, b = first[case], second[case]
        # every DP rank holds the whole mini-batch's selection of its own samples; the loss splits over the ranks,
        # the gradients are summed (finalize_model_grads)
        merged = {"selection": {**a["selection"], **b["selection"]}, "loss": a["loss"] + b["loss"],
                  "grads": a["grads"]}
        _same(reference[case[0], "rows64"], merged, f"dp2 {case}")


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [{"tensor_parallel": 2}, pytest.param({"pipeline_parallel": 2}, marks=pytest.mark.extended)],
                         ids=["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_give_the_same_selection_and_loss(reference, parallel):
    cases = [(algo, "rows64") for algo in SELECTING]
    ranks = run_on_ranks(_worker, 2, parallel, cases)
    last = ranks[-1]  # TP: both ranks hold the loss; PP: the last stage does
    for case in cases:
        _same(reference[case], last[case], f"{parallel} {case}", grads=False)
        if "tensor_parallel" in parallel:
            _same(reference[case], ranks[0][case], f"{parallel} {case} rank 0", grads=False)
