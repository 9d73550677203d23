"""The CPU engine's KV cache, sized to what a run needs.

vLLM's CPU backend preallocates its whole KV cache when the engine starts (``kv_cache_memory_bytes``, or
``VLLM_CPU_KVCACHE_SPACE`` GiB), and the trainer's engine lives in the training process: a fixed 2 GiB cost the
CPU default (a 4-layer model of a few MB) 2 GiB of its ~3 GiB. What a step can use is bounded: at most the step's
sequences at once (``data.prompts_per_step x dynamo.allocation.n_avg``, the rollout budget with or without DRA;
never more than the scheduler's ``max_num_seqs``), each at most ``max_model_len`` tokens, rounded up to whole
blocks of ``block_size`` tokens, times the bytes a token takes (keys and values of every layer's KV heads on this
rank). A cache that size never makes vLLM wait for blocks or preempt a sequence in a step; a smaller one only
queues sequences. The floor (:data:`FLOOR_BYTES`, and at least one whole sequence, which vLLM requires) leaves room
for the periodic evaluation's requests, which queue when they do not fit.

``rollout.cpu_kvcache_gb`` overrides the computed size; ``VLLM_CPU_KVCACHE_SPACE`` (GiB, read by vLLM itself) wins
over both. GPUs size the cache from ``rollout.gpu_memory_utilization`` instead.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_dynamo.models.qwen import normalize_hf_config, parse_qwen_config

#: The CPU engine's block size (tokens per KV-cache block): the least the CPU attention kernel takes (a multiple of
#: 32; vLLM's own CPU default is 128). The n samples of a prompt share the KV of its whole blocks, computed once in
#: the step that prefills them all (prefix caching), so a smaller block leaves less of a prompt computed n times.
CPU_BLOCK_SIZE = 32
#: vLLM's default max_num_seqs on CPU for the ``LLM`` class, per rank of an engine (vllm/engine/arg_utils.py).
CPU_MAX_NUM_SEQS = 256
#: The least KV cache an engine gets: 16 MiB.
FLOOR_BYTES = 16 * 2**20
GiB = 2**30


def kv_bytes_per_token(hf_config: dict[str, Any], tensor_parallel: int = 1, dtype_bytes: int = 4) -> int:
    """Bytes of KV cache one token takes on one rank of an engine: keys and values of every layer for this rank's
    KV heads (vLLM replicates KV heads when the engine has more ranks than the model has KV heads)."""
    arch = parse_qwen_config(normalize_hf_config(dict(hf_config)))
    heads_per_rank = max(1, math.ceil(arch.num_key_value_heads / tensor_parallel))
    return 2 * arch.num_layers * heads_per_rank * arch.head_dim * dtype_bytes


def cpu_kv_cache_bytes(hf_config: dict[str, Any], max_model_len: int, sequences: int, tensor_parallel: int = 1,
                       dtype_bytes: int = 4, block_size: int = CPU_BLOCK_SIZE,
                       max_num_seqs: int = CPU_MAX_NUM_SEQS) -> int:
    """The KV cache (bytes) that holds ``sequences`` sequences of ``max_model_len`` tokens at once (at most
    ``max_num_seqs``: the scheduler never runs more), in whole blocks; at least :data:`FLOOR_BYTES`."""
    blocks_per_sequence = math.ceil(max_model_len / block_size)
    concurrent = max(1, min(sequences, max_num_seqs))
    need = concurrent * blocks_per_sequence * block_size * kv_bytes_per_token(hf_config, tensor_parallel, dtype_bytes)
    return max(need, FLOOR_BYTES)


def kv_cache_size(run, hf_config: dict[str, Any], max_model_len: int, on_gpu: bool) -> dict[str, float]:
    """The engine argument that sizes a training run's CPU KV cache (``cpu_kvcache_space_gb``): the recipe's
    ``rollout.cpu_kvcache_gb`` when set, else what a step needs (:func:`cpu_kv_cache_bytes` for the step's rollout
    budget, fp32 as on CPU). Nothing on a GPU, where ``gpu_memory_utilization`` sizes it."""
    if on_gpu:
        return {}
    if run.rollout.cpu_kvcache_gb is not None:
        return {"cpu_kvcache_space_gb": float(run.rollout.cpu_kvcache_gb)}
    tp = run.rollout.tensor_parallel
    need = cpu_kv_cache_bytes(hf_config, max_model_len, run.data.prompts_per_step * run.dynamo.allocation.n_avg, tp,
                              max_num_seqs=CPU_MAX_NUM_SEQS * tp)
    return {"cpu_kvcache_space_gb": need / GiB}
