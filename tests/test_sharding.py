"""Engine layout, the split of a step's prompts over engines, and the tensor exchange of scored responses.

Properties of ``assign_to_engines`` (hypothesis): every request gets one engine in range; the result depends only
on the loads (same inputs, same split, on every rank); the busiest engine carries at most 4/3 of the optimum's
load bound plus one request; one engine takes everything. ``gather_rollout`` on 3 gloo ranks with uneven shares,
one rank holding nothing: every rank gets every response, in canonical order, bit for bit.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynamo.parallel.topology import EngineLayout
from megatron_dynamo.rollout.sharding import assign_to_engines, engine_loads, request_loads


def test_layout_groups_consecutive_ranks():
    layouts = [EngineLayout(r, 8, 2) for r in range(8)]
    assert [lay.engine_index for lay in layouts] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [lay.is_leader for lay in layouts] == [True, False] * 4
    assert layouts[5].num_engines == 4
    with pytest.raises(ValueError, match="does not divide the 6 ranks"):
        EngineLayout(0, 6, 4)
    assert EngineLayout.of_process(1).world_size == 1  # no process group: one rank


def test_request_loads_count_prompt_once_and_responses_per_sample():
    assert request_loads([10, 20, 5], [2, 0, 3], 100.0) == [210.0, 0.0, 305.0]
    with pytest.raises(ValueError):
        request_loads([1], [1, 2], 3.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), max_size=80), st.integers(1, 9))
def test_assignment_is_complete_deterministic_and_balanced(loads, engines):
    assignment = assign_to_engines(loads, engines)
    assert len(assignment) == len(loads) and all(0 <= e < engines for e in assignment)
    assert assign_to_engines(list(loads), engines) == assignment
    totals = engine_loads(loads, assignment, engines)
    assert sum(totals) == pytest.approx(sum(loads))
    # LPT: the busiest engine carries at most the mean plus the largest single request (and 4/3 of the optimum).
    if loads:
        assert max(totals) <= sum(loads) / engines + max(loads) + 1e-6
    if engines == 1:
        assert set(assignment) <= {0}


def test_equal_loads_spread_evenly_and_idle_requests_round_robin():
    assert sorted(engine_loads([1.0] * 8, assign_to_engines([1.0] * 8, 4), 4)) == [2.0] * 4
    assert assign_to_engines([0.0, 0.0, 0.0], 2) == [0, 1, 0]
    with pytest.raises(ValueError):
        assign_to_engines([1.0], 0)


def _exchange_worker(rank, world_size):
    from megatron_dynamo.rollout.exchange import ScoredResponses, gather_rollout

    shares = {  # rank 2 holds nothing (a rank that is no engine leader, or an engine without prompts)
        0: ScoredResponses([3, 0, 0], [0, 1, 0], [(5, 6), (7,), ()], [False, True, False], [1.0, 0.0, 0.5]),
        1: ScoredResponses([1, 2], [0, 0], [(9, 9, 9), (1, 2, 3, 4)], [True, False], [0.25, 1.0],
                           [(-0.5, -1.0, -1.5), (-0.25, -2.0, -3.0, -4.0)]),  # the engine's log-probs travel too
    }
    merged = vars(gather_rollout(shares.get(rank)))
    # rank 0's share came without log-probs: NaN in their place
    merged["logprobs"] = [tuple(None if x != x else x for x in values) for values in merged["logprobs"]]
    return merged


@pytest.mark.distributed
def test_gather_rollout_gives_every_rank_everything_in_canonical_order():
    from multiproc import run_on_ranks

    results = run_on_ranks(_exchange_worker, 3)
    expected = {"prompt_index": [0, 0, 1, 2, 3], "sample_index": [0, 1, 0, 0, 0],
                "token_ids": [(), (7,), (9, 9, 9), (1, 2, 3, 4), (5, 6)],
                "truncated": [False, True, True, False, False], "rewards": [0.5, 0.0, 0.25, 1.0, 1.0],
                "logprobs": [(), (None,), (-0.5, -1.0, -1.5), (-0.25, -2.0, -3.0, -4.0), (None, None)],
                "routed_experts": [None] * 5}  # a dense rollout: no response carries experts
    assert results == [expected] * 3


def test_gather_rollout_on_one_process_sorts():
    from megatron_dynamo.rollout.exchange import ScoredResponses, gather_rollout

    merged = gather_rollout(ScoredResponses([1, 0], [0, 0], [(1,), (2, 2)], [False, False], [0.0, 1.0]))
    assert merged.prompt_index == [0, 1] and merged.token_ids == [(2, 2), (1,)]
