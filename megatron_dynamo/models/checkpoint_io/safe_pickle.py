"""Loading a checkpoint never runs code from it: every pickle in a Megatron distributed checkpoint is read with an
allow-list of the classes it is made of, and any other global is refused, naming it.

Where torch and Megatron unpickle (megatron-core 0.16, torch 2.13) and what this module puts in their place:

- ``<dir>/.metadata``: torch DCP's ``FileSystemReader.read_metadata`` calls plain ``pickle.load``. Here:
  :class:`MetadataUnpickler`, which admits only DCP's metadata dataclasses (:data:`METADATA_CLASSES`), torch dtypes
  and ``torch.Size``; its storage entries must name files of the directory itself (no ``/``, no ``..``).
- byte items inside ``__<rank>_<n>.distcp`` (the model's ``_extra_state``, Megatron's ``ShardedObject``\\ s): torch
  DCP's ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)``. Here: ``torch.load`` with
  ``weights_only=True`` (tensors, containers, numbers, strings), then torch's own placement of the result. A
  non-empty ``uint8`` extra state (Transformer Engine pickles its FP8 state into one and ``pickle.loads`` it in
  ``set_extra_state``) is read with :class:`ExtraStateUnpickler` first.
- ``common.pt``: Megatron's ``TorchCommonLoadStrategy.load_common`` calls ``torch.load`` without ``weights_only``
  (so ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` makes it unsafe). Here: ``weights_only=True``, always.

:func:`install` makes those three replacements in this process (idempotent; every loader of this package calls it
before it reads a checkpoint). A refused pickle raises :class:`UnsafeCheckpointError`, one line naming the file and
the global. :mod:`.pickle_scan` uses the same readers to check a whole checkpoint before anything is loaded.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pickle
import re
import threading
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch

from megatron_dynamo.models.checkpoint_io.formats import CheckpointError, exception_chain


class UnsafeCheckpointError(CheckpointError):
    """A pickle of a checkpoint names a global outside the allow-list (code, not data), or is not a pickle at all."""


# What torch DCP's metadata is made of (module -> names). Megatron's two dummy classes load mcore 0.15 checkpoints.
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "MetadataIndex", "ChunkStorageMetadata",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                             "LoadItemType"),
    "megatron.core.dist_checkpointing.strategies.torch": ("MCoreMetadata", "MCoreSavePlan"),
    "torch": ("Size",),
    "collections": ("OrderedDict",),
}
# What Transformer Engine's pickled FP8 state holds besides those: tensors (pickled by torch's reducers) and its
# recipe dataclasses and enums.
EXTRA_STATE_CLASSES = {
    "torch._utils": ("_rebuild_tensor_v2",),
    "torch": ("Size",),
    "collections": ("OrderedDict",),
}
EXTRA_STATE_MODULES = ("transformer_engine.common.recipe",)


def _layout_by_name(name: str) -> torch.layout:
    """``torch.serialization._get_layout`` (how torch pickles a layout), limited to returning a layout."""
    value = getattr(torch, str(name).rpartition(".")[2], None)
    if not isinstance(value, torch.layout):
        raise UnsafeCheckpointError(f"unknown torch layout {name!r}")
    return value


def _storage_from_bytes(data: bytes):
    """``torch.storage._load_from_bytes`` (how ``pickle`` stores a tensor's storage), with ``weights_only=True``
    (on the CPU: only checked here; Transformer Engine itself loads it later)."""
    return load_torch_bytes(data, "a pickled tensor storage", map_location="cpu")


SUBSTITUTES = {("torch.serialization", "_get_layout"): _layout_by_name,
               ("torch.storage", "_load_from_bytes"): _storage_from_bytes}


class _AllowListUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of ``allowed`` (module -> names), torch dtypes and
    :data:`SUBSTITUTES`; anything else raises :class:`UnsafeCheckpointError` naming it and ``source``."""

    allowed: dict[str, tuple[str, ...]] = {}
    allowed_modules: tuple[str, ...] = ()

    def __init__(self, file: BinaryIO, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SUBSTITUTES:
            return SUBSTITUTES[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in self.allowed.get(module, ()) or (module in self.allowed_modules and "." not in name):
            value = getattr(importlib.import_module(module), name)
            if module not in self.allowed_modules or isinstance(value, type):
                return value
        raise UnsafeCheckpointError(f"{self.source}: refused to unpickle {module}.{name}: not one of the classes "
                                    "this file is made of (loading it could run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.source}: refused a pickle persistent id (not part of this format)")


class MetadataUnpickler(_AllowListUnpickler):
    allowed = METADATA_CLASSES


class ExtraStateUnpickler(_AllowListUnpickler):
    allowed = EXTRA_STATE_CLASSES
    allowed_modules = EXTRA_STATE_MODULES


def _unpickle(unpickler: type[_AllowListUnpickler], file: BinaryIO, source: str) -> Any:
    try:
        return unpickler(file, source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # a truncated or garbled pickle: damage, said in one line
        raise UnsafeCheckpointError(f"{source}: not a readable pickle ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def load_dcp_metadata(file: BinaryIO, source: str | None = None):
    """The torch DCP ``Metadata`` pickled in ``file`` (a ``.metadata`` file), read with :class:`MetadataUnpickler`;
    every storage entry must name a file of the same directory."""
    from torch.distributed.checkpoint.metadata import Metadata

    source = source or str(getattr(file, "name", ".metadata"))
    metadata = _unpickle(MetadataUnpickler, file, source)
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source}: holds a {type(metadata).__name__}, not torch DCP metadata")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name \
                or "\\" in name:
            raise UnsafeCheckpointError(f"{source}: a storage entry names {name!r}, not a file of its directory")
    return metadata


_UNSUPPORTED_GLOBAL = re.compile(r"(?:GLOBAL|global) ([\w.]+)")


def load_torch_bytes(data: bytes | BinaryIO, source: str, map_location: str | None = None) -> Any:
    """``torch.load(weights_only=True)`` of ``data`` (a ``torch.save`` archive), tensors placed where they were
    saved (as torch DCP's own reader does) unless ``map_location`` says otherwise; a refused global or a garbled
    archive raises :class:`UnsafeCheckpointError` in one line naming ``source``."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return torch.load(stream, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _UNSUPPORTED_GLOBAL.search(str(exc))
        what = f"refused to unpickle {found.group(1)}" if found else "refused by torch's weights-only unpickler"
        raise UnsafeCheckpointError(f"{source}: {what}: not a tensor, container, number or string (loading it "
                                    "could run code)") from None
    except Exception as exc:
        raise UnsafeCheckpointError(f"{source}: not a readable torch archive ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def load_byte_item(data: bytes | BinaryIO, key: str, source: str, map_location: str | None = None) -> Any:
    """A DCP byte item (``key``: its state-dict key) with :func:`load_torch_bytes`. A non-empty ``uint8`` tensor
    under an ``_extra_state`` key is Transformer Engine's pickled FP8 state, which TE ``pickle.loads`` when the
    module loads it: its bytes must pass :class:`ExtraStateUnpickler` too."""
    value = load_torch_bytes(data, source, map_location)
    if "_extra_state" in key and isinstance(value, torch.Tensor) and value.dtype == torch.uint8 \
            and value.numel() > 0:
        _unpickle(ExtraStateUnpickler, io.BytesIO(value.detach().cpu().numpy().tobytes()), f"{source} (its bytes)")
    return value


def load_torch_file(path: str | os.PathLike) -> Any:
    """:func:`load_torch_bytes` of a file (``common.pt``), on the CPU as Megatron reads it."""
    with open(path, "rb") as f:
        return load_torch_bytes(f, str(path), map_location="cpu")


DIST_METADATA = "metadata.json"
BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}


def check_backend(directory: str | os.PathLike) -> None:
    """Raise UnsafeCheckpointError unless the distributed checkpoint's ``metadata.json`` names the torch_dist /
    torch backends (the ones whose unpickling :func:`install` restricts)."""
    path = Path(directory, DIST_METADATA)
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsafeCheckpointError(f"{path}: unreadable ({type(exc).__name__})") from None
    for key, wanted in BACKENDS.items():
        if not isinstance(found, dict) or found.get(key) != wanted:
            got = found.get(key) if isinstance(found, dict) else None
            raise UnsafeCheckpointError(f"{path}: {key} is {got!r}; only {wanted!r} checkpoints are read")


@contextlib.contextmanager
def reading_checkpoint(directory: str | os.PathLike) -> Iterator[None]:
    """Around a Megatron / torch DCP load of the distributed checkpoint ``directory``: :func:`install`, the backend
    check, and a refused pickle (which torch DCP wraps into a multi-line ``CheckpointException``) raised as the
    one-line :class:`UnsafeCheckpointError` it is."""
    install()
    check_backend(directory)
    with open(Path(directory, ".metadata"), "rb") as f:  # read here first: DCP re-raises its failure as text
        load_dcp_metadata(f)
    try:
        yield
    except BaseException as exc:
        refused = next((e for e in exception_chain(exc) if isinstance(e, UnsafeCheckpointError)), None)
        if refused is None or refused is exc:
            raise
        raise UnsafeCheckpointError(str(refused)) from None


class _RestrictedPickleModule:
    """What torch DCP's filesystem module sees as ``pickle``: ``load`` is :func:`load_dcp_metadata`, everything
    else (``dump`` of a save) is the real module."""

    load = staticmethod(load_dcp_metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Replace the three unpickling places listed in the module doc, once per process. Raises RuntimeError if
    torch or Megatron no longer has them where this module expects (a version this code was not written for)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from megatron.core.dist_checkpointing import core as megatron_core
        from megatron.core.dist_checkpointing.strategies import common as megatron_common
        from torch.distributed.checkpoint import default_planner, filesystem

        if getattr(filesystem, "pickle", None) is not pickle or not hasattr(default_planner.DefaultLoadPlanner,
                                                                            "load_bytes") \
                or not hasattr(megatron_common.TorchCommonLoadStrategy, "load_common"):
            raise RuntimeError("safe_pickle.install: torch DCP or Megatron changed where they unpickle; "
                               "update megatron_dynamo/models/checkpoint_io/safe_pickle.py")
        filesystem.pickle = _RestrictedPickleModule()
        torch_load_bytes = default_planner.DefaultLoadPlanner.load_bytes

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            # torch's own placement of the object (nested keys, flattening), given the archive of what the
            # weights-only load produced: the bytes it unpickles are ours, made from allow-listed values.
            fqn = read_item.dest_index.fqn
            checked = load_byte_item(value, fqn, f"byte item {fqn}")
            again = io.BytesIO()
            torch.save(checked, again)
            again.seek(0)
            return torch_load_bytes(self, read_item, again)

        def load_common(self, checkpoint_dir):
            path = os.path.join(checkpoint_dir, "common.pt")
            if not os.path.exists(path):
                raise megatron_core.CheckpointingException(f"Common file {path} does not exist")
            return load_torch_file(path)

        default_planner.DefaultLoadPlanner.load_bytes = load_bytes
        megatron_common.TorchCommonLoadStrategy.load_common = load_common
        _installed = True
