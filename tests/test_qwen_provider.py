"""HF config.json -> Megatron: supported shapes parse exactly, unsupported ones fail naming the field."""

import json
import os

import pytest

from hf_reference import REPO, TINY_QWEN2, TINY_QWEN3
from megatron_dynamo.models.qwen import UnsupportedModelConfig, load_hf_config, parse_qwen_config

MODELS = os.path.join(REPO, "configs", "models")


@pytest.mark.parametrize("name,expect", [
    ("qwen2.5-math-1.5b.json", dict(num_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                                    head_dim=128, vocab_size=151936, tie_word_embeddings=True, qkv_bias=True,
                                    qk_norm=False, rope_theta=10000.0)),
    ("qwen2.5-math-7b.json", dict(num_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                  head_dim=128, vocab_size=152064, tie_word_embeddings=False, qkv_bias=True)),
    ("qwen3-14b.json", dict(num_layers=40, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
                            head_dim=128, intermediate_size=17408, qkv_bias=False, qk_norm=True,
                            rope_theta=1e6, tie_word_embeddings=False)),
    ("tiny-qwen3.json", dict(head_dim=48, qk_norm=True, qkv_bias=False, tie_word_embeddings=True)),
])
def test_public_and_tiny_configs_parse(name, expect):
    arch = parse_qwen_config(load_hf_config(os.path.join(MODELS, name)))
    for field, value in expect.items():
        assert getattr(arch, field) == value, field


def test_tiny_configs_can_be_served_by_cpu_vllm():
    for path in (TINY_QWEN2, TINY_QWEN3):
        assert parse_qwen_config(load_hf_config(path)).head_dim >= 32


@pytest.mark.parametrize("change,field", [
    ({"model_type": "mixtral"}, "model_type"),
    ({"num_experts": 64}, "num_experts"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_unsupported_configs_name_the_field(change, field):
    cfg = load_hf_config(TINY_QWEN2)
    cfg.update(change)
    with pytest.raises(UnsupportedModelConfig, match=field):
        parse_qwen_config(cfg)


def test_default_rope_scaling_is_accepted():
    cfg = load_hf_config(TINY_QWEN2)
    cfg["rope_scaling"] = {"rope_type": "default"}
    assert parse_qwen_config(cfg).rope_theta == 10000.0


def test_load_hf_config_from_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_hf_config(TINY_QWEN3)))
    assert load_hf_config(tmp_path)["model_type"] == "qwen3"


def _tp_divisibility_worker(rank, world_size):
    from megatron_dynamo.models.qwen import build_gpt_model
    from megatron_dynamo.parallel import runtime

    runtime.init_distributed(runtime.ParallelConfig(tensor_parallel=2), seed=0)
    cfg = load_hf_config(TINY_QWEN2)
    cfg["num_key_value_heads"] = 1
    try:
        build_gpt_model(cfg)
    except UnsupportedModelConfig as exc:
        return str(exc)
    return None


@pytest.mark.distributed
def test_layout_the_model_cannot_split_is_rejected():
    from multiproc import run_on_ranks

    messages = run_on_ranks(_tp_divisibility_worker, 2)
    assert all(m and "num_key_value_heads=1" in m and "tensor_parallel=2" in m for m in messages), messages


def test_transformers5_rope_parameters_spelling():
    # transformers >= 5 saves rope_theta inside rope_parameters; reading only the old field would silently
    # fall back to 10000 and give wrong logits.
    cfg = load_hf_config(TINY_QWEN3)
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "default"}
    assert parse_qwen_config(cfg).rope_theta == 1e6
    cfg["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "yarn", "factor": 4.0}
    with pytest.raises(UnsupportedModelConfig, match="rope_scaling"):
        parse_qwen_config(cfg)
    cfg["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    cfg["layer_types"] = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    with pytest.raises(UnsupportedModelConfig, match="layer_types"):
        parse_qwen_config(cfg)


def _local_spec_on_a_gpu_worker(rank, world_size):
    from unittest import mock

    import torch

    from megatron_dynamo.models.qwen import build_gpt_model
    from megatron_dynamo.parallel import runtime

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    # The config and the layers as a GPU without Transformer Engine or apex builds them (the weights stay on the
    # CPU: use_cpu_initialization); megatron-core's wheel ships no compiled softmax kernels.
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        model = build_gpt_model(TINY_QWEN2, "fp32", use_te=False)
    config = model.config
    return {"persist_layer_norm": config.persist_layer_norm, "masked_softmax_fusion": config.masked_softmax_fusion,
            "bias_activation_fusion": config.bias_activation_fusion}


@pytest.mark.slow
def test_local_spec_builds_with_the_gpu_settings():
    """A GPU without Transformer Engine (the lent H200, 2026-11-26) builds the local spec: Megatron's torch norm
    refuses persist_layer_norm, and the fused softmax is asked for only where its compiled kernels import. The
    torch-written fusions stay on."""
    from multiproc import run_on_ranks

    (out,) = run_on_ranks(_local_spec_on_a_gpu_worker, 1)
    assert out == {"persist_layer_norm": False, "masked_softmax_fusion": False, "bias_activation_fusion": True}
