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
  was killed and replaced
- ``error``: anything else: a worker died twice on the item, no reference form could be parsed, every
  comparison raised

Why worker processes: math-verify bounds its sympy work with ``signal.alarm``, which only works in the main
thread of a process, and some expressions run inside C code that no signal interrupts. Each worker is its own
process that runs parse/verify in its main thread (so the alarms work), and the parent enforces a hard
wall-clock deadline per item: a worker past it is killed (SIGKILL) and a fresh one is started while the other
workers keep going. The pool is a small set of ``multiprocessing`` processes with one pipe each rather than a
``concurrent.futures.ProcessPoolExecutor``: an executor cannot tell when a task actually started, cannot kill a
single worker, and breaks as a whole (``BrokenProcessPool``, losing every in-flight task) when one is killed.

Units (what counts): the answer and the reference are both normalised by math-verify, which drops text units
(``\\text{ cm}``, ``\\text{ dollars}``, ``\\mathrm{~cm}``), a bare common unit word such as ``cm``, degrees
``^\\circ``, a currency ``\\$`` and a trailing ``\\%`` -- so ``\\boxed{5 \\text{ cm}}`` matches the reference
``5``. A bare word it does not know (``18 dollars`` outside ``\\text``) is parsed as a product of symbols and
does not match ``18``: models are asked for a boxed number, and this keeps the rule math-verify's.
"""

from __future__ import annotations

import functools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import numpy as np

from megatron_dynamo.cpus import usable_cpu_count

logger = logging.getLogger(__name__)

#: Every reason a response can receive, in reporting order.
REWARD_REASONS: tuple[str, ...] = (
    "correct", "wrong", "no_answer", "too_long", "empty", "truncated", "timeout", "error",
)

#: A reference answer: one string, or a list of accepted forms (any of them verifying counts as correct).
Reference = Union[str, Sequence[str]]

# --- answer extraction limits. They bound the work on adversarial text (a 200k-character response must cost
# milliseconds): the brace matcher gives up after this many characters of boxed content ...
_MAX_BOXED_SCAN_CHARS = 20_000
# ... only the last few \boxed occurrences are tried (a later unclosed or empty one falls back to an earlier one)
_MAX_BOXED_CANDIDATES = 8
# ... and the unboxed fallback only looks at the tail of the response, where a final answer lives.
_FALLBACK_WINDOW_CHARS = 2_000

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# A backslash escape (skipped, so "\{" and "\}" do not count) or a brace.
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.S)
# Inline or display math with bounded lengths: no unbounded backtracking.
_MATH_SEGMENT_RE = re.compile(
    r"\$\$([^$]{1,500})\$\$|\$([^$]{1,500})\$|\\\((.{1,500}?)\\\)|\\\[(.{1,500}?)\\\]", re.S
)
# A number: optional sign, thousands separators, decimals, a simple fraction; not glued to a word.
_NUMBER_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?")
_SCIENTIFIC_RE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?)[eE]([+-]?\d+)\s*$")
_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")


def _matching_brace(text: str, open_pos: int, max_chars: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_pos``; None if the text ends first; -1 if it is still
    open after ``max_chars`` characters."""
    depth = 0
    scan_end = min(len(text), open_pos + max_chars)
    for token in _BRACE_TOKEN_RE.finditer(text, open_pos, scan_end):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return token.start()
    return -1 if scan_end < len(text) else None


def _boxed_content(text: str, macro_end: int) -> str | None:
    """Content of the ``\\boxed`` whose name ends at ``macro_end``; None if unclosed or empty.

    Content still open after ``_MAX_BOXED_SCAN_CHARS`` is returned cut at that length, so that the scorer's
    length cap rejects it (rather than falling back to some number inside it).
    """
    pos = macro_end
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    if pos >= len(text):
        return None
    if text[pos] == "{":
        close = _matching_brace(text, pos, _MAX_BOXED_SCAN_CHARS)
        if close is None:
            return None
        if close == -1:
            return text[pos + 1:pos + _MAX_BOXED_SCAN_CHARS]
        content = text[pos + 1:close].strip()
    elif pos > macro_end:
        # "\\boxed 42": TeX would box one token; models mean the whole word.
        match = re.match(r"[^\s$]{1,200}", text[pos:pos + 200])
        content = match.group().rstrip(".,;:") if match else ""
    else:
        return None
    return content or None


def extract_answer(response: str, *, require_boxed: bool = False) -> str | None:
    """The final answer of a model response, or None when there is none.

    Rule, in order:

    1. The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 42``) with balanced braces
       (escaped ``\\{``/``\\}`` do not count). An unclosed or empty last box (a truncated answer, or an echo
       of the instruction "put your answer in \\boxed{}") falls back to the box before it (up to 8 boxes).
       A box still open after 20,000 characters gives its first 20,000 characters (too long to be scored).
    2. Unless ``require_boxed``: in the last 2,000 characters, whichever ends last of the last inline/display
       math segment (``$...$``, ``$$...$$``, ``\\(...\\)``, ``\\[...\\]``) and the last number (``-3``,
       ``1,000``, ``2.5``, ``3/4``; not part of a word like ``x2``).

    The work is bounded whatever the input (regex scans are linear, the brace matcher and the fallback
    window are capped): a 200,000-character string takes about a millisecond.
    """
    if not response:
        return None
    boxed_positions = [m.end() for m in _BOXED_RE.finditer(response)]
    for macro_end in reversed(boxed_positions[-_MAX_BOXED_CANDIDATES:]):
        content = _boxed_content(response, macro_end)
        if content is not None:
            return content
    if require_boxed:
        return None

    window = response[-_FALLBACK_WINDOW_CHARS:]
    last_math = None
    for last_math in _MATH_SEGMENT_RE.finditer(window):
        pass
    last_number = None
    for last_number in _NUMBER_RE.finditer(window):
        pass
    if last_math is not None and (last_number is None or last_math.end() >= last_number.end()):
        content = next(g for g in last_math.groups() if g is not None).strip()
        return content or None
    if last_number is not None:
        return last_number.group()
    return None


def _scientific_to_latex(text: str) -> str:
    """``3.83e35`` -> ``3.83 \\times 10^{35}``: LaTeX parsing would read ``e`` as Euler's number."""
    match = _SCIENTIFIC_RE.match(text)
    if match is None:
        return text
    return f"{match.group(1)} \\times 10^{{{int(match.group(2))}}}"


def answer_to_latex(answer: str) -> str:
    """What math-verify parses for an extracted answer: the answer as one boxed LaTeX expression.

    Boxing makes math-verify take the whole answer (not some number inside it); stray ``$`` are dropped.
    """
    answer = _UNESCAPED_DOLLAR_RE.sub("", _scientific_to_latex(answer.strip()))
    return "\\boxed{" + answer + "}"


def reference_to_latex(reference: str) -> str:
    """What math-verify parses for a reference answer.

    A bare reference (``\\frac{1}{2}``, ``\\pi``, ``3.83e35``) is boxed: parsed raw, math-verify would miss
    ``\\pi`` and read ``\\sqrt 2`` as 2. A reference that already carries its own ``$...$`` or ``\\boxed``
    (OlympiadBench writes ``$\\frac{1}{2 n+2}$``) is left as it is.
    """
    reference = _scientific_to_latex(reference.strip())
    if _UNESCAPED_DOLLAR_RE.search(reference) or "\\boxed" in reference:
        return reference
    return "\\boxed{" + reference + "}"


def _normalize_references(reference: Reference) -> tuple[str, ...]:
    """A reference (string or list of accepted forms) as a tuple of distinct non-empty strings."""
    if reference is None:
        return ()
    forms = [reference] if isinstance(reference, (str, int, float)) else list(reference)
    out: list[str] = []
    for form in forms:
        if isinstance(form, (int, float)) and not isinstance(form, bool):
            form = str(form)
        if isinstance(form, str) and form.strip() and form.strip() not in out:
            out.append(form.strip())
    return tuple(out)


# ----------------------------------------------------------------------------------------------------------
# What runs inside a worker process (or inline with num_workers=0). Returns (reason, detail) strings only:
# sympy objects never cross the process boundary (pickling a huge one can itself hang).


def _silence_math_verify_logging() -> None:
    """math-verify logs the whole offending string on a timeout; keep such lines out of the logs."""
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


@functools.lru_cache(maxsize=16_384)
def _parse_reference(reference: str, timeout_seconds: int) -> tuple[Any, ...]:
    """Parsed forms of a reference answer; cached, since every response of a prompt shares its reference."""
    from math_verify import parse

    return tuple(parse(reference_to_latex(reference), parsing_timeout=timeout_seconds, raise_on_error=True))


def _verify_answer(answer: str, references: tuple[str, ...], timeout_seconds: int) -> tuple[str, str]:
    """Compare one extracted answer with the accepted reference forms. Returns ``(reason, detail)``.

    Pairs are compared one at a time with ``raise_on_error=True`` so that a timeout (reported as such) is told
    apart from an exception in one comparison (that pair counts as unequal, the others are still tried).
    The first timeout ends the item: more of the same expression would time out again.
    """
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        predicted = parse(answer_to_latex(answer), parsing_timeout=timeout_seconds, raise_on_error=True)
    except TimeoutException:
        return "timeout", "math-verify timed out parsing the answer"
    except Exception as exc:  # noqa: BLE001 -- an unparsable answer is a normal model output
        return "no_answer", f"answer not parsable ({type(exc).__name__})"
    if not predicted:
        return "no_answer", "answer not parsable"

    usable_references = 0
    comparisons_done = 0
    reference_errors: list[str] = []
    for reference in references:
        try:
            gold = _parse_reference(reference, timeout_seconds)
        except TimeoutException:
            reference_errors.append(f"reference timed out: {reference[:80]!r}")
            continue
        except Exception as exc:  # noqa: BLE001
            reference_errors.append(f"reference not parsable ({type(exc).__name__}): {reference[:80]!r}")
            continue
        if not gold:
            reference_errors.append(f"reference not parsable: {reference[:80]!r}")
            continue
        usable_references += 1
        for gold_form in gold:
            for predicted_form in predicted:
                try:
                    if verify(gold_form, predicted_form, timeout_seconds=timeout_seconds, raise_on_error=True):
                        return "correct", ""
                    comparisons_done += 1
                except TimeoutException:
                    return "timeout", "math-verify timed out comparing"
                except Exception:  # noqa: BLE001 -- this pair is unequal; try the others
                    pass
    if usable_references == 0:
        return "error", "; ".join(reference_errors) or "no reference"
    if comparisons_done == 0:
        return "error", "every comparison raised"
    return "wrong", ""


def _worker_main(conn: multiprocessing.connection.Connection, timeout_seconds: int) -> None:
    """Worker process loop: receive ``(task_id, answer, references)``, send ``("result", task_id, reason,
    detail, seconds)``; ``None`` stops it. Runs math-verify in this process's main thread."""
    # Ctrl-C goes to the whole process group: the parent handles it and shuts the workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warnings.simplefilter("ignore")
    try:
        _silence_math_verify_logging()
        import math_verify  # noqa: F401 -- fail here, visibly, if the environment lacks it

        _verify_answer("1", ("1",), timeout_seconds)  # warm the parser caches before taking work
        conn.send(("ready", os.getpid()))
    except BaseException:  # noqa: BLE001 -- report any start-up failure to the parent
        try:
            conn.send(("init_error", traceback.format_exc()))
        except (EOFError, OSError):
            pass
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # parent gone
            return
        if message is None:
            return
        task_id, answer, references = message
        start = time.perf_counter()
        try:
            reason, detail = _verify_answer(answer, references, timeout_seconds)
        except BaseException as exc:  # noqa: BLE001 -- never let one item kill the worker
            reason, detail = "error", f"{type(exc).__name__} in worker"
        try:
            conn.send(("result", task_id, reason, detail, time.perf_counter() - start))
        except (EOFError, OSError):
            return


# ----------------------------------------------------------------------------------------------------------
# The pool (parent side).


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    started_at: float
    ready: bool = False
    task_id: int | None = None
    deadline: float = math.inf


class _VerifierPool:
    """A fixed number of worker processes, one item in flight per worker, each with a wall-clock deadline."""

    def __init__(self, num_workers: int, timeout_seconds: int, hard_timeout_seconds: float,
                 start_method: str, startup_timeout_seconds: float = 120.0):
        self._context = multiprocessing.get_context(start_method)
        self._timeout_seconds = timeout_seconds
        self._hard_timeout_seconds = hard_timeout_seconds
        self._startup_timeout_seconds = startup_timeout_seconds
        self.workers_replaced = 0
        self._failed_starts = 0
        self._workers: list[_Worker] = [self._spawn() for _ in range(num_workers)]

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main, args=(child_conn, self._timeout_seconds), daemon=True,
            name="math-verify-worker",
        )
        process.start()
        child_conn.close()  # the child holds its own copy; closing ours makes EOF visible if it dies
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    @staticmethod
    def _kill(worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()

    def _replace(self, index: int, why: str) -> None:
        self._kill(self._workers[index])
        self.workers_replaced += 1
        logger.warning("reward worker replaced (%s)", why)
        self._workers[index] = self._spawn()

    def run(self, tasks: list[tuple[str, tuple[str, ...]]], max_batch_seconds: float | None
            ) -> tuple[list[tuple[str, str]], float]:
        """Verify every ``(answer, references)``; returns ``[(reason, detail)]`` in order and the summed
        worker seconds. Items still unscored when ``max_batch_seconds`` runs out get ``timeout``."""
        results: list[tuple[str, str] | None] = [None] * len(tasks)
        pending = list(range(len(tasks) - 1, -1, -1))  # a stack: pop() hands out tasks in order
        worker_seconds = 0.0
        deaths: dict[int, int] = {}
        batch_deadline = time.monotonic() + max_batch_seconds if max_batch_seconds else math.inf
        while pending or any(w.task_id is not None for w in self._workers):
            now = time.monotonic()
            if now > batch_deadline:
                for index, worker in enumerate(self._workers):
                    if worker.task_id is not None:
                        results[worker.task_id] = ("timeout", "batch time limit")
                        self._replace(index, "batch time limit reached")
                for task_id in pending:
                    results[task_id] = ("timeout", "batch time limit")
                pending.clear()
                break
            for worker in self._workers:
                if worker.ready and worker.task_id is None and pending:
                    task_id = pending.pop()
                    answer, references = tasks[task_id]
                    try:
                        worker.conn.send((task_id, answer, references))
                    except (OSError, EOFError):
                        pending.append(task_id)  # picked up again once the dead worker is replaced
                        continue
                    worker.task_id = task_id
                    worker.deadline = time.monotonic() + self._hard_timeout_seconds

            next_deadline = min(
                [w.deadline for w in self._workers if w.task_id is not None]
                + [w.started_at + self._startup_timeout_seconds for w in self._workers if not w.ready]
                + [batch_deadline]
            )
            wait_for = [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
            multiprocessing.connection.wait(wait_for, timeout=max(0.0, min(next_deadline - time.monotonic(), 1.0)))

            now = time.monotonic()
            for index, worker in enumerate(self._workers):
                message = None
                try:
                    if worker.conn.poll():
                        message = worker.conn.recv()
                except (EOFError, OSError):
                    message = None
                if message is not None:
                    kind = message[0]
                    if kind == "ready":
                        worker.ready = True
                        self._failed_starts = 0
                    elif kind == "result":
                        _, task_id, reason, detail, seconds = message
                        if task_id == worker.task_id:
                            results[task_id] = (reason, detail)
                            worker_seconds += seconds
                            worker.task_id = None
                            worker.deadline = math.inf
                    elif kind == "init_error":
                        self.close()
                        raise RuntimeError(f"math-verify reward worker failed to start:\n{message[1]}")
                    continue
                if not worker.process.is_alive():
                    if worker.task_id is not None:
                        # The death may have nothing to do with this item (killed from outside, OOM killer):
                        # retry it once on a fresh worker; an item that kills two workers is an error.
                        deaths[worker.task_id] = deaths.get(worker.task_id, 0) + 1
                        if deaths[worker.task_id] < 2:
                            pending.append(worker.task_id)
                        else:
                            results[worker.task_id] = ("error", f"worker died twice on this item "
                                                                f"(exit code {worker.process.exitcode})")
                    self._note_failed_start(worker)
                    self._replace(index, f"worker exited with code {worker.process.exitcode}")
                elif worker.task_id is not None and now > worker.deadline:
                    results[worker.task_id] = ("timeout", f"killed after {self._hard_timeout_seconds:.1f}s")
                    self._replace(index, f"item ran past the hard limit of {self._hard_timeout_seconds:.1f}s")
                elif not worker.ready and now > worker.started_at + self._startup_timeout_seconds:
                    self._note_failed_start(worker)
                    self._replace(index, f"not ready after {self._startup_timeout_seconds:.0f}s")
        return [r if r is not None else ("error", "not scored") for r in results], worker_seconds

    def _note_failed_start(self, worker: _Worker) -> None:
        if worker.ready:
            return
        self._failed_starts += 1
        if self._failed_starts > 3 * len(self._workers):
            exit_code = worker.process.exitcode
            self.close()
            raise RuntimeError(
                f"math-verify reward workers keep failing to start (last exit code {exit_code}); their traceback "
                f"is on stderr. With start_method='spawn' each worker re-imports the main module: it must be an "
                f"importable file (not stdin) with an `if __name__ == '__main__':` guard.")

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(worker)
        self._workers = []


# ----------------------------------------------------------------------------------------------------------
# Public API.


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
    #: distinct (reference, answer) pairs sent to math-verify; the rest were answered from the call's cache
    num_verified: int = 0
    cache_hits: int = 0
    workers_replaced: int = 0
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
            f"{prefix}workers_replaced": float(self.workers_replaced),
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
        max_batch_seconds: optional limit for a whole call; items left when it runs out get ``timeout``.
        start_method: ``"spawn"`` (default; safe in a process that already runs threads, e.g. a trainer) or
            ``"fork"`` / ``"forkserver"``. Spawned workers re-import the main module: a script that creates a
            scorer needs an ``if __name__ == "__main__":`` guard.
    """

    def __init__(self, num_workers: int | None = None, timeout_seconds: int = 5,
                 hard_timeout_seconds: float | None = None, max_answer_chars: int = 1000,
                 require_boxed: bool = False, max_batch_seconds: float | None = None,
                 start_method: str = "spawn"):
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
        self.max_batch_seconds = max_batch_seconds
        self._lock = threading.Lock()
        self._closed = False
        self._pool: _VerifierPool | None = None
        if num_workers > 0:
            self._pool = _VerifierPool(num_workers, self.timeout_seconds, self.hard_timeout_seconds, start_method)
        else:
            _silence_math_verify_logging()

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
        are verified once per call.
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
            if was_truncated:
                reasons[i] = "truncated"
                continue
            if response is None or (isinstance(response, str) and not response.strip()):
                reasons[i] = "empty"
                continue
            if not isinstance(response, str):
                reasons[i] = "error"
                continue
            forms = _normalize_references(references[i])
            if not forms:
                reasons[i] = "error"
                logger.warning("response %d has no usable reference answer (%r)", i, references[i])
                continue
            answer = extract_answer(response, require_boxed=self.require_boxed)
            extracted[i] = answer
            if answer is None:
                reasons[i] = "no_answer"
                continue
            if len(answer) > self.max_answer_chars:
                reasons[i] = "too_long"
                continue
            key = (forms, answer)
            if key not in task_index:
                task_index[key] = len(tasks)
                tasks.append((answer, forms))
            else:
                stats.cache_hits += 1
            item_task[i] = task_index[key]

        if tasks:
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
            for i, task_id in item_task.items():
                reasons[i] = outcomes[task_id][0]
        stats.num_verified = len(tasks)

        final_reasons = [r if r is not None else "error" for r in reasons]
        for reason in final_reasons:
            stats.counts[reason] += 1
        rewards = np.array([1.0 if r == "correct" else 0.0 for r in final_reasons], dtype=np.float32)
        stats.seconds = time.perf_counter() - start
        return ScoredBatch(rewards=rewards, reasons=final_reasons, extracted_answers=extracted, stats=stats)

    def _run_inline(self, tasks: list[tuple[str, tuple[str, ...]]]) -> list[tuple[str, str]]:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("num_workers=0 runs math-verify inline, which needs the main thread (signal.alarm)")
        outcomes = []
        for answer, forms in tasks:
            try:
                outcomes.append(_verify_answer(answer, forms, self.timeout_seconds))
            except Exception as exc:  # noqa: BLE001
                outcomes.append(("error", f"{type(exc).__name__}"))
        return outcomes
