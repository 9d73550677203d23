"""The reasoning task of the CPU ablation testbed (data/reasoning.py): correct worked solutions, lengths in the
20-80 token range, a spread of chain lengths, disjoint seeded splits, the held-out split by name, math-verify."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from megatron_dynamo.config import ConfigError
from megatron_dynamo.data import GENERATED_TASKS, load_math_file, make_reasoning_task, sft_pairs
from megatron_dynamo.data.reasoning import CHAIN_LENGTHS, TEST_SIZE, is_held_out

_CHAIN = re.compile(r"^[1-9]([+-][1-9])+$")


def _value(expression: str) -> int:
    """Left-to-right value of ``a+b-c...`` (independent of the generator's solver)."""
    tokens = re.findall(r"[+-]?\d+", expression)
    return sum(int(t) for t in tokens)


def test_problems_are_seeded_distinct_chains_with_correct_worked_solutions():
    task = make_reasoning_task(400, seed=3)
    assert [e.id for e in task] == [e.id for e in make_reasoning_task(400, seed=3)]
    assert [e.id for e in task] != [e.id for e in make_reasoning_task(400, seed=4)]
    assert len({e.problem for e in task}) == 400
    for e in task:
        assert _CHAIN.match(e.problem), e.problem
        answer = _value(e.problem)
        assert e.answer == str(answer) and e.id == f"reasoning:{e.problem}"
        lines = e.extras["solution"].split("\n")
        assert lines[-1] == f"\\boxed{{{answer}}}"
        assert len(lines) == e.extras["level"] - 1  # one line per operation
        previous = e.problem
        for line in lines[:-1]:  # each line is the previous one with its first operation done
            assert _value(line) == answer
            first, rest = re.match(r"^(\d+[+-]\d+)(.*)$", previous).groups()
            assert line == f"{_value(first)}{rest}"
            previous = line
        # running totals stay in 0..99
        totals = [_value(e.problem[:i]) for i in range(1, len(e.problem) + 1, 2)]
        assert min(totals) >= 0 and max(totals) <= 99


def test_solution_lengths_and_chain_lengths_spread_over_the_range():
    from megatron_dynamo.data.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    task = make_reasoning_task(500, seed=0)
    assert Counter(e.extras["level"] for e in task) == {k: 100 for k in CHAIN_LENGTHS}
    tokens = [len(tokenizer.encode(e.extras["solution"], add_special_tokens=False)) + 1 for e in task]  # + EOS
    assert 20 <= min(tokens) and max(tokens) <= 80
    by_level = {k: [t for t, e in zip(tokens, task) if e.extras["level"] == k] for k in CHAIN_LENGTHS}
    # Longer chains need strictly more tokens: chain length is a difficulty axis of its own.
    for short, long in zip(CHAIN_LENGTHS, CHAIN_LENGTHS[1:]):
        assert max(by_level[short]) < min(by_level[long])


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_train_and_held_out_splits_are_disjoint_for_every_seed(seed):
    test = load_math_file("reasoning_test")
    assert len(test) == TEST_SIZE and test.path == "generated:reasoning_test"
    test_problems = {e.problem for e in test}
    assert all(is_held_out(p) for p in test_problems)
    train = make_reasoning_task(2000, seed=seed)
    assert not test_problems & {e.problem for e in train}
    assert not any(is_held_out(e.problem) for e in train)
    # The held-out split is fixed: the same problems whatever the training seed.
    assert [e.id for e in load_math_file("reasoning_test")] == [e.id for e in test]
    assert set(Counter(e.extras["level"] for e in test)) == set(CHAIN_LENGTHS)


def test_held_out_split_resolves_for_evaluation_and_training_config():
    from megatron_dynamo.eval.runner import EvalConfig, load_benchmarks

    (bench,) = load_benchmarks(EvalConfig(benchmarks=("reasoning_test",), n=1, k=(1,)))
    assert bench.name == "reasoning_test" and len(bench.problems) == TEST_SIZE
    assert "reasoning" in GENERATED_TASKS and "synthetic" in GENERATED_TASKS


def test_answers_and_worked_solutions_are_verified_by_math_verify():
    from megatron_dynamo.reward.math_reward import MathRewardScorer

    task = make_reasoning_task(40, seed=2)
    with MathRewardScorer(num_workers=1) as scorer:
        right = scorer.score([e.extras["solution"] for e in task], [e.references() for e in task])
        wrong = scorer.score([e.extras["solution"].rsplit("{", 1)[0] + f"{{{int(e.answer) + 1}}}" for e in task],
                             [e.references() for e in task])
    assert list(right.rewards) == [1.0] * len(task)
    assert list(wrong.rewards) == [0.0] * len(task)


def test_warm_up_trains_on_worked_solutions_from_its_own_problems():
    from megatron_dynamo.trainer.config import load_run_config

    task = make_reasoning_task(3, seed=0)
    assert [c for _, c in sft_pairs(task)] == [e.extras["solution"] for e in task]
    assert [p for p, _ in sft_pairs(task)] == [e.problem + "=" for e in task]
    run = load_run_config("configs/cpu_reasoning.yaml", ["trainer.steps=0"])
    assert run.trainer.steps == 0 and run.data.train == "reasoning" and run.data.sft_problems > 0
    warm_up = GENERATED_TASKS["reasoning"].make(run.data.sft_problems, run.data.seed + 1)
    assert len({e.problem for e in warm_up}) == run.data.sft_problems
    with pytest.raises(ConfigError, match="sft_problems"):
        load_run_config("configs/cpu_reasoning.yaml", ["data.train=some.jsonl"])
    with pytest.raises(ConfigError, match="trainer.steps: must be >= 0"):
        load_run_config("configs/cpu_reasoning.yaml", ["trainer.steps=-1"])
