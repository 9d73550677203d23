"""``python -m checkpoints_convert sign DIR``: write the manifest of a checkpoint you trust, signed with the key
configured in the environment (``DYNAMO_CHECKPOINT_KEY`` / ``DYNAMO_CHECKPOINT_KEY_FILE``).

For a checkpoint saved before manifests existed (nothing loads it without one), one saved before a key was
configured, or one to sign with a new key. It refuses a checkpoint whose files no longer match the manifest it has
(the damage would be signed), and one whose pickles hold anything but data (``pickle_scan.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_dynamo.models.checkpoint_io import CheckpointError, is_model_checkpoint
from megatron_dynamo.models.checkpoint_io.manifest import MANIFEST_FILE, check_files, load_manifest, unlisted_file
from megatron_dynamo.models.checkpoint_io.pickle_scan import pickle_problem
from megatron_dynamo.models.checkpoint_io.signing import signing_key, trust_line
from megatron_dynamo.models.checkpoint_io.verify import write_full_manifest


def sign_checkpoint(directory: str | os.PathLike) -> str:
    """Check ``directory`` and (re)write its manifest; returns the line to print. Raises CheckpointError."""
    directory = Path(directory).absolute()
    if not is_model_checkpoint(directory):
        raise CheckpointError(f"{directory}: not a megatron_dynamo checkpoint (no megatron_dynamo.json)")
    key = signing_key()
    if (directory / MANIFEST_FILE).exists():
        try:
            entries = load_manifest(directory).files
        except ValueError as exc:
            raise CheckpointError(f"{directory}: {exc}; remove it to list the files as they are now") from None
        problem = unlisted_file(directory, entries) or check_files(directory, entries)
        if problem:
            raise CheckpointError(f"{directory}: {problem}: it no longer matches its manifest, not signed (restore "
                                  f"it, or remove {MANIFEST_FILE} to list the files as they are now)")
    problem = pickle_problem(directory)
    if problem:
        raise CheckpointError(f"{directory}: {problem}; not signed")
    write_full_manifest(directory, key)
    what = f"signed (key {key.key_id})" if key is not None else "listed without a signature (no key configured)"
    return f"sign: {directory / MANIFEST_FILE} written, {what}; {trust_line(key)}"
