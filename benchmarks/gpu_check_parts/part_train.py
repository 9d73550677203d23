"""Parts ``train_tiny`` and ``train_1p5b``: ``dynamo train`` end to end on one GPU."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from typing import Any

from benchmarks.gpu_check_parts.common import Ctx, child_env, run_streaming, small_qwen2
from benchmarks.gpu_check_parts.registry import QWEN_1_5B, REPO, log


def _train(ctx: Ctx, label: str, overrides: list[str], steps: int) -> dict[str, Any]:
    out_dir = ctx.work / label
    if out_dir.exists():
        shutil.rmtree(out_dir)
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", "configs/cpu_default.yaml", *overrides,
           f"trainer.steps={steps}", f"trainer.output_dir={out_dir}", "--nproc", "1"]
    log("command:", " ".join(cmd))
    t0 = time.perf_counter()
    rc, lines = run_streaming(cmd, ctx.remaining() - 15, env=child_env())
    wall = time.perf_counter() - t0
    numbers: dict[str, Any] = {"command": "dynamo train " + " ".join(cmd[4:]).replace(str(ctx.work), "$WORK"),
                               "exit code": rc if rc is not None else "killed (time limit)", "wall s": wall}
    failures = [] if rc == 0 else [f"exit code {rc}" if rc is not None else "killed at the part's time limit"]
    rows = []
    metrics_path = out_dir / "metrics.jsonl"
    records = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()] if metrics_path.exists() else []
    for rec in records:
        row = {"step": rec.get("step")}
        for key in ("step_seconds", "time/rollout", "time/reward", "time/old_logprob", "time/train",
                    "time/weight_sync", "rollouts", "response_length_mean", "reward_mean", "loss", "grad_norm",
                    "optimizer_steps", "weight_sync/bytes"):
            if key in rec:
                row[key] = rec[key]
        if rec.get("weight_sync/bytes") and rec.get("weight_sync/seconds"):
            row["sync GB/s"] = rec["weight_sync/bytes"] / 1e9 / rec["weight_sync/seconds"]
        if rec.get("skipped"):
            row["skipped"] = rec["skipped"]
        rows.append(row)
    if rc == 0:
        if len(records) != steps:
            failures.append(f"metrics.jsonl has {len(records)} records, expected {steps}")
        for rec in records:
            if not (rec.get("rollouts", 0) > 0 and rec.get("weight_sync/bytes", 0) > 0):
                failures.append(f"step {rec.get('step')}: no rollouts or no weight sync recorded")
            if not math.isfinite(float(rec.get("reward_mean", float("nan")))):
                failures.append(f"step {rec.get('step')}: reward_mean not finite")
            if rec.get("skipped"):
                ctx.notes.append(f"step {rec.get('step')} skipped an update: {rec['skipped']}")
        if records and not any(float(rec.get("grad_norm") or 0) > 0 for rec in records):
            ctx.notes.append("every grad norm was 0: no prompt had mixed rewards, so every advantage was 0 (the "
                             "update ran, on zero gradients)")
        checkpoints = sorted((out_dir / "checkpoints").glob("step_*"))
        numbers["checkpoints"] = ", ".join(p.name for p in checkpoints) or "none"
        if not checkpoints:
            failures.append("no checkpoint written")
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)  # a 1.5B checkpoint is ~20 GB
    result = {"status": "fail" if failures else "pass", "numbers": numbers, "tables": {"metrics.jsonl": rows},
              "summary": "; ".join(failures) or (f"{len(records)} steps, "
                                                 f"{sum(r.get('step_seconds', 0) for r in records) / max(1, len(records)):.1f} s/step, "
                                                 f"wall {wall:.0f} s")}
    if failures:
        result["tail"] = [x for x in lines if x.strip()][-40:]
    return result


def part_train_tiny(ctx: Ctx) -> dict[str, Any]:
    if ctx.gpu:
        # The recipe's SFT warm-up (110 tiny steps) stays: without it every reward is 0, every advantage 0, and the
        # update would run on zero gradients.
        overrides = ["model.dtype=bf16", "checkpoint.every=2", "rollout.tensor_parallel=1",
                     "rollout.gpu_memory_utilization=0.3"]
        steps = 3
        ctx.notes.append("not covered on one GPU: TP/PP/DP > 1 and sequence parallelism (need 2+ GPUs), vLLM TP=2")
    else:
        overrides = ["trainer.sft_warmup_steps=2", "data.prompts_per_step=8", "trainer.mini_batch_prompts=8",
                     "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2", "dynamo.allocation.n_max=6",
                     "checkpoint.every=1", "logging.plot=false"]
        steps = 2
    return _train(ctx, "train_tiny", overrides, steps)


def part_train_1p5b(ctx: Ctx) -> dict[str, Any]:
    common = ["model.tokenizer=char", "trainer.sft_warmup_steps=0", "data.prompts_per_step=8",
              "trainer.mini_batch_prompts=8", "dynamo.allocation.n_avg=4", "dynamo.allocation.n_min=2",
              "dynamo.allocation.n_max=8", "checkpoint.every=1000", "optim.lr=1.0e-6", "logging.plot=false"]
    if ctx.gpu:
        overrides = [f"model.config={QWEN_1_5B.relative_to(REPO)}", "model.dtype=bf16", "trainer.micro_batch_size=16",
                     "rollout.max_response_tokens=128", "rollout.tensor_parallel=1",
                     "rollout.gpu_memory_utilization=0.35", *common]
    else:  # a model whose vocabulary is larger than the tokenizer's, like the 1.5B shape with the char tokenizer
        small = ctx.work / "small-qwen2.json"
        small.parent.mkdir(parents=True, exist_ok=True)
        small.write_text(json.dumps(small_qwen2(vocab=1024)))
        overrides = [f"model.config={small}", "trainer.micro_batch_size=16", "rollout.max_response_tokens=8",
                     *common]
    return _train(ctx, "train_1p5b", overrides, 2)
