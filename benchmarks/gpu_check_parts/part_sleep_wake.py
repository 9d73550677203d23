"""Part ``sleep_wake``: GPU memory with vLLM awake, asleep (levels 1 and 2) and woken, the Megatron model
resident; outputs after wake-up equal those before sleep."""

from __future__ import annotations

import time
import traceback
from typing import Any

from benchmarks.gpu_check_parts.common import (Ctx, device_used_gib, error_line, free_cuda, gib, init_megatron,
                                               load_config, make_prompts, sharpen, shutdown_megatron, te_enabled,
                                               write_model_dir)
from benchmarks.gpu_check_parts.part_vllm import start_engine
from benchmarks.gpu_check_parts.registry import QWEN_1_5B, log


def part_sleep_wake(ctx: Ctx) -> dict[str, Any]:
    import torch
    from megatron.core import tensor_parallel

    from megatron_dynamo.rollout import GenerationRequest, SamplingConfig, sync_weights
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    init_megatron(ctx, seed=0)
    cfg = load_config(QWEN_1_5B)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    numbers: dict[str, Any] = {
        "vLLM": "TP=1, gpu_memory_utilization 0.3, CUDA graphs (production defaults), sleep mode on",
        "device used": "total - free of the whole GPU (every process), GiB"}
    used: dict[str, float] = {}

    def mark(key: str, state: str) -> None:
        rows.append({"state": state, "device used GiB": device_used_gib(),
                     "Megatron allocated GiB": gib(torch.cuda.memory_allocated()),
                     "Megatron reserved GiB": gib(torch.cuda.memory_reserved())})
        used[key] = rows[-1]["device used GiB"]
        log(rows[-1])

    def timed(label: str, fn) -> Any:
        t0 = time.perf_counter()
        value = fn()
        numbers[label] = time.perf_counter() - t0
        return value

    actor = engine = None
    try:
        mark("context", "CUDA context only")
        actor = MegatronActor(cfg, dtype="bf16", optim=OptimConfig(lr=1e-6), use_te=te_enabled())
        ids = torch.randint(0, actor.arch.vocab_size, (1, 2049), device="cuda")
        mb = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        actor.forward_backward([mb], lambda lg, m: (
            tensor_parallel.vocab_parallel_cross_entropy(lg.clone(), m["labels"]).mean(), {}))
        actor.optimizer_step()  # the optimizer state now exists, as during training
        del ids, mb
        free_cuda(ctx)
        sharpen(actor, actor.arch)
        mark("megatron", "Megatron 1.5B bf16 + fp32 grads + Adam state resident (no activations)")
        model_dir = write_model_dir(cfg, ctx.work / "model_bf16", "bf16")
        engine = start_engine(model_dir, "bf16", 512, ctx, enable_sleep_mode=True)
        numbers["engine start s"] = engine.startup_seconds
        timed("first sync s", lambda: sync_weights(engine, actor, dtype=torch.bfloat16))
        requests = [GenerationRequest(pid, toks, 4) for pid, toks in make_prompts(8)]
        sampling = SamplingConfig(max_tokens=64, seed=99, stop_token_ids=(0,), detokenize=False)
        reference = engine.generate(requests, sampling, step=1)
        mark("awake", "vLLM awake (weights + KV cache + graphs) + Megatron: the rollout phase")

        def same_as_reference(label: str) -> None:
            out = engine.generate(requests, sampling, step=1)
            same = [r.token_ids for r in out] == [r.token_ids for r in reference]
            diff = max(max((abs(a - b) for a, b in zip(r.logprobs, q.logprobs)), default=0.0)
                       for r, q in zip(out, reference)) if same else float("nan")
            rows[-1].update({"outputs = before sleep": same, "max logp diff": diff})
            if not same:
                failures.append(f"{label}: generated tokens differ from those before sleep")

        for level in (1, 2):
            timed(f"sleep level {level} s", lambda: engine.sleep(level=level))
            mark(f"asleep{level}", f"vLLM asleep, level {level}: the training phase")
            freed = (used["awake"] - used[f"asleep{level}"]) / max(1e-9, used["awake"] - used["megatron"])
            rows[-1]["freed share of vLLM's memory"] = freed
            if freed < 0.7:
                failures.append(f"sleep level {level} freed only {freed:.0%} of vLLM's GPU memory")
            if level == 2:  # the weights were discarded: the trainer's order is wake weights, load, wake KV cache
                timed("re-sync after level 2 s (wakes the weights)",
                      lambda: sync_weights(engine, actor, dtype=torch.bfloat16))
            timed(f"wake after level {level} s", engine.wake_up)
            mark(f"woken{level}", f"vLLM woken after level {level}" + (", weights re-synced" if level == 2 else ""))
            same_as_reference(f"after level {level}")
        # rollout.offload_training_state: Megatron's state in host memory while vLLM generates.
        from megatron_dynamo.trainer.offload import HostOffload, training_state_tensors

        offload = HostOffload(training_state_tensors(actor.chunks, actor.optimizer))
        numbers["Megatron state offloaded GiB"] = gib(offload.nbytes)
        timed("offload Megatron state s", offload.offload)
        free_cuda(ctx)
        mark("offloaded", "vLLM awake + Megatron state offloaded to host (rollout.offload_training_state)")
        same_as_reference("with Megatron offloaded")
        timed("reload Megatron state s", offload.reload)
        mark("reloaded", "Megatron state back on the GPU")
    except Exception as exc:  # noqa: BLE001 - keep the memory table measured so far
        traceback.print_exc()
        failures.append(error_line(exc))
    finally:
        if engine is not None:
            engine.close()
        del actor, engine
        free_cuda(ctx)
    shutdown_megatron()
    summary = ", ".join(f"{label} {used[key]:.1f} GiB" for key, label in (
        ("megatron", "Megatron"), ("awake", "+ vLLM awake"), ("asleep1", "asleep L1"), ("asleep2", "asleep L2"))
        if key in used)
    return {"status": "fail" if failures else "pass", "summary": "; ".join([summary, *failures]),
            "numbers": numbers, "tables": {"GPU memory (device used)": rows}}
