"""The local (pure-PyTorch) layer spec's linear layers: on the CPU, float32 products through oneDNN, not MKL.

Why: torch computes a float32 ``matmul`` on the CPU with MKL's sgemm, and on AMD EPYC MKL runs its generic code
path. At the CPU default's shapes (~1400 tokens, 128 -> 256/384/768 features, 2 threads) oneDNN's inner product
(``torch.ops.mkldnn._linear_pointwise``, the op torch.compile's CPU backend emits for a linear layer; vLLM's CPU layers
use oneDNN too) was 2.2x as fast forward and for the input's gradient, and 1.5x for the weight's, in float32
throughout (oneDNN's default, strict math mode: no bf16 or tf32 rounding). The matrix products were over half of the
CPU default's update.

- :func:`local_linear_layers`: Megatron's ``ColumnParallelLinear`` and ``RowParallelLinear`` (parameters, state dict,
  tensor-parallel split and communication unchanged) whose product is :class:`_OneDNNLinear` where it applies:
  float32 CPU tensors, a trained weight, no sequence parallelism, no deferred weight gradients, no fused gradient
  accumulation (a CUDA kernel). Anywhere else, or in a torch built without oneDNN, Megatron's own function runs.
- :func:`bound_primitive_cache`: oneDNN compiles a kernel for each operand shape and keeps up to 1024 of them; the
  micro-batches' shapes change from step to step, and the CPU default's peak RSS grew by 75 MB in 30 steps. With 64
  it ends 4% below its level with MKL's products (vLLM's kernels are oneDNN's too), at no measured cost in time.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

#: torch's oneDNN linear: ``linear(x, w, b)`` = x @ w.T + b, any leading dimensions, strided operands. None in a torch
#: built without oneDNN.
_ONEDNN = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


#: The oneDNN kernels a process keeps compiled (oneDNN's ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; its default 1024).
PRIMITIVE_CACHE_CAPACITY = 64


def bound_primitive_cache() -> None:
    """Keep at most :data:`PRIMITIVE_CACHE_CAPACITY` compiled oneDNN kernels in this process (a capacity set in the
    environment wins). oneDNN reads it once, at its first kernel: call this before the process computes anything."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _ONEDNN(x, weight, bias, "none", [], "")


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """g.T @ x for g [tokens, out] and x [tokens, in], through oneDNN. oneDNN reads its second operand strided in
    place but wants the first contiguous: of g.T and x.T, the one with fewer features is copied. With more outputs
    than inputs (the MLP's gate/up, the QKV projection) that is x: linear(x.T, g.T) = (g.T @ x).T. A transposing copy
    of the CPU default's gate/up gradient (768 x 1408 floats) took 2 ms of its update's 100 in the trainer. Either
    way about 0.67x MKL's mm over the CPU default's four layer shapes (with both operands copied, no faster)."""
    if grad.shape[1] > x.shape[1]:
        return _linear(x.t().contiguous(), grad.t()).t()
    return _linear(grad.t().contiguous(), x.t())


class _OneDNNLinear(torch.autograd.Function):
    """y = x @ w.T + b. Backward: the input's gradient g @ w (all-reduced over the tensor-parallel group when
    ``allreduce_dgrad``, as Megatron's column-parallel layer does, overlapped with the weight's gradient), the
    weight's g.T @ x (oneDNN too), the bias's sum of g over the tokens."""

    @staticmethod
    def forward(ctx, x, weight, bias, allreduce_dgrad: bool, tp_group):
        ctx.save_for_backward(x, weight)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_input = _linear(grad, weight.t())
        pending = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True) if ctx.allreduce_dgrad else None
        grad_weight = _weight_gradient(grad_2d, x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = grad_2d.sum(0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        if pending is not None:
            pending.wait()
        return grad_input, grad_weight, grad_bias, None, None


def onednn_applies(input, weight, *, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                   sequence_parallel=False, grad_output_buffer=None, tp_group=None, **unused) -> bool:
    """Whether :class:`_OneDNNLinear` computes this call of Megatron's linear function (its keyword arguments)."""
    return (_ONEDNN is not None and input.device.type == "cpu" and input.dtype == weight.dtype == torch.float32
            and weight.requires_grad and not gradient_accumulation_fusion and not sequence_parallel
            and grad_output_buffer is None and (tp_group is not None or not allreduce_dgrad))


class _OneDNNProduct:
    """Mixed into Megatron's parallel linear layers: their ``_forward_impl`` (the product and its backward) through
    :class:`_OneDNNLinear` where :func:`onednn_applies`, else theirs."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if args or not onednn_applies(input, weight, **kwargs):
            return super()._forward_impl(input, weight, *args, **kwargs)
        return _OneDNNLinear.apply(input, weight, kwargs.get("bias"), bool(kwargs.get("allreduce_dgrad")),
                                   kwargs.get("tp_group"))


@functools.cache
def local_linear_layers() -> tuple[type, type]:
    """``(LocalColumnParallelLinear, LocalRowParallelLinear)``. Built on the first call: models/qwen.py, which the
    CLI imports before any rank starts, imports this module at the top, and megatron.core takes seconds to import."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    column = type("LocalColumnParallelLinear", (_OneDNNProduct, ColumnParallelLinear), {"__module__": __name__})
    row = type("LocalRowParallelLinear", (_OneDNNProduct, RowParallelLinear), {"__module__": __name__})
    return column, row
