"""The memory plan (issue 54, item 1): every term against hand arithmetic for a made-up architecture, the 1F1B
in-flight count, the recompute modes, the optimizer's data-parallel sharding, and every recipe against the cluster's
80 GB GPUs; the 30B-A3B recipe as it was (recompute off, 10,240-token micro-batches) is refused in one line by
`dynamo launch show/run` and `dynamo train`. No GPU, no process group: plain arithmetic.

The expected numbers are worked out by hand below (the tiny architecture: hidden 64, FFN 128, 4 layers, 4 heads of
32, 2 key/value heads, vocabulary 1000, Qwen3's q/k norms, untied): one layer's attention holds q 64x128 + k 64x64
+ v 64x64 + o 128x64 = 24,576 weights, two layer norms 128 and the q/k norms 64, 24,768 in all; its MLP 3 x 64 x 128
= 24,576; the model 4 x 49,344 + 2 x 64,000 (embedding, output layer) + 64 (final norm) = 325,440."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_dynamo.cli import main as cli_main
from megatron_dynamo.config import ConfigError
from megatron_dynamo.launch import memory_plan as mp
from megatron_dynamo.launch.memory_check import (architecture, check_job_memory, check_memory, header_block,
                                                 plan_run)
from megatron_dynamo.launch.recipes import PROJECT_ROOT, RECIPES, check_layout, get_recipe, load_recipe
from megatron_dynamo.models.mappings import hf_parameter_shapes
from megatron_dynamo.models.qwen import RECOMPUTE_MODES, QwenArchitecture, load_hf_config, parse_qwen_config
from megatron_dynamo.models.qwen_moe import MoEArchitecture

ROOT = Path(__file__).resolve().parents[1]
GiB = 2 ** 30
DENSE = QwenArchitecture(model_type="qwen3", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, qk_norm=True)
# Layer 0 dense, layers 1-3 MoE: 8 experts of FFN 32, top-2.
MOE = dataclasses.replace(DENSE, model_type="qwen3_moe", moe=MoEArchitecture(
    num_experts=8, top_k=2, expert_intermediate_size=32, norm_topk_prob=True, layer_pattern=(0, 1, 1, 1)))
# The 30B-A3B recipe as issue 54 found it.
AS_WRITTEN = ["trainer.recompute=off", "trainer.micro_batch_tokens=10240"]


def setup(**kw) -> mp.Setup:
    base = dict(micro_batch_tokens=100, capacity=8 * GiB, tensor_parallel=1, pipeline_parallel=2, data_parallel=4,
                engine_tensor_parallel=2, gpu_memory_utilization=0.75)
    return mp.Setup(**{**base, **kw})


# --------------------------------------------------------------------------------------- the terms, by hand
def test_parameters_by_hand_and_against_the_hf_tensor_list():
    assert mp.attention_params(DENSE) == 24_768 and mp.attention_params(DENSE, tp=2) == 24_576 // 2 + 128 + 64
    assert mp.mlp_params(DENSE, False) == (24_576, 0) and mp.mlp_params(DENSE, False, tp=2) == (12_288, 0)
    # An MoE layer at EP 2: the router (8 x 64) whole, 4 of the 8 experts of 3 x 64 x 32.
    assert mp.mlp_params(MOE, True, ep=2) == (512, 4 * 6_144)
    assert mp.model_params(DENSE) == 325_440
    assert mp.model_params(MOE) == 49_344 + 3 * (24_768 + 512 + 8 * 6_144) + 128_064 == 400_704
    for arch in (DENSE, MOE):  # an independent count: the converter's list of HF tensors
        assert mp.model_params(arch) == sum(_numel(shape) for shape in hf_parameter_shapes(arch).values())
    # PP 2: stage 0 holds layers 0-1 and the embedding, stage 1 layers 2-3, the final norm and the output layer.
    assert mp.stage_params(DENSE, setup(), 0) == (2 * 49_344 + 64_000, 0)
    assert mp.stage_params(DENSE, setup(), 1) == (2 * 49_344 + 64 + 64_000, 0)
    # Tied at PP 1: the embedding once; tied at PP 2: the last stage keeps a copy.
    tied = dataclasses.replace(DENSE, tie_word_embeddings=True)
    assert mp.stage_params(tied, setup(pipeline_parallel=1), 0) == (4 * 49_344 + 64_000 + 64, 0)
    assert mp.stage_params(tied, setup(), 1) == (2 * 49_344 + 64 + 64_000, 0)


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def test_every_term_of_a_dense_pipeline_by_hand():
    """PP 2, DP 4, bf16, 100-token micro-batches, vLLM TP 2 at a 0.75 share of an 8 GiB device."""
    stage0, stage1 = mp.plan_gpus(DENSE, setup())
    params0, params1 = 162_688, 162_752
    # Activations a token a layer: attention 2 x (2 x 64 + 8 x 32 + 6 x 32 + 4 x 32) + 4 x 4 = 1,424 B; MLP
    # 2 x (2 x 64 + 3 x 128) = 1,024 B. Stage 0 holds 2 micro-batches of its 2 layers and its output (2 x 64 B);
    # stage 1 one, plus the final norm and the hidden states (2 x 3 x 64 B) and two fp32 chunks of 2^25.
    expected0 = {"weights": 2 * params0, "gradients": 4 * params0, "optimizer": 12 * params0 // 4,
                 "activations": 2 * (2 * 2_448 + 128) * 100, "vllm weights": 325_440,
                 "vllm cache": 6 * GiB - 325_440, "weight sync": 2 * 64_000 * 3 // 2, "runtime": 2 * GiB}
    assert {t.name: t.bytes for t in stage0.terms} == expected0
    assert stage1.term("weights").bytes == 2 * params1 and stage1.term("optimizer").bytes == 12 * params1 // 4
    assert stage1.term("activations").bytes == 2 * 2_448 * 100 + 2 * 192 * 100 + 8 * 2 ** 25
    # Phases: the engine sleeps during the update, its KV cache also during the sync.
    state = 2 * params0 + 4 * params0 + 3 * params0
    assert stage0.phase_total("generate") == state + 6 * GiB + 2 * GiB
    assert stage0.phase_total("sync") == state + 325_440 + 192_000 + 2 * GiB
    assert stage0.phase_total("update") == state + 1_004_800 + 2 * GiB
    assert (stage0.peak_phase, stage0.total, stage0.fits) == ("generate", state + 8 * GiB, False)
    assert stage0.largest().name == "vllm cache"
    assert mp.plan_gpus(DENSE, setup(gpu_memory_utilization=0.5))[0].fits


def test_moe_layer_activations_router_experts_and_the_30b_estimate():
    # 1,424 B of attention + 2 x 2 x 64 (pre-MLP norm) + 8 + 20 x 2 (router) + 2 routed copies x
    # (2 x (64 + 3 x 32) + 4).
    assert mp.layer_activation_bytes(MOE, setup(), True) == 1_424 + 256 + 48 + 2 * 324 == 2_376
    softmax_all = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, norm_topk_prob=False))
    assert mp.layer_activation_bytes(softmax_all, setup(), True) == 2_376 + 4 * 8
    # Qwen3-30B-A3B at TP 1: attention 2 x (4,096 + 5,120 + 4,608 + 4,096) + 128, MoE 2 x 4,096 + 8 x (2 x 4,352 + 4)
    # + 128 + 160: ~114 kB a token a layer, against the issue's ~130 kB (which also counted k copies kept by the
    # unpermute; Megatron-Core 0.16 applies the routing weights inside the experts and keeps none there).
    big = parse_qwen_config(load_hf_config(ROOT / "configs/models/qwen3-30b-a3b.json"))
    per_token = mp.layer_activation_bytes(big, setup(), True)
    assert per_token == 2 * 17_920 + 128 + 2 * 4_096 + 8 * 8_708 + 288 == 114_112
    assert 0.85 * 130_000 < per_token < 130_000


def test_in_flight_micro_batches_by_stage():
    assert [mp.in_flight(setup(pipeline_parallel=4), s) for s in range(4)] == [4, 3, 2, 1]
    assert mp.in_flight(setup(pipeline_parallel=1), 0) == 1
    # Interleaved, PP 2 x VP 2: 2 (PP - s - 1) + (VP - 1) PP + 1 chunk micro-batches of half a stage.
    assert [mp.in_flight(setup(virtual_pipeline=2), s) for s in range(2)] == [2.5, 1.5]
    deep = mp.plan_gpus(DENSE, setup(pipeline_parallel=4))
    assert [p.term("activations").bytes for p in deep[:3]] == [n * (2_448 + 128) * 100 for n in (4, 3, 2)]


def test_recompute_off_above_selective_above_full():
    per_layer = [mp.layer_activation_bytes(DENSE, setup(), False, mode) for mode in ("off", "selective", "full")]
    assert per_layer == [2_448, 2_448 - 16, 2 * 64]
    stage0 = [mp.plan_stage(DENSE, setup(recompute=mode), 0).term("activations").bytes
              for mode in ("off", "selective", "full")]
    # Full: 2 micro-batches of (2 layer inputs + the stage output) and one layer rerun whole.
    assert stage0 == [2 * (2 * 2_448 + 128) * 100, 2 * (2 * 2_432 + 128) * 100, 2 * (2 * 128 + 128) * 100 + 244_800]
    assert stage0[0] > stage0[1] > stage0[2]
    with pytest.raises(ValueError, match="recompute must be one of"):
        mp.layer_activation_bytes(DENSE, setup(), False, "some")


def test_optimizer_state_is_sharded_over_the_data_parallel_and_expert_data_parallel_groups():
    one = setup(pipeline_parallel=1)
    optimizer = lambda **kw: mp.plan_stage(DENSE, dataclasses.replace(one, **kw), 0).term("optimizer").bytes  # noqa
    assert [optimizer(data_parallel=dp) for dp in (1, 2, 4)] == [12 * 325_440, 6 * 325_440, 3 * 325_440]
    assert optimizer(data_parallel=4, distributed_optimizer=False) == 12 * 325_440
    assert optimizer(data_parallel=2, dtype="fp32") == 8 * 325_440 // 2  # no master copy in fp32
    # Experts over the expert-data-parallel group, TP x CP x DP / (EP x ETP) (Megatron-Core 0.16).
    assert setup(tensor_parallel=2, data_parallel=4, expert_parallel=4).expert_data_parallel == 2
    assert setup(data_parallel=8, expert_parallel=8).expert_data_parallel == 1
    moe = mp.plan_stage(MOE, dataclasses.replace(one, expert_parallel=2), 0)
    dense, experts = 49_344 + 3 * 25_280 + 128_064, 3 * 4 * 6_144
    assert mp.stage_params(MOE, dataclasses.replace(one, expert_parallel=2), 0) == (dense, experts)
    assert moe.term("optimizer").bytes == 12 * dense // 4 + 12 * experts // 2
    assert moe.term("weights").bytes == 2 * (dense + experts) and moe.term("gradients").bytes == 4 * (dense + experts)


def test_weight_sync_routes_and_phases_by_hand():
    # The largest unit is the embedding (64,000 > a layer's 49,344): received whole plus the engine's half; under
    # training TP 2 also the gathered shards; a separate trainer assembles one tensor and packs a 128 MiB bucket.
    assert mp.weight_sync_bytes(DENSE, setup(), "colocated") == 192_000
    assert mp.weight_sync_bytes(DENSE, setup(tensor_parallel=2), "colocated") == 2 * (64_000 * 3 // 2 + 64_000)
    assert mp.weight_sync_bytes(DENSE, setup(), "trainer") == 128_000 + 128 * 2 ** 20
    assert mp.weight_sync_bytes(DENSE, setup(), "engine") == 192_000 + 128 * 2 ** 20
    # Routing replay: int16 x 3 MoE layers x top-2 for 1,000 tokens, int64 targets of one 100-token micro-batch.
    replay = setup(pipeline_parallel=1, routing_replay="rollout", mini_batch_tokens=1_000)
    assert mp.plan_stage(MOE, replay, 0).term("routes").bytes == 1_000 * 3 * 2 * 2 + 100 * 2 * 8 * 3
    assert "routes" not in {t.name for t in mp.plan_stage(MOE, setup(), 0).terms}
    # Offloaded training state leaves the generation; without sleep the engine stays through the update.
    offload = mp.plan_stage(DENSE, setup(offload_training_state=True), 0)
    assert offload.phase_total("generate") == 8 * GiB
    awake = mp.plan_stage(DENSE, setup(sleep_during_training=False), 0)
    assert awake.phase_total("update") == 9 * 162_688 + 1_004_800 + 8 * GiB
    # A separate job: training GPUs never generate, engine GPUs keep their share and take the bucket.
    trainer, engine = mp.plan_gpus(DENSE, setup(pipeline_parallel=1, separate=True))[-2:]
    assert trainer.phases == ("sync", "update") and "vllm weights" not in {t.name for t in trainer.terms}
    assert engine.phases == ("generate", "sync") and engine.total == 6 * GiB + 192_000 + 128 * 2 ** 20 + 2 * GiB


def test_the_constants_are_the_code_s():
    from megatron_dynamo.parallel.token_chunks import DEFAULT_CHUNK_ELEMENTS
    from megatron_dynamo.rollout.channel import BUCKET_BYTES

    assert (mp.SYNC_BUCKET_BYTES, mp.OUTPUT_CHUNK_ELEMENTS) == (BUCKET_BYTES, DEFAULT_CHUNK_ELEMENTS)
    assert mp.RECOMPUTE == RECOMPUTE_MODES


# ---------------------------------------------------------------------------------------------- the recipes
def _recipe_plans(name: str, overrides: list[str] = ()):
    recipe = get_recipe(name)
    run = load_recipe(recipe, [*recipe.overrides, *overrides])
    layout = check_layout(run, recipe.nodes, recipe.gpus_per_node)
    return run, architecture(run, PROJECT_ROOT), layout.topology, recipe.device_memory


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_fits_and_its_header_holds_its_plan(name):
    run, arch, topology, capacity = _recipe_plans(name)
    plans = check_memory(run, arch, topology, capacity)
    assert all(plan.fits for plan in plans) and capacity == 81_559 * 2 ** 20
    block = "\n".join(header_block(name, plans))
    assert block in (PROJECT_ROOT / RECIPES[name].config).read_text(), f"regenerate the header's lines:\n{block}"


def test_the_30b_recipe_as_written_is_refused_in_one_line_and_fits_with_the_fix():
    run, arch, topology, capacity = _recipe_plans("qwen3-30b-a3b", AS_WRITTEN)
    with pytest.raises(ConfigError) as refused:
        check_memory(run, arch, topology, capacity)
    message = str(refused.value)
    assert "\n" not in message and "the largest term is activations" in message, message
    assert "during the update" in message and "trainer.recompute=full brings the plan to" in message, message
    fixed = plan_run(dataclasses.replace(run, trainer=dataclasses.replace(run.trainer, recompute="full")), arch,
                     topology, capacity)
    assert all(plan.fits for plan in fixed)
    # No micro-batch is shorter than the longest sequence (2,048 + 8,192): a smaller micro_batch_tokens changes
    # nothing without recompute.
    shorter = _recipe_plans("qwen3-30b-a3b", [*AS_WRITTEN[:1], "trainer.micro_batch_tokens=4096"])
    assert plan_run(*shorter)[0].term("activations") == plan_run(run, arch, topology, capacity)[0].term("activations")
    # The recipe now: full recompute, one longest sequence a micro-batch; the peak is the generation's.
    run, arch, topology, capacity = _recipe_plans("qwen3-30b-a3b")
    assert (run.trainer.recompute, run.trainer.micro_batch_tokens) == ("full", 10_240)
    stage0 = plan_run(run, arch, topology, capacity)[0]
    assert stage0.peak_phase == "generate" and stage0.phase_total("update") < 42 * GiB


def test_a_vllm_share_below_its_weights_is_refused():
    run, arch, topology, capacity = _recipe_plans("qwen3-30b-a3b", ["rollout.gpu_memory_utilization=0.1"])
    with pytest.raises(ConfigError, match=r"^rollout.gpu_memory_utilization=0.1 gives vLLM 8.0 GiB .* weights \(14.2"):
        check_memory(run, arch, topology, capacity)


def test_launch_show_prints_the_plan_and_show_and_run_refuse_the_30b_as_written(capsys):
    assert cli_main(["launch", "show", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "# memory plan per GPU, 79.6 GiB a GPU" in out and "the fullest GPU: pipeline stage 0 of 2" in out
    assert "\n#   activations " in out and "recompute full" in out and ": fits, " in out
    assert cli_main(["launch", "show", "qwen3-30b-a3b", *AS_WRITTEN]) == 2
    shown = capsys.readouterr()
    assert "does NOT fit" in shown.out and "\nmodel:" not in shown.out  # the plan, not the config
    assert shown.err.count("\n") == 1 and shown.err.startswith("dynamo launch: memory plan: "), shown.err
    assert "activations" in shown.err and "trainer.recompute=full" in shown.err
    assert cli_main(["launch", "run", "qwen3-30b-a3b", "--executor", "slurm", "--code-dir", "/c", "--dryrun",
                     *AS_WRITTEN]) == 2
    run = capsys.readouterr()
    assert run.out == "" and run.err.count("\n") == 1 and "trainer.recompute=full" in run.err, run


def test_dynamo_train_refuses_on_a_gpu_and_plans_nothing_on_cpu(monkeypatch, capsys, tmp_path):
    from megatron_dynamo.commands import train

    monkeypatch.setattr(train, "check_run_inputs", lambda cfg, resume: cfg)  # the files of a cluster
    monkeypatch.setattr(train, "device_memory", lambda: 81_559 * 2 ** 20)
    argv = ["train", str(ROOT / "configs/qwen3-30b-a3b.yaml"), *AS_WRITTEN, f"trainer.output_dir={tmp_path}",
            "--nproc", "16"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynamo train: memory plan: ") and "trainer.recompute=full" in err
    run, arch, topology, _ = _recipe_plans("qwen3-30b-a3b", AS_WRITTEN)
    check_job_memory(run, topology, None)  # a CPU run: no device plan
