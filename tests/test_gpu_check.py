"""scripts/gpu_check.sh stays runnable without a GPU: --list, a run whose parts all say "skipped: no CUDA" (exit 0,
report written, RESULTS.md untouched), appending reports fetched from a device machine, the report of parts that
timed out or ran out of budget, and lint. The GPU parts themselves run only where CUDA is (scripts/gpu_check.sh on
a lent GPU); ``--cpu`` runs their CPU variants (one of them below, marked slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
WHEELS_SCRIPT = ROOT / "scripts" / "gpu_wheels.sh"
PARTS = ["tests", "te_parity", "model_1p5b", "moe", "vllm", "train_tiny", "train_1p5b", "sleep_wake", "update"]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(*args, env=None, timeout=120):
    full_env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_WHEELS": "/nonexistent", **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=ROOT)


def test_list_names_every_part():
    out = _run("--list")
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    assert names == PARTS
    assert "s  needs cuda" in out.stdout


def test_unknown_part_and_option_are_usage_errors():
    assert _run("--part", "nonsense").returncode == 2
    assert _run("--frobnicate").returncode == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the parts would really run")
def test_without_cuda_parts_say_skipped_and_the_command_exits_0(tmp_path):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Measured results\n")
    out = _run("--part", "te_parity,vllm", "--part", "sleep_wake", "--out", str(tmp_path / "out"),
               env={"GPU_CHECK_RESULTS_MD": str(results_md)})
    assert out.returncode == 0, out.stdout + out.stderr
    report = (tmp_path / "out" / "gpu_check_report.md").read_text()
    assert report.startswith("## GPU check, ")
    for part in ("te_parity", "vllm", "sleep_wake"):
        assert f"| {part} | skip |" in report
    assert report.count("skipped: no CUDA") == 3
    assert "- command: `scripts/gpu_check.sh --part te_parity\\,vllm --part sleep_wake --out " in report
    results = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert [r["status"] for r in results["results"]] == ["skip"] * 3
    assert results["env"]["cuda"] is False and results["env"]["commit"]
    assert (tmp_path / "out" / "gpu_check.log").stat().st_size > 0
    assert results_md.read_text() == "# Measured results\n"  # nothing ran: nothing appended


def test_default_budget_covers_the_parts_and_parts_left_out_are_not_run(tmp_path):
    gc = _module()
    limits = {part.name: part.timeout_s for part in gc.PARTS.values()}
    out = _run("--part", "vllm,sleep_wake", "--out", str(tmp_path / "a"), "--no-append")
    budget = 120 + limits["vllm"] + 15 + limits["sleep_wake"] + 15
    assert f"total budget {budget} s" in out.stdout, out.stdout
    assert "NOT RUN" not in out.stdout
    # A budget too small for any part: each is reported NOT RUN and the exit status says so (not 0).
    out = _run("--part", "vllm,sleep_wake", "--total-seconds", "30", "--out", str(tmp_path / "b"), "--no-append")
    assert out.returncode == 3, out.stdout + out.stderr
    report = (tmp_path / "b" / "gpu_check_report.md").read_text()
    assert "| vllm | NOT RUN |" in report and "| sleep_wake | NOT RUN |" in report
    assert "2 NOT RUN" in report


def test_append_report_takes_only_gpu_check_reports(tmp_path):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Measured results\n\n## GPU check reports\n\nplaceholder\n")
    good = tmp_path / "gpu_check_report.md"
    good.write_text("## GPU check, 2026-11-24 10:00 UTC\n\n- commit: abc\n")
    bad = tmp_path / "other.md"
    bad.write_text("# something else\n")
    env = {"GPU_CHECK_RESULTS_MD": str(results_md)}
    assert _run("--append-report", str(good), env=env).returncode == 0
    assert results_md.read_text().endswith("placeholder\n\n## GPU check, 2026-11-24 10:00 UTC\n\n- commit: abc\n")
    before = results_md.read_text()
    assert _run("--append-report", str(bad), env=env).returncode == 2
    assert results_md.read_text() == before


def test_report_of_killed_budget_failed_and_passed_parts(tmp_path):
    gc = _module()
    env = {"date": "2026-11-24 10:00 UTC", "commit": "abc123", "cuda": True, "gpu": "NVIDIA H100 80GB HBM3",
           "gpu_memory_gib": 79.2, "gpu_count": 1, "driver": "580", "capability": "9.0", "nccl": "2.27.3",
           "torch": "2.11.0+cu130", "torch_cuda": "13.0", "python": "3.12.3",
           "versions": {"megatron": "0.16.1", "transformers": "5.17.0"},
           "have": {"cuda": None, "megatron": None, "te": "missing transformer_engine: ...", "vllm": "missing vllm"}}
    (tmp_path / "env.json").write_text(json.dumps(env))
    (tmp_path / "tests.json").write_text(json.dumps({"part": "tests", "status": "pass", "summary": "5 passed",
                                                     "numbers": {"exit_code": 0}, "seconds": 50.0}))
    (tmp_path / "model_1p5b.json").write_text(json.dumps({
        "part": "model_1p5b", "status": "fail", "summary": "1x4096: out of memory", "numbers": {"spec": "local"},
        "tables": {"step time": [{"micro-batch": "1x2048", "tokens/s": 12345.678}, {"micro-batch": "1x4096",
                                                                                     "result": "OOM"}]},
        "tail": ["Traceback", "OutOfMemoryError"]}))
    (tmp_path / "model_1p5b.status").write_text("rc=1 seconds=99 limit=420")
    (tmp_path / "vllm.json").write_text(json.dumps({"part": "vllm", "status": "skip",
                                                    "summary": "skipped: missing vllm: the official CUDA build"}))
    (tmp_path / "train_tiny.status").write_text("rc=124 seconds=420 limit=420 leftover=1234,5000MiB")
    (tmp_path / "sleep_wake.status").write_text("rc=budget seconds=0 limit=40")
    names = ["tests", "model_1p5b", "vllm", "train_tiny", "sleep_wake"]
    results = gc.load_results(tmp_path, names)
    assert [r["status"] for r in results] == ["pass", "fail", "skip", "fail", "NOT RUN"]
    assert "timed out after 420 s" in results[3]["summary"] and "1234,5000MiB" in results[3]["notes"][0]
    assert results[4]["summary"].startswith("NOT RUN: the total time budget was spent")
    report = gc.render_report(env, results, "scripts/gpu_check.sh --part x", cpu=False)
    assert report.startswith("## GPU check, 2026-11-24 10:00 UTC\n")
    assert "- result: 1 passed, 2 failed, 1 skipped, 1 NOT RUN," in report and "| sleep_wake | NOT RUN |" in report
    assert "NVIDIA H100 80GB HBM3" in report and "transformer-engine missing" in report
    assert "| 1x2048 | 1.235e+04 |" in report and "| 1x4096 |  | OOM |" in report
    assert "OutOfMemoryError" in report
    out_dir = tmp_path / "out"
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Results\n")
    rc = gc.main(["report", "--work", str(tmp_path), "--parts", " ".join(names), "--command", "c",
                  "--out-dir", str(out_dir), "--append", str(results_md)])
    assert rc == 1  # a part failed
    assert results_md.read_text().startswith("# Results\n\n## GPU check, ")
    assert gc.main(["report", "--work", str(tmp_path), "--parts", "tests vllm", "--command", "c",
                    "--out-dir", str(out_dir), "--strict"]) == 1  # the vLLM skip for a missing package fails
    # No failure, but a part the budget left out: the check did not check everything, a distinct exit status.
    assert gc.main(["report", "--work", str(tmp_path), "--parts", "tests vllm sleep_wake", "--command", "c",
                    "--out-dir", str(out_dir)]) == gc.EXIT_NOT_RUN == 3
    assert gc.main(["report", "--work", str(tmp_path), "--parts", "tests vllm", "--command", "c",
                    "--out-dir", str(out_dir)]) == 0


def test_skip_reasons():
    gc = _module()
    no_cuda = {"have": {"cuda": "no CUDA", "vllm": None, "megatron": None, "te": "no CUDA"}}
    assert gc.skip_reason(gc.PARTS["vllm"], no_cuda, cpu_mode=False) == "no CUDA"
    assert gc.skip_reason(gc.PARTS["vllm"], no_cuda, cpu_mode=True) is None
    assert gc.skip_reason(gc.PARTS["sleep_wake"], no_cuda, cpu_mode=True).startswith("no CUDA")
    gpu = {"have": {"cuda": None, "megatron": None, "te": "missing transformer_engine: hint", "vllm": None}}
    assert gc.skip_reason(gc.PARTS["te_parity"], gpu, cpu_mode=False) == "missing transformer_engine: hint"
    assert gc.skip_reason(gc.PARTS["model_1p5b"], gpu, cpu_mode=False) is None


@pytest.mark.parametrize("script", [SCRIPT, WHEELS_SCRIPT], ids=lambda p: p.name)
def test_scripts_are_executable(script):
    # bash -n and shellcheck: tests/test_launch.py lints every script under scripts/.
    assert os.access(script, os.X_OK), f"{script.name} is not executable"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU variant")
def test_cpu_variant_of_the_model_part_runs(tmp_path):
    """--cpu (developers): the measurement code of the 1.5B part on a tiny model on the CPU, so it cannot rot."""
    out = _run("--cpu", "--part", "model_1p5b", "--out", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())["results"]
    assert results[0]["status"] == "pass", results
    rows = results[0]["tables"]["step time and memory"]
    assert all(r["tokens/s (fwd+bwd+step)"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU variant")
@pytest.mark.extended
def test_cpu_variant_of_the_update_part_runs(tmp_path):
    """--cpu: bench_update's variants (unfused/fused output layer, padded/dynamic/packed micro-batches) through the
    trainer's update on a tiny model, and the part's report of them."""
    out = _run("--cpu", "--part", "update", "--out", str(tmp_path), timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())["results"]
    assert results[0]["status"] == "pass", results
    rows = results[0]["tables"]["update: memory and speed by variant"]
    assert [r["variant"].split()[0] for r in rows] == ["unfused", "fused", "padded", "dynamic", "packed"]
    assert all(r["tokens/s"] > 0 and r["micro-batches"] >= 1 for r in rows)
    assert "padded tokens/s" in results[0]["summary"]


def test_pytest_summary_lines_are_parsed():
    _module()  # puts the repository root on sys.path, as the driver does
    from benchmarks.gpu_check_parts import part_tests as gc
    assert gc.pytest_outcome("PASSED tests/test_gpu.py::test_a[dtype1]") == {
        "outcome": "PASSED", "test": "test_a[dtype1]", "detail": ""}
    assert gc.pytest_outcome("FAILED tests/test_gpu.py::test_b - AssertionError: x") == {
        "outcome": "FAILED", "test": "test_b", "detail": "AssertionError: x"}
    assert gc.pytest_outcome("SKIPPED [2] tests/test_gpu.py:64: Transformer Engine does not import here") == {
        "outcome": "SKIPPED", "test": "test_gpu.py:64", "detail": "Transformer Engine does not import here"}
    assert gc.pytest_outcome("==== 3 passed in 2.0s ====") is None


def test_a_failed_update_variant_reports_its_exception_not_the_warning_after_it():
    """The H200's first run (2026-11-26): every variant's error read "[rank0]:[W...] Warning: WARNING:
    destroy_process_group() was not called", the line torch prints after the traceback."""
    _module()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_update import failure_line

    tail = ["Traceback (most recent call last):",
            '[rank0]:   File "torch_norm.py", line 30, in __new__',
            "[rank0]: AssertionError: persist_layer_norm not supported by torch LayerNorm",
            "[rank0]:[W1126 03:03:20.969828336 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() "
            "was not called before program exit, which can leak resources."]
    assert failure_line(tail, 1) == "AssertionError: persist_layer_norm not supported by torch LayerNorm"
    oom = "torch.OutOfMemoryError: CUDA out of memory."
    assert failure_line([oom], 1) == oom
    assert failure_line(["killed"], -9) == "killed" and failure_line([], -9) == "exit -9"


def test_an_out_of_memory_the_card_cannot_hold_is_a_measured_limit_not_a_failure():
    """The 1.5B part's rule for OOM, with the rows measured on the lent cards (local spec, bf16): 1x2048 peaked at
    40.67 GiB with 14.61 GiB of activations, so 4x2048 needs ~84.5 GiB: expected on an 80 GiB H100 (79.2 GiB
    usable), a failure on a 139 GiB H200 where it ran."""
    from benchmarks.gpu_check_parts.step_shapes import predicted_peak_gib as _predicted_peak_gib

    rows = [{"micro-batch": "1x2048", "peak alloc GiB": 40.67, "activations GiB": 14.61},
            {"micro-batch": "1x4096", "result": "OOM"}]
    assert _predicted_peak_gib(rows, 4, 2048) == pytest.approx(40.67 + 3 * 14.61)
    assert _predicted_peak_gib(rows, 4, 2048) > 0.9 * 79.2
    assert _predicted_peak_gib(rows, 4, 2048) < 0.9 * 139.8
    assert _predicted_peak_gib(rows, 1, 2048) == pytest.approx(40.67)
    assert _predicted_peak_gib(rows, 2, 4096) is None  # 1x4096 did not run: no prediction, the OOM counts


def test_the_moe_part_counts_the_weights_a_token_uses_as_the_model_card_does():
    """Qwen3-30B-A3B's model card: 30.5 B parameters, 3.3 B activated per token (with the input embedding, which
    costs no matmul). The moe part's FLOP count (6 x the weights a token uses at sequence length 0) must agree."""
    import json

    from benchmarks.gpu_check_parts.part_moe import _layers_that_fit, moe_flops_per_token
    from benchmarks.gpu_check_parts.registry import QWEN3_30B_A3B
    from megatron_dynamo.models.qwen import parse_qwen_config

    cfg = json.loads(QWEN3_30B_A3B.read_text())
    arch = parse_qwen_config(cfg)
    activated = moe_flops_per_token(arch, 0) / 6 + arch.vocab_size * arch.hidden_size
    assert activated == pytest.approx(3.3e9, rel=0.02)
    assert moe_flops_per_token(arch, 4096) > moe_flops_per_token(arch, 0)  # attention scores grow with the length
    # 18 B a parameter with the optimizer, half the memory for the weights: 139 GiB (H200) holds 5 of the 48
    # layers, 79 GiB (H100) 2, and a nearly full card still builds one.
    assert [_layers_that_fit(cfg, gib) for gib in (139.0, 79.0, 1.0)] == [5, 2, 1]
