"""The errors a run ends with: one line each, saying why and what was kept."""

from __future__ import annotations


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
