"""A watchdog that leaves no process of a run behind, however the run dies (``kill -9`` included).

Why: vLLM's engine core (and on GPU its workers) run in child processes that wait on sockets, not on their parent:
when the trainer dies without closing the engine (``kill -9``, OOM killer, a crash in C code, a default SIGTERM),
they live on, holding GBs of memory and the GPU. No handler runs in a process killed by SIGKILL, so the cleanup has
to live in another process.

Design. :func:`start_guard` (called early by ``dynamo train`` and ``dynamo eval``, once per process) starts this file
as a script: ``python process_guard.py <owner pid>``. The guard

- runs in its own session (``start_new_session``), so a signal to the trainer's process group or terminal (Ctrl-C,
  ``kill -- -PGID``) does not reach it, and it does not need the package (no torch import: it starts in ~0.1 s);
- every ``interval`` seconds (0.5) records the owner's descendants as psutil processes (pid + create time, so a
  reused pid is never mistaken for a recorded one). The record accumulates: a process whose parent died is
  reparented to init (or a subreaper) and is no longer the owner's descendant, but stays recorded. Entries that
  have exited are dropped;
- once the owner is gone (or a zombie), waits ``settle`` seconds (1) for the recorded processes still alive to exit
  on their own (after a normal exit, vLLM's and multiprocessing's helpers are finishing), then sends SIGTERM to the
  rest and to their descendants, waits ``grace`` seconds (3), sends SIGKILL to what is left, and exits. After a
  normal exit there is nothing left, so the guard just exits.

A process started and orphaned between two polls escapes the record: the ranks and reward workers live for the whole
run, so this does not happen here. Processes that we start ourselves can also die with their parent through
``prctl(PR_SET_PDEATHSIG)`` (:func:`die_with_parent`; the local rank processes of ``parallel.spawn`` use it), which
needs no polling but only covers the direct child and only where we run code in the child before it could be
orphaned (not processes that a library starts).

Signals for the process group. A terminal sends Ctrl-C to its whole foreground process group, which would include
vLLM's engine processes: they shut down on SIGINT, and the trainer could not finish its step. Within
:func:`children_in_own_session` (``dynamo train`` wraps each rank in it), processes started by ``multiprocessing``
with spawn / forkserver (reward workers, checkpoint helpers, and vLLM's processes where a library starts vLLM in
its own processes) begin
in a session of their own, so only the trainer receives such signals and decides. This is done like vLLM's own
NUMA binding: ``multiprocessing``'s executable is replaced by a small wrapper (``sh`` -> ``python -c 'os.setsid();
os.execv(python, ...)'``; the pid stays the same; the 3-line script lives in a private temporary folder until the
process exits) while the block runs. A signal sent to every process of a run (Slurm at the time limit, systemd's
control-group kill) still reaches them all.

Needs psutil (a dependency of the project); without it :func:`start_guard` warns and returns None.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a script: this folder (spawn.py, ...) must not shadow the standard library
    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _here]

import contextlib
import signal
import subprocess
import time

INTERVAL_SECONDS = 0.5
SETTLE_SECONDS = 1.0
GRACE_SECONDS = 3.0

_guards: dict[int, subprocess.Popen] = {}  # owner pid -> its guard (one per owner)


def start_guard(pid: int | None = None, *, interval: float = INTERVAL_SECONDS, settle: float = SETTLE_SECONDS,
                grace: float = GRACE_SECONDS) -> subprocess.Popen | None:
    """Start the guard of process ``pid`` (default: this process), or return the one already running for it.
    The guard ends by itself once ``pid`` is gone (after stopping what it left behind); :func:`stop_guard` ends
    it early without stopping anything. Its messages go to this process's stderr."""
    pid = os.getpid() if pid is None else pid
    guard = _guards.get(pid)
    if guard is not None and guard.poll() is None:
        return guard
    try:
        import psutil  # noqa: F401 -- the guard needs it; fail here, not silently in the guard
    except ImportError:
        print("dynamo: psutil is not installed: processes of this run may outlive it if it is killed",
              file=sys.stderr)
        return None
    cmd = [sys.executable, os.path.realpath(__file__), str(pid), "--interval", str(interval), "--settle",
           str(settle), "--grace", str(grace)]
    guard = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                             close_fds=True)
    _guards[pid] = guard
    return guard


def stop_guard(pid: int | None = None) -> None:
    """End the guard of ``pid`` (default: this process) without stopping any process."""
    guard = _guards.pop(os.getpid() if pid is None else pid, None)
    if guard is not None and guard.poll() is None:
        guard.send_signal(signal.SIGUSR1)
        guard.wait()


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """In a child process: have the kernel send ``sig`` to it when its parent dies (Linux ``PR_SET_PDEATHSIG``;
    a no-op elsewhere). If the parent (``parent_pid``, when given) is already gone, send ``sig`` to itself now.
    The signal follows the parent *thread* that started this process: call it only in children started from a
    thread that lives as long as they should (the main thread)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


_SETSID_EXEC = "import os, sys; os.setsid(); os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
_wrappers: dict[str, str] = {}  # python -> its wrapper, kept until this process exits (see below)


def _own_session_wrapper(python: str) -> str:
    """An executable that runs ``python`` with the given arguments in a new session (same pid). It must outlive
    the block that uses it: ``/bin/sh`` opens the script only after ``Process.start()`` has returned."""
    import atexit
    import shlex
    import shutil
    import tempfile

    wrapper = _wrappers.get(python)
    if wrapper is None or not os.path.exists(wrapper):
        folder = tempfile.mkdtemp(prefix="dynamo-python-")  # private (0700); removed when this process exits
        atexit.register(shutil.rmtree, folder, True)
        wrapper = os.path.join(folder, "python")
        with open(wrapper, "w") as f:  # -I -S: the first interpreter only runs setsid + exec (~20 ms)
            f.write(f'#!/bin/sh\nexec {shlex.quote(python)} -I -S -c {shlex.quote(_SETSID_EXEC)} "$@"\n')
        os.chmod(wrapper, 0o700)
        _wrappers[python] = wrapper
    return wrapper


@contextlib.contextmanager
def children_in_own_session():
    """Within the block, processes that ``multiprocessing`` starts by spawn / forkserver begin in a session of their
    own (and their children stay in it): Ctrl-C at a terminal or a signal to this process group no longer reaches
    them. A no-op where there is no ``/bin/sh`` (not POSIX) or in a frozen executable."""
    import multiprocessing.spawn as mp_spawn

    if sys.platform == "win32" or getattr(sys, "frozen", False) or not os.path.exists("/bin/sh"):
        yield
        return
    original = mp_spawn.get_executable()
    mp_spawn.set_executable(_own_session_wrapper(os.fsdecode(original)))
    try:
        yield
    finally:
        mp_spawn.set_executable(original)


# ------------------------------------------------------------------------------------------- the guard process
def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(proc) -> str:
    try:
        return f"{proc.pid} ({proc.name()})"
    except Exception:  # noqa: BLE001
        return str(proc.pid)


def watch(owner_pid: int, interval: float = INTERVAL_SECONDS, settle: float = SETTLE_SECONDS,
          grace: float = GRACE_SECONDS) -> list:
    """Record the descendants of ``owner_pid`` until it is gone, then stop those still alive. Returns the
    processes that had to be signalled."""
    import psutil

    stop = []
    signal.signal(signal.SIGUSR1, lambda *_: stop.append(True))  # stop_guard: the owner is done with us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        owner = psutil.Process(owner_pid)
    except psutil.Error:
        return []
    me = os.getpid()
    recorded: dict[tuple[int, float], psutil.Process] = {}
    while _alive(owner) and not stop:
        try:
            children = owner.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            try:
                key = (child.pid, child.create_time())
            except psutil.Error:
                continue
            if child.pid != me:
                recorded.setdefault(key, child)
        recorded = {key: proc for key, proc in recorded.items() if _alive(proc)}
        time.sleep(interval)
    if stop:
        return []
    left = [proc for proc in recorded.values() if _alive(proc)]
    if left:
        _, left = psutil.wait_procs(left, timeout=settle)
    # Children born since the last poll (e.g. a worker of a recorded engine process) go too.
    for proc in list(left):
        try:
            left.extend(c for c in proc.children(recursive=True) if c.pid != me and c not in left)
        except psutil.Error:
            pass
    left = [proc for proc in left if _alive(proc)]
    if not left:
        return []
    print(f"dynamo: process {owner_pid} is gone; stopping {len(left)} process(es) it left behind: "
          + ", ".join(_describe(p) for p in left), file=sys.stderr, flush=True)
    for proc in left:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(left, timeout=grace)
    for proc in still:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still, timeout=grace)
    return left


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="stop the descendants of PID once PID is gone")
    parser.add_argument("pid", type=int)
    parser.add_argument("--interval", type=float, default=INTERVAL_SECONDS)
    parser.add_argument("--settle", type=float, default=SETTLE_SECONDS)
    parser.add_argument("--grace", type=float, default=GRACE_SECONDS)
    args = parser.parse_args(argv)
    watch(args.pid, args.interval, args.settle, args.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
