"""Training checkpoints: model and optimizer (Megatron dist_checkpointing), prompt history, data position, RNG
states and step, written atomically; keep the last K; find the latest for ``--resume``.

Layout of ``<checkpoints>/step_000040``::

    megatron_dynamo.json, hf/, model/    the model checkpoint format of ``models/checkpoint_io/`` (so
                                         ``python -m checkpoints_convert megatron-to-hf`` reads it directly)
    optimizer/                           dist_checkpointing of the optimizer's sharded state dict
    trainer_state.json                   step, prompt history, sampler position, RNG states, config
    in_flight.safetensors                rollout batches generated ahead of training and not yet trained on
                                         (``rollout.max_staleness`` > 0; ``trainer/overlap.py``)
    manifest.json                        size and SHA-256 of every other file (``checkpoint_manifest.py``)

Atomicity: every rank writes into ``step_000040.tmp``; rank 0 writes ``trainer_state.json``; every rank hashes the
files it wrote, rank 0 merges them into ``manifest.json``, fsyncs the tree and renames the directory to
``step_000040``, then rewrites ``latest`` (a one-line file, replaced with ``os.replace``). A crash or a full disk
mid-save leaves only a ``.tmp`` directory, which is ignored and removed by the next save, so the previous checkpoint
stays the latest and loadable. ``--resume`` loads the newest checkpoint that matches its manifest
(:func:`resume_checkpoint`); a damaged one it skipped is replaced when its step is saved again.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynamo.models.checkpoint_io import (fsync_tree, load_model_checkpoint, model_sharded_state_dict,
                                                   save_model_checkpoint, write_checkpoint_info)
from megatron_dynamo.models.checkpoint_dirs import (LATEST, STATE_FILE, STEP_DIR, latest_checkpoint,  # noqa: F401
                                                     list_checkpoints, step_dir_name)
from megatron_dynamo.parallel.runtime import collective_device
from megatron_dynamo.trainer.checkpoint_manifest import (MANIFEST_FILE, check_files, hash_files, owned_files,
                                                         read_manifest, write_manifest)



class CheckpointSaveError(RuntimeError):
    """Saving failed (e.g. disk full); the previous checkpoint is untouched."""


def _encode_tensor(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _decode_tensor(s: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(s)), weights_only=True)


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states (JSON-serialisable)."""
    np_state = np.random.get_state()
    return {"python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "torch": _encode_tensor(torch.get_rng_state())}


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decode_tensor(state["torch"]))


def save_checkpoint(root: str | os.PathLike, step: int, chunks, optimizer, trainer_state: dict[str, Any],
                    hf_config: dict[str, Any], dtype: str, keep_last: int, saved_with: dict[str, Any],
                    hf_files_from: Sequence[str | os.PathLike] = (), in_flight: Sequence = ()) -> Path:
    """Collective: save a complete checkpoint of ``step`` atomically, then prune to the last ``keep_last``.
    ``hf_files_from``: directories whose tokenizer / generation-config files go into the checkpoint's ``hf/``
    (so that ``dynamo eval`` and the converter turn it into a complete HF model on their own). ``in_flight``: the
    rollout batches generated ahead (``RolloutBatch``, the same on every rank; rank 0 writes them)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    rank = dist.get_rank()
    error = None
    try:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for leftover in root.glob("step_*.tmp"):
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir()
            write_checkpoint_info(tmp, hf_config, dtype, source={"kind": "training", "step": step},
                                  saved_with=saved_with, hf_files_from=hf_files_from)
    except OSError as exc:
        error = exc
    _raise_if_any_rank_failed(error, tmp, "preparing")
    try:
        save_model_checkpoint(chunks, tmp)
        (tmp / "optimizer").mkdir(exist_ok=True) if rank == 0 else None
        dist.barrier()
        sharded = optimizer.sharded_state_dict(model_sharded_state_dict(chunks))
        dist_checkpointing.save({"optimizer": sharded}, str(tmp / "optimizer"))
        if rank == 0:
            if in_flight:
                save_in_flight(tmp, in_flight)
            (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state, "manifest": MANIFEST_FILE,
                                                      "in_flight": [batch.step for batch in in_flight]}))
    except OSError as exc:
        error = exc
    _raise_if_any_rank_failed(error, tmp, "writing")
    entries = None
    try:  # every rank hashes the files it wrote (in threads); rank 0 merges them into the manifest
        entries = hash_files(tmp, owned_files(tmp, rank))
    except OSError as exc:
        error = exc
    _raise_if_any_rank_failed(error, tmp, "hashing")
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(entries, gathered, dst=0)
    try:
        if rank == 0:
            write_manifest(tmp, {rel: entry for part in gathered for rel, entry in part.items()})
            fsync_tree(tmp)
            if final.exists():  # a damaged checkpoint of this step that --resume skipped: this save replaces it
                shutil.rmtree(final)
            os.rename(tmp, final)
            pointer_tmp = root / (LATEST + ".tmp")
            pointer_tmp.write_text(final.name + "\n")
            os.replace(pointer_tmp, root / LATEST)
            for _, old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        error = exc
    _raise_if_any_rank_failed(error, tmp, "finalising")
    return final


def _raise_if_any_rank_failed(error: BaseException | None, tmp: Path, what: str) -> None:
    failed = torch.tensor([0 if error is None else 1], device=collective_device())
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        reason = f"{type(error).__name__}: {error}" if error is not None else "another rank failed"
        raise CheckpointSaveError(f"checkpoint not saved ({what} {tmp.name} failed: {reason}); "
                                  "the previous checkpoint is intact")


def load_checkpoint(path: str | os.PathLike, chunks, optimizer) -> dict[str, Any]:
    """Collective: load model and optimizer into this rank's objects; return the trainer state dict."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    load_model_checkpoint(chunks, path)
    if optimizer is not None:
        sharded = optimizer.sharded_state_dict(model_sharded_state_dict(chunks), is_loading=True)
        loaded = dist_checkpointing.load({"optimizer": sharded}, str(path / "optimizer"))
        optimizer.load_state_dict(loaded["optimizer"])
    return state


IN_FLIGHT_FILE = "in_flight.safetensors"


def save_in_flight(directory: Path, batches: Sequence) -> None:
    """The rollout batches in flight as one safetensors file (plain tensors: loading it runs no code)."""
    from safetensors.torch import save_file

    tensors = {f"{batch.step}/{name}": tensor.contiguous() for batch in batches
               for name, tensor in batch.to_tensors().items()}
    save_file(tensors, str(directory / IN_FLIGHT_FILE))


def load_in_flight(path: str | os.PathLike) -> list:
    """The rollout batches a checkpoint holds in flight, in step order (none for a colocated run's)."""
    from safetensors.torch import load_file

    from megatron_dynamo.rollout.rollout_batch import RolloutBatch

    file = Path(path) / IN_FLIGHT_FILE
    if not file.exists():
        return []
    by_step: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        step, name = key.split("/", 1)
        by_step.setdefault(int(step), {})[name] = tensor
    return [RolloutBatch.from_tensors(by_step[step]) for step in sorted(by_step)]


NO_INTACT_CHECKPOINT = "--resume: no intact checkpoint"


class NoIntactCheckpoint(RuntimeError):
    """``--resume`` found checkpoints, but every one is damaged or incomplete (the message names each problem)."""


def _checkpoint_problem(path: Path, rank: int, world_size: int) -> tuple[str | None, bool]:
    """(what is wrong with this rank's share of the checkpoint at ``path`` or None, saved before manifests)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"{STATE_FILE} is missing (an incomplete save)", False
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE} is unreadable ({type(exc).__name__})", False
    if not isinstance(state, dict) or "step" not in state:
        return f"{STATE_FILE} holds no step", False
    if "manifest" not in state:  # saved before checksums existed: nothing to check it against
        return None, True
    try:
        entries = read_manifest(path)
    except ValueError as exc:
        return str(exc), False
    return check_files(path, entries, rank, world_size), False


def resume_checkpoint(root: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """Collective: the newest intact checkpoint under ``root`` for ``--resume``, and the console lines to print
    (one per damaged checkpoint skipped, per ``.tmp`` leftover ignored, or for an unverified old checkpoint).

    Every rank checks its own files of a candidate (sizes, then SHA-256 against ``manifest.json``) in parallel;
    the ranks agree on the first problem found. A checkpoint without ``manifest.json`` whose ``trainer_state.json``
    does not name one was saved before manifests existed: it is loaded with a line saying it is unverified.
    (None, lines) when there is no checkpoint at all; :class:`NoIntactCheckpoint` when all are damaged."""
    root = Path(root)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    lines = [f"--resume: ignoring {tmp}, the leftover of an interrupted save (the next save removes it)"
             for tmp in sorted(root.glob("step_*.tmp"))] if root.is_dir() else []
    candidates = sorted(((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))),
                        reverse=True) if root.is_dir() else []
    damaged = []
    for _, path in candidates:
        problem, unverified = _checkpoint_problem(path, rank, world_size)
        problems = [None] * world_size
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
        if problem is None:
            if unverified:
                lines.append(f"--resume: {path} has no {MANIFEST_FILE} (saved before checkpoints carried "
                             "checksums): loading it unverified")
            return path, lines
        lines.append(f"--resume: skipping damaged checkpoint {path}: {problem}")
        damaged.append(f"{path.name}: {problem}")
    if candidates:
        raise NoIntactCheckpoint(f"{NO_INTACT_CHECKPOINT} under {root} ({'; '.join(damaged)}); start a new run "
                                 "without --resume in another trainer.output_dir, or restore a checkpoint")
    return None, lines
