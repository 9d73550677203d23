"""The local spec's linear layers (models/local_linear.py): oneDNN's product against a float64 reference written here,
the rule of where it applies, and the local spec's layers using it (tensor parallelism included)."""

import pytest
import torch

from hf_reference import TINY_QWEN2
from multiproc import run_on_ranks

from megatron_dynamo.models import local_linear
from megatron_dynamo.models.local_linear import onednn_applies

pytestmark = pytest.mark.skipif(local_linear._ONEDNN is None, reason="this torch has no oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("strided_input", [False, True])
@pytest.mark.parametrize("seq", [7, 282])  # 282 x 5: the CPU default's 1408-token micro-batch, summed in the weight's grad
# (in, out): fewer outputs than inputs (the weight's gradient copies g.T) and more (it copies x.T, as the MLP's gate/up)
@pytest.mark.parametrize("features", [(48, 40), (32, 96)], ids=["narrowing", "widening"])
def test_values_and_gradients_match_float64(bias, strided_input, seq, features):
    g = torch.Generator().manual_seed(0)
    n_in, n_out = features
    x = torch.randn(seq, 5, n_in, generator=g)
    if strided_input:  # e.g. the attention's output, [b, s, h] transposed to [s, b, h]
        x = torch.randn(5, seq, n_in, generator=g).transpose(0, 1)
    x.requires_grad_()
    weight = torch.randn(n_out, n_in, generator=g, requires_grad=True)
    b = torch.randn(n_out, generator=g, requires_grad=True) if bias else None
    upstream = torch.randn(seq, 5, n_out, generator=g)
    out = local_linear._OneDNNLinear.apply(x, weight, b, False, None)
    out.backward(upstream)

    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    ref = torch.einsum("sbi,oi->sbo", x64, w64) + (b64 if bias else 0)
    ref.backward(upstream.double())
    for got, want in [(out, ref), (x.grad, x64.grad), (weight.grad, w64.grad)] + ([(b.grad, b64.grad)] if bias else []):
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_where_onednn_computes_the_product():
    x, w = torch.randn(3, 2, 8), torch.randn(4, 8, requires_grad=True)
    assert onednn_applies(x, w, bias=None, allreduce_dgrad=False, tp_group=None, wgrad_deferral_limit=0)
    assert onednn_applies(x, w, allreduce_dgrad=True, tp_group=object())
    # Megatron's own function: another dtype, a frozen weight, sequence parallelism, deferred weight gradients,
    # fused gradient accumulation, or an all-reduce without its group
    assert not onednn_applies(x.bfloat16(), w.detach().bfloat16().requires_grad_())
    assert not onednn_applies(x, w.detach())
    assert not onednn_applies(x, w, sequence_parallel=True)
    assert not onednn_applies(x, w, grad_output_buffer=[])
    assert not onednn_applies(x, w, gradient_accumulation_fusion=True)
    assert not onednn_applies(x, w, allreduce_dgrad=True, tp_group=None)


def _linear_worker(rank, world_size, config, tp):
    from megatron_dynamo.models.megatron_model import MegatronModel
    from megatron_dynamo.parallel import runtime

    runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=tp), seed=0)
    chunk = MegatronModel(config).chunks[0]
    names = {type(m).__name__ for name, m in chunk.named_modules() if name.endswith(("linear_qkv", "linear_proj",
                                                                                     "linear_fc1", "linear_fc2"))}
    layer = next(m for name, m in chunk.named_modules() if name.endswith("mlp.linear_fc1"))
    x = torch.randn(6, 2, layer.weight.shape[1], generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    # the full layer: every rank's shard of fc1's output features, gathered
    shards = [torch.empty_like(layer.weight) for _ in range(tp)]
    torch.distributed.all_gather(shards, layer.weight.detach().contiguous())
    return names, out.grad_fn.name(), x.detach(), x.grad, torch.cat(shards)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_the_local_specs_linear_layers_compute_with_onednn(tp):
    results = run_on_ranks(_linear_worker, tp, TINY_QWEN2, tp)
    for names, grad_fn, x, x_grad, full_weight in results:
        assert names == {"LocalColumnParallelLinear", "LocalRowParallelLinear"}
        assert grad_fn == "_OneDNNLinearBackward"
        # the input's gradient of a column-parallel layer is all-reduced over the tensor-parallel ranks: every rank
        # holds the full layer's, d(sum of all outputs)/dx = the sum of the full weight's rows
        expected = full_weight.double().sum(0).expand_as(x)
        assert (x_grad.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
