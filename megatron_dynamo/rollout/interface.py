"""The generation interface the trainer talks to, whatever engine runs behind it.

Token ids in, token ids out: the trainer tokenizes prompts itself (so the Megatron forward sees exactly the ids the
engine saw) and gets back, per response, the sampled ids and the engine's log-probs of them.

- :class:`SamplingConfig`: sampling parameters of a rollout (temperature, top-p/k, max tokens, stop ids, the run
  seed that per-request seeds are derived from).
- :class:`GenerationRequest`: one prompt (a stable ``prompt_id``, its token ids) and how many responses it gets.
- :class:`GenerationResponse`: one response; it carries its ``prompt_id``, its ``sample_index`` within the prompt's
  group and the prompt's token ids, so no consumer ever needs to realign responses by position (the public
  reference code repeated the prompt metadata uniformly while the counts differed, and scored responses against
  the wrong prompts).
- :class:`GenerationEngine`: the protocol (``generate``, ``update_weights``, ``sleep``, ``wake_up``, ``close``).
- A registry of engine factories by name. This module imports no engine: each engine's module registers itself
  (``rollout/vllm_engine.py`` registers ``"vllm"``), and importing :mod:`megatron_dynamo.rollout` (which Python
  does before any of its modules) imports them. vLLM itself is imported only when an engine is built.

Seeds: with ``SamplingConfig.seed`` set, request ``i`` gets the seed :func:`request_seed` ``(seed, step,
prompt_id)``; a prompt's samples then depend only on (run seed, step, prompt id, prompt tokens, count, weights),
not on which other prompts share the batch or where the prompt sits in it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from megatron_dynamo.parallel.topology import EngineLayout

FinishReason = Literal["stop", "length"]

#: Derived seeds lie in [0, 2**SEED_BITS). vLLM gives the j-th sample of a request the seed ``seed + j``; with 62
#: bits, two prompts' seed ranges overlapping is a ~1e-13 event per step.
SEED_BITS = 62


def request_seed(run_seed: int, step: int, prompt_id: str) -> int:
    """The sampling seed of one prompt at one step: a hash of (run seed, step, prompt id), stable across runs,
    processes and Python versions (blake2b, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{int(run_seed)}\x1f{int(step)}\x1f{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters shared by all requests of a ``generate`` call.

    ``seed``: the run seed from which each request's seed is derived (``None``: unseeded, not reproducible).
    ``top_k``: 0 or -1 disables it. ``stop_token_ids``: extra ids that end a response (the tokenizer's EOS always
    does unless ``ignore_eos``); the stopping id is part of the response's ``token_ids``.
    ``logprobs``: return the engine's log-prob of each sampled token (of the distribution actually sampled from:
    after temperature and top-p/top-k). ``detokenize``: also return the response text. ``routed_experts``: return
    the experts a mixture-of-experts model routed each token to (``GenerationResponse.routed_experts``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1024
    min_tokens: int = 0
    seed: int | None = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = True
    detokenize: bool = True
    routed_experts: bool = False

    def validate(self) -> "SamplingConfig":
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"sampling.temperature must be a finite number > 0, got {self.temperature!r} "
                             "(greedy decoding is not a rollout)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"sampling.top_p must lie in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"sampling.top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"sampling.min_tokens must lie in [0, max_tokens], got {self.min_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"sampling.seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        return self


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt and the number of responses to sample for it.

    ``prompt_id``: stable id (unique within a ``generate`` call). ``prompt_token_ids``: the tokenized prompt (what
    the trainer will feed Megatron). ``prompt_text`` may be given *instead* for convenience; the engine then
    tokenizes it and the responses carry the ids it used. ``count`` may be 0 (no responses). ``seed`` overrides
    the derived per-request seed.
    """

    prompt_id: str
    prompt_token_ids: tuple[int, ...] | None
    count: int
    prompt_text: str | None = None
    seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.prompt_id, str) or not self.prompt_id:
            raise ValueError(f"GenerationRequest.prompt_id must be a non-empty str, got {self.prompt_id!r}")
        if self.prompt_token_ids is None:
            if not isinstance(self.prompt_text, str) or not self.prompt_text:
                raise ValueError(f"request {self.prompt_id!r}: give prompt_token_ids or a non-empty prompt_text")
        else:
            ids = self.prompt_token_ids
            if isinstance(ids, torch.Tensor):
                ids = ids.reshape(-1).tolist()
            ids = tuple(int(t) for t in ids)
            if not ids or min(ids) < 0:
                raise ValueError(f"request {self.prompt_id!r}: prompt_token_ids must be non-empty and >= 0")
            object.__setattr__(self, "prompt_token_ids", ids)
        if not isinstance(self.count, int) or isinstance(self.count, bool):
            try:
                count = int(self.count)  # numpy / torch integers
            except (TypeError, ValueError):
                count = None
            if count is None or count != self.count:
                raise ValueError(f"request {self.prompt_id!r}: count must be an integer, got {self.count!r}")
            object.__setattr__(self, "count", count)
        if self.count < 0:
            raise ValueError(f"request {self.prompt_id!r}: count must be >= 0, got {self.count}")


@dataclass(frozen=True)
class GenerationResponse:
    """One sampled response, tagged with the prompt it answers.

    ``token_ids``: the generated ids (a stop/EOS id that ended the response included). ``logprobs``: the engine's
    log-prob of each of them (``None`` when not requested). ``finish_reason``: ``"stop"`` (EOS or a stop id) or
    ``"length"`` (cut at ``max_tokens`` or the context length: a truncated response). ``routed_experts`` (a
    mixture-of-experts model, when ``SamplingConfig.routed_experts``): int16 [len(prompt_token_ids) +
    len(token_ids) - 1, MoE layers, top-k], the experts of every prompt token, then of each response token but the
    last (the tokens the model read), MoE layers in model order (dense layers skipped).
    """

    prompt_id: str
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: FinishReason
    text: str | None = None
    seed: int | None = None
    routed_experts: torch.Tensor | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def check_requests(requests: Sequence[GenerationRequest]) -> None:
    """Raise ValueError if prompt ids repeat (responses are grouped by id, so ids must identify prompts)."""
    seen: set[str] = set()
    for request in requests:
        if not isinstance(request, GenerationRequest):
            raise TypeError(f"expected GenerationRequest, got {type(request).__name__}")
        if request.prompt_id in seen:
            raise ValueError(f"prompt id {request.prompt_id!r} appears twice in one generate call")
        seen.add(request.prompt_id)


def check_responses(requests: Sequence[GenerationRequest], responses: Sequence[GenerationResponse]) -> None:
    """Raise RuntimeError unless ``responses`` are exactly ``count`` responses per request, grouped in request
    order, with sample indices 0..count-1, each carrying its own prompt's id (and tokens, when the request gave
    them). Engines call this before returning; consumers may call it again."""
    position = 0
    for request in requests:
        for j in range(request.count):
            if position >= len(responses):
                raise RuntimeError(f"engine returned {len(responses)} responses; requests ask for "
                                   f"{sum(r.count for r in requests)}")
            response = responses[position]
            if response.prompt_id != request.prompt_id or response.sample_index != j:
                raise RuntimeError(f"response {position} is ({response.prompt_id!r}, sample {response.sample_index}),"
                                   f" expected ({request.prompt_id!r}, sample {j})")
            if request.prompt_token_ids is not None and response.prompt_token_ids != request.prompt_token_ids:
                raise RuntimeError(f"response {position} of {request.prompt_id!r} carries other prompt tokens")
            if response.logprobs is not None and len(response.logprobs) != len(response.token_ids):
                raise RuntimeError(f"response {position} of {request.prompt_id!r}: {len(response.logprobs)} "
                                   f"log-probs for {len(response.token_ids)} tokens")
            position += 1
    if position != len(responses):
        raise RuntimeError(f"engine returned {len(responses)} responses; requests ask for {position}")


def group_by_prompt(responses: Iterable[GenerationResponse]) -> dict[str, list[GenerationResponse]]:
    """``{prompt_id: [responses in sample order]}`` in first-appearance order, keyed by the ids the responses carry."""
    groups: dict[str, list[GenerationResponse]] = {}
    for response in responses:
        groups.setdefault(response.prompt_id, []).append(response)
    for group in groups.values():
        group.sort(key=lambda r: r.sample_index)
    return groups


@dataclass
class WeightUpdateStats:
    """What one weight load moved on this rank: bytes and tensors loaded, wall seconds (producing the tensors
    included: the engine consumes the stream, e.g. the TP/PP gather, as it loads)."""

    bytes: int = 0
    tensors: int = 0
    seconds: float = 0.0

    @property
    def gb_per_second(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.bytes and self.seconds > 0 else float("nan")

    def as_metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {f"{prefix}bytes": float(self.bytes), f"{prefix}tensors": float(self.tensors),
                f"{prefix}seconds": self.seconds, f"{prefix}gb_per_s": self.gb_per_second}


NamedTensors = Iterable[tuple[str, torch.Tensor]]


@runtime_checkable
class GenerationEngine(Protocol):
    """What the trainer needs from a rollout engine.

    ``generate``: for each request, ``count`` responses; the result is grouped in request order (all responses of
    request 0 by sample index, then request 1, ...) and every response carries its prompt id. ``step`` feeds the
    seed derivation (:func:`request_seed`). ``update_weights``: load HF-named full tensors into the running engine
    (any subset of the model; a stream is consumed once). ``sleep``/``wake_up``: free / restore the engine's
    accelerator memory around a training phase (no-ops where unsupported). ``close``: stop the engine.
    ``layout`` (:class:`~megatron_dynamo.parallel.topology.EngineLayout`): which engine this rank's part belongs to
    (every rank hosts a part; ranks of one engine call ``generate`` with identical requests, the trainer splits a
    step's prompts over the engines).
    """

    layout: "EngineLayout"

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig,
                 step: int = 0) -> list[GenerationResponse]: ...

    def update_weights(self, named_tensors: NamedTensors) -> WeightUpdateStats: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------- registry
EngineFactory = Callable[..., GenerationEngine]
_ENGINES: dict[str, EngineFactory] = {}


def register_engine(name: str, factory: EngineFactory | None = None):
    """Register ``factory(**kwargs) -> GenerationEngine`` under ``name`` (usable as a decorator)."""
    def _register(fn: EngineFactory) -> EngineFactory:
        if name in _ENGINES and _ENGINES[name] is not fn:
            raise ValueError(f"a generation engine named {name!r} is already registered")
        _ENGINES[name] = fn
        return fn

    return _register(factory) if factory is not None else _register


def registered_engines() -> list[str]:
    return sorted(_ENGINES)


def create_engine(name: str, **kwargs: Any) -> GenerationEngine:
    """Build the engine registered as ``name`` (``"vllm"``: ``rollout.vllm_engine.VLLMEngine``, registered there)."""
    try:
        factory = _ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown generation engine {name!r}; registered: {registered_engines()}") from None
    return factory(**kwargs)


def as_mapping(responses: Sequence[GenerationResponse]) -> Mapping[tuple[str, int], GenerationResponse]:
    """``{(prompt_id, sample_index): response}``: look responses up by identity, never by position."""
    return {(r.prompt_id, r.sample_index): r for r in responses}
