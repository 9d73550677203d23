"""Micro-batch layouts (issue 15): token-budget plans, packed sequences, and the real Megatron actor on CPU.

Plan properties (hypothesis): every sample lands in exactly one micro-batch of one rank; a micro-batch stays within
the token budget unless it holds a single longer sequence; the plan depends only on the inputs; the DP ranks' token
loads differ by at most the longest sequence; every rank runs the same number of micro-batches.

The real actor (tiny Qwen2, gloo on CPU): the per-token log-probs, the loss and the parameter gradients of one
update through ``PolicyUpdater.micro_batches_for``, the forward-only token-stats pass and the DynaMO loss are the same
for micro-batches of 1 and 64 sequences, token budgets below, between and above the sequence lengths, and packed
sequences on the local spec; and with two DP ranks, one of which gets no sample.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_reference import REPO, TINY_QWEN2
from samples import micro_batches_with_old_logp
from multiproc import run_on_ranks
from megatron_dynamo.trainer.actor import block_causal_mask, pad_micro_batches
from megatron_dynamo.trainer.batch import (Sample, balance_over_ranks, build_micro_batches, gather_token_values,
                                           make_micro_batches, micro_batch_cost, packed_micro_batch,
                                           plan_micro_batches, plan_token_micro_batches, resolve_pack_sequences,
                                           sequence_length, token_values)
from megatron_dynamo.trainer.policy_loss import response_positions

CPU_DEFAULT = f"{REPO}/configs/cpu_default.yaml"


# ---------------------------------------------------------------------------------------------- plans
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), max_size=60), st.integers(1, 8))
def test_rank_split_is_complete_deterministic_and_balanced(lengths, ranks):
    shares = balance_over_ranks(lengths, ranks)
    assert len(shares) == ranks
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    assert balance_over_ranks(list(lengths), ranks) == shares
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(lengths, default=0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 300), max_size=60), st.integers(1, 1200), st.booleans(), st.sampled_from([1, 2, 4]))
def test_micro_batch_plan_respects_the_budget(lengths, budget, packed, multiple):
    bins = plan_micro_batches(lengths, budget, packed, multiple)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b for b in bins)
    for b in bins:
        cost = micro_batch_cost([lengths[i] for i in b], packed, multiple)
        assert cost <= budget or len(b) == 1, (b, cost)
    assert plan_micro_batches(list(lengths), budget, packed, multiple) == bins
    if not packed:
        # Longest first, consecutive runs: similar lengths share a micro-batch.
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        assert [i for b in bins for i in b] == order


def _random_samples(seed: int, count: int, vocab: int = 128) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        prompt = torch.randint(1, vocab, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(1, vocab, (int(torch.randint(1, 16, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(i, f"p{i % 3}", tuple(prompt), tuple(response), reward=float(i % 2),
                          advantage=float(torch.randn((), generator=g))))
    return out


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 40), st.integers(1, 5), st.integers(1, 80), st.booleans())
def test_step_plan_gives_every_rank_the_same_count_and_every_sample_once(seed, count, ranks, budget, packed):
    samples = _random_samples(seed, count)
    plan = plan_token_micro_batches(samples, ranks, budget, packed)
    assert len(plan) == ranks and len({len(p) for p in plan}) == 1 and len(plan[0]) >= 1
    assert sorted(s.index for p in plan for mb in p for s in mb) == list(range(count))
    for p in plan:
        for mb in p:
            assert len(mb) <= 1 or micro_batch_cost([sequence_length(s) for s in mb], packed) <= budget
    assert plan_token_micro_batches(list(samples), ranks, budget, packed) == plan


def test_pack_sequences_auto_means_transformer_engine_only():
    assert resolve_pack_sequences("auto", use_te=True) and not resolve_pack_sequences("auto", use_te=False)
    assert resolve_pack_sequences(True, use_te=False) and not resolve_pack_sequences(False, use_te=True)


# ---------------------------------------------------------------------------------------------- packed format
def _three():
    return [Sample(4, "a", (5, 6, 7), (8, 9), 1.0, 0.5), Sample(9, "b", (5,), (1, 2, 3), 0.0, -1.0),
            Sample(2, "a", (3, 4), (6,), 0.0, -0.5)]


def test_packed_micro_batch_layout():
    mb = packed_micro_batch(_three(), pad_token_id=0, seq_multiple=4)
    # Lengths 4, 3, 2 (prompt + response - 1): 9 tokens, a padding tail of 3 to a multiple of 4.
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 5, 1, 2, 3, 4, 0, 0, 0]]
    assert mb.labels.tolist() == [[6, 7, 8, 9, 1, 2, 3, 4, 6, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 0, 1, 2]]
    assert mb.token_row.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2, 2, -1, -1, -1]]
    assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.tolist() == [0, 4, 7, 9, 12]
    assert mb.advantages.tolist() == [0.5, -1.0, -0.5] and mb.sample_index.tolist() == [4, 9, 2]
    mask, seq_ids = response_positions(mb)
    assert seq_ids.tolist() == [0, 0, 1, 1, 1, 2] and mask.sum() == 6
    assert mb.advantages[seq_ids].tolist() == [0.5, 0.5, -1.0, -1.0, -1.0, -0.5]
    # No tail when the lengths fill the row exactly; an empty micro-batch is one padding segment.
    assert packed_micro_batch(_three(), 0).cu_seqlens.tolist() == [0, 4, 7, 9]
    empty = packed_micro_batch([], 0, seq_multiple=2)
    assert empty.cu_seqlens.tolist() == [0, 2] and empty.sample_index.numel() == 0
    assert empty.loss_mask.sum() == 0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_scatter_and_gather_token_values_round_trip(packed):
    samples = _three()
    (mb,) = build_micro_batches([samples], 0, packed=packed, fixed_shape=False)
    values = {s.index: torch.arange(s.num_response_tokens, dtype=torch.float32) + 10 * s.index for s in samples}
    mb.old_logp = token_values(mb, values)
    assert mb.old_logp.shape == mb.loss_mask.shape
    assert float(mb.old_logp[mb.loss_mask == 0].abs().sum()) == 0
    back = gather_token_values(mb, mb.old_logp)
    assert back.keys() == values.keys() and all(torch.equal(back[i], values[i]) for i in values)


def test_pipeline_padding_of_packed_micro_batches_adds_a_padding_segment():
    long = packed_micro_batch(_three(), 0)  # T = 9, no tail
    short = packed_micro_batch(_three()[1:], 0, seq_multiple=4)  # T = 8: 5 tokens and a tail of 3
    first, second = pad_micro_batches([long.tensors(), packed_micro_batch(_three()[:1], 0).tensors()])
    assert first["cu_seqlens"].tolist() == [0, 4, 7, 9]
    assert second["cu_seqlens"].tolist() == [0, 4, 9] and second["token_row"].tolist() == [[0] * 4 + [-1] * 5]
    _, padded = pad_micro_batches([long.tensors(), short.tensors()])
    assert padded["cu_seqlens"].tolist() == [0, 3, 5, 9]  # the existing tail extended
    assert padded["input_ids"].shape == (1, 9) and padded["loss_mask"][0, 5:].sum() == 0


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 5)[0, 0]
    allowed = ~mask
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    assert torch.equal(allowed, expected.bool())


def test_fixed_row_micro_batches_keep_their_shapes():
    samples = _random_samples(0, 5)
    micro = make_micro_batches(samples, 2, 0, num_micro_batches=4, fixed_shape=True)
    assert [mb.input_ids.shape[0] for mb in micro] == [2, 2, 2, 2]
    assert [mb.sample_index.tolist() for mb in micro][2:] == [[4, -1], [-1, -1]]
    # Token plans under pipeline parallelism: one shape for all of a rank's micro-batches.
    groups = plan_token_micro_batches(samples, 1, 30)[0]
    shapes = {tuple(mb.input_ids.shape) for mb in build_micro_batches(groups, 0, fixed_shape=True)}
    assert len(shapes) == 1 and len(groups) > 1
    packed = build_micro_batches(groups, 0, fixed_shape=True, packed=True)
    assert len({tuple(mb.input_ids.shape) for mb in packed}) == 1


def test_pipeline_token_plans_pad_only_to_one_shape_within_the_budget():
    # A 1000-token budget, one 999-token sequence and 39 of 50 tokens, padded, one shape (pipeline parallelism).
    # Binned first and padded afterwards this was 3 micro-batches of 20 x 999 tokens (20 times the budget).
    samples = [Sample(0, "p0", (1,) * 500, (2,) * 500, 1.0)]
    samples += [Sample(i, f"p{i}", (1,) * 25, (2,) * 26, 1.0) for i in range(1, 40)]
    assert [sequence_length(s) for s in samples[:2]] == [999, 50]
    groups = plan_token_micro_batches(samples, 1, 1000, fixed_shape=True)[0]
    micro = build_micro_batches(groups, 0, fixed_shape=True)
    assert [tuple(mb.input_ids.shape) for mb in micro] == [(1, 999)] * 40
    # Short sequences only: rows = budget // longest (rounded to seq_multiple), the last bin padded with empty rows.
    groups = plan_token_micro_batches(samples[1:], 1, 1000, fixed_shape=True, seq_multiple=4)[0]
    micro = build_micro_batches(groups, 0, fixed_shape=True, seq_multiple=4)
    assert [tuple(mb.input_ids.shape) for mb in micro] == [(19, 52)] * 3
    assert [int((mb.sample_index >= 0).sum()) for mb in micro] == [19, 19, 1]
    # Two DP ranks (each its own pipeline, its own shape): the 999-token rank 1 x 999, the other 20 x 50; the same
    # count of micro-batches on both (empty ones at the end), every sample once.
    plan = plan_token_micro_batches(samples, 2, 1000, fixed_shape=True)
    shapes = [{tuple(mb.input_ids.shape) for mb in build_micro_batches(share, 0, fixed_shape=True)}
              for share in plan]
    assert shapes == [{(1, 999)}, {(20, 50)}] and len(plan[0]) == len(plan[1]) == 11
    assert sorted(s.index for share in plan for g in share for s in g) == list(range(40))


# ---------------------------------------------------------------------------------------------- the real actor
# name: (config overrides, micro-batches expected on a rank of a DP=1 run of the 7 samples, or None)
LAYOUTS = {
    "rows1": (["trainer.micro_batch_size=1", "trainer.micro_batch_tokens=0", "trainer.pack_sequences=false"], 7),
    "rows64": (["trainer.micro_batch_size=64", "trainer.micro_batch_tokens=0", "trainer.pack_sequences=false"], 1),
    "tokens8": (["trainer.micro_batch_tokens=8", "trainer.pack_sequences=false"], 7),  # under every sequence
    "tokens40": (["trainer.micro_batch_tokens=40", "trainer.pack_sequences=false"], None),
    "tokens_huge": (["trainer.micro_batch_tokens=100000", "trainer.pack_sequences=false"], 1),
    "packed_rows3": (["trainer.micro_batch_size=3", "trainer.micro_batch_tokens=0", "trainer.pack_sequences=true"], 3),
    "packed_tokens40": (["trainer.micro_batch_tokens=40", "trainer.pack_sequences=true"], None),
    "packed_rows64": (["trainer.micro_batch_size=64", "trainer.micro_batch_tokens=0", "trainer.pack_sequences=true"],
                      1),
}


def _update_worker(rank, world_size, cases):
    """For each (layout, number of samples) of ``cases``: one DynaMO update from the same weights: old log-probs
    through the forward-only pass, the modulation scope, the loss and the gradients (summed over DP ranks by
    finalize_model_grads)."""
    from megatron_dynamo.algorithms.modulation import modulation_scope
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.policy_loss import dynamo_loss_fn, scope_inputs
    from megatron_dynamo.trainer.policy_loss import global_denominator

    from hf_reference import hf_state_dict

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    from megatron.core import parallel_state as ps

    actor = MegatronActor(TINY_QWEN2, optim=OptimConfig(lr=1e-3, clip_grad=0.0),
                          hf_weights=hf_state_dict(TINY_QWEN2).__getitem__)
    out = {}
    for name, num_samples in cases:
        samples = _random_samples(3, num_samples)
        run = load_run_config(CPU_DEFAULT, LAYOUTS[name][0])
        updater, micro, stats, _ = micro_batches_with_old_logp(run, actor, samples)
        modulation, loss_cfg = run.dynamo.modulation, run.dynamo.loss
        group = ps.get_data_parallel_group() if world_size > 1 else None
        scope = modulation_scope([scope_inputs(mb, stats, loss_cfg) for mb in micro], modulation, group=group)
        loss_fn = dynamo_loss_fn(modulation, loss_cfg, scope, global_denominator(samples, loss_cfg.loss_agg_mode),
                                 run.rollout.temperature)
        results = actor.forward_backward(micro, loss_fn, output=updater.model_output)
        out[name, num_samples] = {"micro": len(micro), "packed": [mb.cu_seqlens is not None for mb in micro],
                     "logp": {i: v["logp"] for i, v in stats.items()},
                     "loss": sum(float(r["loss"]) for r in results),
                     "grads": {n: p.main_grad.detach().clone() for n, p in actor.named_parameters()}}
        actor.zero_grad()
    return out


def _assert_same_update(ref, other, name):
    # fp32, different summation orders (and RoPE offsets when packed): log-probs agree to an ulp or two (measured
    # <= 1e-6); the loss and the gradients, sums of terms of both signs, to ~2e-5 of their scale (measured).
    for index, logp in ref["logp"].items():
        torch.testing.assert_close(other["logp"][index], logp, rtol=1e-5, atol=1e-5, msg=f"{name} logp {index}")
    assert other["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-7), name
    for param, grad in ref["grads"].items():
        torch.testing.assert_close(other["grads"][param], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()),
                                   msg=f"{name} grad {param}")


DP2_CASES = [("tokens40", 7), ("packed_tokens40", 7), ("packed_rows3", 7), ("tokens40", 1), ("packed_rows3", 1)]


@pytest.fixture(scope="module")
def dp1_updates():
    (updates,) = run_on_ranks(_update_worker, 1, [(name, 7) for name in LAYOUTS] + DP2_CASES[3:])
    return updates


@pytest.mark.distributed
def test_every_micro_batch_layout_gives_the_same_update(dp1_updates):
    full = {name: dp1_updates[name, 7] for name in LAYOUTS}
    ref = full["rows64"]
    assert ref["loss"] != 0 and all(float(g.abs().max()) > 0 for g in ref["grads"].values())
    for name, (_, expected) in LAYOUTS.items():
        got = full[name]
        if expected is not None:
            assert got["micro"] == expected, name
        assert all(got["packed"]) == name.startswith("packed") and any(got["packed"]) == name.startswith("packed")
        _assert_same_update(ref, got, name)
    assert 1 < full["tokens40"]["micro"] < 7 and full["packed_tokens40"]["micro"] <= full["tokens40"]["micro"]


@pytest.mark.distributed
def test_two_dp_ranks_with_token_budgets_and_packing_match_one(dp1_updates):
    dp2 = run_on_ranks(_update_worker, 2, DP2_CASES)
    for case in DP2_CASES:
        first, second = dp2[0][case], dp2[1][case]
        # Both ranks run the same number of micro-batches; with one sample, rank 1 has none (empty micro-batches).
        assert first["micro"] == second["micro"], case
        assert (second["logp"] == {}) == (case[1] == 1), case
        # The loss splits over the ranks; the gradients are summed (finalize_model_grads).
        merged = {**first, "loss": first["loss"] + second["loss"], "logp": {**first["logp"], **second["logp"]}}
        assert merged["logp"].keys() == dp1_updates[case]["logp"].keys()
        _assert_same_update(dp1_updates[case], merged, f"dp2 {case}")
