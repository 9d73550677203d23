"""Part ``model_1p5b``: the Qwen2.5-Math-1.5B shape, random weights, bf16: forward, forward+backward and
optimizer-step times, tokens/s, peak memory."""

from __future__ import annotations

import math
import time
import traceback
from typing import Any

from benchmarks.gpu_check_parts.common import (Ctx, error_line, free_cuda, gib, init_megatron, load_config,
                                               shutdown_megatron, sync_device, te_enabled)
from benchmarks.gpu_check_parts.registry import QWEN_1_5B, TINY_QWEN2


def _model_flops_per_token(arch, seq_len: int) -> float:
    """Matmul FLOPs per token of forward + backward (6 x weights used per token incl. the output layer, plus
    causal attention scores/values: 6 x layers x seq x heads x head_dim)."""
    h, f, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f
    return 6.0 * (layers * per_layer + arch.vocab_size * h) + 6.0 * layers * seq_len * q


def _predicted_peak_gib(rows: list[dict[str, Any]], batch: int, seq: int) -> float | None:
    """Peak memory predicted for `batch` rows of `seq` tokens from the measured 1-row shape of the same length
    (activations grow linearly in the rows at a fixed length); None when that shape was not measured."""
    one = next((r for r in rows if r["micro-batch"] == f"1x{seq}" and "activations GiB" in r), None)
    if one is None:
        return None
    return one["peak alloc GiB"] + (batch - 1) * one["activations GiB"]


def part_model_1p5b(ctx: Ctx) -> dict[str, Any]:
    import torch
    from megatron.core import tensor_parallel

    from megatron_dynamo.trainer.actor import MegatronActor, OptimConfig

    init_megatron(ctx, seed=0)
    if ctx.gpu:
        cfg, name = load_config(QWEN_1_5B), "Qwen2.5-Math-1.5B shape"
        shapes = [(1, 2048), (1, 4096), (4, 2048), (2, 4096)]
        use_te, repeats = te_enabled(), 3
    else:
        cfg, name = load_config(TINY_QWEN2), "tiny Qwen2 (--cpu)"
        shapes, use_te, repeats = [(2, 64), (1, 128)], False, 2
    spec = "transformer-engine" if use_te else "local (pure PyTorch)"
    if ctx.gpu and not use_te:
        ctx.notes.append("Transformer Engine is missing: the local spec was measured (unfused attention: long "
                         "sequences may not fit)")
    failures: list[str] = []
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
    build_s = time.perf_counter() - t0
    arch = actor.arch
    n_params = sum(p.numel() for _, p in actor.named_parameters())
    static_gib = gib(torch.cuda.memory_allocated()) if ctx.gpu else float("nan")
    device = ctx.device()

    def loss_fn(logits, mb):
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), mb["labels"]).mean()
        return loss, {"loss": loss.detach()}

    def timed(fn):
        sync_device(ctx)
        start = time.perf_counter()
        value = fn()
        sync_device(ctx)
        return time.perf_counter() - start, value

    rows = []
    for batch, seq in shapes:
        if ctx.remaining() < 60:
            rows.append({"micro-batch": f"{batch}x{seq}", "result": "not run: part time limit near"})
            continue
        gen = torch.Generator().manual_seed(seq + batch)
        ids = torch.randint(0, arch.vocab_size, (batch, seq + 1), generator=gen).to(device)
        mb = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        row: dict[str, Any] = {"micro-batch": f"{batch}x{seq}", "tokens": batch * seq}
        try:
            actor.forward_backward([mb], loss_fn)  # warm-up (kernels, optimizer state)
            actor.optimizer_step()
            if ctx.gpu:
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if ctx.gpu else 0
            fwd, fb, step, losses, norms = [], [], [], [], []
            for _ in range(repeats):
                fwd.append(timed(lambda: actor.forward_backward([mb], loss_fn, forward_only=True))[0])
                seconds, res = timed(lambda: actor.forward_backward([mb], loss_fn))
                fb.append(seconds)
                losses.append(float(res[0]["loss"]))
                seconds, result = timed(actor.optimizer_step)
                step.append(seconds)
                norms.append(result.grad_norm if result.grad_norm is not None else float("nan"))
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            t_fb, t_step = med(fb), med(step)
            row.update({"fwd s": med(fwd), "fwd+bwd s": t_fb, "opt step s": t_step,
                        "tokens/s (fwd+bwd+step)": batch * seq / (t_fb + t_step),
                        "model TFLOP/s (fwd+bwd)": _model_flops_per_token(arch, seq) * batch * seq / t_fb / 1e12,
                        "loss": losses[-1], "grad norm": norms[-1]})
            if ctx.gpu:
                row["peak alloc GiB"] = gib(torch.cuda.max_memory_allocated())
                row["activations GiB"] = gib(torch.cuda.max_memory_allocated() - before)
                row["peak reserved GiB"] = gib(torch.cuda.max_memory_reserved())
            if not all(math.isfinite(x) for x in losses + norms):
                failures.append(f"{batch}x{seq}: non-finite loss or grad norm")
        except torch.cuda.OutOfMemoryError as exc:
            row["result"] = "OOM"
            row["detail"] = str(exc).splitlines()[0][:160]
            actor.zero_grad()
            need = _predicted_peak_gib(rows, batch, seq)
            capacity = gib(torch.cuda.get_device_properties(device).total_memory)
            if need is not None and need > 0.9 * capacity:
                # Not a defect: the card is too small for this shape (e.g. the local spec's [rows, heads, S, S]
                # attention scores at 4x2048 need ~84 GiB, an H200 fits it, an 80 GiB H100 cannot).
                row["result"] = f"OOM, expected: ~{need:.0f} GiB predicted from 1x{seq}, the card has {capacity:.0f}"
            else:
                failures.append(f"{batch}x{seq}: out of memory"
                                + (f" (predicted ~{need:.0f} GiB of {capacity:.0f})" if need is not None else ""))
        except Exception as exc:  # noqa: BLE001 - the next shape still runs
            traceback.print_exc()
            row["result"] = "error"
            row["detail"] = error_line(exc)
            failures.append(f"{batch}x{seq}: {error_line(exc)}")
            actor.zero_grad()
        del ids, mb
        free_cuda(ctx)
        rows.append(row)
    del actor
    shutdown_megatron()
    ran = [r for r in rows if "fwd+bwd s" in r]
    if not ran:
        failures.append("no shape ran")
    numbers = {"model": name, "parameters (M)": n_params / 1e6, "layer spec": spec, "dtype": "bf16",
               "optimizer": optimizer,
               "build s": build_s, "weights+grads+optimizer GiB (before first step)": static_gib,
               "timing": f"median of {repeats} after 1 warm-up step"}
    best = max(ran, key=lambda r: r["tokens/s (fwd+bwd+step)"]) if ran else None
    summary = (f"{spec}: best {best['tokens/s (fwd+bwd+step)']:.0f} tokens/s at {best['micro-batch']}"
               if best else "no shape ran")
    return {"status": "fail" if failures else "pass", "summary": "; ".join([summary, *failures]),
            "numbers": numbers, "tables": {"step time and memory": rows}}
