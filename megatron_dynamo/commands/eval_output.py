"""``dynamo eval``'s output directory: its default name per checkpoint, and the record that lets a finished evaluation
be reused (same checkpoint files, same arguments) or cleared (``--overwrite``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from megatron_dynamo.eval.model_source import checkpoint_identity
from megatron_dynamo.eval.runner import SAMPLES_FILE, SETTINGS_FILE, SUMMARY_FILE

FINISHED_FILE = "finished.json"
#: The arguments a finished evaluation depends on (the others, --nproc, --problems-per-batch..., change no sample).
RESULT_ARGS = ("benchmarks", "data_dir", "n", "k", "temperature", "top_p", "max_tokens", "template", "seed",
                "answer_only", "limit", "tokenizer", "max_model_len", "dtype")


def default_output(source: Path, name: str) -> Path:
    """``outputs/eval/<name>-<8 hex of the checkpoint's absolute path>``: every checkpoint its own directory."""
    return Path("outputs") / "eval" / f"{name}-{hashlib.sha256(str(source).encode()).hexdigest()[:8]}"


def checkpoint_key(source: Path) -> str:
    """The checkpoint's path and the identity of its files: what a finished evaluation is recorded for."""
    return f"{source}:{checkpoint_identity(source)}"


def result_args(args) -> dict[str, Any]:
    return {key: getattr(args, key) for key in RESULT_ARGS}


def finished_evaluation(output: Path, identity: str, args) -> dict[str, Any] | None:
    """The summary of ``output`` when it holds a finished evaluation of this checkpoint (same path and files) with
    these arguments, else None."""
    try:
        record = json.loads((output / FINISHED_FILE).read_text(encoding="utf-8"))
        summary = json.loads((output / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    same = record.get("checkpoint") == identity and record.get("args") == json.loads(json.dumps(result_args(args)))
    return summary if same else None


def other_model(output: Path, source: Path) -> str | None:
    try:
        model = json.loads((output / SETTINGS_FILE).read_text(encoding="utf-8")).get("model")
    except (OSError, ValueError, AttributeError):
        return None
    return model if model not in (None, str(source)) else None


def record_finished(output: Path, identity: str, args) -> None:
    (output / FINISHED_FILE).write_text(json.dumps({"checkpoint": identity, "args": result_args(args)}, indent=2)
                                        + "\n", encoding="utf-8")


def forget_results(output: Path) -> None:
    """--overwrite: the samples, settings and summary go (a cached conversion stays: it is keyed by identity)."""
    for name in (FINISHED_FILE, SUMMARY_FILE, SAMPLES_FILE, SETTINGS_FILE):
        (output / name).unlink(missing_ok=True)
