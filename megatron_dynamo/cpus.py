"""The CPUs this process may use: what sizes thread pools and worker counts. Imports nothing heavy, so the reward
workers and the rank launchers share it."""

from __future__ import annotations

import os


def usable_cpu_count() -> int:
    """CPUs this process may run on: its affinity mask (set by containers, job schedulers and ``dynamo ablate
    --jobs``), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_rank(local_ranks: int) -> int:
    """Torch threads for one of ``local_ranks`` CPU ranks sharing this process's CPUs (at least 1)."""
    return max(1, usable_cpu_count() // max(1, local_ranks))
