"""Training state to host memory while vLLM generates, and back: ``rollout.offload_training_state``.

With vLLM on every GPU, the GPU holds during generation both the engine (weights, KV cache) and Megatron's state
(parameters, gradient buffers, Adam moments, fp32 master weights). For the large recipes the latter can be moved to
host memory for the rollout (the way verl offloads its actor): :class:`HostOffload` copies each distinct storage of
the given tensors into a host buffer (pinned on GPU machines) and shrinks the device storage to zero bytes; reload
grows it back and copies the bytes in. Tensors, views and ``Parameter`` objects stay the same Python objects, so
Megatron's DDP buckets, the optimizer's references and the model's modules need no re-wiring.
"""

from __future__ import annotations

from typing import Iterable

import torch


class HostOffload:
    """Offload / reload the storages of ``tensors`` (duplicates and views of one storage are handled once).

    ``offload()`` then ``reload()`` restores every byte. Between them the tensors must not be read or written.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]):
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                storage = tensor.untyped_storage()
                storages.setdefault(storage.data_ptr(), storage)
        self._storages = list(storages.values())
        self._host: list[torch.Tensor] | None = None

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    @property
    def nbytes(self) -> int:
        """Bytes these storages hold on the device (when not offloaded)."""
        if self._host is not None:
            return sum(h.numel() for h in self._host)
        return sum(s.nbytes() for s in self._storages)

    def offload(self) -> None:
        """Copy every storage to host memory and free its device bytes. Idempotent."""
        if self._host is not None:
            return
        pin = torch.cuda.is_available()
        host = []
        for storage in self._storages:
            data = _bytes_of(storage)
            copy = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=pin)
            copy.copy_(data, non_blocking=pin)
            host.append(copy)
        if pin:
            torch.cuda.synchronize()
        for storage in self._storages:
            storage.resize_(0)
        self._host = host
        if pin:
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Give every storage its bytes back, on its device. Idempotent."""
        if self._host is None:
            return
        for storage, copy in zip(self._storages, self._host):
            storage.resize_(copy.numel())
            _bytes_of(storage).copy_(copy, non_blocking=copy.is_pinned())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._host = None


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def training_state_tensors(chunks, optimizer) -> list[torch.Tensor]:
    """Every tensor of Megatron's training state on this rank: the model chunks' parameters and buffers, their
    ``main_grad`` and DDP's contiguous parameter / gradient buffers, and the optimizer's state (Adam moments) and
    fp32 master copies, through Megatron's chained and mixed-precision optimizer wrappers."""
    tensors: list[torch.Tensor] = []
    for chunk in chunks:
        tensors.extend(p.data for p in chunk.parameters())
        tensors.extend(torch.nn.Module.buffers(chunk))  # Megatron's DDP shadows .buffers with a list
        tensors.extend(getattr(p, "main_grad", None) for p in chunk.parameters())
        for buffer in list(getattr(chunk, "buffers", None) or []) + list(getattr(chunk, "expert_parallel_buffers",
                                                                              None) or []):
            if not callable(buffer):
                tensors.extend([getattr(buffer, "param_data", None), getattr(buffer, "grad_data", None)])
    stack = [optimizer] if optimizer is not None else []
    while stack:
        opt = stack.pop()
        stack.extend(getattr(opt, "chained_optimizers", []) or [])
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups", "shard_fp32_groups"):
            for group in getattr(opt, name, None) or []:
                tensors.extend(group)
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return [t for t in tensors if isinstance(t, torch.Tensor)]
