"""Tiny HF transformers Qwen models built offline from the configs in configs/models, as parity references."""

from __future__ import annotations

import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_QWEN2 = os.path.join(REPO, "configs", "models", "tiny-qwen2.json")
TINY_QWEN3 = os.path.join(REPO, "configs", "models", "tiny-qwen3.json")
TINY_QWEN3_MOE = os.path.join(REPO, "configs", "models", "tiny-qwen3-moe.json")
TINY_QWEN2_MOE = os.path.join(REPO, "configs", "models", "tiny-qwen2-moe.json")


def hf_model(config: str | dict, seed: int = 0, dtype=torch.float32, **overrides):
    """A randomly initialised ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` / ``Qwen2MoeForCausalLM`` /
    ``Qwen3MoeForCausalLM`` (eval mode, eager attention)."""
    import transformers

    from megatron_dynamo.models.qwen import load_hf_config

    cfg = dict(load_hf_config(config) if isinstance(config, str) else config)
    cfg.update(overrides)
    model_type = cfg.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    # HF initialises norms to 1: perturb them so that a swapped norm mapping cannot go unnoticed.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


ROUTER_SCALE = 30.0  # HF draws router weights with std 0.02: near-uniform routing; scaled, it is decisive


def decisive_moe_model(config: str, seed: int = 0):
    """The HF MoE model of ``config`` (random weights, float32) with its routers scaled by :data:`ROUTER_SCALE`."""
    model = hf_model(config, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(ROUTER_SCALE)
    return model


def hf_state_dict(config: str | dict, seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    model = hf_model(config, seed, **overrides)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_checkpoint_state_dict(model, directory) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` as an HF checkpoint holds them: saved with ``save_pretrained`` into ``directory`` and
    read back (:func:`read_hf_checkpoint`). transformers >= 5 keeps MoE experts fused in memory
    (``mlp.experts.gate_up_proj``) and writes them per expert (``mlp.experts.{e}.gate_proj.weight``), the names
    checkpoints and vLLM use. Call it outside torch.distributed: called on rank 1 of a gloo group,
    ``save_pretrained`` wrote a checkpoint without ``model.embed_tokens.weight``."""
    model.save_pretrained(directory)
    return read_hf_checkpoint(directory)


def read_hf_checkpoint(directory) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory``."""
    from safetensors.torch import load_file

    return {k: v for name in sorted(os.listdir(directory)) if name.endswith(".safetensors")
            for k, v in load_file(os.path.join(directory, name)).items()}
