"""Stream the full HF tensors of a (tensor/pipeline-parallel) Megatron model, one parameter at a time.

:func:`iter_hf_weights` is the single export path of the project: ``megatron-to-hf`` writes its output with it
and the rollout weight sync pushes live trainer weights to the inference engine with it. :func:`export_to_hf`
converts a saved checkpoint to an HF directory by running that converter (``python -m checkpoints_convert``) in a
child process: the trainer and ``dynamo eval`` call it, and so import no converter code.

Contract
--------
- **Collective.** Every rank of the model-parallel group (all TP x PP ranks of a data-parallel replica) must
  iterate the generator to the end, in step: it drives the communication. Ranks outside the receiving replica
  (``dst_rank`` mode) return at once, unless the experts of a mixture-of-experts model are split over
  expert-parallel ranks: those groups span the replicas, so then every rank iterates (and sends the experts it
  holds, see :mod:`.export_experts`).
- **Order.** HF order, the same on every rank: ``model.embed_tokens.weight``, then layer 0 .. L-1 (within a
  layer, the order of :func:`~megatron_dynamo.models.mappings.layer_mappings`: input norm, q, k, v, o, post-attention
  norm, gate, up, down (a MoE layer: the router, each expert's gate, up, down by global expert index, [the shared
  expert's and its gate]), [q/k/v biases], [q/k norms]), ``model.norm.weight``, and ``lm_head.weight`` unless the
  embeddings are tied (then HF has no ``lm_head`` and the output layer is not exported).
- **Who receives.** ``dst_rank=None``: every rank of the model-parallel group yields every ``(name, tensor)``.
  ``dst_rank=r`` (a global rank): only rank ``r`` yields; the others iterate to drive the transfers and yield
  nothing.
- **Dtype.** ``dtype=None``: the model's parameter dtype (fp32, or bf16 for a bf16 model); otherwise tensors are
  cast on the owning rank before they are sent (so bf16 export of an fp32 model moves half the bytes).
- **Device.** Tensors live on the parameters' device (CPU here, the GPU under NCCL).
- **Memory.** One parameter (one expert's tensor) at a time: its TP shards, the HF tensors made from them, and on
  receiving stages a buffer of that size. The model is never gathered whole.
- **Aliasing.** A yielded tensor may share storage with a parameter (replicated norms, TP=1 slices) or be
  reused after the next step of the generator: treat it as read-only and copy it if you keep it.

Communication per parameter: TP shards are combined with ``all_gather`` over the TP group of the owning pipeline
stage (``gather`` to one rank in ``dst_rank`` mode; replicated norms need none), then the owning stage
``broadcast``s the HF tensors over the pipeline group (``send``/``recv`` to ``dst_rank``). Which stage owns which
parameter is agreed once per call with one small ``all_gather_object`` over the pipeline group, so any
pipeline layout (including virtual stages and uneven splits) works without assumptions. Experts split over
expert-parallel ranks (expert tensor parallel 1) come from the rank that holds them: :mod:`.export_experts`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_dynamo.models.export_experts import ExpertRanks, expert_of, expert_ranks, expert_tensors
from megatron_dynamo.models.mappings import (MappingError, ParamMapping, ReplicatedMapping, chunk_mappings,
                                             global_mappings, unwrap_model)
from megatron_dynamo.models.qwen import QwenArchitecture
from megatron_dynamo.parallel.runtime import single_process_environment


def _local_mappings(chunks: Sequence[torch.nn.Module], arch: QwenArchitecture, te_spec: bool):
    """This rank's mappings keyed by their HF names (the key that identifies a parameter across layouts)."""
    local: dict[tuple[str, ...], tuple[ParamMapping, torch.Tensor]] = {}
    for chunk in chunks:
        for mapping, param in chunk_mappings(unwrap_model(chunk), arch, te_spec):
            if mapping.megatron_name == "output_layer.weight" and arch.tie_word_embeddings:
                continue  # a last stage's copy of the tied embedding: the first stage exports the original
            local[mapping.hf_names] = (mapping, param)
    return local


def _world_state():
    from megatron.core import parallel_state

    if not (dist.is_available() and dist.is_initialized()) or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state


@dataclass(frozen=True)
class _ExportRanks:
    """This rank's place in the model-parallel layout, and the destination's (``dst_tp``, ``dst_pp``: the TP rank
    and pipeline stage of ``dst_rank``; None when every rank receives every tensor)."""

    rank: int
    tp_group: Any
    pp_group: Any
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    tp_ranks: list[int]
    pp_ranks: list[int]
    dst_tp: int | None = None
    dst_pp: int | None = None


def _single_process_weights(order: list[ParamMapping], local: dict, out_dtype: torch.dtype
                            ) -> Iterator[tuple[str, torch.Tensor]]:
    """A single process holds the whole model: every HF tensor, with no communication."""
    for mapping in order:
        if mapping.hf_names not in local:
            raise MappingError(f"no parameter of this model maps to {', '.join(mapping.hf_names)}")
        own, param = local[mapping.hf_names]
        for name, tensor in zip(own.hf_names, own.to_hf([param.detach()])):
            yield name, tensor.to(out_dtype)


def _export_ranks(ps, dst_rank: int | None) -> _ExportRanks | None:
    """The layout of this rank and of ``dst_rank``; None when ``dst_rank`` is in another data-parallel replica
    (which delivers to it)."""
    rank = dist.get_rank()
    tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    mp_ranks = dist.get_process_group_ranks(ps.get_model_parallel_group())
    if dst_rank is not None and dst_rank not in mp_ranks:
        return None
    return _ExportRanks(rank, tp_group, pp_group, ps.get_tensor_model_parallel_world_size(), tp_rank,
                        ps.get_pipeline_model_parallel_world_size(), pp_rank,
                        dist.get_process_group_ranks(tp_group), dist.get_process_group_ranks(pp_group))


def _stage_owners(local: dict, ps) -> dict[tuple[str, ...], int]:
    """Which pipeline stage owns each parameter: one small exchange per call."""
    per_stage: list = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(per_stage, sorted(local), group=ps.get_pipeline_model_parallel_group())
    owner: dict[tuple[str, ...], int] = {}
    for stage, keys in enumerate(per_stage):
        for key in keys:
            owner.setdefault(tuple(key), stage)
    return owner


def _with_destination(ps, ranks: _ExportRanks, dst_rank: int) -> _ExportRanks:
    """dst's coordinates: the TP rank it has within its stage and its stage. Every rank of this replica can compute
    them from the group layout: dst shares a pipeline group with the ranks of its TP rank."""
    coords = [None] * dist.get_world_size(ps.get_model_parallel_group())
    dist.all_gather_object(coords, (ranks.rank, ranks.tp_rank, ranks.pp_rank), group=ps.get_model_parallel_group())
    dst_tp, dst_pp = next((t, p) for r, t, p in coords if r == dst_rank)
    return replace(ranks, dst_tp=dst_tp, dst_pp=dst_pp)


def _gather_tensor_parallel(own: ParamMapping, param: torch.Tensor, ranks: _ExportRanks, dst_rank: int | None,
                            out_dtype: torch.dtype) -> list[torch.Tensor] | None:
    """On the owning stage: the TP shards of ``param`` joined into its HF tensors, on every rank of the stage
    (``dst_rank`` None) or on the one with dst's TP rank; None elsewhere."""
    tp_size, tensors = ranks.tp_size, None
    shard = param.detach().contiguous()
    if isinstance(own, ReplicatedMapping) or tp_size == 1 or own.expert:
        # Whole on every TP rank: a replicated parameter, or an expert's weight (expert tensor parallel 1, checked by
        # iter_hf_weights).
        shards = [shard]
        if dst_rank is None or ranks.tp_rank == ranks.dst_tp:
            tensors = own.to_hf(shards)
    elif dst_rank is None:
        shards = [torch.empty_like(shard) for _ in range(tp_size)]
        dist.all_gather(shards, shard, group=ranks.tp_group)
        tensors = own.to_hf(shards)
    else:
        gather_dst = ranks.tp_ranks[ranks.dst_tp]
        shards = [torch.empty_like(shard) for _ in range(tp_size)] if ranks.rank == gather_dst else None
        dist.gather(shard, shards, dst=gather_dst, group=ranks.tp_group)
        if ranks.rank == gather_dst:
            tensors = own.to_hf(shards)
    return None if tensors is None else [t.to(out_dtype).contiguous() for t in tensors]


def _across_stages(tensors: list[torch.Tensor] | None, stage: int, shapes: list[tuple[int, ...]],
                   ranks: _ExportRanks, dst_rank: int | None, out_dtype: torch.dtype, device: torch.device
                   ) -> list[torch.Tensor] | None:
    """From the owning ``stage`` to every stage (``dst_rank`` None: a broadcast) or to dst's (a point-to-point hop
    between the ranks of dst's TP rank, which share a pipeline group)."""
    if dst_rank is None:
        if tensors is None:
            tensors = [torch.empty(s, dtype=out_dtype, device=device) for s in shapes]
        for t in tensors:
            dist.broadcast(t, src=ranks.pp_ranks[stage], group=ranks.pp_group)
    elif stage != ranks.dst_pp and ranks.tp_rank == ranks.dst_tp:
        if ranks.pp_rank == stage:
            for t in tensors:
                dist.send(t, dst=dst_rank, group=ranks.pp_group)
        elif ranks.rank == dst_rank:
            tensors = [torch.empty(s, dtype=out_dtype, device=device) for s in shapes]
            for t in tensors:
                dist.recv(t, src=ranks.pp_ranks[stage], group=ranks.pp_group)
    return tensors


@torch.no_grad()
def iter_hf_weights(chunks: Sequence[torch.nn.Module], arch: QwenArchitecture, te_spec: bool = False, *,
                    dst_rank: int | None = None,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for the whole model from this rank's Megatron ``chunks``.

    ``chunks``: this rank's model chunks (one per virtual pipeline stage; DDP/Float16Module wrappers are fine).
    ``te_spec``: the chunks use the Transformer-Engine layer spec (norms fused into linear_qkv / linear_fc1).
    ``dst_rank``: ``None`` -> every model-parallel rank receives every tensor; a global rank -> only that rank.
    ``dtype``: cast to this dtype (``None``: keep the parameter dtype). See the module docstring for the order,
    the memory bound and the aliasing rules. Collective: all model-parallel ranks must iterate to the end (every
    rank, with experts split over expert-parallel ranks).
    """
    local = _local_mappings(chunks, arch, te_spec)
    params = [p for chunk in chunks for p in unwrap_model(chunk).parameters()]
    if not params:
        raise MappingError("the model chunks hold no parameters")
    device = params[0].device
    out_dtype = dtype or params[0].dtype
    order = global_mappings(arch, te_spec)
    ps = _world_state()
    if ps is None or dist.get_world_size() == 1:
        yield from _single_process_weights(order, local, out_dtype)
        return
    if arch.moe is not None and ps.get_expert_tensor_parallel_world_size() > 1:
        raise MappingError("exporting a mixture-of-experts model at parallel.expert_tensor_parallel > 1 is not "
                           "supported (experts are exported whole: expert tensor parallel 1)")
    experts = expert_ranks(ps, arch.moe.num_experts, dst_rank) if arch.moe is not None else None
    ranks = _export_ranks(ps, dst_rank)
    if ranks is None and experts is None:
        return  # another data-parallel replica delivers to dst_rank
    owner = _stage_owners(local, ps)
    if ranks is not None and dst_rank is not None:
        ranks = _with_destination(ps, ranks, dst_rank)
    for mapping in order:
        key = mapping.hf_names
        if experts is not None and mapping.expert:
            tensors = _expert_tensors(mapping, local, owner, ranks, experts, out_dtype, device)
        elif ranks is not None:
            tensors = _tensors(mapping, local, owner, ranks, dst_rank, out_dtype, device)
        else:
            continue  # outside dst_rank's replica, only experts are sent from here
        if dst_rank is None or (ranks is not None and ranks.rank == dst_rank):
            for name, shape, tensor in zip(key, mapping.hf_shapes, tensors):
                if tuple(tensor.shape) != tuple(shape):
                    raise MappingError(f"{name}: exported shape {tuple(tensor.shape)} differs from {tuple(shape)}")
                yield name, tensor


def _tensors(mapping: ParamMapping, local: dict, owner: dict, ranks: _ExportRanks, dst_rank: int | None,
             out_dtype: torch.dtype, device: torch.device) -> list[torch.Tensor] | None:
    """A parameter of the receiving replica: its HF tensors gathered over TP on the owning stage, then carried to the
    other stages (or dst's)."""
    key = mapping.hf_names
    if key not in owner:
        raise MappingError(f"no pipeline stage holds a parameter for {', '.join(key)}")
    stage = owner[key]
    shapes = [tuple(s) for s in mapping.hf_shapes]
    if len(shapes) != len(key):
        raise MappingError(f"{mapping.megatron_name}: mapping carries no HF shapes")
    tensors = _gather_tensor_parallel(*local[key], ranks, dst_rank, out_dtype) if ranks.pp_rank == stage else None
    if ranks.pp_size > 1:
        tensors = _across_stages(tensors, stage, shapes, ranks, dst_rank, out_dtype, device)
    return tensors


def _expert_tensors(mapping: ParamMapping, local: dict, owner: dict, ranks: _ExportRanks | None,
                    experts: ExpertRanks, out_dtype: torch.dtype, device: torch.device) -> list[torch.Tensor] | None:
    """An expert at expert parallel > 1: from the expert-parallel rank that holds it (:mod:`.export_experts`), then
    (every rank receiving) over the pipeline group from the owning stage."""
    router, _ = expert_of(mapping)
    if router not in owner:
        raise MappingError(f"no pipeline stage holds the router {router[0]} of {mapping.hf_names[0]}")
    stage = owner[router]
    tensors = expert_tensors(mapping, local.get(mapping.hf_names), stage, experts, out_dtype, device)
    if experts.dst_rank is None and ranks.pp_size > 1:
        tensors = _across_stages(tensors, stage, [tuple(s) for s in mapping.hf_shapes], ranks, None, out_dtype,
                                 device)
    return tensors


def export_to_hf(megatron_dir: str | os.PathLike, out: str | os.PathLike,
                 tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """``megatron-to-hf`` in a child process, replacing ``out`` atomically; raises RuntimeError with the
    converter's message on failure. A child process because the converter runs its ranks under torch.distributed
    itself: the trainer (which owns a process group) and ``dynamo eval`` (about to start vLLM) must not. The child
    gets this process's environment without the launcher variables (torchrun's RANK/WORLD_SIZE, srun's SLURM_PROCID
    ...): a rank of an N-process job that converts starts one single-process converter, not a rank of that job."""
    cmd = [sys.executable, "-m", "checkpoints_convert", "megatron-to-hf", "--megatron", str(megatron_dir),
           "--out", str(out), "--force", "--quiet"]
    if tokenizer_dir is not None:
        cmd += ["--tokenizer", str(tokenizer_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=single_process_environment())
    if proc.returncode != 0:
        # The converter's one-line error if it printed one (library warnings may follow it), else its stderr's end.
        errors = [line.removeprefix("error: ") for line in proc.stderr.splitlines() if line.startswith("error: ")]
        raise RuntimeError(f"converting {megatron_dir} to HF failed: "
                           f"{errors[-1] if errors else proc.stderr.strip()[-2000:]}")
    return Path(out)
