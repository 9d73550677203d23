"""The messages between trainer ranks and engine ranks of a job whose engines run apart (``rollout.placement:
separate``), over the bridge groups of ``parallel/placement.py``.

Engine ranks -> trainer ranks, on ``batches`` (the first engine rank broadcasts to every trainer rank):
``READY`` (the engines are built; or ``ERROR`` if they could not be), ``BATCH`` (a :class:`~megatron_dynamo.rollout.rollout_batch.RolloutBatch`), ``EVAL`` (an evaluation's metrics),
``DONE`` (the answer to ``STOP``) and ``ERROR`` (an engine rank failed: its rank and message).

Trainer ranks -> engine ranks, on ``control`` (the first trainer rank broadcasts to every engine rank): ``INIT``
(where the run starts: the data position, the prompt history, which batches to generate; then the weights),
``WEIGHTS`` (a new policy version, streamed in ``BUCKET`` messages of up to :data:`BUCKET_BYTES`, then ``END``),
``STOP``.

Every message is a fixed-size int64 header (kind, integers, then each tensor's dtype and size) followed by its
tensors, each a broadcast of its own; JSON travels as UTF-8 bytes. Nothing is pickled. Both sides follow one
schedule (``trainer/overlap.py``), so each group carries its messages in the same order on every member and no
collective waits for one that never comes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from megatron_dynamo.parallel.placement import BridgeGroup
from megatron_dynamo.rollout.rollout_batch import TENSOR_NAMES, RolloutBatch, tensor_text, text_tensor

BATCH, EVAL, DONE, ERROR, INIT, WEIGHTS, STOP, BUCKET, END, READY = range(1, 11)
KIND_NAMES = {BATCH: "BATCH", EVAL: "EVAL", DONE: "DONE", ERROR: "ERROR", INIT: "INIT", WEIGHTS: "WEIGHTS",
              STOP: "STOP", BUCKET: "BUCKET", END: "END", READY: "READY"}
HEADER_SIZE = 40
DTYPES = (torch.int64, torch.float64, torch.uint8, torch.float32, torch.bfloat16, torch.float16, torch.int32,
          torch.int16)
CODE_OF = {dtype: code for code, dtype in enumerate(DTYPES)}


class EngineRankFailed(RuntimeError):
    """An engine rank reported a failure (``rank``: its global rank)."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


@dataclass
class Message:
    kind: int
    ints: list[int]
    tensors: list[torch.Tensor]


def send(bridge: BridgeGroup, kind: int, ints: Iterable[int] = (), tensors: Iterable[torch.Tensor] = ()) -> None:
    """Collective over ``bridge``, called by its root: one message to every other member."""
    ints, tensors = [int(i) for i in ints], [t.reshape(-1) for t in tensors]
    fields = [kind, len(ints), len(tensors), *ints]
    for tensor in tensors:
        fields += [CODE_OF[tensor.dtype], tensor.numel()]
    if len(fields) > HEADER_SIZE:
        raise ValueError(f"message {KIND_NAMES[kind]}: {len(ints)} integers and {len(tensors)} tensors do not fit "
                         f"a header of {HEADER_SIZE}")
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64, device=bridge.device)
    header[:len(fields)] = torch.tensor(fields, dtype=torch.int64)
    bridge.broadcast(header)
    for tensor in tensors:
        if tensor.numel():  # gloo refuses empty tensors; the receiver knows the size from the header
            bridge.broadcast(_as_bytes(tensor.to(bridge.device).contiguous()))


def receive(bridge: BridgeGroup) -> Message:
    """Collective over ``bridge``, called by every member but the root: the root's next message."""
    header = bridge.broadcast(torch.zeros(HEADER_SIZE, dtype=torch.int64, device=bridge.device)).tolist()
    kind, n_ints, n_tensors = header[:3]
    if kind not in KIND_NAMES:
        raise RuntimeError(f"rollout channel: a message of unknown kind {kind} (the two sides are out of step)")
    ints = header[3:3 + n_ints]
    specs = header[3 + n_ints:3 + n_ints + 2 * n_tensors]
    tensors = []
    for code, numel in zip(specs[0::2], specs[1::2]):
        tensor = torch.empty(numel, dtype=DTYPES[code], device=bridge.device)
        if numel:
            bridge.broadcast(_as_bytes(tensor))  # fills ``tensor``: the bytes are a view of it
        tensors.append(tensor)
    return Message(kind, ints, tensors)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """What a broadcast carries: the tensor, or its bytes for a dtype gloo cannot broadcast (int16: routed
    experts)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.int16 else tensor


def json_tensor(value: Any) -> torch.Tensor:
    return text_tensor(json.dumps(value))


def tensor_json(tensor: torch.Tensor) -> Any:
    return json.loads(tensor_text(tensor))


# ---------------------------------------------------------------------------------------------- batches
def send_batch(bridge: BridgeGroup, batch: RolloutBatch) -> None:
    tensors = batch.to_tensors()
    send(bridge, BATCH, [batch.step], [tensors[name] for name in TENSOR_NAMES])


def send_eval(bridge: BridgeGroup, step: int, metrics: dict[str, Any]) -> None:
    send(bridge, EVAL, [step], [json_tensor(metrics)])


def send_signal(bridge: BridgeGroup, kind: int) -> None:
    """A message that carries nothing but its kind (``READY``, ``DONE``)."""
    send(bridge, kind)


def send_error(bridge: BridgeGroup, rank: int, message: str) -> None:
    send(bridge, ERROR, [rank], [text_tensor(message)])


def receive_from_engines(bridge: BridgeGroup, expected: int) -> Message:
    """The engine ranks' next message, which must be of kind ``expected``; an ``ERROR`` raises
    :class:`EngineRankFailed`."""
    message = receive(bridge)
    if message.kind == ERROR:
        raise EngineRankFailed(message.ints[0], tensor_text(message.tensors[0]))
    if message.kind != expected:
        raise RuntimeError(f"rollout channel: expected {KIND_NAMES[expected]} from the engine ranks, got "
                           f"{KIND_NAMES[message.kind]} (the two sides are out of step)")
    return message


def batch_of(message: Message) -> RolloutBatch:
    return RolloutBatch.from_tensors(dict(zip(TENSOR_NAMES, message.tensors)))


# ---------------------------------------------------------------------------------------------- control
@dataclass
class Control:
    """A command from the trainer ranks. ``WEIGHTS`` (and ``INIT``) are followed by a weight stream
    (:func:`receive_weights`). ``version``: the policy version of those weights; ``generate_until``: the last batch
    the engines may generate; ``evaluate``: evaluate these weights before generating; ``state`` (``INIT``): the
    run's start (``trainer/overlap.py``)."""

    kind: int
    version: int = 0
    generate_until: int = 0
    evaluate: bool = False
    state: dict[str, Any] | None = None


def send_control(bridge: BridgeGroup, control: Control) -> None:
    tensors = [json_tensor(control.state)] if control.kind == INIT else []
    send(bridge, control.kind, [control.version, control.generate_until, int(control.evaluate)], tensors)


def receive_control(bridge: BridgeGroup) -> Control:
    message = receive(bridge)
    if message.kind not in (INIT, WEIGHTS, STOP):
        raise RuntimeError(f"rollout channel: expected a command from the trainer ranks, got "
                           f"{KIND_NAMES[message.kind]} (the two sides are out of step)")
    version, generate_until, evaluate = (message.ints + [0, 0, 0])[:3]
    state = tensor_json(message.tensors[0]) if message.kind == INIT else None
    return Control(message.kind, version, generate_until, bool(evaluate), state)


# A weight bucket: tensors' bytes back to back (each at a multiple of ALIGN, so each is a view of its own dtype)
BUCKET_BYTES = 128 * 2**20
ALIGN = 16


def _aligned(nbytes: int) -> int:
    """The room ``nbytes`` take in a bucket: the next multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def _send_bucket(bridge: BridgeGroup, entries: list[tuple[str, torch.Tensor]], size: int) -> None:
    data = torch.empty(size, dtype=torch.uint8, device=bridge.device)
    index, offset = [], 0
    for name, tensor in entries:
        data[offset:offset + tensor.nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        index.append([name, CODE_OF[tensor.dtype], list(tensor.shape), offset])
        offset += _aligned(tensor.nbytes)
    send(bridge, BUCKET, [], [json_tensor(index), data])


def send_weights(bridge: BridgeGroup, named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int = BUCKET_BYTES) -> tuple[int, int]:
    """The root's half of a weight stream: the ``(hf_name, full tensor)`` pairs packed into ``BUCKET`` messages of
    up to ``bucket_bytes`` (a larger tensor alone in one), then ``END``. One broadcast per bucket instead of three per
    tensor, and the receiver reads one message ahead, so this returns once the data is across, not once the engine
    has loaded it. Returns (bytes, tensors) sent."""
    sent_bytes = count = size = 0
    entries: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named_tensors:
        room = _aligned(tensor.nbytes)
        if entries and size + room > bucket_bytes:
            _send_bucket(bridge, entries, size)
            entries, size = [], 0
        entries.append((name, tensor))
        size += room
        sent_bytes += tensor.nbytes
        count += 1
    if entries:
        _send_bucket(bridge, entries, size)
    send(bridge, END)
    return sent_bytes, count


def _bucket_tensors(message: Message) -> list[tuple[str, torch.Tensor]]:
    index, data = tensor_json(message.tensors[0]), message.tensors[1]
    tensors = []
    for name, code, shape, offset in index:
        dtype = DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize
        tensors.append((name, data[offset:offset + nbytes].view(dtype).reshape(shape)))
    return tensors


def receive_weights(bridge: BridgeGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """The receiving half: ``(hf_name, tensor)`` on the bridge's device until ``END``, each a view into its bucket.
    Each bucket's next message is received before its tensors are handed out (the sender is not held while they
    load). Iterate it to the end (see :func:`drain`), or the group falls out of step."""
    message = receive(bridge)
    while message.kind != END:
        if message.kind != BUCKET:
            raise RuntimeError(f"rollout channel: expected weights, got {KIND_NAMES[message.kind]}")
        tensors = _bucket_tensors(message)
        message = receive(bridge)
        yield from tensors


def drain(stream: Iterator) -> None:
    """Consume what is left of a stream (after a failure while loading it), keeping the group in step."""
    for _ in stream:
        pass
