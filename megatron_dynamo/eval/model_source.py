"""What ``dynamo eval --checkpoint`` accepts, turned into an HF model directory vLLM can load.

- an HF model directory (``config.json`` + safetensors): used as it is;
- a hub id (``Qwen/Qwen2.5-Math-1.5B``): its snapshot in the Hugging Face cache (``models/hub.py``);
- a Megatron model checkpoint of this project (``megatron_dynamo.json``: the converter's output or one step of a
  training run): converted to HF once, into ``<eval output>/hf_model`` (reused while the checkpoint is the same:
  its path and :func:`checkpoint_identity`, so a later run's checkpoint written at the same path is converted
  anew);
- a training run's checkpoint root (``checkpoints/`` with ``latest``) or the run's output directory: its latest
  complete checkpoint.

A training checkpoint also tells the evaluation how the run built its prompts (``data.template``), so that the
default template is the one the model was trained with. Generation stops at the same tokens as the run's rollouts:
:meth:`ModelSource.stop_token_ids` (the model directory's ``generation_config.json``, which a converted checkpoint
carries from its ``hf/``, and the template's end of turn).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron_dynamo.data.stopping import GenerationConfigError, stop_token_ids
from megatron_dynamo.eval.runner import EvalError
from megatron_dynamo.models.checkpoint_dirs import latest_checkpoint
from megatron_dynamo.models.checkpoint_io import TOKENIZER_FILES, is_model_checkpoint
from megatron_dynamo.models.export import export_to_hf
from megatron_dynamo.models.hub import HubModelError, resolve_model_dir

SOURCE_FILE = "converted_from.txt"


@dataclass(frozen=True)
class ModelSource:
    """``hf_dir``: what vLLM loads. ``source``: the resolved path the user's argument named (recorded in the
    evaluation's settings). ``training_config``: the run config stored in a training checkpoint, if any."""

    hf_dir: Path
    source: Path
    is_megatron: bool
    training_config: dict | None

    def stop_token_ids(self, tokenizer, template: str,
                       tokenizer_dir: str | os.PathLike | None = None) -> tuple[int, ...]:
        """The ids that end a response of this model (see :func:`megatron_dynamo.data.stopping.stop_token_ids`):
        ``generation_config.json`` is looked for in ``hf_dir`` and in ``tokenizer_dir`` (``--tokenizer``); a
        malformed one is an EvalError."""
        try:
            return stop_token_ids(tokenizer, template, [self.hf_dir, tokenizer_dir])
        except GenerationConfigError as exc:
            raise EvalError(str(exc)) from None


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The model directory an argument names (see the module doc; a hub id: its snapshot in the Hugging Face
    cache, downloaded there unless HF_HUB_OFFLINE is set), or EvalError saying what was found."""
    try:
        path = resolve_model_dir(path, "checkpoint")
    except HubModelError as exc:
        raise EvalError(f"--checkpoint {exc}") from None
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise EvalError(f"--checkpoint {path}: no such directory")
    if _is_hf_dir(path) or is_model_checkpoint(path):
        return path
    for root in (path, path / "checkpoints"):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise EvalError(f"--checkpoint {path}: neither an HF model directory (config.json + *.safetensors), a "
                    "megatron_dynamo checkpoint (megatron_dynamo.json), nor a run/checkpoint directory with a "
                    "complete checkpoint")


def checkpoint_identity(path: str | os.PathLike) -> str:
    """A short fingerprint of what is in a checkpoint directory: every file's relative path, size and modification
    time (nanoseconds). The same files give the same identity; a checkpoint rewritten at the same path (a new run
    in the same output directory) another one. Cheap: no file is read."""
    import hashlib

    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def prepare_model(path: str | os.PathLike, work_dir: str | os.PathLike,
                  tokenizer: str | os.PathLike | None = None) -> ModelSource:
    """Resolve ``path`` and make sure an HF directory with tokenizer files exists for it (converting a Megatron
    checkpoint into ``<work_dir>/hf_model``). ``tokenizer``: a directory to take tokenizer files from instead."""
    source = resolve_checkpoint(path)
    training_config = None
    state = source / "trainer_state.json"
    if state.is_file():
        training_config = json.loads(state.read_text(encoding="utf-8")).get("config")
    if not is_model_checkpoint(source):
        hf_dir = source
    else:
        hf_dir = Path(work_dir).absolute() / "hf_model"
        stamp = hf_dir / SOURCE_FILE
        identity = f"{source}\n{checkpoint_identity(source)}"
        if not (stamp.is_file() and stamp.read_text().strip() == identity):
            tokenizer_dir = tokenizer or _run_tokenizer(source)
            if stamp.is_file():
                stamp.unlink()  # no stale stamp over a half-written conversion
            try:
                export_to_hf(source, hf_dir, tokenizer_dir=tokenizer_dir)
            except RuntimeError as exc:
                raise EvalError(str(exc)) from None
            stamp.write_text(f"{identity}\n")
    if tokenizer is None and not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        raise EvalError(f"{hf_dir} has no tokenizer files; pass --tokenizer DIR")
    return ModelSource(hf_dir, source, is_model_checkpoint(source), training_config)


def _run_tokenizer(checkpoint: Path) -> Path | None:
    """The tokenizer a training run saved next to its checkpoints (``<output_dir>/tokenizer``), for
    checkpoints written before checkpoints carried their own."""
    if any((checkpoint / "hf" / name).is_file() for name in TOKENIZER_FILES):
        return None
    candidate = checkpoint.parent.parent / "tokenizer"
    return candidate if candidate.is_dir() else None
