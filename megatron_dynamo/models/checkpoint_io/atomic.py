"""Atomic output directories.

:func:`atomic_output_dir` writes into a hidden temporary sibling, fsyncs every file, and renames it into place only
on success; on any error the temporary directory is removed, so the output path either holds a complete result or
does not exist. An existing output is refused unless ``force=True``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from megatron_dynamo.models.checkpoint_io.formats import OutputExistsError


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output_path(path: str | os.PathLike, force: bool = False) -> Path:
    path = Path(path).absolute()
    if (path.exists() or path.is_symlink()) and not force:
        raise OutputExistsError(f"{path} already exists; choose another --out or pass --force to replace it")
    return path


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success move it to ``path`` atomically, on error remove it."""
    path = check_output_path(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the output should get ordinary permissions
    try:
        yield tmp
        fsync_tree(tmp)
        if path.exists() or path.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / "replaced")
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

