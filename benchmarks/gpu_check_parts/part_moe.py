"""Part ``moe``: a random-weight Qwen3-MoE shape on one GPU (Qwen3-30B-A3B's layer: hidden 2048, 128 experts of
768, 8 routed per token; as many of its 48 layers as one GPU holds with the optimizer), bf16, expert parallel 1:
forward, forward+backward and optimizer-step times, tokens/s, peak memory."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_check_parts.common import Ctx, gib, init_megatron, load_config
from benchmarks.gpu_check_parts.registry import QWEN3_30B_A3B, TINY_QWEN3_MOE
from benchmarks.gpu_check_parts.step_shapes import measure_model

#: Bytes per parameter of a bf16 model under the recipes' optimizer: bf16 weight, fp32 gradient, fp32 main weight,
#: Adam's two fp32 moments.
BYTES_PER_PARAM = 2 + 4 + 4 + 8


def moe_flops_per_token(arch, seq_len: int) -> float:
    """Matmul FLOPs per token of forward + backward: 6 x the weights a token uses (attention, the router, its top-k
    experts and the shared expert in MoE layers, the MLP in dense ones, the output layer), plus causal attention
    scores/values (6 x layers x seq x heads x head_dim)."""
    h, moe = arch.hidden_size, arch.moe
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    attention = h * (q + 2 * kv) + q * h
    sparse = h * moe.num_experts + moe.top_k * 3 * h * moe.expert_intermediate_size \
        + 3 * h * moe.shared_expert_intermediate_size
    layers = sum(attention + (sparse if is_moe else 3 * h * arch.intermediate_size) for is_moe in moe.layer_pattern)
    return 6.0 * (layers + arch.vocab_size * h) + 6.0 * len(moe.layer_pattern) * seq_len * q


def _layers_that_fit(cfg: dict[str, Any], free_gib: float) -> int:
    """How many of the shape's layers fit in half of the free memory with the optimizer (the rest: activations)."""
    h, e, f, v = cfg["hidden_size"], cfg["num_experts"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = e * 3 * h * f + h * e + h * (q + 2 * kv) + q * h
    budget = free_gib * 2**30 / 2 / BYTES_PER_PARAM - 2 * v * h
    return max(1, min(cfg["num_hidden_layers"], int(budget // per_layer)))


def part_moe(ctx: Ctx) -> dict[str, Any]:
    import torch

    from megatron_dynamo.models.qwen import parse_qwen_config

    init_megatron(ctx, seed=0)
    if ctx.gpu:
        cfg = load_config(QWEN3_30B_A3B)
        cfg["num_hidden_layers"] = _layers_that_fit(cfg, gib(torch.cuda.mem_get_info()[0]))
        name = f"Qwen3-30B-A3B shape, {cfg['num_hidden_layers']} of its 48 layers"
        shapes, repeats = [(1, 2048), (1, 4096), (4, 2048)], 3
    else:
        cfg, name = load_config(TINY_QWEN3_MOE), "tiny Qwen3-MoE (--cpu)"
        shapes, repeats = [(2, 64), (1, 128)], 2
    run = measure_model(ctx, cfg, shapes, repeats, moe_flops_per_token)
    moe = parse_qwen_config(cfg).moe
    spec = "local spec, SequentialMLP experts, alltoall dispatcher (expert parallel 1)"
    numbers = {"model": name, "parameters (M)": run.parameters / 1e6,
               "experts": f"{moe.num_experts} of {moe.expert_intermediate_size}, top-{moe.top_k}",
               "layer spec": spec, "dtype": "bf16", "optimizer": run.optimizer, "build s": run.build_s,
               "weights+grads+optimizer GiB (before first step)": run.static_gib,
               "timing": f"median of {repeats} after 1 warm-up step"}
    return run.result("MoE", numbers)
