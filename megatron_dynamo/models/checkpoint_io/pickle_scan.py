"""Every pickle of a checkpoint read with the allow-lists of :mod:`.safe_pickle` before anything is loaded, so that
a checkpoint carrying code is refused like a damaged one (``--resume`` falls back to the previous checkpoint).

A Megatron distributed checkpoint directory (``model/``, ``optimizer/``: they hold ``metadata.json``) has three
kinds of pickle: ``.metadata`` (torch DCP's metadata), ``common.pt`` and the byte items inside the
``__<rank>_<n>.distcp`` files. ``metadata.json`` must name the ``torch_dist`` / ``torch`` backends: another
backend would be read by other code (zarr's object codecs unpickle too; :func:`safe_pickle.check_backend`).

Ranks share the work like the checksums do (``manifest.py``): every rank reads ``.metadata`` (it locates the byte
items), rank 0 ``common.pt``, and rank ``r % world_size`` the byte items of the files rank ``r`` saved.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_dynamo.models.checkpoint_io.manifest import file_owner
from megatron_dynamo.models.checkpoint_io.safe_pickle import (DIST_METADATA, UnsafeCheckpointError, check_backend,
                                                               load_byte_item, load_dcp_metadata, load_torch_file)


def dist_checkpoint_dirs(root: str | os.PathLike) -> list[Path]:
    """The Megatron distributed checkpoint directories under ``root`` (``root`` itself included)."""
    root = Path(root)
    return sorted(Path(d) for d, _, files in os.walk(root) if DIST_METADATA in files)


def _check_directory(directory: Path, label: str, rank: int, world_size: int) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    check_backend(directory)
    with open(directory / ".metadata", "rb") as f:
        metadata = load_dcp_metadata(f, f"{label}/.metadata")
    if rank == 0 and (directory / "common.pt").exists():
        load_torch_file(directory / "common.pt")
    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda item: item[0].fqn):
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if file_owner(info.relative_path) % world_size != rank or getattr(info, "transform_descriptors", None):
            continue  # another rank's, or transformed (compressed): the loader's own check covers it
        with open(directory / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        load_byte_item(data, index.fqn, f"{label}/{info.relative_path}: byte item {index.fqn}", map_location="cpu")


def pickle_problem(root: str | os.PathLike, rank: int = 0, world_size: int = 1) -> str | None:
    """This rank's share of the pickles of every distributed checkpoint under ``root``: the first problem as a
    phrase (``"model/.metadata: refused to unpickle posix.system ..."``), or None."""
    root = Path(root)
    for directory in dist_checkpoint_dirs(root):
        label = directory.relative_to(root).as_posix()
        try:
            _check_directory(directory, label if label != "." else root.name, rank, world_size)
        except UnsafeCheckpointError as exc:
            return str(exc).replace(f"{root}/", "")
        except OSError as exc:
            return f"{label}: {exc.strerror or exc} ({getattr(exc, 'filename', '') or ''})"
    return None
