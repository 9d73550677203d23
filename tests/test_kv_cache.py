"""The CPU engine's KV cache sized to the run (rollout/kv_cache.py): the arithmetic against hand-computed sizes, the
recipe override, and the real vLLM (CPU build) allocating exactly that cache and serving a whole CPU-default step
(32 prompts x 8 samples) from it."""

from __future__ import annotations

import pytest

from hf_reference import REPO, TINY_QWEN2, hf_model
from megatron_dynamo.models.qwen import load_hf_config
from megatron_dynamo.rollout.kv_cache import (CPU_BLOCK_SIZE, FLOOR_BYTES, cpu_kv_cache_bytes, kv_bytes_per_token,
                                              kv_cache_size)

CPU_DEFAULT = f"{REPO}/configs/cpu_default.yaml"
BENCH_100M = f"{REPO}/configs/models/bench-qwen2-100m.json"
MiB = 2**20


def test_bytes_per_token_count_keys_and_values_of_every_layer():
    # K and V x layers x KV heads x head_dim x 4 bytes (fp32)
    assert kv_bytes_per_token(load_hf_config(TINY_QWEN2)) == 2 * 4 * 2 * 32 * 4
    assert kv_bytes_per_token(load_hf_config(BENCH_100M)) == 2 * 12 * 2 * 64 * 4
    assert kv_bytes_per_token(load_hf_config(BENCH_100M), dtype_bytes=2) == 2 * 12 * 2 * 64 * 2
    # two KV heads over TP 2: one per rank; over TP 4 vLLM replicates them: still one per rank
    assert kv_bytes_per_token(load_hf_config(BENCH_100M), tensor_parallel=2) == 2 * 12 * 1 * 64 * 4
    assert kv_bytes_per_token(load_hf_config(BENCH_100M), tensor_parallel=4) == 2 * 12 * 1 * 64 * 4


def test_cache_holds_the_step_in_whole_blocks_with_a_floor_and_a_cap():
    big = load_hf_config(BENCH_100M)
    per_token = 2 * 12 * 2 * 64 * 4
    # 128 sequences of 16 + 256 tokens: 9 blocks of 32 tokens each
    assert CPU_BLOCK_SIZE == 32
    assert cpu_kv_cache_bytes(big, 272, 128) == 128 * 9 * 32 * per_token
    assert cpu_kv_cache_bytes(big, 256, 128) == 128 * 8 * 32 * per_token
    assert cpu_kv_cache_bytes(big, 272, 128, block_size=128) == 128 * 3 * 128 * per_token
    # never more sequences than the scheduler runs at once
    assert cpu_kv_cache_bytes(big, 272, 10_000) == cpu_kv_cache_bytes(big, 272, 256) == 256 * 9 * 32 * per_token
    assert cpu_kv_cache_bytes(big, 272, 10_000, max_num_seqs=512) == 512 * 9 * 32 * per_token
    # the floor
    assert cpu_kv_cache_bytes(load_hf_config(TINY_QWEN2), 22, 4) == FLOOR_BYTES == 16 * MiB
    assert cpu_kv_cache_bytes(big, 22, 1) == FLOOR_BYTES


def test_a_run_gets_its_computed_size_or_the_recipe_s():
    from megatron_dynamo.trainer.config import load_run_config

    run = load_run_config(CPU_DEFAULT, ["data.prompts_per_step=16", "trainer.mini_batch_prompts=16"])
    # 16 prompts x n_avg 8 sequences of at most 272 tokens
    want = 16 * 8 * 9 * 32 * (2 * 12 * 2 * 64 * 4)
    assert kv_cache_size(run, load_hf_config(BENCH_100M), 272, on_gpu=False) == {"cpu_kvcache_space_gb": want / 2**30}
    run = load_run_config(CPU_DEFAULT, ["rollout.cpu_kvcache_gb=0.25"])
    assert kv_cache_size(run, load_hf_config(TINY_QWEN2), 22, on_gpu=False) == {"cpu_kvcache_space_gb": 0.25}
    assert kv_cache_size(run, load_hf_config(TINY_QWEN2), 22, on_gpu=True) == {}


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_bad_override_is_refused(value):
    from megatron_dynamo.config import ConfigError
    from megatron_dynamo.trainer.config import load_run_config

    with pytest.raises(ConfigError, match=r"rollout.cpu_kvcache_gb: must be > 0"):
        load_run_config(CPU_DEFAULT, [f"rollout.cpu_kvcache_gb={value}"])


@pytest.mark.slow
def test_the_engine_allocates_that_cache_and_serves_a_whole_step(tmp_path, monkeypatch):
    """vLLM (CPU) started with the CPU default's computed size holds exactly that many bytes of KV cache and
    generates a whole step (32 prompts x 8 samples of the synthetic task) from it without preempting a sequence."""
    from megatron_dynamo.data import build_char_tokenizer, render
    from megatron_dynamo.data.synthetic import make_synthetic_task
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.rollout import GenerationRequest, SamplingConfig
    from megatron_dynamo.rollout.vllm_engine import VLLMEngine
    from megatron_dynamo.trainer.config import load_run_config

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    hf_model(TINY_QWEN2, seed=0).save_pretrained(tmp_path)
    tokenizer = build_char_tokenizer(tmp_path)
    run = load_run_config(CPU_DEFAULT, [])
    max_len = run.data.max_prompt_tokens + run.rollout.max_response_tokens
    size = kv_cache_size(run, load_hf_config(TINY_QWEN2), max_len, on_gpu=False)
    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    try:
        with VLLMEngine(str(tmp_path), max_model_len=max_len, seed=0, **size) as engine:
            worker = engine.llm.llm_engine.model_executor.driver_worker.worker
            allocated = sum(t.untyped_storage().nbytes() for t in _unique_storages(worker.model_runner.kv_caches))
            assert allocated == int(size["cpu_kvcache_space_gb"] * 2**30) == 16 * MiB
            examples = list(make_synthetic_task(run.data.prompts_per_step, seed=0))
            requests = [GenerationRequest(ex.id, tokenizer.encode(render("synthetic", ex.problem),
                                                                  add_special_tokens=False), 8) for ex in examples]
            responses = engine.generate(requests, SamplingConfig(max_tokens=run.rollout.max_response_tokens, seed=0),
                                        step=1)
            assert len(responses) == 32 * 8
            # vLLM's own count: its blocks hold every sequence of the step at full length at once.
            cache = engine.llm.llm_engine.vllm_config.cache_config
            assert cache.num_gpu_blocks // -(-max_len // cache.block_size) >= 32 * 8, (cache.num_gpu_blocks,
                                                                                       cache.block_size)
    finally:
        runtime.shutdown()


def _unique_storages(tensors):
    seen, out = set(), []
    for t in tensors if isinstance(tensors, (list, tuple)) else [tensors]:
        if isinstance(t, (list, tuple)):
            out += _unique_storages(t)
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out

