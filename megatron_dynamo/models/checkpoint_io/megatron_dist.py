"""Megatron distributed checkpoints of the model (``<dir>/model``): save, check, load.

The dist checkpoint is layout-free: :func:`load_model_checkpoint` loads it at any TP/PP (and VPP). The local
(CPU) and Transformer-Engine layer specs share checkpoint keys (Megatron maps the local spec's norm names onto
TE's), so a checkpoint written here also serves the TE model on GPU.
"""

from __future__ import annotations

import os
import queue
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_dynamo.models.checkpoint_io.formats import CHECKPOINT_MODEL_DIR, CheckpointError
from megatron_dynamo.models.checkpoint_io.safe_pickle import reading_checkpoint
from megatron_dynamo.models.mappings import unwrap_model


def model_sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """The sharded state dict of this rank's model chunks: ``{"model": ...}`` or ``{"model0": ..., ...}`` with
    virtual pipeline stages (Megatron's own convention; keys inside are global, so any layout can load it)."""
    if len(chunks) == 1:
        return {"model": unwrap_model(chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap_model(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _discard_pages(t: torch.Tensor) -> None:
    """Return the whole pages inside a contiguous CPU tensor's bytes to the OS (Linux ``MADV_DONTNEED``; their
    contents become zeros). Only for memory that will never be read again. Best effort: a no-op elsewhere."""
    import ctypes
    import mmap

    if t.device.type != "cpu" or not t.is_contiguous() or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    begin, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    begin, end = -(-begin // page) * page, end // page * page
    if end > begin:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), mmap.MADV_DONTNEED)


def _row_pieces(sh, max_item_bytes: int, release: bool = True) -> list:
    """Split a ShardedTensor along its first local axis into the fewest equal pieces of at most
    ``max_item_bytes`` (a deterministic function of the shapes, so every rank holding a shard or replica of
    the key splits it alike), each piece owning a copy of its rows. Main replicas only are written; replicas
    get views. ``release``: the source rows are discarded as soon as they are copied."""
    import dataclasses as dc

    from megatron.core.dist_checkpointing.mapping import is_main_replica

    data = sh.data
    rows = sh.local_shape[0] if sh.local_shape else 1
    nbytes = data.numel() * data.element_size()
    pieces = 1
    if sh.local_shape and nbytes > max_item_bytes:
        needed = -(-nbytes // max_item_bytes)
        # Equal pieces need a divisor of the row count; give up on shapes without a small enough one.
        pieces = next((k for k in range(needed, min(rows, 4 * needed) + 1) if rows % k == 0), 1)
    is_view = data.untyped_storage().nbytes() != nbytes
    if pieces == 1:
        if is_view and is_main_replica(sh.replica_id):
            # Megatron's writer would clone a view anyway; cloning here lets the source be released.
            sh.data = data.clone()
            if release:
                _discard_pages(data)
        return [sh]
    axis = sh.prepend_axis_num
    step = rows // pieces
    out = []
    for j in range(pieces):
        part = data[j * step:(j + 1) * step]
        if is_main_replica(sh.replica_id):
            copy = part.clone()
            if release:
                _discard_pages(part)
            part = copy
        offset, frags = list(sh.global_offset), list(sh.axis_fragmentations)
        offset[axis] += j * step
        frags[axis] *= pieces
        out.append(dc.replace(sh, data=part, local_shape=(step, *sh.local_shape[1:]), global_offset=tuple(offset),
                              axis_fragmentations=tuple(frags)))
    return out


def _stage_for_writing(sharded: dict[str, Any], chunks: Sequence[torch.nn.Module], max_item_bytes: int) -> None:
    """Prepare a model's sharded state dict for a save after which the model is discarded (converters).

    - SwiGLU fc1 factories are built here, each gate/up half copied on its own: Megatron's torch_dist writer
      clones every tensor that is a view of a larger storage before writing, i.e. all fc1 weights (about half
      of a Qwen model) at once.
    - Tensors larger than ``max_item_bytes`` (embeddings, output layer) are stored as several row pieces, so
      that whoever loads the checkpoint never holds more than one piece in its read buffer (torch DCP reads a
      stored item whole before copying it into place). Pieces load at any TP/PP like any other sharding.
    - Each source parameter is released as soon as it is staged: the peak stays at one model plus one piece.
    The chunks are unusable afterwards.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    params_by_ptr = {}
    for chunk in chunks:
        for p in unwrap_model(chunk).parameters():
            params_by_ptr[p.data_ptr()] = p

    def release(tensor: torch.Tensor) -> None:
        param = params_by_ptr.pop(tensor.data_ptr(), None)
        if param is not None:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def walk(node):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            if isinstance(value, ShardedTensorFactory):
                built = value.build()
                halves = list(built.values()) if isinstance(built, dict) else list(built)
                node[key] = [piece for half in halves for piece in _row_pieces(half, max_item_bytes, True)]
                release(value.data)
            elif isinstance(value, ShardedTensor) and value.flattened_range is None and value.data is not None:
                pieces = _row_pieces(value, max_item_bytes, True)
                if len(pieces) > 1:
                    node[key] = pieces
                    release(value.data)
            elif isinstance(value, (dict, list)):
                walk(value)

    walk(sharded)


def save_model_checkpoint(chunks: Sequence[torch.nn.Module], directory: str | os.PathLike,
                          release_params: bool = False, max_item_bytes: int = 16 * 2**20) -> None:
    """Save this rank's model chunks into ``<directory>/model`` with megatron.core.dist_checkpointing.

    Collective over all ranks. ``release_params=True`` (converters, whose model is not used afterwards): stage
    the tensors with :func:`_stage_for_writing` (large tensors stored as pieces of at most ``max_item_bytes``,
    each parameter freed once staged), keeping the save at one model of memory. Without it, Megatron's default
    (the writer clones the fc1 halves, views of their parameter, before writing).
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    model_dir = Path(directory) / CHECKPOINT_MODEL_DIR
    if dist.get_rank() == 0:
        model_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sharded = model_sharded_state_dict(chunks)
    if release_params:
        _stage_for_writing(sharded, chunks, max_item_bytes)
    # Megatron's torch_dist writer forks two writer processes per rank (they share the model's pages).
    write_results_in_process()
    dist_checkpointing.save(sharded, str(model_dir))


def write_results_in_process() -> None:
    """Megatron's torch_dist writer hands its write results to the saving process through a queue, by default one
    served by a Manager process it starts with ``spawn`` at the first save (``filesystem_async.
    _get_write_results_queue``): it imports torch to unpickle them, 200 MB of memory and 2-4 s of CPU, and lives
    as long as the process. Our saves are synchronous (``dist_checkpointing.save``: the results are put and read
    back in this process), so an in-process queue serves them. Not for Megatron's asynchronous saves, which hand
    the queue to another process (never used here). Once per process, before the first save."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _flat_sharded(sharded: dict[str, Any]) -> list:
    """Every ShardedTensor / ShardedObject of a sharded state dict, factories built (views only, no copies)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = []

    def walk(node):
        values = node.values() if isinstance(node, dict) else node
        for value in values:
            if isinstance(value, ShardedTensorFactory):
                built = value.build()
                walk(built if isinstance(built, (dict, list)) else [built])
            elif isinstance(value, (ShardedTensor, ShardedObject)):
                out.append(value)
            elif isinstance(value, (dict, list)):
                walk(value)

    walk(sharded)
    return out


def check_model_checkpoint(chunks: Sequence[torch.nn.Module], model_dir: str | os.PathLike) -> None:
    """Compare the model's sharded tensors with the checkpoint's tensor metadata (collective): every tensor the
    model needs must be there with the same global shape and dtype, and the checkpoint must hold no model
    tensor the model lacks. Errors name the tensor."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    with reading_checkpoint(model_dir):
        ckpt = dist_checkpointing.load_tensors_metadata(str(model_dir))
    mine, objects = {}, set()
    for sh in _flat_sharded(model_sharded_state_dict(chunks)):
        if isinstance(sh, ShardedTensor):
            mine[sh.key] = (tuple(sh.global_shape), sh.dtype)
        else:
            objects.add(sh.key)
    for key, (shape, dtype) in sorted(mine.items()):
        if key not in ckpt:
            raise CheckpointError(f"checkpoint {model_dir} has no tensor '{key}' (the model needs global shape "
                                  f"{shape})")
        theirs = ckpt[key]
        if tuple(theirs.global_shape) != shape:
            raise CheckpointError(f"{key}: shape mismatch: checkpoint has {tuple(theirs.global_shape)}, "
                                  f"the model (from config.json) needs {shape}")
        if theirs.dtype != dtype:
            raise CheckpointError(f"{key}: checkpoint dtype {theirs.dtype} differs from the model's {dtype}")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(set(mine) | objects))
    wanted = set().union(*map(set, everyone))
    unexpected = sorted(k for k in ckpt if k not in wanted and not k.startswith("optimizer"))
    if unexpected:
        raise CheckpointError(f"checkpoint {model_dir} has unexpected tensor '{unexpected[0]}'"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                              + " that the model built from its config.json does not have")


def _merge_in_place(factory):
    """A merge function for a factory whose built tensors are a partition of views of the parameter (SwiGLU
    fc1's gate/up halves): write the loaded pieces back into the parameter and return it, instead of Megatron's
    ``torch.cat`` into a new tensor (which, for every layer at once, would cost ~half a model of extra memory)."""
    def merge(sub_state_dict):
        pieces = list(sub_state_dict.values()) if isinstance(sub_state_dict, dict) else list(sub_state_dict)
        fresh = factory.build()  # views of the parameter, in the same structure as sub_state_dict
        views = [sh.data for sh in (fresh.values() if isinstance(fresh, dict) else fresh)]
        for view, piece in zip(views, pieces):
            if view.data_ptr() != piece.data_ptr():
                view.copy_(piece)
        return factory.data

    return merge


def _is_view_partition(factory) -> bool:
    built = factory.build()
    pieces = list(built.values()) if isinstance(built, dict) else list(built)
    data = factory.data
    try:
        same_storage = all(getattr(p, "data", None) is not None and
                           p.data.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() for p in pieces)
    except (AttributeError, RuntimeError):
        return False
    return same_storage and sum(p.data.numel() for p in pieces) == data.numel()


@torch.no_grad()
def load_model_checkpoint(chunks: Sequence[torch.nn.Module], directory: str | os.PathLike,
                          check: bool = True) -> None:
    """Load ``<directory>/model`` (or ``directory`` itself if it is the dist checkpoint) into this rank's chunks,
    at whatever TP/PP/VPP they were built with. Collective over all ranks.

    Memory: tensors are loaded in place into the parameters (the SwiGLU fc1 halves too, see
    :func:`_merge_in_place`), so loading needs no second copy of the model. No pickle of the checkpoint runs code
    (:mod:`.safe_pickle`): a refused one raises UnsafeCheckpointError.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    directory = Path(directory)
    model_dir = directory / CHECKPOINT_MODEL_DIR if (directory / CHECKPOINT_MODEL_DIR).is_dir() else directory
    if check:
        check_model_checkpoint(chunks, model_dir)
    sharded = model_sharded_state_dict(chunks)
    modules = {name: unwrap_model(chunks[0] if name == "model" else chunks[int(name[5:])]) for name in sharded}
    for sd in sharded.values():
        for value in sd.values():
            if isinstance(value, ShardedTensorFactory) and _is_view_partition(value):
                value.merge_fn = _merge_in_place(value)
    with reading_checkpoint(model_dir):
        state = dist_checkpointing.load(sharded, str(model_dir))
    for name, module in modules.items():
        current = module.state_dict(keep_vars=True)
        loaded = state.get(name, {})
        rest = {}
        for key, value in loaded.items():
            target = current.get(key)
            if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor) \
                    and value.data_ptr() == target.data_ptr() and value.shape == target.shape:
                continue  # loaded in place
            rest[key] = value
        result = module.load_state_dict(rest, strict=False)
        if result.unexpected_keys:
            raise CheckpointError(f"unexpected keys after loading: {', '.join(result.unexpected_keys)}")
        missing = sorted(k for k, v in current.items() if v is not None and k not in loaded)
        if missing:
            raise CheckpointError(f"checkpoint left parameters unloaded: {', '.join(missing)}")
