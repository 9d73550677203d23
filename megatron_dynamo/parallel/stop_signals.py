"""Graceful stop on SIGINT / SIGTERM / SIGUSR1: the first signal asks the run to stop at the next step boundary, a
second SIGINT or SIGTERM kills the process at once. SIGUSR1 is Slurm's time-limit notice (``--signal=USR1@300``, as
nemo-run's batch script asks for it): it may arrive twice (from Slurm and forwarded by torchrun's agent), so a
repeated SIGUSR1 is ignored instead of killing.

- :func:`stop_on_signals` (a context manager, main thread): the first SIGINT or SIGTERM only records the signal
  (:func:`received`) and sets both back to the default action, so a second one terminates the process even when it
  is stuck in C code (a collective, a CUDA call), where Python handlers cannot run. What a killed process leaves
  behind is stopped by ``parallel.process_guard``.
- :func:`agreed_stop_signal` (every rank, after each step): the recorded signals all-reduced with MAX, so all ranks
  stop after the same step even if only some received the signal, or received it during different steps.
- :func:`forward_signals` (the process that spawned local ranks): sends each SIGINT / SIGTERM it receives on to
  the ranks (which run in their own sessions, see ``parallel.spawn``, so they are not signalled twice).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterable, Iterator

from megatron_dynamo.parallel.runtime import collective_device


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# Signals whose repetition is no "stop at once" (the time-limit notice reaches a rank directly and via torchrun).
REPEATABLE = (signal.SIGUSR1,)

_received: int | None = None


def received() -> int | None:
    """The first stop signal this process received, or None."""
    return _received


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(signum: int) -> int:
    """What a shell reports for a process ended by ``signum`` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _handlers(handler: Callable, signals: Iterable[int]) -> Iterator[None]:
    reset()
    if not _in_main_thread():  # signal handlers can only be set in the main thread: no graceful stop there
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def stop_on_signals(message: str | None = None, signals: Iterable[int] = STOP_SIGNALS):
    """Within the block, the first of ``signals`` is recorded (see :func:`received`) and sets all of them back to
    their default action. ``message`` (formatted with ``{signal}``) is written to stderr when it arrives."""
    signals = tuple(signals)

    def handler(signum, frame):
        global _received
        if _received is None:
            _received = signum
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN if sig in REPEATABLE else signal.SIG_DFL)
        if message:  # os.write: print() may be in the middle of writing to the same stream
            os.write(2, (message.format(signal=signal_name(signum)) + "\n").encode())

    return _handlers(handler, signals)


def forward_signals(pids: Callable[[], Iterable[int]], signals: Iterable[int] = STOP_SIGNALS):
    """Within the block, each of ``signals`` received is recorded like :func:`stop_on_signals` does (the first one)
    and sent on to the processes ``pids()`` returns."""

    def handler(signum, frame):
        global _received
        if _received is None:
            _received = signum
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    return _handlers(handler, tuple(signals))


def agreed_stop_signal() -> int:
    """Collective over the default process group: the largest stop signal any rank received (0: none). All ranks
    must call it at the same point."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return _received or 0

    flag = torch.tensor([_received or 0], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def reset() -> None:
    """Forget a received signal (tests, or a process that trains again)."""
    global _received
    _received = None
