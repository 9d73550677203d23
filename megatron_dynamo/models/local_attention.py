"""The local (pure-PyTorch) layer spec's core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Why: megatron-core's ``DotProductAttention`` repeats the keys and values of each query group to every head, writes
the [b * heads, sq, sk] scores into a buffer, masks and softmaxes them in separate ops (a mask of its own for the
causal case) and copies the context back; autograd keeps the scores and the probabilities, memory growing with the
square of the sequence. torch's SDPA runs the same attention as one fused kernel (flash attention on the CPU and
on CUDA, memory-efficient attention under a mask), reads the query groups in place (``enable_gqa``) and keeps no
[sq, sk] matrix for the backward: one layer's forward and backward 5x faster than Megatron's at 1040 tokens on the
CPU. Short sequences are the exception: torch's CPU flash kernel has a fixed cost per (sequence, head) that
does not shrink with more threads, so up to :data:`CPU_MATH_MAX_KEYS` keys SDPA's math backend (the explicit
product and softmax, fewer ops than Megatron's) is used on the CPU; at the CPU default's shape (22 tokens, 2
threads) 1.2 ms per layer against flash's 1.7 ms and Megatron's 1.3 ms. Transformer Engine's fused attention takes
this place in the TE spec.

A ``torch.nn.Module`` rather than a ``MegatronModule``: it has no parameters or state (Megatron's checkpointing
treats such children as it treats its own), and models/qwen.py, which the CLI imports before any rank starts,
imports it at the top, so megatron.core (seconds to import) is imported here only when a model is built.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Up to this many keys the CPU computes attention with SDPA's math backend; flash above (measured crossover between
# 48 and 96 keys at 2 threads, hn 32, ~1.4k tokens per micro-batch).
CPU_MATH_MAX_KEYS = 64


class ScaledDotProductAttention(torch.nn.Module):
    """Megatron's ``DotProductAttention`` (constructor and forward) computed by torch's SDPA.

    Inputs are this tensor-parallel rank's heads: query [sq, b, np, hn], key and value [sk, b, ng, hn] with ng
    dividing np (query head i reads group i // (np / ng), as Megatron's ``repeat_interleave``); the output is the
    context [sq, b, np * hn]. Masking as Megatron's unfused softmax: a given boolean ``attention_mask`` (True =
    masked out, broadcastable to [b, np, sq, sk]) replaces the causal mask; without one, a causal layer attends
    causally (a single query, as in decoding, attends to every key). What SDPA cannot compute here (attention
    bias, packed THD sequences, context parallelism, sliding windows, softmax offsets, QK clipping) is refused
    when the module is built or called, not approximated.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__()
        _check_supported(config, layer_number)
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.causal = attn_mask_type == AttnMaskType.causal
        # Megatron divides its scale by layer_number under apply_query_key_layer_scaling and multiplies the scores
        # by it again inside the softmax (an fp16 overflow guard): the net scale, the one SDPA applies, is this.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("ScaledDotProductAttention: attention_bias is not supported")
        if packed_seq_params is not None:
            raise NotImplementedError("ScaledDotProductAttention: packed_seq_params (THD) is not supported; the "
                                      "local spec packs sequences with a block-diagonal attention_mask")
        sq, b, heads, head_dim = query.shape
        groups = key.shape[2]
        if heads % groups:
            raise ValueError(f"ScaledDotProductAttention: {heads} query heads over {groups} key/value groups")
        # Megatron ignores attn_mask_type here too: the layer's own type decides
        is_causal = self.causal and attention_mask is None and sq > 1
        if is_causal and sq != key.shape[0]:
            raise ValueError(f"ScaledDotProductAttention: causal attention needs as many queries as keys, got "
                             f"{sq} and {key.shape[0]}")
        mask = None if attention_mask is None else _allowed(attention_mask)
        dropout_p = self.dropout_p if self.training else 0.0
        # [s, b, heads, hn] -> [b, heads, s, hn], views: SDPA reads strided inputs
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        with self._dropout_rng(dropout_p), _backend(query.device, query.dtype, key.shape[0]):
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                     is_causal=is_causal, scale=self.softmax_scale,
                                                     enable_gqa=groups != heads)
        # [b, heads, sq, hn] -> [sq, b, heads * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)

    def _dropout_rng(self, dropout_p: float):
        """Megatron draws attention dropout from the tensor-parallel RNG tracker's stream (different per TP rank)
        unless the sequence is split over the ranks."""
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker().fork()


def _backend(device: torch.device, dtype: torch.dtype, keys: int):
    """SDPA's math backend for short fp32/fp64 sequences on the CPU (see the module's docstring; flash keeps
    lower precisions' reductions in fp32), else torch's choice."""
    if device.type == "cpu" and keys <= CPU_MATH_MAX_KEYS and dtype in (torch.float32, torch.float64):
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """SDPA's boolean mask (True = may attend) from Megatron's (True = masked out)."""
    if attention_mask.dtype != torch.bool:
        raise TypeError(f"ScaledDotProductAttention: attention_mask must be boolean (True = masked out), got "
                        f"{attention_mask.dtype}")
    return ~attention_mask


def _check_supported(config, layer_number: int) -> None:
    """Refuse, in one line, the settings of Megatron's attention that this module does not compute."""
    from megatron.core.transformer.utils import is_layer_window_attention

    refused = {
        "context_parallel_size > 1": config.context_parallel_size > 1,
        f"softmax_type={config.softmax_type!r}": config.softmax_type != "vanilla",
        "qk_clip / log_max_attention_logit": bool(config.qk_clip or getattr(config, "log_max_attention_logit", False)),
        "sliding-window attention (window_size)": is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number),
    }
    names = [name for name, present in refused.items() if present]
    if names:
        raise NotImplementedError(f"ScaledDotProductAttention (the local spec's core attention) does not support "
                                  f"{', '.join(names)}")

