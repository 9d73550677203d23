"""Verifiable math reward: final-answer extraction + math-verify in a pool of worker processes.

Reward of a response: 1.0 when math-verify accepts its final answer against the reference answer (or any of a
list of accepted reference forms), else 0.0. Scoring never raises for a bad response: every failure mode gives
reward 0 and is counted under one reason in :class:`RewardStats`:

- ``correct``: math-verify accepted the answer
- ``wrong``: parsed and compared, not equal
- ``no_answer``: no final answer in the text, or math-verify could not parse it
- ``too_long``: the extracted answer is longer than ``max_answer_chars`` (never sent to sympy)
- ``empty``: empty or whitespace-only response (or ``None``)
- ``truncated``: the engine stopped at the token limit (``finish_reason == "length"``); checked first
- ``timeout``: math-verify's own alarm fired, or the item ran past the hard wall-clock limit and its worker
  was killed and replaced, or the batch's time budget ran out before it was scored (also counted in
  ``over_budget``)
- ``error``: anything else: a worker died twice on the item, no reference form could be parsed, every
  comparison raised

Where the parts live: :mod:`megatron_dynamo.reward.answers` extracts the final answer and writes the LaTeX that
math-verify parses; :mod:`megatron_dynamo.reward.verify` is what runs in a worker (math-verify on one answer);
:mod:`megatron_dynamo.reward.pool` is the pool of worker processes (pebble's ``ProcessPool``: math-verify's alarms
work in a worker's main thread, and a worker past the hard wall-clock limit per item is killed and replaced while
the other workers keep going). This module is the scorer: rule order, the cache of verdicts, counts and timing.

Two kinds of pair are decided without a worker: one verified before (the cache of verdicts), and one whose answer
and reference forms are all plain decimal integers (``answers.integer_verdict``: compared as numbers, math-verify's
verdict on such a pair; the IPC round trip and sympy's parse cost ~1 ms a pair, the comparison microseconds).

Units (what counts): the answer and the reference are both normalised by math-verify, which drops text units
(``\\text{ cm}``, ``\\text{ dollars}``, ``\\mathrm{~cm}``), a bare common unit word such as ``cm``, degrees
``^\\circ``, a currency ``\\$`` and a trailing ``\\%`` -- so ``\\boxed{5 \\text{ cm}}`` matches the reference
``5``. A bare word it does not know (``18 dollars`` outside ``\\text``) is parsed as a product of symbols and
does not match ``18``: models are asked for a boxed number, and this keeps the rule math-verify's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from megatron_dynamo.cpus import usable_cpu_count
from megatron_dynamo.reward.answers import Reference, extract_answer, integer_verdict, normalize_references
from megatron_dynamo.reward.pool import OVER_BUDGET, VerifierPool
from megatron_dynamo.reward.verify import silence_math_verify_logging, verify_answer

logger = logging.getLogger(__name__)

#: Every reason a response can receive, in reporting order.
REWARD_REASONS: tuple[str, ...] = (
    "correct", "wrong", "no_answer", "too_long", "empty", "truncated", "timeout", "error",
)

#: math-verify's verdicts that a later call reuses for the same (reference forms, answer) pair: they depend on the
#: pair alone. Not ``timeout`` (the machine's load, the batch's budget) nor ``error`` (a worker's death, its memory).
REMEMBERED_REASONS = frozenset({"correct", "wrong", "no_answer"})
#: How many pairs a scorer remembers (the most recently used): a step's distinct pairs, many times over.
REMEMBERED_PAIRS = 16_384

__all__ = ["REWARD_REASONS", "MathRewardScorer", "Reference", "RewardStats", "ScoredBatch",
           "reward_workers_per_scorer"]


def reward_workers_per_scorer(tensor_parallel: int = 1, cap: int = 4) -> int:
    """Reward worker processes for one engine leader: the cores this process may use shared among the engines of
    its node (``LOCAL_WORLD_SIZE / tensor_parallel`` leaders score at the same time), at most ``cap``, at least 1."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    leaders = max(1, local_ranks // max(1, tensor_parallel))
    return max(1, min(cap, usable_cpu_count() // leaders))


@dataclass
class RewardStats:
    """Counts and timing of one :meth:`MathRewardScorer.score` call."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REWARD_REASONS, 0))
    num_responses: int = 0
    #: distinct (reference, answer) pairs sent to math-verify; the rest were answered from the cache (a pair met
    #: earlier in the call, or in an earlier call)
    num_verified: int = 0
    cache_hits: int = 0
    #: responses whose answer and reference forms are all plain integers, compared here (math-verify's verdict)
    integers_compared: int = 0
    workers_replaced: int = 0
    #: responses left unscored (reward 0, reason ``timeout``) when the batch's time budget ran out
    over_budget: int = 0
    seconds: float = 0.0
    #: summed time the workers spent in math-verify
    verify_seconds: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.counts["correct"] / self.num_responses if self.num_responses else 0.0

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """Flat ``{name: number}`` for a metrics logger."""
        metrics = {f"{prefix}{reason}": float(count) for reason, count in self.counts.items()}
        metrics.update({
            f"{prefix}accuracy": self.accuracy,
            f"{prefix}num_verified": float(self.num_verified),
            f"{prefix}cache_hits": float(self.cache_hits),
            f"{prefix}integers_compared": float(self.integers_compared),
            f"{prefix}workers_replaced": float(self.workers_replaced),
            f"{prefix}over_budget": float(self.over_budget),
            f"{prefix}seconds": self.seconds,
        })
        return metrics


@dataclass
class ScoredBatch:
    """Result of scoring a batch: one reward, reason and extracted answer per response, plus the counts."""

    rewards: np.ndarray  # float32, 1.0 or 0.0
    reasons: list[str]
    extracted_answers: list[str | None]
    stats: RewardStats


class MathRewardScorer:
    """Score responses against reference answers with math-verify in worker processes.

    Use as a context manager (or call :meth:`close`); the workers start at construction and are reused
    across calls. Not for concurrent use from several threads (calls are serialised by a lock).

    Args:
        num_workers: worker processes; default ``min(4, cpu count)``. 0 runs math-verify inline in the
            calling thread (main thread only, math-verify's own alarms but no hard limit: for debugging).
        timeout_seconds: math-verify's own per-call limit (parse, each comparison), whole seconds >= 1.
        hard_timeout_seconds: wall-clock limit per item enforced by the parent; a worker past it is killed
            and replaced. Default ``2 * timeout_seconds + 2``.
        max_answer_chars: longer extracted answers are not sent to sympy (reason ``too_long``).
        require_boxed: only a ``\\boxed{}`` answer counts (no last-number fallback).
        max_batch_seconds: time budget for a whole call (None: none): the answers not scored when it runs out
            get reward 0, reason ``timeout`` (math-verify's own rule, batch-wide), counted in ``over_budget``.
        worker_memory_mb: each worker's address space may grow this much beyond its warm start-up size; an
            allocation past it fails and the item is an ``error`` (None or 0: no limit). Linux.
        start_method: ``"spawn"`` (default; safe in a process that already runs threads, e.g. a trainer) or
            ``"fork"`` / ``"forkserver"``. Spawned workers re-import the main module: a script that creates a
            scorer needs an ``if __name__ == "__main__":`` guard.
    """

    def __init__(self, num_workers: int | None = None, timeout_seconds: int = 5,
                 hard_timeout_seconds: float | None = None, max_answer_chars: int = 1000,
                 require_boxed: bool = False, max_batch_seconds: float | None = None,
                 start_method: str = "spawn", worker_memory_mb: int | None = 2048):
        if num_workers is None:
            num_workers = min(4, usable_cpu_count())
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if int(timeout_seconds) != timeout_seconds or timeout_seconds < 1:
            raise ValueError(f"timeout_seconds must be a whole number >= 1 (signal.alarm), got {timeout_seconds}")
        self.num_workers = num_workers
        self.timeout_seconds = int(timeout_seconds)
        self.hard_timeout_seconds = (float(hard_timeout_seconds) if hard_timeout_seconds is not None
                                     else 2.0 * self.timeout_seconds + 2.0)
        if self.hard_timeout_seconds <= 0:
            raise ValueError(f"hard_timeout_seconds must be > 0, got {hard_timeout_seconds}")
        self.max_answer_chars = max_answer_chars
        self.require_boxed = require_boxed
        if max_batch_seconds is not None and max_batch_seconds <= 0:
            raise ValueError(f"max_batch_seconds must be > 0 (None: no budget), got {max_batch_seconds}")
        self.max_batch_seconds = max_batch_seconds
        self._lock = threading.Lock()
        self._closed = False
        self._verified: OrderedDict[tuple[tuple[str, ...], str], str] = OrderedDict()  # (forms, answer) -> reason
        self._pool: VerifierPool | None = None
        if num_workers > 0:
            self._pool = VerifierPool(num_workers, self.timeout_seconds, self.hard_timeout_seconds, start_method,
                                      memory_growth_bytes=(worker_memory_mb or 0) * 2**20 or None)
        else:
            silence_math_verify_logging()

    def __enter__(self) -> "MathRewardScorer":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

    def close(self) -> None:
        """Stop the worker processes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def score(self, responses: Sequence[str | None], references: Sequence[Reference],
              finish_reasons: Sequence[str | None] | None = None,
              truncated: Sequence[bool] | None = None) -> ScoredBatch:
        """Reward every response against its reference (a string or a list of accepted forms).

        ``finish_reasons`` (engine's, ``"length"`` = cut at the token limit) or ``truncated`` flags mark
        truncated responses, which get 0 whatever they contain. Identical (reference, extracted answer) pairs
        are verified once per call, and a pair whose verdict an earlier call got (correct, wrong, no answer; not a
        timeout or an error) is not verified again: a prompt's answers repeat from step to step.
        """
        if self._closed:
            raise RuntimeError("MathRewardScorer is closed")
        n = len(responses)
        for name, values in (("references", references), ("finish_reasons", finish_reasons),
                             ("truncated", truncated)):
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} responses")
        with self._lock:
            return self._score(responses, references, finish_reasons, truncated)

    def score_one(self, response: str | None, reference: Reference, finish_reason: str | None = None) -> float:
        """Reward of a single response (convenience; batches are much faster per item)."""
        return float(self.score([response], [reference], [finish_reason]).rewards[0])

    def _score(self, responses, references, finish_reasons, truncated) -> ScoredBatch:
        start = time.perf_counter()
        n = len(responses)
        reasons: list[str | None] = [None] * n
        extracted: list[str | None] = [None] * n
        task_index: dict[tuple[tuple[str, ...], str], int] = {}
        tasks: list[tuple[str, tuple[str, ...]]] = []
        item_task: dict[int, int] = {}
        stats = RewardStats(num_responses=n)

        for i, response in enumerate(responses):
            was_truncated = (finish_reasons is not None and finish_reasons[i] == "length") or (
                truncated is not None and bool(truncated[i]))
            reasons[i], extracted[i], forms = self._screen(i, response, references[i], was_truncated)
            if reasons[i] is not None:
                continue
            reasons[i] = integer_verdict(extracted[i], forms)
            if reasons[i] is not None:
                stats.integers_compared += 1
                continue
            key = (forms, extracted[i])
            if key in self._verified:  # an earlier call's answer
                reasons[i] = self._verified[key]
                self._verified.move_to_end(key)
                stats.cache_hits += 1
            elif key not in task_index:
                task_index[key] = len(tasks)
                tasks.append((extracted[i], forms))
            else:
                stats.cache_hits += 1
            if reasons[i] is None:
                item_task[i] = task_index[key]

        if tasks:
            outcomes = self._verify(tasks, start, stats)
            for i, task_id in item_task.items():
                reasons[i] = outcomes[task_id][0]
                stats.over_budget += outcomes[task_id][1] == OVER_BUDGET
            self._remember(task_index, outcomes)
        stats.num_verified = len(tasks)

        final_reasons = [r if r is not None else "error" for r in reasons]
        for reason in final_reasons:
            stats.counts[reason] += 1
        rewards = np.array([1.0 if r == "correct" else 0.0 for r in final_reasons], dtype=np.float32)
        stats.seconds = time.perf_counter() - start
        return ScoredBatch(rewards=rewards, reasons=final_reasons, extracted_answers=extracted, stats=stats)

    def _remember(self, task_index: dict[tuple[tuple[str, ...], str], int], outcomes: list[tuple[str, str]]) -> None:
        """Keep math-verify's verdicts that depend on the pair alone (:data:`REMEMBERED_REASONS`) for later calls,
        the :data:`REMEMBERED_PAIRS` most recently used."""
        for key, task_id in task_index.items():
            if outcomes[task_id][0] in REMEMBERED_REASONS:
                self._verified[key] = outcomes[task_id][0]
        while len(self._verified) > REMEMBERED_PAIRS:
            self._verified.popitem(last=False)

    def _screen(self, i: int, response, reference, was_truncated: bool
                ) -> tuple[str | None, str | None, tuple[str, ...]]:
        """What can be told of response ``i`` without math-verify: (its reason, or None when it goes to the
        verifier; the answer extracted from it; the reference's forms)."""
        if was_truncated:
            return "truncated", None, ()
        if response is None or (isinstance(response, str) and not response.strip()):
            return "empty", None, ()
        if not isinstance(response, str):
            return "error", None, ()
        forms = normalize_references(reference)
        if not forms:
            logger.warning("response %d has no usable reference answer (%r)", i, reference)
            return "error", None, ()
        answer = extract_answer(response, require_boxed=self.require_boxed)
        if answer is None:
            return "no_answer", None, forms
        if len(answer) > self.max_answer_chars:
            return "too_long", answer, forms
        return None, answer, forms

    def _verify(self, tasks: list[tuple[str, tuple[str, ...]]], start: float, stats: RewardStats
                ) -> list[tuple[str, str]]:
        """math-verify on the distinct (answer, forms) tasks, in the worker pool or inline; the first few errors
        logged."""
        if self._pool is not None:
            replaced_before = self._pool.workers_replaced
            outcomes, stats.verify_seconds = self._pool.run(tasks, self.max_batch_seconds)
            stats.workers_replaced = self._pool.workers_replaced - replaced_before
        else:
            outcomes = self._run_inline(tasks)
            stats.verify_seconds = time.perf_counter() - start
        errors_logged = 0
        for reason, detail in outcomes:
            if reason == "error" and errors_logged < 5:
                logger.warning("reward error: %s", detail[:300])
                errors_logged += 1
        return outcomes

    def _run_inline(self, tasks: list[tuple[str, tuple[str, ...]]]) -> list[tuple[str, str]]:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("num_workers=0 runs math-verify inline, which needs the main thread (signal.alarm)")
        outcomes = []
        for answer, forms in tasks:
            try:
                outcomes.append(verify_answer(answer, forms, self.timeout_seconds))
            except Exception as exc:  # noqa: BLE001
                outcomes.append(("error", f"{type(exc).__name__}"))
        return outcomes
