"""Group-normalised GRPO advantages keyed by prompt id, for groups of different sizes."""

import statistics

import numpy as np
import pytest
import torch

from megatron_dynamo.algorithms import (
    get_advantage_estimator,
    group_advantages,
    register_advantage_estimator,
    registered_advantage_estimators,
)


def reference_advantages(rewards, prompt_ids, normalize_std=True, eps=1e-6):
    """Float64 reference from the formula: A = (r - mean_g) / (sample_std_g + eps); constant groups -> 0."""
    out = []
    for reward, pid in zip(rewards, prompt_ids):
        group = [float(r) for r, p in zip(rewards, prompt_ids) if p == pid and type(p) is type(pid)]
        if max(group) == min(group):
            out.append(0.0)
            continue
        centred = float(reward) - statistics.fmean(group)
        out.append(centred / (statistics.stdev(group) + eps) if normalize_std else centred)
    return np.array(out)


def make_batch(seed=0):
    rng = np.random.default_rng(seed)
    sizes = {"p0": 1, "p1": 2, 2: 5, 3: 8, "p4": 13, 5: 6, "const": 4}
    ids = [pid for pid, size in sizes.items() for _ in range(size)]
    rewards = rng.integers(0, 2, len(ids)).astype(np.float64)
    rewards[[i for i, p in enumerate(ids) if p == 5]] = rng.normal(size=6)  # non-binary rewards too
    rewards[[i for i, p in enumerate(ids) if p == "const"]] = 0.1  # equal, not exactly representable
    rewards[[i for i, p in enumerate(ids) if p == 3]] = [1, 0, 1, 1, 0, 0, 0, 1]
    perm = rng.permutation(len(ids))  # interleave the groups: grouping must be by id, not position
    return [ids[i] for i in perm], rewards[perm]


@pytest.mark.parametrize("normalize_std", [True, False])
def test_matches_float64_reference(normalize_std):
    ids, rewards = make_batch()
    got = group_advantages(torch.tensor(rewards), ids, normalize_std=normalize_std)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), reference_advantages(rewards, ids, normalize_std), rtol=1e-12, atol=1e-12)


def test_sample_std_convention_binary_group():
    # group of 4 with rewards 1,1,0,0: mean 0.5, sample std sqrt(1/3) -> A = +-0.5 / sqrt(1/3) = +-0.866
    got = group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), [9, 9, 9, 9], eps=0.0)
    np.testing.assert_allclose(got.numpy(), [0.8660254, 0.8660254, -0.8660254, -0.8660254], rtol=1e-6)
    assert torch.allclose(got, (torch.tensor([1.0, 1, 0, 0]) - 0.5) / torch.tensor([1.0, 1, 0, 0]).std())


def test_constant_and_singleton_groups_are_exactly_zero():
    ids, rewards = make_batch()
    got = group_advantages(torch.tensor(rewards, dtype=torch.float32), ids)
    for pid in ("const", "p0"):
        assert all(got[i].item() == 0.0 for i, p in enumerate(ids) if p == pid)
    assert got.dtype == torch.float32


def test_keyed_by_id_not_position():
    ids, rewards = make_batch()
    base = group_advantages(torch.tensor(rewards), ids)
    perm = np.random.default_rng(1).permutation(len(ids))
    shuffled = group_advantages(torch.tensor(rewards[perm]), [ids[i] for i in perm])
    torch.testing.assert_close(shuffled, base[perm], rtol=1e-12, atol=1e-12)
    # int 2 and str "2" are different prompts
    got = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), [2, "2", 2, "2"])
    assert (got[[0, 2]] == 0).all() and got[1] < 0 < got[3]


def test_id_array_types_and_integer_rewards():
    rewards = torch.tensor([1, 0, 1, 1, 0])
    as_list = group_advantages(rewards, [4, 4, 7, 7, 7])
    as_tensor = group_advantages(rewards, torch.tensor([4, 4, 7, 7, 7]))
    as_numpy = group_advantages(rewards, np.array(["x", "x", "y", "y", "y"]))
    assert as_list.dtype == torch.float32
    torch.testing.assert_close(as_list, as_tensor)
    torch.testing.assert_close(as_list, as_numpy)


def test_bad_inputs():
    with pytest.raises(ValueError, match="prompt ids"):
        group_advantages(torch.tensor([1.0, 0.0]), ["a"])
    with pytest.raises(ValueError, match="one-dimensional"):
        group_advantages(torch.zeros(2, 2), ["a", "b"])
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), ["a", "a"])
    assert group_advantages(torch.zeros(0), []).numel() == 0


def test_registry():
    assert "grpo" in registered_advantage_estimators()
    ids, rewards = make_batch()
    torch.testing.assert_close(get_advantage_estimator("grpo")(torch.tensor(rewards), ids),
                               group_advantages(torch.tensor(rewards), ids))
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'.*grpo"):
        get_advantage_estimator("nope")

    @register_advantage_estimator("test_centred_only")
    def centred(rewards, prompt_ids):
        return group_advantages(rewards, prompt_ids, normalize_std=False)

    assert get_advantage_estimator("test_centred_only") is centred
    register_advantage_estimator("test_centred_only")(centred)  # same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(centred)


