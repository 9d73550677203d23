"""The Executor stage: an experiment's runs as processes, up to N at once on their own CPUs (:func:`cpu_slots`,
:func:`child_environment`), each a train command in a session of its own (:class:`SubprocessLauncher`), a variant
after the SFT run of its seed, a finished run reused and an unfinished one resumed from its checkpoint
(:func:`execute`); Ctrl-C / SIGTERM (:func:`stop_signals`) stop the running runs after their step (a second one
kills them), and no process is left behind. ``dynamo ablate`` and ``dynamo compare`` both run their plans here."""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

from megatron_dynamo.experiments.collector import record_seconds, recorded_seconds
from megatron_dynamo.experiments.plan import RunSpec
from megatron_dynamo.experiments.variants import SFT
from megatron_dynamo.parallel.runtime import single_process_environment

CPUS_ENV = "DYNAMO_ABLATE_CPUS"  # the CPUs a run is pinned to (read by the launcher, left in the run's environment)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


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


def child_environment(base: Mapping[str, str], jobs: int, cpus: Sequence[int] | None) -> dict[str, str]:
    """A run's environment: ``base`` without launcher variables, unbuffered output; with jobs > 1 also its thread
    count (the number of its CPUs) and the CPUs to pin it to (:data:`CPUS_ENV`)."""
    # a run is a single-process job of its own: launcher variables of the experiment's environment must not reach
    # it (it would take itself for a rank of a torchrun/Slurm job, with a job-wide MASTER_PORT shared by all runs)
    env = single_process_environment(base)
    env.pop(CPUS_ENV, None)
    env.setdefault("PYTHONUNBUFFERED", "1")  # train.log follows the run (the step lines as they happen)
    if jobs > 1 and cpus:
        for name in THREAD_VARIABLES:
            env[name] = str(len(cpus))
        env[CPUS_ENV] = ",".join(map(str, cpus))
    return env


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM stops like Ctrl-C (KeyboardInterrupt); so does SIGINT where it arrived ignored (a shell starts a
    background command, e.g. ``nohup dynamo ablate ... &``, with SIGINT ignored, and ``kill -INT`` did nothing). The
    handlers found are put back on exit. Outside the main thread (no signals there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_stop(signum, frame):
        raise KeyboardInterrupt

    for sig in previous:
        signal.signal(sig, on_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ExperimentInterrupted(Exception):
    """Ctrl-C / SIGTERM: the runs were stopped; the message says how many finished."""


Launch = Callable[[Sequence[str], Mapping[str, str], str], int]
StateOf = Callable[[RunSpec], str]  # "done" (reuse), "recorded" (finished elsewhere: in the raw data, not run
# here), "resume" or "fresh" (start over in an emptied directory)


@dataclass
class RunResult:
    spec: RunSpec
    status: str  # "reused", "recorded" (finished on another machine: in the raw data), "ok", "failed", "skipped"
    returncode: int | None = None
    seconds: float | None = None
    resumed: bool = False
    command: list[str] | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("reused", "recorded", "ok")

    @property
    def local(self) -> bool:
        """Finished in its own directory here (its metrics can be read), not only recorded in the raw data."""
        return self.status in ("reused", "ok")


@dataclass
class _Running:
    spec: RunSpec
    slot: int
    started: float
    resume: bool
    command: list[str]


@dataclass
class Executor:
    """Runs ``specs`` (seed-major) with up to ``jobs`` at once: see :func:`execute`."""

    specs: Sequence[RunSpec]
    state_of: StateOf
    command_for: Callable[[RunSpec, bool], list[str]]
    launch: Launch
    jobs: int = 1
    env_for: Callable[[int], Mapping[str, str]] | None = None
    report: Callable[[RunResult, int, int], None] | None = None
    announce: Callable[[RunSpec, bool, int, int], None] | None = None
    reuse: bool = True  # False: a done run is run again (in an emptied directory)
    results: dict[tuple[str, int], RunResult] = field(default_factory=dict)
    interrupted: bool = False

    def __post_init__(self) -> None:
        self.pending = list(self.specs)
        self.free_slots = list(range(max(1, self.jobs)))
        self.running: dict[futures.Future, _Running] = {}

    def finish(self, result: RunResult) -> None:
        self.results[result.spec.key] = result
        if self.report is not None:
            self.report(result, len(self.results), len(self.specs))

    def ready(self, spec: RunSpec) -> str:
        """"go", "wait" (its SFT run is in the plan and has not ended), or "skip" (its SFT run failed)."""
        if spec.is_sft or spec.sft_seed is None:
            return "go"
        sft = self.results.get((SFT, spec.sft_seed))
        if sft is None and any(s.key == (SFT, spec.sft_seed) for s in self.specs):
            return "wait"
        return "skip" if sft is not None and not sft.ok else "go"

    def start(self, pool: futures.ThreadPoolExecutor, spec: RunSpec) -> None:
        resume = self.state_of(spec) == "resume"
        try:
            if not resume and os.path.exists(spec.output_dir):
                shutil.rmtree(spec.output_dir)  # no checkpoint: start over (train refuses to overwrite)
            os.makedirs(spec.output_dir, exist_ok=True)
            command = self.command_for(spec, resume)
        except (OSError, RuntimeError) as exc:
            self.finish(RunResult(spec, "failed", resumed=resume, message=f"could not start: {exc}"))
            return
        slot = self.free_slots.pop(0)
        env = dict(self.env_for(slot) if self.env_for else os.environ)
        if self.announce is not None:
            self.announce(spec, resume, len(self.results), len(self.specs))
        future = pool.submit(self.launch, command, env, os.path.join(spec.output_dir, "train.log"))
        self.running[future] = _Running(spec, slot, time.perf_counter(), resume, command)

    def dispatch(self, pool: futures.ThreadPoolExecutor) -> None:
        for spec in list(self.pending):
            if not self.free_slots:
                return
            state = self.ready(spec)
            if state == "wait":
                continue
            self.pending.remove(spec)
            if state == "skip":
                self.finish(RunResult(spec, "skipped", message=f"its SFT run (seed {spec.sft_seed}) failed"))
            else:
                self.start(pool, spec)

    def ended(self, future: futures.Future) -> None:
        run = self.running.pop(future)
        self.free_slots = sorted([*self.free_slots, run.slot])
        seconds = round(time.perf_counter() - run.started, 1)
        try:
            code = future.result()
        except KeyboardInterrupt:  # raised by the launcher (a test's fake): the same as Ctrl-C here
            if not self.interrupted:
                self.interrupt()
            return
        except Exception as exc:  # noqa: BLE001 -- a launcher failure is this run's failure
            self.finish(RunResult(run.spec, "failed", None, seconds, run.resume, run.command, f"could not run: {exc}"))
            return
        if self.interrupted and code != 0:
            return  # stopped by the interrupt: resumed next time
        if code == 0 and self.state_of(run.spec) == "done":
            record_seconds(run.spec, seconds, run.resume)
            self.finish(RunResult(run.spec, "ok", code, seconds, run.resume, run.command))
            return
        why = f"exit {code}" if code != 0 else "exited 0 but its metrics lack steps or the final evaluation"
        self.finish(RunResult(run.spec, "failed", code, seconds, run.resume, run.command,
                              f"{why}; see {os.path.join(run.spec.output_dir, 'train.log')}"))

    def signal_runs(self, sig: int) -> None:
        send = getattr(self.launch, "signal_all", None)
        if send is not None:
            send(sig)

    def interrupt(self) -> None:
        """The first interrupt: no new run starts and the running ones are asked to stop (SIGINT, after their
        step); a second one kills them."""
        self.signal_runs(signal.SIGKILL if self.interrupted else signal.SIGINT)
        self.interrupted = True

    def step(self, pool: futures.ThreadPoolExecutor) -> bool:
        """Start what can start, wait for a run to end; False when nothing is left to wait for."""
        if not self.interrupted:
            self.dispatch(pool)
        if not self.running:
            if self.pending and not self.interrupted:  # cannot happen: a waiting run's SFT run is running or done
                raise RuntimeError(f"runs waiting on nothing: {[s.describe() for s in self.pending]}")
            return False
        done, _ = futures.wait(list(self.running), return_when=futures.FIRST_COMPLETED)
        for future in done:
            self.ended(future)
        return True

    def run(self) -> dict[tuple[str, int], RunResult]:
        for spec in list(self.pending):
            state = self.state_of(spec) if self.reuse else None
            if state == "done":
                self.finish(RunResult(spec, "reused", seconds=recorded_seconds(spec)))
            elif state == "recorded":
                self.finish(RunResult(spec, "recorded", message="in the raw data, finished elsewhere"))
            else:
                continue
            self.pending.remove(spec)
        pool = futures.ThreadPoolExecutor(max_workers=max(1, self.jobs), thread_name_prefix="experiment-run")
        try:
            while self.pending or self.running:
                try:  # Ctrl-C anywhere in here: stop dispatching, ask the running runs to stop, wait for them
                    if not self.step(pool):
                        break
                except KeyboardInterrupt:
                    self.interrupt()
        except BaseException:
            self.signal_runs(signal.SIGINT)  # an error of this process: stop the runs rather than wait for them
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if self.interrupted:
            raise ExperimentInterrupted(f"interrupted: {len(self.results)} of {len(self.specs)} runs finished; run "
                                        "the same command again to resume")
        return self.results


def execute(specs: Sequence[RunSpec], state_of: StateOf, command_for: Callable[[RunSpec, bool], list[str]],
            launch: Launch, *, jobs: int = 1, env_for: Callable[[int], Mapping[str, str]] | None = None,
            report: Callable[[RunResult, int, int], None] | None = None,
            announce: Callable[[RunSpec, bool, int, int], None] | None = None,
            reuse: bool = True) -> dict[tuple[str, int], RunResult]:
    """Run ``specs`` (seed-major) with up to ``jobs`` at once; a variant waits for the SFT run of its seed.

    Each run's state (``state_of(spec)``, e.g. :func:`~megatron_dynamo.experiments.collector.run_state`) decides:
    reuse (unless ``reuse`` is False), ``--resume`` (``command_for(spec, resume=True)``), or start over (its
    directory removed).
    ``launch(command, env, log_path) -> returncode`` runs one command (:class:`SubprocessLauncher`, a fake in tests);
    ``env_for(slot)`` its environment. A run is ok when it exits 0 and is then done. KeyboardInterrupt (here or
    raised by ``launch``): no new run starts, the running ones are asked to stop (``launch.signal_all(SIGINT)`` when
    it has one; a second interrupt: SIGKILL), and :class:`ExperimentInterrupted` is raised once they have ended.
    """
    return Executor(specs, state_of, command_for, launch, jobs, env_for, report, announce, reuse).run()


def run_then_finish(command: str, run: Callable[[], dict[tuple[str, int], RunResult]],
                    finish: Callable[[dict[tuple[str, int], RunResult]], int],
                    interrupted: Callable[[], None] | None = None) -> int:
    """``finish(run())``, the run under :func:`stop_signals` (SIGTERM and an ignored SIGINT stop it like Ctrl-C);
    interrupted: ``interrupted()`` (what must be kept of the finished runs), the line saying how to resume on
    stderr, exit status 130."""
    try:
        with stop_signals():
            results = run()
    except ExperimentInterrupted as exc:
        if interrupted is not None:
            interrupted()
        print(f"dynamo {command}: {exc}", file=sys.stderr)
        return 130
    return finish(results)
