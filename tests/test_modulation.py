"""Token-level advantage modulation (eqs. 3-4, Theorem 1) against a float64 reference written from the equations;
independence from the micro-batch split and from the data-parallel size (gloo)."""

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_dynamo.algorithms import (
    ModulationConfig,
    ModulationInputs,
    PolicyLossConfig,
    beta_comp,
    beta_stab,
    delta_h_exact,
    delta_h_sequence_mean,
    group_advantages,
    modulate_advantages,
    modulation_scope,
    policy_ratio,
    ppo_clip_loss,
    ppo_clip_mask,
)
from multiproc import run_on_ranks

LOSS_CFG = PolicyLossConfig(clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0)


def make_batch(seed=0, batch=8, length=12, vocab=11, dtype=torch.float64):
    """Logits, sampled tokens and everything the modulation needs, computed from the full vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen, dtype=torch.float64) * 2.5
    logits[0, :3] *= 6  # a few very confident tokens (low entropy)
    tokens = torch.randint(0, vocab, (batch, length), generator=gen)
    logprobs = torch.log_softmax(logits, -1)
    probs = logprobs.exp()
    entropy = -(probs * logprobs).sum(-1)
    lam = logprobs + entropy.unsqueeze(-1)  # Lambda_j = log pi_j + H
    sum_pi2_lambda = (probs * probs * lam).sum(-1)
    logp = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    old_logp = logp + (torch.rand(batch, length, generator=gen, dtype=torch.float64) - 0.5) * 0.8
    prompt_ids = [f"q{i % 3}" for i in range(batch)]
    rewards = torch.randint(0, 2, (batch,), generator=gen).double()
    advantages = group_advantages(rewards, prompt_ids)
    lengths = torch.randint(3, length + 1, (batch,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    ratio = policy_ratio(logp, old_logp)
    clipped = ppo_clip_mask(ratio, advantages, LOSS_CFG.clip_low, LOSS_CFG.clip_high, LOSS_CFG.clip_ratio_c)
    fields = dict(advantages=advantages, entropy=entropy, logp=logp, sum_pi2_lambda=sum_pi2_lambda, ratio=ratio,
                  clipped_mask=clipped, mask=mask)
    fields = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in fields.items()}
    return fields, dict(logits=logits, tokens=tokens, old_logp=old_logp)


def reference_modulation(fields, raw, cfg, seq_mean=False):
    """A_final from eqs. 3, 4, 12 and 14, token by token in Python floats, vocabulary sums done explicitly."""
    logits, tokens = raw["logits"].numpy(), raw["tokens"].numpy()
    adv, mask, clipped = fields["advantages"].double().numpy(), fields["mask"].numpy(), fields["clipped_mask"].numpy()
    ratio = fields["ratio"].double().numpy()
    batch, length, _ = logits.shape
    H, dH = np.zeros((batch, length)), np.zeros((batch, length))
    own = np.zeros((batch, length))
    vocab_sum = np.zeros((batch, length))
    for b in range(batch):
        for t in range(length):
            z = logits[b, t]
            p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            H[b, t] = -sum(pj * math.log(pj) for pj in p)
            lam = [math.log(pj) + H[b, t] for pj in p]
            a = tokens[b, t]
            own[b, t] = p[a] * lam[a]
            vocab_sum[b, t] = sum(pj * pj * lj for pj, lj in zip(p, lam))
    for b in range(batch):
        seq_mean_own = own[b][mask[b]].mean()
        for t in range(length):
            xi = 0.0 if clipped[b, t] else ratio[b, t] * adv[b]
            dH[b, t] = -xi * (own[b, t] - (seq_mean_own if seq_mean else vocab_sum[b, t]))
    valid = mask
    h_min, h_max = H[valid].min(), H[valid].max()
    xi_max = np.abs(dH[valid]).max()
    out = np.zeros((batch, length))
    for b in range(batch):
        for t in range(length):
            comp = 1 + cfg.alpha * (h_max - H[b, t]) / (h_max - h_min) if (cfg.gc and adv[b] > 0) else 1.0
            x = abs(dH[b, t]) / xi_max
            stab = cfg.lambda_min + (1 - cfg.lambda_min) / (1 + math.exp(cfg.gamma * (x - cfg.tau)))
            stab = stab if (cfg.ums and valid[b, t]) else 1.0
            out[b, t] = adv[b] * comp * stab
    return out, H, dH


def call_modulate(fields, cfg, scope=None, group=None, seq_ids=None):
    return modulate_advantages(fields["advantages"], fields["entropy"], fields["logp"], fields["sum_pi2_lambda"],
                               fields["ratio"], fields["clipped_mask"], fields["mask"], seq_ids=seq_ids, cfg=cfg,
                               scope=scope, group=group)


@pytest.mark.parametrize("delta_h", ["exact", "sequence_mean"])
@pytest.mark.parametrize("gc, ums", [(True, True), (True, False), (False, True)])
def test_modulate_matches_float64_reference(delta_h, gc, ums):
    fields, raw = make_batch()
    cfg = ModulationConfig(gc=gc, ums=ums, delta_h=delta_h)
    got, stats = call_modulate(fields, cfg)
    want, H, dH = reference_modulation(fields, raw, cfg, seq_mean=(delta_h == "sequence_mean"))
    valid = fields["mask"].numpy()
    np.testing.assert_allclose(got.numpy()[valid], want[valid], rtol=1e-10, atol=1e-12)
    assert stats["modulation/h_min"].item() == pytest.approx(H[valid].min(), rel=1e-12)
    assert stats["modulation/h_max"].item() == pytest.approx(H[valid].max(), rel=1e-12)
    if ums:
        assert stats["modulation/xi_max"].item() == pytest.approx(np.abs(dH[valid]).max(), rel=1e-10)
    # float32 inputs give the same within float32 precision
    fields32, _ = make_batch(dtype=torch.float32)
    got32, _ = call_modulate(fields32, cfg)
    assert got32.dtype == torch.float32
    np.testing.assert_allclose(got32.numpy()[valid], want[valid], rtol=2e-4, atol=2e-5)


def test_the_factors_actually_modulate():
    fields, _ = make_batch()
    got, stats = call_modulate(fields, ModulationConfig())
    valid = fields["mask"]
    token_adv = fields["advantages"].unsqueeze(-1).expand_as(got)
    scale = (got / token_adv)[valid & (token_adv != 0)]
    assert scale.min() < 0.7 and scale.max() > 1.1  # damped and boosted tokens both present
    assert stats["modulation/beta_comp_mean_pos"] > 1 and stats["modulation/beta_stab_min"] >= 0.6


def test_the_factor_spread_is_its_10th_and_90th_percentile():
    fields, _ = make_batch()
    fields["advantages"] = fields["advantages"] + 0.25  # no A = 0: every token's factor is A_final / A
    got, stats = call_modulate(fields, ModulationConfig())
    token_adv = fields["advantages"].unsqueeze(-1).expand_as(got)
    scale = (got / token_adv)[fields["mask"]].numpy()
    assert (fields["advantages"] != 0).all() and scale.min() < 0.9 and scale.max() > 1.1
    assert stats["modulation/scale_p10"].item() == pytest.approx(np.percentile(scale, 10), rel=1e-9)
    assert stats["modulation/scale_p90"].item() == pytest.approx(np.percentile(scale, 90), rel=1e-9)
    assert stats["modulation/scale_p10"] < stats["modulation/scale_mean"] < stats["modulation/scale_p90"]


def test_all_switches_off_is_plain_grpo():
    fields, _ = make_batch()
    got, stats = call_modulate(fields, ModulationConfig(gc=False, ums=False))
    assert torch.equal(got, fields["advantages"].unsqueeze(-1).expand_as(got)) and stats == {}


@pytest.mark.parametrize("ums", [False, True])
def test_pos_weight_is_gcs_cap_on_every_positive_token(ums):
    """The control for GC (issue 32): every A > 0 token x (1 + alpha), whatever its entropy; the rest as without GC.
    It equals GC exactly where every positive token sits at the scope's H_min, and nowhere else."""
    fields, raw = make_batch()
    cfg = ModulationConfig(gc=False, ums=ums, pos_weight=True, alpha=0.3)
    got, stats = call_modulate(fields, cfg)
    plain, _ = call_modulate(fields, ModulationConfig(gc=False, ums=ums))
    token_adv = fields["advantages"].unsqueeze(-1).expand_as(got)
    valid = fields["mask"]
    positive = valid & (token_adv > 0)
    if ums:  # plain is A x beta_stab; the positive tokens get 1.3 on top
        assert torch.allclose(got[positive], 1.3 * plain[positive], rtol=1e-12)
    else:
        assert torch.equal(got[positive], 1.3 * token_adv[positive])
        assert torch.equal(got[valid & ~positive], token_adv[valid & ~positive])
    assert stats["modulation/beta_comp_mean_pos"].item() == pytest.approx(1.3)
    gc, _ = call_modulate(fields, ModulationConfig(gc=True, ums=ums))
    assert not torch.allclose(gc[positive], got[positive])  # GC follows the entropy here
    # all positive tokens at H_min: GC's factor is its cap, pos_weight is GC
    flat = dict(fields, entropy=torch.where(token_adv > 0, fields["entropy"][valid].min(), fields["entropy"]))
    assert torch.allclose(call_modulate(flat, ModulationConfig(gc=True, ums=ums))[0][valid],
                          call_modulate(flat, cfg)[0][valid], rtol=1e-12)
    with pytest.raises(ValueError, match="pos_weight must be false with gc true"):
        ModulationConfig(gc=True, pos_weight=True).validate()
    assert not ModulationConfig(gc=False, ums=False).enabled and cfg.enabled


def test_delta_h_exact_is_the_first_order_entropy_change():
    # Move the logits as Lemma 1 says, z' = z + eta xi (e_a - pi), and compare H(z') - H(z) with eta * Delta H.
    fields, raw = make_batch()
    eta = 1e-6
    logits, tokens = raw["logits"], raw["tokens"]
    dh = delta_h_exact(fields["logp"], fields["entropy"], fields["sum_pi2_lambda"], fields["ratio"],
                       fields["advantages"], fields["clipped_mask"])
    xi = torch.where(fields["clipped_mask"], 0.0, fields["ratio"] * fields["advantages"].unsqueeze(-1))
    probs = logits.softmax(-1)
    step = eta * xi.unsqueeze(-1) * (torch.nn.functional.one_hot(tokens, logits.shape[-1]) - probs)

    def entropy(z):
        logprobs = z.log_softmax(-1)
        return -(logprobs.exp() * logprobs).sum(-1)

    finite_difference = (entropy(logits + step) - entropy(logits)) / eta
    torch.testing.assert_close(dh, finite_difference, rtol=1e-4, atol=1e-8)
    assert (dh.abs() > 1e-3).any()


def test_beta_comp_and_beta_stab_edge_cases():
    entropy = torch.tensor([[0.5, 1.0, 2.0, 0.5]])
    advantages = torch.tensor([[1.0, -1.0, 1.0, 0.0]])
    # (H_max - H) / (H_max - H_min) = 1, -, 0, - ; only A > 0 is compensated (A = 0 counts as A <= 0)
    torch.testing.assert_close(beta_comp(entropy, advantages, alpha=0.3), torch.tensor([[1.3, 1.0, 1.0, 1.0]]))
    # H_max == H_min: no division by zero, factor 1
    assert torch.equal(beta_comp(torch.ones(1, 3), torch.ones(1, 3), h_min=1.0, h_max=1.0), torch.ones(1, 3))
    # masked tokens get 1
    assert beta_comp(entropy, advantages, torch.tensor([[False, True, True, True]]))[0, 0] == 1
    # xi_max == 0: x = 0 for every token
    f0 = 0.6 + 0.4 / (1 + math.exp(5 * (0 - 0.5)))
    torch.testing.assert_close(beta_stab(torch.zeros(4), 0.0), torch.full((4,), f0))
    xi = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    want = [0.6 + 0.4 / (1 + math.exp(5 * (x - 0.5))) for x in (0.0, 0.5, 1.0)]
    torch.testing.assert_close(beta_stab(xi), torch.tensor(want, dtype=torch.float64))
    assert beta_stab(xi)[1].item() == pytest.approx(0.8)  # f(tau) = (1 + lambda_min) / 2


def test_factors_are_detached():
    fields, _ = make_batch()
    entropy = fields["entropy"].clone().requires_grad_(True)
    got, _ = modulate_advantages(fields["advantages"], entropy, fields["logp"].clone().requires_grad_(True),
                                 fields["sum_pi2_lambda"], fields["ratio"], fields["clipped_mask"], fields["mask"])
    assert not got.requires_grad


@pytest.mark.parametrize("delta_h", ["exact", "sequence_mean"])
def test_one_micro_batch_equals_four(delta_h):
    cfg = ModulationConfig(delta_h=delta_h)
    fields, _ = make_batch(seed=1, dtype=torch.float32)
    full, _ = call_modulate(fields, cfg)
    splits = [torch.arange(0, 1), torch.arange(1, 4), torch.arange(4, 6), torch.arange(6, 8)]
    micro = [{k: v[rows] for k, v in fields.items()} for rows in splits]
    scope = modulation_scope([ModulationInputs(**m) for m in micro], cfg)
    parts = [call_modulate(m, cfg, scope=scope)[0] for m in micro]
    assert torch.equal(torch.cat(parts), full)  # bit-identical
    # the reference code's per-micro-batch normalisation gives something else (so this test can fail)
    local = torch.cat([call_modulate(m, cfg)[0] for m in micro])
    assert not torch.allclose(local, full)


def test_packed_layout_with_seq_ids_equals_rows():
    fields, _ = make_batch(seed=2)
    valid = fields["mask"]
    for delta_h in ("exact", "sequence_mean"):
        cfg = ModulationConfig(delta_h=delta_h)
        rows, _ = call_modulate(fields, cfg)
        seq_ids = torch.arange(valid.shape[0]).unsqueeze(-1).expand_as(valid)[valid].unsqueeze(0) * 7 + 3
        packed = {k: (v.unsqueeze(-1).expand_as(valid) if k == "advantages" else v)[valid].unsqueeze(0)
                  for k, v in fields.items()}
        got, _ = call_modulate(packed, cfg, seq_ids=seq_ids)
        torch.testing.assert_close(got[0], rows[valid], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="seq_ids"):
        delta_h_sequence_mean(fields["logp"][valid], fields["entropy"][valid], fields["ratio"][valid],
                              torch.ones(int(valid.sum()), dtype=torch.float64), None, valid[valid])


def test_missing_inputs_are_named():
    fields, _ = make_batch()
    with pytest.raises(ValueError, match="sum_pi2_lambda"):
        modulate_advantages(fields["advantages"], fields["entropy"], fields["logp"], None, fields["ratio"],
                            fields["clipped_mask"], fields["mask"])
    # UMS off needs neither log-probs nor the ratio
    modulate_advantages(fields["advantages"], fields["entropy"], None, None, None, None, fields["mask"],
                        cfg=ModulationConfig(ums=False))


@pytest.mark.parametrize("kwargs, field", [
    (dict(alpha=-0.1), "alpha"), (dict(gamma=0.0), "gamma"), (dict(tau=float("inf")), "tau"),
    (dict(lambda_min=1.5), "lambda_min"), (dict(delta_h="approx"), "delta_h"), (dict(gc="yes"), "gc"),
])
def test_modulation_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ModulationConfig(**kwargs).validate()
    cfg = ModulationConfig()
    assert (cfg.alpha, cfg.gamma, cfg.tau, cfg.lambda_min, cfg.delta_h) == (0.3, 5.0, 0.5, 0.6, "exact")


# --------------------------------------------------------------------------------------------------------------
# DP=1 vs DP=2: advantages -> scope (reduced over the group) -> modulation -> loss with the global denominator.


def _train_step_shard(fields, raw, rows, cfg, scope_group, global_tokens, micro_splits):
    """Modulate and take the loss gradient of ``rows`` (this rank's share) in the given micro-batches."""
    shard = {k: v[rows] for k, v in fields.items()}
    old_logp = raw["old_logp"][rows]
    micro = [{k: v[m] for k, v in shard.items()} for m in micro_splits]
    scope = modulation_scope([ModulationInputs(**m) for m in micro], cfg, group=scope_group)
    logp = shard["logp"].clone().requires_grad_(True)
    finals, loss_total = [], 0.0
    for m, part in zip(micro_splits, micro):
        final, _ = call_modulate(part, cfg, scope=scope)
        out = ppo_clip_loss(logp[m], old_logp[m], final, part["mask"], LOSS_CFG, global_denominator=global_tokens)
        out.loss.backward()
        finals.append(final)
        loss_total += out.loss.item()
    return torch.cat(finals), logp.grad, loss_total


def _dp_worker(rank, world_size):
    cfg = ModulationConfig()
    fields, raw = make_batch(seed=4, batch=10)
    global_tokens = int(fields["mask"].sum())
    rows = torch.arange(rank, 10, world_size)  # interleaved shards: 5 rows each
    final, grad, loss = _train_step_shard(fields, raw, rows, cfg, dist.group.WORLD, global_tokens,
                                          [torch.arange(0, 2), torch.arange(2, 5)])
    return rows, final, grad, loss


@pytest.mark.distributed
def test_dp2_equals_dp1():
    cfg = ModulationConfig()
    fields, raw = make_batch(seed=4, batch=10)
    global_tokens = int(fields["mask"].sum())
    all_rows = torch.arange(10)
    final_1, grad_1, loss_1 = _train_step_shard(fields, raw, all_rows, cfg, None, global_tokens, [all_rows])
    results = run_on_ranks(_dp_worker, 2)
    final_2, grad_2 = torch.empty_like(final_1), torch.empty_like(grad_1)
    for rows, final, grad, _ in results:
        final_2[rows], grad_2[rows] = final, grad
    assert torch.equal(final_2, final_1)
    torch.testing.assert_close(grad_2, grad_1, rtol=1e-12, atol=1e-15)  # gradients summed over ranks
    assert sum(r[3] for r in results) == pytest.approx(loss_1, rel=1e-12)
    # without the all-reduce each rank would normalise by its own shard: different (so this test can fail)
    shard0, _ = call_modulate({k: v[results[0][0]] for k, v in fields.items()}, cfg)
    assert not torch.allclose(shard0, final_1[results[0][0]])
