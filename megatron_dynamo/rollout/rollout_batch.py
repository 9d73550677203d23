"""One step's scored rollout, as the rollout stage hands it to the update: the prompts, their counts, the responses
with rewards and the engine's log-probs, and what the prompt history and the data position became after it.

The same record serves three places: the colocated trainer produces and consumes it in one process; engine ranks
(``rollout.placement: separate``) send it to the trainer ranks (``rollout/channel.py``); and a checkpoint keeps
the batches already generated but not yet trained on (``rollout.max_staleness`` > 0). For the last two it becomes
plain tensors and a JSON text (:meth:`RolloutBatch.to_tensors`, :meth:`RolloutBatch.from_tensors`): no pickled
object ever travels or lands on disk.

``version`` is the policy version that generated it: the number of optimizer updates (training steps) behind the
weights the engine held. Batch ``step`` is trained on by the weights of version ``step - 1``, so its staleness is
``step - 1 - version`` (0: on-policy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron_dynamo.rollout.exchange import PACKED_NAMES, ScoredResponses


@dataclass
class RolloutBatch:
    """The scored rollout of training step ``step``.

    ``example_indices``: the step's prompts (those trained on), as indices into the run's example list (every rank
    loads the same list); ``prompt_tokens``: each prompt's token ids (as the engine saw them); ``counts``:
    responses per prompt; ``responses``: the scored responses, ``prompt_index`` pointing into the step's prompts,
    in canonical order; ``history_index`` / ``history_correct``: the (example index, 0/1) results the prompt
    history took from this batch (one per scored response, dropped groups of dynamic sampling included), in
    ``history_updates`` updates of those sizes (one per generation round); ``sampler_state``: the data sampler's
    state after drawing this batch's prompts; ``rollouts`` / ``reward_mean``: the responses generated for the step
    and their mean reward (with dynamic sampling every round's, dropped groups included; None: those of
    ``counts`` and ``responses``); ``metrics``: what the rollout stage measured (reward statistics, stage seconds
    ``time/<stage>``); the responses' routed experts, where the engines returned them, travel with them
    (``ScoredResponses.routed_experts``); ``stop_signal``: the stop signal a rank that generated it received (0:
    none)."""

    step: int
    version: int
    example_indices: list[int]
    prompt_tokens: list[tuple[int, ...]]
    counts: list[int]
    variance_ratio: float
    responses: ScoredResponses
    history_index: list[int] = field(default_factory=list)
    history_correct: list[int] = field(default_factory=list)
    sampler_state: dict[str, Any] = field(default_factory=dict)
    history_updates: list[int] | None = None
    rollouts: int | None = None
    reward_mean: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    stop_signal: int = 0

    def __post_init__(self) -> None:
        # Without dynamic sampling the step generated exactly what it trains on, in one round.
        if self.history_updates is None:
            self.history_updates = [len(self.history_index)]
        if self.rollouts is None:
            self.rollouts = int(sum(self.counts))
        if self.reward_mean is None:
            rewards = self.responses.rewards
            self.reward_mean = float(np.mean(rewards)) if rewards else 0.0

    @property
    def staleness(self) -> int:
        """How many updates the policy that trains on this batch is ahead of the one that generated it."""
        return self.step - 1 - self.version

    def history_rounds(self) -> list[tuple[list[int], list[int]]]:
        """The prompt history's updates from this batch, in order: (example indices, 0/1 results), one per
        generation round."""
        out, start = [], 0
        for size in self.history_updates:
            out.append((self.history_index[start:start + size], self.history_correct[start:start + size]))
            start += size
        if start != len(self.history_index):
            raise ValueError(f"rollout batch: history updates of {self.history_updates} results for "
                             f"{len(self.history_index)}")
        return out

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Plain tensors (CPU): the responses packed as ``ScoredResponses.pack`` packs them (their routed experts
        included), the prompt tokens back to back, and the rest as one JSON text in a uint8 tensor."""
        flat_prompts = [t for ids in self.prompt_tokens for t in ids]
        header = {"step": self.step, "version": self.version, "example_indices": self.example_indices,
                  "prompt_lengths": [len(ids) for ids in self.prompt_tokens], "counts": self.counts,
                  "variance_ratio": self.variance_ratio, "history_index": self.history_index,
                  "history_correct": self.history_correct, "history_updates": self.history_updates,
                  "sampler_state": self.sampler_state, "rollouts": self.rollouts, "reward_mean": self.reward_mean,
                  "metrics": self.metrics, "stop_signal": self.stop_signal}
        return {**self.responses.pack(), "prompt_tokens": torch.tensor(flat_prompts, dtype=torch.int64),
                "header": text_tensor(json.dumps(header))}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "RolloutBatch":
        header = json.loads(tensor_text(tensors["header"]))
        flat, prompt_tokens, offset = tensors["prompt_tokens"].tolist(), [], 0
        for length in header["prompt_lengths"]:
            prompt_tokens.append(tuple(flat[offset:offset + length]))
            offset += length
        if offset != len(flat):
            raise ValueError(f"rollout batch: {len(flat)} prompt tokens for lengths summing to {offset}")
        # a checkpoint written before routed experts travelled has none
        responses = ScoredResponses.unpack(**{name: tensors[name] for name in PACKED_NAMES if name in tensors})
        return cls(step=int(header["step"]), version=int(header["version"]),
                   example_indices=[int(i) for i in header["example_indices"]], prompt_tokens=prompt_tokens,
                   counts=[int(c) for c in header["counts"]], variance_ratio=float(header["variance_ratio"]),
                   responses=responses, history_index=[int(i) for i in header["history_index"]],
                   history_correct=[int(c) for c in header["history_correct"]],
                   history_updates=header.get("history_updates"), sampler_state=header["sampler_state"],
                   rollouts=header.get("rollouts"), reward_mean=header.get("reward_mean"), metrics=header["metrics"],
                   stop_signal=int(header["stop_signal"]))


#: The tensors of a batch, in the order they travel.
TENSOR_NAMES = ("header", *PACKED_NAMES, "prompt_tokens")


def text_tensor(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a uint8 tensor (at least one byte: gloo refuses empty tensors)."""
    data = text.encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone() if data else torch.zeros(0, dtype=torch.uint8)


def tensor_text(tensor: torch.Tensor) -> str:
    return tensor.cpu().to(torch.uint8).numpy().tobytes().decode("utf-8")
