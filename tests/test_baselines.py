"""The seven baselines of the paper's Table 1 (algorithms/baselines.py), each against its source's formula on small
tensors whose expected values are written out by hand (or in numpy float64 from the formula), never by calling the
code under test. Clip-COV and KL-COV against verl's compute_policy_loss_clip_cov / _kl_cov, evaluated by hand."""

import math
from dataclasses import replace as dataclass_replace
import os

import numpy as np
import pytest
import torch

from megatron_dynamo.algorithms.advantages import get_advantage_estimator
from megatron_dynamo.algorithms.baselines import (BASELINES, clip_cov_selection, fork_token_weights,
                                                  kl_cov_selection, mini_batch_selection)
from megatron_dynamo.algorithms.config import PolicyLossConfig
from megatron_dynamo.algorithms.losses import compute_actor_loss, get_policy_loss

CPU_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "cpu_default.yaml")


def _grad(name, logp, old_logp, advantages, cfg, **kwargs):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(old_logp, dtype=torch.float64)
    adv = torch.tensor(advantages, dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool)
    out = get_policy_loss(name)(logp, old, adv, mask, cfg, **kwargs)
    out.loss.backward()
    return out, logp.grad.tolist()


# ------------------------------------------------------------------------------------------------- Clip-Higher
def test_clip_higher_is_dapos_decoupled_clip():
    from megatron_dynamo.trainer.config import load_run_config

    run = load_run_config(CPU_DEFAULT, [], algo="clip_higher")
    cfg = run.dynamo.loss
    assert (cfg.name, cfg.clip_low, cfg.clip_high) == ("ppo_clip", 0.2, 0.28)
    assert not run.dynamo.allocation.enabled and not run.dynamo.modulation.gc and not run.dynamo.modulation.ums
    # A > 0 at r = 1.25: inside [0.8, 1.28], so not clipped (GRPO's 1.2 would clip it): loss -r A, gradient -r A.
    out, grad = _grad("ppo_clip", [math.log(1.25), math.log(0.75)], [0.0, 0.0], [1.0, 1.0], cfg)
    # token 2: r = 0.75 < 0.8 with A > 0: min(rA, clip(r)A) = rA, not clipped either
    assert out.loss.item() == pytest.approx((-1.25 - 0.75) / 2)
    assert grad == pytest.approx([-1.25 / 2, -0.75 / 2])
    out, grad = _grad("ppo_clip", [math.log(1.3)], [0.0], [1.0], cfg)
    assert out.loss.item() == pytest.approx(-1.28) and grad == [0.0]


# ------------------------------------------------------------------------------------------------ Entropy Loss
def test_entropy_loss_is_ppo_minus_c_mean_entropy_with_its_exact_gradient():
    """Entropy Loss on the trainer's token statistics (entropy differentiable) against float64 autograd through
    log_softmax: value and gradient w.r.t. the logits."""
    from megatron_dynamo.parallel import vocab_parallel_token_stats

    cfg = PolicyLossConfig(name="entropy_loss", entropy_loss_coef=0.1)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 2
    target = torch.randint(0, 7, (5,), generator=gen)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0], dtype=torch.float64)
    old = torch.log_softmax(logits, -1).gather(-1, target[:, None]).squeeze(-1) - 0.05  # ratio ~1.05, unclipped
    mask = torch.ones(5, dtype=torch.bool)
    z = logits.float().requires_grad_()
    stats = vocab_parallel_token_stats(z, target)
    out = get_policy_loss("entropy_loss")(stats.logp, old.float(), adv.float(), mask, cfg, entropy=stats.entropy)
    out.loss.backward()
    z64 = logits.clone().requires_grad_()
    logpi = torch.log_softmax(z64, -1)
    logp = logpi.gather(-1, target[:, None]).squeeze(-1)
    h = -(logpi.exp() * logpi).sum(-1)
    ratio = torch.exp(logp - old)
    expected = (-adv * ratio).mean() - 0.1 * h.mean()  # token-mean; r in [0.8, 1.2]: no clip
    expected.backward()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=1e-5, atol=1e-6)
    # the bonus really moves the gradient: without it the gradient differs
    z64.grad = None
    (-adv * torch.exp(torch.log_softmax(z64, -1).gather(-1, target[:, None]).squeeze(-1) - old)).mean().backward()
    assert (z.grad.double() - z64.grad).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------- Fork Tokens
def test_fork_token_weights_pick_the_top_20_percent():
    h = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.1, 2.5, 0.7, 1.5, 0.2, 0.9])
    # K = ceil(10 * 0.2) = 2: H = 3.0 (index 3) and 2.5 (index 5), weight N / K = 5
    assert fork_token_weights(h, 0.2).tolist() == [0, 0, 0, 5, 0, 5, 0, 0, 0, 0]
    # K = ceil(7 * 0.2) = ceil(1.4) = 2; ties go to the earlier token
    assert fork_token_weights(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), 0.2).tolist() == \
        [3.5, 3.5, 0, 0, 0, 0, 0]
    assert fork_token_weights(torch.tensor([0.3]), 0.2).tolist() == [1.0]  # at least one token


def test_fork_tokens_loss_is_the_token_mean_over_the_selected_tokens():
    cfg = PolicyLossConfig(name="fork_tokens", fork_top_ratio=0.25)
    weights = fork_token_weights(torch.tensor([0.1, 0.9, 0.3, 0.2]), 0.25)  # K = 1: token 1, weight 4
    out, grad = _grad("fork_tokens", [-1.0] * 4, [-1.0] * 4, [1.0, -1.0, 2.0, 0.5], cfg, selection=weights)
    assert out.loss.item() == pytest.approx(1.0)  # -A_1 over the one selected token
    assert grad == pytest.approx([0.0, 1.0, 0.0, 0.0])
    assert out.metrics["actor/fork_token_frac"].item() == pytest.approx(0.25)


# ------------------------------------------------------------------------------------------ Entropy Advantages
def test_entropy_advantage_is_capped_by_the_advantage():
    cfg = PolicyLossConfig(name="entropy_adv")  # alpha 0.4, kappa 2
    entropy = torch.tensor([1.0, 3.0, 2.0, 0.5], dtype=torch.float64)
    out, grad = _grad("entropy_adv", [-1.0] * 4, [-1.0] * 4, [1.0, -1.0, 0.0, 2.0], cfg, entropy=entropy)
    # psi = min(0.4 H, |A| / 2) = [min(.4, .5), min(1.2, .5), min(.8, 0), min(.2, 1)] = [.4, .5, 0, .2]
    shaped = [1.4, -0.5, 0.0, 2.2]
    assert out.loss.item() == pytest.approx(-sum(shaped) / 4)
    assert grad == pytest.approx([-a / 4 for a in shaped])


# -------------------------------------------------------------------------------------------------- W-REINFORCE
def test_w_reinforce_weights_positive_samples_by_lambda():
    adv = get_advantage_estimator("reinforce_pm1")(torch.tensor([1.0, 0.0, 1.0, 0.0]), ["a", "a", "b", "c"])
    assert adv.tolist() == [1.0, -1.0, 1.0, -1.0]  # +1 / -1 rewards, no baseline
    cfg = PolicyLossConfig(name="w_reinforce")  # lambda 0.1
    out, grad = _grad("w_reinforce", [-0.3, -0.7], [-0.3, -0.7], [1.0, -1.0], cfg)
    assert out.loss.item() == pytest.approx((-0.1 + 1.0) / 2)
    assert grad == pytest.approx([-0.05, 0.5])


# -------------------------------------------------------------------------------------- Clip-COV and KL-COV (verl)
A = [2.0, 2.0, 2.0, -2.0, -2.0, -2.0]
LOGP = [-0.1, -3.0, -0.5, -2.5, -0.2, -1.7]
OLD = [-0.4, -3.0, -0.5, -2.5, -0.2, -1.7]  # token 0: r = e^0.3 = 1.35 > 1.2 with A > 0, PPO-clipped


def _verl_cov():
    """verl's cov_all by hand: (A - mean A) (logp - mean logp) over the valid tokens."""
    a, lp = np.array(A), np.array(LOGP)
    return (a - a.mean()) * (lp - lp.mean())


def test_covariance_by_hand():
    # mean A = 0, mean logp = -8/6; cov = 2 * (logp + 4/3) * sign(A)
    expected = [2 * (1.2 + 1 / 30), -2 * (5 / 3), 2 * (5 / 6), -2 * (-7 / 6), -2 * (17 / 15), -2 * (-11 / 30)]
    np.testing.assert_allclose(_verl_cov(), expected)


def test_clip_cov_matches_verl_on_hand_tensors():
    # verl: candidates lb < cov < ub, not clipped by the PPO clip: cov = [2.47, -3.33, 1.67, 2.33, -2.27, 0.73] ->
    # tokens 0, 2, 3; token 0 is clipped -> {2, 3}. clip_num = max(1, int(0.5 * 6)) = 3 >= 2: both chosen.
    by_origin = torch.tensor([True, False, False, False, False, False])
    chosen = clip_cov_selection(torch.tensor(A), torch.tensor(LOGP), 0.5, 1.0, 5.0, torch.Generator().manual_seed(0),
                                excluded=by_origin)
    assert chosen.tolist() == [False, False, True, True, False, False]
    cfg = PolicyLossConfig(name="clip_cov")
    out, grad = _grad("clip_cov", LOGP, OLD, A, cfg, selection=chosen.double())
    # verl: max(-A r, -A clip(r)) * corr, token-mean: token 0 max(-2 e^.3, -2.4) = -2.4; 1: -2; 2, 3: 0; 4, 5: 2
    assert out.loss.item() == pytest.approx((-2.4 - 2.0 + 0.0 + 0.0 + 2.0 + 2.0) / 6)
    # gradient: token 0 clipped (0), tokens 2, 3 detached (0), the rest -A r / 6
    assert grad == pytest.approx([0.0, -2 / 6, 0.0, 0.0, 2 / 6, 2 / 6])
    assert out.metrics["actor/cov_selected_frac"].item() == pytest.approx(2 / 6)


def test_clip_cov_draws_clip_ratio_of_the_tokens_at_random_with_a_shared_seed():
    a, lp = torch.tensor(A), torch.tensor(LOGP)
    draws = [clip_cov_selection(a, lp, 2e-4, 1.0, 5.0, torch.Generator().manual_seed(s)) for s in range(20)]
    for chosen in draws:  # max(1, int(2e-4 * 6)) = 1 token among the candidates {0, 2, 3} (nothing clipped)
        assert chosen.sum() == 1 and set(torch.nonzero(chosen).reshape(-1).tolist()) <= {0, 2, 3}
    assert len({tuple(c.tolist()) for c in draws}) > 1  # the draw is random...
    again = clip_cov_selection(a, lp, 2e-4, 1.0, 5.0, torch.Generator().manual_seed(3))
    assert torch.equal(again, draws[3])  # ...and the same for the same seed
    # through the trainer's entry point: the run's seed decides, no other state
    cfg = PolicyLossConfig(name="clip_cov")
    assert torch.equal(mini_batch_selection(cfg, a, lp, lp, 11), mini_batch_selection(cfg, a, lp, lp, 11))


def test_kl_cov_matches_verl_on_hand_tensors():
    # verl: k = max(1, int(6 * 0.34)) = 2 largest cov: tokens 0 (2.47) and 3 (2.33)
    chosen = kl_cov_selection(torch.tensor(A), torch.tensor(LOGP), 0.34)
    assert chosen.tolist() == [True, False, False, True, False, False]
    assert kl_cov_selection(torch.tensor(A), torch.tensor(LOGP), 2e-3).tolist() == [True] + [False] * 5  # k >= 1
    cfg = PolicyLossConfig(name="kl_cov")  # kl_cov_coef 1
    out, grad = _grad("kl_cov", LOGP, OLD, A, cfg, selection=chosen.double())
    r0 = math.exp(0.3)
    # verl: -A r everywhere (no ratio clip) + 1 * |logp - old| on the chosen tokens
    per_token = [-2 * r0 + 0.3, -2.0, -2.0, 2.0, 2.0, 2.0]
    assert out.loss.item() == pytest.approx(sum(per_token) / 6)
    assert grad == pytest.approx([(-2 * r0 + 1.0) / 6, -2 / 6, -2 / 6, 2 / 6, 2 / 6, 2 / 6])


# ------------------------------------------------------------------------------------------------- the registry
def test_every_baseline_is_grpo_plus_its_change():
    from megatron_dynamo.trainer.config import ALGORITHMS, load_run_config

    assert ALGORITHMS == ("dynamo", "grpo", "clip_higher", "entropy_loss", "fork_tokens", "entropy_adv", "clip_cov",
                          "kl_cov", "w_reinforce")
    grpo = load_run_config(CPU_DEFAULT, [], algo="grpo")
    for name in BASELINES:
        run = load_run_config(CPU_DEFAULT, [], algo=name)  # validated
        assert run.dynamo.allocation == grpo.dynamo.allocation and run.dynamo.modulation == grpo.dynamo.modulation
        expected = {"clip_higher": "ppo_clip"}.get(name, name)
        assert run.dynamo.loss.name == expected
    w_reinforce = load_run_config(CPU_DEFAULT, [], algo="w_reinforce").dynamo
    assert w_reinforce.advantage_estimator == "reinforce_pm1"
    # issue 32: W-REINFORCE without the dual clip (its source has none); the others keep the recipe's c = 3
    assert w_reinforce.loss.clip_ratio_c is None and grpo.dynamo.loss.clip_ratio_c == 3.0
    assert all(load_run_config(CPU_DEFAULT, [], algo=n).dynamo.loss.clip_ratio_c == 3.0 for n in BASELINES
               if n != "w_reinforce")
    # Clip-COV's authors' clip 1 / 1 is accepted (a lower ratio bound of 0)
    authors = load_run_config(CPU_DEFAULT, ["dynamo.loss.clip_low=1", "dynamo.loss.clip_high=1"], algo="clip_cov")
    assert (authors.dynamo.loss.clip_low, authors.dynamo.loss.clip_high) == (1.0, 1.0)


def test_algo_and_a_key_it_sets_give_one_run_or_a_one_line_error(tmp_path):
    """--algo X and the config keys X sets (dynamo.loss.name=clip_cov ...) written together: the same values give
    the run of --algo X alone; another value is refused before anything runs (it was silently overruled)."""
    import json
    import subprocess
    import sys

    from megatron_dynamo.algorithms.baselines import GRPO_KEYS, algorithm_note
    from megatron_dynamo.config import ConfigError
    from megatron_dynamo.trainer.config import load_run_config

    for name, baseline in {**BASELINES, "grpo": None}.items():
        keys = {**GRPO_KEYS, **(baseline.keys() if baseline else {})}
        written = [f"{key}={json.dumps(value)}" for key, value in keys.items()]
        by_algo = load_run_config(CPU_DEFAULT, [], algo=name)
        assert load_run_config(CPU_DEFAULT, written, algo=name) == by_algo, name
        assert load_run_config(CPU_DEFAULT, written) == by_algo, name  # --algo X is exactly the keys it sets
    for algo, override in (("clip_cov", "dynamo.loss.name=kl_cov"), ("grpo", "dynamo.modulation.gc=true"),
                           ("clip_higher", "dynamo.loss.clip_high=0.3"), ("w_reinforce", "dynamo.loss.clip_ratio_c=3")):
        with pytest.raises(ConfigError) as error:
            load_run_config(CPU_DEFAULT, [override], algo=algo)
        assert f"contradicts --algo {algo}" in str(error.value) and "\n" not in str(error.value)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "train", CPU_DEFAULT, "--algo", "clip_cov",
                           "dynamo.loss.name=kl_cov", f"trainer.output_dir={out}"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("dynamo train: dynamo.loss.name=kl_cov contradicts")
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()
    # the loss key alone keeps --algo dynamo's DRA, GC and UMS: another run than --algo clip_cov, and train says so
    alone = load_run_config(CPU_DEFAULT, ["dynamo.loss.name=clip_cov"])
    assert alone.dynamo.loss.name == "clip_cov" and alone != load_run_config(CPU_DEFAULT, [], algo="clip_cov")
    assert "--algo clip_cov" in algorithm_note("dynamo", "clip_cov")
    assert algorithm_note("clip_cov", "clip_cov") is None and algorithm_note("dynamo", "ppo_clip") is None


def test_w_reinforce_without_the_dual_clip_keeps_the_gradient_of_far_negative_tokens():
    # A = -1 at ratio e^1.5 = 4.5 > c = 3: the dual clip would take its gradient; W-REINFORCE now keeps it
    cfg = PolicyLossConfig(name="w_reinforce", clip_ratio_c=None)
    out, grad = _grad("w_reinforce", [1.5], [0.0], [-1.0], cfg)
    assert grad[0] == pytest.approx(math.exp(1.5))  # d(-A r)/dlogp = r for A = -1: unclipped above
    dual = PolicyLossConfig(name="w_reinforce", clip_ratio_c=3.0)
    assert _grad("w_reinforce", [1.5], [0.0], [-1.0], dual)[1][0] == 0.0


def test_an_unregistered_loss_name_is_refused_by_the_trainer_config():
    from megatron_dynamo.config import ConfigError
    from megatron_dynamo.trainer.config import load_run_config

    with pytest.raises(ConfigError, match="not a registered policy loss"):
        load_run_config(CPU_DEFAULT, ["dynamo.loss.name=nope"])
    with pytest.raises(ConfigError, match="fork_tokens needs loss.loss_agg_mode token-mean"):
        load_run_config(CPU_DEFAULT, ["dynamo.loss.loss_agg_mode=seq-mean-token-sum"], algo="fork_tokens")


def test_the_algorithm_config_module_imports_no_loss_implementation():
    import ast
    import pathlib

    import megatron_dynamo.algorithms.config as config

    tree = ast.parse(pathlib.Path(config.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(m and m.endswith("losses") for m in imported), imported


def test_compute_actor_loss_passes_entropy_and_selection_on():
    cfg = PolicyLossConfig(name="fork_tokens")
    logp = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    weights = fork_token_weights(torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]), 0.2)
    out = compute_actor_loss(logp, torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64),
                             torch.ones(5, dtype=torch.bool), cfg, selection=weights)
    assert out.loss.item() == pytest.approx(-1.0)


def test_the_trainers_loss_gives_dynamo_loss_entropy_coef_its_exact_gradient(monkeypatch):
    """dynamo.loss.entropy_coef (accepted now that the entropy is differentiable) through the trainer's loss function
    on logits [B, S, V]: the logits' gradient equals float64 autograd of PPO - c * token-mean(H) (GRPO: no
    modulation), and differs from the one without the bonus. Was refused by the config before (no gradient)."""
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer import policy_loss
    from megatron_dynamo.trainer.batch import UpdateBatch
    from megatron_dynamo.trainer.policy_loss import dynamo_loss_fn

    monkeypatch.setattr(policy_loss, "_tp_group", lambda: None)  # one process, no Megatron parallel state
    run = load_run_config(CPU_DEFAULT, ["dynamo.loss.entropy_coef=0.05"], algo="grpo")
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 9, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 9, (2, 4), generator=gen)
    loss_mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    logpi = torch.log_softmax(logits, -1)
    old = (logpi.gather(-1, labels[..., None]).squeeze(-1) - 0.02).float()
    batch = UpdateBatch(input_ids=labels, labels=labels, loss_mask=loss_mask, old_logp=old,
                        advantages=torch.tensor([0.7, -1.2]), loss_weight=torch.ones(2, dtype=torch.float64),
                        sample_index=torch.arange(2))
    grads = {}
    for coef in (0.05, 0.0):
        cfg = dataclass_replace(run.dynamo.loss, entropy_coef=coef)
        z = logits.float().requires_grad_()
        loss, _ = dynamo_loss_fn(run.dynamo.modulation, cfg, None, 5.0, 1.0)(z, batch)
        loss.backward()
        grads[coef] = z.grad.double()
    z64 = logits.clone().requires_grad_()
    lp = torch.log_softmax(z64, -1)
    logp = lp.gather(-1, labels[..., None]).squeeze(-1)[loss_mask]
    h = -(lp.exp() * lp).sum(-1)[loss_mask]
    adv = torch.tensor([0.7, -1.2], dtype=torch.float64)[torch.tensor([0, 0, 0, 1, 1])]
    (-(adv * torch.exp(logp - old[loss_mask].double())).sum() / 5.0 - 0.05 * h.sum() / 5.0).backward()
    torch.testing.assert_close(grads[0.05], z64.grad, rtol=1e-5, atol=1e-6)
    assert (grads[0.05] - grads[0.0]).abs().max() > 1e-3
