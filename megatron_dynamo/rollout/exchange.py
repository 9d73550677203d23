"""Every engine's scored responses to every rank, as packed tensors (no pickled Python objects of the rollout).

After generation each engine leader holds the responses of the prompts assigned to its engine, and their rewards.
:func:`gather_rollout` packs them into tensors per leader (integers per response: prompt index, sample index,
length, truncated; the token ids back to back; the rewards) and all-gathers them over the default group (other
ranks contribute empty tensors); so travel the engine's log-prob of every sampled token (float64, NaN where the
engine gave none), for the trainer's engine-vs-trainer gap metrics and ``dynamo.loss.engine_is``, and the experts
the engine's routers chose (mixture-of-experts rollouts with ``SamplingConfig.routed_experts``, for routing replay:
int16, each response's shape beside them). Every rank then holds the whole step's rollout in one canonical order,
prompt order then sample index: the order a single engine produces. Prompt ids and prompt tokens never travel:
every rank has the step's prompts (same sampler, same tokenizer) and refers to them by index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_dynamo.parallel.runtime import collective_device

_META_FIELDS = 4  # prompt index, sample index, response length, truncated
#: The packed form of :class:`ScoredResponses`, in this order (``ScoredResponses.pack``).
PACKED_NAMES = ("meta", "tokens", "rewards", "logprobs", "routed_shape", "routed_experts")


@dataclass
class ScoredResponses:
    """Responses of one step (or one engine's share of it), by prompt index into the step's prompt list."""

    prompt_index: list[int] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)
    token_ids: list[tuple[int, ...]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    logprobs: list[tuple[float, ...] | None] = field(default_factory=list)  # the engine's; empty: none at all
    # the engine's routed experts (GenerationResponse.routed_experts); empty: none at all
    routed_experts: list[torch.Tensor | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_index)

    def pack(self) -> dict[str, torch.Tensor]:
        """Plain tensors, :data:`PACKED_NAMES`: ``meta`` int64 [n, 4], ``tokens`` int64 [sum of lengths],
        ``rewards`` float64 [n], ``logprobs`` float64 [sum of lengths] (NaN for a response without them),
        ``routed_shape`` int64 [n, 3] (each response's routed-experts shape; rows -1: none) and
        ``routed_experts`` int16 (all of them back to back)."""
        n = len(self)
        for name in ("sample_index", "token_ids", "truncated", "rewards"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"ScoredResponses: {len(getattr(self, name))} {name} for {n} responses")
        meta = torch.tensor([[p, s, len(t), int(bool(c))] for p, s, t, c in
                             zip(self.prompt_index, self.sample_index, self.token_ids, self.truncated)],
                            dtype=torch.int64).reshape(n, _META_FIELDS)
        tokens = torch.tensor([t for ids in self.token_ids for t in ids], dtype=torch.int64)
        given = self.logprobs or [None] * n
        if len(given) != n:
            raise ValueError(f"ScoredResponses: {len(given)} logprobs for {n} responses")
        logprobs = []
        for ids, values in zip(self.token_ids, given):
            if values is not None and len(values) != len(ids):
                raise ValueError(f"ScoredResponses: {len(values)} log-probs for {len(ids)} tokens")
            logprobs.extend(values if values is not None else [math.nan] * len(ids))
        routed = self.routed_experts or [None] * n
        if len(routed) != n:
            raise ValueError(f"ScoredResponses: {len(routed)} routed experts for {n} responses")
        shapes = torch.tensor([tuple(r.shape) if r is not None else (-1, 0, 0) for r in routed],
                              dtype=torch.int64).reshape(n, 3)
        flat = [r.to(torch.int16).reshape(-1) for r in routed if r is not None]
        return {"meta": meta, "tokens": tokens, "rewards": torch.tensor(self.rewards, dtype=torch.float64),
                "logprobs": torch.tensor(logprobs, dtype=torch.float64), "routed_shape": shapes,
                "routed_experts": torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int16)}

    @classmethod
    def unpack(cls, meta: torch.Tensor, tokens: torch.Tensor, rewards: torch.Tensor,
               logprobs: torch.Tensor | None = None, routed_shape: torch.Tensor | None = None,
               routed_experts: torch.Tensor | None = None) -> "ScoredResponses":
        """The inverse of :meth:`pack` (tensors flattened in transit are fine; the routed experts are optional)."""
        meta_rows = meta.reshape(-1, _META_FIELDS).tolist()
        flat = tokens.tolist()
        flat_logprobs = logprobs.tolist() if logprobs is not None else [math.nan] * len(flat)
        shapes = routed_shape.reshape(-1, 3).tolist() if routed_shape is not None else [(-1, 0, 0)] * len(meta_rows)
        out, offset, routed_offset = cls(), 0, 0
        for (p, s, length, trunc), reward, shape in zip(meta_rows, rewards.tolist(), shapes):
            out.prompt_index.append(p)
            out.sample_index.append(s)
            out.token_ids.append(tuple(flat[offset:offset + length]))
            out.truncated.append(bool(trunc))
            out.rewards.append(float(reward))
            out.logprobs.append(tuple(flat_logprobs[offset:offset + length]))
            offset += length
            size = math.prod(shape) if shape[0] >= 0 else 0
            out.routed_experts.append(None if shape[0] < 0 else
                                      routed_experts[routed_offset:routed_offset + size].reshape(shape).clone())
            routed_offset += size
        if offset != len(flat):
            raise RuntimeError(f"packed rollout: {len(flat)} tokens for lengths summing to {offset}")
        if routed_experts is not None and routed_offset != routed_experts.numel():
            raise RuntimeError(f"packed rollout: {routed_experts.numel()} routed experts for shapes of {routed_offset}")
        return out

    def sorted(self) -> "ScoredResponses":
        """In canonical order: prompt index, then sample index."""
        order = sorted(range(len(self)), key=lambda i: (self.prompt_index[i], self.sample_index[i]))
        logprobs = self.logprobs or [None] * len(self)
        routed = self.routed_experts or [None] * len(self)
        return ScoredResponses(*([getattr(self, name)[i] for i in order] for name in
                                 ("prompt_index", "sample_index", "token_ids", "truncated", "rewards")),
                               [logprobs[i] for i in order], [routed[i] for i in order])


def _all_gather_padded(tensor: torch.Tensor, sizes: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """All-gather tensors whose first dimension differs by rank (``sizes``), padded to the largest."""
    largest = max(1, *sizes)  # gloo refuses empty tensors
    padded = torch.zeros((largest, *tensor.shape[1:]), dtype=tensor.dtype, device=device)
    padded[:tensor.shape[0]] = tensor.to(device)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return [part[:size].cpu() for part, size in zip(parts, sizes)]


def gather_rollout(local: ScoredResponses | None) -> ScoredResponses:
    """Collective over the default group: every rank's ``local`` share (``None`` or empty on ranks that are not
    engine leaders) to every rank, merged in canonical order. Raises if two shares hold the same response."""
    local = local or ScoredResponses()
    packed = local.pack()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ScoredResponses.unpack(**packed).sorted()
    device = collective_device()
    # gloo all-gathers no int16: the routed experts travel as their bytes
    packed["routed_experts"] = packed["routed_experts"].view(torch.uint8)
    sizes = {"meta": 0, "rewards": 0, "routed_shape": 0, "tokens": 1, "logprobs": 1, "routed_experts": 2}
    counts = torch.tensor([packed["meta"].shape[0], packed["tokens"].shape[0], packed["routed_experts"].shape[0]],
                          dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(all_counts, counts)
    gathered = {name: torch.cat(_all_gather_padded(tensor, [int(c[sizes[name]]) for c in all_counts], device))
                for name, tensor in packed.items()}
    gathered["routed_experts"] = gathered["routed_experts"].view(torch.int16)
    merged = ScoredResponses.unpack(**gathered).sorted()
    keys = list(zip(merged.prompt_index, merged.sample_index))
    if len(set(keys)) != len(keys):
        raise RuntimeError("gather_rollout: two engines returned the same (prompt, sample) response")
    return merged
