"""``dynamo ablate``'s runs as processes: up to N at once on their own CPUs (:func:`cpu_slots`), each a train
command in a session of its own (:class:`SubprocessLauncher`), a variant after the SFT run of its seed
(:func:`execute`); Ctrl-C / SIGTERM stop the running runs after their step (a second one kills them)."""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from megatron_dynamo.commands.ablate_plan import RunSpec, run_state
from megatron_dynamo.report.ablation import SFT

CPUS_ENV = "DYNAMO_ABLATE_CPUS"  # the CPUs a run is pinned to (read by the launcher, left in the run's environment)
# In a finished run's directory: its wall time, so that a later call that reuses the run (another --threshold, more
# seeds) still reports it (ablation.json; scripts/power_calc.py reads run times from there).
RUN_RECORD = "ablate_run.json"


def cpu_slots(jobs: int, cpus: Sequence[int] | None = None) -> list[list[int]]:
    """The CPUs of each of ``jobs`` slots: consecutive blocks of len(cpus) // jobs (the usable CPUs, affinity
    respected); with more jobs than CPUs, one CPU each, round robin."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None and hasattr(os, "sched_getaffinity") else \
        list(cpus or range(os.cpu_count() or 1))
    if jobs <= len(cpus):
        per = len(cpus) // jobs
        return [list(cpus[i * per:(i + 1) * per]) for i in range(jobs)]
    return [[cpus[i % len(cpus)]] for i in range(jobs)]



# The first program of a run: pin it to its CPUs, have the kernel send it SIGTERM should the thread that started it
# die (the ablation killed: the trainer then stops after its step, its watchdog cleans up), then become the train
# command (same pid). Runs with -I -S: no site import, ~20 ms.
_EXEC_WRAPPER = """\
import ctypes, os, signal, sys
cpus, parent, argv = sys.argv[1], int(sys.argv[2]), sys.argv[4:]
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
try:
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != parent:
    sys.exit(143)
os.execvpe(argv[0], argv, os.environ)
"""


class SubprocessLauncher:
    """Runs a command to completion: ``launcher(command, env, log_path) -> returncode`` (its output appended to
    ``log_path``). Each run is started in a session of its own, so a Ctrl-C at the terminal reaches this process
    only; :meth:`signal_all` passes a signal on to every running run (SIGINT: stop after the current step;
    SIGKILL: at once, to its whole process group)."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def __call__(self, command: Sequence[str], env: Mapping[str, str], log_path: str) -> int:
        wrapped = command
        if sys.platform.startswith("linux"):
            wrapped = [sys.executable, "-I", "-S", "-c", _EXEC_WRAPPER, env.get(CPUS_ENV, ""), str(os.getpid()),
                       "--", *command]
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n")
            log.flush()
            proc = subprocess.Popen(wrapped, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(env), start_new_session=True)
        with self._lock:
            self._procs[proc.pid] = proc
        try:
            return proc.wait()
        finally:
            with self._lock:
                self._procs.pop(proc.pid, None)

    def running(self) -> int:
        with self._lock:
            return len(self._procs)

    def signal_all(self, sig: int) -> None:
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if sig == signal.SIGKILL:
                    os.killpg(proc.pid, sig)  # the run is its session's (and group's) leader
                else:
                    proc.send_signal(sig)


class AblationInterrupted(Exception):
    """Ctrl-C / SIGTERM: the runs were stopped; the message says how many finished."""


Launch = Callable[[Sequence[str], Mapping[str, str], str], int]


def _record_seconds(spec: RunSpec, seconds: float, resumed: bool) -> None:
    """Keep a finished run's wall time in its directory (``resumed``: the time of the call that finished it)."""
    with contextlib.suppress(OSError):  # a lost record costs a time in a table, not the run
        with open(os.path.join(spec.output_dir, RUN_RECORD), "w", encoding="utf-8") as f:
            json.dump({"seconds": seconds, "resumed": resumed}, f)


def recorded_seconds(spec: RunSpec) -> float | None:
    """A finished run's wall time kept in its directory (``ablate_run.json``), or None."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        with open(os.path.join(spec.output_dir, RUN_RECORD), encoding="utf-8") as f:
            return float(json.load(f)["seconds"])
    return None


@dataclass
class RunResult:
    spec: RunSpec
    status: str  # "reused", "ok", "failed", "skipped"
    returncode: int | None = None
    seconds: float | None = None
    resumed: bool = False
    command: list[str] | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("reused", "ok")


def execute(specs: Sequence[RunSpec], steps: int, command_for: Callable[[RunSpec, bool], list[str]],
            launch: Launch, *, jobs: int = 1, env_for: Callable[[int], Mapping[str, str]] | None = None,
            report: Callable[[RunResult, int, int], None] | None = None,
            announce: Callable[[RunSpec, bool, int, int], None] | None = None) -> dict[tuple[str, int], RunResult]:
    """Run ``specs`` (seed-major) with up to ``jobs`` at once; a variant waits for the SFT run of its seed.

    Each run's state (:func:`run_state`) decides: reuse, ``--resume`` (``command_for(spec, resume=True)``), or
    start over (its directory removed). ``launch(command, env, log_path) -> returncode`` runs one command
    (:class:`SubprocessLauncher`, a fake in tests); ``env_for(slot)`` its environment. A run is ok when it exits 0
    and is then complete. KeyboardInterrupt (here or raised by ``launch``): no new run starts, the running ones are
    asked to stop (``launch.signal_all(SIGINT)`` when it has one; a second interrupt: SIGKILL), and
    :class:`AblationInterrupted` is raised once they have ended.
    """
    total = len(specs)
    results: dict[tuple[str, int], RunResult] = {}
    pending = list(specs)

    def finish(result: RunResult) -> None:
        results[result.spec.key] = result
        if report is not None:
            report(result, len(results), total)

    for spec in list(pending):
        if run_state(spec, steps) == "done":
            finish(RunResult(spec, "reused", seconds=recorded_seconds(spec)))
            pending.remove(spec)

    def ready(spec: RunSpec) -> str | None:
        """"go", "wait", or "skip" (its SFT run failed)."""
        if spec.is_sft:
            return "go"
        if spec.sft_seed is None:
            return "go"
        sft = results.get((SFT, spec.sft_seed))
        if any(s.key == (SFT, spec.sft_seed) for s in specs) and sft is None:
            return "wait"
        return "skip" if sft is not None and not sft.ok else "go"

    free_slots = list(range(max(1, jobs)))
    running: dict[futures.Future, tuple[RunSpec, int, float, bool, list[str]]] = {}
    interrupted = False

    def dispatch(pool: futures.ThreadPoolExecutor) -> None:
        for spec in list(pending):
            if not free_slots:
                return
            state = ready(spec)
            if state == "wait":
                continue
            pending.remove(spec)
            if state == "skip":
                finish(RunResult(spec, "skipped", message=f"its SFT run (seed {spec.sft_seed}) failed"))
                continue
            resume = run_state(spec, steps) == "resume"
            try:
                if not resume and os.path.exists(spec.output_dir):
                    shutil.rmtree(spec.output_dir)  # no checkpoint: start over (train refuses to overwrite)
                os.makedirs(spec.output_dir, exist_ok=True)
                command = command_for(spec, resume)
            except (OSError, RuntimeError) as exc:
                finish(RunResult(spec, "failed", resume=resume, message=f"could not start: {exc}"))
                continue
            slot = free_slots.pop(0)
            env = dict(env_for(slot) if env_for else os.environ)
            if announce is not None:
                announce(spec, resume, len(results), total)
            future = pool.submit(launch, command, env, os.path.join(spec.output_dir, "train.log"))
            running[future] = (spec, slot, time.perf_counter(), resume, command)

    def collect_finished(done: set[futures.Future]) -> None:
        nonlocal interrupted
        for future in done:
            spec, slot, started, resume, command = running.pop(future)
            free_slots.append(slot)
            free_slots.sort()
            seconds = round(time.perf_counter() - started, 1)
            try:
                code = future.result()
            except KeyboardInterrupt:  # raised by the launcher (a test's fake): the same as Ctrl-C here
                if not interrupted:
                    interrupted = True
                    _signal(launch, signal.SIGINT)
                continue
            except Exception as exc:  # noqa: BLE001 -- a launcher failure is this run's failure
                finish(RunResult(spec, "failed", None, seconds, resume, command, f"could not run: {exc}"))
                continue
            if interrupted and code != 0:
                continue  # stopped by the interrupt: resumed next time
            if code == 0 and run_state(spec, steps) == "done":
                _record_seconds(spec, seconds, resume)
                finish(RunResult(spec, "ok", code, seconds, resume, command))
            else:
                why = f"exit {code}" if code != 0 else "exited 0 but its metrics lack steps or the final evaluation"
                finish(RunResult(spec, "failed", code, seconds, resume, command,
                                 f"{why}; see {os.path.join(spec.output_dir, 'train.log')}"))

    pool = futures.ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="ablate-run")
    try:
        while pending or running:
            try:  # Ctrl-C anywhere in here: stop dispatching, ask the running runs to stop, wait for them
                if not interrupted:
                    dispatch(pool)
                if not running:
                    if pending and not interrupted:  # cannot happen: a waiting run's SFT run is running or done
                        raise RuntimeError(f"runs waiting on nothing: {[s.describe() for s in pending]}")
                    break
                done, _ = futures.wait(list(running), return_when=futures.FIRST_COMPLETED)
                collect_finished(done)
            except KeyboardInterrupt:
                if interrupted:  # a second one: kill the runs
                    _signal(launch, signal.SIGKILL)
                else:
                    interrupted = True
                    _signal(launch, signal.SIGINT)
    except BaseException:
        _signal(launch, signal.SIGINT)  # an error of this process: stop the runs rather than wait for them
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if interrupted:
        raise AblationInterrupted(f"interrupted: {len(results)} of {total} runs finished; run the same command "
                                  "again to resume")
    return results


def _signal(launch: Launch, sig: int) -> None:
    send = getattr(launch, "signal_all", None)
    if send is not None:
        send(sig)
