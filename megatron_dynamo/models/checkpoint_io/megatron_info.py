"""The self-description of a Megatron model checkpoint directory::

    <dir>/megatron_dynamo.json   format, format_version, dtype, model_type, saved_with (tp/pp), source, created
    <dir>/hf/config.json         the HF config the model was built from (+ generation/tokenizer files if any)
    <dir>/model/                 megatron.core.dist_checkpointing (torch_dist) of the model's sharded_state_dict
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from megatron_dynamo.models.checkpoint_io.formats import (CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION, CHECKPOINT_HF_DIR,
                                                          CHECKPOINT_META_FILE, CHECKPOINT_MODEL_DIR, DTYPE_NAMES,
                                                          GENERATION_CONFIG_NAME, TOKENIZER_FILES, CheckpointError,
                                                          read_hf_config)
from megatron_dynamo.models.qwen import QwenArchitecture, parse_qwen_config


@dataclass(frozen=True)
class CheckpointInfo:
    """What a model checkpoint directory says about itself."""

    directory: Path
    meta: dict[str, Any]
    hf_config: dict[str, Any]
    arch: QwenArchitecture

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    @property
    def model_dir(self) -> Path:
        return self.directory / CHECKPOINT_MODEL_DIR

    @property
    def hf_dir(self) -> Path:
        return self.directory / CHECKPOINT_HF_DIR


def is_model_checkpoint(directory: str | os.PathLike) -> bool:
    return (Path(directory) / CHECKPOINT_META_FILE).is_file()


def read_checkpoint_info(directory: str | os.PathLike) -> CheckpointInfo:
    """Read and check ``megatron_dynamo.json`` and ``hf/config.json`` of a model checkpoint directory."""
    directory = Path(directory)
    meta_path = directory / CHECKPOINT_META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{directory}: not a megatron_dynamo model checkpoint (no {CHECKPOINT_META_FILE})")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        meta = meta if isinstance(meta, dict) else {}
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
    if meta.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format_version {meta.get('format_version')} is not supported "
                              f"(this code reads version {CHECKPOINT_FORMAT_VERSION})")
    if meta.get("dtype") not in DTYPE_NAMES:
        raise CheckpointError(f"{meta_path}: dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPE_NAMES)}")
    if not (directory / CHECKPOINT_MODEL_DIR / "metadata.json").is_file():
        raise CheckpointError(f"{directory / CHECKPOINT_MODEL_DIR}: no distributed checkpoint (metadata.json missing)")
    hf_config = read_hf_config(directory / CHECKPOINT_HF_DIR)
    return CheckpointInfo(directory, meta, hf_config, parse_qwen_config(hf_config))


def write_checkpoint_info(directory: str | os.PathLike, hf_config: dict[str, Any], dtype: str,
                          source: dict[str, Any], saved_with: dict[str, Any],
                          hf_files_from: Iterable[str | os.PathLike] = ()) -> None:
    """Write ``megatron_dynamo.json`` and ``hf/`` (config.json verbatim, plus generation config and tokenizer
    files found in ``hf_files_from`` directories, so that megatron-to-hf can restore them)."""
    from importlib import metadata

    directory = Path(directory)
    arch = parse_qwen_config(hf_config)
    (directory / CHECKPOINT_HF_DIR).mkdir(parents=True, exist_ok=True)
    with open(directory / CHECKPOINT_HF_DIR / "config.json", "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
        f.write("\n")
    for source_dir in hf_files_from:
        for file in (GENERATION_CONFIG_NAME, *TOKENIZER_FILES):
            if (Path(source_dir) / file).is_file():
                shutil.copyfile(Path(source_dir) / file, directory / CHECKPOINT_HF_DIR / file)
    meta = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "dtype": dtype,
        "model_type": arch.model_type,
        "saved_with": saved_with,
        "source": source,
        "megatron_core": _package_version("megatron-core", metadata),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with open(directory / CHECKPOINT_META_FILE, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")


def _package_version(name: str, metadata) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"

