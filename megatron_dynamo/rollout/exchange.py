"""Every engine's scored responses to every rank, as packed tensors (no pickled Python objects of the rollout).

After generation each engine leader holds the responses of the prompts assigned to its engine, and their rewards.
:func:`gather_rollout` packs them into three tensors per leader (integers per response: prompt index, sample index,
length, truncated; the token ids back to back; the rewards) and all-gathers them over the default group (other
ranks contribute empty tensors), and the engine's log-prob of every sampled token the same way (float64, NaN where
the engine gave none), for the trainer's engine-vs-trainer gap metrics and ``dynamo.loss.engine_is``, and, where the
engines returned them, each response's routed experts (a mixture-of-experts model's ``moe.routing_replay:
rollout``). Every rank then holds the whole step's rollout in one canonical order, prompt order then sample index:
the order a single engine produces. Prompt ids and prompt tokens never travel: every rank has
the step's prompts (same sampler, same tokenizer) and refers to them by index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_dynamo.parallel.runtime import collective_device

_META_FIELDS = 4  # prompt index, sample index, response length, truncated


@dataclass
class ScoredResponses:
    """Responses of one step (or one engine's share of it), by prompt index into the step's prompt list."""

    prompt_index: list[int] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)
    token_ids: list[tuple[int, ...]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    logprobs: list[tuple[float, ...] | None] = field(default_factory=list)  # the engine's; empty: none at all
    # the engine's experts of each response's input tokens (GenerationResponse.routed_experts); empty: none at all
    routed_experts: list[torch.Tensor | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_index)

    def pack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(meta int64 [n, 4], tokens int64 [sum of lengths], rewards float64 [n], logprobs float64 [sum of
        lengths])``; a response without log-probs gets NaN."""
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
        return (meta, tokens, torch.tensor(self.rewards, dtype=torch.float64),
                torch.tensor(logprobs, dtype=torch.float64))

    @classmethod
    def unpack(cls, meta: torch.Tensor, tokens: torch.Tensor, rewards: torch.Tensor,
               logprobs: torch.Tensor | None = None) -> "ScoredResponses":
        meta_rows = meta.tolist()
        flat = tokens.tolist()
        flat_logprobs = logprobs.tolist() if logprobs is not None else [math.nan] * len(flat)
        out, offset = cls(), 0
        for (p, s, length, trunc), reward in zip(meta_rows, rewards.tolist()):
            out.prompt_index.append(p)
            out.sample_index.append(s)
            out.token_ids.append(tuple(flat[offset:offset + length]))
            out.truncated.append(bool(trunc))
            out.rewards.append(float(reward))
            out.logprobs.append(tuple(flat_logprobs[offset:offset + length]))
            offset += length
        if offset != len(flat):
            raise RuntimeError(f"packed rollout: {len(flat)} tokens for lengths summing to {offset}")
        return out

    def sorted(self) -> "ScoredResponses":
        """In canonical order: prompt index, then sample index."""
        order = sorted(range(len(self)), key=lambda i: (self.prompt_index[i], self.sample_index[i]))
        logprobs = self.logprobs or [None] * len(self)
        routed = [self.routed_experts[i] for i in order] if self.routed_experts else []
        return ScoredResponses(*([getattr(self, name)[i] for i in order] for name in
                                 ("prompt_index", "sample_index", "token_ids", "truncated", "rewards")),
                               [logprobs[i] for i in order], routed)


def pack_routed_experts(values: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Responses' routed experts as one int32 tensor: per response its shape (rows, layers, k; 0, 0, 0 without
    any), then its experts. Empty when none has any."""
    if all(v is None for v in values):
        return torch.zeros(0, dtype=torch.int32)
    parts = []
    for v in values:
        shape = tuple(v.shape) if v is not None else (0, 0, 0)
        parts.append(torch.tensor(shape, dtype=torch.int32))
        if v is not None:
            parts.append(v.reshape(-1).to(torch.int32))
    return torch.cat(parts)


def unpack_routed_experts(flat: torch.Tensor, count: int) -> list[torch.Tensor | None]:
    """Inverse of :func:`pack_routed_experts` for ``count`` responses (int16 experts); [] from an empty tensor."""
    if not flat.numel():
        return []
    out, offset = [], 0
    for _ in range(count):
        rows, layers, k = flat[offset:offset + 3].tolist()
        offset += 3
        size = rows * layers * k
        out.append(flat[offset:offset + size].reshape(rows, layers, k).to(torch.int16) if size else None)
        offset += size
    if offset != flat.numel():
        raise RuntimeError(f"packed routed experts: {flat.numel()} values, {offset} read for {count} responses")
    return out


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
    meta, tokens, rewards, logprobs = local.pack()
    routed = pack_routed_experts(local.routed_experts)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        merged = ScoredResponses.unpack(meta, tokens, rewards, logprobs)
        merged.routed_experts = unpack_routed_experts(routed, len(merged))
        return merged.sorted()
    device = collective_device()
    counts = torch.tensor([meta.shape[0], tokens.shape[0], routed.numel()], dtype=torch.int64, device=device)
    all_counts = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(all_counts, counts)
    responses = [int(c[0]) for c in all_counts]
    token_counts = [int(c[1]) for c in all_counts]
    metas = _all_gather_padded(meta, responses, device)
    token_parts = _all_gather_padded(tokens, token_counts, device)
    reward_parts = _all_gather_padded(rewards, responses, device)
    logprob_parts = _all_gather_padded(logprobs, token_counts, device)
    merged = ScoredResponses.unpack(torch.cat(metas), torch.cat(token_parts), torch.cat(reward_parts),
                                    torch.cat(logprob_parts))
    routed_counts = [int(c[2]) for c in all_counts]
    if any(routed_counts):  # the engines returned routed experts (SamplingConfig.routed_experts)
        parts = _all_gather_padded(routed, routed_counts, device)
        merged.routed_experts = [v for part, n in zip(parts, responses) if n
                                 for v in (unpack_routed_experts(part, n) or [None] * n)]
    merged = merged.sorted()
    keys = list(zip(merged.prompt_index, merged.sample_index))
    if len(set(keys)) != len(keys):
        raise RuntimeError("gather_rollout: two engines returned the same (prompt, sample) response")
    return merged
