"""The GPU check: every GPU path of the project, part by part, with numbers. ``scripts/gpu_check.sh`` is the entry
(it installs what it can, runs each part in its own process under its own time limit, and writes the report);
this module is the driver (its CLI below); the parts, their registry, the environment probe and the report
live in ``benchmarks/gpu_check_parts/``, one module each.

    python benchmarks/gpu_check.py list                         the parts, their time limits and needs
    python benchmarks/gpu_check.py install --wheels .whl --target /tmp/gpu_check_site [--pip]
    python benchmarks/gpu_check.py env --json ENV.json [--commit HASH]
    python benchmarks/gpu_check.py run PART --env ENV.json --result PART.json [--work DIR] [--timeout S] [--cpu]
    python benchmarks/gpu_check.py report --work DIR --parts "a b" --command CMD --out-dir DIR [--append FILE]

Parts (each a function ``part_<name>(ctx) -> dict`` in ``gpu_check_parts/part_<name>.py``; one process each):

- ``tests``: ``pytest tests/test_gpu.py`` (Transformer-Engine spec, bf16 local spec, GPU weight export, token stats).
- ``te_parity``: TE layer spec vs local spec with the same HF weights on a small Qwen2: logits and the gradients of
  one backward (by HF name), fp32 and bf16.
- ``model_1p5b``: the Qwen2.5-Math-1.5B shape, random weights, bf16 (TE spec when TE imports, else the local spec),
  the recipe's distributed optimizer: forward, forward+backward and optimizer-step times, tokens/s, peak memory,
  at several (sequences x tokens) micro-batches.
- ``moe``: a random-weight Qwen3-MoE shape (Qwen3-30B-A3B's layer: 128 experts, top-8; as many of its layers as one
  GPU holds with the optimizer), bf16, expert parallel 1: the same times, tokens/s and peak memory.
- ``vllm``: the official vLLM on CUDA fed by Megatron: per-prompt sample counts (each prompt gets exactly its count),
  weight sync (s, GB/s), generation throughput, and the log-prob gap between the trainer's forward and vLLM on the
  same sampled tokens, in bf16 and fp32.
- ``train_tiny`` / ``train_1p5b``: ``dynamo train`` end to end on one GPU (``--nproc 1``): the CPU default recipe on
  the GPU, and the 1.5B shape (random init, a few prompts, short responses) for 2 steps; exit code and metrics.jsonl.
- ``sleep_wake``: GPU memory with vLLM awake, asleep (levels 1 and 2), woken, with the Megatron model (and its
  optimizer state) resident; outputs after wake-up compared with those before sleep.
- ``update``: ``benchmarks/bench_update.py`` on the GPU: the trainer's RL update (old-log-prob pass, DynaMO loss,
  optimizer steps) at the 1.5B shape (hidden 1536, vocab 151936; all 28 layers with Transformer Engine, 4 without),
  16k response tokens of a DRA-like length mix: peak memory of the fused output layer vs the unfused one, tokens/s
  of dynamic and packed micro-batches vs padded ones.

Without CUDA every part reports "skipped: no CUDA". ``--cpu`` (developers only; never appended to the changelog)
runs the parts that can run on a CPU with tiny shapes, to check this file's own code paths without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_check_parts.common import Ctx, child_env, error_line  # noqa: E402
from benchmarks.gpu_check_parts.environment import collect_env, env_line, install, skip_reason  # noqa: E402
from benchmarks.gpu_check_parts.part_model_1p5b import part_model_1p5b  # noqa: E402
from benchmarks.gpu_check_parts.part_moe import part_moe  # noqa: E402
from benchmarks.gpu_check_parts.part_sleep_wake import part_sleep_wake  # noqa: E402
from benchmarks.gpu_check_parts.part_te_parity import part_te_parity  # noqa: E402
from benchmarks.gpu_check_parts.part_tests import part_tests  # noqa: E402
from benchmarks.gpu_check_parts.part_train import part_train_1p5b, part_train_tiny  # noqa: E402
from benchmarks.gpu_check_parts.part_update import part_update  # noqa: E402
from benchmarks.gpu_check_parts.part_vllm import part_vllm  # noqa: E402
from benchmarks.gpu_check_parts.registry import EXIT_NOT_RUN, NOT_RUN, PARTS, log  # noqa: E402
from benchmarks.gpu_check_parts.report import append_report, load_results, render_report  # noqa: E402


PART_FUNCTIONS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "tests": part_tests, "te_parity": part_te_parity, "model_1p5b": part_model_1p5b, "moe": part_moe,
    "vllm": part_vllm,
    "train_tiny": part_train_tiny, "train_1p5b": part_train_1p5b, "sleep_wake": part_sleep_wake,
    "update": part_update,
}
assert set(PART_FUNCTIONS) == set(PARTS)


def run_part(name: str, env: dict[str, Any], work: Path, timeout_s: float, cpu: bool) -> dict[str, Any]:
    part = PARTS[name]
    start = time.monotonic()
    result: dict[str, Any] = {"part": name}
    reason = skip_reason(part, env, cpu)
    if reason:
        result.update(status="skip", summary=f"skipped: {reason}")
        return result
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]  # vLLM's worker processes import this repo
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(cpu=cpu, work=work, deadline=start + timeout_s - 10)
    try:
        with ctx.stack:
            result.update(PART_FUNCTIONS[name](ctx))
    except BaseException as exc:  # noqa: BLE001 - a part's failure is a result
        tb = traceback.format_exc()
        print(tb, flush=True)
        result.update(status="fail", summary=error_line(exc), tail=tb.strip().splitlines()[-25:])
    if ctx.notes:
        result["notes"] = ctx.notes
    result["seconds"] = time.monotonic() - start
    return result


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="the parts")
    p.add_argument("--tsv", action="store_true", help="name<TAB>timeout per line (for the shell)")
    p.add_argument("--validate", nargs="*", help="exit 2 unless every name given is a part")
    p = sub.add_parser("install")
    p.add_argument("--wheels", type=Path)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--pip", action="store_true")
    p = sub.add_parser("env")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--commit")
    p = sub.add_parser("run")
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--env", type=Path, required=True)
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--work", type=Path)
    p.add_argument("--timeout", type=float)
    p.add_argument("--cpu", action="store_true")
    p = sub.add_parser("report")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--parts", required=True, help="space-separated part names, in order")
    p.add_argument("--command", required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--append", type=Path, help="append the report to this file (only when CUDA ran, never --cpu)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--strict", action="store_true", help="a part skipped for a missing package counts as failed")
    args = parser.parse_args(argv)

    if args.cmd == "list":
        if args.validate is not None:
            bad = [n for n in args.validate if n not in PARTS]
            if bad:
                print(f"unknown part(s): {', '.join(bad)}; parts: {', '.join(PARTS)}", file=sys.stderr)
                return 2
            return 0
        for part in PARTS.values():
            if args.tsv:
                print(f"{part.name}\t{part.timeout_s}")
            else:
                print(f"{part.name:<12} {part.timeout_s:>4} s  needs {'+'.join(part.needs):<45} {part.summary}")
        return 0
    if args.cmd == "install":
        return install(args.wheels, args.target, args.pip)
    if args.cmd == "env":
        env = collect_env(args.commit)
        args.json.write_text(json.dumps(env, indent=2))
        log(f"commit {env.get('commit')}; GPU {env.get('gpu', 'none')}; {env_line(env)}")
        for need, reason in env.get("have", {}).items():
            if reason:
                log(f"not available: {need}: {reason}")
        return 0
    if args.cmd == "run":
        env = json.loads(args.env.read_text())
        part = PARTS[args.part]
        work = args.work or args.result.parent / args.part
        result = run_part(args.part, env, work, args.timeout or part.timeout_s, args.cpu)
        args.result.write_text(json.dumps(result, indent=2, default=str))
        log(f"{args.part}: {result['status']}: {result.get('summary', '')}")
        return 1 if result["status"] == "fail" else 0
    # report
    env_path = args.work / "env.json"
    env = json.loads(env_path.read_text()) if env_path.exists() else {"commit": "?", "have": {}}
    names = args.parts.split()
    results = load_results(args.work, names)
    if args.strict:
        for r in results:
            if r["status"] == "skip" and "missing" in r.get("summary", ""):
                r["status"] = "fail"
    report = render_report(env, results, args.command, args.cpu)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu_check_report.md").write_text(report)
    (args.out_dir / "gpu_check.json").write_text(json.dumps({"env": env, "command": args.command, "results": results},
                                                            indent=2, default=str))
    print("\n" + report, flush=True)
    ran = any(r["status"] not in ("skip", NOT_RUN) for r in results)
    if args.append is not None:
        if args.cpu or not env.get("cuda") or not ran:
            log(f"not appended to {args.append}: " + ("--cpu mode" if args.cpu else "no CUDA" if not env.get("cuda")
                                                       else "every part was skipped"))
        else:
            append_report(report, args.append)
            log(f"appended to {args.append}")
    log(f"report: {args.out_dir / 'gpu_check_report.md'}")
    return report_status(results)


def report_status(results: list[dict[str, Any]]) -> int:
    """1 when a part failed, else EXIT_NOT_RUN when a part did not run (budget spent), else 0."""
    if any(r["status"] == "fail" for r in results):
        return 1
    return EXIT_NOT_RUN if any(r["status"] == NOT_RUN for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
