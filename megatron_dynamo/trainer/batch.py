"""From scored responses to Megatron micro-batches: sequences, response masks, per-sequence advantages.

Every sample carries its prompt id from generation to here; nothing is aligned by position. A step's samples are
split into mini-batches by prompt (all responses of ``mini_batch_prompts`` prompts make one optimizer step), a
mini-batch's samples over the data-parallel ranks, and a rank's share into micro-batches: ``micro_batch_size``
sequences each, or (``trainer.micro_batch_tokens``) bins of at most that many tokens, balanced over the ranks by
tokens (:func:`plan_token_micro_batches`). A micro-batch (an :class:`UpdateBatch`) is padded ([B, S] rows) or packed
(one row, the sequences back to back, no padding: :func:`packed_micro_batch`). Under pipeline parallelism all
micro-batches of a rank get one shape (padded with empty rows, mask 0), because pipeline stages exchange fixed-shape
activations.

Token layout of one sequence (prompt p_0..p_{P-1}, response r_0..r_{R-1}):
    input_ids  = p_0 .. p_{P-1} r_0 .. r_{R-2}
    labels     = p_1 .. p_{P-1} r_0 .. r_{R-1}
    loss_mask  = 1 exactly where the label is a response token (positions P-1 .. P+R-2)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

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
    engine_logp: tuple[float, ...] | None = None  # the rollout engine's log-prob of each response token
    loss_weight: float = 1.0  # its prompt's weight in the loss (algorithms/prompt_weights.py)
    # Mixture of experts: the engine's experts of each input token (prompt + response - 1), int [n, MoE layers, k].
    routed_experts: torch.Tensor | None = None

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_tokens)


@dataclass(slots=True)
class UpdateBatch:
    """One micro-batch of the update: the tensors of its sequences, padded ([B, S] rows) or packed ([1, T], one row,
    with ``position_ids``, ``token_row`` and ``cu_seqlens``), and the per-token values the update puts in before
    its loss reads them. Per-token tensors are shaped like ``loss_mask``; per-sequence ones have one entry a
    sequence (a row, or a packed sequence)."""

    input_ids: torch.Tensor  # long
    labels: torch.Tensor  # long: the next token of each position
    loss_mask: torch.Tensor  # float32: 1 exactly at the response tokens' labels
    advantages: torch.Tensor  # float32, per sequence
    loss_weight: torch.Tensor  # float64, per sequence: its prompt's weight in the loss
    sample_index: torch.Tensor  # long, per sequence: the sample's index in the step, -1 for an empty row
    position_ids: torch.Tensor | None = None  # packed: restarting at 0 for every sequence
    token_row: torch.Tensor | None = None  # packed: the index of each token's sequence, -1 on the padding tail
    cu_seqlens: torch.Tensor | None = None  # packed: int32 cumulative sequence lengths
    old_logp: torch.Tensor | None = None  # per token: the old policy's log-probs (the old-log-prob pass)
    engine_logp: torch.Tensor | None = None  # per token: the rollout engine's log-probs
    selection: torch.Tensor | None = None  # per token: a baseline's mini-batch-wide token selection
    # per token: the experts to replay or compare with, [B, S, MoE layers, k] (or [1, T, ...]), -1: none
    # (models/moe_routing.py)
    routed_experts: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors it holds by name, as the model layer takes a micro-batch (``models.megatron_model``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to(self, device: torch.device | str) -> UpdateBatch:
        return replace(self, **{k: v.to(device, non_blocking=True) for k, v in self.tensors().items()})


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


def sequence_length(sample: Sample) -> int:
    """Tokens the model processes for ``sample``: prompt + response - 1 (the last token is only a label)."""
    return len(sample.prompt_tokens) + len(sample.response_tokens) - 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def resolve_pack_sequences(setting: bool | str, use_te: bool) -> bool:
    """``trainer.pack_sequences``: "auto" packs where the layer spec has variable-length attention (Transformer
    Engine, THD); on the local spec packing costs more than it saves on CPU (docs: README, trainer keys), so
    "auto" pads there. True packs on either spec (the local spec gets a block-diagonal causal mask)."""
    if setting == "auto":
        return bool(use_te)
    return bool(setting)


def micro_batch_cost(lengths: list[int], packed: bool, seq_multiple: int = 1) -> int:
    """Tokens a micro-batch of sequences of ``lengths`` occupies: their sum packed, rows x the longest padded
    (both rounded up to ``seq_multiple``)."""
    if not lengths:
        return 0
    if packed:
        return _round_up(sum(lengths), seq_multiple)
    return len(lengths) * _round_up(max(lengths), seq_multiple)


def balance_over_ranks(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Indices of ``lengths`` per rank, balanced by tokens: longest first (ties: lower index), each to the rank
    with the fewest tokens so far (ties: lower rank). Deterministic, so every rank computes the same split alone.
    The heaviest rank exceeds the lightest by at most the longest sequence."""
    loads = [0] * num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        shares[rank].append(i)
        loads[rank] += lengths[i]
    return shares


def plan_micro_batches(lengths: list[int], max_tokens: int, packed: bool = False,
                       seq_multiple: int = 1) -> list[list[int]]:
    """Bin sequence indices into micro-batches of at most ``max_tokens`` tokens (:func:`micro_batch_cost`); a
    sequence over the budget alone gets a micro-batch of its own. Sequences are taken longest first, so similar
    lengths share a micro-batch (little padding): padded micro-batches are consecutive runs of that order (a new
    one starts when the next sequence does not fit); packed ones are filled first-fit (no padding to waste, so the
    fewest micro-batches). Deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    if not packed:
        for i in order:
            if bins and micro_batch_cost([lengths[j] for j in bins[-1]] + [lengths[i]], False,
                                         seq_multiple) <= max_tokens:
                bins[-1].append(i)
            else:
                bins.append([i])
        return bins
    used: list[int] = []
    for i in order:
        for b, total in enumerate(used):
            if _round_up(total + lengths[i], seq_multiple) <= max_tokens:
                bins[b].append(i)
                used[b] += lengths[i]
                break
        else:
            bins.append([i])
            used.append(lengths[i])
    return bins


def plan_fixed_shape_micro_batches(lengths: list[int], max_tokens: int, seq_multiple: int = 1) -> list[list[int]]:
    """Padded micro-batches that must all have one shape [B, S] (pipeline parallelism: the schedule takes one
    ``micro_batch_size`` and ``seq_length`` per call): S is the longest sequence (rounded up to ``seq_multiple``),
    B = max(1, ``max_tokens`` // S), and the sequences, longest first, fill consecutive bins of B. Every micro-batch
    then stays within the budget (unless S alone exceeds it) and holds the least padding one shape allows; binning
    by :func:`plan_micro_batches` first and padding each bin to the largest bin's rows times S afterwards made a
    1000-token budget 20 x 999-token micro-batches."""
    if not lengths:
        return []
    rows = max(1, max_tokens // _round_up(max(lengths), seq_multiple))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[start:start + rows] for start in range(0, len(order), rows)]


def plan_token_micro_batches(samples: list[Sample], num_ranks: int, max_tokens: int, packed: bool = False,
                             seq_multiple: int = 1, fixed_shape: bool = False) -> list[list[list[Sample]]]:
    """A mini-batch's dynamic micro-batches (``trainer.micro_batch_tokens``): per data-parallel rank, its
    micro-batches as lists of samples. The samples are split over the ranks balanced by tokens
    (:func:`balance_over_ranks`), each rank's share binned by :func:`plan_micro_batches` (padded with
    ``fixed_shape``, pipeline parallelism: :func:`plan_fixed_shape_micro_batches`); every rank gets the same
    number of micro-batches (the largest count; the others end with empty ones). Every rank holds all samples
    of the step, so each computes this plan alone and takes its own part."""
    lengths = [sequence_length(s) for s in samples]
    plan = []
    for share in balance_over_ranks(lengths, num_ranks):
        if fixed_shape and not packed:
            bins = plan_fixed_shape_micro_batches([lengths[i] for i in share], max_tokens, seq_multiple)
        else:
            bins = plan_micro_batches([lengths[i] for i in share], max_tokens, packed, seq_multiple)
        plan.append([[samples[share[j]] for j in b] for b in bins])
    count = max(1, max(len(p) for p in plan))
    return [p + [[] for _ in range(count - len(p))] for p in plan]


def make_micro_batches(samples: list[Sample], micro_batch_size: int, pad_token_id: int,
                       num_micro_batches: int | None = None, fixed_shape: bool = True,
                       device: torch.device | str = "cpu", seq_multiple: int = 1,
                       packed: bool = False) -> list[UpdateBatch]:
    """Split samples into micro-batches of ``micro_batch_size`` sequences (:func:`build_micro_batches`).

    ``fixed_shape`` (needed with pipeline parallelism, whose stages exchange fixed-shape activations) pads the
    last micro-batch with empty rows; without it the last one is just shorter. ``num_micro_batches`` forces a
    count (padding with all-empty micro-batches) so that every rank of a pipeline runs the same schedule. Padded
    micro-batches all have the longest sequence's length S, as before token budgets existed.
    """
    count = max(1, -(-len(samples) // micro_batch_size))
    if num_micro_batches is not None:
        if num_micro_batches < count:
            raise ValueError(f"{len(samples)} samples need {count} micro-batches, {num_micro_batches} requested")
        count = num_micro_batches
    groups = [samples[m * micro_batch_size:(m + 1) * micro_batch_size] for m in range(count)]
    return build_micro_batches(groups, pad_token_id, fixed_shape=fixed_shape, device=device,
                               seq_multiple=seq_multiple, packed=packed, rows=micro_batch_size, common_seq_len=True)


def build_micro_batches(groups: list[list[Sample]], pad_token_id: int, fixed_shape: bool = True,
                        device: torch.device | str = "cpu", seq_multiple: int = 1, packed: bool = False,
                        rows: int | None = None, common_seq_len: bool = False) -> list[UpdateBatch]:
    """One micro-batch per group of samples, built on the CPU and moved to ``device`` once.

    Padded (``packed=False``): ``input_ids``, ``labels``, ``loss_mask`` [B, S], ``advantages``, ``loss_weight``
    (float64) and ``sample_index`` [B] (-1 for empty rows). S is the group's longest sequence rounded up to ``seq_multiple``
    (sequence parallelism splits S over the TP ranks), or the longest of all groups with ``common_seq_len``; B the
    group's size, ``rows`` for an empty group. With ``fixed_shape`` every micro-batch gets the same shape: ``rows``
    (else the largest group) rows and the longest sequence of all groups.

    Packed: the group's sequences one after the other in a single row (:func:`packed_micro_batch`); with
    ``fixed_shape`` all of the same length T (the padding tail is a segment of its own).
    """
    lengths = [[sequence_length(s) for s in g] for g in groups]
    longest = max([max(ls) for ls in lengths if ls] or [1])
    if packed:
        total = max(sum(ls) for ls in lengths) if fixed_shape else None
        batches = [packed_micro_batch(g, pad_token_id, seq_multiple, total) for g in groups]
    else:
        num_rows = max([rows or 1] + [len(g) for g in groups]) if fixed_shape else None
        batches = []
        for g, ls in zip(groups, lengths):
            seq_len = longest if fixed_shape or common_seq_len else max(ls or [1])
            size = num_rows if fixed_shape else (len(g) or rows or 1)
            batches.append(padded_micro_batch(g, pad_token_id, size, _round_up(seq_len, seq_multiple)))
    return [mb.to(device) for mb in batches]


def padded_micro_batch(samples: list[Sample], pad_token_id: int, num_rows: int,
                       seq_len: int) -> UpdateBatch:
    """``samples`` as the rows of [num_rows, seq_len] tensors (see the module docstring for the token layout). The
    rows are built as lists and become tensors at once: a few tensor operations a micro-batch, not seven a row."""
    ids, labels, mask = [], [], []
    for sample in samples:
        tokens, start = sample.prompt_tokens + sample.response_tokens, len(sample.prompt_tokens) - 1
        n = len(tokens) - 1
        ids.append([*tokens[:-1], *[pad_token_id] * (seq_len - n)])
        labels.append([*tokens[1:], *[pad_token_id] * (seq_len - n)])
        mask.append([0.0] * start + [1.0] * (n - start) + [0.0] * (seq_len - n))
    empty = num_rows - len(samples)
    padding = [[pad_token_id] * seq_len] * empty
    return UpdateBatch(input_ids=torch.tensor(ids + padding, dtype=torch.long).view(num_rows, seq_len),
                       labels=torch.tensor(labels + padding, dtype=torch.long).view(num_rows, seq_len),
                       loss_mask=torch.tensor(mask + [[0.0] * seq_len] * empty).view(num_rows, seq_len),
                       advantages=torch.tensor([s.advantage for s in samples] + [0.0] * empty, dtype=torch.float32),
                       loss_weight=torch.tensor([s.loss_weight for s in samples] + [0.0] * empty,
                                                dtype=torch.float64),
                       sample_index=torch.tensor([s.index for s in samples] + [-1] * empty, dtype=torch.long),
                       routed_experts=routed_experts_rows(samples, [(row, 0) for row in range(len(samples))],
                                                          (num_rows, seq_len)))


def routed_experts_rows(samples: list[Sample], starts: list[tuple[int, int]],
                        shape: tuple[int, int]) -> torch.Tensor | None:
    """The samples' ``routed_experts`` in a micro-batch's token layout ``shape`` ([B, S] or [1, T]), each from its
    (row, first position) in ``starts``: [*shape, layers, k], -1 elsewhere; None when no sample carries any."""
    given = [s.routed_experts for s in samples if s.routed_experts is not None]
    if not given:
        return None
    out = torch.full((*shape, *given[0].shape[1:]), -1, dtype=given[0].dtype)
    for sample, (row, start) in zip(samples, starts):
        if sample.routed_experts is not None:
            out[row, start:start + sample.routed_experts.shape[0]] = sample.routed_experts
    return out


def packed_micro_batch(samples: list[Sample], pad_token_id: int, seq_multiple: int = 1,
                       length: int | None = None) -> UpdateBatch:
    """``samples`` packed without padding into one row of T tokens: T is their total length (at least
    ``length``, at least 1) rounded up to ``seq_multiple``; a padding tail forms a segment of its own.

    ``input_ids``, ``labels``, ``loss_mask``, ``position_ids`` (restarting at 0 for every sequence) and
    ``token_row`` (the index 0..n-1 of each token's sequence, -1 on the padding tail) are [1, T]; ``cu_seqlens``
    (int32, [n+1], or [n+2] with a padding tail) the cumulative sequence lengths; ``advantages``, ``loss_weight``
    and ``sample_index`` [n] one per sequence.
    """
    lengths = [sequence_length(s) for s in samples]
    used = sum(lengths)
    total = _round_up(max(used, length or 0, 1), seq_multiple)
    input_ids = torch.full((1, total), pad_token_id, dtype=torch.long)
    labels = torch.full((1, total), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((1, total), dtype=torch.float32)
    position_ids = torch.zeros((1, total), dtype=torch.long)
    token_row = torch.full((1, total), -1, dtype=torch.long)
    cu_seqlens = [0]
    for i, (sample, n) in enumerate(zip(samples, lengths)):
        start = cu_seqlens[-1]
        tokens = torch.tensor(sample.prompt_tokens + sample.response_tokens, dtype=torch.long)
        input_ids[0, start:start + n] = tokens[:-1]
        labels[0, start:start + n] = tokens[1:]
        loss_mask[0, start + len(sample.prompt_tokens) - 1:start + n] = 1.0
        position_ids[0, start:start + n] = torch.arange(n)
        token_row[0, start:start + n] = i
        cu_seqlens.append(start + n)
    if total > used:
        position_ids[0, used:] = torch.arange(total - used)
        cu_seqlens.append(total)
    return UpdateBatch(input_ids=input_ids, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
                       token_row=token_row, cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32),
                       advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
                       loss_weight=torch.tensor([s.loss_weight for s in samples], dtype=torch.float64),
                       sample_index=torch.tensor([s.index for s in samples], dtype=torch.long),
                       routed_experts=routed_experts_rows(samples, [(0, start) for start in cu_seqlens[:-1]],
                                                          (1, total)))


def _response_counts(micro_batch: UpdateBatch) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The micro-batch's response positions (its loss mask as booleans) and (sample index, number of positions) per
    real sequence, in the order its positions come in the mask (row-major: by row, or along the packed row)."""
    mask = micro_batch.loss_mask.bool()
    indices = micro_batch.sample_index.tolist()
    if micro_batch.token_row is None:
        counts = mask.sum(dim=1).tolist()
    else:
        counts = torch.bincount(micro_batch.token_row[mask], minlength=len(indices)).tolist()
    return mask, [(index, count) for index, count in zip(indices, counts) if index >= 0]


def token_values(micro_batch: UpdateBatch, values: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """Per-sample token values (e.g. old log-probs, [R] per sample) at the response positions of a micro-batch, in
    its per-token layout (shaped like ``loss_mask``: [B, S], or [1, T] packed; 0 elsewhere, and everywhere without
    ``values``). The values may live on the host (the engine's log-probs): they are copied to the micro-batch's
    device."""
    out = torch.zeros_like(micro_batch.loss_mask)
    if values is not None:
        mask, counts = _response_counts(micro_batch)
        if [len(values[index]) for index, _ in counts] != [count for _, count in counts]:
            raise ValueError("token_values: a sample's values do not match its response positions")
        if counts:
            out[mask] = torch.cat([values[index] for index, _ in counts]).to(device=out.device, dtype=out.dtype)
    return out


def gather_token_values(micro_batch: UpdateBatch, token_values: torch.Tensor) -> dict[int, torch.Tensor]:
    """Inverse of :func:`token_values`: ``{sample index: values at its response positions}``."""
    mask, counts = _response_counts(micro_batch)
    values = token_values[mask].detach().split([count for _, count in counts])
    return {index: v for (index, _), v in zip(counts, values)}
