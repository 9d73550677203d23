"""The local spec's core attention on torch's SDPA (models/local_attention.py) against a float64 reference written
here (explicit softmax(Q K^T * scale + mask) V, key/value groups repeated to the heads), and its place in the
local layer specs."""

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from hf_reference import TINY_QWEN2, TINY_QWEN3_MOE
from multiproc import run_on_ranks

from megatron_dynamo.models.local_attention import CPU_MATH_MAX_KEYS, ScaledDotProductAttention
from megatron_dynamo.models.megatron_model import block_causal_mask

HEADS, HEAD_DIM = 4, 16


def _config(groups: int, **overrides) -> TransformerConfig:
    settings = dict(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=groups,
                    kv_channels=HEAD_DIM, attention_dropout=0.0, cuda_graph_scope=[])
    return TransformerConfig(**{**settings, **overrides})


def _reference(q, k, v, masked_out, scale):
    """[s, b, heads, hn] inputs in float64; masked_out True = may not attend; output [sq, b, heads * hn]."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    scores = scores.masked_fill(masked_out, float("-inf"))
    context = torch.softmax(scores, dim=-1) @ v
    return context.permute(2, 0, 1, 3).flatten(2)


def _inputs(sq, sk, groups, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, 3, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(sk, 3, groups, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(sk, 3, groups, HEAD_DIM, generator=g, dtype=torch.float64)
    upstream = torch.randn(sq, 3, HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], upstream


def _check(module, sq, sk, groups, mask, masked_out, dtype, tol):
    (q, k, v), upstream = _inputs(sq, sk, groups, dtype)
    out = module(q, k, v, mask)
    assert out.shape == (sq, 3, HEADS * HEAD_DIM) and out.dtype == dtype
    out.backward(upstream.to(dtype))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = _reference(*leaves, masked_out, 1 / math.sqrt(HEAD_DIM))
    expected.backward(upstream)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    for got, want in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=tol, atol=tol)


# 13 tokens: SDPA's math backend on the CPU; 80 (> CPU_MATH_MAX_KEYS): its flash kernel.
LENGTHS = [13, 80]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("groups", [HEADS, HEADS // 2])
@pytest.mark.parametrize("length", LENGTHS)
def test_causal_attention_values_and_gradients_match_float64(length, groups, dtype, tol):
    assert LENGTHS[0] <= CPU_MATH_MAX_KEYS < LENGTHS[1]
    module = ScaledDotProductAttention(_config(groups), 1, AttnMaskType.causal, "self")
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    _check(module, length, length, groups, None, future, dtype, tol)


@pytest.mark.parametrize("groups", [HEADS, HEADS // 2])
@pytest.mark.parametrize("length", LENGTHS)
def test_a_given_block_diagonal_mask_replaces_the_causal_one(length, groups):
    # three sequences packed in one row, as the local spec's packed micro-batches: the mask, not causality, decides
    mask = block_causal_mask(torch.tensor([0, 5, length - 3, length]), length)
    segment = torch.tensor([0] * 5 + [1] * (length - 8) + [2] * 3)
    masked_out = (segment[:, None] != segment[None, :]) | torch.ones(length, length, dtype=torch.bool).triu(1)
    assert torch.equal(mask[0, 0], masked_out)  # the reference's mask is built here, not by block_causal_mask
    module = ScaledDotProductAttention(_config(groups), 1, AttnMaskType.causal, "self")
    _check(module, length, length, groups, mask, masked_out, torch.float64, 1e-10)


def test_a_single_query_attends_to_every_key():
    # decoding with a KV cache: Megatron's unfused softmax applies no causal mask to one query
    module = ScaledDotProductAttention(_config(2), 1, AttnMaskType.causal, "self")
    _check(module, 1, 9, 2, None, torch.zeros(1, 9, dtype=torch.bool), torch.float64, 1e-10)


def test_the_scale_is_megatrons_net_scale():
    # apply_query_key_layer_scaling divides Megatron's scale by the layer number and multiplies the scores back in
    # its softmax: the attention is unchanged
    config = _config(2, apply_query_key_layer_scaling=True, fp16=True)
    module = ScaledDotProductAttention(config, 3, AttnMaskType.causal, "self")
    assert module.softmax_scale == 1 / math.sqrt(HEAD_DIM)
    given = ScaledDotProductAttention(_config(2), 1, AttnMaskType.causal, "self", softmax_scale=0.5)
    (q, k, v), _ = _inputs(7, 7, 2, torch.float64)
    expected = _reference(q, k, v, torch.ones(7, 7, dtype=torch.bool).triu(1), 0.5)
    torch.testing.assert_close(given(q, k, v, None), expected)


def test_what_sdpa_does_not_compute_is_refused():
    module = ScaledDotProductAttention(_config(2), 1, AttnMaskType.causal, "self")
    (q, k, v), _ = _inputs(5, 5, 2, torch.float32)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        module(q, k, v, None, attention_bias=torch.zeros(1, HEADS, 5, 5))
    with pytest.raises(NotImplementedError, match="packed_seq_params"):
        module(q, k, v, None, packed_seq_params=object())
    with pytest.raises(TypeError, match="boolean"):
        module(q, k, v, torch.zeros(1, 1, 5, 5))
    with pytest.raises(ValueError, match="as many queries as keys"):
        module(q[:3], k, v, None)
    with pytest.raises(NotImplementedError, match="window_size"):
        ScaledDotProductAttention(_config(2, window_size=(4, 0)), 1, AttnMaskType.causal, "self")
    with pytest.raises(NotImplementedError, match="softmax_type"):
        ScaledDotProductAttention(_config(2, softmax_type="off-by-one"), 1, AttnMaskType.causal, "self")


def _core_attention_worker(rank, world_size, configs):
    from megatron_dynamo.models.megatron_model import MegatronModel
    from megatron_dynamo.parallel import runtime

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)  # the tensor-parallel RNG tracker dropout draws from
    found = {config: sorted({type(m.self_attention.core_attention).__name__ for chunk in MegatronModel(config).chunks
                             for m in chunk.modules() if hasattr(m, "self_attention")}) for config in configs}
    module = ScaledDotProductAttention(_config(2, attention_dropout=0.5), 1, AttnMaskType.causal, "self")
    (q, k, v), _ = _inputs(13, 13, 2, torch.float64)
    return found, (q, k, v), module.eval()(q, k, v, None), module.train()(q, k, v, None)


@pytest.mark.distributed
def test_the_local_specs_attend_with_sdpa_and_drop_out_in_training_only():
    (result,) = run_on_ranks(_core_attention_worker, 1, [TINY_QWEN2, TINY_QWEN3_MOE])
    found, (q, k, v), evaluated, trained = result
    assert found == {TINY_QWEN2: ["ScaledDotProductAttention"], TINY_QWEN3_MOE: ["ScaledDotProductAttention"]}
    expected = _reference(q, k, v, torch.ones(13, 13, dtype=torch.bool).triu(1), 1 / math.sqrt(HEAD_DIM))
    torch.testing.assert_close(evaluated, expected)
    assert not torch.allclose(trained, expected)
