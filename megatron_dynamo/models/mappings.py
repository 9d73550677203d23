"""Typed HF <-> Megatron parameter mappings for Qwen2 / Qwen2.5 / Qwen3 and Qwen2-MoE / Qwen3-MoE.

Each mapping knows one Megatron parameter (per layer where templated), the HF tensors it is made of, how the
parameter is split over tensor-parallel ranks, and how to go both ways:

- ``to_megatron(hf_tensors, tp_rank, tp_size)`` -> this rank's shard;
- ``to_hf(shards)`` (the shards of every TP rank, in rank order) -> the HF tensors.

Layouts (Megatron-Core GPTModel, local or Transformer-Engine spec):
- ``linear_qkv``: rows grouped per query group g: [q heads of g (heads/groups x head_dim rows), k_g, v_g]; a TP
  rank holds a contiguous run of whole groups.
- ``linear_fc1`` (SwiGLU): each TP rank holds [gate shard r; up shard r], so the unsharded (TP=1) weight is
  [gate; up] but a TP=2 rank is not a contiguous slice of it.
- column-parallel (``output_layer``, word embeddings): split rows; row-parallel (``linear_proj``,
  ``linear_fc2``): split columns; norms: replicated.
- MoE layers (``mlp`` is Megatron's MoELayer with SequentialMLP experts): the router (HF ``mlp.gate``) replicated;
  expert e's ``linear_fc1`` / ``linear_fc2`` from HF's per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (the
  names HF checkpoints and vLLM's loaders use; transformers >= 5 fuses them into 3-D tensors in memory only), split
  over the expert-tensor-parallel ranks; a rank of expert-parallel rank r holds experts r * E/EP .. as
  ``local_experts.0 ..``. Qwen2-MoE's shared expert is a tensor-parallel gated MLP, its sigmoid gate replicated.
The same mappings serve checkpoint conversion and the export of live trainer weights to the rollout engine
(:func:`megatron_dynamo.models.export.iter_hf_weights`).

Each mapping also carries the HF shapes its architecture implies (``hf_shapes``: checkpoints are validated from
their headers, receivers allocate buffers without asking) and, where its shard is made of row ranges of the HF
tensors, ``row_pieces`` (a loader can then fill the parameter from a file in bounded chunks).
:func:`global_mappings` lists the whole model in HF order; :func:`check_hf_tensor_shapes` names the first missing,
unexpected or mis-shaped tensor of a checkpoint. The mapping types live in
:mod:`megatron_dynamo.models.param_mapping` (re-exported here).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from megatron_dynamo.models.param_mapping import (GatedMLPMapping, MappingError, ParamMapping, QKVMapping,
                                                  ReplicatedMapping, RowPiece, SplitMapping)
from megatron_dynamo.models.qwen import QwenArchitecture

__all__ = [  # the mapping types are re-exported: importers name them from here
    "GatedMLPMapping", "MappingError", "ParamMapping", "QKVMapping", "ReplicatedMapping", "RowPiece", "SplitMapping",
    "IGNORED_HF_TENSOR_SUFFIXES", "check_hf_tensor_shapes", "chunk_mappings", "embedding_mapping", "final_norm_mapping",
    "gated_mlp_mappings", "global_mappings", "hf_parameter_names", "hf_parameter_shapes", "layer_mappings",
    "load_hf_weights", "moe_mappings", "output_mapping", "unwrap_model",
]


def layer_mappings(arch: QwenArchitecture, te_spec: bool = False, moe_layer: bool = False,
                   experts: Sequence[int] | None = None) -> list[ParamMapping]:
    """Per-layer mappings, templated with ``{layer}`` (Megatron side: the layer's index within its chunk).

    ``moe_layer``: the layer's MLP is a mixture of experts (:meth:`QwenArchitecture.is_moe_layer`); ``experts``: the
    global indices of the experts this rank holds, in local order (default: all of them, expert parallel 1)."""
    hf = "model.layers.{layer}."
    mg = "decoder.layers.{layer}."
    qkv = dict(num_heads=arch.num_attention_heads, num_groups=arch.num_query_groups, head_dim=arch.head_dim)
    hidden, ffn = arch.hidden_size, arch.intermediate_size
    q_rows, kv_rows = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    # The TE spec fuses the pre-attention and pre-MLP norms into linear_qkv / linear_fc1.
    input_norm = mg + ("self_attention.linear_qkv.layer_norm_weight" if te_spec else "input_layernorm.weight")
    # The TE spec fuses the pre-MLP norm into a dense linear_fc1 only: its MoE layers keep a norm of their own.
    mlp_norm = mg + ("mlp.linear_fc1.layer_norm_weight" if te_spec and not moe_layer else "pre_mlp_layernorm.weight")
    maps: list[ParamMapping] = [
        ReplicatedMapping(input_norm, (hf + "input_layernorm.weight",), ((hidden,),)),
        QKVMapping(mg + "self_attention.linear_qkv.weight",
                   tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
                   ((q_rows, hidden), (kv_rows, hidden), (kv_rows, hidden)), **qkv),
        SplitMapping(mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",),
                     ((hidden, q_rows),), dim=1),
        ReplicatedMapping(mlp_norm, (hf + "post_attention_layernorm.weight",), ((hidden,),)),
        *(moe_mappings(arch, experts) if moe_layer else gated_mlp_mappings(mg + "mlp.", hf + "mlp.", hidden, ffn)),
    ]
    if arch.qkv_bias:
        maps.append(QKVMapping(mg + "self_attention.linear_qkv.bias",
                               tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"),
                               ((q_rows,), (kv_rows,), (kv_rows,)), **qkv))
    if arch.qk_norm:
        maps += [ReplicatedMapping(mg + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",),
                                   ((arch.head_dim,),)),
                 ReplicatedMapping(mg + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",),
                                   ((arch.head_dim,),))]
    return maps


def gated_mlp_mappings(mg: str, hf: str, hidden: int, ffn: int, expert: bool = False) -> list[ParamMapping]:
    """A SwiGLU MLP: Megatron ``{mg}linear_fc1`` ([gate; up]) and ``{mg}linear_fc2`` from HF ``{hf}gate_proj``,
    ``up_proj`` and ``down_proj``."""
    return [GatedMLPMapping(mg + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                            ((ffn, hidden), (ffn, hidden)), expert=expert),
            SplitMapping(mg + "linear_fc2.weight", (hf + "down_proj.weight",), ((hidden, ffn),), dim=1, expert=expert)]


def moe_mappings(arch: QwenArchitecture, experts: Sequence[int] | None = None) -> list[ParamMapping]:
    """A MoE layer's MLP (templated with ``{layer}``): the router, the experts this rank holds (global indices in
    local order; default all), and Qwen2-MoE's shared expert with its gate."""
    moe, hidden = arch.moe, arch.hidden_size
    hf, mg = "model.layers.{layer}.mlp.", "decoder.layers.{layer}.mlp."
    maps: list[ParamMapping] = [ReplicatedMapping(mg + "router.weight", (hf + "gate.weight",),
                                                  ((moe.num_experts, hidden),))]
    for local, expert in enumerate(range(moe.num_experts) if experts is None else experts):
        maps += gated_mlp_mappings(mg + f"experts.local_experts.{local}.", hf + f"experts.{expert}.", hidden,
                                   moe.expert_intermediate_size, expert=True)
    if moe.shared_expert_intermediate_size:
        maps += gated_mlp_mappings(mg + "shared_experts.", hf + "shared_expert.", hidden,
                                   moe.shared_expert_intermediate_size)
        maps.append(ReplicatedMapping(mg + "shared_experts.gate_weight", (hf + "shared_expert_gate.weight",),
                                      ((1, hidden),)))
    return maps


def embedding_mapping(arch: QwenArchitecture | None = None) -> ParamMapping:
    shapes = ((arch.vocab_size, arch.hidden_size),) if arch is not None else ()
    return SplitMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), shapes, dim=0)


def output_mapping(arch: QwenArchitecture) -> ParamMapping:
    # Tied models have no lm_head in HF; a last pipeline stage that is not also the first holds a copy.
    source = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    return SplitMapping("output_layer.weight", (source,), ((arch.vocab_size, arch.hidden_size),), dim=0)


def final_norm_mapping(arch: QwenArchitecture | None = None) -> ParamMapping:
    shapes = ((arch.hidden_size,),) if arch is not None else ()
    return ReplicatedMapping("decoder.final_layernorm.weight", ("model.norm.weight",), shapes)


def global_mappings(arch: QwenArchitecture, te_spec: bool = False) -> list[ParamMapping]:
    """Every mapping of the whole model in HF order, layers resolved with their global index.

    The output layer of a tied model is left out: its HF tensor is the embedding's. This is the order in which
    :func:`hf_parameter_names` lists tensors and in which the exporter streams them.
    """
    maps = [embedding_mapping(arch)]
    for layer in range(arch.num_layers):
        maps += [m.resolve(layer) for m in layer_mappings(arch, te_spec, arch.is_moe_layer(layer))]
    maps.append(final_norm_mapping(arch))
    if not arch.tie_word_embeddings:
        maps.append(output_mapping(arch))
    return maps


def hf_parameter_names(arch: QwenArchitecture) -> list[str]:
    """Every tensor name an HF checkpoint of this architecture holds, in a stable order."""
    return [name for mapping in global_mappings(arch) for name in mapping.hf_names]


def hf_parameter_shapes(arch: QwenArchitecture) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor of this architecture, in :func:`hf_parameter_names` order."""
    return {name: tuple(shape) for mapping in global_mappings(arch)
            for name, shape in zip(mapping.hf_names, mapping.hf_shapes)}


# Non-parameter tensors that some HF checkpoints carry and that are recomputed from config.json.
IGNORED_HF_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


def check_hf_tensor_shapes(arch: QwenArchitecture, found: dict[str, Sequence[int]],
                           allow_tied_lm_head: bool = False) -> None:
    """Check the tensor names and shapes of an HF checkpoint (from its headers) against the architecture.

    Raises :class:`MappingError` naming the first missing tensor, unexpected tensor or shape mismatch (and how
    many more there are). ``allow_tied_lm_head``: a tied model's checkpoint may also carry ``lm_head.weight``
    (the caller checks that it equals the embedding).
    """
    expected = hf_parameter_shapes(arch)
    missing = [name for name in expected if name not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MappingError(f"HF checkpoint is missing tensor '{missing[0]}'{more}")
    unexpected = [name for name in found if name not in expected
                  and not name.endswith(IGNORED_HF_TENSOR_SUFFIXES)
                  and not (allow_tied_lm_head and arch.tie_word_embeddings and name == "lm_head.weight")]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise MappingError(f"HF checkpoint has unexpected tensor '{sorted(unexpected)[0]}'{more}, which "
                           f"config.json (model_type={arch.model_type}, {arch.num_layers} layers) does not explain")
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise MappingError(f"{name}: shape mismatch: expected {shape} from config.json, "
                               f"found {tuple(found[name])}")


def chunk_mappings(model, arch: QwenArchitecture, te_spec: bool = False) -> Iterator[tuple[ParamMapping, torch.nn.Parameter]]:
    """The resolved mapping of every parameter of one (unwrapped) GPTModel chunk, with the parameter.

    Megatron names layers by their index within the chunk; the HF index is the layer's global number, read
    from the layer itself (``layer_number`` is 1-based and includes the pipeline/virtual-stage offset). Likewise
    experts: Megatron's by their index on this expert-parallel rank, HF's by their global index (read from the
    layer's ``local_expert_indices``).
    """
    params = dict(model.named_parameters())
    seen = set()

    def emit(mapping: ParamMapping):
        if mapping.megatron_name not in params:
            raise MappingError(f"Megatron model has no parameter '{mapping.megatron_name}'")
        seen.add(mapping.megatron_name)
        return mapping, params[mapping.megatron_name]

    if getattr(model, "pre_process", False):
        yield emit(embedding_mapping(arch))
    for local_index, layer in enumerate(model.decoder.layers):
        moe_layer = arch.is_moe_layer(layer.layer_number - 1)
        experts = layer.mlp.local_expert_indices if moe_layer else None
        for template in layer_mappings(arch, te_spec, moe_layer, experts):
            mapping = template.resolve(local_index)
            hf_mapping = template.resolve(layer.layer_number - 1)
            yield emit(type(mapping)(**{**mapping.__dict__, "hf_names": hf_mapping.hf_names}))
    if getattr(model, "post_process", False):
        yield emit(final_norm_mapping(arch))
        if "output_layer.weight" in params:
            yield emit(output_mapping(arch))
    unexpected = sorted(set(params) - seen)
    if unexpected:
        raise MappingError(f"Megatron parameters without a mapping: {', '.join(unexpected)}")


@torch.no_grad()
def load_hf_weights(chunks, arch: QwenArchitecture, get_hf_tensor, te_spec: bool = False, *,
                    read_rows=None, hf_shapes: dict[str, Sequence[int]] | None = None,
                    chunk_bytes: int = 16 * 2**20) -> int:
    """Copy HF tensors into this rank's Megatron chunks (any TP/PP/VPP layout), one tensor at a time.

    ``get_hf_tensor(name)`` returns an HF tensor by name (a dict's ``__getitem__``, or a safetensors reader), so
    a large checkpoint is streamed rather than held in memory. Returns the number of parameters loaded.

    Optional row streaming: with ``read_rows(name, start, stop)`` (rows ``start:stop`` of an HF tensor) and
    ``hf_shapes`` (name -> shape, e.g. from the file headers), every parameter whose shard is a set of row
    ranges (:meth:`ParamMapping.row_pieces`: all but row-parallel splits) is filled in pieces of at most
    ``chunk_bytes``, so no whole HF tensor (an embedding of 1.5 GB, say) is ever materialised next to the model.
    """
    from megatron.core import parallel_state

    if read_rows is not None and hf_shapes is None:
        raise ValueError("load_hf_weights: read_rows needs hf_shapes (name -> shape)")
    tp = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    etp = (parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size())
    count = 0
    for chunk in chunks:
        model = unwrap_model(chunk)
        for mapping, param in chunk_mappings(model, arch, te_spec):
            tp_rank, tp_size = etp if mapping.expert else tp
            pieces = mapping.row_pieces(tp_rank, tp_size) if read_rows is not None else None
            if pieces is not None:
                _fill_by_rows(mapping, param, pieces, read_rows, hf_shapes, chunk_bytes)
                count += 1
                continue
            tensors = []
            for name in mapping.hf_names:
                try:
                    tensors.append(get_hf_tensor(name))
                except KeyError:
                    raise MappingError(f"HF checkpoint has no tensor '{name}' (needed for {mapping.megatron_name})") from None
            mapping.check_hf_shapes([t.shape for t in tensors])
            shard = mapping.to_megatron(tensors, tp_rank, tp_size)
            if tuple(shard.shape) != tuple(param.shape):
                raise MappingError(f"{mapping.megatron_name}: shape {tuple(param.shape)} does not match "
                                   f"{tuple(shard.shape)} made from {', '.join(mapping.hf_names)}")
            param.copy_(shard)
            count += 1
    return count


def _fill_by_rows(mapping: ParamMapping, param: torch.Tensor, pieces: list[RowPiece], read_rows,
                  hf_shapes: dict[str, Sequence[int]], chunk_bytes: int) -> None:
    """Fill ``param`` from row ranges of the HF tensors, at most ``chunk_bytes`` per read."""
    missing = [name for name in mapping.hf_names if name not in hf_shapes]
    if missing:
        raise MappingError(f"HF checkpoint has no tensor '{missing[0]}' (needed for {mapping.megatron_name})")
    mapping.check_hf_shapes([hf_shapes[name] for name in mapping.hf_names])
    if sum(p.rows for p in pieces) != param.shape[0]:
        raise MappingError(f"{mapping.megatron_name}: row pieces cover {sum(p.rows for p in pieces)} of "
                           f"{param.shape[0]} rows")
    step = max(1, chunk_bytes // max(1, param[0].numel() * param.element_size()))
    for piece in pieces:
        name = mapping.hf_names[piece.hf_index]
        for offset in range(0, piece.rows, step):
            rows = min(step, piece.rows - offset)
            part = read_rows(name, piece.src_start + offset, piece.src_start + offset + rows)
            param[piece.dst_start + offset:piece.dst_start + offset + rows].copy_(part)
            del part


def unwrap_model(module):
    """Strip DDP / Float16Module wrappers down to the GPTModel."""
    while hasattr(module, "module"):
        module = module.module
    return module
