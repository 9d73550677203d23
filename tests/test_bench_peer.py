"""The peer benchmark's bookkeeping (benchmarks/bench_peer.py, peer_runs.py, peer_report.py, peer_sweep.py,
peer_plot.py, peer_tree.py), without running either trainer: the prompts TRL gets are our sampler's, step by step;
the settings it gets are the run's; the CPU window and the start-up come from the sampled process tree as
documented; an overlapped run's parts are the trainer rank's; a real child process's tree is sampled; the sweep's
points, order, budget, skips, length check, table and plot; ``rollout.min_response_tokens``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_peer  # noqa: E402
import peer_plot  # noqa: E402
import peer_report  # noqa: E402
import peer_runs  # noqa: E402
import peer_sweep  # noqa: E402
import peer_tree  # noqa: E402
from peer_tree import RunTrace, trace_run  # noqa: E402


def test_trl_gets_our_prompts_in_our_order_and_our_settings(tmp_path):
    from megatron_dynamo.data.dataset import PromptSampler
    from megatron_dynamo.data.templates import render
    from megatron_dynamo.trainer.preflight import load_examples

    _, run = peer_runs.run_config(bench_peer.SHAPES["cpu_default"], tmp_path / "hf", steps=3)
    spec = peer_runs.peer_spec(run, tmp_path / "hf", 3, tmp_path)
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
    _, run = peer_runs.run_config(bench_peer.SHAPES["large"], tmp_path / "hf", steps=5)
    spec = peer_runs.peer_spec(run, tmp_path / "hf", 5, tmp_path)
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
    out = peer_report.summarise(_trace(), records, "ours")
    assert out["step_s"] == pytest.approx(1.4)  # median of steps 3, 4, 5
    assert out["wall_per_step_s"] == pytest.approx((109.5 - 105.0) / 3)
    assert out["cpu_per_step_s"] == pytest.approx(2.0 * (109.5 - 105.0) / 3)
    assert out["startup_s"] == pytest.approx(104.0 - 1.1 - 100.0)
    assert out["parts"]["old_logprob"] == 0.0 and out["parts"]["update"] == 0.5
    assert out["parts"]["other"] == pytest.approx(1.4 - 0.85)
    peer = [{**{k: v for k, v in r.items() if not k.startswith("time/")}, "time/generation": 0.3,
             "time/reward": 0.1, "time/update": 0.6, "time/score_other": 0.02, "prompts_match": True}
            for r in records]
    out = peer_report.summarise(_trace(), peer, "trl")
    assert out["parts"]["generation"] == 0.3 and out["parts"]["other"] == 0.02 and out["prompts_match"]
    text = peer_report.table("t", {"colocated": [(peer_report.summarise(_trace(), records, "ours"), out)]})
    assert "| step (median from step 3), s | 1.400 | 1.400 | 1.00x |" in text
    assert "|   weight_sync, s | 0.050 | 0.000 | - |" in text
    assert "start-up phases" not in text  # the records hold none


def test_table_names_the_machine_and_each_sides_start_up_phases():
    import torch

    def records(startup):
        return [{"step": s, "step_seconds": 1.0, "reward_mean": 0.5, "response_length_mean": 3.0, "prompts_match": True,
                 **(startup if s == 1 else {})} for s in range(1, 6)]

    pairs = [(peer_report.summarise(_trace(), records({"startup/launch": launch, "startup/engine": 3.0,
                                                      "startup/total": launch + 4.0}), "ours"),
              peer_report.summarise(_trace(), records({"startup/imports": 2.0, "startup/total": 2.5}), "trl"))
             for launch in (1.0, 2.0, 4.0)]
    machine = peer_report.machine_info()
    assert machine["torch"] == torch.__version__ and machine["cpu_model"] and machine["cpus"] >= 1
    text = peer_report.table("t", {"colocated": pairs}, machine)
    assert text.splitlines()[2] == peer_report.machine_line(machine)
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


def test_pss_is_read_once_a_pss_interval_and_carried_between_reads(tmp_path, monkeypatch):
    """A PSS read walks the measured process's page tables (and slows it): CPU every interval, PSS less often."""
    reads, sample = [], peer_tree._sample
    monkeypatch.setattr(peer_tree, "_sample", lambda root, cpu, read_pss: reads.append(read_pss) or sample(root, cpu,
                                                                                                        read_pss))
    trace = trace_run([sys.executable, "-c", "import time; time.sleep(1.3)"], tmp_path, tmp_path / "steps.jsonl",
                      tmp_path / "console.log", interval=0.05, pss_interval=0.5)
    assert sum(reads) >= 2 and sum(reads) < len(reads) / 2  # far fewer PSS reads than samples
    values = [pss for _, _, pss in trace.samples]
    # between reads every sample carries the last value read: it changes at a read only
    assert sum(a != b for a, b in zip(values, values[1:])) <= sum(reads) - 1
    assert max(values) > 2**20


# ------------------------------------------------------------------------------------------------ overlapped placement
def test_overlapped_runs_on_two_ranks_with_the_engine_on_its_own(tmp_path):
    overrides, run = peer_runs.run_config(bench_peer.SHAPES["cpu_default"], tmp_path / "hf", 4, "overlapped")
    assert (run.rollout.placement, run.rollout.engine_ranks, run.rollout.max_staleness) == ("separate", 1, 1)
    assert run.dynamo.loss.engine_is == "truncate" and peer_runs.NPROC["overlapped"] == ["--nproc", "2"]
    _, colocated = peer_runs.run_config(bench_peer.SHAPES["cpu_default"], tmp_path / "hf", 4)
    assert colocated.rollout.placement == "colocated" and peer_runs.NPROC["colocated"] == []
    assert bench_peer.placements_of("cpu_default", None) == ["colocated", "overlapped"]
    assert bench_peer.placements_of("large", None) == ["colocated"]
    assert bench_peer.placements_of("large", "overlapped") == ["overlapped"]


def _overlapped_records():
    """As the trainer rank of an overlapped run logs them: its own wait, update and sync, and the engine rank's
    generation and scoring of the batch (spent during the update before, so they exceed the step's rest)."""
    return [{"step": s, "step_seconds": 1.0, "time/wait_rollout": 0.1 * s, "time/advantages": 0.01,
             "time/train": 0.6, "time/weight_sync": 0.05, "time/rollout": 0.7, "time/reward": 0.2,
             "time/data": 0.001, "reward_mean": 0.5, "response_length_mean": 3.0,
             **({"startup/distributed": 2.0, "startup/first_sync": 3.0, "startup/total": 6.0} if s == 1 else {})}
            for s in range(1, 6)]


def test_overlapped_step_parts_are_the_trainer_ranks():
    out = peer_report.summarise(_trace(), _overlapped_records(), "ours")
    assert out["overlapped"] is True
    assert list(out["parts"]) == ["generation", "reward", "wait_rollout", "old_logprob", "update", "weight_sync",
                                  "other"]
    assert out["parts"]["wait_rollout"] == pytest.approx(0.4)  # median of steps 3, 4, 5
    assert out["parts"]["generation"] == 0.7 and out["parts"]["reward"] == 0.2  # the engine rank's, overlapped
    # other: the step less the trainer rank's parts (not generation and reward, which overlap the update)
    assert out["parts"]["other"] == pytest.approx(1.0 - 0.4 - 0.6 - 0.05)
    assert out["startup_s"] == pytest.approx(104.0 - 1.0 - 100.0)
    assert out["startup_phases"] == {"distributed": 2.0, "first_sync": 3.0, "total": 6.0}
    colocated = peer_report.summarise(_trace(), [{k: v for k, v in r.items() if k != "time/wait_rollout"}
                                                 for r in _overlapped_records()], "ours")
    assert "wait_rollout" not in colocated["parts"] and colocated["overlapped"] is False
    assert colocated["parts"]["other"] == pytest.approx(1.0 - 0.7 - 0.2 - 0.6 - 0.05)


def test_table_has_a_row_set_per_placement_against_the_same_trl_runs():
    peer = [{"step": s, "step_seconds": 0.5, "time/generation": 0.2, "time/update": 0.3, "reward_mean": 0.5,
             "response_length_mean": 3.0, "prompts_match": True,
             **({"startup/imports": 2.0, "startup/total": 2.5} if s == 1 else {})} for s in range(1, 6)]
    colocated = [{k: v for k, v in r.items() if k != "time/wait_rollout"} for r in _overlapped_records()]
    trl = peer_report.summarise(_trace(), peer, "trl")
    text = peer_report.table("t", {"colocated": [(peer_report.summarise(_trace(), colocated, "ours"), trl)],
                                   "overlapped": [(peer_report.summarise(_trace(), _overlapped_records(), "ours"),
                                                   trl)]})
    lines = text.splitlines()
    first, second = (lines.index(f"| **{peer_report.PLACEMENTS[p][1]}** | | | | |") for p in ("colocated", "overlapped"))
    assert first < second
    assert "|   wait_rollout, s | 0.400 | 0.000 | - | 0.400 / 0.000 |" in lines[second:]
    assert not any("wait_rollout" in line for line in lines[first:second])
    assert lines[first + 1] == lines[second + 1] == "| step (median from step 3), s | 1.000 | 0.500 | 2.00x | 1.000 / 0.500 |"
    assert ("overlapped: start-up phases, s (median over pairs): ours distributed 2.0 + first_sync 3.0 (total 6.0); "
            "TRL imports 2.0 (total 2.5)") in lines
    assert any(line.startswith("overlapped: responses per step") for line in lines)


# ------------------------------------------------------------------------------------------------ the sweep
def test_model_params_count_the_hf_models_parameters():
    """Against transformers' own count of each swept model (built on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for name, path in peer_sweep.MODELS.items():
        config = AutoConfig.from_pretrained(ROOT / path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert peer_sweep.model_params(json.loads((ROOT / path).read_text())) == model.num_parameters(), name
    qwen05 = json.loads((ROOT / peer_sweep.MODELS["0.5b"]).read_text())
    assert (qwen05["hidden_size"], qwen05["num_hidden_layers"], qwen05["num_attention_heads"],
            qwen05["num_key_value_heads"], qwen05["intermediate_size"], qwen05["tie_word_embeddings"]) == \
        (896, 24, 14, 2, 4864, True)


def test_points_run_smallest_work_first_and_the_memory_estimate_grows_with_both():
    models = {name: json.loads((ROOT / path).read_text()) for name, path in peer_sweep.MODELS.items()}
    points = peer_sweep.plan_points(models, [1024, 16, 256, 64])
    works = [p["work"] for p in points]
    assert works == sorted(works) and len(points) == 16
    assert (points[0]["model"], points[0]["length"]) == ("tiny", 16)
    assert (points[-1]["model"], points[-1]["length"]) == ("0.5b", 1024)
    estimate = {(p["model"], p["length"]): p["estimate_gib"] for p in points}
    assert estimate[("0.5b", 1024)] > 24 > estimate[("0.5b", 256)] > estimate[("100m", 256)]
    # below the large shape's measured peak (6.9 GiB: the same model and length, micro-batches twice as large)
    assert 1.5 < estimate[("100m", 256)] < 6.9


def _fake_point(model, length, work):
    return {"model": model, "length": length, "params": work, "work": work, "estimate_gib": work / 10}


def test_budget_memory_and_failures_are_recorded_not_raised():
    points = [_fake_point("a", 16, 1), _fake_point("a", 64, 2), _fake_point("b", 16, 30), _fake_point("b", 64, 4),
              _fake_point("b", 256, 5), _fake_point("b", 1024, 6)]
    now = [0.0]
    measured = []

    def measure(point, index):
        measured.append((point["model"], point["length"], index))
        now[0] += 40.0
        if point["length"] == 64 and point["model"] == "b":
            raise RuntimeError("dynamo train ... exited with 1:\nTraceback\nMemoryError")
        return {"status": "measured", "ratio": 1.0}

    results = peer_sweep.run_points(points, measure, budget_s=100.0, memory_gib=lambda: 2.0, clock=lambda: now[0])
    assert [r["status"] for r in results] == ["measured", "measured", "skipped", "skipped", "not run", "not run"]
    assert measured == [("a", 16, 0), ("a", 64, 1), ("b", 64, 3)]  # the third is over 2 GiB: never started
    assert results[2]["reason"] == "estimated 3.0 GiB of memory, 2.0 GiB available"
    assert results[3]["reason"] == "RuntimeError: dynamo train ... exited with 1:" and results[3]["detail"][-1] == \
        "MemoryError"
    assert results[4]["reason"] == "the sweep's budget was spent" and results[0]["seconds"] == 40.0
    unlimited = peer_sweep.run_points(points[:2], lambda p, i: {"status": "measured"}, None, lambda: 99.0)
    assert [r["status"] for r in unlimited] == ["measured", "measured"]


def _summary(step_s, lengths):
    return {"step_s": step_s, "response_lengths": lengths, "response_length_mean": sum(lengths) / len(lengths),
            "parts": {"generation": step_s / 2}, "peak_pss_gib": 1.0}


def test_a_point_whose_responses_are_not_its_length_is_refused(monkeypatch, tmp_path):
    assert peer_sweep.length_mismatch("ours", _summary(1.0, [64.0, 64.0, 64.0]), 64) is None
    assert peer_sweep.length_mismatch("trl", _summary(1.0, [64.0, 63.5, 64.0]), 64) == \
        "trl's responses are not all 64 tokens: mean response lengths per step 64, 63.5, 64"
    # measure_point on made-up runs (the bookkeeping only): the order alternates, a short TRL run refuses the point
    monkeypatch.setattr(peer_sweep, "export_model", lambda setup, work: tmp_path / "hf")
    monkeypatch.setattr(peer_sweep, "peer_spec", lambda *args: {})
    calls = []

    def ours(setup, hf, steps, out, interval, pss_interval):
        calls.append(("ours", setup["rl"][0], steps))
        return _summary(2.0, [16.0] * 3), {}

    def trl(spec, out, interval, pss_interval):
        calls.append(("trl",))
        return _summary(4.0, [16.0, 12.0, 16.0] if len(calls) > 2 else [16.0] * 3), {}

    monkeypatch.setattr(peer_sweep, "run_ours", ours)
    monkeypatch.setattr(peer_sweep, "run_trl", trl)
    args = type("Args", (), {"sweep_lengths": [16], "steps": None, "interval": 0.1, "pss_interval": 1.0})()
    point = _fake_point("tiny", 16, 1)
    first = peer_sweep.measure_point(point, 0, args, tmp_path)
    assert first["status"] == "measured" and first["ratio"] == 0.5 and first["order"] == ["ours", "trl"]
    assert calls[0] == ("ours", "rollout.min_response_tokens=16", 3)
    second = peer_sweep.measure_point(point, 1, args, tmp_path)
    assert second["order"] == ["trl", "ours"] and second["status"] == "refused"
    assert second["reason"].startswith("trl's responses are not all 16 tokens")
    copy = json.loads((tmp_path / "models" / "tiny.json").read_text())
    assert copy["max_position_embeddings"] == 256  # tiny's own 256 holds 16 + 16
    assert json.loads(peer_sweep.sweep_model_config("tiny", [16, 1024], tmp_path).read_text())[
        "max_position_embeddings"] == 16 + 1024


def test_the_sweeps_runs_have_responses_of_exactly_the_length(tmp_path):
    from megatron_dynamo.data import build_char_tokenizer
    from megatron_dynamo.trainer.rollout_setup import sampling_config

    setup = peer_sweep.setup_of(tmp_path / "model.json", 64)
    _, run = peer_runs.run_config(setup, tmp_path / "hf", 3)
    assert run.rollout.max_response_tokens == run.rollout.min_response_tokens == 64
    assert (run.data.prompts_per_step, run.dynamo.allocation.n_avg, run.optim.lr) == (2, 4, 1e-6)
    assert run.trainer.micro_batch_tokens == 4 * (run.data.max_prompt_tokens + 64)
    sampling = sampling_config(run, build_char_tokenizer())
    assert (sampling.min_tokens, sampling.max_tokens) == (64, 64)
    spec = peer_runs.peer_spec(run, tmp_path / "hf", 3, tmp_path)
    assert (spec["min_response_tokens"], spec["micro_batch_size"], spec["micro_batches"]) == (64, 4, 2)


def test_min_response_tokens_is_checked_in_one_line():
    from megatron_dynamo.config import ConfigError
    from megatron_dynamo.trainer.config import load_run_config

    assert load_run_config(str(ROOT / "configs/cpu_default.yaml")).rollout.min_response_tokens == 0
    for value in (7, -1):
        with pytest.raises(ConfigError) as info:
            load_run_config(str(ROOT / "configs/cpu_default.yaml"), [f"rollout.min_response_tokens={value}"])
        assert str(info.value) == f"rollout.min_response_tokens: must lie in [0, max_response_tokens (6)], got {value}"


def _made_up_sweep():
    points = []
    for model, scale in (("tiny", 1.0), ("30m", 6.0)):
        for length in (16, 64):
            ours, trl = scale * length / 100, scale * length / 80
            points.append({"model": model, "length": length, "params": int(scale * 1e6), "status": "measured",
                           "ours": _summary(ours, [float(length)] * 3), "trl": _summary(trl, [float(length)] * 3),
                           "ratio": ours / trl})
    points[-1] = {**points[-1], "status": "not run", "reason": "the sweep's budget was spent"}
    return {"settings": {"lengths": [16, 64], "models": ["tiny", "30m"], "steps": 3, "prompts": 2, "group": 4},
            "points": points, "date": "2026-11-29 12:00"}


def test_sweep_table_rows_models_columns_lengths():
    text = peer_sweep.sweep_table(_made_up_sweep())
    lines = text.splitlines()
    assert lines[2] == "| model | 16 tokens: ours s / TRL s / ratio | 64 tokens: ours s / TRL s / ratio |"
    assert lines[4] == "| tiny (1M) | 0.160 / 0.200 / 0.80x | 0.640 / 0.800 / 0.80x |"
    assert lines[5] == "| 30m (6M) | 0.960 / 1.200 / 0.80x | not run |"
    assert lines[-1] == "- 30m x 64: not run: the sweep's budget was spent"


def test_the_plot_is_drawn_from_the_json_alone(tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_made_up_sweep()))
    png = tmp_path / "plot" / "peer_sweep.png"
    assert bench_peer.main(["--plot-only", str(sweep), "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert [len(points) for points in peer_plot.series(_made_up_sweep()).values()] == [2, 1]


def test_sweep_options_are_checked():
    with pytest.raises(SystemExit):
        bench_peer.parse_args(["--sweep", "--sweep-models", "tiny,7b"])
    with pytest.raises(SystemExit):
        bench_peer.parse_args(["--sweep", "--steps", "2"])
    args = bench_peer.parse_args(["--sweep", "--sweep-lengths", "16,64"])
    assert args.sweep_lengths == [16, 64] and args.sweep_models == ["tiny", "30m", "100m", "0.5b"]
