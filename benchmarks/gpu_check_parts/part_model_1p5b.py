"""Part ``model_1p5b``: the Qwen2.5-Math-1.5B shape, random weights, bf16: forward, forward+backward and
optimizer-step times, tokens/s, peak memory."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_check_parts.common import Ctx, init_megatron, load_config, te_enabled
from benchmarks.gpu_check_parts.registry import QWEN_1_5B, TINY_QWEN2
from benchmarks.gpu_check_parts.step_shapes import measure_model


def _model_flops_per_token(arch, seq_len: int) -> float:
    """Matmul FLOPs per token of forward + backward (6 x weights used per token incl. the output layer, plus
    causal attention scores/values: 6 x layers x seq x heads x head_dim)."""
    h, f, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    return 6.0 * (layers * per_layer + arch.vocab_size * h) + 6.0 * layers * seq_len * q


def part_model_1p5b(ctx: Ctx) -> dict[str, Any]:
    init_megatron(ctx, seed=0)
    if ctx.gpu:
        cfg, name = load_config(QWEN_1_5B), "Qwen2.5-Math-1.5B shape"
        shapes, repeats = [(1, 2048), (1, 4096), (4, 2048), (2, 4096)], 3
    else:
        cfg, name = load_config(TINY_QWEN2), "tiny Qwen2 (--cpu)"
        shapes, repeats = [(2, 64), (1, 128)], 2
    spec = "transformer-engine" if ctx.gpu and te_enabled() else "local (pure PyTorch)"
    if ctx.gpu and not te_enabled():
        ctx.notes.append("Transformer Engine is missing: the local spec was measured (unfused attention: long "
                         "sequences may not fit)")
    run = measure_model(ctx, cfg, shapes, repeats, lambda arch, seq: _model_flops_per_token(arch, seq))
    numbers = {"model": name, "parameters (M)": run.parameters / 1e6, "layer spec": spec, "dtype": "bf16",
               "optimizer": run.optimizer, "build s": run.build_s,
               "weights+grads+optimizer GiB (before first step)": run.static_gib,
               "timing": f"median of {repeats} after 1 warm-up step"}
    return run.result(spec, numbers)
