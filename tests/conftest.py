import os
import sys

import pytest

# Make `tests/multiproc.py` importable as `multiproc` and the repo importable without installation.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))


def _pin_xdist_worker() -> None:
    """Give each pytest-xdist worker its own share of the CPUs (2 workers on 2 cores: one core each).

    The product sizes torch's thread pools and its ranks' threads to the CPUs its process may run on
    (``megatron_dynamo.cpus``, the affinity mask, as ``dynamo ablate --jobs`` shares cores). Unpinned, two workers
    each run 2-thread pools on 2 cores, and every small op of the tiny test models waits for a descheduled thread:
    a training test that takes 31 s alone took 86 s beside one busy process, and 35 s pinned to a core of its own.
    Processes a test starts inherit the mask; Slurm's jobs, started by slurmd, do not. The slots are the ones
    ``dynamo ablate --jobs`` gives its runs (``executor.cpu_slots``); with fewer CPUs than workers nothing is pinned,
    since two workers on one core would be worse than sharing them all."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < count:
        return
    from megatron_dynamo.experiments.executor import cpu_slots

    os.sched_setaffinity(0, cpu_slots(count)[int(worker.removeprefix("gw")) % count])


def pytest_configure(config):
    _pin_xdist_worker()
    config.addinivalue_line("markers", "distributed: spawns several gloo processes")
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it)")
    config.addinivalue_line("markers", "slow: more than ~12 s on the 2-core CPU machine, or several processes "
                                       "(every distributed and slurm test); `pytest -m 'not slow'` is the fast tier")
    config.addinivalue_line("markers", "extended: a larger variant of a property that a CI test already checks (one more "
                                       "layout, placement or CLI resume); CI leaves it out to stay under 25 minutes, "
                                       "`bash scripts/run_tests.sh --all` runs it")
    config.addinivalue_line("markers", "slurm: real jobs on the local Slurm cluster (scripts/local_slurm.sh up; "
                                       "skipped without it)")


def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:  # the fast tier runs in one process: multi-process and Slurm tests are slow by definition
        if "distributed" in item.keywords or "slurm" in item.keywords or "extended" in item.keywords:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
