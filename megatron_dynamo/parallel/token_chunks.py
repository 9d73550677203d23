"""The chunk kernels behind ``parallel/token_stats.py``: one chunk of tokens' statistics of the softmax over a
vocabulary shard (forward) and its gradient w.r.t. the logits (backward), the chunk size, the tensor-parallel group's
rank/size and its all-reduce. Every collective of the token statistics goes through :func:`all_reduce` here; the
autograd functions that call these kernels, and the module doc with the maths, are in ``token_stats.py``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

# Automatic chunk size: chunk * (V/tp) ~= 2^25 elements, i.e. 128 MiB per fp32 scratch buffer (two are live in the
# forward). Big enough for efficient kernels/GEMMs, small enough to be negligible next to the model.
DEFAULT_CHUNK_ELEMENTS = 1 << 25

_F32 = torch.float32


def tp_info(group) -> tuple[int, int]:
    """(rank in the TP group, TP size); group=None means no tensor parallelism."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def resolve_chunk(chunk_size: Optional[int], n_tokens: int, vocab_local: int) -> int:
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // max(1, vocab_local))
        if chunk_size >= 64:
            chunk_size -= chunk_size % 64
    chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return max(1, min(chunk_size, n_tokens))


def dot_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_j a[i, j] * b[i, j] per row, as a batched [1, V] x [V, 1] product: no [rows, V] temporary."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).view(a.shape[0])


def local_targets(target: torch.Tensor, vocab_start: int, vocab_local: int):
    """Shard-local target index (clamped into range so that gather/scatter are always legal) and ownership mask."""
    local = target - vocab_start
    owned = (local >= 0) & (local < vocab_local)
    return local.clamp(0, vocab_local - 1).unsqueeze(-1), owned


def chunk_stats(x: torch.Tensor, e: torch.Tensor, local_t: torch.Tensor, owned: torch.Tensor, temperature: float,
                 group):
    """Statistics of one chunk. ``x`` is fp32 scratch [c, V/tp] holding the raw logits (not yet divided by T); it is
    overwritten. ``e`` is a second fp32 scratch buffer of the same shape (contents ignored, overwritten).

    Returns (m, Z, logp, H, sum_pi2_lambda), each [c] fp32, m being the max of the *raw* logits (max(x / T) = m / T
    since T > 0: subtracting before dividing keeps d = (x - m) / T accurate relative to d, not to x / T).
    Exactly one MAX and one SUM all-reduce.
    """
    # 1) global max over the whole vocabulary (all shards). Rows whose logits are all -inf keep m finite (0) so
    #    that x - m is -inf (-> exp 0), never nan; such a row has no distribution anyway.
    local_max, top_idx = x.max(dim=-1)
    m = local_max.clone()
    all_reduce(m, dist.ReduceOp.MAX, group)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    is_top = local_max == m  # this shard holds the global max of the row (at top_idx, where d == 0 exactly)

    # 2) d = (x - m) / T <= 0, in place. Clamp -inf (masked entries) to the most negative finite float: exp gives 0
    #    and 0 * (finite) = 0, whereas 0 * (-inf) would be nan. Finite d (even -2e4 for +-1e4 logits) needs no guard.
    d = x.sub_(m.unsqueeze(-1))
    if temperature != 1.0:
        d.div_(temperature)
    d.clamp_(min=torch.finfo(_F32).min)
    d_a = d.gather(-1, local_t).squeeze(-1) * owned  # target's d on its owning shard, 0 elsewhere

    torch.exp(d, out=e)  # e^{d} in [0, 1]
    # Take the global max's own term (exactly e^0 = 1) out of the sums and count it separately: Z = n_top + R with
    # R = sum of the other terms. For peaked distributions Z ~= 1 and an fp32 Z would carry an absolute error of
    # ~1e-7, i.e. a large *relative* error on log Z ~= log pi_a ~= 0 and on small H; log Z = log n + log1p(R / n)
    # keeps them accurate. The top term contributes 0 to S1 and S3 (d = 0) and n_top to S2.
    top_val = e.gather(-1, top_idx.unsqueeze(-1))
    e.scatter_(-1, top_idx.unsqueeze(-1), top_val * (~is_top).unsqueeze(-1))
    r = e.sum(dim=-1)                    # R  = Z - n_top
    s2 = dot_rows(e, e)                 # S2 - n_top
    ed = d.mul_(e)                       # e^{d} d (overwrites d, no longer needed)
    s1 = ed.sum(dim=-1)                  # S1 = sum e^{d} d
    s3 = dot_rows(ed, e)                # S3 = sum e^{2d} d

    # 3) one SUM all-reduce of the stacked partials
    partial = torch.stack([r, is_top.to(_F32), s1, s2, s3, d_a], dim=-1)  # [c, 6]
    all_reduce(partial, dist.ReduceOp.SUM, group)
    r, n_top, s1, s2, s3, d_a = partial.unbind(-1)  # n_top >= 1 (several only for ties across shards)

    z_sum = n_top + r
    s2 = s2 + n_top
    log_z = torch.log(n_top) + torch.log1p(r / n_top)
    s1_over_z = s1 / z_sum
    logp = d_a - log_z
    entropy = log_z - s1_over_z
    sum_pi2_lambda = (s3 - s2 * s1_over_z) / (z_sum * z_sum)
    return m, z_sum, logp, entropy, sum_pi2_lambda


def chunk_grad_logits(x: torch.Tensor, m: torch.Tensor, z_sum: torch.Tensor, logp: torch.Tensor,
                       grad: torch.Tensor | None, local_t: torch.Tensor, owned: torch.Tensor, temperature: float,
                       grad_entropy: torch.Tensor | None = None,
                       entropy: torch.Tensor | None = None) -> torch.Tensor:
    """d(sum_t g_t log pi_{a_t} + sum_t g^H_t H_t) / d logits for one chunk, fp32, computed in place in ``x`` (raw
    logits, fp32 scratch). ``grad`` (g) or ``grad_entropy`` (g^H) may be None (no gradient reaches that output).

    pi_j = e^{(x_j - m) / T} / Z (recomputed from the saved m and Z, no saved softmax);
    d log pi_a / d logits_j = (1[j == a] - pi_j) / T. At j = a it is written as -expm1(log pi_a) / T from the saved
    log pi_a, which stays accurate when pi_a ~= 1 (1 - pi_a would cancel).
    dH / d logits_j = -pi_j (log pi_j + H) / T (the saved H; log pi_j = (x_j - m) / T - log Z): needs one more
    [chunk, V/tp] buffer, allocated only when an entropy gradient arrives (an entropy bonus in the loss).
    """
    coef = (grad.to(_F32) if grad is not None else torch.zeros_like(z_sum)) / temperature  # g_t / T
    d = x.sub_(m.unsqueeze(-1))
    if temperature != 1.0:
        d.div_(temperature)
    if grad_entropy is None:
        g = d.exp_().div_(z_sum.unsqueeze(-1)).mul_(-coef.unsqueeze(-1))  # -pi_j g / T
        at_target = torch.where(owned, -coef * torch.expm1(logp), g.gather(-1, local_t).squeeze(-1))
    else:
        coef_h = grad_entropy.to(_F32) / temperature  # g^H_t / T
        log_z = torch.log(z_sum)
        d.clamp_(min=torch.finfo(_F32).min)  # masked (-inf) logits: pi_j = 0 and a finite log pi_j, never 0 * inf
        p = torch.exp(d).div_(z_sum.unsqueeze(-1))
        # pi_j * (-g / T - (g^H / T) (d_j - log Z + H)), in place in d; pi_j d_j first (0 for masked logits, where
        # d_j is the most negative float and any coefficient could overflow it)
        row = -coef - coef_h * (entropy - log_z)
        g = d.mul_(p).mul_(-coef_h.unsqueeze(-1)).addcmul_(p, row.unsqueeze(-1))
        del p
        pi_a = torch.exp(logp)
        at_target = torch.where(owned, -coef * torch.expm1(logp) - coef_h * pi_a * (logp + entropy),
                                g.gather(-1, local_t).squeeze(-1))
    g.scatter_(-1, local_t, at_target.unsqueeze(-1))  # (1 - pi_a) g / T (+ the entropy term) at the target
    return g


def check_common(target: torch.Tensor, n_tokens: int, temperature: float) -> None:
    if target.dim() != 1 or target.shape[0] != n_tokens:
        raise ValueError(f"target must have shape [{n_tokens}], got {tuple(target.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be an integer tensor, got {target.dtype}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
