"""The paper's variance claim (section 2.1, appendix C, eq. 23), measured by Monte Carlo.

For a spread of success rates p_i (some prompts always solved, some never), each allocation n draws n_i Bernoulli
rewards per prompt, many times; the group-mean estimate g_i = mean of prompt i's rewards has variance
sigma_i^2 / n_i with sigma_i^2 = p_i (1 - p_i). The measured total variance sum_i Var[g_i] must match the predicted
sum_i sigma_i^2 / n_i within sampling error, for every allocation rule. Run with ``pytest -s`` to see the table.

Allocation rules: uniform (16 each); the paper's rule n ~ P = sigma^2 (power 1); n ~ sigma (power 0.5, eq. 1);
each with the paper's bounds [8, 24] and without bounds ([0, B]).
"""

import numpy as np
import pytest

from megatron_dynamo.algorithms import (
    PromptHistory,
    allocate_rollouts,
    predicted_variance_ratio,
    prompt_variances,
    water_level,
)

SUCCESS_RATES = np.concatenate([np.zeros(12), np.ones(8), np.linspace(0.03, 0.97, 44)])
NUM_PROMPTS = SUCCESS_RATES.size
BUDGET = NUM_PROMPTS * 16
SIGMA2 = SUCCESS_RATES * (1 - SUCCESS_RATES)
NUM_INFORMATIVE = int((SIGMA2 > 0).sum())
TRIALS = 10_000
# Eq. 23: the ratio to uniform that n ~ sigma reaches without bounds, (sum sigma_i)^2 / (N sum sigma_i^2).
EQ23_BOUND = float(np.sqrt(SIGMA2).sum() ** 2 / (NUM_PROMPTS * SIGMA2.sum()))


def predicted_total_variance(counts):
    informative = SIGMA2 > 0
    return float((SIGMA2[informative] / counts[informative]).sum())


def measured_total_variance(counts, rng):
    """Monte Carlo: TRIALS repetitions of drawing n_i Bernoulli(p_i) rewards per prompt (vectorised).

    Returns the mean over trials of sum_i (g_i - p_i)^2 (an unbiased estimate of sum_i Var[g_i], using the known
    mean p_i) and its standard error."""
    sampled = counts > 0  # prompts with 0 rollouts contribute nothing (they all have sigma^2 = 0 here)
    n = counts[sampled]
    starts = np.concatenate([[0], np.cumsum(n)[:-1]])
    rates = np.repeat(SUCCESS_RATES[sampled], n).astype(np.float32)
    totals = np.empty(TRIALS)
    for trials in np.array_split(np.arange(TRIALS), 5):  # chunks keep memory small
        rewards = (rng.random((trials.size, rates.size), dtype=np.float32) < rates).astype(np.float32)
        group_means = np.add.reduceat(rewards, starts, axis=1) / n
        totals[trials] = ((group_means - SUCCESS_RATES[sampled]) ** 2).sum(axis=1)
    return float(totals.mean()), float(totals.std(ddof=1) / np.sqrt(TRIALS))


def estimated_variances(rng, past_samples=16):
    """P_i from a history of ``past_samples`` attempts per prompt (what the trainer actually has)."""
    history = PromptHistory()
    ids = np.repeat(np.arange(NUM_PROMPTS), past_samples)
    history.update(ids, rng.random(ids.size) < SUCCESS_RATES[ids])
    return prompt_variances(history, np.arange(NUM_PROMPTS))


@pytest.fixture(scope="module")
def table():
    rng = np.random.default_rng(20240607)
    allocations = {
        "uniform": np.full(NUM_PROMPTS, 16, dtype=np.int64),
        "P^1   [8,24]": allocate_rollouts(SIGMA2, BUDGET, 8, 24, power=1.0),
        "P^0.5 [8,24]": allocate_rollouts(SIGMA2, BUDGET, 8, 24, power=0.5),
        "P^1   [0,B]": allocate_rollouts(SIGMA2, BUDGET, 0, BUDGET, power=1.0),
        "P^0.5 [0,B]": allocate_rollouts(SIGMA2, BUDGET, 0, BUDGET, power=0.5),
        "P^1   [8,24] est.P": allocate_rollouts(estimated_variances(rng), BUDGET, 8, 24, power=1.0),
    }
    rows = {}
    for name, counts in allocations.items():
        measured, stderr = measured_total_variance(counts, rng)
        rows[name] = dict(counts=counts, predicted=predicted_total_variance(counts), measured=measured,
                          stderr=stderr, ratio=predicted_variance_ratio(SIGMA2, counts),
                          zero_p_rollouts=int(counts[SIGMA2 == 0].sum()))
    print(f"\n{NUM_PROMPTS} prompts ({NUM_PROMPTS - NUM_INFORMATIVE} with p in {{0, 1}}), budget {BUDGET}, "
          f"{TRIALS} Monte-Carlo trials; eq. 23 bound (sum sigma)^2/(N sum sigma^2) = "
          f"{EQ23_BOUND:.4f}, share of informative prompts M/N = "
          f"{NUM_INFORMATIVE / NUM_PROMPTS:.4f}")
    print(f"{'allocation':20s} {'predicted':>10s} {'measured':>10s} {'std.err':>8s} {'ratio vs unif':>13s} "
          f"{'rollouts on P=0':>15s}")
    for name, row in rows.items():
        print(f"{name:20s} {row['predicted']:10.5f} {row['measured']:10.5f} {row['stderr']:8.5f} "
              f"{row['ratio']:13.4f} {row['zero_p_rollouts']:15d}")
    return rows


def test_measured_variance_matches_prediction(table):
    for name, row in table.items():
        assert abs(row["measured"] - row["predicted"]) < 4 * row["stderr"], name


def test_power_half_is_below_uniform_as_eq23_says(table):
    uniform, half = table["uniform"], table["P^0.5 [8,24]"]
    assert half["predicted"] < uniform["predicted"]
    combined = np.hypot(half["stderr"], uniform["stderr"])
    assert uniform["measured"] - half["measured"] > 5 * combined  # measured, not only predicted
    # with the bounds n ~ sigma is the optimum of the box-constrained problem: it beats the paper's n ~ P
    assert half["predicted"] <= table["P^1   [8,24]"]["predicted"]
    # without bounds it reaches the Cauchy-Schwarz bound of eq. 23 (up to integer rounding)
    assert table["P^0.5 [0,B]"]["ratio"] == pytest.approx(EQ23_BOUND, rel=2e-3)


def test_power_one_equals_uniform_over_informative_prompts_without_bounds(table):
    # Continuous solution: n_i = B sigma_i^2 / sum sigma^2 on P > 0, so sum sigma^2 / n = M sum sigma^2 / B,
    # exactly a uniform split of B over the M informative prompts; relative to uniform over all N: M / N.
    level = water_level(SIGMA2, BUDGET, 0, BUDGET, power=1.0)
    informative = SIGMA2 > 0
    uniform_over_informative = NUM_INFORMATIVE * SIGMA2.sum() / BUDGET
    assert float((SIGMA2[informative] / level[informative]).sum()) == pytest.approx(uniform_over_informative,
                                                                                    rel=1e-12)
    assert predicted_variance_ratio(SIGMA2, level) == pytest.approx(NUM_INFORMATIVE / NUM_PROMPTS, rel=1e-12)
    # integer counts: the same up to rounding, and measured so
    row = table["P^1   [0,B]"]
    assert row["predicted"] == pytest.approx(uniform_over_informative, rel=5e-3)
    assert abs(row["measured"] - uniform_over_informative) < 4 * row["stderr"] + 5e-3 * uniform_over_informative


def test_power_one_gain_comes_from_taking_rollouts_off_zero_variance_prompts(table):
    # With the bounds: split the gain of n ~ P over uniform into (a) moving rollouts off P = 0 prompts (uniform
    # over the informative prompts with the rollouts they actually get) and (b) the rest.
    uniform, paper = table["uniform"], table["P^1   [8,24]"]
    informative_budget = BUDGET - paper["zero_p_rollouts"]
    uniform_over_informative = NUM_INFORMATIVE * SIGMA2.sum() / informative_budget
    from_zero_prompts = uniform["predicted"] / uniform_over_informative
    rest = uniform_over_informative / paper["predicted"]
    print(f"\npaper's rule with bounds: total gain x{uniform['predicted'] / paper['predicted']:.4f} = "
          f"x{from_zero_prompts:.4f} (rollouts moved off P=0 prompts: {uniform['zero_p_rollouts']} -> "
          f"{paper['zero_p_rollouts']}) * x{rest:.4f} (reshaping among P>0 prompts, from the bounds)")
    assert paper["zero_p_rollouts"] == 8 * (NUM_PROMPTS - NUM_INFORMATIVE)  # P = 0 prompts sit at n_min
    assert from_zero_prompts > 1.2 and from_zero_prompts > rest ** 3  # the dominant part of the gain
    combined = np.hypot(paper["stderr"], uniform["stderr"])
    assert uniform["measured"] - paper["measured"] > 5 * combined
