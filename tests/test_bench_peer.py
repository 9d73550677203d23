"""The peer benchmark's bookkeeping (benchmarks/bench_peer.py, peer_tree.py), without running either trainer: the
prompts TRL gets are our sampler's, step by step; the settings it gets are the run's; the CPU window and the
start-up come from the sampled process tree as documented; a real child process's tree is sampled."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_peer  # noqa: E402
from peer_tree import RunTrace, trace_run  # noqa: E402


def test_trl_gets_our_prompts_in_our_order_and_our_settings(tmp_path):
    from megatron_dynamo.data.dataset import PromptSampler
    from megatron_dynamo.data.templates import render
    from megatron_dynamo.trainer.preflight import load_examples

    _, run = bench_peer.run_config(bench_peer.SHAPES["cpu_default"], tmp_path / "hf", steps=3)
    spec = bench_peer.peer_spec(run, tmp_path / "hf", 3, tmp_path)
    sampler = PromptSampler(load_examples(run), seed=run.data.seed)  # as trainer.Trainer builds it
    for step in (1, 2, 3):
        want = [render("synthetic", ex.problem) for ex in sampler.next_batch(32)]
        assert [p["prompt"] for p in spec["prompts"] if p["step"] == step] == want
    assert len(spec["prompts"]) == 3 * 32 and all(p["answers"] for p in spec["prompts"])
    assert (spec["group_size"], spec["micro_batch_size"], spec["micro_batches"]) == (8, 64, 4)
    assert spec["optim"] == {"lr": 1e-4, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8,
                             "weight_decay": 0.0, "clip_grad": 1.0}
    assert (spec["max_response_tokens"], spec["temperature"], spec["top_p"]) == (6, 1.0, 1.0)
    assert run.dynamo.allocation.enabled is False and run.trainer.sft_warmup_steps == 0  # --algo grpo, no warm-up


def test_large_shape_settings(tmp_path):
    _, run = bench_peer.run_config(bench_peer.SHAPES["large"], tmp_path / "hf", steps=5)
    spec = bench_peer.peer_spec(run, tmp_path / "hf", 5, tmp_path)
    assert (spec["group_size"], spec["micro_batch_size"], spec["micro_batches"]) == (8, 8, 4)
    assert spec["max_response_tokens"] == 256 and spec["optim"]["lr"] == 1e-6
    assert run.model.checkpoint == str(tmp_path / "hf") and run.model.config is None
    # ours: token budgets of TRL's 8 sequences at their longest (prompt + response), so neither side's budget is larger
    longest = run.data.max_prompt_tokens + run.rollout.max_response_tokens
    assert run.trainer.micro_batch_tokens == spec["micro_batch_size"] * longest


def _trace():
    trace = RunTrace(launched=100.0)
    # CPU seconds grow 2 per second from t = 101; PSS peaks at 7 GiB-ish once
    trace.samples = [(100.0 + t, max(0.0, 2.0 * (t - 1)), 5 + (2 if t == 3 else 0)) for t in range(12)]
    trace.step_end = {1: 104.0, 2: 105.0, 3: 106.5, 4: 108.0, 5: 109.5}
    return trace


def test_cpu_is_interpolated_between_samples():
    trace = _trace()
    assert trace.cpu_at(104.25) == pytest.approx(6.5)
    assert trace.cpu_at(50.0) == 0.0 and trace.cpu_at(500.0) == 20.0
    assert trace.peak_pss == 7


def test_summary_windows_and_medians():
    records = [{"step": s, "step_seconds": 1.0 + s / 10, "time/rollout": 0.2, "time/reward": 0.1,
                "time/train": 0.5, "time/weight_sync": 0.05, "reward_mean": 0.5, "response_length_mean": 3.0}
               for s in range(1, 6)]
    out = bench_peer.summarise(_trace(), records, "ours")
    assert out["step_s"] == pytest.approx(1.4)  # median of steps 3, 4, 5
    assert out["wall_per_step_s"] == pytest.approx((109.5 - 105.0) / 3)
    assert out["cpu_per_step_s"] == pytest.approx(2.0 * (109.5 - 105.0) / 3)
    assert out["startup_s"] == pytest.approx(104.0 - 1.1 - 100.0)
    assert out["parts"]["old_logprob"] == 0.0 and out["parts"]["update"] == 0.5
    assert out["parts"]["other"] == pytest.approx(1.4 - 0.85)
    peer = [{**{k: v for k, v in r.items() if not k.startswith("time/")}, "time/generation": 0.3,
             "time/reward": 0.1, "time/update": 0.6, "time/score_other": 0.02, "prompts_match": True}
            for r in records]
    out = bench_peer.summarise(_trace(), peer, "trl")
    assert out["parts"]["generation"] == 0.3 and out["parts"]["other"] == 0.02 and out["prompts_match"]
    text = bench_peer.table("t", [(bench_peer.summarise(_trace(), records, "ours"), out)])
    assert "| step (median from step 3), s | 1.400 | 1.400 | 1.00x |" in text
    assert "|   weight_sync, s | 0.050 | 0.000 | - |" in text
    assert "start-up phases" not in text  # the records hold none


def test_table_names_the_machine_and_each_sides_start_up_phases():
    import torch

    def records(startup):
        return [{"step": s, "step_seconds": 1.0, "reward_mean": 0.5, "response_length_mean": 3.0, "prompts_match": True,
                 **(startup if s == 1 else {})} for s in range(1, 6)]

    pairs = [(bench_peer.summarise(_trace(), records({"startup/launch": launch, "startup/engine": 3.0,
                                                      "startup/total": launch + 4.0}), "ours"),
              bench_peer.summarise(_trace(), records({"startup/imports": 2.0, "startup/total": 2.5}), "trl"))
             for launch in (1.0, 2.0, 4.0)]
    machine = bench_peer.machine_info()
    assert machine["torch"] == torch.__version__ and machine["cpu_model"] and machine["cpus"] >= 1
    text = bench_peer.table("t", pairs, machine)
    assert text.splitlines()[2] == bench_peer.machine_line(machine)
    assert f"{machine['cpu_model']}, {machine['cpus_usable']} of {machine['cpus']} cores" in text
    assert ("start-up phases, s (median over pairs): ours launch 2.0 + engine 3.0 (total 6.0); "
            "TRL imports 2.0 (total 2.5)") in text


def test_a_child_tree_is_sampled(tmp_path):
    """A real command with a child process: its steps' ends are seen, its tree's CPU and PSS are counted."""
    log = tmp_path / "steps.jsonl"
    script = (f"import subprocess, sys, time, json\n"
              f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(2)'])\n"
              f"for step in range(1, 4):\n"
              f"    end = time.process_time() + 0.2\n"
              f"    while time.process_time() < end: pass\n"
              f"    open({str(log)!r}, 'a').write(json.dumps({{'step': step}}) + '\\n')\n"
              f"child.wait()\n")
    trace = trace_run([sys.executable, "-c", script], tmp_path, log, tmp_path / "console.log", interval=0.05)
    assert sorted(trace.step_end) == [1, 2, 3]
    assert trace.step_end[1] < trace.step_end[2] < trace.step_end[3]
    assert trace.samples[-1][1] >= 0.6  # at least the busy loops' CPU seconds
    assert trace.peak_pss > 2 * 2**20  # two Python processes
    json.dumps(trace.as_json())
    with pytest.raises(RuntimeError, match="exited with 3"):
        trace_run([sys.executable, "-c", "raise SystemExit(3)"], tmp_path, log, tmp_path / "c.log")
