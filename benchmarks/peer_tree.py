"""One command's whole process tree followed while it runs (``benchmarks/bench_peer.py``): CPU seconds summed over the
tree every ``interval`` seconds, its PSS every ``pss_interval`` seconds, and the wall time at which each line of its
per-step log first appeared (the end of that step).

Why PSS less often: the kernel computes a process's PSS by walking its page tables under the process's memory-map
lock. For our 1 GB CPU-default trainer one read took 19 ms of a core (AMD EPYC, 2 cores); read ten times a second it
took a fifth of a core from the measured run and blocked its page faults meanwhile: in back-to-back runs of the CPU
default (2 pairs each) the step came out 9% slower for ours and 13% for TRL's than with a read once a second, the
ratio within its noise (2026-11-29). Once a second, the peak is the same (the trees' PSS is flat after start-up).

CPU: user + system time of every process of the tree, the last value seen for a process that has exited (children's
times are not added: a reaped child's time would then count twice). A process that lives less than one interval is
missed (none does in a training step). PSS (each sample carries the last value read): ``memory_full_info().pss``
(from ``/proc/<pid>/smaps_rollup`` where the kernel has it, else ``smaps``), each shared page split among the
processes that map it, so the sum over the tree counts every page once.
"""

from __future__ import annotations

import bisect
import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import child_process  # benchmarks/child_process.py (this folder is on sys.path wherever peer_tree is imported)


@dataclass
class RunTrace:
    launched: float  # time.time() when the command was started
    exit_code: int = 0
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (time, tree CPU s, tree PSS bytes)
    step_end: dict[int, float] = field(default_factory=dict)  # step (line number of the log) -> time first seen
    load_before: float = 0.0
    load_after: float = 0.0

    @property
    def peak_pss(self) -> int:
        return max((pss for _, _, pss in self.samples), default=0)

    def cpu_at(self, when: float) -> float:
        """The tree's CPU seconds at ``when``, interpolated between the samples around it."""
        times = [t for t, _, _ in self.samples]
        i = bisect.bisect_left(times, when)
        if i == 0:
            return self.samples[0][1]
        if i == len(times):
            return self.samples[-1][1]
        (t0, c0, _), (t1, c1, _) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1

    def as_json(self) -> dict:
        return {"launched": self.launched, "exit_code": self.exit_code, "load_before": self.load_before,
                "load_after": self.load_after, "step_end": self.step_end,
                "samples": [[round(t - self.launched, 3), round(c, 3), p] for t, c, p in self.samples]}


def _line_count(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _sample(root, cpu_by_process: dict, read_pss: bool) -> int | None:
    """Update ``cpu_by_process`` with every live process of the tree; return the tree's PSS (None unless
    ``read_pss``)."""
    import psutil

    try:
        processes = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        processes = []
    pss = 0
    for process in processes:
        try:
            with process.oneshot():
                times = process.cpu_times()
                cpu_by_process[(process.pid, process.create_time())] = times.user + times.system
                if read_pss:
                    pss += process.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return pss if read_pss else None


def trace_run(cmd: list[str], cwd: Path, step_log: Path, console: Path, interval: float = 0.1,
              pss_interval: float = 1.0) -> RunTrace:
    """Run ``cmd`` (output to ``console``) and follow its tree until it exits; a failed command raises with the end
    of its console output."""
    import psutil

    step_log.unlink(missing_ok=True)
    trace = RunTrace(launched=time.time(), load_before=os.getloadavg()[0])
    cpu_by_process: dict[tuple[int, float], float] = {}
    with open(console, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        pss, pss_read_at = 0, -math.inf
        try:
            while True:
                read_pss = time.time() - pss_read_at >= pss_interval
                value = _sample(root, cpu_by_process, read_pss)
                now = time.time()
                if read_pss:
                    pss, pss_read_at = value, now
                trace.samples.append((now, sum(cpu_by_process.values()), pss))
                for step in range(len(trace.step_end) + 1, _line_count(step_log) + 1):
                    trace.step_end[step] = now
                if proc.poll() is not None:
                    break
                time.sleep(interval)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM as SystemExit): the run must not outlive us
            child_process.stop(proc)
            raise
    trace.exit_code = proc.returncode
    trace.load_after = os.getloadavg()[0]
    if proc.returncode != 0:
        tail = console.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {proc.returncode}:\n" + "\n".join(tail))
    return trace
