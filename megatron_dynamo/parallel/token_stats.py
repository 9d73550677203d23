"""Vocab-parallel per-token statistics: log pi(target) (with gradient), entropy H and sum_j pi_j^2 Lambda_j.

DynaMO's token-level modulation needs, for every response token t with sampled token a and policy
pi = softmax(z / T) over the *whole* vocabulary (T = sampling temperature):

* ``logp``  = log pi_a                                  (differentiable: it feeds the PPO ratio)
* ``entropy`` H = -sum_j pi_j log pi_j                  (with gradient, for an entropy bonus; detached where it weights)
* ``sum_pi2_lambda`` = sum_j pi_j^2 Lambda_j, with Lambda_j = log pi_j + H   (no gradient)

The last one is the vocabulary sum of the exact first-order entropy change (Theorem 1 of the paper, see
``docs/algorithm.md``, "The entropy change, exactly"): a policy-gradient step that moves the logits by
eta * xi_t * (e_a - pi) changes H by
    Delta H_t ~= -eta * xi_t * (pi_a Lambda_a - sum_j pi_j^2 Lambda_j)
(``algorithms.modulation.delta_h_exact`` forms it from these three statistics).

The vocabulary is sharded across the tensor-parallel (TP) group as in Megatron's vocab-parallel output layer:
rank r of a group of size tp holds the global ids [r * V/tp, (r + 1) * V/tp). Everything is computed from
max-shifted sums, so two collectives per chunk of tokens are enough. With x the raw logits,

    m   = max_j x_j                     (all-reduce MAX of the per-shard maxima; max_j x_j / T is the max after
                                         temperature, T > 0, and subtracting before dividing keeps d accurate)
    d_j = (x_j - m) / T  (<= 0)         so that log pi_j = d_j - log Z
    Z  = sum_j e^{d_j}                  S1 = sum_j e^{d_j} d_j
    S2 = sum_j e^{2 d_j}                S3 = sum_j e^{2 d_j} d_j
    d_a                                 (only the shard that owns the target a contributes; the others add 0)
                                        (one all-reduce SUM of the stacked [chunk, 6] partials, see below)
then
    log pi_a            = d_a - log Z
    H                   = log Z - S1 / Z
    sum pi^2            = S2 / Z^2
    sum pi^2 log pi     = S3 / Z^2 - log Z * S2 / Z^2
    sum pi^2 Lambda     = sum pi^2 log pi + H sum pi^2 = (S3 - S2 * S1 / Z) / Z^2
(the last form: log Z cancels out exactly).

Accuracy for peaked distributions: the term of the global max is exactly e^0 = 1. It is taken out of the sums and
counted (n_top, 1 unless the max is tied across shards), Z = n_top + R, and log Z = log n_top + log1p(R / n_top).
An fp32 Z ~= 1 would carry an absolute error of ~1e-7, which is a large *relative* error on log pi_a ~= 0 and on a
small H; this way they stay ~1e-7 relative. The six stacked partials are R, n_top, S1, S2 - n_top, S3 and d_a.

Memory. The naive way (log_softmax + gather + entropy) materialises several [tokens, V/tp] fp32 tensors and keeps
the softmax alive for backward. Here tokens are processed in chunks: the forward keeps fp32 scratch of
2 x chunk x V/tp and saves, besides a *reference* to the input (not a copy), four fp32 numbers per token
(m, Z, log pi_a, H); the backward recomputes pi chunk by chunk, d log pi_a / d x_j = (1[j == a] - pi_j) / T
(and dH / d x_j = -pi_j (log pi_j + H) / T when the entropy has a gradient).
``fused_vocab_parallel_token_stats`` also takes the output layer in: it computes the logits chunk by chunk
(hidden_chunk @ weight_shard^T), in forward and again in backward, so the [tokens, V/tp] logits never exist.

All statistics accumulate in fp32 whatever the input dtype (fp32, bf16, fp16); gradients come back in the
input dtype. Targets must be valid global ids in [0, V); a target that no shard owns contributes d_a = 0 and no
one-hot gradient (its logp is meaningless: mask such tokens out of the loss).
Logits of +inf are not supported; -inf logits (masked vocabulary entries) are fine, as long as a token has at least
one finite logit.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megatron_dynamo.parallel.token_chunks import (
    DEFAULT_CHUNK_ELEMENTS,
    all_reduce,
    check_common,
    chunk_grad_logits,
    chunk_stats,
    dot_rows,
    local_targets,
    resolve_chunk,
    tp_info,
)

__all__ = [
    "TokenStats",
    "vocab_parallel_token_stats",
    "fused_vocab_parallel_token_stats",
    "DEFAULT_CHUNK_ELEMENTS",
]

_F32 = torch.float32


class TokenStats(NamedTuple):
    """Per-token outputs, each of shape ``target.shape``, fp32.

    logp:           log pi(target); differentiable w.r.t. the logits (or hidden states and weight, fused variant).
    entropy:        H = -sum_j pi_j log pi_j; differentiable (dH/dx_j = -pi_j (log pi_j + H) / T).
    sum_pi2_lambda: sum_j pi_j^2 (log pi_j + H); no gradient.
    """

    logp: torch.Tensor
    entropy: torch.Tensor
    sum_pi2_lambda: torch.Tensor


# ----------------------------------------------------------------------------------------------------------------
# logits in


def _rows(grad: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if grad is None else grad[rows]


def _stats_by_chunk(target, vocab_start, vocab_local, chunk, temperature, group, chunk_logits, device):
    """The forward of both Functions: ``chunk_stats`` over the tokens, ``chunk`` at a time. ``chunk_logits(rows)``
    gives the fp32 logits [rows, V/tp] of a slice of tokens (it may reuse one buffer). Returns m, Z, log pi_a, H and
    sum pi^2 Lambda, [n] fp32 each, on ``device`` (the logits')."""
    n = target.shape[0]
    m, z_sum, logp, entropy, sum_pi2_lambda = torch.empty(5, n, dtype=_F32, device=device)
    # one fp32 scratch buffer reused by every chunk (on CPU a fresh large allocation is a fresh mmap, whose page
    # faults cost as much as the arithmetic; on GPU the caching allocator would reuse it anyway)
    e_buf = torch.empty(chunk, vocab_local, dtype=_F32, device=device)
    for s in range(0, n, chunk):
        rows = slice(s, min(s + chunk, n))
        local_t, owned = local_targets(target[rows], vocab_start, vocab_local)
        x = chunk_logits(rows)
        m[rows], z_sum[rows], logp[rows], entropy[rows], sum_pi2_lambda[rows] = chunk_stats(
            x, e_buf[:x.shape[0]], local_t, owned, temperature, group)
    return m, z_sum, logp, entropy, sum_pi2_lambda


def _remember(ctx, saved, temperature, chunk, vocab_start, sum_pi2_lambda) -> None:
    """What both Functions' backward passes read."""
    ctx.save_for_backward(*saved)
    ctx.temperature = temperature
    ctx.chunk = chunk
    ctx.vocab_start = vocab_start
    ctx.mark_non_differentiable(sum_pi2_lambda)
    ctx.set_materialize_grads(False)  # an output nothing depends on brings None, not a tensor of zeros


class _VocabParallelTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, group, chunk_size):
        n, vocab_local = logits.shape
        rank, _ = tp_info(group)
        vocab_start = rank * vocab_local
        chunk = resolve_chunk(chunk_size, n, vocab_local)

        x_buf = torch.empty(chunk, vocab_local, dtype=_F32, device=logits.device)
        # fp32 copy into a reused buffer: the caller's logits are never written
        m, z_sum, logp, entropy, sum_pi2_lambda = _stats_by_chunk(
            target, vocab_start, vocab_local, chunk, temperature, group,
            lambda rows: x_buf[:rows.stop - rows.start].copy_(logits[rows]), logits.device)
        del x_buf
        # Saved: the caller's logits (a reference, not a copy; autograd's version counter catches later in-place
        # edits), the targets and four fp32 numbers per token. No softmax.
        _remember(ctx, (logits, target, m, z_sum, logp, entropy), temperature, chunk, vocab_start, sum_pi2_lambda)
        return logp, entropy, sum_pi2_lambda

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _grad_sum):
        logits, target, m, z_sum, logp, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_entropy is None):
            return None, None, None, None, None
        n, vocab_local = logits.shape
        grad_logits = torch.empty((n, vocab_local), dtype=logits.dtype, device=logits.device)  # input dtype
        # fp32 input: compute each chunk in place in its slice of the gradient; otherwise in one fp32 scratch buffer
        x_buf = None if logits.dtype == _F32 else torch.empty(ctx.chunk, vocab_local, dtype=_F32,
                                                               device=logits.device)
        for s in range(0, n, ctx.chunk):
            sl = slice(s, min(s + ctx.chunk, n))
            local_t, owned = local_targets(target[sl], ctx.vocab_start, vocab_local)
            x = grad_logits[sl] if x_buf is None else x_buf[:sl.stop - sl.start]
            x.copy_(logits[sl])
            g = chunk_grad_logits(x, m[sl], z_sum[sl], logp[sl], _rows(grad_logp, sl), local_t, owned,
                                  ctx.temperature, _rows(grad_entropy, sl), entropy[sl])
            if x_buf is not None:
                grad_logits[sl].copy_(g)  # cast to the input dtype
        # No collective: the logits shard's gradient only involves this shard's pi and the (saved) global m, Z.
        return grad_logits, None, None, None, None


def vocab_parallel_token_stats(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                               group: Optional[dist.ProcessGroup] = None,
                               chunk_size: Optional[int] = None) -> TokenStats:
    """log pi(target), entropy H and sum_j pi_j^2 (log pi_j + H) from vocab-sharded logits, pi = softmax(logits / T).

    Args:
        logits: [..., V/tp] this rank's vocabulary shard (global ids [rank * V/tp, (rank + 1) * V/tp) of ``group``),
            fp32, bf16 or fp16. Never modified.
        target: [...] global target ids (int64/int32), same leading shape as ``logits``, identical on all TP ranks.
        temperature: T > 0; the statistics are those of softmax(logits / T).
        group: the tensor-parallel process group; None means no tensor parallelism (the shard is the vocabulary).
        chunk_size: tokens per chunk (None: about ``DEFAULT_CHUNK_ELEMENTS / (V/tp)``). Extra memory: two
            chunk x V/tp fp32 buffers in forward; in backward the [..., V/tp] gradient itself plus one such buffer
            for bf16/fp16 input (none for fp32: each chunk is computed in place in its slice of the gradient).

    Per chunk: one all-reduce MAX ([chunk]) and one all-reduce SUM ([chunk, 6]); none in backward.
    Formulas (d = (logits - m) / T, m the global max): see the module docstring.

    Returns:
        ``TokenStats(logp, entropy, sum_pi2_lambda)``, fp32, shape ``target.shape``; ``logp`` and ``entropy`` have
        gradients (d log pi_a / d logits_j = (1[j == a] - pi_j) / T, dH / d logits_j = -pi_j (log pi_j + H) / T, in
        the dtype of ``logits``).
    """
    lead = logits.shape[:-1]
    if tuple(target.shape) != tuple(lead):
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)}")
    logits2 = logits.reshape(-1, logits.shape[-1])
    target1 = target.reshape(-1)
    check_common(target1, logits2.shape[0], float(temperature))
    out = _VocabParallelTokenStats.apply(logits2, target1, float(temperature), group, chunk_size)
    return TokenStats(*(o.view(lead) for o in out))


# ----------------------------------------------------------------------------------------------------------------
# fused with the output layer


class _ChunkLogits:
    """hidden_chunk @ weight^T into reused buffers, returned as fp32 scratch [c, V/tp] (ours to overwrite).

    The GEMM runs in the input dtype, as Megatron's output layer does (bf16 logits are then upcast to fp32).
    """

    def __init__(self, chunk: int, weight: torch.Tensor):
        self.weight_t = weight.t()
        self.x_buf = torch.empty(chunk, weight.shape[0], dtype=_F32, device=weight.device)
        self.low_buf = None if weight.dtype == _F32 else torch.empty(chunk, weight.shape[0], dtype=weight.dtype,
                                                                      device=weight.device)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        c = h.shape[0]
        x = self.x_buf[:c]
        if self.low_buf is None:
            return torch.mm(h, self.weight_t, out=x)
        return x.copy_(torch.mm(h, self.weight_t, out=self.low_buf[:c]))


class _FusedVocabParallelTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, temperature, group, chunk_size, allreduce_grad_hidden):
        n = hidden.shape[0]
        vocab_local = weight.shape[0]
        rank, _ = tp_info(group)
        vocab_start = rank * vocab_local
        chunk = resolve_chunk(chunk_size, n, vocab_local)

        chunk_logits = _ChunkLogits(chunk, weight)
        m, z_sum, logp, entropy, sum_pi2_lambda = _stats_by_chunk(
            target, vocab_start, vocab_local, chunk, temperature, group, lambda rows: chunk_logits(hidden[rows]),
            hidden.device)
        del chunk_logits
        # references to the inputs + 4 floats per token
        _remember(ctx, (hidden, weight, target, m, z_sum, logp, entropy), temperature, chunk, vocab_start,
                  sum_pi2_lambda)
        ctx.group = group
        ctx.allreduce_grad_hidden = allreduce_grad_hidden
        return logp, entropy, sum_pi2_lambda

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _grad_sum):
        hidden, weight, target, m, z_sum, logp, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        n = hidden.shape[0]
        vocab_local = weight.shape[0]
        dtype = hidden.dtype
        low = dtype != _F32
        tp_reduce = ctx.allreduce_grad_hidden and ctx.group is not None and dist.get_world_size(ctx.group) > 1
        # grad_hidden: each row is written once (by its chunk). When it has to be summed over the TP group and the
        # input is low precision, the per-rank partials (bf16/fp16 GEMM outputs) are kept in fp32 so that the TP sum
        # is done in fp32 (Megatron would all-reduce in the low-precision dtype).
        gh_dtype = _F32 if (tp_reduce and low) else dtype
        grad_hidden = torch.empty(hidden.shape, dtype=gh_dtype, device=hidden.device) if need_h else None
        # grad_weight accumulates over chunks (tokens): always fp32, cast once at the end.
        grad_weight = torch.zeros(weight.shape, dtype=_F32, device=weight.device) if need_w else None
        gw_tmp = torch.empty(weight.shape, dtype=dtype, device=weight.device) if (need_w and low) else None

        chunk_logits = _ChunkLogits(ctx.chunk, weight)
        for s in range(0, n, ctx.chunk):
            sl = slice(s, min(s + ctx.chunk, n))
            local_t, owned = local_targets(target[sl], ctx.vocab_start, vocab_local)
            h = hidden[sl]
            x = chunk_logits(h)  # recompute this chunk's logits
            g = chunk_grad_logits(x, m[sl], z_sum[sl], logp[sl], _rows(grad_logp, sl), local_t, owned,
                                  ctx.temperature, _rows(grad_entropy, sl), entropy[sl])
            if low:
                # as in the unfused path, the logits gradient is in the input dtype before the output layer's GEMMs
                # (tensor cores on GPU); the products are accumulated in fp32.
                g = chunk_logits.low_buf[:g.shape[0]].copy_(g)
            if need_h:
                if gh_dtype == dtype:
                    torch.mm(g, weight, out=grad_hidden[sl])  # [c, h] partial over this vocabulary shard
                else:
                    grad_hidden[sl].copy_(g @ weight)
            if need_w:
                if low:
                    grad_weight.add_(torch.mm(g.t(), h, out=gw_tmp))  # low-precision GEMM, fp32 accumulation
                else:
                    grad_weight.addmm_(g.t(), h)
        del chunk_logits, gw_tmp

        if need_h and tp_reduce:
            # The hidden states entering the vocab-parallel output layer are replicated over the TP group (Megatron's
            # copy_to_tensor_model_parallel_region: identity forward, all-reduce backward). Each rank only sees its
            # vocabulary shard, so d loss / d hidden = sum over TP ranks of (d loss / d logits_shard) @ W_shard.
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)
        if grad_hidden is not None and grad_hidden.dtype != dtype:
            grad_hidden = grad_hidden.to(dtype)
        if grad_weight is not None and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_vocab_parallel_token_stats(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                     temperature: float = 1.0, group: Optional[dist.ProcessGroup] = None,
                                     chunk_size: Optional[int] = None,
                                     allreduce_grad_hidden: bool = True) -> TokenStats:
    """``vocab_parallel_token_stats(hidden @ weight.T, ...)`` without ever materialising the [tokens, V/tp] logits.

    Args:
        hidden: [..., h] hidden states entering the output layer, replicated over the TP group (identical on every
            TP rank, as in Megatron without sequence parallelism; with sequence parallelism, all-gather them first).
        weight: [V/tp, h] this rank's shard of the vocab-parallel output weight (rows = global ids
            [rank * V/tp, (rank + 1) * V/tp)); same dtype as ``hidden``.
        target, temperature, group, chunk_size: as in ``vocab_parallel_token_stats``.
        allreduce_grad_hidden: sum grad wrt ``hidden`` over the TP group in backward (True: the full gradient, like
            Megatron's copy_to_tensor_model_parallel_region). False returns this rank's partial
            (d loss / d logits_shard) @ weight_shard, for callers that reduce (or reduce-scatter) it themselves.

    Logits are computed per chunk as hidden_chunk @ weight^T in the input dtype, then upcast to fp32; the backward
    recomputes them per chunk and produces grad_hidden (written once per row) and grad_weight (accumulated in fp32
    over chunks, returned in the weight dtype). Extra memory: ~2-3 x chunk x V/tp fp32 + an fp32 [V/tp, h]
    accumulator (+ an fp32 [tokens, h] buffer for a low-precision TP reduction), independent of tokens x vocab.

    Returns:
        ``TokenStats(logp, entropy, sum_pi2_lambda)`` as ``vocab_parallel_token_stats``; ``logp`` and ``entropy`` are
        differentiable w.r.t. ``hidden`` and ``weight``.
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match "
                         "([..., h] and [V/tp, h])")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    lead = hidden.shape[:-1]
    if tuple(target.shape) != tuple(lead):
        raise ValueError(f"target shape {tuple(target.shape)} does not match hidden {tuple(hidden.shape)}")
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    target1 = target.reshape(-1)
    check_common(target1, hidden2.shape[0], float(temperature))
    out = _FusedVocabParallelTokenStats.apply(hidden2, weight, target1, float(temperature), group, chunk_size,
                                              bool(allreduce_grad_hidden))
    return TokenStats(*(o.view(lead) for o in out))
