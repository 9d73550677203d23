"""Dynamic rollout allocation: history, Bernoulli variance (eq. 2), water level (appendix D), eq. 23 ratio."""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynamo.algorithms import (
    AllocationConfig,
    PromptHistory,
    allocate_rollouts,
    bernoulli_variance,
    plan_rollouts,
    predicted_variance_ratio,
    prompt_variances,
    water_level,
)

# --------------------------------------------------------------------------------------------------------------
# An independent continuous solution: bisection on lambda of sum_i clip(lambda w_i, n_min, n_max) = B.


def reference_water_level(variances, budget, n_min, n_max, power):
    variances = np.asarray(variances, dtype=np.float64)
    weight = variances ** power
    positive = weight > 0
    num = variances.size
    if n_min == n_max:
        return np.full(num, float(n_min))
    if not positive.any():
        return np.full(num, budget / num)
    saturated = (num - positive.sum()) * n_min + positive.sum() * n_max
    if budget >= saturated:
        share = (budget - saturated) / max(num - positive.sum(), 1)
        return np.where(positive, float(n_max), n_min + share)
    lam_lo, lam_hi = 0.0, n_max / weight[positive].min()
    for _ in range(300):
        mid = 0.5 * (lam_lo + lam_hi)
        if np.clip(mid * weight, n_min, n_max).sum() < budget:
            lam_lo = mid
        else:
            lam_hi = mid
    return np.clip(lam_hi * weight, n_min, n_max)


variance_values = st.one_of(st.just(0.0), st.just(0.25),
                            st.floats(1e-6, 1.0, allow_nan=False, allow_infinity=False, allow_subnormal=False))


@st.composite
def allocation_problems(draw, unique=False):
    num = draw(st.integers(1, 40))
    values = draw(st.lists(variance_values, min_size=num, max_size=num, unique=unique))
    n_min = draw(st.integers(0, 12))
    n_max = draw(st.integers(n_min, n_min + 30))
    budget = draw(st.integers(num * n_min, num * n_max))
    power = draw(st.sampled_from([1.0, 0.5, 2.0]))
    return np.asarray(values, dtype=np.float64), budget, n_min, n_max, power


@settings(max_examples=200, deadline=None)
@given(allocation_problems())
def test_allocator_invariants_and_distance_to_continuous_solution(problem):
    variances, budget, n_min, n_max, power = problem
    counts = allocate_rollouts(variances, budget, n_min, n_max, power)
    assert counts.dtype == np.int64 and counts.shape == variances.shape
    assert int(counts.sum()) == budget
    assert counts.min() >= n_min and counts.max() <= n_max
    reference = reference_water_level(variances, budget, n_min, n_max, power)
    assert np.abs(counts - reference).max() < 1 + 1e-6
    # the module's own continuous solution agrees with the bisection
    np.testing.assert_allclose(water_level(variances, budget, n_min, n_max, power), reference, rtol=1e-9, atol=1e-7)


@settings(max_examples=200, deadline=None)
@given(allocation_problems())
def test_allocator_is_monotone_in_variance(problem):
    variances, budget, n_min, n_max, power = problem
    counts = allocate_rollouts(variances, budget, n_min, n_max, power)
    larger_variance = variances[:, None] > variances[None, :]
    assert not (larger_variance & (counts[:, None] < counts[None, :])).any()


@settings(max_examples=200, deadline=None)
@given(allocation_problems(), st.randoms(use_true_random=False))
def test_allocator_is_permutation_equivariant(problem, rnd):
    variances, budget, n_min, n_max, power = problem
    perm = np.arange(variances.size)
    rnd.shuffle(perm)
    counts = allocate_rollouts(variances, budget, n_min, n_max, power)
    permuted = allocate_rollouts(variances[perm], budget, n_min, n_max, power)
    if np.unique(variances).size == variances.size:
        np.testing.assert_array_equal(permuted, counts[perm])
    else:
        # equal variances may swap which of them gets the extra rollout (ties go by index): compare per value
        for value in np.unique(variances):
            np.testing.assert_array_equal(np.sort(permuted[variances[perm] == value]),
                                          np.sort(counts[variances == value]))


def test_worked_example_and_rounding():
    # lambda = 160: 0.1 -> 16, 0.2 and 0.25 -> capped at 24, 0 -> 8, 0.05 -> 8
    np.testing.assert_array_equal(allocate_rollouts([0.1, 0.2, 0.25, 0.0, 0.05], 80, 8, 24), [16, 24, 24, 8, 8])
    # continuous 8 + 1/3 each for three equal positive prompts plus one P=0 prompt: largest remainder by index
    counts = allocate_rollouts([0.2, 0.2, 0.2, 0.0], 8 * 4 + 1, 8, 24)
    np.testing.assert_array_equal(counts, [9, 8, 8, 8])


def test_rounding_ties_go_to_the_larger_variance():
    # two distinct variances whose square roots round to the same double: equal water levels (16.5 each), so the
    # extra rollout must go to the larger variance, not to the lower index, or monotonicity breaks
    low, high = 0.25, float(np.nextafter(0.25, 1.0))
    assert np.sqrt(low) == np.sqrt(high)
    np.testing.assert_array_equal(allocate_rollouts([high, low], 33, 8, 24, power=0.5), [17, 16])
    np.testing.assert_array_equal(allocate_rollouts([low, high], 33, 8, 24, power=0.5), [16, 17])


def test_all_zero_is_uniform_and_as_even_as_possible():
    np.testing.assert_array_equal(allocate_rollouts(np.zeros(4), 64, 8, 24), [16, 16, 16, 16])
    counts = allocate_rollouts(np.zeros(7), 7 * 16 + 3, 8, 24)
    assert counts.sum() == 7 * 16 + 3 and counts.max() - counts.min() == 1
    np.testing.assert_array_equal(counts, [17, 17, 17, 16, 16, 16, 16])


def test_saturated_informative_prompts_leave_the_rest_to_zero_variance_prompts():
    counts = allocate_rollouts([0.25, 0.0, 0.0, 0.0], 64, 8, 24)
    np.testing.assert_array_equal(counts, [24, 14, 13, 13])


def test_equal_bounds_and_extreme_budgets():
    np.testing.assert_array_equal(allocate_rollouts([0.1, 0.2], 32, 16, 16), [16, 16])
    np.testing.assert_array_equal(allocate_rollouts([0.1, 0.2, 0.0], 24, 8, 24), [8, 8, 8])
    np.testing.assert_array_equal(allocate_rollouts([0.1, 0.2, 0.0], 72, 8, 24), [24, 24, 24])


def test_accepts_lists_tensors_and_large_batches():
    expected = allocate_rollouts(np.array([0.1, 0.2, 0.0]), 48, 8, 24)
    np.testing.assert_array_equal(allocate_rollouts([0.1, 0.2, 0.0], 48, 8, 24), expected)
    np.testing.assert_array_equal(allocate_rollouts(torch.tensor([0.1, 0.2, 0.0]).double(), 48, 8, 24), expected)
    rng = np.random.default_rng(0)
    variances = rng.random(100_000) * 0.25
    variances[rng.random(100_000) < 0.3] = 0.0
    counts = allocate_rollouts(variances, 100_000 * 16, 8, 24)
    assert counts.sum() == 1_600_000 and counts.min() == 8 and counts.max() == 24


@pytest.mark.parametrize("args, message", [
    (([0.1, 0.2], 15, 8, 24), "budget"),          # below N * n_min
    (([0.1, 0.2], 49, 8, 24), "budget"),          # above N * n_max
    (([0.1, float("nan")], 32, 8, 24), "NaN"),
    (([0.1, -0.2], 32, 8, 24), "negative"),
    (([0.1, float("inf")], 32, 8, 24), "inf"),
    (([0.1, 0.2], 32, 24, 8), "n_min"),
    (([], 0, 8, 24), "empty"),
    (([0.1, 0.2], 32.5, 8, 24), "budget"),
    (([[0.1, 0.2]], 32, 8, 24), "one-dimensional"),
])
def test_bad_input_raises_value_error_naming_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        allocate_rollouts(*args)


@pytest.mark.parametrize("power", [0.0, -1.0, float("nan")])
def test_bad_power_raises(power):
    with pytest.raises(ValueError, match="power"):
        allocate_rollouts([0.1, 0.2], 32, 8, 24, power)


# --------------------------------------------------------------------------------------------------------------
# eq. 2


def test_bernoulli_variance_formula_and_unbiasedness():
    assert bernoulli_variance(3, 8) == pytest.approx(3 * 5 / (8 * 7))
    np.testing.assert_allclose(bernoulli_variance([0, 4, 8], [8, 8, 8]), [0.0, 16 / 56, 0.0])
    assert math.isnan(bernoulli_variance(1, 1)) and math.isnan(bernoulli_variance(0, 0))
    # E[P] over k ~ Binomial(G, p) is exactly p (1 - p) (eq. 22): exact enumeration
    for G in (2, 5, 16):
        k = np.arange(G + 1)
        for p in (0.1, 0.5, 0.83):
            pmf = np.array([math.comb(G, int(i)) * p ** i * (1 - p) ** (G - i) for i in k])
            assert float((pmf * bernoulli_variance(k, np.full(G + 1, G))).sum()) == pytest.approx(p * (1 - p))


@pytest.mark.parametrize("k, G, message", [(5, 4, "exceed"), (-1, 4, "non-negative"), (float("nan"), 4, "finite")])
def test_bernoulli_variance_rejects_bad_counts(k, G, message):
    with pytest.raises(ValueError, match=message):
        bernoulli_variance(k, G)


# --------------------------------------------------------------------------------------------------------------
# PromptHistory


def test_history_update_by_id_with_uneven_interleaved_groups():
    history = PromptHistory()
    ids = ["a", 7, "a", "b", 7, "a", 7, 7]
    correct = [1, 0, 0, 1, 1, 1, 1, 0]
    history.update(ids, correct)
    k, G = history.counts(["a", 7, "b", "never"])
    np.testing.assert_array_equal(k, [2, 2, 1, 0])
    np.testing.assert_array_equal(G, [3, 4, 1, 0])
    history.update(np.array([7, 7]), torch.tensor([True, True]))
    k, G = history.counts([7])
    assert (k[0], G[0]) == (4, 6)
    # int 1 and str "1" are different prompts
    history.update([1, "1", "1"], [1, 0, 0])
    k, G = history.counts([1, "1"])
    np.testing.assert_array_equal(k, [1, 0])
    np.testing.assert_array_equal(G, [1, 2])


def test_history_rejects_bad_updates():
    history = PromptHistory()
    with pytest.raises(ValueError, match="results"):
        history.update(["a", "b"], [1])
    with pytest.raises(ValueError, match="correct"):
        history.update(["a"], [2])
    with pytest.raises(TypeError, match="int or str"):
        history.update([1.5], [1])


def test_history_state_dict_json_round_trip_and_resume():
    history = PromptHistory()
    history.update([3, "x", 3, "x", "y"], [1, 0, 0, 0, 1])
    restored = PromptHistory()
    restored.load_state_dict(json.loads(json.dumps(history.state_dict())))
    assert restored.state_dict() == history.state_dict()
    assert 3 in restored and "3" not in restored
    for h in (history, restored):
        h.update(["x", 3, "z"], [1, 1, 0])
    assert restored.state_dict() == history.state_dict()
    with pytest.raises(ValueError, match="lengths"):
        restored.load_state_dict({"ids": [1, 2], "k": [0.0], "G": [1.0]})
    with pytest.raises(ValueError, match="duplicate"):
        restored.load_state_dict({"ids": [1, 1], "k": [0.0, 0.0], "G": [1.0, 1.0]})


def test_history_decay_is_per_visit_and_off_by_default():
    plain, decayed = PromptHistory(), PromptHistory(decay=0.5)
    for h in (plain, decayed):
        h.update(["a"] * 4 + ["b"] * 2, [1, 1, 1, 1, 0, 0])
        h.update(["a"] * 4, [0, 0, 0, 0])
    assert tuple(x[0] for x in plain.counts(["a"])) == (4, 8)
    assert tuple(x[0] for x in decayed.counts(["a"])) == (2, 6)  # 0.5 * (4, 4) + (0, 4)
    assert tuple(x[0] for x in decayed.counts(["b"])) == (0, 2)  # not revisited: untouched
    with pytest.raises(ValueError, match="decay"):
        PromptHistory(decay=0.0)


def test_prompt_variances_fill_in_rule():
    history = PromptHistory()
    assert np.all(prompt_variances(history, ["a", "b"]) == 0.25)  # nothing known: 0.25
    history.update(["a"] * 4 + ["b"] * 4 + ["c"], [1, 1, 0, 0, 1, 1, 1, 1, 1])
    p_a = bernoulli_variance(2, 4)
    variances = prompt_variances(history, ["a", "b", "c", "new"])
    # c has G = 1 < 2, "new" has no history: both take the mean over the known prompts a and b
    np.testing.assert_allclose(variances, [p_a, 0.0, p_a / 2, p_a / 2])


def test_plan_rollouts_first_step_uniform_then_dynamic_and_switch_off():
    cfg = AllocationConfig()
    history = PromptHistory()
    ids = list(range(8))
    np.testing.assert_array_equal(plan_rollouts(history, ids, cfg), np.full(8, 16))
    history.update(np.repeat(ids, 16), np.concatenate([np.ones(16 * 4), np.zeros(16 * 2), np.tile([1, 0], 16)]))
    counts = plan_rollouts(history, ids, cfg)
    # 6 and 7 (P > 0) saturate at n_max; the rest is shared evenly by the P = 0 prompts (80 over 6)
    np.testing.assert_array_equal(counts, [14, 14, 13, 13, 13, 13, 24, 24])
    off = AllocationConfig(enabled=False)
    np.testing.assert_array_equal(plan_rollouts(history, ids, off), np.full(8, 16))


@pytest.mark.parametrize("kwargs, field", [
    (dict(n_avg=30), "n_avg"), (dict(n_avg=4), "n_avg"), (dict(n_min=30), "n_min"), (dict(n_min=0), "n_min"),
    (dict(power=0.0), "power"), (dict(history_decay=1.5), "history_decay"), (dict(enabled=1), "enabled"),
    (dict(unknown_variance=-1.0), "unknown_variance"),
])
def test_allocation_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AllocationConfig(**kwargs).validate()
    AllocationConfig().validate()


# --------------------------------------------------------------------------------------------------------------
# eq. 23


def test_predicted_variance_ratio():
    variances = np.array([0.25, 0.09, 0.0, 0.0])
    assert predicted_variance_ratio(variances, [16, 16, 16, 16]) == pytest.approx(1.0)
    assert predicted_variance_ratio(np.zeros(3), [1, 2, 3]) == 1.0
    chosen = 0.25 / 24 + 0.09 / 24
    uniform = (0.25 + 0.09) / 16
    assert predicted_variance_ratio(variances, [24, 24, 8, 8]) == pytest.approx(chosen / uniform)
    # n ~ sigma without bounds reaches the Cauchy-Schwarz bound of eq. 23
    variances = np.array([0.25, 0.16, 0.04, 0.01])
    sigma = np.sqrt(variances)
    optimum = 400 * sigma / sigma.sum()
    # eq. 23: (sum sigma)^2 / (N sum sigma^2) = (0.5 + 0.4 + 0.2 + 0.1)^2 / (4 * 0.46), by hand
    assert predicted_variance_ratio(variances, optimum) == pytest.approx(1.2 ** 2 / (4 * 0.46))
    with pytest.raises(ValueError, match="0 rollouts"):
        predicted_variance_ratio([0.1, 0.2], [0, 4])
