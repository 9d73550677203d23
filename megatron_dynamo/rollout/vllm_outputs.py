"""One ``generate`` call's requests through vLLM and its outputs back as
:class:`~megatron_dynamo.rollout.interface.GenerationResponse` (``VLLMEngine.generate``): outputs matched to the
requests by vLLM's request id, each response checked against its request (prompt tokens, sample indices, log-probs)
and given its routed experts when the call records them (``rollout/routed_experts.py``)."""

from __future__ import annotations

import logging
from dataclasses import replace

from megatron_dynamo.rollout.interface import GenerationRequest, GenerationResponse, SamplingConfig
from megatron_dynamo.rollout.routed_experts import sample_request_id

logger = logging.getLogger(__name__)


def submit_and_wait(llm, prompts: list, params: list) -> tuple[list[str], list]:
    """Submit and wait; vLLM's request ids and outputs, both in request order."""
    returned_ids = [str(r) for r in llm.enqueue(prompts, params, use_tqdm=False)]
    outputs = llm.wait_for_completion(use_tqdm=False)
    by_id = {str(o.request_id): o for o in outputs}
    # enqueue() returns vLLM's internal ids ("<external id>-<8 random characters>") while outputs carry the external
    # id: accept either.
    external = [rid if rid in by_id else rid.rsplit("-", 1)[0] for rid in returned_ids]
    missing = [rid for rid in external if rid not in by_id]
    if missing or len(set(external)) != len(external):
        raise RuntimeError(f"vLLM outputs do not match the request ids {returned_ids[:5]}...: got {sorted(by_id)[:5]}...")
    extra = set(by_id) - set(external)
    if extra:
        logger.warning("ignoring %d vLLM outputs of requests this call did not make", len(extra))
    return returned_ids, [by_id[rid] for rid in external]


def responses_of(request: GenerationRequest, request_id: str, output, seed: int | None, sampling: SamplingConfig,
                 routed=None) -> list[GenerationResponse]:
    """The ``count`` responses of ``request`` from vLLM's ``output`` (vLLM request ``request_id``) in sample order;
    ``routed``: where their routed experts come from (None: not recorded)."""
    prompt_ids = tuple(int(t) for t in output.prompt_token_ids)
    if request.prompt_token_ids is not None and prompt_ids != request.prompt_token_ids:
        raise RuntimeError(f"vLLM output for {request.prompt_id!r} carries other prompt tokens")
    completions = sorted(output.outputs, key=lambda c: c.index)
    if [c.index for c in completions] != list(range(request.count)):
        raise RuntimeError(f"vLLM returned samples {[c.index for c in completions]} for {request.prompt_id!r}, "
                           f"expected 0..{request.count - 1}")
    responses = []
    for completion in completions:
        token_ids = tuple(int(t) for t in completion.token_ids)
        logprobs = None
        if sampling.logprobs:
            if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
                raise RuntimeError(f"vLLM returned no log-probs (or the wrong number) for {request.prompt_id!r}")
            logprobs = sampled_logprobs(completion.logprobs, token_ids, request.prompt_id)
        reason = completion.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample of {request.prompt_id!r} with reason {reason!r}")
        experts = None if routed is None else routed.routed_experts(
            sample_request_id(request_id, request.count, completion.index), completion,
            len(prompt_ids) + len(token_ids) - 1)
        responses.append(GenerationResponse(
            prompt_id=request.prompt_id, sample_index=int(completion.index), prompt_token_ids=prompt_ids,
            token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
            seed=None if seed is None else seed + int(completion.index), routed_experts=experts))
    return responses


def sampled_logprobs(flat, token_ids: tuple[int, ...], prompt_id: str) -> tuple[float, ...]:
    """The log-prob of each sampled token from vLLM's flat log-probs of one sample (``flat_logprobs``, asked with
    ``logprobs=0``: one entry per position, the sampled token's)."""
    if len(flat) != len(token_ids) or list(flat.start_indices) != list(range(len(token_ids))) \
            or list(flat.token_ids) != list(token_ids):
        raise RuntimeError(f"vLLM returned log-probs of other tokens for {prompt_id!r}")
    return tuple(float(x) for x in flat.logprobs)


def with_texts(responses: list[GenerationResponse], tokenizer) -> list[GenerationResponse]:
    """``responses`` with their texts, decoded in one batch as vLLM's detokenizer would (special tokens skipped)."""
    texts = tokenizer.batch_decode([list(r.token_ids) for r in responses], skip_special_tokens=True)
    return [replace(r, text=text) for r, text in zip(responses, texts)]
