"""What runs inside a reward worker process (or inline with ``num_workers=0``): math-verify on one extracted answer.

Returns ``(reason, detail)`` strings only: sympy objects never cross the process boundary (pickling a huge one can
itself hang). math-verify bounds its sympy work with ``signal.alarm``, which only works in the main thread of a
process: the pool's workers (:mod:`megatron_dynamo.reward.pool`) call :func:`verify_in_worker` in theirs.
"""

from __future__ import annotations

import functools
import logging
import time
import traceback
import warnings
from typing import Any

from megatron_dynamo.reward.answers import answer_to_latex, reference_to_latex

MEMORY_LIMIT = "ran into the reward worker's memory limit"


def silence_math_verify_logging() -> None:
    """math-verify logs the whole offending string on a timeout; keep such lines out of the logs."""
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


@functools.lru_cache(maxsize=16_384)
def _parse_reference(reference: str, timeout_seconds: int) -> tuple[Any, ...]:
    """Parsed forms of a reference answer; cached, since every response of a prompt shares its reference."""
    from math_verify import parse

    return tuple(parse(reference_to_latex(reference), parsing_timeout=timeout_seconds, raise_on_error=True))


def verify_answer(answer: str, references: tuple[str, ...], timeout_seconds: int) -> tuple[str, str]:
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
    except MemoryError:
        return "error", MEMORY_LIMIT
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
                except MemoryError:
                    return "error", MEMORY_LIMIT
                except Exception:  # noqa: BLE001 -- this pair is unequal; try the others
                    pass
    if usable_references == 0:
        return "error", "; ".join(reference_errors) or "no reference"
    if comparisons_done == 0:
        return "error", "every comparison raised"
    return "wrong", ""



_start_error: str | None = None


def limit_memory_growth(growth_bytes: int) -> None:
    """Let this process's address space grow by at most ``growth_bytes`` beyond its size now (``RLIMIT_AS``):
    an allocation past it raises MemoryError (a sympy expression that would take the node's memory), instead of
    the kernel's OOM killer picking a process of the job. Linux only (the size comes from /proc)."""
    import resource

    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + growth_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))


def start_worker(timeout_seconds: int, memory_growth_bytes: int | None = None) -> None:
    """The pool's initializer, run in each worker before it takes any item (so not inside an item's time limit): no
    warnings or math-verify log lines (they would print whole expressions), math-verify imported and its parser
    caches warm, then the memory limit (``memory_growth_bytes`` beyond the warm worker's size; None: none). A
    failure is kept for :func:`worker_start_error` (the parent asks each worker once) rather than raised: a
    raising initializer would make the pool restart the worker forever."""
    global _start_error
    try:
        warnings.simplefilter("ignore")
        silence_math_verify_logging()
        verify_answer("1", ("1",), timeout_seconds)
        if memory_growth_bytes:
            limit_memory_growth(memory_growth_bytes)
    except BaseException:  # noqa: BLE001 -- reported to the parent by worker_start_error
        _start_error = traceback.format_exc()


def worker_start_error() -> str | None:
    """The traceback of this worker's failed start, or None: the pool's first task for each worker."""
    return _start_error


def verify_in_worker(answer: str, references: tuple[str, ...], timeout_seconds: int) -> tuple[str, str, float]:
    """One pool task: ``(reason, detail, seconds in math-verify)``. Never raises for an item: anything that escapes
    :func:`verify_answer` is reason ``error`` (the worker keeps serving)."""
    start = time.perf_counter()
    try:
        reason, detail = verify_answer(answer, references, timeout_seconds)
    except BaseException as exc:  # noqa: BLE001 -- never let one item kill the worker
        reason, detail = "error", f"{type(exc).__name__} in worker"
    return reason, detail, time.perf_counter() - start
