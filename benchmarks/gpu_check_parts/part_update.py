"""Part ``update``: ``benchmarks/bench_update.py`` on the GPU (the trainer's RL update at the 1.5B shape)."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from benchmarks.gpu_check_parts.common import Ctx, child_env, run_streaming, te_enabled
from benchmarks.gpu_check_parts.registry import QWEN_1_5B, REPO


def part_update(ctx: Ctx) -> dict[str, Any]:
    """benchmarks/bench_update.py in a child process (it runs every variant in a fresh process of its own)."""
    out = ctx.work / "bench_update.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if ctx.gpu:
        te = te_enabled()
        shape = ["--model", str(QWEN_1_5B.relative_to(REPO)), "--layers", "28" if te else "4", "--tokens", "16384",
                 "--responses", "32", "--max-response", "4096", "--micro-batch-size", "4",
                 "--micro-batch-tokens", "16384" if te else "8192", "--device", "cuda", "--dtype", "bf16",
                 "--repeats", "3"]
        if not te:
            ctx.notes.append("Transformer Engine is missing: 4 layers of the 1.5B shape on the local spec (its "
                             "unfused attention holds [rows, heads, S, S] scores), micro_batch_tokens 8192")
    else:
        shape = ["--hidden", "64", "--layers", "1", "--vocab", "4096", "--tokens", "1024", "--responses", "12",
                 "--max-response", "256", "--micro-batch-size", "4", "--micro-batch-tokens", "512", "--device",
                 "cpu", "--threads", "1", "--repeats", "1"]
    per_variant = max(60.0, (ctx.remaining() - 30) / 4)
    cmd = [sys.executable, "benchmarks/bench_update.py", *shape, "--timeout", f"{per_variant:.0f}", "--json", str(out)]
    rc, lines = run_streaming(cmd, ctx.remaining() - 10, env=child_env())
    if not out.exists():
        return {"status": "fail", "summary": f"bench_update wrote no result (exit {rc})", "tail": lines[-40:]}
    data = json.loads(out.read_text())
    results, same_as = data["results"], data.get("same_as", {})

    def res(variant):
        return results.get(same_as.get(variant, variant), {})

    failures = [f"{v}: {r['error']}" for v, r in results.items() if "error" in r and v != "unfused"]
    if "error" in results.get("unfused", {}) and results["unfused"]["error"] != "OOM":
        failures.append(f"unfused: {results['unfused']['error']}")
    parts = []
    fused, unfused = res("fused"), res("unfused")
    if "peak_extra" in fused and "peak_extra" in unfused:
        unit = 2**30
        parts.append(f"peak extra fused {fused['peak_extra'] / unit:.2f} GiB vs unfused {unfused['peak_extra'] / unit:.2f} "
                     f"GiB ({fused['peak_extra'] / max(1, unfused['peak_extra']):.2f}x)")
        if ctx.gpu and not fused["peak_extra"] < unfused["peak_extra"]:
            failures.append("the fused output layer did not lower the peak memory")
    elif unfused.get("error") == "OOM":
        parts.append("unfused: out of memory; fused ran" if "peak_extra" in fused else "unfused: out of memory")
    padded = res("padded")
    for v in ("dynamic", "packed"):
        r = res(v)
        if "seconds" in r and "seconds" in padded:
            parts.append(f"{v} {padded['seconds'] / r['seconds']:.2f}x padded tokens/s")
    numbers = {**data["settings"], "exit_code": rc if rc is not None else "killed (time limit)"}
    out_rows = [{k: (v if not isinstance(v, float) or math.isfinite(v) else "nan") for k, v in row.items()}
                for row in data["rows"]]
    result = {"status": "fail" if failures or rc is None else "pass",
              "summary": "; ".join(parts + failures) or "no variant ran",
              "numbers": numbers, "tables": {"update: memory and speed by variant": out_rows}}
    if failures:
        result["tail"] = lines[-30:]
    return result
