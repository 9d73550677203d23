"""Run a function in several local gloo processes (one per rank) and collect each rank's return value
(NCCL and one GPU per rank where CUDA is available).

Used by the multi-process tests, the benchmarks and the CLIs that need N ranks on one machine without torchrun:
``results = run_on_ranks(fn, world_size, *args)``. ``fn(rank, world_size,
*args)`` must be a module-level function (it is pickled into spawned children) and may return anything
``torch.save`` can write. torch.distributed is initialised with gloo before ``fn`` runs and destroyed after.
A failure on any rank is re-raised in the parent as :class:`RankError` with that rank's traceback, or its message
alone for the errors a user can act on (``user_errors=``: :func:`failure_text`).

Processes: each rank runs in its own session and is killed by the kernel when the parent dies
(``process_guard.die_with_parent``), so a signal to the parent's process group (Ctrl-C at a terminal) reaches the
parent only, and ranks never outlive it. ``forward=(SIGINT, SIGTERM)`` sends those signals on to the ranks while
they run (``dynamo train``: they stop together after the current step, see ``parallel.stop_signals``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_dynamo.cpus import threads_per_rank
from megatron_dynamo.parallel.process_guard import die_with_parent
from megatron_dynamo.parallel.stop_signals import forward_signals, received



class RankError(RuntimeError):
    """One or more spawned ranks failed. ``errors``: (rank, text) per failed rank; the message is the text when
    all ranks failed alike, else each rank's text prefixed by its rank."""

    def __init__(self, errors: list[tuple[int, str]]):
        self.errors = errors
        texts = {text for _, text in errors}
        message = errors[0][1] if len(texts) == 1 else "\n".join(f"rank {r}: {t}" for r, t in errors)
        super().__init__(message)


def failure_text(exc: BaseException, user_errors: tuple[type[BaseException], ...] = ()) -> str:
    """What a failed rank reports: the message of an error a user can act on (an instance of ``user_errors``: a
    bad checkpoint, a missing file...), else the whole traceback."""
    if isinstance(exc, user_errors):
        return str(exc)
    return "".join(traceback.format_exception(exc)).rstrip()


def _worker(rank, world_size, port, out_dir, fn, args, parent_pid=None, user_errors=(), init_group=True):
    with contextlib.suppress(OSError):
        os.setsid()  # signals for the parent's process group (Ctrl-C) are the parent's: it forwards what ranks need
    die_with_parent(signal.SIGKILL, parent_pid)
    # The parent serves the rendezvous store (_serve_store): every rank, rank 0 too, connects to it as a client,
    # the way torchrun's ranks connect to its agent's store.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    # Share this process's cores (its affinity, e.g. one `dynamo ablate --jobs` slot) between the ranks instead of
    # each rank taking them all.
    torch.set_num_threads(threads_per_rank(world_size))
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        if torch.cuda.is_available():  # GPU machines: one device per rank, NCCL (what Megatron needs there)
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if init_group:  # else fn forms its own groups from the variables above (parallel.placement.join_job)
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank,
                                    world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        torch.save({"ok": False, "error": failure_text(exc, user_errors)}, path)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _wait_for_ranks(processes, stop_grace: float) -> None:
    """Wait until every rank has exited. Once one has failed, the others are killed (a rank waiting in a collective
    for the failed one would wait for the process group's timeout), at once, or after up to ``stop_grace`` seconds
    when this process forwarded a stop signal: then they are saving and shutting down too (rank 0 closes vLLM)."""
    from multiprocessing.connection import wait

    failed_at = None
    while True:
        running = [p for p in processes if p.exitcode is None]
        if not running:
            return
        if failed_at is None and any(p.exitcode for p in processes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at >= (stop_grace if received() else 0.0):
            for process in running:
                process.kill()
                process.join()
            return
        wait([p.sentinel for p in running], timeout=0.5)


def _serve_store(world_size: int) -> dist.TCPStore:
    """The job's rendezvous store, served by this process while the ranks run. The kernel picks its port as it
    binds, so nothing can take the port first: a port found free here and bound by rank 0 seconds later (once the
    spawned child has imported torch) can meanwhile become the local port of any connection on the machine
    (EADDRINUSE)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def run_on_ranks(fn, world_size: int, *args, user_errors: tuple[type[BaseException], ...] = (),
                 forward=(), stop_grace: float = 60.0, init_group: bool = True):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the list of results by rank.
    A failing rank reports :func:`failure_text` ``(exc, user_errors)`` (its message for those errors, else its
    traceback). ``init_group=False``: no default process group is made; ``fn`` forms its own from the launcher
    variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT) each rank gets.
    ``forward``: signals this process sends on to the ranks while they run (main thread only); after one, ranks
    still running when another failed get ``stop_grace`` seconds to finish before they are killed."""
    with tempfile.TemporaryDirectory() as out_dir:
        store = _serve_store(world_size)
        context = mp.start_processes(_worker, args=(world_size, store.port, out_dir, fn, args, os.getpid(),
                                                    user_errors, init_group),
                                     nprocs=world_size, join=False, start_method="spawn")
        processes = context.processes
        try:
            running = lambda: [p.pid for p in processes if p.exitcode is None]  # noqa: E731
            with forward_signals(running, forward) if forward else contextlib.nullcontext():
                _wait_for_ranks(processes, stop_grace)
        finally:  # KeyboardInterrupt while waiting: no rank outlives the call
            for process in processes:
                if process.exitcode is None:
                    process.kill()
                    process.join()
        if any(p.exitcode for p in processes):  # the ranks' own tracebacks are more useful than exit codes
            errors = []
            for rank in range(world_size):
                path = os.path.join(out_dir, f"rank{rank}.pt")
                if os.path.exists(path):
                    rec = torch.load(path, weights_only=False)
                    if not rec["ok"]:
                        errors.append((rank, rec["error"]))
            codes = ", ".join(f"rank {r}: {_exit_text(p.exitcode)}" for r, p in enumerate(processes) if p.exitcode)
            raise RankError(errors or [(-1, f"a worker process died without reporting an error ({codes})")])
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)["result"]
                for r in range(world_size)]
