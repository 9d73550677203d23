"""From scored responses to Megatron micro-batches: sequences, response masks, per-sequence advantages.

Every sample carries its prompt id from generation to here; nothing is aligned by position. A step's samples are
split into mini-batches by prompt (all responses of ``mini_batch_prompts`` prompts make one optimizer step), a
mini-batch's samples over the data-parallel ranks, and a rank's share into micro-batches of equal shape (padded
with empty rows, mask 0, because pipeline stages exchange fixed-shape activations).

Token layout of one sequence (prompt p_0..p_{P-1}, response r_0..r_{R-1}):
    input_ids  = p_0 .. p_{P-1} r_0 .. r_{R-2}
    labels     = p_1 .. p_{P-1} r_0 .. r_{R-1}
    loss_mask  = 1 exactly where the label is a response token (positions P-1 .. P+R-2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One response with everything the update needs. ``index`` is its position in the step (stable ordering)."""

    index: int
    prompt_id: str
    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]
    reward: float
    advantage: float = 0.0

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_tokens)


def split_mini_batches(samples: list[Sample], prompt_order: list[str], prompts_per_mini_batch: int) -> list[list[Sample]]:
    """Group samples by prompt into mini-batches of ``prompts_per_mini_batch`` prompts, in ``prompt_order``."""
    by_prompt: dict[str, list[Sample]] = {}
    for sample in samples:
        by_prompt.setdefault(sample.prompt_id, []).append(sample)
    mini_batches = []
    for start in range(0, len(prompt_order), prompts_per_mini_batch):
        chunk = [s for pid in prompt_order[start:start + prompts_per_mini_batch] for s in by_prompt.get(pid, [])]
        mini_batches.append(chunk)
    return mini_batches


def shard_for_rank(samples: list[Sample], dp_rank: int, dp_size: int) -> list[Sample]:
    """This data-parallel rank's share: longest-first round robin, so ranks get similar token counts."""
    ordered = sorted(samples, key=lambda s: (-(len(s.prompt_tokens) + len(s.response_tokens)), s.index))
    return ordered[dp_rank::dp_size]


def response_token_count(samples: list[Sample]) -> int:
    return sum(s.num_response_tokens for s in samples)


def make_micro_batches(samples: list[Sample], micro_batch_size: int, pad_token_id: int,
                       num_micro_batches: int | None = None, fixed_shape: bool = True,
                       device: torch.device | str = "cpu", seq_multiple: int = 1) -> list[dict[str, torch.Tensor]]:
    """Pack samples into micro-batches of ``micro_batch_size`` rows.

    ``fixed_shape`` (needed with pipeline parallelism, whose stages exchange fixed-shape activations) pads the
    last micro-batch with empty rows; without it the last one is just shorter. ``num_micro_batches`` forces a
    count (padding with all-empty micro-batches) so that every rank of a pipeline runs the same schedule. Each micro-batch holds ``input_ids``, ``labels``, ``loss_mask``
    ([B, S]), ``advantages`` and ``sample_index`` ([B]; -1 for padding rows), on ``device`` (built on the CPU, moved
    once). S is the longest sequence rounded up to a multiple of ``seq_multiple`` (sequence parallelism splits S
    over the TP ranks).
    """
    count = max(1, -(-len(samples) // micro_batch_size))
    if num_micro_batches is not None:
        if num_micro_batches < count:
            raise ValueError(f"{len(samples)} samples need {count} micro-batches, {num_micro_batches} requested")
        count = num_micro_batches
    seq_len = max([len(s.prompt_tokens) + len(s.response_tokens) - 1 for s in samples] or [1])
    seq_len = -(-seq_len // seq_multiple) * seq_multiple
    micro_batches = []
    for m in range(count):
        rows = samples[m * micro_batch_size:(m + 1) * micro_batch_size]
        size = micro_batch_size if fixed_shape or not rows else len(rows)
        input_ids = torch.full((size, seq_len), pad_token_id, dtype=torch.long)
        labels = torch.full((size, seq_len), pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros((size, seq_len), dtype=torch.float32)
        advantages = torch.zeros(size, dtype=torch.float32)
        sample_index = torch.full((size,), -1, dtype=torch.long)
        for row, sample in enumerate(rows):
            tokens = torch.tensor(sample.prompt_tokens + sample.response_tokens, dtype=torch.long)
            n = tokens.numel() - 1
            input_ids[row, :n] = tokens[:-1]
            labels[row, :n] = tokens[1:]
            prompt_len = len(sample.prompt_tokens)
            loss_mask[row, prompt_len - 1:n] = 1.0
            advantages[row] = sample.advantage
            sample_index[row] = sample.index
        batch = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask, "advantages": advantages,
                 "sample_index": sample_index}
        micro_batches.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    return micro_batches


def scatter_token_values(micro_batch: dict[str, torch.Tensor], values: dict[int, torch.Tensor],
                         name: str) -> None:
    """Put per-sample token values (e.g. old log-probs, [R] per sample) at the response positions of a
    micro-batch as ``micro_batch[name]`` ([B, S], 0 elsewhere)."""
    out = torch.zeros_like(micro_batch["loss_mask"])
    for row, index in enumerate(micro_batch["sample_index"].tolist()):
        if index >= 0:
            positions = micro_batch["loss_mask"][row].nonzero().squeeze(-1)
            out[row, positions] = values[index].to(out.dtype)
    micro_batch[name] = out


def gather_token_values(micro_batch: dict[str, torch.Tensor], token_values: torch.Tensor) -> dict[int, torch.Tensor]:
    """Inverse of :func:`scatter_token_values`: ``{sample index: values at its response positions}``."""
    out = {}
    for row, index in enumerate(micro_batch["sample_index"].tolist()):
        if index >= 0:
            out[index] = token_values[row][micro_batch["loss_mask"][row].bool()].detach()
    return out
