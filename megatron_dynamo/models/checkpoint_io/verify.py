"""Whether a checkpoint may be loaded: the one check ``--resume``, a run's ``model.checkpoint``, the converter
(``megatron-to-hf``, ``verify``) and ``dynamo eval`` make before they read anything of it.

In order: the manifest is there and well formed (entries inside the checkpoint); with a key (``signing.py``) its
signature verifies; every file is listed; every listed file has its size and SHA-256; every pickle holds only
the classes its format is made of (``pickle_scan.py``). Collective use: each rank passes its rank and the world
size and checks its share of the files; the caller agrees on the first problem.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_dynamo.models.checkpoint_io.formats import CheckpointError
from megatron_dynamo.models.checkpoint_io.manifest import (MANIFEST_FILE, check_files, hash_files, load_manifest,
                                                           unlisted_file, write_manifest)
from megatron_dynamo.models.checkpoint_io.pickle_scan import pickle_problem
from megatron_dynamo.models.checkpoint_io.signing import SigningKey, key_inside


def checkpoint_problem(root: str | os.PathLike, key: SigningKey | None, rank: int = 0,
                       world_size: int = 1) -> str | None:
    """This rank's share of the checks of the module doc: the first problem as a phrase, or None."""
    try:
        manifest = load_manifest(root)
    except ValueError as exc:
        return str(exc)
    if key is not None:
        if key_inside(key, root):
            return f"the key file {key.source} lies inside the checkpoint it would verify"
        problem = key.problem(manifest.body, manifest.signature)
        if problem:
            return problem
    return (unlisted_file(root, manifest.files) or check_files(root, manifest.files, rank, world_size)
            or pickle_problem(root, rank, world_size))


def verify_checkpoint(root: str | os.PathLike, key: SigningKey | None) -> None:
    """:func:`checkpoint_problem` in one process; raises CheckpointError ``"<root>: <problem>; not loaded"``."""
    problem = checkpoint_problem(root, key)
    if problem:
        raise CheckpointError(f"checkpoint {root}: {problem}; not loaded")


def write_full_manifest(root: str | os.PathLike, key: SigningKey | None) -> None:
    """Hash every file under ``root`` in this process and write its manifest (signed with ``key`` if given): for
    directories written by one process at the end (the converter's output), or re-signing one by hand."""
    root = Path(root)
    files = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*"))
             if p.is_file() and not p.is_symlink() and p.relative_to(root).as_posix() != MANIFEST_FILE]
    write_manifest(root, hash_files(root, files), key)
