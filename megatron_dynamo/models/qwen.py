"""Qwen2 / Qwen2.5 / Qwen3 and their mixture-of-experts variants in Megatron-Core: HF ``config.json`` ->
``TransformerConfig`` + layer spec -> ``GPTModel``.

Qwen2/2.5: RMSNorm, SwiGLU MLP, GQA, rotary embeddings with ``rope_theta``, q/k/v biases, no other biases,
tied or untied embeddings. Qwen3: the same without q/k/v biases, plus per-head RMSNorm on queries and keys
(``qk_layernorm``) and an explicit ``head_dim`` that need not equal hidden_size / num_heads.
Qwen2-MoE / Qwen3-MoE (``qwen2_moe``, ``qwen3_moe``): the same attention, and in the layers that
``decoder_sparse_step`` / ``mlp_only_layers`` select, a softmax top-k router over SwiGLU experts
(:class:`MoEArchitecture`); Qwen2-MoE adds an always-on shared expert scaled by a sigmoid gate.

On GPU with Transformer Engine importable, the TE layer spec (fused bf16 kernels); otherwise Megatron's
pure-PyTorch local spec. Anything this provider cannot reproduce exactly (sliding-window attention, rope scaling,
other activations or routers) is rejected with an error that names the config field.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_dynamo.models.config_errors import UnsupportedModelConfig, require_field
from megatron_dynamo.models.local_attention import ScaledDotProductAttention
from megatron_dynamo.models.local_kernels import LocalRMSNorm, SequenceParallelRMSNorm, install_rotary
from megatron_dynamo.models.local_linear import local_linear_layers
from megatron_dynamo.models.qwen_moe import (MoEArchitecture, MoEConfig, check_moe_layout, moe_architecture_kwargs,
                                             parse_moe_config)

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", *MOE_MODEL_TYPES)


@dataclass(frozen=True)
class QwenArchitecture:
    """The architecture fields of a Qwen HF config that the Megatron model and the converters need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    initializer_range: float = 0.02
    moe: MoEArchitecture | None = None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based, global) is a mixture-of-experts layer."""
        return self.moe is not None and bool(self.moe.layer_pattern[layer])

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def load_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``config.json`` (a file, or a model directory holding one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def normalize_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A copy of an HF config dict with the fields :func:`parse_qwen_config` reads in their classic places.

    transformers >= 5 writes ``rope_parameters: {rope_theta, rope_type, ...}`` instead of a top-level
    ``rope_theta`` / ``rope_scaling``, and ``layer_types`` per layer; checkpoints on the Hub mostly use the older
    fields. Both spellings give the same architecture here.
    """
    cfg = dict(cfg)
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        if cfg.get("rope_theta") is None and rope.get("rope_theta") is not None:
            cfg["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
            cfg["rope_scaling"] = rope
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        kinds = sorted(set(layer_types) - {"full_attention"})
        raise UnsupportedModelConfig(f"config.json: layer_types contains {', '.join(kinds)} "
                                     "(only full_attention is supported)")
    return cfg


def parse_qwen_config(cfg: dict[str, Any]) -> QwenArchitecture:
    """Validate a Qwen2/Qwen2.5/Qwen3 HF config dict (either transformers spelling, see
    :func:`normalize_hf_config`) and return its architecture. Errors name the field."""
    cfg = normalize_hf_config(cfg)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelConfig(
            f"config.json: model_type={model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    experts = [f for f in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(f)]
    if model_type not in MOE_MODEL_TYPES and experts:
        raise UnsupportedModelConfig(f"config.json: {experts[0]}={cfg[experts[0]]} (mixture of experts) with model_type="
                                     f"{model_type!r}; experts are read for {' and '.join(MOE_MODEL_TYPES)}")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelConfig(
            "config.json: use_sliding_window=true is not supported (set it to false; full attention only)")
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind not in (None, "default"):
            raise UnsupportedModelConfig(f"config.json: rope_scaling type {kind!r} is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelConfig(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelConfig("config.json: mlp_bias=true is not supported")

    hidden = int(require_field(cfg, "hidden_size"))
    heads = int(require_field(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise UnsupportedModelConfig(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise UnsupportedModelConfig(
                f"config.json: hidden_size={hidden} is not divisible by num_attention_heads={heads} and no head_dim is given")
        head_dim = hidden // heads
    is_qwen3 = model_type in ("qwen3", "qwen3_moe")
    # Qwen3 reads attention_bias; Qwen2-MoE's transformers config has qkv_bias (default true); Qwen2 always has them.
    qkv_bias = bool(cfg.get("attention_bias", False)) if is_qwen3 else bool(cfg.get("qkv_bias", True))
    num_layers = int(require_field(cfg, "num_hidden_layers"))
    return QwenArchitecture(
        model_type=model_type,
        vocab_size=int(require_field(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(require_field(cfg, "intermediate_size")),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=is_qwen3,
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        moe=parse_moe_config(cfg, num_layers) if model_type in MOE_MODEL_TYPES else None,
    )


def te_importable() -> bool:
    """``transformer_engine.pytorch`` imports, i.e. with its torch extension (``transformer_engine_torch``, built
    against the installed torch). ``import transformer_engine`` alone succeeds without the extension, so a TE whose
    extension is missing or built for another torch must fail here, not at the first layer."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken TE install is as good as none (ImportError, OSError of the .so ...)
        return False
    return True


def te_available() -> bool:
    """Transformer Engine is usable: CUDA is present and ``transformer_engine.pytorch`` imports (te_importable)."""
    return torch.cuda.is_available() and te_importable()


def fused_softmax_kernels_importable() -> bool:
    """Megatron's compiled softmax kernels (the local spec's ``masked_softmax_fusion``) are installed."""
    return all(importlib.util.find_spec(name) is not None
               for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                            "scaled_softmax_cuda"))


def _dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def _architecture_kwargs(arch: QwenArchitecture) -> dict:
    """The ``TransformerConfig`` keys of the Qwen architecture itself (no parallel layout, dtype or kernels)."""
    return dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
    )


def check_model_layout(arch: QwenArchitecture, tensor_parallel: int, pipeline_parallel: int,
                       expert_parallel: int = 1, expert_tensor_parallel: int = 1) -> None:
    """The model over a parallel layout: heads and vocabulary over the TP ranks, layers over the stages, experts over
    the expert ranks. :class:`UnsupportedModelConfig` / ConfigError in one line otherwise. ``dynamo train`` and
    ``dynamo launch`` call it before any rank starts; every rank calls it again when it builds the model."""
    tp, pp = tensor_parallel, pipeline_parallel
    for name, value in (("num_attention_heads", arch.num_attention_heads),
                        ("num_key_value_heads", arch.num_key_value_heads), ("vocab_size", arch.vocab_size)):
        if value % tp:
            raise UnsupportedModelConfig(f"config.json: {name}={value} is not divisible by tensor_parallel={tp}")
    if arch.num_layers % pp:
        raise UnsupportedModelConfig(
            f"config.json: num_hidden_layers={arch.num_layers} is not divisible by pipeline_parallel={pp}")
    check_moe_layout(arch.moe, tp, expert_parallel, expert_tensor_parallel)


RECOMPUTE_MODES = ("off", "selective", "full")


def recompute_kwargs(mode: str) -> dict[str, Any]:
    """Megatron's activation recompute for ``trainer.recompute``: ``selective`` recomputes the core attention (its
    scores and softmax, the activations that grow with the square of the sequence); ``full`` checkpoints every
    transformer layer at its input and reruns it in the backward."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if mode == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def transformer_config(arch: QwenArchitecture, dtype: str | torch.dtype = "fp32", moe: MoEConfig | None = None,
                       **overrides):
    """The Megatron ``TransformerConfig`` of a Qwen architecture under the current parallel state.

    ``moe``: the training settings of a mixture-of-experts model (default :class:`MoEConfig`). ``overrides`` are
    passed to TransformerConfig (e.g. ``recompute_granularity``).
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch_dtype = _dtype(dtype)
    on_gpu = torch.cuda.is_available()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    check_model_layout(arch, tp, pp, parallel_state.get_expert_model_parallel_world_size(),
                       parallel_state.get_expert_tensor_parallel_world_size())
    kwargs = dict(
        **_architecture_kwargs(arch),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        # Initialise the full weight on the CPU and slice it, so that every TP/PP layout starts from the same model.
        use_cpu_initialization=True,
        # Fusions written in torch (jit/compile): on any GPU. On CPU the plain torch paths are used.
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        # The local spec's fused softmax calls Megatron's compiled kernels (scaled_*softmax_cuda, built with apex or
        # Megatron-LM), which megatron-core's wheel lacks: asked for without them, the first forward fails on their
        # import. TE's attention does its own softmax and ignores the flag.
        masked_softmax_fusion=on_gpu and fused_softmax_kernels_importable(),
        # Megatron's fused-rotary hook: Transformer Engine's kernel where TE is installed (left unused, as it was),
        # else this package's (models/local_kernels.py; the CPU's update faster).
        apply_rope_fusion=install_rotary(),
        # apex's persistent LayerNorm kernel: Qwen normalises with RMSNorm, and Megatron's torch norm (the local
        # spec) refuses the flag outright.
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # Kept in fp32 so that the vocab-parallel log-prob routine sees full-precision logits.
        cross_entropy_loss_fusion=False,
    )
    if arch.moe:
        kwargs.update(moe_architecture_kwargs(arch.moe), **(moe or MoEConfig()).transformer_config_kwargs(),
                      expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                      expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size())
    if "cuda_graph_scope" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        # The whole layer, as megatron-core's default "full", which it deprecates with a warning on every build.
        kwargs["cuda_graph_scope"] = []
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(arch: QwenArchitecture, use_te: bool | None = None, config=None, vp_stage: int | None = None):
    """The TE layer spec when TE is usable (or ``use_te=True``), else a block spec of Megatron's pure-PyTorch local
    layers with torch's SDPA as core attention and norms that are
    :class:`~megatron_dynamo.models.local_kernels.LocalRMSNorm` (each layer's, the final one, Qwen3's query/key
    norms), or under sequence parallelism ``SequenceParallelRMSNorm`` for the first two. A
    mixture-of-experts model gets a block spec of this stage's layers, dense or MoE as ``config.moe_layer_freq``
    says. Every spec but the dense TE one needs the model's ``config``."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    use_te = te_available() if use_te is None else use_te
    if use_te and arch.moe is None:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    if config is None:
        raise ValueError("layer_spec: the local spec and mixture-of-experts models need their TransformerConfig")
    if arch.moe is not None:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                           normalization="RMSNorm", vp_stage=vp_stage)
        if use_te:
            return block
    else:
        block = TransformerBlockSubmodules(layer_specs=[gpt_layer_specs.get_gpt_layer_local_spec(
            qk_layernorm=arch.qk_norm, normalization="RMSNorm")] * get_num_layers_to_build(config, vp_stage))
    norm = SequenceParallelRMSNorm if config.sequence_parallel else LocalRMSNorm
    return dataclasses.replace(block, layer_specs=[_local_layer(layer, norm) for layer in block.layer_specs],
                               layer_norm=norm)


def _local_layer(layer, norm):
    """A local layer spec with ``norm`` for its input and pre-MLP norms, LocalRMSNorm for query/key norms, torch's
    SDPA for the core attention (models/local_attention.py) and linear layers whose CPU product is oneDNN's
    (models/local_linear.py)."""
    from megatron.core.transformer.identity_op import IdentityOp

    column, row = local_linear_layers()
    attention = layer.submodules.self_attention
    qk_norms = {name: LocalRMSNorm for name in ("q_layernorm", "k_layernorm")
                if getattr(attention.submodules, name) is not IdentityOp}
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, core_attention=ScaledDotProductAttention, linear_qkv=column, linear_proj=row,
        **qk_norms))
    mlp = layer.submodules.mlp
    if hasattr(mlp.submodules, "linear_fc1"):  # a dense MLP (an MoE layer's experts keep Megatron's layers)
        mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc1=column,
                                                                      linear_fc2=row))
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attention, mlp=mlp))


def build_gpt_model(arch: QwenArchitecture | dict[str, Any] | str, dtype: str | torch.dtype = "fp32",
                    pre_process: bool | None = None, post_process: bool | None = None,
                    vp_stage: int | None = None, use_te: bool | None = None, **config_overrides):
    """Build this pipeline stage's ``GPTModel`` for a Qwen architecture (a parsed config, a dict or a path).

    bf16 models are wrapped in Megatron's ``Float16Module`` so that norms and embeddings are bf16 too and
    outputs come back in fp32.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if isinstance(arch, (str, os.PathLike)):
        arch = load_hf_config(arch)
    if isinstance(arch, dict):
        arch = parse_qwen_config(arch)
    config = transformer_config(arch, dtype, **config_overrides)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, use_te, config, vp_stage),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
        vp_stage=vp_stage,
    )
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model
