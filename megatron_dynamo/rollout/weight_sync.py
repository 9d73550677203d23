"""Push the live Megatron weights into every rank's colocated vLLM worker after each update: in process, no disk.

:func:`sync_weights` (collective over all ranks):

1. :func:`~megatron_dynamo.models.export.iter_hf_weights` streams ``(hf_name, full tensor)`` one parameter at a time
   to every rank of each model-parallel group: TP shards all-gathered over the owning stage's TP group, then
   broadcast over the pipeline group, on the training device (GPU) and cast to the engine's dtype on the owning
   rank before anything is sent. Data-parallel replicas each gather their own copy (they hold the same weights).
2. Each rank's engine loads the stream into its own vLLM worker, in process (``VLLMEngine.update_weights``: vLLM's
   layer-wise reload; the worker keeps its slice of the engine's TP split). Peak extra memory: the tensors of one
   decoder layer (buffered by the reload until the layer is complete); the model is never copied whole.

No bytes are packed and nothing crosses a process boundary: the previous design (rank 0 gathers, packs host byte
buckets, hands them to vLLM's worker process through ``collective_rpc``) moved 0.2-0.3 GiB/s here; it lives on in
``benchmarks/bench_weight_sync.py`` as the baseline. A failure while loading on one rank still iterates the export
stream to its end (so the other ranks' collectives complete) and re-raises afterwards.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_dynamo.models.export import iter_hf_weights
from megatron_dynamo.rollout import channel
from megatron_dynamo.rollout.interface import WeightUpdateStats


def sync_weights(engine, model: Any, arch: Any = None, *, dtype: torch.dtype | None = None,
                 te_spec: bool | None = None) -> WeightUpdateStats:
    """Export the live Megatron weights and load them into this rank's ``engine`` (collective: every rank calls it).

    ``model``: a :class:`~megatron_dynamo.trainer.actor.MegatronActor` (its chunks, architecture and layer spec are
    used) or this rank's list of model chunks (then give ``arch``). ``dtype``: the dtype sent (default the engine's
    ``weight_dtype``). Returns this rank's stats (bytes and seconds: the engine consumes the gather as it loads).
    """
    if hasattr(model, "chunks") and hasattr(model, "arch"):
        chunks, arch = model.chunks, model.arch
        te_spec = getattr(model, "use_te", False) if te_spec is None else te_spec
    else:
        chunks = model
        if arch is None:
            raise ValueError("sync_weights: pass the architecture (arch) with a list of model chunks")
    dtype = dtype or getattr(engine, "weight_dtype", None)
    stream = iter_hf_weights(chunks, arch, bool(te_spec), dst_rank=None, dtype=dtype)
    try:
        return engine.update_weights(stream)
    except BaseException:
        for _ in stream:  # keep the other ranks' collectives going, then re-raise
            pass
        raise


def send_weights_to_engine_ranks(control, model, *, dtype: torch.dtype | None = None) -> WeightUpdateStats:
    """Collective over the trainer ranks (``rollout.placement: separate``): export the live weights to the first
    trainer rank (TP/PP gathered there, ``dst_rank=0``), which streams them to every engine rank over the
    ``control`` bridge group in buckets (``rollout.channel``). ``control``: the bridge on the first
    trainer rank, None on the others (they only drive the gather)."""
    import time

    start = time.perf_counter()
    stream = iter_hf_weights(model.chunks, model.arch, bool(getattr(model, "use_te", False)), dst_rank=0,
                             dtype=dtype)
    stats = WeightUpdateStats()
    if control is None:
        for _ in stream:
            pass
    else:
        stats.bytes, stats.tensors = channel.send_weights(control, stream)
    stats.seconds = time.perf_counter() - start
    return stats


def load_weights_from_trainer_ranks(engine, control) -> WeightUpdateStats:
    """The engine ranks' half: load the stream arriving on the ``control`` bridge into this rank's engine. A failure
    while loading still receives the stream to its end (the group stays in step) and re-raises afterwards."""
    stream = channel.receive_weights(control)
    try:
        return engine.update_weights(stream)
    except BaseException:
        channel.drain(stream)
        raise
