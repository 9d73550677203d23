"""Per-prompt rollout counts, computed once on rank 0 and broadcast, so every rank has the same alignment.

:func:`allocate_counts` runs the DynaMO allocator (``megatron_dynamo.algorithms``: Bernoulli variances from the
prompt history with the fill-in rule, budget N * n_avg, bounds [n_min, n_max], power) on ``src`` only and broadcasts
the integer counts, the eq. 23 variance ratio and a digest of the prompt ids in one int64 tensor. Every rank checks
that its own prompt ids (in order) have the digest of ``src``'s: counts are positional, so a rank whose batch differs
would pair counts with the wrong prompts. A mismatch raises on every rank (one extra all-reduce of a flag), so no rank
is left waiting in a later collective.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynamo.algorithms import (AllocationConfig, PromptHistory, plan_rollouts, predicted_variance_ratio,
                                        prompt_variances)
from megatron_dynamo.parallel.runtime import collective_device


@dataclass(frozen=True)
class RolloutAllocation:
    """The counts of one step (``counts[i]`` responses for ``prompt_ids[i]``) and their diagnostics."""

    prompt_ids: tuple[str, ...]
    counts: tuple[int, ...]
    #: eq. 23: sum P_i / n_i under these counts over the same sum under uniform counts (1.0: no gain, or DRA off)
    predicted_variance_ratio: float

    @property
    def budget(self) -> int:
        return sum(self.counts)


def prompt_ids_digest(prompt_ids: Sequence[Any]) -> int:
    """A signed 63-bit digest of the ordered prompt ids (type-tagged: 1 and "1" differ)."""
    h = hashlib.blake2b(digest_size=8)
    for pid in prompt_ids:
        h.update(f"{type(pid).__name__}:{pid}\x1e".encode())
    return int.from_bytes(h.digest(), "little") >> 1


def compute_counts(history: PromptHistory, prompt_ids: Sequence[Any], cfg: AllocationConfig) -> tuple[np.ndarray, float]:
    """The local computation (what ``src`` runs): counts and the eq. 23 ratio."""
    counts = np.asarray(plan_rollouts(history, list(prompt_ids), cfg), dtype=np.int64)
    if cfg.enabled:
        ratio = predicted_variance_ratio(prompt_variances(history, list(prompt_ids), cfg.unknown_variance), counts)
    else:
        ratio = 1.0
    return counts, float(ratio)


def allocate_counts(history: PromptHistory | None, prompt_ids: Sequence[Any], cfg: AllocationConfig,
                    group: Any = None, src: int = 0) -> RolloutAllocation:
    """Counts for ``prompt_ids`` (same order on every rank), computed on global rank ``src`` and broadcast over
    ``group`` (default: the world). ``history`` is only read on ``src`` (other ranks may pass ``None``).
    Without torch.distributed (or with one process) the counts are computed locally.
    """
    ids = list(prompt_ids)
    if not ids:
        raise ValueError("allocate_counts: no prompts")
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if not distributed or rank == src:
        if history is None:
            raise ValueError(f"allocate_counts: rank {rank} computes the counts and needs the prompt history")
        counts, ratio = compute_counts(history, ids, cfg)
    if not distributed:
        return RolloutAllocation(tuple(str(i) for i in ids), tuple(int(c) for c in counts), ratio)

    device = collective_device(group)
    digest = prompt_ids_digest(ids)
    # [digest, ratio as float64 bits, counts...] in one int64 broadcast.
    payload = torch.empty(len(ids) + 2, dtype=torch.int64, device=device)
    if rank == src:
        payload[0] = digest
        payload[1:2] = torch.tensor([ratio], dtype=torch.float64).view(torch.int64)
        payload[2:] = torch.from_numpy(counts)
    dist.broadcast(payload, src=src, group=group)
    payload = payload.cpu()
    mismatch = torch.tensor([int(int(payload[0]) != digest)], dtype=torch.int64, device=device)
    dist.all_reduce(mismatch, op=dist.ReduceOp.MAX, group=group)
    if int(mismatch.item()):
        raise RuntimeError(
            f"allocate_counts: the ranks disagree on the step's prompt ids (rank {rank}: "
            f"{'same as' if int(payload[0]) == digest else 'differs from'} rank {src}); counts are positional, "
            "so every rank must pass the same prompt ids in the same order")
    ratio = float(payload[1:2].view(torch.float64).item())
    return RolloutAllocation(tuple(str(i) for i in ids), tuple(int(c) for c in payload[2:].tolist()), ratio)
