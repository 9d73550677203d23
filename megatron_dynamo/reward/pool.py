"""The reward workers: math-verify in a pebble ``ProcessPool``, one item per task, a wall-clock limit per item.

Why processes: math-verify bounds its sympy work with ``signal.alarm``, which only works in the main thread of a
process, and some expressions run inside C code that no signal interrupts. pebble's pool runs each task in a worker's
main thread (so the alarms work) and enforces a hard wall-clock limit per task, measured from the moment a worker took
it: a worker past it is stopped (SIGTERM, SIGKILL 3 s later if it is stuck in C code) and replaced while the others
keep going, and the task's future raises ``TimeoutError``. A ``concurrent.futures.ProcessPoolExecutor`` cannot do
this: it cannot kill a single worker and breaks as a whole (``BrokenProcessPool``) when one dies.

What this module adds to pebble:

- an item whose worker died (killed from outside, OOM killer) is retried once on a fresh worker; an item that kills
  two workers is an ``error``;
- pebble's pool breaks as a whole when a worker dies while no task is running (an idle worker killed from outside:
  pebble issue #70, still so in 5.2.3; every later ``schedule`` raises ``RuntimeError``). Then the pool is rebuilt
  and the items it had aborted are sent again (not counted as deaths): nothing is lost;
- a time budget per batch (:meth:`VerifierPool.run`): items not scored when it runs out are ``timeout`` with the
  detail :data:`OVER_BUDGET` (math-verify's timeout rule, batch-wide), their running workers stopped and replaced;
- the workers import math-verify and warm its caches in pebble's initializer, before they take an item (a fresh
  worker's start-up is not counted in the item's time limit), then limit their own memory growth
  (``verify.limit_memory_growth``); the pool starts at construction (the caller goes on)
  and the first :meth:`VerifierPool.run` reads one start-up question per worker: a worker that cannot start
  (no math-verify: its traceback; a ``spawn`` main module without a ``__main__`` guard: after the start-up limit)
  raises a clear ``RuntimeError`` instead of hanging.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import multiprocessing
import time

from pebble import ProcessExpired, ProcessPool

from megatron_dynamo.reward.verify import start_worker, verify_in_worker, worker_start_error

logger = logging.getLogger(__name__)

_BROKEN_POOL_ERRORS = (RuntimeError, concurrent.futures.process.BrokenProcessPool)
OVER_BUDGET = "batch time limit"  # the detail of an item left unscored when a batch's time budget ran out


class VerifierPool:
    """``num_workers`` math-verify worker processes; :meth:`run` scores a list of ``(answer, references)`` items."""

    def __init__(self, num_workers: int, timeout_seconds: int, hard_timeout_seconds: float,
                 start_method: str, startup_timeout_seconds: float = 120.0, memory_growth_bytes: int | None = None):
        self._num_workers = num_workers
        self._memory_growth_bytes = memory_growth_bytes
        self._context = multiprocessing.get_context(start_method)
        self._timeout_seconds = timeout_seconds
        self._hard_timeout_seconds = hard_timeout_seconds
        self._startup_timeout_seconds = startup_timeout_seconds
        self.workers_replaced = 0
        self._pool: ProcessPool | None = None
        self._warm_up: list[concurrent.futures.Future] = []
        self._start()

    def _start(self) -> None:
        self._pool = ProcessPool(max_workers=self._num_workers, context=self._context, initializer=start_worker,
                                 initargs=(self._timeout_seconds, self._memory_growth_bytes))
        self._warm_up = [self._pool.schedule(worker_start_error) for _ in range(self._num_workers)]

    def _restart(self, why: str) -> None:
        logger.warning("reward worker pool rebuilt (%s)", why)
        self.workers_replaced += 1
        self._stop_pool()
        self._start()

    def _check_started(self) -> None:
        """Read the start-up answers that have come (waiting, the first time, for one of them only: a worker that is
        up takes items while the others start); a worker that cannot start is an error, not a hang."""
        if not self._warm_up:
            return
        first = len(self._warm_up) == self._num_workers
        done, not_done = concurrent.futures.wait(
            self._warm_up, timeout=self._startup_timeout_seconds if first else 0,
            return_when=concurrent.futures.FIRST_COMPLETED)
        self._warm_up = list(not_done)
        start_errors = [f.result() for f in done if f.exception() is None and f.result() is not None]
        if start_errors:
            self.close()
            raise RuntimeError(f"math-verify reward worker failed to start:\n{start_errors[0]}")
        if not done and first:
            self.close()
            raise RuntimeError(
                f"math-verify reward workers did not start within {self._startup_timeout_seconds:.0f}s (their "
                f"traceback is on stderr). With start_method='spawn' each worker re-imports the main module: it must "
                f"be an importable file (not stdin) with an `if __name__ == '__main__':` guard.")

    def _schedule(self, task: tuple[str, tuple[str, ...]]) -> concurrent.futures.Future:
        answer, references = task
        try:
            return self._pool.schedule(verify_in_worker, args=(answer, references, self._timeout_seconds),
                                       timeout=self._hard_timeout_seconds)
        except _BROKEN_POOL_ERRORS as exc:
            self._restart(f"pool broken: {exc}")
            return self._pool.schedule(verify_in_worker, args=(answer, references, self._timeout_seconds),
                                       timeout=self._hard_timeout_seconds)

    def run(self, tasks: list[tuple[str, tuple[str, ...]]], max_batch_seconds: float | None
            ) -> tuple[list[tuple[str, str]], float]:
        """Verify every ``(answer, references)``; returns ``[(reason, detail)]`` in order and the summed seconds the
        workers spent in math-verify. Items still unscored when ``max_batch_seconds`` runs out get ``timeout``."""
        self._check_started()
        results: list[tuple[str, str] | None] = [None] * len(tasks)
        worker_seconds = 0.0
        deaths: dict[int, int] = {}
        batch_deadline = time.monotonic() + max_batch_seconds if max_batch_seconds else math.inf
        in_flight = {self._schedule(task): task_id for task_id, task in enumerate(tasks)}
        while in_flight:
            remaining = batch_deadline - time.monotonic()
            if remaining <= 0:  # the batch time limit: cancelling a running task stops (and replaces) its worker
                for future, task_id in in_flight.items():
                    if future.running():
                        self.workers_replaced += 1
                        logger.warning("reward worker replaced (batch time limit reached)")
                    future.cancel()
                    results[task_id] = ("timeout", OVER_BUDGET)
                break
            done, _ = concurrent.futures.wait(in_flight, timeout=min(remaining, 1.0),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
            again: list[int] = []
            for future in done:
                task_id = in_flight.pop(future)
                outcome = self._outcome(future, task_id, deaths)
                if outcome is None:
                    again.append(task_id)
                else:
                    results[task_id] = outcome[:2]
                    worker_seconds += outcome[2]
            if not self._pool.active:  # broken: the tasks it still holds would never finish
                again.extend(in_flight.values())
                in_flight.clear()
                self._restart("a worker died while the pool was idle")
            for task_id in again:
                in_flight[self._schedule(tasks[task_id])] = task_id
        return [r if r is not None else ("error", "not scored") for r in results], worker_seconds

    def _outcome(self, future: concurrent.futures.Future, task_id: int, deaths: dict[int, int]
                 ) -> tuple[str, str, float] | None:
        """``(reason, detail, worker seconds)`` of a finished task, or None when the item is to be sent again."""
        try:
            return future.result()
        except TimeoutError:
            self.workers_replaced += 1
            logger.warning("reward worker replaced (item ran past the hard limit of %.1fs)",
                           self._hard_timeout_seconds)
            return "timeout", f"killed after {self._hard_timeout_seconds:.1f}s", 0.0
        except ProcessExpired as exc:
            # The death may have nothing to do with this item (killed from outside, OOM killer): retry it once on
            # a fresh worker; an item that kills two workers is an error.
            self.workers_replaced += 1
            logger.warning("reward worker replaced (worker exited with code %s)", exc.exitcode)
            deaths[task_id] = deaths.get(task_id, 0) + 1
            if deaths[task_id] < 2:
                return None
            return "error", f"worker died twice on this item (exit code {exc.exitcode})", 0.0
        except _BROKEN_POOL_ERRORS:
            return None  # the pool broke under it: sent again to the rebuilt pool, not counted as a death
        except Exception as exc:  # noqa: BLE001 -- e.g. an unpicklable item: this item only
            return "error", f"{type(exc).__name__}: {exc}"[:300], 0.0

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None

    def close(self) -> None:
        self._warm_up = []
        self._stop_pool()
