"""The mapping types: how one Megatron parameter is made of HF tensors and split over tensor-parallel ranks.

:class:`ParamMapping` (``to_megatron`` / ``to_hf`` / ``row_pieces``) and its kinds: replicated (norms), split along
rows or columns (column- / row-parallel linears, embeddings), the grouped ``linear_qkv`` and the SwiGLU
``linear_fc1``. The Qwen tables built from them, and loading, are in :mod:`megatron_dynamo.models.mappings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


class MappingError(ValueError):
    """A tensor is missing, unexpected or of the wrong shape; the message names it."""


@dataclass(frozen=True)
class RowPiece:
    """``shard[dst_start : dst_start + rows] = hf_tensors[hf_index][src_start : src_start + rows]``."""

    hf_index: int
    src_start: int
    dst_start: int
    rows: int


@dataclass(frozen=True)
class ParamMapping:
    """Base class: one Megatron parameter made of ``hf_names`` (templates with ``{layer}``).

    ``hf_shapes`` (one per HF name, empty when unknown) are the full HF tensor shapes the architecture implies;
    they let a checkpoint be validated from its headers alone and let receivers of streamed weights allocate
    buffers without asking the sender.
    """

    megatron_name: str
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...] = ()
    # An expert's weight (MoE layers): split over the expert-tensor-parallel ranks (Megatron's ETP group), not the
    # tensor-parallel ones; ``tp_rank`` / ``tp_size`` below are then that group's.
    expert: bool = False

    def resolve(self, layer: int | None) -> "ParamMapping":
        if layer is None:
            return self
        return type(self)(**{**self.__dict__,
                             "megatron_name": self.megatron_name.format(layer=layer),
                             "hf_names": tuple(n.format(layer=layer) for n in self.hf_names)})

    def check_hf_shapes(self, shapes: Sequence[Sequence[int]]) -> None:
        """Raise :class:`MappingError` naming the first HF tensor whose shape is not the expected one."""
        for name, expected, got in zip(self.hf_names, self.hf_shapes, shapes):
            if tuple(expected) != tuple(got):
                raise MappingError(f"{name}: shape mismatch: expected {tuple(expected)} from config.json, "
                                   f"found {tuple(got)}")

    def to_megatron(self, hf_tensors: Sequence[torch.Tensor], tp_rank: int, tp_size: int) -> torch.Tensor:
        raise NotImplementedError

    def to_hf(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The HF tensors from every TP rank's shard. With a single shard the results may be views of it."""
        raise NotImplementedError

    def row_pieces(self, tp_rank: int, tp_size: int) -> list[RowPiece] | None:
        """This rank's shard as row ranges (along dim 0) of the HF tensors, or None when it is not one (a
        row-parallel split takes columns). Lets a loader fill a parameter from a file in bounded chunks without
        materialising whole HF tensors; must agree with :meth:`to_megatron` (tested)."""
        return None


@dataclass(frozen=True)
class ReplicatedMapping(ParamMapping):
    """Same tensor on every TP rank (norm weights)."""

    def to_megatron(self, hf_tensors, tp_rank, tp_size):
        return hf_tensors[0]

    def to_hf(self, shards):
        return [shards[0]]

    def row_pieces(self, tp_rank, tp_size):
        return [RowPiece(0, 0, 0, self.hf_shapes[0][0])] if self.hf_shapes else None


@dataclass(frozen=True)
class SplitMapping(ParamMapping):
    """One HF tensor split evenly along ``dim`` over TP ranks (dim 0: column-parallel, dim 1: row-parallel)."""

    dim: int = 0

    def to_megatron(self, hf_tensors, tp_rank, tp_size):
        tensor = hf_tensors[0]
        if tensor.shape[self.dim] % tp_size:
            raise MappingError(f"{self.hf_names[0]}: dim {self.dim} of size {tensor.shape[self.dim]} "
                               f"is not divisible by tensor_parallel={tp_size}")
        return tensor.chunk(tp_size, dim=self.dim)[tp_rank]

    def to_hf(self, shards):
        if len(shards) == 1:
            return [shards[0]]
        return [torch.cat(list(shards), dim=self.dim)]

    def row_pieces(self, tp_rank, tp_size):
        if self.dim != 0 or not self.hf_shapes or self.hf_shapes[0][0] % tp_size:
            return None
        rows = self.hf_shapes[0][0] // tp_size
        return [RowPiece(0, tp_rank * rows, 0, rows)]


@dataclass(frozen=True)
class QKVMapping(ParamMapping):
    """HF q_proj/k_proj/v_proj (weights or biases) <-> Megatron's fused ``linear_qkv``, grouped per query group."""

    num_heads: int = 0
    num_groups: int = 0
    head_dim: int = 0

    def _fuse(self, q, k, v):
        heads_per_group = self.num_heads // self.num_groups
        rest = q.shape[1:]
        q = q.reshape(self.num_groups, heads_per_group * self.head_dim, *rest)
        k = k.reshape(self.num_groups, self.head_dim, *rest)
        v = v.reshape(self.num_groups, self.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def to_megatron(self, hf_tensors, tp_rank, tp_size):
        q, k, v = hf_tensors
        expected = (self.num_heads * self.head_dim, self.num_groups * self.head_dim, self.num_groups * self.head_dim)
        for name, tensor, rows in zip(self.hf_names, (q, k, v), expected):
            if tensor.shape[0] != rows:
                raise MappingError(f"{name}: expected {rows} rows, got shape {tuple(tensor.shape)}")
        if self.num_groups % tp_size:
            raise MappingError(f"{self.megatron_name}: {self.num_groups} query groups are not divisible by "
                               f"tensor_parallel={tp_size}")
        return self._fuse(q, k, v).chunk(tp_size, dim=0)[tp_rank]

    def to_hf(self, shards):
        heads_per_group = self.num_heads // self.num_groups
        fused = shards[0] if len(shards) == 1 else torch.cat(list(shards), dim=0)
        rest = fused.shape[1:]
        grouped = fused.reshape(self.num_groups, (heads_per_group + 2) * self.head_dim, *rest)
        q, k, v = grouped.split([heads_per_group * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]

    def row_pieces(self, tp_rank, tp_size):
        if self.num_groups % tp_size:
            return None
        heads_per_group = self.num_heads // self.num_groups
        q_rows, d = heads_per_group * self.head_dim, self.head_dim
        block = q_rows + 2 * d
        groups = self.num_groups // tp_size
        pieces = []
        for j in range(groups):
            g = tp_rank * groups + j
            pieces += [RowPiece(0, g * q_rows, j * block, q_rows),
                       RowPiece(1, g * d, j * block + q_rows, d),
                       RowPiece(2, g * d, j * block + q_rows + d, d)]
        return pieces


@dataclass(frozen=True)
class GatedMLPMapping(ParamMapping):
    """HF gate_proj/up_proj <-> Megatron's fused ``linear_fc1``: rank r holds [gate shard r; up shard r]."""

    def to_megatron(self, hf_tensors, tp_rank, tp_size):
        gate, up = hf_tensors
        if gate.shape != up.shape:
            raise MappingError(f"{self.hf_names[0]} {tuple(gate.shape)} and {self.hf_names[1]} "
                               f"{tuple(up.shape)} differ in shape")
        if gate.shape[0] % tp_size:
            raise MappingError(f"{self.hf_names[0]}: {gate.shape[0]} rows not divisible by tensor_parallel={tp_size}")
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)

    def to_hf(self, shards):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        if len(halves) == 1:
            return list(halves[0])
        return [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]

    def row_pieces(self, tp_rank, tp_size):
        if not self.hf_shapes or self.hf_shapes[0][0] % tp_size:
            return None
        rows = self.hf_shapes[0][0] // tp_size
        return [RowPiece(0, tp_rank * rows, 0, rows), RowPiece(1, tp_rank * rows, rows, rows)]
