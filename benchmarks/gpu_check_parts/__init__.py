"""The parts of the GPU check (``benchmarks/gpu_check.py`` is the driver): one module per part, plus the
registry, the environment probe, shared helpers and the report."""
