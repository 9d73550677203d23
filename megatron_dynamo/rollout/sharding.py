"""Which engine generates which prompt.

Which ranks form which engine, and which rank leads it, is the job's topology
(:class:`~megatron_dynamo.parallel.topology.EngineLayout`): a world of W engine ranks has W /
``rollout.tensor_parallel`` engines.

Prompts go to engines by :func:`assign_to_engines`: longest-processing-time first over the requests' expected token
loads, ties broken by position, so every rank computes the same assignment from the same inputs without talking.
Seeds are per request (``interface.request_seed``), so a response does not depend on its engine.

Plain Python: nothing here imports torch.distributed or vLLM.
"""

from __future__ import annotations

import heapq
from typing import Sequence


def request_loads(prompt_lengths: Sequence[int], counts: Sequence[int], expected_response_tokens: float) -> list[float]:
    """The expected work of each request in tokens: its prompt (prefilled once, shared by its samples) plus
    ``count`` responses of the expected length. A request with count 0 costs nothing."""
    if len(prompt_lengths) != len(counts):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(counts)} counts")
    return [float(p) + float(n) * float(expected_response_tokens) if n > 0 else 0.0
            for p, n in zip(prompt_lengths, counts)]


def assign_to_engines(loads: Sequence[float], num_engines: int) -> list[int]:
    """The engine of each request: largest load first onto the least-loaded engine (lowest index on ties).

    Deterministic in (loads, num_engines). Zero-load requests (nothing to generate) are spread round-robin so no
    engine is handed all of them. The largest engine load is at most 4/3 of the optimum (Graham's LPT bound).
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    assignment = [0] * len(loads)
    if num_engines == 1:
        return assignment
    heap = [(0.0, engine) for engine in range(num_engines)]
    order = sorted(range(len(loads)), key=lambda i: (-float(loads[i]), i))
    idle = 0
    for i in order:
        if loads[i] <= 0:
            assignment[i] = idle % num_engines
            idle += 1
            continue
        total, engine = heapq.heappop(heap)
        assignment[i] = engine
        heapq.heappush(heap, (total + float(loads[i]), engine))
    return assignment


def engine_loads(loads: Sequence[float], assignment: Sequence[int], num_engines: int) -> list[float]:
    """The summed load of each engine under ``assignment``."""
    totals = [0.0] * num_engines
    for load, engine in zip(loads, assignment):
        totals[engine] += float(load)
    return totals
