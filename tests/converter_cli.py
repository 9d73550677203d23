"""``python -m checkpoints_convert`` for the converter's tests: in this process (validation errors come before any
model or process group exists) or as a program of its own (its spawned workers, its exit status)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

from hf_reference import REPO


def converter_cli(*args) -> tuple[int, str]:
    """The CLI in this process: exit status and stderr."""
    from checkpoints_convert.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, err.getvalue()


def converter_program(*args, timeout=300) -> tuple[int, str, str]:
    """The CLI as a program: exit status, stdout and stderr."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "checkpoints_convert", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr
