"""Tests of megatron_dynamo.parallel.token_stats against a float64 single-process reference.

TP = 1 runs in-process (group=None); TP = 2 and 4 run in gloo processes, with all the checks of one world size done
in a single spawned run (each spawn costs seconds). Tolerances: log-prob, H and sum pi^2 Lambda element by element
within 1e-6 relative (plus an absolute floor of 1e-8 x the largest magnitude), gradients within 1e-6 of the largest
gradient entry (entries of size pi_j ~ 1e-9 cannot be relative-1e-6 exact in fp32: exp's argument alone carries
|d| x 6e-8).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_dynamo.parallel import (TokenStats, fused_vocab_parallel_token_stats,
                                      vocab_parallel_token_stats)
from multiproc import run_on_ranks

N, V, HID = 64, 96, 16  # tokens, global vocabulary (divisible by 1, 2, 4), hidden size
SEED = 1234


# ----------------------------------------------------------------------------------------------------------------
# data and reference


def _data(seed: int = SEED, scale: float = 3.0):
    """Global logits [N, V], targets [N] (some in every eighth of the vocabulary), upstream grad [N], hidden, weight."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=gen) * scale
    target = torch.randint(0, V, (N,), generator=gen)
    target[:8] = torch.arange(8) * (V // 8) + 5  # every eighth of the vocabulary: every shard for tp in {1, 2, 4}
    # a few peaked rows whose target is the argmax: pi_a ~= 1, log pi_a ~= 0 and H ~= 0 (the hard case for fp32)
    target[8:12] = logits[8:12].argmax(-1)
    logits[torch.arange(8, 12), target[8:12]] += 4.0 * scale
    grad = torch.randn(N, generator=gen)
    hidden = torch.randn(N, HID, generator=gen)
    weight = torch.randn(V, HID, generator=gen) * (scale / math.sqrt(HID))
    return logits, target, grad, hidden, weight


def _reference(logits: torch.Tensor, target: torch.Tensor, temperature: float, grad: torch.Tensor | None = None):
    """float64 plain-torch reference: (logp, H, sum pi^2 (log pi + H)) and d(sum grad * logp)/d logits."""
    x = logits.detach().to(torch.float64).requires_grad_(grad is not None)
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    p = logp_all.exp()
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        safe = torch.where(p > 0, logp_all, torch.zeros_like(logp_all))  # 0 * log 0 = 0 (masked -inf logits)
        entropy = -(p * safe).sum(-1)
        sum_pi2_lambda = (p * p * (safe + entropy.unsqueeze(-1))).sum(-1)
    out = {"logp": logp.detach(), "entropy": entropy, "sum_pi2_lambda": sum_pi2_lambda}
    if grad is not None:
        (out["grad"],) = torch.autograd.grad((logp * grad.double()).sum(), x)
    return out


def _reference_with_entropy(logits, target, temperature, grad, grad_h):
    """float64 autograd of sum(g * log pi_a + g^H * H) w.r.t. the logits (masked -inf logits: 0 * log 0 = 0)."""
    x = logits.detach().to(torch.float64).requires_grad_()
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    (g,) = torch.autograd.grad((logp * grad.double()).sum() + (entropy * grad_h.double()).sum(), x)
    return g


def _reference_fused(hidden, weight, target, temperature, grad):
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.t()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    gh, gw = torch.autograd.grad((logp * grad.double()).sum(), (h, w))
    ref = _reference(logits.detach(), target, temperature)
    ref.update(grad_hidden=gh, grad_weight=gw)
    return ref


def _assert_stats_close(ours, ref: dict, rtol: float = 1e-6) -> None:
    for name in ("logp", "entropy", "sum_pi2_lambda"):
        a = getattr(ours, name) if isinstance(ours, TokenStats) else ours[name]
        b = ref[name]
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=1e-8 * b.abs().max().item(), msg=name)


def _assert_grad_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6, name: str = "grad") -> None:
    err = (a.double() - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= tol * scale, f"{name}: max error {err:.3e} > {tol:g} x max |ref| {scale:.3e}"


def _shard(t: torch.Tensor, rank: int, tp: int, dim: int = -1) -> torch.Tensor:
    return t.chunk(tp, dim=dim)[rank].contiguous()


# ----------------------------------------------------------------------------------------------------------------
# TP = 1, in process


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [7, 64, None])  # 7 does not divide 64; None = automatic (whole batch here)
def test_tp1_matches_float64_reference(temperature, chunk_size):
    logits, target, grad, _, _ = _data()
    x = logits.clone().requires_grad_()
    before, version = x.detach().clone(), x._version
    out = vocab_parallel_token_stats(x, target, temperature, group=None, chunk_size=chunk_size)
    assert isinstance(out, TokenStats)
    assert out.logp.requires_grad and out.entropy.requires_grad and not out.sum_pi2_lambda.requires_grad
    ref = _reference(logits, target, temperature, grad)
    _assert_stats_close(out, ref)
    (g,) = torch.autograd.grad((out.logp * grad).sum(), x)
    assert g.dtype == torch.float32 and g.shape == x.shape
    _assert_grad_close(g, ref["grad"])
    # the caller's logits are untouched: same values, no in-place op recorded
    assert torch.equal(x.detach(), before) and x._version == version


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [7, None])
def test_entropy_gradient_matches_float64_autograd(temperature, chunk_size):
    """dH / dz_j = -pi_j (log pi_j + H) / T, alone and with the log-prob's gradient, unfused and fused, with a masked
    (-inf) logit in a row; the entropy gradient alone is not the log-prob's (the test can tell them apart)."""
    logits, target, grad, hidden, weight = _data()
    grad_h = torch.randn(N, generator=torch.Generator().manual_seed(7))
    logits[20, (target[20] + 1) % V] = float("-inf")
    x = logits.clone().requires_grad_()
    out = vocab_parallel_token_stats(x, target, temperature, chunk_size=chunk_size)
    (g_both,) = torch.autograd.grad((out.logp * grad).sum() + (out.entropy * grad_h).sum(), x, retain_graph=True)
    (g_h,) = torch.autograd.grad((out.entropy * grad_h).sum(), x)
    assert torch.isfinite(g_both).all() and g_both[20, (target[20] + 1) % V] == 0
    _assert_grad_close(g_both, _reference_with_entropy(logits, target, temperature, grad, grad_h))
    zero = torch.zeros(N)
    _assert_grad_close(g_h, _reference_with_entropy(logits, target, temperature, zero, grad_h))
    assert (g_h.double() - _reference(logits, target, temperature, grad)["grad"]).abs().max() > 1e-2

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused = fused_vocab_parallel_token_stats(h, w, target, temperature, chunk_size=chunk_size)
    gh, gw = torch.autograd.grad((fused.logp * grad).sum() + (fused.entropy * grad_h).sum(), (h, w))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = h64 @ w64.t()
    (g_z,) = [_reference_with_entropy(z.detach(), target, temperature, grad, grad_h)]
    ref_h, ref_w = torch.autograd.grad(z, (h64, w64), g_z)
    _assert_grad_close(gh, ref_h, name="fused grad_hidden")
    _assert_grad_close(gw, ref_w, name="fused grad_weight")


def test_peaked_rows_are_accurate_relative_to_their_size():
    """log pi_a ~= -1e-5 and H ~= 1e-4 on the peaked rows: still 1e-6 relative (an fp32 Z ~= 1 would not be)."""
    logits, target, _, _, _ = _data()
    out = vocab_parallel_token_stats(logits, target, 1.0)
    ref = _reference(logits, target, 1.0)
    rows = slice(8, 12)
    assert (ref["logp"][rows].abs() < 1e-3).all()  # the case is really peaked
    for name in ("logp", "entropy"):
        torch.testing.assert_close(getattr(out, name)[rows].double(), ref[name][rows], rtol=1e-6, atol=0, msg=name)


def test_entropy_change_factor_is_the_first_order_entropy_change():
    """dH along the step e_a - pi of the logits equals -(pi_a Lambda_a - sum pi^2 Lambda) (Theorem 1)."""
    logits, target, _, _, _ = _data()
    temperature = 0.7
    out = vocab_parallel_token_stats(logits, target, temperature, chunk_size=10)
    z = (logits.double() / temperature).requires_grad_()
    p = torch.softmax(z, -1)
    entropy = -(p * torch.log_softmax(z, -1)).sum(-1)
    (dh_dz,) = torch.autograd.grad(entropy.sum(), z)  # rows are independent
    step = torch.nn.functional.one_hot(target, V).double() - p.detach()
    expected = -(dh_dz * step).sum(-1)
    assert not out.sum_pi2_lambda.requires_grad
    logp = out.logp.detach()
    factor = torch.exp(logp) * (logp + out.entropy.detach()) - out.sum_pi2_lambda  # pi_a Lambda_a - sum pi^2 Lambda
    torch.testing.assert_close(factor.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_extreme_logits_stay_finite_and_correct():
    logits, target, grad, _, _ = _data(scale=1e4)  # +-1e4 (and 5e4 on the peaked rows)
    logits[20, 3] = -float("inf")  # a masked vocabulary entry
    logits[21, :] = 1e4            # an exact tie over the whole row
    x = logits.clone().requires_grad_()
    out = vocab_parallel_token_stats(x, target, 0.7, chunk_size=9)
    (g,) = torch.autograd.grad((out.logp * grad).sum(), x)
    for t in (*out, g):
        assert torch.isfinite(t).all()
    ref = _reference(logits, target, 0.7, grad)
    torch.testing.assert_close(out.logp.double(), ref["logp"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.entropy.double(), ref["entropy"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.sum_pi2_lambda.double(), ref["sum_pi2_lambda"], rtol=1e-6, atol=1e-6)
    assert out.entropy[21].item() == pytest.approx(math.log(V), rel=1e-6)  # tie -> uniform
    _assert_grad_close(g, ref["grad"])


def test_bf16_input_accumulates_in_fp32():
    logits, target, grad, _, _ = _data()
    x = logits.to(torch.bfloat16).requires_grad_()
    out = vocab_parallel_token_stats(x, target, 0.7, chunk_size=13)
    ref = _reference(x.detach(), target, 0.7, grad)  # reference on the same (bf16-rounded) values
    # the bf16 values are exact in fp32, so the statistics are as accurate as from fp32 input
    _assert_stats_close(out, ref, rtol=1e-5)
    (g,) = torch.autograd.grad((out.logp * grad).sum(), x)
    assert g.dtype == torch.bfloat16
    _assert_grad_close(g, ref["grad"], tol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_unfused_tp1(dtype):
    _, target, grad, hidden, weight = _data()
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    fused = fused_vocab_parallel_token_stats(h, w, target, 0.7, chunk_size=11)
    gh, gw = torch.autograd.grad((fused.logp * grad).sum(), (h, w))
    assert gh.dtype == dtype and gw.dtype == dtype
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    plain = vocab_parallel_token_stats(h2 @ w2.t(), target, 0.7, chunk_size=64)
    gh2, gw2 = torch.autograd.grad((plain.logp * grad).sum(), (h2, w2))
    ref = _reference_fused(h.detach(), w.detach(), target, 0.7, grad)
    if dtype == torch.float32:
        for a, b in zip(fused, plain):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        _assert_stats_close(fused, ref, rtol=1e-5)  # fp32 GEMM rounding of the logits (h = 16) included
        _assert_grad_close(gh, ref["grad_hidden"], 1e-6, "grad_hidden")
        _assert_grad_close(gw, ref["grad_weight"], 1e-6, "grad_weight")
    else:
        for a, b in zip(fused, plain):  # same bf16 GEMM per row -> same logits -> same statistics
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        _assert_grad_close(gh, gh2.double(), 2e-2, "grad_hidden vs unfused")
        _assert_grad_close(gw, gw2.double(), 2e-2, "grad_weight vs unfused")
        _assert_grad_close(gh, ref["grad_hidden"], 3e-2, "grad_hidden")
        _assert_grad_close(gw, ref["grad_weight"], 3e-2, "grad_weight")


def test_leading_dims_are_flattened():
    logits, target, _, _, _ = _data()
    out = vocab_parallel_token_stats(logits.view(4, N // 4, V), target.view(4, N // 4), chunk_size=5)
    flat = vocab_parallel_token_stats(logits, target, chunk_size=5)
    assert out.logp.shape == (4, N // 4)
    for a, b in zip(out, flat):
        torch.testing.assert_close(a.reshape(-1), b, rtol=0, atol=0)


def test_saves_no_softmax():
    """Backward keeps only references to the inputs plus per-token vectors (no [tokens, vocab] tensor of its own)."""
    logits, target, _, hidden, weight = _data()
    x = logits.clone().requires_grad_()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_token_stats(x, target, 0.7, chunk_size=8)
        fused_vocab_parallel_token_stats(h, w, target, 0.7, chunk_size=8)
    inputs = {t.data_ptr() for t in (x, h, w, target)}
    big = [t for t in saved if t.numel() > N]
    assert len(big) == 3 and all(t.data_ptr() in inputs for t in big)  # logits; hidden, weight: not copies
    assert len(saved) >= 8  # the hooks really saw the saved tensors


class _NewStorageRecorder(TorchDispatchMode):
    """Records the size in bytes of every tensor storage an op creates (views and in-place results excluded)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def test_memory_is_bounded_by_the_chunk():
    n, chunk = 256, 16
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, V, generator=gen, requires_grad=True)
    hidden = torch.randn(n, HID, generator=gen, requires_grad=True)
    weight = torch.randn(V, HID, generator=gen, requires_grad=True)
    target = torch.randint(0, V, (n,), generator=gen)
    full = n * V * 4  # bytes of the fp32 [tokens, vocab] logits
    chunk_bound = chunk * V * 4

    with _NewStorageRecorder() as fwd:
        out = vocab_parallel_token_stats(logits, target, 0.7, chunk_size=chunk)
    with _NewStorageRecorder() as bwd:
        torch.autograd.grad(out.logp.sum(), logits)
    assert max(fwd.sizes) <= chunk_bound
    assert sorted(bwd.sizes)[-2] <= chunk_bound and max(bwd.sizes) == full  # the gradient itself, once

    with _NewStorageRecorder() as fused_rec:
        out = fused_vocab_parallel_token_stats(hidden, weight, target, 0.7, chunk_size=chunk)
        torch.autograd.grad(out.logp.sum(), (hidden, weight))
    assert max(fused_rec.sizes) <= max(chunk_bound, n * HID * 4, V * HID * 4) < full


def test_rejects_bad_input():
    logits, target, _, hidden, weight = _data()
    with pytest.raises(ValueError):
        vocab_parallel_token_stats(logits, target[:-1])
    with pytest.raises(ValueError):
        vocab_parallel_token_stats(logits, target, temperature=0.0)
    with pytest.raises(TypeError):
        vocab_parallel_token_stats(logits, target.float())
    with pytest.raises(ValueError):
        fused_vocab_parallel_token_stats(hidden, weight.t(), target)


# ----------------------------------------------------------------------------------------------------------------
# TP = 2 and 4, gloo processes


class _CountAllReduce:
    """Wraps torch.distributed.all_reduce to record the op of every call (restored on exit)."""

    def __enter__(self):
        self.ops, self._orig = [], dist.all_reduce

        def wrapped(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.ops.append(("max" if op == dist.ReduceOp.MAX else "sum" if op == dist.ReduceOp.SUM else str(op),
                             tuple(tensor.shape)))
            return self._orig(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = wrapped
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _tp_rank_checks(rank: int, world_size: int, seed: int) -> dict:
    group = dist.new_group(list(range(world_size)))  # a non-default group, as the TP group is in Megatron
    logits, target, grad, hidden, weight = _data(seed)
    res = {}

    # fp32, T = 0.7, chunk 7 (does not divide 64), collectives counted
    x = _shard(logits, rank, world_size).requires_grad_()
    before, version = x.detach().clone(), x._version
    with _CountAllReduce() as fwd_ops:
        out = vocab_parallel_token_stats(x, target, 0.7, group=group, chunk_size=7)
    with _CountAllReduce() as bwd_ops:
        (g,) = torch.autograd.grad((out.logp * grad).sum(), x)
    res["fp32"] = dict(out._asdict(), grad=g)
    res["fwd_ops"], res["bwd_ops"] = fwd_ops.ops, bwd_ops.ops
    res["unchanged"] = torch.equal(x.detach(), before) and x._version == version

    # the entropy's gradient too (an entropy bonus): still no collective in backward
    x = _shard(logits, rank, world_size).requires_grad_()
    out = vocab_parallel_token_stats(x, target, 0.7, group=group, chunk_size=7)
    grad_h = torch.randn(N, generator=torch.Generator().manual_seed(7))
    with _CountAllReduce() as entropy_bwd_ops:
        (g,) = torch.autograd.grad((out.logp * grad).sum() + (out.entropy * grad_h).sum(), x)
    res["entropy_grad"], res["entropy_bwd_ops"] = g, entropy_bwd_ops.ops

    # extreme logits
    ext, _, _, _, _ = _data(seed, scale=1e4)
    x = _shard(ext, rank, world_size).requires_grad_()
    out = vocab_parallel_token_stats(x, target, 0.7, group=group, chunk_size=9)
    (g,) = torch.autograd.grad((out.logp * grad).sum(), x)
    res["extreme"] = dict(out._asdict(), grad=g)

    # bf16
    x = _shard(logits, rank, world_size).to(torch.bfloat16).requires_grad_()
    out = vocab_parallel_token_stats(x, target, 1.0, group=group, chunk_size=16)
    (g,) = torch.autograd.grad((out.logp * grad).sum(), x)
    res["bf16"] = dict(out._asdict(), grad=g)

    # fused with the output layer: grad wrt hidden all-reduced over the group, or left as this rank's partial
    w_shard = _shard(weight, rank, world_size, dim=0)
    for name, reduce in (("fused", True), ("fused_partial", False)):
        h = hidden.clone().requires_grad_()
        w = w_shard.clone().requires_grad_()
        with _CountAllReduce() as fused_fwd_ops:
            out = fused_vocab_parallel_token_stats(h, w, target, 0.7, group=group, chunk_size=10,
                                                   allreduce_grad_hidden=reduce)
        with _CountAllReduce() as fused_bwd_ops:
            gh, gw = torch.autograd.grad((out.logp * grad).sum(), (h, w))
        res[name] = dict(out._asdict(), grad_hidden=gh, grad_weight=gw, fwd_ops=fused_fwd_ops.ops,
                         bwd_ops=fused_bwd_ops.ops)
    unfused = vocab_parallel_token_stats(hidden @ w_shard.t(), target, 0.7, group=group, chunk_size=64)
    res["unfused_same_logits"] = unfused._asdict()
    return res


def _check_tp(world_size: int) -> None:
    logits, target, grad, hidden, weight = _data(SEED)
    shard_of_target = (target // (V // world_size)).unique().tolist()
    assert shard_of_target == list(range(world_size))  # targets fall in every shard
    results = run_on_ranks(_tp_rank_checks, world_size, SEED)
    vl = V // world_size
    chunks = math.ceil(N / 7)

    ref = _reference(logits, target, 0.7, grad)
    for rank, res in enumerate(results):
        _assert_stats_close(res["fp32"], ref)
        for name in ("logp", "entropy", "sum_pi2_lambda"):  # every TP rank gets the same statistics
            assert torch.equal(res["fp32"][name], results[0]["fp32"][name]), name
        _assert_grad_close(res["fp32"]["grad"], _shard(ref["grad"], rank, world_size))
        # one MAX ([chunk]) and one SUM ([chunk, 6]) all-reduce per chunk, in that order; none in backward
        assert [op for op, _ in res["fwd_ops"]] == ["max", "sum"] * chunks
        assert res["fwd_ops"][0] == ("max", (7,)) and res["fwd_ops"][1] == ("sum", (7, 6))
        assert res["bwd_ops"] == []
        assert res["unchanged"]
    ref_entropy = _reference_with_entropy(logits, target, 0.7, grad, torch.randn(N, generator=torch.Generator().manual_seed(7)))
    for rank, res in enumerate(results):
        _assert_grad_close(res["entropy_grad"], _shard(ref_entropy, rank, world_size), name="grad with entropy")
        assert res["entropy_bwd_ops"] == []
    grad_full = torch.cat([r["fp32"]["grad"] for r in results], dim=-1)
    assert grad_full.shape == (N, V)
    _assert_grad_close(grad_full, ref["grad"])

    ref_ext = _reference(_data(SEED, scale=1e4)[0], target, 0.7, grad)
    for rank, res in enumerate(results):
        for t in res["extreme"].values():
            assert torch.isfinite(t).all()
        torch.testing.assert_close(res["extreme"]["logp"].double(), ref_ext["logp"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res["extreme"]["entropy"].double(), ref_ext["entropy"], rtol=1e-6, atol=1e-6)
        _assert_grad_close(res["extreme"]["grad"], _shard(ref_ext["grad"], rank, world_size))

    ref_bf16 = _reference(logits.to(torch.bfloat16), target, 1.0, grad)
    for rank, res in enumerate(results):
        _assert_stats_close(res["bf16"], ref_bf16, rtol=1e-5)
        assert res["bf16"]["grad"].dtype == torch.bfloat16 and res["bf16"]["grad"].shape == (N, vl)
        _assert_grad_close(res["bf16"]["grad"], _shard(ref_bf16["grad"], rank, world_size), tol=1e-2)

    ref_f = _reference_fused(hidden, weight, target, 0.7, grad)
    for rank, res in enumerate(results):
        f = res["fused"]
        _assert_stats_close(f, ref_f, rtol=1e-5)
        for name in ("logp", "entropy", "sum_pi2_lambda"):  # fused == unfused on the same logits
            torch.testing.assert_close(f[name], res["unfused_same_logits"][name], rtol=1e-6, atol=1e-7)
        _assert_grad_close(f["grad_hidden"], ref_f["grad_hidden"], name="grad_hidden (all-reduced)")
        _assert_grad_close(f["grad_weight"], _shard(ref_f["grad_weight"], rank, world_size, dim=0),
                           name="grad_weight shard")
        assert [op for op, _ in f["fwd_ops"]] == ["max", "sum"] * math.ceil(N / 10)
        assert f["bwd_ops"] == [("sum", (N, HID))]  # the grad-hidden all-reduce, once
        assert res["fused_partial"]["bwd_ops"] == []
    # without the reduction each rank holds a partial; the partials sum to the full gradient and none equals it
    partials = [r["fused_partial"]["grad_hidden"] for r in results]
    _assert_grad_close(sum(partials), ref_f["grad_hidden"], name="sum of partial grad_hidden")
    assert (partials[0].double() - ref_f["grad_hidden"]).abs().max() > 1e-3


@pytest.mark.distributed
def test_tp2_matches_reference():
    _check_tp(2)


@pytest.mark.distributed
def test_tp4_matches_reference():
    _check_tp(4)
