"""Reading HF safetensors checkpoints lazily, by tensor name.

- :class:`HFCheckpointReader`: a safetensors checkpoint (one ``model.safetensors``, a sharded
  ``model.safetensors.index.json``, or loose ``*.safetensors``) read lazily by tensor name. Names, shapes and dtypes
  come from the file headers without touching tensor data; ``get(name)`` opens the file with ``safe_open`` for
  that one tensor, so pages of the memory map are released as soon as the caller drops the tensor (holding one
  map open for the whole conversion would keep every touched page resident).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_dynamo.models.checkpoint_io.formats import (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, SAFETENSORS_DTYPES,
                                                          CheckpointError)


def read_safetensors_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets; plus __metadata__)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (length,) = struct.unpack("<Q", raw)
            if length > 100 * 2**20 or length > os.path.getsize(path):
                raise CheckpointError(f"{path}: corrupt safetensors header length {length}")
            return json.loads(f.read(length))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


class HFCheckpointReader:
    """Lazy, by-name access to the tensors of an HF safetensors checkpoint directory."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        index_path = self.directory / SAFE_WEIGHTS_INDEX_NAME
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from None
            files = sorted(set(weight_map.values()))
        elif (self.directory / SAFE_WEIGHTS_NAME).exists():
            weight_map, files = None, [SAFE_WEIGHTS_NAME]
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
            weight_map = None
            if not files:
                bins = sorted(p.name for p in self.directory.glob("*.bin"))
                hint = f" (found {', '.join(bins[:3])}: convert PyTorch .bin weights to safetensors first)" if bins else ""
                raise CheckpointError(f"{self.directory}: no {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME} or "
                                      f"*.safetensors files{hint}")
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            header = read_safetensors_header(self.directory / file)
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if name in self.tensors:
                    raise CheckpointError(f"tensor '{name}' appears in both {self.tensors[name].file} and {file}")
                dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
                if dtype is None:
                    raise CheckpointError(f"{file}: tensor '{name}' has unsupported dtype {entry.get('dtype')!r}")
                self.tensors[name] = TensorInfo(file, dtype, tuple(entry["shape"]))
        if weight_map is not None:
            for name, file in weight_map.items():
                if name not in self.tensors:
                    raise CheckpointError(f"{SAFE_WEIGHTS_INDEX_NAME} lists tensor '{name}' in {file}, "
                                          "which does not hold it")
                if self.tensors[name].file != file:
                    raise CheckpointError(f"{SAFE_WEIGHTS_INDEX_NAME} puts tensor '{name}' in {file}, "
                                          f"but it is in {self.tensors[name].file}")
        self.files = files

    def names(self) -> list[str]:
        return list(self.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}

    def dtypes(self) -> set[torch.dtype]:
        return {info.dtype for info in self.tensors.values()}

    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read one tensor (``KeyError`` if absent). The result may be backed by the file's memory map until it
        is dropped; ``dtype`` casts it (a copy)."""
        from safetensors import safe_open

        info = self.tensors[name]
        with safe_open(str(self.directory / info.file), framework="pt") as f:
            tensor = f.get_tensor(name)
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    __getitem__ = get

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (along dim 0) of one tensor, reading only those bytes of the file."""
        from safetensors import safe_open

        info = self.tensors[name]
        if not 0 <= start <= stop <= (info.shape[0] if info.shape else 1):
            raise CheckpointError(f"{name}: rows {start}:{stop} out of range for shape {info.shape}")
        with safe_open(str(self.directory / info.file), framework="pt") as f:
            return f.get_slice(name)[start:stop]

