"""The mechanism testbed's task (data/testbed.py): sums of one-digit terms added in any order. Every worked
solution is a valid path (checked by an independent replay), the decision points are real (several valid next
lines, and the warm-up's solutions take different ones), the warm-up covers only its levels, the splits are
disjoint as multisets, the held-out split resolves by name and math-verify accepts the boxed total."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from megatron_dynamo.data import GENERATED_TASKS, load_math_file, make_testbed_task, sft_pairs
from megatron_dynamo.data.testbed import (LENGTHS, TEST_SIZE, WARMUP_LENGTHS, check_solution, is_held_out,
                                          make_warmup_problems, solve)

_SUM = re.compile(r"^[1-9](\+[1-9])+$")


def _replay(problem: str, solution: str) -> list[int]:
    """Independent check of a worked solution: the partner index chosen at every line (ValueError if a line is
    not the previous state with its first number added to one of the others)."""
    state = [int(t) for t in problem.split("+")]
    chosen = []
    for line in solution.split("\n"):
        boxed = re.fullmatch(r"\\boxed\{(\d+)\}", line)
        new = [int(boxed.group(1))] if boxed else [int(t) for t in line.split("+")]
        options = [j for j in range(1, len(state)) if [state[0] + state[j]] + state[1:j] + state[j + 1:] == new]
        if not options or bool(boxed) != (len(new) == 1):
            raise ValueError(f"{problem}: invalid line {line!r} after {state}")
        chosen.append(options[0])
        state = new
    if len(state) != 1:
        raise ValueError(f"{problem}: unfinished solution")
    return chosen


def test_problems_are_seeded_distinct_sums_with_valid_worked_solutions():
    task = make_testbed_task(500, seed=3)
    assert [e.id for e in task] == [e.id for e in make_testbed_task(500, seed=3)]
    assert [e.id for e in task] != [e.id for e in make_testbed_task(500, seed=4)]
    assert len({e.problem for e in task}) == 500
    assert Counter(e.extras["level"] for e in task) == {k: 100 for k in LENGTHS}
    for e in task:
        assert _SUM.match(e.problem) and e.id == f"testbed:{e.problem}"
        assert e.answer == str(sum(int(t) for t in e.problem.split("+")))
        assert len(e.extras["solution"].split("\n")) == e.extras["level"] - 1
        _replay(e.problem, e.extras["solution"])
        assert check_solution(e.problem, e.extras["solution"]) == (e.extras["level"] - 1,) * 2


def test_solutions_take_different_orders_so_every_line_is_a_decision_point():
    """The warm-up's worked solutions choose partners uniformly: at the first line of a 6-term sum each of the 5
    partners is taken about a fifth of the time (the model is taught that all orders are valid)."""
    warmup = make_warmup_problems(3000, seed=1)
    first = Counter(_replay(e.problem, e.extras["solution"])[0] for e in warmup if e.extras["level"] == 6)
    assert set(first) == {1, 2, 3, 4, 5}
    assert all(0.15 < c / sum(first.values()) < 0.25 for c in first.values()), first
    # the deterministic order (always the next term) is one valid path among many
    total, text = solve("3+8+5+2")
    assert (total, text) == (18, "11+5+2\n16+2\n\\boxed{18}")
    distinct = {solve("3+8+5+2", __import__("numpy").random.default_rng(s))[1] for s in range(200)}
    assert len(distinct) == 6  # 3 x 2 x 1 orders of the partners, all found


def test_check_solution_counts_valid_lines_and_stops_at_the_first_wrong_one():
    assert check_solution("3+8+5+2", "8+8+2\n10+8\n\\boxed{18}") == (3, 3)
    assert check_solution("3+8+5+2", "8+8+2\n10+8\n\\boxed{17}") == (2, 3)  # wrong last sum
    assert check_solution("3+8+5+2", "8+8+5\n13+5\n\\boxed{18}") == (0, 3)  # dropped the wrong term
    assert check_solution("3+8+5+2", "11+5+2\n16+3\n\\boxed{19}") == (1, 3)
    assert check_solution("3+8+5+2", "") == (0, 3)
    with pytest.raises(ValueError):
        check_solution("12+3", "15")


def test_warmup_covers_only_its_levels_and_training_prompts_cover_all():
    warmup = make_warmup_problems(900, seed=1)
    assert Counter(e.extras["level"] for e in warmup) == {k: 300 for k in WARMUP_LENGTHS}
    assert set(WARMUP_LENGTHS) < set(LENGTHS)
    task = GENERATED_TASKS["testbed"]
    assert task.sft is make_warmup_problems and {e.extras["level"] for e in task.make(50, 0)} == set(LENGTHS)
    # the warm-up trains on the worked solutions, not on the bare answers
    (prompt, completion), = sft_pairs(warmup[:1], template="synthetic", answer_format="plain")
    assert prompt == warmup[0].problem + "=" and completion == warmup[0].extras["solution"]


@pytest.mark.parametrize("seed", [0, 5])
def test_splits_are_disjoint_as_multisets(seed):
    test = load_math_file("testbed_test")
    assert len(test) == TEST_SIZE and test.path == "generated:testbed_test"
    assert Counter(e.extras["level"] for e in test) == {k: TEST_SIZE // len(LENGTHS) for k in LENGTHS}
    multisets = {tuple(sorted(e.problem.split("+"))) for e in test}
    train = make_testbed_task(3000, seed=seed)
    assert not multisets & {tuple(sorted(e.problem.split("+"))) for e in train}
    # any reordering of a held-out sum is held out
    for e in list(test)[:50]:
        assert all(is_held_out("+".join(p)) for p in itertools.islice(itertools.permutations(e.problem.split("+")), 24))
    assert [e.id for e in load_math_file("testbed_test")] == [e.id for e in test]


def test_math_verify_accepts_the_boxed_total_and_rejects_a_wrong_one():
    from megatron_dynamo.reward import MathRewardScorer

    e = make_testbed_task(1, seed=0)[0]
    with MathRewardScorer(num_workers=0) as scorer:
        rewards = scorer.score([e.extras["solution"], e.extras["solution"].replace(
            f"{{{e.answer}}}", f"{{{int(e.answer) + 1}}}")], [e.answer, e.answer]).rewards
    assert list(rewards) == [1.0, 0.0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_problems"):
        make_testbed_task(0)
    with pytest.raises(ValueError, match="split"):
        make_testbed_task(5, split="dev")
    with pytest.raises(ValueError, match="lengths"):
        make_testbed_task(5, lengths=(1,))
    with pytest.raises(ValueError, match="cannot draw"):
        make_testbed_task(200, split="test", lengths=(3,))  # only 43 held-out orderings of 3 terms


def _power_calc():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "power_calc.py"
    spec = importlib.util.spec_from_file_location("power_calc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_power_calc_t_quantiles_and_seed_count():
    pc = _power_calc()
    for q, df, want in ((0.975, 2, 4.3027), (0.8, 2, 1.0607), (0.975, 9, 2.2622), (0.975, 1000, 1.9623)):
        assert abs(pc.t_quantile(q, df) - want) < 2e-3
    # sigma^2 = 0, V_eval = 0.25 pts^2 (SE 0.5 per seed): t_{S-1} sum vs 1.5 / sqrt(0.25 / S)
    # S=3: 1.5 / 0.289 = 5.20 < 4.30 + 1.06; S=4: 1.5 / 0.25 = 6.0 >= 3.18 + 0.98
    assert pc.required_seeds(0.0, 0.25, 1.5, 0.8) == 4


@pytest.mark.slow
def test_power_calc_recovers_the_problem_clustered_evaluation_noise(tmp_path):
    """A pilot with known pass rates: variant A = B + a seed-specific shift, so the per-problem differences carry
    only sampling noise, V_eval = (w_A + w_B) / (n P); the script's estimate must match it (P = 400: ~7%) and its
    between-problem part must be ~0. Then the seed variance: shifts with SD 2 points over 12 seeds."""
    import json

    import numpy as np

    pc = _power_calc()
    rng = np.random.default_rng(0)
    P, n, seeds = 400, 8, 12
    p = rng.uniform(0.1, 0.9, P)
    shifts = rng.normal(0, 0.02, seeds)
    for s in range(seeds):
        for variant, rate in (("a", np.clip(p + shifts[s], 0, 1)), ("b", p)):
            d = tmp_path / "runs" / variant / f"seed{s + 1}" / "eval" / "step_000030"
            d.mkdir(parents=True)
            rows = [{"problem_id": f"q{i}", "correct": bool(rng.random() < rate[i])} for i in range(P) for _ in range(n)]
            (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (d.parent.parent / "metrics.jsonl").write_text(json.dumps({"step": 30, "step_seconds": 1.0}) + "\n")
    out = tmp_path / "power.json"
    assert pc.main([str(tmp_path), "--variants", "a,b", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    w = float(np.mean(p * (1 - p)))
    theory = 2 * w / (n * P) * 1e4
    assert abs(got["v_eval0"] / theory - 1) < 0.15, (got["v_eval0"], theory)
    assert got["tau_d2"] < 0.1 * got["w_sum"]
    assert 1.0 < got["sigma2_train"] < 10.0  # true 4 points^2, 11 df
    assert got["sigma2_train_upper80"] > got["sigma2_train"]
