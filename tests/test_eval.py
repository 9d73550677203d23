"""Evaluation: the pass@k estimator against enumeration, and the runner end to end with the real vLLM (CPU build)
and math-verify on a tiny model over the first problems of each of the paper's six benchmarks."""

from __future__ import annotations

import itertools
import json
import math
import os
from fractions import Fraction

import pytest

from megatron_dynamo.data.dataset import BENCHMARKS
from megatron_dynamo.eval.passk import mean_pass_at_k, pass_at_k
from megatron_dynamo.eval.runner import (EvalConfig, EvalError, evaluate, format_table, summarize,
                                         summary_metrics)

from hf_reference import REPO, hf_model

DATA_DIR = os.path.join(REPO, "tests", "fixtures", "math")  # the first rows of the six benchmarks (its README)


# ------------------------------------------------------------------------------------------------ estimator
def _enumerated(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_enumeration_for_small_n():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_enumerated(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_exact_where_binomials_overflow():
    for n, c, k in [(1024, 3, 512), (2000, 1, 1999), (4096, 100, 32), (32, 5, 1)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)
    assert pass_at_k(32, 0, 32) == 0.0 and pass_at_k(32, 1, 32) == 1.0
    assert pass_at_k(32, 8, 1) == pytest.approx(0.25, abs=1e-15)  # pass@1 is the mean accuracy
    assert mean_pass_at_k([(4, 1), (4, 4), (2, 0)], 1) == pytest.approx((0.25 + 1 + 0) / 3)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (4.5, 2, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_eval_config_rejects_bad_values():
    for bad in (dict(n=0), dict(n=4, k=(8,)), dict(benchmarks=()), dict(benchmarks=("aime24", "aime24")),
                dict(temperature=0.0), dict(top_p=1.5), dict(max_tokens=0), dict(template="nope"),
                dict(limit=0), dict(problems_per_batch=0)):
        with pytest.raises((ValueError, KeyError)):
            EvalConfig(**{"n": 4, "k": (4,), **bad}).validate()
    assert EvalConfig(n=8, k=(4, 8, 4)).k == (1, 4, 8)


# ------------------------------------------------------------------------------------------- summary, table
def _records(benchmark, problem, flags):
    return [{"benchmark": benchmark, "problem_id": problem, "sample_index": i, "correct": f, "num_tokens": 10 + i,
             "finish_reason": "stop" if i else "length"} for i, f in enumerate(flags)]


def test_summary_averages_benchmarks_and_table_has_the_paper_layout(tmp_path):
    from megatron_dynamo.eval.runner import Benchmark
    from megatron_dynamo.data.dataset import MathExample

    a = Benchmark("aime24", "a", (MathExample("aime24:0", "p", "1"), MathExample("aime24:1", "p", "2")))
    b = Benchmark("minerva", "b", (MathExample("minerva:0", "p", "1"),))
    finished = {("aime24", "aime24:0"): _records("aime24", "aime24:0", [1, 0, 0, 0]),
                ("aime24", "aime24:1"): _records("aime24", "aime24:1", [0, 0, 0, 0]),
                ("minerva", "minerva:0"): _records("minerva", "minerva:0", [1, 1, 0, 1])}
    summary = summarize([a, b], finished, EvalConfig(n=4, k=(2, 4)))
    aime, minerva = summary["benchmarks"]["aime24"], summary["benchmarks"]["minerva"]
    assert aime["pass@1"] == pytest.approx(0.125) and aime["pass@2"] == pytest.approx(0.25)
    assert aime["pass@4"] == pytest.approx(0.5) and minerva["pass@1"] == pytest.approx(0.75)
    assert minerva["pass@2"] == pytest.approx(1.0)
    assert summary["avg"]["pass@1"] == pytest.approx((0.125 + 0.75) / 2)  # the paper's Avg.: mean of columns
    assert aime["problems"] == 2 and aime["samples"] == 8 and aime["truncated_fraction"] == pytest.approx(0.25)
    table = format_table([("DynaMO", summary)]).splitlines()
    assert table[0].split() == ["AIME24", "Minerva", "Avg."]
    assert table[1].split() == ["P@1", "P@2", "P@4"] * 3
    assert table[2].split() == ["DynaMO", "12.5", "25.0", "50.0", "75.0", "100.0", "100.0", "43.8", "62.5", "75.0"]
    metrics = summary_metrics(summary)
    assert metrics["eval/aime24/pass@4"] == pytest.approx(0.5) and metrics["eval/avg/pass@1"] == pytest.approx(0.4375)


# ------------------------------------------------------------------------- collective runner, fake engines
class _FakeTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [1 + ord(c) % 500 for c in text]


class _FakeEngine:
    """Responses that depend on (seed, problem id, sample index) only, as vLLM's: the right answer for one seed in
    three. ``generated``: the problem ids this engine was asked for."""

    def __init__(self, answers, layout=None):
        self.answers, self.layout, self.generated = answers, layout, []

    def generate(self, requests, sampling, step=0):
        from megatron_dynamo.rollout.interface import GenerationResponse, request_seed

        responses = []
        for request in requests:
            self.generated.append(request.prompt_id)
            seed = request_seed(sampling.seed, step, request.prompt_id)
            for j in range(request.count):
                right = (seed + j) % 3 == 0
                text = f"so \\boxed{{{self.answers[request.prompt_id] if right else -1}}}"
                responses.append(GenerationResponse(request.prompt_id, j, request.prompt_token_ids,
                                                    tuple(range(5 + (seed + j) % 4)), None,
                                                    "stop" if j % 2 else "length", text, seed + j))
        return responses


def _fake_config(data_dir):
    return EvalConfig(benchmarks=("aime24", "amc23"), n=3, k=(3,), max_tokens=16, limit=5, problems_per_batch=3,
                      data_dir=data_dir)


def _answers(config):
    from megatron_dynamo.eval.runner import load_benchmarks

    return {ex.id: ex.answer for bench in load_benchmarks(config) for ex in bench.problems}


class _Interrupt(Exception):
    pass


def _collective_worker(rank, world_size, data_dir, out_root):
    """Every rank evaluates with its engine: two engines of one rank, then one engine of two ranks (a scorer on its
    leader only), each interrupted after its first batch and resumed; then a settings error on every rank."""
    from megatron_dynamo.reward.math_reward import MathRewardScorer
    from megatron_dynamo.parallel.topology import EngineLayout

    config = _fake_config(data_dir)
    results = {}
    with MathRewardScorer(num_workers=0) as scorer:
        for tp in (1, 2):
            layout = EngineLayout(rank, world_size, tp)
            engine = _FakeEngine(_answers(config), layout)
            out = os.path.join(out_root, f"tp{tp}")

            def stop(problems):
                raise _Interrupt

            try:
                evaluate(engine, _FakeTokenizer(), scorer if layout.is_leader else None, config, out, model="fake",
                         progress=False, on_batch=stop)
            except _Interrupt:
                pass
            summary = evaluate(engine, _FakeTokenizer(), scorer if layout.is_leader else None, config, out,
                               model="fake", progress=False)
            results[tp] = (summary, engine.generated)
        try:
            evaluate(engine, _FakeTokenizer(), scorer, EvalConfig(**{**config.__dict__, "n": 2, "k": (2,)}),
                     os.path.join(out_root, "tp1"), model="fake", progress=False)
        except EvalError as exc:
            results["error"] = str(exc)
    return results


TIMING = ("seconds", "problems_per_second", "generated_problems")


def _untimed(summary):
    return {k: v for k, v in summary.items() if k not in TIMING}


@pytest.mark.distributed
def test_collective_evaluation_writes_what_one_engine_writes(tmp_path):
    """Two ranks: the problems of each batch are split over two engines (each problem generated once), or one
    two-rank engine generates them all; either way, resumed after an interruption, samples.jsonl and summary.json
    are those of one engine in one process (timing aside), and every rank returns the summary."""
    from multiproc import run_on_ranks

    from megatron_dynamo.reward.math_reward import MathRewardScorer

    config = _fake_config(DATA_DIR)
    with MathRewardScorer(num_workers=0) as scorer:
        single = evaluate(_FakeEngine(_answers(config)), _FakeTokenizer(), scorer, config, tmp_path / "single",
                          model="fake", progress=False)
    expected = (tmp_path / "single" / "samples.jsonl").read_text()
    assert single["benchmarks"]["aime24"]["pass@3"] > 0
    per_rank = run_on_ranks(_collective_worker, 2, DATA_DIR, str(tmp_path))
    for tp in (1, 2):
        assert (tmp_path / f"tp{tp}" / "samples.jsonl").read_text() == expected, tp
        written = json.loads((tmp_path / f"tp{tp}" / "summary.json").read_text())
        assert _untimed(written) == _untimed(single)
        assert written["generated_problems"] == 10 - 3  # the first batch (3 problems) was written before the stop
        for rank in (0, 1):
            assert _untimed(per_rank[rank][tp][0]) == _untimed(single)
    first, second = per_rank[0][1][1], per_rank[1][1][1]  # two engines: each problem generated once
    assert first and second and not set(first) & set(second) and len(first) + len(second) == 10
    assert per_rank[0][2][1] == per_rank[1][2][1] and len(per_rank[0][2][1]) == 10  # one engine over both ranks
    assert per_rank[0]["error"] == per_rank[1]["error"] and "other settings" in per_rank[1]["error"]


# ---------------------------------------------------------------------------------- runner with real vLLM
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny Qwen2 with the offline character tokenizer, long enough for the first benchmark prompts."""
    from megatron_dynamo.data.tokenizer import build_char_tokenizer
    from hf_reference import TINY_QWEN2

    path = tmp_path_factory.mktemp("tiny_eval_model")
    hf_model(TINY_QWEN2, seed=3, max_position_embeddings=2048).save_pretrained(path)
    build_char_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from megatron_dynamo.rollout.vllm_engine import VLLMEngine

    with VLLMEngine(tiny_model, max_model_len=2048, cpu_kvcache_space_gb=1, seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def scorer():
    from megatron_dynamo.reward.math_reward import MathRewardScorer

    with MathRewardScorer(num_workers=2) as s:
        yield s


def _lines(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _by_key(records):
    return {(r["benchmark"], r["problem_id"], r["sample_index"]): r for r in records}


SMALL = dict(n=3, k=(3,), max_tokens=8, limit=2, problems_per_batch=2, data_dir=DATA_DIR)


@pytest.mark.slow
def test_six_benchmarks_resume_after_interruption_to_the_same_samples(engine, tokenizer, scorer, tmp_path):
    config = EvalConfig(benchmarks=BENCHMARKS, **SMALL)
    whole = evaluate(engine, tokenizer, scorer, config, tmp_path / "whole", model="tiny", progress=False)
    expected = _lines(tmp_path / "whole" / "samples.jsonl")
    assert len(expected) == 6 * 2 * 3 and set(whole["benchmarks"]) == set(BENCHMARKS)
    assert json.loads((tmp_path / "whole" / "summary.json").read_text())["avg"] == whole["avg"]
    for record in expected:
        assert set(record) >= {"benchmark", "problem_id", "sample_index", "response", "extracted_answer", "correct"}

    class Interrupt(Exception):
        pass

    batches = []

    def stop_after_two(problems):
        batches.append(problems)
        if len(batches) == 2:
            raise Interrupt

    out = tmp_path / "resumed"
    with pytest.raises(Interrupt):
        evaluate(engine, tokenizer, scorer, config, out, model="tiny", progress=False, on_batch=stop_after_two)
    assert len(_lines(out / "samples.jsonl")) == 2 * 2 * 3
    with open(out / "samples.jsonl", "a", encoding="utf-8") as f:  # a crash mid-write: a torn line
        f.write('{"benchmark": "amc23", "problem_id": "amc23:0", "sample_ind')
    resumed = evaluate(engine, tokenizer, scorer, config, out, model="tiny", progress=False)
    assert resumed["generated_problems"] == 4 * 2  # only the four benchmarks not finished before
    assert _by_key(_lines(out / "samples.jsonl")) == _by_key(expected)
    assert resumed["benchmarks"] == whole["benchmarks"]

    with pytest.raises(EvalError, match="other settings .*n"):
        evaluate(None, tokenizer, scorer, EvalConfig(benchmarks=BENCHMARKS, **{**SMALL, "n": 2, "k": (2,)}),
                 out, model="tiny", progress=False)
    with pytest.raises(EvalError, match="exceed the engine's 50 prompt tokens"):
        evaluate(None, tokenizer, scorer, config, tmp_path / "short", max_prompt_tokens=50, progress=False)


@pytest.mark.slow
def test_correct_flags_and_answer_candidates(engine, tokenizer, scorer, tmp_path):
    """Rig a benchmark whose accepted answers are answers the model gave: the same seeds give the same samples,
    so those samples must be counted correct, every flag must agree with the scorer, and pass@k with the flags."""
    config = EvalConfig(benchmarks=("math500",), **{**SMALL, "n": 8, "k": (8,), "limit": 8, "max_tokens": 40})
    evaluate(engine, tokenizer, scorer, config, tmp_path / "first", progress=False)
    first = _lines(tmp_path / "first" / "samples.jsonl")
    given = {}  # problem id -> (sample index, the answer the model gave there)
    for record in first:
        if record["extracted_answer"] and record["problem_id"] not in given:
            given[record["problem_id"]] = (record["sample_index"], record["extracted_answer"])
    assert len(given) >= 2, "the tiny model should finish some responses with a number in them"
    data = [json.loads(line) for line in open(os.path.join(DATA_DIR, "math500.jsonl"), encoding="utf-8")][:8]
    rigged_dir = tmp_path / "rigged"
    rigged_dir.mkdir()
    with open(rigged_dir / "math500.jsonl", "w", encoding="utf-8") as f:
        for row in data:
            answer = given.get(f"math500:{row['id']}", (None, None))[1]
            # The model's answer only as an accepted alternative form (like Minerva's candidates).
            f.write(json.dumps({**row, "answer": "-987654", "answer_candidates": [answer] if answer else []}) + "\n")
    rigged = EvalConfig(**{**config.__dict__, "data_dir": str(rigged_dir)})
    with_forms = evaluate(engine, tokenizer, scorer, rigged, tmp_path / "forms", progress=False)
    samples = _lines(tmp_path / "forms" / "samples.jsonl")
    assert [s["response"] for s in samples] == [s["response"] for s in first]  # same seeds, same samples
    by_key = _by_key(samples)
    for problem, (index, _) in given.items():
        assert by_key[("math500", problem, index)]["correct"], problem
    for s in samples:
        accepted = given.get(s["problem_id"], (None, None))[1]
        expected = accepted is not None and scorer.score_one(s["response"], ["-987654", accepted],
                                                             s["finish_reason"]) == 1.0
        assert s["correct"] == expected
    counts = {}
    for s in samples:
        n, c = counts.get(s["problem_id"], (0, 0))
        counts[s["problem_id"]] = (n + 1, c + s["correct"])
    for k in (1, 8):
        assert with_forms["benchmarks"]["math500"][f"pass@{k}"] == pytest.approx(mean_pass_at_k(counts.values(), k))
    assert with_forms["benchmarks"]["math500"]["pass@8"] >= len(given) / 8
    answer_only = evaluate(engine, tokenizer, scorer, EvalConfig(**{**rigged.__dict__, "answer_candidates": False}),
                           tmp_path / "answer_only", progress=False)
    assert answer_only["benchmarks"]["math500"]["pass@8"] == 0.0


# The launch variables a VLLMEngine of this process (the fixture's) left in os.environ: a child given them would
# take itself for a torchrun rank or reuse the port of this process's group.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _child_env():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def _dynamo_eval(*args):
    """`dynamo eval ARGS` in a child process (this one may hold the fixture's vLLM engine and its process group)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "megatron_dynamo.cli", "eval", *args], cwd=REPO, env=_child_env(),
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_dynamo_eval_command_on_a_megatron_checkpoint(tiny_model, tmp_path):
    """The CLI end to end: HF -> Megatron with the converter, then `dynamo eval` converts it back, generates with
    vLLM, writes samples/summary and prints the table."""
    import subprocess
    import sys

    megatron = tmp_path / "megatron"
    subprocess.run([sys.executable, "-m", "checkpoints_convert", "hf-to-megatron", "--hf", tiny_model, "--out",
                    str(megatron), "--quiet"], check=True, env=_child_env())
    out = tmp_path / "eval"
    proc = _dynamo_eval("--checkpoint", str(megatron), "--benchmarks", "aime24,minerva", "--data-dir", DATA_DIR,
                        "--n", "2", "--k", "2", "--max-tokens", "6", "--limit", "2", "--output", str(out),
                        "--label", "tiny", "--reward-workers", "1", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout
    assert "AIME24" in printed and "Minerva" in printed and "Avg." in printed and "tiny" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["model"] == str(megatron.absolute())
    assert summary["settings"]["template"] == "qwen_math_boxed" and summary["k"] == [1, 2]
    # EOS (the model's generation_config.json: 0) and ChatML's <|im_end|>, as in training rollouts.
    assert summary["settings"]["stop_token_ids"] == [0, 2]
    assert {b: r["samples"] for b, r in summary["benchmarks"].items()} == {"aime24": 4, "minerva": 4}
    assert (out / "hf_model" / "config.json").is_file() and len(_lines(out / "samples.jsonl")) == 8
    # The same command again: the finished evaluation is shown, not redone (no conversion, no vLLM, no rewrite).
    converted = (out / "hf_model" / "config.json").stat().st_mtime_ns
    samples = (out / "samples.jsonl").read_bytes()
    again = _dynamo_eval("--checkpoint", str(megatron), "--benchmarks", "aime24,minerva", "--data-dir", DATA_DIR,
                         "--n", "2", "--k", "2", "--max-tokens", "6", "--limit", "2", "--output", str(out),
                         "--label", "tiny", "--reward-workers", "1", "--no-progress")
    assert again.returncode == 0 and "already holds this evaluation" in again.stdout, again.stderr[-3000:]
    from megatron_dynamo.eval.runner import format_table

    table = format_table([("tiny", summary)])
    assert table in printed and table in again.stdout  # the same table
    assert (out / "samples.jsonl").read_bytes() == samples
    # --overwrite evaluates again, with the cached conversion (same checkpoint files), to the same samples
    redone = _dynamo_eval("--checkpoint", str(megatron), "--benchmarks", "aime24,minerva", "--data-dir", DATA_DIR,
                          "--n", "2", "--k", "2", "--max-tokens", "6", "--limit", "2", "--output", str(out),
                          "--label", "tiny", "--reward-workers", "1", "--no-progress", "--overwrite")
    assert redone.returncode == 0 and "already holds" not in redone.stdout, redone.stderr[-3000:]
    assert (out / "hf_model" / "config.json").stat().st_mtime_ns == converted
    assert (out / "samples.jsonl").read_bytes() == samples


@pytest.mark.extended
@pytest.mark.distributed
def test_dynamo_eval_on_two_engines_writes_what_one_engine_writes(tiny_model, tmp_path):
    """`--nproc 2` (TP 1: two vLLM engines, each batch of problems split over them) against `--nproc 1`: the same
    samples.jsonl, the same summary.json (timing aside) and the same table."""
    common = ["--checkpoint", tiny_model, "--benchmarks", "aime24,amc23", "--data-dir", DATA_DIR, "--n", "2",
              "--k", "2", "--max-tokens", "6", "--limit", "3", "--problems-per-batch", "2", "--label", "tiny",
              "--reward-workers", "1", "--no-progress"]
    runs = {}
    for nproc in (1, 2):
        proc = _dynamo_eval(*common, "--output", str(tmp_path / f"nproc{nproc}"), "--nproc", str(nproc))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[nproc] = proc.stdout
    assert "2 engines of 1 rank(s)" in runs[2]
    table = [[line for line in runs[n].splitlines() if "AIME24" in line or "P@" in line or line.startswith("tiny")]
             for n in (1, 2)]
    assert table[0] == table[1] and len(table[0]) == 3
    one, two = (tmp_path / "nproc1", tmp_path / "nproc2")
    assert (two / "samples.jsonl").read_text() == (one / "samples.jsonl").read_text()
    assert len(_lines(one / "samples.jsonl")) == 2 * 3 * 2
    summaries = [json.loads((d / "summary.json").read_text()) for d in (one, two)]
    assert _untimed(summaries[0]) == _untimed(summaries[1]) and summaries[1]["generated_problems"] == 6


def test_dynamo_eval_rejects_bad_input_before_loading_a_model(tmp_path, capsys, monkeypatch):
    from megatron_dynamo.cli import main

    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert main(["eval", "--checkpoint", str(tmp_path / "missing"), "--nproc", "3", "--tensor-parallel", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("dynamo eval: --tensor-parallel=2 does not divide --nproc 3 (every "
                                               "rank hosts one vLLM worker, in engines of --tensor-parallel ranks)")
    assert main(["eval", "--checkpoint", str(tmp_path), "--nproc", "0"]) == 2
    assert capsys.readouterr().err.strip() == "dynamo eval: --nproc: must be >= 1, got 0"
    assert main(["eval", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path), "--n", "4", "--k", "8"]) == 2
    assert "k must lie in [1, n=4]" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path), "--benchmarks", "nope.jsonl"]) == 2
    assert "neither an HF model directory" in capsys.readouterr().err
