"""The child processes of ``bench_weight_sync.py`` (one rank each, started by ``parallel.spawn.run_on_ranks``):
the OLD path, the NEW path, and the NEW engine's generation; plus the interleaved timing they share.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench_weight_sync_legacy import LEGACY_EXTENSION, legacy_update


def _timed(fns: dict, repeats: int, check=None) -> tuple[dict, dict]:
    """One untimed warm-up of each ``fn() -> {"bytes", "seconds", ...}``, then ``repeats`` rounds calling each once,
    interleaved (so load from other work on the machine hits all of them alike). ``check()`` runs (untimed) after
    each fn of the last round: the state that fn loaded. Returns (stats by name, check results by name)."""
    warmup = {name: fn() for name, fn in fns.items()}
    runs: dict[str, list] = {name: [] for name in fns}
    checks = {}
    for round_index in range(repeats):
        for name, fn in fns.items():
            runs[name].append(fn())
            if check is not None and round_index == repeats - 1:
                checks[name] = check()
    out = {}
    for name, rs in runs.items():
        seconds = [r["seconds"] for r in rs]
        nbytes, median = rs[0]["bytes"], statistics.median(seconds)
        out[name] = {"bytes": nbytes, "tensors": rs[0].get("tensors"), "buckets": rs[0].get("buckets"),
                     "warmup_seconds": warmup[name]["seconds"], "seconds": seconds, "median_seconds": median,
                     "median_s_per_gb": median / (nbytes / 1e9), "median_gb_per_s": nbytes / 1e9 / median,
                     "min_s_per_gb": min(seconds) / (nbytes / 1e9), "runs": rs}
    return out, checks


def _greedy(llm, prompt_ids: list[int], max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=0)
    out = llm.generate([{"prompt_token_ids": list(prompt_ids)}], params, use_tqdm=False)[0].outputs[0]
    ids = [int(t) for t in out.token_ids]
    return {"tokens": ids, "logprob_sum": float(sum(p[t].logprob for p, t in zip(out.logprobs, ids)))}


def _load_state(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return dict(load_file(os.path.join(model_dir, "model.safetensors")))


def _child_setup(spec: dict) -> None:
    from megatron_dynamo import library_logs

    library_logs.apply_from_environment()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _build_actor(spec: dict, state: dict):
    from megatron_dynamo.trainer.actor import MegatronActor

    return MegatronActor(spec["config"], optim=None, hf_weights=state.__getitem__)


# ------------------------------------------------------------------------------------------------ child processes
def legacy_child(rank: int, world_size: int, spec: dict) -> dict:
    """OLD path: separate-process vLLM, packed buckets through collective_rpc."""
    _child_setup(spec)
    import vllm

    from megatron_dynamo.models.export import iter_hf_weights
    from megatron_dynamo.parallel import runtime

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "20")
    runtime.init_distributed(runtime.ParallelConfig(), seed=0)  # the trainer's process, as the old engine had it
    state = _load_state(spec["model_dir"])
    actor = _build_actor(spec, state) if spec["actor"] else None
    t0 = time.perf_counter()
    llm = vllm.LLM(model=spec["model_dir"], dtype="float32", max_model_len=spec["max_model_len"], seed=0,
                   enforce_eager=True, load_format="dummy", worker_extension_cls=LEGACY_EXTENSION,
                   enable_chunked_prefill=False, logprobs_mode="processed_logprobs")
    result = {"startup_seconds": time.perf_counter() - t0, "loads": {}}
    try:
        prompt = spec["check_prompt"]
        result["check_before"] = _greedy(llm, prompt, spec["check_tokens"])
        fns = {}
        for mib in spec["bucket_mb"]:
            fns[f"hf/{mib}"] = lambda mib=mib: legacy_update(llm, iter(state.items()), mib << 20)
            if actor is not None:
                fns[f"actor/{mib}"] = lambda mib=mib: legacy_update(
                    llm, iter_hf_weights(actor.chunks, actor.arch, dtype=torch.float32), mib << 20)
        result["loads"], result["checks"] = _timed(fns, spec["repeats"],
                                                   lambda: _greedy(llm, prompt, spec["check_tokens"]))
    finally:
        t0 = time.perf_counter()
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown(timeout=30)
        result["shutdown_seconds"] = time.perf_counter() - t0
    return result


def new_child(rank: int, world_size: int, spec: dict) -> dict:
    """NEW path: vLLM in this process, ``update_weights`` / ``sync_weights``."""
    _child_setup(spec)
    from megatron_dynamo.models.export import iter_hf_weights
    from megatron_dynamo.parallel import runtime
    from megatron_dynamo.rollout import VLLMEngine, sync_weights

    runtime.init_distributed(runtime.ParallelConfig(), seed=0)
    state = _load_state(spec["model_dir"])
    actor = _build_actor(spec, state) if spec["actor"] else None
    engine = VLLMEngine(spec["model_dir"], dtype="float32", max_model_len=spec["max_model_len"], seed=0,
                        cpu_kvcache_space_gb=1, engine_kwargs={"load_format": "dummy"},
                        reload_in_place=spec["reload_in_place"])
    result = {"startup_seconds": engine.startup_seconds, "loads": {},
              "reload_in_place": engine.config.reload_in_place}
    try:
        prompt, llm = spec["check_prompt"], engine.llm
        result["check_before"] = _greedy(llm, prompt, spec["check_tokens"])

        def load_hf():
            s = engine.update_weights(iter(state.items()))
            return {"bytes": s.bytes, "tensors": s.tensors, "seconds": s.seconds}

        def export_only():
            t0, nbytes, count = time.perf_counter(), 0, 0
            for _, t in iter_hf_weights(actor.chunks, actor.arch, dtype=torch.float32):
                nbytes, count = nbytes + t.numel() * t.element_size(), count + 1
            return {"bytes": nbytes, "tensors": count, "seconds": time.perf_counter() - t0}

        def sync():
            s = sync_weights(engine, actor)
            return {"bytes": s.bytes, "tensors": s.tensors, "seconds": s.seconds}

        fns = {"hf": load_hf}
        if actor is not None:
            fns.update(actor=sync, export_only=export_only)
        result["loads"], checks = _timed(fns, spec["repeats"], lambda: _greedy(llm, prompt, spec["check_tokens"]))
        checks.pop("export_only", None)  # loads nothing: its check repeats the previous state
        result["checks"] = checks
    finally:
        t0 = time.perf_counter()
        engine.close()
        result["shutdown_seconds"] = time.perf_counter() - t0
    return result


def generation_child(rank: int, world_size: int, spec: dict) -> dict:
    """NEW engine on the tiny model: this rank's engine generates its share of the requests."""
    _child_setup(spec)
    if spec.get("gen_threads"):
        torch.set_num_threads(spec["gen_threads"])  # the engine keeps the thread count it finds
    if not spec.get("gen_bare"):
        from megatron_dynamo.parallel import runtime

        runtime.init_distributed(runtime.ParallelConfig(), seed=0)  # as in training: Megatron's CPU layer installed
    import torch.distributed as dist

    from megatron_dynamo.data import build_char_tokenizer, make_synthetic_task, render
    from megatron_dynamo.rollout import (GenerationRequest, SamplingConfig, VLLMEngine, assign_to_engines,
                                         request_loads)

    tokenizer = build_char_tokenizer()
    examples = make_synthetic_task(spec["gen_prompts"], seed=0)
    requests = [GenerationRequest(ex.id, tuple(tokenizer.encode(render("qwen_math_boxed", ex.problem),
                                                                add_special_tokens=False)), spec["gen_n"])
                for ex in examples]
    sampling = SamplingConfig(max_tokens=spec["gen_tokens"], ignore_eos=True, seed=0)
    engine = VLLMEngine(spec["tiny_dir"], dtype="float32", max_model_len=256, seed=0, cpu_kvcache_space_gb=1,
                        engine_kwargs={"load_format": "dummy"})
    try:
        layout = engine.layout
        loads = request_loads([len(r.prompt_token_ids) for r in requests], [r.count for r in requests],
                              spec["gen_tokens"])
        assignment = assign_to_engines(loads, layout.num_engines)
        mine = [r for r, e in zip(requests, assignment) if e == layout.engine_index]
        engine.generate(mine[:2], sampling, step=0)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        responses = engine.generate(mine, sampling, step=1)
        generate_seconds = time.perf_counter() - t0
        dist.barrier()
        wall = time.perf_counter() - t0
        return {"rank": rank, "engines": layout.num_engines, "engine": layout.engine_index, "requests": len(mine),
                "sequences": len(responses), "tokens": sum(r.num_tokens for r in responses),
                "generate_seconds": generate_seconds, "wall_seconds": wall,
                "startup_seconds": engine.startup_seconds, "torch_threads": torch.get_num_threads()}
    finally:
        engine.close()
