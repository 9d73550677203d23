"""A Qwen model in Megatron-Core for the current parallel state: the model chunks of this pipeline stage on this
rank's device, optionally loaded from HF weights, and forward (and backward) through Megatron's pipeline schedules,
for any TP/PP/DP layout. No optimizer: the trainer's ``MegatronActor`` adds DDP and the optimizer on top; the
checkpoint converter uses this class as it is (forward-only logit checks).

Loss normalisation: the schedule is run with ``calculate_per_token_loss`` so that it neither divides the loss by
the number of micro-batches nor averages gradients over data-parallel ranks. The loss function therefore returns
``sum(per-token loss) / global_denominator`` where the caller's denominator counts the tokens of the whole
mini-batch on all data-parallel ranks: summing gradients over micro-batches and ranks then gives exactly the
mini-batch token-mean gradient, whatever the micro-batch size or the DP size.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Sequence, get_args

import torch

from megatron_dynamo.models.mappings import load_hf_weights, unwrap_model
from megatron_dynamo.models.moe_routing import MoERouting, RoutingPass
from megatron_dynamo.models.qwen import (QwenArchitecture, build_gpt_model, load_hf_config, parse_qwen_config,
                                         te_available)
from megatron_dynamo.parallel.runtime import current_device

MicroBatch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class OutputLayerInput:
    """What the loss function gets on the last pipeline stage with ``forward_backward(output="hidden")``: the hidden
    states entering the vocab-parallel output layer, [B, S, h] in the model dtype (sequence-parallel shards already
    gathered), and this rank's output weight shard [V/tp, h] (the embedding under tied embeddings). The loss
    computes logits only at the positions it needs, chunk by chunk, and never holds them all
    (``parallel.token_stats.fused_vocab_parallel_token_stats``). ``grad_reduced_by_gather``: the gradient of
    ``hidden`` is summed over the TP group by the sequence-parallel gather's backward (a reduce-scatter), so the
    fused routine must not all-reduce it too."""

    hidden: torch.Tensor
    weight: torch.Tensor
    grad_reduced_by_gather: bool


# "fp32_logits": the vocab-parallel logits [B, S, V/tp] as Megatron returns them (upcast to fp32 for bf16 models);
# "logits": the same in the model dtype (no upcast); "hidden": an OutputLayerInput (no logits at all).
ModelOutput = Literal["fp32_logits", "logits", "hidden"]
# loss_fn(logits [B, S, V/tp] or OutputLayerInput, micro_batch) -> (scalar loss, metrics dict)
LossFn = Callable[[Any, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


def pad_micro_batches(micro_batches: Sequence[MicroBatch], pad_values: dict[str, float] | None = None) -> list[MicroBatch]:
    """Right-pad every [B, S, ...] tensor of every micro-batch to the longest S, so that pipeline stages exchange
    activations of one shape. Right padding never changes earlier tokens under a causal mask. A packed micro-batch
    ([1, T], ``cu_seqlens``) gets a longer padding tail: its own segment in ``cu_seqlens`` (the last one extended
    when there is one already), ``token_row`` -1 there, so the padding is neither attended to nor trained on."""
    pad_values = {"token_row": -1, **(pad_values or {})}
    seq_len = max(mb["input_ids"].shape[1] for mb in micro_batches)
    padded = []
    for mb in micro_batches:
        out = {}
        for key, value in mb.items():
            if value.dim() >= 2 and value.shape[1] < seq_len:
                pad = value.new_full((value.shape[0], seq_len - value.shape[1], *value.shape[2:]),
                                     pad_values.get(key, 0))
                value = torch.cat([value, pad], dim=1)
            out[key] = value
        if "cu_seqlens" in mb and mb["input_ids"].shape[1] < seq_len:
            cu = mb["cu_seqlens"]
            has_tail = cu.numel() == mb["sample_index"].numel() + 2
            out["cu_seqlens"] = torch.cat([cu[:-1] if has_tail else cu, cu.new_full((1,), seq_len)])
        padded.append(out)
    return padded


def block_causal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Megatron's attention mask ([1, 1, T, T] bool, True = masked out) for sequences packed back to back
    (``cu_seqlens``): each token attends to the earlier tokens of its own sequence only."""
    bounds = cu_seqlens.to(torch.long)
    segment = torch.repeat_interleave(torch.arange(bounds.numel() - 1, device=bounds.device), bounds.diff(),
                                      output_size=length)
    causal = torch.ones(length, length, dtype=torch.bool, device=bounds.device).tril_()
    return ~(causal & (segment.unsqueeze(0) == segment.unsqueeze(1))).view(1, 1, length, length)


def packed_model_inputs(micro_batch: MicroBatch, use_te: bool) -> dict[str, Any]:
    """The attention inputs of a micro-batch for ``GPTModel.forward``: none for padded rows (the causal mask is
    built in the attention); for a packed one, ``packed_seq_params`` (THD, variable-length attention) on the
    Transformer Engine spec, or a block-diagonal causal ``attention_mask`` on the local spec, whose
    ``DotProductAttention`` refuses packed_seq_params (its PyTorch softmax uses a given mask in place of the
    causal one; see :meth:`MegatronModel._use_given_attention_masks` for the fused kernel).

    Positions: Qwen's GPTModel has no learned position embedding and ignores ``position_ids``; RoPE is computed
    for ``rotary_seq_len`` positions (megatron-core 0.16.1, ``GPTModel._preprocess``): with THD params for
    max_seqlen positions, applied per sequence from 0 through ``cu_seqlens``; on the local spec for 0..T-1 over
    the packed row, so a packed sequence is rotated by its offset. RoPE scores depend only on relative positions,
    so the offset changes the attention by float rounding only."""
    cu_seqlens = micro_batch.get("cu_seqlens")
    if cu_seqlens is None:
        return {"attention_mask": None}
    length = micro_batch["input_ids"].shape[1]
    if not use_te:
        return {"attention_mask": block_causal_mask(cu_seqlens, length)}
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = cu_seqlens.to(torch.int32)
    max_seqlen = int(cu_seqlens.diff().max())
    return {"attention_mask": None,
            "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens,
                                                 cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen,
                                                 max_seqlen_kv=max_seqlen)}


class MegatronModel:
    """A Qwen model in Megatron-Core for the current parallel state (call ``runtime.init_distributed`` first):
    inference only (no DDP wrapper, no optimizer). ``hf_weights(name)`` returns an HF tensor by name: when given,
    those weights are loaded; otherwise the model keeps Megatron's seeded random initialisation.
    """

    def __init__(self, model_config: QwenArchitecture | dict | str, dtype: str = "fp32",
                 use_te: bool | None = None, hf_weights: Callable[[str], torch.Tensor] | None = None,
                 **config_overrides):
        from megatron.core import parallel_state

        if isinstance(model_config, str):
            model_config = load_hf_config(model_config)
        self.arch = model_config if isinstance(model_config, QwenArchitecture) else parse_qwen_config(model_config)
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        stages = range(vp_size) if vp_size else [None]
        config_overrides.setdefault("calculate_per_token_loss", True)
        self.chunks = [build_gpt_model(self.arch, dtype, vp_stage=vp, use_te=use_te, **config_overrides)
                       for vp in stages]
        self.device = current_device()
        for chunk in self.chunks:
            chunk.to(self.device)
        self.config = unwrap_model(self.chunks[0]).config
        self.use_te = te_available() if use_te is None else use_te
        if hf_weights is not None:
            load_hf_weights(self.chunks, self.arch, hf_weights, te_spec=self.use_te)
        self.moe_routing = MoERouting(self.chunks) if self.arch.moe is not None else None

    # ------------------------------------------------------------------ compute
    def forward_backward(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn,
                         forward_only: bool = False, output: ModelOutput = "fp32_logits",
                         routing: RoutingPass | None = None) -> list[dict[str, Any]]:
        """Run all micro-batches through the pipeline schedule; return, on the last pipeline stage, each
        micro-batch's metrics dict from ``loss_fn`` (an empty list on other stages). Gradients accumulate in
        the DDP buffers when the chunks are wrapped for training (``trainer.actor.MegatronActor``: call its
        ``optimizer_step`` after the last micro-batch of a mini-batch). ``output`` is what
        ``loss_fn`` gets on the last stage (:data:`ModelOutput`).

        Mixture of experts: a micro-batch carrying ``routed_experts`` has them replayed where the model replays
        (``moe.routing_replay``); ``routing`` records the chosen experts or measures the routers
        (``models/moe_routing.py``)."""
        if output not in get_args(ModelOutput):
            raise ValueError(f"output must be one of {get_args(ModelOutput)}, got {output!r}")
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # Model inputs on the model's device (a no-op for micro-batches built there, as the trainer's are).
        micro_batches = [{k: v.to(self.device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches]
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            # Pipeline stages exchange activations of one shape (given to the schedule below).
            micro_batches = pad_micro_batches(micro_batches, {"routed_experts": -1})
            if len({mb["input_ids"].shape[0] for mb in micro_batches}) > 1:
                raise ValueError("with pipeline parallelism all micro-batches must have the same number of sequences")
        if not self.use_te and any("cu_seqlens" in mb for mb in micro_batches):
            self._use_given_attention_masks()
        batch_size, seq_len = micro_batches[0]["input_ids"].shape
        for chunk in self.chunks:
            chunk.train(not forward_only)
        # Each chunk's iterator yields (index, micro-batch): the routers record by micro-batch index.
        iterators = [iter(enumerate(micro_batches)) for _ in self.chunks]
        context = torch.no_grad() if forward_only else contextlib.nullcontext()
        try:
            with context:
                results = get_forward_backward_func()(
                    forward_step_func=self._forward_step(loss_fn, output, routing, len(micro_batches)),
                    data_iterator=iterators if len(iterators) > 1 else iterators[0],
                    model=self.chunks,
                    num_microbatches=len(micro_batches),
                    seq_length=seq_len,
                    micro_batch_size=batch_size,
                    forward_only=forward_only,
                )
        finally:
            if self.moe_routing is not None:
                self.moe_routing.finish()
        return list(results)

    def _forward_step(self, loss_fn: LossFn, output: ModelOutput, routing: RoutingPass | None, count: int):
        """The schedule's forward step: one micro-batch (of ``count``) through one model chunk."""
        # Megatron's Float16Module upcasts the last stage's output to fp32 unless told not to.
        output_kwargs = {"fp32_output": False} if output != "fp32_logits" and self.config.bf16 else {}

        def forward_step(data_iterator, model):
            index, mb = next(data_iterator)
            position_ids = mb.get("position_ids")
            if position_ids is None:
                ids = mb["input_ids"]
                position_ids = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            attention = packed_model_inputs(mb, self.use_te)  # mask / packed_seq_params: padded or packed
            with self._routed(model, index, count, mb, routing) as outputs, \
                    _output_layer_bypassed(model, output == "hidden") as bypassed:
                model_output = model(mb["input_ids"], position_ids, **attention, **output_kwargs)
                outputs.append(model_output)
            if bypassed:
                model_output = OutputLayerInput(model_output, *bypassed)
            return model_output, functools.partial(_schedule_loss, loss_fn, mb)

        return forward_step

    def _routed(self, model, index: int, count: int, micro_batch: MicroBatch, routing: RoutingPass | None):
        """Around a chunk's forward of micro-batch ``index`` (of ``count``): its routers replay, record, measure,
        weigh the aux losses (``MoERouting.micro_batch``); nothing for a dense model."""
        if self.moe_routing is None:
            return contextlib.nullcontext([])
        chunk = next(i for i, c in enumerate(self.chunks) if c is model)
        return self.moe_routing.micro_batch(chunk, index, count, micro_batch, routing)

    def _use_given_attention_masks(self) -> None:
        """Packed micro-batches on the local spec: Megatron's fused softmax kernel (bf16/fp16 on CUDA) applies
        its own upper-triangular mask for the causal mask type and ignores a given one, so the block-diagonal
        mask needs the PyTorch softmax path, which uses the mask it is given."""
        from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

        for chunk in self.chunks:
            for module in chunk.modules():
                if isinstance(module, FusedScaleMaskSoftmax):
                    module.scaled_masked_softmax_fusion = False

    @property
    def sequence_multiple(self) -> int:
        """Sequence lengths must be a multiple of this: the TP size under sequence parallelism, else 1."""
        return self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1

    def named_parameters(self):
        """This rank's parameters with Megatron names (no DDP/Float16Module prefixes), chunk by chunk."""
        for chunk in self.chunks:
            yield from unwrap_model(chunk).named_parameters()


@contextlib.contextmanager
def _output_layer_bypassed(model, bypass: bool) -> Iterator[list]:
    """With ``bypass``, within the block the output layer of ``model`` (on the last pipeline stage) returns its
    input, the final hidden states, instead of computing logits; the yielded list is then [output weight,
    grad_reduced_by_gather] (empty on other stages, or without ``bypass``). The layer's own ``forward`` is shadowed
    by an instance attribute for the block only, so its parameters, names and state dict stay as they are."""
    module = unwrap_model(model)
    layer = getattr(module, "output_layer", None) if getattr(module, "post_process", False) else None
    captured: list = []
    if not bypass or layer is None:
        yield captured
        return

    def hidden_states_out(hidden_states, weight=None, runtime_gather_output=None):
        captured.extend([layer.weight if weight is None else weight, bool(layer.sequence_parallel)])
        if layer.sequence_parallel:
            # As the layer itself would: all-gather the sequence shards; the backward reduce-scatters (sums) the
            # per-rank partial gradients of the vocabulary shards.
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True,
                                                                 group=layer.tp_group)
        return hidden_states, None

    layer.forward = hidden_states_out
    try:
        yield captured
    finally:
        del layer.forward


def _schedule_loss(loss_fn: LossFn, micro_batch: MicroBatch, output):
    loss, metrics = loss_fn(output, micro_batch)
    # A 3-tuple tells the schedule (with calculate_per_token_loss) to leave the loss unscaled.
    return loss, torch.tensor(1, dtype=torch.int, device=loss.device), metrics

