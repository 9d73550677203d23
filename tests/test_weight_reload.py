"""The CPU engine's two ways of loading new weights (rollout/vllm_reload.py): in place, into the linear weights a dense
model keeps beside their packed copies (the CPU default), and through vLLM's layer-wise reload (mixtures of experts,
GPU). Both give the same samples and log-probs to the bit after a full update and after a partial one, with an
untied LM head (tiny-qwen2) and a tied one (tiny-qwen3: the head packs the embeddings it shares)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_reference import TINY_QWEN2, TINY_QWEN2_MOE, TINY_QWEN3, hf_model, hf_state_dict
from multiproc import run_on_ranks

from megatron_dynamo.rollout.vllm_setup import VLLMEngineConfig

PROMPTS = [[5, 17, 40, 3, 9, 22, 61, 30], [70, 2, 2, 45, 11], [90, 13, 54, 7, 33, 8, 101, 4, 12, 6]]


def _model_dir(tmp_path, config: str) -> str:
    from megatron_dynamo.data import build_char_tokenizer

    path = tmp_path / "model"
    hf_model(config, seed=0).save_pretrained(path)
    build_char_tokenizer(path)
    return str(path)


def _updates(config: str) -> list[list[tuple[str, torch.Tensor]]]:
    """A full update (seed 1), then a partial one: seed 2's tensors of the first layer's attention and MLP and of
    the final norm; the rest of the model stays at seed 1."""
    full = hf_state_dict(config, seed=1)
    partial = {name: tensor for name, tensor in hf_state_dict(config, seed=2).items()
               if name.startswith(("model.layers.0.self_attn.", "model.layers.0.mlp.", "model.norm."))}
    assert any("q_proj" in name for name in partial) and any("gate_proj" in name for name in partial)
    return [list(full.items()), list(partial.items())]


def _reload_worker(rank, world_size, model_dir, in_place, updates):
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.rollout import GenerationRequest, SamplingConfig
    from megatron_dynamo.rollout.vllm_engine import VLLMEngine

    runtime.init_distributed(runtime.ParallelConfig(), seed=1234)  # Megatron's CPU layer installed, as in training
    engine = VLLMEngine(model_dir, max_model_len=128, cpu_kvcache_space_gb=0.25, seed=0, reload_in_place=in_place)
    requests = [GenerationRequest(f"p{i}", tuple(prompt), 3) for i, prompt in enumerate(PROMPTS)]
    sampling = SamplingConfig(max_tokens=12, seed=7, ignore_eos=True)
    try:
        outputs = [engine.generate(requests, sampling)]
        for update in updates:
            engine.update_weights(iter(update))
            outputs.append(engine.generate(requests, sampling))
        return {"reload_in_place": engine.config.reload_in_place,
                "outputs": [[(r.prompt_id, r.sample_index, r.token_ids, r.logprobs) for r in out] for out in outputs]}
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("config", [TINY_QWEN2, TINY_QWEN3], ids=["untied-head", "tied-head"])
def test_in_place_and_layerwise_reloads_agree(tmp_path, config):
    model_dir = _model_dir(tmp_path, config)
    updates = _updates(config)
    in_place, = run_on_ranks(_reload_worker, 1, model_dir, None, updates)  # the CPU default for a dense model
    layerwise, = run_on_ranks(_reload_worker, 1, model_dir, False, updates)
    assert in_place["reload_in_place"] is True and layerwise["reload_in_place"] is False
    before, full, partial = in_place["outputs"]
    # Each update changes what the engine samples (else the comparison below would prove nothing) ...
    logprobs = lambda out: [lp for *_, lps in out for lp in lps]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(logprobs(before), logprobs(full))) > 1e-2
    assert max(abs(a - b) for a, b in zip(logprobs(full), logprobs(partial))) > 1e-3
    # ... and both ways load the same weights: samples and log-probs equal to the bit.
    assert in_place["outputs"] == layerwise["outputs"]


def test_reload_in_place_is_the_cpu_default_for_dense_models(tmp_path):
    dirs = {}
    for name, config in (("dense", TINY_QWEN2), ("moe", TINY_QWEN2_MOE), ("unknown", None)):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        if config is not None:
            shutil.copy(config, dirs[name] / "config.json")
        else:
            (dirs[name] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    resolved = lambda name, gpu, **kw: VLLMEngineConfig(model=str(dirs[name]), **kw).resolved(on_gpu=gpu)  # noqa: E731
    assert resolved("dense", False).reload_in_place is True
    assert resolved("moe", False).reload_in_place is False  # its experts' post-load step needs the layer-wise reload
    assert resolved("unknown", False).reload_in_place is False
    assert resolved("dense", True).reload_in_place is False
    assert resolved("dense", False, reload_in_place=False).reload_in_place is False
    for name, gpu in (("dense", True), ("moe", False), ("unknown", False)):
        with pytest.raises(ValueError, match="vllm.reload_in_place needs the CPU engine and a dense Qwen model"):
            resolved(name, gpu, reload_in_place=True)
