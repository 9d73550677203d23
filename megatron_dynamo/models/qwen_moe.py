"""The mixture-of-experts part of the Qwen provider: Qwen2-MoE / Qwen3-MoE ``config.json`` fields
(:class:`MoEArchitecture`, :func:`parse_moe_config`), how an MoE model trains (the run's ``moe`` section,
:class:`MoEConfig`), and the Megatron ``TransformerConfig`` keys that reproduce HF's router and experts exactly
(:func:`moe_architecture_kwargs`). ``models/qwen.py`` builds the model with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_dynamo.models.config_errors import UnsupportedModelConfig, require_field
from megatron_dynamo.parallel.topology import check_experts


@dataclass(frozen=True)
class MoEArchitecture:
    """The mixture-of-experts fields of a Qwen2-MoE / Qwen3-MoE config.

    Routing (HF's ``Qwen*MoeTopKRouter``): softmax over all ``num_experts`` router logits, the ``top_k`` largest
    probabilities, divided by their sum when ``norm_topk_prob``. ``layer_pattern[i]`` is 1 where layer i is a MoE
    layer, 0 where it is a dense MLP of ``intermediate_size`` (Megatron's ``moe_layer_freq`` list)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    layer_pattern: tuple[int, ...]
    # Qwen2-MoE: an expert every token goes through, scaled by sigmoid(shared_expert_gate(x)); 0: none (Qwen3-MoE).
    shared_expert_intermediate_size: int = 0


# Router options of other MoE families (DeepSeek's): Qwen's HF models ignore them, so a config that sets them was
# written for a router this provider does not build.
# Absent, or a value that means Qwen's own routing, is accepted.
_OTHER_ROUTER_FIELDS = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "n_group": (1,), "topk_group": (1,),
                        "routed_scaling_factor": (1.0,)}


def parse_moe_config(cfg: dict[str, Any], num_layers: int) -> MoEArchitecture:
    """The mixture-of-experts fields of a (normalised) ``qwen2_moe`` / ``qwen3_moe`` config dict, as HF's decoder
    layers read them. Errors name the field."""
    for field, same_as_qwen in _OTHER_ROUTER_FIELDS.items():
        if cfg.get(field) not in (None, *same_as_qwen):
            raise UnsupportedModelConfig(f"config.json: {field}={cfg[field]!r} is not supported (Qwen's router: "
                                         "softmax over all experts, then the top num_experts_per_tok)")
    # transformers >= 5 writes qwen3_moe's expert count as num_local_experts (its attribute map); older ones and
    # Hub checkpoints num_experts.
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise UnsupportedModelConfig(f"config.json: num_experts must be an integer >= 1 for model_type "
                                     f"{cfg['model_type']}, got {experts!r}")
    top_k = require_field(cfg, "num_experts_per_tok")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise UnsupportedModelConfig(f"config.json: num_experts_per_tok must be an integer in [1, num_experts="
                                     f"{experts}], got {top_k!r}")
    step = cfg.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise UnsupportedModelConfig(f"config.json: decoder_sparse_step must be an integer >= 1, got {step!r}")
    mlp_only = cfg.get("mlp_only_layers") or []
    outside = [i for i in mlp_only if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if outside:
        raise UnsupportedModelConfig(f"config.json: mlp_only_layers names layer {outside[0]!r}, not one of the "
                                     f"{num_layers} layers 0..{num_layers - 1}")
    pattern = tuple(0 if i in mlp_only or (i + 1) % step else 1 for i in range(num_layers))
    if not any(pattern):
        raise UnsupportedModelConfig("config.json: decoder_sparse_step and mlp_only_layers leave no mixture-of-experts "
                                     "layer (use the dense model_type)")
    norm_topk_prob = cfg.get("norm_topk_prob", False)
    if not isinstance(norm_topk_prob, bool):
        raise UnsupportedModelConfig(f"config.json: norm_topk_prob must be true or false, got {norm_topk_prob!r}")
    shared = 0
    if cfg["model_type"] == "qwen2_moe":
        shared = require_field(cfg, "shared_expert_intermediate_size")
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
            raise UnsupportedModelConfig(f"config.json: shared_expert_intermediate_size must be an integer >= 1, "
                                         f"got {shared!r}")
    return MoEArchitecture(num_experts=experts, top_k=top_k,
                           expert_intermediate_size=int(require_field(cfg, "moe_intermediate_size")),
                           norm_topk_prob=norm_topk_prob, layer_pattern=pattern,
                           shared_expert_intermediate_size=shared)


#: moe.routing_replay: off | rollout (the engine's experts) | old_policy (the old-log-prob pass's experts).
ROUTING_REPLAY = ("off", "rollout", "old_policy")


@dataclass(frozen=True)
class MoEConfig:
    """How a mixture-of-experts model trains (the run's ``moe`` section; a dense model ignores it).

    Keys:
        aux_loss_coef {>= 0}: the weight of the load-balancing loss (Switch Transformer's, per micro-batch:
            Megatron's ``moe_aux_loss_coeff``): its mean over the update's micro-batches, times this, is added to the
            policy loss; 0: none.
        z_loss_coef {>= 0}: the weight of the router z-loss (ST-MoE: the squared log-sum-exp of the router logits),
            which keeps router logits small, added the same way; 0: none.
        routing_replay: which experts the update's forwards use (docs/moe.md, "Routing replay"): ``off``, the
            trainer's router chooses; ``old_policy``, the experts the old-log-prob pass chose, in every forward and
            backward of the step's update; ``rollout``, the experts the rollout engine chose for each token (the
            engine returns them). Must be ``off`` for a dense model.
    """

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    routing_replay: str = "off"

    def validate(self) -> None:
        for name in ("aux_loss_coef", "z_loss_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"routing_replay must be one of {ROUTING_REPLAY}, got {self.routing_replay!r}")

    def transformer_config_kwargs(self) -> dict:
        return dict(moe_router_load_balancing_type="aux_loss" if self.aux_loss_coef else "none",
                    moe_aux_loss_coeff=self.aux_loss_coef, moe_z_loss_coeff=self.z_loss_coef or None,
                    moe_enable_routing_replay=self.routing_replay != "off")


def moe_architecture_kwargs(moe: MoEArchitecture) -> dict:
    """The ``TransformerConfig`` keys of a Qwen MoE architecture: HF's router and experts, exactly."""
    shared = moe.shared_expert_intermediate_size
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.expert_intermediate_size,
        moe_layer_freq=list(moe.layer_pattern),
        # HF: top-k of softmax(all logits), divided by their sum when norm_topk_prob. Megatron's pre-softmax routing
        # is the former as it is; without pre-softmax it takes the top-k logits and softmaxes over those k, which is
        # the renormalised top-k (the same top k, since softmax is monotone; equal up to rounding: tested).
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_topk_scaling_factor=None,
        # The router's logits and softmax in fp32 whatever the model dtype, as HF's (softmax in float) and vLLM's.
        moe_router_dtype="fp32",
        # Dropless, as inference is: every token reaches its k experts (no capacity factor, no padding).
        moe_expert_capacity_factor=None,
        # SequentialMLP: one plain MLP per expert (the grouped GEMM needs Transformer Engine or the grouped_gemm
        # package); the alltoall dispatcher works for any expert-parallel size, on gloo too.
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),
    )


def check_moe_layout(moe: MoEArchitecture | None, tensor_parallel: int, expert_parallel: int,
                     expert_tensor_parallel: int) -> None:
    """The experts of ``moe`` (None: a dense model) over the expert ranks, and each expert's (and the shared expert's)
    FFN over the ranks that split it; :class:`UnsupportedModelConfig` / ConfigError in one line otherwise."""
    check_experts(moe.num_experts if moe else 0, expert_parallel)
    if moe is None:
        return
    for name, value, ranks, key in (
            ("moe_intermediate_size", moe.expert_intermediate_size, expert_tensor_parallel, "expert_tensor_parallel"),
            ("shared_expert_intermediate_size", moe.shared_expert_intermediate_size, tensor_parallel,
             "tensor_parallel")):
        if value % ranks:
            raise UnsupportedModelConfig(f"config.json: {name}={value} is not divisible by {key}={ranks}")


__all__ = ["ROUTING_REPLAY", "MoEArchitecture", "MoEConfig", "check_moe_layout", "moe_architecture_kwargs",
           "parse_moe_config"]
