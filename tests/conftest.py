import json
import os
import sys
import time
from collections import defaultdict

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
    since two workers on one core would be worse than sharing them all. The worker's own pool is resized too: torch
    is imported by then (the import of ``cpu_slots``) and sized its pool to the whole machine, so every test that
    computes in the worker itself (an in-process vLLM engine, the HF references) ran two spinning threads on one
    core: test_eval's answer-candidates test took 102 s in the suite and 2.3 s alone.
    """
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < count:
        return
    from megatron_dynamo.experiments.executor import cpu_slots

    os.sched_setaffinity(0, cpu_slots(count)[int(worker.removeprefix("gw")) % count])
    import torch

    from megatron_dynamo.cpus import usable_cpu_count

    torch.set_num_threads(usable_cpu_count())


# Seconds per test file (setup, call and teardown of its tests) from one whole run of the README's test command, by
# `--record-durations`. CI runs the files heaviest first (scripts/run_tests.sh: two processes, each file whole in
# one, `--no-loadscope-reorder`): a five-minute file that starts last leaves the other process idle for minutes.
DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test file's total seconds in this run to PATH (JSON), e.g. tests/durations.json "
                          "after a whole run of scripts/run_tests.sh; the order of the files in CI comes from it")


def _file_weights() -> dict[str, float]:
    try:
        with open(DURATIONS, encoding="utf-8") as f:
            return json.load(f)["seconds"]
    except (OSError, ValueError, KeyError):
        return {}


def pytest_configure(config):
    _pin_xdist_worker()
    if config.getoption("record_durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(_DurationRecorder(config.getoption("record_durations")), "durations")
    config.addinivalue_line("markers", "distributed: spawns several gloo processes")
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it)")
    config.addinivalue_line("markers", "slow: more than ~12 s on the 2-core CPU machine, or several processes "
                                       "(every distributed and slurm test); `pytest -m 'not slow'` is the fast tier")
    config.addinivalue_line("markers", "extended: a larger variant of a property that a CI test already checks (one more "
                                       "layout, placement or CLI resume); CI leaves it out to stay under 25 minutes, "
                                       "`bash scripts/run_tests.sh --all` runs it")
    config.addinivalue_line("markers", "slurm: real jobs on the local Slurm cluster (scripts/local_slurm.sh up; "
                                       "skipped without it)")


class _DurationRecorder:
    """Sums each file's test phases as the reports arrive (in the controller when the run is split in processes)."""

    def __init__(self, path: str):
        self.path, self.seconds, self.start = path, defaultdict(float), time.monotonic()

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid.split("::")[0]] += report.duration

    def pytest_sessionfinish(self, session):
        from megatron_dynamo.trainer.provenance import cpu_model

        record = {"machine": f"{cpu_model()}, {os.cpu_count()} CPUs",
                  "date": time.strftime("%Y-%m-%d"), "wall_seconds": round(time.monotonic() - self.start),
                  "seconds": {name: round(s, 1) for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}}
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


def pytest_collection_modifyitems(config, items):
    import torch

    weights = _file_weights()  # heaviest files first; a file not yet measured goes first too (it may be heavy)
    items.sort(key=lambda item: -weights.get(item.nodeid.split("::")[0], float("inf")))

    for item in items:  # the fast tier runs in one process: multi-process and Slurm tests are slow by definition
        if "distributed" in item.keywords or "slurm" in item.keywords or "extended" in item.keywords:
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
