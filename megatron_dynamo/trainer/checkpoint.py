"""Training checkpoints: model and optimizer (Megatron dist_checkpointing), prompt history, data position, RNG
states and step, written atomically; keep the last K; find the latest for ``--resume``.

Layout of ``<checkpoints>/step_000040``::

    megatron_dynamo.json, hf/, model/    the model checkpoint format of ``models/checkpoint_io/`` (so
                                         ``python -m checkpoints_convert megatron-to-hf`` reads it directly)
    optimizer/                           dist_checkpointing of the optimizer's sharded state dict
    trainer_state.json                   step, prompt history, sampler position, RNG states, config
    in_flight.safetensors                rollout batches generated ahead of training and not yet trained on
                                         (``rollout.max_staleness`` > 0; ``trainer/overlap.py``)
    manifest.json                        size and SHA-256 of every other file, signed when a key is configured
                                         (``models/checkpoint_io/manifest.py``, ``signing.py``)

Atomicity: every rank writes into ``step_000040.tmp``; rank 0 writes ``trainer_state.json``; every rank hashes the
files it wrote, rank 0 merges them into ``manifest.json``, fsyncs the tree and renames the directory to
``step_000040``, then rewrites ``latest`` (a one-line file, replaced with ``os.replace``). A failed save (a full
disk, an unwritable directory) removes its ``.tmp`` directory and says why in one line; a crash mid-save leaves the
``.tmp``, which is ignored and removed by the next save. Either way the previous checkpoint stays the latest and
loadable. ``--resume`` loads the newest checkpoint that verifies (:func:`resume_checkpoint`); a damaged one it
skipped is replaced when its step is saved again.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynamo.models.checkpoint_io import (fsync_tree, load_model_checkpoint, model_sharded_state_dict,
                                                   save_model_checkpoint, write_checkpoint_info)
from megatron_dynamo.models.checkpoint_dirs import (LATEST, STATE_FILE, STEP_DIR, latest_checkpoint,  # noqa: F401
                                                     list_checkpoints, step_dir_name)
from megatron_dynamo.models.checkpoint_io.manifest import MANIFEST_FILE, hash_files, owned_files, write_manifest
from megatron_dynamo.models.checkpoint_io.safe_pickle import reading_checkpoint
from megatron_dynamo.models.checkpoint_io.signing import SigningKey, signing_key, trust_line
from megatron_dynamo.models.checkpoint_io.verify import checkpoint_problem
from megatron_dynamo.models.checkpoint_io.write_errors import write_exceptions, write_failure
from megatron_dynamo.parallel.runtime import collective_device
from megatron_dynamo.rollout.rollout_batch import RolloutBatch


class CheckpointSaveError(RuntimeError):
    """Saving failed (a full disk, an unwritable directory, ...); the previous checkpoint is untouched."""


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
    rollout batches generated ahead (``RolloutBatch``, the same on every rank; rank 0 writes them). The manifest is
    signed when a key is configured (``models/checkpoint_io/signing.py``). Any failure (a full disk, an
    unwritable directory, an exception of torch DCP) raises :class:`CheckpointSaveError`, one line naming the
    directory and the cause, after the partial ``.tmp`` is removed; ``latest`` still names the previous step."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    rank = dist.get_rank()
    phase = partial(_on_every_rank, root=root, tmp=tmp, step=step)
    key = phase(lambda: _start_directory(root, tmp, rank, step, hf_config, dtype, saved_with, hf_files_from))
    phase(lambda: _write_state(tmp, rank, step, chunks, optimizer, trainer_state, in_flight))
    # every rank hashes the files it wrote (in threads); rank 0 merges them into the manifest
    entries = phase(lambda: hash_files(tmp, owned_files(tmp, rank)))
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(entries, gathered, dst=0)
    phase(lambda: _publish(root, tmp, final, gathered, key, keep_last) if rank == 0 else None)
    return final


def _on_every_rank(write: Callable[[], Any], root: Path, tmp: Path, step: int) -> Any:
    """Collective: run this rank's part of a save phase; a failure on any rank is raised on every rank as one
    :class:`CheckpointSaveError` (``_raise_if_any_rank_failed``)."""
    result, error = None, None
    try:
        result = write()
    except write_exceptions() as exc:
        error = exc
    _raise_if_any_rank_failed(error, root, tmp, step)
    return result


def _start_directory(root: Path, tmp: Path, rank: int, step: int, hf_config: dict[str, Any], dtype: str,
                     saved_with: dict[str, Any], hf_files_from: Sequence[str | os.PathLike]) -> SigningKey | None:
    """Rank 0: the ``.tmp`` directory (leftovers of an interrupted save removed) with the checkpoint's info; the
    signing key (rank 0's; None elsewhere or without one)."""
    key = signing_key() if rank == 0 else None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob("step_*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir()
        write_checkpoint_info(tmp, hf_config, dtype, source={"kind": "training", "step": step},
                              saved_with=saved_with, hf_files_from=hf_files_from)
    return key


def _write_state(tmp: Path, rank: int, step: int, chunks, optimizer, trainer_state: dict[str, Any],
                 in_flight: Sequence) -> None:
    """The model and optimizer shards (every rank), the batches in flight and the trainer's state (rank 0)."""
    from megatron.core import dist_checkpointing

    save_model_checkpoint(chunks, tmp)
    (tmp / "optimizer").mkdir(exist_ok=True) if rank == 0 else None
    dist.barrier()
    sharded = optimizer.sharded_state_dict(model_sharded_state_dict(chunks), metadata=OPTIMIZER_METADATA)
    dist_checkpointing.save({"optimizer": sharded}, str(tmp / "optimizer"))
    if rank == 0:
        if in_flight:
            save_in_flight(tmp, in_flight)
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **trainer_state, "manifest": MANIFEST_FILE,
                                                  "in_flight": [batch.step for batch in in_flight]}))


def _publish(root: Path, tmp: Path, final: Path, gathered: list, key: SigningKey | None, keep_last: int) -> None:
    """Rank 0: the manifest, then ``tmp`` renamed to ``final`` and ``latest`` pointed at it; older checkpoints
    pruned to ``keep_last``."""
    write_manifest(tmp, {rel: entry for part in gathered for rel, entry in part.items()}, key)
    pointer_tmp = root / (LATEST + ".tmp")
    pointer_tmp.write_text(final.name + "\n")  # before the rename: nothing after it needs space
    fsync_tree(tmp)
    if final.exists():  # a damaged checkpoint of this step that --resume skipped: this save replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    os.replace(pointer_tmp, root / LATEST)
    for _, old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _raise_if_any_rank_failed(error: BaseException | None, root: Path, tmp: Path, step: int) -> None:
    """Collective: if any rank failed, every rank raises the same CheckpointSaveError (the first failed rank's
    cause), after rank 0 removed ``tmp`` (the cause is found first: a full disk is measured while it is full)."""
    failed = torch.tensor([0 if error is None else 1], device=collective_device())
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return
    causes: list = [None] * dist.get_world_size()
    dist.all_gather_object(causes, None if error is None else write_failure(error, tmp))
    rank, cause = next((r, c) for r, c in enumerate(causes) if c is not None)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (root / (LATEST + ".tmp")).unlink(missing_ok=True)
    dist.barrier()
    kept = list_checkpoints(root)
    still = (f"latest is still {kept[-1][1].name}" if kept else "no checkpoint of this run was saved before")
    on_rank = f" (rank {rank})" if dist.get_world_size() > 1 else ""
    raise CheckpointSaveError(f"checkpoint of step {step} not saved in {root}{on_rank}: {cause}; {tmp.name} "
                              f"removed, {still}")


def load_checkpoint(path: str | os.PathLike, chunks, optimizer) -> dict[str, Any]:
    """Collective: load model and optimizer into this rank's objects; return the trainer state dict."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = json.loads((path / STATE_FILE).read_text())
    load_model_checkpoint(chunks, path)
    if optimizer is not None:
        sharded = optimizer.sharded_state_dict(model_sharded_state_dict(chunks), is_loading=True,
                                               metadata=OPTIMIZER_METADATA)
        with reading_checkpoint(path / "optimizer"):
            loaded = dist_checkpointing.load({"optimizer": sharded}, str(path / "optimizer"))["optimizer"]
        if set(loaded) != set(sharded):  # saved at another expert-parallel size
            loaded = _in_this_chaining(optimizer, sharded, loaded)
        optimizer.load_state_dict(loaded)
    return state


# Megatron chains a second optimizer for the experts at expert parallel > 1 (one optimizer at 1) and by default
# prefixes each one's tensor keys with its place in the chain ("chained_1.optimizer.state.exp_avg...."). Without the
# prefix the keys are the parameters' own, the same at every expert-parallel size, so the state reshards. The
# distributed optimizer's format is its per-parameter one: megatron-core 0.16.1's default (fully_sharded_model_space)
# cannot be saved at all ("ShardedTensor.flattened_range is not supported").
OPTIMIZER_METADATA = {"chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": "fully_reshardable"}


def _torch_states(node):
    """The torch optimizer state dicts (``state`` and ``param_groups``) inside a Megatron optimizer's state dict."""
    if isinstance(node, dict):
        if "state" in node and "param_groups" in node:
            yield node
        else:
            for value in node.values():
                yield from _torch_states(value)


def _saved_steps(node):
    """Every ``common_step`` (Megatron's one step of all parameters' Adam states) inside a loaded state dict."""
    if isinstance(node, dict):
        if "common_step" in node:
            yield node["common_step"]
        for value in node.values():
            yield from _saved_steps(value)


def _in_this_chaining(optimizer, sharded, loaded):
    """The optimizer state of a checkpoint saved at another expert-parallel size, for this optimizer: dist
    checkpointing loaded every state tensor into this optimizer's structure (``sharded``: a dict per chained
    optimizer, or one), but the rest (parameter groups, the step) in the saved one. This optimizer's own parameter
    groups, the loaded tensors, and the saved step (Adam's bias correction depends on it)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer])):
        # Its step lives in its parameter groups, not carried over here: megatron-core 0.16.1 cannot load a
        # distributed optimizer without CUDA (apex/TE), so no test here could show it right.
        raise RuntimeError("resuming at another parallel.expert_parallel than the checkpoint's needs "
                           "optim.use_distributed_optimizer: false")

    def fill(node, got):
        if isinstance(node, ShardedBase):
            return got
        if isinstance(node, LocalNonpersistentObject):
            return node.unwrap()
        if isinstance(node, dict):
            return {k: fill(v, got.get(k) if isinstance(got, dict) else None) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v, got[i] if isinstance(got, list) and i < len(got) else None) for i, v in enumerate(node)]
        return node

    # The saved step sits in the saved structure (the only one the loaded dict holds a step in: this optimizer is
    # fresh); the loaded dict also holds this optimizer's own parameter lists where its structure has them.
    steps = list(_saved_steps(loaded))
    state = fill(sharded, loaded)
    for torch_state in _torch_states(state):
        if steps:  # none when no update was ever taken
            torch_state["state"]["common_step"] = steps[0]
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

    file = Path(path) / IN_FLIGHT_FILE
    if not file.exists():
        return []
    by_step: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        step, name = key.split("/", 1)
        by_step.setdefault(int(step), {})[name] = tensor
    return [RolloutBatch.from_tensors(by_step[step]) for step in sorted(by_step)]


NO_INTACT_CHECKPOINT = "--resume: no intact checkpoint"
UNUSABLE_START = "model.checkpoint: not loaded"
BAD_CHECKPOINT = (NO_INTACT_CHECKPOINT, UNUSABLE_START)  # how the messages of bad input (exit 2) begin


class NoIntactCheckpoint(RuntimeError):
    """``--resume`` found checkpoints, but every one is damaged or incomplete (the message names each problem),
    or the checkpoint a run starts from (``model.checkpoint``) does not verify."""


def _agreed_problem(problem: str | None) -> str | None:
    """Collective: the first rank's problem (each rank checked its share of the files), the same on every rank."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def load_start_checkpoint(path: str | os.PathLike, chunks) -> None:
    """Collective: verify the Megatron model checkpoint a run starts from (``model.checkpoint``), every rank its
    share of the files, then load it; NoIntactCheckpoint (one line) when it does not verify."""
    problem = _agreed_problem(checkpoint_problem(path, signing_key(), dist.get_rank(), dist.get_world_size()))
    if problem is not None:
        raise NoIntactCheckpoint(f"{UNUSABLE_START}: {path}: {problem}")
    load_model_checkpoint(chunks, path)


def _checkpoint_problem(path: Path, step: int, key: SigningKey | None, rank: int,
                        world_size: int) -> str | None:
    """What is wrong with this rank's share of the checkpoint of ``step`` at ``path`` (a phrase), or None."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"{STATE_FILE} is missing (an incomplete save)"
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE} is unreadable ({type(exc).__name__})"
    if not isinstance(state, dict) or "step" not in state:
        return f"{STATE_FILE} holds no step"
    problem = checkpoint_problem(path, key, rank, world_size)
    if problem is None and state["step"] != step:  # (checked after the manifest: then the step is the saved one)
        problem = f"{STATE_FILE} says step {state['step']}: the directory was renamed"
    return problem


def resume_checkpoint(root: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """Collective: the newest intact checkpoint under ``root`` for ``--resume``, and the console lines to print:
    what the check proves (signed or integrity only), one per damaged checkpoint skipped, one per ``.tmp``
    leftover ignored.

    Every rank checks its own files of a candidate in parallel (``models/checkpoint_io/verify.py``: manifest,
    signature with a key, sizes, SHA-256, no unlisted file, pickles that hold data only); the ranks agree on the
    first problem found. A checkpoint without a manifest is damaged like any other: nothing is loaded unverified.
    (None, lines) when there is no checkpoint at all; :class:`NoIntactCheckpoint` when all are damaged."""
    root = Path(root)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    key = signing_key()
    lines = [f"--resume: ignoring {tmp}, the leftover of an interrupted save (the next save removes it)"
             for tmp in sorted(root.glob("step_*.tmp"))] if root.is_dir() else []
    candidates = sorted(((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))),
                        reverse=True) if root.is_dir() else []
    if candidates:
        lines.insert(0, f"--resume: {trust_line(key)}")
    damaged = []
    for step, path in candidates:
        problem = ("it is a symbolic link (out of the run's directory)" if path.is_symlink()
                   else _checkpoint_problem(path, step, key, rank, world_size))
        problem = _agreed_problem(problem)
        if problem is None:
            return path, lines
        lines.append(f"--resume: skipping damaged checkpoint {path}: {problem}")
        damaged.append(f"{path.name}: {problem}")
    if candidates:
        raise NoIntactCheckpoint(f"{NO_INTACT_CHECKPOINT} under {root} ({'; '.join(damaged)}); start a new run "
                                 "without --resume in another trainer.output_dir, or restore a checkpoint")
    return None, lines
