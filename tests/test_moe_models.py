"""Qwen2-MoE / Qwen3-MoE in Megatron-Core: config.json -> Megatron's MoE settings, one-line errors, the expert
layout checks, and the same logits as HF transformers' own MoE models (single process, and two expert-parallel
ranks on gloo).

References are HF transformers' classes (routers, decoder layers, whole models) built from the same config.json,
and the tensors its ``save_pretrained`` writes; none of them call the code under test.
"""

from __future__ import annotations

import pytest
import torch

from hf_reference import (REPO, TINY_QWEN2_MOE, TINY_QWEN3_MOE, decisive_moe_model, hf_checkpoint_state_dict,
                          read_hf_checkpoint)
from megatron_dynamo.config import ConfigError
from megatron_dynamo.models.qwen import (MoEArchitecture, MoEConfig, UnsupportedModelConfig, load_hf_config,
                                         moe_architecture_kwargs, parse_qwen_config)
from megatron_dynamo.parallel.topology import (JobTopology, TrainingLayout, check_expert_tensor_parallel_on_cpu,
                                               check_experts)
from megatron_dynamo.trainer.config import load_run_config
from multiproc import run_on_ranks

CPU_DEFAULT = f"{REPO}/configs/cpu_default.yaml"
SEQ = 12
def input_ids(rank: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (2, SEQ), generator=torch.Generator().manual_seed(100 + rank))


# ---------------------------------------------------------------------------------------------- config mapping
def test_tiny_qwen3_moe_maps_every_field():
    arch = parse_qwen_config(load_hf_config(TINY_QWEN3_MOE))
    assert (arch.model_type, arch.qk_norm, arch.qkv_bias, arch.head_dim, arch.intermediate_size) == (
        "qwen3_moe", True, False, 32, 256)
    assert arch.moe == MoEArchitecture(num_experts=8, top_k=2, expert_intermediate_size=64, norm_topk_prob=True,
                                       layer_pattern=(0, 1, 1, 1), shared_expert_intermediate_size=0)
    kwargs = moe_architecture_kwargs(arch.moe)
    assert kwargs == dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64, moe_layer_freq=[0, 1, 1, 1],
                          moe_router_score_function="softmax", moe_router_pre_softmax=False,
                          moe_router_topk_scaling_factor=None, moe_router_dtype="fp32",
                          moe_expert_capacity_factor=None, moe_grouped_gemm=False,
                          moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=None,
                          moe_shared_expert_gate=False)


def test_tiny_qwen2_moe_maps_the_shared_expert_and_biases():
    arch = parse_qwen_config(load_hf_config(TINY_QWEN2_MOE))
    assert (arch.model_type, arch.qk_norm, arch.qkv_bias, arch.tie_word_embeddings) == ("qwen2_moe", False, True, True)
    assert arch.moe == MoEArchitecture(num_experts=4, top_k=2, expert_intermediate_size=64, norm_topk_prob=False,
                                       layer_pattern=(1, 1, 1), shared_expert_intermediate_size=128)
    kwargs = moe_architecture_kwargs(arch.moe)
    assert (kwargs["moe_router_pre_softmax"], kwargs["moe_shared_expert_intermediate_size"],
            kwargs["moe_shared_expert_gate"]) == (True, 128, True)


def test_transformers_own_spelling_of_the_expert_count_parses():
    """transformers >= 5 writes qwen3_moe's expert count as num_local_experts in the config.json it saves."""
    cfg = load_hf_config(TINY_QWEN3_MOE)
    cfg["num_local_experts"] = cfg.pop("num_experts")
    assert parse_qwen_config(cfg).moe.num_experts == 8


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("step,mlp_only", [(1, []), (2, []), (1, [0, 3]), (2, [1]), (3, [5])])
def test_layer_pattern_is_where_hf_builds_sparse_blocks(family, step, mlp_only):
    import transformers

    cfg = load_hf_config(TINY_QWEN3_MOE if family == "qwen3_moe" else TINY_QWEN2_MOE)
    cfg.update(num_hidden_layers=6, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    arch = parse_qwen_config(cfg)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg))
    sparse = tuple(int(type(layer.mlp).__name__.endswith("SparseMoeBlock")) for layer in model.model.layers)
    assert arch.moe.layer_pattern == sparse
    assert [arch.is_moe_layer(i) for i in range(6)] == [bool(s) for s in sparse]


# ---------------------------------------------------------------------------------------------- the router
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatrons_routing_settings_reproduce_hfs_router(family, norm_topk_prob):
    """Megatron's top-k routing with the settings :func:`moe_architecture_kwargs` picks gives HF's routing weights on
    random inputs; the other pre-softmax choice does not (so the check can tell them apart)."""
    import transformers
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    path = TINY_QWEN3_MOE if family == "qwen3_moe" else TINY_QWEN2_MOE
    cfg = dict(load_hf_config(path), norm_topk_prob=norm_topk_prob, num_experts=8)
    module = {"qwen3_moe": transformers.models.qwen3_moe.modeling_qwen3_moe,
              "qwen2_moe": transformers.models.qwen2_moe.modeling_qwen2_moe}[family]
    router_class = getattr(module, f"{'Qwen3' if family == 'qwen3_moe' else 'Qwen2'}MoeTopKRouter")
    router = router_class(transformers.AutoConfig.for_model(**cfg))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    hidden = torch.randn(64, cfg["hidden_size"])
    _, weights, indices = router(hidden)
    expected = torch.zeros(64, 8).scatter(1, indices, weights)

    kwargs = moe_architecture_kwargs(parse_qwen_config(cfg).moe)
    logits = hidden.float() @ router.weight.detach().float().t()

    def megatron_probs(pre_softmax: bool) -> torch.Tensor:
        probs, routing_map = topk_routing_with_score_function(
            logits, kwargs["moe_router_topk"], use_pre_softmax=pre_softmax,
            score_function=kwargs["moe_router_score_function"],
            scaling_factor=kwargs["moe_router_topk_scaling_factor"])
        assert torch.equal(routing_map, expected > 0)
        return probs

    torch.testing.assert_close(megatron_probs(kwargs["moe_router_pre_softmax"]), expected, rtol=0, atol=1e-6)
    assert (megatron_probs(not kwargs["moe_router_pre_softmax"]) - expected).abs().max() > 0.01


# ---------------------------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize("path,change,message", [
    (TINY_QWEN3_MOE, {"num_experts": 0}, "config.json: num_experts must be an integer >= 1 for model_type qwen3_moe, "
                                         "got 0"),
    (TINY_QWEN3_MOE, {"num_experts_per_tok": 9}, "config.json: num_experts_per_tok must be an integer in "
                                                 "[1, num_experts=8], got 9"),
    (TINY_QWEN3_MOE, {"moe_intermediate_size": None}, "config.json: missing required field 'moe_intermediate_size'"),
    (TINY_QWEN3_MOE, {"mlp_only_layers": [4]}, "config.json: mlp_only_layers names layer 4, not one of the 4 layers "
                                               "0..3"),
    (TINY_QWEN3_MOE, {"decoder_sparse_step": 0}, "config.json: decoder_sparse_step must be an integer >= 1, got 0"),
    (TINY_QWEN3_MOE, {"mlp_only_layers": [0, 1, 2, 3]}, "config.json: decoder_sparse_step and mlp_only_layers leave "
                                                           "no mixture-of-experts layer (use the dense model_type)"),
    (TINY_QWEN3_MOE, {"norm_topk_prob": "yes"}, "config.json: norm_topk_prob must be true or false, got 'yes'"),
    (TINY_QWEN3_MOE, {"scoring_func": "sigmoid"}, "config.json: scoring_func='sigmoid' is not supported (Qwen's "
                                                  "router: softmax over all experts, then the top "
                                                  "num_experts_per_tok)"),
    (TINY_QWEN3_MOE, {"hidden_act": "gelu"}, "config.json: hidden_act='gelu' is not supported (only 'silu')"),
    (TINY_QWEN2_MOE, {"shared_expert_intermediate_size": 0}, "config.json: shared_expert_intermediate_size must be "
                                                             "an integer >= 1, got 0"),
    (TINY_QWEN2_MOE, {"model_type": "qwen2", "num_experts": 4}, "config.json: num_experts=4 (mixture of experts) "
                                                                "with model_type='qwen2'; experts are read for "
                                                                "qwen2_moe and qwen3_moe"),
])
def test_unsupported_moe_configs_are_one_line(path, change, message):
    cfg = dict(load_hf_config(path), **change)
    with pytest.raises(UnsupportedModelConfig) as error:
        parse_qwen_config(cfg)
    assert str(error.value) == message


@pytest.mark.parametrize("check,message", [
    (lambda: JobTopology.resolve(6, _parallel(tp=2, ep=4), _colocated()),
     "parallel.expert_parallel x expert_tensor_parallel = 4 does not divide the 6 training ranks of each pipeline "
     "stage (the expert layers split each stage's data x tensor x context parallel ranks into whole expert groups)"),
    (lambda: JobTopology.resolve(4, _parallel(pp=2, ep=4), _colocated()),
     "parallel.expert_parallel x expert_tensor_parallel = 4 does not divide the 2 training ranks of each pipeline "
     "stage (the expert layers split each stage's data x tensor x context parallel ranks into whole expert groups)"),
    (lambda: TrainingLayout(2, expert_parallel=0), "parallel.expert_parallel: must be >= 1, got 0"),
    (lambda: check_experts(8, 3), "parallel.expert_parallel=3 does not divide the model's 8 experts (every expert "
                                  "rank holds as many experts)"),
    (lambda: check_experts(0, 2), "parallel.expert_parallel: must be 1 for a dense model (no experts to split), "
                                  "got 2"),
    (lambda: check_expert_tensor_parallel_on_cpu(2), "parallel.expert_tensor_parallel: must be 1 without CUDA (gloo "
                                                     "cannot gather the uneven token counts of split experts), got 2"),
    (lambda: load_run_config(CPU_DEFAULT, ["parallel.expert_tensor_parallel=0"]),
     "parallel.expert_tensor_parallel: must be >= 1, got 0"),
    (lambda: load_run_config(CPU_DEFAULT, ["moe.aux_loss_coef=-0.1"]), "moe.aux_loss_coef: must be >= 0, got -0.1"),
])
def test_expert_layout_errors_are_one_exact_line(check, message):
    with pytest.raises(ConfigError) as error:
        check()
    assert str(error.value) == message


def _parallel(tp=1, pp=1, ep=1, etp=1):
    from types import SimpleNamespace

    return SimpleNamespace(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=1, expert_parallel=ep,
                           expert_tensor_parallel=etp)


def _colocated():
    from types import SimpleNamespace

    return SimpleNamespace(tensor_parallel=1, placement="colocated", engine_ranks=0)


def test_expert_layouts_megatron_accepts_resolve():
    # Expert groups cut across tensor-parallel groups: TP 2 x DP 2 ranks hold 4 expert ranks.
    topology = JobTopology.resolve(4, _parallel(tp=2, ep=4), _colocated())
    assert (topology.parallel.data_parallel, topology.parallel.expert_parallel) == (2, 4)
    assert load_run_config(CPU_DEFAULT, ["moe.aux_loss_coef=0.001"]).moe == MoEConfig(aux_loss_coef=0.001)


# ---------------------------------------------------------------------------------------------- parity with HF
MOE_CONFIG_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
                     "moe_router_pre_softmax", "moe_router_dtype", "moe_shared_expert_intermediate_size",
                     "moe_shared_expert_gate", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                     "moe_z_loss_coeff", "add_qkv_bias", "qk_layernorm", "expert_model_parallel_size",
                     "expert_tensor_parallel_size")


def _logits_worker(rank, world_size, config, expert_parallel, checkpoint_dir):
    from megatron_dynamo.models.mappings import unwrap_model
    from megatron_dynamo.models.megatron_model import MegatronModel
    from megatron_dynamo.parallel import runtime

    runtime.init_distributed(runtime.ParallelConfig(expert_parallel=expert_parallel), seed=0)
    state = read_hf_checkpoint(checkpoint_dir)
    model = MegatronModel(config, hf_weights=state.__getitem__, moe=MoEConfig(aux_loss_coef=0.01))
    gpt = unwrap_model(model.chunks[0]).eval()
    with torch.no_grad():
        logits = gpt(input_ids(rank), position_ids=None, attention_mask=None)
    return {"logits": logits, "config": {f: getattr(gpt.config, f) for f in MOE_CONFIG_FIELDS},
            "mlps": [type(layer.mlp).__name__ for layer in gpt.decoder.layers],
            "local_experts": [len(layer.mlp.experts.local_experts) for layer in gpt.decoder.layers
                              if type(layer.mlp).__name__ == "MoELayer"]}


def _hf_checkpoint_and_logits(config: str, directory, ranks: int = 1) -> list[torch.Tensor]:
    """Write the reference model's checkpoint into ``directory``; its logits on each rank's input."""
    model = decisive_moe_model(config)
    hf_checkpoint_state_dict(model, directory)
    with torch.no_grad():
        return [model(input_ids=input_ids(rank)).logits for rank in range(ranks)]


@pytest.mark.distributed
@pytest.mark.parametrize("config,pattern,shared", [(TINY_QWEN3_MOE, [0, 1, 1, 1], None),
                                                   (TINY_QWEN2_MOE, [1, 1, 1], 128)], ids=["qwen3_moe", "qwen2_moe"])
def test_megatron_moe_model_gives_hf_logits(tmp_path, config, pattern, shared):
    (expected,) = _hf_checkpoint_and_logits(config, tmp_path)
    (result,) = run_on_ranks(_logits_worker, 1, config, 1, str(tmp_path))
    assert (result["logits"] - expected).abs().max().item() <= 1e-5
    assert result["mlps"] == ["MoELayer" if p else "MLP" for p in pattern]
    arch = parse_qwen_config(load_hf_config(config))
    assert result["config"] == dict(
        num_moe_experts=arch.moe.num_experts, moe_router_topk=2, moe_ffn_hidden_size=64, moe_layer_freq=pattern,
        moe_router_pre_softmax=not arch.moe.norm_topk_prob, moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=bool(shared),
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=None,
        add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm, expert_model_parallel_size=1,
        expert_tensor_parallel_size=1)


@pytest.mark.distributed
def test_two_expert_parallel_ranks_give_hf_logits(tmp_path):
    """Each rank holds half the experts and routes its own tokens to both ranks' experts through gloo's
    all-to-all (cpu_compat hands it the split sizes as lists)."""
    expected = _hf_checkpoint_and_logits(TINY_QWEN3_MOE, tmp_path, ranks=2)
    results = run_on_ranks(_logits_worker, 2, TINY_QWEN3_MOE, 2, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["local_experts"] == [4, 4, 4]
        assert result["config"]["expert_model_parallel_size"] == 2
        assert (result["logits"] - expected[rank]).abs().max().item() <= 1e-5
