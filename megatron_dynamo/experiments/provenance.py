"""Where a run's numbers come from: the machine it ran on and the warm-up checkpoint it started from.

Another CPU model or torch build runs other floating-point kernels, so the same command gives other numbers there:
results are bit-identical on one machine only. The raw data (``experiments/raw_data.py``) therefore names both
for every run, an experiment that moves to another machine reruns the unfinished seeds there (a seed is never split
across machines), and ``dynamo confirm`` refuses a seed whose runs span two machines or two warm-ups
(:func:`seed_groups`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from importlib import metadata
from typing import Any, Iterable, Mapping

#: What a seed's runs must share: (machine, warm-up hash).
Group = tuple[str, str]


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


def machine_id() -> str:
    """``"<CPU model>, <N> cores, torch <version>"``: what decides the floating-point kernels of a CPU run."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    cores = os.cpu_count() or 1
    return f"{cpu_model()}, {cores} core{'s' if cores != 1 else ''}, torch {torch_version}"


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


def group_of(row: Mapping[str, Any]) -> Group:
    """A raw-data row's (machine, warm-up); empty strings where an older file did not record them."""
    return str(row.get("machine") or ""), str(row.get("warmup") or "")


def seed_groups(rows: Iterable[Mapping[str, Any]]) -> dict[int, dict[Group, int]]:
    """Per seed, how many of its runs (the warm-up rows aside) ran in each (machine, warm-up)."""
    out: dict[int, dict[Group, int]] = {}
    for row in rows:
        if row.get("variant") == "sft":
            continue
        counts = out.setdefault(int(row["seed"]), {})
        counts[group_of(row)] = counts.get(group_of(row), 0) + 1
    return out


def check_one_group_per_seed(rows: Iterable[Mapping[str, Any]]) -> None:
    """ValueError (one line) for the first seed whose runs span two machines or two warm-ups."""
    for seed, groups in sorted(seed_groups(rows).items()):
        if len(groups) < 2:
            continue
        machines = {machine for machine, _ in groups}
        what = "two machines" if len(machines) > 1 else "two warm-ups"
        parts = "; ".join(f"{n} run(s) on {machine or 'an unrecorded machine'} from warm-up {warmup or '?'}"
                          for (machine, warmup), n in sorted(groups.items()))
        raise ValueError(f"seed {seed}'s runs span {what} ({parts}): its runs are paired, so rerun the seed on one "
                         "machine (dynamo ablate --raw-data reruns it where it resumes)")


__all__ = ["Group", "check_one_group_per_seed", "checkpoint_hash", "cpu_model", "group_of", "machine_id",
           "seed_groups"]
