"""Why writing a checkpoint failed, in one phrase: the disk full, a directory not writable, or the exception.

A failed write rarely says so plainly. On a full disk torch's zip writer raises ``RuntimeError: ... unexpected
pos`` (no errno), and torch DCP wraps every rank's exception into ``CheckpointException``, a ``BaseException``
(not an ``Exception``, so ``except OSError`` misses it) whose message is a multi-line traceback. Here the
exception chain is searched for an ``OSError`` with an errno, and a write that failed on a (nearly) full file
system is called what it is, with the free and total space.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from megatron_dynamo.models.checkpoint_io.formats import exception_chain


def write_exceptions() -> tuple[type[BaseException], ...]:
    """What a failed checkpoint write may raise: any ``Exception`` and torch DCP's ``CheckpointException``."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} bytes"


def disk_space(directory: str | os.PathLike) -> tuple[int, int] | None:
    """(free, total) bytes of the file system holding ``directory`` (or its nearest existing ancestor)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return None
    return usage.free, usage.total


def no_space_phrase(directory: str | os.PathLike) -> str:
    space = disk_space(directory)
    if space is None:
        return "no space left on device"
    return f"no space left on device: {human_bytes(space[0])} free of {human_bytes(space[1])}"


# Below this much free space a write error without an errno is taken for a full disk.
NEARLY_FULL_BYTES = 1 << 20


def write_failure(exc: BaseException, directory: str | os.PathLike) -> str:
    """One phrase for why writing into ``directory`` failed (call it before the partial files are removed: the
    free space is measured now)."""
    chain = exception_chain(exc)
    for error in chain:
        if isinstance(error, OSError) and error.errno is not None:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                return no_space_phrase(directory)
            where = f" ({error.filename})" if error.filename else ""
            return f"{error.strerror or os.strerror(error.errno)}{where}"
    space = disk_space(directory)
    if space is not None and space[0] < NEARLY_FULL_BYTES:
        return no_space_phrase(directory)
    # The first exception that is not a wrapper of others (DCP's CheckpointException carries the ranks' ones).
    innermost = next((error for error in chain if not getattr(error, "failures", None)), exc)
    text = str(innermost).strip().splitlines()
    return f"{type(innermost).__name__}: {text[0] if text else ''}".rstrip(": ")
