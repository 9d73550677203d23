"""Checkpoints that prove themselves: a manifest (``manifest.json``) with the size and SHA-256 of every file of a
checkpoint, written before the checkpoint's atomic rename, and checked before ``--resume`` loads anything.

Ownership: a rank hashes the files it wrote (``__<rank>_<n>.distcp`` of Megatron's dist_checkpointing), rank 0
the shared ones (``.metadata``, ``common.pt``, ``megatron_dynamo.json``, ``hf/``, ``trainer_state.json``). On
verification the file saved by rank ``r`` is read by rank ``r % world_size``, so the ranks read in parallel, each
(on a cluster) from its own node's view of the files. Hashing runs in threads (hashlib releases the GIL).

Entries are relative paths inside the checkpoint (no absolute path, no ``..``, no symlink out of it), and the
checkpoint holds no file the manifest does not list. With a key (``signing.py``) the manifest is signed.

SHA-256, not BLAKE2b: measured on this project's CPU machine (SHA extensions) 380 MB/s against 170 MB/s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from megatron_dynamo.models.checkpoint_io.signing import SigningKey

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
ALGORITHM = "sha256"
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_CHUNK = 8 * 2**20


def file_owner(relative: str) -> int:
    """The rank that writes ``relative`` (a path inside the checkpoint): the N of ``__N_k.distcp``, else 0."""
    match = _RANK_FILE.match(os.path.basename(relative))
    return int(match.group(1)) if match else 0


def hash_file(path: str | os.PathLike) -> tuple[int, str]:
    """(size, hex digest) of one file, read in 8 MiB chunks."""
    digest = hashlib.new(ALGORITHM)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _threads(n_files: int) -> int:
    return max(1, min(n_files, len(os.sched_getaffinity(0)), 8))


def hash_files(root: str | os.PathLike, relatives: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{relative: {"size", "sha256", "rank"}}`` for files under ``root``, hashed in parallel threads."""
    root = Path(root)
    relatives = sorted(relatives)
    with ThreadPoolExecutor(_threads(len(relatives))) as pool:
        results = list(pool.map(lambda rel: hash_file(root / rel), relatives))
    return {rel: {"size": size, ALGORITHM: digest, "rank": file_owner(rel)}
            for rel, (size, digest) in zip(relatives, results)}


def owned_files(root: str | os.PathLike, rank: int) -> list[str]:
    """Files under ``root`` (relative paths) that ``rank`` wrote and hashes on save."""
    root = Path(root)
    found = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel != MANIFEST_FILE and file_owner(rel) == rank:
                found.append(rel)
    return found


@dataclass(frozen=True)
class Manifest:
    files: dict[str, dict[str, Any]]
    signature: dict[str, str] | None

    @property
    def body(self) -> dict[str, Any]:
        """What a signature covers: everything but the signature."""
        return {"format": MANIFEST_FORMAT, "algorithm": ALGORITHM, "files": self.files}


def write_manifest(root: str | os.PathLike, entries: dict[str, dict[str, Any]],
                   key: SigningKey | None = None) -> None:
    """Write ``manifest.json`` (the merged entries of every rank) into ``root``, signed with ``key`` if given."""
    manifest = Manifest(dict(sorted(entries.items())), None)
    body = manifest.body
    if key is not None:
        body["signature"] = key.sign(manifest.body)
    Path(root, MANIFEST_FILE).write_text(json.dumps(body, indent=1) + "\n")


def confined(relative: Any) -> bool:
    """Whether a manifest entry names a path inside its checkpoint: relative, normalised, no ``..``."""
    return (isinstance(relative, str) and relative != "" and not os.path.isabs(relative) and "\\" not in relative
            and os.path.normpath(relative) == relative and ".." not in relative.split("/")
            and relative != MANIFEST_FILE)


def _entry_problem(relative: Any, entry: Any) -> str | None:
    if not confined(relative):
        return f"names {relative!r}, not a path inside the checkpoint"
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or entry["size"] < 0 \
            or not re.fullmatch(r"[0-9a-f]{64}", str(entry.get(ALGORITHM, ""))) \
            or not isinstance(entry.get("rank", 0), int) or entry.get("rank", 0) < 0:
        return f"has a malformed entry for {relative}"
    return None


def load_manifest(root: str | os.PathLike) -> Manifest:
    """The manifest of ``root``, every entry checked (:func:`confined`, size, checksum). Raises ValueError (one
    line) if it is missing, unreadable or names a path outside the checkpoint."""
    path = Path(root, MANIFEST_FILE)
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown manifest algorithm {manifest.get('algorithm')!r}")
    except FileNotFoundError:
        raise ValueError(f"{MANIFEST_FILE} is missing") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{MANIFEST_FILE} is unreadable ({type(exc).__name__}: {exc})") from None
    for relative, entry in files.items():
        problem = _entry_problem(relative, entry)
        if problem:
            raise ValueError(f"{MANIFEST_FILE} {problem}")
    return Manifest(files, manifest.get("signature"))


def read_manifest(root: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The manifest's file entries (:func:`load_manifest`)."""
    return load_manifest(root).files


def unlisted_file(root: str | os.PathLike, entries: dict[str, dict[str, Any]]) -> str | None:
    """A file (or symlink, or special file) under ``root`` that the manifest does not list, as a phrase, or None.
    Every file a loader may read is listed, so nothing outside the checksums (or the signature) is read."""
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            relative = path.relative_to(root).as_posix()
            if path.is_symlink():
                return f"{relative} is a symbolic link (a checkpoint holds plain files only)"
            if name in filenames and relative not in entries and relative != MANIFEST_FILE:
                return f"{relative} is not listed in {MANIFEST_FILE} (added after the save)"
    return None


def check_files(root: str | os.PathLike, entries: dict[str, dict[str, Any]], rank: int = 0,
                world_size: int = 1) -> str | None:
    """Check this rank's share of ``entries`` (saved by rank r: checked by rank ``r % world_size``) against the
    files under ``root``: presence and size first (cheap), then the checksums in threads. The first problem as
    a phrase (``"model/__0_1.distcp: 812 bytes, the manifest says 4096"``), or None if all match."""
    root = Path(root)
    inside = root.resolve()
    mine = sorted(rel for rel, entry in entries.items() if int(entry.get("rank", 0)) % world_size == rank)
    for rel in mine:
        path = root / rel
        if not confined(rel) or path.is_symlink() or not path.resolve().is_relative_to(inside):
            return f"{rel} is not a file inside the checkpoint (a symbolic link or a path out of it)"
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != entries[rel]["size"]:
            return f"{rel} has {size} bytes, the manifest says {entries[rel]['size']} (truncated or overwritten)"
    if not mine:
        return None
    with ThreadPoolExecutor(_threads(len(mine))) as pool:
        digests = list(pool.map(lambda rel: hash_file(root / rel)[1], mine))
    for rel, digest in zip(mine, digests):
        if digest != entries[rel][ALGORITHM]:
            return f"{rel} does not match its {ALGORITHM} checksum (its bytes changed since the save)"
    return None
