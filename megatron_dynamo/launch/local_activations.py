"""What one decoder layer keeps for the backward with Megatron's local layers (every CPU run; a GPU run without
Transformer Engine), per token: the memory plan's ``kernels="local"`` (``launch/memory_plan.py`` plans Transformer
Engine's; ``tests/test_memory_measured.py`` checks the terms they share and these against the tensors a CPU run
saves). Plain arithmetic, no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # read only
    from megatron_dynamo.models.qwen import QwenArchitecture


def local_layer_bytes(arch: QwenArchitecture, setup, moe_layer: bool, recompute: str) -> float:
    """:func:`memory_plan.layer_activation_bytes` for Megatron's local layers (b = 4 in the CPU's fp32), recompute
    off or selective; ``setup``: the plan's ``Setup`` (not imported: the plan imports this module).
    What differs from Transformer Engine's, each seen in the saved tensors of a CPU run (tests/test_memory_measured.py):

    - every RMSNorm also keeps its fp32 1/rms (1 value a row: the two layer norms, a + g with Qwen3's q/k norms);
    - rotary embeddings keep their cos and sin in every layer, one row per position (2d x S / the micro-batch's
      tokens, a token);
    - the unfused attention keeps q, k and v repeated to all a heads (3 a d/t), its softmax's output (a S/t a token,
      S the sequence length) and its output; selective recompute keeps q and k after rotary, the fused qkv output
      (v is a view of it: (a + 2g) d/t) and the output;
    - the unfused SwiGLU keeps fc1's output and three more of f (2f + 3f/t: silu's input and output, and the product),
      an expert's four more (the weighting by the routing probability, 2f + 4f);
    - the router also keeps the fp32 probabilities scattered over all E experts (4E)."""
    if setup.sequence_length <= 0:  # the attention scores and rotary tables grow with it: no default would be right
        raise ValueError(f"kernels='local' needs the micro-batch's sequence_length (> 0), got {setup.sequence_length}")
    b, t, h = setup.dtype_bytes, setup.tensor_parallel, arch.hidden_size
    s = t if setup.sequence_parallel else 1
    a, g, d = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    norms = (2 + ((a + g) / t if arch.qk_norm else 0)) * 4
    positions = setup.sequence_length / setup.micro_batch_tokens
    attention = b * (2 * h / s + ((a + g) * d / t if arch.qk_norm else 0) + 2 * d * positions)
    if recompute == "off":
        attention += b * (4 * a * d + a * setup.sequence_length) / t
    else:
        attention += b * (a * d + g * d + (a + 2 * g) * d + a * d) / t
    norm = b * 2 * h / s
    if not moe_layer:
        return norms + attention + norm + b * 5 * arch.intermediate_size / t
    moe, etp = arch.moe, setup.expert_tensor_parallel
    router = moe.num_experts * (1 + 4 + (0 if moe.norm_topk_prob else 4)) + 20 * moe.top_k
    routed = moe.top_k * etp / t * b * (h + 6 * moe.expert_intermediate_size / etp + 1)
    return norms + attention + norm + router + routed
