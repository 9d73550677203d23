"""The errors a run ends with: one line each, saying why and what was kept; and :func:`raise_on_any_rank`, which
turns a failure on one rank into the same error on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dynamo.parallel.placement import job_rank
from megatron_dynamo.parallel.runtime import collective_device


class TrainingError(RuntimeError):
    """A run cannot go on; the message says why and what was kept."""


class ResumeError(TrainingError):
    """``--resume`` found checkpoints but none intact, or ``model.checkpoint`` does not verify (``dynamo train``
    exits 2: bad input)."""


class TrainingStopped(TrainingError):
    """The run stopped at a step boundary on SIGINT / SIGTERM (``signum``) after ``step``; the message says which
    checkpoint holds it."""

    def __init__(self, message: str, signum: int, step: int):
        super().__init__(message)
        self.signum = signum
        self.step = step


class RolloutError(RuntimeError):
    """Generation, scoring or a weight load failed on some rank; raised on every rank."""


def raise_on_any_rank(failure: str | None, what: str) -> None:
    """Collective: raise :class:`RolloutError` on every rank if any rank has a ``failure`` (its text, else None),
    naming the first failed rank's reason."""
    if dist.get_world_size() == 1:
        failed = [] if failure is None else [failure] if job_rank(0) == 0 else [f"rank {job_rank(0)}: {failure}"]
    else:
        flag = torch.tensor([0.0 if failure is None else 1.0], device=collective_device())
        dist.all_reduce(flag)
        if flag.item() == 0:
            return
        reasons = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, failure)  # a few lines of text, only on failure
        failed = [f"rank {job_rank(r)}: {text}" for r, text in enumerate(reasons) if text is not None]
    if failed:
        raise RolloutError(f"{what} ({failed[0]}). The checkpoints written so far are intact: fix the cause and "
                           "rerun with --resume.")
