"""PPO-clip policy loss: separate clip bounds, dual clip, aggregation over micro-batches, KL k3, registry."""

import math

import pytest
import torch

from megatron_dynamo.algorithms import (
    PolicyLossConfig,
    PolicyLossOutput,
    compute_actor_loss,
    get_policy_loss,
    k3_kl,
    loss_agg,
    policy_ratio,
    ppo_clip_loss,
    ppo_clip_mask,
    register_policy_loss,
    registered_policy_losses,
)

CFG = PolicyLossConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)


def reference_token(logp, old_logp, adv, clip_low, clip_high, c):
    """Per-token loss and d loss / d logp from the PPO-clip equations, in Python floats (float64)."""
    r = math.exp(logp - old_logp)
    clipped_r = min(max(r, 1 - clip_low), 1 + clip_high)
    surrogate = min(r * adv, clipped_r * adv)
    if c is not None and adv < 0:
        surrogate = max(surrogate, c * adv)
    zero_grad = (adv > 0 and r > 1 + clip_high) or (adv < 0 and r < 1 - clip_low) or \
        (c is not None and adv < 0 and r > c)
    return -surrogate, (0.0 if zero_grad else -adv * r), zero_grad


def make_tokens(seed=0, batch=6, length=10, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(batch, length, generator=gen, dtype=dtype) * 3
    log_ratio = (torch.rand(batch, length, generator=gen, dtype=dtype) - 0.5) * 3  # ratios ~ 0.22 .. 4.5
    logp = old_logp + log_ratio
    advantages = torch.randn(batch, generator=gen, dtype=dtype)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    return logp, old_logp, advantages, mask


def test_ppo_clip_matches_float64_reference_loss_and_gradient():
    logp, old_logp, advantages, mask = make_tokens()
    logp = logp.clone().requires_grad_(True)
    out = ppo_clip_loss(logp, old_logp, advantages, mask, CFG)
    out.loss.backward()
    num_valid = int(mask.sum())
    ref_loss, ref_grad, ref_clipped = 0.0, torch.zeros_like(logp), torch.zeros_like(mask)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            loss, grad, clipped = reference_token(logp[b, t].item(), old_logp[b, t].item(), advantages[b].item(),
                                                  CFG.clip_low, CFG.clip_high, CFG.clip_ratio_c)
            ref_loss += loss / num_valid
            ref_grad[b, t] = grad / num_valid
            ref_clipped[b, t] = clipped
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-12)
    torch.testing.assert_close(logp.grad, ref_grad, rtol=1e-12, atol=1e-15)
    assert torch.equal(out.clipped_mask, ref_clipped)
    assert 0 < ref_clipped.sum() < num_valid  # the data covers clipped and unclipped tokens
    # the clipped mask is exactly where the gradient vanishes (on valid tokens)
    assert torch.equal(out.clipped_mask, (logp.grad == 0) & mask)


def test_clip_high_differs_from_clip_low_exactly():
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, clip_ratio_c=None)
    ratios = torch.tensor([1.27, 1.29, 0.81, 0.79], dtype=torch.float64)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    logp = ratios.log().unsqueeze(0).requires_grad_(True)
    out = ppo_clip_loss(logp, torch.zeros_like(logp), advantages.unsqueeze(0), torch.ones_like(logp, dtype=torch.bool),
                        dataclass_replace(cfg, loss_agg_mode="seq-mean-token-sum"))
    out.loss.backward()
    # A>0: 1.27 < 1.28 is not clipped, 1.29 is (-> 1.28); A<0: 0.81 > 0.8 is not clipped, 0.79 is (-> 0.8)
    assert out.loss.item() == pytest.approx(-(1.27 + 1.28) + (0.81 + 0.80), rel=1e-12)
    assert out.clipped_mask.tolist() == [[False, True, False, True]]
    assert (logp.grad[0] != 0).tolist() == [True, False, True, False]
    # clip_high = clip_low = 0.2 clips 1.27 too: nothing silently becomes 0.28 (nor 0.2 * 1.4)
    symmetric = ppo_clip_mask(ratios, advantages, 0.2, 0.2)
    assert symmetric.tolist() == [True, True, False, True]


def dataclass_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_dual_clip_bounds_negative_advantage_tokens():
    ratios = torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64)
    advantages = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(ratios, dtype=torch.bool)
    per_token = {}
    for c in (3.0, None):
        cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.2, clip_ratio_c=c, loss_agg_mode="seq-mean-token-sum")
        logp = ratios.log().requires_grad_(True)
        out = ppo_clip_loss(logp, torch.zeros_like(logp), advantages, mask, cfg)
        out.loss.backward()
        per_token[c] = (out.loss.item(), logp.grad.tolist()[0], out.clipped_mask.tolist()[0], out.metrics)
    # c = 3: the r = 5 negative token costs c |A| = 3 with no gradient; r = 2 is unclipped (pessimistic min): 2
    loss, grad, clipped, metrics = per_token[3.0]
    assert loss == pytest.approx(3.0 + 2.0 - 1.2)
    assert grad[0] == 0 and grad[1] == pytest.approx(2.0) and grad[2] == 0
    assert clipped == [True, False, True]
    assert metrics["actor/pg_clipfrac_dual"].item() == pytest.approx(1 / 3)
    # without dual clip the r = 5 token costs 5 and keeps its gradient
    loss, grad, clipped, _ = per_token[None]
    assert loss == pytest.approx(5.0 + 2.0 - 1.2)
    assert grad[0] == pytest.approx(5.0) and clipped == [False, False, True]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_with_global_denominator_equal_one_batch(mode):
    cfg = dataclass_replace(CFG, loss_agg_mode=mode)
    logp, old_logp, advantages, mask = make_tokens(seed=3, batch=8)
    full_logp = logp.clone().requires_grad_(True)
    full = ppo_clip_loss(full_logp, old_logp, advantages, mask, cfg)
    full.loss.backward()

    denominator = int(mask.sum()) if mode == "token-mean" else int(mask.any(-1).sum())
    micro_logp = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in torch.arange(8).split([1, 3, 2, 2]):  # uneven micro-batches
        out = ppo_clip_loss(micro_logp[rows], old_logp[rows], advantages[rows], mask[rows], cfg,
                            global_denominator=denominator)
        out.loss.backward()  # gradient accumulation
        total += out.loss.item()
    assert total == pytest.approx(full.loss.item(), rel=1e-12)
    torch.testing.assert_close(micro_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-15)
    # without the global denominator, per-micro-batch means do not add up (the test can fail)
    local = sum(ppo_clip_loss(logp[r], old_logp[r], advantages[r], mask[r], cfg).loss.item()
                for r in torch.arange(8).split([1, 3, 2, 2]))
    assert local != pytest.approx(full.loss.item(), rel=1e-6)


def test_loss_agg_modes_by_hand_and_packed_sequences():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert loss_agg(values, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert loss_agg(values, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert loss_agg(values, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert loss_agg(values, mask, "token-mean", global_denominator=7).item() == pytest.approx(1.0)
    # packed [1, T] layout with sequence ids gives the same as rows
    packed = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64)
    seq_ids = torch.tensor([[10, 10, 42]])
    packed_mask = torch.ones_like(packed, dtype=torch.bool)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        assert loss_agg(packed, packed_mask, mode, seq_ids=seq_ids).item() == pytest.approx(
            loss_agg(values, mask, mode).item())
    with pytest.raises(ValueError, match="aggregation mode"):
        loss_agg(values, mask, "sum")
    with pytest.raises(ValueError, match="global_denominator"):
        loss_agg(values, mask, "token-mean", global_denominator=0)


def test_k3_kl_value_and_actor_loss_terms():
    logp = torch.log(torch.tensor([0.5, 0.2], dtype=torch.float64))
    ref_logp = torch.log(torch.tensor([0.25, 0.2], dtype=torch.float64))
    # d = log(0.25/0.5): exp(d) - d - 1 = 0.5 + log 2 - 1
    torch.testing.assert_close(k3_kl(logp, ref_logp), torch.tensor([math.log(2) - 0.5, 0.0], dtype=torch.float64))

    logp, old_logp, advantages, mask = make_tokens(seed=5)
    ref_logp = old_logp + 0.3 * torch.randn(old_logp.shape, generator=torch.Generator().manual_seed(1),
                                            dtype=old_logp.dtype)
    entropy = torch.rand(logp.shape, dtype=logp.dtype, generator=torch.Generator().manual_seed(2))
    cfg = dataclass_replace(CFG, kl_coef=0.1, entropy_coef=0.01)
    out = compute_actor_loss(logp, old_logp, advantages, mask, cfg, ref_logp=ref_logp, entropy=entropy)
    pg = ppo_clip_loss(logp, old_logp, advantages, mask, cfg).loss
    kl = (k3_kl(logp, ref_logp) * mask).sum() / mask.sum()
    ent = (entropy * mask).sum() / mask.sum()
    assert out.loss.item() == pytest.approx((pg + 0.1 * kl - 0.01 * ent).item(), rel=1e-12)
    assert out.metrics["actor/kl_k3"].item() == pytest.approx(kl.item())
    assert (k3_kl(logp, ref_logp) >= 0).all()
    with pytest.raises(ValueError, match="ref_logp"):
        compute_actor_loss(logp, old_logp, advantages, mask, cfg, entropy=entropy)
    with pytest.raises(ValueError, match="entropy"):
        compute_actor_loss(logp, old_logp, advantages, mask, cfg, ref_logp=ref_logp)


def test_metrics_and_ratio():
    logp, old_logp, advantages, mask = make_tokens(seed=7)
    out = ppo_clip_loss(logp, old_logp, advantages, mask, CFG)
    ratio = policy_ratio(logp, old_logp)
    clipped = ppo_clip_mask(ratio, advantages, CFG.clip_low, CFG.clip_high, CFG.clip_ratio_c) & mask
    assert torch.equal(out.clipped_mask, clipped)
    assert out.metrics["actor/ppo_kl"].item() == pytest.approx(((old_logp - logp) * mask).sum().item() / mask.sum())
    assert out.metrics["actor/num_tokens"].item() == mask.sum().item()
    frac = out.metrics["actor/pg_clipfrac_upper"] + out.metrics["actor/pg_clipfrac_lower"] + \
        out.metrics["actor/pg_clipfrac_dual"]
    assert frac.item() == pytest.approx(clipped.sum().item() / mask.sum().item())
    assert all(not v.requires_grad for v in out.metrics.values())


def test_registry():
    assert get_policy_loss("ppo_clip") is ppo_clip_loss
    assert "ppo_clip" in registered_policy_losses()
    with pytest.raises(ValueError, match="unknown policy loss 'nope'.*ppo_clip"):
        get_policy_loss("nope")

    @register_policy_loss("test_vanilla_pg")
    def vanilla(logp, old_logp, advantages, mask, cfg, *, global_denominator=None, seq_ids=None, **_):
        loss = loss_agg(-advantages.unsqueeze(-1) * logp, mask, cfg.loss_agg_mode, global_denominator, seq_ids)
        return PolicyLossOutput(loss=loss, clipped_mask=torch.zeros_like(mask), metrics={})

    logp, old_logp, advantages, mask = make_tokens()
    cfg = PolicyLossConfig(name="test_vanilla_pg").validate()
    out = compute_actor_loss(logp, old_logp, advantages, mask, cfg)
    assert out.loss.item() == pytest.approx(((-advantages.unsqueeze(-1) * logp) * mask).sum().item() / mask.sum())
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo_clip")(vanilla)


@pytest.mark.parametrize("kwargs, field", [
    (dict(clip_low=1.01), "clip_low"), (dict(clip_high=-0.1), "clip_high"), (dict(clip_ratio_c=1.0), "clip_ratio_c"),
    (dict(kl_coef=-1.0), "kl_coef"), (dict(entropy_coef=float("nan")), "entropy_coef"),
    (dict(loss_agg_mode="mean"), "loss_agg_mode"), (dict(name=""), "name"), (dict(prompt_weight="tokens"), "prompt_weight"),
])
def test_policy_loss_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**kwargs).validate()
    PolicyLossConfig(clip_ratio_c=None).validate()
    PolicyLossConfig(clip_low=1.0, clip_high=1.0).validate()  # Clip-COV's authors' clip: ratio in [0, 2]
