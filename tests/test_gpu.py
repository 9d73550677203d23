"""GPU-only paths: the Transformer-Engine layer spec, bf16 kernels, the GPU side of the weight export and of the
token statistics. Skipped without CUDA (see conftest); the TE tests also need Transformer Engine to import.
scripts/gpu_check.sh runs this file as its first part."""

import os

import pytest
import torch

from hf_reference import REPO, TINY_QWEN2, hf_state_dict
from multiproc import run_on_ranks

from megatron_dynamo.models.qwen import te_available

pytestmark = pytest.mark.gpu
QWEN_1_5B = os.path.join(REPO, "configs", "models", "qwen2.5-math-1.5b.json")
# te_available() is False at once without CUDA (no import attempted); on a GPU it imports transformer_engine.pytorch.
requires_te = pytest.mark.skipif(not te_available(), reason="Transformer Engine does not import here")


def _te_step_worker(rank, world_size, config, seq_len):
    from megatron_dynamo.models.qwen import te_available
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    assert te_available(), "Transformer Engine must import on a CUDA machine with the gpu extra installed"
    actor = MegatronActor(config, dtype="bf16", optim=OptimConfig(lr=1e-5), use_te=True)
    ids = torch.randint(0, actor.arch.vocab_size, (2, seq_len + 1), device="cuda")
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def loss_fn(logits, mb):
        from megatron.core import tensor_parallel

        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb["labels"]).mean()
        return loss, {"loss": loss.detach()}

    losses = []
    for _ in range(3):
        losses.append(actor.forward_backward([batch], loss_fn)[0]["loss"].item())
        result = actor.optimizer_step()
    return {"losses": losses, "grad_norm": result.grad_norm,
            "param_dtype": str(next(p for _, p in actor.named_parameters()).dtype)}


@requires_te
def test_te_spec_trains_qwen_1_5b_shape_in_bf16():
    (out,) = run_on_ranks(_te_step_worker, 1, QWEN_1_5B, 1024)
    assert out["param_dtype"] == "torch.bfloat16"
    assert all(torch.isfinite(torch.tensor(out["losses"]))) and out["grad_norm"] > 0


def _te_vs_local_worker(rank, world_size, config):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    state = hf_state_dict(config)
    ids = torch.randint(0, 128, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    logits = {}
    for use_te in (True, False):
        actor = MegatronActor(config, dtype="fp32", use_te=use_te, hf_weights=state.__getitem__)
        out = actor.forward_backward([{"input_ids": ids}], lambda lg, mb: (lg.sum(), {"logits": lg.detach()}),
                                     forward_only=True)
        logits[use_te] = out[0]["logits"].cpu()
    return (logits[True] - logits[False]).abs().max().item()


@requires_te
def test_te_spec_matches_local_spec_with_the_same_weights():
    (diff,) = run_on_ranks(_te_vs_local_worker, 1, TINY_QWEN2)
    assert diff < 1e-3  # TF32 matmuls in TE


def _local_bf16_worker(rank, world_size, config):
    from megatron.core import tensor_parallel

    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    actor = MegatronActor(config, dtype="bf16", optim=OptimConfig(lr=1e-3, weight_decay=0.0), use_te=False)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, actor.arch.vocab_size, (4, 65), generator=gen).cuda()
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def loss_fn(logits, mb):
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb["labels"]).mean()
        return loss, {"loss": loss.detach()}

    losses, norms = [], []
    for _ in range(8):
        losses.append(actor.forward_backward([batch], loss_fn)[0]["loss"].item())
        norms.append(actor.optimizer_step().grad_norm)
    param = next(p for _, p in actor.named_parameters())
    return {"losses": losses, "norms": norms, "dtype": str(param.dtype), "device": param.device.type}


def test_local_spec_trains_in_bf16_on_the_gpu():
    """The path every GPU run without Transformer Engine takes: local spec, bf16 (Float16Module), NCCL, DDP buffers,
    Megatron's bf16 optimizer, on a batch held on the GPU."""
    (out,) = run_on_ranks(_local_bf16_worker, 1, TINY_QWEN2)
    assert out["dtype"] == "torch.bfloat16" and out["device"] == "cuda"
    assert all(torch.isfinite(torch.tensor(out["losses"] + out["norms"])))
    assert out["losses"][-1] < out["losses"][0] - 0.1  # it learns the fixed batch


def _export_worker(rank, world_size, config):
    from megatron_dynamo.models.export import iter_hf_weights
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.trainer.actor import MegatronActor

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    actor = MegatronActor(config, dtype="bf16", optim=None, use_te=False)
    devices, dtypes, reference = set(), set(), []
    for name, tensor in iter_hf_weights(actor.chunks, actor.arch, False, dtype=torch.bfloat16):
        devices.add(tensor.device.type)
        dtypes.add(str(tensor.dtype))
        reference.append((name, tensor.detach().clone()))
    again = list(iter_hf_weights(actor.chunks, actor.arch, False, dtype=torch.bfloat16))
    same = [n for n, _ in again] == [n for n, _ in reference] and all(
        torch.equal(a, b) for (_, a), (_, b) in zip(again, reference))
    hf = {name for name, _ in reference}
    return {"devices": sorted(devices), "dtypes": sorted(dtypes), "same": same, "tensors": len(hf)}


def test_weight_export_streams_bf16_tensors_on_the_gpu():
    """The weight sync's trainer half on a GPU: every HF tensor of the stream stays on the GPU (the in-process
    load into vLLM takes it there: no host hop), cast to bf16, and two exports agree exactly."""
    (out,) = run_on_ranks(_export_worker, 1, TINY_QWEN2)
    assert out["devices"] == ["cuda"] and out["dtypes"] == ["torch.bfloat16"]
    assert out["same"] and out["tensors"] > 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_stats_on_the_gpu_match_log_softmax(dtype):
    """Vocab-parallel log-prob / entropy (TP=1) on CUDA logits, forward and backward, against log_softmax."""
    from megatron_dynamo.parallel.token_stats import vocab_parallel_token_stats

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(300, 5003, device="cuda", generator=gen)).to(dtype).requires_grad_()
    target = torch.randint(0, 5003, (300,), device="cuda", generator=gen)
    temperature = 0.7
    stats = vocab_parallel_token_stats(logits, target, temperature, None, chunk_size=64)
    stats.logp.sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(ref_logits / temperature, dim=-1)
    ref_logp = logp_all.gather(-1, target[:, None]).squeeze(-1)
    ref_logp.sum().backward()
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    assert stats.logp.device.type == "cuda" and stats.logp.dtype == torch.float32
    torch.testing.assert_close(stats.logp.double(), ref_logp.detach(), rtol=0, atol=1e-4)
    torch.testing.assert_close(stats.entropy.double(), entropy.detach(), rtol=0, atol=1e-4)
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=0, atol=atol)
