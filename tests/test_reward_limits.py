"""A time budget for scoring a batch and a memory limit for the reward workers (issue 33): N slow answers cost about
N x timeout / workers before; now past ``reward.batch_seconds`` the answers left get 0 (reason ``timeout``, the
verifier's own rule applied batch-wide) and are counted in ``reward/over_budget``; each worker's address space may
grow ``reward.worker_memory_mb`` beyond its start-up size, past which an allocation fails and the answer is an
``error``. Real math-verify workers (pebble), real rlimits."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from megatron_dynamo.reward import MathRewardScorer

TIMEOUT = 2
# Power towers: sympy compares them until math-verify's alarm fires (TIMEOUT s each); distinct, so none is cached.
TOWERS = [f"\\boxed{{9^{{9^{{9^{{9^{{9^{{{k}}}}}}}}}}}}}" for k in range(2, 10)]


def _score(scorer, answers):
    start = time.perf_counter()
    result = scorer.score(answers, ["1"] * len(answers))
    return result, time.perf_counter() - start


@pytest.mark.slow
def test_past_the_batch_budget_the_remaining_answers_score_zero_and_are_counted():
    with MathRewardScorer(num_workers=2, timeout_seconds=TIMEOUT, hard_timeout_seconds=8.0) as unlimited:
        _score(unlimited, ["\\boxed{1.5}"])  # the workers' start-up is not scoring time (not an integer: they score it)
        _, slow = _score(unlimited, TOWERS)
    with MathRewardScorer(num_workers=2, timeout_seconds=TIMEOUT, hard_timeout_seconds=8.0,
                          max_batch_seconds=3.0) as budgeted:
        _score(budgeted, ["\\boxed{1.5}"])
        result, elapsed = _score(budgeted, TOWERS)
        budgeted.max_batch_seconds = None  # (the replacements' start-up may take longer than 3 s on a busy machine)
        after = budgeted.score(["\\boxed{3.5}"], ["3.5"])  # the workers stopped at the budget were replaced
    print(f"\n8 slow answers, 2 workers: {slow:.1f} s without a budget, {elapsed:.1f} s with 3 s "
          f"({result.stats.over_budget} over budget)")
    assert slow >= len(TOWERS) * TIMEOUT / 2 - 0.5  # what the issue measured: N x timeout / workers
    assert elapsed < 3.0 + 1.5  # the budget, plus stopping the workers that were busy
    assert result.rewards.tolist() == [0.0] * len(TOWERS) and set(result.reasons) == {"timeout"}
    # 2 workers finish 1 to 4 answers of ~2 s in 3 s (one may still be starting); the others are over budget
    assert len(TOWERS) - 4 <= result.stats.over_budget <= len(TOWERS) - 1
    assert result.stats.as_metrics()["reward/over_budget"] == result.stats.over_budget
    assert result.stats.workers_replaced >= 1 and after.reasons == ["correct"]


def _worker_limits(expected: int) -> list[tuple[int, int]]:
    """(RLIMIT_AS soft limit, address-space size) of each reward worker of this process, once ``expected`` of
    them have finished starting (a worker sets its limit at the end of its start-up, after math-verify's imports)."""
    deadline = time.monotonic() + 60
    while True:
        workers = [p for p in psutil.Process().children() if any("spawn_main" in part for part in p.cmdline())]
        limits = [(w.rlimit(psutil.RLIMIT_AS)[0], w.memory_info().vms) for w in workers]
        if sum(soft != psutil.RLIM_INFINITY for soft, _ in limits) >= expected or time.monotonic() > deadline:
            return limits
        time.sleep(0.2)


def test_each_worker_gets_a_memory_limit_above_its_start_up_size():
    with MathRewardScorer(num_workers=2, timeout_seconds=TIMEOUT, worker_memory_mb=256) as scorer:
        assert scorer.score(["\\boxed{1.5}"], ["1.5"]).reasons == ["correct"]
        limits = _worker_limits(2)
        assert len(limits) == 2
        for soft, size in limits:
            assert 200 * 2**20 < soft - size <= 256 * 2**20, (soft, size)
    with MathRewardScorer(num_workers=1, timeout_seconds=TIMEOUT, worker_memory_mb=0) as unlimited:
        unlimited.score(["\\boxed{1.5}"], ["1.5"])
        time.sleep(1)
        assert [soft for soft, _ in _worker_limits(0)] == [psutil.RLIM_INFINITY]


def test_an_allocation_past_the_limit_fails_and_the_answer_is_an_error(monkeypatch):
    code = ("from megatron_dynamo.reward.verify import limit_memory_growth\n"
            "limit_memory_growth(64 * 2**20)\nok = bytearray(16 * 2**20)\n"
            "try:\n    bytearray(256 * 2**20)\nexcept MemoryError:\n    print('MemoryError')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.strip() == "MemoryError", proc.stderr
    import math_verify

    from megatron_dynamo.reward import verify

    def greedy(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(math_verify, "parse", greedy)
    assert verify.verify_answer("2^{2^{40}}", ("1",), TIMEOUT) == ("error", verify.MEMORY_LIMIT)


def test_the_trainer_scores_with_the_runs_reward_limits(monkeypatch, tmp_path):
    """The scorer of a training or engine rank (rollout_setup.create_scorer, which Trainer and the engine ranks
    call) gets reward.timeout_seconds / batch_seconds / worker_memory_mb (before: no budget at all); 0 turns the
    budget off; an engine's other ranks get none; bad values are config errors."""
    from types import SimpleNamespace

    from megatron_dynamo.config import ConfigError
    from megatron_dynamo.parallel.topology import EngineLayout
    from megatron_dynamo.trainer import rollout_setup
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.rollout_setup import create_scorer

    made = []
    monkeypatch.setattr(rollout_setup, "MathRewardScorer", lambda *args, **kwargs: made.append((args, kwargs)))
    leader, follower = SimpleNamespace(layout=EngineLayout(0, 2, 2)), SimpleNamespace(layout=EngineLayout(1, 2, 2))
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "cpu_default.yaml")
    for overrides, budget in (([], 600.0), (["reward.batch_seconds=0", "reward.timeout_seconds=3"], None)):
        run = load_run_config(config, [f"trainer.output_dir={tmp_path / 'run'}", "reward.worker_memory_mb=512",
                                       *overrides])
        assert create_scorer(run.reward, follower) is None and not made
        create_scorer(run.reward, leader)
        args, kwargs = made.pop()
        assert args[1] == run.reward.timeout_seconds
        assert kwargs == {"max_batch_seconds": budget, "worker_memory_mb": 512}
    for bad in ("reward.batch_seconds=-1", "reward.timeout_seconds=0", "reward.worker_memory_mb=-5"):
        with pytest.raises(ConfigError, match="reward"):
            load_run_config(config, [bad])
