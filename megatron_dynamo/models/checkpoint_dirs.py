"""Where a training run keeps its checkpoints: ``<checkpoints>/step_NNNNNN/`` directories, complete once they
hold ``trainer_state.json`` (a save writes ``step_N.tmp`` and renames it), and a ``latest`` file naming the newest.

Discovery only (no torch, no Megatron): the trainer saves and resumes them (``trainer/checkpoint.py``), and
``dynamo eval``, the launch entry points and ``dynamo ablate`` find them here without importing the trainer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d{6,})$")
LATEST = "latest"
STATE_FILE = "trainer_state.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (``.tmp`` leftovers excluded), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.match(path.name)
        if match and not path.is_symlink() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint named by ``latest`` if it is complete, else the newest complete one, else None.

    ``latest`` must name a step directory of ``root`` itself (``step_NNNNNN``, not a symbolic link): a pointer
    such as ``../victim`` or ``/elsewhere`` is ignored like a missing one."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file() and not pointer.is_symlink():
        name = pointer.read_text(errors="replace").strip()
        candidate = root / name
        if STEP_DIR.match(name) and not candidate.is_symlink() and (candidate / STATE_FILE).is_file():
            return candidate
    checkpoints = list_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None
