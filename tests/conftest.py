import os
import sys

import pytest

# Make `tests/multiproc.py` importable as `multiproc` and the repo importable without installation.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))


def pytest_configure(config):
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
