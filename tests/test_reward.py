"""Reward stage: answer extraction and math-verify scoring in worker processes (timeouts, kills, caching)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynamo.reward import REWARD_REASONS, MathRewardScorer, extract_answer
from megatron_dynamo.reward.answers import integer_verdict
from megatron_dynamo.reward.verify import verify_answer

MATH_DATA = Path(__file__).parent / "fixtures" / "math"  # the first rows of every benchmark file (its README)

# A power tower: sympy's comparison runs until math-verify's alarm fires (measured: exactly the timeout).
POWER_TOWER = "\\boxed{9^{9^{9^{9^{9^{9}}}}}}"
TIMEOUT_SECONDS = 2


@pytest.fixture(scope="module")
def scorer():
    with MathRewardScorer(num_workers=2, timeout_seconds=TIMEOUT_SECONDS, hard_timeout_seconds=8.0) as s:
        yield s


# (case id, response, reference, expected reason). Units: math-verify's normalisation drops units it knows
# (\text{ cm}, \mathrm{~cm}, a bare "cm", ^\circ, \%, \$), so those match the bare number; an unknown word
# ("dollars" outside \text) becomes a product of symbols and does not.
TABLE = [
    ("boxed_int", "So the total is \\boxed{42}.", "42", "correct"),
    ("boxed_int_wrong", "So the total is \\boxed{41}.", "42", "wrong"),
    ("unboxed_final_number", "Adding them up, the answer is 204.", "204", "correct"),
    ("unboxed_thousands", "Final answer: 1,000", "1000", "correct"),
    ("unboxed_negative", "Therefore x = -7", "-7", "correct"),
    ("inline_math_last", "Thus the probability is $\\frac{3}{4}$.", "0.75", "correct"),
    ("fraction_vs_decimal", "\\boxed{\\frac{1}{2}}", "0.5", "correct"),
    ("decimal_vs_fraction", "\\boxed{0.5}", "\\frac{1}{2}", "correct"),
    ("dfrac", "\\boxed{\\dfrac{1}{2}}", "\\frac12", "correct"),
    ("slash_fraction", "\\boxed{1/2}", "0.5", "correct"),
    ("third_rounded_6", "\\boxed{0.333333}", "\\frac13", "correct"),
    ("third_rounded_3", "\\boxed{0.333}", "\\frac13", "wrong"),
    ("sqrt", "\\boxed{\\sqrt{2}}", "\\sqrt 2", "correct"),
    ("sqrt_simplify", "\\boxed{2\\sqrt{3}}", "\\sqrt{12}", "correct"),
    ("pi", "\\boxed{\\pi}", "\\pi", "correct"),
    ("pi_decimal", "\\boxed{3.14159}", "\\pi", "wrong"),
    ("polynomial", "\\boxed{x^2+2x+1}", "(x+1)^2", "correct"),
    ("tuple", "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", "correct"),
    ("set_escaped_braces", "\\boxed{\\{1,2\\}}", "\\{1,2\\}", "correct"),
    ("equation_rhs", "\\boxed{x = 5}", "5", "correct"),
    ("units_text", "\\boxed{5 \\text{ cm}}", "5", "correct"),
    ("units_bare_word", "\\boxed{5 cm}", "5", "correct"),
    ("units_mathrm", "\\boxed{5}", "5 \\mathrm{~cm}", "correct"),
    ("units_text_word", "\\boxed{18 \\text{ dollars}}", "18", "correct"),
    ("units_unknown_word", "\\boxed{18 dollars}", "18", "wrong"),
    ("degrees", "\\boxed{41.8^\\circ}", "41.8", "correct"),
    ("percent", "\\boxed{50\\%}", "50", "correct"),
    ("dollar_sign", "\\boxed{\\$18}", "18", "correct"),
    ("reference_in_dollars", "\\boxed{\\frac{1}{2n+2}}", "$\\frac{1}{2 n+2}$", "correct"),
    ("scientific_reference", "\\boxed{3.83 \\times 10^{35}}", "3.83e35", "correct"),
    ("multiple_boxed_last_wins", "First \\boxed{3}, on reflection \\boxed{4}.", "4", "correct"),
    ("multiple_boxed_first_loses", "First \\boxed{3}, on reflection \\boxed{4}.", "3", "wrong"),
    ("echoed_empty_box", "The answer is \\boxed{12}. I put it in \\boxed{}.", "12", "correct"),
    ("fbox", "\\fbox{42}", "42", "correct"),
    ("boxed_no_braces", "\\boxed 42", "42", "correct"),
    ("choice_letter", "\\boxed{(B)}", "B", "correct"),
    ("garbage", "I have no idea, sorry!", "5", "no_answer"),
    ("boxed_text", "\\boxed{\\text{no idea}}", "5", "wrong"),
    ("empty", "", "5", "empty"),
    ("whitespace", "   \n ", "5", "empty"),
    ("none_response", None, "5", "empty"),
    ("too_long_answer", "\\boxed{" + "1+" * 600 + "1}", "1201", "too_long"),
    ("candidates_second", "\\boxed{0.02}", ["0.01", "0.02"], "correct"),
    ("candidates_none", "\\boxed{0.03}", ["0.01", "0.02"], "wrong"),
    ("candidates_latex_form", "\\boxed{7.5 \\times 10^7}", ["7.5e7", "7.5 \\times 10^7"], "correct"),
    ("reference_unparsable", "\\boxed{1}", "\\text{}", "error"),
]


@pytest.fixture(scope="module")
def table_result(scorer):
    return scorer.score([c[1] for c in TABLE], [c[2] for c in TABLE])


@pytest.mark.parametrize("case_id,response,reference,expected", TABLE, ids=[c[0] for c in TABLE])
def test_answer_table(table_result, case_id, response, reference, expected):
    index = [c[0] for c in TABLE].index(case_id)
    reason = table_result.reasons[index]
    assert reason == expected, f"{case_id}: extracted {table_result.extracted_answers[index]!r} -> {reason}"
    assert table_result.rewards[index] == (1.0 if expected == "correct" else 0.0)


def test_table_stats(table_result):
    stats = table_result.stats
    assert table_result.rewards.dtype == np.float32 and table_result.rewards.shape == (len(TABLE),)
    assert sum(stats.counts.values()) == stats.num_responses == len(TABLE)
    assert set(stats.counts) == set(REWARD_REASONS)
    assert stats.counts["correct"] == int(table_result.rewards.sum())
    # identical (reference, answer) pairs (the two multiple_boxed cases differ by reference) are verified once
    metrics = stats.as_metrics()
    assert metrics["reward/correct"] == stats.counts["correct"] and "reward/seconds" in metrics


# --- extraction -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response,expected", [
    ("\\boxed{\\frac{a}{b}}", "\\frac{a}{b}"),
    ("\\boxed{ 7 }", "7"),
    ("\\boxed{1} and \\boxed{2}", "2"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{5} then later \\boxed{6", "5"),        # an unclosed last box falls back to the previous one
    ("\\boxed{42", "42"),                            # ... or to the last number
    ("answer \\boxed{9} echo \\boxed{}", "9"),
    ("so $x = 3$ and hence $y=4$", "y=4"),
    ("we have $x=3$, so the answer is 12.", "12"),
    ("the value is \\(\\sqrt{2}\\)", "\\sqrt{2}"),
    ("x2 is the answer", None),
    ("3/4 of them", "3/4"),
    ("", None),
    ("no numbers here", None),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_extract_answer_require_boxed():
    assert extract_answer("the answer is 7", require_boxed=True) is None
    assert extract_answer("\\boxed{7}", require_boxed=True) == "7"


@pytest.mark.parametrize("kind", ["letters", "digits", "open_boxes", "open_braces", "dollars", "parens",
                                  "box_at_end", "huge_box"])
def test_extract_answer_is_fast_on_200k_characters(kind):
    n = 200_000
    text = {
        "letters": "x" * n,
        "digits": "1" * n,
        "open_boxes": "\\boxed{" * (n // 7),
        "open_braces": "{" * n,
        "dollars": "$" * n,
        "parens": "\\(" * (n // 2),
        "box_at_end": "a" * n + "\\boxed{7}",
        "huge_box": "\\boxed{" + "1+" * (n // 2) + "1}",
    }[kind]
    start = time.perf_counter()
    answer = extract_answer(text)
    assert time.perf_counter() - start < 0.5
    if kind == "box_at_end":
        assert answer == "7"
    if kind == "huge_box":  # not a number picked out of the box: too long, so the scorer rejects it
        assert len(answer) > 1000


# --- scoring behaviour ----------------------------------------------------------------------------------------

def test_200k_character_response_scores_zero_quickly(scorer):
    responses = ["x" * 200_000, "7" * 200_000, "\\boxed{" + "1+" * 100_000 + "1}", "\\boxed{" * 28_000]
    start = time.perf_counter()
    result = scorer.score(responses, ["3", "7", "1", "1"])
    assert time.perf_counter() - start < 3.0
    assert result.rewards.tolist() == [0.0] * 4
    assert result.reasons == ["no_answer", "too_long", "too_long", "no_answer"]


def test_truncated_responses_score_zero(scorer):
    result = scorer.score(["\\boxed{4}", "\\boxed{4}", "\\boxed{4}"], ["4", "4", "4"],
                          finish_reasons=["length", "stop", None])
    assert result.reasons == ["truncated", "correct", "correct"]
    result = scorer.score(["\\boxed{4}", "\\boxed{4}"], ["4", "4"], truncated=[True, False])
    assert result.rewards.tolist() == [0.0, 1.0]
    assert result.stats.counts["truncated"] == 1


def test_cache_verifies_each_pair_once(scorer):
    responses = ["\\boxed{1.5}", "I get 1.5", "\\boxed{1.5}", "\\boxed{2.5}", "\\boxed{1.5}"]
    references = ["1.5", "1.5", "1.5", "1.5", ["1.5", "3/2"]]
    result = scorer.score(responses, references)
    assert result.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]
    # ("1.5","1.5") three times -> one check; ("1.5","2.5") one; (("1.5","3/2"),"1.5") one
    assert result.stats.num_verified == 3 and result.stats.cache_hits == 2 and result.stats.integers_compared == 0


def test_plain_integers_are_compared_without_math_verify():
    responses = ["\\boxed{6}", "I get 006", "\\boxed{7}", "\\boxed{6}", "\\boxed{6}", "\\boxed{1,000}"]
    references = ["6", "6", "6", ["6", "12"], ["6", "six"], "1000"]
    with MathRewardScorer(num_workers=1, timeout_seconds=TIMEOUT_SECONDS) as fresh:  # nothing remembered
        result = fresh.score(responses, references)
    assert result.reasons == ["correct", "correct", "wrong", "correct", "correct", "correct"]
    # a form that is not a plain integer ("six"), or an answer with a separator, goes to math-verify
    assert result.stats.integers_compared == 4 and result.stats.num_verified == 2


# Plain integers as a model or a dataset writes them: signs, leading zeros, neighbours that differ in the last of
# up to 30 digits. A string, so that the zeros and the sign are kept as written.
_INTEGER_TEXT = st.builds(lambda sign, zeros, digits: sign + "0" * zeros + digits,
                          st.sampled_from(["", "-"]), st.integers(0, 2),
                          st.from_regex(r"[1-9][0-9]{0,29}|0", fullmatch=True))


@settings(max_examples=150, deadline=None)
@given(answer=_INTEGER_TEXT, reference=_INTEGER_TEXT, neighbour=st.sampled_from([None, -1, 0, 1]))
def test_integer_verdict_is_math_verifys(answer, reference, neighbour):
    if neighbour is not None:  # the reference next to (or equal to) the answer, written without zeros
        reference = str(int(answer) + neighbour)
    verdict = integer_verdict(answer, (reference,))
    assert verdict in ("correct", "wrong")
    assert verdict == verify_answer(answer, (reference,), TIMEOUT_SECONDS)[0]


@pytest.mark.parametrize("answer, forms", [
    ("1,000", ("1000",)), ("+5", ("5",)), ("\u0667", ("7",)), ("7.0", ("7",)), ("7", ("7", "x")), ("7", ()),
    ("-", ("0",)), ("1" * 31, ("1" * 31,)),
])
def test_integer_verdict_leaves_anything_else_to_math_verify(answer, forms):
    assert integer_verdict(answer, forms) is None


def test_later_calls_reuse_verdicts_but_not_timeouts(monkeypatch):
    from megatron_dynamo.reward import math_reward

    monkeypatch.setattr(math_reward, "REMEMBERED_PAIRS", 3)
    with MathRewardScorer(num_workers=1, timeout_seconds=1) as fresh:
        responses, references = ["\\boxed{1.2}", "\\boxed{1.3}", POWER_TOWER], ["1.2", "1.2", "1"]
        first = fresh.score(responses, references)
        assert first.reasons == ["correct", "wrong", "timeout"] and first.stats.num_verified == 3
        again = fresh.score(responses + ["\\boxed{1.2}"], references + ["1.2"])
        assert again.reasons == first.reasons + ["correct"]
        # the timeout goes to math-verify again (it may be the machine's load); the verdicts do not
        assert again.stats.num_verified == 1 and again.stats.cache_hits == 3
        # only the most recently used pairs are kept: two new ones push (1.2, 1.3), the oldest, out
        fresh.score(["\\boxed{1.4}", "\\boxed{1.5}"], ["1.2", "1.2"])
        last = fresh.score(["\\boxed{1.3}", "\\boxed{1.2}"], ["1.2", "1.2"])
        assert last.reasons == ["wrong", "correct"]
        assert last.stats.num_verified == 1 and last.stats.cache_hits == 1


def test_minerva_candidates_from_the_data():
    from megatron_dynamo.data import load_math_jsonl

    path = MATH_DATA / "minerva_math.jsonl"
    examples = {e.id: e for e in load_math_jsonl(path)}
    example = next(e for e in examples.values() if e.answer == "3.83e35")
    assert example.references()[0] == "3.83e35" and "3.83 \\times 10^{35}" in example.references()
    with MathRewardScorer(num_workers=0, timeout_seconds=TIMEOUT_SECONDS) as inline:
        result = inline.score(["\\boxed{3.83 \\times 10^{35}}", "\\boxed{3.83}"],
                              [example.references(), example.references()])
    assert result.reasons == ["correct", "wrong"]


def test_mismatched_lengths_raise(scorer):
    with pytest.raises(ValueError, match="references"):
        scorer.score(["\\boxed{1}", "\\boxed{2}"], ["1"])
    with pytest.raises(ValueError, match="finish_reasons"):
        scorer.score(["\\boxed{1}"], ["1"], finish_reasons=[None, None])


def test_math_verify_timeout_is_counted_and_the_pool_keeps_scoring(scorer, capfd):
    start = time.perf_counter()
    result = scorer.score([POWER_TOWER, "\\boxed{3.5}"], ["1", "3.5"])
    elapsed = time.perf_counter() - start
    assert result.reasons == ["timeout", "correct"]
    assert result.stats.counts["timeout"] == 1
    # it really ran into math-verify's alarm (not a fast failure), and well before the hard limit
    assert TIMEOUT_SECONDS - 0.5 <= elapsed < scorer.hard_timeout_seconds
    assert result.stats.workers_replaced == 0
    after = scorer.score(["\\boxed{10.5}", "\\boxed{11.5}"], ["10.5", "10.5"])
    assert after.reasons == ["correct", "wrong"]
    # math-verify's logger would print the whole expression on a timeout: silenced in the workers
    captured = capfd.readouterr()
    assert "9^{9^{9" not in captured.out + captured.err


def test_hard_timeout_kills_and_replaces_the_worker(caplog):
    # math-verify's own limit (5 s) is above the parent's hard limit (1 s): the parent must kill the worker.
    with MathRewardScorer(num_workers=1, timeout_seconds=5, hard_timeout_seconds=1.0) as single:
        start = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="megatron_dynamo.reward.pool"):
            result = single.score([POWER_TOWER, "\\boxed{3.5}", "\\boxed{4.5}"], ["1", "3.5", "5.5"])
        elapsed = time.perf_counter() - start
        assert result.reasons == ["timeout", "correct", "wrong"]
        assert result.stats.workers_replaced == 1
        assert elapsed < 8.0  # 1 s limit + restart of one worker (the replacement count proves the kill)
        assert any("hard limit" in r.getMessage() for r in caplog.records)
        assert single.score(["\\boxed{8.5}"], ["8.5"]).reasons == ["correct"]


def _worker_pids() -> set[int]:
    """The reward workers of this process (spawned multiprocessing children; the resource tracker is not one)."""
    import psutil

    return {p.pid for p in psutil.Process().children()
            if any("spawn_main" in part for part in p.cmdline())}


def test_a_worker_killed_from_outside_is_replaced(scorer):
    # an idle worker killed from outside (pebble's own pool breaks as a whole then: rebuilt, nothing lost), then a
    # busy one (its item is retried on a fresh worker). Decimals: plain integers never reach the workers.
    scorer.score(["\\boxed{1.25}"], ["1.25"])
    pids = _worker_pids()
    assert len(pids) == 2
    os.kill(min(pids), signal.SIGKILL)
    time.sleep(0.5)
    result = scorer.score([f"\\boxed{{{i}.75}}" for i in range(20)], [f"{i}.75" for i in range(20)])
    assert result.rewards.tolist() == [1.0] * 20
    assert min(pids) not in _worker_pids() and len(_worker_pids()) == 2
    busy = sorted(_worker_pids())
    killer = threading.Timer(0.3, os.kill, (busy[0], signal.SIGKILL))
    killer.start()
    result = scorer.score([POWER_TOWER, POWER_TOWER, "\\boxed{3.125}"], ["1", "1", "3.125"])
    killer.join()
    assert result.reasons == ["timeout", "timeout", "correct"]
    assert busy[0] not in _worker_pids() and len(_worker_pids()) == 2


def test_inline_mode_and_score_one():
    with MathRewardScorer(num_workers=0, timeout_seconds=TIMEOUT_SECONDS) as inline:
        assert inline.score_one("\\boxed{\\frac{2}{4}}", "1/2") == 1.0
        assert inline.score_one("\\boxed{3}", "1/2") == 0.0
        assert inline.score_one("\\boxed{3}", "3", finish_reason="length") == 0.0


def test_closed_scorer_refuses_work():
    scorer = MathRewardScorer(num_workers=1)
    scorer.close()
    scorer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["1"], ["1"])


def test_bad_configuration_is_rejected():
    with pytest.raises(ValueError, match="timeout_seconds"):
        MathRewardScorer(num_workers=0, timeout_seconds=0.5)
    with pytest.raises(ValueError, match="num_workers"):
        MathRewardScorer(num_workers=-1)


def test_synthetic_answers_in_model_output_forms(scorer):
    from megatron_dynamo.data import make_synthetic_task

    task = make_synthetic_task(60, seed=3)
    plain = scorer.score([e.answer for e in task], [e.answer for e in task])
    boxed = scorer.score([f"\\boxed{{{e.answer}}}" for e in task], [e.answer for e in task])
    off_by_one = scorer.score([str(int(e.answer) + 1) for e in task], [e.answer for e in task])
    assert plain.rewards.all() and boxed.rewards.all() and not off_by_one.rewards.any()
    json.dumps(plain.stats.as_metrics())  # plain floats, loggable as JSON
