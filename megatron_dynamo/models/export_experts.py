"""The experts of a mixture-of-experts model split over expert-parallel ranks, for :mod:`megatron_dynamo.models.export`.

With ``parallel.expert_parallel`` (EP) > 1 each MoE layer's experts are divided over the ranks of an expert-parallel
group: EP rank ``k`` holds the global experts ``k * E/EP .. (k + 1) * E/EP - 1`` (Megatron's ``local_expert_indices``),
whole (expert tensor parallel 1). The expert groups tile the ranks of each pipeline stage across data-parallel
replicas, so the ranks that hold an expert are not those of one model-parallel group: the export of an expert reaches
past the receiving replica.

Per expert tensor (one HF tensor set, cast on the holder before it is sent):

- every rank receives (``dst_rank`` None): on the owning pipeline stage, each expert group broadcasts it from the
  member that holds it; the caller then broadcasts it over the pipeline group as any other parameter;
- one rank receives (``dst_rank``): one point-to-point transfer from a holder to ``dst_rank`` (over the default
  group, which holds both), the holder agreed once per call: ``dst_rank`` itself if it holds the expert, else the
  lowest rank of the owning stage that does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_dynamo.models.param_mapping import MappingError, ParamMapping

_EXPERT_NAME = re.compile(r"(model\.layers\.\d+\.mlp\.)experts\.(\d+)\.")


def expert_of(mapping: ParamMapping) -> tuple[tuple[str, ...], int]:
    """The HF key of the router of ``mapping``'s layer (every rank of the owning stage holds it: it names the stage)
    and the expert's global index."""
    match = _EXPERT_NAME.match(mapping.hf_names[0])
    if match is None:
        raise MappingError(f"{mapping.megatron_name}: an expert mapping without an HF expert name")
    return (match.group(1) + "gate.weight",), int(match.group(2))


@dataclass(frozen=True)
class ExpertRanks:
    """This rank's expert-parallel group and, with a ``dst_rank``, which rank sends each stage's experts to it."""

    rank: int
    pp_rank: int
    ep_group: Any
    ep_ranks: list[int]
    experts_per_rank: int
    dst_rank: int | None
    senders: dict[tuple[int, int], int]  # (pipeline stage, EP rank) -> the rank that sends to dst_rank

    def source(self, stage: int, expert: int) -> tuple[int, int]:
        """The EP rank that holds ``expert``, and the global rank that sends it (dst_rank mode; -1 otherwise)."""
        ep_rank = expert // self.experts_per_rank
        return ep_rank, self.senders.get((stage, ep_rank), -1)


def expert_ranks(ps, num_experts: int, dst_rank: int | None) -> ExpertRanks | None:
    """The expert layout of this rank (None at expert parallel 1: every rank of a stage holds every expert, and the
    dense path exports them). Collective over every rank in ``dst_rank`` mode (one small exchange per call)."""
    ep_size = ps.get_expert_model_parallel_world_size()
    if ep_size == 1:
        return None
    group, pp_rank = ps.get_expert_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    senders: dict[tuple[int, int], int] = {}
    if dst_rank is not None:
        coords: list = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (pp_rank, ps.get_expert_model_parallel_rank()))
        for rank, coord in sorted(enumerate(coords), key=lambda rc: (rc[0] != dst_rank, rc[0])):
            senders.setdefault(tuple(coord), rank)
    return ExpertRanks(dist.get_rank(), pp_rank, group, dist.get_process_group_ranks(group), num_experts // ep_size,
                       dst_rank, senders)


def expert_tensors(mapping: ParamMapping, held: tuple[ParamMapping, torch.Tensor] | None, stage: int,
                   ranks: ExpertRanks, out_dtype: torch.dtype, device: torch.device) -> list[torch.Tensor] | None:
    """One expert's HF tensors: on every rank of the owning ``stage`` (``dst_rank`` None; the caller carries them
    over the pipeline group) or on ``dst_rank`` only; None elsewhere. ``held``: this rank's (mapping, parameter) of
    the expert, None when it does not hold it."""
    ep_rank, sender = ranks.source(stage, expert_of(mapping)[1])
    tensors = None
    if held is not None and (ranks.dst_rank is None or ranks.rank == sender):
        own, param = held
        tensors = [t.to(out_dtype).contiguous() for t in own.to_hf([param.detach()])]
    if ranks.dst_rank is None:
        if ranks.pp_rank != stage:
            return None
        if tensors is None:
            tensors = [torch.empty(shape, dtype=out_dtype, device=device) for shape in mapping.hf_shapes]
        for t in tensors:
            dist.broadcast(t, src=ranks.ep_ranks[ep_rank], group=ranks.ep_group)
        return tensors
    if sender == ranks.dst_rank:
        return tensors if ranks.rank == sender else None
    if ranks.rank == sender:
        for t in tensors:
            dist.send(t, dst=ranks.dst_rank)
        return None
    if ranks.rank == ranks.dst_rank:
        tensors = [torch.empty(shape, dtype=out_dtype, device=device) for shape in mapping.hf_shapes]
        for t in tensors:
            dist.recv(t, src=sender)
        return tensors
    return None
