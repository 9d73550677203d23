"""Part ``vllm``: the official vLLM on CUDA fed by Megatron: per-prompt counts, weight sync, generation
throughput, trainer-vs-vLLM log-prob gap (bf16, fp32)."""

from __future__ import annotations

import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_parts.common import (Ctx, error_line, free_cuda, init_megatron, load_config, make_prompts,
                                               sharpen, shutdown_megatron, small_qwen2, te_enabled, write_model_dir)
from benchmarks.gpu_check_parts.registry import QWEN_1_5B
from benchmarks.gpu_check_parts.report import transpose_rows


def _trainer_logprobs(actor, responses, device, micro_batch_size: int = 8) -> dict[int, Any]:
    """The trainer's log-probs of each response's tokens (the trainer's own path: micro-batches, the pipeline
    schedule, vocab-parallel token stats), keyed by position in ``responses``."""
    from megatron_dynamo.trainer.batch import Sample, gather_token_values, make_micro_batches
    from megatron_dynamo.trainer.policy_loss import token_stats_fn

    samples = [Sample(i, r.prompt_id, tuple(r.prompt_token_ids), tuple(r.token_ids), 0.0, 0.0)
               for i, r in enumerate(responses) if r.token_ids]
    micro = make_micro_batches(samples, micro_batch_size, 0, fixed_shape=False)
    micro = [mb.to(device) for mb in micro]
    results = actor.forward_backward(micro, token_stats_fn(1.0), forward_only=True)
    out: dict[int, Any] = {}
    for mb, res in zip(micro, results):
        out.update(gather_token_values(mb, res["logp"]))
    return out


def _logprob_gap(actor, responses, device) -> dict[str, float]:
    import torch

    trainer = _trainer_logprobs(actor, responses, device)
    diffs, seq_diffs, vllm_all = [], [], []
    for i, r in enumerate(responses):
        if not r.token_ids:
            continue
        t = trainer[i].detach().double().cpu()  # on the model's device
        v = torch.tensor(r.logprobs, dtype=torch.float64)
        if t.shape != v.shape:
            raise RuntimeError(f"response {i}: {t.numel()} trainer log-probs vs {v.numel()} from vLLM")
        diffs.append((t - v).abs())
        seq_diffs.append(abs(float(t.sum() - v.sum())))
        vllm_all.append(v)
    d = torch.cat(diffs)
    v = torch.cat(vllm_all)
    return {"tokens": int(d.numel()), "max abs": float(d.max()), "mean abs": float(d.mean()),
            "p99 abs": float(torch.quantile(d.float(), 0.99)), "frac > 0.1": float((d > 0.1).double().mean()),
            "max |seq sum diff|": max(seq_diffs), "mean vLLM logp": float(v.mean())}


def start_engine(model_dir: Path, dtype: str, max_len: int, ctx: Ctx, **kwargs):
    from megatron_dynamo.rollout import VLLMEngine

    kwargs.setdefault("enable_sleep_mode", False)
    return VLLMEngine(str(model_dir), tensor_parallel=1, dtype="bfloat16" if dtype == "bf16" else "float32",
                      max_model_len=max_len, seed=0, gpu_memory_utilization=kwargs.pop("gpu_memory_utilization", 0.3),
                      engine_kwargs={"load_format": "dummy"}, **kwargs)


def _check_counts(requests, responses) -> list[str]:
    """Each prompt got exactly its count, samples 0..n-1, its own prompt tokens, one log-prob per token."""
    problems = []
    got = Counter(r.prompt_id for r in responses)
    for req in requests:
        if got.get(req.prompt_id, 0) != req.count:
            problems.append(f"{req.prompt_id}: {got.get(req.prompt_id, 0)} responses, asked {req.count}")
        mine = [r for r in responses if r.prompt_id == req.prompt_id]
        if sorted(r.sample_index for r in mine) != list(range(req.count)):
            problems.append(f"{req.prompt_id}: sample indices {sorted(r.sample_index for r in mine)}")
        if any(r.prompt_token_ids != req.prompt_token_ids for r in mine):
            problems.append(f"{req.prompt_id}: a response carries other prompt tokens")
        if any(r.logprobs is None or len(r.logprobs) != len(r.token_ids) for r in mine):
            problems.append(f"{req.prompt_id}: log-probs missing or of the wrong length")
    return problems


def _vllm_round(ctx: Ctx, cfg: dict[str, Any], dtype: str, eager: bool | None, row: dict[str, Any],
                problems: list[str]) -> None:
    """One engine in one dtype; fills ``row`` as it goes (so an error keeps what was measured before it)."""
    import torch

    from megatron_dynamo.rollout import GenerationRequest, SamplingConfig, sync_weights
    from megatron_dynamo.trainer.actor import MegatronActor

    weight_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if not torch.distributed.is_initialized():  # the previous round's engine ended the group (vLLM's shutdown)
        init_megatron(ctx, seed=0, placement=False)
    actor = engine = None
    try:
        actor = MegatronActor(cfg, dtype=dtype, optim=None, use_te=te_enabled() if ctx.gpu else False)
        sharpen(actor, actor.arch)
        model_dir = write_model_dir(cfg, ctx.work / f"model_{dtype}", dtype)
        max_tokens = 48 if ctx.gpu else 12
        engine = start_engine(model_dir, dtype, 96 + 256 if ctx.gpu else 96 + 32, ctx, enforce_eager=eager)
        row["engine start s"] = engine.startup_seconds
        stats = [sync_weights(engine, actor, dtype=weight_dtype) for _ in range(2)]
        row["sync GB"] = stats[-1].bytes / 1e9
        row["sync first s"] = stats[0].seconds
        row["sync s"] = min(s.seconds for s in stats)
        row["sync GB/s"] = stats[-1].bytes / 1e9 / row["sync s"]
        row["sync path"] = "in process (layer-wise reload), no host copy"
        if ctx.gpu and dtype == "bf16":
            row["sync goal >= 10 GB/s met"] = row["sync GB/s"] >= 10

        prompts = make_prompts(8)
        counts = [1, 3, 0, 5, 2, 8, 4, 1]
        requests = [GenerationRequest(pid, toks, n) for (pid, toks), n in zip(prompts, counts)]
        sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=1234,
                                  stop_token_ids=(0,), logprobs=True, detokenize=False)
        responses = engine.generate(requests, sampling, step=1)
        problems += _check_counts(requests, responses)
        row["counts asked"] = " ".join(map(str, counts))
        row["counts ok"] = not problems
        again = engine.generate(requests, sampling, step=1)
        row["seeded repeat identical"] = [r.token_ids for r in again] == [r.token_ids for r in responses]
        alone = engine.generate([requests[5]], sampling, step=1)
        row["prompt alone identical"] = ([r.token_ids for r in alone]
                                         == [r.token_ids for r in responses if r.prompt_id == requests[5].prompt_id])

        gap = _logprob_gap(actor, responses, ctx.device())
        row.update({f"logp gap {k}": v for k, v in gap.items()})

        if ctx.remaining() > 90:
            many = make_prompts(64 if ctx.gpu else 8, seed=1)
            n = [4 + (7 * i) % 9 for i in range(len(many))]  # uneven counts 4..12, like DynaMO's allocation
            big = [GenerationRequest(pid, toks, c) for (pid, toks), c in zip(many, n)]
            tokens = 256 if ctx.gpu else 16
            fixed = SamplingConfig(temperature=1.0, max_tokens=tokens, seed=7, ignore_eos=True, logprobs=True,
                                   detokenize=False)
            engine.generate(big[:4], fixed, step=0)  # warm-up
            t0 = time.perf_counter()
            out = engine.generate(big, fixed, step=2)
            seconds = time.perf_counter() - t0
            problems += _check_counts(big, out)
            row["throughput batch"] = f"{len(big)} prompts, {len(out)} seqs x {tokens} tokens"
            row["generated tokens/s"] = sum(r.num_tokens for r in out) / seconds
    finally:
        if engine is not None:
            engine.close()
        del actor, engine
        free_cuda(ctx)


def part_vllm(ctx: Ctx) -> dict[str, Any]:
    init_megatron(ctx, seed=0)
    if ctx.gpu:
        cfg, name = load_config(QWEN_1_5B), "Qwen2.5-Math-1.5B shape"
        rounds = [("bf16", None), ("fp32", True)]  # bf16: the production engine (CUDA graphs); fp32: eager
    else:
        cfg, name = small_qwen2(vocab=1024), "small Qwen2, vocab 1024 (--cpu)"
        rounds = [("fp32", True)]
    limits = {"bf16": (1.5, 0.05), "fp32": (0.1, 5e-3)}  # (max abs, mean abs) nats
    rows, failures = [], []
    for dtype, eager in rounds:
        if ctx.remaining() < 150:
            failures.append(f"{dtype}: not run (part time limit near)")
            continue
        row: dict[str, Any] = {"dtype": dtype}
        problems: list[str] = []
        rows.append(row)
        try:
            _vllm_round(ctx, cfg, dtype, eager, row, problems)
        except Exception as exc:  # noqa: BLE001 - the other dtype still runs
            traceback.print_exc()
            problems.append(error_line(exc))
        failures += [f"{dtype}: {p}" for p in problems]
        max_lim, mean_lim = limits[dtype]
        if "logp gap max abs" not in row:
            continue
        if not (row["logp gap max abs"] <= max_lim and row["logp gap mean abs"] <= mean_lim):
            failures.append(f"{dtype}: log-prob gap max {row['logp gap max abs']:.3g} / mean "
                            f"{row['logp gap mean abs']:.3g} over the limits {max_lim} / {mean_lim}")
    shutdown_megatron()
    numbers = {"model": name + ", random init, final norm scaled for peaked distributions",
               "vLLM": "TP=1, gpu_memory_utilization 0.3, load_format dummy, weights pushed from Megatron",
               "log-prob gap": "|trainer log pi - vLLM processed log-prob| per sampled token, temperature 1",
               "limits (max, mean abs)": "; ".join(f"{k}: {a}, {b}" for k, (a, b) in limits.items())}
    summary = "; ".join(f"{r['dtype']}: sync {r['sync GB/s']:.2f} GB/s, gap max {r['logp gap max abs']:.3g} "
                        f"mean {r['logp gap mean abs']:.3g}" for r in rows if "logp gap max abs" in r)
    return {"status": "fail" if failures else "pass", "summary": "; ".join([summary, *failures]),
            "numbers": numbers, "tables": {"vLLM rounds": transpose_rows(rows, "dtype")}}
