"""A run's memory plan (``launch/memory_plan.py``) from its config and layout: the table ``dynamo launch show``
prints, and the refusal of ``dynamo launch show/run`` and ``dynamo train`` when a GPU's plan exceeds the device's
memory: one line (a :class:`ConfigError`) naming the largest term of the fullest phase and a key that brings the plan
under the device's memory, found by planning the run again with it (docs/cluster.md, "The memory plan").

The device's memory: the recipe's (``Recipe.device_memory``, by default ``DEFAULT_DEVICE_MEMORY``, the cluster's
80 GB GPUs) for ``dynamo launch``; the GPU's own for ``dynamo train`` on a GPU; a CPU run has no device plan.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import replace
from pathlib import Path

from megatron_dynamo.config import ConfigError
from megatron_dynamo.launch.memory_plan import GiB, MemoryPlan, Setup, fullest, plan_gpus
from megatron_dynamo.models.config_errors import UnsupportedModelConfig
from megatron_dynamo.models.qwen import QwenArchitecture, check_model_layout, load_hf_config, parse_qwen_config
from megatron_dynamo.parallel.topology import JobTopology


def architecture(run, root: Path | None = None) -> QwenArchitecture | None:
    """The run's architecture from ``model.config`` (relative to ``root`` when given and not found as it is) or the
    checkpoint's config.json; None when neither is readable here (a site path of another machine)."""
    source = run.model.config_source() if run.model.config or run.model.checkpoint else None
    candidates = [Path(source).expanduser()] if source else []
    if root is not None and run.model.config:
        candidates.append(root / run.model.config)
    for path in candidates:
        if (path / "config.json" if path.is_dir() else path).is_file():
            return parse_qwen_config(load_hf_config(path))
    return None


def longest_sequence(run, arch: QwenArchitecture) -> int:
    """Prompt + response at most, and no more than the model's positions (the engine's max_model_len)."""
    return min(run.data.max_prompt_tokens + run.rollout.max_response_tokens, arch.max_position_embeddings)


def micro_batch_tokens(run, arch: QwenArchitecture) -> int:
    """The largest micro-batch: ``trainer.micro_batch_tokens``, or one longer sequence alone; with 0,
    ``micro_batch_size`` sequences padded to the longest."""
    longest = longest_sequence(run, arch)
    if run.trainer.micro_batch_tokens:
        return max(run.trainer.micro_batch_tokens, longest)
    return run.trainer.micro_batch_size * longest


def mini_batch_tokens(run, arch: QwenArchitecture, data_parallel: int) -> int:
    """The most tokens of one mini-batch on one data-parallel rank: its prompts x the most responses a prompt gets
    (``n_max`` with rollout allocation), within the step's budget, of the longest sequence each."""
    alloc = run.dynamo.allocation
    responses = min(run.trainer.mini_batch_prompts * (alloc.n_max if alloc.enabled else alloc.n_avg),
                    run.data.prompts_per_step * alloc.n_avg)
    return math.ceil(responses * longest_sequence(run, arch) / data_parallel)


def setup_of(run, arch: QwenArchitecture, topology: JobTopology, capacity: int) -> Setup:
    p, r, layout = run.parallel, run.rollout, topology.parallel
    return Setup(
        micro_batch_tokens=micro_batch_tokens(run, arch), capacity=capacity, dtype=run.model.dtype,
        tensor_parallel=p.tensor_parallel, pipeline_parallel=p.pipeline_parallel,
        virtual_pipeline=p.virtual_pipeline_parallel, context_parallel=p.context_parallel,
        sequence_parallel=p.sequence_parallel, data_parallel=layout.data_parallel, expert_parallel=p.expert_parallel,
        expert_tensor_parallel=p.expert_tensor_parallel, distributed_optimizer=run.optim.use_distributed_optimizer,
        recompute=run.trainer.recompute, separate=topology.separate, engine_tensor_parallel=r.tensor_parallel,
        gpu_memory_utilization=r.gpu_memory_utilization, sleep_during_training=r.sleep_during_training,
        offload_training_state=r.offload_training_state, routing_replay=run.moe.routing_replay,
        mini_batch_tokens=mini_batch_tokens(run, arch, layout.data_parallel))


def plan_run(run, arch: QwenArchitecture, topology: JobTopology, capacity: int) -> list[MemoryPlan]:
    return plan_gpus(arch, setup_of(run, arch, topology, capacity))


def _with(run, key: str, value):
    """A copy of the frozen config ``run`` with the dotted ``key`` set."""
    head, _, rest = key.partition(".")
    return replace(run, **{head: _with(getattr(run, head), rest, value) if rest else value})


def _candidates(run, arch: QwenArchitecture, plan: MemoryPlan, term: str) -> list[tuple[str, object]]:
    """Keys that shrink ``term``, in the order they are tried."""
    t, r, p = run.trainer, run.rollout, run.parallel
    colocated = r.placement != "separate"
    offload = [("rollout.offload_training_state", True)] if colocated and not r.offload_training_state else []
    deeper = [("parallel.pipeline_parallel", 2 * p.pipeline_parallel)]
    if term == "activations":
        longest, tokens = longest_sequence(run, arch), t.micro_batch_tokens
        smaller = []
        while tokens // 2 >= longest:
            tokens //= 2
            smaller.append(("trainer.micro_batch_tokens", tokens))
        return ([("trainer.recompute", "full")] if t.recompute != "full" else []) + smaller + deeper
    if term in ("weights", "gradients", "optimizer"):
        distributed = [] if run.optim.use_distributed_optimizer else [("optim.use_distributed_optimizer", True)]
        return distributed + (offload if plan.peak_phase == "generate" else []) + deeper
    if term == "vllm cache":
        others = plan.total - plan.term("vllm cache").bytes - plan.term("vllm weights").bytes
        share = math.floor((plan.capacity - others) / plan.capacity * 100) / 100
        return ([("rollout.gpu_memory_utilization", share)] if share > 0 else []) + offload
    if term == "vllm weights":
        return [("rollout.tensor_parallel", 2 * r.tensor_parallel)] + offload
    return []


def _replan(run, arch: QwenArchitecture, topology: JobTopology, capacity: int) -> list[MemoryPlan] | None:
    """The plans of a changed run on the same ranks, or None if its layout does not divide."""
    try:
        new = JobTopology.resolve(topology.world_size, run.parallel, run.rollout)
        check_model_layout(arch, run.parallel.tensor_parallel, run.parallel.pipeline_parallel,
                           run.parallel.expert_parallel, run.parallel.expert_tensor_parallel)
    except (ConfigError, UnsupportedModelConfig):
        return None
    return plan_run(run, arch, new, capacity)


def find_fix(run, arch: QwenArchitecture, topology: JobTopology, capacity: int) -> tuple[str, MemoryPlan] | None:
    """The first ``key=value`` (for the fullest plan's terms of its fullest phase, largest first) under which every
    GPU's plan fits, with the new fullest plan; None when no single key does."""
    plan = fullest(plan_run(run, arch, topology, capacity))
    terms = sorted((t for t in plan.terms if plan.peak_phase in t.phases), key=lambda t: -t.bytes)
    for term in terms:
        for key, value in _candidates(run, arch, plan, term.name):
            plans = _replan(_with(run, key, value), arch, topology, capacity)
            if plans is not None and all(p.fits for p in plans):
                shown = str(value).lower() if isinstance(value, bool) else value
                return f"{key}={shown}", fullest(plans)
    return None


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def check_memory(run, arch: QwenArchitecture, topology: JobTopology, capacity: int) -> list[MemoryPlan]:
    """The run's plans, or a ConfigError in one line when a GPU's plan exceeds ``capacity`` or the engine's share
    cannot hold its weights."""
    plans = plan_run(run, arch, topology, capacity)
    for plan in plans:
        names = {t.name for t in plan.terms}
        if "vllm cache" in names and plan.term("vllm cache").bytes == 0:
            weights = plan.term("vllm weights")
            share, engine_tp = run.rollout.gpu_memory_utilization, run.rollout.tensor_parallel
            raise ConfigError(f"rollout.gpu_memory_utilization={share:g} gives vLLM {_gib(share * capacity)} of the "
                              f"device, no more than its weights ({_gib(weights.bytes)} at rollout.tensor_parallel="
                              f"{engine_tp}): raise either")
    plan = fullest(plans)
    if plan.fits:
        return plans
    largest = plan.largest()
    fix = find_fix(run, arch, topology, capacity)
    remedy = (f"{fix[0]} brings the plan to {_gib(fix[1].total)}" if fix
              else "no single key brings the plan under it (more GPUs, shorter sequences)")
    raise ConfigError(f"memory plan: a GPU of {plan.gpu} needs {_gib(plan.total)} during the {plan.peak_phase}, more "
                      f"than the device's {_gib(capacity)}; the largest term is {largest.name}, {_gib(largest.bytes)}: "
                      f"{largest.what}; {remedy} (`dynamo launch show` prints it)")


def check_job_memory(run, topology: JobTopology, capacity: int | None, root: Path | None = None) -> None:
    """:func:`check_memory` for a job on GPUs of ``capacity`` bytes; nothing for a CPU job (``capacity`` None) or a
    model whose config.json is not readable here."""
    arch = architecture(run, root) if capacity else None
    if arch is not None:
        check_memory(run, arch, topology, capacity)


def plan_table(plans: list[MemoryPlan], capacity_note: str) -> list[str]:
    """The fullest GPU's plan as comment lines: term, GiB, when it is on the device, what it is; then the totals."""
    plan = fullest(plans)
    lines = [f"# memory plan per GPU, {capacity_note}; the fullest GPU: {plan.gpu}",
             f"#   {'term':13s} {'GiB':>6s}  {'when':16s} what"]
    for term in plan.terms:
        when = "always" if set(term.phases) == set(plan.phases) else "+".join(term.phases)
        lines.append(f"#   {term.name:13s} {term.bytes / GiB:6.2f}  {when:16s} {term.what}")
    phases = ", ".join(f"{phase} {plan.phase_total(phase) / GiB:.2f}" for phase in plan.phases)
    verdict = (f"fits, {(plan.capacity - plan.total) / GiB:.1f} GiB to spare" if plan.fits
               else f"does NOT fit, {(plan.total - plan.capacity) / GiB:.1f} GiB over")
    lines.append(f"#   {'total':13s} {plan.total / GiB:6.2f}  {'peak: ' + plan.peak_phase:16s} {phases} "
                 f"(of {plan.capacity / GiB:.2f} GiB): {verdict}")
    lines += [f"#   other GPUs: {other.gpu}: {other.total / GiB:.2f} GiB ({other.peak_phase})"
              for other in plans if other is not plan]
    return lines


def header_block(name: str, plans: list[MemoryPlan]) -> list[str]:
    """The memory lines of a recipe YAML's header, generated from its plan (tests/test_memory_plan.py checks that
    every recipe's header holds them): each kind of GPU's terms and phase totals, in GiB."""
    wrap = dict(width=118, initial_indent="# ", subsequent_indent="# ")
    lines = textwrap.wrap(f"Memory plan of {name} (launch/memory_plan.py; `dynamo launch show {name}` prints it, "
                          f"tests/test_memory_plan.py checks these lines against it), GiB per GPU of "
                          f"{plans[0].capacity / GiB:.2f}:", **wrap)
    for plan in plans:
        terms = ", ".join(f"{t.name} {t.bytes / GiB:.2f}" for t in plan.terms)
        others = ", ".join(f"{phase} {plan.phase_total(phase) / GiB:.2f}" for phase in plan.phases
                           if phase != plan.peak_phase)
        text = f"{plan.gpu}: {terms}; peak: {plan.peak_phase} {plan.total / GiB:.2f} ({others})"
        lines += textwrap.wrap(text, width=118, initial_indent="# - ", subsequent_indent="#   ")
    return lines
