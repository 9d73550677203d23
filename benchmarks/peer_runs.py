"""Running either side of the peer benchmark (``benchmarks/bench_peer.py``, ``benchmarks/peer_sweep.py``): the
exported start model, our ``dynamo train --algo grpo`` run and TRL's (``peer_trl.py``) on the same model, prompts
and settings, each run's process tree followed by ``peer_tree.trace_run`` and summed up by
``peer_report.summarise``.

A setup is a dict: ``recipe`` (the YAML), ``overrides`` (of the recipe for the model and its export: the model
config, the warm-up), ``rl`` (the RL run's overrides) and ``steps``. Placements of ours: ``colocated`` (the
recipe's one rank) and ``overlapped``: ``--nproc 2`` with ``OVERLAPPED`` (rank 0 trains, rank 1 generates and
scores one step ahead, docs/rollout.md "Separate engine ranks", as configs/cpu_overlap.yaml runs it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from peer_report import summarise  # benchmarks/ (on sys.path wherever this is imported)
from peer_tree import trace_run

from megatron_dynamo.data.dataset import PromptSampler
from megatron_dynamo.data.templates import render
from megatron_dynamo.trainer.config import load_run_config
from megatron_dynamo.trainer.preflight import load_examples

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["logging.tensorboard=false", "logging.plot=false", "logging.progress=false"]
# The engine on a rank of its own, generating one step ahead; the behaviour policy's staleness corrected token by
# token (AReaL's decoupled objective, as configs/cpu_overlap.yaml)
OVERLAPPED = ["rollout.placement=separate", "rollout.engine_ranks=1", "rollout.max_staleness=1",
              "dynamo.loss.engine_is=truncate", "dynamo.loss.engine_is_cap=2.0"]
NPROC = {"colocated": [], "overlapped": ["--nproc", "2"]}


def dynamo_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_dynamo.cli", "train", *args]


def export_model(setup: dict, work: Path) -> Path:
    """The setup's start model (its supervised warm-up, or random weights with ``trainer.sft_warmup_steps=0``)
    exported to HF (``<work>/warm/hf``); reused when it is there."""
    hf = work / "warm" / "hf"
    if (hf / "config.json").is_file():
        return hf
    shutil.rmtree(work / "warm", ignore_errors=True)  # an export that did not finish: start it again
    cmd = dynamo_command(setup["recipe"], *setup["overrides"], "trainer.steps=0", "checkpoint.export_hf=true",
                         f"trainer.output_dir={work / 'warm'}", *QUIET)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return hf


def run_config(setup: dict, hf: Path, steps: int, placement: str = "colocated"):
    """Our RL run's overrides and config (the recipe, the setup's RL overrides, the exported model)."""
    overrides = [o for o in setup["overrides"] if not o.startswith("model.config=")] + setup["rl"] + [
        f"model.checkpoint={hf}", f"model.tokenizer={hf}", "model.config=null", "trainer.sft_warmup_steps=0",
        f"trainer.steps={steps}", "checkpoint.every=1000000", *QUIET]
    if placement == "overlapped":
        overrides += OVERLAPPED
    return overrides, load_run_config(str(ROOT / setup["recipe"]), overrides, algo="grpo")


def peer_spec(run, hf: Path, steps: int, out: Path) -> dict:
    """What peer_trl.py needs: the same model, prompts (our sampler's order, step by step) and settings."""
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
            "max_response_tokens": run.rollout.max_response_tokens,
            "min_response_tokens": run.rollout.min_response_tokens, "temperature": run.rollout.temperature,
            "top_p": run.rollout.top_p, "clip_low": run.dynamo.loss.clip_low, "clip_high": run.dynamo.loss.clip_high,
            "optim": {k: getattr(optim, k) for k in ("lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay",
                                                     "clip_grad")},
            # TRL's GRPOConfig checkpoints every layer by default: it does so exactly when ours reruns every layer
            "gradient_checkpointing": run.trainer.recompute == "full",
            "output_dir": str(out / "trl_out"), "step_log": str(out / "steps.jsonl")}


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_ours(setup: dict, hf: Path, steps: int, out: Path, interval: float,
             placement: str = "colocated", pss_interval: float = 1.0) -> tuple[dict, dict]:
    """Our run in ``out``: its summary and its trace (JSON)."""
    overrides, _ = run_config(setup, hf, steps, placement)
    cmd = dynamo_command(setup["recipe"], *overrides, f"trainer.output_dir={out}", "--algo", "grpo",
                         *NPROC[placement])
    trace = trace_run(cmd, ROOT, out / "metrics.jsonl", out / "console.log", interval, pss_interval)
    summary = summarise(trace, read_records(out / "metrics.jsonl"), "ours")
    summary["placement"] = placement
    return summary, trace.as_json()


def run_trl(spec: dict, out: Path, interval: float, pss_interval: float = 1.0) -> tuple[dict, dict]:
    """TRL's run of ``spec`` in ``out``: its summary and its trace (JSON)."""
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peer_trl.py"), str(spec_path)]
    trace = trace_run(cmd, ROOT, Path(spec["step_log"]), out / "console.log", interval, pss_interval)
    return summarise(trace, read_records(Path(spec["step_log"])), "trl"), trace.as_json()
