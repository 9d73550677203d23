"""Forward, forward+backward and optimizer-step times of a Megatron actor at several micro-batch shapes, with
tokens/s, model TFLOP/s and peak memory: what the ``model_1p5b`` (dense) and ``moe`` parts measure."""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from benchmarks.gpu_check_parts.common import (Ctx, error_line, free_cuda, gib, shutdown_megatron,
                                               sync_device, te_enabled)


def predicted_peak_gib(rows: list[dict[str, Any]], batch: int, seq: int) -> float | None:
    """Peak memory predicted for `batch` rows of `seq` tokens from the measured 1-row shape of the same length
    (activations grow linearly in the rows at a fixed length); None when that shape was not measured."""
    one = next((r for r in rows if r["micro-batch"] == f"1x{seq}" and "activations GiB" in r), None)
    if one is None:
        return None
    return one["peak alloc GiB"] + (batch - 1) * one["activations GiB"]


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _loss_fn(logits, mb):
    from megatron.core import tensor_parallel

    loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb["labels"]).mean()
    return loss, {"loss": loss.detach()}


def _timed(ctx: Ctx, fn):
    sync_device(ctx)
    start = time.perf_counter()
    value = fn()
    sync_device(ctx)
    return time.perf_counter() - start, value


def _measure_one(ctx: Ctx, actor, mb: dict, repeats: int) -> dict[str, Any]:
    import torch

    actor.forward_backward([mb], _loss_fn)  # warm-up (kernels, optimizer state)
    actor.optimizer_step()
    if ctx.gpu:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if ctx.gpu else 0
    fwd, fb, step, losses, norms = [], [], [], [], []
    for _ in range(repeats):
        fwd.append(_timed(ctx, lambda: actor.forward_backward([mb], _loss_fn, forward_only=True))[0])
        seconds, res = _timed(ctx, lambda: actor.forward_backward([mb], _loss_fn))
        fb.append(seconds)
        losses.append(float(res[0]["loss"]))
        seconds, result = _timed(ctx, actor.optimizer_step)
        step.append(seconds)
        norms.append(result.grad_norm if result.grad_norm is not None else float("nan"))
    row = {"fwd s": _median(fwd), "fwd+bwd s": _median(fb), "opt step s": _median(step), "loss": losses[-1],
           "grad norm": norms[-1], "finite": all(math.isfinite(x) for x in losses + norms)}
    if ctx.gpu:
        row["peak alloc GiB"] = gib(torch.cuda.max_memory_allocated())
        row["activations GiB"] = gib(torch.cuda.max_memory_allocated() - before)
        row["peak reserved GiB"] = gib(torch.cuda.max_memory_reserved())
    return row


def _out_of_memory(ctx: Ctx, rows: list, row: dict, exc: BaseException, batch: int, seq: int) -> str | None:
    """Record an OOM in ``row``; the failure to report, or None when the card is simply too small for the shape."""
    import torch

    row["result"] = "OOM"
    row["detail"] = str(exc).splitlines()[0][:160]
    need = predicted_peak_gib(rows, batch, seq)
    capacity = gib(torch.cuda.get_device_properties(ctx.device()).total_memory)
    if need is not None and need > 0.9 * capacity:
        # Not a defect: the card is too small for this shape (e.g. the local spec's [rows, heads, S, S] attention
        # scores at 4x2048 of the 1.5B shape need ~84 GiB: an H200 fits it, an 80 GiB H100 cannot).
        row["result"] = f"OOM, expected: ~{need:.0f} GiB predicted from 1x{seq}, the card has {capacity:.0f}"
        return None
    return (f"{batch}x{seq}: out of memory" + (f" (predicted ~{need:.0f} GiB of {capacity:.0f})" if need is not None
                                               else ""))


def measure_shapes(ctx: Ctx, actor, vocab_size: int, shapes: list[tuple[int, int]], repeats: int,
                   flops_per_token: Callable[[int], float]) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per (rows x tokens) micro-batch of random tokens: median times of ``repeats`` after a warm-up step,
    tokens/s, model TFLOP/s (``flops_per_token(seq)`` x tokens / forward+backward time), peak memory on a GPU. A
    shape that fails is a row saying so and the next shape still runs. Returns (rows, failures)."""
    import torch

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    for batch, seq in shapes:
        if ctx.remaining() < 60:
            rows.append({"micro-batch": f"{batch}x{seq}", "result": "not run: part time limit near"})
            continue
        gen = torch.Generator().manual_seed(seq + batch)
        ids = torch.randint(0, vocab_size, (batch, seq + 1), generator=gen).to(ctx.device())
        row: dict[str, Any] = {"micro-batch": f"{batch}x{seq}", "tokens": batch * seq}
        try:
            row.update(_measure_one(ctx, actor, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, repeats))
            row["tokens/s (fwd+bwd+step)"] = batch * seq / (row["fwd+bwd s"] + row["opt step s"])
            row["model TFLOP/s (fwd+bwd)"] = flops_per_token(seq) * batch * seq / row["fwd+bwd s"] / 1e12
            if not row.pop("finite"):
                failures.append(f"{batch}x{seq}: non-finite loss or grad norm")
        except torch.cuda.OutOfMemoryError as exc:
            actor.zero_grad()
            failure = _out_of_memory(ctx, rows, row, exc, batch, seq)
            failures += [failure] if failure else []
        except Exception as exc:  # noqa: BLE001 - the next shape still runs
            traceback.print_exc()
            row.update(result="error", detail=error_line(exc))
            failures.append(f"{batch}x{seq}: {error_line(exc)}")
            actor.zero_grad()
        del ids
        free_cuda(ctx)
        rows.append(row)
    return rows, failures


def best_row_summary(spec: str, rows: list[dict[str, Any]]) -> str:
    ran = [r for r in rows if "fwd+bwd s" in r]
    if not ran:
        return "no shape ran"
    best = max(ran, key=lambda r: r["tokens/s (fwd+bwd+step)"])
    return f"{spec}: best {best['tokens/s (fwd+bwd+step)']:.0f} tokens/s at {best['micro-batch']}"


def build_actor(ctx: Ctx, cfg: dict[str, Any], failures: list[str]):
    """The recipes' optimizer (Megatron Adam, distributed, fp32 main params) on a bf16 model; the plain optimizer,
    with the failure recorded, when the distributed one cannot be built. Returns (actor, optimizer, build s)."""
    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    use_te = ctx.gpu and te_enabled()
    optimizer = "Megatron Adam, distributed optimizer (the recipes' setting; DP=1), fp32 main params + grads"
    t0 = time.perf_counter()
    try:
        actor = MegatronActor(cfg, dtype="bf16", optim=OptimConfig(lr=1e-6, use_distributed_optimizer=True),
                              use_te=use_te)
    except Exception as exc:  # noqa: BLE001 - measure with the plain optimizer, report the failure
        traceback.print_exc()
        failures.append(f"distributed optimizer: {error_line(exc)}")
        optimizer = "Megatron Adam (plain: the distributed optimizer failed), fp32 main params + grads"
        free_cuda(ctx)
        t0 = time.perf_counter()
        actor = MegatronActor(cfg, dtype="bf16", optim=OptimConfig(lr=1e-6), use_te=use_te)
    return actor, optimizer, time.perf_counter() - t0


@dataclass
class ModelRun:
    """What :func:`measure_model` measured of one model."""

    parameters: int
    optimizer: str
    build_s: float
    static_gib: float  # GPU memory allocated before the first step (weights, gradient buffers, optimizer state)
    rows: list[dict[str, Any]]
    failures: list[str] = field(default_factory=list)

    def result(self, spec: str, numbers: dict[str, Any]) -> dict[str, Any]:
        """The part's result: pass unless a shape (or the optimizer) failed or none ran."""
        failures = self.failures + ([] if any("fwd+bwd s" in r for r in self.rows) else ["no shape ran"])
        return {"status": "fail" if failures else "pass",
                "summary": "; ".join([best_row_summary(spec, self.rows), *failures]),
                "numbers": numbers, "tables": {"step time and memory": self.rows}}


def measure_model(ctx: Ctx, cfg: dict[str, Any], shapes: list[tuple[int, int]], repeats: int,
                  flops_per_token: Callable[[Any, int], float]) -> ModelRun:
    """Build the model of HF config ``cfg`` (:func:`build_actor`), measure it at ``shapes``
    (:func:`measure_shapes`; ``flops_per_token(arch, seq)``), and shut Megatron down."""
    import torch

    failures: list[str] = []
    actor, optimizer, build_s = build_actor(ctx, cfg, failures)
    arch = actor.arch
    parameters = sum(p.numel() for _, p in actor.named_parameters())
    static_gib = gib(torch.cuda.memory_allocated()) if ctx.gpu else float("nan")
    rows, shape_failures = measure_shapes(ctx, actor, arch.vocab_size, shapes, repeats,
                                          lambda seq: flops_per_token(arch, seq))
    del actor
    shutdown_megatron()
    return ModelRun(parameters, optimizer, build_s, static_gib, rows, failures + shape_failures)
