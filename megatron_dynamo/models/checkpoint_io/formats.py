"""Names, dtypes and errors shared by the checkpoint readers and writers, and ``config.json`` reading."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


CHECKPOINT_FORMAT = "megatron_dynamo.model_checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
CHECKPOINT_META_FILE = "megatron_dynamo.json"
CHECKPOINT_HF_DIR = "hf"
CHECKPOINT_MODEL_DIR = "model"

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json")

# safetensors dtype codes <-> torch dtypes (the floating types a Qwen checkpoint can hold).
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16}



class CheckpointError(ValueError):
    """A checkpoint is unreadable, incomplete or inconsistent; the message names the file or tensor."""


class OutputExistsError(CheckpointError):
    """The output path exists and overwriting was not asked for."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPE_NAMES.items():
        if value == dtype:
            return name
    raise CheckpointError(f"unsupported dtype {dtype} (supported: {', '.join(DTYPE_NAMES)})")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPE_NAMES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return DTYPE_NAMES[name]


# ----------------------------------------------------------------------------------------------- HF config
def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The raw ``config.json`` of a model directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file (an HF model directory needs a config.json)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None



def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception behind it: ``__cause__`` / ``__context__``, and the per-rank failures a torch
    DCP ``CheckpointException`` carries (a ``BaseException`` whose message is a multi-line traceback)."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo.extend(pair[0] if isinstance(pair, tuple) else pair for pair in failures.values())
        todo.extend((current.__cause__, current.__context__))
    return seen
