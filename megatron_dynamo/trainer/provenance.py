"""What a run records of where its numbers come from: the machine it ran on and the warm-up checkpoint it started
from (``provenance.json`` in its output directory).

Another CPU model, torch build or kernel library runs other floating-point kernels, so the same command gives other
numbers there: results are bit-identical on one machine only. Every run therefore records both itself, as it starts
(:func:`write_run_provenance`, one entry per start, so a resumed run lists each machine it ran on), and a warm-up run
adds the hash of the checkpoint it saved (:func:`write_saved_warmup`). The experiments' raw data copies them from
there (:func:`recorded_provenance`; ``experiments/raw_data.py``) and never infers them.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import platform
import re
import subprocess
import warnings
from importlib import metadata
from typing import Any, Mapping

def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model name", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def kernel_libraries() -> str:
    """The kernel libraries torch dispatches to here, as torch's build reports them: MKL's and oneDNN's versions and
    the CPU capability it uses (``AVX2``, ``AVX512``...); "" without torch."""
    try:
        import torch  # here, not at the top: dynamo confirm reads this module and never needs torch (~1.5 s)
    except ImportError:
        return ""
    build = torch.__config__.show()
    parts = []
    for label, pattern in (("MKL", r"Math Kernel Library Version ([\d.]+)"), ("oneDNN", r"(?:MKL-DNN|oneDNN) v(\S+)")):
        found = re.search(pattern, build)
        if found:
            parts.append(f"{label} {found.group(1)}")
    parts.append(torch.backends.cpu.get_cpu_capability())
    return ", ".join(parts)


def machine_id() -> str:
    """``"<CPU model>, <N> cores, torch <version>, MKL <v>, oneDNN <v>, <capability>"``: what decides the
    floating-point kernels of a CPU run."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    cores = os.cpu_count() or 1
    libraries = kernel_libraries()
    return (f"{cpu_model()}, {cores} core{'s' if cores != 1 else ''}, torch {torch_version}"
            + (f", {libraries}" if libraries else ""))


def code_version() -> str:
    """The commit of this project's checkout that runs (``+ changes`` when its tracked files differ from it), or ""
    outside a git checkout: the same machine gives other numbers with other code (a kernel's summation order)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", root, "diff", "--quiet", "HEAD", "--", "."], timeout=30).returncode
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return commit.stdout.strip() + (" + changes" if dirty else "")


#: In a run's output directory: what the run recorded of where it ran (:func:`write_run_provenance`).
PROVENANCE_FILE = "provenance.json"


def read_run_provenance(output_dir: str | os.PathLike) -> dict[str, Any]:
    """What a run recorded in ``provenance.json`` ({"starts": [...], "saved_warmup": ...}), or {} without one."""
    try:
        with open(os.path.join(output_dir, PROVENANCE_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_provenance(output_dir: str | os.PathLike, record: Mapping[str, Any]) -> None:
    path = os.path.join(output_dir, PROVENANCE_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


#: A start checkpoint's weights are hashed up to this size; a larger one (a cluster model) is named by its path: the
#: hash would read every weight once more on rank 0 before the first step.
HASHED_START_BYTES = 2 << 30


def _start_hash(checkpoint: str | os.PathLike | None) -> str:
    if not checkpoint or not os.path.isdir(checkpoint):
        return ""  # random weights (or a hub id the launcher resolved elsewhere)
    model = os.path.join(checkpoint, "model")
    hashed = model if os.path.isfile(os.path.join(model, ".metadata")) else checkpoint  # what checkpoint_hash reads
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(hashed) for f in files)
    return checkpoint_hash(checkpoint) if size <= HASHED_START_BYTES else f"path {os.path.abspath(checkpoint)}"


def write_run_provenance(output_dir: str | os.PathLike, start_checkpoint: str | os.PathLike | None,
                         resumed: bool = False) -> dict[str, Any]:
    """Append this start of a run to its ``provenance.json``: the machine (:func:`machine_id`), when, whether it
    resumes, and the hash of the checkpoint it starts from (``model.checkpoint``: the warm-up; "" for none, its path
    above :data:`HASHED_START_BYTES`). Called by the run itself (rank 0) before its first step; returns the
    record."""
    record = read_run_provenance(output_dir)
    start = {"machine": machine_id(), "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
             "resumed": resumed, "warmup": _start_hash(start_checkpoint), "code": code_version()}
    record["starts"] = [*record.get("starts", []), start]
    _write_provenance(output_dir, record)
    return record


def write_saved_warmup(output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> None:
    """A warm-up run (no RL steps) records the hash of the checkpoint it saved: the start of every run after it."""
    record = read_run_provenance(output_dir)
    record["saved_warmup"] = checkpoint_hash(checkpoint)
    _write_provenance(output_dir, record)


def recorded_provenance(output_dir: str | os.PathLike, warmup_run: bool) -> tuple[str, str]:
    """(machine, warm-up) as the run in ``output_dir`` recorded them: its machine (machines in start order, joined by
    " then " where a resume moved it), and the hash of the warm-up it started from (``warmup_run``: the one it
    saved). Empty strings where it recorded nothing (a run of an older version): copied, never inferred."""
    record = read_run_provenance(output_dir)
    starts = [s for s in record.get("starts", []) if isinstance(s, dict)]
    machines = list(dict.fromkeys(str(s.get("machine") or "") for s in starts))
    warmup = record.get("saved_warmup", "") if warmup_run else (starts[0].get("warmup", "") if starts else "")
    return " then ".join(m for m in machines if m), str(warmup or "")


def checkpoint_hash(path: str | os.PathLike) -> str:
    """SHA-256 (first 16 hex digits) of a checkpoint's model weights: every tensor of its Megatron ``model/``
    (torch_dist) by name, dtype, shape and bytes, so the same weights give the same hash whatever the files'
    metadata (torch's writer stamps each save with a random id and its path). A checkpoint without one: every file,
    by relative path and content. The optimizer and the trainer's state are left out: two warm-ups with the same
    weights start every run identically."""
    model = os.path.join(path, "model")
    metadata = os.path.join(model, ".metadata")
    if os.path.isfile(metadata):
        # torch rewrites .metadata with every save: its modification time names the save, so one load and hash
        # serves every run of an ablation that starts from the same warm-up (it asks once per run)
        return _weights_hash(os.path.realpath(model), os.stat(metadata).st_mtime_ns)
    digest = hashlib.sha256()
    for directory, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(directory, name)
            digest.update(os.path.relpath(full, path).encode("utf-8") + b"\0")
            with open(full, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=64)
def _weights_hash(model_dir: str, metadata_mtime_ns: int) -> str:
    digest = hashlib.sha256()
    for header, data in _model_tensors(model_dir):
        digest.update(header.encode("utf-8"))
        digest.update(data)
    return digest.hexdigest()[:16]


def _model_tensors(model_dir: str) -> list[tuple[str, bytes]]:
    """("name, dtype, shape" header, raw bytes) of every tensor of a torch_dist checkpoint directory, by name, loaded
    without a process group."""
    # torch here, not at the top: dynamo confirm reads this module and never needs torch (~1.5 s)
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "no process group: loading in a single process" is what we mean
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(storage_reader=FileSystemReader(model_dir))
    return [(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0", t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for name, t in sorted(state.items()) if isinstance(t, torch.Tensor)]


__all__ = ["HASHED_START_BYTES", "PROVENANCE_FILE", "checkpoint_hash", "code_version", "cpu_model", "kernel_libraries", "machine_id",
           "read_run_provenance", "recorded_provenance", "write_run_provenance", "write_saved_warmup"]
