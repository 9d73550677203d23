"""RMSNorm and rotary embedding for the local (pure-PyTorch) layer spec, each an autograd function whose backward is
written out.

Why: at the CPU default's shape (hidden 128, 64 sequences of ~20 tokens per micro-batch) a training step costs
little in matrix products and much in elementwise kernels, each a parallel region over the tensor. torch's
``rms_norm`` is composite on the CPU (ten multiplications and three powers forward and backward) and Megatron's
unfused rotary embedding recomputes ``cos``/``sin`` in every layer, builds the rotated half with ``chunk``/``neg``/
``cat`` and copies the result once more; autograd then differentiates each of those ops. Written out, the norm takes
four kernels forward and six backward, the rotary embedding three each way: the CPU default's update about 25%
faster (docs/changelog.md, issue 43's second sitting). Transformer Engine's fused kernels take these places on a GPU.

- :class:`LocalRMSNorm`: ``torch.nn.RMSNorm`` with this forward/backward (parameters and state dict unchanged);
  :class:`SequenceParallelRMSNorm` the same under sequence parallelism.
- :func:`apply_rotary`: Megatron's ``fused_apply_rotary_pos_emb`` hook (``rope_utils``), which Megatron calls when
  ``apply_rope_fusion`` is set; :func:`install_rotary` fills the hook where Transformer Engine has not.
"""

from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    """y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension; the reduction in float32
    for lower precisions, as torch's own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
        normed = (xf * rstd).to(x.dtype)
        ctx.save_for_backward(normed, rstd, weight)
        return normed * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        normed, rstd, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).reshape(-1, grad.shape[-1]).sum(0)
        grad_normed = (grad * weight).float()
        normed_f = normed.float()
        # d/dx of x * rstd: rstd * (g - normed * mean(g * normed))
        projection = (grad_normed * normed_f).mean(-1, keepdim=True)
        grad_x = grad_normed.sub_(normed_f * projection).mul_(rstd).to(grad.dtype)
        return grad_x, grad_weight, None


class LocalRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (weight, eps, state dict) with :class:`_RMSNorm`'s forward and backward. Takes
    Megatron's norm arguments (``config``, ``hidden_size``, ``eps``) like its own torch norm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


class SequenceParallelRMSNorm(LocalRMSNorm):
    """The local spec's norm under sequence parallelism (Megatron's own torch norm refuses it).

    Each TP rank normalises its slice of the sequence with the full (replicated) weight, so the weight's gradient
    is a partial sum per rank; the ``sequence_parallel`` attribute makes Megatron's ``finalize_model_grads``
    all-reduce it over the TP group, as it does for Transformer Engine's norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(config, hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


_angles: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None


def _cos_signed_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(freqs) and sin(freqs) with the first half's sign flipped, in ``dtype``. Megatron computes the rotary
    angles once per forward (``RotaryEmbedding`` caches them by length) and hands the same tensor to every layer:
    one entry, kept with a reference to that tensor, serves them all."""
    global _angles
    if _angles is not None and _angles[0] is freqs and _angles[1] == dtype:
        return _angles[2], _angles[3]
    half = freqs.shape[-1] // 2
    sign = torch.ones(freqs.shape[-1], dtype=freqs.dtype, device=freqs.device)
    sign[:half] = -1
    cos, sin = torch.cos(freqs).to(dtype), (torch.sin(freqs) * sign).to(dtype)
    _angles = (freqs, dtype, cos, sin)
    return cos, sin


def _rotate(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # t * cos + [-t2, t1] * sin, with [-t2, t1] * sin = [t2, t1] * signed_sin: one roll instead of chunk/neg/cat
    out = t * cos
    out += torch.roll(t, t.shape[-1] // 2, dims=-1) * signed_sin
    return out


class _Rotary(torch.autograd.Function):
    """The rotation of each (t_i, t_{i+d/2}) pair; its backward is the rotation by the opposite angle."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, signed_sin)
        return _rotate(t, cos, signed_sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, signed_sin = ctx.saved_tensors
        # out = C t + P S t with P the half swap (P = P^T): grad_t = C g + S P g, i.e. the roll before the product
        grad_t = grad * cos
        grad_t += torch.roll(grad * signed_sin, grad.shape[-1] // 2, dims=-1)
        return grad_t, None, None


def apply_rotary(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of ``t`` [s, b, heads, d] by the angles ``freqs`` [s, 1 or b, 1, d_rot] (halves laid out
    as Qwen's: pairs (i, i + d_rot/2)); dimensions past ``d_rot`` pass through. The signature of Transformer
    Engine's ``fused_apply_rotary_pos_emb``, the hook Megatron calls when ``apply_rope_fusion`` is set."""
    if interleaved:
        raise ValueError("apply_rotary: interleaved rotary embeddings are not supported (Qwen rotates halves)")
    rot_dim = freqs.shape[-1]
    cos, signed_sin = _cos_signed_sin(freqs, t.dtype)
    if rot_dim == t.shape[-1]:
        return _Rotary.apply(t, cos, signed_sin)
    return torch.cat((_Rotary.apply(t[..., :rot_dim], cos, signed_sin), t[..., rot_dim:]), dim=-1)


def install_rotary() -> bool:
    """Fill Megatron's fused-rotary hook with :func:`apply_rotary` where Transformer Engine has not filled it.
    Returns whether the hook is now :func:`apply_rotary` (a config may then set ``apply_rope_fusion``). The local
    spec never passes ``cu_seqlens`` to the rotary embedding (packed rows there are masked, not THD), so the THD
    hook stays as it is."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = apply_rotary
    return rope_utils.fused_apply_rotary_pos_emb is apply_rotary
