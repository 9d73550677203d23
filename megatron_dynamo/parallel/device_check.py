"""Catch tensors on the wrong device without a GPU: a CPU run that follows CUDA's placement rules.

On a GPU node the model and every NCCL collective need CUDA tensors, while a tensor built without ``device=`` lives
on the CPU. A CPU-only run cannot see the difference: everything is on the CPU, and gloo takes it all. Inside
:func:`simulated_gpu_placement` every tensor carries the place it would have on a GPU node, and the run fails
where CUDA would:

- ``host``: made by a factory without a device (``torch.tensor(...)``, ``torch.zeros(n)``, ``torch.from_numpy``),
  or by ``.cpu()``;
- ``device``: made with a CUDA device argument (``"cuda"``, an ordinal, ``t.device`` of a device tensor, the
  device :func:`megatron_dynamo.parallel.runtime.current_device` returns in this mode), moved with ``.to(cuda)``
  / ``.cuda()``, or computed from a device tensor; parameters become device tensors when the model is moved;
- unknown: anything else (e.g. gradients made inside autograd); never reported.

Reported, as :class:`DevicePlacementError`: an op mixing device and host tensors (0-dim host tensors and the indices
of ``t[i]`` excepted, as in CUDA), ``.numpy()`` of a device tensor, and a host tensor given to a collective of a
non-gloo group (Megatron's ``*_GLOO`` groups and the object collectives, which place their own buffers, are
exempt). ``Tensor.device`` of a device tensor answers ``cuda:0``, so ``torch.zeros(n, device=x.device)`` follows
``x`` as it would on a GPU; the data itself stays on the CPU (the compatibility layer maps CUDA to the CPU
underneath).

Used by the tests (``tests/test_device_placement.py``) around real training steps; costs a Python call per op.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from megatron_dynamo.parallel import cpu_compat
from megatron_dynamo.parallel.cpu_compat import is_cuda_device


DEVICE, HOST = "device", "host"
SIMULATED_DEVICE = torch.device("cuda", 0)
_ATTR = "_dynamo_simulated_place"
_state = threading.local()

# Collectives whose tensor arguments must be device tensors on an NCCL group.
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
                "send", "recv", "_all_gather_base", "_reduce_scatter_base", "batch_isend_irecv")
# isend/irecv stay as they are: P2POp accepts only the originals; their tensors are checked in batch_isend_irecv.
# They build and place their own byte buffers (CUDA under NCCL): whatever they do inside is exempt.
_OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                       "send_object_list", "recv_object_list")


class DevicePlacementError(RuntimeError):
    """A tensor is on a device where CUDA would refuse it."""


def is_active() -> bool:
    return bool(getattr(_state, "depth", 0))


def place(tensor: torch.Tensor) -> str | None:
    """``"device"``, ``"host"`` or None (unknown) for a tensor seen by the mode."""
    return getattr(tensor, _ATTR, None)


def _mark(value: Any, where: str | None) -> None:
    if where is None:
        return
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _ATTR, where)
            except (AttributeError, RuntimeError):  # e.g. tensors of C++ namedtuples
                pass


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


_FACTORIES = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.zeros, torch.ones, torch.empty, torch.full,
              torch.arange, torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye,
              torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
              torch.randn_like, torch.randint_like, torch.frombuffer}
_LIKE_FACTORIES = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
                   torch.randn_like, torch.randint_like}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_COPIES = {torch.Tensor.copy_}
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}


def _property_accessor(func) -> tuple[str, str] | None:
    """("device", "__get__") for ``Tensor.device``'s getter, etc. (a fresh method-wrapper object at every access,
    so identity cannot be compared)."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", None) in ("__get__", "__set__") and getattr(owner, "__objclass__", None) is \
            torch._C.TensorBase:
        return owner.__name__, func.__name__
    return None


class _PlacementMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        accessor = _property_accessor(func)
        if accessor == ("device", "__get__"):
            return SIMULATED_DEVICE if place(args[0]) == DEVICE else func(*args, **kwargs)
        if func is torch.Tensor.numpy and place(args[0]) == DEVICE:
            raise DevicePlacementError(f"numpy() of a device tensor {_describe(args[0])}: move it with .cpu() first")
        if accessor == ("data", "__set__"):  # e.g. Module.to(): the parameter takes the moved tensor's place
            func(*args, **kwargs)
            _mark(args[0], place(args[1]))
            return None
        out = func(*args, **kwargs)
        where = self._result_place(func, args, kwargs)
        if func in _MOVES and out is args[0] and where != place(out):
            # A move within the CPU returns the tensor itself; on a GPU it would be a new tensor, and the original
            # keeps its place.
            out = out.clone()
        _mark(out, where)
        return out

    def _result_place(self, func, args, kwargs) -> str | None:
        if func in _FACTORIES:
            if "device" in kwargs and kwargs["device"] is not None:
                return DEVICE if is_cuda_device(kwargs["device"]) else HOST
            if func in _LIKE_FACTORIES:
                return place(args[0])
            return HOST
        if func is torch.Tensor.cpu:
            return HOST
        if func is torch.Tensor.cuda:
            return DEVICE
        if func is torch.Tensor.to:
            target = kwargs.get("device")
            for a in args[1:]:
                if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
                    target = a
                elif isinstance(a, torch.Tensor):
                    return place(a)
            if target is not None:
                return DEVICE if is_cuda_device(target) else HOST
            return place(args[0])
        if func in _COPIES:  # copies cross devices by design
            return place(args[0])
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in _INDEXING:
            # CUDA takes CPU index tensors. A value stored through basic indexing is copied (any device); through
            # tensor indices (index_put_) it must be on the indexed tensor's device.
            advanced = any(isinstance(i, torch.Tensor) for i in tree_flatten(args[1])[0])
            tensors = [args[0]] + ([args[2]] if func is torch.Tensor.__setitem__ and advanced
                                   and isinstance(args[2], torch.Tensor) else [])
        places = {place(t) for t in tensors if not (place(t) == HOST and t.dim() == 0)}
        if DEVICE in places and HOST in places:
            host = next(t for t in tensors if place(t) == HOST and t.dim() > 0)
            raise DevicePlacementError(
                f"{getattr(func, '__name__', func)} mixes device tensors with a host tensor {_describe(host)} "
                "(made without device=, or by .cpu()): CUDA would refuse this")
        if DEVICE in places:
            return DEVICE
        return HOST if HOST in places else None


def _megatron_gloo_groups() -> list[Any]:
    try:
        from megatron.core import parallel_state
    except ImportError:
        return []
    groups = []
    for name in dir(parallel_state):
        if name.endswith("_GLOO"):
            value = getattr(parallel_state, name)
            groups.extend(value if isinstance(value, (list, tuple)) else [value])
    return [g for g in groups if g is not None]


def _vllm_gloo_groups() -> list[Any]:
    """vLLM's ``cpu_group`` of each of its group coordinators: gloo on a GPU too (only when vLLM is loaded)."""
    import sys

    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is None:
        return []
    groups = []
    for value in vars(state).values():
        cpu_group = getattr(value, "cpu_group", None) if type(value).__name__ == "GroupCoordinator" else None
        if cpu_group is not None:
            groups.append(cpu_group)
    return groups


def _check_collective(name: str, args, kwargs) -> None:
    if getattr(_state, "inside_object_collective", 0):
        return
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    if group is not None and any(group is g for g in _megatron_gloo_groups() + _vllm_gloo_groups()):
        return
    flat = tree_flatten((args, kwargs))[0]
    for item in flat:
        tensors = [item] if isinstance(item, torch.Tensor) else (
            [item.tensor] if isinstance(item, dist.P2POp) else [])
        for t in tensors:
            if place(t) == HOST:
                raise DevicePlacementError(
                    f"torch.distributed.{name} got a host tensor {_describe(t)} (made without device=, or by "
                    ".cpu()): NCCL takes only CUDA tensors; create it on the model's device")


def _guarded(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _check_collective(name, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _object_collective(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _state.inside_object_collective = getattr(_state, "inside_object_collective", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _state.inside_object_collective -= 1

    return wrapper


@contextlib.contextmanager
def simulated_gpu_placement() -> Iterator[None]:
    """Run the body under CUDA's placement rules (see the module docstring). CPU only: on a GPU the real rules
    apply anyway. Enter it after ``runtime.init_distributed`` and before the model is built (parameters become
    device tensors when the model is moved to ``runtime.current_device()``)."""
    if torch.cuda.is_available():
        raise RuntimeError("simulated_gpu_placement is for CPU runs; on a GPU the real placement rules apply")

    cpu_compat.install()  # CUDA device arguments must reach the CPU underneath this mode
    originals = {name: getattr(dist, name) for name in _COLLECTIVES + _OBJECT_COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, _object_collective(fn) if name in _OBJECT_COLLECTIVES else _guarded(name, fn))
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with _PlacementMode():
            yield
    finally:
        _state.depth -= 1
        for name, fn in originals.items():
            setattr(dist, name, fn)


__all__ = ["DevicePlacementError", "is_active", "place", "simulated_gpu_placement", "SIMULATED_DEVICE"]
