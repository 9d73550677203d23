"""A benchmark's child runs: none may outlive the benchmark (Ctrl-C, SIGTERM, a timeout of the benchmark)."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, again (our trainer stops at once on a second one), then SIGKILL; each given 10 s."""
    for signal_it in (proc.terminate, proc.terminate, proc.kill):
        signal_it()
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def run(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)``, stopping the child if we are interrupted."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:  # KeyboardInterrupt, SystemExit from the SIGTERM handler
        stop(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def add_output_options(parser, name: str) -> None:
    """``--out`` (run directories and JSON, default ``outputs/<name>``; finished runs there are reused) and
    ``--json`` (another copy of the JSON, e.g. under benchmarks/results/)."""
    parser.add_argument("--out", default=f"outputs/{name}",
                        help="run directories and JSON; the warm-up and finished runs there are reused")
    parser.add_argument("--json", default=None, help="also write the JSON here (e.g. benchmarks/results/...)")


def exit_on_sigterm() -> None:
    """SIGTERM exits (status 143) through Python, so :func:`run` stops the child in progress too."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
