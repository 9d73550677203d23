"""The local spec's written-out kernels (models/local_kernels.py) against float64 references written here, and the
actor's fused Adam against the Adam formula."""

import math

import pytest
import torch

from hf_reference import TINY_QWEN2, hf_state_dict
from multiproc import run_on_ranks

from megatron_dynamo.models.local_kernels import LocalRMSNorm, apply_rotary


def _rms_reference(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_rms_norm_values_and_gradients_match_float64(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(13, 3, 48, generator=g) * 3).to(dtype).requires_grad_()
    upstream = torch.randn(13, 3, 48, generator=g).to(dtype)
    norm = LocalRMSNorm(None, 48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) + 0.5)
    out = norm(x)
    out.backward(upstream)

    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    ref = _rms_reference(x64, w64, 1e-6)
    ref.backward(upstream.double())
    assert out.dtype == dtype
    scale = lambda t: t.abs().max().item()  # noqa: E731
    assert (out.double() - ref).abs().max().item() <= tol * scale(ref)
    assert (x.grad.double() - x64.grad).abs().max().item() <= tol * scale(x64.grad)
    assert (norm.weight.grad.double() - w64.grad).abs().max().item() <= tol * scale(w64.grad)


def _rotary_reference(t, freqs):
    """Qwen's rotary embedding: pairs (i, i + d/2) rotated by the angle freqs[..., i]; the rest passes through."""
    rot = freqs.shape[-1]
    half = rot // 2
    x1, x2, rest = t[..., :half], t[..., half:rot], t[..., rot:]
    cos, sin = torch.cos(freqs[..., :half]), torch.sin(freqs[..., :half])
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


@pytest.mark.parametrize("rot_dim", [32, 16])
def test_rotary_values_and_gradients_match_float64(rot_dim):
    g = torch.Generator().manual_seed(1)
    s, b, heads, d = 11, 3, 4, 32
    angles = torch.randn(s, 1, 1, rot_dim // 2, generator=g) * 3
    freqs = torch.cat((angles, angles), dim=-1)  # Megatron's layout: the half's angles twice
    t = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    upstream = torch.randn(s, b, heads, d, generator=g)
    out = apply_rotary(t, freqs)
    out.backward(upstream)

    t64 = t.detach().double().requires_grad_()
    ref = _rotary_reference(t64, freqs.double())
    ref.backward(upstream.double())
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (t.grad.double() - t64.grad).abs().max().item() < 1e-5


def test_rotary_angles_follow_the_tensor_they_come_from():
    """The cached cos/sin belong to one angle tensor: new angles of the same shape give their own rotation."""
    g = torch.Generator().manual_seed(2)
    t = torch.randn(5, 2, 2, 8, generator=g)
    first, second = (torch.randn(5, 1, 1, 4, generator=g).repeat(1, 1, 1, 2) for _ in range(2))
    for freqs in (first, second, first):
        assert torch.allclose(apply_rotary(t, freqs), _rotary_reference(t, freqs), atol=1e-6)


def test_interleaved_rotary_is_refused():
    with pytest.raises(ValueError, match="interleaved"):
        apply_rotary(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4), interleaved=True)


def _adam_worker(rank, world_size, config):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    actor = MegatronActor(config, optim=optim, hf_weights=hf_state_dict(config).__getitem__)
    groups = [g for inner in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
              for g in inner.optimizer.param_groups]
    ids = torch.randint(1, actor.arch.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))

    def loss_fn(logits, mb):
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), mb["labels"].flatten(), reduction="sum")
        return loss, {}

    params = [p for chunk in actor.chunks for p in chunk.parameters()]
    history = []
    for _ in range(2):
        actor.forward_backward([{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], loss_fn)
        before = [p.detach().double().clone() for p in params]
        grads = [p.main_grad.detach().double().clone() for p in params]
        actor.optimizer_step()
        history.append((before, grads, [p.detach().double().clone() for p in params]))
    settings = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    return {"fused": [g["fused"] for g in groups], "history": history,
            "settings": [settings[id(p)] for p in params]}


@pytest.mark.distributed
def test_the_actors_adam_is_fused_on_the_cpu_and_steps_as_the_formula():
    result = run_on_ranks(_adam_worker, 1, TINY_QWEN2)[0]
    assert result["fused"] and all(result["fused"])
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    moments = None
    for step, (before, grads, after) in enumerate(result["history"], start=1):
        moments = moments or [(torch.zeros_like(g), torch.zeros_like(g)) for g in grads]
        for i, (p, grad, new, (lr, wd)) in enumerate(zip(before, grads, after, result["settings"])):
            m, v = moments[i]
            m = beta1 * m + (1 - beta1) * grad
            v = beta2 * v + (1 - beta2) * grad * grad
            moments[i] = (m, v)
            expected = p * (1 - lr * wd) - lr * (m / (1 - beta1 ** step)) / (
                (v / (1 - beta2 ** step)).sqrt() + eps)
            assert (new - expected).abs().max().item() < 1e-6 * max(1.0, p.abs().max().item()), (step, i)
        assert not math.isnan(sum(a.sum().item() for a in after))
